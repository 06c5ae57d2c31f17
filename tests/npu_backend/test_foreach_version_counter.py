"""In-place foreach ops on npu tensors bump the version counter, as on the CPU (found while running
VeOmni's training under npu-run --detect-overflow; the device kernel bumps every tensor an op
returning nothing wrote, as CUDA's foreach kernels do).

Without the bump autograd cannot see that a foreach update overwrote a tensor saved for backward:
on the CPU `backward()` raises 'one of the variables needed for gradient computation has been
modified by an inplace operation', on the emulated npu it returns a wrong gradient silently.
torch.optim's default (foreach) Adam/AdamW/SGD update npu parameters this way."""

from __future__ import annotations

import pytest
import torch

import npukit.npu_backend  # noqa: F401  the emulated npu device

NPU = "npu:0"


def test_foreach_in_place_ops_bump_the_version():
    tensor, other = torch.ones(4, device=NPU), torch.ones(4, device=NPU)
    before = tensor._version
    torch._foreach_add_([tensor], [other])
    torch._foreach_mul_([tensor], 2.0)
    assert tensor._version == before + 2


def test_a_saved_tensor_overwritten_by_a_foreach_op_is_refused_in_backward():
    x = torch.ones(4, device=NPU, requires_grad=True)
    y = x * 1
    z = y.sin()  # saves y
    with torch.no_grad():
        torch._foreach_add_([y], [torch.ones(4, device=NPU)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
