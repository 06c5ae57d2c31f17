"""What a reader needs to know of the process it watches: its rank, and where its npu tensors live."""

from __future__ import annotations

import os
import sys

import torch

from npukit.errors import UserError


def rank_from_env() -> int:
    value = os.environ.get("RANK", "0")
    try:
        rank = int(value)
    except ValueError:
        raise UserError(f"RANK environment variable: {value!r} is not an integer") from None
    if rank < 0:
        raise UserError(f"RANK environment variable: {value!r} is negative")
    return rank


def npu_in_host_memory() -> bool:
    """The npu device is npukit's emulated one, whose tensors live in host memory (not torch_npu's)."""
    return "npukit.npu_backend" in sys.modules


def host_memory(tensor: torch.Tensor) -> bool:
    """True where reading a value back costs no device sync (CPU, and the emulated NPU)."""
    if tensor.is_cpu:
        return True
    return tensor.device.type == "npu" and npu_in_host_memory()
