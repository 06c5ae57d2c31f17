"""flash_attn 2.x's attention functions as plain torch (the reference for the --fused tests).

Semantics as flash_attn documents them: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k,
nheads_k, headdim) with nheads a multiple of nheads_k (GQA); softmax_scale defaults to 1/sqrt(headdim);
causal and window_size=(left, right) align to the bottom-right corner: query i sees key j when
i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1 unbounded; causal sets
right to 0). The varlen functions take (total_tokens, nheads, headdim) with cumulative sequence
lengths cu_seqlens (0, l1, l1 + l2, ...), each sequence attended on its own.
"""

import torch


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size):
    seq_q, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    seq_k = k.shape[1]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    left, right = window_size
    if causal:
        right = 0
    offset = torch.arange(seq_k)[None, :] - torch.arange(seq_q)[:, None] - (seq_k - seq_q)
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    probs = torch.softmax(scores.masked_fill(~allowed.to(scores.device), float("-inf")), dim=-1)
    if dropout_p:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def _supported(softcap, alibi_slopes, return_attn_probs):
    if softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("the stub computes plain attention only")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _supported(softcap, alibi_slopes, return_attn_probs)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _supported(softcap, alibi_slopes, return_attn_probs)
    outputs = []
    for index in range(len(cu_seqlens_q) - 1):
        q_start, q_end = int(cu_seqlens_q[index]), int(cu_seqlens_q[index + 1])
        k_start, k_end = int(cu_seqlens_k[index]), int(cu_seqlens_k[index + 1])
        outputs.append(_attention(q[None, q_start:q_end], k[None, k_start:k_end], v[None, k_start:k_end],
                                  dropout_p, softmax_scale, causal, window_size)[0])
    return torch.cat(outputs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
