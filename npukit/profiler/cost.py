"""FLOPs and bytes moved per op, from the recorded input shapes and dtypes.

FLOPs count a multiply-add as 2. Covered: mm, addmm, bmm, baddbmm, addbmm, matmul, linear,
convolution forward (any rank, from weight and input shapes; stride comes from torch's own
conv2d count when recorded, else stride 1 is assumed) and convolution_backward (from
grad_output, so stride is exact), and scaled-dot-product attention forward and backward.

Bytes moved = all tensor inputs read + the output written. The profiler does not record
output shapes, so the output is derived for matmul/conv/attention and taken as the largest
input for other ops (exact for elementwise ops, an upper bound for reductions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ELEMENT_SIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}

Tensor = tuple[tuple[int, ...], str]  # (shape, dtype name such as "float32")

_MATMUL_2D = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addbmm": (1, 2)}
_MATMUL_BATCHED = {"aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
_CONV_FORWARD = {
    "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution",
    "aten::convolution_overrideable", "aten::mkldnn_convolution", "aten::cudnn_convolution",
    "aten::_slow_conv2d_forward", "aten::thnn_conv2d", "aten::slow_conv3d",
}
_CONV_TRANSPOSED = {"aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d"}
_CONV_BACKWARD = {"aten::convolution_backward", "aten::convolution_backward_overrideable"}
_ATTENTION_FORWARD = {
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward", "aten::_fused_sdp_choice",
}
_ATTENTION_BACKWARD = {
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_efficient_attention_backward", "aten::_flash_attention_backward",
    "aten::_efficient_attention_backward",
}
MATMUL_OPS = frozenset({*_MATMUL_2D, *_MATMUL_BATCHED, "aten::matmul", "aten::linear"})
CONV_OPS = frozenset({*_CONV_FORWARD, *_CONV_TRANSPOSED, *_CONV_BACKWARD})


def element_size(dtype: str) -> int:
    return ELEMENT_SIZE.get(dtype, 4)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def compute_dtype(tensors: Sequence[Tensor]) -> str:
    """The dtype an op computes in: its first floating input, else its first input."""
    for _, dtype in tensors:
        if dtype.startswith(("float", "bfloat", "complex")):
            return dtype
    return tensors[0][1] if tensors else "float32"


def matmul_dims(name: str, tensors: Sequence[Tensor]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matmul-class op, or None when the shapes do not fit."""
    shapes = [shape for shape, _ in tensors]
    try:
        if name in _MATMUL_2D:
            a, b = (shapes[i] for i in _MATMUL_2D[name])
            if name == "aten::addbmm":
                return a[0], a[1], a[2], b[2]
            return 1, a[0], a[1], b[1]
        if name in _MATMUL_BATCHED:
            a, b = (shapes[i] for i in _MATMUL_BATCHED[name])
            return a[0], a[1], a[2], b[2]
        if name == "aten::linear":
            x, w = shapes[0], shapes[1]
            return numel(x[:-1]), 1, x[-1], w[0]
        if name == "aten::matmul":
            a, b = shapes[0], shapes[1]
            if len(a) == 1:
                a = (1, *a)
            if len(b) == 1:
                b = (*b, 1)
            batch = max(numel(a[:-2]), numel(b[:-2]))
            return batch, a[-2], a[-1], b[-1]
    except (IndexError, TypeError):
        return None
    return None


def _conv_forward(tensors: Sequence[Tensor], transposed: bool, known_flops: float) -> tuple[float, int]:
    (x_shape, _), (w_shape, _) = tensors[0], tensors[1]
    if len(x_shape) < 3 or len(w_shape) != len(x_shape):
        return 0.0, 0
    batch, spatial = x_shape[0], x_shape[2:]
    kernel = numel(w_shape[2:])
    if transposed:
        c_in, c_out_per_group = w_shape[0], w_shape[1]
        flops = 2.0 * batch * c_in * numel(spatial) * c_out_per_group * kernel
        return flops, batch * c_out_per_group * numel(spatial)
    c_out, c_in_per_group = w_shape[0], w_shape[1]
    per_output = 2.0 * c_in_per_group * kernel
    if known_flops > 0:
        out_positions = known_flops / per_output / max(batch * c_out, 1)
        return known_flops, int(batch * c_out * out_positions)
    # Stride unknown: assume stride 1 with "same" padding (an upper bound for strided convs).
    out_numel = batch * c_out * numel(spatial)
    return per_output * out_numel, out_numel


def _attention(tensors: Sequence[Tensor]) -> tuple[float, int] | None:
    if len(tensors) < 3 or len(tensors[0][0]) < 2:
        return None
    q, k, v = (shape for shape, _ in tensors[:3])
    batch_heads, length, head_dim = numel(q[:-2]), q[-2], q[-1]
    source_len, value_dim = k[-2], v[-1]
    flops = 2.0 * batch_heads * length * source_len * (head_dim + value_dim)
    return flops, batch_heads * length * value_dim


def op_cost(name: str, tensors: Sequence[Tensor], known_flops: float = 0.0) -> tuple[float, float]:
    """(flops, bytes moved) of one call of `name` with these tensor inputs.

    known_flops: torch's own count when it made one (it knows conv2d strides); used for conv.
    """
    if not tensors:
        return 0.0, 0.0
    size = element_size(compute_dtype(tensors))
    read = float(sum(numel(shape) * element_size(dtype) for shape, dtype in tensors))
    flops, out_numel = 0.0, max(numel(shape) for shape, _ in tensors)
    try:
        dims = matmul_dims(name, tensors) if name in MATMUL_OPS else None
        if dims is not None:
            batch, m, k, n = dims
            flops, out_numel = 2.0 * batch * m * k * n, batch * m * n
        elif name in _CONV_FORWARD or name in _CONV_TRANSPOSED:
            flops, out_numel = _conv_forward(tensors, name in _CONV_TRANSPOSED, known_flops)
        elif name in _CONV_BACKWARD and len(tensors) >= 3:
            grad_out, x, w = (shape for shape, _ in tensors[:3])
            per_pass = 2.0 * numel(grad_out) * w[1] * numel(w[2:])
            # grad_input and grad_weight each cost one forward pass (the bias grad is a sum).
            flops, out_numel = 2 * per_pass, numel(x) + numel(w)
        elif name in _ATTENTION_FORWARD:
            flops, out_numel = _attention(tensors) or (0.0, out_numel)
        elif name in _ATTENTION_BACKWARD:
            # inputs: grad_out, q, k, v, out ...: recompute scores + dQ, dK, dV, dP.
            found = _attention(tensors[1:4])
            if found:
                flops, out_numel = 2.5 * found[0], sum(numel(shape) for shape, _ in tensors[1:4])
    except (IndexError, TypeError, ValueError):
        flops = 0.0
    return flops, read + out_numel * size
