"""flash_attn.layers.rotary.apply_rotary_emb as plain torch (flash_attn's own apply_rotary_emb_torch).

x (batch, seqlen, nheads, headdim); cos, sin (seqlen_ro >= seqlen, rotary_dim / 2): the first
rotary_dim features of x are rotated (GPT-NeoX halves, or GPT-J pairs when interleaved), the rest kept.
"""

import torch


def _rotate_half(x, interleaved):
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    first, second = x[..., ::2], x[..., 1::2]
    return torch.stack((-second, first), dim=-1).flatten(-2)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    if inplace or seqlen_offsets or cu_seqlens is not None:
        raise NotImplementedError("the stub rotates a fresh tensor from position 0 only")
    rotary_dim = cos.shape[-1] * 2
    seqlen = x.shape[1]

    def table(half):
        full = half.repeat_interleave(2, -1) if interleaved else torch.cat((half, half), -1)
        return full[:seqlen, None].float()

    rotated = x[..., :rotary_dim].float()
    rotated = rotated * table(cos) + _rotate_half(rotated, interleaved) * table(sin)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
