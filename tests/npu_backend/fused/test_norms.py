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


def test_rms_norm_backward_is_on_torch_npu_for_a_hand_written_autograd_function():
    """Code written for Ascend wraps the forward and grad ops in its own autograd.Function, calling
    torch_npu.npu_rms_norm_backward (the wheel exports every op of torch.ops.npu, grad ops included)."""

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, gamma):
            y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6)
            ctx.save_for_backward(x, gamma, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, gamma, rstd = ctx.saved_tensors
            return torch_npu.npu_rms_norm_backward(dy, x, gamma, rstd)

    torch.manual_seed(0)
    x, gamma, dy = torch.randn(3, 5, 32).npu(), torch.randn(32).npu(), torch.randn(3, 5, 32).npu()
    x_op, g_op = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    expected = torch.autograd.grad(torch_npu.npu_rms_norm(x_op, g_op, epsilon=1e-6)[0], [x_op, g_op], dy)
    x_fn, g_fn = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    got = torch.autograd.grad(RMSNorm.apply(x_fn, g_fn), [x_fn, g_fn], dy)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


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


# ---- npu_add_rms_norm, npu_gemma_rms_norm, npu_layer_norm_eval -----------------------------------

def layer_norm_fp64(x, normalized_shape, weight, bias, eps):
    x = x.double()
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_rms_norm_returns_y_rstd_and_the_sum(dtype):
    torch.manual_seed(2)
    x1, x2 = torch.randn(3, 5, 32, dtype=torch.float64), torch.randn(3, 5, 32, dtype=torch.float64)
    gamma = torch.randn(32, dtype=torch.float64)
    x1_l, x2_l, g_l = x1.to(dtype), x2.to(dtype), gamma.to(dtype)
    y, rstd, x = torch_npu.npu_add_rms_norm(x1_l.npu(), x2_l.npu(), g_l.npu(), 1e-6)
    assert y.dtype == x.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    total = (x1_l.double() + x2_l.double()).to(dtype)
    assert torch.equal(x.cpu(), total)  # the sum, rounded once to the dtype ...
    total = total.double()  # ... is what the kernel normalises
    assert_close_to_reference(y, rms_norm_fp64(total, g_l, 1e-6), dtype, "y", factor=1.5)
    assert_close_to_reference(rstd, torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6), torch.float32, "rstd")


def test_add_rms_norm_fp16_keeps_the_kernels_intermediates_in_fp16():
    """CANN's AddRmsNorm rounds the sum and x * rstd to fp16 before multiplying by an fp16 gamma;
    an fp32 gamma multiplies the fp32 value; the golden run rounds only its outputs."""
    torch.manual_seed(3)
    x1, x2 = (torch.randn(16, 256) * 3).half(), (torch.randn(16, 256) * 3).half()
    gamma = (torch.rand(256) + 0.5).half()
    x = (x1.double() + x2.double()).half().double()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    kernel = ((x * rstd).half().double() * gamma.double()).half()
    y = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.npu())[0].cpu()
    assert (y != kernel).float().mean() < 0.01
    y_fp32_gamma = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.float().npu())[0].cpu()
    assert (y_fp32_gamma != (x * rstd * gamma.double()).half()).float().mean() < 0.01
    with numerics.golden():
        golden = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.npu())[0].cpu()
    exact = (x1.double() + x2.double()) * torch.rsqrt((x1.double() + x2.double()).pow(2).mean(-1, keepdim=True)
                                                      + 1e-6) * gamma.double()
    assert (golden != exact.half()).float().mean() < 0.01
    assert (y != golden).any()


def test_add_rms_norm_over_two_dims_of_gamma():
    x1, x2 = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    gamma = torch.randn(6, 8)
    y, rstd, _ = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.npu())
    total = (x1 + x2).double()
    expected = total * torch.rsqrt(total.pow(2).mean((1, 2), keepdim=True) + 1e-6) * gamma.double()
    assert rstd.shape == (4, 1, 1)
    assert_close_to_reference(y, expected, torch.float32, "y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gemma_rms_norm_scales_by_one_plus_gamma(dtype):
    x = torch.randn(4, 7, 64, dtype=torch.float64)
    gamma = torch.randn(64, dtype=torch.float64) * 0.1
    y, rstd = torch_npu.npu_gemma_rms_norm(x.to(dtype).npu(), gamma.to(dtype).npu(), 1e-6)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (4, 7, 1)
    assert_close_to_reference(y, rms_norm_fp64(x.to(dtype), 1 + gamma.to(dtype).double(), 1e-6), dtype, "y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_eval_is_layer_norm(dtype, affine):
    x = torch.randn(3, 4, 16, dtype=torch.float64) * 3 + 1
    weight = torch.randn(4, 16, dtype=torch.float64) if affine else None
    bias = torch.randn(4, 16, dtype=torch.float64) if affine else None
    low = [t.to(dtype) if t is not None else None for t in (x, weight, bias)]
    y = torch_npu.npu_layer_norm_eval(low[0].npu(), [4, 16], *(t.npu() if t is not None else None for t in low[1:]),
                                      eps=1e-5)
    assert y.dtype == dtype
    assert_close_to_reference(y, layer_norm_fp64(low[0], (4, 16), low[1], low[2], 1e-5), dtype, "y")


@pytest.mark.parametrize("call", [
    lambda x, g: torch_npu.npu_add_rms_norm(x, x, g)[0],
    lambda x, g: torch_npu.npu_gemma_rms_norm(x, g)[0],
    lambda x, g: torch_npu.npu_layer_norm_eval(x, [16], g),
])
def test_norms_without_a_torch_npu_derivative_raise_on_backward(call):
    x = torch.randn(2, 16).npu().requires_grad_()
    y = call(x, torch.randn(16).npu())
    with pytest.raises(NotImplementedError, match="derivative for torch_npu.npu_.* is not implemented"):
        y.sum().backward()


def test_norm_arguments_the_op_refuses_raise_naming_it():
    with pytest.raises(ValueError, match="npu_add_rms_norm.*same shape"):
        torch_npu.npu_add_rms_norm(torch.randn(2, 8).npu(), torch.randn(3, 8).npu(), torch.randn(8).npu())
    with pytest.raises(ValueError, match="npu_gemma_rms_norm.*gamma"):
        torch_npu.npu_gemma_rms_norm(torch.randn(2, 8).npu(), torch.randn(4).npu())
    with pytest.raises(ValueError, match="npu_layer_norm_eval.*normalized_shape"):
        torch_npu.npu_layer_norm_eval(torch.randn(2, 8).npu(), [4])


def test_other_norms_golden_run_is_the_cpu_kernel():
    x1, x2 = torch.randn(3, 32).half(), torch.randn(3, 32).half()
    gamma = torch.randn(32).half()
    ops = [lambda a, b, g: torch_npu.npu_add_rms_norm(a, b, g)[0],
           lambda a, b, g: torch_npu.npu_gemma_rms_norm(a, g)[0],
           lambda a, b, g: torch_npu.npu_layer_norm_eval(a, [32], g, g)]
    for op in ops:
        with numerics.golden():
            golden = op(x1.npu(), x2.npu(), gamma.npu()).cpu()
        assert torch.equal(golden, op(x1, x2, gamma))


def test_other_norms_under_compile_and_autocast():
    x1, x2 = torch.randn(2, 5, 16).npu(), torch.randn(2, 5, 16).npu()
    gamma = torch.randn(16).npu()

    def f(a, b, g):
        y, _, s = torch_npu.npu_add_rms_norm(a, b, g)
        return y + torch_npu.npu_gemma_rms_norm(s, g)[0] + torch_npu.npu_layer_norm_eval(s, [16], g, g)

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    torch.testing.assert_close(compiled(x1, x2, gamma).cpu(), f(x1, x2, gamma).cpu())
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(x1, torch.randn(16, 16).npu())
        y, rstd, s = torch_npu.npu_add_rms_norm(h, x2.half(), gamma)
    assert y.dtype == s.dtype == torch.float16
    total = h.cpu().double() + x2.half().cpu().double()
    assert_close_to_reference(y, rms_norm_fp64(total, gamma.cpu(), 1e-6), torch.float16, "y")
