"""Where a training step ends, for readers that count steps without taking part in them.

A step ends when optimizer.step() returns; with several optimizers, at the step of the first one
that stepped (one training step, not one per optimizer). Under GradScaler it ends when
GradScaler.update returns (its ops are the step's), also when GradScaler.step skipped
optimizer.step (inf/nan gradients), or, without an update call, when the next GradScaler.step
starts. The dump and the overflow detector, which pause their recording inside optimizer.step and
end the step at GradScaler.step, use GradScalerStepWatch directly.

A script with no optimizer (inference, or updates made by hand) has no optimizer.step: there a
step ends each time its first root module starts a new forward (ForwardSteps).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

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
        return root is module and not self._optimizer_alive()

    def _optimizer_alive(self) -> bool:
        if self._optimizer_exists is None:
            # type(obj), not isinstance: isinstance reads __class__, which deprecated objects warn on
            import torch

            optimizer = torch.optim.Optimizer
            self._optimizer_exists = any(issubclass(type(obj), optimizer) for obj in gc.get_objects())
        return self._optimizer_exists
