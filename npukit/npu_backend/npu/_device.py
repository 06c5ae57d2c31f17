"""Device selection helpers shared by the torch.npu submodules."""

from __future__ import annotations

import torch

from npukit.npu_backend import _C


def device_index(device=None, optional: bool = True) -> int:
    """Resolve None / int / "npu:1" / torch.device to a device index (None -> current)."""
    if device is None:
        return _C.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"Expected an npu device, got {device}")
        return _C.current_device() if device.index is None else device.index
    if isinstance(device, int):
        if device < 0:
            return _C.current_device()
        if device >= _C.device_count():
            raise RuntimeError(f"Invalid device id: npu:{device} (device count is {_C.device_count()})")
        return device
    raise TypeError(f"Expected an npu device (int, str or torch.device), got {device!r}")
