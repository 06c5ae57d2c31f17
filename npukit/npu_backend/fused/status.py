"""The float-status ops older Ascend mixed-precision code checks overflow with (apex-style loss
scalers, Megatron's NPU patches): they read and clear the device's sticky overflow flag, the register
npukit's saturation mode sets (`numerics.overflow_flag()`).

The status is 8 float32 values; the flag is the first (a sum or any() of the tensor reads it, as
the code that calls these ops does). `mode` selects the status register on the hardware; the
emulator has one flag.
"""

from __future__ import annotations

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.fused import fused_op

STATUS_SIZE = 8


def _status(like: torch.Tensor, overflowed: bool) -> torch.Tensor:
    status = torch.zeros(STATUS_SIZE, dtype=torch.float32, device=like.device)
    if overflowed:
        status[0] = 1.0
    return status


@fused_op("npu_alloc_float_status(Tensor input) -> Tensor", unfused="torch.zeros(8)",
          fake=lambda x: x.new_empty(STATUS_SIZE, dtype=torch.float32))
def npu_alloc_float_status(x):
    return _status(x, False)


def _reads_flag(x: torch.Tensor) -> bool:
    return x.device.type == "npu" and _C.get_overflow_flag()


@fused_op("npu_get_float_status(Tensor input, int mode=0) -> Tensor",
          unfused="torch.npu.utils.get_npu_overflow_flag()",
          fake=lambda x, mode=0: x.new_empty(STATUS_SIZE, dtype=torch.float32))
def npu_get_float_status(x, mode=0):
    return _status(x, _reads_flag(x))


@fused_op("npu_clear_float_status(Tensor input, int mode=0) -> Tensor",
          unfused="torch.npu.utils.clear_npu_overflow_flag()",
          fake=lambda x, mode=0: x.new_empty(STATUS_SIZE, dtype=torch.float32))
def npu_clear_float_status(x, mode=0):
    if x.device.type == "npu":
        _C.set_overflow_flag(False)
    return _status(x, False)
