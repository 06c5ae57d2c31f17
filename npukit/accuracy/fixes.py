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
| `fp32_master` | (a module, no op) each optimizer.step() updates an fp32 master copy of the module's fp16/bf16 parameters (their gradients cast up, the optimizer's state for them fp32); each parameter then holds its master rounded to its dtype | keep_fp32_master(): the same, with optimizer step hooks |

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

KINDS = ("fp32", "hf32_off", "finite_fill", "unfuse", "inf_nan_mode", "fp32_master")
FIX_ENV = "NPUKIT_PRECISION_FIX"
# the fill APIs whose value argument may be +-inf (the `inf-fill` finding of npu-migrate)
FILL_APIS = frozenset({"Tensor.masked_fill", "Tensor.masked_fill_", "Torch.masked_fill", "Tensor.fill_",
                       "Torch.fill", "Torch.full", "Torch.full_like", "Tensor.new_full", "Tensor.index_fill",
                       "Tensor.index_fill_", "Torch.index_fill"})


@dataclass(frozen=True)
class FixChange:
    kind: str
    api: str = ""  # "Functional.linear"; empty for a whole-run change and for fp32_master (a module's parameters)
    module: str = ""  # the calling module's path; "" is the model itself; `h.*.attn`: every index
    line: str = ""  # "train.py:16": only this call site of the api in that module ("" = every one)
    source: str = ""  # the code at that line, for the suggestion (not used to match)

    def describe(self, with_line: bool = True) -> str:
        if self.kind == "inf_nan_mode":
            return "fp16 in INF_NAN mode (not saturation)"
        module = f"every {self.module}" if "*" in self.module else self.module or "the model"
        if self.kind == "fp32_master":
            return f"keep an fp32 master copy of {module}'s fp16/bf16 parameters for the optimizer"
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

# The code fix_code() prints for fp32_master: the master copy PrecisionFixSession keeps, with the optimizer's
# step hooks (public torch API), pasted once the model and its optimizer are built.
_KEEP_FP32_MASTER = '''import re

import torch


def keep_fp32_master(model, optimizer, modules):
    """Each fp16/bf16 parameter of the modules of `model` whose path matches `modules` (a regex; "": the
    model itself) gets an fp32 master copy: optimizer.step() updates the master (the gradient cast up; the
    optimizer's state for it is fp32) and the parameter then holds the master rounded to its dtype."""
    low = (torch.float16, torch.bfloat16)
    params = {p for name, module in model.named_modules() if re.fullmatch(modules, name)
              for p in module.parameters() if p.dtype in low}
    masters, swapped = {}, []
    def before(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in params and p.grad is not None and p.dtype in low:
                    grad, dtype, master = p.grad, p.dtype, masters.get(p)
                    if master is None or not torch.equal(master.to(dtype), p.data):
                        master = p.data.float()  # the first step, or the weight was set since (a checkpoint)
                    p.grad = None
                    p.data = master
                    p.grad = grad.float()
                    state = optimizer.state.get(p, {})
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dtype == dtype:
                            state[key] = value.float()
                    swapped.append((p, dtype, grad))
    def after(optimizer, args, kwargs):
        while swapped:
            p, dtype, grad = swapped.pop()
            masters[p] = p.data
            p.grad = None
            p.data = masters[p].to(dtype)
            p.grad = grad
    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
'''


def fix_code(changes: list[FixChange]) -> str:
    """The fix as code: pasted as it is once the model is built (named `model`), it makes the changes
    npu-run --precision-fix applied, to the same ops in the same modules: an op change is change_op()
    (defined once) per op and line, over the modules it names; a fill as the line with its value
    spelled finite (to edit there); a fused op unfused as the call to write at its line and the
    decomposition it calls, printed in full (unfuse.code); INF_NAN mode as the variable to set before the run;
    fp32 master copies as keep_fp32_master() (defined once) over the modules named, once the optimizer is built."""
    calls, edits, unfused, masters = [], [], [], []
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
        elif change.kind == "fp32_master":
            masters.append(change)
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
    if masters:
        modules = "|".join(_module_regex(change.module) for change in masters)
        where = "; ".join(change.describe() for change in masters)
        edits.append("# paste once the model and its optimizer are built (`model`, `optimizer`): the master copies "
                     f"npu-run --precision-fix kept\n{_KEEP_FP32_MASTER}# {where}\n"
                     f"keep_fp32_master(model, optimizer, r\"{modules}\")\n"
                     "# or keep those weights in fp32 (no .to(torch.bfloat16) / .half() on them): autocast casts them "
                     "for the forward")
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
    source: str = ""  # the file it was loaded from, named in errors (not written by to_json)

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
            if item["kind"] == "fp32_master" and (item.get("api") or item.get("line")):
                raise UserError(f"--precision-fix {path}: change {index}: fp32_master names a module (its parameters),"
                                " not an op: leave api and line empty")
            if item["kind"] == "unfuse":  # a fused op with a decomposition
                from npukit.accuracy.unfuse import check_api

                check_api(str(item.get("api", "")), f"--precision-fix {path}: change {index}")
            changes.append(FixChange(**{key: str(value) for key, value in item.items()}))
        return cls(changes, str(path))


class PrecisionFixSession:
    """Applies a PrecisionFix to everything the run does between enter and exit."""

    def __init__(self, fix: PrecisionFix) -> None:
        self.fix = fix
        self._by_api: dict[str, list[FixChange]] = {}
        for change in fix.changes:
            if change.kind not in ("inf_nan_mode", "fp32_master"):
                self._by_api.setdefault(change.api, []).append(change)
        self._masters = _Fp32Masters(fix, self) if any(c.kind == "fp32_master" for c in fix.changes) else None
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
        if not self._by_api and self._masters is None:
            return self
        self._paths = naming.ModulePaths()
        self._names = naming.api_name_table()
        # Dynamo cannot trace through the module hooks, and a compiled graph would bypass the changes:
        # compiled code runs eagerly while the fix applies; a fullgraph region runs compiled, unfixed
        eager.enter("the precision fix", self._on_compiled_region)
        self._compile_watched = True
        self._handles = [module_hooks.register_module_forward_pre_hook(self._enter_module),
                         module_hooks.register_module_forward_hook(self._leave_module, always_call=True)]
        if self._masters is not None:
            self._masters.watch()
        if not self._by_api:
            return self
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
        if self._masters is not None:
            self._masters.unwatch()
            self._masters.check_applied(exc_info[0])

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

    def module_paths(self) -> list[tuple[object, str]]:
        """(module, path as the dump names it) of every module the run has called so far."""
        return list(self._paths.items())

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
            from npukit.watch.op_hooks import op_ran_with

            dtype = _fill_dtype(args, kwargs)
            args, kwargs = _finite(args, dtype), _finite(kwargs, dtype)
            result = func(*args, **kwargs)
            # the dump above records the fill the op ran with: its compare then sees finfo.min for golden's
            # -inf (the same masking), not an output off while its recorded inputs match
            op_ran_with(args, kwargs)
            return result
        if change.kind == "unfuse":
            from npukit.accuracy import unfuse

            return unfuse.run(change, args, kwargs)
        return func(*args, **kwargs)


class _Fp32Masters:
    """fp32_master: the fp16/bf16 parameters of the modules a fix names get fp32 master copies that
    every optimizer.step() updates. Inside the step (the optimizer's own step hooks, which run inside
    the global ones of the dump, the monitor and the other sessions: those see the parameters as the
    run keeps them) each parameter holds its master and its gradient cast up, so the optimizer's update
    and its state are fp32; after it the master is kept and the parameter gets it rounded to its
    dtype. A master is dropped when its parameter was written since (a checkpoint, --replay's state)."""

    _LOW = ("torch.float16", "torch.bfloat16")

    def __init__(self, fix: PrecisionFix, session: PrecisionFixSession) -> None:
        self._changes = [(index, change) for index, change in enumerate(fix.changes) if change.kind == "fp32_master"]
        self._source = fix.source or "(the fix)"
        self._session = session
        self._global_hook = None
        self._hooked = None  # optimizer -> its own step hooks' handles
        self._masters: dict[int, tuple] = {}  # id(parameter) -> (weakref to it, its fp32 master)
        self._swapped: list[tuple] = []  # inside a step: (parameter, its dtype, its gradient)
        self._wanted: tuple[int, dict[int, set]] = (-1, {})  # (modules known, id(parameter) -> changes naming it)
        self._matched: set[int] = set()  # changes whose module the run called
        self._kept: set[int] = set()  # changes that kept a master of at least one parameter
        self._steps = 0

    def watch(self) -> None:
        import weakref

        from torch.optim import optimizer as optimizer_hooks

        self._hooked = weakref.WeakKeyDictionary()
        self._global_hook = optimizer_hooks.register_optimizer_step_pre_hook(self._on_step)

    def unwatch(self) -> None:
        if self._swapped:  # a step that raised: the parameters back in their dtype
            self._after_step(None, None, None)
        for handles in list(self._hooked.values()) if self._hooked is not None else ():
            for handle in handles:
                handle.remove()
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None

    def _on_step(self, optimizer, args, kwargs) -> None:
        # the optimizer's own hooks run after every global pre-hook and before every global post-hook
        if optimizer not in self._hooked:
            self._hooked[optimizer] = [optimizer.register_step_pre_hook(self._before_step),
                                       optimizer.register_step_post_hook(self._after_step)]

    def _parameters(self) -> dict[int, set]:
        """id(parameter) -> the changes that name its module (or a module above it), for the modules the
        run has called. A parameter modules share (tied weights) is one entry: one master."""
        modules = self._session.module_paths()
        if self._wanted[0] != len(modules):
            wanted: dict[int, set] = {}
            for module, path in modules:
                for index, change in self._changes:
                    if module_matches(change.module, path):
                        self._matched.add(index)
                        for parameter in module.parameters():
                            wanted.setdefault(id(parameter), set()).add(index)
            self._wanted = (len(modules), wanted)
        return self._wanted[1]

    def _before_step(self, optimizer, args, kwargs) -> None:
        import weakref

        import torch
        from torch.autograd.graph import increment_version

        self._steps += 1
        wanted = self._parameters()
        with torch._C.DisableTorchFunction():  # the casts are no ops of the run's (the dump records none)
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    naming = wanted.get(id(parameter))
                    if naming is None or parameter.grad is None or str(parameter.dtype) not in self._LOW:
                        continue
                    grad, dtype = parameter.grad, parameter.dtype
                    ref, master = self._masters.get(id(parameter), (None, None))
                    if ref is None or ref() is not parameter or not torch.equal(master.to(dtype), parameter.data):
                        master = parameter.data.float()  # the first step, or the parameter was written since
                    parameter.grad = None  # (a gradient must have its parameter's dtype)
                    parameter.data = master
                    increment_version(parameter)  # other values: what the dump measured of it is not them
                    parameter.grad = grad.float()
                    state = optimizer.state.get(parameter, {})
                    for key, value in state.items():  # (a state loaded into the parameter took its dtype)
                        if isinstance(value, torch.Tensor) and value.dtype == dtype:
                            state[key] = value.float()
                    self._masters[id(parameter)] = (weakref.ref(parameter), master)
                    self._swapped.append((parameter, dtype, grad))
                    self._kept |= naming

    def _after_step(self, optimizer, args, kwargs) -> None:
        import torch
        from torch.autograd.graph import increment_version

        with torch._C.DisableTorchFunction():
            while self._swapped:
                parameter, dtype, grad = self._swapped.pop()
                master = parameter.data  # updated in place by the optimizer
                self._masters[id(parameter)] = (self._masters[id(parameter)][0], master)
                parameter.grad = None
                parameter.data = master.to(dtype)
                increment_version(parameter)
                parameter.grad = grad

    def check_applied(self, exc_type) -> None:
        """A fix that changed nothing is an error (the run ended as it does without it): no optimizer
        stepped (a script updating its weights by hand), the module never ran, or it holds no fp16/bf16
        parameter the optimizer updated. Not raised over the run's own error."""
        from npukit.watch.stop import StoppedAfterStep

        if exc_type is not None and not issubclass(exc_type, StoppedAfterStep):
            return
        for index, change in self._changes:
            what = f"--precision-fix {self._source}: change {index} ({change.describe()})"
            if not self._steps:
                raise UserError(f"{what}: no optimizer stepped in this run (torch.optim's optimizer.step(), or "
                                "scaler.step(optimizer)), and the master copy is updated there: a script that "
                                "updates its weights by hand (`p -= lr * p.grad` under torch.no_grad()) cannot be "
                                "fixed this way. Keep those weights in fp32 (autocast casts them for the forward), "
                                "or apply the update to fp32 copies of them")
            if index not in self._matched:
                raise UserError(f"{what}: the run called no module {change.module!r} (name it as the dump does: "
                                "the divergence's module)")
            if index not in self._kept:
                raise UserError(f"{what}: it holds no fp16/bf16 parameter with a gradient that an optimizer "
                                "updated: nothing to keep an fp32 master copy of")


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
