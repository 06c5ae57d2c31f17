"""Norms: npu_rms_norm (+ its backward), the pattern every family module follows; npu_add_rms_norm,
npu_gemma_rms_norm and npu_layer_norm_eval.

RmsNorm's kernel reads fp16/bf16 inputs, computes the mean square and the normalisation in fp32,
multiplies by gamma in fp32 and rounds the result once to the input dtype; rstd is fp32 with the
input's leading dims and a 1 for each of gamma's dims (torch_npu's meta kernel). The other norms
compute the same way. torch_npu defines a backward for npu_rms_norm only: the others raise when
backpropagated through, as they do on the device (`register_no_derivative`).
"""

from __future__ import annotations

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.fused import (
    fused_op,
    npu_numerics,
    register_autograd,
    register_no_derivative,
    round_intermediate,
    upcast,
)


def _normalized_dims(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    return list(range(x.dim() - gamma.dim(), x.dim()))


@fused_op("npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
          unfused="x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma")
def npu_rms_norm(x, gamma, epsilon=1e-6):
    check_float_dtypes("npu_rms_norm", input=x, gamma=gamma)
    if x.dtype in KERNEL_FLOAT_DTYPES and gamma.dtype in KERNEL_FLOAT_DTYPES:
        # torch's own fused RMSNorm kernel computes exactly this decomposition (fp16/bf16 read, the mean
        # square, rstd and x * rstd * gamma in fp32, y rounded once to x's dtype; bit for bit the ops
        # below), in two passes over x and with no fp32 copy of it.
        y, rstd = torch.ops.aten._fused_rms_norm(x, list(gamma.shape), gamma, epsilon)
        return y, rstd
    x32 = upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(_normalized_dims(x, gamma), keepdim=True) + epsilon)
    y = x32 * rstd * upcast(gamma)
    return y.to(x.dtype), rstd.float()


def _check_rms_norm_backward(dy, x, gamma, rstd):
    _check_gamma("npu_rms_norm_backward", x, gamma)
    if dy.shape != x.shape:
        raise ValueError(f"torch_npu.npu_rms_norm_backward: dy's shape {tuple(dy.shape)} must be the input's "
                         f"{tuple(x.shape)}")
    if rstd.numel() * gamma.numel() != x.numel():
        raise ValueError(f"torch_npu.npu_rms_norm_backward: rstd has {rstd.numel()} values, one per normalized row "
                         f"({x.numel() // max(gamma.numel(), 1)}) expected")


def _rms_norm_backward_fake(dy, x, gamma, rstd):
    _check_rms_norm_backward(dy, x, gamma, rstd)
    return x.new_empty(x.shape), gamma.new_empty(gamma.shape)


@fused_op("npu_rms_norm_backward(Tensor dy, Tensor input, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)",
          unfused="autograd of npu_rms_norm's decomposition", public=False, fake=_rms_norm_backward_fake)
def npu_rms_norm_backward(dy, x, gamma, rstd):
    """One pass over each row in C++ (csrc/fused_kernels_impl.h): x_hat = x * rstd, dxhat = dy * gamma,
    dx = (dxhat - x_hat * mean(dxhat * x_hat)) * rstd and dgamma = sum over rows of dy * x_hat, in fp32
    from the fp16/bf16 values in registers, each gradient rounded once."""
    _check_rms_norm_backward(dy, x, gamma, rstd)
    return _C.rms_norm_backward(dy, x, gamma, rstd)


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
    return dx, dgamma, None


register_autograd("npu_rms_norm", _rms_norm_backward, _rms_norm_setup)


# ---- checks shared by the families ---------------------------------------------------------------

KERNEL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_float_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    """The vector kernels take float16, bfloat16 and float32: an npu tensor of another dtype (float64,
    an integer) is refused, naming the op and the argument. CPU tensors (the golden reference) pass."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device.type == "npu" and tensor.dtype not in KERNEL_FLOAT_DTYPES:
            raise ValueError(f"torch_npu.{op}: {name} must be float16, bfloat16 or float32 on the NPU, "
                             f"got {tensor.dtype}")


# ---- ops torch_npu defines no derivative for ------------------------------------------------------

# ---- npu_add_rms_norm, npu_gemma_rms_norm, npu_layer_norm_eval -----------------------------------

def _check_gamma(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    if gamma.dim() == 0 or gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"torch_npu.{op}: gamma's shape {tuple(gamma.shape)} must be the last dims of the "
                         f"input's shape {tuple(x.shape)}")


@fused_op("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
          unfused="x = x1 + x2; (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma, rstd, x)")
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    check_float_dtypes("npu_add_rms_norm", x1=x1, x2=x2, gamma=gamma)
    if x1.shape != x2.shape:
        raise ValueError(f"torch_npu.npu_add_rms_norm: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have "
                         "the same shape")
    _check_gamma("npu_add_rms_norm", x1, gamma)
    # CANN's AddRmsNorm (Atlas A2/A3) keeps two intermediates in the input dtype: the sum x, which it
    # returns and normalises as rounded, and x * rstd, which it multiplies by a gamma of the same dtype
    # (an fp32 gamma multiplies the fp32 value); y is rounded once more.
    dtype, npu = x1.dtype, npu_numerics(x1)
    total = upcast(x1) + upcast(x2)
    x32 = round_intermediate(total, dtype, npu)
    rstd = torch.rsqrt(x32.pow(2).mean(_normalized_dims(x1, gamma), keepdim=True) + epsilon)
    normalized = x32 * rstd
    if gamma.dtype == dtype:
        normalized = round_intermediate(normalized, dtype, npu)
    y = normalized.mul_(upcast(gamma))
    return y.to(dtype), rstd.float(), total.to(dtype)


register_no_derivative("npu_add_rms_norm")


@fused_op("npu_gemma_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
          unfused="x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + gamma)")
def npu_gemma_rms_norm(x, gamma, epsilon=1e-6):
    check_float_dtypes("npu_gemma_rms_norm", input=x, gamma=gamma)
    _check_gamma("npu_gemma_rms_norm", x, gamma)
    x32 = upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(_normalized_dims(x, gamma), keepdim=True) + epsilon)
    # Gemma stores the scale minus one: the kernel multiplies by (1 + gamma) in fp32.
    y = x32 * rstd * (1.0 + upcast(gamma))
    return y.to(x.dtype), rstd.float()


register_no_derivative("npu_gemma_rms_norm")


@fused_op("npu_layer_norm_eval(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
          "float eps=1e-05) -> Tensor",
          unfused="torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)")
def npu_layer_norm_eval(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    check_float_dtypes("npu_layer_norm_eval", input=x, weight=weight, bias=bias)
    normalized_shape = tuple(normalized_shape)
    if not normalized_shape or tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape:
        raise ValueError(f"torch_npu.npu_layer_norm_eval: normalized_shape {list(normalized_shape)} must be the "
                         f"last dims of the input's shape {tuple(x.shape)}")
    for what, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tuple(tensor.shape) != normalized_shape:
            raise ValueError(f"torch_npu.npu_layer_norm_eval: {what}'s shape {tuple(tensor.shape)} must be "
                             f"normalized_shape {list(normalized_shape)}")
    # torch's layer norm computes fp16/bf16 inputs in fp32 and rounds once, with weights in the input's dtype
    # or fp32 (autocast's mix), as the kernel does: it runs on the inputs directly.
    weight, bias = (t if t is None or t.dtype in (x.dtype, torch.float32) else t.float() for t in (weight, bias))
    return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)


register_no_derivative("npu_layer_norm_eval")
