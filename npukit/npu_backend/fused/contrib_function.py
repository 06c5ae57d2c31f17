"""`torch_npu.contrib.function` on the emulated NPU.

The wheel's contrib functions are Python helpers that call fused NPU kernels. Those that training
code commonly uses are computed here with PyTorch ops, with the semantics their docstrings state:
`dropout_with_byte_mask`, `fuse_add_softmax_dropout`, `roll`, `matmul_transpose`, `npu_iou` /
`npu_ptiou`, `npu_giou`, `npu_diou`, `npu_ciou`,
`npu_fast_condition_index_put`. Every other name of the wheel's list is an attribute
that raises one NotImplementedError naming it and its plain-PyTorch equivalent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "npu_multiclass_nms", "npu_batched_multiclass_nms", "npu_single_level_responsible_flags",
    "npu_fast_condition_index_put", "npu_bbox_coder_encode_yolo", "npu_bbox_coder_encode_xyxy2xywh",
    "npu_bbox_coder_decode_xywh2xyxy", "fuse_add_softmax_dropout", "roll", "matmul_transpose", "npu_fused_attention",
    "npu_fused_attention_with_layernorm", "dropout_with_byte_mask",
    # exported by torch_npu.contrib as well
    "npu_iou", "npu_ptiou", "npu_giou", "npu_diou", "npu_ciou",
]
# torch_npu.contrib re-exports these (the shim sets them on the package)
PARENT_EXPORTS = [
    "npu_iou", "npu_ptiou", "npu_giou", "npu_diou", "npu_ciou", "npu_multiclass_nms", "npu_batched_multiclass_nms",
    "npu_single_level_responsible_flags", "npu_fast_condition_index_put", "npu_bbox_coder_encode_yolo",
    "npu_bbox_coder_encode_xyxy2xywh", "npu_bbox_coder_decode_xywh2xyxy", "roll", "matmul_transpose",
    "npu_fused_attention_with_layernorm", "npu_fused_attention", "fuse_add_softmax_dropout",
]
# The wheel's module files and their names (`from torch_npu.contrib.function.roll import roll`).
WHEEL_SUBMODULES = {
    "anchor_generator": ("npu_single_level_responsible_flags",),
    "bbox_coder": ("npu_bbox_coder_encode_yolo", "npu_bbox_coder_encode_xyxy2xywh", "npu_bbox_coder_decode_xywh2xyxy"),
    "fuse_add_softmax_dropout": ("fuse_add_softmax_dropout",),
    "fused_attention": ("npu_fused_attention_with_layernorm", "npu_fused_attention"),
    "index_op": ("npu_fast_condition_index_put",), "iou": ("npu_iou", "npu_giou", "npu_diou", "npu_ciou", "npu_ptiou"),
    "matmul_transpose": ("matmul_transpose",), "nms": ("npu_multiclass_nms", "npu_batched_multiclass_nms"),
    "npu_functional": ("dropout_with_byte_mask",), "roll": ("roll",),
}


def not_emulated(qualified_name: str, equivalent: str) -> Callable:
    """A contrib attribute the emulator does not provide: calling it says so, and what to use."""
    short_name = qualified_name.rsplit(".", 1)[-1]

    def raiser(*args, **kwargs):
        raise NotImplementedError(f"{qualified_name} is not emulated by npukit; use {equivalent} instead")

    raiser.__name__ = raiser.__qualname__ = short_name
    raiser.npukit_missing = True
    return raiser


def dropout_with_byte_mask(input1, p=0.5, training=True, inplace=False):
    """Dropout through a byte (uint8) keep-mask drawn per element: in training, each element is
    zeroed with probability p and the others scaled by 1 / (1 - p); outside training the input is
    returned. inplace=True is refused, as by torch_npu."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if inplace:
        raise ValueError("dropout_with_byte_mask has no in-place computation: call it with inplace=False")
    if not training or p == 0.0:
        return input1
    if p == 1.0:
        return input1 * 0
    keep = (torch.rand(input1.shape, device=input1.device) >= p).to(torch.uint8)
    return input1 * keep / (1.0 - p)


def fuse_add_softmax_dropout(training, dropout, attn_mask, attn_scores, attn_head_size, p=0.5, dim=-1):
    """softmax(attn_mask + attn_scores / sqrt(attn_head_size), dim) followed by dropout(p) in
    training (the `dropout` module outside torch_npu's fused shapes; this emulation applies `dropout`
    in training and nothing outside it)."""
    scores = torch.add(attn_mask, attn_scores, alpha=1 / math.sqrt(attn_head_size))
    probabilities = F.softmax(scores, dim=dim)
    if not training:
        return probabilities
    return dropout(probabilities) if dropout is not None else F.dropout(probabilities, p, training=True)


class _NpuRoll:
    """roll(x, shifts, dims) for an NHWC tensor rolled over two of its dims (Swin Transformer's
    shifted windows): torch.roll's result, with the wheel's argument checks."""

    def __call__(self, x, shifts, dims):
        if x.dim() != 4:
            raise ValueError(f"torch_npu.contrib.function.roll: expected a 4-D (N, H, W, C) x, got {x.dim()}-D")
        if len(shifts) != 2 or len(dims) != 2:
            raise ValueError("torch_npu.contrib.function.roll: expected two shifts and two dims")
        return torch.roll(x, shifts=tuple(shifts), dims=tuple(dims))


roll = _NpuRoll()


def matmul_transpose(tensor1, tensor2):
    """tensor1 @ tensor2.transpose(-2, -1) (attention scores q @ k^T), differentiable."""
    return torch.matmul(tensor1, tensor2.transpose(-2, -1))


def npu_iou(boxes1, boxes2, mode="ptiou", is_normalized=False, normalized_scale=100.0):
    """Pairwise IoU of (N, 4) and (M, 4) xyxy boxes, shape (N, M), as torch_npu computes it:
    iou = (overlap + 0.001) / (union + 0.001), ptiou = overlap / (union + 0.001). Normalized boxes
    are first multiplied by normalized_scale."""
    if mode not in ("iou", "ptiou"):
        raise ValueError(f"torch_npu.contrib.function.npu_iou: mode must be 'iou' or 'ptiou', got {mode!r}")
    for name, boxes in (("boxes1", boxes1), ("boxes2", boxes2)):
        if boxes.dim() != 2 or boxes.shape[-1] != 4:
            raise ValueError(f"torch_npu.contrib.function.npu_iou: {name} must be (N, 4), got {tuple(boxes.shape)}")
    dtype = boxes1.dtype if boxes1.is_floating_point() else torch.float32
    a, b = boxes1.float(), boxes2.float()
    if is_normalized:
        a, b = a * normalized_scale, b * normalized_scale
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    overlap = (bottom_right - top_left).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    union = area_a[:, None] + area_b[None, :] - overlap
    result = (overlap + 0.001) / (union + 0.001) if mode == "iou" else overlap / (union + 0.001)
    return result.to(dtype)


npu_ptiou = npu_iou


def _aligned_box_geometry(boxes1, boxes2, trans):
    """Corner coordinates of (4, n) boxes (xywh rows when trans, else xyxy), with IoU, union and
    the smallest enclosing box, computed in fp32."""
    def corners(boxes):
        boxes = boxes.float()
        if trans:
            x, y, w, h = boxes.unbind(0)
            return x - w / 2, y - h / 2, x + w / 2, y + h / 2
        return boxes.unbind(0)

    a, b = corners(boxes1), corners(boxes2)
    overlap = ((torch.minimum(a[2], b[2]) - torch.maximum(a[0], b[0])).clamp(min=0)
               * (torch.minimum(a[3], b[3]) - torch.maximum(a[1], b[1])).clamp(min=0))
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    union = area_a + area_b - overlap
    enclose_w = torch.maximum(a[2], b[2]) - torch.minimum(a[0], b[0])
    enclose_h = torch.maximum(a[3], b[3]) - torch.minimum(a[1], b[1])
    return a, b, overlap / union, union, enclose_w, enclose_h


def _check_aligned(name, boxes1, boxes2, is_cross, mode):
    if is_cross or mode != 0:
        raise NotImplementedError(f"torch_npu.contrib.function.{name}: only is_cross=False and mode=0 (iou) are "
                                  f"emulated, as the wheel's backward supports")
    if boxes1.shape != boxes2.shape or boxes1.dim() != 2 or boxes1.shape[0] != 4:
        raise ValueError(f"torch_npu.contrib.function.{name}: boxes must both be (4, n), got {tuple(boxes1.shape)} "
                         f"and {tuple(boxes2.shape)}")


def npu_giou(boxes1, boxes2, is_permuted=True):
    """Generalized IoU of aligned xywh boxes (n, 4) (transposed to (4, n) when is_permuted):
    giou = iou - (enclose_area - union) / enclose_area, shape (n, 1), differentiable."""
    if boxes1.shape != boxes2.shape:
        raise ValueError(f"torch_npu.contrib.function.npu_giou: expected boxes1.shape == boxes2.shape, got "
                         f"{tuple(boxes1.shape)} and {tuple(boxes2.shape)}")
    if is_permuted:
        boxes1, boxes2 = boxes1.permute(1, 0), boxes2.permute(1, 0)
    _check_aligned("npu_giou", boxes1, boxes2, False, 0)
    _, _, iou, union, enclose_w, enclose_h = _aligned_box_geometry(boxes1, boxes2, True)
    enclose = enclose_w * enclose_h
    return (iou - (enclose - union) / enclose).unsqueeze(-1).to(boxes1.dtype)


def npu_diou(boxes1, boxes2, trans=True, is_cross=False, mode=0):
    """Distance IoU of aligned (4, n) boxes (boxes2 the ground truth): diou = iou - rho^2 / c^2,
    rho the distance of the centres, c the enclosing box's diagonal; shape (1, n), differentiable."""
    _check_aligned("npu_diou", boxes1, boxes2, is_cross, mode)
    a, b, iou, _, enclose_w, enclose_h = _aligned_box_geometry(boxes1, boxes2, trans)
    rho2 = ((a[0] + a[2]) / 2 - (b[0] + b[2]) / 2) ** 2 + ((a[1] + a[3]) / 2 - (b[1] + b[3]) / 2) ** 2
    return (iou - rho2 / (enclose_w ** 2 + enclose_h ** 2)).unsqueeze(0).to(boxes1.dtype)


def npu_ciou(boxes1, boxes2, trans=True, is_cross=False, mode=0):
    """Complete IoU of aligned (4, n) boxes (boxes2 the ground truth): diou - alpha * v with
    v = 4 / pi^2 (atan(w_gt / h_gt) - atan(w / h))^2, alpha = v / (1 - iou + v); shape (1, n)."""
    _check_aligned("npu_ciou", boxes1, boxes2, is_cross, mode)
    a, b, iou, _, enclose_w, enclose_h = _aligned_box_geometry(boxes1, boxes2, trans)
    rho2 = ((a[0] + a[2]) / 2 - (b[0] + b[2]) / 2) ** 2 + ((a[1] + a[3]) / 2 - (b[1] + b[3]) / 2) ** 2
    v = (4 / math.pi ** 2) * (torch.atan((b[2] - b[0]) / (b[3] - b[1])) - torch.atan((a[2] - a[0]) / (a[3] - a[1]))) ** 2
    with torch.no_grad():  # alpha is a weight, not differentiated (as in the CIoU paper)
        alpha = v / (1 - iou + v)
    return (iou - rho2 / (enclose_w ** 2 + enclose_h ** 2) - alpha * v).unsqueeze(0).to(boxes1.dtype)


def npu_fast_condition_index_put(x, condition, value):
    """x with `value` where the bool `condition` holds (x[condition] = value, out of place)."""
    if condition.dtype != torch.bool:
        raise TypeError(f"torch_npu.contrib.function.npu_fast_condition_index_put: condition must be bool, got "
                        f"{condition.dtype}")
    return torch.where(condition, torch.full_like(x, value), x)


# Names of the wheel's list the emulator does not compute: each raises, naming what to use.
npu_multiclass_nms = not_emulated("torch_npu.contrib.function.npu_multiclass_nms",
                                  "torchvision.ops.batched_nms over the score-thresholded boxes of each class")
npu_batched_multiclass_nms = not_emulated("torch_npu.contrib.function.npu_batched_multiclass_nms",
                                          "torchvision.ops.batched_nms per image")
npu_single_level_responsible_flags = not_emulated("torch_npu.contrib.function.npu_single_level_responsible_flags",
                                                  "mmdet's AnchorGenerator.single_level_responsible_flags")
npu_bbox_coder_encode_yolo = not_emulated("torch_npu.contrib.function.npu_bbox_coder_encode_yolo",
                                          "mmdet's YOLOBBoxCoder.encode")
npu_bbox_coder_encode_xyxy2xywh = not_emulated("torch_npu.contrib.function.npu_bbox_coder_encode_xyxy2xywh",
                                               "mmdet's DeltaXYWHBBoxCoder.encode")
npu_bbox_coder_decode_xywh2xyxy = not_emulated("torch_npu.contrib.function.npu_bbox_coder_decode_xywh2xyxy",
                                               "mmdet's DeltaXYWHBBoxCoder.decode")
npu_fused_attention = not_emulated("torch_npu.contrib.function.npu_fused_attention",
                                   "torch.nn.functional.scaled_dot_product_attention (or torch_npu.npu_fusion_attention)")
npu_fused_attention_with_layernorm = not_emulated("torch_npu.contrib.function.npu_fused_attention_with_layernorm",
                                                  "torch.nn.LayerNorm, then torch.nn.functional.scaled_dot_product_attention")
