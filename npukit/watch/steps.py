"""Where a training step ends, for readers that count steps without taking part in them.

A step ends when optimizer.step() returns; with several optimizers, at the step of the first one
that stepped (one training step, not one per optimizer). Under GradScaler it ends when
GradScaler.update returns (its ops are the step's), also when GradScaler.step skipped
optimizer.step (inf/nan gradients), or, without an update call, when the next GradScaler.step
starts. The dump and the overflow detector, which pause their recording inside optimizer.step and
end the step at GradScaler.step, use GradScalerStepWatch directly.

A script with no optimizer (inference, or updates made by hand) has no optimizer.step: there a
step ends each time its first root module starts a new forward (ForwardSteps).

RunSteps joins the two: TrainingSteps' ends and, until an optimizer step begins, ForwardSteps'
boundaries of forwards run with gradients (an evaluation forward, without them, starts no step). The
monitor numbers its steps with it, and so do --replay-step and --stop-after-step (the dump under
--monitor, --replay or --stop-after-step numbers its steps to match).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch

from npukit.watch.scaler_steps import GradScalerStepWatch


class TrainingSteps:
    """on_end(optimizer, skipped, loss_scale): once per training step, as it ends. skipped: GradScaler
    skipped optimizer.step; loss_scale: the scale the step's backward ran at (None without GradScaler).
    `counting`: when False the boundaries are not reported (a reader whose user marks steps)."""

    def __init__(self, on_end: Callable[[object, bool, float | None], None]) -> None:
        self.on_end = on_end
        self.counting = True
        self.scaler = GradScalerStepWatch(lambda: True, self._end_scaler_step, self._after_scaler_step,
                                          self._end_scaler_step)
        self._clock: weakref.ref | None = None  # the optimizer whose step() ends a training step
        self._scaler_step_ending = None  # (optimizer, skipped, scale) of the step GradScaler.update ends
        self._hook = None

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        self.scaler.install()

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.scaler.remove()

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.scaler.optimizer is optimizer:  # inside GradScaler.step: ended by update (or the next step)
            return
        self._end(optimizer, False, None)

    def _after_scaler_step(self, skipped: bool, scale: float) -> None:
        self._scaler_step_ending = (self.scaler.optimizer, skipped, scale)

    def _end_scaler_step(self) -> None:
        """GradScaler.update returned (or, without one, the next GradScaler.step starts)."""
        ending, self._scaler_step_ending = self._scaler_step_ending, None
        if ending is not None:
            self._end(*ending)

    def _end(self, optimizer, skipped: bool, scale: float | None) -> None:
        if not self.counting:
            return
        if self._clock is None or self._clock() is None:
            self._clock = weakref.ref(optimizer)
        if self._clock() is optimizer:  # with several optimizers, one step = the first one's step
            self.on_end(optimizer, skipped, scale)

    def ends_steps(self, optimizer) -> bool:
        """optimizer is the one whose step ends training steps (the first that stepped, while alive)."""
        return self._clock is not None and self._clock() is optimizer

    @property
    def step_ended(self) -> bool:
        """A training step has ended (so an optimizer ends them: ends_steps tells which)."""
        return self._clock is not None


class ForwardSteps:
    """Step boundaries of a script without an optimizer: new_step(module), called as a root module
    (no module running) starts its forward, is True when that starts a new step: the first root
    module seen runs again and no optimizer exists (asked once, by one gc scan, then)."""

    def __init__(self) -> None:
        self._root: weakref.ref | None = None
        self._optimizer_exists: bool | None = None

    def new_step(self, module) -> bool:
        root = self._root() if self._root is not None else None
        if root is None:
            self._root = weakref.ref(module)
            return False
        return root is module and not self.optimizer_alive()

    def optimizer_alive(self, remember: bool = True) -> bool:
        """remember=False: a scan made before the root's first repeat (which asks, and remembers) is
        not kept, so an optimizer made after it is still seen then, as the monitor's scan sees it."""
        if self._optimizer_exists is not None:
            return self._optimizer_exists
        # type(obj), not isinstance: isinstance reads __class__, which deprecated objects warn on
        optimizer = torch.optim.Optimizer
        exists = any(issubclass(type(obj), optimizer) for obj in gc.get_objects())
        if remember:
            self._optimizer_exists = exists
        return exists


class RunSteps:
    """Steps numbered as the monitor numbers them (and so the dump of --localize's re-runs):
    on_end(optimizer, skipped, loss_scale) once per step as it ends. With an optimizer, as
    TrainingSteps ends steps; until an optimizer step begins, also as ForwardSteps sees the first
    root module start a new forward with gradients enabled (a script updating its weights by hand):
    then optimizer is None and on_end runs in that forward's pre-hook, before the forward and before
    the pre-hooks registered after install(): a client that registers its own hooks after install()
    sees the new step already begun.

    watch_forwards=False: for a client that hooks module forwards itself (the monitor, which passes
    over torch.compile's wrapper and counts the model inside): RunSteps registers no module hook, and
    the client calls root_forward(module) as each of its root forwards starts.

    `optimizer_stepped`: an optimizer step began (or GradScaler skipped one); forwards end no step
    from then on (LBFGS's closure runs forwards inside the first step), and the module hooks are
    removed as that first step ends: a long run pays nothing for them.
    `forward_begun`: a root forward with gradients started in the step running now (under forward
    steps, what follows it in that step, e.g. the DataLoader's next batch, prepares the next step)."""

    def __init__(self, on_end: Callable[[object, bool, float | None], None], *, watch_forwards: bool = True) -> None:
        self.on_end = on_end
        self.optimizer_stepped = False
        self.forward_begun = False
        self._watch_forwards = watch_forwards
        self._forwards = ForwardSteps()
        self._training = TrainingSteps(self._on_training_end)
        self._depth = 0  # module forwards running
        self._handles: list = []  # removed once the first training step ended

    def install(self) -> None:
        from torch.nn.modules import module as module_hooks
        from torch.optim import optimizer as optimizer_hooks

        self._training.install()
        self._handles = [optimizer_hooks.register_optimizer_step_pre_hook(self._on_optimizer_pre_step)]
        if self._watch_forwards:
            self._handles += [module_hooks.register_module_forward_pre_hook(self._on_pre_forward),
                              module_hooks.register_module_forward_hook(self._on_forward, always_call=True)]

    def remove(self) -> None:
        self._training.remove()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def by_forwards(self) -> bool:
        """Steps end at forwards: no optimizer stepped, and none exists (ForwardSteps' gc scan; asked
        before the root's first repeat, the answer is not kept: the step count takes it there)."""
        return not self.optimizer_stepped and not self._forwards.optimizer_alive(remember=False)

    def ends_steps(self, optimizer) -> bool:
        """With several optimizers, optimizer is the one whose step ends a training step."""
        return self._training.ends_steps(optimizer)

    @property
    def training_step_ended(self) -> bool:
        """An optimizer's step (or GradScaler's) has ended a training step."""
        return self._training.step_ended

    def _on_training_end(self, optimizer, skipped: bool, loss_scale: float | None) -> None:
        self.optimizer_stepped = True
        if self._handles:
            self._remove_hooks()  # forwards end no step from here
        self.forward_begun = False
        self.on_end(optimizer, skipped, loss_scale)

    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_stepped = True

    def root_forward(self, module) -> None:
        """A root module (no module running) starts its forward."""
        if self.optimizer_stepped or not torch.is_grad_enabled():
            return
        if self._forwards.new_step(module):
            self.on_end(None, False, None)
        self.forward_begun = True

    def _on_pre_forward(self, module, args) -> None:
        self._depth += 1
        if self._depth == 1:
            self.root_forward(module)

    def _on_forward(self, module, args, output) -> None:
        self._depth = max(0, self._depth - 1)
