"""npu-run --stop-after-step N: the run ends once training step N (0-based, as --dump-steps counts)
has ended, so a re-run that only needs steps 0..N (npu-compare --localize's) does not run the rest.

Steps are counted as the monitor counts them (watch.steps.RunSteps): at each optimizer step or, in a
script without an optimizer (weights updated by hand), as its first model starts a new forward with
gradients enabled. The run is stopped as the next module forward starts, not inside the step's end:
every reader's own step-end work (the dump writing step N, or under forward steps, the dump and the
monitor writing the step in progress as they stop) has run by then. StoppedAfterStep derives from
BaseException so that a script's `except Exception` does not take it for its own error; npu-run
exits 0 on it.
"""

from __future__ import annotations


class StoppedAfterStep(BaseException):
    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step} (--stop-after-step)")
        self.step = step


class StopAfterStep:
    def __init__(self, step: int) -> None:
        # here, not at the top: npu-run imports the exception before torch may be imported
        from npukit.errors import UserError
        from npukit.watch.steps import RunSteps

        if step < 0:
            raise UserError(f"--stop-after-step: a step number is >= 0, not {step}")
        self.step = step
        self.steps_ended = 0
        self._steps = RunSteps(self._on_step_end)
        self._handle = None

    def __enter__(self) -> StopAfterStep:
        from torch.nn.modules import module as module_hooks

        self._steps.install()  # first: a step that ends as a forward starts has ended when _on_forward runs
        self._handle = module_hooks.register_module_forward_pre_hook(self._on_forward)
        return self

    def __exit__(self, *exc_info) -> None:
        self._steps.remove()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_step_end(self, optimizer, skipped: bool, loss_scale) -> None:
        self.steps_ended += 1

    def _on_forward(self, module, args) -> None:
        if self.steps_ended > self.step:
            raise StoppedAfterStep(self.step)
