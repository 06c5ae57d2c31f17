"""Rotary position embedding: npu_rotary_mul (+ npu_rotary_mul_backward), npu_apply_rotary_pos_emb
and npu_mrope.

Every mode computes `x * cos + rotate(x) * sin` (torch_npu's docs), with
- 'half' (GPT-NeoX): rotate(x) = cat(-x2, x1) for the two halves of the last dim;
- 'interleave' (GPT-J): the pairs (x[2i], x[2i+1]) become (-x[2i+1], x[2i]);
- 'quarter' (npu_apply_rotary_pos_emb): the half rotation in each half of the last dim,
  cat(-x2, x1, -x4, x3) for its four quarters.
The kernels read fp16/bf16 inputs, compute in fp32 and round the result once to the input dtype.
torch_npu defines a backward for npu_rotary_mul only; npu_apply_rotary_pos_emb and npu_mrope are
inference kernels and raise when backpropagated through, as on the device.
"""

from __future__ import annotations

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.fused import fused_op, register_autograd, register_no_derivative, upcast
from npukit.npu_backend.fused.norms import check_float_dtypes

ROTARY_MUL_MODES = ("half", "interleave")
APPLY_ROTARY_MODES = ("half", "interleave", "quarter")
# npu_apply_rotary_pos_emb's layouts: where the head axis N is (cos/sin have 1 there).
APPLY_ROTARY_LAYOUTS = {"BSND": 2, "SBND": 2, "BNSD": 1, "TND": 1}


def rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    """rotate(x) of `x * cos + rotate(x) * sin` along the last dim."""
    if mode == "quarter":
        return rotate(x.unflatten(-1, (2, -1)), "half").flatten(-2)
    first, second = _pair_halves(x, mode)
    return torch.stack((-second, first), -2 if mode == "half" else -1).flatten(-2)


def _pair_halves(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of every rotated pair: the two halves ('half') or the even and odd features
    ('interleave') of the last dim (views)."""
    if mode == "half":
        return x.chunk(2, -1)
    return x[..., 0::2], x[..., 1::2]


def rotary_embed(x32: torch.Tensor, cos32: torch.Tensor, sin32: torch.Tensor, mode: str) -> torch.Tensor:
    """x * cos + rotate(x) * sin, each pair (x1, x2) written as (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2):
    two passes into one new tensor, where a rotated copy, two products and a sum would take five."""
    if mode == "quarter":  # the half rotation within each half of the last dim
        halves = [t.unflatten(-1, (2, -1)) for t in (x32, cos32, sin32)]
        return rotary_embed(*halves, "half").flatten(-2)
    shape = torch.broadcast_shapes(x32.shape, cos32.shape, sin32.shape)
    out = torch.empty(shape, dtype=torch.promote_types(x32.dtype, cos32.dtype), device=x32.device)
    x1, x2 = _pair_halves(x32, mode)
    c1, c2 = _pair_halves(cos32, mode)
    s1, s2 = _pair_halves(sin32, mode)
    o1, o2 = _pair_halves(out, mode)
    torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1)
    torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    return out


# ---- npu_rotary_mul ------------------------------------------------------------------------------

def _check_rotary_mul(op: str, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> None:
    check_float_dtypes(op, input=x, r1=r1, r2=r2)
    if mode not in ROTARY_MUL_MODES:
        raise ValueError(f"torch_npu.{op}: rotary_mode must be 'half' or 'interleave', got {mode!r}")
    for what, tensor in (("input", x), ("r1", r1), ("r2", r2)):
        if tensor.dim() != 4:
            raise ValueError(f"torch_npu.{op}: {what} must be a 4-dim tensor (BNSD, BSND or SBND), "
                             f"got shape {tuple(tensor.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"torch_npu.{op}: the input's last dim D={x.shape[-1]} must be even")
    if r1.shape != r2.shape:
        raise ValueError(f"torch_npu.{op}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have the same shape")
    if any(r not in (1, n) for r, n in zip(r1.shape, x.shape)) or r1.shape[-1] != x.shape[-1]:
        raise ValueError(f"torch_npu.{op}: r1/r2 of shape {tuple(r1.shape)} do not broadcast to the input's "
                         f"shape {tuple(x.shape)} (each dim 1 or the input's, the last dim D the input's)")
    if mode == "interleave" and sum(size > 1 for size in r1.shape[:3]) > 1:
        raise ValueError(f"torch_npu.{op}: in 'interleave' mode r1/r2 must be 11SD, 1S1D or S11D (one table "
                         f"broadcast over batch and heads), got shape {tuple(r1.shape)}")


def _rotary_mul_fake(x, r1, r2, rotary_mode="half", rotation=None):
    _check_rotary_mul("npu_rotary_mul", x, r1, r2, rotary_mode)
    return x.new_empty(x.shape)


@fused_op("npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
          unfused="x * cos + torch.cat((-x2, x1), -1) * sin  (rotate_half; interleave: pairs rotated)",
          fake=_rotary_mul_fake)
def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotation=None):
    _check_rotary_mul("npu_rotary_mul", x, r1, r2, rotary_mode)
    if rotation is None:
        # one pass in C++ (csrc/fused_kernels_impl.h): fp16/bf16 read, rotary_embed's fp32 arithmetic in
        # registers, rounded once; bit for bit rotary_embed on fp32 working copies
        return _C.rotary_mul(x, r1, r2, rotary_mode == "interleave", x.dtype)
    d = x.shape[-1]
    if rotation.shape != (d, d):
        raise ValueError(f"torch_npu.npu_rotary_mul: rotate must be a ({d}, {d}) matrix for the input's last "
                         f"dim, got shape {tuple(rotation.shape)}")
    # The developer-built rotation matrix (argument `rotate`): rotate(x) = x @ rotate, exact since its
    # entries are 0 and +-1.
    x32 = upcast(x)
    rotated = torch.matmul(x32, rotation.to(x32.dtype))
    return (x32 * upcast(r1) + rotated * upcast(r2)).to(x.dtype)


def _rotary_mul_backward_fake(grad, x, r1, r2, rotary_mode="half"):
    _check_rotary_mul("npu_rotary_mul_backward", x, r1, r2, rotary_mode)
    return x.new_empty(x.shape), r1.new_empty(r1.shape, dtype=x.dtype), r2.new_empty(r2.shape, dtype=x.dtype)


@fused_op("npu_rotary_mul_backward(Tensor grad, Tensor input, Tensor r1, Tensor r2, str rotary_mode='half') "
          "-> (Tensor, Tensor, Tensor)",
          unfused="autograd of npu_rotary_mul's decomposition", public=False, fake=_rotary_mul_backward_fake)
def npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    _check_rotary_mul("npu_rotary_mul_backward", x, r1, r2, rotary_mode)
    if grad.shape != x.shape:
        raise ValueError(f"torch_npu.npu_rotary_mul_backward: grad's shape {tuple(grad.shape)} must be the "
                         f"input's {tuple(x.shape)}")
    dx = _rotary_input_grad(grad, r1, r2, rotary_mode, x.dtype)
    dy, x32 = upcast(grad), upcast(x)
    # r1/r2 broadcast over batch/heads: their gradients sum over the broadcast dims.
    dr1 = (dy * x32).sum_to_size(r1.shape)
    dr2 = (dy * rotate(x32, rotary_mode)).sum_to_size(r2.shape)
    return dx, dr1.to(x.dtype), dr2.to(x.dtype)


def _rotary_input_grad(dy: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str,
                       dtype: torch.dtype) -> torch.Tensor:
    """dx = dy * r1 + rotate^T(dy * r2), rotate^T mapping a pair (g1, g2) to (g2, -g1): per pair
    (dy1 cos1 + dy2 sin2, dy2 cos2 - dy1 sin1), the forward's kernel with sin's pair members swapped
    and negated (sin is the small broadcast table, usually), rounded once to `dtype`."""
    first, second = _pair_halves(upcast(r2), mode)
    swapped_sin = torch.stack((-second, -first), -2 if mode == "half" else -1).flatten(-2)
    return _C.rotary_mul(dy, r1, swapped_sin, mode == "interleave", dtype)


def _rotary_mul_setup(ctx, inputs, output):
    x, r1, r2, mode, rotation = inputs
    ctx.mode = mode
    ctx.has_rotate = rotation is not None
    ctx.save_for_backward(x, r1, r2)


def _rotary_mul_backward(ctx, dy):
    if ctx.has_rotate:
        raise RuntimeError("torch_npu.npu_rotary_mul: the rotate matrix does not support backpropagation "
                           "(torch_npu's docs); call it without rotate where gradients are needed")
    x, r1, r2 = ctx.saved_tensors
    if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
        # the usual case, constant cos/sin tables: the grad op's table gradients (a product and a
        # reduction over the whole input each) would be computed to be dropped
        return _rotary_input_grad(dy, r1, r2, ctx.mode, x.dtype), None, None, None, None
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(dy, x, r1, r2, ctx.mode)
    return dx, dr1, dr2, None, None


register_autograd("npu_rotary_mul", _rotary_mul_backward, _rotary_mul_setup)


# ---- npu_apply_rotary_pos_emb --------------------------------------------------------------------

def _apply_rotary(x32: torch.Tensor, cos32: torch.Tensor, sin32: torch.Tensor, mode: str) -> torch.Tensor:
    """rotary_embed over the first cos.shape[-1] features (the rest pass through)."""
    rotary_dim = cos32.shape[-1]
    if rotary_dim == x32.shape[-1]:
        return rotary_embed(x32, cos32, sin32, mode)
    return torch.cat((rotary_embed(x32[..., :rotary_dim], cos32, sin32, mode), x32[..., rotary_dim:]), -1)


def _atlas_350() -> bool:
    """Is the emulated chip an Atlas 350 (Ascend950)? Its ApplyRotaryPosEmb takes every layout and mode
    and partial rotary dims; Atlas A2/A3 (the default Ascend910B2) take BSND/TND, 'half', D 64 or 128."""
    from npukit.npu_backend import npu

    return npu.CHIP_NAME.startswith("Ascend950")


def _check_apply_rotary(query, key, cos, sin, layout, rotary_mode):
    check_float_dtypes("npu_apply_rotary_pos_emb", query=query, key=key, cos=cos, sin=sin)
    op = "torch_npu.npu_apply_rotary_pos_emb"
    if len({t.dtype for t in (query, key, cos, sin)}) != 1:
        raise ValueError(f"{op}: query, key, cos and sin must have the same dtype, got "
                         f"{query.dtype}, {key.dtype}, {cos.dtype}, {sin.dtype}")
    if not _atlas_350():
        chip = "on Atlas A2/A3 (the emulated chip; NPUKIT_CHIP=Ascend950... emulates an Atlas 350, which takes more)"
        if layout not in ("BSND", "TND") or rotary_mode != "half":
            raise ValueError(f"{op}: layout must be BSND or TND and rotary_mode 'half' {chip}, got layout "
                             f"{layout!r} and rotary_mode {rotary_mode!r}")
        if query.shape[-1] not in (64, 128) or cos.shape[-1] != query.shape[-1]:
            raise ValueError(f"{op}: the head dim D of query, key, cos and sin must be 64 or 128 {chip}, got "
                             f"{query.shape[-1]} and cos/sin {cos.shape[-1]}")
        leading = query.shape[:-2]  # (B, S) or (T,): cos/sin do not broadcast there
        if cos.shape[:-2] != leading:
            raise ValueError(f"{op}: cos/sin {tuple(cos.shape)} must match query {tuple(query.shape)} in every "
                             f"dim but N (which is 1) and D {chip}")
    if layout not in APPLY_ROTARY_LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {', '.join(APPLY_ROTARY_LAYOUTS)}, got {layout!r}")
    if rotary_mode not in APPLY_ROTARY_MODES:
        raise ValueError(f"{op}: rotary_mode must be one of {', '.join(APPLY_ROTARY_MODES)}, got {rotary_mode!r}")
    dims = 3 if layout == "TND" else 4
    for what, tensor in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if tensor.dim() != dims:
            raise ValueError(f"{op}: {what} must have {dims} dims for layout {layout}, got shape {tuple(tensor.shape)}")
    head_axis = APPLY_ROTARY_LAYOUTS[layout]
    other = [i for i in range(dims) if i != head_axis]
    if [query.shape[i] for i in other] != [key.shape[i] for i in other]:
        raise ValueError(f"{op}: query {tuple(query.shape)} and key {tuple(key.shape)} may differ in the head "
                         f"dim N only (layout {layout})")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.shape[head_axis] != 1:
        raise ValueError(f"{op}: cos/sin must have 1 in the head dim N (layout {layout}), got {tuple(cos.shape)}")
    for i in other[:-1]:
        if cos.shape[i] not in (1, query.shape[i]):
            raise ValueError(f"{op}: cos/sin of shape {tuple(cos.shape)} do not broadcast to query's "
                             f"{tuple(query.shape)} (layout {layout})")
    rotary_dim, head_dim = cos.shape[-1], query.shape[-1]
    if rotary_dim > head_dim:
        raise ValueError(f"{op}: cos/sin's last dim {rotary_dim} exceeds the head dim D={head_dim}")
    multiple = 4 if rotary_mode == "quarter" else 2
    if rotary_dim % multiple:
        raise ValueError(f"{op}: the rotary dim {rotary_dim} must be a multiple of {multiple} for rotary_mode "
                         f"{rotary_mode!r}")


def _apply_rotary_pos_emb_out_of_place(query, key, cos, sin, layout, rotary_mode):
    _check_apply_rotary(query, key, cos, sin, layout, rotary_mode)
    cos32, sin32 = upcast(cos), upcast(sin)
    q_out = _apply_rotary(upcast(query), cos32, sin32, rotary_mode).to(query.dtype)
    k_out = _apply_rotary(upcast(key), cos32, sin32, rotary_mode).to(key.dtype)
    return q_out, k_out


@fused_op("npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', "
          "str rotary_mode='half') -> (Tensor, Tensor)",
          unfused="q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin (written into q and k)")
def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    """The op itself is functional, as its schema says (and as torch_npu's graph mode runs it);
    torch_npu.npu_apply_rotary_pos_emb is `apply_rotary_pos_emb_in_place`."""
    return _apply_rotary_pos_emb_out_of_place(query, key, cos, sin, layout, rotary_mode)


def apply_rotary_pos_emb_in_place(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    """torch_npu.npu_apply_rotary_pos_emb: eager, the kernel writes the results into query and key and
    returns them (torch_npu's docs: "直接对结果执行原地更新") although its schema declares no mutation.
    The copy is made here, in sight of autograd and torch.compile (which trace it as the mutation of
    query and key it is), rather than hidden inside the op."""
    q_out, k_out = torch.ops.npu.npu_apply_rotary_pos_emb(query, key, cos, sin, layout, rotary_mode)
    query.copy_(q_out)
    key.copy_(k_out)
    return query, key


register_no_derivative("npu_apply_rotary_pos_emb")


# ---- npu_mrope -----------------------------------------------------------------------------------

MROPE_CACHE_MODES = ("default", "interleave")


def _mrope_cos_sin(positions, cos_sin_cache, mrope_section, cache_mode):
    """cos and sin (each rotary_dim / 2 wide) of every token: the cache's row at its position; in
    mrope mode (3 position rows: temporal, height, width) each frequency takes the row its section
    says, the sections contiguous ('default') or interleaved t, h, w, t, h, w ... ('interleave')."""
    cos, sin = cos_sin_cache[positions].chunk(2, -1)
    if positions.dim() == 1:
        return cos, sin
    if cache_mode == "default":
        bounds = [0, mrope_section[0], mrope_section[0] + mrope_section[1], sum(mrope_section)]
        # A loop over the three sections of the argument, not over data.
        return tuple(torch.cat([t[i, :, bounds[i]:bounds[i + 1]] for i in range(3)], -1) for t in (cos, sin))
    selected = []
    for t in (cos, sin):
        merged = t[0].clone()
        for row in (1, 2):
            merged[..., row:mrope_section[row] * 3:3] = t[row, ..., row:mrope_section[row] * 3:3]
        selected.append(merged)
    return tuple(selected)


def _check_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section, rotary_mode, cache_mode):
    check_float_dtypes("npu_mrope", query=query, key=key, cos_sin_cache=cos_sin_cache)
    op = "torch_npu.npu_mrope"
    if rotary_mode not in ROTARY_MUL_MODES:
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if cache_mode not in MROPE_CACHE_MODES:
        raise ValueError(f"{op}: cache_mode must be 'default' or 'interleave', got {cache_mode!r}")
    if positions.dtype not in (torch.int32, torch.int64) or positions.dim() not in (1, 2):
        raise ValueError(f"{op}: positions must be an int32/int64 tensor of shape (num_tokens,) or "
                         f"(3, num_tokens), got {positions.dtype} {tuple(positions.shape)}")
    if positions.dim() == 2 and positions.shape[0] != 3:
        raise ValueError(f"{op}: mrope positions must have 3 rows (temporal, height, width), got "
                         f"{tuple(positions.shape)}")
    for what, tensor in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if tensor.dim() != 2:
            raise ValueError(f"{op}: {what} must be 2-dim, got shape {tuple(tensor.shape)}")
    num_tokens = positions.shape[-1]
    for what, tensor in (("query", query), ("key", key)):
        if tensor.shape[0] != num_tokens or head_size <= 0 or tensor.shape[1] % head_size:
            raise ValueError(f"{op}: {what} must be (num_tokens={num_tokens}, num_heads * head_size={head_size}), "
                             f"got {tuple(tensor.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    multiple = 16 if query.dtype == torch.float32 else 32
    if rotary_dim > head_size or rotary_dim % multiple:
        raise ValueError(f"{op}: the rotary dim (cos_sin_cache's dim 1) {rotary_dim} must be at most head_size "
                         f"{head_size} and a multiple of {multiple} for {query.dtype}")
    section = list(mrope_section) if mrope_section is not None else [0, 0, 0]
    if positions.dim() == 2:
        if len(section) != 3 or sum(section) != rotary_dim // 2 or min(section) < 0:
            raise ValueError(f"{op}: mrope mode (2-dim positions) needs mrope_section of 3 sizes summing to "
                             f"rotary_dim / 2 = {rotary_dim // 2}, got {mrope_section}")
    elif any(section):
        raise ValueError(f"{op}: mrope_section {mrope_section} needs (3, num_tokens) positions; rope mode "
                         "(1-dim positions) takes none or [0, 0, 0]")
    return section


def _mrope_rotate(x, cos, sin, head_size, mode):
    heads = x.reshape(x.shape[0], -1, head_size)
    x32 = upcast(heads)
    # Each rotary pair (x1, x2) with its frequency's cos/sin: (x1 cos - x2 sin, x2 cos + x1 sin).
    if mode == "half":
        cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos_full, sin_full = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    rotated = _apply_rotary(x32, cos_full.unsqueeze(1), sin_full.unsqueeze(1), mode)
    return rotated.to(x.dtype).reshape(x.shape)


@fused_op("npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, *, "
          "int[]? mrope_section=None, str? rotary_mode='half', str? cache_mode='default') -> (Tensor, Tensor)",
          unfused="cos, sin = cos_sin_cache[positions].chunk(2, -1); rotary embedding of each head of query and key")
def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None, rotary_mode="half",
              cache_mode="default"):
    rotary_mode = rotary_mode or "half"
    cache_mode = cache_mode or "default"
    section = _check_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section, rotary_mode, cache_mode)
    cos, sin = _mrope_cos_sin(positions, upcast(cos_sin_cache), section, cache_mode)
    return (_mrope_rotate(query, cos, sin, head_size, rotary_mode),
            _mrope_rotate(key, cos, sin, head_size, rotary_mode))


register_no_derivative("npu_mrope")


# Plain attributes of torch_npu (the shim sets them after the ops).
TORCH_NPU_ATTRIBUTES = {"npu_apply_rotary_pos_emb": apply_rotary_pos_emb_in_place}
