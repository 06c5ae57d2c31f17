"""aten kernels of the emulated NPU that the host's CPU kernels cannot stand in for.

Every other aten op on an npu tensor runs the CPU kernel on the same memory (the boxed fallback
of csrc/device.cpp). The ops here are those whose CPU kernel refuses inputs the device accepts:

- `histc` of an integer tensor. The CPU kernel takes floating-point input only ("histogram_cpu"
  not implemented for 'Int'); the device's, like CUDA's, counts integer tensors too, in the
  input's dtype. transformers' MoE experts (Mixtral, Qwen2-MoE, ... `grouped_mm` experts) count
  the tokens routed to each expert with `torch.histc(expert_ids.int(), ...)` on every device
  but cpu and mps, so without this no MoE model trains on the emulated NPU.
"""

from __future__ import annotations

import torch

_library: torch.library.Library | None = None


def _type_name(dtype: torch.dtype) -> str:
    """torch's C++ name of a dtype in its messages: float, long int, c10::Half ..."""
    return {torch.float32: "float", torch.float64: "double", torch.int64: "long int", torch.int32: "int",
            torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
            torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}.get(dtype, str(dtype))


def _histc(self: torch.Tensor, bins: int = 100, min=0, max=0) -> torch.Tensor:
    # The CPU kernel runs on a host copy: integers counted in float64 (exact below 2**53,
    # where float32 would merge neighbouring large ids into one bin), the counts in the
    # input's dtype, as the device returns them.
    host = self.detach().to("cpu")
    counted = host if host.is_floating_point() else host.to(torch.float64)
    counts = torch.histc(counted, bins=bins, min=min, max=max)
    return counts.to(self.dtype).to(self.device)


def _histc_out(self: torch.Tensor, bins: int = 100, min=0, max=0, *, out: torch.Tensor) -> torch.Tensor:
    # out= is checked as the CPU and CUDA kernels check it: the input's dtype and device
    if out.dtype != self.dtype:
        raise RuntimeError(f"torch.histogram: input tensor and hist tensor should have the same dtype, but got "
                           f"input {_type_name(self.dtype)} and hist {_type_name(out.dtype)}")
    if out.device != self.device:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{self.device} and {out.device}! (when checking argument for argument out in method "
                           "wrapper_PrivateUse1_out_histc_out)")
    counts = _histc(self, bins, min, max)
    out.resize_(counts.shape)
    out.copy_(counts)
    return out


def install() -> None:
    """Register the kernels for the npu (PrivateUse1) key (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("histc", _histc, "PrivateUse1")
    library.impl("histc.out", _histc_out, "PrivateUse1")
    _library = library
