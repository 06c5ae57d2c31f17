"""flash_attn.ops.rms_norm: the dropout_layer_norm CUDA kernel's RMS norm, in fp32 rounded to x's dtype."""

import torch


def rms_norm(x, weight, epsilon):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float()
    return y.to(x.dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)
