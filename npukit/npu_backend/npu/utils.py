"""torch_npu.npu.utils: the overflow flag of the emulated device and version queries."""

from __future__ import annotations

import math

import torch

from npukit.npu_backend import numerics

__all__ = ["npu_check_overflow", "get_npu_overflow_flag", "clear_npu_overflow_flag", "is_support_inf_nan",
           "is_force_overflow_check", "get_cann_version", "get_soc_version"]

# torch_npu's SocVersion numbers (torch_npu/csrc/core/npu/NpuVariables.h in the wheel) of the chips
# NPUKIT_CHIP can name: code picks kernels and build targets by them (`get_soc_version() >= 220`: 910B).
SOC_VERSIONS = {"Ascend910A": 102, "Ascend910B1": 220, "Ascend910B2": 221, "Ascend910B3": 223, "Ascend910B4": 224,
                "Ascend910_9391": 250}


def is_support_inf_nan() -> bool:
    """True in INF_NAN mode (910B default); False when fp16 saturation mode is on."""
    return numerics.fp16_mode() == "inf_nan"


def is_force_overflow_check() -> bool:
    return False


def get_npu_overflow_flag() -> bool:
    """The sticky float-status flag: set when a saturating fp16 op clamped a value."""
    return numerics.overflow_flag()


def clear_npu_overflow_flag() -> None:
    numerics.clear_overflow_flag()


def npu_check_overflow(grad) -> bool:
    """As torch_npu: in INF_NAN mode look for inf/nan in `grad`; else read and clear the flag."""
    if is_support_inf_nan():
        value = float(grad.float().sum()) if isinstance(grad, torch.Tensor) else float(grad)
        return math.isinf(value) or math.isnan(value)
    overflowed = numerics.overflow_flag()
    numerics.clear_overflow_flag()
    return overflowed


def get_cann_version(module: str = "CANN") -> str:
    return "emulated"


def get_soc_version() -> int:
    """The emulated chip's SocVersion number, as torch_npu.npu.utils.get_soc_version() returns it."""
    from npukit.npu_backend.npu import CHIP_NAME  # (this module is imported while the package initialises)

    return SOC_VERSIONS[CHIP_NAME]
