import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference, grads_of, relative_error


def rms_norm_fp64(x, gamma, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()


def test_rms_norm_is_one_op_in_torch_ops_npu():
    assert torch_npu.npu_rms_norm is torch.ops.npu.npu_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_forward_and_backward_against_fp64(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 7, 64, dtype=torch.float64)
    gamma = torch.randn(64, dtype=torch.float64)
    dy = torch.randn(4, 7, 64, dtype=torch.float64)
    x_ref, g_ref = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    y_ref, (dx_ref, dg_ref) = grads_of(lambda a, b: rms_norm_fp64(a, b, 1e-6), x_ref, g_ref, grad_output=dy)

    x_npu = x.to(dtype).npu().requires_grad_()
    g_npu = gamma.to(dtype).npu().requires_grad_()
    y, rstd = torch_npu.npu_rms_norm(x_npu, g_npu, epsilon=1e-6)
    assert y.dtype == dtype and y.device.type == "npu"
    assert rstd.dtype == torch.float32 and rstd.shape == (4, 7, 1)
    dx, dg = torch.autograd.grad(y, [x_npu, g_npu], dy.to(dtype).npu())
    assert_close_to_reference(y, y_ref, dtype, "y")
    assert_close_to_reference(dx, dx_ref, dtype, "dx", factor=2)
    assert_close_to_reference(dg, dg_ref, dtype, "dgamma", factor=2)


def test_rms_norm_fp16_rounds_once_like_the_kernel():
    """fp16 in, fp32 inside, one rounding out: the result is the fp64 reference rounded to fp16
    (an unfused fp16 decomposition rounds after every op and is further off)."""
    torch.manual_seed(1)
    x = (torch.randn(8, 256) * 30).half()
    gamma = torch.randn(256).half()
    y = torch_npu.npu_rms_norm(x.npu(), gamma.npu())[0].cpu()
    exact = rms_norm_fp64(x, gamma, 1e-6)
    assert torch.equal(y, exact.half()) or relative_error(y, exact) <= relative_error(exact.half(), exact) * 1.01
    unfused = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma)
    assert relative_error(y, exact) < relative_error(unfused, exact)


def test_rms_norm_golden_run_is_the_fp32_reference():
    x = torch.randn(3, 32).half()
    gamma = torch.randn(32).half()
    with numerics.golden():
        golden = torch_npu.npu_rms_norm(x.npu(), gamma.npu())[0].cpu()
    cpu = torch_npu.npu_rms_norm(x, gamma)[0]
    assert torch.equal(golden, cpu)


def test_rms_norm_under_compile_equals_eager():
    x = torch.randn(2, 5, 16).npu()
    gamma = torch.randn(16).npu()
    compiled = torch.compile(lambda a, b: torch_npu.npu_rms_norm(a, b)[0] * 2, backend="npu", fullgraph=True)
    torch.testing.assert_close(compiled(x, gamma).cpu(), (torch_npu.npu_rms_norm(x, gamma)[0] * 2).cpu())


def test_rms_norm_under_autocast_takes_mixed_dtypes():
    x = torch.randn(2, 16).npu()
    gamma = torch.randn(16).npu()
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(x, torch.randn(16, 16).npu())
        y = torch_npu.npu_rms_norm(h, gamma)[0]
    assert y.dtype == torch.float16
    assert_close_to_reference(y, rms_norm_fp64(h.cpu(), gamma.cpu(), 1e-6), torch.float16, "y")
