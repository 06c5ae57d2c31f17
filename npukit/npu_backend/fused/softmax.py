"""Softmax: npu_scaled_masked_softmax (+ its backward) and npu_dropout_with_add_softmax (+ its
backward).

ScaledMaskedSoftmax (Megatron's fused softmax): softmax((x * scale).masked_fill(mask, -10000))
over the last dim, mask True = masked; with fixed_triu_mask the kernel makes the causal mask itself
(True above the diagonal) and ignores the given one. DropoutWithAddSoftmax: y = x1 + alpha * x,
softmax over dim, then dropout with drop probability `prob` (kept values scaled by 1 / (1 - prob)),
returning the byte mask (1 = kept, one per element, flat), the softmax and the dropped output; its
three stages round their results to the input dtype.
Both read fp16/bf16, compute in fp32 and round each output once to the input dtype (the fp16
ScaledMaskedSoftmax kernel scales its logits in fp16 first).

Speed: ScaledMaskedSoftmax and its backward are one-pass C++ kernels (csrc/fused_kernels_impl.h:
each row's fp32 working copy stays in L1, fp16/bf16 converted in registers), bit for bit the
previous composition of the device's ops on fp32 working copies.
"""

from __future__ import annotations

import functools

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.fused import (
    fused_op,
    npu_numerics,
    register_autograd,
    round_intermediate,
    upcast,
)
from npukit.npu_backend.fused.norms import check_float_dtypes

SCALED_MASKED_SOFTMAX_SIZES = range(32, 4097, 32)  # H and W: multiples of 32 in [32, 4096]
DROPOUT_ADD_SOFTMAX_SIZES = (128, 256, 384, 512)


def _scaled_masked_mask(op: str, x: torch.Tensor, mask: torch.Tensor, fixed_triu_mask: bool) -> torch.Tensor:
    if mask.dtype != torch.bool:
        raise ValueError(f"torch_npu.{op}: mask must be a bool tensor (True = masked), got {mask.dtype}")
    if mask.dim() != 4 or mask.shape[-2:] != x.shape[-2:]:
        raise ValueError(f"torch_npu.{op}: mask must be 4-dim with x's last two dims, got {tuple(mask.shape)} "
                         f"for x {tuple(x.shape)}")
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        raise ValueError(f"torch_npu.{op}: mask {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}") from None
    if fixed_triu_mask:
        h, w = x.shape[-2:]
        return torch.ones(h, w, dtype=torch.bool, device=x.device).triu(1)
    return mask


def _check_scaled_masked_softmax(op: str, x: torch.Tensor) -> None:
    check_float_dtypes(op, x=x)
    if x.dim() != 4 or x.shape[-2] not in SCALED_MASKED_SOFTMAX_SIZES or x.shape[-1] not in SCALED_MASKED_SOFTMAX_SIZES:
        raise ValueError(f"torch_npu.{op}: x must be 4-dim (N, C, H, W) with H and W multiples of 32 in "
                         f"[32, 4096], got shape {tuple(x.shape)}")


def _scaled_masked_softmax_fake(x, mask, scale=1, fixed_triu_mask=False):
    _check_scaled_masked_softmax("npu_scaled_masked_softmax", x)
    _scaled_masked_mask("npu_scaled_masked_softmax", x, mask, fixed_triu_mask)
    return x.new_empty(x.shape)


@fused_op("npu_scaled_masked_softmax(Tensor x, Tensor mask, Scalar scale=1, bool fixed_triu_mask=False) -> Tensor",
          unfused="torch.softmax((x * scale).masked_fill(mask, -10000), -1)", fake=_scaled_masked_softmax_fake)
def npu_scaled_masked_softmax(x, mask, scale=1, fixed_triu_mask=False):
    _check_scaled_masked_softmax("npu_scaled_masked_softmax", x)
    mask = _scaled_masked_mask("npu_scaled_masked_softmax", x, mask, fixed_triu_mask)
    # CANN's fp16 kernel scales in fp16 (the scale and the product rounded to fp16, saturated as the
    # device's fp16 mul saturates it) before its fp32 softmax; bf16 and fp32 scale in fp32.
    half_logits = x.dtype == torch.float16 and npu_numerics(x)
    return _C.scaled_masked_softmax_forward(x, mask, _fp16_scale(scale) if half_logits else float(scale), half_logits)


@functools.lru_cache(maxsize=64)
def _fp16_scale(scale: float) -> float:
    """The scale as the fp16 kernel holds it (rounded to fp16), as a Python float."""
    return float(torch.tensor(float(scale), dtype=torch.float16))


def _scaled_masked_softmax_backward_fake(y_grad, y, mask, scale, fixed_triu_mask):
    _check_scaled_masked_softmax("npu_scaled_masked_softmax_backward", y)
    _scaled_masked_mask("npu_scaled_masked_softmax_backward", y, mask, fixed_triu_mask)
    return y_grad.new_empty(y.shape)


@fused_op("npu_scaled_masked_softmax_backward(Tensor y_grad, Tensor y, Tensor mask, Scalar scale, "
          "bool fixed_triu_mask) -> Tensor",
          unfused="autograd of npu_scaled_masked_softmax's decomposition", public=False,
          fake=_scaled_masked_softmax_backward_fake)
def npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask):
    _check_scaled_masked_softmax("npu_scaled_masked_softmax_backward", y)
    mask = _scaled_masked_mask("npu_scaled_masked_softmax_backward", y, mask, fixed_triu_mask)
    if y_grad.shape != y.shape:
        raise ValueError(f"torch_npu.npu_scaled_masked_softmax_backward: y_grad's shape {tuple(y_grad.shape)} must "
                         f"be y's {tuple(y.shape)}")
    # y (dy - sum(dy y)) as torch's softmax backward computes it, then scaled and masked, in fp32
    return _C.scaled_masked_softmax_backward(y_grad, y, mask, float(scale))


def _scaled_masked_softmax_setup(ctx, inputs, output):
    _, mask, scale, fixed_triu_mask = inputs
    ctx.scale, ctx.fixed_triu_mask = scale, fixed_triu_mask
    ctx.save_for_backward(output, mask)


def _scaled_masked_softmax_backward(ctx, dy):
    y, mask = ctx.saved_tensors
    dx = torch.ops.npu.npu_scaled_masked_softmax_backward(dy, y, mask, ctx.scale, ctx.fixed_triu_mask)
    return dx, None, None, None


register_autograd("npu_scaled_masked_softmax", _scaled_masked_softmax_backward, _scaled_masked_softmax_setup)


# ---- npu_dropout_with_add_softmax ----------------------------------------------------------------

def _check_dropout_with_add_softmax(x, x1, prob, dim):
    check_float_dtypes("npu_dropout_with_add_softmax", input=x, x1=x1)
    op = "torch_npu.npu_dropout_with_add_softmax"
    if x.shape != x1.shape or x.dim() != 4:
        raise ValueError(f"{op}: self and x1 must be 4-dim (N, C, H, W) of the same shape, got "
                         f"{tuple(x.shape)} and {tuple(x1.shape)}")
    n, c, h, w = x.shape
    if h not in DROPOUT_ADD_SOFTMAX_SIZES or w not in DROPOUT_ADD_SOFTMAX_SIZES or (n * c) % 32:
        raise ValueError(f"{op}: H and W must be one of {DROPOUT_ADD_SOFTMAX_SIZES} and N * C a multiple of 32, "
                         f"got shape {tuple(x.shape)}")
    if dim not in (-1, 3):
        raise ValueError(f"{op}: dim must be -1 (the softmax runs over W), got {dim}")
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"{op}: prob (the drop probability) must be in [0, 1], got {prob}")


def _keep_scale(prob: float) -> float:
    return 0.0 if prob >= 1.0 else 1.0 / (1.0 - prob)


@fused_op("npu_dropout_with_add_softmax(Tensor input, Tensor x1, Scalar alpha, float prob, int dim) "
          "-> (Tensor, Tensor, Tensor)",
          unfused="s = torch.softmax(x1 + alpha * x, dim); (mask, s, torch.nn.functional.dropout(s, prob))")
def npu_dropout_with_add_softmax(x, x1, alpha, prob, dim):
    _check_dropout_with_add_softmax(x, x1, prob, dim)
    # The kernel chains AxpyV2, SoftmaxV2 and DropOutDoMaskV3: each stage's result is in the input dtype
    # (the softmax is an output, the sum its input), the stages compute in fp32.
    dtype, npu = x.dtype, npu_numerics(x)
    logits = round_intermediate(torch.add(upcast(x1), upcast(x), alpha=alpha), dtype, npu)
    softmax = round_intermediate(torch.softmax(logits, dim), dtype, npu)
    # DropOutDoMaskV3's byte mask, one per element (1 = kept), from the device's generator (torch.manual_seed
    # reproduces it).
    keep = torch.rand(x.shape, device=x.device) >= prob
    output = softmax * keep * _keep_scale(prob)
    return keep.flatten().to(torch.uint8), softmax.to(dtype), output.to(dtype)


@fused_op("npu_dropout_with_add_softmax_backward(Tensor grad, Tensor mask, Tensor softmax_out, Scalar alpha, "
          "float prob, int dim) -> (Tensor, Tensor)",
          unfused="autograd of npu_dropout_with_add_softmax's decomposition", public=False)
def npu_dropout_with_add_softmax_backward(grad, mask, softmax_out, alpha, prob, dim):
    if mask.numel() != grad.numel():
        raise ValueError(f"torch_npu.npu_dropout_with_add_softmax_backward: mask has {mask.numel()} elements, "
                         f"grad {grad.numel()}")
    d_softmax = upcast(grad) * mask.reshape(grad.shape) * _keep_scale(prob)
    s = upcast(softmax_out)
    d_sum = s * (d_softmax - (d_softmax * s).sum(dim, keepdim=True))
    return (alpha * d_sum).to(grad.dtype), d_sum.to(grad.dtype)


def _dropout_add_softmax_setup(ctx, inputs, output):
    _, _, alpha, prob, dim = inputs
    ctx.alpha, ctx.prob, ctx.dim = alpha, prob, dim
    ctx.save_for_backward(output[0], output[1])


def _dropout_add_softmax_backward(ctx, _dmask, d_softmax, d_output):
    mask, softmax = ctx.saved_tensors
    backward = torch.ops.npu.npu_dropout_with_add_softmax_backward
    dx = dx1 = None
    if d_output is not None:
        dx, dx1 = backward(d_output, mask, softmax, ctx.alpha, ctx.prob, ctx.dim)
    if d_softmax is not None:
        # A gradient reaching the softmax output itself: the same backward without the dropout.
        keep_all = torch.ones_like(mask)
        sx, sx1 = backward(d_softmax, keep_all, softmax, ctx.alpha, 0.0, ctx.dim)
        dx, dx1 = (sx, sx1) if dx is None else (dx + sx, dx1 + sx1)
    return dx, dx1, None, None, None


register_autograd("npu_dropout_with_add_softmax", _dropout_add_softmax_backward, _dropout_add_softmax_setup)
