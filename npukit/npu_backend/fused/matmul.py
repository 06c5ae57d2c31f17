"""Matmul family: npu_grouped_matmul (MoE experts), npu_bmmV2 and npu_linear, with their backward.

The cube unit reads fp16/bf16 operands, accumulates in fp32 and rounds the result once to the
output dtype, a bias being added to the fp32 accumulator first. The kernels here multiply the
operands upcast to fp32 (exact for fp16/bf16 values, so it is the fp32 accumulation; fp32 operands
stay fp32 and the device's HF32 policy applies), add the bias and round once.

npu_grouped_matmul splits one x along M into the groups of `group_list` and multiplies group e by
expert e's weight with `torch._grouped_mm` (one call for all groups, no Python loop per group);
its K-split form (group_type=2, the weight gradient of a grouped matmul) is the same primitive.
torch_npu 2.13 registers no autograd for npu_grouped_matmul (its docs: an inference interface;
training code such as MindSpeed's gmm wraps it in a torch.autograd.Function whose backward calls
npu_grouped_matmul again): its backward raises here as on the device.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from npukit.npu_backend.fused import (
    _LIBRARY,
    NAMESPACE,
    allowed_floats,
    fused_op,
    register_autograd,
    register_no_derivative,
    upcast,
)

# torch_npu's `int` dtype arguments take c10 ScalarType numbers (torch_npu's TORCH_DTYPE_MAP).
_SCALAR_TYPE_BY_NUMBER = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# torch._grouped_mm wants every stride of its operands and result a multiple of 16 bytes.
_ALIGNMENT_BYTES = 16


def _compute_operand(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """A matmul operand in the kernel's compute dtype: floats in fp32 (mixed fp16/fp32 included),
    integer operands (npu_bmmV2 takes int32) as they are."""
    if tensor.is_floating_point():
        return upcast(tensor)
    return tensor.float() if other.is_floating_point() else tensor


def _check_float(op: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in allowed_floats(tensor):
        raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32 on the emulator, got {tensor.dtype}")


def _alignment(tensor: torch.Tensor) -> int:
    return _ALIGNMENT_BYTES // tensor.element_size()


def _aligned(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`tensor` as torch._grouped_mm takes it: zero-padded so that each of `dims` spans a multiple
    of 16 bytes, with aligned strides. A contiguous tensor whose `dims` are aligned already (the
    usual case) is returned as it is without the general checks, which cost per call."""
    if tensor.is_contiguous():
        alignment, shape = _alignment(tensor), tensor.shape
        for dim in dims:
            if shape[dim] % alignment:
                break
        else:
            return tensor
    return _with_aligned_strides(_pad_to_alignment(tensor, dims))


def _pad_to_alignment(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`tensor` zero-padded so that each of `dims` spans a multiple of 16 bytes (zeros add nothing
    to a product; the caller slices the padding off the result)."""
    pad = [0] * (2 * tensor.dim())
    for dim in dims:
        pad[2 * (tensor.dim() - 1 - dim) + 1] = -tensor.shape[dim] % _alignment(tensor)
    return torch.nn.functional.pad(tensor, pad) if any(pad) else tensor


def _with_aligned_strides(tensor: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm wants a unit stride and every other stride a multiple of 16 bytes: a
    (transposed) view that has them is used as it is, anything else as a contiguous copy."""
    strides = [stride for stride, size in zip(tensor.stride(), tensor.shape) if size > 1]
    if 1 in strides and all(stride == 1 or stride % _alignment(tensor) == 0 for stride in strides):
        return tensor
    return tensor.contiguous()


def _is_fake(tensor: torch.Tensor) -> bool:
    """Tracing (torch.compile's fake tensors): torch._grouped_mm's meta kernel takes bf16 only, so
    the traced grouped matmuls are given their shape directly."""
    if type(tensor) is torch.Tensor:  # a plain tensor is fake only on the meta device
        return tensor.is_meta
    return is_fake(tensor) or tensor.is_meta


def grouped_rows_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [E, K, N] -> [M, N]: rows offsets[e-1]:offsets[e] of x times weight e, in x's
    dtype (fp32; or bf16 operands, which torch._grouped_mm accumulates in fp32 and rounds once).

    Rows past offsets[-1] belong to no group and are 0 (torch._grouped_mm leaves them unset)."""
    rows, n = x.shape[0], weight.shape[-1]
    if _is_fake(x):
        return x.new_empty(rows, n)
    grouped_rows = _check_offsets(offsets, rows, "x.size(0)")
    if x.dtype == torch.float64:  # torch._grouped_mm takes no float64: the CPU reference, group by group
        out = x.new_zeros(rows, n)
        for group, (start, end) in enumerate(_group_bounds(offsets)):
            out[start:end] = x[start:end] @ weight[group]
        return out
    out = torch._grouped_mm(_aligned(x, (1,)), _aligned(weight, (1, 2)), offs=offsets)
    if out.shape[1] != n:
        out = out[:, :n]
    if grouped_rows < rows:
        out[grouped_rows:].zero_()
    return out


def grouped_reduce_matmul(a32: torch.Tensor, b32: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[M, K] and [K, N] -> [E, M, N]: group e sums k over offsets[e-1]:offsets[e] (fp32); the
    weight gradient of a grouped matmul (a = x transposed, b = the output's gradient)."""
    m, n = a32.shape[0], b32.shape[1]
    if _is_fake(a32):
        return a32.new_empty(offsets.shape[0], m, n)
    _check_offsets(offsets, a32.shape[1], "the K of x")
    if a32.dtype == torch.float64:  # torch._grouped_mm takes no float64: the CPU reference, group by group
        return torch.stack([a32[:, start:end] @ b32[start:end] for start, end in _group_bounds(offsets)])
    return torch._grouped_mm(_aligned(a32, (0, 1)), _aligned(b32, (0, 1)), offs=offsets)[:, :m, :n]


def _check_offsets(offsets: torch.Tensor, limit: int, what: str) -> int:
    """The groups must tile a prefix of the split dim (torch._grouped_mm would read past it); returns
    the prefix's length (host memory: reading the offsets costs no device sync)."""
    ends = offsets.tolist()
    # non-negative sizes: cumulative ends from >= 0, non-decreasing
    if ends[0] < 0 or ends != sorted(ends) or ends[-1] > limit:
        raise ValueError(f"{_GMM}: group_list must give non-negative group sizes summing to at most {what} "
                         f"({limit}); as cumulative ends it is {ends}")
    return ends[-1]


def group_of_rows(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group of each row (clamped to the last group) and whether the row is in a group."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    group = torch.searchsorted(offsets, positions, right=True)
    return group.clamp(max=offsets.numel() - 1), positions < offsets[-1:]


def _offsets(group_list: torch.Tensor, group_list_type: int) -> torch.Tensor:
    """group_list as the cumulative row ends torch._grouped_mm takes (int32)."""
    ends = group_list if group_list_type == 0 else torch.cumsum(group_list, 0)
    return ends if ends.dtype == torch.int32 else ends.to(torch.int32)


# ---- npu_grouped_matmul -----------------------------------------------------------------------

_GMM = "npu_grouped_matmul"
_QUANT_ARGUMENTS = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
                    "activation_input", "activation_quant_scale", "activation_quant_offset")
_FP8_DTYPE_ARGUMENTS = ("x_dtype", "weight_dtype", "scale_dtype", "per_token_scale_dtype")


def _output_dtype(output_dtype, x: torch.Tensor) -> torch.dtype:
    if output_dtype is None:
        return x.dtype
    if isinstance(output_dtype, torch.dtype):
        dtype = output_dtype
    else:
        dtype = _SCALAR_TYPE_BY_NUMBER.get(int(output_dtype))
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{_GMM}: output_dtype {output_dtype} is not float16, bfloat16 or float32 "
                         f"(the emulator's non-quantized grouped matmul)")
    return dtype


def _validate_gmm(x, weight, bias, split_item, group_type, group_list_type, act_type, named_extras):
    if not x or not weight:
        raise ValueError(f"{_GMM}: x and weight must each hold at least one tensor")
    if len(x) > 128 or len(weight) > 128:
        raise ValueError(f"{_GMM}: x and weight hold at most 128 tensors, got {len(x)} and {len(weight)}")
    for name, value in named_extras.items():
        if value is not None:
            raise NotImplementedError(
                f"{_GMM}: {name} (quantized / fp8 grouped matmul) is not emulated; dequantize the "
                f"weight and call it with float16/bfloat16/float32 tensors")
    if split_item not in (0, 1, 2, 3):
        raise ValueError(f"{_GMM}: split_item must be 0, 1, 2 or 3, got {split_item}")
    if group_type not in (-1, 0, 2):
        raise ValueError(f"{_GMM}: group_type must be -1 (no grouping), 0 (split M) or 2 (split K), "
                         f"got {group_type}")
    if group_list_type not in (0, 1):
        raise ValueError(f"{_GMM}: group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
    if act_type not in (0, None):
        raise ValueError(f"{_GMM}: act_type {act_type} needs per-token quantization (torch_npu computes "
                         f"an activation only there); apply the activation to the output")
    for name, tensors in (("x", x), ("weight", weight), ("bias", bias or [])):
        for tensor in tensors:
            _check_float(_GMM, name, tensor)


def _stacked_weight(op_weight: list[torch.Tensor]) -> torch.Tensor:
    if len(op_weight) == 1 and op_weight[0].dim() == 3:
        return op_weight[0]
    if any(w.dim() != 2 for w in op_weight):
        raise ValueError(f"{_GMM}: weight must be one [E, K, N] tensor or a list of [K, N] tensors")
    return torch.stack(op_weight)


def _stacked_bias(bias, experts: int) -> torch.Tensor | None:
    if not bias:
        return None
    stacked = bias[0] if len(bias) == 1 and bias[0].dim() == 2 else torch.stack(list(bias))
    if stacked.shape[0] != experts:
        raise ValueError(f"{_GMM}: bias must give one row per weight group ({experts}), got {tuple(stacked.shape)}")
    return stacked


def _split_m(x, weight, bias, offsets, split_item, out_dtype, counts):
    """One x split along M by group_list, group e times weight e (group_type 0)."""
    if x[0].dim() != 2:
        raise ValueError(f"{_GMM}: with a group_list, x must be 2-D [M, K], got {tuple(x[0].shape)}")
    stacked = _stacked_weight(weight)
    if offsets.numel() != stacked.shape[0]:
        raise ValueError(f"{_GMM}: group_list has {offsets.numel()} groups but weight has {stacked.shape[0]}")
    stacked_bias = _stacked_bias(bias, stacked.shape[0])
    if stacked_bias is None and x[0].dtype == stacked.dtype == out_dtype == torch.bfloat16:
        # bf16 read, fp32 accumulation, one rounding: torch._grouped_mm does exactly that, without
        # fp32 copies of x and the weights (fp16 goes through fp32: its cast applies saturation)
        out = grouped_rows_matmul(x[0], stacked, offsets)
        return [out] if split_item in (2, 3) else _per_group(out, offsets, counts)
    out = grouped_rows_matmul(upcast(x[0]), upcast(stacked), offsets)
    if stacked_bias is not None:
        group, in_a_group = group_of_rows(offsets, out.shape[0])
        out = out + upcast(stacked_bias)[group] * in_a_group.unsqueeze(1)
    out = out.to(out_dtype)
    if split_item in (2, 3):
        return [out]
    # 单多多: one output per group, sized by group_list (data-dependent unless given as ints)
    return _per_group(out, offsets, counts)


def _per_group(out: torch.Tensor, offsets: torch.Tensor, counts) -> list[torch.Tensor]:
    """单多多: the output split into one tensor per group, sized by group_list. Traced with a tensor
    group_list, the sizes are unknown (unbacked) symbols."""
    if _is_fake(out) and counts is None:
        context = torch.library.get_ctx()
        return [out.new_empty(context.new_dynamic_size(), out.shape[1]) for _ in range(offsets.numel())]
    # a custom op's outputs may not alias one another: each group is a tensor of its own
    return [part.clone() for part in torch.split(out, counts if counts is not None else _group_sizes(offsets))]


def _group_sizes(offsets: torch.Tensor) -> list[int]:
    return [end - start for start, end in _group_bounds(offsets)]


def _group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each group along the split dim."""
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


def _split_k(x, weight, bias, offsets, split_item, out_dtype):
    """group_type 2: x [M, K] and weight [K, N] split along K, one [M, N] product per group."""
    if bias:
        raise ValueError(f"{_GMM}: group_type=2 (split K) takes no bias")
    if len(x) != 1 or len(weight) != 1 or x[0].dim() != 2 or weight[0].dim() != 2:
        raise ValueError(f"{_GMM}: group_type=2 takes one 2-D x [M, K] and one 2-D weight [K, N]")
    out = grouped_reduce_matmul(upcast(x[0]), upcast(weight[0]), offsets).to(out_dtype)
    return [out] if split_item in (2, 3) else [part.clone() for part in out.unbind(0)]


def _per_list(x, weight, bias, split_item, out_dtype):
    """x_i @ weight_i + bias_i for each listed pair (group_type -1, or x given as a list)."""
    if len(x) != len(weight):
        raise ValueError(f"{_GMM}: x and weight must hold as many tensors ({len(x)} vs {len(weight)}) "
                         f"unless one x is split by a group_list")
    if bias and len(bias) != len(weight):
        raise ValueError(f"{_GMM}: bias must hold one tensor per weight ({len(weight)}), got {len(bias)}")
    outs = []
    for i, (x_i, weight_i) in enumerate(zip(x, weight)):
        if weight_i.dim() != 2:
            raise ValueError(f"{_GMM}: weight[{i}] must be 2-D [K, N] here, got {tuple(weight_i.shape)}")
        y = torch.matmul(upcast(x_i), upcast(weight_i))
        if bias:
            y = y + upcast(bias[i])
        outs.append(y.to(out_dtype))
    if split_item in (2, 3):
        if any(y.dim() != 2 for y in outs):
            raise ValueError(f"{_GMM}: split_item 2/3 (one output) needs 2-D x tensors")
        return [torch.cat(outs)]
    return outs


def grouped_matmul_forward(x, weight, bias, group_list, split_item, group_type, group_list_type,
                           out_dtype, counts=None):
    """The grouped matmul of validated arguments (counts: the group sizes when known statically)."""
    if group_type == 2:
        if group_list is None:
            raise ValueError(f"{_GMM}: group_type=2 needs a group_list")
        return _split_k(x, weight, bias, _offsets(group_list, group_list_type), split_item, out_dtype)
    if group_list is not None and len(x) == 1 and (group_type == 0 or len(weight) > 1 or weight[0].dim() == 3):
        return _split_m(x, weight, bias, _offsets(group_list, group_list_type), split_item, out_dtype, counts)
    if group_list is None and len(x) == 1 and (len(weight) > 1 or weight[0].dim() == 3):
        raise ValueError(f"{_GMM}: one x with {len(weight)} weight groups needs a group_list")
    return _per_list(x, weight, bias, split_item, out_dtype)


@fused_op(
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None) -> Tensor[]",
    unfused="[x[rows of group e] @ weight[e] + bias[e] for each group e]",
    # split_item 0/1 with one x and a tensor group_list returns one tensor per group, sized by the
    # group_list's values: the only data-dependent shapes, traced as unbacked sizes.
    fake=True)
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                       group_type=None, group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                       x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    split_item = 0 if split_item is None else split_item
    group_list_type = 0 if group_list_type is None else group_list_type
    unsupported = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                   activation_quant_scale, activation_quant_offset, x_dtype, weight_dtype, scale_dtype,
                   per_token_scale_dtype)
    # named only when one is given (the error names it): no dict built on every call
    extras = {} if all(value is None for value in unsupported) else dict(
        zip(_QUANT_ARGUMENTS + _FP8_DTYPE_ARGUMENTS, unsupported))
    if group_type is None:
        raise ValueError(f"{_GMM}: group_type must be -1, 0 or 2 when group_list is a tensor or None "
                         f"(only the int-list group_list form leaves it None)")
    _validate_gmm(x, weight, bias, split_item, group_type, group_list_type, act_type, extras)
    return grouped_matmul_forward(x, weight, bias, group_list, split_item, group_type, group_list_type,
                                  _output_dtype(output_dtype, x[0]))


# The overload with group_list as a Python int list (cumulative ends; group_type None): torch_npu's
# npu_grouped_matmul.List. Its group sizes are static, so every form traces.
_GMM_LIST_SCHEMA = (
    "npu_grouped_matmul.List(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, int[]? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, ScalarType? output_dtype=None) -> Tensor[]")


def npu_grouped_matmul_list(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                            antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                            activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                            group_type=None, group_list_type=0, act_type=0, output_dtype=None):
    split_item = 0 if split_item is None else split_item
    extras = dict(zip(_QUANT_ARGUMENTS, (scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                         activation_input, activation_quant_scale, activation_quant_offset)))
    if group_type not in (None, -1, 0):
        raise ValueError(f"{_GMM}: with group_list as a list of ints, group_type must be None, got {group_type}")
    _validate_gmm(x, weight, bias, split_item, -1 if group_type is None else group_type, 0, act_type, extras)
    out_dtype = _output_dtype(output_dtype, x[0])
    if group_list is None or len(x) > 1:
        return _per_list(x, weight, bias, split_item, out_dtype)
    if any(b < a for a, b in zip([0] + list(group_list), group_list)):
        raise ValueError(f"{_GMM}: group_list {list(group_list)} must be non-decreasing cumulative row ends")
    ends = torch.tensor(group_list, dtype=torch.int64, device=x[0].device)
    counts = [end - start for start, end in zip([0] + list(group_list[:-1]), group_list)]
    return grouped_matmul_forward(x, weight, bias, ends, split_item, 0, 0, out_dtype, counts=counts)


_LIBRARY.define(_GMM_LIST_SCHEMA)
for _key in ("PrivateUse1", "CPU"):
    _LIBRARY.impl("npu_grouped_matmul.List", npu_grouped_matmul_list, _key)
torch.library.register_fake(f"{NAMESPACE}::npu_grouped_matmul.List", npu_grouped_matmul_list, lib=_LIBRARY)


# torch_npu 2.13 defines no backward for npu_grouped_matmul (its docs: an inference interface; its
# libtorch_npu has no NpuGroupedMatmulBackward0): training code wraps it in a torch.autograd.Function
# whose backward is two more grouped matmuls, M-split for dx and K-split (group_type=2) for dweight,
# as MindSpeed's gmm does. The emulator refuses the backward as the device does.
register_no_derivative("npu_grouped_matmul")
register_no_derivative("npu_grouped_matmul.List", npu_grouped_matmul_list)


# ---- npu_bmmV2 -------------------------------------------------------------------------------------

_BMM = "npu_bmmV2"


def _broadcast_matmul_shape(mat1: torch.Tensor, mat2: torch.Tensor) -> list[int]:
    batch = torch.broadcast_shapes(mat1.shape[:-2], mat2.shape[:-2])
    return [*batch, mat1.shape[-2], mat2.shape[-1]]


def _check_bmm_operands(op: str, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    if mat1.dim() < 2 or mat2.dim() < 2:
        raise ValueError(f"{op}: input and mat2 must be at least 2-D, got {tuple(mat1.shape)} and {tuple(mat2.shape)}")
    if mat1.shape[-1] != mat2.shape[-2]:
        raise ValueError(f"{op}: input {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)} do not chain (K differs)")


def _reduce_to(grad: torch.Tensor, size) -> torch.Tensor:
    """grad of a broadcast operand: summed over the dims broadcasting added or expanded."""
    size = list(size)
    extra = grad.dim() - len(size)
    if extra:
        grad = grad.sum(list(range(extra)))
    expanded = [d for d, (g, s) in enumerate(zip(grad.shape, size)) if s == 1 and g != 1]
    if expanded:
        grad = grad.sum(expanded, keepdim=True)
    return grad


@fused_op("npu_bmmV2(Tensor input, Tensor mat2, int[] output_sizes) -> Tensor",
          unfused="torch.matmul(input, mat2) (then .reshape(output_sizes) when given)")
def npu_bmmV2(mat1, mat2, output_sizes):
    _check_bmm_operands(_BMM, mat1, mat2)
    out = torch.matmul(_compute_operand(mat1, mat2), _compute_operand(mat2, mat1))
    out_dtype = mat1.dtype  # the activation's (autocast may hand an fp32 mat2)
    if output_sizes:
        if out.numel() != _numel(output_sizes):
            raise ValueError(f"{_BMM}: output_sizes {list(output_sizes)} do not hold the product's "
                             f"{list(out.shape)} elements")
        out = out.reshape(output_sizes)
    return out.to(out_dtype)


def _numel(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


@fused_op("npu_bmm_v2_mat1_backward(Tensor grad, Tensor mat1, Tensor mat2, SymInt[] size) -> Tensor",
          unfused="grad @ mat2.transpose(-1, -2) summed to mat1's size", public=False)
def npu_bmm_v2_mat1_backward(grad, mat1, mat2, size):
    grad32 = upcast(grad).reshape(_broadcast_matmul_shape(mat1, mat2))
    return _reduce_to(torch.matmul(grad32, upcast(mat2).transpose(-1, -2)), size).to(mat1.dtype)


@fused_op("npu_bmm_v2_mat2_backward(Tensor grad, Tensor mat1, Tensor mat2, SymInt[] size) -> Tensor",
          unfused="mat1.transpose(-1, -2) @ grad summed to mat2's size", public=False)
def npu_bmm_v2_mat2_backward(grad, mat1, mat2, size):
    grad32 = upcast(grad).reshape(_broadcast_matmul_shape(mat1, mat2))
    return _reduce_to(torch.matmul(upcast(mat1).transpose(-1, -2), grad32), size).to(mat2.dtype)


def _bmm_setup(ctx, inputs, output):
    mat1, mat2, _ = inputs
    ctx.save_for_backward(mat1, mat2)


def _bmm_backward(ctx, grad):
    mat1, mat2 = ctx.saved_tensors
    dmat1 = dmat2 = None
    if ctx.needs_input_grad[0]:
        dmat1 = torch.ops.npu.npu_bmm_v2_mat1_backward(grad, mat1, mat2, mat1.shape)
    if ctx.needs_input_grad[1]:
        dmat2 = torch.ops.npu.npu_bmm_v2_mat2_backward(grad, mat1, mat2, mat2.shape)
    return dmat1, dmat2, None


register_autograd("npu_bmmV2", _bmm_backward, _bmm_setup)


# ---- npu_linear --------------------------------------------------------------------------------------

_LINEAR = "npu_linear"


@fused_op("npu_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
          unfused="torch.nn.functional.linear(input, weight, bias)")
def npu_linear(x, weight, bias=None):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{_LINEAR}: input and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{_LINEAR}: input {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{_LINEAR}: bias must be 1-D of weight's {weight.shape[0]} rows, got {tuple(bias.shape)}")
    out = torch.matmul(upcast(x), upcast(weight).t())
    if bias is not None:
        out = out + upcast(bias)
    return out.to(x.dtype)


@fused_op("npu_linear_backward(Tensor grad, Tensor input, Tensor weight) -> (Tensor, Tensor)",
          unfused="(grad @ weight, grad.t() @ input)", public=False)
def npu_linear_backward(grad, x, weight):
    grad32 = upcast(grad)
    dx = torch.matmul(grad32, upcast(weight))
    dweight = torch.matmul(grad32.t(), upcast(x))
    return dx.to(x.dtype), dweight.to(weight.dtype)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dweight = torch.ops.npu.npu_linear_backward(grad, x, weight)
    dbias = None if ctx.bias_dtype is None else upcast(grad).sum(0).to(ctx.bias_dtype)
    return dx, dweight, dbias


register_autograd("npu_linear", _linear_backward, _linear_setup)
