"""MoE routing family: gating top-k softmax, init/finalize routing, expert token counts and the
token permute/unpermute pair (with backward), with the semantics of torch_npu's op docs (and
CANN's aclnnMoe* docs where torch_npu's are terse).

Vocabulary: N token rows of hidden size H, each routed to K of E experts. The "expanded" rows are
the N*K (token, expert) pairs sorted by expert. Sorting is by expert id, ties in the order the docs'
keyValueSort gives: by row_idx for npu_moe_init_routing (its row_idx is column-major, j*N + i), by
the flat position i*K + j for npu_moe_init_routing_v2 and npu_moe_token_permute.

Values are computed in fp32 and rounded once to the output dtype. Only npu_moe_token_permute and
npu_moe_token_unpermute have autograd in torch_npu 2.13 (and here); the routing ops are inference
interfaces there, and backpropagating through them raises on the emulator as on the device.

Shapes: every op's output sizes follow from its arguments (the fake kernels are the kernels),
except what the docs leave undefined, which is filled with zeros (or -1 for indices) here.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from npukit.npu_backend import _C
from npukit.npu_backend.fused import (
    allowed_floats,
    compute_dtype,
    fused_op,
    register_autograd,
    register_no_derivative,
    upcast,
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_dtype(op: str, name: str, tensor: torch.Tensor, allowed) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{op}: {name} must be {names}, got {tensor.dtype}")


def _check_float(op: str, name: str, tensor: torch.Tensor) -> None:
    _check_dtype(op, name, tensor, allowed_floats(tensor))


def _check_dims(op: str, name: str, tensor: torch.Tensor, dims) -> None:
    if tensor.dim() not in dims:
        raise ValueError(f"{op}: {name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(tensor.shape)}")


def _inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """position[order[i]] = i."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _pair_rows(index: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index [N, K] of rows (-1 or past the last row: the pair has none) as a safe gather index,
    and which pairs have a row."""
    present = (index >= 0) & (index < rows)
    return index.clamp(0, max(rows - 1, 0)), present


def _weighted_sum_of_rows(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum_k weights[i, k] * rows[index[i, k]], accumulated in fp32 and rounded once.

    One gather and one fused multiply-add into an fp32 accumulator per top-k slot: the products of
    fp16/bf16 values are exact in fp32, so this is the kernel's fp32 arithmetic, without an fp32
    copy of the [N, K, H] gathered rows. (A loop over the K slots, K <= 8 in practice: the batched
    [1, K] @ [K, H] matmul runs one small matmul per token on the device and measured 2-3x slower.)"""
    accumulation = compute_dtype(rows.dtype)
    out = torch.zeros(index.shape[0], rows.shape[-1], device=rows.device, dtype=accumulation)
    weights32 = weights.to(accumulation)
    for slot in range(index.shape[1]):
        out.addcmul_(rows.index_select(0, index[:, slot]), weights32[:, slot:slot + 1])
    return out.to(out_dtype)


def _row_dots(rows: torch.Tensor, index: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """dots[i, k] = <rows[index[i, k]], vectors[i]> in fp32 (one slot at a time, as above)."""
    vectors32 = upcast(vectors)
    return torch.stack([rows.index_select(0, index[:, slot]).to(vectors32.dtype).mul_(vectors32).sum(-1)
                        for slot in range(index.shape[1])], dim=1)


def _is_fake(tensor: torch.Tensor) -> bool:
    """Tracing with fake tensors (torch.compile): values, and so data-dependent fills, do not exist."""
    return is_fake(tensor) or tensor.device.type == "meta"


# ---- gating -------------------------------------------------------------------------------------

_GATING = "npu_moe_gating_top_k_softmax"


@fused_op("npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
          unfused="y, expert_idx = torch.softmax(x.float(), -1).topk(k); row_idx[r, j] = j * rows + r")
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    _check_dims(_GATING, "x", x, (2, 3))
    _check_dtype(_GATING, "x", x, _FLOAT_DTYPES)
    experts = x.shape[-1]
    if not 0 < k <= min(experts, 1024):
        raise ValueError(f"{_GATING}: k must be in (0, min(x.size(-1)={experts}, 1024)], got {k}")
    y, expert_idx = torch.softmax(upcast(x), dim=-1).topk(k, dim=-1)
    expert_idx = expert_idx.to(torch.int32)
    if finished is not None:
        _check_dtype(_GATING, "finished", finished, (torch.bool,))
        if finished.shape != x.shape[:-1]:
            raise ValueError(f"{_GATING}: finished must have x's shape without its last dim "
                             f"{tuple(x.shape[:-1])}, got {tuple(finished.shape)}")
        # a finished row routes to no expert: its expert ids are E (one past the last)
        expert_idx = expert_idx.masked_fill(finished.unsqueeze(-1), experts)
    rows = x.numel() // experts
    row_idx = (torch.arange(rows, device=x.device, dtype=torch.int32).unsqueeze(1)
               + torch.arange(k, device=x.device, dtype=torch.int32) * rows)
    return y.to(x.dtype), expert_idx, row_idx.reshape(y.shape)


# ---- init routing ----------------------------------------------------------------------------------

_INIT = "npu_moe_init_routing"


@fused_op("npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)",
          unfused="order = argsort by (expert_idx, row_idx); expanded_x = x[row_idx[order] % N]")
def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    _check_dims(_INIT, "x", x, (2,))
    _check_dims(_INIT, "expert_idx", expert_idx, (2,))
    _check_dtype(_INIT, "x", x, _FLOAT_DTYPES)
    _check_dtype(_INIT, "expert_idx", expert_idx, (torch.int32,))
    _check_dtype(_INIT, "row_idx", row_idx, (torch.int32,))
    if row_idx.shape != expert_idx.shape or expert_idx.shape[0] != x.shape[0]:
        raise ValueError(f"{_INIT}: row_idx {tuple(row_idx.shape)} and expert_idx {tuple(expert_idx.shape)} "
                         f"must both be (x.size(0)={x.shape[0]}, K)")
    if active_num < 0:
        raise ValueError(f"{_INIT}: active_num must be >= 0, got {active_num}")
    rows, k = expert_idx.shape
    flat_rows = row_idx.reshape(-1).long()
    # keyValueSort(expert_idx, row_idx): by expert, equal experts by row_idx
    order = torch.argsort(expert_idx.reshape(-1).long() * (rows * k) + flat_rows)
    sorted_rows = flat_rows[order]
    expanded_expert_idx = expert_idx.reshape(-1)[order]
    expanded_row_idx = _inverse_permutation(sorted_rows).to(torch.int32)
    active_rows = min(rows, active_num) * k
    expanded_x = x.index_select(0, sorted_rows[:active_rows] % rows)
    return expanded_x, expanded_row_idx, expanded_expert_idx


_INIT_V2 = "npu_moe_init_routing_v2"


def _init_v2_arguments(x, expert_idx, scale, offset, expert_capacity, expert_num, drop_pad_mode,
                       expert_tokens_num_type, expert_tokens_num_flag, quant_mode, active_expert_range,
                       row_idx_type, x_dtype) -> tuple[int, int]:
    """Checks the arguments; returns the active expert range [start, end)."""
    _check_dims(_INIT_V2, "x", x, (2,))
    _check_dims(_INIT_V2, "expert_idx", expert_idx, (2,))
    _check_dtype(_INIT_V2, "x", x, _FLOAT_DTYPES)
    _check_dtype(_INIT_V2, "expert_idx", expert_idx, (torch.int32,))
    if x.shape[0] != expert_idx.shape[0]:
        raise ValueError(f"{_INIT_V2}: x and expert_idx must have the same first dim, got "
                         f"{tuple(x.shape)} and {tuple(expert_idx.shape)}")
    if quant_mode != -1 or x_dtype is not None or offset is not None:
        raise NotImplementedError(
            f"{_INIT_V2}: quant_mode={quant_mode} (quantized routing, x_dtype, offset) is not emulated; "
            f"route with quant_mode=-1 and quantize the result with torch_npu.npu_dynamic_quant")
    if drop_pad_mode not in (0, 1):
        raise ValueError(f"{_INIT_V2}: drop_pad_mode must be 0 (dropless) or 1 (drop/pad), got {drop_pad_mode}")
    if expert_tokens_num_type not in (0, 1, 2):
        raise ValueError(f"{_INIT_V2}: expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key_value), "
                         f"got {expert_tokens_num_type}")
    if row_idx_type not in (0, 1):
        raise ValueError(f"{_INIT_V2}: row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type}")
    if (drop_pad_mode == 1 or expert_tokens_num_flag) and expert_num <= 0:
        raise ValueError(f"{_INIT_V2}: expert_num must be > 0 for drop/pad or expert token counts, got {expert_num}")
    if drop_pad_mode == 1 and not 0 < expert_capacity <= x.shape[0]:
        raise ValueError(f"{_INIT_V2}: drop_pad_mode=1 needs expert_capacity in (0, x.size(0)={x.shape[0]}], "
                         f"got {expert_capacity}")
    if scale is not None and (scale.dim() != 1 or scale.shape[0] != x.shape[0]):
        raise ValueError(f"{_INIT_V2}: scale (no quantization) must be 1-D of x.size(0)={x.shape[0]}, "
                         f"got {tuple(scale.shape)}")
    if active_expert_range:
        if len(active_expert_range) != 2:
            raise ValueError(f"{_INIT_V2}: active_expert_range must be [expert_start, expert_end], got {active_expert_range}")
        start, end = active_expert_range
        if not 0 <= start < end or (expert_num > 0 and end > expert_num):
            raise ValueError(f"{_INIT_V2}: active_expert_range {list(active_expert_range)} must satisfy "
                             f"0 <= start < end <= expert_num ({expert_num})")
        if drop_pad_mode == 1 and (start, end) != (0, expert_num):
            raise ValueError(f"{_INIT_V2}: drop_pad_mode=1 takes the full active_expert_range [0, expert_num]")
        return start, end
    return 0, expert_num


def _expert_token_counts(sorted_experts, valid_sorted, start, end, expert_num, tokens_num_type):
    """The expert_token_cumsum_or_count output (int64) of the experts in [start, end)."""
    experts_in_range = end - start
    hits = (sorted_experts - start).clamp(0, experts_in_range - 1)
    counts = torch.zeros(experts_in_range, dtype=torch.int64, device=sorted_experts.device)
    counts = counts.index_add_(0, hits, valid_sorted.to(torch.int64))
    return _token_counts_output(counts, start, end, expert_num, tokens_num_type)


def _token_counts_output(counts, start, end, expert_num, tokens_num_type):
    """The tokens of each expert in [start, end) (int64) as expert_tokens_num_type asks for them."""
    if tokens_num_type == 0:
        return counts.cumsum(0)
    if tokens_num_type == 1:
        return counts
    # key_value: (expert id, count) of the experts with tokens, packed at the head of an
    # [expert_num, 2] tensor; the pair after the last is (0, 0), like the rest
    pairs = torch.stack([torch.arange(start, end, device=counts.device), counts], dim=1)
    nonzero = counts > 0
    slot = torch.where(nonzero, torch.cumsum(nonzero.to(torch.int64), 0) - 1, expert_num)
    packed = torch.zeros(expert_num + 1, 2, dtype=torch.int64, device=counts.device)
    return packed.index_copy_(0, slot, pairs)[:expert_num]


@fused_op(
    "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
    "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
    "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
    "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)",
    unfused="order = stable argsort of expert_idx.flatten(); expanded_x = x[order // K] "
            "(per expert capacity rows, zero padded, with drop_pad_mode=1)")
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    start, end = _init_v2_arguments(x, expert_idx, scale, offset, expert_capacity, expert_num, drop_pad_mode,
                                    expert_tokens_num_type, expert_tokens_num_flag, quant_mode,
                                    active_expert_range, row_idx_type, x_dtype)
    rows, k = expert_idx.shape
    pairs = rows * k
    device = x.device
    if drop_pad_mode == 0 and pairs and not _is_fake(x):
        lowest, highest = (int(bound) for bound in torch.aminmax(expert_idx))  # host memory: no device sync
        if end <= 0 or (lowest >= start and highest < end):
            return _init_v2_all_active(x, expert_idx.reshape(-1), scale, k, active_num, start, end, expert_num,
                                       expert_tokens_num_type, expert_tokens_num_flag, row_idx_type)
    flat_experts = expert_idx.reshape(-1).long()
    valid = (flat_experts >= start) & (flat_experts < end) if end > 0 else torch.ones_like(flat_experts, dtype=torch.bool)
    # experts outside the active range sort last; equal experts keep their flat order i*K + j
    positions = torch.arange(pairs, device=device)
    order = torch.argsort(torch.where(valid, flat_experts, end + 1), stable=True)
    sorted_experts = flat_experts[order]
    valid_sorted = valid[order]
    token_of_sorted = order // k
    if drop_pad_mode == 1:
        # each expert keeps its first expert_capacity pairs, at rows e*C .. e*C + C - 1
        counts = torch.zeros(expert_num, dtype=torch.int64, device=device).index_add_(
            0, sorted_experts.clamp(0, expert_num - 1), valid_sorted.to(torch.int64))
        first_of_expert = counts.cumsum(0) - counts
        rank_in_expert = positions - first_of_expert[sorted_experts.clamp(0, expert_num - 1)]
        kept = valid_sorted & (rank_in_expert < expert_capacity)
        slot = torch.where(kept, sorted_experts * expert_capacity + rank_in_expert, -1)
        out_rows = expert_num * expert_capacity
    else:
        # sorted pair i is row i; active_num keeps the first rows of expanded_x (the row index
        # still maps every valid pair, as the docs' expandedRowIdx[sortedRowIdx[i]] = i)
        slot = torch.where(valid_sorted, positions, -1)
        out_rows = pairs if active_num <= 0 else min(active_num, pairs)
        kept = valid_sorted & (positions < out_rows)
    landing = torch.where(kept, slot, out_rows)
    if drop_pad_mode == 1:
        # rows of expanded_x no pair fills are 0; pairs that do not land go to a spare last row
        expanded_x = x.new_zeros(out_rows + 1, x.shape[1]).index_copy_(
            0, landing, x.index_select(0, token_of_sorted))[:out_rows]
        expanded_x = expanded_x.reshape(expert_num, expert_capacity, x.shape[1])
    else:
        # sorted pair i is row i; the pairs outside the active range sort last and their rows are 0
        expanded_x = x.index_select(0, token_of_sorted[:out_rows])
        if not _is_fake(x):
            expanded_x[int(valid.sum()):].zero_()  # host memory: the count costs no device sync
    if row_idx_type == 0:
        # gather index: expanded_row_idx[flat pair] = its row of expanded_x, -1 when it has none
        expanded_row_idx = torch.full((pairs,), -1, dtype=torch.int64, device=device).scatter_(0, order, slot)
    else:
        # scatter index: expanded_row_idx[i] = the flat pair of sorted position i (-1 past the valid ones)
        expanded_row_idx = torch.where(valid_sorted, order, -1)
    if expert_tokens_num_flag:
        token_counts = _expert_token_counts(sorted_experts, valid_sorted, start, end, expert_num,
                                            expert_tokens_num_type)
    else:
        token_counts = torch.zeros((), dtype=torch.int64, device=device)
    expanded_scale = torch.zeros(out_rows, dtype=torch.float32, device=device)
    if scale is not None:
        expanded_scale = expanded_scale.new_zeros(out_rows + 1).index_copy_(
            0, landing, upcast(scale)[token_of_sorted].float())[:out_rows]
    return expanded_x, expanded_row_idx.to(torch.int32), token_counts, expanded_scale


def _init_v2_all_active(x, flat_experts, scale, k, active_num, start, end, expert_num, tokens_num_type,
                        tokens_num_flag, row_idx_type):
    """npu_moe_init_routing_v2, dropless, when every pair's expert is in the active range (the usual
    call): the general path's outputs without its bookkeeping of inactive pairs (a third of its ops)."""
    pairs = flat_experts.shape[0]
    if end > 0:  # a counting sort, with each expert's count
        order, counts = _C.stable_expert_order(flat_experts, start, end)
    else:
        order = torch.argsort(flat_experts, stable=True)  # equal experts keep their flat order i*K + j
        counts = None
    token_of_sorted = order // k
    out_rows = pairs if active_num <= 0 else min(active_num, pairs)
    if out_rows < pairs:
        token_of_sorted = token_of_sorted[:out_rows]
    expanded_x = x.index_select(0, token_of_sorted)
    if row_idx_type == 0:  # gather index: each flat pair's row of expanded_x (its sorted position)
        expanded_row_idx = torch.empty(pairs, dtype=torch.int32, device=x.device).scatter_(
            0, order, torch.arange(pairs, dtype=torch.int32, device=x.device))
    else:  # scatter index: the flat pair of each sorted position
        expanded_row_idx = order.to(torch.int32)
    if tokens_num_flag:
        if counts is None:
            counts = torch.bincount(flat_experts - start if start else flat_experts, minlength=end - start)
        token_counts = _token_counts_output(counts, start, end, expert_num, tokens_num_type)
    else:
        token_counts = torch.zeros((), dtype=torch.int64, device=x.device)
    if scale is None:
        expanded_scale = torch.zeros(out_rows, dtype=torch.float32, device=x.device)
    else:
        expanded_scale = upcast(scale)[token_of_sorted].float()
    return expanded_x, expanded_row_idx, token_counts, expanded_scale


# ---- finalize routing, expert token counts ------------------------------------------------------------

_FINALIZE = "npu_moe_finalize_routing"


@fused_op(
    "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
    "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
    "int? k=1) -> Tensor",
    unfused="skip1 + skip2 + sum_k scales[:, k, None] * (rows[src_to_dst[k * N + i]] + bias[experts[:, k]])")
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    drop_pad_mode = 0 if drop_pad_mode is None else drop_pad_mode
    if drop_pad_mode not in (0, 1, 2, 3):
        raise ValueError(f"{_FINALIZE}: drop_pad_mode must be 0-3 (dropless/drop-pad, column/row-major index), "
                         f"got {drop_pad_mode}")
    _check_dtype(_FINALIZE, "expanded_permuted_rows", expanded_permuted_rows, _FLOAT_DTYPES)
    _check_dims(_FINALIZE, "expanded_permuted_rows", expanded_permuted_rows, (3,) if drop_pad_mode in (1, 3) else (2,))
    _check_dims(_FINALIZE, "expanded_src_to_dst_row", expanded_src_to_dst_row, (1,))
    _check_dtype(_FINALIZE, "expanded_src_to_dst_row", expanded_src_to_dst_row, _INDEX_DTYPES)
    top_k = scales.shape[1] if scales is not None else (k or 1)
    if expanded_src_to_dst_row.numel() % top_k:
        raise ValueError(f"{_FINALIZE}: expanded_src_to_dst_row ({expanded_src_to_dst_row.numel()}) is not "
                         f"NUM_ROWS * K with K={top_k}")
    rows = expanded_src_to_dst_row.numel() // top_k
    if bias is not None and export_for_source_row is None:
        raise ValueError(f"{_FINALIZE}: bias needs export_for_source_row (the expert of each row's k-th choice)")
    hidden = expanded_permuted_rows.shape[-1]
    expert_rows = expanded_permuted_rows.reshape(-1, hidden)
    # drop_pad_mode 0/1 index the (row i, choice k) pair at k * N + i, modes 2/3 at i * K + k
    if drop_pad_mode in (0, 1):
        destination = expanded_src_to_dst_row.reshape(top_k, rows).t()
    else:
        destination = expanded_src_to_dst_row.reshape(rows, top_k)
    # drop/pad rows of -1 (a dropped pair) add nothing, their bias neither
    index, present = _pair_rows(destination.long(), expert_rows.shape[0])
    weights = present.to(expanded_permuted_rows.dtype if scales is None else scales.dtype)
    if scales is not None:
        weights = weights * scales
    extra = [skip for skip in (skip1, skip2) if skip is not None]
    if not extra and bias is None:
        return _weighted_sum_of_rows(expert_rows, index, weights, expanded_permuted_rows.dtype)
    out = _weighted_sum_of_rows(expert_rows, index, weights, torch.float32)
    if bias is not None:
        # sum_k w[i, k] * bias[expert(i, k)]: the weights per expert [N, E] times bias [E, H]
        experts = export_for_source_row.long()
        per_expert = torch.zeros(rows, bias.shape[0], device=out.device).scatter_add_(1, experts, weights.float())
        out = out + per_expert @ upcast(bias)
    for skip in extra:
        out = out + upcast(skip)
    return out.to(expanded_permuted_rows.dtype)


_EXPERT_TOKENS = "npu_moe_compute_expert_tokens"


@fused_op("npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
          unfused="torch.searchsorted(sorted_experts, torch.arange(num_expert), right=True)")
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    _check_dims(_EXPERT_TOKENS, "sorted_expert_for_source_row", sorted_expert_for_source_row, (1,))
    _check_dtype(_EXPERT_TOKENS, "sorted_expert_for_source_row", sorted_expert_for_source_row, (torch.int32,))
    if not 0 < num_expert <= 2048:
        raise ValueError(f"{_EXPERT_TOKENS}: num_expert must be in (0, 2048], got {num_expert}")
    # the end of each expert's rows in the sorted list (the cumsum of the tokens per expert)
    experts = torch.arange(num_expert, device=sorted_expert_for_source_row.device,
                           dtype=sorted_expert_for_source_row.dtype)
    return torch.searchsorted(sorted_expert_for_source_row, experts, right=True).to(sorted_expert_for_source_row.dtype)


# torch_npu 2.13's routing ops are inference interfaces: no backward (no Npu<Op>Backward0 in libtorch_npu)
for _routing_op in ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_init_routing_v2",
                    "npu_moe_finalize_routing", "npu_moe_compute_expert_tokens"):
    register_no_derivative(_routing_op)


# ---- token permute / unpermute ----------------------------------------------------------------------------

_PERMUTE = "npu_moe_token_permute"
_UNPERMUTE = "npu_moe_token_unpermute"


def _refuse_padded_mode(op: str, padded_mode: bool, restore_shape=None) -> None:
    if padded_mode:
        raise ValueError(f"{op}: padded_mode=True is not supported by torch_npu (only False)")
    if restore_shape is not None:
        raise ValueError(f"{op}: restore_shape is only for padded_mode=True, which torch_npu does not support")


def _permuted_rows(pairs: int, num_out_tokens) -> int:
    num_out = num_out_tokens or 0
    return min(num_out, pairs) if num_out > 0 else max(num_out + pairs, 0)


@fused_op("npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, "
          "bool padded_mode=False) -> (Tensor, Tensor)",
          unfused="order = torch.argsort(indices.flatten(), stable=True); "
                  "permuted = tokens[order // topK][:num_out_tokens]; sorted_indices = argsort(order)")
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    _refuse_padded_mode(_PERMUTE, padded_mode)
    _check_dims(_PERMUTE, "tokens", tokens, (2,))
    _check_dims(_PERMUTE, "indices", indices, (1, 2))
    _check_float(_PERMUTE, "tokens", tokens)
    _check_dtype(_PERMUTE, "indices", indices, _INDEX_DTYPES)
    if indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"{_PERMUTE}: indices {tuple(indices.shape)} must have one row per token ({tokens.shape[0]})")
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    order = torch.argsort(indices.reshape(-1), stable=True)
    # sorted_indices[i]: the row of permuted_tokens that flat pair i (token i // topK) went to
    sorted_indices = _inverse_permutation(order).to(torch.int32)
    kept = _permuted_rows(order.numel(), num_out_tokens)
    return tokens.index_select(0, order[:kept] // top_k), sorted_indices


def _permute_grad(grad_permuted, sorted_indices, top_k, tokens_dtype):
    """grad_tokens[t] = sum_k grad_permuted[sorted_indices[t * topK + k]] (pairs num_out_tokens
    dropped add nothing); the sum accumulates in fp32 and rounds once (torch's reduction of
    fp16/bf16 does)."""
    index, present = _pair_rows(sorted_indices.long().reshape(-1, top_k), grad_permuted.shape[0])
    gathered = grad_permuted.index_select(0, index.reshape(-1)).reshape(*index.shape, grad_permuted.shape[1])
    gathered = gathered.masked_fill_(~present.unsqueeze(-1), 0)
    return gathered.sum(1, dtype=torch.float32 if gathered.dtype != tokens_dtype else None).to(tokens_dtype)


@fused_op("npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices, "
          "Tensor sorted_indices, bool padded_mode=False) -> Tensor",
          unfused="grad_tokens[t] = sum over k of grad_permuted[sorted_indices[t * topK + k]]", public=False)
def npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode=False):
    _refuse_padded_mode(_PERMUTE, padded_mode)
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    return _permute_grad(grad_permuted_tokens, sorted_indices, top_k, tokens.dtype)


@fused_op("npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, SymInt tokens_size_0, "
          "ScalarType tokens_dtype, SymInt num_topK, bool padded_mode=False) -> Tensor",
          unfused="grad_tokens[t] = sum over k of grad_permuted[sorted_indices[t * topK + k]]", public=False)
def npu_moe_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK,
                                  padded_mode=False):
    _refuse_padded_mode(_PERMUTE, padded_mode)
    return _permute_grad(grad_permuted_tokens, sorted_indices, num_topK, tokens_dtype)


def _permute_setup(ctx, inputs, output):
    tokens, indices, _, padded_mode = inputs
    ctx.save_for_backward(output[1])
    ctx.tokens_rows, ctx.tokens_dtype, ctx.padded_mode = tokens.shape[0], tokens.dtype, padded_mode
    ctx.top_k = indices.shape[1] if indices.dim() == 2 else 1


def _permute_backward(ctx, grad_permuted, _grad_sorted_indices):
    (sorted_indices,) = ctx.saved_tensors
    grad_tokens = torch.ops.npu.npu_moe_token_permute_grad_v2(
        grad_permuted, sorted_indices, ctx.tokens_rows, ctx.tokens_dtype, ctx.top_k, ctx.padded_mode)
    return grad_tokens, None, None, None


register_autograd("npu_moe_token_permute", _permute_backward, _permute_setup)


@fused_op("npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
          "bool padded_mode=False, int[]? restore_shape=None) -> Tensor",
          unfused="(permuted_tokens[sorted_indices].reshape(-1, topK, H) * probs[..., None]).sum(1)")
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    _refuse_padded_mode(_UNPERMUTE, padded_mode, restore_shape)
    _check_dims(_UNPERMUTE, "permuted_tokens", permuted_tokens, (2,))
    _check_dims(_UNPERMUTE, "sorted_indices", sorted_indices, (1,))
    _check_float(_UNPERMUTE, "permuted_tokens", permuted_tokens)
    _check_dtype(_UNPERMUTE, "sorted_indices", sorted_indices, _INDEX_DTYPES)
    top_k = 1
    if probs is not None:
        _check_dims(_UNPERMUTE, "probs", probs, (2,))
        _check_float(_UNPERMUTE, "probs", probs)
        top_k = probs.shape[1]
        if probs.numel() != sorted_indices.numel():
            raise ValueError(f"{_UNPERMUTE}: probs {tuple(probs.shape)} must hold one value per sorted index "
                             f"({sorted_indices.numel()})")
    index, present = _pair_rows(sorted_indices.long().reshape(-1, top_k), permuted_tokens.shape[0])
    weights = present.to(permuted_tokens.dtype if probs is None else probs.dtype)
    if probs is not None:
        weights = weights * probs
    return _weighted_sum_of_rows(permuted_tokens, index, weights, permuted_tokens.dtype)


def _unpermute_grads(grad_unpermuted, sorted_indices, permuted_rows, permuted_dtype, probs, permuted_tokens):
    top_k = probs.shape[1] if probs is not None else 1
    index, present = _pair_rows(sorted_indices.long().reshape(-1, top_k), permuted_rows)
    weights = present.to(grad_unpermuted.dtype if probs is None else probs.dtype)
    if probs is not None:
        weights = weights * probs
    # pair (t, k) sends weights[t, k] * grad[t] to its permuted row; each row has at most one pair,
    # so each row gathers its pair's token gradient and scales it in place (the exact product,
    # rounded once); a row no pair reaches (none when the rows come from npu_moe_token_permute)
    # takes the spare weight 0
    pairs = index.numel()
    pair_of_row = torch.full((permuted_rows + 1,), pairs, dtype=torch.long, device=index.device)
    pair_of_row = pair_of_row.scatter_(0, torch.where(present, index, permuted_rows).reshape(-1),
                                       torch.arange(pairs, device=index.device))[:permuted_rows]
    weight_of_row = torch.cat([weights.reshape(-1), weights.new_zeros(1)]).index_select(0, pair_of_row)
    token_of_row = (pair_of_row // top_k).clamp(max=max(grad_unpermuted.shape[0] - 1, 0))
    grad_permuted = grad_unpermuted.index_select(0, token_of_row)
    if grad_permuted.dtype == permuted_dtype:
        grad_permuted = grad_permuted.mul_(weight_of_row.unsqueeze(1))
    else:
        grad_permuted = (upcast(grad_permuted) * weight_of_row.float().unsqueeze(1)).to(permuted_dtype)
    grad_probs = None
    if probs is not None:
        # grad_probs[t, k] = <permuted[index[t, k]], grad[t]>
        grad_probs = (_row_dots(permuted_tokens, index, grad_unpermuted) * present).to(probs.dtype)
    return grad_permuted, grad_probs


@fused_op("npu_moe_token_unpermute_grad(Tensor permuted_tokens, Tensor grad_unpermuted_tokens, Tensor sorted_indices, "
          "Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> (Tensor, Tensor)",
          unfused="grad_permuted[sorted_indices] = probs * grad; grad_probs = <permuted[sorted_indices], grad>",
          public=False)
def npu_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs=None,
                                 padded_mode=False, restore_shape=None):
    _refuse_padded_mode(_UNPERMUTE, padded_mode, restore_shape)
    grad_permuted, grad_probs = _unpermute_grads(grad_unpermuted_tokens, sorted_indices, permuted_tokens.shape[0],
                                                 permuted_tokens.dtype, probs, permuted_tokens)
    return grad_permuted, _empty_when_none(grad_probs, grad_permuted)


@fused_op("npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, "
          "SymInt permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False, "
          "int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (Tensor, Tensor)",
          unfused="grad_permuted[sorted_indices] = probs * grad; grad_probs = <permuted[sorted_indices], grad>",
          public=False)
def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                                    permuted_tokens_dtype, probs=None, padded_mode=False, restore_shape=None,
                                    permuted_tokens=None):
    _refuse_padded_mode(_UNPERMUTE, padded_mode, restore_shape)
    if probs is not None and permuted_tokens is None:
        raise ValueError(f"{_UNPERMUTE}: the gradient of probs needs permuted_tokens")
    grad_permuted, grad_probs = _unpermute_grads(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                                                 permuted_tokens_dtype, probs, permuted_tokens)
    return grad_permuted, _empty_when_none(grad_probs, grad_permuted)


def _empty_when_none(grad_probs, like):
    """A schema `Tensor` output cannot be None: no probs, an empty gradient (torch_npu's meta
    kernel says None; an op returning Tensor gives an empty tensor instead)."""
    return grad_probs if grad_probs is not None else like.new_empty(0)


def _unpermute_setup(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    ctx.save_for_backward(permuted_tokens, sorted_indices, probs)
    ctx.padded_mode, ctx.restore_shape = padded_mode, restore_shape


def _unpermute_backward(ctx, grad):
    permuted_tokens, sorted_indices, probs = ctx.saved_tensors
    grad_permuted, grad_probs = torch.ops.npu.npu_moe_token_unpermute_grad_v2(
        grad, sorted_indices, permuted_tokens.shape[0], permuted_tokens.dtype, probs, ctx.padded_mode,
        ctx.restore_shape, permuted_tokens)
    return grad_permuted, None, grad_probs if probs is not None else None, None, None


register_autograd("npu_moe_token_unpermute", _unpermute_backward, _unpermute_setup)
