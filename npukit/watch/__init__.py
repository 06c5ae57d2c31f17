"""watch: what every reader of a running script needs, once, below the readers.

The dump, the overflow detector, the monitor and the profiler are clients of this layer: the
profiler and accuracy/ import nothing of each other, and the device takes nothing of a reader, only
the collective mark from here. Inside accuracy/, the dump, the overflow detector and the monitor
take what they share from here too, none from another's module.

    scaler_steps.py   GradScalerStepWatch: GradScaler.step/unscale_/update, whether a step was skipped
    steps.py          TrainingSteps: where a training step ends (optimizer.step, GradScaler's steps;
                      the profiler's steps); ForwardSteps: without an optimizer, a step per new
                      forward of the first root module; RunSteps: the two joined (forwards with
                      gradients until an optimizer steps), the monitor's steps and those of
                      --replay-step and --stop-after-step; RecordedSteps: the dump's and the overflow
                      detector's (recording paused inside optimizer.step, a step per optimizer.step or
                      GradScaler.step: why they differ is in steps.py)
    stop.py           StopAfterStep: --stop-after-step N ends the run once step N (RunSteps') ended
    collectives.py    COLLECTIVE_MARK: the range the emulated device records around each collective
    op_hooks.py       ApiMode: the TorchFunctionMode that hands every torch / functional / Tensor
                      call to a reader's handler (the dump's, the overflow detector's), named as
                      the reader says (accuracy.naming.MsprobeOpNames)
    module_hooks.py   ModuleHooks: a reader's global module forward hooks over the modules running
                      (outermost first): torch.compile's wrapper passed over (the model inside still
                      named), root forwards told to the reader's step count before its enter, a post
                      hook popping only its own module, also when forward raised; the reader keeps
                      what it records (the dump's, the overflow detector's and the monitor's)
    hook_guard.py     a reader's hook that fails is reported once and switched off, the run goes
                      on (unintercepted, hook_failed, revive_hooks); readers listening are told
    tensors.py        the tensors a hook is handed: tensors_in (nested arguments), tensor_version
                      (and ops_ran, for inference tensors), real_view, local_shard, strided_form
    process.py        rank_from_env; npu_in_host_memory, host_memory: where a read costs no sync
    tensor_stats.py   tensor_stats: max, min, mean, norm, nan and inf counts on the tensor's device
                      (one pass on host memory, with the compiled kernels below); StatsBuffer: a
                      step's statistics fetched with one device->host copy
    csrc/             the one-pass kernels over host buffers, compiled as _stats (no torch: also the
                      compare's pair metrics, the dump's CRC-32 and the monitor's Adam statistics and
                      CRC-32C, whose readers import them from here) and _tensor_stats (given a tensor)
"""
