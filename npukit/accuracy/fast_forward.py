"""`npu-run --fast-forward DIR`: reach step N of a script cheaply, then run it exactly.

DIR is a recorded replay folder (`--replay DIR --replay-step N`) or a monitor's checkpoint
(`--monitor-checkpoint-every`, DIR/checkpoints/step-N): the state at step N's start. A script
cannot be entered at step N from outside (its loop, data iterator, learning-rate scheduler and
counters are its own), so steps 0 to N-1 still run, the script's own code, but with the model's
heavy compute skipped: while they run, an npu op of the matrix-product, convolution and attention
families (forward and backward) returns zero-filled outputs of the shape, strides and dtype its
meta kernel gives, and inside optimizer.step every npu op is skipped (an in-place update returns
its argument untouched, aliasing intact). Views, elementwise ops, reductions and ops whose output
shape depends on values (nonzero, item) run for real, on what the skipped ops left. At step N's
start (counted as --replay-step counts: watch.steps.RunSteps) the skipping ends and DIR's state is
loaded (ReplaySession: root modules' weights and buffers, optimizers' state, GradScalers' loss
scale and growth tracker, random generators), so from step N on the run is the one DIR was recorded
from, its random draws too (past the recorded run's later checkpoints: recording them changed nothing). The skipped steps' gradients (zeros where a skipped op made them) overflow otherwise than the
real ones, so until then a GradScaler's scale is not the recorded run's (mostly it grows, never
backed off); DIR's replaces it at step N (a DIR recorded before npukit recorded scalers leaves it
so, and the run says so).

What is not in DIR comes from the skipped steps: state the script keeps outside its modules,
optimizers and scalers, and decisions the script made on values (an early stop on the loss, an
assert on it). A script that fails on the zeros, or ends before step N, fails: the run
says so (npu-compare --localize then re-runs from the beginning).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map

from npukit.accuracy.replay import ReplaySession
from npukit.watch.steps import RunSteps

# aten and npu ops (overload packet names) skipped in any npu op of a fast-forwarded step
SKIPPED_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear", "_addmm_activation",
    "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "npu_fusion_attention", "npu_fusion_attention_grad",
})


class FastForwardSession:
    """Skip the heavy compute until the step `directory` was recorded at, then load its state there."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        # the folder's manifest is read (and checked) here, before the script starts
        self._replay = ReplaySession(self.directory, batches=0, start_step=None)
        self.start_step = self._replay.start_step
        self.skipping = self.start_step > 0
        self.skipped_ops = 0
        self._in_optimizer = 0
        self._steps_ended = 0
        self._steps = RunSteps(self._on_step_end)
        self._mode = _SkipHeavyCompute(self)
        self._handles: list = []
        self._mode_on = False

    def __enter__(self) -> FastForwardSession:
        from torch.optim import optimizer as optimizer_hooks

        # installed before the replay's own step count: the skipping has ended when it loads the state
        self._steps.install()
        self._handles = [optimizer_hooks.register_optimizer_step_pre_hook(self._on_optimizer_pre_step),
                         optimizer_hooks.register_optimizer_step_post_hook(self._on_optimizer_post_step)]
        self._replay.__enter__()
        if self.skipping:
            self._mode.__enter__()
            self._mode_on = True
        return self

    def _leave_mode(self) -> None:
        """Off the dispatch-mode stack: a mode, even passing every op through, changes what ops do
        (under one, torch._foreach_add_ leaves its tensors' version counters unchanged: the dump would
        take a step counter's new value for its old one). Left at once when on top (the perturbed
        golden run's mode is entered before it), else as the session ends."""
        if self._mode_on and _get_current_dispatch_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode_on = False

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._leave_mode()
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._steps.remove()
        finally:
            self._replay.__exit__(exc_type, exc, tb)  # a run that ended before step N: says so

    def mark_run_failed(self) -> None:
        self._replay.mark_run_failed()

    def skips(self, func) -> bool:
        return self.skipping and (self._in_optimizer > 0 or func.overloadpacket.__name__ in SKIPPED_OPS)

    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        self._in_optimizer += 1

    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)

    def _on_step_end(self, optimizer, skipped: bool, loss_scale) -> None:
        self._steps_ended += 1
        if not self.skipping or self._steps_ended < self.start_step:
            return
        self.skipping = False
        self._leave_mode()
        print(f"npu-run: fast-forwarded steps 0-{self.start_step - 1} ({self.skipped_ops} matrix-product, "
              "convolution, attention and optimizer ops skipped); from step "
              f"{self.start_step} on computed, from the state in {self.directory}", file=sys.stderr)


class _SkipHeavyCompute(TorchDispatchMode):
    def __init__(self, session: FastForwardSession) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.session.skips(func):
            device = _npu_device(args, kwargs)
            if device is not None:
                skipped, result = _skip(func, args, kwargs, device)
                if skipped:
                    self.session.skipped_ops += 1
                    return result
        return func(*args, **kwargs)


def _npu_device(args, kwargs):
    leaves, _ = tree_flatten((args, kwargs))
    return next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type == "npu"), None)


def _skip(func, args, kwargs, device) -> tuple[bool, object]:
    """(True, what the op returns without computing it), or (False, None): the op must run."""
    schema = func._schema
    written = [index for index, argument in enumerate(schema.arguments)
               if argument.alias_info is not None and argument.alias_info.is_write]
    if written:  # in place or out=: the written arguments are returned as they are
        if not schema.returns:
            return True, None
        if len(schema.returns) != len(written) or any(ret.alias_info is None for ret in schema.returns):
            return False, None
        values = [kwargs[schema.arguments[index].name] if schema.arguments[index].name in kwargs else args[index]
                  for index in written]
        return True, values[0] if len(values) == 1 else tuple(values)
    if any(ret.alias_info is not None for ret in schema.returns):  # a view: its aliasing matters, and it is cheap
        return False, None
    try:
        meta = func(*tree_map(_on_meta, args), **tree_map(_on_meta, kwargs))
    except Exception:  # no meta kernel, or a shape that depends on values: computed
        return False, None
    return True, tree_map(lambda value: _zeros_like(value, device), meta)


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _zeros_like(value, device):
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device).zero_()
    return value
