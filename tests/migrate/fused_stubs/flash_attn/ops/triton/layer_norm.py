"""flash_attn.ops.triton.layer_norm's norms as its kernel computes them: x (+ residual) added in fp32,
the residual sum kept in the residual's dtype (fp32 for residual_in_fp32 without one), the norm of the
unrounded sum rounded to x's dtype; prenorm also returns the sum (x itself when there is nothing to add)."""

import torch


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                  is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    total = x.float() if residual is None else x.float() + residual.float()
    if is_rms_norm:
        y = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = (total - total.mean(-1, keepdim=True)) * torch.rsqrt(total.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * weight.float() + (bias.float() if bias is not None else 0)
    if not prenorm:
        return y.to(x.dtype)
    if residual is not None:
        kept = total.to(residual.dtype)
    else:
        kept = x.float() if residual_in_fp32 else x
    return y.to(x.dtype), kept


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    return layer_norm_fn(x, weight, bias, residual, eps=eps, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                         is_rms_norm=True)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm,
                           residual_in_fp32=residual_in_fp32)
