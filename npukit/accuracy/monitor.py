"""`npu-run --monitor DIR`: per-step statistics of every module of a training run, and alerts.

    with MonitorSession(Path("mon"), every=1, modules=r"blocks\\.\\d+\\.mlp"):
        runpy.run_path("train.py", run_name="__main__")

Every monitored step (numbered by watch.steps.RunSteps: steps end where the profiler's do, at the
first optimizer's step or GradScaler's; without an optimizer, as the first root module starts a new
forward with gradients), for each module the filter keeps: the
statistics (max, min, mean, norm, nan and inf counts) of its outputs in forwards that record
gradients (`activation`; an evaluation forward is not the step's) and of their gradients
(`activation_grad`, unscaled by GradScaler's scale), of its parameters (`weight`) and their
gradients (`grad`, as the optimizer sees them), and under Adam/AdamW of exp_avg, exp_avg_sq and
the update-to-weight ratio (the norm of lr x m^ / (sqrt(v^) + eps), weight decay left out, over
the norm of the weight before the update); per step the loss (the tensor backward() was first
called on, unscaled), the total gradient norm and GradScaler's loss scale.

Statistics are computed on the tensor's device as the dump computes them (one pass on host memory)
and fetched with one device->host copy per step (watch.tensor_stats.StatsBuffer). A writer thread appends
them to DIR/rank{R}/monitor.csv, scalars.csv and a TensorBoard event file as the run goes; at most
two steps wait for it, so memory stays bounded however long the run. Alerts (monitor_alerts) are
printed once each and appended to DIR/rank{R}/alerts.csv.

The monitor never fails the run: an error inside it is reported once, the monitor switches itself
off, and training goes on.
"""

from __future__ import annotations

import csv
import io
import math
import operator
import re
import sys
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from npukit.accuracy import eager, naming
from npukit.accuracy.event_file import ScalarEventFile, SummaryLayout
from npukit.accuracy.monitor_alerts import Alert, AlertRules, Alerts, Record
from npukit.errors import UserError
from npukit.files import check_output_location, output_folder, refuse_links_inside
from npukit.watch._tensor_stats import adam_host_stats, csv_rows, host_stats, record_host_stats
from npukit.watch.hook_guard import hook_failed
from npukit.watch.module_hooks import ModuleHooks
from npukit.watch.process import npu_in_host_memory, rank_from_env
from npukit.watch.steps import RunSteps
from npukit.watch.tensor_stats import StatsBuffer
from npukit.watch.tensors import local_shard, tensors_in

no_torch_function = torch._C.DisableTorchFunction  # a hook's own tensor reads skip any mode
STAT_NAMES = ("max", "min", "mean", "norm", "nan", "inf")  # tensor_stats' order
RECORD_COLUMNS = ("step", "kind", "name", "dtype", *STAT_NAMES)
SCALAR_COLUMNS = ("step", "loss", "grad_norm", "loss_scale", "skipped_by_grad_scaler")
ALERT_COLUMNS = ("step", "rule", "name", "statistic", "value", "message")
_FILES = ("monitor.csv", "scalars.csv", "alerts.csv")
_PENDING_STEPS = 2  # steps handed to the writer and not yet written, at most


class MonitorSession:
    """out_dir/rank{R}/: monitor.csv (a row per record), scalars.csv (a row per step), alerts.csv,
    events.out.tfevents.* (TensorBoard: `{kind}/{name}/{statistic}` and `loss`, `grad_norm`,
    `loss_scale`). every: monitor steps 0, N, 2N ... (from start_step); modules: a regular
    expression a module's dotted path must contain (re.search)."""

    def __init__(self, out_dir: Path, every: int = 1, modules: str | None = None, *, start_step: int = 0,
                 rank: int | None = None, rules: AlertRules | None = None, tensorboard: bool = True,
                 csv_files: bool = True) -> None:
        if every < 1:
            raise UserError(f"--monitor-every must be at least 1, got {every}")
        if start_step < 0:
            raise UserError(f"--monitor: start_step must be 0 or more, got {start_step}")
        try:
            self.module_filter = re.compile(modules) if modules else None
        except re.error as exc:
            raise UserError(f"--monitor-modules {modules!r} is not a regular expression: {exc}") from None
        self.out_dir = Path(out_dir)
        check_output_location(self.out_dir, "--monitor")
        self.every, self.start_step = every, start_step
        self.rank = rank_from_env() if rank is None else rank
        self.alerts = Alerts(rules)
        self.tensorboard, self.csv_files = tensorboard, csv_files
        self.step_index = 0
        self.raised: list[Alert] = []
        self.broken = False
        self._active = False
        self._in_optimizer = 0
        self._ending: tuple | None = None  # (_StepRecord, skipped, loss_scale): see _end_training_step
        self._several_optimizers: bool | None = None  # None: not known before the second step begins
        # the step count; told of root forwards by the module hooks, which pass over compile wrappers
        self._steps = RunSteps(self._guarded(self._on_step_end), watch_forwards=False)
        self._paths = naming.ModulePaths()
        # every module forward is on its stack (also inside optimizer.step): named from the outermost
        self._module_hooks = ModuleHooks(naming.ModuleNames(self._paths), owner=type(self).__name__,
                                         guard=self._guarded, root=self._on_root_forward,
                                         leave=self._on_module_forward)
        self._kept: dict[str, bool] = {}  # module path -> the filter keeps it
        self._module_names: dict[int, tuple[weakref.ref, str, bool]] = {}  # id(module) -> (it, path, kept)
        # id(parameter) -> (a weak reference to it, its name, its module's path): tensors compare by
        # value, so no WeakKeyDictionary
        self._parameter_names: dict[int, tuple[weakref.ref, str, str]] = {}
        # id(optimizer) -> (it, its groups and parameters in order, what _parameters returns for them)
        self._optimizer_parameters: dict[int, tuple[weakref.ref, list, list]] = {}
        self._handles: list = []
        self._local_gradient_hooks: dict[int, tuple[weakref.ref, object]] = {}  # id(parameter) -> (it, handle)
        self._many_ranks = False  # a process group of more than one rank exists (found once)
        self._original_backward = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._files: dict = {}
        self._layout: _StepLayout | None = None  # the writer thread's
        self._new_step()

    # ------------------------------------------------------------------ session
    def __enter__(self) -> MonitorSession:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        from torch.optim import optimizer as optimizer_hooks

        refuse_links_inside(self.out_dir, "--monitor", depth=1)
        self.directory = output_folder(self.out_dir, f"rank{self.rank}")
        # An earlier run's files would be read as this run's (its alerts.csv, its TensorBoard points)
        for old in [*self.directory.glob("events.out.tfevents.*"), *(self.directory / name for name in _FILES)]:
            old.unlink(missing_ok=True)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npukit-monitor")
        # Dynamo cannot trace through global module hooks: compiled models run eagerly while the
        # monitor watches (a notice says so), fullgraph regions compiled and unseen, as under the dump
        eager.enter("the monitor")
        self._module_hooks.install()
        self._handles = [
            optimizer_hooks.register_optimizer_step_pre_hook(self._guarded(self._on_optimizer_pre_step)),
            optimizer_hooks.register_optimizer_step_post_hook(self._guarded(self._on_optimizer_post_step)),
        ]
        self._steps.install()
        self._original_backward = torch.Tensor.backward
        original, on_backward = self._original_backward, self._guarded(self._on_backward)

        def backward(tensor, *args, **kwargs):
            on_backward(tensor)
            return original(tensor, *args, **kwargs)

        torch.Tensor.backward = backward
        self._active = True

    def stop(self) -> None:
        if not self._active:
            return
        torch.Tensor.backward = self._original_backward
        self._module_hooks.remove()
        for handle in [*self._handles, *(handle for _, handle in self._local_gradient_hooks.values())]:
            handle.remove()
        self._handles = []
        self._local_gradient_hooks = {}
        self._steps.remove()
        eager.leave()
        if self._ending is not None and not self.broken:
            self._guarded(self._finish_ending)()
        if self._step.used and not self.broken:  # a run without optimizer.step, or its last forward
            self._guarded(self._finish_step)(None, False, None)
        self._active = False
        try:
            for future in self._pending:
                self._report_write_error(future)
        finally:
            self._writer.shutdown(wait=True)
            for file in self._files.values():
                file.close()
            self._files = {}

    # ------------------------------------------------------------------ robustness
    def _guarded(self, hook, kind: str | None = None):
        """The hook, or nothing once the monitor broke; an error inside it is said once (hook_failed),
        switches the whole monitor off (a half-recorded step would mislead) and never reaches the run."""
        kind = kind or f"MonitorSession.{hook.__name__}"

        def run(*args, **kwargs):
            if self.broken:
                return None
            try:
                with no_torch_function():
                    return hook(*args, **kwargs)
            except Exception as exc:
                self._stop_after(kind, exc)
                return None
        return run

    def _stop_after(self, kind: str, exc: Exception) -> None:
        self.broken = True
        hook_failed(kind, exc)
        print(f"npukit monitor: monitoring stopped at step {self.step_index}; what was written before "
              f"stays in {self.out_dir}", file=sys.stderr)

    def _watch_activation_grad(self, tensor: torch.Tensor, leaf: _Leaf) -> None:
        """The output's gradient measured as backward makes it. The hook runs cache-cold once per output
        per step: it is one closure (no partial and _guarded layers), put into the tensor's hook dict
        as Tensor.register_hook does, without the RemovableHandle nobody removes (the output dies with
        the step); keyed by its leaf, unique, so it never takes a handle's integer id."""
        def on_gradient(gradient):
            if self.broken:
                return None
            try:
                with no_torch_function():
                    self._on_activation_grad(leaf, gradient)
            except Exception as exc:
                self._stop_after("MonitorSession._on_activation_grad", exc)
            return None

        hooks = tensor._backward_hooks
        if hooks is None:
            hooks = tensor._backward_hooks = OrderedDict()  # torch's type: a handle takes a weak reference to it
            if tensor.grad_fn is not None:
                tensor.grad_fn._register_hook_dict(tensor)
        hooks[leaf] = on_gradient

    # ------------------------------------------------------------------ recording
    def _new_step(self) -> None:
        self._npu_in_host_memory = npu_in_host_memory()  # asked once a step, not in each hook
        self._buffer = StatsBuffer()
        self._step = _StepRecord(self.step_index)

    def _monitored(self) -> bool:
        """The step being recorded is monitored (or, with several optimizers, the one whose end waits
        for the other optimizers' steps)."""
        if not self._active:
            return False
        step = self.step_index - self.start_step  # _is_monitored, inline: asked in every hook
        if step >= 0 and step % self.every == 0:
            return True
        ending = self._ending
        return ending is not None and self._is_monitored(ending[0].step)

    def _is_monitored(self, step: int) -> bool:
        step -= self.start_step
        return step >= 0 and step % self.every == 0

    def _keeps(self, path: str) -> bool:
        kept = self._kept.get(path)
        if kept is None:
            kept = self._kept[path] = self.module_filter is None or bool(self.module_filter.search(path))
        return kept

    def _add(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        # The same tensor seen twice in a step (a Sequential's output is its last layer's; a residual
        # add hands one gradient to both branches) is measured once, unless changed in place since.
        # By identity, not by address: a freed tensor's memory is reused within the step.
        record = self._step
        # hooks run cache-cold: a plain float host tensor is looked up, measured and recorded in one
        # C++ call, its fields read there, its statistics the slot themselves (nothing to fetch); any
        # other tensor (another device or dtype, nan/inf) is asked what it is first, below
        if record_host_stats(record.measured, record.slots, kind, name, tensor, self._npu_in_host_memory):
            record.used = True
            return
        key, version = id(tensor), tensor._version
        seen = record.measured.get(key)
        if seen is not None and seen[0]() is tensor and seen[1] == version:
            slot = seen[2]
        else:
            if not tensor.is_floating_point() or tensor.numel() == 0:
                return
            slot = self._buffer.add(tensor)
            record.measured[key] = (weakref.ref(tensor), version, slot)
        record.used = True
        record.slots.append((kind, name, tensor.dtype, slot))

    def _on_root_forward(self, module) -> None:
        self._distributed()  # asked once per root forward (a process group made since is seen)
        # before the first optimizer step, a new forward with gradients may end a step (RunSteps)
        self._steps.root_forward(module)

    def _on_module_forward(self, module, frame, args, output) -> None:
        # evaluation forwards (no gradient) are not the training step's
        if self._in_optimizer or not torch.is_grad_enabled() or not self._monitored():
            return
        # named as the dump names it: from the outermost running module; a module with nothing
        # above it running (a layer called outside its model's forward) by its owner's attribute path
        named = self._module_names.get(id(module))
        if named is None or named[0]() is not module:
            path = self._module_hooks.path(module) or type(module).__name__
            names, key = self._module_names, id(module)
            # a module's path, once given, is its own: looked up once (dropped with the module)
            named = names[key] = (weakref.ref(module, lambda _: names.pop(key, None)), path, self._keeps(path))
        _, path, kept = named
        if not kept:
            return
        record = self._step
        calls = record.calls.get(path, 0)
        record.calls[path] = calls + 1
        if self._many_ranks:
            self._watch_local_gradients(module, path)
        if type(output) is torch.Tensor:  # most modules: one plain tensor, no nested walk
            outputs = [output] if output.is_floating_point() else []
        else:
            outputs = [t for t in tensors_in(output) if t.is_floating_point()]
        for index, tensor in enumerate(outputs):
            leaf = _Leaf(path, calls, "" if len(outputs) == 1 else f".{index}")
            record.leaves.append(leaf)
            self._add("activation", leaf, tensor)
            if tensor.requires_grad:  # grad mode is on: checked above
                self._watch_activation_grad(tensor, leaf)

    def _on_activation_grad(self, leaf: _Leaf, gradient) -> None:
        if gradient is not None and self._monitored():
            self._add("activation_grad", leaf, gradient)

    def _distributed(self) -> bool:
        if not self._many_ranks:
            distributed = torch.distributed
            self._many_ranks = (distributed.is_available() and distributed.is_initialized()
                                and distributed.get_world_size() > 1)
        return self._many_ranks

    def _watch_local_gradients(self, module, path: str) -> None:
        """grad_local: each parameter's gradient as this rank's backward left it, before the data-parallel
        reduce. A post-accumulate-grad hook runs inside AccumulateGrad, before the node's post hooks,
        where DDP's reducer marks the gradient ready and launches its bucket's all-reduce (a manual
        all_reduce of gradients runs after backward)."""
        on_gradient = self._guarded(self._on_local_gradient)
        for name, parameter in module.named_parameters(recurse=False):
            known = self._local_gradient_hooks.get(id(parameter))
            if not parameter.requires_grad or (known is not None and known[0]() is parameter):
                continue
            full_name = f"{path}.{name}" if path else name

            def hook(tensor, full_name=full_name):
                on_gradient(full_name, tensor)

            self._local_gradient_hooks[id(parameter)] = (weakref.ref(parameter),
                                                         parameter.register_post_accumulate_grad_hook(hook))

    def _on_local_gradient(self, name: str, parameter) -> None:
        if parameter.grad is None or self._in_optimizer or not self._monitored():
            return
        # accumulated over several backwards (micro-batches): the last one is what the reduce gets
        slots = self._step.slots
        entry = self._step.local_grads.get(name)
        recorded = len(slots)
        self._add("grad_local", name, parameter.grad.detach())
        if len(slots) == recorded:  # not a floating-point gradient, or an empty one
            return
        if entry is not None:
            slots[entry] = slots.pop()
        else:
            self._step.local_grads[name] = len(slots) - 1

    def _on_backward(self, tensor) -> None:
        record = self._step
        if record.loss_slot is None and self._monitored() and tensor.numel() == 1 and tensor.is_floating_point():
            # one element: its statistics are its value's, whatever its shape (host_stats reads it in place)
            stats = host_stats(tensor, self._npu_in_host_memory)
            record.loss_slot = stats if stats is not None else self._buffer.add(tensor.detach().reshape(()))
            record.used = True

    def _parameter_name(self, parameter, group: int, index: int) -> tuple[str, str]:
        """(the parameter's dotted name, its module's path), from the modules seen running."""
        found = self._parameter_names.get(id(parameter))
        if found is None or found[0]() is not parameter:
            for module, path in list(self._paths.items()):
                for name, candidate in module.named_parameters(recurse=False):
                    known = self._parameter_names.get(id(candidate))
                    if known is None or known[0]() is not candidate:
                        self._parameter_names[id(candidate)] = (weakref.ref(candidate),
                                                                f"{path}.{name}" if path else name, path)
            found = self._parameter_names.get(id(parameter))
            if found is None or found[0]() is not parameter:  # of no module that ran (a bare tensor)
                found = self._parameter_names[id(parameter)] = (weakref.ref(parameter),
                                                                f"param_group{group}.{index}", "")
        return found[1], found[2]

    def _parameters(self, optimizer) -> list[tuple[dict, str, torch.Tensor]]:
        """(group, name, parameter) of the optimizer's parameters the filter keeps. Made again only
        when its groups or their parameters change (load_state_dict makes new groups); a parameter's
        name, once found, stays its own."""
        current = []
        for group in optimizer.param_groups:
            current.append(group)
            current.extend(group["params"])
        cached = self._optimizer_parameters.get(id(optimizer))
        if (cached is not None and cached[0]() is optimizer and len(cached[1]) == len(current)
                and all(map(operator.is_, cached[1], current))):
            return cached[2]
        kept = []
        for group_index, group in enumerate(optimizer.param_groups):
            for index, parameter in enumerate(group["params"]):
                name, path = self._parameter_name(parameter, group_index, index)
                if self.module_filter is None or self._keeps(path or name):
                    kept.append((group, name, parameter))
        lists, key = self._optimizer_parameters, id(optimizer)
        # dropped with the optimizer: a run that makes a new optimizer per epoch keeps no old parameters
        lists[key] = (weakref.ref(optimizer, lambda _: lists.pop(key, None)), current, kept)
        return kept

    def _record_parameters(self, optimizer) -> None:
        for _, name, parameter in self._parameters(optimizer):
            self._add("weight", name, parameter)
            if parameter.grad is not None:
                self._add("grad", name, parameter.grad)

    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        if self._ending is not None and self._in_optimizer == 0 and self._steps.ends_steps(optimizer):
            self._finish_ending()  # the next training step's first optimizer: the last one ended
        self._in_optimizer += 1
        if self._monitored() and self._in_optimizer == 1:
            self._record_parameters(optimizer)

    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        if self._monitored() and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            self._record_adam(optimizer)
        if self._in_optimizer == 0 and self._steps.ended_by_another(optimizer):
            self._several_optimizers = True
            if self._ending is not None:  # what led to this optimizer's step is the ending step's
                self._ending[0].absorb(self._step)
                self._step = _StepRecord(self.step_index, continues=self._ending[0])

    def _record_adam(self, optimizer) -> None:
        """exp_avg, exp_avg_sq, and the norm of Adam's step direction m^ / (sqrt(v^) + eps) per
        parameter; the ratio to the weight's norm (taken before the update) is made on the host at
        the step's end. m^ / (sqrt(v^) + eps) = c1 m / (sqrt(c2) (sqrt(v) + eps / sqrt(c2))), with
        c = 1 / (1 - beta^t): the norm of m / (sqrt(v) + eps / sqrt(c2)), the constants applied to it.
        fp32 state in host memory is read once for all three (adam_host_stats); other state takes torch's
        foreach ops (one call per op for all of a group's parameters)."""
        groups: dict[int, tuple[dict, list]] = {}
        for group, name, parameter in self._parameters(optimizer):
            state = optimizer.state.get(parameter)
            if not state or "exp_avg" not in state:
                continue
            beta1, beta2 = group["betas"]
            step = float(state["step"])
            root_c2 = math.sqrt(1 / (1 - beta2 ** step))
            scale = float(group["lr"]) / (1 - beta1 ** step) / root_c2
            m, v = state["exp_avg"], state["exp_avg_sq"]
            read_once = _adam_state_in_one_read(m, v, group["eps"] / root_c2)
            if read_once is not None:
                m_stats, v_stats, update_norm = read_once
                self._step.slots.append(("exp_avg", name, m.dtype, m_stats))
                self._step.slots.append(("exp_avg_sq", name, v.dtype, v_stats))
                self._step.update_norms.append((name, update_norm, scale))
                self._step.used = True
                continue
            self._add("exp_avg", name, m)
            self._add("exp_avg_sq", name, v)
            groups.setdefault(id(group), (group, []))[1].append((name, state, root_c2, scale))
        for group, members in groups.values():
            with torch.no_grad():
                # in fp32: in fp16 state's own dtype eps / sqrt(c2) (1e-8 and less) rounds to 0, and an
                # element with m = v = 0 (a zero gradient) gives 0 / 0 = nan where the update is 0
                denominator = torch._foreach_sqrt([_in_fp32(state["exp_avg_sq"]) for _, state, _, _ in members])
                torch._foreach_add_(denominator, [group["eps"] / root for _, _, root, _ in members])
                norms = torch._foreach_norm(torch._foreach_div(
                    [_in_fp32(state["exp_avg"]) for _, state, _, _ in members], denominator))
            for (name, _, _, scale), norm in zip(members, norms):
                self._step.update_norms.append((name, self._buffer.add(norm), scale))

    # ------------------------------------------------------------------ step end
    def _on_step_end(self, optimizer, skipped: bool, loss_scale: float | None) -> None:
        """RunSteps ended a step: at a new root forward without an optimizer (optimizer None), or at
        the first optimizer's step."""
        if optimizer is None:
            self._finish_step(None, False, None)
        else:
            self._end_training_step(optimizer, skipped, loss_scale)

    def _end_training_step(self, optimizer, skipped: bool, loss_scale: float | None) -> None:
        """The first optimizer's step ended a training step. With several optimizers (a GAN's D and G,
        two optimizers over parameter groups), the others step after it in the same training step
        (RunSteps numbers one step, at the first one's): the step is written when the first optimizer's
        next step begins, with what led to each other optimizer's step (its forward, backward, weights,
        gradients, state)."""
        if self._ending is not None:  # a step GradScaler skipped starts no optimizer.step: no pre-hook ended it
            self._finish_ending()
        # the first step waits, like those of several optimizers: whether another optimizer steps
        # after the first is seen before the first one's next step begins
        if self._several_optimizers is False:
            self._finish_step(optimizer, skipped, loss_scale)
            return
        if skipped and self._monitored() and self._step.used:
            self._record_parameters(optimizer)  # now: zero_grad may come before the step is written
        self._ending = (self._step, skipped, loss_scale)
        self.step_index += 1
        self._step = _StepRecord(self.step_index, continues=self._step)

    def _finish_ending(self) -> None:
        """Write the step whose end waited for the other optimizers; what was recorded since their
        last step is the next step's, its values kept (the buffer they were in goes with this step)."""
        (record, skipped, loss_scale), self._ending = self._ending, None
        if self._several_optimizers is None:
            self._several_optimizers = False  # no other optimizer stepped in the first step
        buffer, following = self._buffer, self._step
        self._buffer = StatsBuffer()
        values = buffer.resolve() if record.used or following.used else []  # one device->host copy
        following.own_step(record, values)
        self._finish(record, buffer, values, skipped, loss_scale)

    def _finish_step(self, optimizer, skipped: bool, loss_scale: float | None) -> None:
        if self._monitored() and self._step.used and skipped:
            # GradScaler.step ran no optimizer.step: no pre-hook saw the (inf/nan) gradients
            self._record_parameters(optimizer)
        record, buffer = self._step, self._buffer
        self.step_index += 1
        self._new_step()
        self._finish(record, buffer, None, skipped, loss_scale)

    def _finish(self, record: _StepRecord, buffer: StatsBuffer, values: list | None, skipped: bool,
                loss_scale: float | None) -> None:
        step = record.step
        if not (self._is_monitored(step) and record.used):
            return
        if values is None:
            values = buffer.resolve()  # the step's one device->host copy
        slots, loss_slot, update_norms = record.slots, record.loss_slot, record.update_norms
        unscale = 1.0 / loss_scale if loss_scale else 1.0
        records = []
        squares = 0.0
        for kind, name, dtype, slot in slots:
            stats = values[slot] if isinstance(slot, int) else slot
            if stats is None:
                continue
            name = str(name)
            if kind in ("activation_grad", "grad_local") and unscale != 1.0:
                # a copy: a tensor measured twice in the step shares its values
                stats = [value * unscale for value in stats[:4]] + list(stats[4:])
            if kind == "grad":
                squares += stats[3] ** 2
            records.append(Record(kind, name, dtype, stats))
        weight_norms = {r.name: r.values[3] for r in records if r.kind == "weight"}
        for name, slot, scale in update_norms:
            weight_norm = weight_norms.get(name)
            norm = values[slot][2] if isinstance(slot, int) and values[slot] is not None else slot
            if weight_norm and isinstance(norm, float):
                ratio = scale * norm / weight_norm
                records.append(Record("update_ratio", name, torch.float32, [ratio, ratio, ratio, abs(ratio),
                                                                            float(math.isnan(ratio)),
                                                                            float(math.isinf(ratio))]))
        grad_norm = math.sqrt(squares) if any(r.kind == "grad" for r in records) else None
        loss = None
        loss_values = values[loss_slot] if isinstance(loss_slot, int) else loss_slot
        if loss_values is not None:
            loss = loss_values[2] * unscale  # the mean of a one-element tensor: its value
        alerts = self.alerts.judge(step, records, loss, grad_norm, skipped, loss_scale)
        for alert in alerts:
            print(f"npukit monitor: {alert.message}", file=sys.stderr)
        self.raised.extend(alerts)
        self._write(step, records, loss, grad_norm, loss_scale, skipped, alerts)

    # ------------------------------------------------------------------ files
    def _write(self, step, records, loss, grad_norm, loss_scale, skipped, alerts) -> None:
        while len(self._pending) >= _PENDING_STEPS:  # bounded memory: wait for the oldest step's files
            self._report_write_error(self._pending.pop(0))
        self._pending.append(self._writer.submit(self._write_step, step, records, loss, grad_norm, loss_scale,
                                                 skipped, alerts))

    def _report_write_error(self, future: Future) -> None:
        error = future.exception()
        if error is not None and not self.broken:
            self.broken = True
            hook_failed("MonitorSession._write_step", error)
            print(f"npukit monitor: could not write into {self.directory}; monitoring stopped, the run goes on",
                  file=sys.stderr)

    def _csv(self, name: str, columns: tuple[str, ...]):
        entry = self._files.get(name)
        if entry is None:
            file = open(self.directory / name, "w", newline="")  # noqa: SIM115 (open for the run)
            writer = csv.writer(file)
            writer.writerow(columns)
            entry = self._files[name] = _CsvFile(file, writer)
        return entry

    def _write_step(self, step, records, loss, grad_norm, loss_scale, skipped, alerts) -> None:
        layout = self._layout_of(records)
        values = [value for r in records for value in r.values]
        if self.csv_files:
            rows = self._csv("monitor.csv", RECORD_COLUMNS)
            # the rows csv.writer writes, from each record's fields as written once (_StepLayout), the
            # values' repr made in C++ (in Python, most of the writer's time)
            rows.file.write(csv_rows(str(step), layout.csv_prefixes, values, len(STAT_NAMES)))
            rows.flush()
            scalars = self._csv("scalars.csv", SCALAR_COLUMNS)
            scalars.writer.writerow([step, _number(loss), _number(grad_norm), _number(loss_scale), int(skipped)])
            scalars.flush()
        if alerts:
            table = self._csv("alerts.csv", ALERT_COLUMNS)
            table.writer.writerows([a.step, a.rule, a.name, a.statistic, _number(a.value), a.message] for a in alerts)
            table.flush()
        if self.tensorboard:
            events = self._files.get("events")
            if events is None:
                events = self._files["events"] = ScalarEventFile(self.directory)
            scalars = [(tag, value) for tag, value in (("loss", loss), ("grad_norm", grad_norm),
                                                      ("loss_scale", loss_scale)) if value is not None]
            events.write(step, scalars, layout.summary, values)

    def _layout_of(self, records) -> _StepLayout:
        """The step's record fields as written (the last step's: one kept, memory stays bounded)."""
        key = [(r.kind, r.name, r.dtype) for r in records]
        if self._layout is None or self._layout.key != key:
            self._layout = _StepLayout(key)
        return self._layout


class _StepLayout:
    """What a step's files hold for its records besides their values, made once for the run's steps
    that record the same (kind, name, dtype) in the same order: each record's monitor.csv fields
    before its values, and the TensorBoard tags (`{kind}/{name}/{statistic}`)."""

    def __init__(self, key: list[tuple[str, str, torch.dtype]]) -> None:
        self.key = key
        buffer = io.StringIO()
        fields = csv.writer(buffer)
        self.csv_prefixes = []
        for kind, name, dtype in key:
            buffer.seek(0)
            buffer.truncate()
            fields.writerow([kind, name, str(dtype).removeprefix("torch."), ""])
            self.csv_prefixes.append(buffer.getvalue()[:-2])  # "kind,name,dtype," without the row's end
        self.summary = SummaryLayout([f"{kind}/{name}/{stat}" for kind, name, _ in key for stat in STAT_NAMES])


class _Leaf:
    """A module output's record name, `path`, `path.call1` ... (+ `.0`, `.1` for several outputs):
    numbered by the module's calls in the step, renumbered when a step's tail turns out to start the next."""
    __slots__ = ("path", "call", "suffix")

    def __init__(self, path: str, call: int, suffix: str) -> None:
        self.path, self.call, self.suffix = path, call, suffix

    def __str__(self) -> str:
        return (self.path if self.call == 0 else f"{self.path}.call{self.call}") + self.suffix


class _StepRecord:
    """What one training step recorded, until it is written. slots: (kind, name, dtype, a buffer slot
    or the statistics themselves); update_norms: (parameter, the norm's buffer slot or the norm,
    lr / (1 - beta1^t) / sqrt(1 / (1 - beta2^t))); loss_slot: a buffer slot or the statistics."""

    def __init__(self, step: int, continues: _StepRecord | None = None) -> None:
        self.step = step
        self.used = False
        self.slots: list[tuple[str, str | _Leaf, torch.dtype, int | list[float]]] = []
        # a tail that may still join the step it follows (several optimizers) numbers calls on from it
        self.calls: dict[str, int] = dict(continues.calls) if continues is not None else {}
        self.leaves: list[_Leaf] = []
        self.measured: dict[int, tuple] = {}  # id(tensor) -> (weak reference, version, buffer slot)
        self.loss_slot: int | list[float] | None = None
        self.update_norms: list[tuple[str, int | float, float]] = []
        self.local_grads: dict[str, int] = {}  # parameter -> its grad_local entry in slots

    def absorb(self, tail: _StepRecord) -> None:
        """The records made since this step's first optimizer stepped, up to another optimizer's step."""
        offset = len(self.slots)
        for name, entry in tail.local_grads.items():
            if name in self.local_grads:  # the gradient this step's reduce got came first
                tail.slots[entry] = None
            else:
                self.local_grads[name] = entry + offset
        self.slots += [slot for slot in tail.slots if slot is not None]
        self.calls, self.leaves = tail.calls, self.leaves + tail.leaves
        self.update_norms += tail.update_norms
        if self.loss_slot is None:
            self.loss_slot = tail.loss_slot
        self.used = self.used or tail.used
        self.measured = {}  # a slot of the tail is not one to share

    def own_step(self, ended: _StepRecord, values: list) -> None:
        """This tail starts the next step after all: its calls numbered from 0, its statistics taken
        out of the buffer that goes with the ended step."""
        for leaf in self.leaves:
            leaf.call -= ended.calls.get(leaf.path, 0)
        self.calls = {path: count - ended.calls.get(path, 0) for path, count in self.calls.items()
                      if count > ended.calls.get(path, 0)}
        self.slots = [(kind, name, dtype, values[slot] if isinstance(slot, int) else slot)
                      for kind, name, dtype, slot in self.slots]
        self.update_norms = [(name, values[slot][2] if isinstance(slot, int) else slot, scale)
                             for name, slot, scale in self.update_norms]
        if isinstance(self.loss_slot, int):
            self.loss_slot = values[self.loss_slot]
        self.measured = {}


def _in_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 as fp32; fp32 and fp64 as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _adam_state_in_one_read(m: torch.Tensor, v: torch.Tensor, eps: float):
    """(m's statistics, v's, the norm of m / (sqrt(v) + eps)) from one read of fp32 host state, or
    None where torch's ops measure it (other dtypes or layouts, another device, nan/inf in it): one
    C++ call that also makes the checks (adam_host_stats: 2.2 us on a 1000-element npu state, 8.2 us
    with dtype, shape, layout and device read from Python, timeit, hot).
    FSDP2's state is DTensors, wrappers without data of their own: this rank's shards are read, as its
    weights and gradients are measured."""
    if type(m) is not torch.Tensor:  # (a plain tensor skips local_shard's lookups: ~1.3 us a parameter a step)
        m, v = local_shard(m), local_shard(v)
    return adam_host_stats(m, v, eps, npu_in_host_memory())


class _CsvFile:
    def __init__(self, file, writer) -> None:
        self.file, self.writer = file, writer

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _number(value) -> str:
    if value is None:
        return ""
    return repr(float(value))


# msprobe monitor's config.json keys npukit reads; its other keys choose what msprobe collects
# (npukit always collects every statistic) or how it runs on Megatron/FSDP: not applied, said once.
_CONFIG_KEYS = ("step_interval", "start_step", "targets", "format", "alert")


def load_monitor_config(path: Path) -> dict:
    """MonitorSession's options from msprobe monitor's config.json: step_interval (every),
    start_step, targets (module name prefixes, as msprobe matches them), format (csv |
    tensorboard: which files), alert.rules' AnomalyTurbulence threshold."""
    from npukit.accuracy.msprobe_config import read_config_object

    config = read_config_object(path, "--monitor-config")

    def number(key: str, default: int, least: int) -> int:
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise UserError(f"--monitor-config {path}: {key} must be an integer >= {least}, got {value!r}")
        return value

    options: dict = {"every": number("step_interval", 1, 1), "start_step": number("start_step", 0, 0)}
    targets = config.get("targets", {})
    if not isinstance(targets, dict):
        raise UserError(f"--monitor-config {path}: targets must be an object of module names, got {targets!r}")
    prefixes = [name for name in targets if name]
    options["modules"] = "^(?:" + "|".join(re.escape(name) for name in prefixes) + ")" if prefixes else None
    file_format = config.get("format", "csv")
    if file_format not in ("csv", "tensorboard"):
        raise UserError(f"--monitor-config {path}: format {file_format!r}: npukit writes csv or tensorboard")
    options["tensorboard"], options["csv_files"] = file_format == "tensorboard", file_format == "csv"
    rules = AlertRules()
    alert = config.get("alert", {})
    for rule in (alert.get("rules", []) if isinstance(alert, dict) else []):
        if isinstance(rule, dict) and rule.get("rule_name") == "AnomalyTurbulence":
            threshold = rule.get("args", {}).get("threshold")
            if not isinstance(threshold, int | float) or threshold < 0:
                raise UserError(f"--monitor-config {path}: AnomalyTurbulence's threshold must be a number >= 0, "
                                f"got {threshold!r}")
            rules.turbulence = float(threshold)
    options["rules"] = rules
    ignored = sorted(key for key in config if key not in _CONFIG_KEYS)
    if ignored:
        print(f"npukit monitor: {path}: {', '.join(ignored)} not applied (npukit records every statistic of every "
              "module the targets keep)", file=sys.stderr)
    return options
