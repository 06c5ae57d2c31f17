"""xformers.ops.memory_efficient_attention and its causal bias kinds, written out in fp32.

query/key/value: [batch, seq, heads, head_dim], or [batch, seq, head_dim] without heads; scale
defaults to 1/sqrt(head_dim); LowerTriangularMask masks key j > query i (diagonal at the top-left
corner), LowerTriangularFromBottomRightMask key j > i + seq_k - seq_q (bottom-right).
"""

import torch


class LowerTriangularMask:
    offset = staticmethod(lambda seq_q, seq_k: 0)


class LowerTriangularFromBottomRightMask:
    offset = staticmethod(lambda seq_q, seq_k: seq_k - seq_q)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    headless = query.dim() == 3
    if headless:
        query, key, value = query[:, :, None], key[:, :, None], value[:, :, None]
    seq_q, seq_k = query.shape[1], key.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale
    if attn_bias is not None:
        masked = torch.arange(seq_k)[None, :] > torch.arange(seq_q)[:, None] + attn_bias.offset(seq_q, seq_k)
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, value.float()).to(query.dtype)
    return out[:, :, 0] if headless else out
