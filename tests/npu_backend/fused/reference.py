"""Shared checks of the fused-op tests: an op against an unfused fp64 reference written in the test
from torch_npu's documented semantics, forward and backward, in fp32 and in low precision."""

from __future__ import annotations

import torch

# Tolerances of a low-precision fused op against its fp64 reference: one rounding of the output to
# the dtype plus fp32 accumulation (relative to the output's scale).
LOW_PRECISION_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def assert_close_to_reference(actual, expected, dtype: torch.dtype, what: str, factor: float = 1.0):
    error = relative_error(actual, expected)
    bound = LOW_PRECISION_TOLERANCE[dtype] * factor
    assert error <= bound, f"{what}: relative L2 error {error:.3g} > {bound:.3g} ({dtype})"


def grads_of(fn, *inputs, grad_output=None):
    """Output and gradients of fn's first output w.r.t. every input that requires grad."""
    out = fn(*inputs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    if grad_output is None:
        grad_output = torch.ones_like(first)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(first, leaves, grad_output)
    return first, grads
