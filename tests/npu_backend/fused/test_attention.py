import copy
import math

import pytest
import torch
import torch_npu

from npukit.npu_backend import _C, numerics
from npukit.npu_backend.fused import attention
from tests.npu_backend.fused.reference import assert_close_to_reference, relative_error

INT_MAX = 2147483647  # the default pre_tockens / next_tockens
CAUSAL_2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # the optimised mask of sparse modes 2/3/4


# ---- the fp64 reference, from the documented formula --------------------------------------------

def attention_fp64(q, k, v, scale, masked=None, pse=None, pse_type=1, sink=None, dropped=None, keep_prob=1.0):
    """softmax(Mask(scale * (q k^T + pse))) @ v per head, in BNSD; key/value head h // (N / Nkv)
    serves query head h; a row with every key masked gives zeros; sink: one more logit per head
    that takes part in the softmax without a value; dropped: the probabilities dropout zeroes."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = (s + pse.double()) * scale if pse_type == 1 else s * scale + pse.double()
    else:
        s = s * scale
    lowest = torch.finfo(torch.float64).min
    if masked is not None:
        s = s.masked_fill(masked, lowest)
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s, -1)
    if sink is not None:
        p = p[..., :-1]
    if masked is not None:
        p = torch.where(masked.all(-1, keepdim=True), 0.0, p)
    if dropped is not None:
        p = p.masked_fill(dropped, 0) / keep_prob
    return p @ v


def softmax_stats_fp64(q, k, scale, masked=None):
    """The row max of the scaled, masked scores and the row sum of exp(scores - max)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    if masked is not None:
        s = s.masked_fill(masked, -math.inf)
    row_max = s.amax(-1, keepdim=True)
    return row_max[..., 0], torch.exp(s - row_max).sum(-1)


def band_mask(sq, skv, pre, nxt, bottom_right=False):
    """True outside pre <= i - j + offset ... : the keys a query row does not see (docs' triu/tril)."""
    offset = skv - sq if bottom_right else 0
    ones = torch.ones(sq, skv, dtype=torch.bool)
    return ones.triu(nxt + 1 + offset) | ones.tril(-pre - 1 + offset)


def to_layout(x_bnsd, layout):
    if layout == "BNSD":
        return x_bnsd
    if layout == "BSND":
        return x_bnsd.transpose(1, 2)
    if layout == "BSH":
        return x_bnsd.transpose(1, 2).flatten(2)
    return x_bnsd.permute(2, 0, 1, 3).flatten(2)  # SBH


def leaves(*tensors, dtype=torch.float32, device="npu"):
    return [t.detach().to(dtype).to(device).contiguous().requires_grad_() for t in tensors]


def grads_fp64(fn, *inputs, grad_output):
    inputs = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, grad_output.double())


def qkv(b=2, n=4, nkv=2, sq=12, skv=20, d=16, dv=16, seed=0):
    torch.manual_seed(seed)
    return torch.randn(b, n, sq, d), torch.randn(b, nkv, skv, d), torch.randn(b, nkv, skv, dv)


# ---- npu_fusion_attention ------------------------------------------------------------------------

def test_fusion_attention_is_one_op_in_torch_ops_npu():
    assert torch_npu.npu_fusion_attention is torch.ops.npu.npu_fusion_attention
    assert torch_npu.npu_fusion_attention_v2 is torch.ops.npu.npu_fusion_attention_v2


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_fusion_attention_layouts_gqa_forward_backward_against_fp64(layout):
    q, k, v = qkv(n=4, nkv=2)
    masked = torch.rand(12, 20) > 0.7
    scale = 0.25
    dy = torch.randn(2, 4, 12, 16)
    ref, (dq_ref, dk_ref, dv_ref) = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, scale, masked), q, k, v,
                                                grad_output=dy)
    qn, kn, vn = leaves(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout))
    out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = torch_npu.npu_fusion_attention(
        qn, kn, vn, 4, layout, atten_mask=masked.npu(), scale=scale)
    assert out.shape == qn.shape and out.dtype == torch.float32 and out.device.type == "npu"
    assert softmax_max.shape == (2, 4, 12, 8) and softmax_sum.dtype == torch.float32
    assert softmax_out.numel() == 0 and (seed, offset, numels) == (0, 0, 2 * 4 * 12 * 20)
    torch.testing.assert_close(out.cpu().double(), to_layout(ref, layout), rtol=1e-5, atol=1e-5)
    max_ref, sum_ref = softmax_stats_fp64(q, k, scale, masked)
    torch.testing.assert_close(softmax_max[..., 3].cpu().double(), max_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(softmax_sum[..., 0].cpu().double(), sum_ref, rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.autograd.grad(out, [qn, kn, vn], to_layout(dy, layout).npu())
    for got, want, name in ((dq, dq_ref, "dq"), (dk, dk_ref, "dk"), (dv, dv_ref, "dv")):
        torch.testing.assert_close(got.cpu().double(), to_layout(want, layout), rtol=1e-4, atol=1e-5, msg=name)


SPARSE_CASES = {
    # sparse_mode: (pre_tockens, next_tockens, Sq, Skv, the keys each query row may not see)
    "0-band": (0, 3, 2, 16, 16, lambda sq, skv: band_mask(sq, skv, 3, 2)),
    "0-causal": (0, INT_MAX, 0, 12, 20, lambda sq, skv: band_mask(sq, skv, INT_MAX, 0)),
    "1-all": (1, 5, 5, 12, 20, None),
    "2-left-up": (2, INT_MAX, INT_MAX, 12, 20, lambda sq, skv: band_mask(sq, skv, INT_MAX, 0)),
    "2-left-up-sq>skv": (2, INT_MAX, INT_MAX, 20, 12, lambda sq, skv: band_mask(sq, skv, INT_MAX, 0)),
    "3-right-down": (3, INT_MAX, INT_MAX, 12, 20, lambda sq, skv: band_mask(sq, skv, INT_MAX, 0, True)),
    "3-right-down-sq>skv": (3, INT_MAX, INT_MAX, 20, 12, lambda sq, skv: band_mask(sq, skv, INT_MAX, 0, True)),
    "4-band": (4, 4, 1, 12, 20, lambda sq, skv: band_mask(sq, skv, 4, 1, True)),
    "4-band-negative-next": (4, 9, -3, 12, 20, lambda sq, skv: band_mask(sq, skv, 9, -3, True)),
}


@pytest.mark.parametrize("query_block_rows", [None, 4], ids=["unblocked", "blocks-of-4-rows"])
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_fusion_attention_sparse_modes_against_fp64(case, query_block_rows, monkeypatch):
    if query_block_rows:  # every mode through the blocked computation too, where its blocks skip keys
        monkeypatch.setattr(attention, "QUERY_BLOCK_ROWS", query_block_rows)
    mode, pre, nxt, sq, skv, make_mask = SPARSE_CASES[case]
    q, k, v = qkv(sq=sq, skv=skv, seed=1)
    if mode == 1:  # allMask: any full mask, pre/next ignored
        masked = torch.rand(2, 1, sq, skv) > 0.6
        op_mask = masked
    else:
        masked = make_mask(sq, skv)
        op_mask = CAUSAL_2048 if mode in (2, 3, 4) else masked
    scale = 0.3
    dy = torch.randn(2, 4, sq, 16)
    ref, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, scale, masked), q, k, v, grad_output=dy)
    qn, kn, vn = leaves(q, k, v)
    out = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "BNSD", atten_mask=op_mask.npu(), scale=scale,
                                         pre_tockens=pre, next_tockens=nxt, sparse_mode=mode)[0]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out, [qn, kn, vn], dy.npu()), grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)


def test_fusion_attention_without_mask_computes_everything_whatever_the_sparse_mode():
    q, k, v = qkv()
    full = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3)[0]
    for mode, pre, nxt in ((2, INT_MAX, INT_MAX), (3, INT_MAX, INT_MAX), (4, 1, 1), (0, 1, 0)):
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3, sparse_mode=mode, pre_tockens=pre,
                                             next_tockens=nxt)[0]
        torch.testing.assert_close(out, full)
    torch.testing.assert_close(full.double(), attention_fp64(q, k, v, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pse_shape", [(2, 4, 12, 20), (1, 4, 12, 20), (2, 4, 1, 20)])
def test_fusion_attention_pse_and_its_gradient(pse_shape):
    q, k, v = qkv()
    pse = torch.randn(pse_shape)
    masked = band_mask(12, 20, INT_MAX, 0)
    scale = 0.3
    dy = torch.randn(2, 4, 12, 16)
    ref, grads_ref = grads_fp64(lambda a, b, c, p: attention_fp64(a, b, c, scale, masked, pse=p), q, k, v, pse,
                                grad_output=dy)
    qn, kn, vn, pn = leaves(q, k, v, pse)
    out = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "BNSD", pse=pn, atten_mask=masked.npu(), scale=scale)[0]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out, [qn, kn, vn, pn], dy.npu())
    assert grads[3].shape == pse_shape
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)


def test_fusion_attention_sink_takes_part_in_the_softmax():
    q, k, v = qkv(n=4, nkv=4, sq=10, skv=10)
    sink = torch.linspace(-0.5, 1.5, 4)
    dy = torch.randn(2, 4, 10, 16)
    masked = band_mask(10, 10, INT_MAX, 0)
    ref, grads_ref = grads_fp64(lambda a, b, c, s: attention_fp64(a, b, c, 0.25, masked, sink=s), q, k, v, sink,
                                grad_output=dy)
    qn, kn, vn, sn = leaves(q, k, v, sink)
    out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "BNSD", scale=0.25,
                                                                   atten_mask=masked.npu(), sink=sn)[:3]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    # m = max(sink, max(S)), sum = sum(exp(S - m)) + exp(sink - m) (the v2 docs' formula)
    s = (q.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(masked, -math.inf)
    m = torch.maximum(s.amax(-1), sink.double().view(1, 4, 1))
    total = torch.exp(s - m[..., None]).sum(-1) + torch.exp(sink.double().view(1, 4, 1) - m)
    torch.testing.assert_close(softmax_max[..., 0].cpu().double(), m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(softmax_sum[..., 0].cpu().double(), total, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, [qn, kn, vn, sn], dy.npu()), grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)


def test_fusion_attention_dropout_keeps_the_documented_fraction_and_scales_by_keep_prob():
    """With v = I the output is the dropped probability matrix itself."""
    torch.manual_seed(3)
    b, n, s = 2, 2, 64
    q, k = torch.randn(b, n, s, 16), torch.randn(b, n, s, 16)
    v = torch.eye(s).expand(b, n, s, s).contiguous()
    keep_prob = 0.8
    out, *_, seed, offset, numels = torch_npu.npu_fusion_attention(q.npu(), k.npu(), v.npu(), n, "BNSD", scale=0.25,
                                                                   keep_prob=keep_prob)
    assert numels == b * n * s * s and (seed, offset) != (0, 0)
    p = attention_fp64(q, k, torch.eye(s).expand(b, n, s, s), 0.25)
    out = out.cpu().double()
    kept = out != 0
    assert abs(kept.double().mean().item() - keep_prob) < 0.02
    torch.testing.assert_close(out[kept], (p / keep_prob)[kept], rtol=1e-5, atol=1e-7)
    # the same seed and offset give the same mask; a new call draws a new one
    again = torch_npu.npu_fusion_attention(q.npu(), k.npu(), v.npu(), n, "BNSD", scale=0.25, keep_prob=keep_prob,
                                           seed=seed, offset=offset)[0]
    torch.testing.assert_close(again.cpu().double(), out)
    fresh = torch_npu.npu_fusion_attention(q.npu(), k.npu(), v.npu(), n, "BNSD", scale=0.25, keep_prob=keep_prob)
    assert fresh[5] != offset and not torch.equal(fresh[0].cpu().double(), out)


def test_fusion_attention_dropout_backward_regenerates_the_forward_mask():
    """gradcheck in fp64: the grad op's mask is the forward's (from the returned seed and offset)."""
    q, k, v = (t.double().requires_grad_() for t in qkv(b=1, n=2, nkv=1, sq=5, skv=6, d=4, dv=4))
    mask = band_mask(5, 6, INT_MAX, 1)

    def fn(a, b, c):
        return torch_npu.npu_fusion_attention(a, b, c, 2, "BNSD", atten_mask=mask, scale=0.5, keep_prob=0.6,
                                              seed=1234, offset=77)[0]
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)
    torch.manual_seed(5)
    first = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, keep_prob=0.6)
    torch.manual_seed(5)
    second = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, keep_prob=0.6)
    assert first[4:6] == second[4:6]  # a seeded run reproduces its masks
    torch.testing.assert_close(first[0], second[0])


def cumulative(lengths):
    return [sum(lengths[:i + 1]) for i in range(len(lengths))]


TND_LENGTHS = {
    # similar lengths: computed as one zero-padded batch of the sequences
    "padded": ([3, 7, 1, 5], [5, 7, 4, 9]),
    # one long sequence among short ones: buckets of similar sequences, each padded to its own longest
    "bucketed": ([12, 1, 2, 1, 1], [12, 3, 2, 1, 4]),
}


def tnd_buckets(q_lens, kv_lens) -> int:
    """How many buckets of similar sequences a TND call of these lengths is computed in."""
    varlen = attention._varlen("op", cumulative(q_lens), cumulative(kv_lens), sum(q_lens), sum(kv_lens))
    return len(attention._varlen_buckets(varlen))


@pytest.fixture
def small_buckets(monkeypatch):
    """Buckets for sequences of a few tokens too (a bucket's own cost otherwise outweighs their padding)."""
    monkeypatch.setattr(attention, "BUCKET_OVERHEAD_SCORES", 100)


@pytest.mark.parametrize("lengths", list(TND_LENGTHS))
@pytest.mark.parametrize("sparse_mode", ["none", "0-mask", 2, 3])
def test_fusion_attention_tnd_varlen_equals_each_sequence_alone(sparse_mode, lengths, small_buckets):
    torch.manual_seed(4)
    q_lens, kv_lens = TND_LENGTHS[lengths]
    assert (tnd_buckets(q_lens, kv_lens) > 1) == (lengths == "bucketed")
    n, nkv, d = 4, 2, 8
    q = torch.randn(sum(q_lens), n, d)
    k, v = torch.randn(sum(kv_lens), nkv, d), torch.randn(sum(kv_lens), nkv, d)
    dy = torch.randn(sum(q_lens), n, d)
    if sparse_mode == "0-mask":  # [maxSq, maxSkv], read in each sequence's coordinates
        mask, mode = torch.rand(max(q_lens), max(kv_lens)) > 0.7, 0
        mask[:, 0] = False
    else:
        mask, mode = (None, 0) if sparse_mode == "none" else (CAUSAL_2048, sparse_mode)
    qn, kn, vn = leaves(q, k, v)
    out, softmax_max = torch_npu.npu_fusion_attention(
        qn, kn, vn, n, "TND", atten_mask=None if mask is None else mask.npu(), scale=0.3, sparse_mode=mode,
        actual_seq_qlen=cumulative(q_lens), actual_seq_kvlen=cumulative(kv_lens))[:2]
    assert out.shape == (sum(q_lens), n, d) and softmax_max.shape == (sum(q_lens), n, 8)
    # trailing zeros: sequences that take no part (the docs' [2, 5, 9, 0, 0])
    trailing = torch_npu.npu_fusion_attention(
        qn, kn, vn, n, "TND", atten_mask=None if mask is None else mask.npu(), scale=0.3, sparse_mode=mode,
        actual_seq_qlen=cumulative(q_lens) + [0, 0], actual_seq_kvlen=cumulative(kv_lens) + [0, 0])[0]
    torch.testing.assert_close(trailing, out)
    dq, dk, dv = torch.autograd.grad(out, [qn, kn, vn], dy.npu())
    qs, ks, vs, dys = q.split(q_lens), k.split(kv_lens), v.split(kv_lens), dy.split(q_lens)
    for i in range(len(q_lens)):
        # sequence i alone, BSND with B = 1, its own sparse mode's mask in its own coordinates
        a, b, c = (t.unsqueeze(0).contiguous().requires_grad_() for t in (qs[i], ks[i], vs[i]))
        own_mask = mask if mode or mask is None else mask[:q_lens[i], :kv_lens[i]]
        alone, alone_max = torch_npu.npu_fusion_attention(a, b, c, n, "BSND", atten_mask=own_mask, scale=0.3,
                                                          sparse_mode=mode)[:2]
        grads = torch.autograd.grad(alone, [a, b, c], dys[i].unsqueeze(0))
        torch.testing.assert_close(out.cpu().split(q_lens)[i], alone[0].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(softmax_max.cpu().split(q_lens)[i], alone_max[0].transpose(0, 1))
        for got, want, lens in zip((dq, dk, dv), grads, (q_lens, kv_lens, kv_lens)):
            torch.testing.assert_close(got.cpu().split(lens)[i], want[0], rtol=1e-4, atol=1e-5)


def test_fusion_attention_tnd_split_sequence_modes_7_and_8(small_buckets):
    """Mode 7: rightDownCausal but the last sequence a bottom-right band; mode 8: leftUpCausal but
    the first sequence a band (the docs' examples of a sequence split across devices)."""
    torch.manual_seed(6)
    n, d = 2, 8
    cases = ((7, [3, 2], [3, 6], 6, -2), (8, [3, 5, 4], [4, 5, 4], 4, 1),  # one padded batch
             (7, [1, 1, 9, 2], [2, 1, 9, 6], 6, -2), (8, [3, 9, 1, 1], [4, 9, 2, 1], 4, 1))  # buckets
    for mode, q_lens, kv_lens, pre, nxt in cases:
        q = torch.randn(sum(q_lens), n, d)
        k, v = torch.randn(sum(kv_lens), n, d), torch.randn(sum(kv_lens), n, d)
        out = torch_npu.npu_fusion_attention(q, k, v, n, "TND", atten_mask=CAUSAL_2048, scale=0.4, sparse_mode=mode,
                                             pre_tockens=pre, next_tockens=nxt, actual_seq_qlen=cumulative(q_lens),
                                             actual_seq_kvlen=cumulative(kv_lens))[0]
        special = len(q_lens) - 1 if mode == 7 else 0
        for i, (qs, ks, vs) in enumerate(zip(q.split(q_lens), k.split(kv_lens), v.split(kv_lens))):
            sq, skv = q_lens[i], kv_lens[i]
            if i == special:
                masked = band_mask(sq, skv, pre, nxt, bottom_right=True)
            else:
                masked = band_mask(sq, skv, INT_MAX, 0, bottom_right=mode == 7)
            want = attention_fp64(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], 0.4,
                                  masked)[0].transpose(0, 1)
            torch.testing.assert_close(out.split(q_lens)[i].double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fusion_attention_tnd_one_long_among_many_short_costs_what_its_sequences_need():
    """1 sequence of 2048 tokens and 30 of 64 (causal): each sequence's outputs and gradients are
    its own BNSD call's, and the peak memory is a few times the scores the sequences need, not the
    scores of a batch padded to 2048 (31 x 2048^2) or of all tokens as one sequence (3968^2)."""
    torch.manual_seed(8)
    lens, n, d = [64] * 15 + [2048] + [64] * 15, 2, 64
    assert tnd_buckets(lens, lens) == 2
    q, k, v, dy = (torch.randn(sum(lens), n, d) for _ in range(4))
    qn, kn, vn = leaves(q, k, v)
    mask = CAUSAL_2048.npu()
    torch.npu.synchronize()
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_allocated()
    out, softmax_max = torch_npu.npu_fusion_attention(qn, kn, vn, n, "TND", atten_mask=mask, scale=0.125,
                                                      sparse_mode=3, actual_seq_qlen=cumulative(lens),
                                                      actual_seq_kvlen=cumulative(lens))[:2]
    grads = torch.autograd.grad(out, [qn, kn, vn], dy.npu())
    peak = torch.npu.max_memory_allocated() - before
    scores_needed = sum(length * length for length in lens) * n * 4  # fp32
    assert peak < 5 * scores_needed, (peak, scores_needed)
    for i, (qs, ks, vs, dys) in enumerate(zip(*(t.split(lens) for t in (q, k, v, dy)))):
        a, b, c = (t.transpose(0, 1)[None].contiguous().npu().requires_grad_() for t in (qs, ks, vs))
        alone, alone_max = torch_npu.npu_fusion_attention(a, b, c, n, "BNSD", atten_mask=mask, scale=0.125,
                                                          sparse_mode=3)[:2]
        alone_grads = torch.autograd.grad(alone, [a, b, c], dys.transpose(0, 1)[None].npu())
        torch.testing.assert_close(out.split(lens)[i], alone[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(softmax_max.split(lens)[i], alone_max[0].transpose(0, 1))
        for got, want in zip(grads, alone_grads):
            torch.testing.assert_close(got.split(lens)[i], want[0].transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_fusion_attention_tnd_buckets_dropout_backward_regenerates_the_forward_mask(small_buckets):
    """gradcheck in fp64 of a TND call computed in buckets: each bucket's grad regenerates its
    forward's dropout mask."""
    q_lens, kv_lens = [7, 1, 2, 1], [7, 2, 1, 3]
    assert tnd_buckets(q_lens, kv_lens) > 1
    torch.manual_seed(9)
    q = torch.randn(sum(q_lens), 1, 2, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(kv_lens), 1, 2, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def fn(a, b, c, keep_prob=0.7):
        return torch_npu.npu_fusion_attention(a, b, c, 1, "TND", scale=0.5, keep_prob=keep_prob, seed=4321, offset=5,
                                              actual_seq_qlen=cumulative(q_lens),
                                              actual_seq_kvlen=cumulative(kv_lens))[0]
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)
    assert not torch.allclose(fn(q, k, v), fn(q, k, v, keep_prob=1.0))  # some probabilities were dropped


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fusion_attention_low_precision_against_fp64_and_the_kernels_accumulation(dtype):
    q, k, v = (t.to(dtype) for t in qkv(sq=32, skv=48, d=32, dv=32, seed=7))
    masked = band_mask(32, 48, INT_MAX, 0, bottom_right=True)
    dy = torch.randn(2, 4, 32, 32).to(dtype)
    ref, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, 0.2, masked), q, k, v, grad_output=dy)
    qn, kn, vn = leaves(q, k, v, dtype=dtype)
    out = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "BNSD", atten_mask=CAUSAL_2048.npu(), scale=0.2,
                                         sparse_mode=3)[0]
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, "attention_out")
    for got, want, name in zip(torch.autograd.grad(out, [qn, kn, vn], dy.npu()), grads_ref, ("dq", "dk", "dv")):
        assert got.dtype == dtype
        assert_close_to_reference(got, want, dtype, name, factor=3)
    # The kernel's accumulation: fp32 scores, exp(S - max) unnormalised and rounded to the input dtype
    # for the P @ V matmul (fp32 accumulation), that divided by the row sum, one rounding of the output.
    s = (q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2) * 0.2).masked_fill(masked, -math.inf)
    p = (s - s.amax(-1, keepdim=True)).exp()
    kernel = ((p.to(dtype).float() @ v.float().repeat_interleave(2, 1)) / p.sum(-1, keepdim=True)).to(dtype)
    assert relative_error(out, kernel) < relative_error(kernel, ref) * 0.05 + 1e-6


def test_fusion_attention_fp16_gradients_within_flash_attentions_tolerance_of_fp32():
    """fp16 causal attention of uniform [0, 1) inputs: the gradients within 1e-3 of the fp32 ones, as
    code written for Ascend checks them. The normalised probabilities rounded to fp16 (rather than
    exp(S - max), divided after P @ V) skewed the output by their sum's rounding, and the backward's
    rowsum(dO * O) turned that into dq errors past 1e-3 in rows of two keys."""
    torch.manual_seed(0)
    q, k, v = (torch.rand(8, 32, 32, 64).half() for _ in range(3))  # BNSD
    masked = torch.ones(32, 32, dtype=torch.bool).triu(1)
    _, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, 0.125, masked), q, k, v,
                              grad_output=torch.ones(8, 32, 32, 64, dtype=torch.float64))
    qn, kn, vn = leaves(q, k, v, dtype=torch.float16)
    out = torch_npu.npu_fusion_attention(qn, kn, vn, 32, "BNSD", atten_mask=masked.npu(), scale=0.125)[0]
    for got, want, name in zip(torch.autograd.grad(out, [qn, kn, vn], torch.ones_like(out)), grads_ref,
                               ("dq", "dk", "dv")):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode, pre, nxt", [(2, INT_MAX, 0), (4, 48, 0)], ids=["causal", "band"])
def test_fusion_attention_query_blocks_skip_the_masked_keys_and_keep_the_softmax(dtype, mode, pre, nxt, monkeypatch):
    """Under a causal or band mask the kernel computes blocks of QUERY_BLOCK_ROWS query rows over the keys
    they see (_query_blocks), each block holding all its rows' keys: softmax_max is the unblocked one value
    for value, softmax_sum, the output and the gradients the unblocked ones to fp32 summation order, and
    all within the fp64 reference's tolerances."""
    seen_blocks = []

    def query_blocks(problem):
        seen_blocks.append(blocks := unspied(problem))
        return blocks
    unspied = attention._query_blocks
    monkeypatch.setattr(attention, "_query_blocks", query_blocks)
    monkeypatch.setattr(attention, "BF16_AMX", False)  # fp16: the Python path, not the one-kernel one
    q, k, v = (t.to(dtype) for t in qkv(b=1, n=2, nkv=1, sq=256, skv=256, seed=11))
    dy = torch.randn(1, 2, 256, 16).to(dtype)
    masked = band_mask(256, 256, pre, nxt, bottom_right=True)
    ref, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, 0.25, masked), q, k, v, grad_output=dy)
    results = {}
    for block_rows in (attention.QUERY_BLOCK_ROWS, 1 << 30):  # blocked, then one block of every row
        monkeypatch.setattr(attention, "QUERY_BLOCK_ROWS", block_rows)
        seen_blocks.clear()
        qn, kn, vn = leaves(q, k, v, dtype=dtype)
        out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(
            qn, kn, vn, 2, "BNSD", atten_mask=CAUSAL_2048.npu(), scale=0.25, sparse_mode=mode, pre_tockens=pre,
            next_tockens=nxt)[:3]
        grads = torch.autograd.grad(out, [qn, kn, vn], dy.npu())
        assert len(seen_blocks) == 2 and all((blocks is not None) == (block_rows < 256) for blocks in seen_blocks)
        results[block_rows] = [t.cpu().double() for t in (out, softmax_max, softmax_sum, *grads)]
    blocked, unblocked = results.values()
    assert torch.equal(blocked[1], unblocked[1])
    rtol = 1e-5 if dtype == torch.float32 else 1e-3  # fp16: a result 1 ulp the other side of a rounding
    for got, want, name in zip(blocked[2:], unblocked[2:], ("softmax_sum", "attention_out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=lambda m, name=name: f"{name}: {m}")
    for got, want, name in zip([blocked[0], *blocked[3:]], [ref, *grads_ref], ("attention_out", "dq", "dk", "dv")):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert_close_to_reference(got, want, dtype, name, factor=1 if name == "attention_out" else 3)


# ---- the matmuls on AVX512-BF16: exact products of bf16 values summed in fp32 ----------------------

needs_bf16_dot = pytest.mark.skipif(not attention.BF16_DOT_PRODUCT, reason="the CPU has no AVX512-BF16")
# where the products run: vdpbf16ps, and the AMX tiles (oneDNN's brgemm) where the CPU has them (the default)
ENGINES = [pytest.param(False, id="vdpbf16ps"),
           pytest.param(True, id="amx", marks=pytest.mark.skipif(not (attention.BF16_DOT_PRODUCT and _C.has_amx_bf16()),
                                                                 reason="the CPU has no AMX"))]


def matmul_operands(batches, m, k, n, layout, a_dtype):
    """a [batches, m, k] (a_dtype) and bf16 b [batches, k, n] on npu: contiguous, transposed views, or
    every other (third) element of a wider tensor."""
    if layout == "transposed":
        return (torch.randn(batches, k, m, device="npu").to(a_dtype).transpose(1, 2),
                torch.randn(batches, n, k, device="npu").bfloat16().transpose(1, 2))
    if layout == "strided":
        return (torch.randn(batches, m, 2 * k, device="npu").to(a_dtype)[..., ::2],
                torch.randn(batches, 3 * k, n, device="npu").bfloat16()[:, ::3])
    return torch.randn(batches, m, k, device="npu").to(a_dtype), torch.randn(batches, k, n, device="npu").bfloat16()


def fp32_sum_bound(a, b, alpha, bias=None):
    """How far an fp32 sum of the K exact products, scaled and added to the bias (each step rounded),
    can be from the exact value: (K + 2) units of 2^-24 of the magnitudes summed."""
    magnitude = (a.cpu().double().abs() @ b.cpu().double().abs()) * abs(alpha)
    if bias is not None:
        magnitude = magnitude + bias.cpu().double().abs()
    return (a.shape[2] + 2) * 2.0 ** -24 * magnitude


@needs_bf16_dot
@pytest.mark.parametrize("batches, m, k, n", [(1, 1, 1, 1), (1, 37, 63, 45), (3, 8, 2, 32), (2, 17, 129, 33),
                                              (1, 9, 5, 600), (2, 3, 0, 5), (4, 64, 64, 64)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("a_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on_amx", ENGINES)
def test_bf16_matmul_equals_fp64_of_the_bf16_inputs_within_fp32_accumulation(batches, m, k, n, layout, a_dtype,
                                                                               on_amx):
    torch.manual_seed(batches * 1000 + m + k + n)
    a, b = matmul_operands(batches, m, k, n, layout, a_dtype)
    a_bf16 = a.bfloat16()  # an fp32 a is multiplied as its bf16 rounding
    exact = a_bf16.cpu().double() @ b.cpu().double()
    for alpha, bias in ((1.0, None), (0.125, torch.randn(1, m, n, device="npu")),
                        (0.3, torch.randn(batches, n, m, device="npu").transpose(1, 2))):
        got = _C.bf16_matmul(a, b, alpha, bias, on_amx=on_amx)
        assert got.dtype == torch.float32 and got.device.type == "npu" and got.shape == (batches, m, n)
        want = alpha * exact + (0 if bias is None else bias.cpu().double())
        error = (got.cpu().double() - want).abs()
        assert bool((error <= fp32_sum_bound(a_bf16, b, alpha, bias)).all()), f"alpha={alpha}: max error {error.max()}"
        # a bf16 result: the fp32 one rounded once
        assert torch.equal(_C.bf16_matmul(a, b, alpha, bias, out_dtype=torch.bfloat16, on_amx=on_amx).cpu(),
                           got.bfloat16().cpu())
    if k >= 8:  # more accurate than the CPU's bf16 matmul, which rounds the sum to bf16
        rounded = (torch.bmm(a_bf16, b).cpu().double() - exact).abs().max()
        assert (_C.bf16_matmul(a, b, on_amx=on_amx).cpu().double() - exact).abs().max() < rounded / 100


@needs_bf16_dot
@pytest.mark.skipif(attention.BF16_DOT_PRODUCT and _C.has_amx_bf16(), reason="the CPU has AMX")
def test_bf16_matmul_refuses_amx_on_a_cpu_without_it():
    a, b = matmul_operands(1, 4, 4, 4, "contiguous", torch.bfloat16)
    with pytest.raises(RuntimeError, match="on_amx on a CPU without AMX"):
        _C.bf16_matmul(a, b, on_amx=True)


@needs_bf16_dot
@pytest.mark.parametrize("on_amx", ENGINES)
def test_bf16_matmul_skips_what_masking_makes_known_and_computes_the_rest(on_amx, monkeypatch):
    """Masked scores are the masked score itself (tiles masked throughout are not computed), so a
    non-finite key where it is masked does not reach them; the rows' zeros past the causal band are not
    multiplied either. With the rows' log-sum-exp the result is the probabilities, 0 where masked, and
    with the probabilities too, dS."""
    kernel = _C.bf16_matmul
    monkeypatch.setattr(_C, "bf16_matmul", lambda *args, **kwargs: kernel(*args, **kwargs, on_amx=on_amx))
    torch.manual_seed(3)
    m, n, masked_score = 40, 70, attention.MASKED_SCORE
    a, b = matmul_operands(2, m, 16, n, "contiguous", torch.bfloat16)
    b[:, :, 69] = float("inf")  # column 69: masked in every row; column 35: from row 35 on, not
    b[:, :, 35] = float("nan")
    masked = torch.ones(m, n, dtype=torch.bool).triu(1)
    bias = torch.where(masked, masked_score, torch.randn(m, n)).unsqueeze(0).npu()
    got = _C.bf16_matmul(a, b, 0.5, bias, masked_score).cpu()
    assert bool((got[:, masked] == torch.tensor(masked_score, dtype=torch.float32)).all())
    assert bool(got[:, 35:, 35].isnan().all()) and bool(got[:, :, :35].tril().isfinite().all())
    want = 0.5 * (a.cpu().double() @ b.cpu().double()) + bias.cpu().double()
    computed = ~masked & want.isfinite()
    error = (got.double() - want).abs()[computed]
    assert bool((error <= fp32_sum_bound(a, b, 0.5, bias)[computed]).all())
    log_sum_exp = torch.randn(2, m, 1, device="npu")
    probabilities = _C.bf16_matmul(a, b, 0.5, bias, masked_score, log_sum_exp).cpu()
    finite = got.isfinite()
    expected = (got - log_sum_exp.cpu()).clamp(-87, 0).exp().masked_fill(masked, 0)
    torch.testing.assert_close(probabilities[finite], expected[finite], rtol=1e-6, atol=0)
    assert bool((probabilities[:, masked] == 0).all())
    # dS = P * (dP - the rows' sum of P dP), 0 where P is 0 throughout a tile (an inf dP there included)
    dy, v = matmul_operands(2, m, 16, n, "contiguous", torch.bfloat16)
    v[:, :, 69] = float("inf")
    row_dot = torch.randn(2, m, 1, device="npu")
    dp = _C.bf16_matmul(dy, v).cpu()
    ds = _C.bf16_matmul(dy, v, row_offset=row_dot, probabilities=probabilities.npu()).cpu()
    reached = dp.isfinite() & probabilities.isfinite()
    assert torch.equal(ds[reached], (probabilities * (dp - row_dot.cpu()))[reached])
    assert bool((ds[:, :, 64:] == 0).all())  # columns 64-69 are masked in every row
    # causal probabilities: an inf value where a row's probabilities are 0 (past its band) is not multiplied
    p = torch.rand(2, m, m, device="npu").tril()
    v = torch.randn(2, m, 24, device="npu").bfloat16()
    v[:, -1] = float("inf")  # only the last row of p reaches the last key
    out = _C.bf16_matmul(p, v).cpu()
    assert bool(out[:, :-8].isfinite().all())  # the rows of blocks before the last (8 rows; 32 on AMX)
    v_reached = v.clone()
    v_reached[:, -1] = 0  # what those rows' sums are: their products with the last key are 0 x inf
    exact = p.bfloat16().cpu().double() @ v_reached.cpu().double()
    error = (out.double() - exact).abs()[:, :-8]
    assert bool((error <= fp32_sum_bound(p.bfloat16(), v_reached, 1.0)[:, :-8]).all())


@needs_bf16_dot
def test_fusion_attention_bf16_matmuls_on_avx512_bf16_equal_the_cpus_gemms(monkeypatch):
    """With AVX512-BF16 the seven matmuls of forward and backward multiply the bf16 values exactly and
    sum in fp32, the scores and dP kept in fp32 where fp32 copies were multiplied before, the others
    rounded once to bf16 as the CPU's bf16 GEMM: forward and gradients equal the fp32/bf16 GEMMs' but
    for the order of the sums (a few bf16 roundings), and match fp64."""
    torch.manual_seed(21)
    b, n, s, d = 2, 4, 80, 64
    q, k, v, dy = (torch.randn(b, n, s, d).bfloat16() for _ in range(4))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    calls = []
    kernel = _C.bf16_matmul
    monkeypatch.setattr(_C, "bf16_matmul", lambda *args: calls.append(args[0].shape) or kernel(*args))
    monkeypatch.setattr(attention, "BF16_AMX", False)  # the matmuls one by one (see the one-kernel test below)
    results = {}
    for bf16_dot in (True, False):
        monkeypatch.setattr(attention, "BF16_DOT_PRODUCT", bf16_dot)
        qn, kn, vn = leaves(q, k, v, dtype=torch.bfloat16)
        out = torch_npu.npu_fusion_attention(qn, kn, vn, n, "BNSD", atten_mask=mask.npu(), scale=d ** -0.5)[0]
        results[bf16_dot] = [out, *torch.autograd.grad(out, [qn, kn, vn], dy.npu())]
    assert len(calls) == 7  # scores, P @ V; the scores again, dV, dP, dQ, dK
    ref, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, d ** -0.5, mask), q, k, v, grad_output=dy)
    for got, cpu_gemms, want, name in zip(results[True], results[False], [ref, *grads_ref],
                                          ("attention_out", "dq", "dk", "dv")):
        assert got.dtype == torch.bfloat16
        assert relative_error(got, cpu_gemms) < relative_error(cpu_gemms, want) * 0.1, name
        assert_close_to_reference(got, want, torch.bfloat16, name, factor=1 if name == "attention_out" else 3)


@pytest.mark.skipif(not attention.BF16_AMX, reason="the CPU has no AMX for bf16")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["causal", "bottom_right_uneven", "pse_per_head", "no_mask"])
def test_fusion_attention_one_kernel_on_amx_equals_the_ops_one_by_one(case, dtype, monkeypatch):
    """On AMX the bf16 and fp16 forward and gradients each run as one kernel (_C.attention_forward and
    _backward: a block of query rows' scores, probabilities and dS stay in its buffer): the numerics of the ops
    one by one (bf16: the seven matmuls; fp16: fp32 matmuls, P and dS rounded to fp16) -- the softmax's max
    value for value in bf16, the rest to the order of fp32 sums -- and within the fp64
    reference's tolerance. GQA, sequences that are not multiples of the kernel's 32-row and 32-key blocks, a
    bias per batch and head (pse: the forward only), and no mask."""
    sq, skv = {"causal": (128, 128), "bottom_right_uneven": (45, 83)}.get(case, (70, 70))
    q, k, v = (t.to(dtype) for t in qkv(b=2, n=4, nkv=2, sq=sq, skv=skv, d=32, dv=64, seed=3))
    dy = torch.randn(2, 4, sq, 64).to(dtype)
    masked = band_mask(sq, skv, INT_MAX, 0, bottom_right=True) if case in ("causal", "bottom_right_uneven") else None
    pse = torch.randn(2, 4, sq, skv).to(dtype) if case == "pse_per_head" else None
    kwargs = {"causal": dict(atten_mask=CAUSAL_2048.npu(), sparse_mode=2),
              "bottom_right_uneven": dict(atten_mask=CAUSAL_2048.npu(), sparse_mode=3),
              "pse_per_head": dict(pse=pse.npu() if pse is not None else None)}.get(case, {})
    kernels = {"attention_forward": 0, "attention_backward": 0}
    for name in kernels:
        unspied = getattr(_C, name)
        monkeypatch.setattr(_C, name, lambda *args, name=name, unspied=unspied: kernels.__setitem__(name, kernels[name] + 1)
                            or unspied(*args))
    results = {}
    for amx in (True, False):
        monkeypatch.setattr(attention, "BF16_AMX", amx)
        qn, kn, vn = leaves(q, k, v, dtype=dtype)
        out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "BNSD", scale=0.3, **kwargs)[:3]
        results[amx] = [t.cpu() for t in (softmax_max, softmax_sum, out, *torch.autograd.grad(out, [qn, kn, vn], dy.npu()))]
    # with pse the grad op returns dpse, i.e. dS, which the one-kernel backward keeps in its buffers
    assert kernels == {"attention_forward": 1, "attention_backward": 0 if case == "pse_per_head" else 1}
    (one_kernel_max, one_kernel_sum, *one_kernel), (max_one_by_one, sum_one_by_one, *one_by_one) = results.values()
    if dtype == torch.bfloat16:  # the same AMX sums of the scores
        assert torch.equal(one_kernel_max, max_one_by_one)
    else:  # brgemm's fp32 sums of the scores against the fp32 bmm's: another order
        torch.testing.assert_close(one_kernel_max, max_one_by_one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one_kernel_sum, sum_one_by_one, rtol=1e-5, atol=0)
    ref, grads_ref = grads_fp64(lambda a, b, c: attention_fp64(a, b, c, 0.3, masked, pse=pse), q, k, v, grad_output=dy)
    # fp16: a sum in another order can turn dS's rounding to fp16 the other way, which dQ and dK then carry
    share = 0.1 if dtype == torch.bfloat16 else 0.25
    for got, want_one_by_one, want, name in zip(one_kernel, one_by_one, [ref, *grads_ref], ("attention_out", "dq", "dk", "dv")):
        assert got.dtype == dtype
        assert relative_error(got, want_one_by_one) < relative_error(want_one_by_one, want) * share, name
        assert_close_to_reference(got, want, dtype, name, factor=1 if name == "attention_out" else 3)


@pytest.mark.skipif(not attention.BF16_AMX, reason="the CPU has no AMX for bf16")
def test_fusion_attention_fp16_one_kernel_saturates_ds_as_the_ops_one_by_one(monkeypatch):
    """A dS past fp16's range: the one-kernel backward saturates it in the device's saturation mode and raises
    the overflow flag, as the ops one by one (_C.round_to_half) do: the same gradients."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 40, 16).half() for _ in range(3))
    dy = (torch.randn(1, 2, 40, 16) * 3e4).clamp(-6e4, 6e4).half()  # finite, but dS = P * (dP - rowsum) is not
    results = []
    with numerics.policies(fp16_mode="saturation"):
        for amx in (True, False):
            monkeypatch.setattr(attention, "BF16_AMX", amx)
            numerics.clear_overflow_flag()
            qn, kn, vn = leaves(q, k, v, dtype=torch.float16)
            out = torch_npu.npu_fusion_attention(qn, kn, vn, 2, "BNSD", atten_mask=CAUSAL_2048[:40, :40].npu(),
                                                 scale=4.0)[0]
            results.append([t.cpu() for t in torch.autograd.grad(out, [qn, kn, vn], dy.npu())])
            assert numerics.overflow_flag(), f"amx={amx}"
        numerics.clear_overflow_flag()
    for got, want, name in zip(*results, ("dq", "dk", "dv")):
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-3, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("in_place", [True, False])
def test_round_to_half_is_the_fp16_round_trip_in_one_pass(in_place):
    torch.manual_seed(4)
    x = torch.randn(3, 37, 41, device="npu") * 10.0 ** torch.randint(-9, 6, (3, 37, 41), device="npu")
    x[0, 0, :4] = torch.tensor([65520.0, -1e6, float("inf"), float("nan")])  # 65520 rounds to inf in fp16
    want = x.cpu().half().float()
    out = None if in_place else torch.empty_like(x)
    before = x.cpu().clone()
    got = _C.round_to_half(x, out)
    assert (got.data_ptr() == x.data_ptr()) == in_place
    assert torch.equal(got.cpu().nan_to_num(), want.nan_to_num()) and bool(got.cpu()[0, 0, 3].isnan())
    assert torch.equal(x.cpu().nan_to_num(), (want if in_place else before).nan_to_num())
    # saturation mode: what the rounding makes non-finite saturates (a nan becomes 0), as fp16 results do
    x = torch.tensor([65520.0, -1e6, 1.0 / 3.0, float("nan")], device="npu")
    with numerics.policies(fp16_mode="saturation"):
        numerics.clear_overflow_flag()
        assert _C.round_to_half(x).cpu().tolist() == [65504.0, -65504.0, float(torch.tensor(1 / 3).half()), 0.0]
        assert numerics.overflow_flag()
        numerics.clear_overflow_flag()
        assert _C.round_to_half(torch.ones(4, device="npu")).cpu().tolist() == [1.0] * 4
        assert not numerics.overflow_flag()


def test_exp_rows_is_the_unnormalised_softmax_with_its_max_and_sum():
    """exp(s - the row's max) in place, 0 below exp(-87) (the masked scores), and the rows' max and sum."""
    torch.manual_seed(6)
    s = torch.randn(3, 5, 37, device="npu") * 20
    s[0, 0, 3:] = attention.MASKED_SCORE
    s[1, 2, :] = attention.MASKED_SCORE  # a row with every key masked: all exp(0)
    exact = s.cpu().double()
    shifted = (s.cpu() - s.cpu().amax(-1, keepdim=True)).double()  # s - max rounded to fp32, as the kernel does
    row_max, row_sum = _C.exp_rows(s)
    want = torch.where(shifted < -87, 0.0, shifted.exp())
    torch.testing.assert_close(s.cpu().double(), want, rtol=2.5e-7, atol=0)  # the exp within 2 units of fp32
    assert bool((s.cpu()[0, 0, 3:] == 0).all()) and bool((s.cpu()[1, 2] == 1).all())
    assert torch.equal(row_max.cpu(), exact.amax(-1, keepdim=True).float())
    torch.testing.assert_close(row_sum.cpu().double(), want.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    assert row_max.device.type == "npu" and row_sum.shape == (3, 5, 1)


@pytest.mark.parametrize("keep_prob", [1.0, 0.7])
def test_fusion_attention_fp16_intermediates_rounded_in_one_pass_equal_the_round_trip(monkeypatch, keep_prob):
    """P (read by P @ V, and by dV) and dS (read by dQ, dK), rounded to fp16 by _C.round_to_half (in place
    where the unrounded values are not read again): forward and gradients bit for bit those of the
    .to(float16).to(float32) copies; with pse, dpse reads the unrounded dS."""
    torch.manual_seed(22)
    q, k, v, dy = (torch.randn(1, 2, 40, 16).half() for _ in range(4))
    pse = torch.randn(1, 2, 40, 40).half()
    mask = torch.ones(40, 40, dtype=torch.bool).triu(1).npu()
    monkeypatch.setattr(attention, "BF16_AMX", False)  # the Python path, which rounds through _C.round_to_half
    results = []
    for one_pass in (True, False):
        if not one_pass:
            monkeypatch.setattr(_C, "round_to_half",
                                lambda t, out=None: (t if out is None else out).copy_(t.half().float()))
        qn, kn, vn, pn = leaves(q, k, v, pse, dtype=torch.float16)
        torch.manual_seed(5)  # the same dropout mask
        out = torch_npu.npu_fusion_attention(qn, kn, vn, 2, "BNSD", pse=pn, atten_mask=mask, scale=0.25,
                                             keep_prob=keep_prob)[0]
        results.append([out, *torch.autograd.grad(out, [qn, kn, vn, pn], dy.npu())])
    for got, want, name in zip(*results, ("attention_out", "dq", "dk", "dv", "dpse")):
        assert torch.equal(got.cpu(), want.cpu()), name


def test_fusion_attention_golden_run_is_the_cpu_kernel():
    q, k, v = (t.half() for t in qkv())
    with numerics.golden():
        golden = torch_npu.npu_fusion_attention(q.npu(), k.npu(), v.npu(), 4, "BNSD", scale=0.3,
                                                atten_mask=CAUSAL_2048.npu(), sparse_mode=2)
    cpu = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3, atten_mask=CAUSAL_2048, sparse_mode=2)
    for a, b in zip(golden[:3], cpu[:3]):
        assert torch.equal(a.cpu(), b)


def test_fusion_attention_under_autocast():
    torch.manual_seed(8)
    x = torch.randn(2, 12, 32).npu()
    weights = [torch.randn(32, 32).npu() for _ in range(3)]
    with torch.autocast("npu", dtype=torch.float16):
        q, k, v = (torch.nn.functional.linear(x, w) for w in weights)
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BSH", scale=0.35, atten_mask=CAUSAL_2048.npu(),
                                             sparse_mode=2)[0]
    assert out.dtype == torch.float16 and out.shape == (2, 12, 32)
    bnsd = [t.cpu().unflatten(2, (4, 8)).transpose(1, 2) for t in (q, k, v)]
    ref = attention_fp64(*bnsd, 0.35, band_mask(12, 12, INT_MAX, 0)).transpose(1, 2).flatten(2)
    assert_close_to_reference(out, ref, torch.float16, "attention_out")


def test_fusion_attention_under_compile_forward_and_backward_equal_eager():
    q, k, v = qkv()

    def step(a, b, c):
        out = torch_npu.npu_fusion_attention(a, b, c, 4, "BNSD", scale=0.3, atten_mask=CAUSAL_2048.npu(),
                                             sparse_mode=3)[0]
        return (out * out).sum()

    compiled = torch.compile(step, backend="npu", fullgraph=True)
    eager_inputs, compiled_inputs = leaves(q, k, v), leaves(q, k, v)
    step(*eager_inputs).backward()
    loss = compiled(*compiled_inputs)
    loss.backward()
    torch.testing.assert_close(loss.cpu(), step(*eager_inputs).detach().cpu())
    for a, b in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu())


def test_each_new_optimised_mask_is_checked_bit_for_bit_whatever_its_layout():
    """Code that builds its 2048x2048 mask at every call (MindSpeed-LLM's GPT-OSS) has each new mask
    checked against one made once per device, 8 bytes at a time where its layout allows: the same
    answers as torch.equal on every layout, a uint8 mask and a mask one element off included."""
    q, k, v = qkv()
    expected = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=CAUSAL_2048, sparse_mode=2, scale=0.25)[0]
    wide = torch.zeros(2048, 4096, dtype=torch.bool)
    wide[:, 1:2049] = CAUSAL_2048
    for mask in (CAUSAL_2048.clone(), CAUSAL_2048.to(torch.uint8), CAUSAL_2048[None, None].clone(),
                 wide[:, 1:2049]):  # a view neither dense nor on an 8-byte boundary
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, sparse_mode=2, scale=0.25)[0]
        assert torch.equal(out, expected)
    for index in ((0, 0), (0, 1), (2047, 2047), (1000, 1512)):
        off_by_one = CAUSAL_2048.clone()
        off_by_one[index] = ~off_by_one[index]
        with pytest.raises(ValueError, match="upper-triangular"):
            torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=off_by_one, sparse_mode=2, scale=0.25)
        strided = wide.clone()[:, 1:2049]
        strided[index] = off_by_one[index]
        with pytest.raises(ValueError, match="upper-triangular"):
            torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=strided, sparse_mode=2, scale=0.25)


def test_masks_made_under_inference_mode_are_used_and_their_in_place_changes_seen():
    """A mask made under torch.inference_mode (a model's forward in an inference server) is an inference
    tensor, without a version counter: the mask caches keyed by it raised 'Inference tensors do not
    track version counter'. Such a mask is used uncached, so a write into it is seen at the next call."""
    q, k, v = qkv()
    causal = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=CAUSAL_2048, sparse_mode=2, scale=0.25)[0]
    full = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25)[0]
    with torch.inference_mode():
        compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=compressed, sparse_mode=2, scale=0.25)[0]
        assert torch.equal(out, causal)
        mask = band_mask(12, 20, INT_MAX, 0)
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.25)[0]
        assert torch.equal(out, causal)
        mask.fill_(False)  # nothing masked from now on
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.25)[0]
        torch.testing.assert_close(out, full)


def test_fusion_attention_refuses_what_the_kernel_refuses():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="input_layout"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BHSD")
    with pytest.raises(ValueError, match="2048x2048"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=band_mask(12, 20, INT_MAX, 0), sparse_mode=3)
    with pytest.raises(ValueError, match="upper-triangular"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(2048, 2048, dtype=torch.bool),
                                       sparse_mode=2)
    with pytest.raises(ValueError, match="padding_mask"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", padding_mask=torch.zeros(1))
    with pytest.raises(ValueError, match="TND only"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=CAUSAL_2048, sparse_mode=7)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        torch_npu.npu_fusion_attention(q, k[:, :1].expand(2, 3, 20, 16), v[:, :1].expand(2, 3, 20, 16), 4, "BNSD")
    with pytest.raises(NotImplementedError, match="dropout_mask"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.9, dropout_mask=torch.ones(8, dtype=torch.uint8))


# ---- npu_fusion_attention_v2 ---------------------------------------------------------------------

@pytest.mark.parametrize("pse_type", [0, 1])
def test_fusion_attention_v2_pse_type_orders_scale_and_pse(pse_type):
    """pse_type 1: scale * (qk + pse); pse_type 0: scale * qk + pse."""
    q, k, v = qkv()
    pse = torch.randn(1, 4, 12, 20)
    dy = torch.randn(2, 4, 12, 16)
    ref, grads_ref = grads_fp64(lambda a, b, c, p: attention_fp64(a, b, c, 0.3, pse=p, pse_type=pse_type), q, k, v,
                                pse, grad_output=dy)
    qn, kn, vn, pn = leaves(q, k, v, pse)
    out = torch_npu.npu_fusion_attention_v2(qn, kn, vn, 4, "bnsd", pse=pn, scale=0.3, pse_type=pse_type)[0]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out, [qn, kn, vn, pn], dy.npu()), grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)


def test_fusion_attention_v2_equals_v1_where_they_overlap():
    q, k, v = qkv()
    sink = torch.randn(4)
    args = dict(atten_mask=CAUSAL_2048, scale=0.3, sparse_mode=4)
    v1 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", pre_tockens=3, next_tockens=2, sink=sink, **args)
    v2 = torch_npu.npu_fusion_attention_v2(q, k, v, 4, "BNSD", pre_tokens=3, next_tokens=2, sink=sink, **args)
    for a, b in zip(v1[:3], v2[:3]):
        torch.testing.assert_close(a, b)


def test_fusion_attention_v2_rope_adds_the_rope_scores():
    """scale * (q k^T + q_rope k_rope^T), TND, bf16; dq_rope and dk_rope through autograd."""
    torch.manual_seed(9)
    lens = [5, 3]
    n, d, d_rope = 2, 16, 8
    q, k, v = torch.randn(8, n, d), torch.randn(8, n, d), torch.randn(8, n, d)
    q_rope, k_rope = torch.randn(8, n, d_rope), torch.randn(8, n, d_rope)
    mask = CAUSAL_2048
    inputs = leaves(q, k, v, q_rope, k_rope, dtype=torch.bfloat16)
    out = torch_npu.npu_fusion_attention_v2(inputs[0], inputs[1], inputs[2], n, "TND", query_rope=inputs[3],
                                            key_rope=inputs[4], atten_mask=mask.npu(), scale=0.2, sparse_mode=3,
                                            actual_seq_qlen=cumulative(lens), actual_seq_kvlen=cumulative(lens))[0]
    dy = torch.randn(8, n, d).bfloat16()
    grads = torch.autograd.grad(out, inputs, dy.npu())
    bf = [t.detach().cpu() for t in inputs]

    def per_sequence(a, b, c, qr, kr):
        outs = []
        for qs, ks, vs, qrs, krs in zip(*(t.split(lens) for t in (a, b, c, qr, kr))):
            bnsd = [t.transpose(0, 1)[None] for t in (torch.cat([qs, qrs], -1), torch.cat([ks, krs], -1), vs)]
            outs.append(attention_fp64(*bnsd, 0.2, band_mask(len(qs), len(ks), INT_MAX, 0))[0].transpose(0, 1))
        return torch.cat(outs)
    ref, grads_ref = grads_fp64(per_sequence, *bf, grad_output=dy)
    assert_close_to_reference(out, ref, torch.bfloat16, "attention_out")
    for got, want, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dq_rope", "dk_rope")):
        assert got.shape == want.shape
        assert_close_to_reference(got, want, torch.bfloat16, name, factor=3)


def test_fusion_attention_v2_names_what_it_does_not_emulate():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="pse_type=2"):
        torch_npu.npu_fusion_attention_v2(q, k, v, 4, "BNSD", pse=torch.rand(4), pse_type=2)
    with pytest.raises(ValueError, match="TND only"):
        torch_npu.npu_fusion_attention_v2(q.bfloat16(), k.bfloat16(), v.bfloat16(), 4, "BNSD",
                                          query_rope=q.bfloat16(), key_rope=k.bfloat16())


# ---- inference: prompt / incremental / fused infer attention --------------------------------------

def per_batch_fp64(q, k, v, scale, masks, q_lens=None, kv_lens=None, pse=None):
    """attention_fp64 of each batch item in its own lengths (BNSD); query rows beyond a length give
    zeros, keys beyond it are not seen."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        sq = q.shape[2] if q_lens is None else q_lens[i]
        skv = k.shape[2] if kv_lens is None else kv_lens[i]
        mask = None if masks is None else masks(i, sq, skv)
        bias = None if pse is None else pse[i if pse.shape[0] > 1 else 0, :, :sq, :skv][None]
        out[i, :, :sq] = attention_fp64(q[i:i + 1, :, :sq], k[i:i + 1, :, :skv], v[i:i + 1, :, :skv], scale, mask,
                                        pse=bias, pse_type=0)[0]
    return out


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "BNSD_BSND"])
def test_prompt_flash_attention_layouts_gqa_causal_mask_against_fp64(layout):
    q, k, v = (t.half() for t in qkv(n=4, nkv=2, sq=10, skv=10, seed=10))
    mask = band_mask(10, 10, INT_MAX, 0)
    in_layout = "BNSD" if layout == "BNSD_BSND" else layout
    out = torch_npu.npu_prompt_flash_attention(
        to_layout(q, in_layout).npu(), to_layout(k, in_layout).npu(), to_layout(v, in_layout).npu(),
        atten_mask=mask.npu(), num_heads=4, num_key_value_heads=2, scale_value=0.25, input_layout=layout)
    ref = attention_fp64(q, k, v, 0.25, mask)
    assert out.dtype == torch.float16
    assert_close_to_reference(out, to_layout(ref, "BSND" if layout == "BNSD_BSND" else layout), torch.float16, "out")


def test_prompt_flash_attention_actual_lengths_and_sparse_modes():
    q, k, v = qkv(n=2, nkv=2, sq=8, skv=12, seed=11)
    q_lens, kv_lens = [5, 8], [9, 12]
    # mode 3 (2048 mask): bottom-right causal in each batch's own lengths
    out = torch_npu.npu_prompt_flash_attention(q.npu(), k.npu(), v.npu(), atten_mask=CAUSAL_2048.npu(), num_heads=2,
                                               scale_value=0.3, input_layout="BNSD", sparse_mode=3,
                                               actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens)
    ref = per_batch_fp64(q, k, v, 0.3, lambda i, sq, skv: band_mask(sq, skv, INT_MAX, 0, True), q_lens, kv_lens)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    # mode 0: the mask, and the band pre_tokens/next_tokens (default next_tokens=0: causal)
    padding = torch.zeros(2, 1, 8, 12, dtype=torch.bool)
    padding[0, ..., 10:] = True
    out = torch_npu.npu_prompt_flash_attention(q.npu(), k.npu(), v.npu(), atten_mask=padding.npu(), num_heads=2,
                                               scale_value=0.3, input_layout="BNSD", pre_tokens=3)
    ref = per_batch_fp64(q, k, v, 0.3, lambda i, sq, skv: padding[i, 0] | band_mask(sq, skv, 3, 0))
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-6)


def test_prompt_flash_attention_pse_shift_is_added_to_the_scaled_scores():
    q, k, v = qkv(n=2, nkv=2, sq=6, skv=8, seed=12)
    pse = torch.randn(1, 2, 6, 8)
    out = torch_npu.npu_prompt_flash_attention(q, k, v, pse_shift=pse, num_heads=2, scale_value=0.3,
                                               input_layout="BNSD", next_tokens=INT_MAX)
    torch.testing.assert_close(out.double(), attention_fp64(q, k, v, 0.3, pse=pse, pse_type=0), rtol=1e-5, atol=1e-6)


def test_incre_flash_attention_decode_step_against_fp64():
    torch.manual_seed(13)
    b, n, nkv, d, skv = 3, 8, 2, 16, 20
    q = torch.randn(b, 1, n * d).bfloat16()
    k, v = torch.randn(b, skv, nkv * d).bfloat16(), torch.randn(b, skv, nkv * d).bfloat16()
    kv_lens = [20, 7, 13]
    mask = torch.rand(b, skv) > 0.8  # (B, KV_S) for Q_S = 1
    mask[:, 0] = False
    out = torch_npu.npu_incre_flash_attention(q.npu(), k.npu(), v.npu(), atten_mask=mask.npu(),
                                              actual_seq_lengths=kv_lens, num_heads=n, num_key_value_heads=nkv,
                                              scale_value=d ** -0.5, input_layout="BSH")
    bnsd = [t.unflatten(2, (-1, d)).transpose(1, 2) for t in (q, k, v)]
    ref = per_batch_fp64(*bnsd, d ** -0.5, lambda i, sq, skv: mask[i, :skv][None], kv_lens=kv_lens)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert_close_to_reference(out, ref.transpose(1, 2).flatten(2), torch.bfloat16, "out")


@pytest.mark.parametrize("cache_layout", ["(blocknum, blocksize, H)", "(blocknum, Nkv, blocksize, D)"])
def test_incre_flash_attention_paged_cache_equals_the_contiguous_cache(cache_layout):
    torch.manual_seed(14)
    b, n, nkv, d, block = 2, 4, 2, 8, 4
    kv_lens = [10, 6]
    q = torch.randn(b, n, 1, d)
    k, v = torch.randn(b, nkv, 12, d), torch.randn(b, nkv, 12, d)
    contiguous = torch_npu.npu_incre_flash_attention(q, k, v, actual_seq_lengths=kv_lens, num_heads=n,
                                                     num_key_value_heads=nkv, scale_value=0.3, input_layout="BNSD")
    # scatter each sequence's 3 blocks of 4 tokens over a shuffled pool of 8 blocks
    block_table = torch.tensor([[5, 0, 3], [7, 2, 6]], dtype=torch.int32)
    pools = []
    for cache in (k, v):
        blocks = cache.unflatten(2, (3, block)).permute(0, 2, 1, 3, 4)  # [B, 3, Nkv, block, D]
        pool = torch.zeros(8, nkv, block, d)
        pool[block_table.long()] = blocks
        pools.append(pool if cache_layout.endswith("D)") else pool.transpose(1, 2).flatten(2))
    paged = torch_npu.npu_incre_flash_attention(q, *pools, actual_seq_lengths=kv_lens, block_table=block_table,
                                                block_size=block, num_heads=n, num_key_value_heads=nkv,
                                                scale_value=0.3, input_layout="BNSD")
    torch.testing.assert_close(paged, contiguous)
    torch.testing.assert_close(contiguous.double(), per_batch_fp64(q, k, v, 0.3, None, kv_lens=kv_lens),
                               rtol=1e-5, atol=1e-6)


def test_fused_infer_attention_score_takes_the_prompt_and_the_incremental_branch():
    q, k, v = qkv(n=4, nkv=2, sq=6, skv=9, seed=15)
    mask = band_mask(6, 9, INT_MAX, 0, True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, atten_mask=CAUSAL_2048, sparse_mode=3, num_heads=4,
                                                         num_key_value_heads=2, scale=0.3, input_layout="BNSD",
                                                         softmax_lse_flag=True)
    torch.testing.assert_close(out.double(), attention_fp64(q, k, v, 0.3, mask), rtol=1e-5, atol=1e-6)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(mask, -math.inf)
    assert lse.shape == (2, 4, 6, 1)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1, keepdim=True), rtol=1e-5, atol=1e-6)
    prompt = torch_npu.npu_prompt_flash_attention(q, k, v, atten_mask=CAUSAL_2048, sparse_mode=3, num_heads=4,
                                                  num_key_value_heads=2, scale_value=0.3, input_layout="BNSD")
    torch.testing.assert_close(out, prompt)
    step = q[:, :, -1:]
    out, lse = torch_npu.npu_fused_infer_attention_score(step, k, v, num_heads=4, num_key_value_heads=2, scale=0.3,
                                                         input_layout="BNSD", actual_seq_lengths_kv=[9, 4],
                                                         atten_mask=torch.zeros(2, 9, dtype=torch.bool))
    assert lse.shape == (1,) and lse.item() == 0  # softmax_lse_flag=False
    incre = torch_npu.npu_incre_flash_attention(step, k, v, num_heads=4, num_key_value_heads=2, scale_value=0.3,
                                                input_layout="BNSD", actual_seq_lengths=[9, 4])
    torch.testing.assert_close(out, incre)


@pytest.mark.parametrize("lengths", [([3, 5], [4, 8]), ([9, 1, 2], [10, 2, 3])], ids=["padded", "bucketed"])
def test_fused_infer_attention_score_tnd_and_mla_rope(lengths, small_buckets):
    torch.manual_seed(16)
    (q_lens, kv_lens), n, d, d_rope = lengths, 2, 16, 8
    tq, tkv = sum(q_lens), sum(kv_lens)
    assert (tnd_buckets(q_lens, kv_lens) > 1) == (len(q_lens) == 3)
    q, q_rope = torch.randn(tq, n, d).bfloat16(), torch.randn(tq, n, d_rope).bfloat16()
    k, k_rope = torch.randn(tkv, n, d).bfloat16(), torch.randn(tkv, n, d_rope).bfloat16()
    v = torch.randn(tkv, n, d).bfloat16()
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v, query_rope=q_rope, key_rope=k_rope, atten_mask=CAUSAL_2048, sparse_mode=3, num_heads=n, scale=0.2,
        input_layout="TND", actual_seq_lengths=cumulative(q_lens), actual_seq_lengths_kv=cumulative(kv_lens),
        softmax_lse_flag=True)
    assert out.shape == (tq, n, d) and lse.shape == (tq, n, 1)
    refs, ref_lses = [], []
    for qs, qrs, ks, krs, vs in zip(q.split(q_lens), q_rope.split(q_lens), k.split(kv_lens), k_rope.split(kv_lens),
                                    v.split(kv_lens)):
        bnsd = [t.transpose(0, 1)[None] for t in (torch.cat([qs, qrs], -1), torch.cat([ks, krs], -1), vs)]
        masked = band_mask(len(qs), len(ks), INT_MAX, 0, True)
        refs.append(attention_fp64(*bnsd, 0.2, masked)[0].transpose(0, 1))
        scores = (0.2 * bnsd[0].double() @ bnsd[1].double().transpose(-1, -2)).masked_fill(masked, -math.inf)
        ref_lses.append(scores.logsumexp(-1)[0].transpose(0, 1))
    assert_close_to_reference(out, torch.cat(refs), torch.bfloat16, "out")
    torch.testing.assert_close(lse[..., 0].double(), torch.cat(ref_lses), rtol=1e-5, atol=1e-5)


def test_fused_infer_attention_score_under_compile():
    q, k, v = (t.half().npu() for t in qkv(n=4, nkv=2, sq=6, skv=9))

    def attend(a, b, c):
        return torch_npu.npu_fused_infer_attention_score(a, b, c, atten_mask=CAUSAL_2048.npu(), sparse_mode=3,
                                                         num_heads=4, num_key_value_heads=2, scale=0.3,
                                                         input_layout="BNSD", softmax_lse_flag=True)
    compiled = torch.compile(attend, backend="npu", fullgraph=True)
    for a, b in zip(compiled(q, k, v), attend(q, k, v)):
        torch.testing.assert_close(a.cpu(), b.cpu())


def test_inference_ops_name_the_arguments_they_do_not_emulate():
    q, k, v = qkv(n=2, nkv=2, sq=1, skv=8)
    with pytest.raises(NotImplementedError, match="quant_scale2"):
        torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", quant_scale2=torch.ones(1))
    with pytest.raises(NotImplementedError, match="kv_padding_size"):
        torch_npu.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", kv_padding_size=torch.ones(1))
    with pytest.raises(NotImplementedError, match="antiquant_scale, antiquant_offset"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD",
                                                  antiquant_scale=torch.ones(2), antiquant_offset=torch.ones(2))
    with pytest.raises(NotImplementedError, match="int8"):
        torch_npu.npu_fused_infer_attention_score(q, k.to(torch.int8), v.to(torch.int8), num_heads=2,
                                                  input_layout="BNSD")
    with pytest.raises(ValueError, match="block_table"):
        torch_npu.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD",
                                            block_table=torch.zeros(2, 1, dtype=torch.int32), block_size=8)


# ---- transformers' NPU flash-attention path --------------------------------------------------------

def test_transformers_flash_attention_2_on_npu_calls_fusion_attention_as_it_does(monkeypatch):
    """transformers' integrations/npu_flash_attention.py: BSND with the 2048 causal mask and
    sparse_mode 3 for a full batch, TND with cumulative lengths for a padded one (varlen)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import npu_flash_attention

    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["input_layout"] if "input_layout" in kwargs else args[4], kwargs.get("sparse_mode"),
                      tuple(kwargs["atten_mask"].shape)))
        return torch_npu.npu_fusion_attention(*args, **kwargs)
    monkeypatch.setattr(npu_flash_attention, "npu_fusion_attention", spy)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(17)
    # each model its own config: _from_config records the attention implementation in it
    flash = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="flash_attention_2",
                                          dtype=torch.bfloat16)
    eager = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    assert flash.config._attn_implementation == "flash_attention_2"
    eager.load_state_dict(flash.state_dict())
    flash, eager = flash.npu(), eager.npu()
    ids = torch.randint(0, 64, (2, 12)).npu()
    padding = torch.ones(2, 12, dtype=torch.long).npu()
    padding[1, :4] = 0  # left padding: transformers unpads to TND
    for mask in (None, padding):
        logits = flash(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
        keep = slice(None) if mask is None else mask.bool()
        assert_close_to_reference(logits[keep], want[keep], torch.bfloat16, "logits", factor=2)
    logits.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in flash.parameters())
    assert calls == [("BSND", 3, (2048, 2048)), ("TND", 3, (2048, 2048))]


def test_transformers_flash_attention_2_logits_and_gradients_equal_eager_in_fp32():
    """A tiny Llama in fp32 with flash_attention_2 on npu (npu_fusion_attention) against the same
    weights with eager attention: logits and every parameter's gradient within fp32 tolerance, for a
    full batch (BSND) and a left-padded one (TND)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(19)
    flash = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="flash_attention_2",
                                          dtype=torch.float32)
    eager = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    eager.load_state_dict(flash.state_dict())
    flash, eager = flash.npu(), eager.npu()
    ids = torch.randint(0, 64, (2, 12)).npu()
    padding = torch.ones(2, 12, dtype=torch.long).npu()
    padding[1, :4] = 0
    for mask in (None, padding):
        keep = slice(None) if mask is None else mask.bool()
        results = []
        for model in (flash, eager):
            model.zero_grad()
            logits = model(ids, attention_mask=mask).logits
            logits[keep].square().mean().backward()
            results.append((logits[keep].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (flash_logits, flash_grads), (eager_logits, eager_grads) = results
        torch.testing.assert_close(flash_logits.cpu(), eager_logits.cpu(), rtol=1e-4, atol=1e-5)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(flash_grads[name].cpu(), grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)


def test_fusion_attention_prefix_modes_5_and_6():
    """Mode 6 (compressed, the 3072x2048 mask): rightDownCausal plus the first prefix[b] keys of
    batch b; mode 5 takes the same mask uncompressed (B1SS)."""
    q, k, v = qkv(sq=8, skv=12, seed=18)
    prefix = [6, 3]
    masked = torch.stack([band_mask(8, 12, INT_MAX, 0, True) & (torch.arange(12) >= n) for n in prefix])[:, None]
    compressed = torch.cat([CAUSAL_2048, torch.zeros(1024, 2048, dtype=torch.bool)])
    compressed[2048:, 1024:] = True
    ref = attention_fp64(q, k, v, 0.3, masked)
    for mode, mask in ((6, compressed), (5, masked)):
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3, sparse_mode=mode,
                                             prefix=prefix)[0]
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_fusion_attention_compile_tnd_and_dropout_with_an_explicit_seed():
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in qkv(b=1, n=2, nkv=2, sq=10, skv=10))
    lens = cumulative([4, 6])

    def attend(a, b, c, **kwargs):
        return torch_npu.npu_fusion_attention(a, b, c, 2, "TND", scale=0.3, atten_mask=CAUSAL_2048.npu(),
                                              sparse_mode=3, actual_seq_qlen=lens, actual_seq_kvlen=lens, **kwargs)[0]
    inputs = leaves(q, k, v)
    compiled = torch.compile(lambda a, b, c: attend(a, b, c, keep_prob=0.7, seed=11, offset=5), backend="npu",
                             fullgraph=True)
    out = compiled(*inputs)
    torch.testing.assert_close(out.cpu(), attend(*inputs, keep_prob=0.7, seed=11, offset=5).detach().cpu())
    grads = torch.autograd.grad(out.sum(), inputs)
    eager = torch.autograd.grad(attend(*inputs, keep_prob=0.7, seed=11, offset=5).sum(), inputs)
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a.cpu(), b.cpu())
    # a seed the kernel draws cannot reach the compiled backward: refused, saying what to pass
    with pytest.raises(Exception, match="explicit seed and offset"):
        torch.compile(lambda a, b, c: attend(a, b, c, keep_prob=0.7), backend="npu", fullgraph=True)(*inputs)


def test_fused_infer_attention_score_v2_renames_v1_and_adds_a_learnable_sink():
    q, k, v = (t.bfloat16() for t in qkv(n=4, nkv=2, sq=6, skv=9, seed=19))
    common = dict(atten_mask=CAUSAL_2048, sparse_mode=3, num_key_value_heads=2, input_layout="BNSD")
    v1 = torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, scale=0.3, softmax_lse_flag=True,
                                                   actual_seq_lengths=[6, 4], actual_seq_lengths_kv=[9, 7], **common)
    v2 = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, softmax_scale=0.3,
                                                      return_softmax_lse=True, actual_seq_qlen=[6, 4],
                                                      actual_seq_kvlen=[9, 7], **common)
    for a, b in zip(v1, v2):
        torch.testing.assert_close(a, b)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0]).bfloat16()
    out = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, softmax_scale=0.3,
                                                       learnable_sink=sink, **common)[0]
    ref = attention_fp64(q, k, v, 0.3, band_mask(6, 9, INT_MAX, 0, True), sink=sink)
    assert_close_to_reference(out, ref, torch.bfloat16, "out")
    with pytest.raises(NotImplementedError, match="key_quant_mode=1"):
        torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, key_quant_mode=1, value_quant_mode=1,
                                                     input_layout="BNSD", num_key_value_heads=2)
