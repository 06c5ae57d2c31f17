"""watch: what every reader of a running script needs, once, below the readers.

The dump, the overflow detector, the monitor and the profiler are clients of this layer: the
profiler and accuracy/ import nothing of each other, and the device takes nothing of a reader, only
the collective mark from here. (Inside accuracy/, the overflow detector and the monitor still take
the dump's statistics buffer and hook guard from dump.py.)

    scaler_steps.py   GradScalerStepWatch: GradScaler.step/unscale_/update, whether a step was skipped
    steps.py          TrainingSteps: where a training step ends (optimizer.step, GradScaler's steps);
                      ForwardSteps: without an optimizer, a step per new forward of the first root module;
                      RunSteps: the two as the monitor joins them (forwards with gradients until an
                      optimizer steps), for --replay-step and --stop-after-step
    stop.py           StopAfterStep: --stop-after-step N ends the run once step N (RunSteps') ended
    collectives.py    COLLECTIVE_MARK: the range the emulated device records around each collective
"""
