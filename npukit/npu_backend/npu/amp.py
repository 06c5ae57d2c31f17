"""torch.npu.amp / torch_npu.npu.amp: autocast, GradScaler, custom_fwd, custom_bwd for "npu".

The cast policies are PyTorch's CUDA autocast lists, registered for the npu autocast key.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd"]


class autocast(torch.amp.autocast_mode.autocast):
    """`torch.npu.amp.autocast(dtype=torch.float16)`, the same as `torch.autocast("npu", ...)`."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """`torch.npu.amp.GradScaler(...)`, the same as `torch.amp.GradScaler("npu", ...)`."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, dynamic: bool = True):
        super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.dynamic = dynamic


custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="npu")
custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="npu")
