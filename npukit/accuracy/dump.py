"""Per-layer dumps of an unmodified training or inference script, in msprobe's dump.json layout.

    with DumpSession(Path("dump"), level="mix", mode="stats"):
        runpy.run_path("train.py", run_name="__main__")

Levels: `module` hooks every nn.Module (forward inputs/outputs/parameters, backward grads,
parameter grads); `api` sees every torch / functional / Tensor call through a TorchFunctionMode
(torch itself is never patched) and its backward through autograd node hooks; `mix` does both.

What msprobe records, as it names it: the modules below the model (not the model itself: a root
module running modules of its own has no entry), and the apis an optimizer.step runs
(construct.json parent "optimizer").

Steps are found automatically: an optimizer step ends a step; a script without an optimizer ends
a step each time its first root module starts a new forward. Calling step() yourself switches the
automatic boundaries off.

Statistics are computed on the tensor's device and fetched once per step; a tensor that is the
output of one op and the input of the next is measured (and, in tensor mode, written) only once.
"""

from __future__ import annotations

import sys
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from npukit.accuracy import eager, graph, msprobe_config, naming
from npukit.accuracy.dump_leaves import describe_value, fill_stats
from npukit.accuracy.dumpfile import (
    ARGUMENTS,
    COMPILED_REGION,
    DUMPED_BY,
    HF32_OPS,
    INCOMPLETE,
    INTERNAL_ERROR,
    OPTIMIZER,
)
from npukit.accuracy.stacks import CallStacks
from npukit.accuracy.tensor_io import TensorFileWriter, lower_thread_priority, tensor_to_numpy
from npukit.errors import UserError
from npukit.files import check_output_location, output_folder, refuse_links_inside, write_json
from npukit.watch.hook_guard import add_failure_listener, remove_failure_listener, revive_hooks, unintercepted
from npukit.watch.module_hooks import ModuleHooks
from npukit.watch.op_hooks import ApiMode, rewritten_arguments
from npukit.watch.process import rank_from_env
from npukit.watch.steps import RecordedSteps
from npukit.watch.tensor_stats import StatsBuffer
from npukit.watch.tensors import local_shard, tensor_version, tensors_in

LEVELS = ("module", "api", "mix")
MODES = ("stats", "tensor", "md5")
# Tensor files: .npy (default: 1.7-4x cheaper to write and ~3x faster to read than torch.save's zip,
# memory-mapped by npu-compare) or .pt (a bare tensor, what `msprobe compare` reads).
TENSOR_FORMATS = ("npy", "pt")
_TASK_NAMES = {"stats": "statistics", "tensor": "tensor", "md5": "md5"}
_LEVEL_NAMES = {"module": "L0", "api": "L1", "mix": "mix"}  # msprobe's names for the levels
TENSOR_DATA_DIR = "dump_tensor_data"

# Ops whose output holds exactly the input's elements (reshaped or reordered): the output's max,
# min, mean and norm are the input's, so statistics are reused instead of recomputed -- forward,
# and for their gradients in backward. They are a third of a transformer's calls.
_SAME_ELEMENTS = frozenset(
    f"{prefix}.{op}"
    for prefix in ("Tensor", "Torch")
    for op in ("view", "reshape", "transpose", "permute", "t", "flatten", "unflatten", "unsqueeze", "squeeze",
               "contiguous", "view_as", "reshape_as", "swapaxes", "movedim", "ravel", "T", "mT")
)

_MAX_STACK_FRAMES = 30
_MAX_MODULE_NODES = 50_000  # a bound on the graph walk behind one module call


_MAX_STEP = 10**9
_MAX_SELECTED = 10**6


def parse_steps(spec: str | None, option: str = "--dump-steps") -> frozenset[int] | None:
    """`"0,2-4"` -> {0, 2, 3, 4}; None means every step (also used for rank lists)."""
    if spec is None or not str(spec).strip():
        return None
    steps: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(value) for value in part.split("-", 1))
                if low < 0 or high < low:
                    raise ValueError
            else:
                low = high = int(part)
                if low < 0:
                    raise ValueError
        except ValueError:
            raise UserError(f"{option}: {part!r} is not a number or range (expected e.g. 0,2-4)") from None
        if high > _MAX_STEP:
            raise UserError(f"{option}: {part!r}: numbers above {_MAX_STEP:,} are not steps or ranks a run reaches")
        if high - low >= _MAX_SELECTED:
            raise UserError(f"{option}: {part!r} selects more than {_MAX_SELECTED:,}; select fewer")
        steps.update(range(low, high + 1))
    return frozenset(steps)


def parse_name_list(spec: str | None, option: str) -> tuple[str, ...] | None:
    """Comma list of names; None or empty means no filter."""
    if spec is None:
        return None
    items = tuple(item.strip() for item in str(spec).split(","))
    if not any(items):
        return None
    if not all(items):
        raise UserError(f"{option}: empty name in {spec!r}")
    return items


_RAISED = object()  # the forward hook's output when the module's forward raised
_NOT_RECORDED = ("", None)  # the frame of a module running in a step not dumped


class _Entry:
    __slots__ = ("name", "data", "parent", "stack_id", "placed", "producers")

    def __init__(self, name: str, parent: str | None, stack_id: int | None) -> None:
        self.name = name
        self.data: dict = {}
        self.parent = parent
        self.stack_id = stack_id
        self.placed = False
        self.producers: list | None = None  # a module's inputs' producers, until its forward ends


class _StepRecord:
    """Everything recorded during one step; written by DumpSession._flush."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.stats = StatsBuffer()
        self.leaves: list[tuple[dict, int]] = []
        # id(tensor) -> (weakref, version, stats slot, producing leaf name, data file name)
        self.seen: dict[int, tuple] = {}
        # id(tensor) -> (weakref, version) of tensors holding uninitialized memory
        self.uninitialized: dict[int, tuple] = {}
        # id(tensor) -> (weakref, version, leaf name) of outputs of apis left out (--dump-ops): where
        # the value they pass on was recorded, so the op using them still names its producer
        self.carried: dict[int, tuple] = {}
        self.stacks = CallStacks(_MAX_STACK_FRAMES)
        self.counter = naming.CallCounter()
        self.arguments: dict[str, list] = {}  # api backward -> the argument of each `output` (dump's ARGUMENTS)
        self.skipped_at_loss_scale: float | None = None  # GradScaler skipped the optimizer step
        # what this step's dump lacks (dump.json "npukit_incomplete"): compiled regions, then at
        # _flush the internal errors that switched a hook off
        self.incomplete: list[dict] = []

    def place(self, entry: _Entry) -> None:
        if not entry.placed:
            entry.placed = True
            self.entries.append(entry)


class _ParameterTensors:
    """Which parameter each tensor a foreach call takes belongs to: the parameter, its gradient, an
    optimizer's state of it (Adam's exp_avg), and what foreach ops computed from them (the
    denominators), by the parameter's position: in the optimizer's parameter list inside its step,
    else among the parameters of the modules the dump has seen (clip_grad_norm_'s norms).

    A foreach op runs once per dtype: a golden run that keeps fc2 in fp32 updates all parameters in
    one `torch._foreach_add_`, an NPU run that keeps fc2 in bf16 in two. So each element of a foreach
    call is recorded as an entry of its own, named by its parameter rather than by the call: the n-th
    call of an api on parameter k is `api.{base + n * P + k}` (P parameters, base: the api's index
    when the step first called it), the same in both runs. With one parameter list, the foreach
    entries are the per-tensor optimizer's (`Tensor.add_.2`, fc2's update, is `Torch._foreach_add_.2`)."""

    def __init__(self, parameters, first_entry: int) -> None:
        """parameters(): each parameter with the other tensors that are its own (its state)."""
        self._parameters = parameters
        self._keys: dict[int, tuple] = {}  # id(tensor) -> (weakref, parameter position)
        self._owners: list = []  # weakref of the parameter at each position
        self.count = self._scan()
        self._bases: dict[str, int] = {}
        self._calls: dict[tuple[str, int], int] = {}
        # Where each element entry goes: the step's entries from first_entry on are put back in the
        # order one parameter list would have run them (each call in turn, the parameters in order),
        # whatever order the dtype groups ran in: the compare pairs entries in order.
        self.first_entry = first_entry
        self._slots: dict[tuple[str, int], int] = {}  # (api, n-th call on a parameter) -> its rank
        self.places: dict[int, tuple[int, int]] = {}  # id(entry) -> (slot rank, parameter)

    @classmethod
    def of_optimizer(cls, optimizer, first_entry: int) -> _ParameterTensors:
        def parameters():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    state = optimizer.state.get(parameter, {}).values()
                    yield parameter, [value for value in state if isinstance(value, torch.Tensor)]
        return cls(parameters, first_entry)

    @classmethod
    def of_modules(cls, modules, first_entry: int) -> _ParameterTensors:
        def parameters():
            for module in list(modules):
                for parameter in module._parameters.values():
                    if parameter is not None:
                        yield parameter, ()
        return cls(parameters, first_entry)

    def _scan(self) -> int:
        """Adopt every parameter, its gradient and its own tensors; the number of parameters."""
        count = 0
        for parameter, own in self._parameters():
            held = self._keys.get(id(parameter))
            if held is not None and held[0]() is parameter and held[1] < count:
                continue  # a parameter two modules share: its first position
            self.adopt(parameter, count)
            # (a scan again after the state was loaded: replay's, a checkpoint's, may hold new parameters)
            self._owners[count:count + 1] = [weakref.ref(parameter)]
            if parameter.grad is not None:
                self.adopt(parameter.grad, count)
            for tensor in own:
                self.adopt(tensor, count)
            count += 1
        return count

    def adopt(self, tensor: torch.Tensor, key: int) -> None:
        self._keys[id(tensor)] = (weakref.ref(tensor), key)

    def keys_of(self, args: tuple) -> list[int] | None:
        """The parameter of each element of a foreach call's lists, or None when one is unknown."""
        lists = [arg for arg in args if _tensor_list(arg)]
        if not lists:
            return None
        keys = self._keys_in(lists)
        if keys is None:  # the step made state since it began (Adam's exp_avg at its first step)
            self._scan()
            keys = self._keys_in(lists)
        return keys if keys is not None and len(set(keys)) == len(keys) else None

    def _keys_in(self, lists: list) -> list[int] | None:
        keys = []
        for k in range(len(lists[0])):
            found = None
            for tensors in lists:
                held = self._keys.get(id(tensors[k])) if k < len(tensors) else None
                if held is not None and held[0]() is tensors[k]:
                    found = held[1]
                    break
            if found is None:
                return None
            keys.append(found)
        return keys

    def parameter(self, key: int) -> torch.Tensor | None:
        return self._owners[key]() if key < len(self._owners) else None

    def element_name(self, api: str, key: int, counter: naming.CallCounter) -> tuple[str, tuple[int, int]]:
        """The entry name of parameter `key`'s element of this call of `api`, and its place."""
        base = self._bases.setdefault(api, counter.peek(api))
        calls = self._calls.get((api, key), 0)
        self._calls[(api, key)] = calls + 1
        index = base + calls * self.count + key
        counter.taken(api, index)
        return naming.api_entry_name(api, index), (self._slots.setdefault((api, calls), len(self._slots)), key)

    def put_in_order(self, entries: list) -> None:
        positions = [i for i in range(self.first_entry, len(entries)) if id(entries[i]) in self.places]
        ordered = sorted((entries[i] for i in positions), key=lambda entry: self.places[id(entry)])
        for position, entry in zip(positions, ordered):
            entries[position] = entry


def _tensor_list(value) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(item, torch.Tensor) for item in value)


def _element(value, k: int, count: int):
    """A foreach argument's value for the k-th element: its k-th item if it is a list (of tensors or
    of per-tensor scalars), else the argument itself (a scalar all elements share)."""
    return value[k] if isinstance(value, list | tuple) and len(value) == count else value


def hf32_ops_on() -> list[str]:
    """The fp32 op kinds the device computes in HF32 now: torch_npu's (and the emulated NPU's)
    `torch.npu.conv.allow_hf32` / `torch.npu.matmul.allow_hf32`. npu-compare judges those ops
    by HF32's limits, not fp32's."""
    npu = getattr(torch, "npu", None)
    return [kind for kind in ("conv", "matmul") if getattr(getattr(npu, kind, None), "allow_hf32", False) is True]


class DumpSession:
    """Dump per-layer statistics or tensors to `out_dir/step{S}/rank{R}/dump.json`.

    Use as a context manager around a script, or call start() / step() / stop() from a loop.
    """

    def __init__(
        self,
        out_dir: Path,
        level: str = "mix",
        mode: str = "stats",
        steps: str | None = None,
        scope: str | None = None,
        names: str | None = None,
        *,
        stack: bool = True,
        rank: int | None = None,
        ranks: str | None = None,
        tensor_format: str = "pt",
        ops: str | None = None,
        training_steps: bool = False,
    ) -> None:
        """training_steps: number steps as --monitor, --replay-step and --stop-after-step do, where a
        forward without gradients before the first optimizer step (an evaluation before training)
        starts no step; by default each such forward is a step (an inference run's steps)."""
        if level not in LEVELS:
            raise UserError(f"--dump-level: {level!r} is not one of {', '.join(LEVELS)}")
        if mode not in MODES:
            raise UserError(f"--dump-mode: {mode!r} is not one of {', '.join(MODES)}")
        if tensor_format not in TENSOR_FORMATS:
            raise UserError(f"--dump-tensor-format: {tensor_format!r} is not one of {', '.join(TENSOR_FORMATS)}")
        self.tensor_format = tensor_format
        self.out_dir = Path(out_dir)
        check_output_location(self.out_dir, "--dump")
        self.level = level
        self.mode = mode
        self.steps = parse_steps(steps)
        self.scope = tuple(
            naming.module_path_of(item) or item for item in parse_name_list(scope, "--dump-scope") or ()
        ) or None
        self.names = parse_name_list(names, "--dump-list")
        # Which apis (msprobe_config.OP_SETS): by default those msprobe records by default; under a
        # scope its whole support list (as msprobe records a scope); with a list what it names,
        # whatever msprobe hooks (--dump-list Tensor.view records the views).
        self.ops = msprobe_config.check_op_set(ops) if ops is not None \
            else "all" if self.names else "msprobe-all" if self.scope else "focus"
        self.rank = rank_from_env() if rank is None else rank
        selected_ranks = parse_steps(ranks, "--dump-ranks")
        # A rank outside the list installs nothing: its training runs at full speed.
        self.rank_selected = selected_ranks is None or self.rank in selected_ranks
        self.capture_stack = stack
        self.step_index = 0
        self.written_steps: list[int] = []
        self._modules = level in ("module", "mix")
        self._apis = level in ("api", "mix")
        self._active = False
        self._finished = False
        # of each optimizer step running, innermost last (None: a step not dumped)
        self._optimizer_tensors: list[_ParameterTensors | None] = []
        self._model_tensors: _ParameterTensors | None = None  # outside optimizer steps, made when needed
        self._paths = naming.ModulePaths()
        # running: (module, (path, entry)); inside optimizer.step (steps.paused) and once finished, none
        self._module_hooks = ModuleHooks(naming.ModuleNames(self._paths), owner=type(self).__name__,
                                         guard=unintercepted, watching=self._watching_modules,
                                         root=self._on_root_forward, enter=self._enter_module,
                                         leave=self._leave_module, with_kwargs=True)
        self._handles: list = []
        self._mode: ApiMode | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending_writes: list = []
        self._file_jobs: list = []  # tensor files to write or link, not yet handed to the writer
        self._tensor_files: TensorFileWriter | None = None  # host copies of tensors, until written
        self._record = _StepRecord()
        self._op_nodes = graph.OpNodes()
        # steps.paused > 0 inside optimizer.step(): no module entries; its apis are the optimizer's
        self._steps = RecordedSteps(lambda: self._active, self._on_auto_step_end,
                                    after_scaler_step=self._after_scaler_step,
                                    forwards_with_gradients_only=training_steps)
        self._data_dirs: dict[int, Path] = {}  # step -> its tensor data folder, once made
        self._internal_errors: list[dict] = []  # hooks switched off: every later step lacks their part

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> DumpSession:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        if self._active or not self.rank_selected:
            return
        from torch.optim import optimizer as optimizer_hooks

        refuse_links_inside(self.out_dir, "--dump")
        self._active = True
        revive_hooks(type(self).__name__)
        add_failure_listener(self._on_hook_failed)
        eager.enter("the dump", self._on_compiled_region)
        self._module_hooks.install()
        self._handles = [
            optimizer_hooks.register_optimizer_step_pre_hook(self._on_optimizer_pre_step),
            optimizer_hooks.register_optimizer_step_post_hook(self._on_optimizer_post_step),
        ]
        self._steps.install()
        # Files are written by one thread, in order, while training goes on.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npukit-dump",
                                          initializer=lower_thread_priority)
        if self._apis:
            self._mode = ApiMode(self._recording_api, self._record_api, naming.MsprobeOpNames())
            self._mode.__enter__()

    def step(self) -> None:
        """End the current step (written if selected) and start the next one."""
        self._steps.automatic = False
        self._end_step()

    def stop(self) -> None:
        """Write the step in progress (if anything was recorded) and remove every hook."""
        if not self._active:
            return
        self._active = False
        if self._mode is not None:
            self._mode.close()
            self._mode = None
        self._module_hooks.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._steps.remove()
        eager.leave(self._on_compiled_region)
        remove_failure_listener(self._on_hook_failed)
        try:
            if self._record.entries or self._record.incomplete:
                self._flush()
            self._submit_file_jobs()
            self._check_writes(wait=True)
        finally:
            self._writer.shutdown(wait=True)
            self._writer = None
            self._pending_writes = []
            self._file_jobs = []
            self._tensor_files = None  # its reusable buffers with it
        if self.steps is not None and not self.written_steps:
            selected = ", ".join(str(step) for step in sorted(self.steps)[:5]) + (" ..." if len(self.steps) > 5 else "")
            print(f"npukit: nothing dumped into {self.out_dir}: --dump-steps selected step(s) {selected}, and the "
                  f"run ended in step {self.step_index} (steps count from 0 and end at optimizer.step)",
                  file=sys.stderr)

    # ------------------------------------------------------------------ step logic
    def _step_selected(self) -> bool:
        return not self._finished and (self.steps is None or self.step_index in self.steps)

    def _recording_api(self) -> bool:
        # inside optimizer.step (paused for modules): its update ops, as msprobe records them; inside
        # GradScaler.step but outside the optimizer's: its unscaling, no op of the model
        steps = self._steps
        return (self._active and self._module_hooks.forward_seen and (steps.paused > 0 or not steps.scaler.inside)
                and self._step_selected())

    def _end_step(self) -> None:
        if self._record.entries or self._record.incomplete:
            self._flush()
        self._model_tensors = None
        self._record = _StepRecord()
        self._module_hooks.running.clear()
        self.step_index += 1
        if self.steps is not None and self.step_index > max(self.steps):
            self._finished = True

    def _on_hook_failed(self, kind: str, where: str, detail: str) -> None:
        if kind.startswith(type(self).__name__ + "."):
            self._internal_errors.append({"kind": INTERNAL_ERROR, "where": where, "detail": detail})

    @unintercepted
    def _on_compiled_region(self, name: str) -> None:
        """A torch.compile(fullgraph=True) region runs compiled: its ops are missing from this step
        (not from an optimizer step's, whose update ops are never dumped)."""
        if self._active and self._step_selected() and not self._steps.paused and not self._steps.scaler.inside:
            incomplete = self._record.incomplete
            if all(item["where"] != name for item in incomplete):
                incomplete.append({"kind": COMPILED_REGION, "where": name, "detail": eager.REGION_DETAIL})

    @unintercepted
    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        if self._modules and self._step_selected():
            self._record_parameter_grads()
        self._steps.optimizer_step_begins()
        if self._mode is not None:
            selected = self._step_selected()
            self._optimizer_tensors.append(_ParameterTensors.of_optimizer(optimizer, len(self._record.entries))
                                           if selected else None)
            if not selected:
                self._mode.lift()  # a step not dumped: each update op would pay a Python dispatch for nothing

    @unintercepted
    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        if self._mode is not None:
            self._mode.restore()
            if self._optimizer_tensors:
                tensors = self._optimizer_tensors.pop()
                if tensors is not None:
                    tensors.put_in_order(self._record.entries)
        self._steps.optimizer_step_returned()
        self._steps.end_after_optimizer_step()

    @unintercepted
    def _after_scaler_step(self, skipped: bool, scale: float) -> None:
        if skipped and self._step_selected():
            self._record.skipped_at_loss_scale = scale
            if self._modules:  # no optimizer pre-hook ran: the (unscaled, non-finite) gradients now
                self._record_parameter_grads()

    @unintercepted
    def _on_auto_step_end(self, skipped: bool, loss_scale: float | None) -> None:
        self._end_step()

    # ------------------------------------------------------------------ modules
    def _watching_modules(self) -> bool:
        return not self._finished and not self._steps.paused

    def _on_root_forward(self, module) -> None:
        self._steps.root_forward(module)  # without an optimizer, a new forward of the model may end a step

    def _enter_module(self, module, args, root: bool) -> tuple[str, _Entry | None]:
        if not self._step_selected():
            return _NOT_RECORDED
        path = self._module_hooks.path(module)
        entry = None
        selected_scope = self._in_scope(path)
        index = self._record.counter.next(f"Module.{path}.{type(module).__name__}")
        name = naming.module_entry_name(path, type(module).__name__, index)
        if self._modules and selected_scope and self._name_selected(name) and not (root and not path and _model_root(module)):
            entry = _Entry(name, self._parent_name(), self._stack_id())
            entry.data["input_args"] = self._describe(args, f"{name}.input", False)
            entry.data["input_kwargs"] = {}
            if torch.is_grad_enabled():  # a layer that changes its input in place gives it a new node
                entry.producers = graph.producers(tensors_in(args))
        return path, entry

    def _leave_module(self, module, frame: tuple[str, _Entry | None], args, kwargs, output=_RAISED) -> None:
        path, entry = frame
        # always_call: torch also calls the hook, as hook(module, args, None), when forward raised.
        if entry is None or output is _RAISED:
            return
        before, entry.producers = entry.producers, None  # nodes: not kept until the step is written
        name = entry.name
        if kwargs:
            entry.data["input_kwargs"] = {
                key: self._describe(value, f"{name}.input.{key}", False) for key, value in kwargs.items()
            }
        entry.data["output"] = self._describe_output(output, name)
        params = {
            key: self._tensor_leaf(param, f"{name}.parameters.{key}", False)
            for key, param in module._parameters.items()
            if param is not None
        }
        if params:
            entry.data["parameters"] = params
        self._record.place(entry)
        if torch.is_grad_enabled():
            self._hook_module_backward(path, type(module).__name__, name, args, kwargs, output, before)

    def _hook_module_backward(self, path, class_name, forward_name, args, kwargs, output, before=None) -> None:
        """`input`: the gradients of the module's outputs; `output`: the module's own gradient for
        each tensor argument that needs one (as msprobe's full backward hook gives it: an input
        also used outside the module, a residual, gets only the module's share)."""
        index = int(forward_name.rsplit(".", 1)[1])
        backward_name = naming.module_entry_name(path, class_name, index, naming.BACKWARD)
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if not outputs:
            return
        inputs = tensors_in((args, kwargs))
        if before is not None:  # the keyword arguments' tensors come after the positional ones
            before = before + graph.producers(inputs[len(before):])
        # `output` holds the gradients of the tensor arguments that need one, in order, as msprobe
        # 26.2 writes it: an argument without one has no place (not a null), so a module whose
        # inputs need no gradient writes "output": [].
        needing = [i for i, (_, _, requires_grad) in enumerate(before or graph.producers(inputs)) if requires_grad]
        inputs = [inputs[i] for i in needing]
        if before is not None:
            before = [before[i] for i in needing]
        record = self._record
        entry = _Entry(backward_name, None, None)
        entry.data = {"input": [None] * len(outputs), "output": [None] * len(inputs)}
        # Placed when its first input gradient is out, or, when none will be (no input needs a
        # gradient, or none was found), when its output gradients arrive.
        placed_with_outputs = [True]

        # Tensor hooks see the whole gradient of each output. They hold no tensor: a hook on a
        # tensor's grad_fn holding that tensor is a cycle that keeps every activation alive.
        def grad_output_hook(position):
            @unintercepted
            def hook(grad):
                if record is self._record:
                    entry.data["input"][position] = self._tensor_leaf(grad, f"{backward_name}.input.{position}", True)
                    if placed_with_outputs[0]:
                        record.place(entry)
            return hook

        for position, tensor in enumerate(outputs):
            tensor.register_hook(grad_output_hook(position))
        if inputs:
            nodes = graph.nodes_after(graph.newest_input_node(inputs, before), outputs, _MAX_MODULE_NODES)
            placed_with_outputs[0] = not self._hook_input_grads(record, entry, nodes, inputs, backward_name,
                                                                before=before)

    def _record_parameter_grads(self) -> None:
        for module, path in list(self._paths.items()):
            grads = {
                key: local_shard(param.grad)  # FSDP2: this rank's shard of the reduced gradient
                for key, param in module._parameters.items()
                if param is not None and param.grad is not None
            }
            if not grads or not self._in_scope(path):
                continue
            name = naming.module_params_grad_name(path, type(module).__name__)
            if not self._name_selected(name):
                continue
            entry = _Entry(name, None, None)
            # msprobe's form: a list per parameter ({"weight": [leaf]})
            entry.data = {key: [self._tensor_leaf(grad, f"{name}.{key}", False)] for key, grad in grads.items()}
            self._record.place(entry)

    # ------------------------------------------------------------------ apis
    def _record_api(self, api: str, func, args, kwargs):
        # a left-out api that merges values of several recorded ops (torch.stack of a step's values)
        # is recorded: one producer link cannot say where its output came from
        if not msprobe_config.api_recorded(self.ops, api) and not self._merges_recorded(args, kwargs):
            return self._pass_through(api, func, args, kwargs)
        if naming.foreach_op(api):
            tensors = self._parameter_tensors()
            keys = tensors.keys_of(args) if tensors is not None else None
            if keys is not None:
                return self._record_foreach(api, func, args, kwargs, tensors, keys)
        record = self._record
        index = record.counter.next(api)
        name = naming.api_entry_name(api, index)
        running = self._module_hooks.running
        path = running[-1][1][0] if running else ""
        if not (self._in_scope(path) and self._name_selected(name)):
            return func(*args, **kwargs)
        in_place = naming.writes_its_input(api, args, kwargs)
        entry = _Entry(name, OPTIMIZER if self._steps.paused else self._parent_name(), self._stack_id())
        uninitialized_output = api in naming.UNINITIALIZED_OUTPUT
        # a resize_ that does not grow keeps initialized elements: its size before tells
        numel_before = args[0].numel() if uninitialized_output and in_place and args \
            and isinstance(args[0], torch.Tensor) else 0
        before = None
        if in_place:  # measure inputs before the op overwrites them
            if torch.is_grad_enabled():  # and see where they came from: the op gives them new nodes
                before = graph.producers(tensors_in((args, kwargs)))
            written_args, written_kwargs = naming.caller_arguments(api, args, kwargs)
            entry.data["input_args"] = self._describe(written_args, f"{name}.input", False)
            entry.data["input_kwargs"] = self._describe_kwargs(written_kwargs, name)
            if api in naming.OVERWRITES_FIRST_INPUT and entry.data["input_args"] \
                    and isinstance(entry.data["input_args"][0], dict):
                entry.data["input_args"][0][naming.UNINITIALIZED] = True
        output = func(*args, **kwargs)
        ran_with = rewritten_arguments()
        # an in-place foreach op returns None: what it wrote is its first list (`output.k` its k-th tensor)
        written = args[0] if output is None and in_place and args and naming.foreach_op(api) else output
        out_tensors = tensors_in(written)
        if not out_tensors:
            return output
        if not in_place:
            written_args, written_kwargs = naming.caller_arguments(api, args, kwargs)
            entry.data["input_args"] = self._describe(written_args, f"{name}.input", False)
            entry.data["input_kwargs"] = self._describe_kwargs(written_kwargs, name)
        if ran_with is not None:  # a precision fix below ran it with other numbers (finite_fill): those
            ran_args, ran_kwargs = naming.caller_arguments(api, *ran_with)
            entry.data["input_args"] = _numbers_as_run(entry.data["input_args"], ran_args)
            entry.data["input_kwargs"] = {key: _numbers_as_run(value, ran_kwargs.get(key))
                                          for key, value in entry.data["input_kwargs"].items()}
        if uninitialized_output and not (in_place and out_tensors[0].numel() <= numel_before):
            for tensor in out_tensors:
                record.uninitialized[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor))
        same_as = args[0] if api in _SAME_ELEMENTS and args and isinstance(args[0], torch.Tensor) else None
        if same_as is not None and isinstance(output, torch.Tensor) and output.numel() == same_as.numel():
            entry.data["output"] = [self._tensor_leaf(output, f"{name}.output.0", True, same_values_as=same_as)]
        else:
            entry.data["output"] = self._describe_output(written, name)
        record.place(entry)
        if torch.is_grad_enabled():
            self._hook_api_backward(api, index, args, kwargs, out_tensors, before)
        return output

    def _parameter_tensors(self) -> _ParameterTensors | None:
        if self._steps.paused:
            return self._optimizer_tensors[-1] if self._optimizer_tensors else None
        if self._model_tensors is None:
            self._model_tensors = _ParameterTensors.of_modules(self._paths, len(self._record.entries))
        return self._model_tensors

    def _record_foreach(self, api: str, func, args, kwargs, tensors: _ParameterTensors, keys: list[int]):
        """A foreach call on parameters' tensors, an entry per element (see _ParameterTensors): inputs
        measured before the op writes them, the op run once as called."""
        record = self._record
        stack_id = self._stack_id()
        count = len(keys)
        entries: list[_Entry | None] = []
        # under --dump-scope, the elements of the parameters of the modules in it (an optimizer's step
        # runs in no module: its per-tensor ops are left out, its foreach ops kept for those parameters)
        scoped = self._parameter_paths() if self.scope is not None else None
        for k, key in enumerate(keys):
            name, place = tensors.element_name(api, key, record.counter)
            if scoped is not None and not self._in_scope(scoped.get(id(tensors.parameter(key)), "\0")):
                entries.append(None)
                continue
            if not self._name_selected(name):
                entries.append(None)
                continue
            entry = _Entry(name, OPTIMIZER, stack_id)
            tensors.places[id(entry)] = place
            entry.data["input_args"] = self._describe(tuple(_element(arg, k, count) for arg in args),
                                                      f"{name}.input", False)
            entry.data["input_kwargs"] = self._describe_kwargs({key_: _element(value, k, count)
                                                                for key_, value in kwargs.items()}, name)
            entries.append(entry)
        output = func(*args, **kwargs)
        written = args[0] if output is None else output  # an in-place foreach op returns None
        for k, (key, entry) in enumerate(zip(keys, entries)):
            value = _element(written, k, count)
            if isinstance(value, torch.Tensor):
                tensors.adopt(value, key)  # computed from parameter k's tensors: k's too
            if entry is not None:
                entry.data["output"] = self._describe_output(value, entry.name)
                record.place(entry)
        return output

    def _parameter_paths(self) -> dict[int, str]:
        """id(parameter) -> the path of its module, for the modules seen."""
        return {id(parameter): path for module, path in list(self._paths.items())
                for parameter in module._parameters.values() if parameter is not None}

    def _pass_through(self, api: str, func, args, kwargs):
        """Run an api the op set leaves out. Its outputs carry where its (first) input was recorded:
        the op that uses them names that producer, as if the left-out op were not there."""
        inputs = tensors_in((args, kwargs))
        if api in naming.OVERWRITES_FIRST_INPUT:
            inputs = inputs[1:]  # x.copy_(y) holds y's values
        if api.endswith("_like") or api.startswith("Tensor.new_"):
            inputs = []  # a new tensor of that shape: not its values
        origin = next((found for found in map(self._recorded_as, inputs) if found is not None), None)
        in_place = api in naming.UNINITIALIZED_OUTPUT and naming.writes_its_input(api, args, kwargs)
        numel_before = args[0].numel() if in_place and isinstance(args[0], torch.Tensor) else 0
        output = func(*args, **kwargs)
        for tensor in tensors_in(output):
            try:
                if origin is not None:
                    self._record.carried[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor), origin)
                # torch.empty_like's memory (or a growing resize_'s): still marked where an op reads it
                if api in naming.UNINITIALIZED_OUTPUT and not (in_place and tensor.numel() <= numel_before):
                    self._record.uninitialized[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor))
            except TypeError:
                pass
        return output

    def _merges_recorded(self, args, kwargs) -> bool:
        origins = {self._recorded_as(tensor) for tensor in tensors_in((args, kwargs))}
        origins.discard(None)
        return len(origins) > 1

    def _recorded_as(self, tensor: torch.Tensor) -> str | None:
        """The leaf that first recorded this tensor's present value (directly or carried through
        left-out apis), or None."""
        version = tensor_version(tensor)
        for table, position in ((self._record.seen, 3), (self._record.carried, 2)):
            found = table.get(id(tensor))
            if found is not None and found[0]() is tensor and found[1] == version:
                return found[position]
        return None

    def _hook_api_backward(self, api, index, args, kwargs, out_tensors, before=None) -> None:
        """One backward entry per api call, whatever autograd nodes it made (which can differ
        between a golden and an NPU run: another kernel, another graph): `input` the gradients
        arriving at its outputs, `output` its gradient for each tensor argument."""
        inputs = tensors_in((args, kwargs))
        nodes = self._op_nodes.created(inputs, out_tensors, before)
        if not nodes:
            return
        created = {id(node) for node in nodes}
        output_nodes: list = []
        for tensor in out_tensors:
            node = tensor.grad_fn
            if node is not None and id(node) in created and all(node is not seen for seen in output_nodes):
                output_nodes.append(node)
        record = self._record
        name = naming.api_entry_name(api, index, naming.BACKWARD)
        entry = _Entry(name, None, None)
        entry.data = {"input": [], "output": [None] * len(inputs)}

        @unintercepted
        def incoming(grad_outputs):
            if record is self._record:
                first = len(entry.data["input"])
                entry.data["input"] += [self._grad_leaf(g, f"{name}.input.{first + i}")
                                        for i, g in enumerate(grad_outputs)]
                record.place(entry)

        one_node = len(nodes) == 1
        if not one_node:
            for node in output_nodes:
                node.register_prehook(incoming)
        reshapes = api in _SAME_ELEMENTS and one_node and len(inputs) == 1
        # One node (most calls): its one hook also takes the incoming gradients, and its gradients
        # are numbered as msprobe numbers them (by the node's edges).
        self._hook_input_grads(record, entry, nodes, inputs, name, reshapes, incoming if one_node else None, before,
                               by_edge=one_node)

    def _hook_input_grads(self, record: _StepRecord, entry: _Entry, nodes: list, inputs: list, name: str,
                          reshapes: bool = False, incoming=None, before=None, by_edge: bool = False) -> bool:
        """Fill entry's `output.i` with the gradient for inputs[i] that leaves `nodes` (summed over
        the edges that carry it); place the entry when the first one arrives. False when no
        edge was found (nothing hooked).

        reshapes: one node that only reorders its input's elements; its gradient's statistics are
        those of the incoming gradient. incoming: for a one-node call, called first with the
        node's incoming gradients. by_edge: (one node) where the node's edges are not the tensor
        arguments in order (batch_norm's node has none for the running statistics,
        embedding's none for the indices), `output.i` is the gradient leaving edge i, as msprobe
        numbers them, and the dump's ARGUMENTS says whose it is."""
        edges = graph.input_edges(nodes, inputs, before)
        slot = {}  # input position -> its place in `output`, where that is not the position
        if by_edge and edges:
            [pairs] = edges.values()
            if len({edge for edge, _ in pairs}) == len({position for _, position in pairs}) == len(pairs) \
                    and any(edge != position for edge, position in pairs):
                slot = {position: edge for edge, position in pairs}
                entry.data["output"] = [None] * len(nodes[0].next_functions)
                arguments = record.arguments[name] = [None] * len(nodes[0].next_functions)
                for edge, position in pairs:
                    arguments[edge] = position
        if incoming is not None:
            edges.setdefault(0, [])
        expected: dict[int, int] = {}
        for pairs in edges.values():
            for _, position in pairs:
                expected[position] = expected.get(position, 0) + 1
        arrived: dict[int, list] = {}  # position -> [gradients so far]; summed once all are in
        # A gradient taken where it enters a weight's cast is in the cast's dtype; autograd hands
        # the weight its own dtype.
        dtypes = [tensor.dtype for tensor in inputs]

        # The hooks hold neither nodes nor tensors of the graph: a node's hook holding that node
        # is a cycle that keeps the graph alive.
        def outgoing(pairs):
            @unintercepted
            def hook(grad_inputs, grad_outputs):
                if record is not self._record:
                    return
                if incoming is not None:
                    incoming(grad_outputs)
                record.place(entry)
                for edge, position in pairs:
                    grads = arrived.setdefault(position, [])
                    grads.append(grad_inputs[edge])
                    if len(grads) < expected[position]:
                        continue
                    del arrived[position]
                    present = [g for g in grads if isinstance(g, torch.Tensor)]
                    if not present:
                        continue
                    grad = present[0]
                    for more in present[1:]:  # the hook runs with torch-function handling off
                        grad = grad + more
                    if grad.dtype != dtypes[position] and grad.is_floating_point():
                        grad = grad.to(dtypes[position])
                    arriving = grad_outputs[0] if len(grad_outputs) == 1 else None
                    reuse = reshapes and isinstance(arriving, torch.Tensor) and arriving.numel() == grad.numel()
                    place = slot.get(position, position)
                    entry.data["output"][place] = self._tensor_leaf(
                        grad, f"{name}.output.{place}", True, same_values_as=arriving if reuse else None)
            return hook

        for node_index, pairs in edges.items():
            nodes[node_index].register_hook(outgoing(pairs))
        return bool(edges)

    def _grad_leaf(self, grad, leaf_name):
        return self._tensor_leaf(grad, leaf_name, True) if isinstance(grad, torch.Tensor) else None

    # ------------------------------------------------------------------ leaves
    def _describe_kwargs(self, kwargs: dict, name: str) -> dict:
        return {key: self._describe(value, f"{name}.input.{key}", False) for key, value in kwargs.items()}

    def _describe(self, value, leaf_name: str, is_output: bool):
        if isinstance(value, torch.Tensor):
            if value.is_nested:  # no single shape, no statistics: described, not measured
                return {"type": "torch.Tensor", "layout": "nested", "dtype": str(value.dtype)}
            return self._tensor_leaf(value, leaf_name, is_output)
        if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
            return [self._describe(item, f"{leaf_name}.{i}", is_output) for i, item in enumerate(value)]
        if isinstance(value, dict):
            return {key: self._describe(item, f"{leaf_name}.{key}", is_output) for key, item in value.items()}
        return describe_value(value)

    def _describe_output(self, output, name: str) -> list:
        """msprobe's `output` is always a list: a single tensor is `output.0`."""
        if isinstance(output, list | tuple) and not isinstance(output, torch.Size):
            return self._describe(output, f"{name}.output", True)
        return [self._describe(output, f"{name}.output.0", True)]

    def _tensor_leaf(self, tensor: torch.Tensor, leaf_name: str, is_output: bool,
                     same_values_as: torch.Tensor | None = None) -> dict:
        """dump.json leaf of one tensor; statistics (and data) are taken once per tensor version.

        same_values_as: a tensor holding the same elements (the input of a reshape): its statistics
        are reused.
        """
        tensor = local_shard(tensor)  # a DTensor is dumped as this rank's shard: shape, statistics, data
        if same_values_as is not None:
            same_values_as = local_shard(same_values_as)
        record = self._record
        key = id(tensor)
        version = tensor_version(tensor)
        seen = record.seen.get(key)
        if seen is not None and seen[0]() is tensor and seen[1] == version:
            # Already recorded: reuse its statistics and data, and point at where it was first seen
            # (the op that produced it, or the earlier input it is passed through from).
            _, _, slot, producer, data_name = seen
            if self.mode == "tensor" and self.tensor_format == "pt":
                # msprobe compare pairs rows by data file: a leaf sharing another's file is listed
                # once per sharer (752 rows for 234 names). As msprobe writes them: a file per leaf.
                data_name = self._write_data(tensor, leaf_name, same_as=data_name)
        else:
            slot = self._slot_of(same_values_as) if same_values_as is not None else None
            if slot is None:
                slot = record.stats.add(tensor)
            producer = leaf_name
            if not is_output:
                carried = self._record.carried.get(key)
                if carried is not None and carried[0]() is tensor and carried[1] == version:
                    producer = carried[2]
            data_name = self._write_data(tensor, leaf_name) if self.mode == "tensor" else None
            try:
                record.seen[key] = (weakref.ref(tensor), version, slot, producer, data_name)
            except TypeError:
                pass
        leaf = {
            "type": "torch.Tensor",
            "dtype": str(tensor.dtype),
            "shape": list(tensor.shape),
            "requires_grad": tensor.requires_grad,
        }
        if data_name is not None:
            leaf["data_name"] = data_name
        garbage = record.uninitialized.get(key)
        if garbage is not None and garbage[0]() is tensor and garbage[1] == version:
            leaf[naming.UNINITIALIZED] = True
        if not is_output and producer != leaf_name:
            leaf["producer"] = producer
        if self.mode == "md5":
            leaf["md5"] = f"{zlib.crc32(tensor_to_numpy(tensor).tobytes()):08x}"
        record.leaves.append((leaf, slot))
        return leaf

    def _slot_of(self, tensor: torch.Tensor) -> int | None:
        seen = self._record.seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor_version(tensor):
            return seen[2]
        return None

    def _write_data(self, tensor: torch.Tensor, leaf_name: str, same_as: str | None = None) -> str:
        """Name of the leaf's data file, written by the writer thread. same_as: the file of this
        tensor's same value in this step, whose bytes the new file shares (a hard link)."""
        data_name = f"{leaf_name}.{self.tensor_format}"
        directory = self._data_dirs.get(self.step_index)
        if directory is None:
            directory = output_folder(self.out_dir, f"step{self.step_index}", f"rank{self.rank}", TENSOR_DATA_DIR)
            self._data_dirs = {self.step_index: directory}
        if self._tensor_files is None:
            self._tensor_files = TensorFileWriter()
        files = self._tensor_files
        if same_as is not None:
            self._file_jobs.append((files.link, directory / data_name, directory / same_as))
        else:  # copied now: the tensor may be changed in place before the writer thread runs
            copied = files.copy(tensor, before_waiting=self._submit_file_jobs)
            self._file_jobs.append((files.write, directory / data_name, copied))
        if len(self._file_jobs) >= _FILE_JOBS_PER_TASK:
            self._submit_file_jobs()
        return data_name

    def _submit_file_jobs(self) -> None:
        """Hand the writer thread the file jobs gathered so far, as one task: a task per file cost
        the training thread more than the files' links."""
        if self._file_jobs:
            jobs, self._file_jobs = self._file_jobs, []
            self._pending_writes.append(self._writer.submit(_run_jobs, jobs))

    # ------------------------------------------------------------------ filters, context
    def _in_scope(self, path: str) -> bool:
        if self.scope is None:
            return True
        return any(path == item or path.startswith(item + ".") for item in self.scope)

    def _name_selected(self, name: str) -> bool:
        return self.names is None or any(naming.name_matches(item, name) for item in self.names)

    def _parent_name(self) -> str | None:
        for _, (_, entry) in reversed(self._module_hooks.running):
            if entry is not None:
                return entry.name
        return None

    def _stack_id(self) -> int | None:
        return self._record.stacks.capture(3) if self.capture_stack else None

    # ------------------------------------------------------------------ writing
    def _flush(self) -> None:
        """Resolve the step's statistics here (one device sync); put them in the leaves and write
        the files in the writer thread while the next step runs."""
        record = self._record
        if self._model_tensors is not None:
            self._model_tensors.put_in_order(record.entries)
        record.incomplete = self._internal_errors + record.incomplete
        record.stats.resolve()
        self._submit_file_jobs()
        self._check_writes(wait=False)
        tensor_writes, self._pending_writes = self._pending_writes, []
        self._pending_writes.append(self._writer.submit(self._write_step, record, self.step_index, tensor_writes))
        self.written_steps.append(self.step_index)

    def _check_writes(self, wait: bool) -> None:
        """Raise the first error of a finished write (of all writes, with wait)."""
        for future in self._pending_writes:
            if wait or future.done():
                future.result()
        self._pending_writes = [future for future in self._pending_writes if not future.done()]

    def _write_step(self, record: _StepRecord, step: int, tensor_writes: list) -> None:
        for future in tensor_writes:  # done already (one writer thread, in order); their errors stop us
            future.result()
        values = record.stats.resolve()  # resolved by _flush: only host floats here
        for leaf, slot in record.leaves:
            fill_stats(leaf, values[slot])
        rank_dir = output_folder(self.out_dir, f"step{step}", f"rank{self.rank}")
        dump = {
            "task": _TASK_NAMES[self.mode],
            "level": _LEVEL_NAMES[self.level],
            "framework": "pytorch",
            "dump_data_dir": str((rank_dir / TENSOR_DATA_DIR).absolute()) if self.mode == "tensor" else None,
            "data": {entry.name: entry.data for entry in record.entries},
        }
        dump[DUMPED_BY] = "npukit"  # npukit's own keys; msprobe ignores them
        dump[HF32_OPS] = hf32_ops_on()
        if record.skipped_at_loss_scale is not None:
            dump["step_skipped_by_grad_scaler"] = {"loss_scale": record.skipped_at_loss_scale}
        if record.incomplete:
            dump[INCOMPLETE] = record.incomplete
        written = {entry.name for entry in record.entries}
        arguments = {name: positions for name, positions in record.arguments.items() if name in written}
        if arguments:
            dump[ARGUMENTS] = arguments
        grouped: dict[int, list[str]] = {}
        for entry in record.entries:
            if entry.stack_id is not None:
                grouped.setdefault(entry.stack_id, []).append(entry.name)
        stack = {  # msprobe's stack.json: {index: [entry names, ["File f, line n, in g, \n source", ...]]}
            str(i): [names, [f"File {file}, line {line}, in {function}, \n {source}"
                             for file, line, function, source in record.stacks.frames(stack_id)]]
            for i, (stack_id, names) in enumerate(grouped.items())
        }
        write_json(rank_dir / "dump.json", dump)
        write_json(rank_dir / "stack.json", stack)
        write_json(rank_dir / "construct.json", _construct(record.entries))


_FILE_JOBS_PER_TASK = 64


def _numbers_as_run(described, value):
    """An argument's description with its numbers as `value` (the argument the op ran with) has them;
    its tensors as described (the values the caller passed)."""
    if isinstance(value, bool | int | float) and isinstance(described, dict) and "value" in described:
        return describe_value(value)
    if isinstance(value, list | tuple) and isinstance(described, list) and len(value) == len(described):
        return [_numbers_as_run(item, other) for item, other in zip(described, value)]
    if isinstance(value, dict) and isinstance(described, dict) and "type" not in described:
        return {key: _numbers_as_run(item, value.get(key)) for key, item in described.items()}
    return described


def _run_jobs(jobs: list) -> None:
    for function, *arguments in jobs:
        function(*arguments)


def _model_root(module: torch.nn.Module) -> bool:
    """A root module (at the top of the module paths: not a block of an nn.ModuleList that the
    script calls itself) that is a model: its forward runs modules of its own, whose entries say what
    it does (msprobe records the modules below the model it is given, not the model). A root
    without submodules (a bare nn.Linear) or whose forward runs compiled (nothing below it is
    seen) is not: its entry is all there is of it."""
    if next(module.children(), None) is None:
        return False
    return not (hasattr(module.forward, "_torchdynamo_orig_callable")
                or getattr(module, "_compiled_call_impl", None) is not None)


def _construct(entries: list[_Entry]) -> dict[str, str | None]:
    """msprobe's construct.json: each forward and backward entry -> the module entry it ran in (a
    backward entry: that module's backward entry, when it has one), None at the top; an
    optimizer's apis -> "optimizer" (itself at the top)."""
    names = {entry.name for entry in entries}
    parents = {entry.name: entry.parent for entry in entries if naming.split_entry_name(entry.name)[1] == naming.FORWARD}
    construct: dict[str, str | None] = {}
    for entry in entries:
        direction = naming.split_entry_name(entry.name)[1]
        if entry.parent == OPTIMIZER:
            construct.setdefault(OPTIMIZER, None)
            construct[entry.name] = OPTIMIZER
        elif direction == naming.FORWARD:
            construct[entry.name] = entry.parent
        elif direction == naming.BACKWARD:
            forward = naming.with_direction(entry.name, naming.FORWARD)
            parent = parents.get(forward)
            backward_parent = naming.with_direction(parent, naming.BACKWARD) if parent else None
            construct[entry.name] = backward_parent if backward_parent in names else None
    return construct
