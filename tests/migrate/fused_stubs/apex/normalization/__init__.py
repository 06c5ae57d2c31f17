"""apex.normalization's FusedLayerNorm and FusedRMSNorm, their math written out in fp32."""

import torch


class _FusedNorm(torch.nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape))
            if self.has_bias:
                self.bias = torch.nn.Parameter(torch.zeros(self.normalized_shape))

    def forward(self, x):
        dims = tuple(range(-len(self.normalized_shape), 0))
        y = self.normalize(x.float(), dims)
        if hasattr(self, "weight"):
            y = y * self.weight.float()
        if hasattr(self, "bias"):
            y = y + self.bias.float()
        return y.to(x.dtype)


class FusedLayerNorm(_FusedNorm):
    has_bias = True

    def normalize(self, x, dims):
        mean = x.mean(dims, keepdim=True)
        variance = ((x - mean) ** 2).mean(dims, keepdim=True)
        return (x - mean) / torch.sqrt(variance + self.eps)


class FusedRMSNorm(_FusedNorm):
    has_bias = False

    def normalize(self, x, dims):
        return x / torch.sqrt((x * x).mean(dims, keepdim=True) + self.eps)
