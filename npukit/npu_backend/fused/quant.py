"""Quantization: npu_dynamic_quant, npu_dynamic_quant_asymmetric, npu_quantize, npu_anti_quant,
npu_trans_quant_param, npu_convert_weight_to_int4pack, npu_quant_matmul and
npu_weight_quant_batchmatmul.

Integer semantics follow torch_npu's op docs and the CANN operators behind them:
- float -> integer conversions round half to even (the vector unit's default CAST_RINT) and
  saturate to the output type's range;
- int8 x int8 (and int4 x int4) matmuls accumulate exactly in int32 (an integer matmul, no float
  accumulation), then dequantize in fp32 (`out = (x1 @ x2 + bias_int32) * scale * pertoken_scale
  + offset`, or `+ bias` after the scales for a float bias) and round once to the output dtype;
- an int64 `scale` is the hardware word `npu_trans_quant_param` makes: the fp32 scale truncated to
  its upper 19 bits (FP19) in bits 0-31, a 9-bit offset in bits 37-45, bit 46 set. The matmul uses
  the FP19 scale, as the hardware does;
- int4 values travel packed 8 to an int32 (torch.quint4x2 as dtype): value i of each group of 8 in
  bits 4i..4i+3, two's complement, the layout `npu_convert_weight_to_int4pack`, `npu_quantize` and
  `npu_dynamic_quant` produce and the matmuls and `npu_anti_quant` read.

dtype arguments are ints in the schemas (c10 ScalarType numbers: torch.int8 is 1, torch.qint8 12,
torch.quint4x2 16 ...); torch.ops accepts a torch.dtype for them, as torch_npu's callers pass.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from npukit.npu_backend.fused import cube_matmul, fused_op, npu_numerics, round_intermediate

# c10 ScalarType numbers (and torch_npu's own float8 numbers) -> what the quant ops produce.
INT4 = "int4"  # packed 8 to an int32
_SCALAR_TYPES = {
    0: torch.uint8, 1: torch.int8, 3: torch.int32, 5: torch.float16, 6: torch.float32, 12: torch.int8,
    13: torch.uint8, 14: torch.int32, 15: torch.bfloat16, 16: INT4, 23: torch.float8_e5m2,
    24: torch.float8_e4m3fn, 291: torch.float8_e5m2, 292: torch.float8_e4m3fn,
}
_NAMES = {0: "torch.uint8", 1: "torch.int8", 3: "torch.int32", 5: "torch.float16", 6: "torch.float32",
          12: "torch.qint8", 13: "torch.quint8", 14: "torch.qint32", 15: "torch.bfloat16",
          16: "torch.quint4x2", 23: "torch.float8_e5m2", 24: "torch.float8_e4m3fn",
          285: "torch_npu.int4", 290: "torch_npu.hifloat8", 291: "torch_npu.float8_e5m2",
          292: "torch_npu.float8_e4m3fn", 296: "torch_npu.float4_e2m1fn_x2"}
_INTEGER_RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255), INT4: (-8, 7),
                  # the largest fp32 values inside int32's range
                  torch.int32: (-2147483648.0, 2147483520.0)}
_FLOAT8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_INT4_SHIFTS = tuple(range(0, 32, 4))


def _dtype_name(code: int | None) -> str:
    return _NAMES.get(code, str(code))


def _target(op: str, argument: str, code: int | None, allowed: tuple[int, ...], default: int):
    code = default if code is None else code
    if code not in allowed:
        names = ", ".join(_dtype_name(c) for c in allowed)
        raise ValueError(f"torch_npu.{op}: {argument}={_dtype_name(code)} is not supported (supported: {names})")
    return _SCALAR_TYPES[code]


def _saturate(values: torch.Tensor, target, in_range: bool = False, in_place: bool = False) -> torch.Tensor:
    """fp32 values -> `target`: round half to even and saturate (integers), or the float8 cast.
    `in_range`: the values are known to lie within the target's range (no clamp needed).
    `in_place`: values is the kernel's own fp32 working tensor, rounded and clamped where it is."""
    if target in _FLOAT8_MAX:
        bound = _FLOAT8_MAX[target]
        if not in_range:
            values = values.clamp_(-bound, bound) if in_place else values.clamp(-bound, bound)
        return values.to(target)
    low, high = _INTEGER_RANGE[target]
    rounded = values.round_() if in_place else torch.round(values)
    if not in_range:
        rounded = rounded.clamp_(low, high) if in_place else rounded.clamp(low, high)
    if target is INT4:
        return pack_int4(rounded.to(torch.int32))
    return rounded.to(target)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], last dim a multiple of 8 -> int32 with 8 nibbles each (value i in
    bits 4i..4i+3)."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    shifts = torch.tensor(_INT4_SHIFTS, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(-1)
    # the 32-bit word as a signed int32 (bit 31 set -> negative)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 words of 8 int4 values -> int8 values, the last dim 8 times longer."""
    shifts = torch.tensor(_INT4_SHIFTS, dtype=torch.int64, device=packed.device)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    values = nibbles - ((nibbles >> 3) << 4)  # two's complement: 8..15 -> -8..-1
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.int8)


def _unpack_int4_matrix(packed: torch.Tensor, op: str, argument: str) -> torch.Tensor:
    """A packed int4 matrix as int8 values: (k, n//8) contiguous, or the transpose of a contiguous
    (n, k//8) (the two layouts the docs accept)."""
    if packed.is_contiguous():
        return unpack_int4(packed)
    if packed.mT.is_contiguous():
        return unpack_int4(packed.mT).mT
    raise ValueError(f"torch_npu.{op}: an int32 (packed int4) {argument} must be contiguous or the transpose "
                     f"of a contiguous tensor")


def decode_quant_param(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int64 scale word of npu_trans_quant_param -> (the FP19 scale as fp32, the 9-bit offset)."""
    low = words & 0xFFFFE000
    scale = (low - ((low >> 31) << 32)).to(torch.int32).view(torch.float32)
    offset = (words >> 37) & 0x1FF
    offset = (offset - ((offset >> 8) << 9)).to(torch.float32)  # 9-bit two's complement
    return scale, offset


def _scale_of(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if scale.dtype == torch.int64:
        return decode_quant_param(scale)
    return scale.float(), None


# ---- npu_trans_quant_param, npu_convert_weight_to_int4pack ----------------------------------------

@fused_op("npu_trans_quant_param(Tensor scale, Tensor? offset=None, int? round_mode=0) -> Tensor",
          unfused="(scale.float().view(torch.int32).long() & 0xFFFFE000) | (1 << 46) | ((offset & 0x1FF) << 37)")
def npu_trans_quant_param(scale, offset=None, round_mode=0):
    op = "npu_trans_quant_param"
    if scale.dtype != torch.float32:
        raise ValueError(f"torch_npu.{op}: scale must be float32, got {scale.dtype}")
    if not (scale.dim() == 1 or (scale.dim() == 2 and scale.shape[0] == 1)):
        raise ValueError(f"torch_npu.{op}: scale must have shape (t,) or (1, n), got {tuple(scale.shape)}")
    if round_mode not in (None, 0, 1):
        raise ValueError(f"torch_npu.{op}: round_mode must be 0 (truncate) or 1 (round), got {round_mode}")
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if round_mode == 1:
        # round the fp32 bit pattern to its upper 19 bits before they are kept
        bits = (bits + 0x1000) & 0xFFFFFFFF
    words = (bits & 0xFFFFE000) | (1 << 46)
    if offset is not None:
        if offset.dtype != torch.float32:
            raise ValueError(f"torch_npu.{op}: offset must be float32, got {offset.dtype}")
        offset_int = torch.round(offset).clamp(-256, 255).to(torch.int64)
        words, offset_int = torch.broadcast_tensors(words, offset_int)
        words = (words & 0x4000FFFFFFFF) | ((offset_int & 0x1FF) << 37)
    return words.contiguous()


@fused_op("npu_convert_weight_to_int4pack(Tensor weight, int inner_k_tiles=0) -> Tensor",
          unfused="8 int4 values of the last dim packed into each int32 (value i in bits 4i..4i+3)")
def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    op = "npu_convert_weight_to_int4pack"
    if weight.dtype != torch.int32 or weight.dim() != 2:
        raise ValueError(f"torch_npu.{op}: weight must be a 2-D int32 tensor of int4 values, got "
                         f"{weight.dim()}-D {weight.dtype}")
    if weight.shape[-1] % 8:
        raise ValueError(f"torch_npu.{op}: the last dim of weight ({weight.shape[-1]}) must be a multiple of 8")
    return pack_int4(weight.contiguous())


# ---- quantize / dequantize -----------------------------------------------------------------------

@fused_op("npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
          "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)",
          unfused="scale = (x * smooth).abs().amax(-1) / 127; y = torch.round(x * smooth / scale[..., None]).to(torch.int8)")
def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    op = "npu_dynamic_quant"
    target = _dynamic_target(op, x, dst_type, quant_mode, (1, 12, 16, 23, 24, 291, 292))
    type_max = float(_FLOAT8_MAX.get(target, _INTEGER_RANGE.get(target, (0, 0))[1]))
    dtype_max = float(dst_type_max) if dst_type_max > 0 else type_max
    values = _smoothed(op, x, smooth_scales, group_index)
    # max |v| as max(max v, -min v): two reductions, no |v| temporary of x's size
    amax = torch.maximum(_reduce(values, quant_mode, torch.amax), _reduce(values, quant_mode, torch.amin).neg_()).abs_()
    scale = amax / dtype_max
    # an all-zero row has scale 0: its values (all 0) are divided by 1 rather than 0
    # |values / scale| <= dtype_max by construction: no clamp unless dst_type_max exceeds the type
    y = _saturate(values.div_(torch.where(scale > 0, scale, torch.ones_like(scale))), target,
                  in_range=dtype_max <= type_max, in_place=True)
    return y, _reduced_shape(scale, quant_mode)


@fused_op("npu_dynamic_quant_asymmetric(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
          "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor, Tensor)",
          unfused="scale = (x.amax(-1) - x.amin(-1)) / 255; offset = 127 - x.amax(-1) / scale; "
                  "y = torch.round(x / scale[..., None] + offset[..., None]).to(torch.int8)")
def npu_dynamic_quant_asymmetric(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                                 dst_type_max=0.0):
    """scale = (rowMax - rowMin) / (DST_MAX - DST_MIN), offset = DST_MAX - rowMax / scale,
    y = round(x / scale + offset) (int8: 127/-128, int4: 7/-8), after the smooth scales."""
    op = "npu_dynamic_quant_asymmetric"
    target = _dynamic_target(op, x, dst_type, quant_mode, (1, 12, 16))
    if dst_type_max:
        raise ValueError(f"torch_npu.{op}: dst_type_max applies to float8 outputs, not {_dtype_name(dst_type)}")
    low, high = _INTEGER_RANGE[target]
    values = _smoothed(op, x, smooth_scales, group_index)
    row_max = _reduce(values, quant_mode, torch.amax)
    row_min = _reduce(values, quant_mode, torch.amin)
    scale = (row_max - row_min) / (high - low)
    # a constant row has scale 0: divided by 1 instead (every value maps to DST_MAX)
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    offset = high - row_max / safe_scale
    y = _saturate(values.div_(safe_scale).add_(offset), target, in_place=True)
    return y, _reduced_shape(scale, quant_mode), _reduced_shape(offset, quant_mode)


def _dynamic_target(op: str, x: torch.Tensor, dst_type, quant_mode: str, allowed: tuple[int, ...]):
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: input must be float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"torch_npu.{op}: input must have at least 2 dims, got {x.dim()}")
    if quant_mode not in ("pertoken", "pertensor", "perchannel"):
        raise ValueError(f"torch_npu.{op}: quant_mode must be 'pertoken', 'pertensor' or 'perchannel', "
                         f"got {quant_mode!r}")
    target = _target(op, "dst_type", dst_type, allowed, 1)
    if target is INT4 and x.shape[-1] % 8:
        raise ValueError(f"torch_npu.{op}: an int4 (torch.quint4x2) output needs the last dim of input "
                         f"({x.shape[-1]}) to be a multiple of 8")
    return target


def _smoothed(op: str, x: torch.Tensor, smooth_scales, group_index) -> torch.Tensor:
    """x in fp32, multiplied by its smooth scales (per MoE expert's rows with group_index): a fresh fp32
    working tensor, which the callers update in place (no further full-size temporaries)."""
    values = x.to(torch.float32, copy=True)
    if smooth_scales is None:
        return values
    if smooth_scales.shape[-1] != x.shape[-1]:
        raise ValueError(f"torch_npu.{op}: smooth_scales' last dim ({smooth_scales.shape[-1]}) must equal "
                         f"input's ({x.shape[-1]})")
    smooth = smooth_scales.float()
    if group_index is None:
        if smooth.dim() != 1:
            raise ValueError(f"torch_npu.{op}: smooth_scales must be 1-D without group_index, got {smooth.dim()}-D")
        return values.mul_(smooth)
    # MoE: rows [group_index[e-1], group_index[e]) use smooth_scales[e]
    if smooth.dim() != 2 or group_index.dim() != 1 or group_index.shape[0] != smooth.shape[0]:
        raise ValueError(f"torch_npu.{op}: with group_index, smooth_scales must be (experts, H) and group_index "
                         f"(experts,)")
    rows = values.reshape(-1, x.shape[-1])
    row_ids = torch.arange(rows.shape[0], device=x.device, dtype=group_index.dtype)
    expert = torch.searchsorted(group_index, row_ids, right=True).clamp_max(smooth.shape[0] - 1)
    return rows.mul_(smooth[expert]).reshape(x.shape)


def _reduce(values: torch.Tensor, quant_mode: str, reduction) -> torch.Tensor:
    """The per-token (last dim), per-channel (second-last dim) or per-tensor reduction, kept
    broadcastable against values."""
    if quant_mode == "pertoken":
        return reduction(values, -1, keepdim=True)
    if quant_mode == "perchannel":
        return reduction(values, -2, keepdim=True)
    return reduction(values.reshape(-1), 0).reshape([1] * values.dim())


def _reduced_shape(param: torch.Tensor, quant_mode: str) -> torch.Tensor:
    """A reduced parameter in the op's output shape: x's shape without its last (pertoken) or
    second-last (perchannel) dim, or (1,) per tensor."""
    if quant_mode == "pertoken":
        return param.squeeze(-1)
    if quant_mode == "perchannel":
        return param.squeeze(-2)
    return param.reshape(1)


def _along_axis(param: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A 1-D per-axis parameter shaped to broadcast against x along `axis`."""
    if param.dim() != 1:
        return param
    return param.reshape([param.shape[0]] + [1] * (x.dim() - 1 - axis))


@fused_op("npu_quantize(Tensor input, Tensor scales, Tensor? zero_points, int dtype, int axis=1, "
          "bool div_mode=True) -> Tensor",
          unfused="torch.round(x / scales + zero_points).clamp(-128, 127).to(torch.int8)")
def npu_quantize(x, scales, zero_points, dtype, axis=1, div_mode=True):
    op = "npu_quantize"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: input must be float32, float16 or bfloat16, got {x.dtype}")
    if div_mode:
        target = _target(op, "dtype", dtype, (1, 12, 13, 0, 3, 14, 23, 24, 291, 292), 12)
        if not -x.dim() <= axis < x.dim():
            raise ValueError(f"torch_npu.{op}: axis={axis} is out of range for a {x.dim()}-D input")
        axis %= x.dim()
    else:
        target = _target(op, "dtype", dtype, (1, 12, 16), 12)
        if axis < -2 or axis >= x.dim():
            raise ValueError(f"torch_npu.{op}: with div_mode=False axis must be in [-2, {x.dim() - 1}], got {axis}")
        # div_mode=False: -2 is the second-last axis, anything above it the last axis
        axis = x.dim() - 2 if axis == -2 else x.dim() - 1
        if target is INT4 and x.shape[-1] % 8:
            raise ValueError(f"torch_npu.{op}: a torch.quint4x2 output needs the last dim of input "
                             f"({x.shape[-1]}) to be a multiple of 8")
    for name, param in (("scales", scales), ("zero_points", zero_points)):
        if param is not None and param.dim() == 1 and param.shape[0] not in (1, x.shape[axis]):
            raise ValueError(f"torch_npu.{op}: {name} has {param.shape[0]} values, input's axis {axis} has "
                             f"{x.shape[axis]}")
    scale = _along_axis(scales.float(), x, axis)
    zero_point = None if zero_points is None else _along_axis(zero_points.float(), x, axis)
    # one fp32 working tensor, updated in place: x's fp32 copy (an fp32 x itself is not written), unless
    # a parameter broadcasts x to a larger shape
    fits = all(p is None or torch.broadcast_shapes(p.shape, x.shape) == x.shape for p in (scale, zero_point))
    if x.dtype == torch.float32 or not fits:
        values = x.float() / scale if div_mode else x.float() * scale
    else:
        values = x.float().div_(scale) if div_mode else x.float().mul_(scale)
    if zero_point is not None:
        values = values.add_(zero_point) if fits else values + zero_point
    return _saturate(values, target, in_place=True)


@fused_op("npu_anti_quant(Tensor x, Tensor scale, *, Tensor? offset=None, int? dst_dtype=None, "
          "int? src_dtype=None) -> Tensor",
          unfused="((x.float() + offset) * scale).to(torch.float16)")
def npu_anti_quant(x, scale, *, offset=None, dst_dtype=None, src_dtype=None):
    op = "npu_anti_quant"
    target = _target(op, "dst_dtype", dst_dtype, (5, 15), 5)
    if src_dtype not in (None, 1, 12, 16, 285):
        raise ValueError(f"torch_npu.{op}: src_dtype={_dtype_name(src_dtype)} is not supported "
                         f"(torch.int8 or torch.quint4x2)")
    if x.dtype == torch.int32:
        if x.dim() == 0:
            raise ValueError(f"torch_npu.{op}: an int32 (packed int4) x cannot be a scalar")
        values = unpack_int4(x)
    elif x.dtype == torch.int8:
        values = x
    else:
        raise ValueError(f"torch_npu.{op}: x must be int8 or int32 (8 packed int4), got {x.dtype}")
    if scale.dim() != 1 or scale.shape[0] not in (1, values.shape[-1]):
        raise ValueError(f"torch_npu.{op}: scale must be 1-D with 1 or {values.shape[-1]} values, got "
                         f"{tuple(scale.shape)}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"torch_npu.{op}: offset must have scale's shape {tuple(scale.shape)}, got "
                         f"{tuple(offset.shape)}")
    return _dequantize_rows(values, scale.float(), None if offset is None else offset.float(), target)


# fp32 elements of the dequantization's working tensor per block: 512 KB, within a core's L2
_DEQUANT_BLOCK_ELEMENTS = 1 << 17


def _dequantize_rows(values: torch.Tensor, scale32: torch.Tensor, offset32: torch.Tensor | None,
                     target: torch.dtype) -> torch.Tensor:
    """((values + offset) * scale) in fp32, rounded once to `target` (scale and offset along the
    last dim). Computed a block of rows at a time in one reused fp32 buffer that stays in cache:
    the same four elementwise passes (int -> fp32, + offset, * scale, round) as on the whole
    tensor, without a fresh fp32 tensor of x's size that each pass streams through memory."""
    rows = values.reshape(-1, values.shape[-1])
    out = torch.empty(rows.shape, dtype=target, device=values.device)
    # traced (fake tensors): one block, no loop over symbolic sizes
    block_rows = rows.shape[0] if is_fake(values) else max(1, _DEQUANT_BLOCK_ELEMENTS // max(1, rows.shape[1]))
    buffer = torch.empty((min(block_rows, rows.shape[0]), rows.shape[1]), dtype=torch.float32, device=values.device)
    for row_block, out_block in zip(rows.split(block_rows), out.split(block_rows)):
        working = buffer[:row_block.shape[0]]
        working.copy_(row_block)
        if offset32 is not None:
            working.add_(offset32)
        out_block.copy_(working.mul_(scale32))
    return out.reshape(values.shape)


# ---- quantized matmuls ---------------------------------------------------------------------------

_QUANT_MATMUL_OUTPUTS = (1, 12, 5, 15, 3)


@fused_op("npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
          "Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, "
          "int? x2_dtype=None, int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, "
          "Tensor? y_scale=None) -> Tensor",
          unfused="((x1.int() @ x2.int() + bias) * scale * pertoken_scale[:, None] + offset).to(output_dtype)")
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    op = "npu_quant_matmul"
    for name, value in (("x1_dtype", x1_dtype), ("x2_dtype", x2_dtype), ("scale_dtype", scale_dtype),
                        ("pertoken_scale_dtype", pertoken_scale_dtype), ("y_scale", y_scale)):
        if value is not None:
            raise NotImplementedError(f"torch_npu.{op}: {name} (float8/float4/hifloat8 and mx quantization) is not "
                                      f"emulated; the emulator supports int8 x int8 and int4 x int4 (int32-packed)")
    if group_sizes is not None and any(group_sizes):
        raise NotImplementedError(f"torch_npu.{op}: group_sizes={list(group_sizes)} (per-block quantization) is not "
                                  f"emulated")
    target = _target(op, "output_dtype", output_dtype, _QUANT_MATMUL_OUTPUTS, 1)
    if x1.dtype != x2.dtype or x1.dtype not in (torch.int8, torch.int32):
        raise ValueError(f"torch_npu.{op}: x1 and x2 must both be int8 or both int32 (8 packed int4), got "
                         f"{x1.dtype} and {x2.dtype}")
    if not (2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6):
        raise ValueError(f"torch_npu.{op}: x1 and x2 must have 2 to 6 dims, got {x1.dim()} and {x2.dim()}")
    if x1.dtype == torch.int32:
        if not x1.is_contiguous():
            raise ValueError(f"torch_npu.{op}: an int32 (packed int4) x1 must be contiguous")
        a, b = unpack_int4(x1), _unpack_int4_matrix(x2, op, "x2")
    else:
        a, b = x1, x2
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"torch_npu.{op}: x1's k ({a.shape[-1]}) does not match x2's ({b.shape[-2]}): "
                         f"x1 {tuple(a.shape)}, x2 {tuple(b.shape)}")
    n = b.shape[-1]
    if scale.dim() != 1 or scale.shape[0] not in (1, n):
        raise ValueError(f"torch_npu.{op}: scale must be 1-D with 1 or n={n} values, got {tuple(scale.shape)}")
    if scale.dtype not in (torch.float32, torch.int64, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: scale must be float32, int64 or bfloat16, got {scale.dtype}")
    if pertoken_scale is not None and (pertoken_scale.dim() != 1 or pertoken_scale.shape[0] != a.shape[-2]):
        raise ValueError(f"torch_npu.{op}: pertoken_scale must be 1-D with m={a.shape[-2]} values, got "
                         f"{tuple(pertoken_scale.shape)}")
    if bias is not None and bias.dtype not in (torch.int32, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: bias must be int32, float32, float16 or bfloat16, got {bias.dtype}")
    # the dtype combinations torch_npu accepts
    if target is torch.int32 and bias is not None and bias.dtype != torch.int32:
        raise ValueError(f"torch_npu.{op}: an int32 output needs an int32 bias, got {bias.dtype}")
    if bias is not None and bias.dtype == torch.bfloat16 and target is not torch.bfloat16:
        raise ValueError(f"torch_npu.{op}: a bfloat16 bias needs output_dtype=torch.bfloat16")
    if bias is not None and bias.dtype == torch.float16 and (pertoken_scale is None or target is not torch.float16):
        raise ValueError(f"torch_npu.{op}: a float16 bias needs pertoken_scale and output_dtype=torch.float16")
    if scale.dtype == torch.bfloat16 and target not in (torch.bfloat16, torch.int32):
        raise ValueError(f"torch_npu.{op}: a bfloat16 scale needs output_dtype torch.bfloat16 or torch.int32")
    if offset is not None and (x1.dtype != torch.int8 or offset.dtype != torch.float32):
        raise ValueError(f"torch_npu.{op}: offset must be float32 and needs int8 x1 and x2")
    # the cube unit's exact int32 accumulation
    accumulator = torch.matmul(a.to(torch.int32), b.to(torch.int32))
    if bias is not None and bias.dtype == torch.int32:
        accumulator = accumulator + bias
    if target is torch.int32:
        return accumulator
    dequant_scale, word_offset = _scale_of(scale)
    y = accumulator.float() * dequant_scale
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    if offset is not None:
        y = y + offset.float()
    elif word_offset is not None and target is torch.int8:
        y = y + word_offset
    return _saturate(y, target) if target is torch.int8 else y.to(target)


def _group_expand(param: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """A per-group (ceil(k / group), n) parameter repeated to one row per k."""
    return param.repeat_interleave(group_size, dim=0)[:k]


@fused_op("npu_weight_quant_batchmatmul(Tensor x, Tensor weight, Tensor antiquant_scale, "
          "Tensor? antiquant_offset=None, Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? bias=None, "
          "int antiquant_group_size=0, int inner_precise=0, int? weight_dtype=None) -> Tensor",
          unfused="x @ ((weight.to(x.dtype) + antiquant_offset) * antiquant_scale) + bias")
def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0,
                                 weight_dtype=None):
    op = "npu_weight_quant_batchmatmul"
    if weight_dtype is not None:
        raise NotImplementedError(f"torch_npu.{op}: weight_dtype={_dtype_name(weight_dtype)} (uint8-carried "
                                  f"int4/float4) is not emulated; pass int4 weights as int32 packed by "
                                  f"npu_convert_weight_to_int4pack")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"torch_npu.{op}: x (M, K) and weight (K, N) must be 2-D, got {x.dim()}-D and "
                         f"{weight.dim()}-D")
    if weight.dtype == torch.int32:
        w = _unpack_int4_matrix(weight, op, "weight")
    elif weight.dtype == torch.int8:
        w = weight
    else:
        raise ValueError(f"torch_npu.{op}: weight must be int8 or int32 (8 packed int4), got {weight.dtype}")
    k, n = w.shape
    if x.shape[1] != k:
        raise ValueError(f"torch_npu.{op}: x's K ({x.shape[1]}) does not match weight's ({k})")
    if antiquant_offset is not None and antiquant_offset.dtype == torch.int32:
        raise NotImplementedError(f"torch_npu.{op}: an int32 antiquant_offset (with an int64 antiquant_scale) is "
                                  f"not emulated")
    scale = _scale_of(antiquant_scale)[0]
    offset = None if antiquant_offset is None else antiquant_offset.float()
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        if antiquant_group_size % 32 or not 32 <= antiquant_group_size < k:
            raise ValueError(f"torch_npu.{op}: antiquant_group_size must be a multiple of 32 in [32, K-1], got "
                             f"{antiquant_group_size}")
        if tuple(scale.shape) != (groups, n):
            raise ValueError(f"torch_npu.{op}: per-group antiquant_scale must be (ceil(K/group)={groups}, N={n}), "
                             f"got {tuple(scale.shape)}")
        scale = _group_expand(scale, k, antiquant_group_size)
        if offset is not None:
            offset = _group_expand(offset.reshape(groups, n), k, antiquant_group_size)
    else:
        if scale.numel() not in (1, n):
            raise ValueError(f"torch_npu.{op}: antiquant_scale must be per-tensor (1,) or per-channel (N={n},), "
                             f"got {tuple(scale.shape)}")
        scale = scale.reshape(1, -1)
        if offset is not None:
            offset = offset.reshape(1, -1)
    npu = npu_numerics(x)
    dequantized = w.float() if offset is None else w.float() + offset
    # the kernel dequantizes the weight into x's dtype and feeds the cube unit with it
    dequantized = round_intermediate(dequantized * scale, x.dtype, npu)
    y = cube_matmul(x.float(), dequantized, x.dtype, npu)
    if bias is not None:
        y = y + bias.float().reshape(-1)
    if quant_scale is None:
        return y.to(x.dtype)
    requant_scale, word_offset = _scale_of(quant_scale)
    y = y * requant_scale.reshape(-1)
    if quant_offset is not None:
        y = y + quant_offset.float().reshape(-1)
    elif word_offset is not None:
        y = y + word_offset.reshape(-1)
    return _saturate(y, torch.int8)

