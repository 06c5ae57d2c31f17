import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import torch_npu
import torch_npu.contrib
import torch_npu.contrib.function as contrib_function
import torch_npu.contrib.module as contrib_module

from tests.npu_backend.fused.reference import assert_close_to_reference

# The wheel's torch_npu.contrib.module.__all__, contrib.function.__all__ and contrib.__all__.
WHEEL_MODULE_ALL = [
    "ChannelShuffle", "Prefetcher", "LabelSmoothingCrossEntropy", "ROIAlign", "ModulatedDeformConv", "PSROIPool",
    "NpuFairseqDropout", "NpuCachedDropout", "MultiheadAttention", "NpuDropPath", "Focus", "LinearA8W8Quant",
    "LinearQuant", "LinearWeightQuant", "DropoutWithByteMask", "QuantConv2d",
]
WHEEL_FUNCTION_ALL = [
    "npu_multiclass_nms", "npu_batched_multiclass_nms", "npu_single_level_responsible_flags",
    "npu_fast_condition_index_put", "npu_bbox_coder_encode_yolo", "npu_bbox_coder_encode_xyxy2xywh",
    "npu_bbox_coder_decode_xywh2xyxy", "fuse_add_softmax_dropout", "roll", "matmul_transpose", "npu_fused_attention",
    "npu_fused_attention_with_layernorm", "dropout_with_byte_mask",
]
WHEEL_CONTRIB_ALL = [
    "npu_multiclass_nms", "npu_batched_multiclass_nms", "npu_single_level_responsible_flags",
    "npu_fast_condition_index_put", "npu_bbox_coder_encode_yolo", "npu_bbox_coder_encode_xyxy2xywh",
    "npu_bbox_coder_decode_xywh2xyxy", "fuse_add_softmax_dropout", "roll", "matmul_transpose",
    "npu_fused_attention_with_layernorm", "npu_fused_attention", "ChannelShuffle", "Prefetcher",
    "LabelSmoothingCrossEntropy", "ROIAlign", "ModulatedDeformConv", "PSROIPool", "NpuFairseqDropout",
    "NpuCachedDropout", "MultiheadAttention", "NpuDropPath", "Focus", "LinearA8W8Quant", "LinearQuant",
    "LinearWeightQuant",
]


def test_every_wheel_name_is_an_attribute_and_the_missing_ones_say_so():
    for name in WHEEL_MODULE_ALL:
        assert hasattr(contrib_module, name), name
    for name in WHEEL_FUNCTION_ALL:
        assert hasattr(contrib_function, name), name
    for name in WHEEL_CONTRIB_ALL:
        assert hasattr(torch_npu.contrib, name), name
    missing = [name for name in WHEEL_MODULE_ALL + WHEEL_FUNCTION_ALL
               if getattr(getattr(contrib_module, name, None) or getattr(contrib_function, name), "npukit_missing", False)]
    assert set(missing) == {"ModulatedDeformConv", "PSROIPool", "MultiheadAttention", "QuantConv2d",
                            "npu_multiclass_nms", "npu_batched_multiclass_nms", "npu_single_level_responsible_flags",
                            "npu_bbox_coder_encode_yolo", "npu_bbox_coder_encode_xyxy2xywh",
                            "npu_bbox_coder_decode_xywh2xyxy", "npu_fused_attention",
                            "npu_fused_attention_with_layernorm"}
    with pytest.raises(NotImplementedError, match="contrib.module.MultiheadAttention is not emulated.*torch.nn.MultiheadAttention"):
        contrib_module.MultiheadAttention(16, 2)
    with pytest.raises(NotImplementedError, match="contrib.function.npu_fused_attention is not emulated.*scaled_dot_product"):
        contrib_function.npu_fused_attention(None, None)


@pytest.mark.parametrize(("path", "name"), [
    ("torch_npu.contrib.module.npu_modules", "DropoutWithByteMask"), ("torch_npu.contrib.module.roi_align", "ROIAlign"),
    ("torch_npu.contrib.module.multihead_attention", "MultiheadAttention"),
    ("torch_npu.contrib.module.batchnorm_with_int32_count", "FastBatchNorm2d"),
    ("torch_npu.contrib.function.roll", "roll"), ("torch_npu.contrib.function.iou", "npu_giou")])
def test_classes_import_from_the_wheels_module_files(path, name):
    """The op docs' call examples import from the wheel's files:
    `from torch_npu.contrib.module.npu_modules import DropoutWithByteMask`."""
    package = contrib_module if ".module." in path else contrib_function
    assert getattr(importlib.import_module(path), name) is getattr(package, name)


def test_a_function_named_as_its_file_stays_the_packages_attribute():
    """torch_npu.contrib.function.roll is the function (the wheel's `from .roll import roll`), not its module."""
    assert callable(contrib_function.roll) and contrib_module.roi_align is not sys.modules.get(
        "torch_npu.contrib.module.roi_align")


# ---- activations -------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "formula"), [
    ("Mish", lambda x: x * torch.tanh(F.softplus(x))),
    ("SiLU", lambda x: x * torch.sigmoid(x)),
    ("Swish", lambda x: x * torch.sigmoid(x)),
])
def test_activation_modules_forward_and_backward_against_fp64(name, formula):
    x = torch.randn(4, 8, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    y_ref = formula(x_ref)
    (dx_ref,) = torch.autograd.grad(y_ref.sum(), x_ref)
    with pytest.warns(FutureWarning, match="deprecated"):
        module = getattr(contrib_module, name)()
    x_npu = x.float().npu().requires_grad_()
    y = module(x_npu)
    y.sum().backward()
    assert_close_to_reference(y, y_ref, torch.float32, name)
    assert_close_to_reference(x_npu.grad, dx_ref, torch.float32, f"{name} grad")


# ---- dropouts ----------------------------------------------------------------------------------

def test_dropout_with_byte_mask_zeroes_p_and_scales_the_rest():
    torch.manual_seed(0)
    x = (torch.rand(64, 64) + 1.0).npu().requires_grad_()
    module = contrib_module.DropoutWithByteMask(p=0.25)
    y = module(x)
    y.backward(torch.ones_like(y))
    kept = y.detach().cpu() != 0
    assert 0.2 < 1 - kept.double().mean().item() < 0.3
    torch.testing.assert_close(y.detach().cpu()[kept], (x.detach().cpu() / 0.75)[kept])
    torch.testing.assert_close(x.grad.cpu(), kept.float() / 0.75)
    module.eval()
    assert module(x) is x
    with pytest.raises(ValueError, match="no in-place computation"):
        contrib_function.dropout_with_byte_mask(x, 0.5, True, inplace=True)


def test_fairseq_dropout_trains_and_hands_out_masks():
    torch.manual_seed(1)
    dropout = contrib_module.NpuFairseqDropout(0.5)
    assert contrib_module.NpuFairseqDropout is contrib_module.NpuCachedDropout
    x = torch.ones(32, 32).npu()
    y = dropout(x).cpu()
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0.4 < (y == 0).double().mean().item() < 0.6
    mask = dropout([(2, 4, 8), torch.float16, x.device])
    assert mask.shape == (2, 4, 8) and mask.dtype == torch.uint8 and mask.device.type == "npu"
    assert contrib_module.NpuCachedDropout.enable_dropout_ensemble(torch.nn.Linear(2, 2)) is not None
    dropout.eval()
    assert dropout(x) is x


def test_drop_path_drops_whole_samples_forward_and_backward():
    torch.manual_seed(2)
    x = torch.randn(64, 3, 5).npu().requires_grad_()
    drop = contrib_module.NpuDropPath(0.5)
    y = drop(x)
    y.sum().backward()
    y_cpu, x_cpu = y.detach().cpu(), x.detach().cpu()
    dropped = (y_cpu == 0).flatten(1).all(1)
    assert 0 < dropped.sum() < 64
    torch.testing.assert_close(y_cpu[~dropped], x_cpu[~dropped] / 0.5)
    torch.testing.assert_close(x.grad.cpu(), (~dropped).float().view(-1, 1, 1).expand(64, 3, 5) / 0.5)
    drop.eval()
    assert drop(x) is x


# ---- layers ------------------------------------------------------------------------------------

def test_channel_shuffle_forward_and_backward():
    torch.manual_seed(3)
    x1, x2 = torch.randn(2, 4, 3, 3, dtype=torch.float64), torch.randn(2, 4, 3, 3, dtype=torch.float64)
    joined = torch.cat([x1, x2], 1)
    reference = joined.view(2, 2, 4, 3, 3).transpose(1, 2).reshape(2, 8, 3, 3)  # ShuffleNet's shuffle
    a, b = x1.float().npu().requires_grad_(), x2.float().npu().requires_grad_()
    first, second = contrib_module.ChannelShuffle(8, split_shuffle=True)(a, b)
    torch.testing.assert_close(torch.cat([first, second], 1).cpu().double(), reference)
    (first.sum() * 2 + second.sum()).backward()
    # channels that land in the first half get gradient 2
    grad = torch.cat([a.grad, b.grad], 1).cpu()
    lands_first = torch.zeros(8)
    lands_first[torch.arange(8).view(2, 4).t().flatten()[:4]] = 1
    torch.testing.assert_close(grad, (1 + lands_first).view(1, 8, 1, 1).expand(2, 8, 3, 3))
    whole = contrib_module.ChannelShuffle(8, split_shuffle=False)(a, b)
    torch.testing.assert_close(whole.detach().cpu().double(), reference)


def test_label_smoothing_cross_entropy_against_fp64():
    torch.manual_seed(4)
    logits = torch.randn(6, 10, dtype=torch.float64)
    target = torch.randint(0, 10, (6,))
    labels = torch.full((6, 10), 0.1 / 9, dtype=torch.float64)
    labels[torch.arange(6), target] = 0.9
    logits_ref = logits.clone().requires_grad_()
    loss_ref = -(labels * torch.log_softmax(logits_ref, 1)).sum(1).mean()
    loss_ref.backward()
    logits_npu = logits.half().npu().requires_grad_()
    loss = contrib_module.LabelSmoothingCrossEntropy(num_classes=10, smooth_factor=0.1)(logits_npu, target.npu())
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - loss_ref.item()) < 2e-3 * abs(loss_ref.item())
    assert_close_to_reference(logits_npu.grad, logits_ref.grad, torch.float16, "dlogits", factor=2)


def roi_align_fp64(features, rois, out_h, out_w, scale, sampling_ratio, aligned):
    """torchvision's RoIAlign, one RoI, bin and sample at a time, in fp64."""
    features = features.double()
    _, channels, height, width = features.shape
    result = []
    for roi in rois.double():
        image = features[int(roi[0])]
        offset = 0.5 if aligned else 0.0
        x1, y1, x2, y2 = (roi[1:] * scale - offset).tolist()
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / out_h, roi_w / out_w
        grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / out_h)
        grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / out_w)
        bins = torch.zeros(channels, out_h, out_w, dtype=torch.float64)
        for ph in range(out_h):
            for pw in range(out_w):
                total = torch.zeros(channels, dtype=torch.float64)
                for iy in range(grid_h):
                    for ix in range(grid_w):
                        y = y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
                        x = x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
                        if y < -1 or y > height or x < -1 or x > width:
                            continue
                        y, x = max(y, 0.0), max(x, 0.0)
                        y_low, x_low = int(y), int(x)
                        if y_low >= height - 1:
                            y_low = y_high = height - 1
                            y = float(y_low)
                        else:
                            y_high = y_low + 1
                        if x_low >= width - 1:
                            x_low = x_high = width - 1
                            x = float(x_low)
                        else:
                            x_high = x_low + 1
                        ly, lx = y - y_low, x - x_low
                        total = total + ((1 - ly) * (1 - lx) * image[:, y_low, x_low] + (1 - ly) * lx * image[:, y_low, x_high]
                                         + ly * (1 - lx) * image[:, y_high, x_low] + ly * lx * image[:, y_high, x_high])
                bins[:, ph, pw] = total / max(grid_h * grid_w, 1)
        result.append(bins)
    return torch.stack(result)


@pytest.mark.parametrize(("sampling_ratio", "aligned"), [(2, True), (0, True), (2, False), (0, False)])
def test_roi_align_against_fp64_torchvision_semantics(sampling_ratio, aligned):
    torch.manual_seed(5)
    features = torch.randn(2, 3, 12, 10)
    rois = torch.tensor([[0, 1.0, 1.5, 7.0, 9.0], [1, 0.0, 0.0, 3.2, 2.1], [0, 4.5, 2.0, 9.9, 11.5],
                         [1, -2.0, 6.0, 4.0, 14.0]])
    expected = roi_align_fp64(features, rois, 3, 2, 0.8, sampling_ratio, aligned)
    module = contrib_module.ROIAlign((3, 2), spatial_scale=0.8, sampling_ratio=sampling_ratio, aligned=aligned)
    x = features.npu().requires_grad_()
    y = module(x, rois.npu())
    assert y.shape == (4, 3, 3, 2) and y.dtype == torch.float32
    torch.testing.assert_close(y.detach().cpu().double(), expected, rtol=1e-5, atol=1e-5)
    weights = torch.randn(4, 3, 3, 2)
    (y * weights.npu()).sum().backward()
    features_ref = features.double().requires_grad_()
    (roi_align_fp64(features_ref, rois, 3, 2, 0.8, sampling_ratio, aligned) * weights.double()).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), features_ref.grad, rtol=1e-5, atol=1e-5)


def test_focus_forward_and_backward_equal_its_unfused_layers():
    torch.manual_seed(6)
    focus = contrib_module.Focus(3, 8, k=3).npu()
    x = torch.randn(2, 3, 8, 6).npu().requires_grad_()
    y = focus(x)
    slices = torch.cat([x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]], 1)
    conv = focus.conv
    expected = F.leaky_relu(conv.bn(F.conv2d(slices, conv.conv.weight, padding=1)), 0.1)
    torch.testing.assert_close(y, expected)
    assert y.shape == (2, 8, 4, 3)
    y.sum().backward()
    assert x.grad is not None and conv.conv.weight.grad is not None


def test_bilstm_joins_a_forward_and_a_reversed_lstm():
    torch.manual_seed(7)
    with pytest.warns(FutureWarning):
        lstm = contrib_module.BiLSTM(4, 5).npu()
    x = torch.randn(6, 2, 4).npu()
    y = lstm(x)
    assert y.shape == (6, 2, 10)
    torch.testing.assert_close(y[..., :5], lstm.fw_rnn(x)[0])
    torch.testing.assert_close(y[..., 5:], lstm.bw_rnn(x.flip(0))[0].flip(0))


def test_fast_batch_norm_counts_in_int32_and_normalizes_like_batch_norm():
    torch.manual_seed(8)
    fast, plain = contrib_module.FastBatchNorm2d(4).npu(), torch.nn.BatchNorm2d(4).npu()
    assert fast.num_batches_tracked.dtype == torch.int32
    x = torch.randn(3, 4, 5, 5).npu()
    torch.testing.assert_close(fast(x), plain(x))
    assert fast.num_batches_tracked.item() == 1
    torch.testing.assert_close(fast.running_var, plain.running_var)


def test_prefetcher_yields_batches_on_the_npu_then_none():
    loader = [(torch.randn(2, 3), torch.tensor([0, 1])), (torch.randn(2, 3), torch.tensor([1, 0]))]
    prefetcher = contrib_module.Prefetcher(loader)
    first = prefetcher.next()
    assert first[0].device.type == "npu" and torch.equal(first[0].cpu(), loader[0][0])
    second = prefetcher.next()
    assert torch.equal(second[1].cpu(), loader[1][1])
    assert prefetcher.next() == (None, None)


# ---- quantized linears ---------------------------------------------------------------------------

def test_linear_quant_a8w8_with_packed_scale_and_offset():
    torch.manual_seed(9)
    layer = contrib_module.LinearQuant(32, 16, bias=True, offset=True, output_dtype=torch.float16).npu()
    weight = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    scale, offset = torch.rand(16) * 1e-3, torch.randn(16)
    bias = torch.randint(-100, 100, (16,), dtype=torch.int32)
    layer.weight.data, layer.scale.data, layer.offset.data, layer.bias.data = (
        weight.npu(), scale.npu(), offset.npu(), bias.npu())
    x = torch.randint(-128, 128, (4, 32), dtype=torch.int8)
    y = layer(x.npu())
    assert y.dtype == torch.float16 and y.shape == (4, 16)
    fp19 = (scale.view(torch.int32) & -8192).view(torch.float32).double()  # npu_trans_quant_param keeps 19 bits
    expected = (x.double() @ weight.double().t() + bias.double()) * fp19 + offset.double()
    assert_close_to_reference(y, expected, torch.float16, "LinearQuant")


def test_linear_quant_a4w4_and_a8w8_deprecated_twin():
    torch.manual_seed(10)
    values_w, values_x = torch.randint(-8, 8, (24, 16), dtype=torch.int32), torch.randint(-8, 8, (3, 16), dtype=torch.int32)
    layer = contrib_module.LinearQuant(16, 24, bias=False, output_dtype=torch.float16).npu()
    layer.weight.data = torch_npu.npu_convert_weight_to_int4pack(values_w.npu())
    layer.scale.data = torch.full((1,), 0.01).npu()
    y = layer(torch_npu.npu_convert_weight_to_int4pack(values_x.npu()))
    assert_close_to_reference(y, values_x.double() @ values_w.double().t() * 0.01, torch.float16, "A4W4")

    with pytest.warns(FutureWarning, match="LinearA8W8Quant is deprecated"):
        old = contrib_module.LinearA8W8Quant(8, 4, bias=False)
    old.weight.data = torch.ones(4, 8, dtype=torch.int8)
    old.scale.data = torch.ones(4)
    with pytest.raises(ValueError, match="input and weight should be both torch.int32 or both torch.int8"):
        old(torch.ones(2, 8))


def test_linear_weight_quant_per_group_int8_against_fp64():
    torch.manual_seed(11)
    layer = contrib_module.LinearWeightQuant(64, 8, bias=True, antiquant_offset=True, antiquant_group_size=32).npu()
    weight = torch.randint(-128, 128, (8, 64), dtype=torch.int8)
    scale, offset = (torch.rand(8, 2) * 0.01).half(), torch.randn(8, 2).half()
    bias = torch.randn(8).half()
    layer.weight.data, layer.antiquant_scale.data = weight.npu(), scale.npu()
    layer.antiquant_offset.data, layer.bias.data = offset.npu(), bias.npu()
    x = torch.randn(5, 64).half()
    y = layer(x.npu())
    dequantized = (weight.double() + offset.double().repeat_interleave(32, 1)) * scale.double().repeat_interleave(32, 1)
    expected = x.double() @ dequantized.t() + bias.double()
    assert y.dtype == torch.float16
    assert_close_to_reference(y, expected, torch.float16, "LinearWeightQuant", factor=2)


# ---- functions ---------------------------------------------------------------------------------

def test_roll_and_matmul_transpose_forward_and_backward():
    x = torch.randn(2, 6, 5, 3).npu()
    torch.testing.assert_close(contrib_function.roll(x, (-2, 1), (1, 2)), torch.roll(x, (-2, 1), (1, 2)))
    with pytest.raises(ValueError, match="roll: expected a 4-D"):
        contrib_function.roll(x[0], (1, 1), (0, 1))
    q, k = torch.randn(2, 3, 4, 8, dtype=torch.float64), torch.randn(2, 3, 5, 8, dtype=torch.float64)
    q_npu, k_npu = q.float().npu().requires_grad_(), k.float().npu().requires_grad_()
    scores = contrib_function.matmul_transpose(q_npu, k_npu)
    assert_close_to_reference(scores, q @ k.transpose(-2, -1), torch.float32, "q k^T")
    scores.sum().backward()
    assert_close_to_reference(q_npu.grad, torch.ones(2, 3, 4, 5, dtype=torch.float64) @ k, torch.float32, "dq")


def test_fuse_add_softmax_dropout_is_scaled_masked_softmax():
    torch.manual_seed(12)
    scores, mask = torch.randn(2, 2, 4, 4, dtype=torch.float64), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    probabilities = contrib_function.fuse_add_softmax_dropout(
        False, torch.nn.Dropout(0.1), mask.half().npu(), scores.half().npu(), 16, p=0.1)
    expected = torch.softmax(mask.half().double() + scores.half().double() / 4, -1)
    assert_close_to_reference(probabilities, expected, torch.float16, "softmax(mask + s / sqrt(d))", factor=2)
    dropped = contrib_function.fuse_add_softmax_dropout(
        True, contrib_module.DropoutWithByteMask(0.5), mask.npu(), scores.npu(), 16, p=0.5)
    kept = dropped.cpu() != 0
    torch.testing.assert_close(dropped.cpu().double()[kept], (torch.softmax(mask + scores / 4, -1) * 2)[kept])


def test_box_ious_against_their_fp64_formulas():
    boxes1 = torch.tensor([[0.0, 0.0, 4.0, 4.0], [1.0, 2.0, 5.0, 3.0]], dtype=torch.float64)
    boxes2 = torch.tensor([[2.0, 2.0, 6.0, 5.0], [0.0, 0.0, 1.0, 1.0], [10.0, 10.0, 11.0, 12.0]], dtype=torch.float64)
    overlap = torch.tensor([[4.0, 1.0, 0.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    union = torch.tensor([[16 + 12 - 4, 16.0, 18.0], [4 + 12 - 3, 5.0, 6.0]], dtype=torch.float64)
    iou = contrib_function.npu_iou(boxes1.float().npu(), boxes2.float().npu(), mode="iou").cpu().double()
    torch.testing.assert_close(iou, (overlap + 0.001) / (union + 0.001))
    ptiou = torch_npu.contrib.npu_ptiou(boxes1.float().npu(), boxes2.float().npu()).cpu().double()
    torch.testing.assert_close(ptiou, overlap / (union + 0.001))

    # aligned xywh boxes: prediction (4, n) and ground truth (4, n)
    pred = torch.tensor([[2.0, 3.0], [2.0, 2.5], [4.0, 2.0], [4.0, 1.0]], dtype=torch.float64)
    gt = torch.tensor([[4.0, 3.0], [3.5, 2.0], [4.0, 2.0], [3.0, 2.0]], dtype=torch.float64)

    def corners(b):
        return b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2

    (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = corners(pred), corners(gt)
    inter = (torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1)).clamp(min=0) * (torch.minimum(ay2, by2) - torch.maximum(ay1, by1)).clamp(min=0)
    uni = pred[2] * pred[3] + gt[2] * gt[3] - inter
    enclose_w, enclose_h = torch.maximum(ax2, bx2) - torch.minimum(ax1, bx1), torch.maximum(ay2, by2) - torch.minimum(ay1, by1)
    iou_aligned = inter / uni
    giou = iou_aligned - (enclose_w * enclose_h - uni) / (enclose_w * enclose_h)
    rho2 = (pred[0] - gt[0]) ** 2 + (pred[1] - gt[1]) ** 2
    diou = iou_aligned - rho2 / (enclose_w ** 2 + enclose_h ** 2)
    v = 4 / math.pi ** 2 * (torch.atan(gt[2] / gt[3]) - torch.atan(pred[2] / pred[3])) ** 2
    ciou = diou - v / (1 - iou_aligned + v) * v

    pred_npu = pred.float().npu().requires_grad_()
    result = torch_npu.contrib.npu_giou(pred_npu.t(), gt.float().npu().t())
    assert result.shape == (2, 1)
    torch.testing.assert_close(result.detach().cpu().double().view(-1), giou, rtol=1e-6, atol=1e-6)
    result.sum().backward()
    assert pred_npu.grad is not None
    torch.testing.assert_close(contrib_function.npu_diou(pred.float().npu(), gt.float().npu()).cpu().double(),
                               diou.view(1, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(contrib_function.npu_ciou(pred.float().npu(), gt.float().npu()).cpu().double(),
                               ciou.view(1, -1), rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="npu_diou: only is_cross=False"):
        contrib_function.npu_diou(pred.float(), gt.float(), is_cross=True)


def test_fast_condition_index_put():
    x = torch.randn(4, 5).npu()
    condition = x > 0
    expected = x.clone()
    expected[condition] = 3.0
    torch.testing.assert_close(contrib_function.npu_fast_condition_index_put(x, condition, 3.0), expected)
    with pytest.raises(TypeError, match="condition must be bool"):
        contrib_function.npu_fast_condition_index_put(x, condition.int(), 3.0)


# ---- autocast and compile ----------------------------------------------------------------------

def test_roi_align_under_autocast_reads_fp16_features_in_fp32():
    torch.manual_seed(13)
    conv = torch.nn.Conv2d(3, 4, 1).npu()
    rois = torch.tensor([[0, 0.5, 0.5, 5.0, 6.0]]).npu()
    with torch.autocast("npu", dtype=torch.float16):
        features = conv(torch.randn(1, 3, 8, 8).npu())
        pooled = contrib_module.ROIAlign((2, 2), 1.0, 2)(features, rois)
    assert features.dtype == torch.float16 and pooled.dtype == torch.float32
    expected = roi_align_fp64(features.cpu(), rois.cpu(), 2, 2, 1.0, 2, True)
    torch.testing.assert_close(pooled.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_contrib_layers_under_compile_equal_eager():
    torch.manual_seed(14)
    drop_path = contrib_module.NpuDropPath(0.3).eval()
    shuffle = contrib_module.ChannelShuffle(8, split_shuffle=False)

    def block(q, k, a, b):
        scores = contrib_function.matmul_transpose(q, k)
        return drop_path(scores), shuffle(a, b)

    inputs = (torch.randn(2, 4, 8).npu(), torch.randn(2, 5, 8).npu(), torch.randn(1, 4, 2, 2).npu(),
              torch.randn(1, 4, 2, 2).npu())
    compiled = torch.compile(block, backend="npu", fullgraph=True)
    for got, expected in zip(compiled(*inputs), block(*inputs), strict=True):
        torch.testing.assert_close(got.cpu(), expected.cpu())
