"""Attention: npu_fusion_attention (+ its grad op), npu_fusion_attention_v2 (+ grad), and the
inference kernels npu_prompt_flash_attention, npu_incre_flash_attention and
npu_fused_infer_attention_score (+ _v2).

FlashAttentionScore computes, per batch and query head (key/value head = query head // (Nq / Nkv),
GQA/MQA):

    scores = scale * (q @ k^T + pse)          (v1, and v2 with pse_type=1: the documented formula)
    scores = scale * (q @ k^T) + pse          (v2 with pse_type=0)
    P = softmax(masked(scores)),  attention_out = dropout(P, keep_prob) @ v

with q @ k^T accumulated in fp32 on the cube unit, the softmax in fp32 on the vector unit, the
probabilities rounded to the input dtype before the P @ V matmul, and one rounding of the output
to the input dtype (bf16 on a CPU with AVX512-BF16: every matmul multiplies the bf16 values exactly
and sums in fp32 in C++, _cube_matmul, on the AMX tiles where the CPU has them, skipping masked blocks
as the flash kernel does; elsewhere the fp32 results come from fp32 matmuls of upcast copies, the fp16
intermediates rounded in one pass; on a CPU with AMX the bf16 and fp16 forward and gradients are one C++
kernel each, _C.attention_forward / _backward, which keep a block of 32 query rows' fp32 scores, P and dS in
a buffer of their own, as the flash kernel keeps them on chip: see _Problem.one_kernel). softmax_max and
softmax_sum are the row max and the row sum of exp(scores - max), each repeated 8 times (the kernel's 32-byte
blocks); the grad op recomputes P from them instead of keeping the probability matrix, as the flash-attention backward does.
Where the mask hides whole stretches of keys (causal, band), the fp16/fp32 path computes blocks of 64
query rows, each over the keys from its first to its last visible one, as the flash kernel skips masked
blocks (_query_blocks; the bf16 matmul skips masked tiles itself). Each block holds all its rows' keys,
so no running max and rescaling is needed: softmax_max is the unblocked one value for value, the sums,
output and gradients the same to fp32 summation order (dk and dv are summed over the blocks).

Masks (atten_mask True/1 = masked out) follow sparse_mode:
  0 defaultMask: the given mask, and only the band -pre_tockens <= j - i <= next_tockens (top-left
    origin) computed; no mask: everything computed, pre/next ignored;
  1 allMask: the given mask;
  2 leftUpCausal: j > i masked;  3 rightDownCausal: j - i > Skv - Sq masked;
  4 band: j - i - (Skv - Sq) outside [-pre_tockens, next_tockens] masked (bottom-right origin);
    2, 3 and 4 take the 2048x2048 compressed upper-triangular mask (torch.triu(ones, 1));
  5 prefix (uncompressed): the given BNSS/B1SS mask;
  6 prefix (compressed, 3072x2048 mask): rightDownCausal, plus the first prefix[b] keys of batch b;
  7, 8 (TND, a sequence split across devices): rightDownCausal / leftUpCausal, except that the last
    (mode 7) / first (mode 8) sequence is a bottom-right band of pre_tockens, next_tockens.
Without atten_mask every mode computes everything (the documented behaviour). A row every key of
which is masked gives zeros (the kernel's invalid-row correction) and no gradient.

TND (varlen) takes cumulative sequence lengths. The sequences are split into at most 8 buckets of
similar lengths (chosen to minimise the padded scores, sum of sequences x maxSq x maxSkv per bucket,
see _varlen_buckets), each gathered into a zero-padded batch of its own longest and computed as one
batched matmul over its sequences and heads (no loop over sequences): a call costs about the scores
its sequences need (one sequence of 2048 tokens among 30 of 64: 2048^2 + 30 * 64^2 per head, not
31 * 2048^2 padded or 3968^2 packed). Masks apply per sequence in its own coordinates (the
[maxSq, maxSkv] atten_mask cut to each sequence; modes 7/8 and prefix by the sequence's index in
the call). With pse, given per padded batch [B, N, maxSq, maxSkv], all the sequences stay one
padded batch. Dropout masks come from a generator seeded by (seed, offset): the forward returns the
pair and the grad op regenerates the same mask from it; the buckets of a split call each draw their
own (seeded also by the bucket's index, the grad op's buckets being the forward's), so a call the
buckets split drops other elements than one padded batch of the same sequences would.

The inference kernels compute the same attention forward-only: scores = scale * q @ k^T + pse_shift,
the sparse modes 0-4 as above (prompt flash attention's next_tokens defaults to 0: with a mask,
only the causal band), actual_seq_lengths(_kv) per batch (keys beyond masked, rows beyond zero),
a paged KV cache gathered through block_table, and the MLA rope parts joined to q and k.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.fused import (
    _LIBRARY,
    compute_dtype,
    fused_op,
    npu_numerics,
    register_autograd,
    round_intermediate,
    unwatched_backward,
    upcast,
)

INT_MAX = 2147483647
TRAINING_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
COMPRESSED_MASK_SIZE = 2048  # sparse modes 2, 3, 4, 7, 8: the 2048x2048 upper-triangular mask
PREFIX_MASK_SHAPE = (3072, 2048)  # sparse mode 6: triu(2048x2048) over a 1024x2048 [0 | 1] block
# What a masked score becomes before the softmax: far below any real score, finite so that a row
# with every key masked gives no NaN (its output is zeroed afterwards).
MASKED_SCORE = -1e30
# exp(-87) rounded up: the backward's recomputed probabilities below it are 0 (see _Problem.scores)
_EXP_FLOOR = 1.7e-38
SOFTMAX_STAT_WIDTH = 8  # softmax_max / softmax_sum repeat each row's value 8 times


# ---- geometry ------------------------------------------------------------------------------------

@dataclass
class _Varlen:
    """TND sequences: per-sequence lengths and their offsets in T; a bucket of them (see
    _varlen_buckets) keeps their indices among all `count` sequences of the call (sparse modes 7/8
    and prefix name a sequence by its index)."""
    q_lens: list[int]
    kv_lens: list[int]
    q_starts: list[int]
    kv_starts: list[int]
    sequences: list[int]
    count: int

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens, default=0)


@dataclass
class _Geometry:
    layout: str
    batch: int
    heads: int       # query heads (N)
    kv_heads: int    # key/value heads (Nkv); heads % kv_heads == 0
    sq: int          # query sequence (TND: the longest)
    skv: int         # key/value sequence (TND: the longest)
    d: int           # q/k head dim
    dv: int          # v head dim
    varlen: _Varlen | None = None
    q_tokens: int = 0   # TND: T of query
    kv_tokens: int = 0  # TND: T of key/value

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _cumulative_to_lengths(op: str, name: str, cumulative) -> tuple[list[int], list[int]]:
    values = [int(v) for v in cumulative]
    # Trailing zeros: sequences at the end that take no part (the documented [2, 5, 9, 0, 0]).
    while len(values) > 1 and values[-1] == 0 and max(values[:-1]) > 0:
        values.pop()
    lengths, starts, previous = [], [], 0
    for value in values:
        if value < previous:
            raise ValueError(f"torch_npu.{op}: {name} must be cumulative (non-decreasing), got {list(cumulative)}")
        starts.append(previous)
        lengths.append(value - previous)
        previous = value
    return lengths, starts


def _varlen(op: str, actual_seq_qlen, actual_seq_kvlen, q_tokens: int, kv_tokens: int) -> _Varlen:
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError(f"torch_npu.{op}: input_layout TND needs actual_seq_qlen and actual_seq_kvlen "
                         "(cumulative sequence lengths)")
    q_lens, q_starts = _cumulative_to_lengths(op, "actual_seq_qlen", actual_seq_qlen)
    kv_lens, kv_starts = _cumulative_to_lengths(op, "actual_seq_kvlen", actual_seq_kvlen)
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"torch_npu.{op}: actual_seq_qlen and actual_seq_kvlen must have the same length, got "
                         f"{len(q_lens)} and {len(kv_lens)}")
    if sum(q_lens) > q_tokens or sum(kv_lens) > kv_tokens:
        raise ValueError(f"torch_npu.{op}: actual_seq_qlen/actual_seq_kvlen end at {sum(q_lens)}/{sum(kv_lens)}, "
                         f"beyond the T of query/key ({q_tokens}/{kv_tokens})")
    return _Varlen(q_lens, kv_lens, q_starts, kv_starts, list(range(len(q_lens))), len(q_lens))


MAX_BUCKETS = 8
# What a bucket costs beyond its scores (its gathers, mask and launches), in score elements: a
# split saving less is not made.
BUCKET_OVERHEAD_SCORES = 1 << 16
BUCKET_UNITS = 512  # the bucketing's search runs over at most this many groups of similar sequences


def _varlen_buckets(varlen: _Varlen) -> list[_Varlen]:
    """The sequences in at most MAX_BUCKETS buckets of similar lengths, each a zero-padded batch
    padded to its own longest (see _bucket_members)."""
    members = _bucket_members(tuple(varlen.q_lens), tuple(varlen.kv_lens), BUCKET_OVERHEAD_SCORES)
    if members is None:
        return [varlen]
    return [_Varlen([varlen.q_lens[i] for i in bucket], [varlen.kv_lens[i] for i in bucket],
                    [varlen.q_starts[i] for i in bucket], [varlen.kv_starts[i] for i in bucket],
                    [varlen.sequences[i] for i in bucket], varlen.count) for bucket in members]


@functools.lru_cache(maxsize=64)  # forward and grad, and every layer of a step, split the same lengths
def _bucket_members(q_lens: tuple[int, ...], kv_lens: tuple[int, ...], overhead: int) -> list[list[int]] | None:
    """The sequences (indices) of each bucket, None for one bucket of them all: chosen to minimise
    the padded scores (sum over buckets of sequences x maxSq x maxSkv, plus `overhead` each), the
    sequences sorted by their scores and split into contiguous runs by dynamic programming.
    Sequences without queries output nothing and are left out."""
    active = sorted((i for i in range(len(q_lens)) if q_lens[i] > 0),
                    key=lambda i: (q_lens[i] * kv_lens[i], q_lens[i], kv_lens[i]))
    if len(active) <= 1:
        return None
    # Units: runs of the sorted sequences (one sequence each unless there are more than BUCKET_UNITS).
    edges = torch.linspace(0, len(active), min(len(active), BUCKET_UNITS) + 1).round().long()
    q = torch.tensor([q_lens[i] for i in active], dtype=torch.float64)
    kv = torch.tensor([kv_lens[i] for i in active], dtype=torch.float64)
    units = edges.shape[0] - 1
    unit_of = torch.repeat_interleave(torch.arange(units), edges.diff())
    unit_q = torch.zeros(units, dtype=torch.float64).scatter_reduce_(0, unit_of, q, "amax")
    unit_kv = torch.zeros(units, dtype=torch.float64).scatter_reduce_(0, unit_of, kv, "amax")
    # cost[i, e]: units i..e as one bucket (inf for e < i)
    after = torch.arange(units).unsqueeze(1) <= torch.arange(units).unsqueeze(0)
    run_q = torch.where(after, unit_q.unsqueeze(0), 0).cummax(1).values
    run_kv = torch.where(after, unit_kv.unsqueeze(0), 0).cummax(1).values
    sizes = edges[1:].double().unsqueeze(0) - edges[:-1].double().unsqueeze(1)
    cost = torch.where(after, sizes * run_q * run_kv + overhead, math.inf)
    best = [cost[0]]  # best[k - 1][e]: units 0..e in exactly k buckets
    starts = [torch.zeros(units, dtype=torch.long)]
    for _ in range(1, min(MAX_BUCKETS, units)):
        # a last bucket of units i..e (i >= 1) after units 0..i-1 in the buckets before
        candidates = best[-1][:-1].unsqueeze(1) + cost[1:]
        value, index = candidates.min(0)
        best.append(torch.cat([value.new_full((1,), math.inf), value[1:]]))
        starts.append(index + 1)
    buckets_count = int(torch.stack([b[-1] for b in best]).argmin()) + 1
    runs, end = [], units - 1
    for k in range(buckets_count - 1, -1, -1):
        first = int(starts[k][end])
        runs.append((int(edges[first]), int(edges[end + 1])))
        end = first - 1
    if len(runs) == 1 and len(active) == len(q_lens):
        return None
    return [sorted(active[begin:stop]) for begin, stop in reversed(runs)]


def _split_hidden(op: str, what: str, hidden: int, parts: int, unit: str) -> int:
    """hidden / parts, which must be whole (H = N * D)."""
    if parts <= 0 or hidden % parts:
        raise ValueError(f"torch_npu.{op}: {what}'s hidden size {hidden} is not a multiple of {parts} ({unit})")
    return hidden // parts


def _geometry(op: str, query, key, value, head_num: int, layout: str, actual_seq_qlen=None,
              actual_seq_kvlen=None, kv_heads: int | None = None) -> _Geometry:
    """Sizes of a q/k/v triple in `layout`; kv_heads is needed only for BSH/SBH inputs whose
    key head count the shapes do not give (the inference ops' num_key_value_heads). TND: the padded
    batch of all the sequences (see _parts for its buckets)."""
    dims = {"BSH": 3, "SBH": 3, "TND": 3, "BNSD": 4, "BSND": 4}[layout]
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != dims:
            raise ValueError(f"torch_npu.{op}: input_layout {layout} needs {dims}-D {name}, got shape "
                             f"{tuple(tensor.shape)}")
    if head_num <= 0:
        raise ValueError(f"torch_npu.{op}: head_num must be positive, got {head_num}")
    if layout in ("BSH", "SBH"):
        b_axis, s_axis = (0, 1) if layout == "BSH" else (1, 0)
        d = _split_hidden(op, "query", query.shape[2], head_num, "head_num")
        nkv = kv_heads if kv_heads else _split_hidden(op, "key", key.shape[2], d, "the query's head dim")
        if key.shape[2] != nkv * d:
            raise ValueError(f"torch_npu.{op}: key's hidden size {key.shape[2]} is not num_key_value_heads ({nkv}) x "
                             f"the head dim ({d})")
        dv = _split_hidden(op, "value", value.shape[2], nkv, "key/value heads")
        geometry = _Geometry(layout, query.shape[b_axis], head_num, nkv, query.shape[s_axis], key.shape[s_axis], d, dv)
        if key.shape[b_axis] != geometry.batch or value.shape[b_axis] != geometry.batch:
            raise ValueError(f"torch_npu.{op}: query, key and value must have the same batch size")
    elif layout in ("BNSD", "BSND"):
        n_axis, s_axis = (1, 2) if layout == "BNSD" else (2, 1)
        if query.shape[n_axis] != head_num:
            raise ValueError(f"torch_npu.{op}: head_num={head_num} but query ({layout}) has "
                             f"{query.shape[n_axis]} heads")
        geometry = _Geometry(layout, query.shape[0], head_num, key.shape[n_axis], query.shape[s_axis],
                             key.shape[s_axis], query.shape[3], value.shape[3])
        if key.shape[0] != geometry.batch or value.shape[0] != geometry.batch:
            raise ValueError(f"torch_npu.{op}: query, key and value must have the same batch size")
    else:  # TND
        if query.shape[1] != head_num:
            raise ValueError(f"torch_npu.{op}: head_num={head_num} but query (TND) has {query.shape[1]} heads")
        varlen = _varlen(op, actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0])
        geometry = _Geometry(layout, varlen.batch, head_num, key.shape[1], varlen.max_q, varlen.max_kv,
                             query.shape[2], value.shape[2], varlen, query.shape[0], key.shape[0])
    if geometry.kv_heads <= 0 or geometry.heads % geometry.kv_heads:
        raise ValueError(f"torch_npu.{op}: query heads ({geometry.heads}) must be a multiple of key/value heads "
                         f"({geometry.kv_heads})")
    if key.dim() == 4 and key.shape[:3] != value.shape[:3] or key.dim() == 3 and layout == "TND" and \
            key.shape[:2] != value.shape[:2]:
        raise ValueError(f"torch_npu.{op}: key {tuple(key.shape)} and value {tuple(value.shape)} must agree but "
                         "for the head dim")
    if key.shape[-1] != query.shape[-1] and layout in ("BNSD", "BSND", "TND"):
        raise ValueError(f"torch_npu.{op}: query and key must have the same head dim, got {query.shape[-1]} and "
                         f"{key.shape[-1]}")
    return geometry


def _parts(geometry: _Geometry, split: bool = True) -> list[_Geometry]:
    """What to compute one batched problem each: TND (when split) its buckets of similar sequences,
    each padded to its own longest; otherwise the geometry itself."""
    if geometry.varlen is None or not split:
        return [geometry]
    return [dataclasses.replace(geometry, batch=bucket.batch, sq=bucket.max_q, skv=bucket.max_kv, varlen=bucket)
            for bucket in _varlen_buckets(geometry.varlen)]


# ---- layouts -------------------------------------------------------------------------------------

def _varlen_gather_index(lens: list[int], starts: list[int], padded: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, padded] token indices of each sequence (padding rows point at token 0) and its validity."""
    position = torch.arange(padded, device=device)
    lengths = torch.tensor(lens, device=device).unsqueeze(1)
    valid = position < lengths
    index = torch.where(valid, torch.tensor(starts, device=device).unsqueeze(1) + position, 0)
    return index, valid


def _to_bnsd(x: torch.Tensor, layout: str, heads: int, varlen: _Varlen | None = None, which: str = "q",
             padded: int = 0) -> torch.Tensor:
    """[B, N, S, D] view (TND: the sequences of `varlen` gathered into a zero-padded batch)."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.unflatten(2, (heads, -1)).transpose(1, 2)
    if layout == "SBH":
        return x.unflatten(2, (heads, -1)).permute(1, 2, 0, 3)
    lens, starts = (varlen.q_lens, varlen.q_starts) if which == "q" else (varlen.kv_lens, varlen.kv_starts)
    if x.shape[0] == 0:
        return x.new_zeros(len(lens), x.shape[1], padded, x.shape[2])
    index, valid = _varlen_gather_index(lens, starts, padded, x.device)
    gathered = x[index] * valid[..., None, None].to(x.dtype)  # [B, S, N, D]
    return gathered.transpose(1, 2)


def _from_bnsd(y: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of _to_bnsd, contiguous (TND: see _varlen_scatter)."""
    if layout == "BNSD":
        return y.contiguous()
    if layout == "BSND":
        return y.transpose(1, 2).contiguous()
    if layout == "BSH":
        return y.transpose(1, 2).flatten(2).contiguous()
    return y.permute(2, 0, 1, 3).flatten(2).contiguous()  # SBH


def _varlen_scatter(ys: list[torch.Tensor], varlens: list[_Varlen], which: str, tokens: int) -> torch.Tensor:
    """[T, N, X]: the valid rows of each padded batch ys[i] [B_i, N, S_i, X] (the sequences of
    varlens[i]) at their tokens, zeros for tokens no sequence holds."""
    out = ys[0].new_zeros(tokens, ys[0].shape[1], ys[0].shape[3])
    for y, varlen in zip(ys, varlens):
        lens_list, starts_list = (varlen.q_lens, varlen.q_starts) if which == "q" else (varlen.kv_lens,
                                                                                       varlen.kv_starts)
        total = sum(lens_list)
        lens = torch.tensor(lens_list, dtype=torch.long, device=y.device)
        batch_index = torch.repeat_interleave(torch.arange(lens.shape[0], device=y.device), lens, output_size=total)
        position = torch.arange(total, device=y.device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens,
                                                                                 output_size=total)
        token = torch.repeat_interleave(torch.tensor(starts_list, dtype=torch.long, device=y.device), lens,
                                        output_size=total) + position
        out[token] = y.transpose(1, 2)[batch_index, position]
    return out


def _assemble(ys: list[torch.Tensor], geometry: _Geometry, parts: list[_Geometry], which: str = "q") -> torch.Tensor:
    """The parts' [B, N, S, X] results (see _parts) in the input layout, contiguous."""
    if geometry.layout != "TND":
        return _from_bnsd(ys[0], geometry.layout)
    tokens = geometry.q_tokens if which == "q" else geometry.kv_tokens
    return _varlen_scatter(ys, [part.varlen for part in parts], which, tokens)


def _out_shape(geometry: _Geometry) -> list[int]:
    """attention_out's shape in the input layout (the value's head dim)."""
    b, n, sq, dv = geometry.batch, geometry.heads, geometry.sq, geometry.dv
    return {"BSH": [b, sq, n * dv], "SBH": [sq, b, n * dv], "BNSD": [b, n, sq, dv], "BSND": [b, sq, n, dv],
            "TND": [geometry.q_tokens, n, dv]}[geometry.layout]


def _stat_shape(geometry: _Geometry) -> list[int]:
    if geometry.layout == "TND":
        return [geometry.q_tokens, geometry.heads, SOFTMAX_STAT_WIDTH]
    return [geometry.batch, geometry.heads, geometry.sq, SOFTMAX_STAT_WIDTH]


def _stats_to_rows(stat: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """softmax_max/sum ([B, N, Sq, 8] or [T, N, 8]) as [B, N, Sq] rows of the (part's) padded problem."""
    if geometry.layout != "TND":
        return stat[..., 0]
    return _to_bnsd(stat[..., :1], "TND", geometry.heads, geometry.varlen, "q", geometry.sq)[..., 0]


def _rows_to_stats(rows: list[torch.Tensor], geometry: _Geometry, parts: list[_Geometry]) -> torch.Tensor:
    """The parts' [B, N, Sq] rows as softmax_max/sum ([B, N, Sq, 8] in every layout but TND's [T, N, 8])."""
    stat = _assemble([r.unsqueeze(-1) for r in rows], geometry, parts) if geometry.layout == "TND" \
        else rows[0].unsqueeze(-1)
    return stat.expand(*stat.shape[:-1], SOFTMAX_STAT_WIDTH).contiguous()


# ---- masks ---------------------------------------------------------------------------------------

CACHED_MASKS = 8  # masks (and their checks) kept per process: a model passes the same few every step
CACHED_BIAS_ELEMENTS = 1 << 22  # a per-batch/per-head mask as large as the scores is built anew
_checked_masks: dict[tuple, torch.Tensor] = {}


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch._subclasses.FakeTensor) or tensor.device.type == "meta"


def _check_compressed_mask(op: str, mask: torch.Tensor, sparse_mode: int) -> torch.Tensor:
    """The 2048x2048 (mode 6: 3072x2048) optimised mask the kernel reads its causal tiles from.

    Its shape, and (once per tensor version) its content: a different mask gives wrong results on
    the NPU, so the emulator says so instead of computing something else."""
    expected = PREFIX_MASK_SHAPE if sparse_mode == 6 else (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    squeezed = mask
    while squeezed.dim() > 2 and squeezed.shape[0] == 1:
        squeezed = squeezed[0]
    if tuple(squeezed.shape) != expected:
        raise ValueError(f"torch_npu.{op}: sparse_mode={sparse_mode} takes the optimised atten_mask of shape "
                         f"{expected[0]}x{expected[1]} (torch.triu(torch.ones(2048, 2048), 1).bool()"
                         f"{' over a 1024x2048 [zeros | ones] block' if sparse_mode == 6 else ''}), got "
                         f"{tuple(mask.shape)}")
    if _is_fake(squeezed):
        return squeezed
    inference = mask.is_inference()
    key = None if inference else (id(mask), mask._version, sparse_mode)
    checked = None if inference else _checked_masks.get(key)
    if checked is None or checked is not mask:
        if not _same_mask(squeezed.bool(), _optimised_mask(sparse_mode, squeezed.device)):
            raise ValueError(f"torch_npu.{op}: sparse_mode={sparse_mode} needs atten_mask to be the optimised "
                             "upper-triangular mask torch.triu(torch.ones(2048, 2048), diagonal=1).bool() (True above "
                             "the diagonal); the NPU reads its causal tiles from it, another mask gives wrong results")
        if inference:  # no version counter: an in-place write could not be told, so it is not kept
            return squeezed
        if len(_checked_masks) >= CACHED_MASKS:
            _checked_masks.clear()
        _checked_masks[key] = mask  # held, so that its id is not reused while cached
    return squeezed


_optimised_masks: dict[tuple, torch.Tensor] = {}  # (device, mode 6 or not) -> the mask the kernel expects


def _optimised_mask(sparse_mode: int, device: torch.device) -> torch.Tensor:
    """The optimised mask, made once per device: code that builds its mask at every call (MindSpeed-LLM's
    GPT-OSS: torch.triu(torch.ones(2048, 2048)) in each attention) had each call make it again too."""
    key = (device, sparse_mode == 6)
    want = _optimised_masks.get(key)
    if want is None:
        size = COMPRESSED_MASK_SIZE
        want = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
        if sparse_mode == 6:
            lower = torch.zeros(PREFIX_MASK_SHAPE[0] - size, size, dtype=torch.bool, device=device)
            lower[:, size // 2:] = True
            want = torch.cat([want, lower])
        _optimised_masks[key] = want
    return want


def _same_mask(mask: torch.Tensor, want: torch.Tensor) -> bool:
    """torch.equal, 8 mask bytes at a time where the mask's layout allows: on bool it compares element
    by element (~12 ms for 2048x2048 on the AMX CPU, ~2 ms as int64)."""
    try:
        return torch.equal(mask.view(torch.int64), want.view(torch.int64))
    except RuntimeError:  # not contiguous, or not on an 8-byte boundary
        return torch.equal(mask, want)


def _band(diff: torch.Tensor, low: int | torch.Tensor, high: int | torch.Tensor) -> torch.Tensor:
    """True where low <= diff <= high."""
    return (diff >= low) & (diff <= high)


def _structural_allowed(op, sparse_mode, i, j, sq, skv, pre, nxt, prefix_len, batch_index,
                        batch) -> torch.Tensor | None:
    """Where the sparse mode lets query position i attend key position j (None: everywhere), both
    in their sequence's coordinates; sq, skv, prefix_len, batch_index: the sequence's lengths, prefix
    and index, broadcastable against them."""
    diff = j - i
    offset = skv - sq  # bottom-right origin
    if sparse_mode == 0:
        if pre >= INT_MAX and nxt >= INT_MAX:
            return None
        return _band(diff, -pre, nxt)
    if sparse_mode in (1, 5):
        return None
    if sparse_mode == 2:
        return diff <= 0
    if sparse_mode == 3:
        return diff <= offset
    if sparse_mode == 4:
        return _band(diff - offset, -pre, nxt)
    if sparse_mode == 6:
        return (diff <= offset) | (j < prefix_len)
    if sparse_mode in (7, 8):
        band = _band(diff - offset, -pre, nxt)
        causal = diff <= offset if sparse_mode == 7 else diff <= 0
        special = batch - 1 if sparse_mode == 7 else 0
        return torch.where(batch_index == special, band, causal)
    raise ValueError(f"torch_npu.{op}: sparse_mode must be in 0..8, got {sparse_mode}")


def _user_mask(op: str, atten_mask: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """A full atten_mask (modes 0, 1, 5) as bool broadcastable to [B, N, Sq, Skv]."""
    mask = atten_mask if atten_mask.dtype == torch.bool else atten_mask != 0
    if geometry.layout == "TND":
        if mask.dim() != 2:
            raise ValueError(f"torch_npu.{op}: with input_layout TND atten_mask must be [maxSq, maxSkv], got "
                             f"{tuple(atten_mask.shape)}")
        varlen = geometry.varlen
        if mask.shape[0] < varlen.max_q or mask.shape[1] < varlen.max_kv:
            raise ValueError(f"torch_npu.{op}: atten_mask {tuple(atten_mask.shape)} is smaller than the longest "
                             f"sequences ({varlen.max_q}, {varlen.max_kv})")
        return mask[:varlen.max_q, :varlen.max_kv]
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or mask.shape[0] not in (1, geometry.batch) or mask.shape[1] not in (1, geometry.heads) \
            or tuple(mask.shape[2:]) != (geometry.sq, geometry.skv):
        raise ValueError(f"torch_npu.{op}: atten_mask must be [B, N, Sq, Skv], [B, 1, Sq, Skv], [1, 1, Sq, Skv] or "
                         f"[Sq, Skv] = {geometry.sq}x{geometry.skv}, got {tuple(atten_mask.shape)}")
    return mask


@dataclass
class _Masking:
    bias: torch.Tensor | None       # additive fp32 bias (scaled pse, MASKED_SCORE at masked positions), 4-D
    row_valid: torch.Tensor | None  # [B|1, N|1, Sq, 1] bool: rows with at least one key (None: all)
    # _query_blocks' answer per query group size, kept with a cached mask
    query_blocks: dict = dataclasses.field(default_factory=dict, repr=False)


_masking_cache: OrderedDict[tuple, tuple[torch.Tensor | None, _Masking]] = OrderedDict()


def _masking(op: str, geometry: _Geometry, atten_mask, sparse_mode: int, pre: int, nxt: int, prefix,
             pse_bias: torch.Tensor | None, query: torch.Tensor, q_lens=None, kv_lens=None) -> _Masking:
    """_build_masking, remembered for the few masks a model passes every step (forward and
    backward build the same one) when there is no pse to add."""
    # an inference tensor (a mask made under torch.inference_mode) has no version counter to key it by
    if pse_bias is not None or _is_fake(query) or (atten_mask is not None and atten_mask.is_inference()):
        return _build_masking(op, geometry, atten_mask, sparse_mode, pre, nxt, prefix, pse_bias, query.device,
                              q_lens, kv_lens)
    varlen = geometry.varlen
    key = (query.device, sparse_mode, pre, nxt, geometry.batch, geometry.heads, geometry.sq, geometry.skv,
           None if varlen is None else (tuple(varlen.q_lens), tuple(varlen.kv_lens), tuple(varlen.sequences),
                                        varlen.count),
           None if q_lens is None else tuple(q_lens), None if kv_lens is None else tuple(kv_lens),
           None if prefix is None else tuple(prefix), id(atten_mask), None if atten_mask is None else atten_mask._version)
    cached = _masking_cache.get(key)
    if cached is not None and cached[0] is atten_mask:
        _masking_cache.move_to_end(key)
        return cached[1]
    masking = _build_masking(op, geometry, atten_mask, sparse_mode, pre, nxt, prefix, None, query.device, q_lens,
                             kv_lens)
    if masking.bias is None or masking.bias.numel() <= CACHED_BIAS_ELEMENTS:
        _masking_cache[key] = (atten_mask, masking)  # the mask held, so that its id is not reused while cached
        if len(_masking_cache) > CACHED_MASKS:
            _masking_cache.popitem(last=False)
    return masking


def _build_masking(op: str, geometry: _Geometry, atten_mask, sparse_mode: int, pre: int, nxt: int, prefix,
                   pse_bias: torch.Tensor | None, device, q_lens=None, kv_lens=None) -> _Masking:
    """The additive bias of the scores and the valid rows, for a (padded) [B, N, Sq, Skv] problem.

    q_lens / kv_lens: per-batch valid lengths (TND sequences, or the inference ops'
    actual_seq_lengths): keys beyond are masked, rows beyond give zeros."""
    if sparse_mode < 0 or sparse_mode > 8:
        raise ValueError(f"torch_npu.{op}: sparse_mode must be in 0..8, got {sparse_mode}")
    varlen = geometry.varlen
    if varlen is not None and sparse_mode == 5:
        raise ValueError(f"torch_npu.{op}: sparse_mode=5 (uncompressed prefix) is not supported with input_layout TND")
    if varlen is None and sparse_mode in (7, 8):
        raise ValueError(f"torch_npu.{op}: sparse_mode={sparse_mode} is for input_layout TND only")
    if varlen is not None:
        q_lens, kv_lens = varlen.q_lens, varlen.kv_lens
    masked = None
    if atten_mask is not None:
        _check_mask_arguments(op, atten_mask, sparse_mode, prefix)
        if sparse_mode in (0, 1, 5):
            masked = _user_mask(op, atten_mask, geometry)
            if sparse_mode == 5 and (masked.dim() != 4 or masked.shape[0] != geometry.batch):
                raise ValueError(f"torch_npu.{op}: sparse_mode=5 needs a BNSS or B1SS atten_mask, got "
                                 f"{tuple(atten_mask.shape)}")
        else:
            _check_compressed_mask(op, atten_mask, sparse_mode)
        per_batch = q_lens is not None
        i = torch.arange(geometry.sq, device=device).unsqueeze(1)
        j = torch.arange(geometry.skv, device=device).unsqueeze(0)
        batch_index = None
        batches = len(q_lens) if per_batch else geometry.batch
        prefix_len = None if prefix is None else torch.tensor(prefix, device=device).view(-1, 1, 1)
        if per_batch:
            sq = torch.tensor(q_lens, device=device).view(-1, 1, 1)
            skv = torch.tensor(kv_lens, device=device).view(-1, 1, 1)
            batch_index = torch.arange(len(q_lens), device=device).view(-1, 1, 1)
        else:
            sq, skv = geometry.sq, geometry.skv
        if varlen is not None:  # a bucket's sequences: their indices among all the call's
            batches = varlen.count
            batch_index = torch.tensor(varlen.sequences, device=device).view(-1, 1, 1)
            if prefix_len is not None and prefix_len.shape[0] == varlen.count:
                prefix_len = prefix_len[batch_index.view(-1)]
        allowed = _structural_allowed(op, sparse_mode, i, j, sq, skv, pre, nxt, prefix_len, batch_index, batches)
        if allowed is not None:
            structural = ~allowed
            if structural.dim() == 3:
                structural = structural.unsqueeze(1)
            masked = structural if masked is None else masked | structural
    if q_lens is not None or kv_lens is not None:
        # Padding: keys beyond a sequence's length are masked, rows beyond it give zeros.
        q_len = torch.tensor(q_lens if q_lens is not None else [geometry.sq] * geometry.batch, device=device)
        kv_len = torch.tensor(kv_lens if kv_lens is not None else [geometry.skv] * geometry.batch, device=device)
        padding = (torch.arange(geometry.sq, device=device).view(1, 1, -1, 1) >= q_len.view(-1, 1, 1, 1)) | \
                  (torch.arange(geometry.skv, device=device).view(1, 1, 1, -1) >= kv_len.view(-1, 1, 1, 1))
        masked = padding if masked is None else masked | padding
    if masked is None:
        return _Masking(pse_bias, None)
    if masked.dim() == 2:
        masked = masked[None, None]
    if pse_bias is None:
        bias = torch.where(masked, MASKED_SCORE, 0.0)
    else:
        bias = pse_bias.masked_fill(masked, MASKED_SCORE)
    return _Masking(bias, _valid_rows(masked))


def _valid_rows(masked: torch.Tensor) -> torch.Tensor | None:
    """_Masking.row_valid: the rows with at least one key, None when that is every row (as with a causal
    mask: no pass over the output and its gradient to zero nothing)."""
    row_valid = ~masked.all(-1, keepdim=True)
    if not _is_fake(row_valid) and bool(row_valid.all()):
        return None
    return row_valid


def _check_mask_arguments(op: str, atten_mask, sparse_mode: int, prefix) -> None:
    if atten_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        raise ValueError(f"torch_npu.{op}: atten_mask must be bool or uint8 (True/1 = masked), got {atten_mask.dtype}")
    if sparse_mode in (5, 6) and prefix is None:
        raise ValueError(f"torch_npu.{op}: sparse_mode={sparse_mode} needs prefix (one N per batch)")


# ---- the kernel's computation --------------------------------------------------------------------

def _group(t: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """A [B|1, N|1, Sq|1, X] tensor as [B|1, Nkv|1, G|1, Sq|1, X], matching the grouped scores."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.unflatten(1, (geometry.kv_heads, geometry.group))


# Query rows per block of the blocked computation (see _query_blocks): 64 measured fastest on the AMX CPU
# at B*N=16, S=256 (fp16 fused/unfused 1.13; 32 rows 1.25, 128 rows 1.29, unblocked 1.39).
QUERY_BLOCK_ROWS = 64
# Blocked only where the skipped keys save at least this share of the scores: the blocks' extra calls
# cost more than the rest.
MIN_SKIPPED_SCORES = 0.2


@dataclass(frozen=True)
class _Block:
    """A block of query rows (of the [B*Nkv, G*Sq, X] problem) and the keys any of them sees."""
    rows: slice
    keys: slice


def _query_blocks(problem: _Problem) -> list[_Block] | None:
    """The flash kernel's blocking where the mask makes it pay: blocks of QUERY_BLOCK_ROWS query rows, each
    computed over the keys from its first to its last unmasked one (under a causal mask, the first block
    reads QUERY_BLOCK_ROWS keys, not Skv: the matmuls' work and the fp32 score blocks shrink). A block holds
    every key its rows see, so the softmax needs no running max and rescaling: the row max is the
    unblocked one value for value, the row sum, output and gradients the same to fp32 summation order
    (the backward sums dk and dv over the row blocks). None (compute unblocked) on the bf16 cube path, whose matmul skips
    masked tiles itself, without a bias baddbmm broadcasts, with a row every key of which is masked, or
    where the blocks would skip less than MIN_SKIPPED_SCORES of the scores."""
    masking, g = problem.masking, problem.geometry
    if (problem.bf16_cube or masking.bias is None or masking.row_valid is not None or _is_fake(problem.q_in)
            or g.group * g.sq <= QUERY_BLOCK_ROWS):
        return None
    key = (g.group, QUERY_BLOCK_ROWS)
    if key not in masking.query_blocks:
        bias3 = problem.bias3
        blocks = None
        if bias3 is not None:
            seen = (bias3 != MASKED_SCORE).any(0)  # [G*Sq, Skv]: keys some batch's row sees
            rows = seen.shape[0]
            seen_by_block = torch.stack([seen[r0:r0 + QUERY_BLOCK_ROWS].any(0) for r0 in range(0, rows, QUERY_BLOCK_ROWS)])
            first = seen_by_block.int().argmax(1).tolist()
            last = (g.skv - seen_by_block.flip(1).int().argmax(1)).tolist()
            if sum(end - start for start, end in zip(first, last)) * QUERY_BLOCK_ROWS <= \
                    (1 - MIN_SKIPPED_SCORES) * rows * g.skv:
                blocks = [_Block(slice(r0, min(r0 + QUERY_BLOCK_ROWS, rows)), slice(start, end))
                          for r0, start, end in zip(range(0, rows, QUERY_BLOCK_ROWS), first, last)]
        masking.query_blocks[key] = blocks
    return masking.query_blocks[key]


@dataclass
class _Problem:
    """q/k/v of one call as the batched matmuls read them: q [B*Nkv, G*Sq, D], k [B*Nkv, Skv, D],
    v [B*Nkv, Skv, Dv]; a group of query heads shares its key/value head. q_in, k_in, v_in are in the
    input dtype, q, k, v their copies in the compute dtype (made when first read)."""
    geometry: _Geometry
    q_in: torch.Tensor
    k_in: torch.Tensor
    v_in: torch.Tensor
    scale: float
    masking: _Masking
    in_dtype: torch.dtype   # what the kernel rounds its intermediates to (the input dtype)
    npu: bool
    dropout_stream: int = 0  # which of a TND call's buckets: its dropout mask's own draws (see _dropped)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (fp32, or fp64 for fp64 inputs)."""
        return compute_dtype(self.in_dtype)

    @functools.cached_property
    def q(self) -> torch.Tensor:
        return self.q_in.to(self.dtype)

    @functools.cached_property
    def k(self) -> torch.Tensor:
        return self.k_in.to(self.dtype)

    @functools.cached_property
    def v(self) -> torch.Tensor:
        return self.v_in.to(self.dtype)

    @property
    def bf16_cube(self) -> bool:
        """Can a matmul whose fp32 result the kernel rounds straight to the input dtype run as the CPU's
        bf16 matmul? Its bf16 GEMM (AVX512-BF16) multiplies exactly, accumulates in fp32 and rounds
        once: the cube unit's numerics, at a third of an fp32 matmul's cost. (No fp16 GEMM on the
        CPU is faster than fp32; the golden run keeps fp32.)"""
        return self.npu and self.in_dtype == torch.bfloat16

    @property
    def one_kernel(self) -> bool:
        """Can the forward and the gradients each run as one C++ kernel (_C.attention_forward and _backward: a
        block of query rows' scores, probabilities and dS never leave its buffer, as in the flash kernel)? bf16
        with bf16_dot's numerics (even head dims: bf16 pairs), fp16 with the fp16 path's (fp32 sums of the exact
        fp16 products, P and dS rounded to fp16); on the npu of a CPU with AMX, with a bias the kernels
        broadcast (or none), keys, and every row seeing one; the callers check for dropout and dpse."""
        masking = self.masking
        if self.in_dtype == torch.bfloat16:
            fits = self.bf16_dot and self.q_in.shape[-1] % 2 == 0 and self.v_in.shape[-1] % 2 == 0
        else:
            fits = self.npu and self.in_dtype == torch.float16
        return (fits and BF16_AMX and masking.row_valid is None and (masking.bias is None or self.bias3 is not None)
                and self.k_in.shape[1] > 0 and not _is_fake(self.q_in))

    @property
    def bf16_dot(self) -> bool:
        """Can every matmul run as _cube_matmul (exact products of bf16 values summed in fp32, rounded
        once to fp32 or bf16: the cube unit's numerics), the scores and dP included, whose fp32 results
        the kernel keeps (the CPU's bf16 GEMM rounds to bf16)? Where the CPU has AVX512-BF16."""
        return self.bf16_cube and BF16_DOT_PRODUCT

    def grouped(self, t3: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        return t3.view(g.batch, g.kv_heads, g.group, g.sq, t3.shape[-1])

    def heads(self, t3: torch.Tensor) -> torch.Tensor:
        """[B*Nkv, G*Sq, X] as [B, N, Sq, X]."""
        g = self.geometry
        return t3.view(g.batch, g.heads, g.sq, t3.shape[-1])

    def scores(self, log_sum_exp: torch.Tensor | None = None, block: _Block | None = None) -> torch.Tensor:
        """scale * q @ k^T plus the bias (scaled pse, masked positions), fp32 [B*Nkv, G*Sq, Skv]; given
        the rows' log-sum-exp, the probabilities exp(scores - log_sum_exp) (see _backward). With a block
        (see _query_blocks), its rows and keys only (log_sum_exp: the block's rows)."""
        bias = self.masking.bias
        bias3 = self.bias3
        if block is not None:  # _query_blocks gives blocks only where bias3 exists and bf16_dot does not
            s = torch.baddbmm(bias3[:, block.rows, block.keys].to(self.dtype), self.q[:, block.rows],
                              self.k[:, block.keys].transpose(1, 2), alpha=self.scale)
            return s if log_sum_exp is None else self._probabilities(s, log_sum_exp)
        if self.bf16_dot and (bias is None or bias3 is not None):  # one pass: the matmul adds the bias
            return _cube_matmul(self.q_in, self.k_in.transpose(1, 2), self.scale, bias3, log_sum_exp)
        if self.bf16_dot:
            s = _cube_matmul(self.q_in, self.k_in.transpose(1, 2), self.scale)
            self.grouped(s).add_(_group(bias, self.geometry))
        else:
            k_t = self.k.transpose(1, 2)
            if bias is None:
                s = torch.bmm(self.q, k_t).mul_(self.scale)
            elif bias3 is not None:  # one pass: the matmul adds it
                s = torch.baddbmm(bias3.to(self.dtype), self.q, k_t, alpha=self.scale)
            else:
                s = torch.bmm(self.q, k_t).mul_(self.scale)
                self.grouped(s).add_(_group(bias, self.geometry))
        if log_sum_exp is None:
            return s
        return self._probabilities(s, log_sum_exp)

    @staticmethod
    def _probabilities(s: torch.Tensor, log_sum_exp: torch.Tensor) -> torch.Tensor:
        """exp(s - log_sum_exp) in place, floored and capped (see the comment)."""
        # Floored at exp(-87) (a normal float, ~1e-38): the CPU's vectorised exp leaves its fast path for
        # masked scores (-1e30) and denormal results. Capped at exp(0): fp64 scores sit above their fp32
        # row max by its rounding, and a row with every key masked (-1e30 in fp64, -1.0000000150e30 as the
        # fp32 max) gave exp(1.5e22) = inf, inf x 0 = nan. Then the floor is made 0 again, as the masked
        # probabilities are: products of ~1e-38 are denormal, and the backward's three matmuls over P
        # and dS ran 8-30x slower on CPUs that trap on them (npu_fusion_attention's fp32 gradient 3.3x
        # the unfused one's on a Sapphire Rapids).
        p = s.sub_(log_sum_exp).clamp_(-87.0, 0.0).exp_()
        return torch.threshold_(p, _EXP_FLOOR, 0.0)

    @functools.cached_property
    def bias3(self) -> torch.Tensor | None:
        """The bias as a [1 or B*Nkv, G*Sq, Skv] tensor baddbmm broadcasts, when that needs no copy
        of the scores' size (a bias per batch but not per head would); None without a bias."""
        bias = self.masking.bias
        if bias is None:
            return None
        g = self.geometry
        if bias.shape[2] != g.sq and g.group > 1:
            return None
        if bias.shape[0] == 1 and bias.shape[1] == 1:
            plane = bias[0, 0]
            return (plane.repeat(g.group, 1) if g.group > 1 else plane).unsqueeze(0)
        if bias.shape[1] == g.heads and (bias.shape[0] == g.batch or g.batch == 1) and bias.shape[2] == g.sq:
            return bias.reshape(g.batch * g.kv_heads, g.group * g.sq, g.skv)
        return None


def _problem(q4, k4, v4, geometry: _Geometry, scale: float, masking: _Masking, in_dtype, npu,
             dropout_stream: int = 0) -> _Problem:
    g = geometry
    q_in = q4.unflatten(1, (g.kv_heads, g.group)).reshape(g.batch * g.kv_heads, g.group * g.sq, g.d)
    k_in = k4.reshape(g.batch * g.kv_heads, g.skv, k4.shape[-1])
    v_in = v4.reshape(g.batch * g.kv_heads, g.skv, v4.shape[-1])
    return _Problem(g, q_in, k_in, v_in, scale, masking, in_dtype, npu, dropout_stream)


def _is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


# Whether this CPU multiplies bf16 pairs into fp32 (AVX512-BF16), which _cube_matmul needs.
BF16_DOT_PRODUCT = _C.has_bf16_dot_product()
# Whether it has AMX tiles for bf16 too, where the one-kernel forward and backward run (_Problem.one_kernel).
BF16_AMX = BF16_DOT_PRODUCT and _C.has_amx_bf16()


def _cube_matmul(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, bias: torch.Tensor | None = None,
                 log_sum_exp: torch.Tensor | None = None, probabilities: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """alpha * a @ b (+ bias) of batches a (bf16, or fp32 rounded to bf16) and b (bf16) as the cube
    unit computes them: the products exact, summed in fp32, rounded once to out_dtype (see
    _Problem.bf16_dot). Where the bias is MASKED_SCORE the result is MASKED_SCORE (not MASKED_SCORE +
    the score: the same for any finite score below 3.8e22), and a tile masked throughout is not
    computed, nor the zeros of a's rows past the causal band, as the flash kernel skips masked blocks.
    Given the rows' log-sum-exp [batches, M, 1], the result x becomes the probabilities
    exp(clamp(x - log_sum_exp, -87, 0)), 0 where masked; given the probabilities too, dS =
    probabilities * (x - log_sum_exp) (there the rows' sum of P * dP), 0 where they are 0 throughout a tile."""
    if _is_fake(a):
        return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=out_dtype)
    return _C.bf16_matmul(a, b, alpha, bias, MASKED_SCORE if bias is not None else None, log_sum_exp, probabilities,
                          out_dtype)


def _masked_score(problem: _Problem) -> float | None:
    """What the one-kernel forward and backward make a score whose bias is MASKED_SCORE (None without a bias)."""
    return MASKED_SCORE if problem.bias3 is not None else None


def _bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as the CPU's bf16 batched GEMM (fp32 accumulation, one rounding to bf16): the npu device
    runs an out= matmul as given, where its plain matmul would compute in fp32 (see _Problem.bf16_cube)."""
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.bfloat16, device=a.device)
    return torch.bmm(a.to(torch.bfloat16), b.to(torch.bfloat16), out=out)


def _round_to_input_dtype(t: torch.Tensor, problem: _Problem, in_place: bool) -> torch.Tensor:
    """round_intermediate of an fp32 intermediate (the probabilities, dS) the kernel keeps in the input
    dtype; fp16 on the npu in one pass (_C.round_to_half), in place where the caller no longer needs t
    unrounded, instead of two copies."""
    if (problem.npu and problem.in_dtype == torch.float16 and t.dtype == torch.float32 and t.is_contiguous()
            and not _is_fake(t)):
        return _C.round_to_half(t, None if in_place else torch.empty_like(t))
    return round_intermediate(t, problem.in_dtype, problem.npu)


def _dropped(shape, keep_prob: float, seed: int, offset: int, device, stream: int = 0) -> torch.Tensor:
    """Which probabilities dropout zeroes: uniform 16-bit draws of a generator seeded by (seed,
    offset), so the grad op regenerates the same mask from the pair the forward returns; `stream`:
    the TND bucket (see _varlen_buckets), each its own draws (forward and grad bucket alike)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + offset + stream * 0xBF58476D1CE4E5B9) % (1 << 63))
    numel = math.prod(shape)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None,
                                                                                  generator=generator)
    uniform16 = words.view(torch.int16)[:numel].view(shape)  # in [-32768, 32767]
    threshold = round(keep_prob * 65536) - 32768
    return uniform16 >= threshold


def _draw_seed_offset(device) -> tuple[int, int]:
    """Where a dropout mask's randomness comes from: the device generator's seed and a position
    drawn from it (advancing it), so a seeded run reproduces its masks."""
    index = device.index if device.index is not None else 0
    generator = torch.npu.default_generators[index] if device.type == "npu" else torch.default_generator
    offset = int(torch.empty((), dtype=torch.int64, device=device).random_(0, 1 << 62, generator=generator))
    return int(generator.initial_seed()), offset


def _forward(problem: _Problem, keep_prob: float, seed: int, offset: int, sink: torch.Tensor | None):
    """attention_out [B, N, Sq, Dv] (compute dtype) and the softmax's row max and sum [B, N, Sq]."""
    g = problem.geometry
    one_kernel = keep_prob == 1 and problem.one_kernel
    blocks = _query_blocks(problem) if keep_prob == 1 and not one_kernel else None
    if one_kernel:
        out, row_max, row_sum = _C.attention_forward(problem.q_in, problem.k_in, problem.v_in, problem.bias3,
                                                     _masked_score(problem), problem.scale)
    elif blocks is None:
        out, row_max, row_sum = _attend(problem, problem.scores(), keep_prob, seed, offset)
    else:
        rows = problem.q_in.shape[:2]
        out = torch.empty(*rows, problem.v_in.shape[-1], dtype=problem.dtype, device=problem.q_in.device)
        row_max = torch.empty(*rows, 1, dtype=problem.dtype, device=problem.q_in.device)
        row_sum = torch.empty_like(row_max)
        for block in blocks:
            out[:, block.rows], row_max[:, block.rows], row_sum[:, block.rows] = _attend(
                problem, problem.scores(block=block), keep_prob, seed, offset, block.keys)
    out, row_max, row_sum = problem.heads(out), problem.heads(row_max), problem.heads(row_sum)
    if sink is not None:
        # A per-head logit that joins every row's softmax without a value: m = max(sink, max(S)),
        # sum += exp(sink - m); the probabilities computed without it shrink by the same factor.
        sink_logit = sink.to(out.dtype).view(1, g.heads, 1, 1)
        new_max = torch.maximum(row_max, sink_logit)
        kept = row_sum * torch.exp(row_max - new_max)
        new_sum = kept + torch.exp(sink_logit - new_max)
        out = out * (kept / new_sum)
        row_max, row_sum = new_max, new_sum
    if problem.masking.row_valid is not None:
        out = out * problem.masking.row_valid
    return out, row_max[..., 0], row_sum[..., 0]


def _attend(problem: _Problem, s: torch.Tensor, keep_prob: float, seed: int, offset: int,
            keys: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(s) @ v as the kernel computes it, of the scores s [B*Nkv, rows, keys] (consumed) and v's
    rows `keys`: the output [B*Nkv, rows, Dv] and the rows' max and sum [B*Nkv, rows, 1]."""
    # The flash kernel's softmax leaves exp(S - max) unnormalised (largest value exactly 1), its P @ V
    # reads that in the input dtype and the fp32 result is divided by the row sum afterwards
    # (Bmm2ResultDiv): rounding the normalised probabilities instead skews the output by the rounding of
    # their sum, which D = rowsum(dO * O) in the backward amplifies.
    # For fp32 (fp64) inputs nothing is rounded between: the normalised probabilities times V are the same
    # to the compute dtype's rounding, without the two passes over P and the output.
    rounds_p = problem.in_dtype not in (torch.float32, torch.float64)
    if rounds_p and s.dtype == torch.float32 and not _is_fake(s):
        # exp(S - max) and the rows' max and sum in one pass over S (C++: the exp clamped at -87, the
        # masked -1e30 scores 0, as the CPU's exp of them leaves its fast path, 8x slower)
        row_max, row_sum = _C.exp_rows(s)
        p = s
    else:
        row_max = s.amax(-1, keepdim=True)
        p = torch.softmax(s, -1)
        largest = p.amax(-1, keepdim=True)  # exp(0) / sum
        row_sum = largest.reciprocal()
        if rounds_p:
            p.div_(largest)  # exp(S - max), its largest value exactly 1
    del s
    if keep_prob < 1:
        p.masked_fill_(_dropped(p.shape, keep_prob, seed, offset, p.device, problem.dropout_stream),
                       0).mul_(1 / keep_prob)
    if problem.bf16_dot:
        out = _cube_matmul(p, problem.v_in[:, keys])  # exp(S - max) read as bf16, fp32 sums
    else:
        out = torch.bmm(_round_to_input_dtype(p, problem, in_place=True), problem.v[:, keys])
    del p
    if rounds_p:
        out.div_(row_sum)  # rounded once to the input dtype by the caller, as the kernel does
    return out, row_max, row_sum


def _backward(problem: _Problem, dy4, out4, row_max, row_sum, keep_prob, seed, offset, sink, want_dpse: bool):
    """dq [B, N, Sq, D], dk, dv [B, Nkv, Skv, D|Dv] (compute dtype), d(scores) [B, N, Sq, Skv] when
    asked (for dpse), dsink [N] or None."""
    g = problem.geometry
    dtype = problem.dtype
    dy = dy4.to(dtype)
    if problem.masking.row_valid is not None:
        dy = dy * problem.masking.row_valid  # rows with every key masked output zeros: no gradient
    dy3 = dy.reshape(g.batch * g.kv_heads, g.group * g.sq, -1)
    out3 = out4.to(dtype).reshape(dy3.shape)
    # A padding row of a TND batch has sum 0: any finite value keeps its (zero) gradient finite.
    log_sum_exp = row_max + torch.log(row_sum.clamp_min(torch.finfo(torch.float32).tiny))
    log_sum_exp = log_sum_exp.to(dtype).reshape(dy3.shape[0], dy3.shape[1], 1)
    if keep_prob == 1 and not want_dpse and problem.one_kernel and dy4.dtype == problem.in_dtype:
        row_dot = (dy3 * out3).sum(-1, keepdim=True)
        dq, dk, dv = _C.attention_backward(problem.q_in, problem.k_in, problem.v_in, dy4.reshape(dy3.shape),
                                           problem.bias3, _masked_score(problem), log_sum_exp, row_dot, problem.scale)
        return (problem.heads(dq), dk.view(g.batch, g.kv_heads, g.skv, -1), dv.view(g.batch, g.kv_heads, g.skv, -1),
                None, _sink_gradient(problem, sink, log_sum_exp, row_dot))
    blocks = _query_blocks(problem) if keep_prob == 1 and not want_dpse else None
    if blocks is not None:
        row_dot = (dy3 * out3).sum(-1, keepdim=True)
        dq, dk, dv = _blocked_gradients(problem, dy3, log_sum_exp, row_dot, blocks)
        return (problem.heads(dq), dk.view(g.batch, g.kv_heads, g.skv, -1), dv.view(g.batch, g.kv_heads, g.skv, -1),
                None, _sink_gradient(problem, sink, log_sum_exp, row_dot))
    # The forward's probabilities, from its statistics (0 where masked with AVX512-BF16, as in the forward)
    p = problem.scores(log_sum_exp)
    dropped = (_dropped(p.shape, keep_prob, seed, offset, p.device, problem.dropout_stream) if keep_prob < 1
               else None)
    p_out = p if dropped is None else p.masked_fill(dropped, 0).mul_(1 / keep_prob)
    if problem.bf16_dot and problem.masking.row_valid is None:  # dv, rounded once to bf16
        dv = _cube_matmul(p_out.transpose(1, 2), dy4.reshape(dy3.shape).to(torch.bfloat16), out_dtype=torch.bfloat16)
    elif problem.bf16_cube and problem.masking.row_valid is None:
        dv = _bf16_matmul(p_out.transpose(1, 2), dy4.reshape(dy3.shape))  # dv, rounded once to bf16
    else:  # p_out is P itself without dropout: kept unrounded for dS
        dv = torch.bmm(_round_to_input_dtype(p_out, problem, in_place=dropped is not None).transpose(1, 2), dy3)
    del p_out
    row_dot = (dy3 * out3).sum(-1, keepdim=True)  # sum_j P_j dP_j, from the rounded output as the kernel does
    if problem.bf16_dot and dy4.dtype == torch.bfloat16 and dropped is None:
        # dS = P * (dP - row_dot) as the matmul of dP stores it (0 where P is 0 throughout a tile)
        dy_in = dy4 if problem.masking.row_valid is None else dy4 * problem.masking.row_valid
        ds = _cube_matmul(dy_in.reshape(dy3.shape), problem.v_in.transpose(1, 2), log_sum_exp=row_dot, probabilities=p)
    else:
        dp = torch.bmm(dy3, problem.v.transpose(1, 2))
        if dropped is not None:
            dp.masked_fill_(dropped, 0).mul_(1 / keep_prob)
        ds = p.mul_(dp.sub_(row_dot))
        del dp
    if problem.bf16_dot:
        # dq, dk = scale * (dS @ k), scale * (dS^T @ q): dS rounded to bf16, the fp32 sums scaled, rounded once
        dq = _cube_matmul(ds, problem.k_in, problem.scale, out_dtype=torch.bfloat16)
        dk = _cube_matmul(ds.transpose(1, 2), problem.q_in, problem.scale, out_dtype=torch.bfloat16)
    elif problem.bf16_cube and _is_power_of_two(problem.scale):
        # dq, dk = scale * (dS @ k), scale * (dS^T @ q), rounded once to bf16: scaling by a power of two
        # (head dim 16, 64, 256) commutes with the rounding, so the bf16 GEMM's result scaled is the same
        ds_in = ds.to(torch.bfloat16)
        dq = _bf16_matmul(ds_in, problem.k_in).mul_(problem.scale)
        dk = _bf16_matmul(ds_in.transpose(1, 2), problem.q_in).mul_(problem.scale)
    else:  # dS kept unrounded for dpse
        ds_in = _round_to_input_dtype(ds, problem, in_place=not want_dpse)
        dq = torch.bmm(ds_in, problem.k).mul_(problem.scale)
        dk = torch.bmm(ds_in.transpose(1, 2), problem.q).mul_(problem.scale)
    return (problem.heads(dq), dk.view(g.batch, g.kv_heads, g.skv, -1), dv.view(g.batch, g.kv_heads, g.skv, -1),
            problem.heads(ds) if want_dpse else None, _sink_gradient(problem, sink, log_sum_exp, row_dot))


def _blocked_gradients(problem: _Problem, dy3: torch.Tensor, log_sum_exp: torch.Tensor, row_dot: torch.Tensor,
                       blocks: list[_Block]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv [B*Nkv, G*Sq|Skv, D|Dv] (compute dtype) as _backward computes them (P recomputed from the
    softmax statistics, P and dS rounded to the input dtype for their matmuls), one query block at a
    time over the keys it sees (see _query_blocks): dk and dv summed over the blocks (fp32 in fp32)."""
    q, k, v = problem.q, problem.k, problem.v
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for block in blocks:
        rows, keys = block.rows, block.keys
        p = problem.scores(log_sum_exp[:, rows], block)
        dv[:, keys].baddbmm_(_round_to_input_dtype(p, problem, in_place=False).transpose(1, 2), dy3[:, rows])
        dp = torch.bmm(dy3[:, rows], v[:, keys].transpose(1, 2))
        ds = _round_to_input_dtype(p.mul_(dp.sub_(row_dot[:, rows])), problem, in_place=True)
        del dp
        torch.bmm(ds, k[:, keys], out=dq[:, rows])
        dk[:, keys].baddbmm_(ds.transpose(1, 2), q[:, rows])
    return dq.mul_(problem.scale), dk.mul_(problem.scale), dv


def _sink_gradient(problem: _Problem, sink: torch.Tensor | None, log_sum_exp: torch.Tensor,
                   row_dot: torch.Tensor) -> torch.Tensor | None:
    """dsink [N]: the sink's probability times -rowsum(dO * O), summed over batches and rows."""
    if sink is None:
        return None
    p_sink = torch.exp(sink.to(problem.dtype).view(1, problem.geometry.heads, 1, 1) - problem.heads(log_sum_exp))
    return -(p_sink * problem.heads(row_dot)).sum((0, 2, 3))


# ---- npu_fusion_attention ------------------------------------------------------------------------

def _layout(op: str, input_layout: str, allowed=TRAINING_LAYOUTS) -> str:
    layout = input_layout.upper()
    if layout not in allowed:
        raise ValueError(f"torch_npu.{op}: input_layout must be one of {', '.join(allowed)}, got {input_layout!r}")
    return layout


def _check_dtypes(op: str, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"torch_npu.{op}: {name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def _pse_bias(op: str, pse, geometry: _Geometry, scale: float, pse_type: int) -> torch.Tensor | None:
    """pse as the fp32 bias added to scale * q @ k^T: scale * pse (pse_type 1: scale * (qk + pse)),
    pse itself (pse_type 0: scale * qk + pse). BNSS, BN1S, 1NSS (TND: per sequence, padded)."""
    if pse is None:
        return None
    b, n, sq, skv = geometry.batch, geometry.heads, geometry.sq, geometry.skv
    if pse.dim() != 4 or pse.shape[0] not in (1, b) or pse.shape[1] != n or pse.shape[2] not in (1, sq) \
            or pse.shape[3] != skv:
        hint = (" (the alibi-compressed form, the last 1024 rows, is not emulated: pass the full pse)"
                if pse.dim() == 4 and pse.shape[2] == 1024 and sq > 1024 else "")
        raise ValueError(f"torch_npu.{op}: pse must be [B, N, Sq, Skv], [B, N, 1, Skv] or [1, N, Sq, Skv] = "
                         f"[{b}, {n}, {sq}, {skv}], got {tuple(pse.shape)}{hint}")
    bias = pse.to(compute_dtype(pse.dtype) if pse.dtype != torch.float64 else torch.float64)
    return bias * scale if pse_type == 1 else bias.clone()


@dataclass
class _Call:
    """Everything one npu_fusion_attention(_v2) call decides before computing: the geometry and a
    problem per part (TND: per bucket of similar sequences, see _parts)."""
    geometry: _Geometry
    problems: list[_Problem]
    numels: int

    @property
    def parts(self) -> list[_Geometry]:
        return [problem.geometry for problem in self.problems]


def _prepare(op: str, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
             pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink,
             pse_type=1, query_rope=None, key_rope=None) -> _Call:
    layout = _layout(op, input_layout)
    _check_dtypes(op, query=query, key=key, value=value, pse=pse)
    if padding_mask is not None:
        raise ValueError(f"torch_npu.{op}: padding_mask is reserved and not supported (pass None); "
                         "use atten_mask")
    if not 0 < keep_prob <= 1:
        raise ValueError(f"torch_npu.{op}: keep_prob must be in (0, 1], got {keep_prob}")
    if softmax_layout not in ("", "TND") or softmax_layout == "TND" and layout != "TND":
        raise ValueError(f"torch_npu.{op}: softmax_layout must be '' or 'TND' (with input_layout TND), "
                         f"got {softmax_layout!r}")
    if pse is not None and sparse_mode in (7, 8):
        raise ValueError(f"torch_npu.{op}: sparse_mode={sparse_mode} does not take pse")
    if sink is not None and (sink.dim() != 1 or sink.shape[0] != head_num):
        raise ValueError(f"torch_npu.{op}: sink must have shape [head_num] = [{head_num}], got {tuple(sink.shape)}")
    if query_rope is not None:
        query = torch.cat([query, query_rope.to(query.dtype)], -1)
        key = torch.cat([key, key_rope.to(key.dtype)], -1)
    geometry = _geometry(op, query, key, value, head_num, layout, actual_seq_qlen, actual_seq_kvlen)
    varlen = geometry.varlen
    pse_bias = _pse_bias(op, pse, geometry, scale, pse_type)
    problems = []
    # pse is given per padded batch [B, N, maxSq, maxSkv]: its TND problem stays the one padded batch
    for stream, part in enumerate(_parts(geometry, split=pse is None)):
        q4 = _to_bnsd(query, layout, part.heads, part.varlen, "q", part.sq)
        k4 = _to_bnsd(key, layout, part.kv_heads, part.varlen, "kv", part.skv)
        v4 = _to_bnsd(value, layout, part.kv_heads, part.varlen, "kv", part.skv)
        masking = _masking(op, part, atten_mask, sparse_mode, pre_tokens, next_tokens, prefix, pse_bias, query)
        problems.append(_problem(q4, k4, v4, part, scale, masking, query.dtype, npu_numerics(query), stream))
    if varlen is not None:
        numels = geometry.heads * sum(a * b for a, b in zip(varlen.q_lens, varlen.kv_lens))
    else:
        numels = geometry.batch * geometry.heads * geometry.sq * geometry.skv
    return _Call(geometry, problems, numels)


def _seed_offset(query, keep_prob: float, seed: int, offset: int) -> tuple[int, int]:
    if keep_prob >= 1:
        return 0, 0
    if seed or offset:
        return seed, offset
    return _draw_seed_offset(query.device)


def _fusion_attention(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                      keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                      softmax_layout, sink, dropout_mask, seed, offset, pse_type=1, query_rope=None, key_rope=None):
    if dropout_mask is not None:
        raise NotImplementedError(f"torch_npu.{op}: an external dropout_mask is not emulated; pass keep_prob "
                                  "(and seed/offset to fix the mask)")
    call = _prepare(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
                    pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
                    sink, pse_type, query_rope, key_rope)
    seed, offset = _seed_offset(query, keep_prob, seed, offset)
    outs, row_maxes, row_sums = [], [], []
    for problem in call.problems:
        out, row_max, row_sum = _forward(problem, keep_prob, seed, offset, sink)
        outs.append(out.to(query.dtype))
        row_maxes.append(row_max.float())
        row_sums.append(row_sum.float())
    g, parts = call.geometry, call.parts
    return (_assemble(outs, g, parts), _rows_to_stats(row_maxes, g, parts), _rows_to_stats(row_sums, g, parts),
            query.new_empty(0), seed, offset, call.numels)


def _fusion_attention_fake(op, query, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen,
                           keep_prob, seed, offset, query_rope=None, key_rope=None):
    layout = _layout(op, input_layout)
    if query_rope is not None:
        query = torch.cat([query, query_rope], -1)
        key = torch.cat([key, key_rope], -1)
    g = _geometry(op, query, key, value, head_num, layout, actual_seq_qlen, actual_seq_kvlen)
    if keep_prob < 1 and not (seed or offset):
        # A traced graph keeps the int outputs its fake kernel returns: the forward's freshly drawn
        # seed would not reach the backward, which would drop other elements.
        raise RuntimeError(f"torch_npu.{op}: under torch.compile, keep_prob < 1 needs an explicit seed and offset "
                           "(the graph cannot carry the seed the kernel draws to its backward)")
    numels = (g.heads * sum(a * b for a, b in zip(g.varlen.q_lens, g.varlen.kv_lens)) if g.varlen
              else g.batch * g.heads * g.sq * g.skv)
    seed, offset = (seed, offset) if keep_prob < 1 else (0, 0)
    stat = query.new_empty(_stat_shape(g), dtype=torch.float32)
    return (query.new_empty(_out_shape(g)), stat, torch.empty_like(stat), query.new_empty(0), seed, offset, numels)


_FUSION_ATTENTION_SCHEMA = (
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
    "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
    "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
    "bool sync=False, str softmax_layout=\"\", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, "
    "int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)")
_UNFUSED = ("torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v "
            "(torch.nn.functional.scaled_dot_product_attention)")


def _fusion_attention_v1_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                              atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX,
                              inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                              sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None,
                              dropout_mask=None, seed=0, offset=0):
    return _fusion_attention_fake("npu_fusion_attention", query, key, value, head_num, input_layout,
                                  actual_seq_qlen, actual_seq_kvlen, keep_prob, seed, offset)


@fused_op(_FUSION_ATTENTION_SCHEMA, unfused=_UNFUSED, fake=_fusion_attention_v1_fake)
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0,
                         offset=0):
    return _fusion_attention("npu_fusion_attention", query, key, value, head_num, input_layout, pse, padding_mask,
                             atten_mask, scale, keep_prob, pre_tockens, next_tockens, prefix, actual_seq_qlen,
                             actual_seq_kvlen, sparse_mode, softmax_layout, sink, dropout_mask, seed, offset)


def _fusion_attention_grad(op, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask,
                           softmax_max, softmax_sum, attention_in, scale, keep_prob, pre_tokens, next_tokens, seed,
                           offset, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink,
                           pse_type=1, query_rope=None, key_rope=None):
    """dq, dk, dv, dpse, dsink (and, with rope inputs, dq_rope and dk_rope)."""
    for name, tensor in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum), ("attention_in", attention_in)):
        if tensor is None:
            raise ValueError(f"torch_npu.{op}: {name} is required (the forward's output of that name)")
    call = _prepare(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
                    pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
                    sink, pse_type, query_rope, key_rope)
    grads = []
    for problem in call.problems:
        part = problem.geometry
        dy4 = _to_bnsd(dy, part.layout, part.heads, part.varlen, "q", part.sq)
        out4 = _to_bnsd(attention_in, part.layout, part.heads, part.varlen, "q", part.sq)
        row_max = _stats_to_rows(softmax_max, part).to(problem.dtype)
        row_sum = _stats_to_rows(softmax_sum, part).to(problem.dtype)
        dq, dk, dv, dscores, dsink = _backward(problem, dy4, out4, row_max, row_sum, keep_prob, seed, offset, sink,
                                               pse is not None)
        grads.append((dq.to(query.dtype), dk.to(query.dtype), dv.to(query.dtype), dsink))
    g, parts = call.geometry, call.parts
    dq = _assemble([grad[0] for grad in grads], g, parts, "q")
    dk = _assemble([grad[1] for grad in grads], g, parts, "kv")
    dv = _assemble([grad[2] for grad in grads], g, parts, "kv")
    if sink is not None:
        dsink = sum(grad[3] for grad in grads)
    if pse is not None:  # one part (see _prepare)
        # scores = scale * (qk + pse) (pse_type 1) or scale * qk + pse (pse_type 0)
        dscores = dscores * scale if pse_type == 1 else dscores
        dpse = dscores.sum_to_size(pse.shape).to(pse.dtype)
    else:
        dpse = query.new_empty(0)
    dsink = dsink.to(sink.dtype) if sink is not None else query.new_empty(0, dtype=torch.float32)
    if query_rope is not None:
        d_rope = query_rope.shape[-1]
        dq, dq_rope = dq[..., :-d_rope].contiguous(), dq[..., -d_rope:].contiguous()
        dk, dk_rope = dk[..., :-d_rope].contiguous(), dk[..., -d_rope:].contiguous()
        return dq, dk, dv, dpse, dsink, dq_rope.to(query_rope.dtype), dk_rope.to(key_rope.dtype)
    return dq, dk, dv, dpse, dsink, None, None


def _grad_fake(query, key, value, pse, sink, query_rope=None, key_rope=None):
    dpse = pse.new_empty(pse.shape) if pse is not None else query.new_empty(0)
    dsink = sink.new_empty(sink.shape) if sink is not None else query.new_empty(0, dtype=torch.float32)
    return (query.new_empty(query.shape), key.new_empty(key.shape, dtype=query.dtype),
            value.new_empty(value.shape, dtype=query.dtype), dpse, dsink,
            query_rope.new_empty(query_rope.shape) if query_rope is not None else query.new_empty(0),
            key_rope.new_empty(key_rope.shape) if key_rope is not None else query.new_empty(0))


_GRAD_SCHEMA = (
    "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? softmax_max=None, "
    "Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, "
    "int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
    "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _fusion_attention_grad_fake(query, key, value, dy, head_num, input_layout, *, pse=None, sink=None, **_):
    return _grad_fake(query, key, value, pse, sink)[:5]


@fused_op(_GRAD_SCHEMA, unfused="autograd of npu_fusion_attention's decomposition", public=False,
          fake=_fusion_attention_grad_fake)
def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=INT_MAX,
                              next_tockens=INT_MAX, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    return _fusion_attention_grad("npu_fusion_attention_grad", query, key, value, dy, head_num, input_layout, pse,
                                  padding_mask, atten_mask, softmax_max, softmax_sum, attention_in, scale_value,
                                  keep_prob, pre_tockens, next_tockens, seed, offset, prefix, actual_seq_qlen,
                                  actual_seq_kvlen, sparse_mode, softmax_layout, sink)[:5]


_V1_ARGS = ("query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask", "scale",
            "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix", "actual_seq_qlen",
            "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout", "sink", "dropout_mask",
            "seed", "offset")


def _fusion_attention_setup(ctx, inputs, output):
    args = dict(zip(_V1_ARGS, inputs))
    ctx.args = {name: value for name, value in args.items() if not isinstance(value, torch.Tensor)}
    ctx.args.update(seed=output[4], offset=output[5], numels=output[6])
    ctx.has = {name: args[name] is not None for name in ("pse", "atten_mask", "sink")}
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["pse"], args["atten_mask"], args["sink"],
                          output[0], output[1], output[2])


def _fusion_attention_backward(ctx, d_out, _dmax, _dsum, _dsoftmax, *_ints):
    query, key, value, pse, atten_mask, sink, out, softmax_max, softmax_sum = ctx.saved_tensors
    a = ctx.args
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv, dpse, dsink = torch.ops.npu.npu_fusion_attention_grad(
        query, key, value, d_out, a["head_num"], a["input_layout"], pse=pse, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=a["scale"],
        keep_prob=a["keep_prob"], pre_tockens=a["pre_tockens"], next_tockens=a["next_tockens"],
        inner_precise=a["inner_precise"], seed=a["seed"], offset=a["offset"], numels=a["numels"], prefix=a["prefix"],
        actual_seq_qlen=a["actual_seq_qlen"], actual_seq_kvlen=a["actual_seq_kvlen"], sparse_mode=a["sparse_mode"],
        softmax_layout=a["softmax_layout"], sink=sink)
    grads = {"query": dq, "key": dk, "value": dv, "pse": dpse if ctx.has["pse"] else None,
             "sink": dsink if ctx.has["sink"] else None}
    return tuple(grads.get(name) for name in _V1_ARGS)


register_autograd("npu_fusion_attention", _fusion_attention_backward, _fusion_attention_setup)


# ---- npu_fusion_attention_v2 ---------------------------------------------------------------------

def _check_v2(op: str, pse, query_rope, key_rope, input_layout, keep_prob, pse_type, query) -> None:
    if pse_type in (2, 3):
        raise NotImplementedError(f"torch_npu.{op}: pse_type={pse_type} (the alibi pse the kernel generates from "
                                  "per-head slopes, with q_start_idx/kv_start_idx) is not emulated; pass the full pse "
                                  "with pse_type 0 or 1")
    if pse_type not in (0, 1):
        raise ValueError(f"torch_npu.{op}: pse_type must be 0, 1, 2 or 3, got {pse_type}")
    if (query_rope is None) != (key_rope is None):
        raise ValueError(f"torch_npu.{op}: query_rope and key_rope go together")
    if query_rope is not None:
        if input_layout.upper() != "TND":
            raise ValueError(f"torch_npu.{op}: query_rope/key_rope are supported with input_layout TND only")
        if keep_prob != 1 or pse is not None:
            raise ValueError(f"torch_npu.{op}: with query_rope/key_rope keep_prob must be 1 and pse None")
        if not all(t.dtype == torch.bfloat16 for t in (query, query_rope, key_rope)):
            raise ValueError(f"torch_npu.{op}: with query_rope/key_rope the inputs must be bfloat16")


_V2_SCHEMA = (
    "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, *, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? query_rope=None, "
    "Tensor? key_rope=None, float scale=1., float keep_prob=1., int pre_tokens=2147483647, "
    "int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
    "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, int pse_type=1, "
    "int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout=\"\", Tensor? sink=None, "
    "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)")


def _fusion_attention_v2_fake(query, key, value, head_num, input_layout, *, query_rope=None, key_rope=None,
                              keep_prob=1.0, actual_seq_qlen=None, actual_seq_kvlen=None, seed=0, offset=0, **_):
    return _fusion_attention_fake("npu_fusion_attention_v2", query, key, value, head_num, input_layout,
                                  actual_seq_qlen, actual_seq_kvlen, keep_prob, seed, offset, query_rope, key_rope)


@fused_op(_V2_SCHEMA, unfused=_UNFUSED, fake=_fusion_attention_v2_fake)
def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                            atten_mask=None, query_rope=None, key_rope=None, scale=1.0, keep_prob=1.0,
                            pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                            sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout="",
                            sink=None, dropout_mask=None, seed=0, offset=0):
    op = "npu_fusion_attention_v2"
    _check_v2(op, pse, query_rope, key_rope, input_layout, keep_prob, pse_type, query)
    return _fusion_attention(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                             keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen,
                             sparse_mode, softmax_layout, sink, dropout_mask, seed, offset, pse_type, query_rope,
                             key_rope)


_GRAD_V2_SCHEMA = (
    "npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
    "Tensor? query_rope=None, Tensor? key_rope=None, float scale_value=1., float keep_prob=1., "
    "int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, int seed=0, int offset=0, "
    "int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    "bool gen_mask_parallel=True, bool sync=False, int pse_type=1, int[]? q_start_idx=None, "
    "int[]? kv_start_idx=None, str softmax_layout=\"\", Tensor? sink=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _fusion_attention_grad_v2_fake(query, key, value, dy, head_num, input_layout, *, pse=None, sink=None,
                                   query_rope=None, key_rope=None, **_):
    dq, dk, dv, dpse, dsink, dq_rope, dk_rope = _grad_fake(query, key, value, pse, sink, query_rope, key_rope)
    return dq, dk, dv, dpse, dq_rope, dk_rope, dsink


@fused_op(_GRAD_V2_SCHEMA, unfused="autograd of npu_fusion_attention_v2's decomposition", public=False,
          fake=_fusion_attention_grad_v2_fake)
def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1.0, keep_prob=1.0,
                                 pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0, seed=0, offset=0,
                                 numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                 gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None,
                                 softmax_layout="", sink=None):
    op = "npu_fusion_attention_grad_v2"
    _check_v2(op, pse, query_rope, key_rope, input_layout, keep_prob, pse_type, query)
    dq, dk, dv, dpse, dsink, dq_rope, dk_rope = _fusion_attention_grad(
        op, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, softmax_max, softmax_sum,
        attention_in, scale_value, keep_prob, pre_tokens, next_tokens, seed, offset, prefix, actual_seq_qlen,
        actual_seq_kvlen, sparse_mode, softmax_layout, sink, pse_type, query_rope, key_rope)
    if dq_rope is None:
        dq_rope, dk_rope = query.new_empty(0), query.new_empty(0)
    return dq, dk, dv, dpse, dq_rope, dk_rope, dsink


_V2_TENSORS = ("query", "key", "value", "pse", "atten_mask", "query_rope", "key_rope", "sink")


def _fusion_attention_v2_backward(ctx, d_out, *_rest):
    saved = dict(zip(_V2_TENSORS + ("out", "softmax_max", "softmax_sum"), ctx.saved_tensors))
    a = ctx.args
    if d_out is None:
        d_out = torch.zeros_like(saved["out"])
    dq, dk, dv, dpse, dq_rope, dk_rope, dsink = torch.ops.npu.npu_fusion_attention_grad_v2(
        saved["query"], saved["key"], saved["value"], d_out, a["head_num"], a["input_layout"], pse=saved["pse"],
        atten_mask=saved["atten_mask"], softmax_max=saved["softmax_max"], softmax_sum=saved["softmax_sum"],
        attention_in=saved["out"], query_rope=saved["query_rope"], key_rope=saved["key_rope"],
        scale_value=a["scale"], keep_prob=a["keep_prob"], pre_tokens=a["pre_tokens"],
        next_tokens=a["next_tokens"], inner_precise=a["inner_precise"], seed=a["seed"], offset=a["offset"],
        numels=a["numels"], prefix=a["prefix"], actual_seq_qlen=a["actual_seq_qlen"],
        actual_seq_kvlen=a["actual_seq_kvlen"], sparse_mode=a["sparse_mode"], pse_type=a["pse_type"],
        softmax_layout=a["softmax_layout"], sink=saved["sink"])
    grads = {"query": dq, "key": dk, "value": dv, "pse": dpse, "query_rope": dq_rope, "key_rope": dk_rope,
             "sink": dsink}
    return (None, *(grads.get(name) if present else None for name, present in zip(_V2_TENSORS, ctx.present)))


class _FusionAttentionV2Function(torch.autograd.Function):
    """Autograd of npu_fusion_attention_v2 through npu_fusion_attention_grad_v2 (its tensors are
    keyword-only, which torch.library.register_autograd does not take)."""

    @staticmethod
    def forward(ctx, args, *tensors):
        kwargs = dict(args, **dict(zip(_V2_TENSORS, tensors)))
        with torch._C._AutoDispatchBelowAutograd():
            outputs = torch.ops.npu.npu_fusion_attention_v2.default(**kwargs)
        ctx.args = dict(args, seed=outputs[4], offset=outputs[5], numels=outputs[6])
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*tensors, outputs[0], outputs[1], outputs[2])
        ctx.mark_non_differentiable(outputs[1], outputs[2], outputs[3])
        return outputs

    backward = staticmethod(unwatched_backward(_fusion_attention_v2_backward))


_V2_SIGNATURE = inspect.signature(npu_fusion_attention_v2)


def _fusion_attention_v2_autograd(*args, **kwargs):
    bound = _V2_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    tensors = [bound.arguments[name] for name in _V2_TENSORS]
    args = {name: value for name, value in bound.arguments.items() if name not in _V2_TENSORS}
    return _FusionAttentionV2Function.apply(args, *tensors)


_LIBRARY.impl("npu_fusion_attention_v2", _fusion_attention_v2_autograd, "Autograd")


# ---- inference: npu_prompt_flash_attention, npu_incre_flash_attention, npu_fused_infer_attention_score ----

INFER_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")


def _refuse(op: str, **arguments) -> None:
    """Quantization, paging and padding arguments this emulation does not compute: name them."""
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise NotImplementedError(f"torch_npu.{op}: {', '.join(given)} (quantization / left-padding / shared-prefix "
                                  "arguments) are not emulated; pass float16/bfloat16/float32 query, key and value "
                                  "without them")


def _per_batch(op: str, name: str, lengths, batch: int) -> list[int] | None:
    """actual_seq_lengths(_kv) of a non-TND layout: one value for every batch, or the first B."""
    if lengths is None:
        return None
    values = [int(v) for v in lengths]
    if len(values) == 1:
        return values * batch
    if len(values) < batch:
        raise ValueError(f"torch_npu.{op}: {name} must have 1 or at least B={batch} values, got {len(values)}")
    return values[:batch]


def _paged(op: str, cache: torch.Tensor, block_table: torch.Tensor, block_size: int, kv_heads: int) -> torch.Tensor:
    """The [B, Nkv, S, D] keys (values) of a paged cache: (blocknum, blocksize, H) or
    (blocknum, Nkv, blocksize, D) blocks, gathered along each batch's row of block_table."""
    if block_table.dim() != 2:
        raise ValueError(f"torch_npu.{op}: block_table must be 2-D [B, max blocks per sequence], got "
                         f"{tuple(block_table.shape)}")
    size_axis = 1 if cache.dim() == 3 else 2
    if cache.dim() not in (3, 4) or block_size <= 0 or cache.shape[size_axis] != block_size:
        raise ValueError(f"torch_npu.{op}: with block_table the key/value cache must be (blocknum, block_size, H) or "
                         f"(blocknum, Nkv, block_size, D) with block_size={block_size}, got {tuple(cache.shape)}")
    blocks = cache[block_table.long()]  # [B, blocks, block_size, H] or [B, blocks, Nkv, block_size, D]
    b, n_blocks = block_table.shape
    if cache.dim() == 3:
        return blocks.reshape(b, n_blocks * block_size, kv_heads, -1).transpose(1, 2)
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, cache.shape[1], n_blocks * block_size, cache.shape[3])


def _infer_mask(op: str, atten_mask, sparse_mode: int, sq: int, skv: int, varlen: bool):
    """atten_mask as _masking takes it: a full mask [B|1, 1, Sq, Skv] cut to the sequence lengths
    (the inference kernels accept masks padded beyond them), the compressed mask as it is."""
    if atten_mask is None or sparse_mode in (2, 3, 4) or varlen:
        return atten_mask
    mask = atten_mask
    if mask.dim() == 2:
        mask = mask[:, None, None, :] if sq == 1 and mask.shape[0] != 1 else mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dim() != 4 or mask.shape[-2] < sq or mask.shape[-1] < skv:
        raise ValueError(f"torch_npu.{op}: atten_mask must be (Q_S, KV_S), (B, Q_S, KV_S), (B, 1, Q_S, KV_S) or, for "
                         f"Q_S = 1, (B, KV_S), at least {sq}x{skv}; got {tuple(atten_mask.shape)}")
    return mask[..., :sq, :skv]


def _infer_attention(op, query, key, value, *, layout, num_heads, num_key_value_heads, scale, atten_mask, pse_shift,
                     q_lengths, kv_lengths, pre_tokens, next_tokens, sparse_mode, block_table=None, block_size=0,
                     query_rope=None, key_rope=None, incremental=False, sink=None):
    """attention_out in the output layout and the rows' log-sum-exp [B, N, Sq] (TND: [T, N])."""
    if layout not in INFER_LAYOUTS:
        raise ValueError(f"torch_npu.{op}: input_layout must be one of {', '.join(INFER_LAYOUTS)}, got {layout!r}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise NotImplementedError(f"torch_npu.{op}: {name} of dtype {tensor.dtype} (int8/int4 quantized inputs) "
                                      "is not emulated; pass float16, bfloat16 or float32")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise NotImplementedError(f"torch_npu.{op}: sparse_mode={sparse_mode} is not supported (0..4 are)")
    if (query_rope is None) != (key_rope is None):
        raise ValueError(f"torch_npu.{op}: query_rope and key_rope go together")
    in_layout, out_layout = ("BNSD", "BSND") if layout == "BNSD_BSND" else (layout, layout)
    if query_rope is not None:  # MLA: the rope part of the scores, q_rope k_rope^T, joins q k^T
        query = torch.cat([query, query_rope.to(query.dtype)], -1)
        key = torch.cat([key, key_rope.to(key.dtype)], -1)
    varlen = in_layout == "TND"
    if block_table is not None:
        if varlen:
            raise NotImplementedError(f"torch_npu.{op}: block_table (paged KV cache) with input_layout TND is not "
                                      "emulated")
        if kv_lengths is None:
            raise ValueError(f"torch_npu.{op}: with block_table, the kv sequence lengths (actual_seq_lengths"
                             f"{'' if incremental else '_kv'}) are required")
        q4 = _to_bnsd(query, in_layout, num_heads)
        kv_heads = num_key_value_heads or num_heads
        if key.dim() == 3 and key.shape[2] % kv_heads:
            raise ValueError(f"torch_npu.{op}: the cache's H={key.shape[2]} is not a multiple of num_key_value_heads")
        k4 = _paged(op, key, block_table, block_size, kv_heads)
        v4 = _paged(op, value, block_table, block_size, kv_heads)
        geometry = _Geometry(in_layout, q4.shape[0], num_heads, k4.shape[1], q4.shape[2], k4.shape[2], q4.shape[3],
                             v4.shape[3])
        if geometry.heads % geometry.kv_heads:
            raise ValueError(f"torch_npu.{op}: num_heads ({num_heads}) must be a multiple of the key/value heads "
                             f"({geometry.kv_heads})")
    else:
        geometry = _geometry(op, query, key, value, num_heads, in_layout, q_lengths if varlen else None,
                             kv_lengths if varlen else None, kv_heads=num_key_value_heads or None)
        if num_key_value_heads and geometry.kv_heads != num_key_value_heads:
            raise ValueError(f"torch_npu.{op}: num_key_value_heads={num_key_value_heads} but key has "
                             f"{geometry.kv_heads} heads")
    q_lens = None if varlen else _per_batch(op, "actual_seq_lengths", q_lengths, geometry.batch)
    kv_lens = None if varlen else _per_batch(op, "actual_seq_lengths_kv", kv_lengths, geometry.batch)
    for lens, bound, name in ((q_lens, geometry.sq, "query"), (kv_lens, geometry.skv, "key/value")):
        if lens is not None and max(lens) > bound:
            raise ValueError(f"torch_npu.{op}: an actual sequence length exceeds the {name} sequence ({bound})")
    if incremental:  # one new token per sequence: no sparse mode, no band
        sparse_mode, pre_tokens, next_tokens = 0, INT_MAX, INT_MAX
    pse_bias = None
    if pse_shift is not None:
        if pse_shift.dim() != 4 or pse_shift.shape[0] not in (1, geometry.batch) or pse_shift.shape[1] != num_heads \
                or pse_shift.shape[2] < geometry.sq or pse_shift.shape[3] < geometry.skv:
            raise ValueError(f"torch_npu.{op}: pse_shift must be (B, N, Q_S, KV_S) or (1, N, Q_S, KV_S), got "
                             f"{tuple(pse_shift.shape)}")
        pse_bias = upcast(pse_shift[:, :, :geometry.sq, :geometry.skv])  # scale * q k^T + pse_shift
    mask = _infer_mask(op, atten_mask, sparse_mode, geometry.sq, geometry.skv, varlen)
    if sink is not None and (sink.dim() != 1 or sink.shape[0] != num_heads):
        raise ValueError(f"torch_npu.{op}: learnable_sink must have shape (Q_N,) = ({num_heads},), got "
                         f"{tuple(sink.shape)}")
    # TND: a problem per bucket of similar sequences (one padded batch with a pse_shift, given per batch)
    parts = [geometry] if block_table is not None else _parts(geometry, split=pse_shift is None)
    outs, log_sum_exps = [], []
    for part in parts:
        if block_table is None:
            q4 = _to_bnsd(query, in_layout, part.heads, part.varlen, "q", part.sq)
            k4 = _to_bnsd(key, in_layout, part.kv_heads, part.varlen, "kv", part.skv)
            v4 = _to_bnsd(value, in_layout, part.kv_heads, part.varlen, "kv", part.skv)
        masking = _masking(op, part, mask, sparse_mode, pre_tokens, next_tokens, None, pse_bias, query, q_lens,
                           kv_lens)
        problem = _problem(q4, k4, v4, part, scale, masking, query.dtype, npu_numerics(query))
        out, row_max, row_sum = _forward(problem, 1.0, 0, 0, sink)
        outs.append(out.to(query.dtype))
        log_sum_exps.append(row_max + torch.log(row_sum))
    if varlen:
        return (_assemble(outs, geometry, parts), _assemble([lse.unsqueeze(-1) for lse in log_sum_exps], geometry,
                                                             parts)[..., 0], geometry)
    return _from_bnsd(outs[0], out_layout), log_sum_exps[0], geometry


_PFA_SCHEMA = (
    "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
    "Tensor? atten_mask=None, Tensor? pse_shift=None, int[]? actual_seq_lengths=None, Tensor? deq_scale1=None, "
    "Tensor? quant_scale1=None, Tensor? deq_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
    "int num_heads=1, float scale_value=1.0, int pre_tokens=2147483647, int next_tokens=0, str input_layout=\"BSH\", "
    "int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None, int sparse_mode=0) -> Tensor")
_INFER_UNFUSED = "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~atten_mask, scale=scale)"


@fused_op(_PFA_SCHEMA, unfused=_INFER_UNFUSED)
def npu_prompt_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                               actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                               quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                               pre_tokens=INT_MAX, next_tokens=0, input_layout="BSH", num_key_value_heads=0,
                               actual_seq_lengths_kv=None, sparse_mode=0):
    op = "npu_prompt_flash_attention"
    _refuse(op, deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2, quant_scale2=quant_scale2,
            quant_offset2=quant_offset2)
    if padding_mask is not None:
        raise ValueError(f"torch_npu.{op}: padding_mask is reserved and not supported (pass None)")
    return _infer_attention(op, query, key, value, layout=input_layout, num_heads=num_heads,
                            num_key_value_heads=num_key_value_heads, scale=scale_value, atten_mask=atten_mask,
                            pse_shift=pse_shift, q_lengths=actual_seq_lengths, kv_lengths=actual_seq_lengths_kv,
                            pre_tokens=pre_tokens, next_tokens=next_tokens, sparse_mode=sparse_mode)[0]


_IFA_SCHEMA = (
    "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
    "Tensor? atten_mask=None, Tensor? pse_shift=None, SymInt[]? actual_seq_lengths=None, "
    "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? block_table=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? kv_padding_size=None, int num_heads=1, float scale_value=1.0, "
    "str input_layout=\"BSH\", int num_key_value_heads=0, int block_size=0, int inner_precise=1) -> Tensor")


@fused_op(_IFA_SCHEMA, unfused=_INFER_UNFUSED)
def npu_incre_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                              actual_seq_lengths=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
                              dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None,
                              quant_offset2=None, kv_padding_size=None, num_heads=1, scale_value=1.0,
                              input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1):
    op = "npu_incre_flash_attention"
    _refuse(op, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, dequant_scale1=dequant_scale1,
            quant_scale1=quant_scale1, dequant_scale2=dequant_scale2, quant_scale2=quant_scale2,
            quant_offset2=quant_offset2, kv_padding_size=kv_padding_size)
    if padding_mask is not None:
        raise ValueError(f"torch_npu.{op}: padding_mask is reserved and not supported (pass None)")
    if input_layout not in ("BSH", "BSND", "BNSD"):
        raise ValueError(f"torch_npu.{op}: input_layout must be BSH, BSND or BNSD, got {input_layout!r}")
    return _infer_attention(op, query, key, value, layout=input_layout, num_heads=num_heads,
                            num_key_value_heads=num_key_value_heads, scale=scale_value, atten_mask=atten_mask,
                            pse_shift=pse_shift, q_lengths=None, kv_lengths=actual_seq_lengths, pre_tokens=INT_MAX,
                            next_tokens=INT_MAX, sparse_mode=0, block_table=block_table, block_size=block_size,
                            incremental=True)[0]


_FIA_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
    "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
    "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    "int next_tokens=2147483647, str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
    "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
    "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)")


@fused_op(_FIA_SCHEMA, unfused=_INFER_UNFUSED)
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    op = "npu_fused_infer_attention_score"
    _refuse(op, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1, dequant_scale2=dequant_scale2,
            quant_scale2=quant_scale2, quant_offset2=quant_offset2, antiquant_scale=antiquant_scale,
            antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
            key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
            value_antiquant_offset=value_antiquant_offset, query_padding_size=query_padding_size,
            kv_padding_size=kv_padding_size, key_shared_prefix=key_shared_prefix,
            value_shared_prefix=value_shared_prefix, actual_shared_prefix_len=actual_shared_prefix_len,
            key_rope_antiquant_scale=key_rope_antiquant_scale)
    return _fused_infer(op, query, key, value, pse_shift, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                        block_table, query_rope, key_rope, None, num_heads, num_key_value_heads, scale, pre_tokens,
                        next_tokens, input_layout, sparse_mode, block_size, softmax_lse_flag)


def _fused_infer(op, query, key, value, pse_shift, atten_mask, q_lengths, kv_lengths, block_table, query_rope,
                 key_rope, sink, num_heads, num_key_value_heads, scale, pre_tokens, next_tokens, layout, sparse_mode,
                 block_size, softmax_lse):
    """FusedInferAttentionScore (v1 and v2): the incremental branch for Q_S = 1, the prompt branch
    otherwise; attention_out and softmax_lse (log(sum) + max per row, or [1] zeros when not asked)."""
    if sparse_mode == 9:
        raise NotImplementedError(f"torch_npu.{op}: sparse_mode=9 (tree mask) is not emulated")
    seq_axis = {"BSH": 1, "BSND": 1, "BNSD": 2, "BNSD_BSND": 2, "TND": 0}.get(layout, 1)
    # Q_S = 1 takes the incremental (IncreFlashAttention) branch: no sparse mode, no band.
    incremental = layout != "TND" and query.shape[seq_axis] == 1 and query_rope is None
    out, log_sum_exp, geometry = _infer_attention(
        op, query, key, value, layout=layout, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
        scale=scale, atten_mask=atten_mask, pse_shift=pse_shift, q_lengths=None if incremental else q_lengths,
        kv_lengths=kv_lengths, pre_tokens=pre_tokens, next_tokens=next_tokens, sparse_mode=sparse_mode,
        block_table=block_table, block_size=block_size, query_rope=query_rope, key_rope=key_rope,
        incremental=incremental, sink=sink)
    if not softmax_lse:
        return out, query.new_zeros(1, dtype=torch.float32)
    return out, log_sum_exp.float().unsqueeze(-1)  # [B, N, Sq, 1] (TND: [T, N, 1])


_FIA_V2_SCHEMA = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
    "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
    "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, "
    "int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
    "str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, int query_quant_mode=0, int key_quant_mode=0, "
    "int value_quant_mode=0, int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, "
    "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, "
    "int? key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
    "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, "
    "int? out_dtype=None) -> (Tensor, Tensor)")


@fused_op(_FIA_V2_SCHEMA, unfused=_INFER_UNFUSED)
def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                       atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                       block_table=None, dequant_scale_query=None, dequant_scale_key=None,
                                       dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
                                       dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None,
                                       quant_scale_p=None, learnable_sink=None, num_query_heads=1,
                                       num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX,
                                       next_tokens=INT_MAX, input_layout="BSH", sparse_mode=0, block_size=0,
                                       query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
                                       return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None,
                                       query_rope_dtype=None, key_rope_dtype=None, key_shared_prefix_dtype=None,
                                       value_shared_prefix_dtype=None, dequant_scale_query_dtype=None,
                                       dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
                                       dequant_scale_key_rope_dtype=None, out_dtype=None):
    op = "npu_fused_infer_attention_score_v2"
    _refuse(op, dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
            dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
            dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
            quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p,
            query_dtype=query_dtype, key_dtype=key_dtype, value_dtype=value_dtype, query_rope_dtype=query_rope_dtype,
            key_rope_dtype=key_rope_dtype, key_shared_prefix_dtype=key_shared_prefix_dtype,
            value_shared_prefix_dtype=value_shared_prefix_dtype, dequant_scale_query_dtype=dequant_scale_query_dtype,
            dequant_scale_key_dtype=dequant_scale_key_dtype, dequant_scale_value_dtype=dequant_scale_value_dtype,
            dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, out_dtype=out_dtype)
    modes = {"query_quant_mode": query_quant_mode, "key_quant_mode": key_quant_mode,
             "value_quant_mode": value_quant_mode}
    quantized = [f"{name}={mode}" for name, mode in modes.items() if mode]
    if quantized:
        raise NotImplementedError(f"torch_npu.{op}: {', '.join(quantized)} (quantized query/key/value) is not emulated")
    return _fused_infer(op, query, key, value, pse_shift, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                        query_rope, key_rope, learnable_sink, num_query_heads, num_key_value_heads, softmax_scale,
                        pre_tokens, next_tokens, input_layout, sparse_mode, block_size, return_softmax_lse)
