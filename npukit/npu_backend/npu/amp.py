"""torch.npu.amp / torch_npu.npu.amp: autocast, GradScaler, custom_fwd, custom_bwd for "npu".

The cast policies are PyTorch's CUDA autocast lists, registered for the npu autocast key.

GradScaler on npu finds overflow in both fp16 modes. In INF_NAN mode overflow shows as inf/nan
gradients, which the stock scaler finds. In saturation mode (NPUKIT_FP16_MODE=saturation) the
device clamps fp16 results to +-65504, so gradients stay finite: like torch_npu's scaler, the
npu scaler then takes found_inf from the sticky overflow flag. The flag window of a step runs
from the previous update() (for the first step: the scaler's creation) to unscale_(), so an
overflow in the forward or backward of any micro-batch of the step skips it. Under
torch.distributed the flag is all-reduced, so every rank skips the same steps.
"""

from __future__ import annotations

import functools

import torch

from npukit.npu_backend import numerics

__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd"]


class autocast(torch.amp.autocast_mode.autocast):
    """`torch.npu.amp.autocast(dtype=torch.float16)`, the same as `torch.autocast("npu", ...)`."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """`torch.npu.amp.GradScaler(...)`, the same as `torch.amp.GradScaler("npu", ...)`.

    `dynamic=False` (torch_npu's static loss scale): overflowing steps are still skipped, but
    update() keeps the scale at `init_scale`.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, dynamic: bool = True):
        super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.dynamic = dynamic

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self.dynamic or new_scale is not None or not self._enabled:
            super().update(new_scale)
        else:
            super().update(float(self._init_scale))


custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="npu")
custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="npu")


# ---------------------------------------------------------------- overflow flag for every npu scaler
# `torch.amp.GradScaler("npu")` is PyTorch's own class, so the flag is wired into it (for npu
# scalers only); torch.npu.amp.GradScaler and torch.cuda.amp.GradScaler inherit it.

def _reads_overflow_flag(scaler: torch.amp.GradScaler) -> bool:
    return scaler._device == "npu" and scaler._enabled and numerics.fp16_mode() == "saturation"


def _step_overflowed() -> bool:
    overflowed = numerics.overflow_flag()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A CPU tensor works on every default group: hccl serves CPU tensors through gloo too.
        flag = torch.tensor([1.0 if overflowed else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        overflowed = bool(flag.item())
    return overflowed


def _wire_overflow_flag(cls: type) -> None:
    """Make `cls`'s own _unscale_grads_ and update read and reset the flag (npu scalers only).

    torch.amp.GradScaler is wired at import; a subclass that overrides them (FSDP's
    ShardedGradScaler, a user's scaler) is wired when its first instance is created.
    """
    if cls.__dict__.get("_npukit_overflow_flag", False):
        return
    stock_unscale_grads, stock_update = cls.__dict__.get("_unscale_grads_"), cls.__dict__.get("update")

    if stock_unscale_grads is not None:
        @functools.wraps(stock_unscale_grads)
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            per_device_found_inf = stock_unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16)
            if _reads_overflow_flag(self) and _step_overflowed():
                for device_found_inf in per_device_found_inf.values():
                    device_found_inf.fill_(1.0)
            return per_device_found_inf

        cls._unscale_grads_ = _unscale_grads_

    if stock_update is not None:
        @functools.wraps(stock_update)
        def update(self, new_scale=None):
            stock_update(self, new_scale)
            if _reads_overflow_flag(self):
                numerics.clear_overflow_flag()  # the next step's window opens here

        cls.update = update
    cls._npukit_overflow_flag = True


def _install_overflow_flag_checks() -> None:
    scaler_cls = torch.amp.GradScaler
    if scaler_cls.__dict__.get("_npukit_overflow_flag", False):
        return
    stock_init = scaler_cls.__init__

    @functools.wraps(stock_init)
    def __init__(self, *args, **kwargs):
        for cls in type(self).__mro__:
            if cls is scaler_cls:
                break
            _wire_overflow_flag(cls)
        stock_init(self, *args, **kwargs)
        if _reads_overflow_flag(self):
            numerics.clear_overflow_flag()  # the first step's window opens here

    scaler_cls.__init__ = __init__
    _wire_overflow_flag(scaler_cls)


_install_overflow_flag_checks()
