"""Where a step of a running script ends: the step boundaries every reader of it counts by.

TrainingSteps: a training step ends when optimizer.step() returns; with several optimizers, at the
step of the first one that stepped (one training step, not one per optimizer). Under GradScaler it
ends when GradScaler.update returns (its ops are the step's), also when GradScaler.step skipped
optimizer.step (inf/nan gradients), or, without an update call, when the next GradScaler.step
starts. The profiler counts its steps so.

ForwardSteps: a script with no optimizer (inference, or updates made by hand) has no
optimizer.step: there a step ends each time its first root module starts a new forward.

RunSteps joins the two: TrainingSteps' ends and, until an optimizer step begins, ForwardSteps'
boundaries of forwards run with gradients (an evaluation forward, without them, starts no step). The
monitor numbers its steps with it, and so do --replay-step and --stop-after-step (the dump under
--monitor, --replay or --stop-after-step numbers its steps to match).

RecordedSteps: the steps of the dump and the overflow detector, which record a step's ops, the
optimizer's update among them (the dump writes the update's ops under the parent "optimizer", as
msprobe does; the detector checks the update as one op). They differ from RunSteps on purpose:
  - recording pauses inside optimizer.step (`paused`: no module of the model runs there) and inside
    GradScaler's own step, unscale_ and update (none of their ops is the model's);
  - a step ends as optimizer.step or GradScaler.step returns, skipped or not (what GradScaler.update
    then runs is recorded by neither), so that the step is read or written before the next begins;
  - every optimizer's step ends a step (two optimizers, two steps), where RunSteps ends one training
    step at the first optimizer's;
  - before the first optimizer step, each new forward of the first root module ends a step, also one
    without gradients (an inference run's steps), unless forwards_with_gradients_only (the dump beside
    --monitor, --replay or --stop-after-step: with one optimizer its step S is then RunSteps' step S);
  - a user's own step() call switches the automatic boundaries off (`automatic`).
The readers drive it from their own hooks (optimizer_step_begins, optimizer_step_returned,
end_after_optimizer_step, root_forward) instead of it hooking the script: their work around a
boundary has an order (gradients read before the pause, the update checked before the step ends).
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

    def ended_by_another(self, optimizer) -> bool:
        """A training step has ended, at another optimizer's step than this one's (several optimizers)."""
        return self._clock is not None and self._clock() is not optimizer


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
    steps, what follows it in that step, e.g. the DataLoader's next batch, prepares the next step).
    ends_steps(optimizer) / ended_by_another(optimizer): with several optimizers, whether this one's
    step is the one that ends training steps / a step has ended at another's (TrainingSteps').
    scalers(): the GradScalers that stepped, in the order of their first step (GradScalerStepWatch's)."""

    def __init__(self, on_end: Callable[[object, bool, float | None], None], *, watch_forwards: bool = True) -> None:
        self.on_end = on_end
        self.optimizer_stepped = False
        self.forward_begun = False
        self._watch_forwards = watch_forwards
        self._forwards = ForwardSteps()
        self._training = TrainingSteps(self._on_training_end)
        # with several optimizers, which one's step ends a training step (the monitor asks at each
        # optimizer step: TrainingSteps' own methods, no call in between)
        self.ends_steps = self._training.ends_steps
        self.ended_by_another = self._training.ended_by_another
        self.scalers = self._training.scaler.scalers
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


class RecordedSteps:
    """Step boundaries of a reader that records a step's ops, the optimizer's update among them (the
    dump, the overflow detector), which differ from RunSteps' on purpose (see the module docstring):
    on_end(skipped, loss_scale) as a step ends automatically; loss_scale is None unless GradScaler
    ended it. The reader calls optimizer_step_begins() from its optimizer step-pre hook,
    optimizer_step_returned() then end_after_optimizer_step() from its post hook, and
    root_forward(module) as a root module of its own count starts its forward outside optimizer.step.

    `paused` > 0 while optimizer.step runs (no module of the model runs then: its ops are the
    update's); `scaler.inside` > 0 while GradScaler's own step, unscale_ or update runs (none of
    those ops is the model's); `automatic`: set False when the user ends steps by hand (step()).
    before_scaler_step(): GradScaler.step starts (gradients still scaled); after_scaler_step(skipped,
    loss_scale): it returned, before it ends the step."""

    def __init__(self, is_active: Callable[[], bool], on_end: Callable[[bool, float | None], None], *,
                 before_scaler_step: Callable[[], None] | None = None,
                 after_scaler_step: Callable[[bool, float], None] | None = None,
                 forwards_with_gradients_only: bool = False) -> None:
        self.on_end = on_end
        self.automatic = True
        self.paused = 0
        self.optimizer_seen = False  # an optimizer step began, or GradScaler.step ran (and maybe skipped it)
        self.scaler = GradScalerStepWatch(is_active, before_scaler_step or _nothing, self._after_scaler_step)
        self._after_scaler = after_scaler_step
        self._gradients_only = forwards_with_gradients_only
        self._forwards = ForwardSteps()

    def install(self) -> None:
        self.scaler.install()

    def remove(self) -> None:
        self.scaler.remove()

    def optimizer_step_begins(self) -> None:
        self.optimizer_seen = True
        self.paused += 1

    def optimizer_step_returned(self) -> None:
        self.paused = max(0, self.paused - 1)

    def end_after_optimizer_step(self) -> None:
        """The outermost optimizer.step returned, not inside GradScaler.step (which ends the step itself)."""
        if self.automatic and self.paused == 0 and not self.scaler.inside:
            self.on_end(False, None)

    def _after_scaler_step(self, skipped: bool, loss_scale: float) -> None:
        self.optimizer_seen = True
        if self._after_scaler is not None:
            self._after_scaler(skipped, loss_scale)
        if self.automatic and not self.scaler.inside:  # the outermost of nested GradScaler.steps
            self.on_end(skipped, loss_scale)

    def root_forward(self, module) -> None:
        """Without an optimizer, a new forward of the first root module ends the step (with gradients
        enabled only, under forwards_with_gradients_only)."""
        if (self.automatic and not self.optimizer_seen
                and (not self._gradients_only or torch.is_grad_enabled()) and self._forwards.new_step(module)):
            self.on_end(False, None)


def _nothing() -> None:
    pass
