"""The one-pass C++ kernels (csrc/fused_kernels_impl.h) compute what the op-by-op composition on
fp32 working copies they replace computed: fp16/bf16 read, fp32 inside, one rounding at the end.
npu_swiglu, npu_rotary_mul and npu_scaled_masked_softmax bit for bit; npu_rms_norm_backward up to the order of its fp32 sums. The compositions below are those ops' Python kernels as
they were (issue #30), forward and backward, on odd sizes (vector tails), a size ATen's elementwise
loops split across threads, other split dims and non-contiguous inputs, on the npu and on the CPU
(the golden reference)."""

import pytest
import torch
import torch.nn.functional as F
import torch_npu

from npukit.npu_backend import numerics
from npukit.npu_backend.fused import npu_numerics

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICES = ["npu", "cpu"]


def upcast(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.device == expected.device
    differing = (actual.cpu() != expected.cpu()).sum().item()
    assert differing == 0, f"{differing} of {expected.numel()} elements differ from the composition"


# ---- npu_swiglu ----------------------------------------------------------------------------------

def swiglu_composition(x, dim):
    a, b = x.chunk(2, dim)
    out = a.to(torch.float32, copy=True)  # the fp32 working copy (a copy in fp32 too: silu_ is in place)
    F.silu(out, inplace=True)
    return out.mul_(b.float()).to(x.dtype)


def swiglu_backward_composition(dy, x, dim):
    a, b = x.chunk(2, dim)
    a32, dy32 = a.to(torch.float32, copy=True), dy.float()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    da, db = dx.chunk(2, dim)
    gate = b.to(torch.float32, copy=True).mul_(dy32)
    da.copy_(torch.ops.aten.silu_backward.grad_input(gate, a32, grad_input=gate))
    db.copy_(F.silu(a32, inplace=True).mul_(dy32))
    return dx


SWIGLU_CASES = [
    ((3, 5, 74), -1),     # 37 per row: every row ends in a partial vector
    ((6, 8, 10), 1),      # split along a middle dim
    ((6, 8, 10), 0),
    ((70, 2000), -1),     # 70000 halves: ATen's loops split them across threads, with scalar tails
    ((5, 10, 12), -1, "transposed"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SWIGLU_CASES, ids=lambda case: "x".join(map(str, case[0])) + f"_dim{case[1]}"
                         + ("_" + case[2] if len(case) > 2 else ""))
def test_swiglu_is_the_composition_bit_for_bit(device, dtype, case):
    shape, dim = case[:2]
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype).to(device)
    if len(case) > 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not x.is_contiguous()
    assert_same_bits(torch_npu.npu_swiglu(x, dim=dim), swiglu_composition(x, dim))
    dy = torch.randn(swiglu_composition(x, dim).shape).to(dtype).to(device)
    assert_same_bits(torch.ops.npu.npu_swiglu_backward(dy, x, dim), swiglu_backward_composition(dy, x, dim))
    # through autograd, with the gradient of a sum (an expanded, stride-0 grad_output)
    leaf = x.detach().requires_grad_()
    torch_npu.npu_swiglu(leaf, dim=dim).sum().backward()
    ones = torch.ones(swiglu_composition(x, dim).shape, dtype=dtype, device=device)
    assert_same_bits(leaf.grad, swiglu_backward_composition(ones, x, dim))


def test_swiglu_fp32_gradient_of_a_low_precision_input():
    """An fp32 grad_output for a bf16 input: computed in fp32, rounded once to the input's dtype."""
    torch.manual_seed(1)
    x = torch.randn(4, 38, dtype=torch.bfloat16).npu()
    dy = torch.randn(4, 19).npu()
    assert_same_bits(torch.ops.npu.npu_swiglu_backward(dy, x, -1), swiglu_backward_composition(dy, x, -1))


def test_swiglu_fp16_overflow_saturates_and_sets_the_flag():
    x = torch.tensor([[300.0, 2.0, 300.0, -1.0]], dtype=torch.float16).npu()  # silu(300) * 300 > 65504
    with numerics.policies(fp16_mode="saturation"):
        numerics.clear_overflow_flag()
        y = torch_npu.npu_swiglu(x)
        assert y.cpu().tolist() == [[65504.0, -1.76171875]]
        assert numerics.overflow_flag()
    assert torch.isinf(torch_npu.npu_swiglu(x).cpu()[0, 0])  # INF_NAN mode


def test_swiglu_backward_refuses_a_gradient_of_another_shape():
    x = torch.randn(4, 8).npu()
    with pytest.raises(ValueError, match="npu_swiglu_backward: grad_output's shape"):
        torch.ops.npu.npu_swiglu_backward(torch.randn(4, 8).npu(), x, -1)


# ---- npu_rotary_mul ------------------------------------------------------------------------------

def pair_halves(x, mode):
    return x.chunk(2, -1) if mode == "half" else (x[..., 0::2], x[..., 1::2])


def rotary_composition(x, cos, sin, mode, dtype):
    x32, cos32, sin32 = upcast(x), upcast(cos), upcast(sin)
    shape = torch.broadcast_shapes(x32.shape, cos32.shape, sin32.shape)
    out = torch.empty(shape, dtype=torch.promote_types(x32.dtype, cos32.dtype), device=x32.device)
    x1, x2 = pair_halves(x32, mode)
    c1, c2 = pair_halves(cos32, mode)
    s1, s2 = pair_halves(sin32, mode)
    o1, o2 = pair_halves(out, mode)
    torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1)
    torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    return out.to(dtype)


def rotary_input_grad_composition(dy, cos, sin, mode, dtype):
    first, second = pair_halves(upcast(sin), mode)
    swapped_sin = torch.stack((-second, -first), -2 if mode == "half" else -1).flatten(-2)
    return rotary_composition(dy, cos, swapped_sin, mode, dtype)


ROTARY_CASES = [  # (x, cos/sin)
    ((2, 3, 5, 74), (1, 1, 5, 74)),   # D/2 = 37: partial vectors
    ((2, 3, 5, 74), (2, 1, 5, 74)),
    ((2, 3, 5, 74), (2, 3, 5, 74)),   # tables as large as x
    ((2, 5, 3, 40), (1, 5, 1, 40)),   # BSND: the table broadcasts over B and N
]


# interleave takes one table broadcast over batch and heads
ROTARY_MODE_CASES = [(mode, shapes) for mode in ("half", "interleave") for shapes in ROTARY_CASES
                     if mode == "half" or sum(size > 1 for size in shapes[1][:3]) <= 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,shapes", ROTARY_MODE_CASES,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[0])) + "-" + "x".join(map(str, v[1])))
def test_rotary_mul_is_the_composition_bit_for_bit(device, dtype, mode, shapes):
    x_shape, table_shape = shapes
    torch.manual_seed(1)
    x = (torch.randn(x_shape) * 3).to(dtype).to(device)
    cos, sin = (torch.randn(table_shape).to(dtype).to(device) for _ in range(2))
    expected = rotary_composition(x, cos, sin, mode, dtype)
    assert_same_bits(torch_npu.npu_rotary_mul(x, cos, sin, mode), expected)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert_same_bits(torch_npu.npu_rotary_mul(strided, cos, sin, mode), expected)
    dy = torch.randn(x_shape).to(dtype).to(device)
    dx, _, _ = torch.ops.npu.npu_rotary_mul_backward(dy, x, cos, sin, mode)
    assert_same_bits(dx, rotary_input_grad_composition(dy, cos, sin, mode, dtype))
    # autograd with constant tables (the backward's own path): the same input gradient
    leaf = x.detach().requires_grad_()
    torch.autograd.backward(torch_npu.npu_rotary_mul(leaf, cos, sin, mode), dy)
    assert_same_bits(leaf.grad, rotary_input_grad_composition(dy, cos, sin, mode, dtype))


def test_rotary_mul_fp32_tables_for_a_bf16_input():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16).npu()
    cos, sin = torch.randn(1, 1, 4, 64).npu(), torch.randn(1, 1, 4, 64).npu()
    assert_same_bits(torch_npu.npu_rotary_mul(x, cos, sin), rotary_composition(x, cos, sin, "half", torch.bfloat16))


# ---- npu_rms_norm_backward -----------------------------------------------------------------------

def rms_norm_backward_composition(dy, x, gamma, rstd):
    dims = list(range(x.dim() - gamma.dim(), x.dim()))
    x_hat = upcast(x).mul_(rstd) if x.dtype != upcast(x).dtype else x * rstd
    dy32 = upcast(dy)
    dgamma = (dy32 * x_hat).sum(list(range(x.dim() - gamma.dim())))
    dxhat = dy32 * upcast(gamma)
    projection = (dxhat * x_hat).mean(dims, keepdim=True)
    dx = dxhat.sub_(x_hat.mul_(projection)).mul_(rstd)
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def assert_same_up_to_fp32_sum_order(actual, expected):
    """Equal but where an fp32 sum taken in another order moves the result: by at most one rounding of
    the result's dtype, plus fp32 rounding relative to the largest value."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.device == expected.device
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=torch.finfo(expected.dtype).eps,
                               atol=64 * torch.finfo(torch.float32).eps * expected.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((3, 5, 37), (37,)), ((4, 6, 10), (6, 10)), ((2, 64, 512), (512,)),
                                    ((40, 30, 64), (64,))],  # 1200 rows: split across threads
                         ids=lambda s: "x".join(map(str, s[0])))
def test_rms_norm_backward_is_the_composition(device, dtype, shapes):
    x_shape, gamma_shape = shapes
    torch.manual_seed(3)
    x, dy = (torch.randn(x_shape).to(dtype).to(device) for _ in range(2))
    gamma = torch.randn(gamma_shape).to(dtype).to(device)
    _, rstd = torch_npu.npu_rms_norm(x, gamma)
    for grad in (dy, dy[:1].expand(x_shape), dy.float()):  # an expanded gradient, an fp32 one
        dx, dgamma = torch.ops.npu.npu_rms_norm_backward(grad, x, gamma, rstd)
        expected_dx, expected_dgamma = rms_norm_backward_composition(grad, x, gamma, rstd)
        assert_same_up_to_fp32_sum_order(dx, expected_dx)
        assert_same_up_to_fp32_sum_order(dgamma, expected_dgamma)
        if dtype != torch.float32:  # rounded once to fp16/bf16: all but a few elements are the same bits
            assert (dx.cpu() != expected_dx.cpu()).float().mean() < 0.02


def test_rms_norm_backward_refuses_mismatched_gradients():
    x, gamma = torch.randn(4, 8).npu(), torch.randn(8).npu()
    _, rstd = torch_npu.npu_rms_norm(x, gamma)
    with pytest.raises(ValueError, match="npu_rms_norm_backward: dy's shape"):
        torch.ops.npu.npu_rms_norm_backward(torch.randn(4, 4).npu(), x, gamma, rstd)
    with pytest.raises(ValueError, match="npu_rms_norm_backward: rstd has 2 values"):
        torch.ops.npu.npu_rms_norm_backward(torch.randn(4, 8).npu(), x, gamma, rstd[:2])


# ---- npu_scaled_masked_softmax -------------------------------------------------------------------

def scaled_masked_softmax_composition(x, mask, scale, fixed_triu_mask):
    if fixed_triu_mask:
        mask = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
    if x.dtype == torch.float16 and npu_numerics(x):  # the fp16 kernel's logits: scale and product in fp16
        logits = x * float(torch.tensor(float(scale), dtype=torch.float16))
    else:
        logits = upcast(x).mul_(scale) if x.dtype != upcast(x).dtype else x * scale
    logits.masked_fill_(mask, -10000.0)
    return torch.softmax(logits, -1).to(x.dtype)


def scaled_masked_softmax_backward_composition(dy, y, mask, scale, fixed_triu_mask):
    if fixed_triu_mask:
        mask = torch.ones(y.shape[-2:], dtype=torch.bool, device=y.device).triu(1)
    dy32, y32 = upcast(dy), upcast(y)
    dx = torch.ops.aten._softmax_backward_data(dy32, y32, -1, y32.dtype)
    return dx.mul_(scale).masked_fill_(mask, 0.0).to(dy.dtype)


SOFTMAX_CASES = [  # (x, mask); 192 rows of 64 and of 96: more rows than a thread's share of the loop
    ((2, 3, 32, 64), (2, 3, 32, 64)),
    ((2, 3, 32, 96), (2, 1, 32, 96)),
    ((1, 2, 64, 32), (1, 1, 64, 32)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fixed_triu_mask", [False, True])
@pytest.mark.parametrize("shapes", SOFTMAX_CASES, ids=lambda s: "x".join(map(str, s[0])) + "-" + "x".join(map(str, s[1])))
def test_scaled_masked_softmax_is_the_composition_bit_for_bit(device, dtype, fixed_triu_mask, shapes):
    x_shape, mask_shape = shapes
    torch.manual_seed(4)
    x = (torch.randn(x_shape) * 8).to(dtype).to(device)
    mask = (torch.rand(mask_shape) < 0.3).to(device)
    mask[..., 0, :] = True  # a fully masked row: every logit -10000
    scale = 0.3  # not an fp16 value: the fp16 kernel rounds it
    y = torch_npu.npu_scaled_masked_softmax(x, mask, scale, fixed_triu_mask)
    assert_same_bits(y, scaled_masked_softmax_composition(x, mask, scale, fixed_triu_mask))
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert_same_bits(torch_npu.npu_scaled_masked_softmax(strided, mask, scale, fixed_triu_mask), y)
    dy = torch.randn(x_shape).to(dtype).to(device)
    dx = torch.ops.npu.npu_scaled_masked_softmax_backward(dy, y, mask, scale, fixed_triu_mask)
    assert_same_bits(dx, scaled_masked_softmax_backward_composition(dy, y, mask, scale, fixed_triu_mask))
    leaf = x.detach().requires_grad_()  # through autograd, with an expanded (stride-0) gradient
    torch_npu.npu_scaled_masked_softmax(leaf, mask, scale, fixed_triu_mask).sum().backward()
    ones = torch.ones(x_shape, dtype=dtype, device=device)
    assert_same_bits(leaf.grad, scaled_masked_softmax_backward_composition(ones, y, mask, scale, fixed_triu_mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_masked_softmax_non_finite_inputs_are_the_composition(dtype):
    """inf, nan and (in fp16) logits past 65504: the composition's results, inf/nan included."""
    x = torch.randn(1, 2, 32, 32) * 4
    x[0, 0, 1, 3], x[0, 0, 2, 5], x[0, 1, 3, 7] = float("inf"), float("nan"), -float("inf")
    x[0, 1, 4, :4] = 60000.0  # x * 2 overflows fp16
    x = x.to(dtype).npu()
    mask = (torch.rand(1, 1, 32, 32) < 0.2).npu()
    for fp16_mode in ("inf_nan", "saturation"):
        with numerics.policies(fp16_mode=fp16_mode):
            numerics.clear_overflow_flag()
            y = torch_npu.npu_scaled_masked_softmax(x, mask, 2.0)
            flag = numerics.overflow_flag()
            numerics.clear_overflow_flag()
            expected = scaled_masked_softmax_composition(x, mask, 2.0, False)
            assert flag == numerics.overflow_flag()
            assert torch.equal(y.cpu().isnan(), expected.cpu().isnan())
            assert_same_bits(y.nan_to_num(), expected.nan_to_num())
            dy = torch.randn(x.shape).to(dtype).npu()
            dx = torch.ops.npu.npu_scaled_masked_softmax_backward(dy, y, mask, 2.0, False)
            expected = scaled_masked_softmax_backward_composition(dy, y, mask, 2.0, False)
            assert_same_bits(dx.nan_to_num(), expected.nan_to_num())


def test_scaled_masked_softmax_fp32_gradient_of_a_low_precision_output():
    torch.manual_seed(5)
    x = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16).npu()
    mask = (torch.rand(1, 1, 32, 64) < 0.3).npu()
    y = torch_npu.npu_scaled_masked_softmax(x, mask, 0.5)
    dy = torch.randn(1, 2, 32, 64).npu()
    assert_same_bits(torch.ops.npu.npu_scaled_masked_softmax_backward(dy, y, mask, 0.5, False),
                     scaled_masked_softmax_backward_composition(dy, y, mask, 0.5, False))
