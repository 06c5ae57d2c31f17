import math

import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference, grads_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# fp64 references from torch_npu's documented formulas (written out, not through torch's activations).

def sigmoid64(x):
    return 1 / (1 + torch.exp(-x))


def silu64(x):
    return x * sigmoid64(x)


def gelu64(x, approximate):
    if approximate == 1:  # tanh
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def swiglu64(x, dim=-1):
    a, b = x.chunk(2, dim)  # A * sigmoid(A) * B
    return silu64(a) * b


def geglu64(x, dim=-1, approximate=1, activate_left=False):
    a, b = x.chunk(2, dim)
    if activate_left:  # Gelu(A) * B
        return gelu64(a, approximate) * b
    return a * gelu64(b, approximate)  # A * Gelu(B): the right half is activated by default


def fast_gelu64(x):
    # torch_npu's formula 1 (the training series' form): x / (1 + e^{-1.702|x|}) e^{0.851 (x - |x|)}; the docs
    # print the exponent as "0.851x(x-|x|)", where the first x is the multiplication sign (read literally it
    # is e^{1.702 x^2} for x < 0, which is no gelu; formula 2, x / (1 + e^{-1.702x}), is the same function)
    return x / (1 + torch.exp(-1.702 * x.abs())) * torch.exp(0.851 * (x - x.abs()))


def mish64(x):
    return x * torch.tanh(torch.log1p(torch.exp(x)))


def check_forward_backward(op, reference, x64, dtype, factor=1.0, out_index=None):
    """op on npu in `dtype` against the fp64 reference, output and input gradient."""
    torch.manual_seed(3)
    x_ref = x64.clone().requires_grad_()
    y_ref = reference(x_ref)
    dy = torch.randn_like(y_ref)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)

    x = x64.to(dtype).npu().requires_grad_()
    out = op(x)
    y = out if out_index is None else out[out_index]
    assert y.dtype == dtype and y.device.type == "npu" and y.shape == y_ref.shape
    (dx,) = torch.autograd.grad(y, x, dy.to(dtype).npu())
    assert dx.dtype == dtype
    assert_close_to_reference(y, y_ref, dtype, "y", factor)
    assert_close_to_reference(dx, dx_ref, dtype, "dx", 2 * factor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_swiglu_against_fp64(dtype, dim):
    x = torch.randn(6, 8, 10, dtype=torch.float64) * 2
    check_forward_backward(lambda t: torch_npu.npu_swiglu(t, dim=dim), lambda t: swiglu64(t, dim), x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [0, 1])
@pytest.mark.parametrize("activate_left", [False, True])
def test_geglu_against_fp64_every_mode(dtype, approximate, activate_left):
    x = torch.randn(4, 6, 16, dtype=torch.float64) * 2
    check_forward_backward(
        lambda t: torch_npu.npu_geglu(t, dim=-1, approximate=approximate, activate_left=activate_left),
        lambda t: geglu64(t, -1, approximate, activate_left), x, dtype, out_index=0)


@pytest.mark.parametrize("activate_left", [False, True])
def test_geglu_returns_the_gelu_of_the_activated_half(activate_left):
    x = torch.randn(3, 8, dtype=torch.float64)
    y, gelu = torch_npu.npu_geglu(x.float().npu(), dim=1, approximate=0, activate_left=activate_left)
    a, b = x.chunk(2, 1)
    expected = gelu64(a if activate_left else b, 0)
    assert y.shape == gelu.shape == (3, 4)
    assert_close_to_reference(gelu, expected, torch.float32, "gelu")


@pytest.mark.parametrize("name", ["fast_gelu", "npu_fast_gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_gelu_is_the_documented_formula(name, dtype):
    x = torch.randn(5, 33, dtype=torch.float64) * 4
    check_forward_backward(getattr(torch_npu, name), fast_gelu64, x, dtype)


def test_fast_gelu_formulas_agree_and_differ_from_gelu():
    """The docs' two formulas (training series / A2) are one function, not torch's erf gelu."""
    x = torch.linspace(-8, 8, 101, dtype=torch.float64)
    assert torch.allclose(fast_gelu64(x), x / (1 + torch.exp(-1.702 * x)))
    y = torch_npu.npu_fast_gelu(x.float().npu()).cpu()
    assert torch.allclose(y.double(), fast_gelu64(x), atol=1e-6)
    assert not torch.allclose(y, torch.nn.functional.gelu(x.float()), atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mish_against_fp64(dtype):
    x = torch.randn(7, 9, dtype=torch.float64) * 3
    check_forward_backward(torch_npu.npu_silu, silu64, x, dtype)
    check_forward_backward(torch_npu.npu_mish, mish64, x, dtype)


def test_silu_in_place_writes_its_input_eager_and_compiled():
    x = torch.randn(4, 5)
    x_npu = x.npu()
    out = torch_npu.npu_silu_(x_npu)
    assert out is x_npu
    assert_close_to_reference(x_npu, silu64(x.double()), torch.float32, "npu_silu_")
    compiled = torch.compile(lambda t: torch_npu.npu_silu_(t) * 2, backend="npu", fullgraph=True)
    y = x.npu()
    result = compiled(y)
    assert torch.equal(y.cpu(), x_npu.cpu()) and torch.equal(result.cpu(), x_npu.cpu() * 2)


def test_backward_ops_are_ops_of_their_own():
    x = torch.randn(4, 8, dtype=torch.float64)
    dy = torch.randn(4, 4, dtype=torch.float64)
    dx = torch.ops.npu.npu_swiglu_backward(dy.float().npu(), x.float().npu(), -1)
    _, (dx_ref,) = grads_of(swiglu64, x.clone().requires_grad_(), grad_output=dy)
    assert_close_to_reference(dx, dx_ref, torch.float32, "npu_swiglu_backward")
    y = torch.ops.npu.npu_silu(x.float().npu())
    dx = torch.ops.npu.npu_silu_backward(dy.repeat(1, 2).float().npu(), x.float().npu(), y)
    _, (dx_ref,) = grads_of(silu64, x.clone().requires_grad_(), grad_output=dy.repeat(1, 2))
    assert_close_to_reference(dx, dx_ref, torch.float32, "npu_silu_backward")


def test_fp16_rounds_once_like_the_kernel():
    """fp16 in, fp32 inside, one rounding: exactly the fp64 reference rounded to fp16 (almost
    everywhere), where an fp16 decomposition rounds after each op."""
    torch.manual_seed(1)
    x = (torch.randn(64, 128) * 3).half()
    y = torch_npu.npu_swiglu(x.npu()).cpu()
    exact = swiglu64(x.double()).half()
    assert (y != exact).float().mean() < 0.01
    unfused = torch.nn.functional.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]
    assert (unfused != exact).float().mean() > (y != exact).float().mean()


def test_invalid_arguments_name_the_op():
    with pytest.raises(ValueError, match="npu_swiglu.*even"):
        torch_npu.npu_swiglu(torch.randn(3, 5).npu())
    with pytest.raises(ValueError, match="npu_geglu.*approximate"):
        torch_npu.npu_geglu(torch.randn(3, 4).npu(), approximate=2)
    with pytest.raises(ValueError, match="npu_geglu.*dim"):
        torch_npu.npu_geglu(torch.randn(3, 4).npu(), dim=2)


def test_golden_run_is_the_cpu_reference():
    x = (torch.randn(8, 32) * 3).half()
    ops = [torch_npu.npu_swiglu, lambda t: torch_npu.npu_geglu(t)[0], torch_npu.npu_fast_gelu, torch_npu.npu_silu,
           torch_npu.npu_mish]
    for op in ops:
        with numerics.golden():
            golden = op(x.npu()).cpu()
        assert torch.equal(golden, op(x))


def test_under_autocast_takes_mixed_dtypes():
    x = torch.randn(4, 16).npu()
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(x, torch.randn(32, 16).npu())
        y = torch_npu.npu_swiglu(h)
        z = torch_npu.npu_geglu(h)[0]
    assert h.dtype == y.dtype == z.dtype == torch.float16
    assert_close_to_reference(y, swiglu64(h.cpu().double()), torch.float16, "swiglu")
    assert_close_to_reference(z, geglu64(h.cpu().double()), torch.float16, "geglu")


def test_under_compile_forward_and_backward_equal_eager():
    x = torch.randn(4, 16).npu()

    def f(t):
        return (torch_npu.npu_swiglu(t) * torch_npu.npu_geglu(t, approximate=0)[0]).sum() + \
            torch_npu.npu_fast_gelu(t).sum() + torch_npu.npu_silu(t).sum() + torch_npu.npu_mish(t).sum()

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    x_c = x.clone().requires_grad_()
    x_e = x.clone().requires_grad_()
    compiled(x_c).backward()
    f(x_e).backward()
    torch.testing.assert_close(x_c.grad.cpu(), x_e.grad.cpu())


def test_dtypes_the_kernels_do_not_take_are_refused_on_the_npu():
    with pytest.raises(ValueError, match="torch_npu.npu_swiglu: input must be float16, bfloat16 or float32"):
        torch_npu.npu_swiglu(torch.randn(2, 4, dtype=torch.float64).npu())
    with pytest.raises(ValueError, match="torch_npu.npu_rms_norm: gamma must be float16"):
        torch_npu.npu_rms_norm(torch.randn(2, 4).npu(), torch.ones(4, dtype=torch.int32).npu())
    # the CPU kernel (the golden reference) computes any dtype
    torch_npu.npu_swiglu(torch.randn(2, 4, dtype=torch.float64))


def test_geglu_fp16_multiplies_the_rounded_gelu_like_the_kernel():
    """CANN's fp16 GeGluV2 rounds gelu to fp16 (its second output) and multiplies that in fp16; the
    bf16 kernel multiplies the fp32 gelu; the golden run rounds the outputs only."""
    torch.manual_seed(4)
    x = (torch.randn(32, 256) * 2).half()
    a, b = x.double().chunk(2, -1)
    gelu = gelu64(b, 1)
    y, g = torch_npu.npu_geglu(x.npu())
    assert_close_to_reference(g, gelu, torch.float16, "gelu")
    kernel = (a * g.cpu().double()).half()  # the fp16 product of the fp16 gelu output
    assert torch.equal(y.cpu(), kernel)
    with numerics.golden():
        golden = torch_npu.npu_geglu(x.npu())[0].cpu()
    a32, b32 = x.float().chunk(2, -1)
    assert torch.equal(golden, (a32 * torch.nn.functional.gelu(b32, approximate="tanh")).half())  # one rounding
    assert (golden != y.cpu()).any()
