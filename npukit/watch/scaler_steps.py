"""GradScaler.step ends a training step even when it skips optimizer.step.

Steps that end at optimizer.step (steps.TrainingSteps, steps.RecordedSteps) would otherwise run
a skipped step (inf/nan gradients under loss scaling) into the next one. While installed, the
watch wraps GradScaler.step (and so every subclass that does not override it) and tells its
session, around each enabled call, whether the optimizer stepped. It also marks the time spent
in GradScaler's own bookkeeping (step, unscale_, update): those ops are not the model's, and
update's, run after the step ended, would otherwise open the next step. And it keeps the scalers
it saw step, in the order of their first GradScaler.step (scalers()): the scalers a script uses,
whose state --replay-step records and loads with the optimizers' (replay.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class GradScalerStepWatch:
    """before(): called as GradScaler.step starts (the gradients are still scaled).
    after(skipped, scale): called when it returns; skipped when no optimizer.step ran inside.
    `inside` > 0 while GradScaler.step, unscale_ or update runs: sessions record none of their
    ops, and optimizer hooks leave ending the step to `after`. `optimizer`: the optimizer of the
    GradScaler.step call in progress. updated(): called when GradScaler.update returns.
    scalers(): the enabled GradScalers whose step ran while active, in the order of their first."""

    def __init__(self, is_active: Callable[[], bool], before: Callable[[], None],
                 after: Callable[[bool, float], None], updated: Callable[[], None] | None = None) -> None:
        self.is_active, self.before, self.after, self.updated = is_active, before, after, updated
        self.inside = 0
        self.optimizer = None
        self._optimizer_steps = 0
        self._scalers: list[weakref.ref] = []
        self._installed: tuple | None = None

    def install(self) -> None:
        from torch.optim import optimizer as optimizer_hooks

        scaler_cls = torch.amp.GradScaler
        originals = {name: getattr(scaler_cls, name) for name in ("step", "unscale_", "update")}
        watch = self

        def bookkeeping(original):
            def run(scaler, *args, **kwargs):
                watch.inside += 1
                try:
                    return original(scaler, *args, **kwargs)
                finally:
                    watch.inside -= 1
            return run

        def step(scaler, optimizer, *args, **kwargs):
            if not watch.is_active() or not scaler.is_enabled():
                return originals["step"](scaler, optimizer, *args, **kwargs)
            if not any(ref() is scaler for ref in watch._scalers):
                watch._scalers.append(weakref.ref(scaler))
            scale = scaler.get_scale()
            watch.optimizer = optimizer
            try:
                watch.before()
                optimizer_steps = watch._optimizer_steps
                result = bookkeeping(originals["step"])(scaler, optimizer, *args, **kwargs)
                watch.after(watch._optimizer_steps == optimizer_steps, scale)
            finally:
                watch.optimizer = None
            return result

        def update(scaler, *args, **kwargs):
            result = bookkeeping(originals["update"])(scaler, *args, **kwargs)
            if watch.updated is not None and watch.is_active():
                watch.updated()
            return result

        def count(optimizer, args, kwargs) -> None:
            self._optimizer_steps += 1

        handle = optimizer_hooks.register_optimizer_step_pre_hook(count)
        scaler_cls.step = step
        scaler_cls.unscale_ = bookkeeping(originals["unscale_"])
        scaler_cls.update = update
        self._installed = (scaler_cls, originals, handle)

    def scalers(self) -> list:
        return [scaler for scaler in (ref() for ref in self._scalers) if scaler is not None]

    def remove(self) -> None:
        if self._installed is not None:
            owner, originals, handle = self._installed
            for name, original in originals.items():
                setattr(owner, name, original)
            handle.remove()
            self._installed = None
