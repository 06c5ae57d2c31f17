"""Fused torch_npu ops by their unfused decompositions in plain torch: the precision fix `unfuse`.

A fused kernel rounds where its reference does not: npu_fusion_attention keeps its softmax
probabilities in the input dtype for the P @ V matmul, so over a long fp16 row the many small
probabilities below fp16's smallest subnormal (2**-25) are lost together. The fix computes that
call by the same math written with torch's own ops, in fp32, rounded once to the output dtype:
what the golden run computes (the emulator's fused kernels with the device's numerics off,
npukit/npu_backend/fused). `npu-run --precision-fix` runs the function below in place of the call,
and the fix finder prints that same function's source for the user to paste, after the functions it
calls (HELPERS): they use nothing but torch (a test runs their source in a namespace holding only
torch). Decomposed: npu_fusion_attention and _v2, and the inference kernels npu_prompt_flash_attention,
npu_incre_flash_attention and npu_fused_infer_attention_score (and _v2: v1's under v2's names), all by
attention_unfused.

The decomposition calls torch's functions (`torch.matmul`, `torch.mul`), not Tensor operators: a dump
of the patched code records them in place of the fused op, and the compare, aligning the two op
streams by name, then does not pair them with the user's own `*` or `+` after the call.

`accepts()` says whether a call the dump recorded is one the decomposition computes, by running it
on fake tensors of the recorded shapes: the function's own checks are the only list of what it
covers.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import torch


def attention_layout_unfused(x, layout, heads):
    """[B, N, S, D] of a BNSD, BSND, BSH or SBH attention input of `heads` heads."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    x = x.unflatten(2, (heads, -1))
    return x.transpose(1, 2) if layout == "BSH" else x.permute(1, 2, 0, 3)


def attention_output_unfused(out, layout):
    """A [B, N, S, D] attention output in `layout` (BNSD, BSND, BSH or SBH), contiguous."""
    if layout == "BSND":
        out = out.transpose(1, 2)
    elif layout == "BSH":
        out = out.transpose(1, 2).flatten(2)
    elif layout == "SBH":
        out = out.permute(2, 0, 1, 3).flatten(2)
    return out.contiguous()


def attention_masked_unfused(sq, skv, atten_mask, sparse_mode, pre_tokens, next_tokens, device, q_lens=None,
                             kv_lens=None):
    """Where (True) a query may not see a key, broadcastable to [B, N, Sq, Skv], or None. With atten_mask
    (True = masked out) the sparse mode applies: 0 the mask and only the band -pre_tokens <= j - i <=
    next_tokens (top-left origin), 1 the mask, 2 j > i, 3 j - i > Skv - Sq, 4 the band around the
    bottom-right diagonal (2-4 take the compressed 2048x2048 mask, whose content is that rule); without a
    mask every mode computes everything. q_lens / kv_lens: each batch's valid lengths (rows and keys
    beyond them masked, the bottom-right diagonal theirs)."""
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(skv, device=device).view(1, -1)
    masked = None
    if q_lens is not None or kv_lens is not None:
        batch = len(q_lens if q_lens is not None else kv_lens)
        sq = torch.tensor(q_lens if q_lens is not None else [sq] * batch, device=device).view(-1, 1, 1, 1)
        skv = torch.tensor(kv_lens if kv_lens is not None else [skv] * batch, device=device).view(-1, 1, 1, 1)
        masked = (i >= sq) | (j >= skv)
    if atten_mask is None:
        return masked
    diff = j - i
    if sparse_mode in (0, 1):
        structural = atten_mask.bool()
        if sparse_mode == 0:
            structural = structural | (diff < -pre_tokens) | (diff > next_tokens)
    elif sparse_mode == 2:
        structural = diff > 0
    elif sparse_mode == 3:
        structural = diff > skv - sq
    else:  # 4
        structural = (diff - (skv - sq) < -pre_tokens) | (diff - (skv - sq) > next_tokens)
    return structural if masked is None else masked | structural


def attention_unfused(q, k, v, scale, bias=None, masked=None):
    """softmax(scale * q @ k^T + bias, masked) @ v per head in fp32 (fp64 inputs: fp64): q [B, N, Sq, D],
    k and v [B, Nkv, Skv, D] (a key/value head serves N / Nkv query heads), masked (True) scores at -1e30
    before the softmax, a row whose every key is masked giving zeros. Returns that output [B, N, Sq, Dv]
    and the softmax's row max and sum of exp(score - max) [B, N, Sq, 1]."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, 1)
    v = v.to(dtype).repeat_interleave(group, 1)
    scores = torch.mul(torch.matmul(q.to(dtype), k.transpose(-1, -2)), scale)
    if bias is not None:
        scores = torch.add(scores, bias.to(dtype))
    if masked is not None:
        scores = torch.masked_fill(scores, masked, -1e30)
    probs = torch.softmax(scores, -1)
    out = torch.matmul(probs, v)
    if masked is not None:
        out = torch.masked_fill(out, masked.all(-1, keepdim=True), 0.0)
    # the largest probability is 1 / that sum
    return out, torch.amax(scores, -1, keepdim=True), torch.reciprocal(torch.amax(probs, -1, keepdim=True))


def refuse_unfused(function, options):
    """A ValueError naming the options (name: given) the decomposition `function` does not compute."""
    refused = [name for name, given in options.items() if given]
    if refused:
        raise ValueError(f"{function} does not compute {', '.join(refused)}: keep the fused call")


def fusion_attention_unfused(query, key, value, head_num, layout, pse, pse_type, atten_mask, scale, pre_tokens,
                             next_tokens, sparse_mode):
    """npu_fusion_attention(_v2)'s outputs (attention_out, softmax_max, softmax_sum, softmax_out, seed,
    offset, numels) from the options its caller computes (it refused the others)."""
    if layout in ("BSH", "SBH"):
        kv_heads = key.shape[2] // (query.shape[2] // head_num)
    else:
        kv_heads = key.shape[1 if layout == "BNSD" else 2]
    with torch.autocast(query.device.type, enabled=False):
        q = attention_layout_unfused(query, layout, head_num)
        k = attention_layout_unfused(key, layout, kv_heads)
        masked = attention_masked_unfused(q.shape[2], k.shape[2], atten_mask, sparse_mode, pre_tokens, next_tokens,
                                          query.device)
        # pse_type 1: scale * (q @ k^T + pse); 0: scale * q @ k^T + pse
        bias = None if pse is None else torch.mul(pse.to(torch.promote_types(pse.dtype, torch.float32)), scale) \
            if pse_type == 1 else pse
        out, row_max, row_sum = attention_unfused(q, k, attention_layout_unfused(value, layout, kv_heads), scale,
                                                  bias, masked)
    b, n, sq, skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return (attention_output_unfused(out.to(query.dtype), layout), row_max.float().expand(b, n, sq, 8).contiguous(),
            row_sum.float().expand(b, n, sq, 8).contiguous(), query.new_empty(0), 0, 0, b * n * sq * skv)


def npu_fusion_attention_unfused(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                                 atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                                 next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                                 actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                                 softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    """torch_npu.npu_fusion_attention unfused: per head softmax(scale * (q @ k^T + pse), masked) @ v in
    fp32 (a key/value head serves head_num / its count query heads), the output rounded once to the
    input dtype. Returns what the fused op returns: (attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels). Layouts BSH, SBH, BSND, BNSD; sparse_mode 0-4; no dropout."""
    layout = input_layout.upper()
    refuse_unfused("npu_fusion_attention_unfused", {
        f"input_layout {input_layout}": layout not in ("BSH", "SBH", "BSND", "BNSD"),
        f"keep_prob {keep_prob} (dropout)": keep_prob != 1, f"sparse_mode {sparse_mode}": sparse_mode not in range(5),
        "padding_mask": padding_mask is not None, "prefix": prefix is not None,
        "actual_seq_qlen": actual_seq_qlen is not None, "actual_seq_kvlen": actual_seq_kvlen is not None,
        "sink": sink is not None, "dropout_mask": dropout_mask is not None})
    return fusion_attention_unfused(query, key, value, head_num, layout, pse, 1, atten_mask, scale, pre_tockens,
                                    next_tockens, sparse_mode)


def npu_fusion_attention_v2_unfused(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                                    atten_mask=None, query_rope=None, key_rope=None, scale=1.0, keep_prob=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, prefix=None,
                                    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                    gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                                    kv_start_idx=None, softmax_layout="", sink=None, dropout_mask=None, seed=0,
                                    offset=0):
    """torch_npu.npu_fusion_attention_v2 unfused: as npu_fusion_attention_unfused, the pse added after
    the scale with pse_type 0 (scale * q @ k^T + pse), inside it with pse_type 1. Layouts BSH, SBH,
    BSND, BNSD; sparse_mode 0-4; no dropout, no rope parts, no generated (alibi) pse."""
    layout = input_layout.upper()
    refuse_unfused("npu_fusion_attention_v2_unfused", {
        f"input_layout {input_layout}": layout not in ("BSH", "SBH", "BSND", "BNSD"),
        f"keep_prob {keep_prob} (dropout)": keep_prob != 1, f"sparse_mode {sparse_mode}": sparse_mode not in range(5),
        f"pse_type {pse_type}": pse_type not in (0, 1), "padding_mask": padding_mask is not None,
        "prefix": prefix is not None, "actual_seq_qlen": actual_seq_qlen is not None,
        "actual_seq_kvlen": actual_seq_kvlen is not None, "query_rope": query_rope is not None,
        "key_rope": key_rope is not None, "sink": sink is not None, "dropout_mask": dropout_mask is not None})
    return fusion_attention_unfused(query, key, value, head_num, layout, pse, pse_type, atten_mask, scale, pre_tokens,
                                    next_tokens, sparse_mode)


def infer_attention_unfused(query, key, value, pse_shift, atten_mask, q_lens, kv_lens, num_heads, num_key_value_heads,
                            scale, pre_tokens, next_tokens, input_layout, sparse_mode):
    """The inference kernels' attention: per head softmax(scale * q @ k^T + pse_shift, masked) @ v in fp32,
    the output rounded once to the input dtype, in the output layout (BNSD_BSND: BSND); and the rows'
    log-sum-exp [B, N, Sq, 1] (fp32). atten_mask: (Sq, Skv), (B, Sq, Skv), (B, 1, Sq, Skv) or, for Sq = 1,
    (B, Skv), cut to the sequences; pse_shift (B|1, N, >=Sq, >=Skv), cut too; q_lens / kv_lens: each
    batch's valid lengths (one value: every batch's)."""
    layout, out_layout = ("BNSD", "BSND") if input_layout == "BNSD_BSND" else (input_layout, input_layout)
    kv_heads = num_key_value_heads or num_heads
    with torch.autocast(query.device.type, enabled=False):
        q = attention_layout_unfused(query, layout, num_heads)
        k = attention_layout_unfused(key, layout, kv_heads)
        batch, sq, skv = q.shape[0], q.shape[2], k.shape[2]
        q_lens = None if q_lens is None else [int(n) for n in q_lens] * (batch if len(q_lens) == 1 else 1)
        kv_lens = None if kv_lens is None else [int(n) for n in kv_lens] * (batch if len(kv_lens) == 1 else 1)
        mask = atten_mask
        if mask is not None and sparse_mode in (0, 1):
            if mask.dim() == 2:
                mask = mask[:, None, None, :] if sq == 1 and mask.shape[0] != 1 else mask[None, None]
            elif mask.dim() == 3:
                mask = mask[:, None]
            mask = mask[..., :sq, :skv]
        masked = attention_masked_unfused(sq, skv, mask, sparse_mode, pre_tokens, next_tokens, query.device,
                                          None if q_lens is None else q_lens[:batch],
                                          None if kv_lens is None else kv_lens[:batch])
        bias = None if pse_shift is None else pse_shift[:, :, :sq, :skv]
        out, row_max, row_sum = attention_unfused(q, k, attention_layout_unfused(value, layout, kv_heads), scale,
                                                  bias, masked)
        log_sum_exp = torch.add(row_max, torch.log(row_sum)).float()
    return attention_output_unfused(out.to(query.dtype), out_layout), log_sum_exp


def npu_prompt_flash_attention_unfused(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                                       actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                                       quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                                       pre_tokens=2147483647, next_tokens=0, input_layout="BSH",
                                       num_key_value_heads=0, actual_seq_lengths_kv=None, sparse_mode=0):
    """torch_npu.npu_prompt_flash_attention unfused: per head softmax(scale_value * q @ k^T + pse_shift,
    masked) @ v in fp32, the output rounded once to the input dtype. Layouts BSH, BSND, BNSD, BNSD_BSND;
    sparse_mode 0-4 (0 with a mask: only the band, next_tokens 0 by default); actual_seq_lengths(_kv);
    no quantization."""
    refuse_unfused("npu_prompt_flash_attention_unfused", {
        f"input_layout {input_layout}": input_layout not in ("BSH", "BSND", "BNSD", "BNSD_BSND"),
        f"sparse_mode {sparse_mode}": sparse_mode not in range(5), "padding_mask": padding_mask is not None,
        **{name: given is not None for name, given in (
            ("deq_scale1", deq_scale1), ("quant_scale1", quant_scale1), ("deq_scale2", deq_scale2),
            ("quant_scale2", quant_scale2), ("quant_offset2", quant_offset2))}})
    return infer_attention_unfused(query, key, value, pse_shift, atten_mask, actual_seq_lengths,
                                   actual_seq_lengths_kv, num_heads, num_key_value_heads, scale_value, pre_tokens,
                                   next_tokens, input_layout, sparse_mode)[0]


def npu_incre_flash_attention_unfused(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                                      actual_seq_lengths=None, antiquant_scale=None, antiquant_offset=None,
                                      block_table=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                                      quant_scale2=None, quant_offset2=None, kv_padding_size=None, num_heads=1,
                                      scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0,
                                      inner_precise=1):
    """torch_npu.npu_incre_flash_attention unfused: the new tokens' softmax(scale_value * q @ k^T +
    pse_shift, masked) @ v per head in fp32, the output rounded once to the input dtype. Layouts BSH,
    BSND, BNSD; actual_seq_lengths (the keys' lengths); no paged cache (block_table), no quantization."""
    refuse_unfused("npu_incre_flash_attention_unfused", {
        f"input_layout {input_layout}": input_layout not in ("BSH", "BSND", "BNSD"),
        "padding_mask": padding_mask is not None, "block_table (paged KV cache)": block_table is not None,
        **{name: given is not None for name, given in (
            ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset),
            ("dequant_scale1", dequant_scale1), ("quant_scale1", quant_scale1), ("dequant_scale2", dequant_scale2),
            ("quant_scale2", quant_scale2), ("quant_offset2", quant_offset2), ("kv_padding_size", kv_padding_size))}})
    return infer_attention_unfused(query, key, value, pse_shift, atten_mask, None, actual_seq_lengths, num_heads,
                                   num_key_value_heads, scale_value, 2147483647, 2147483647, input_layout, 0)[0]


def npu_fused_infer_attention_score_unfused(query, key, value, *, pse_shift=None, atten_mask=None,
                                            actual_seq_lengths=None, actual_seq_lengths_kv=None, dequant_scale1=None,
                                            quant_scale1=None, dequant_scale2=None, quant_scale2=None,
                                            quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
                                            key_antiquant_scale=None, key_antiquant_offset=None,
                                            value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                            query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                            value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                            key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                            pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                            num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                            antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                            softmax_lse_flag=False):
    """torch_npu.npu_fused_infer_attention_score unfused: per head softmax(scale * q @ k^T + pse_shift,
    masked) @ v in fp32 (one query token: no sparse mode, no band, as the kernel's incremental branch),
    the output rounded once to the input dtype; returns (attention_out, softmax_lse) as the fused op
    does (lse [B, N, Sq, 1] with softmax_lse_flag, else a [1] zero). Layouts BSH, BSND, BNSD, BNSD_BSND;
    sparse_mode 0-4; actual_seq_lengths(_kv); MLA rope parts; no paged cache, no quantization."""
    refuse_unfused("npu_fused_infer_attention_score_unfused", {
        f"input_layout {input_layout}": input_layout not in ("BSH", "BSND", "BNSD", "BNSD_BSND"),
        f"sparse_mode {sparse_mode}": sparse_mode not in range(5),
        "block_table (paged KV cache)": block_table is not None,
        "query_rope without key_rope": (query_rope is None) != (key_rope is None),
        **{name: given is not None for name, given in (
            ("dequant_scale1", dequant_scale1), ("quant_scale1", quant_scale1), ("dequant_scale2", dequant_scale2),
            ("quant_scale2", quant_scale2), ("quant_offset2", quant_offset2), ("antiquant_scale", antiquant_scale),
            ("antiquant_offset", antiquant_offset), ("key_antiquant_scale", key_antiquant_scale),
            ("key_antiquant_offset", key_antiquant_offset), ("value_antiquant_scale", value_antiquant_scale),
            ("value_antiquant_offset", value_antiquant_offset), ("query_padding_size", query_padding_size),
            ("kv_padding_size", kv_padding_size), ("key_shared_prefix", key_shared_prefix),
            ("value_shared_prefix", value_shared_prefix), ("actual_shared_prefix_len", actual_shared_prefix_len),
            ("key_rope_antiquant_scale", key_rope_antiquant_scale))}})
    if query_rope is not None:  # MLA: the rope part's scores q_rope @ k_rope^T join q @ k^T
        query = torch.cat([query, query_rope.to(query.dtype)], -1)
        key = torch.cat([key, key_rope.to(key.dtype)], -1)
    layout = "BNSD" if input_layout == "BNSD_BSND" else input_layout
    if query.shape[2 if layout == "BNSD" else 1] == 1 and query_rope is None:  # the incremental branch
        actual_seq_lengths, sparse_mode, pre_tokens, next_tokens = None, 0, 2147483647, 2147483647
    out, log_sum_exp = infer_attention_unfused(query, key, value, pse_shift, atten_mask, actual_seq_lengths,
                                               actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                                               pre_tokens, next_tokens, input_layout, sparse_mode)
    return out, log_sum_exp if softmax_lse_flag else query.new_zeros(1, dtype=torch.float32)


def npu_fused_infer_attention_score_v2_unfused(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                               atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                               block_table=None, dequant_scale_query=None, dequant_scale_key=None,
                                               dequant_offset_key=None, dequant_scale_value=None,
                                               dequant_offset_value=None, dequant_scale_key_rope=None,
                                               quant_scale_out=None, quant_offset_out=None, quant_scale_p=None,
                                               learnable_sink=None, num_query_heads=1, num_key_value_heads=0,
                                               softmax_scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                                               input_layout="BSH", sparse_mode=0, block_size=0, query_quant_mode=0,
                                               key_quant_mode=0, value_quant_mode=0, inner_precise=0,
                                               return_softmax_lse=False, query_dtype=None, key_dtype=None,
                                               value_dtype=None, query_rope_dtype=None, key_rope_dtype=None,
                                               key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
                                               dequant_scale_query_dtype=None, dequant_scale_key_dtype=None,
                                               dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None,
                                               out_dtype=None):
    """torch_npu.npu_fused_infer_attention_score_v2 unfused: v1's decomposition under v2's names
    (num_query_heads, softmax_scale, actual_seq_qlen/kvlen, return_softmax_lse); returns (attention_out,
    softmax_lse). Layouts BSH, BSND, BNSD, BNSD_BSND; sparse_mode 0-4; MLA rope parts; no TND, no paged
    cache, no learnable sink, no quantization."""
    refuse_unfused("npu_fused_infer_attention_score_v2_unfused", {
        f"input_layout {input_layout}": input_layout not in ("BSH", "BSND", "BNSD", "BNSD_BSND"),
        "learnable_sink": learnable_sink is not None,
        **{f"{name}={mode}": bool(mode) for name, mode in (
            ("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode),
            ("value_quant_mode", value_quant_mode))},
        **{name: given is not None for name, given in (
            ("dequant_scale_query", dequant_scale_query), ("dequant_scale_key", dequant_scale_key),
            ("dequant_offset_key", dequant_offset_key), ("dequant_scale_value", dequant_scale_value),
            ("dequant_offset_value", dequant_offset_value), ("dequant_scale_key_rope", dequant_scale_key_rope),
            ("quant_scale_out", quant_scale_out), ("quant_offset_out", quant_offset_out),
            ("quant_scale_p", quant_scale_p), ("query_dtype", query_dtype), ("key_dtype", key_dtype),
            ("value_dtype", value_dtype), ("query_rope_dtype", query_rope_dtype), ("key_rope_dtype", key_rope_dtype),
            ("key_shared_prefix_dtype", key_shared_prefix_dtype),
            ("value_shared_prefix_dtype", value_shared_prefix_dtype),
            ("dequant_scale_query_dtype", dequant_scale_query_dtype),
            ("dequant_scale_key_dtype", dequant_scale_key_dtype),
            ("dequant_scale_value_dtype", dequant_scale_value_dtype),
            ("dequant_scale_key_rope_dtype", dequant_scale_key_rope_dtype), ("out_dtype", out_dtype))}})
    return npu_fused_infer_attention_score_unfused(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_qlen,
        actual_seq_lengths_kv=actual_seq_kvlen, block_table=block_table, query_rope=query_rope, key_rope=key_rope,
        num_heads=num_query_heads, scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens,
        input_layout=input_layout, num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
        softmax_lse_flag=return_softmax_lse)


# The fused ops (as dumps name them) that the unfuse fix computes by their decomposition.
DECOMPOSITIONS = {"NPU.npu_fusion_attention": npu_fusion_attention_unfused,
                  "NPU.npu_fusion_attention_v2": npu_fusion_attention_v2_unfused,
                  "NPU.npu_prompt_flash_attention": npu_prompt_flash_attention_unfused,
                  "NPU.npu_incre_flash_attention": npu_incre_flash_attention_unfused,
                  "NPU.npu_fused_infer_attention_score": npu_fused_infer_attention_score_unfused,
                  "NPU.npu_fused_infer_attention_score_v2": npu_fused_infer_attention_score_v2_unfused}
# The functions the decompositions call, printed before them (each once).
HELPERS = {
    "NPU.npu_fusion_attention": (attention_layout_unfused, attention_output_unfused, attention_masked_unfused,
                                 attention_unfused, refuse_unfused, fusion_attention_unfused),
    "NPU.npu_fusion_attention_v2": (attention_layout_unfused, attention_output_unfused, attention_masked_unfused,
                                    attention_unfused, refuse_unfused, fusion_attention_unfused),
    **dict.fromkeys(("NPU.npu_prompt_flash_attention", "NPU.npu_incre_flash_attention",
                     "NPU.npu_fused_infer_attention_score"),
                    (attention_layout_unfused, attention_output_unfused, attention_masked_unfused, attention_unfused,
                     refuse_unfused, infer_attention_unfused)),
    "NPU.npu_fused_infer_attention_score_v2": (attention_layout_unfused, attention_output_unfused,
                                               attention_masked_unfused, attention_unfused, refuse_unfused,
                                               infer_attention_unfused, npu_fused_infer_attention_score_unfused)}


def decomposition(api: str):
    return DECOMPOSITIONS.get(api)


def source(*apis: str) -> str:
    """The decompositions' source as printed for the user: `import torch`, the functions they call (each
    once), then each decomposition."""
    functions = []
    for function in [*(helper for api in apis for helper in HELPERS[api]), *(DECOMPOSITIONS[api] for api in apis)]:
        if function not in functions:
            functions.append(function)
    return "import torch\n\n\n" + "\n\n".join(inspect.getsource(function) for function in functions)


def call_replaced(line: str, api: str) -> str | None:
    """The user's line with the fused call (`torch_npu.npu_fusion_attention(`, `torch.ops.npu.X.default(`,
    a bare imported name) calling the decomposition instead; None when the line does not name it."""
    name = api.removeprefix("NPU.")
    call = re.compile(rf"(?<![\w.])(?:[A-Za-z_][\w.]*\.)?{re.escape(name)}(?:\.default)?(?=\s*\()")
    replaced, count = call.subn(DECOMPOSITIONS[api].__name__, line)
    return replaced if count == 1 else None


def check_api(api: str, where: str) -> None:
    """A UserError unless `api` is a fused op with a decomposition."""
    if api not in DECOMPOSITIONS:
        from npukit.errors import UserError

        raise UserError(f"{where}: unfuse {api or '(no api)'}: no decomposition of that op (unfuse takes "
                        f"{', '.join(DECOMPOSITIONS)})")


def run(change, args, kwargs):
    """The call `change` (a FixChange of kind unfuse) names, computed by its op's decomposition."""
    from npukit.errors import UserError

    check_api(change.api, "--precision-fix")
    try:
        return DECOMPOSITIONS[change.api](*args, **kwargs)
    except ValueError as exc:  # an option the decomposition does not cover
        raise UserError(f"--precision-fix: {change.describe()}: {exc}") from None


def code(changes) -> str:
    """The unfuse changes as code to paste: for each call site the line to write there (the call
    replaced), then each op's decomposition in full, once. Changes at one line in several modules
    (blocks 6 and 7 of a model whose blocks share that line) are one edit: the line then computes
    unfused in every module that runs it, more than the fix needs and no less precise."""
    sites: dict[tuple, list] = {}
    for change in changes:
        sites.setdefault((change.api, change.line, change.source), []).append(change)
    notes, apis = [], []
    for (api, line, line_source), group in sites.items():
        function = DECOMPOSITIONS[api].__name__
        replaced = call_replaced(line_source, api) if line_source else None
        what = "; ".join(change.describe(False) for change in group)
        notes.append(f"# {what}: at {line or 'its line'} call {function} (defined below with the\n"
                     f"# functions it calls: put them in that file) in place of the fused op, as\n"
                     f"#   {replaced or f'{function}(<the arguments of the fused call>)'}")
        if api not in apis:
            apis.append(api)
    return "\n".join([*notes, source(*apis)]).rstrip("\n")


def accepts(name: str, body: dict, leaves) -> bool:
    """Does the decomposition compute this call, as dump.json recorded it? `name`: its forward entry
    (`NPU.npu_fusion_attention.1.forward`), `body`: its dump.json record, `leaves`: its input tensors
    (the DumpEntry's). The decomposition runs on fake tensors of the recorded shapes and dtypes, the
    arguments decoded as the pre-check decodes them: its own checks decide."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npukit.accuracy import naming
    from npukit.accuracy.precheck import CannotRun, _arguments, _fill, _torch_dtype

    function = DECOMPOSITIONS.get(naming.split_entry_name(name)[0])
    if function is None or not isinstance(body, dict):
        return False
    try:
        args, kwargs, slots = _arguments(name, body, {leaf.name: leaf for leaf in leaves})
        with FakeTensorMode():
            tensors = [torch.empty(leaf.shape, dtype=_torch_dtype(leaf.dtype)) for leaf in slots]
            function(*_fill(args, tensors, "cpu"), **_fill(kwargs, tensors, "cpu"))
    except (CannotRun, ValueError, TypeError, RuntimeError, IndexError):
        return False  # an option it refuses, shapes it cannot take, an argument the dump did not keep
    return True


def recorded_calls(rank_dir: Path, names: list[str]) -> dict[str, dict]:
    """The bodies dump.json recorded for these forward entries (their arguments), read from the file's
    text at each name: the dump is not parsed whole again for the few fused calls the fix finder asks about."""
    if not names:
        return {}
    try:
        text = (Path(rank_dir) / "dump.json").read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    decoder, bodies = json.JSONDecoder(), {}
    for name in names:
        found = re.search(rf'"{re.escape(name)}"\s*:\s*', text)
        if found is None:
            continue
        try:
            body = decoder.raw_decode(text, found.end())[0]
        except ValueError:
            continue
        if isinstance(body, dict):
            bodies[name] = body
    return bodies
