"""Overflow detection during a normal training run: which op overflowed first, where, and when.

    with OverflowSession(Path("overflow"), action="report"):
        runpy.run_path("train.py", run_name="__main__")

    session = OverflowSession(Path("overflow")).start()   # or from a training loop
    for batch in data:
        ...; optimizer.step(); session.step()
    session.stop()

An event is an op (forward, or its backward node) whose floating outputs hold inf/nan although
every floating input was finite -- or, in fp16 saturation mode, an op that set the device's
sticky overflow flag (it clamped a value to +-65504 or turned a nan into 0). Events are named
like the dump (`Functional.linear.3.forward`, `Module.fc1.Linear.backward.0`), with step, rank,
module path, dtype, input/output statistics and the user's stack.

Cheap by design: each output gets one reduction computed on its own device (a sum for fp32/fp64,
min and max for fp16/bf16) appended to a list of device scalars; the list is read with one copy
per step, at the optimizer step (before the weights change) or at step(). Inputs that are the
outputs of earlier ops reuse those results. On the emulated device the sticky flag is a host
variable, read around each op at no sync cost. `level="module"` checks module outputs only.
`underflow=True` also lists fp16/bf16 ops whose outputs hold clearly more zeros than their input.

The `dump` action must see the tensors while they are alive, so it reads each op's result right
away (one host read per op) and writes the event's inputs and outputs in the dump format, with a
fp32 CPU replay of forward ops that tells a real fp16 overflow from a device bug.

Steps end at optimizer.step (or GradScaler.step, which may skip the optimizer: that step is
reported as skipped, and backward events in it are loss-scaling overflows, not failures). A
script without an optimizer ends a step when its first root module starts a new forward.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from npukit.accuracy import eager, naming
from npukit.accuracy.dump_leaves import describe_value, fill_stats
from npukit.accuracy.dumpfile import COMPILED_REGION, INTERNAL_ERROR
from npukit.accuracy.graph import OpNodes
from npukit.accuracy.stacks import CallStacks
from npukit.accuracy.tensor_io import write_tensor
from npukit.console import number_ranges
from npukit.errors import UserError
from npukit.files import check_output_location, write_json
from npukit.watch.hook_guard import add_failure_listener, remove_failure_listener, revive_hooks, unintercepted
from npukit.watch.module_hooks import ModuleHooks
from npukit.watch.op_hooks import ApiMode
from npukit.watch.process import host_memory, rank_from_env
from npukit.watch.steps import RecordedSteps
from npukit.watch.tensor_stats import StatsBuffer, tensor_stats
from npukit.watch.tensors import local_shard, real_view, strided_form, tensor_version, tensors_in

ACTIONS = ("report", "dump", "stop")
LEVELS = ("api", "module")
FP16_MAX = 65504.0
REPORT_NAME = "overflow.json"
_FORMAT_VERSION = 1
_MIN_MAX_DTYPES = (torch.float16, torch.bfloat16)  # min/max: a sum of fp16 values can overflow by itself
# so can one of fp32 (or fp64) values: min/max too, fp32 in host memory from the one-pass kernel
_WIDE_FLOATS = (torch.float32, torch.float64)
_MAX_STACK_FRAMES = 12

# Ops whose every output value is a copy of an input value (or zero): they cannot turn finite
# inputs into inf/nan, so their outputs take their inputs' checks instead of a reduction of their
# own (a third of a transformer's tensors). Backward, the same holds for these autograd nodes.
_COPIES_VALUES = frozenset(
    f"{prefix}.{op}"
    for prefix in ("Tensor", "Torch")
    for op in ("view", "reshape", "transpose", "permute", "t", "flatten", "unflatten", "unsqueeze", "squeeze",
               "contiguous", "view_as", "reshape_as", "swapaxes", "movedim", "ravel", "T", "mT", "split", "chunk",
               "unbind", "narrow", "select", "clone", "cat", "concat", "stack", "relu", "hstack", "vstack",
               "__getitem__", "expand", "expand_as", "repeat", "index_select", "gather", "broadcast_to")
) | {"Functional.relu"}
# The copies whose output holds exactly their one input's elements, rearranged.
_SAME_ELEMENTS = frozenset(
    f"{prefix}.{op}"
    for prefix in ("Tensor", "Torch")
    for op in ("view", "reshape", "transpose", "permute", "t", "flatten", "unflatten", "unsqueeze", "squeeze",
               "contiguous", "view_as", "reshape_as", "swapaxes", "movedim", "ravel", "T", "mT", "clone")
)
_SAME_ELEMENT_NODES = frozenset(
    f"{op}Backward0"
    for op in ("View", "UnsafeView", "Reshape", "ReshapeAlias", "Transpose", "Permute", "T", "Unsqueeze", "Squeeze",
               "Clone", "Alias")
)
_COPYING_NODES = frozenset(
    f"{op}Backward0"
    for op in ("View", "UnsafeView", "Reshape", "ReshapeAlias", "Transpose", "Permute", "T", "Unsqueeze", "Squeeze",
               "Clone", "Cat", "Stack", "Split", "SplitWithSizes", "Unbind", "Slice", "Select", "Narrow", "Relu",
               "Threshold", "Alias", "AsStrided")
)
# Ops whose outputs (or gradients) hold zeros by design, not by underflow.
_ZEROS_BY_DESIGN = re.compile(
    r"dropout|mask|where|pad|tril|triu|zero|fill|scatter|index|threshold|hardtanh|clamp|clip|relu|embedding|"
    r"max|min|topk|sort|kthvalue|median|getitem|gather|select|narrow|slice|split|chunk|cat|stack|expand|repeat"
)
_RESOLVE_EVERY = 16384  # pending device scalars read early when a step runs this long


class OverflowStop(UserError):
    """Raised by action="stop" at the first overflow event; npu-run prints it as a clean error."""

    npukit_propagate = True  # the user asked the run to stop: npukit's hooks let it through


# ---------------------------------------------------------------------------- device flag
class _DeviceFlag:
    """The device's sticky overflow flag (the float-status register in saturation mode).

    On the emulated device it is a host variable: read around every op, and put back afterwards
    so a script or a GradScaler reading it sees what it would have seen without the detector.
    On a real Ascend device reading it syncs, so it is read once per step.
    """

    def __init__(self) -> None:
        self.per_op = False
        self.unseen = False  # set by something the detector does not watch (found at the next op)
        self._left = False  # the value the detector last left the flag at
        self._get = self._clear = self._set = None
        if "npukit.npu_backend" in sys.modules:
            from npukit.npu_backend import _C

            self.per_op = True
            self._get, self._set = _C.get_overflow_flag, _C.set_overflow_flag
            self._clear = lambda: _C.set_overflow_flag(False)
        elif "torch_npu" in sys.modules:
            utils = sys.modules["torch_npu"].npu.utils
            self._get, self._clear = utils.get_npu_overflow_flag, utils.clear_npu_overflow_flag

    def value(self) -> bool:
        return self._get()

    def begin(self) -> bool:
        was = self._get()
        if was:
            self.unseen |= not self._left
            self._clear()
        return was

    def end(self, was: bool) -> bool:
        """True when the op between begin() and end() set the flag."""
        now = self._get()
        if was and not now:
            self._set(True)
        self._left = was or now
        return now

    def sync_left(self) -> None:
        """Whatever the flag holds at session start is not the detector's to report."""
        if self.per_op:
            self._left = self._get()
            self.unseen = False

    def discard_since(self, was: bool) -> None:
        """Undo a flag set by the detector's own checks (a fp16 min/max of an inf input saturates)."""
        if not was and self._get():
            self._clear()

    def read_and_clear(self) -> bool:
        if self._get is None:
            return False
        was = self._get()
        if was:
            self._clear()
        return was


def _saturation_mode() -> bool:
    if "npukit.npu_backend" in sys.modules:
        from npukit.npu_backend import numerics

        return numerics.fp16_mode() == "saturation"
    if "torch_npu" in sys.modules:
        return not sys.modules["torch_npu"].npu.utils.is_support_inf_nan()
    return False


# ---------------------------------------------------------------------------- checks
class _Checks:
    """Device scalars of one step (one or two per tensor), fetched with one copy when resolved."""

    def __init__(self, zeros: bool = False) -> None:
        self.zeros = zeros  # also count the non-zero values of fp16/bf16 tensors (underflow)
        self.pending: list[torch.Tensor] = []
        self.values: list[float] = []
        # id(tensor) -> (weakref, version, slots, zero slot): a tensor passed on is checked once.
        self.seen: dict[int, tuple] = {}

    def slots(self, tensor: torch.Tensor) -> tuple[tuple[int, ...], int | None]:
        """(slots of the finiteness check, slot of the non-zero count or None)."""
        key = id(tensor)
        version = tensor_version(tensor)
        known = self.seen.get(key)
        if known is not None and known[0]() is tensor and known[1] == version:
            return known[2], known[3]
        data = strided_form(tensor.detach())
        if data is not None and data.is_complex():
            data = real_view(data)  # inf/nan in either part
        if data is None or not data.is_floating_point() or data.numel() == 0 or data.device.type == "meta":
            return (), None  # nested tensors included: their components are checked where they are used
        start = len(self.values) + len(self.pending)
        zero_slot = None
        with torch._C.DisableTorchFunction():
            extremes = _finite_float32_extremes(data)
            if extremes is not None:
                self.pending += extremes
                slots = (start, start + 1)
                self.remember(tensor, slots)
                return slots, None
            if data.dtype in _MIN_MAX_DTYPES:
                low, high = torch.aminmax(data)
                self.pending += (low, high)
                if self.zeros:
                    zero_slot = start + 2
                    self.pending.append(torch.count_nonzero(data))
            elif data.dtype in _WIDE_FLOATS:  # fp32 on a device or with inf/nan in it, fp64
                self.pending += torch.aminmax(data)
            else:
                self.pending.append(data.sum())
        slots = tuple(range(start, start + (2 if data.dtype in _MIN_MAX_DTYPES or data.dtype in _WIDE_FLOATS else 1)))
        self.remember(tensor, slots, zero_slot)
        return slots, zero_slot

    def minimum(self, tensor: torch.Tensor) -> int | None:
        """Slot of the tensor's smallest element (floating tensors only)."""
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.is_nested:
            return None
        with torch._C.DisableTorchFunction():
            self.pending.append(tensor.detach().amin())
        return len(self.values) + len(self.pending) - 1

    def remember(self, tensor: torch.Tensor, slots: tuple[int, ...], zero_slot: int | None = None) -> None:
        with contextlib.suppress(TypeError):
            self.seen[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor), slots, zero_slot)

    def resolve(self) -> list[float]:
        if self.pending:
            # One copy per device (a step usually has one; CPU-side checks of the data are the other).
            by_device: dict[torch.device, list[int]] = {}
            fetched = [0.0] * len(self.pending)
            for position, value in enumerate(self.pending):
                if isinstance(value, float):  # measured on the host already
                    fetched[position] = value
                else:
                    by_device.setdefault(value.device, []).append(position)
            with torch._C.DisableTorchFunction():
                for positions in by_device.values():
                    stacked = torch.stack([self.pending[p] for p in positions]).cpu().tolist()
                    for position, value in zip(positions, stacked):
                        fetched[position] = value
            self.values += fetched
            self.pending = []
        return self.values


def _finite_float32_extremes(data: torch.Tensor) -> tuple[float, float] | None:
    """(min, max) of an fp32 tensor in host memory whose values are all finite, from one read
    (watch's tensor_stats, whose one-pass kernel sums in float64); None otherwise (another dtype or device, or
    inf/nan in it: torch's min/max then). Not a float32 sum: finite values can sum to inf
    (transformers' eager mask, torch.finfo(torch.float32).min wherever a key is hidden, sums to -inf,
    an overflow named in every fp32 run of a Hugging Face model with eager attention)."""
    if data.dtype != torch.float32 or not host_memory(data):
        return None
    values = tensor_stats(data)  # max, min, mean, norm, nan count, inf count
    if not isinstance(values, list) or values[4] or values[5]:
        return None
    return values[1], values[0]


@dataclass(slots=True)
class _TensorCheck:
    leaf: str  # "input.0", "output.1"
    dtype: torch.dtype
    shape: tuple
    slots: tuple[int, ...]
    zero_slot: int | None = None  # underflow option: count of non-zero values

    def zero_fraction(self, values: list[float]) -> float | None:
        if self.zero_slot is None:
            return None
        count = math.prod(self.shape)
        return (count - values[self.zero_slot]) / count

    def finite(self, values: list[float]) -> bool:
        return all(math.isfinite(values[slot]) for slot in self.slots)

    def describe(self, values: list[float]) -> dict:
        out = {"name": self.leaf, "dtype": str(self.dtype), "shape": list(self.shape),
               "finite": self.finite(values)}
        if len(self.slots) == 2:
            out["Min"], out["Max"] = (_json_number(values[slot]) for slot in self.slots)
        elif len(self.slots) == 1:
            count = math.prod(self.shape) or 1
            out["Mean"] = _json_number(values[self.slots[0]] / count)
        return out


@dataclass(slots=True)
class _OpRecord:
    name: str
    direction: str
    module: str  # path of the innermost running module ("" for the root or outside any module)
    stack_id: int | None
    inputs: list[_TensorCheck]
    outputs: list[_TensorCheck] = field(default_factory=list)
    flag: bool = False
    # Tensors the op also reads without being its arguments: a backward node's saved forward
    # inputs and outputs, a module's parameters. An event needs them finite too.
    context: list[_TensorCheck] = field(default_factory=list)
    parent: _OpRecord | None = None  # module level: the enclosing module call
    module_class: str = ""
    live: tuple | None = None  # dump action: (func, args, kwargs, outputs) while the op is resolved
    infinite_scalar: bool = False  # an argument is a Python +-inf (masked_fill(mask, float("-inf")))
    # a Python float argument is inf/nan: its inf/nan output is asked for (masking before a softmax)
    nonfinite_scalar: bool = False
    input_minimum: int | None = None  # a logarithm's: slot of its input's smallest element


_LOGARITHMS = frozenset({"log", "log2", "log10", "log_", "log2_", "log10_"})


def _log_of_exact_zeros(record: _OpRecord, outputs: list[_TensorCheck], values: list[float]) -> bool:
    """A logarithm whose only non-finite results are -inf from inputs that are exactly 0 and none
    negative: log(0) = -inf as written, not an overflow (`torch.log(torch.tril(ones))` is how
    pytorch/examples' word_language_model builds its causal mask). Its gradient at 0 is infinite:
    a log of zeros that is differentiated is found in the backward."""
    if record.input_minimum is None or values[record.input_minimum] != 0.0:
        return False
    # min/max (floating dtypes) or a sum (others): -inf and only -inf (a nan or +inf makes the sum nan)
    return all(values[check.slots[0]] == -math.inf and math.isfinite(values[check.slots[-1]]) if len(check.slots) == 2
               else values[check.slots[0]] == -math.inf for check in outputs if check.slots)


class _StepState:
    def __init__(self, zeros: bool = False) -> None:
        self.checks = _Checks(zeros)
        self.ops: list[_OpRecord] = []
        self.recorded = False  # any op recorded in this step
        self.backward = False  # a backward op recorded: a training step is in progress
        self.counter = naming.CallCounter()
        self.unattributed_flag = False
        self.events: list[dict] = []
        self.event_records: list[_OpRecord] = []
        self.handled: list[dict] = []  # gradient overflows of a step GradScaler skipped
        self.module_backward: dict[str, list[_OpRecord]] = {}  # module level: path -> backward records


def _json_number(value: float):
    if value != value:
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


# ---------------------------------------------------------------------------- session
class OverflowSession:
    """Detect overflowing ops of a training run; events go to the console and `out_dir/overflow.json`.

    action: "report" (record and go on), "dump" (also write each event op's inputs and outputs),
    "stop" (raise OverflowStop at the first event). max_events: stop checking after that many.
    level: "api" (every torch op, forward and backward) or "module" (module outputs only).
    """

    def __init__(self, out_dir: Path = Path("overflow"), action: str = "report", max_events: int = 20, *,
                 level: str = "api", stack: bool = True, rank: int | None = None, console: bool = True,
                 underflow: bool = False, underflow_threshold: float = 0.01) -> None:
        if action not in ACTIONS:
            raise UserError(f"--overflow-action: {action!r} is not one of {', '.join(ACTIONS)}")
        if level not in LEVELS:
            raise UserError(f"overflow level: {level!r} is not one of {', '.join(LEVELS)}")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise UserError(f"--overflow-max: expected a positive number of events, got {max_events!r}")
        if not 0 < underflow_threshold <= 1:
            raise UserError(f"underflow threshold: expected a fraction in (0, 1], got {underflow_threshold!r}")
        self.underflow = underflow
        self.underflow_threshold = underflow_threshold
        self.underflows: dict[str, dict] = {}  # op name -> its worst underflow finding
        self.out_dir = Path(out_dir)
        check_output_location(self.out_dir, "--overflow-dir")
        self.action = action
        self.max_events = max_events
        self._stopped_in_step: int | None = None  # --overflow-max reached there: later steps are not checked
        self.level = level
        self.capture_stack = stack
        self.rank = rank_from_env() if rank is None else rank
        self.per_rank = rank is not None or "RANK" in os.environ
        self.events: list[dict] = []
        self.skipped_steps: list[dict] = []
        self.step_index = 0
        self._brought: dict[int, str] = {}  # step -> the first collective that brought inf/nan here
        self._event_count = 0
        self._shown_sites: list[tuple] = []  # (op, kind, first stack line) of events printed
        self._repeats = 0
        self._console = None
        self._show = console
        self._eager = action == "dump"  # the event's tensors must still be alive
        self._flag = _DeviceFlag()  # made again at start(): the device may be installed in between
        self._saturation = False
        self._bracket = False
        self._active = False
        self._run_failed = False
        self._checking = False
        self._auto_ended = False  # the last step boundary was an automatic one
        # steps.paused > 0 inside optimizer.step(): its update ops are not the model's
        self._steps = RecordedSteps(lambda: self._active, self._on_auto_step_end,
                                    before_scaler_step=self._before_scaler_step)
        self._optimizer_update: _OpRecord | None = None  # the running optimizer.step's, inputs checked
        self._paths = naming.ModulePaths()
        # running: (module, (path, record (module level), flag value before the module ran)); none
        # inside optimizer.step (steps.paused)
        steps = self._steps
        self._module_hooks = ModuleHooks(naming.ModuleNames(self._paths), owner=type(self).__name__,
                                         guard=unintercepted, watching=lambda: not steps.paused,
                                         root=steps.root_forward, enter=self._enter_module,
                                         leave=self._leave_module)
        self._stacks = CallStacks(_MAX_STACK_FRAMES)
        self._op_nodes = OpNodes()
        self._handles: list = []
        self._mode: ApiMode | None = None
        self._state = _StepState(self.underflow)
        # what the detector could not watch: fullgraph regions that ran compiled, hooks an internal
        # error switched off (overflow.json "not_watched")
        self.not_watched: list[dict] = []

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> OverflowSession:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not (exc_type is SystemExit and exc.code in (0, None)):
            self.mark_run_failed()
        self.stop()

    def mark_run_failed(self) -> None:
        """The watched code raised: it was not checked to its end, and the summary must say so."""
        self._run_failed = True

    def start(self) -> OverflowSession:
        if self._active:
            return self
        from torch.optim import optimizer as optimizer_hooks

        self._active = self._checking = True
        revive_hooks(type(self).__name__)
        add_failure_listener(self._on_hook_failed)
        eager.enter("overflow detection", self._on_compiled_region)
        self._flag = _DeviceFlag()
        self._read_mode()
        if self._flag.per_op:
            self._flag.sync_left()
        else:
            self._flag.read_and_clear()  # a flag left over from before the session is not ours
        self._module_hooks.install()
        self._handles = [
            optimizer_hooks.register_optimizer_step_pre_hook(self._on_optimizer_pre_step),
            optimizer_hooks.register_optimizer_step_post_hook(self._on_optimizer_post_step),
        ]
        self._steps.install()
        self._watch_collectives(True)
        if self.level == "api":
            steps = self._steps
            self._mode = ApiMode(lambda: not steps.paused and not steps.scaler.inside, self._run_api,
                                 naming.MsprobeOpNames(naming.creation_table()))
            self._mode.__enter__()
        return self

    def step(self) -> None:
        """End the current step (its checks are read now) and start the next one.

        The first call switches the automatic boundaries off; if the optimizer step just ended this
        step automatically, that boundary counts and no empty step is added.
        """
        just_ended = self._steps.automatic and self._auto_ended and not self._state.recorded
        self._steps.automatic = False
        if not just_ended:
            self._end_step()

    def stop(self) -> None:
        """Read the step in progress, remove every hook, write overflow.json and print a summary."""
        if not self._active:
            return
        self._active = False
        eager.leave(self._on_compiled_region)
        remove_failure_listener(self._on_hook_failed)
        try:
            self._resolve()
        finally:
            self._stop_checking()
            self._exit_mode()
            self._module_hooks.remove()
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._steps.remove()
            self._watch_collectives(False)
            self._write_report(final=True)
            self._print_summary()

    @property
    def first_event(self) -> dict | None:
        return self.events[0] if self.events else None

    # ------------------------------------------------------------------ steps
    def _end_step(self, skipped_by_scaler: bool = False, scale: float | None = None) -> None:
        state = self._state
        skipped = None
        if skipped_by_scaler:
            skipped = {"step": self.step_index, "rank": self.rank, "scale": scale, "first_overflow": None,
                       "overflows": 0, "nonfinite_from_collective": self._brought.get(self.step_index)}
            self.skipped_steps.append(skipped)
        if state.ops or state.unattributed_flag or skipped_by_scaler or state.checks.pending:
            self._resolve(skipped_by_scaler=skipped_by_scaler)
        if skipped is not None:
            # Gradients overflowing under loss scaling are what GradScaler handles by skipping the
            # step: they are not events (the dump action found them before the skip was known).
            handled = [event for event in state.events if event["direction"] != naming.FORWARD] + state.handled
            for event in state.events:  # the dump action reported them before the skip was known
                event["step_skipped_by_grad_scaler"] = True
            if handled:
                self.events = [event for event in self.events if all(event is not item for item in handled)]
                skipped.update(first_overflow=handled[0]["name"], overflows=len(handled))
            if handled or state.events:
                self._write_report()
            self._print(f"[yellow]step {self.step_index}: skipped by GradScaler[/] (scale {scale:g})"
                        + (f"; gradients overflowed first in {handled[0]['name']}" if handled else ""))
        self._state = _StepState(self.underflow)
        self._brought.pop(self.step_index, None)
        self._auto_ended = self._steps.automatic
        self._read_mode()
        self._module_hooks.running.clear()
        self.step_index += 1

    def _watch_collectives(self, watch: bool) -> None:
        """Be told, by the emulated NPU's hccl group, of the collectives that bring inf/nan to this
        rank from finite inputs: they name how an overflow on another rank reached it."""
        distributed = sys.modules.get("npukit.npu_backend.distributed")
        if distributed is not None:
            (distributed.observe_nonfinite if watch else distributed.forget_nonfinite)(self._on_nonfinite_collective)

    def _on_nonfinite_collective(self, collective: str) -> None:
        if self._checking:
            self._brought.setdefault(self.step_index, collective)

    def _read_mode(self) -> None:
        self._saturation = _saturation_mode()
        # Only a saturating device sets the flag: in INF_NAN mode no op needs bracketing.
        self._bracket = self._saturation and self._flag.per_op

    @unintercepted
    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        if self._steps.paused == 0:
            if not self._steps.scaler.inside:
                self._check_parameter_grads()
            # Read before the update: with action="stop" the weights never see the overflow.
            self._resolve()
            self._optimizer_update = self._optimizer_update_record(optimizer)
        self._steps.optimizer_step_begins()
        if self._mode is not None:
            self._mode.lift()

    @unintercepted
    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        if self._mode is not None:
            self._mode.restore()
        self._steps.optimizer_step_returned()
        if self._steps.paused == 0 and self._optimizer_update is not None:
            record, self._optimizer_update = self._optimizer_update, None
            updated = self._updated(optimizer)
            # Checked afresh: an update through param.data (or a foreach op on the emulated device)
            # leaves the parameter's version counter as it was, so its pre-step check would be reused.
            for param in updated:
                self._state.checks.seen.pop(id(param), None)
            record.outputs = [self._check(param, f"output.{i}") for i, param in enumerate(updated)]
            self._append(record)
        self._steps.end_after_optimizer_step()

    @staticmethod
    def _updated(optimizer) -> list[torch.Tensor]:
        """The parameters an optimizer step updates: those with a gradient."""
        return [local_shard(param) for group in optimizer.param_groups for param in group["params"]
                if param.grad is not None]

    def _optimizer_update_record(self, optimizer) -> _OpRecord | None:
        """optimizer.step() as one op: finite parameters and gradients in, the parameters out. Its
        update ops are not watched one by one (they are not the model's), but an update that makes a
        weight inf/nan is where the run breaks: fp16 weights with Adam's eps=1e-8 (0 in fp16) divide
        a zero moment by zero; the next forward only passes the nan on."""
        if not self._checking or self.level != "api":
            return None
        params = self._updated(optimizer)
        if not params:
            return None
        name = f"Optimizer.{type(optimizer).__name__}.step"
        inputs = [self._check(param, f"input.{i}") for i, param in enumerate(params)]
        inputs += [self._check(local_shard(param.grad), f"grad.{i}") for i, param in enumerate(params)]
        return _OpRecord(naming.api_entry_name(name, self._state.counter.next(name)), naming.FORWARD, "",
                         self._stack_id(), inputs)

    @unintercepted
    def _before_scaler_step(self) -> None:
        self._check_parameter_grads()  # still scaled: what GradScaler is about to look at

    @unintercepted
    def _on_auto_step_end(self, skipped: bool, loss_scale: float | None) -> None:
        self._end_step(skipped_by_scaler=skipped, scale=loss_scale)

    def _on_hook_failed(self, kind: str, where: str, detail: str) -> None:
        if kind.startswith(type(self).__name__ + "."):
            self._not_watched(INTERNAL_ERROR, where, detail + " (not watched from here on)")

    @unintercepted
    def _on_compiled_region(self, name: str) -> None:
        """A torch.compile(fullgraph=True) region runs compiled: its ops are not checked one by one
        (inside an optimizer step the update is still checked as one op)."""
        if self._active and self._checking and not self._steps.paused:
            self._not_watched(COMPILED_REGION, name, eager.REGION_DETAIL)

    def _not_watched(self, kind: str, where: str, detail: str) -> None:
        if all(item["where"] != where or item["kind"] != kind for item in self.not_watched):
            self.not_watched.append({"kind": kind, "where": where, "detail": detail, "step": self.step_index})

    def _stop_checking(self) -> None:
        """max_events reached or the run stops: no more per-op work; steps are still counted.

        The api mode stays on the stack until stop(): this may run inside the mode's own handler,
        where the mode is temporarily off the stack."""
        self._checking = False

    def _exit_mode(self) -> None:
        if self._mode is not None:
            self._mode.close()  # a mode left below another passes calls through: _checking is off
            self._mode = None

    # ------------------------------------------------------------------ modules
    def _enter_module(self, module, args, root: bool) -> tuple[str, _OpRecord | None, bool]:
        path = self._module_hooks.path(module)
        record = None
        if self.level == "module" and self._checking:
            index = self._state.counter.next(f"Module.{path}.{type(module).__name__}")
            name = naming.module_entry_name(path, type(module).__name__, index)
            parent = next((entry for _, (_, entry, _) in reversed(self._module_hooks.running) if entry is not None),
                          None)
            record = _OpRecord(name, naming.FORWARD, path, self._stack_id(), self._check_all(args, "input"),
                               context=self._check_list(list(module.parameters()), "parameters"), parent=parent,
                               module_class=type(module).__name__)
        was = self._flag.begin() if record is not None and self._bracket else False
        return path, record, was

    def _leave_module(self, module, frame: tuple[str, _OpRecord | None, bool], args, output=None) -> None:
        _, record, was = frame
        if record is None or not self._checking:
            return
        record.flag = self._flag.end(was) if self._bracket else False
        outputs = tensors_in(output)
        record.outputs = self._check_list(outputs, "output")
        self._add_record(record, (None, args, {}, output))
        if torch.is_grad_enabled():
            self._hook_module_backward(record, type(module).__name__, args, outputs)

    def _hook_module_backward(self, forward: _OpRecord, class_name: str, args, outputs) -> None:
        grad_outputs = [t for t in outputs if t.requires_grad]
        grad_inputs = [t for t in tensors_in(args) if t.requires_grad]
        if not grad_outputs:
            return
        index = int(forward.name.rsplit(".", 1)[1])
        name = naming.module_entry_name(forward.module, class_name, index, naming.BACKWARD)
        state = self._state
        backward = _OpRecord(name, naming.BACKWARD, forward.module, forward.stack_id, [None] * len(grad_outputs),
                             [None] * len(grad_inputs), context=forward.inputs + forward.outputs + forward.context,
                             module_class=class_name)
        placed = []
        # Its incoming gradients are also what its parameter gradients come from.
        state.module_backward.setdefault(forward.module, []).append(backward)

        def incoming(position):
            @unintercepted
            def hook(grad):
                if state is self._state and self._checking:
                    backward.inputs[position] = self._check(grad, f"input.{position}")
            return hook

        def outgoing(position):
            @unintercepted
            def hook(grad):
                if state is self._state and self._checking:
                    backward.outputs[position] = self._check(grad, f"output.{position}")
                    if not placed:
                        placed.append(True)
                        self._append(backward)
            return hook

        for position, tensor in enumerate(grad_outputs):
            tensor.register_hook(incoming(position))
        for position, tensor in enumerate(grad_inputs):
            tensor.register_hook(outgoing(position))

    def _check_parameter_grads(self) -> None:
        """Module level: parameter gradients, checked once per step before the optimizer (or the
        GradScaler) uses them. At op level the ops that computed them are checked already."""
        if self.level != "module" or not self._checking:
            return
        state = self._state
        for module, path in list(self._paths.items()):
            grads = [(key, local_shard(param.grad)) for key, param in module._parameters.items()
                     if param is not None and param.grad is not None]
            if not grads:
                continue
            incoming = [check for record in state.module_backward.get(path, ())
                        for check in record.inputs if check is not None]
            class_name = type(module).__name__
            self._append(_OpRecord(naming.module_params_grad_name(path, class_name), naming.BACKWARD, path, None,
                                   incoming, [self._check(grad, f"parameters_grad.{key}") for key, grad in grads],
                                   module_class=class_name))

    # ------------------------------------------------------------------ apis
    def _run_api(self, api: str, func, args, kwargs):
        if not self._checking:
            return func(*args, **kwargs)
        state = self._state
        index = state.counter.next(api)
        inputs = self._check_all((args, kwargs), "input")
        in_place = naming.writes_its_input(api, args, kwargs)
        live_args = args
        if self._eager and in_place:  # the op overwrites its inputs: keep them for the dump
            with torch._C.DisableTorchFunction():
                live_args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        was = self._flag.begin() if self._bracket else False
        output = func(*args, **kwargs)
        flag = self._flag.end(was) if self._bracket else False
        if api in naming.UNINITIALIZED_OUTPUT and not flag:
            return output  # uninitialized memory: whatever bytes it holds are not the op's result
        outputs = tensors_in(output)
        running = self._module_hooks.running
        module, module_class = (running[-1][1][0], type(running[-1][0]).__name__) if running else ("", "")
        copies = api in _COPIES_VALUES and not flag
        # A copy cannot be where an overflow starts: its record only carries checks to its backward.
        record = _OpRecord(naming.api_entry_name(api, index), naming.FORWARD, module,
                           None if copies else self._stack_id(), inputs, flag=flag, module_class=module_class)
        if flag:  # rare: look at the scalars only for ops that saturated
            record.infinite_scalar = _has_infinite_scalar((args, kwargs))
        record.nonfinite_scalar = _nonfinite_scalar_argument(args, kwargs)
        if api.rpartition(".")[2] in _LOGARITHMS and args and isinstance(args[0], torch.Tensor):
            record.input_minimum = state.checks.minimum(args[0] if not in_place else live_args[0])
        if copies:
            record.outputs = self._copied_checks(inputs, outputs, api in _SAME_ELEMENTS)
        else:
            record.outputs = self._check_list(outputs, "output")
            self._add_record(record, (func, live_args, kwargs, output))
        if torch.is_grad_enabled() and outputs:
            self._hook_api_backward(api, index, record, args, kwargs, outputs)
        return output

    def _hook_api_backward(self, api, index, forward: _OpRecord, args, kwargs, outputs) -> None:
        nodes = self._op_nodes.created(tensors_in((args, kwargs)), outputs)
        if not nodes:
            return
        state = self._state
        name = naming.api_entry_name(api, index, naming.BACKWARD)
        flags: list[bool] = []
        # A logarithm's gradient (grad / x) reads only its input: its -inf output at x = 0 is no
        # earlier overflow the gradient merely passes on.
        logarithm = forward.input_minimum is not None

        @unintercepted
        def pre_hook(grad_outputs):
            if state is self._state and self._checking:
                flags.append(self._flag.begin())

        def hook_for(node):
            copies = type(node).__name__ in _COPYING_NODES
            same_elements = type(node).__name__ in _SAME_ELEMENT_NODES

            @unintercepted
            def hook(grad_inputs, grad_outputs):
                if state is not self._state or not self._checking:
                    return
                flag = self._flag.end(flags.pop()) if flags else False
                incoming = self._check_list(grad_outputs, "input")
                if copies and not flag:
                    self._copied_checks(incoming, grad_inputs, same_elements)
                    return
                record = _OpRecord(name, naming.BACKWARD, forward.module, forward.stack_id, incoming,
                                   self._check_list(grad_inputs, "output"), flag=flag,
                                   context=forward.inputs + ([] if logarithm else forward.outputs),
                                   module_class=forward.module_class)
                self._add_record(record, (None, grad_outputs, {}, grad_inputs))
            return hook

        for node in nodes:
            if self._bracket:
                node.register_prehook(pre_hook)
            node.register_hook(hook_for(node))

    # ------------------------------------------------------------------ checks and records
    def _check(self, tensor, leaf: str) -> _TensorCheck | None:
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested:  # no single shape
            return None
        if self._bracket and tensor.dtype == torch.float16:
            was = self._flag.value()
            slots, zero_slot = self._state.checks.slots(tensor)
            self._flag.discard_since(was)
        else:
            slots, zero_slot = self._state.checks.slots(tensor)
        return _TensorCheck(leaf, tensor.dtype, tuple(tensor.shape), slots, zero_slot)

    def _check_list(self, tensors, prefix: str) -> list[_TensorCheck]:
        checks = (self._check(tensor, f"{prefix}.{i}") for i, tensor in enumerate(tensors))
        return [check for check in checks if check is not None]

    def _copied_checks(self, inputs: list[_TensorCheck], outputs, same_zeros: bool) -> list[_TensorCheck]:
        """Checks of outputs that copy their inputs' values: any non-finite input may be in them.

        same_zeros: the output holds exactly its one input's elements (a view, a transpose), so its
        share of zeros is the input's too (the underflow option compares zero shares).
        """
        inputs = [check for check in inputs if check is not None and check.slots]
        slots = tuple(slot for check in inputs for slot in check.slots)
        zero_slot = inputs[0].zero_slot if same_zeros and len(inputs) == 1 else None
        checks = []
        for position, tensor in enumerate(outputs):
            if isinstance(tensor, torch.Tensor) and not tensor.is_nested:
                floating = tensor.is_floating_point()
                if floating:
                    self._state.checks.remember(tensor, slots, zero_slot)
                checks.append(_TensorCheck(f"output.{position}", tensor.dtype, tuple(tensor.shape),
                                           slots if floating else (), zero_slot if floating else None))
        return checks

    def _check_all(self, value, prefix: str) -> list[_TensorCheck]:
        return self._check_list(tensors_in(value), prefix)

    def _add_record(self, record: _OpRecord, live: tuple) -> None:
        if self._eager:
            record.live = live
            self._append(record)
            self._resolve()
            record.live = None
        else:
            self._append(record)

    def _append(self, record: _OpRecord) -> None:
        state = self._state
        state.ops.append(record)
        state.recorded = True
        state.backward |= record.direction == naming.BACKWARD
        if len(state.checks.pending) >= _RESOLVE_EVERY:
            self._resolve()  # a step without end (a long evaluation loop) must not grow without bound

    def _stack_id(self) -> int | None:
        return self._stacks.capture(2) if self.capture_stack else None

    # ------------------------------------------------------------------ resolving
    def _resolve(self, skipped_by_scaler: bool = False) -> None:
        """Read this step's pending checks (one device->host copy) and turn new ones into events."""
        state = self._state
        if self._flag.per_op:
            state.unattributed_flag |= self._flag.unseen
            self._flag.unseen = False
        elif self._flag.read_and_clear():
            state.unattributed_flag = True  # real device: the flag is only read once per step
        if not state.ops and not state.unattributed_flag:
            return
        values = state.checks.resolve()
        found = len(state.event_records)
        ops, state.ops = state.ops, []
        for record in ops:
            kind = self._event_kind(record, values)
            if kind is not None and not self._inside_event(record, state.event_records):
                state.event_records.append(record)
                self._record_event(record, kind, values, skipped_by_scaler)
            elif kind is None and self.underflow:
                self._note_underflow(record, values)
        if state.unattributed_flag and not state.event_records and self._checking:
            self._record_event(None, "saturation", values, skipped_by_scaler)
        state.unattributed_flag = False
        if len(state.event_records) > found:
            self._write_report()

    def _event_kind(self, record: _OpRecord, values: list[float]) -> str | None:
        """"inf_nan" or "saturation" when this op is where the overflow starts, else None."""
        inputs = [check for check in record.inputs + record.context if check is not None]
        if not all(check.finite(values) for check in inputs):
            return None  # it only passes on an earlier overflow

        def at_limit(check):
            return check.dtype == torch.float16 and any(abs(values[slot]) >= FP16_MAX for slot in check.slots)

        # In saturation mode an input at +-65504 is an earlier op's clamped result passed on.
        fresh_inputs = not (self._saturation and any(at_limit(check) for check in inputs))
        if record.flag:
            return "saturation" if fresh_inputs else None
        outputs = [check for check in record.outputs if check is not None]
        if not record.nonfinite_scalar and any(not check.finite(values) for check in outputs) \
                and not _log_of_exact_zeros(record, outputs, values):
            return "inf_nan"
        if self._saturation and not self._flag.per_op and fresh_inputs and any(at_limit(c) for c in outputs):
            return "saturation"  # real device: its flag is read once per step, the values tell the op
        return None

    def _note_underflow(self, record: _OpRecord, values: list[float]) -> None:
        """An fp16/bf16 op whose outputs hold clearly more zeros than its inputs: values flushed to zero."""
        produced = [f for f in (check.zero_fraction(values) for check in record.outputs if check is not None)
                    if f is not None]
        if not produced or _ZEROS_BY_DESIGN.search(record.name.lower()):
            return
        # Compared with the op's largest input (the activation or incoming gradient, not a zero bias);
        # when its share of zeros is unknown (fp32, or a relu's output) nothing can be said.
        inputs = [check for check in record.inputs if check is not None and check.slots]
        largest = max(inputs, key=lambda check: math.prod(check.shape), default=None)
        input_zeros = largest.zero_fraction(values) if largest is not None else None
        if input_zeros is None:
            return
        output_zeros = max(produced)
        if output_zeros - input_zeros < self.underflow_threshold:
            return
        known = self.underflows.get(record.name)
        if known is None or output_zeros - input_zeros > known["zero_fraction"] - known["input_zero_fraction"]:
            dtypes = sorted({str(check.dtype) for check in record.outputs if check is not None})
            self.underflows[record.name] = {
                "name": record.name, "step": self.step_index, "rank": self.rank, "direction": record.direction,
                "module": record.module, "module_class": record.module_class, "dtype": ", ".join(dtypes),
                "zero_fraction": output_zeros, "input_zero_fraction": input_zeros,
                "stack": self._stack_lines(record.stack_id)[:1],
            }

    @staticmethod
    def _inside_event(record: _OpRecord, found: list[_OpRecord]) -> bool:
        """Module level: a module whose child overflowed is not a second event."""
        return any(event.parent is not None and _encloses(record, event) for event in found)

    def _record_event(self, record: _OpRecord | None, kind: str, values: list[float], skipped: bool) -> None:
        if not self._checking:
            return
        self._event_count += 1
        event = {
            "index": self._event_count - 1,
            "step": self.step_index,
            "rank": self.rank,
            "time_ns": time.time_ns(),  # wall clock: orders the ranks' events of a step (one clock per host)
            "kind": kind,
            "step_skipped_by_grad_scaler": skipped,
        }
        if record is None:
            event.update(name=None, direction=None, module=None, module_class=None, dtype=None, inputs=[],
                         outputs=[], stack=[],
                         message="the device overflow flag was set by an op the detector does not see")
        else:
            dtypes = sorted({str(check.dtype) for check in record.outputs if check is not None})
            event.update(
                name=record.name, op=naming.split_entry_name(record.name)[0], direction=record.direction,
                module=record.module, module_class=record.module_class,
                dtype=dtypes[0] if len(dtypes) == 1 else dtypes,
                inputs=[check.describe(values) for check in record.inputs if check is not None],
                outputs=[check.describe(values) for check in record.outputs if check is not None],
                stack=self._stack_lines(record.stack_id),
            )
            if record.infinite_scalar and kind == "saturation":
                event["hint"] = INFINITE_FILL_HINT
            if record.live is not None and self.action == "dump":
                event.update(self._dump_event(record, event))
        if skipped and event["direction"] != naming.FORWARD:
            self._state.handled.append(event)
            return
        self.events.append(event)
        self._state.events.append(event)
        # The same op overflowing the same way at the same line (every step, every layer of a
        # loop) is shown once; the report has every event.
        site = (event.get("op") if event["stack"] else event["name"], event["kind"], event["stack"][:1])
        if site in self._shown_sites:
            self._repeats += 1
        else:
            self._shown_sites.append(site)
            self._print_event(event)
        if len(self.events) >= self.max_events:
            self._print(f"[yellow]{self.max_events} overflow events recorded (--overflow-max): checking stops[/]")
            self._stopped_in_step = self.step_index
            self._stop_checking()
        if self.action == "stop":
            self._stop_checking()  # the run ends here: what follows in this step is not another event
            self._write_report()
            raise OverflowStop(_stop_message(event))

    def _stack_lines(self, stack_id: int | None) -> list[str]:
        if stack_id is None:
            return []
        return [f"File {file}, line {line}, in {function}\n    {source}"
                for file, line, function, source in self._stacks.frames(stack_id)]

    # ------------------------------------------------------------------ dump action
    def _dump_event(self, record: _OpRecord, event: dict) -> dict:
        """Write the op's inputs and outputs as a one-entry dump (npu-compare's format) and replay it."""
        func, args, kwargs, output = record.live
        rank_dir = self.out_dir / "dump" / f"step{self.step_index}" / f"rank{self.rank}"
        data_dir = rank_dir / "dump_tensor_data"
        data_dir.mkdir(parents=True, exist_ok=True)
        stats = StatsBuffer()
        leaves = []

        def describe(value, leaf_name):
            if isinstance(value, torch.Tensor):
                value = local_shard(value)
                leaf = {"type": "torch.Tensor", "dtype": str(value.dtype), "shape": list(value.shape),
                        "requires_grad": value.requires_grad, "data_name": f"{leaf_name}.npy"}
                with torch._C.DisableTorchFunction():
                    write_tensor(data_dir / leaf["data_name"], value.detach().cpu())
                    leaves.append((leaf, stats.add(value)))
                return leaf
            if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
                return [describe(item, f"{leaf_name}.{i}") for i, item in enumerate(value)]
            return describe_value(value)

        name = record.name
        body = {"input_args": describe(tuple(args), f"{name}.input"),
                "input_kwargs": {key: describe(value, f"{name}.input.{key}") for key, value in kwargs.items()},
                "output": describe(output if isinstance(output, list | tuple) else (output,), f"{name}.output")}
        if record.direction == naming.BACKWARD:
            body = {"input": body["input_args"], "output": body["output"]}
        resolved = stats.resolve()
        for leaf, slot in leaves:
            fill_stats(leaf, resolved[slot])
        write_json(rank_dir / "dump.json", {"task": "tensor", "level": "L1", "framework": "pytorch",
                                            "dump_data_dir": str(data_dir.absolute()), "data": {name: body}})
        result = {"dump": str(rank_dir / "dump.json")}
        if func is not None:
            result["fp32_replay"] = replay_in_fp32(func, args, kwargs, output)
        return result

    # ------------------------------------------------------------------ output
    def _print(self, markup: str) -> None:
        if not self._show:
            return
        if self._console is None:
            from npukit.console import make_console

            self._console = make_console(stderr=True, highlight=False, soft_wrap=True)
        self._console.print(markup)

    def _print_event(self, event: dict) -> None:
        if event["name"] is None:
            self._print(f"[red]overflow[/] step {event['step']} rank {event['rank']}: {event['message']}")
            return
        what = "saturated (overflow flag)" if event["kind"] == "saturation" else "inf/nan from finite inputs"
        module = f" in [bold]{_module_label(event)}[/]" if event["module_class"] else ""
        skipped = " (step skipped by GradScaler)" if event["step_skipped_by_grad_scaler"] else ""
        self._print(f"[red]overflow[/] step {event['step']} rank {event['rank']}: [bold]{event['name']}[/]{module}, "
                    f"{event['dtype']}: {what}{skipped}")
        if event["stack"]:
            self._print("  " + event["stack"][0].replace("\n", "\n  "))
        if "fp32_replay" in event:
            self._print(f"  fp32 replay: {event['fp32_replay']['verdict']}")
        if "hint" in event:
            self._print(f"  [yellow]hint:[/] {event['hint']}")

    def _print_summary(self) -> None:
        steps = self._steps_seen()
        if self.not_watched:
            self._print("overflow check: not watched: " + "; ".join(
                f"{item['where']} ({'ran compiled, fullgraph' if item['kind'] == COMPILED_REGION else 'internal error'}"
                f", from step {item['step']})" for item in self.not_watched))
        if self.underflows:
            worst = self._underflow_list()[0]
            where = f" in {_module_label(worst)}" if worst["module_class"] else ""
            self._print(f"underflow: {len(self.underflows)} fp16/bf16 op(s) flushed values to zero; most: "
                        f"{worst['name']}{where}, {worst['zero_fraction']:.1%} of its outputs zero "
                        f"(inputs {worst['input_zero_fraction']:.1%})")
        elif self.underflow:
            self._print("underflow: no fp16/bf16 op flushed values to zero")
        if not self.events and self._run_failed:
            self._print(f"overflow check: the run stopped with an error in step {self.step_index}; no overflow was "
                        f"seen in the {steps} step(s) before it (the check did not reach the end of the run)")
            return
        if not self.events:
            self._print(f"overflow check: no overflow in {steps} step(s) "
                        f"({'saturation' if self._saturation else 'inf_nan'} mode, {self.level} level)"
                        + (f"; {len(self.skipped_steps)} step(s) skipped by GradScaler" if self.skipped_steps else ""))
            return
        first = self.events[0]
        where = first["name"] or "an op the detector does not see"
        # the steps after --overflow-max's last event ran unchecked: "in N steps" would count them
        unchecked = self._stopped_in_step is not None and self._stopped_in_step + 1 < steps
        checked = (f"{len(self.events)} event(s) in {steps} step(s)" if not unchecked else
                   f"{len(self.events)} event(s) before checking stopped in step {self._stopped_in_step} "
                   f"(--overflow-max {self.max_events}; the run had {steps} step(s))")
        self._print(f"overflow check: {checked}; first: {where} "
                    f"(step {first['step']}, {first['direction'] or 'unknown direction'}"
                    f"{', in ' + _module_label(first) if first.get('module_class') else ''}); "
                    f"{len(self.skipped_steps)} step(s) skipped by GradScaler; details in {self._report_path()}"
                    + (f" ({self._repeats} repeat(s) of an event shown above not printed)" if self._repeats else ""))

    def _steps_seen(self) -> int:
        # Ops after the last step boundary (printing the loss) are not another step; a backward is.
        state = self._state
        in_progress = state.backward or (state.recorded and not self.step_index)
        return self.step_index + (1 if in_progress else 0)

    def _report_path(self) -> Path:
        return self.out_dir / f"rank{self.rank}" / REPORT_NAME if self.per_rank else self.out_dir / REPORT_NAME

    def _write_report(self, final: bool = False) -> None:
        """Written as events happen (a crash keeps them), and once more at the end (`final`)."""
        path = self._report_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, self._payload())
            world_size = int(os.environ.get("WORLD_SIZE", "1")) if final else None
            merged, last = _merge(self.out_dir, world_size) if self.per_rank else (None, False)
        except OSError as exc:
            raise UserError(f"--overflow-dir: cannot write {path} ({exc.strerror or exc})") from None
        # the last rank of the run to finish has every rank's report: it says where the overflow began
        if last and merged.get("across_ranks"):
            self._print(across_ranks_line(merged["across_ranks"], self.out_dir / REPORT_NAME))

    def _payload(self) -> dict:
        return {"version": _FORMAT_VERSION, "ranks": [self.rank], "level": self.level, "action": self.action,
                "fp16_mode": "saturation" if self._saturation else "inf_nan",
                "steps": self._steps_seen(),
                "truncated": len(self.events) >= self.max_events,
                "skipped_steps": self.skipped_steps, "events": self.events,
                "underflow": self._underflow_list() if self.underflow else None,
                "not_watched": self.not_watched}

    def _underflow_list(self) -> list[dict]:
        return sorted(self.underflows.values(),
                      key=lambda item: item["input_zero_fraction"] - item["zero_fraction"])


def _encloses(outer: _OpRecord, inner: _OpRecord) -> bool:
    parent = inner.parent
    while parent is not None:
        if parent is outer:
            return True
        parent = parent.parent
    return False


def _module_label(event: dict) -> str:
    """`module blocks.1 (Block)`, or `root module (Net)`."""
    path = event["module"]
    return f"module {path} ({event['module_class']})" if path else f"root module ({event['module_class']})"


INFINITE_FILL_HINT = (
    "an infinite fill value: in saturation mode (Ascend 910A) fp16 cannot hold +-inf, so it saturates to "
    "+-65504 and sets the overflow flag, and GradScaler skips every step. Fill with torch.finfo(x.dtype).min "
    "(or .max) instead of float('-inf')."
)


def _nonfinite_scalar_argument(args: tuple, kwargs: dict) -> bool:
    """A top-level Python float argument that is inf or nan (cheap: runs for every op)."""
    for value in args:
        if type(value) is float and not math.isfinite(value):
            return True
    return bool(kwargs) and any(type(v) is float and not math.isfinite(v) for v in kwargs.values())


def _has_infinite_scalar(value) -> bool:
    if isinstance(value, float):
        return math.isinf(value)
    if isinstance(value, list | tuple):
        return any(_has_infinite_scalar(item) for item in value)
    if isinstance(value, dict):
        return any(_has_infinite_scalar(item) for item in value.values())
    return False


def _stop_message(event: dict) -> str:
    if event["name"] is None:
        return f"overflow at step {event['step']} (rank {event['rank']}): {event['message']}"
    what = "set the overflow flag (saturated fp16)" if event["kind"] == "saturation" else "produced inf/nan from finite inputs"
    where = f" in {_module_label(event)}" if event["module_class"] else ""
    lines = [f"overflow at step {event['step']} (rank {event['rank']}): {event['name']}{where} {what} "
             f"[{event['dtype']}]"]
    if event["stack"]:
        lines.append("  " + event["stack"][0].replace("\n", "\n  "))
    if "hint" in event:
        lines.append(f"  hint: {event['hint']}")
    return "\n".join(lines)


def replay_in_fp32(func, args, kwargs, output) -> dict:
    """Run a forward op again on the CPU in fp32: a real fp16 overflow stays out of range there."""
    def to_fp32(value):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            return value.float() if value.is_floating_point() else value
        if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
            return type(value)(to_fp32(item) for item in value)
        return value

    with torch._C.DisableTorchFunction(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        try:
            reference = func(*to_fp32(tuple(args)), **{key: to_fp32(value) for key, value in kwargs.items()})
        except Exception as exc:  # an op that has no fp32 CPU kernel: say so rather than fail the run
            return {"verdict": f"not replayed ({type(exc).__name__}: {exc})"}
        tensors = [t for t in tensors_in(reference) if t.is_floating_point()]
        if not tensors:
            return {"verdict": "not replayed (no floating output)"}
        finite = all(bool(torch.isfinite(t).all()) for t in tensors)
        peak = max(float(t.abs().max()) if t.numel() and bool(torch.isfinite(t).all()) else math.inf for t in tensors)
    dtypes = {t.dtype for t in tensors_in(output)}
    limit = FP16_MAX if torch.float16 in dtypes else float(torch.finfo(torch.bfloat16).max) if torch.bfloat16 in dtypes else math.inf
    if not finite:
        verdict = "fp32 result is inf/nan too: the op overflows or is undefined for these inputs"
    elif peak > limit:
        verdict = f"real overflow: fp32 result max |x| = {peak:.6g} exceeds the output dtype's range ({limit:g})"
    else:
        verdict = f"fp32 result fits (max |x| = {peak:.6g}): the device result is wrong, not the inputs"
    return {"verdict": verdict, "fp32_max_abs": _json_number(peak), "fp32_finite": finite}


# ---------------------------------------------------------------------------- torchrun
def merge_rank_reports(out_dir: Path) -> dict:
    """Merge DIR/rank*/overflow.json into DIR/overflow.json, events ordered by step, then by time.

    Every rank calls it after writing its own file, under a lock: the last one to finish sees all.
    """
    return _merge(out_dir, None)[0]


def _merge(out_dir: Path, world_size: int | None) -> tuple[dict, bool]:
    """merge_rank_reports, and whether this rank is the last of its run to merge (counted under the
    same lock in DIR/.overflow.merged, per run: torchrun's rendezvous address and run id)."""
    import fcntl
    import json

    out_dir = Path(out_dir)
    with open(out_dir / ".overflow.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        last = False
        if world_size and world_size > 1:
            run = ":".join(os.environ.get(name, "") for name in
                           ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
            counter = out_dir / ".overflow.merged"
            try:
                seen = json.loads(counter.read_text())
            except (OSError, ValueError):
                seen = {}
            count = seen.get("count", 0) + 1 if isinstance(seen, dict) and seen.get("run") == run else 1
            write_json(counter, {"run": run, "count": count})
            last = count == world_size
        reports = []
        for path in sorted(out_dir.glob(f"rank*/{REPORT_NAME}")):
            try:
                reports.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"{path}: cannot read overflow report ({exc})") from None
        merged = {
            "version": _FORMAT_VERSION,
            "ranks": sorted(rank for report in reports for rank in report.get("ranks", [])),
            "level": reports[0]["level"] if reports else None,
            "action": reports[0]["action"] if reports else None,
            "fp16_mode": reports[0]["fp16_mode"] if reports else None,
            "steps": max((report.get("steps", 0) for report in reports), default=0),
            "truncated": any(report.get("truncated") for report in reports),
            "skipped_steps": sorted((item for report in reports for item in report.get("skipped_steps", [])),
                                    key=lambda item: (item["step"], item["rank"])),
            # within a step, in the order they happened (reports before time_ns: by rank)
            "events": sorted((event for report in reports for event in report.get("events", [])),
                             key=lambda event: (event["step"], event.get("time_ns", 0), event["rank"], event["index"])),
            "underflow": [item for report in reports for item in report.get("underflow") or []] or None,
        }
        merged["across_ranks"] = _where_it_began(merged)
        write_json(out_dir / REPORT_NAME, merged)
    return merged, last


def _where_it_began(merged: dict) -> dict | None:
    """With several ranks: the earliest event over all ranks, and the other ranks of that step:
    those with overflowing ops of their own, and those whose step GradScaler skipped with none (the
    non-finite values reached them through a collective, such as DDP's gradient all-reduce)."""
    if len(merged["ranks"]) < 2 or not merged["events"]:
        return None
    first = merged["events"][0]
    step = first["step"]
    own = {event["rank"] for event in merged["events"] if event["step"] == step} - {first["rank"]}
    skipped = [item for item in merged["skipped_steps"] if item["step"] == step]
    reached = {item["rank"] for item in skipped} - own - {first["rank"]}
    # the collectives that brought inf/nan to the reached ranks (where the hccl group tells)
    through = [item.get("nonfinite_from_collective") for item in skipped if item["rank"] in reached]
    return {"rank": first["rank"], "step": step, "name": first["name"], "direction": first["direction"],
            "module": first.get("module"), "module_class": first.get("module_class"),
            "ranks_with_their_own_overflow": sorted(own),
            "ranks_reached_through_a_collective": sorted(reached),
            "collectives": list(dict.fromkeys(name for name in through if name))}


def across_ranks_line(began: dict, report: Path) -> str:
    where = f" in {_module_label(began)}" if began.get("module_class") else ""
    line = (f"overflow across ranks: it began on rank {began['rank']}, step {began['step']}: "
            f"{began['name'] or 'an op the detector does not see'}{where}")
    if began["ranks_reached_through_a_collective"]:
        reached = number_ranges(began["ranks_reached_through_a_collective"])
        if began.get("collectives"):
            line += (f"; then it spread to rank(s) {reached} through {' and '.join(began['collectives'])} (inf/nan in its"
                     " output from finite inputs there; their step was skipped with no overflowing op of their own)")
        else:
            line += (f"; it reached rank(s) {reached} through a collective (their step was skipped with no overflowing"
                     " op of their own, e.g. DDP's gradient all-reduce)")
    if began["ranks_with_their_own_overflow"]:
        line += f"; rank(s) {number_ranges(began['ranks_with_their_own_overflow'])} overflowed later in the step too"
    return line + f". All ranks: {report}"
