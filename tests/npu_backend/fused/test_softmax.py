import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def scaled_masked_softmax64(x, mask, scale, fixed_triu_mask):
    """softmax((x * scale).masked_fill(mask, -10000)) over the last dim; fixed_triu_mask: the causal
    mask (True above the diagonal) instead of the given one."""
    if fixed_triu_mask:
        mask = torch.ones(x.shape[-2:], dtype=torch.bool).triu(1)
    logits = (x.double() * scale).masked_fill(mask, -10000.0)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


# mask shapes broadcast to x (2, 3, 32, 64): full, per batch, shared by all heads and batches
MASKS = [(2, 3, 32, 64), (2, 1, 32, 64), (1, 1, 32, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", MASKS)
@pytest.mark.parametrize("fixed_triu_mask", [False, True])
def test_scaled_masked_softmax_forward_and_backward_against_fp64(dtype, mask_shape, fixed_triu_mask):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 64, dtype=torch.float64) * 3
    mask = torch.rand(mask_shape) < 0.3
    scale = 0.125
    x_ref = x.to(dtype).double().requires_grad_()
    y_ref = scaled_masked_softmax64(x_ref, mask, scale, fixed_triu_mask)
    dy = torch.randn_like(y_ref)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)

    x_npu = x.to(dtype).npu().requires_grad_()
    y = torch_npu.npu_scaled_masked_softmax(x_npu, mask.npu(), scale, fixed_triu_mask)
    (dx,) = torch.autograd.grad(y, x_npu, dy.to(dtype).npu())
    assert y.dtype == dx.dtype == dtype
    assert_close_to_reference(y, y_ref, dtype, "y")
    assert_close_to_reference(dx, dx_ref, dtype, "dx", factor=2)
    # masked positions: probability ~0 and no gradient
    effective = torch.ones(32, 64, dtype=torch.bool).triu(1) if fixed_triu_mask else mask
    effective = effective.expand(2, 3, 32, 64)
    assert float(y.detach().float().cpu()[effective].abs().max()) < 1e-3
    assert torch.all(dx.cpu()[effective] == 0)


def test_mask_true_means_masked():
    x = torch.zeros(1, 1, 32, 32)
    mask = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    mask[..., 16:] = True
    y = torch_npu.npu_scaled_masked_softmax(x.npu(), mask.npu()).cpu()
    assert torch.allclose(y[..., :16], torch.full((1, 1, 32, 16), 1 / 16))
    assert torch.all(y[..., 16:] < 1e-6)


def test_scaled_masked_softmax_backward_is_an_op_of_its_own():
    x = torch.randn(1, 2, 32, 32, dtype=torch.float64)
    mask = torch.rand(1, 1, 32, 32) < 0.2
    dy = torch.randn(1, 2, 32, 32, dtype=torch.float64)
    y = torch_npu.npu_scaled_masked_softmax(x.float().npu(), mask.npu(), 2.0)
    dx = torch.ops.npu.npu_scaled_masked_softmax_backward(dy.float().npu(), y, mask.npu(), 2.0, False)
    x_ref = x.clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(scaled_masked_softmax64(x_ref, mask, 2.0, False), x_ref, dy)
    assert_close_to_reference(dx, dx_ref, torch.float32, "dx")


def test_scaled_masked_softmax_refuses_what_the_kernel_refuses():
    mask = torch.zeros(1, 1, 32, 32, dtype=torch.bool).npu()
    with pytest.raises(ValueError, match="npu_scaled_masked_softmax.*multiples of 32"):
        torch_npu.npu_scaled_masked_softmax(torch.randn(1, 1, 30, 32).npu(), mask)
    with pytest.raises(ValueError, match="npu_scaled_masked_softmax.*bool"):
        torch_npu.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).npu(), mask.float())
    with pytest.raises(ValueError, match="npu_scaled_masked_softmax.*mask must be 4-dim"):
        torch_npu.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 64).npu(), mask)
    with pytest.raises(ValueError, match="npu_scaled_masked_softmax.*broadcast"):
        torch_npu.npu_scaled_masked_softmax(torch.randn(2, 2, 32, 32).npu(), mask.expand(3, 1, 32, 32))
    with pytest.raises(ValueError, match="npu_scaled_masked_softmax.*4-dim"):
        torch_npu.npu_scaled_masked_softmax(torch.randn(2, 32, 32).npu(), mask[0])


# ---- npu_dropout_with_add_softmax ----------------------------------------------------------------

SHAPE = (2, 16, 128, 128)  # N * C a multiple of 32, H and W in (128, 256, 384, 512)


def add_softmax64(x, x1, alpha):
    logits = x1.double() + alpha * x.double()  # y = x1 + self * alpha
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_with_add_softmax_forward_and_backward_against_fp64(dtype):
    torch.manual_seed(5)
    x, x1 = torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64)
    alpha, prob = 0.125, 0.1
    x_npu = x.to(dtype).npu().requires_grad_()
    x1_npu = x1.to(dtype).npu().requires_grad_()
    mask, softmax, out = torch_npu.npu_dropout_with_add_softmax(x_npu, x1_npu, alpha, prob, -1)
    assert mask.dtype == torch.uint8 and mask.shape == (x.numel(),)
    assert softmax.dtype == out.dtype == dtype and softmax.shape == out.shape == SHAPE
    keep = mask.cpu().reshape(SHAPE).bool()
    assert abs(keep.float().mean().item() - (1 - prob)) < 0.01  # the drop probability is prob

    refs = [t.to(dtype).double().requires_grad_() for t in (x, x1)]
    softmax_ref = add_softmax64(*refs, alpha)
    out_ref = softmax_ref * keep / (1 - prob)  # (the kernel drops out its rounded softmax: within tolerance)
    dy = torch.randn(SHAPE, dtype=torch.float64)
    grads_ref = torch.autograd.grad(out_ref, refs, dy)
    grads = torch.autograd.grad(out, [x_npu, x1_npu], dy.to(dtype).npu())
    assert_close_to_reference(softmax, softmax_ref, dtype, "softmax")
    assert_close_to_reference(out, out_ref, dtype, "output")
    for name, grad, grad_ref in zip(("dx", "dx1"), grads, grads_ref):
        assert grad.dtype == dtype
        assert_close_to_reference(grad, grad_ref, dtype, name, factor=2)


def test_dropout_mask_is_reproducible_and_prob_zero_keeps_all():
    x, x1 = torch.randn(SHAPE).npu(), torch.randn(SHAPE).npu()
    torch.manual_seed(11)
    first = torch_npu.npu_dropout_with_add_softmax(x, x1, 1.0, 0.5, -1)
    torch.manual_seed(11)
    second = torch_npu.npu_dropout_with_add_softmax(x, x1, 1.0, 0.5, -1)
    for a, b in zip(first, second):
        assert torch.equal(a.cpu(), b.cpu())
    third = torch_npu.npu_dropout_with_add_softmax(x, x1, 1.0, 0.5, -1)
    assert not torch.equal(first[0].cpu(), third[0].cpu())
    mask, softmax, out = torch_npu.npu_dropout_with_add_softmax(x, x1, 1.0, 0.0, -1)  # eval: prob 0
    assert bool(mask.cpu().all()) and torch.equal(softmax.cpu(), out.cpu())


def test_gradient_through_the_softmax_output_too():
    x = torch.randn(SHAPE, dtype=torch.float64)
    x1 = torch.randn(SHAPE, dtype=torch.float64)
    leaves = [t.float().npu().requires_grad_() for t in (x, x1)]
    mask, softmax, out = torch_npu.npu_dropout_with_add_softmax(*leaves, 0.5, 0.2, -1)
    (softmax * 2 + out).sum().backward()
    keep = mask.cpu().reshape(SHAPE).double()
    refs = [t.clone().requires_grad_() for t in (x, x1)]
    s = add_softmax64(*refs, 0.5)
    (s * 2 + s * keep / 0.8).sum().backward()
    for leaf, ref in zip(leaves, refs):
        assert_close_to_reference(leaf.grad, ref.grad, torch.float32, "grad")


def test_dropout_with_add_softmax_refuses_unsupported_shapes():
    with pytest.raises(ValueError, match="npu_dropout_with_add_softmax.*H and W"):
        torch_npu.npu_dropout_with_add_softmax(torch.randn(2, 16, 64, 64).npu(), torch.randn(2, 16, 64, 64).npu(),
                                               1.0, 0.1, -1)
    with pytest.raises(ValueError, match="npu_dropout_with_add_softmax.*dim"):
        torch_npu.npu_dropout_with_add_softmax(torch.randn(SHAPE).npu(), torch.randn(SHAPE).npu(), 1.0, 0.1, 2)


def test_golden_run_is_the_cpu_kernel():
    x = torch.randn(1, 2, 32, 64).half()
    mask = torch.rand(1, 1, 32, 64) < 0.3
    with numerics.golden():
        golden = torch_npu.npu_scaled_masked_softmax(x.npu(), mask.npu(), 0.5).cpu()
    assert torch.equal(golden, torch_npu.npu_scaled_masked_softmax(x, mask, 0.5))
    a, b = torch.randn(SHAPE).half(), torch.randn(SHAPE).half()
    torch.manual_seed(3)
    with numerics.golden():
        golden = [t.cpu() for t in torch_npu.npu_dropout_with_add_softmax(a.npu(), b.npu(), 0.5, 0.1, -1)]
    torch.manual_seed(3)
    cpu = torch_npu.npu_dropout_with_add_softmax(a, b, 0.5, 0.1, -1)
    for g, c in zip(golden, cpu):
        assert torch.equal(g, c)


def test_under_autocast_and_compile():
    x = torch.randn(1, 2, 32, 32).npu()
    mask = (torch.rand(1, 1, 32, 32) < 0.3).npu()
    with torch.autocast("npu", dtype=torch.float16):
        scores = torch.matmul(x, x.transpose(-1, -2))
        y = torch_npu.npu_scaled_masked_softmax(scores, mask, 0.1)
    assert y.dtype == torch.float16
    assert_close_to_reference(y, scaled_masked_softmax64(scores.cpu(), mask.cpu(), 0.1, False), torch.float16, "y")

    def f(t, m):
        return (torch_npu.npu_scaled_masked_softmax(t, m, 0.5, False) * t).sum()

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(x_c, mask).backward()
    f(x_e, mask).backward()
    torch.testing.assert_close(x_c.grad.cpu(), x_e.grad.cpu())


def test_scaled_masked_softmax_fp16_scales_in_fp16_like_the_kernel():
    """CANN's fp16 ScaledMaskedSoftmax multiplies x by the scale in fp16 (both rounded), then runs its
    softmax in fp32 and rounds once; the golden run scales in fp32."""
    torch.manual_seed(8)
    x = (torch.randn(1, 4, 32, 64) * 4).half()
    mask = torch.rand(1, 1, 32, 64) < 0.2
    y = torch_npu.npu_scaled_masked_softmax(x.npu(), mask.npu(), 0.7).cpu()
    logits = (x.double() * torch.tensor(0.7).half().double()).half()  # fp16 product of fp16 values
    kernel = scaled_masked_softmax64(logits, mask, 1.0, False).half()
    assert (y != kernel).float().mean() < 0.001
    with numerics.golden():
        golden = torch_npu.npu_scaled_masked_softmax(x.npu(), mask.npu(), 0.7).cpu()
    assert (golden != scaled_masked_softmax64(x, mask, 0.7, False).half()).float().mean() < 0.001
    assert (golden != y).any()


def test_dropout_with_add_softmax_fp16_rounds_each_stage_like_the_kernel():
    torch.manual_seed(9)
    x, x1 = (torch.randn(SHAPE) * 3).half(), (torch.randn(SHAPE) * 3).half()
    mask, softmax, out = (t.cpu() for t in torch_npu.npu_dropout_with_add_softmax(x.npu(), x1.npu(), 0.3, 0.25, -1))
    logits = (x1.double() + 0.3 * x.double()).half().double()  # AxpyV2's fp16 result
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    expected_softmax = (e / e.sum(-1, keepdim=True)).half()
    assert (softmax != expected_softmax).float().mean() < 0.001
    keep = mask.reshape(SHAPE).double()
    assert torch.equal(out, (softmax.double() * keep / 0.75).half())  # the dropout of the fp16 softmax
