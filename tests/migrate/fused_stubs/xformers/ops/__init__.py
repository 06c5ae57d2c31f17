"""xformers.ops.memory_efficient_attention, its causal bias kinds and a tensor bias, written out in fp32.

query/key/value: [batch, seq, heads, head_dim], or [batch, seq, head_dim] without heads; scale
defaults to 1/sqrt(head_dim); LowerTriangularMask masks key j > query i (diagonal at the top-left
corner), LowerTriangularFromBottomRightMask key j > i + seq_k - seq_q (bottom-right);
LowerTriangularMask().add_bias(t) (LowerTriangularMaskWithTensorBias) adds t, then masks as causal; a tensor
attn_bias ([B, H, Sq, Skv] or broadcastable to it) is added to the scaled scores; the block-diagonal
kinds are in fmha/attn_bias.py.
"""

import torch

from xformers.ops import fmha  # noqa: F401  (xops.fmha.BlockDiagonalMask, as in xformers)
from xformers.ops.fmha.attn_bias import BlockDiagonalMask


class LowerTriangularMask:
    offset = staticmethod(lambda seq_q, seq_k: 0)

    def add_bias(self, bias):
        return LowerTriangularMaskWithTensorBias(bias)


class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """The causal mask (top-left) with an additive tensor bias, added to the scaled scores before the mask."""

    def __init__(self, bias):
        self._bias = bias


class LowerTriangularFromBottomRightMask:
    offset = staticmethod(lambda seq_q, seq_k: seq_k - seq_q)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    headless = query.dim() == 3
    if headless:
        query, key, value = query[:, :, None], key[:, :, None], value[:, :, None]
    seq_q, seq_k = query.shape[1], key.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale
    if isinstance(attn_bias, LowerTriangularMaskWithTensorBias):
        scores = scores + (attn_bias._bias[:, None] if headless else attn_bias._bias).float()
    if isinstance(attn_bias, torch.Tensor):  # additive, after the scale; [B, Sq, Skv] for 3-D inputs
        scores = scores + (attn_bias[:, None] if headless else attn_bias).float()
    elif isinstance(attn_bias, BlockDiagonalMask):  # batch 1, the sequences concatenated
        scores = scores.masked_fill(attn_bias.masked(), float("-inf"))
    elif attn_bias is not None:
        masked = torch.arange(seq_k)[None, :] > torch.arange(seq_q)[:, None] + attn_bias.offset(seq_q, seq_k)
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, value.float()).to(query.dtype)
    return out[:, :, 0] if headless else out
