"""watch: what every reader of a running script needs, once, below the readers.

The dump, the overflow detector, the monitor and the profiler are clients of this layer; none of
them imports another, and the device imports nothing here but the collective mark's protocol.

    scaler_steps.py   GradScalerStepWatch: GradScaler.step/unscale_/update, whether a step was skipped
    steps.py          TrainingSteps: where a training step ends (optimizer.step, GradScaler's steps);
                      ForwardSteps: without an optimizer, a step per new forward of the first root module
    collectives.py    COLLECTIVE_MARK: the range the emulated device records around each collective
"""
