"""Precision fixes applied to a run without editing its code: `npu-run --precision-fix FIX.json`.

A fix is a list of changes, each aimed at one op of the model as the dumps name it: its api name
(`Functional.linear`), the module whose forward calls it (`blocks.0.fc1`, "" for the model itself)
and, where the module calls that api more than once, the user's source line (`train.py:16`):

| kind          | what the run does at that op                                  | what the user writes instead |
|---------------|---------------------------------------------------------------|------------------------------|
| `fp32`        | autocast off, floating inputs cast to float32                  | an autocast-disabled region at that line |
| `hf32_off`    | `torch.npu.matmul.allow_hf32` / `conv.allow_hf32` off around it and its backward | the same flags around that line |
| `finite_fill` | a fill value of +-inf becomes the tensor dtype's max / min     | `torch.finfo(x.dtype).min` at that line |
| `inf_nan_mode`| (the whole run) fp16 in INF_NAN mode, not saturation           | `INF_NAN_MODE_ENABLE=1` |

Only torch's public API is used (autocast, torch.npu's HF32 flags), so a fix found on the emulated
NPU means the same on an Ascend host with torch_npu. The fix finder (`npu-compare --find-fix`)
writes these files for its trial runs; a user can apply one the same way to try a fix before
editing the code.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from npukit.errors import UserError

KINDS = ("fp32", "hf32_off", "finite_fill", "inf_nan_mode")
FIX_ENV = "NPUKIT_PRECISION_FIX"
# the fill APIs whose value argument may be +-inf (the `inf-fill` finding of npu-migrate)
FILL_APIS = frozenset({"Tensor.masked_fill", "Tensor.masked_fill_", "Torch.masked_fill", "Tensor.fill_",
                       "Torch.fill", "Torch.full", "Torch.full_like", "Tensor.new_full", "Tensor.index_fill",
                       "Tensor.index_fill_", "Torch.index_fill"})


@dataclass(frozen=True)
class FixChange:
    kind: str
    api: str = ""  # "Functional.linear"; empty for a whole-run change
    module: str = ""  # the calling module's path; "" is the model itself; `h.*.attn`: every index
    line: str = ""  # "train.py:16": only this call site of the api in that module ("" = every one)
    source: str = ""  # the code at that line, for the suggestion (not used to match)

    def describe(self, with_line: bool = True) -> str:
        if self.kind == "inf_nan_mode":
            return "fp16 in INF_NAN mode (not saturation)"
        module = f"every {self.module}" if "*" in self.module else self.module or "the model"
        where = f"{self.api} in {module}" + (f" at {self.line}" if self.line and with_line else "")
        return {"fp32": f"compute {where} in fp32", "hf32_off": f"HF32 off for {where}",
                "finite_fill": f"fill with the dtype's min/max instead of +-inf in {where}"}[self.kind]

    def code(self) -> str:
        """What to write in the user's code for this change, at `line` (shown as it is, from `source`)."""
        if self.kind == "inf_nan_mode":
            return "# before the run (Ascend 910B and later): fp16 with IEEE inf/nan, not saturation\nexport INF_NAN_MODE_ENABLE=1"
        where = f"# {self.line or 'in ' + (self.module or 'the model') + chr(39) + 's forward'}: {self.describe(with_line=False)}"
        original = self.source or "<the line that calls it>"
        indented = "\n".join("    " + line for line in original.splitlines())
        if self.kind == "fp32":
            text = (f"{where}\nwith torch.autocast(\"npu\", enabled=False):  # fp32 here: cast its fp16/bf16 tensor "
                    f"inputs with .float()\n{indented}")
            if not self.module:
                return text
            if "*" in self.module:
                apply = (f"for name, module in model.named_modules():  # every {self.module}\n"
                         f"    if fnmatch.fnmatchcase(name, \"{self.module}\"):\n"
                         "        module.forward = fp32_forward(module.forward)")
            else:
                apply = (f"module = model.get_submodule(\"{self.module}\")\n"
                         "module.forward = fp32_forward(module.forward)")
            # the module's forward in fp32 with its inputs cast: pasteable as it is, once the model is built
            return ("# keep the module in fp32 under autocast, once the model is built:\n"
                    "def fp32_forward(forward):\n"
                    "    def run(*args, **kwargs):\n"
                    "        with torch.autocast(\"npu\", enabled=False):\n"
                    "            return forward(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a"
                    " for a in args), **kwargs)\n"
                    f"    return run\n{apply}\n# or at the line, with its fp16/bf16 tensor inputs cast (x.float()):\n"
                    + text.split("\n", 1)[1])
        if self.kind == "hf32_off":
            flag = "torch.npu.conv.allow_hf32" if "conv" in self.api.lower() else "torch.npu.matmul.allow_hf32"
            return (f"{where} (its forward, and its backward inside loss.backward())\n"
                    f"#   {original}\n"
                    f"{flag} = False  # for the whole step: the op's backward runs later, in loss.backward()\n"
                    "# (to keep HF32 for the other ops, npu-run --precision-fix applies it to this op alone)")
        finite = _finite_fill_source(self.source)
        if finite is not None:
            return f"{where}\n{finite}"
        return f"{where}: write the fill value as torch.finfo(<tensor>.dtype).min (or .max for +inf)\n{original}"


@dataclass
class PrecisionFix:
    changes: list[FixChange]

    def to_json(self) -> str:
        return json.dumps({"changes": [asdict(change) for change in self.changes]}, indent=1)

    @classmethod
    def load(cls, path: Path) -> PrecisionFix:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"--precision-fix {path}: {exc}") from None
        changes = []
        for index, item in enumerate(data.get("changes", []) if isinstance(data, dict) else []):
            if not isinstance(item, dict) or item.get("kind") not in KINDS:
                raise UserError(f"--precision-fix {path}: change {index}: kind must be one of {', '.join(KINDS)}")
            unknown = set(item) - {"kind", "api", "module", "line", "source"}
            if unknown:
                raise UserError(f"--precision-fix {path}: change {index}: unknown field(s) {', '.join(sorted(unknown))}")
            changes.append(FixChange(**{key: str(value) for key, value in item.items()}))
        return cls(changes)


class PrecisionFixSession:
    """Applies a PrecisionFix to everything the run does between enter and exit."""

    def __init__(self, fix: PrecisionFix) -> None:
        self.fix = fix
        self._by_api: dict[str, list[FixChange]] = {}
        for change in fix.changes:
            if change.kind != "inf_nan_mode":
                self._by_api.setdefault(change.api, []).append(change)
        self._handles: list = []
        self._mode = None
        self._module_stack: list = []

    def __enter__(self) -> PrecisionFixSession:
        import torch
        from torch.nn.modules import module as module_hooks

        from npukit.accuracy import naming

        if any(change.kind == "inf_nan_mode" for change in self.fix.changes):
            os.environ["INF_NAN_MODE_ENABLE"] = "1"  # torch_npu's switch, read at its start
            try:
                from npukit.npu_backend import numerics

                numerics.set_fp16_mode("inf_nan")
            except ImportError:  # a real Ascend host: the variable above is the switch
                pass
        if not self._by_api:
            return self
        self._paths = naming.ModulePaths()
        self._names = naming.api_name_table()
        self._handles = [module_hooks.register_module_forward_pre_hook(self._enter_module),
                         module_hooks.register_module_forward_hook(self._leave_module, always_call=True)]
        session = self

        class _FixMode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                change = session._change_for(func)
                if change is None:
                    return func(*args, **kwargs)
                return session._apply(change, func, args, kwargs)  # this mode is off inside: casts are not ops

        self._mode = _FixMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ where the run is
    def _enter_module(self, module, args) -> None:
        from npukit.accuracy import naming

        outer = self._module_stack[0] if self._module_stack else None
        self._module_stack.append(module)
        naming.module_path(self._paths, module, outer)

    def _leave_module(self, module, args, output) -> None:
        if self._module_stack and self._module_stack[-1] is module:
            self._module_stack.pop()

    def _change_for(self, func) -> FixChange | None:
        from npukit.accuracy import naming

        changes = self._by_api.get(self._names.get(func) or naming.npu_op_api_name(func) or "")
        if not changes:
            return None
        module = self._paths.get(self._module_stack[-1], "") if self._module_stack else ""
        line = None
        for change in changes:
            if module_matches(change.module, module):
                if change.line and line is None:
                    line = _user_line()
                if not change.line or change.line == line:
                    return change
        return None

    # ------------------------------------------------------------------ the changes
    def _apply(self, change: FixChange, func, args, kwargs):
        import torch

        if change.kind == "fp32":
            device = next((t.device.type for t in _tensors((args, kwargs))), "cpu")
            with torch.autocast(device, enabled=False):
                return func(*_to_fp32(args), **_to_fp32(kwargs))
        if change.kind == "hf32_off":
            with _hf32_off():
                result = func(*args, **kwargs)
            _hf32_off_in_backward(result)
            return result
        if change.kind == "finite_fill":
            dtype = _fill_dtype(args, kwargs)
            return func(*_finite(args, dtype), **_finite(kwargs, dtype))
        return func(*args, **kwargs)


_NEGATIVE_INF = re.compile(r"""float\(\s*(['"])-inf\1\s*\)|-\s*float\(\s*(['"])inf\2\s*\)|-\s*(?:math|torch|np|numpy)\.inf\b""")
_POSITIVE_INF = re.compile(r"""float\(\s*(['"])\+?inf\1\s*\)|(?<![-\w.])(?:math|torch|np|numpy)\.inf\b""")
_FILL_RECEIVER = re.compile(r"([A-Za-z_][\w.]*)\s*\.\s*(?:masked_fill_?|fill_|index_fill_?|new_full)\s*\(")


def _finite_fill_source(source: str) -> str | None:
    """The line with its +-inf fill value spelled as the receiver dtype's min/max, or None."""
    receiver = _FILL_RECEIVER.search(source)
    if receiver is None:
        return None
    name = receiver.group(1)
    finite = _NEGATIVE_INF.sub(f"torch.finfo({name}.dtype).min", source)
    finite = _POSITIVE_INF.sub(f"torch.finfo({name}.dtype).max", finite)
    return finite if finite != source else None


def module_pattern(path: str) -> str:
    """`h.0.attn` -> `h.*.attn`: the module path with every index a wildcard."""
    return ".".join("*" if part.isdigit() else part for part in path.split(".")) if path else path


def module_matches(pattern: str, path: str) -> bool:
    """A fix's module (`h.0.attn`, or `h.*.attn` for every index) names this module path."""
    if "*" not in pattern:
        return pattern == path
    parts, wanted = path.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w == "*" or w == p for w, p in zip(wanted, parts))


def _user_line() -> str:
    """`file.py:LINE` of the op's call site in the user's code, as the dump's stack names it."""
    from npukit.accuracy.stacks import user_call_site

    site = user_call_site(sys._getframe(2))
    return f"{os.path.basename(site[0])}:{site[1]}" if site else ""


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _to_fp32(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_fp32(item) for key, item in value.items()}
    return value


def _hf32_flags() -> list:
    import torch

    npu = getattr(torch, "npu", None)
    return [owner for owner in (getattr(npu, "matmul", None), getattr(npu, "conv", None))
            if owner is not None and hasattr(owner, "allow_hf32")]


@contextlib.contextmanager
def _hf32_off():
    flags = _hf32_flags()
    before = [owner.allow_hf32 for owner in flags]
    for owner in flags:
        owner.allow_hf32 = False
    try:
        yield
    finally:
        for owner, value in zip(flags, before):
            owner.allow_hf32 = value


def _hf32_off_in_backward(result) -> None:
    """The op's backward (its autograd node: the input and weight gradients of a conv or matmul)
    runs with HF32 off too: a pre-hook turns it off, a hook restores it."""
    for tensor in _tensors(result):
        node = tensor.grad_fn
        if node is None:
            continue
        saved: list = []

        def turn_off(grad_outputs, saved=saved):
            saved.append([(owner, owner.allow_hf32) for owner in _hf32_flags()])
            for owner, _ in saved[-1]:
                owner.allow_hf32 = False

        def restore(grad_inputs, grad_outputs, saved=saved):
            for owner, value in saved.pop() if saved else ():
                owner.allow_hf32 = value

        node.register_prehook(turn_off)
        node.register_hook(restore)
        return  # one node computes the op's backward


def _fill_dtype(args, kwargs):
    import torch

    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()), torch.get_default_dtype())
    return dtype


def _finite(value, dtype):
    import torch

    if isinstance(value, float) and math.isinf(value) and dtype.is_floating_point:
        info = torch.finfo(dtype)
        return info.max if value > 0 else info.min
    if isinstance(value, (list, tuple)):
        return type(value)(_finite(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _finite(item, dtype) for key, item in value.items()}
    return value
