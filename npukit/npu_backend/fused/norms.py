"""Norms: npu_rms_norm (+ its backward), the pattern every family module follows.

RmsNorm's kernel reads fp16/bf16 inputs, computes the mean square and the normalisation in fp32,
multiplies by gamma in fp32 and rounds the result once to the input dtype; rstd is fp32 with the
input's leading dims and a 1 for each of gamma's dims (torch_npu's meta kernel).
"""

from __future__ import annotations

import torch

from npukit.npu_backend.fused import fused_op, register_autograd, upcast


def _normalized_dims(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    return list(range(x.dim() - gamma.dim(), x.dim()))


@fused_op("npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
          unfused="x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma")
def npu_rms_norm(x, gamma, epsilon=1e-6):
    x32 = upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(_normalized_dims(x, gamma), keepdim=True) + epsilon)
    y = x32 * rstd * upcast(gamma)
    return y.to(x.dtype), rstd.float()


@fused_op("npu_rms_norm_backward(Tensor dy, Tensor input, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)",
          unfused="autograd of npu_rms_norm's decomposition", public=False)
def npu_rms_norm_backward(dy, x, gamma, rstd):
    dims = _normalized_dims(x, gamma)
    dy32, x32, g32 = upcast(dy), upcast(x), upcast(gamma)
    x_hat = x32 * rstd
    dgamma = (dy32 * x_hat).sum(list(range(x.dim() - gamma.dim())))
    dxhat = dy32 * g32
    # d/dx of x * rstd(x): rstd * (dxhat - x_hat * mean(dxhat * x_hat)) over the normalized dims
    dx = rstd * (dxhat - x_hat * (dxhat * x_hat).mean(dims, keepdim=True))
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
    return dx, dgamma, None


register_autograd("npu_rms_norm", _rms_norm_backward, _rms_norm_setup)
