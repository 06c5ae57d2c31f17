"""flash_attn.ops.fused_dense.FusedDense: an nn.Linear whose cuBLAS matmul accumulates in fp32."""

import torch


class FusedDense(torch.nn.Linear):
    def __init__(self, in_features, out_features, bias=True, return_residual=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x, process_group=None):
        bias = self.bias.float() if self.bias is not None else None
        out = torch.nn.functional.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return (out, x) if self.return_residual else out
