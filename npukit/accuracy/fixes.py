"""Precision fixes applied to a run without editing its code: `npu-run --precision-fix FIX.json`.

A fix is a list of changes, each aimed at one op of the model as the dumps name it: its api name
(`Functional.linear`), the module whose forward calls it (`blocks.0.fc1`, "" for the model itself)
and, where the module calls that api more than once, the user's source line (`train.py:16`):

| kind          | what the run does at that op                                  | what the user writes instead |
|---------------|---------------------------------------------------------------|------------------------------|
| `fp32`        | autocast off, floating inputs cast to float32                  | an autocast-disabled region at that line |
| `hf32_off`    | `torch.npu.matmul.allow_hf32` / `conv.allow_hf32` off around it and its backward | the same flags around that line |
| `finite_fill` | a fill value of +-inf becomes the tensor dtype's max / min     | `torch.finfo(x.dtype).min` at that line |
| `unfuse`      | a fused attention op (npu_fusion_attention and _v2, the inference kernels) computed by its decomposition in fp32, rounded to its output dtype (unfuse.py) | a call of that decomposition (printed in full, plain torch) at that line |
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

from npukit.accuracy import eager
from npukit.errors import UserError

KINDS = ("fp32", "hf32_off", "finite_fill", "unfuse", "inf_nan_mode")
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
                "finite_fill": f"fill with the dtype's min/max instead of +-inf in {where}",
                "unfuse": f"unfuse {where} (its decomposition in fp32)"}[self.kind]

    def code(self) -> str:
        """This change as code to paste (fix_code() of it alone)."""
        return fix_code([self])


# The code fix_code() prints for op changes: the change npu-run --precision-fix applies (PrecisionFixSession),
# in torch's public API, for the user to paste once the model is built (no blank line inside the
# function: it pastes into an interactive interpreter too).
_CHANGE_OP = '''import os
import re
import sys

import torch


def change_op(model, modules, ops, line, kind):
    """`ops` called by the forward of a module of `model` whose path matches `modules` (a regex), itself
    and not in its sub-modules, at `line` ("train.py:16"; "": any line): kind "fp32" computes them in
    fp32 (autocast off, fp16/bf16 inputs cast), "hf32_off" with HF32 off (forward and backward)."""
    torch_dir = os.path.dirname(torch.__file__)
    names = {module: name for name, module in model.named_modules()}
    running = []  # (path, mode or None) of each module whose forward runs, innermost last
    def called_at_line():
        frame = sys._getframe(2)  # the op's caller, past torch's own frames
        while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
            frame = frame.f_back
        return not line or frame is not None and f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" == line
    def to_fp32(value):
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            return value.float()
        if isinstance(value, (list, tuple)):
            return type(value)(to_fp32(item) for item in value)
        return {key: to_fp32(item) for key, item in value.items()} if isinstance(value, dict) else value
    def set_hf32(allow):
        before = (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32)
        torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32 = allow
        return before
    class ChangeOp(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "overloadpacket", func) not in ops or running[-1][1] is not self or not called_at_line():
                return func(*args, **kwargs)
            if kind == "fp32":
                device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
                with torch.autocast(device, enabled=False):
                    return func(*to_fp32(args), **to_fp32(kwargs))
            before = set_hf32((False, False))
            try:
                result = func(*args, **kwargs)
            finally:
                set_hf32(before)
            # its backward (inside loss.backward()) with HF32 off too: every autograd node this call
            # made (a linear over tokens is a view of an addmm), none of its inputs' own
            inputs = {t.grad_fn for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                      if isinstance(t, torch.Tensor)}
            todo = [t.grad_fn for t in (result if isinstance(result, (list, tuple)) else [result])
                    if isinstance(t, torch.Tensor)]
            made = set()
            while todo:
                node = todo.pop()
                if node is None or node in made or node in inputs or hasattr(node, "variable"):
                    continue
                made.add(node)
                todo += [following for following, _ in node.next_functions]
                saved = []
                def turn_off(grad_outputs, saved=saved):
                    saved.append(set_hf32((False, False)))
                def restore(grad_inputs, grad_outputs, saved=saved):
                    if saved:
                        set_hf32(saved.pop())
                node.register_prehook(turn_off)
                node.register_hook(restore)
            return result
    def enter(module, args):
        mode = ChangeOp() if re.fullmatch(modules, names[module]) else None
        running.append((names[module], mode))
        if mode is not None:
            mode.__enter__()
    def leave(module, args, output):
        _, mode = running.pop()
        if mode is not None:
            mode.__exit__(None, None, None)
    for module in names:
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
'''


def fix_code(changes: list[FixChange]) -> str:
    """The fix as code: pasted as it is once the model is built (named `model`), it makes the changes
    npu-run --precision-fix applied, to the same ops in the same modules: an op change is change_op()
    (defined once) per op and line, over the modules it names; a fill as the line with its value
    spelled finite (to edit there); a fused op unfused as the call to write at its line and the
    decomposition it calls, printed in full (unfuse.code); INF_NAN mode as the variable to set before the run."""
    calls, edits, unfused = [], [], []
    merged: dict[tuple, list[FixChange]] = {}
    for change in changes:
        if change.kind in ("fp32", "hf32_off"):
            merged.setdefault((change.kind, change.api, change.line), []).append(change)
        elif change.kind == "finite_fill":
            where = f"# {change.line or 'in ' + (change.module or 'the model') + chr(39) + 's forward'}: {change.describe(False)}"
            finite = _finite_fill_source(change.source)
            edits.append(f"{where}, as\n#   {finite}" if finite is not None else
                         f"{where}: write the fill value as torch.finfo(<tensor>.dtype).min (or .max for +inf)\n"
                         f"#   {change.source or '<the line that calls it>'}")
        elif change.kind == "unfuse":
            unfused.append(change)
        else:
            edits.append("# before the run (Ascend 910B and later), fp16 with IEEE inf/nan, not saturation: in the shell\n"
                         "#   export INF_NAN_MODE_ENABLE=1")
    for (kind, api, line), group in merged.items():
        modules = "|".join(_module_regex(change.module) for change in group)
        ops = ", ".join(_op_expressions(api)) + ","
        where = "; ".join(change.describe() for change in group)
        calls.append(f"# {where}\nchange_op(model, r\"{modules}\", ({ops}), \"{line}\", \"{kind}\")")
        source = group[0].source
        if kind == "fp32" and source:  # the same, written at the line instead (a comment: the paste runs)
            calls.append(f"# or at {line or 'the line'}, with its fp16/bf16 tensor inputs cast (x.float()):\n"
                         f"#   with torch.autocast(\"npu\", enabled=False):\n#       {source}")
        elif kind == "hf32_off":  # the simpler, wider change: every matmul/conv of the step
            flag = "torch.npu.conv.allow_hf32" if "conv" in api.lower() else "torch.npu.matmul.allow_hf32"
            calls.append(f"# or, for every op of the step (its backward runs later, in loss.backward()):\n"
                         f"#   {flag} = False")
    head = "# paste once the model is built (`model`): the change(s) npu-run --precision-fix made\n" + _CHANGE_OP
    if unfused:
        from npukit.accuracy import unfuse  # (torch: imported when the fix holds such a change)

        edits.append(unfuse.code(unfused))
    parts = [head if calls else "", *calls, *edits]
    return "\n".join(part for part in parts if part)


def _module_regex(pattern: str) -> str:
    """`blocks.*.fc` as the regex of the module paths module_matches() gives it."""
    return r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")) if pattern else ""


def _op_expressions(api: str) -> list[str]:
    """The Python names of the functions the dumps call `api` (`Functional.gelu`: torch.nn.functional.gelu)."""
    from torch.overrides import get_overridable_functions

    from npukit.accuracy import naming

    if api.startswith("NPU."):
        return [f"torch.ops.npu.{api[4:]}"]
    table = naming.api_name_table()
    found = []
    for namespace, funcs in get_overridable_functions().items():
        owner = getattr(namespace, "__name__", None)
        if not isinstance(owner, str):
            continue  # Tensor property getters
        owner = "torch.Tensor" if owner == "Tensor" else owner
        for func in funcs:
            name = getattr(func, "__name__", None)
            if name and table.get(func) == api and f"{owner}.{name}" not in found:
                found.append(f"{owner}.{name}")
    if not found:
        raise UserError(f"no torch function is named {api} in the dumps (a fix names an op the dumps recorded)")
    return found


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
            if item["kind"] == "unfuse":  # a fused op with a decomposition
                from npukit.accuracy.unfuse import check_api

                check_api(str(item.get("api", "")), f"--precision-fix {path}: change {index}")
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
        self._compile_watched = False
        self._unfixed_regions: set[str] = set()

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
        # Dynamo cannot trace through the module hooks, and a compiled graph would bypass the changes:
        # compiled code runs eagerly while the fix applies; a fullgraph region runs compiled, unfixed
        eager.enter("the precision fix", self._on_compiled_region)
        self._compile_watched = True
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
        if self._compile_watched:
            self._compile_watched = False
            eager.leave(self._on_compiled_region)

    def _on_compiled_region(self, name: str) -> None:
        if name not in self._unfixed_regions:
            self._unfixed_regions.add(name)
            print(f"npukit: {name} runs compiled (fullgraph=True): --precision-fix cannot change the ops "
                  "inside it; compile it without fullgraph=True for the fix to apply there", file=sys.stderr)

    # ------------------------------------------------------------------ where the run is
    def _enter_module(self, module, args) -> None:
        from npukit.accuracy import naming

        if eager.not_a_layer(module):
            return
        outer = self._module_stack[0] if self._module_stack else None
        self._module_stack.append(module)
        naming.module_path(self._paths, module, outer)

    def _leave_module(self, module, args, output) -> None:
        if eager.not_a_layer(module):
            return
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
            _hf32_off_in_backward(result, (args, kwargs))
            return result
        if change.kind == "finite_fill":
            dtype = _fill_dtype(args, kwargs)
            return func(*_finite(args, dtype), **_finite(kwargs, dtype))
        if change.kind == "unfuse":
            from npukit.accuracy import unfuse

            return unfuse.run(change, args, kwargs)
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


def _hf32_off_in_backward(result, inputs) -> None:
    """The op's backward runs with HF32 off too: every autograd node the call made (a linear over
    tokens is a view of an addmm, the weight gradient one node down), none of its inputs' own. Each
    node's pre-hook turns HF32 off, its hook restores it."""
    upstream = {tensor.grad_fn for tensor in _tensors(inputs)}
    todo = [tensor.grad_fn for tensor in _tensors(result)]
    made: set = set()
    while todo:
        node = todo.pop()
        # AccumulateGrad (a leaf's, it has .variable) and the inputs' nodes ran before this op
        if node is None or node in made or node in upstream or hasattr(node, "variable"):
            continue
        made.add(node)
        todo += [following for following, _ in node.next_functions]
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
