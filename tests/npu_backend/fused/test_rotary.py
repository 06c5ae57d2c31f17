import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# fp64 references from torch_npu's docs.

def rotate_half64(x):
    x1, x2 = torch.chunk(x, 2, -1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleave64(x):
    # rearrange(torch.stack((-x2, x1), dim=-1), "... d two -> ...(d two)", two=2)
    x1, x2 = x[..., ::2], x[..., 1::2]
    stacked = torch.stack((-x2, x1), dim=-1)
    return stacked.reshape(*stacked.shape[:-2], -1)


def rotate_quarter64(x):
    q1, q2, q3, q4 = torch.chunk(x, 4, -1)
    return torch.cat((-q2, q1, -q4, q3), dim=-1)


ROTATIONS = {"half": rotate_half64, "interleave": rotate_interleave64, "quarter": rotate_quarter64}


def rotary_mul64(x, r1, r2, mode):
    return r1 * x + r2 * ROTATIONS[mode](x)


# (input shape, r1/r2 shape) for every documented layout and broadcast of r1/r2: BNSD with 11SD, B1SD, BNSD;
# BSND with 1S1D, BS1D, BSND; SBND with S11D, SB1D.
B, N, S, D = 2, 3, 5, 8
BROADCASTS = [
    ((B, N, S, D), (1, 1, S, D)), ((B, N, S, D), (B, 1, S, D)), ((B, N, S, D), (B, N, S, D)),
    ((B, S, N, D), (1, S, 1, D)), ((B, S, N, D), (B, S, 1, D)), ((B, S, N, D), (B, S, N, D)),
    ((S, B, N, D), (S, 1, 1, D)), ((S, B, N, D), (S, B, 1, D)),
]


# interleave mode takes the 11SD, 1S1D and S11D tables only (torch_npu's docs)
MODE_BROADCASTS = [("half", shapes) for shapes in BROADCASTS] + \
    [("interleave", shapes) for shapes in BROADCASTS if sum(size > 1 for size in shapes[1][:3]) == 1]


@pytest.mark.parametrize(("mode", "shapes"), MODE_BROADCASTS)
def test_rotary_mul_forward_and_backward_against_fp64(mode, shapes):
    torch.manual_seed(0)
    x_shape, r_shape = shapes
    x = torch.randn(x_shape, dtype=torch.float64)
    r1 = torch.rand(r_shape, dtype=torch.float64) * 2 - 1
    r2 = torch.rand(r_shape, dtype=torch.float64) * 2 - 1
    dy = torch.randn(x_shape, dtype=torch.float64)
    refs = [t.clone().requires_grad_() for t in (x, r1, r2)]
    y_ref = rotary_mul64(*refs, mode)
    grads_ref = torch.autograd.grad(y_ref, refs, dy)

    leaves = [t.float().npu().requires_grad_() for t in (x, r1, r2)]
    y = torch_npu.npu_rotary_mul(*leaves, rotary_mode=mode)
    grads = torch.autograd.grad(y, leaves, dy.float().npu())
    assert_close_to_reference(y, y_ref, torch.float32, "y")
    for name, grad, grad_ref in zip(("dx", "dr1", "dr2"), grads, grads_ref):
        assert grad.shape == grad_ref.shape
        assert_close_to_reference(grad, grad_ref, torch.float32, name)


@pytest.mark.parametrize(("mode", "shapes"), MODE_BROADCASTS)
def test_rotary_mul_input_gradient_with_constant_tables(mode, shapes):
    """cos/sin tables that need no gradient (the usual case): only dx is computed, and it is the same."""
    torch.manual_seed(1)
    x_shape, r_shape = shapes
    x, dy = torch.randn(x_shape, dtype=torch.float64), torch.randn(x_shape, dtype=torch.float64)
    r1, r2 = (torch.rand(r_shape, dtype=torch.float64) * 2 - 1 for _ in range(2))
    x_ref = x.clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(rotary_mul64(x_ref, r1, r2, mode), [x_ref], dy)
    x_npu = x.float().npu().requires_grad_()
    y = torch_npu.npu_rotary_mul(x_npu, r1.float().npu(), r2.float().npu(), rotary_mode=mode)
    (dx,) = torch.autograd.grad(y, [x_npu], dy.float().npu())
    assert_close_to_reference(dx, dx_ref, torch.float32, "dx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_low_precision(dtype, mode):
    torch.manual_seed(1)
    x = torch.randn(B, S, N, 64, dtype=torch.float64)
    angles = torch.randn(1, S, 1, 64, dtype=torch.float64)
    r1, r2 = angles.cos(), angles.sin()
    low = [t.to(dtype) for t in (x, r1, r2)]
    leaves = [t.npu().requires_grad_() for t in low]
    y = torch_npu.npu_rotary_mul(*leaves, mode)
    assert y.dtype == dtype
    refs = [t.double().requires_grad_() for t in low]
    y_ref = rotary_mul64(*refs, mode)
    dy = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad(y_ref, refs, dy)
    grads = torch.autograd.grad(y, leaves, dy.to(dtype).npu())
    assert_close_to_reference(y, y_ref, dtype, "y")
    for name, grad, grad_ref in zip(("dx", "dr1", "dr2"), grads, grads_ref):
        assert grad.dtype == dtype
        assert_close_to_reference(grad, grad_ref, dtype, name, factor=2)


def test_rotary_mul_with_a_rotate_matrix_is_x_at_rotate():
    n = 16
    half = n // 2
    rotate = torch.zeros(n, n)
    rotate[:half, half:] = torch.eye(half)  # the docs' half-mode matrix
    rotate[half:, :half] = -torch.eye(half)
    swap = torch.zeros(n, n)
    for i in range(0, n, 2):  # the docs' interleave example matrix
        swap[i, i + 1] = 1
        swap[i + 1, i] = 1
    x = torch.randn(2, 2, 5, n, dtype=torch.float64)
    r1, r2 = torch.rand(1, 1, 5, n, dtype=torch.float64), torch.rand(1, 1, 5, n, dtype=torch.float64)
    args = [t.float().npu() for t in (x, r1, r2)]
    y = torch_npu.npu_rotary_mul(*args, "half", rotate.npu())
    assert_close_to_reference(y, rotary_mul64(x, r1, r2, "half"), torch.float32, "half via rotate")
    y = torch_npu.npu_rotary_mul(*args, "interleave", swap.npu())
    assert_close_to_reference(y, r1 * x + r2 * (x @ swap.double()), torch.float32, "x @ rotate")
    leaf = args[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="npu_rotary_mul.*rotate"):
        torch_npu.npu_rotary_mul(leaf, args[1], args[2], "half", rotate.npu()).sum().backward()


def test_rotary_mul_backward_is_an_op_of_its_own():
    x, r1, r2 = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    dy = torch.randn(1, 2, 3, 8)
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(dy.npu(), x.npu(), r1.npu(), r2.npu(), "half")
    refs = [t.double().requires_grad_() for t in (x, r1, r2)]
    grads_ref = torch.autograd.grad(rotary_mul64(*refs, "half"), refs, dy.double())
    for grad, grad_ref in zip((dx, dr1, dr2), grads_ref):
        assert_close_to_reference(grad, grad_ref, torch.float32, "grad")


def test_rotary_mul_refuses_what_the_kernel_refuses():
    x = torch.randn(1, 2, 3, 8).npu()
    r = torch.randn(1, 2, 1, 8).npu()
    with pytest.raises(ValueError, match="npu_rotary_mul.*rotary_mode"):
        torch_npu.npu_rotary_mul(x, r, r, "quarter")
    with pytest.raises(ValueError, match="npu_rotary_mul.*4-dim"):
        torch_npu.npu_rotary_mul(x[0], r[0], r[0])
    with pytest.raises(ValueError, match="npu_rotary_mul.*broadcast"):
        torch_npu.npu_rotary_mul(x, torch.randn(1, 3, 1, 8).npu(), torch.randn(1, 3, 1, 8).npu())
    per_batch = torch.randn(1, 2, 3, 8).npu()
    torch_npu.npu_rotary_mul(x, per_batch, per_batch)  # BNSD with a BNSD table: half mode only
    with pytest.raises(ValueError, match="npu_rotary_mul.*'interleave' mode.*11SD"):
        torch_npu.npu_rotary_mul(x, per_batch, per_batch, "interleave")


def test_rotary_mul_golden_run_is_the_cpu_kernel():
    x = torch.randn(1, 2, 3, 16).half()
    r1, r2 = (torch.randn(1, 1, 3, 16).half() for _ in range(2))
    with numerics.golden():
        golden = torch_npu.npu_rotary_mul(x.npu(), r1.npu(), r2.npu(), "interleave").cpu()
    assert torch.equal(golden, torch_npu.npu_rotary_mul(x, r1, r2, "interleave"))


def test_rotary_mul_under_autocast_and_compile():
    x = torch.randn(2, 4, 3, 16).npu()
    angles = torch.randn(1, 4, 1, 16).npu()
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(x, torch.randn(16, 16).npu())
        y = torch_npu.npu_rotary_mul(h, angles.cos(), angles.sin())  # fp16 activations, fp32 cos/sin
    assert y.dtype == torch.float16
    expected = rotary_mul64(h.cpu().double(), angles.cos().cpu().double(), angles.sin().cpu().double(), "half")
    assert_close_to_reference(y, expected, torch.float16, "y")

    def f(t, c, s):
        return (torch_npu.npu_rotary_mul(t, c, s) * torch_npu.npu_rotary_mul(t, c, s, "interleave")).sum()

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    leaves_c = [t.clone().requires_grad_() for t in (x, angles.cos(), angles.sin())]
    leaves_e = [t.clone().requires_grad_() for t in (x, angles.cos(), angles.sin())]
    compiled(*leaves_c).backward()
    f(*leaves_e).backward()
    for c, e in zip(leaves_c, leaves_e):
        torch.testing.assert_close(c.grad.cpu(), e.grad.cpu())


# ---- npu_apply_rotary_pos_emb ---------------------------------------------------------------------

@pytest.fixture
def atlas_350(monkeypatch):
    """Emulate an Atlas 350 (its ApplyRotaryPosEmb takes every layout and mode)."""
    from npukit.npu_backend import npu

    monkeypatch.setattr(npu, "CHIP_NAME", "Ascend950PR")


# layout -> (query shape, key shape, cos shape): B=2, S=6, Nq=4, Nk=2, D=64 (T=12 for TND)
APPLY_LAYOUTS = {
    "BSND": ((2, 6, 4, 64), (2, 6, 2, 64), (2, 6, 1, 64)),
    "SBND": ((6, 2, 4, 64), (6, 2, 2, 64), (6, 2, 1, 64)),
    "BNSD": ((2, 4, 6, 64), (2, 2, 6, 64), (2, 1, 6, 64)),
    "TND": ((12, 4, 64), (12, 2, 64), (12, 1, 64)),
}


def check_apply_rotary(layout, mode, dtype=torch.float32):
    torch.manual_seed(2)
    q_shape, k_shape, c_shape = APPLY_LAYOUTS[layout]
    q, k = torch.randn(q_shape, dtype=torch.float64), torch.randn(k_shape, dtype=torch.float64)
    angles = torch.randn(c_shape, dtype=torch.float64)
    low = [t.to(dtype) for t in (q, k, angles.cos(), angles.sin())]
    q_npu, k_npu, cos, sin = (t.npu() for t in low)
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(q_npu, k_npu, cos, sin, layout=layout, rotary_mode=mode)
    assert q_out is q_npu and k_out is k_npu  # "直接对结果执行原地更新"
    q64, k64, cos64, sin64 = (t.double() for t in low)
    assert_close_to_reference(q_npu, rotary_mul64(q64, cos64, sin64, mode), dtype, "query")
    assert_close_to_reference(k_npu, rotary_mul64(k64, cos64, sin64, mode), dtype, "key")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_pos_emb_updates_query_and_key_in_place(layout, dtype):
    check_apply_rotary(layout, "half", dtype)


@pytest.mark.parametrize("layout", list(APPLY_LAYOUTS))
@pytest.mark.parametrize("mode", ["half", "interleave", "quarter"])
def test_apply_rotary_pos_emb_every_layout_and_mode_on_atlas_350(atlas_350, layout, mode):
    check_apply_rotary(layout, mode)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_apply_rotary_pos_emb_partial_rotary_dim_on_atlas_350(atlas_350, dtype):
    q, k = torch.randn(2, 6, 4, 16, dtype=torch.float64), torch.randn(2, 6, 4, 16, dtype=torch.float64)
    angles = torch.randn(1, 6, 1, 8, dtype=torch.float64)  # cos/sin: B of 1 and D below the head dim
    low = [t.to(dtype) for t in (q, k, angles.cos(), angles.sin())]
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(*(t.npu() for t in low))
    ref_q = torch.cat((rotary_mul64(low[0][..., :8].double(), low[2].double(), low[3].double(), "half"),
                       low[0][..., 8:].double()), -1)
    assert q_out.dtype == dtype
    assert_close_to_reference(q_out, ref_q, dtype, "query")


def test_apply_rotary_pos_emb_refuses_what_atlas_a2_refuses():
    q = torch.randn(2, 6, 4, 64).npu()
    c = torch.randn(2, 6, 1, 64).npu()
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*BSND or TND.*Atlas A2"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c, c, layout="SBND")
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*'half'"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c, c, rotary_mode="interleave")
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*64 or 128"):
        torch_npu.npu_apply_rotary_pos_emb(q[..., :32], q[..., :32].clone(), c[..., :32], c[..., :32])
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*must match query"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c[:1], c[:1])
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*same dtype"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c.half(), c.half())


def test_apply_rotary_pos_emb_refuses_bad_arguments(atlas_350):
    q = torch.randn(2, 6, 4, 16).npu()
    c = torch.randn(2, 6, 1, 16).npu()
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*layout"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c, c, layout="BHSD")
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*rotary_mode"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), c, c, rotary_mode="full")
    with pytest.raises(ValueError, match="npu_apply_rotary_pos_emb.*head dim"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), q, q)
    projected = q.clone().requires_grad_() * 2  # an activation (a leaf that requires grad cannot be updated)
    q_out, _ = torch_npu.npu_apply_rotary_pos_emb(projected, q.clone(), c, c)
    with pytest.raises(NotImplementedError, match="derivative for torch_npu.npu_apply_rotary_pos_emb"):
        q_out.sum().backward()


# ---- npu_mrope -----------------------------------------------------------------------------------

def mrope64(positions, x, cache, head_size, section, rotary_mode, cache_mode):
    """Each head's first rotary_dim features as rotary_dim / 2 pairs, pair j rotated by the cache's
    cos/sin at column j of the row of the position its section names."""
    rotary_dim = cache.shape[1]
    half = rotary_dim // 2
    j = torch.arange(half)
    if positions.dim() == 1:
        rows = positions[None, :].expand(half, -1)
    else:
        if cache_mode == "default":
            which = (j >= section[0]).long() + (j >= section[0] + section[1]).long()
        else:  # t, h, w interleaved: h at j = 1 mod 3 below 3 * section[1], w at 2 mod 3 below 3 * section[2]
            which = torch.zeros(half, dtype=torch.long)
            which[(j % 3 == 1) & (j < 3 * section[1])] = 1
            which[(j % 3 == 2) & (j < 3 * section[2])] = 2
        rows = positions[which]  # (half, tokens)
    cos = cache[rows, j[:, None]].T.double()  # (tokens, half)
    sin = cache[rows, half + j[:, None]].T.double()
    heads = x.double().reshape(x.shape[0], -1, head_size)
    rot = heads[..., :rotary_dim]
    if rotary_mode == "half":
        first, second = rot[..., :half], rot[..., half:]
    else:
        first, second = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out1, out2 = first * c - second * s, second * c + first * s
    if rotary_mode == "half":
        rotated = torch.cat((out1, out2), -1)
    else:
        rotated = torch.stack((out1, out2), -1).reshape(rot.shape)
    return torch.cat((rotated, heads[..., rotary_dim:]), -1).reshape(x.shape)


@pytest.mark.parametrize("rotary_mode", ["half", "interleave"])
@pytest.mark.parametrize("cache_mode", ["default", "interleave"])
@pytest.mark.parametrize("mrope", [False, True])
def test_mrope_against_fp64(rotary_mode, cache_mode, mrope):
    torch.manual_seed(4)
    tokens, head_size, rotary_dim, max_seq = 7, 48, 32, 20
    query, key = torch.randn(tokens, 4 * head_size), torch.randn(tokens, 2 * head_size)
    cache = torch.randn(max_seq, rotary_dim)
    section = [6, 5, 5] if mrope else None
    positions = torch.randint(0, max_seq, (3, tokens) if mrope else (tokens,))
    q_out, k_out = torch_npu.npu_mrope(positions.npu(), query.npu(), key.npu(), cache.npu(), head_size,
                                       mrope_section=section, rotary_mode=rotary_mode, cache_mode=cache_mode)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    assert_close_to_reference(q_out, mrope64(positions, query, cache, head_size, section, rotary_mode, cache_mode),
                              torch.float32, "query")
    assert_close_to_reference(k_out, mrope64(positions, key, cache, head_size, section, rotary_mode, cache_mode),
                              torch.float32, "key")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mrope_low_precision_and_golden(dtype):
    tokens, head_size = 5, 64
    positions = torch.arange(tokens).repeat(3, 1)
    query, key = (torch.randn(tokens, 2 * head_size).to(dtype) for _ in range(2))
    cache = torch.randn(8, head_size).to(dtype)
    args = (head_size,)
    kwargs = {"mrope_section": [16, 8, 8]}
    q_out, _ = torch_npu.npu_mrope(positions.npu(), query.npu(), key.npu(), cache.npu(), *args, **kwargs)
    assert q_out.dtype == dtype
    expected = mrope64(positions, query, cache, head_size, [16, 8, 8], "half", "default")
    assert_close_to_reference(q_out, expected, dtype, "query")
    with numerics.golden():
        golden = torch_npu.npu_mrope(positions.npu(), query.npu(), key.npu(), cache.npu(), *args, **kwargs)[0]
    assert torch.equal(golden.cpu(), torch_npu.npu_mrope(positions, query, key, cache, *args, **kwargs)[0])


def test_mrope_refuses_bad_sections():
    positions = torch.arange(4).repeat(3, 1).npu()
    query = torch.randn(4, 64).npu()
    cache = torch.randn(8, 32).npu()
    with pytest.raises(ValueError, match="npu_mrope.*mrope_section"):
        torch_npu.npu_mrope(positions, query, query, cache, 32, mrope_section=[8, 4, 3])
    with pytest.raises(ValueError, match="npu_mrope.*multiple of 16"):
        torch_npu.npu_mrope(positions[0], query, query, torch.randn(8, 24).npu(), 32)
    q_out, _ = torch_npu.npu_mrope(positions[0], query.clone().requires_grad_(), query, cache, 32)
    with pytest.raises(NotImplementedError, match="derivative for torch_npu.npu_mrope"):
        q_out.sum().backward()


def test_mrope_under_compile_equals_eager():
    positions = torch.arange(6).npu()
    query, key, cache = torch.randn(6, 64).npu(), torch.randn(6, 32).npu(), torch.randn(10, 32).npu()

    def f(p, q, k, c):
        q_out, k_out = torch_npu.npu_mrope(p, q, k, c, 32)
        return q_out.sum() + k_out.sum()

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    torch.testing.assert_close(compiled(positions, query, key, cache).cpu(), f(positions, query, key, cache).cpu())


def test_apply_rotary_pos_emb_op_is_functional_and_compiles_as_the_in_place_update():
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)
    angles = torch.randn(1, 4, 1, 64)
    q_npu, k_npu, cos, sin = q.npu(), k.npu(), angles.cos().npu(), angles.sin().npu()
    q_out, k_out = torch.ops.npu.npu_apply_rotary_pos_emb(q_npu, k_npu, cos, sin)  # the op, as its schema says
    assert torch.equal(q_npu.cpu(), q) and torch.equal(k_npu.cpu(), k)

    def f(a, b, c, s):
        a_out, b_out = torch_npu.npu_apply_rotary_pos_emb(a, b, c, s)
        return a_out + b_out

    compiled = torch.compile(f, backend="npu", fullgraph=True)
    q_c, k_c = q.npu(), k.npu()
    result = compiled(q_c, k_c, cos, sin)
    torch.testing.assert_close(q_c.cpu(), q_out.cpu())  # query and key updated in place, compiled too
    torch.testing.assert_close(k_c.cpu(), k_out.cpu())
    torch.testing.assert_close(result.cpu(), (q_out + k_out).cpu())


def test_rotary_mul_fp16_rounds_once_like_the_kernel():
    """fp16 in, fp32 inside, one rounding: the fp64 result rounded to fp16 (but for the rare tie of
    an fp32 sum), where an fp16 decomposition rounds each product and the sum."""
    torch.manual_seed(6)
    x = (torch.randn(2, 16, 4, 64) * 4).half()
    angles = torch.randn(1, 16, 1, 64)
    cos, sin = angles.cos().half(), angles.sin().half()
    y = torch_npu.npu_rotary_mul(x.npu(), cos.npu(), sin.npu()).cpu()
    exact = rotary_mul64(x.double(), cos.double(), sin.double(), "half").half()
    unfused = x * cos + rotate_half64(x) * sin
    assert (y != exact).float().mean() < 0.001
    assert (unfused != exact).float().mean() > 0.05
