import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference
from tests.npu_backend.fused.test_matmul import GmmFunction

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def distinct_experts(rows, k, experts, seed):
    """Each row's k different experts (what a top-k gives)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(rows)]).to(torch.int32)


# ---- gating --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)])
def test_gating_top_k_softmax_against_fp64(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    finished = torch.rand(shape[:-1]) < 0.3
    y, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(x.npu(), finished.npu(), k=3)
    probs = torch.softmax(x.double(), -1)
    y_ref, idx_ref = probs.topk(3, -1)
    assert y.dtype == dtype and expert_idx.dtype == row_idx.dtype == torch.int32
    assert y.shape == expert_idx.shape == row_idx.shape == (*shape[:-1], 3)
    assert_close_to_reference(y, y_ref, dtype, "y")
    # a finished row routes to expert E (the number of experts)
    expected_idx = torch.where(finished.unsqueeze(-1), 8, idx_ref)
    assert torch.equal(expert_idx.cpu().long(), expected_idx)
    rows = x.numel() // 8
    expected_rows = torch.tensor([[j * rows + r for j in range(3)] for r in range(rows)]).reshape(row_idx.shape)
    assert torch.equal(row_idx.cpu().long(), expected_rows)


def test_routing_ops_have_no_backward_as_in_torch_npu():
    """torch_npu's routing ops are inference interfaces: backpropagating through them raises (here
    as on the device) rather than training on the emulator only."""
    x = torch.randn(4, 6, device="npu", requires_grad=True)
    expert_idx = distinct_experts(4, 2, 3, seed=20).npu()
    outputs = [
        torch_npu.npu_moe_gating_top_k_softmax(x, k=2)[0],
        torch_npu.npu_moe_init_routing_v2(x, expert_idx)[0],  # keyword-only tensor arguments
        torch_npu.npu_moe_finalize_routing(x.repeat(2, 1), None, None, None, None,
                                           torch.arange(8, dtype=torch.int32).npu(), None, 0, 2),
    ]
    for out in outputs:
        with pytest.raises(NotImplementedError, match=r"the derivative for torch_npu\.npu_moe_\w+ is not implemented"):
            out.sum().backward()


def test_gating_refuses_a_k_beyond_the_experts():
    with pytest.raises(ValueError, match=r"npu_moe_gating_top_k_softmax: k must be in \(0, min"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(2, 4).npu(), k=5)


# ---- init routing ----------------------------------------------------------------------------------

def test_init_routing_matches_the_docs_example_and_formula():
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4]).npu()
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32).npu()
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32).npu()
    expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    # keyValueSort(expert_idx, row_idx): (0,1) (0,2) (1,0) (1,4) (2,3) (2,5)
    assert expanded_expert_idx.cpu().tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.cpu().tolist() == [2, 0, 1, 4, 3, 5]  # expanded_row_idx[sorted_row_idx[i]] = i
    assert expanded_x[:, 0].cpu().tolist() == pytest.approx([0.2, 0.3, 0.1, 0.2, 0.1, 0.3])


@pytest.mark.parametrize("active_num", [100, 4])
def test_init_routing_against_its_formula(active_num):
    rows, k, experts = 7, 3, 5
    x = torch.randn(rows, 6)
    expert_idx = distinct_experts(rows, k, experts, seed=1)
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).t().contiguous()
    expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(
        x.npu(), row_idx.npu(), expert_idx.npu(), active_num)
    pairs = sorted(zip(expert_idx.flatten().tolist(), row_idx.flatten().tolist()))
    sorted_rows = [r for _, r in pairs]
    assert expanded_expert_idx.cpu().tolist() == [e for e, _ in pairs]
    expected_row_idx = [0] * (rows * k)
    for i, r in enumerate(sorted_rows):
        expected_row_idx[r] = i
    assert expanded_row_idx.cpu().tolist() == expected_row_idx
    assert expanded_x.shape == (min(rows, active_num) * k, 6)
    assert torch.equal(expanded_x.cpu(), x[[r % rows for r in sorted_rows[:expanded_x.shape[0]]]])


def init_routing_v2_reference(x, expert_idx, *, active_num=-1, expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                              expert_tokens_num_type=0, active_expert_range=None, row_idx_type=0):
    """CANN's MoeInitRoutingV3 formulas, with loops."""
    rows, k = expert_idx.shape
    start, end = active_expert_range or (0, expert_num)
    flat = expert_idx.flatten().tolist()
    pairs = sorted((e, p) for p, e in enumerate(flat) if start <= e < end)
    gather = [-1] * (rows * k)
    if drop_pad_mode == 1:
        expanded = torch.zeros(expert_num * expert_capacity, x.shape[1], dtype=torch.float64)
        rank = {}
        for e, p in pairs:
            rank[e] = rank.get(e, -1) + 1
            if rank[e] < expert_capacity:
                gather[p] = e * expert_capacity + rank[e]
                expanded[gather[p]] = x[p // k].double()
        expanded = expanded.reshape(expert_num, expert_capacity, -1)
    else:
        out_rows = rows * k if active_num <= 0 else min(active_num, rows * k)
        expanded = torch.zeros(out_rows, x.shape[1], dtype=torch.float64)
        for i, (_, p) in enumerate(pairs):
            gather[p] = i
            if i < out_rows:
                expanded[i] = x[p // k].double()
    scatter = [p for _, p in pairs] + [-1] * (rows * k - len(pairs))
    counts = [sum(1 for e, _ in pairs if e == expert) for expert in range(start, end)]
    if expert_tokens_num_type == 0:
        tokens = torch.tensor(counts).cumsum(0)
    elif expert_tokens_num_type == 1:
        tokens = torch.tensor(counts)
    else:
        tokens = torch.zeros(expert_num, 2, dtype=torch.int64)
        present = [(start + i, c) for i, c in enumerate(counts) if c]
        if present:
            tokens[:len(present)] = torch.tensor(present)
    return expanded, torch.tensor(gather if row_idx_type == 0 else scatter), tokens


V2_CASES = [
    dict(expert_num=6, expert_tokens_num_type=1),
    dict(expert_num=6, expert_tokens_num_type=0, active_num=9),
    dict(expert_num=6, expert_tokens_num_type=2, active_expert_range=[2, 5]),
    dict(expert_num=6, expert_tokens_num_type=1, active_expert_range=[1, 4], row_idx_type=1),
    dict(expert_num=6, expert_tokens_num_type=1, drop_pad_mode=1, expert_capacity=3),
]


@pytest.mark.parametrize("case", V2_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_routing_v2_modes_against_the_formulas(case, dtype):
    rows, k = 8, 2
    x = torch.randn(rows, 5).to(dtype)
    expert_idx = distinct_experts(rows, k, case["expert_num"], seed=2)
    scale = torch.rand(rows)
    expanded_x, expanded_row_idx, tokens, expanded_scale = torch_npu.npu_moe_init_routing_v2(
        x.npu(), expert_idx.npu(), scale=scale.npu(), expert_tokens_num_flag=True, **case)
    expected_x, expected_row_idx, expected_tokens = init_routing_v2_reference(x, expert_idx, **case)
    assert expanded_x.dtype == dtype and expanded_row_idx.dtype == torch.int32 and tokens.dtype == torch.int64
    assert expanded_x.shape == expected_x.shape
    assert torch.equal(expanded_x.cpu().double(), expected_x)
    assert expanded_row_idx.cpu().tolist() == expected_row_idx.tolist()
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    # expanded_scale carries each valid row's scale with it
    if case.get("drop_pad_mode", 0) == 0:
        token_of_row = init_routing_v2_reference(x, expert_idx, **{**case, "row_idx_type": 1})[1]
        valid = min(int((token_of_row >= 0).sum()), expanded_scale.shape[0])
        assert torch.equal(expanded_scale.cpu()[:valid], scale[token_of_row[:valid] // k])


@pytest.mark.parametrize("case", [dict(expert_num=4, expert_tokens_num_type=1),
                                  dict(expert_num=6, expert_tokens_num_type=0, active_expert_range=[2, 5]),
                                  dict(expert_num=6, expert_tokens_num_type=2, active_expert_range=[2, 5],
                                       row_idx_type=1, active_num=50)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_init_routing_v2_every_pair_active_keeps_the_flat_order_of_equal_experts(case):
    """Every pair in the active range (the usual call, sorted by counting): many pairs per expert, each
    expert's pairs in their flat order i*K + j, as the formulas (a stable sort) give them."""
    rows, k = 40, 3
    start, end = case.get("active_expert_range") or (0, case["expert_num"])
    x = torch.randn(rows, 4)
    expert_idx = torch.randint(start, end, (rows, k), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    expanded_x, expanded_row_idx, tokens, _ = torch_npu.npu_moe_init_routing_v2(
        x.npu(), expert_idx.npu(), expert_tokens_num_flag=True, **case)
    expected_x, expected_row_idx, expected_tokens = init_routing_v2_reference(x, expert_idx, **case)
    assert torch.equal(expanded_x.cpu().double(), expected_x)
    assert expanded_row_idx.cpu().tolist() == expected_row_idx.tolist()
    assert tokens.cpu().tolist() == expected_tokens.tolist()


def test_init_routing_v2_without_counts_and_refusals():
    x, expert_idx = torch.randn(4, 3).npu(), distinct_experts(4, 2, 4, seed=3).npu()
    expanded_x, _, tokens, expanded_scale = torch_npu.npu_moe_init_routing_v2(x, expert_idx)
    assert expanded_x.shape == (8, 3) and tokens.shape == () and expanded_scale.shape == (8,)
    with pytest.raises(NotImplementedError, match="npu_moe_init_routing_v2: quant_mode=1"):
        torch_npu.npu_moe_init_routing_v2(x, expert_idx, quant_mode=1, expert_num=4)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: drop_pad_mode=1 needs expert_capacity"):
        torch_npu.npu_moe_init_routing_v2(x, expert_idx, drop_pad_mode=1, expert_num=4)


# ---- finalize routing, expert tokens --------------------------------------------------------------------

def finalize_fp64(rows_, skip1, skip2, bias, scales, src_to_dst, experts, drop_pad_mode):
    """out(i) = skip1 + skip2 + sum_k scales[i,k] * (rows[dst(i,k)] + bias[experts[i,k]]), with
    dst(i,k) = src_to_dst[k*N + i] (modes 0/1) or src_to_dst[i*K + k] (modes 2/3); -1: dropped."""
    n, k = scales.shape
    flat_rows = rows_.double().reshape(-1, rows_.shape[-1])
    out = skip1.double() + skip2.double()
    for i in range(n):
        for j in range(k):
            dst = int(src_to_dst[j * n + i] if drop_pad_mode in (0, 1) else src_to_dst[i * k + j])
            if dst >= 0:
                out[i] += scales[i, j].double() * (flat_rows[dst] + bias[experts[i, j]].double())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop_pad_mode", [0, 1, 2, 3])
def test_finalize_routing_against_fp64(dtype, drop_pad_mode):
    torch.manual_seed(4)
    n, k, experts, hidden, capacity = 5, 2, 4, 6, 3
    if drop_pad_mode in (1, 3):
        expanded = torch.randn(experts, capacity, hidden).to(dtype)
        src_to_dst = torch.randperm(experts * capacity)[:n * k].to(torch.int32)
        src_to_dst[::3] = -1  # dropped pairs
    else:
        expanded = torch.randn(n * k, hidden).to(dtype)
        src_to_dst = torch.randperm(n * k).to(torch.int32)
    skip1, skip2 = torch.randn(n, hidden).to(dtype), torch.randn(n, hidden).to(dtype)
    bias, scales = torch.randn(experts, hidden).to(dtype), torch.rand(n, k).to(dtype)
    expert_of_row = distinct_experts(n, k, experts, seed=5)
    out = torch_npu.npu_moe_finalize_routing(
        expanded.npu(), skip1.npu(), skip2.npu(), bias.npu(), scales.npu(), src_to_dst.npu(), expert_of_row.npu(),
        drop_pad_mode, k)
    assert out.dtype == dtype and out.shape == (n, hidden)
    expected = finalize_fp64(expanded, skip1, skip2, bias, scales, src_to_dst, expert_of_row, drop_pad_mode)
    assert_close_to_reference(out, expected, dtype, "out")


def test_finalize_routing_without_optional_inputs_and_golden():
    torch.manual_seed(6)
    expanded, src_to_dst = torch.randn(6, 4).half(), torch.randperm(6).to(torch.int32)
    args = (None, None, None, None, src_to_dst)
    with numerics.golden():
        golden = torch_npu.npu_moe_finalize_routing(expanded.npu(), *args[:4], src_to_dst.npu(), None, 0, 2).cpu()
    cpu = torch_npu.npu_moe_finalize_routing(expanded, *args, None, 0, 2)
    assert torch.equal(golden, cpu) and cpu.shape == (3, 4)
    expected = expanded.double()[src_to_dst.long()].reshape(2, 3, 4).sum(0)
    assert_close_to_reference(cpu, expected, torch.float16, "out")


def test_compute_expert_tokens_is_each_experts_end_row():
    sorted_experts = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32)
    assert torch_npu.npu_moe_compute_expert_tokens(sorted_experts.npu(), 3).cpu().tolist() == [3, 5, 6]
    sorted_experts = torch.tensor([1, 1, 3, 3, 3], dtype=torch.int32)
    out = torch_npu.npu_moe_compute_expert_tokens(sorted_experts.npu(), 5)
    assert out.dtype == torch.int32 and out.cpu().tolist() == [0, 2, 2, 5, 5]


# ---- token permute / unpermute -------------------------------------------------------------------------

def test_permute_and_unpermute_match_the_docs_examples():
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16).npu()
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]]).npu()
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
    assert permuted[:, 0].cpu().tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert sorted_indices.dtype == torch.int32 and sorted_indices.cpu().tolist() == [0, 4, 5, 1, 2, 6, 7, 3]
    probs = torch.ones(4, 2, dtype=torch.float16).npu() / 2
    assert torch.equal(torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs).cpu(), tokens.cpu())


def permute_fp64(tokens, indices, num_out):
    top_k = indices.shape[1]
    order = torch.argsort(indices.flatten(), stable=True)
    return tokens[order[:num_out] // top_k]


def unpermute_fp64(permuted, sorted_indices, probs):
    top_k = probs.shape[1]
    padded = torch.cat([permuted, permuted.new_zeros(1, permuted.shape[1])])  # index past the rows: nothing
    index = sorted_indices.long().clamp(max=permuted.shape[0])
    return (padded[index].reshape(-1, top_k, permuted.shape[1]) * probs.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_out_tokens", [None, 9, -3])
def test_permute_unpermute_forward_and_backward_against_fp64(dtype, num_out_tokens):
    torch.manual_seed(7)
    n, k, experts, hidden = 6, 2, 4, 8
    tokens, probs = torch.randn(n, hidden), torch.rand(n, k)
    indices = distinct_experts(n, k, experts, seed=8).long()
    kept = {None: n * k, 9: 9, -3: n * k - 3}[num_out_tokens]
    grad_out = torch.randn(n, hidden)

    tokens_npu, probs_npu = tokens.to(dtype).npu().requires_grad_(), probs.to(dtype).npu().requires_grad_()
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens_npu, indices.npu(), num_out_tokens)
    assert permuted.shape == (kept, hidden) and permuted.dtype == dtype
    out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs_npu)
    assert out.dtype == dtype and out.shape == (n, hidden)
    d_tokens, d_probs = torch.autograd.grad(out, [tokens_npu, probs_npu], grad_out.to(dtype).npu())

    tokens_ref, probs_ref = tokens.to(dtype).double().requires_grad_(), probs.to(dtype).double().requires_grad_()
    permuted_ref = permute_fp64(tokens_ref, indices, kept)
    order = torch.argsort(indices.flatten(), stable=True)
    sorted_ref = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    assert torch.equal(sorted_indices.cpu().long(), sorted_ref)
    assert torch.equal(permuted.detach().cpu().double(), permuted_ref.detach())
    out_ref = unpermute_fp64(permuted_ref, sorted_ref, probs_ref)
    d_tokens_ref, d_probs_ref = torch.autograd.grad(out_ref, [tokens_ref, probs_ref], grad_out.to(dtype).double())
    assert_close_to_reference(out, out_ref, dtype, "unpermuted")
    assert_close_to_reference(d_tokens, d_tokens_ref, dtype, "dtokens", factor=2)
    assert_close_to_reference(d_probs, d_probs_ref, dtype, "dprobs", factor=2)


def test_permute_unpermute_compute_cpu_float64_in_float64_and_refuse_npu_float64():
    """The pre-check's reference run calls the ops on float64 CPU tensors: they compute in float64
    (1 + 2**-40 is not an fp32 value), forward and backward; npu float64 is refused as the device does."""
    torch.manual_seed(12)
    n, k, hidden = 6, 2, 4
    tokens = (torch.randn(n, hidden, dtype=torch.float64) + 2**-40).requires_grad_()
    probs = torch.rand(n, k, dtype=torch.float64).requires_grad_()
    indices = distinct_experts(n, k, 3, seed=13).long()
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
    out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    assert out.dtype == torch.float64
    grad_out = torch.randn(n, hidden, dtype=torch.float64)
    d_tokens, d_probs = torch.autograd.grad(out, [tokens, probs], grad_out)

    tokens_ref, probs_ref = tokens.detach().requires_grad_(), probs.detach().requires_grad_()
    out_ref = unpermute_fp64(permute_fp64(tokens_ref, indices, n * k), sorted_indices, probs_ref)
    d_tokens_ref, d_probs_ref = torch.autograd.grad(out_ref, [tokens_ref, probs_ref], grad_out)
    for value, reference in ((out, out_ref), (d_tokens, d_tokens_ref), (d_probs, d_probs_ref)):
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, reference, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="npu_moe_token_permute: tokens must be float16, bfloat16, float32"):
        torch_npu.npu_moe_token_permute(tokens.detach().npu(), indices.npu())
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: permuted_tokens must be float16"):
        torch_npu.npu_moe_token_unpermute(permuted.detach().npu(), sorted_indices.npu(), probs=probs.detach().float().npu())


def test_permute_and_unpermute_grad_ops_agree_with_autograd():
    torch.manual_seed(9)
    tokens, indices = torch.randn(4, 3).npu(), distinct_experts(4, 2, 3, seed=10).npu()
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
    grad = torch.randn_like(permuted)
    v1 = torch.ops.npu.npu_moe_token_permute_grad(tokens, grad, indices, sorted_indices)
    v2 = torch.ops.npu.npu_moe_token_permute_grad_v2(grad, sorted_indices, 4, tokens.dtype, 2)
    assert torch.equal(v1.cpu(), v2.cpu())
    probs, grad_out = torch.rand(4, 2).npu(), torch.randn(4, 3).npu()
    g1 = torch.ops.npu.npu_moe_token_unpermute_grad(permuted, grad_out, sorted_indices, probs)
    g2 = torch.ops.npu.npu_moe_token_unpermute_grad_v2(grad_out, sorted_indices, 8, permuted.dtype, probs,
                                                      permuted_tokens=permuted)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(g1, g2))


def test_permute_refuses_padded_mode():
    with pytest.raises(ValueError, match="npu_moe_token_permute: padded_mode=True is not supported"):
        torch_npu.npu_moe_token_permute(torch.randn(2, 3).npu(), torch.zeros(2, 1, dtype=torch.int64).npu(),
                                        padded_mode=True)


def test_routing_ops_under_compile_equal_eager():
    torch.manual_seed(11)
    logits, x = torch.randn(6, 4).npu(), torch.randn(6, 8).npu()

    def fn(logits, x):
        scales, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(logits, k=2)
        expanded_x, expanded_row_idx, _ = torch_npu.npu_moe_init_routing(x, row_idx, expert_idx, 6)
        routed = torch_npu.npu_moe_finalize_routing(expanded_x * 2, None, None, None, scales, expanded_row_idx,
                                                    expert_idx)
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(x, expert_idx)
        expanded_v2, _, counts, _ = torch_npu.npu_moe_init_routing_v2(
            x, expert_idx, expert_num=4, expert_tokens_num_flag=True, expert_tokens_num_type=1)
        return routed, torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=scales), expanded_v2, counts

    compiled = torch.compile(fn, backend="npu", fullgraph=True)
    for got, expected in zip(compiled(logits, x), fn(logits, x)):
        assert torch.equal(got.cpu(), expected.cpu())


def test_routing_under_autocast_takes_mixed_dtypes():
    torch.manual_seed(12)
    x, router = torch.randn(5, 8).npu(), torch.randn(4, 8).npu()
    with torch.autocast("npu", dtype=torch.float16):
        logits = torch.nn.functional.linear(x, router)
        scales, expert_idx, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, k=2)
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(logits, expert_idx)
        out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=scales.float())  # fp32 probs
    assert scales.dtype == out.dtype == torch.float16
    expected = logits.cpu().double() * scales.cpu().double().sum(1, keepdim=True)
    assert_close_to_reference(out, expected, torch.float16, "out")


# ---- a tiny MoE layer, end to end -----------------------------------------------------------------------

def moe_layer_fp64(x, router, w_up, w_down, k):
    """The layer in plain torch ops: softmax router, top-k, a loop over experts, weighted sum."""
    probs = torch.softmax(x @ router.t(), -1)
    top_probs, top_experts = probs.topk(k, -1)
    out = torch.zeros_like(x)
    for expert in range(w_up.shape[0]):
        token, slot = torch.nonzero(top_experts == expert, as_tuple=True)
        hidden = torch.relu(x[token] @ w_up[expert]) @ w_down[expert]
        out = out.index_add(0, token, hidden * top_probs[token, slot].unsqueeze(-1))
    return out


def test_moe_inference_chain_equals_the_plain_layer():
    """router -> npu_moe_gating_top_k_softmax -> npu_moe_init_routing -> npu_grouped_matmul (group_list)
    -> npu_moe_finalize_routing, against the layer in fp64 (torch_npu's inference routing ops)."""
    torch.manual_seed(13)
    tokens, hidden, inner, experts, k = 10, 8, 12, 4, 2
    x, router = torch.randn(tokens, hidden), torch.randn(experts, hidden)
    w_up, w_down = torch.randn(experts, hidden, inner) * 0.3, torch.randn(experts, inner, hidden) * 0.3
    x_npu = x.bfloat16().npu()
    logits = torch_npu.npu_linear(x_npu, router.bfloat16().npu())
    scales, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(logits, k=k)
    expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(x_npu, row_idx, expert_idx,
                                                                                       tokens)
    group_list = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, experts).long()
    gmm = dict(group_list=group_list, split_item=3, group_type=0, group_list_type=0)
    (up,) = torch_npu.npu_grouped_matmul([expanded_x], [w_up.bfloat16().npu()], **gmm)
    (down,) = torch_npu.npu_grouped_matmul([torch.relu(up)], [w_down.bfloat16().npu()], **gmm)
    out = torch_npu.npu_moe_finalize_routing(down, None, None, None, scales, expanded_row_idx, expert_idx, 0, k)
    rounded = [t.bfloat16().double() for t in (x, router, w_up, w_down)]
    assert_close_to_reference(out, moe_layer_fp64(*rounded, k), torch.bfloat16, "moe out", factor=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_training_chain_forward_and_backward_equal_the_plain_layer(dtype):
    """The differentiable path, as training code on Ascend writes it: router probs in torch ops,
    npu_moe_token_permute -> npu_grouped_matmul (in a gmm autograd.Function) ->
    npu_moe_token_unpermute(probs); gradients of x, the router and the experts against fp64."""
    torch.manual_seed(14)
    tokens, hidden, inner, experts, k = 12, 8, 12, 4, 2
    x, router = torch.randn(tokens, hidden), torch.randn(experts, hidden)
    w_up, w_down = torch.randn(experts, hidden, inner) * 0.3, torch.randn(experts, inner, hidden) * 0.3
    grad_out = torch.randn(tokens, hidden)

    def layer(x, router, w_up, w_down):
        probs = torch.softmax((x @ router.t()).float(), -1)
        top_probs, top_experts = probs.topk(k, -1)
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(x, top_experts)
        counts = torch.bincount(top_experts.flatten(), minlength=experts)
        up = GmmFunction.apply(permuted, w_up, counts)  # torch_npu's gmm trains through such a Function
        down = GmmFunction.apply(torch.relu(up), w_down, counts)
        return torch_npu.npu_moe_token_unpermute(down, sorted_indices, probs=top_probs.to(down.dtype))

    leaves = [t.to(dtype).npu().requires_grad_() for t in (x, router, w_up, w_down)]
    out = layer(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype).npu())
    ref_leaves = [t.to(dtype).double().requires_grad_() for t in (x, router, w_up, w_down)]
    out_ref = moe_layer_fp64(*ref_leaves, k)
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, grad_out.to(dtype).double())
    assert_close_to_reference(out, out_ref, dtype, "moe out", factor=2)
    for grad, ref, name in zip(grads, grads_ref, ("dx", "drouter", "dw_up", "dw_down")):
        assert_close_to_reference(grad, ref, dtype, name, factor=3)
