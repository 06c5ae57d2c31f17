"""`torch_npu.contrib.module` on the emulated NPU.

The wheel's contrib modules wrap fused NPU kernels in nn.Modules. Those that LLM and vision
training code uses are real modules here, computing what their docstrings state with PyTorch ops
and the emulator's fused ops (LinearQuant, LinearA8W8Quant and LinearWeightQuant call
npu_quant_matmul / npu_weight_quant_batchmatmul): ChannelShuffle, Prefetcher,
LabelSmoothingCrossEntropy, ROIAlign, NpuFairseqDropout (= NpuCachedDropout), NpuDropPath, Focus,
DropoutWithByteMask, Mish, SiLU (= Swish), BiLSTM, FastBatchNorm1d/2d/3d, FastSyncBatchNorm and
the three quantized linears. Parameter and buffer names are the wheel's, so checkpoints load.
Every other name the wheel exports is an attribute that raises one NotImplementedError naming it
and its plain-PyTorch equivalent.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter
from torch.nn.modules.utils import _pair

from npukit.npu_backend.fused.contrib_function import dropout_with_byte_mask

__all__ = [
    "ChannelShuffle", "Prefetcher", "LabelSmoothingCrossEntropy", "ROIAlign", "ModulatedDeformConv", "PSROIPool",
    "NpuFairseqDropout", "NpuCachedDropout", "MultiheadAttention", "NpuDropPath", "Focus", "LinearA8W8Quant",
    "LinearQuant", "LinearWeightQuant", "DropoutWithByteMask", "QuantConv2d",
    # exported by torch_npu.contrib (and importable from torch_npu.contrib.module) as well
    "DCNv2", "Mish", "SiLU", "Swish", "BiLSTM", "FusedColorJitter", "FastBatchNorm1d", "FastBatchNorm2d",
    "FastBatchNorm3d", "FastSyncBatchNorm",
]
# torch_npu.contrib re-exports these (the shim sets them on the package)
PARENT_EXPORTS = [
    "ChannelShuffle", "Prefetcher", "LabelSmoothingCrossEntropy", "ROIAlign", "DCNv2", "ModulatedDeformConv", "Mish",
    "BiLSTM", "PSROIPool", "SiLU", "Swish", "NpuFairseqDropout", "NpuCachedDropout", "MultiheadAttention",
    "FusedColorJitter", "NpuDropPath", "Focus", "FastBatchNorm1d", "FastBatchNorm2d", "FastBatchNorm3d",
    "FastSyncBatchNorm", "LinearA8W8Quant", "LinearQuant", "LinearWeightQuant",
]
# The wheel's module files and their names (the op docs' examples import from them:
# `from torch_npu.contrib.module.npu_modules import DropoutWithByteMask`).
_FAST_BATCH_NORMS = ("FastBatchNorm1d", "FastBatchNorm2d", "FastBatchNorm3d", "FastSyncBatchNorm")
WHEEL_SUBMODULES = {
    "activations": ("Mish", "SiLU", "Swish"), "bidirectional_lstm": ("BiLSTM",), "channel_shuffle": ("ChannelShuffle",),
    "crossentropy": ("LabelSmoothingCrossEntropy",), "deform_conv": ("ModulatedDeformConv", "DCNv2"),
    "drop_path": ("NpuDropPath",), "ensemble_dropout": ("NpuCachedDropout", "NpuFairseqDropout"), "focus": ("Focus",),
    "fusedcolorjitter": ("FusedColorJitter",), "linear_a8w8_quant": ("LinearA8W8Quant",),
    "linear_quant": ("LinearQuant",), "linear_weight_quant": ("LinearWeightQuant",),
    "multihead_attention": ("MultiheadAttention",), "npu_modules": ("DropoutWithByteMask",),
    "prefetcher": ("Prefetcher",), "ps_roi_pooling": ("PSROIPool",), "quant_conv2d": ("QuantConv2d",),
    "roi_align": ("ROIAlign",), "_batchnorm_with_int32_count": _FAST_BATCH_NORMS,
    "batchnorm_with_int32_count": _FAST_BATCH_NORMS,
}


# ---- activations and dropouts --------------------------------------------------------------------

class Mish(nn.Module):
    """mish(x) = x * tanh(softplus(x)). Deprecated in torch_npu for torch.nn.Mish."""

    def __init__(self):
        super().__init__()
        warnings.warn("torch_npu.contrib.module.Mish is deprecated. Please use torch.nn.Mish as a replacement.",
                      FutureWarning, stacklevel=2)

    def forward(self, x):
        return F.mish(x)


class SiLU(nn.Module):
    """silu(x) = x * sigmoid(x) (also called Swish). Deprecated in torch_npu for torch.nn.SiLU."""

    def __init__(self):
        super().__init__()
        warnings.warn("torch_npu.contrib.module.SiLU is deprecated. Please use torch.nn.SiLU as a replacement.",
                      FutureWarning, stacklevel=2)

    def forward(self, x):
        return F.silu(x)


Swish = SiLU


class DropoutWithByteMask(nn.Module):
    """Dropout through a uint8 keep-mask (contrib.function.dropout_with_byte_mask): elements zeroed
    with probability p in training, the others scaled by 1 / (1 - p)."""

    def __init__(self, p=0.5, inplace=False, max_seed=2 ** 10 - 1):
        super().__init__()
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    def forward(self, input1):
        return dropout_with_byte_mask(input1, self.p, self.training, self.inplace)


class NpuCachedDropout(nn.Dropout):
    """Fairseq's dropout on the NPU: elements zeroed with probability p in training, the others
    scaled by 1 / (1 - p). Called with `[shape, dtype, device]` it returns a uint8 keep-mask of that
    shape (1 = kept), as the wheel hands pre-generated masks to its fused attention.

    torch_npu draws these masks ahead on a side stream once `enable_dropout_ensemble(model)` is
    called; the emulator draws them when they are used, so that call only keeps its signature.
    """

    def __init__(self, p, module_name=None):
        super().__init__(p)
        self.module_name = module_name

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            shape, _dtype, device = x
            return (torch.rand(tuple(shape), device=device) >= self.p).to(torch.uint8)
        if not isinstance(x, torch.Tensor):
            raise RuntimeError(f"NpuCachedDropout: input must be a tensor or [shape, dtype, device], got {type(x)}")
        if self.p == 0 or not self.training:
            return x
        return F.dropout(x, self.p, training=True)

    @classmethod
    def enable_dropout_ensemble(cls, model):
        """Accepted for compatibility: masks are drawn when used on the emulator."""
        return model


NpuFairseqDropout = NpuCachedDropout


class NpuDropPath(nn.Module):
    """Stochastic depth per sample (Swin Transformer's drop path): in training each sample's
    path is dropped with probability drop_prob and kept samples are scaled by 1 / keep_prob."""

    def __init__(self, drop_prob=None):
        super().__init__()
        self.drop_prob = drop_prob
        self.keep_prob = 1 - drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        if not isinstance(x, torch.Tensor):
            raise RuntimeError(f"NpuDropPath: input must be a tensor, got {type(x)}")
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        keep = torch.floor(self.keep_prob + torch.rand(shape, dtype=x.dtype, device=x.device))
        return x.div(self.keep_prob) * keep

    @classmethod
    def enable_droppath_ensemble(cls, model):
        """Accepted for compatibility: random tensors are drawn when used on the emulator."""
        return model


# ---- layers ------------------------------------------------------------------------------------

class ChannelShuffle(nn.Module):
    """Channel shuffle of two inputs concatenated on dim 1 (ShuffleNetV2): channel c of group g
    goes to position c * groups + g; with split_shuffle the result is returned as two halves.

    Args: in_channels (the total of both inputs), groups=2, split_shuffle=True.
    """

    def __init__(self, in_channels, groups=2, split_shuffle=True):
        super().__init__()
        if in_channels % groups:
            raise ValueError(f"ChannelShuffle: in_channels ({in_channels}) must be a multiple of groups ({groups})")
        self.split_shuffle = split_shuffle
        self.group_len = in_channels // groups
        self.out_channels = torch.arange(in_channels).reshape(groups, self.group_len).t().flatten()

    def forward(self, x1, x2):
        x = torch.cat([x1, x2], dim=1)
        shuffled = x.index_select(1, self.out_channels.to(x.device))
        if self.split_shuffle:
            return shuffled[:, :self.group_len], shuffled[:, self.group_len:]
        return shuffled


class Prefetcher:
    """Yields a loader's (input, target) batches already on the NPU, the next one copied while the
    current one is used: `next()` returns (None, None) after the last batch."""

    def __init__(self, loader, stream=None):
        self.loader = iter(loader)
        self.stream = stream if stream is not None else torch.npu.Stream()
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = self.next_target = None
            return
        with torch.npu.stream(self.stream):
            self.next_input = self.next_input.npu(non_blocking=True)
            self.next_target = self.next_target.npu(non_blocking=True)

    def next(self):
        torch.npu.current_stream().wait_stream(self.stream)
        batch = self.next_input, self.next_target
        if self.next_target is not None:
            self.preload()
        return batch


class LabelSmoothingCrossEntropy(nn.Module):
    """Cross entropy against smoothed one-hot labels (1 - smooth_factor on the target class,
    smooth_factor / (num_classes - 1) elsewhere), averaged over the batch in fp32."""

    def __init__(self, num_classes=1000, smooth_factor=0.0):
        super().__init__()
        self.num_classes = num_classes
        self.on_value = 1.0 - smooth_factor
        self.off_value = 1.0 * smooth_factor / (num_classes - 1)

    def forward(self, pred, target):
        labels = torch.full(pred.shape, self.off_value, dtype=torch.float32, device=pred.device)
        labels.scatter_(1, target.long().unsqueeze(1), self.on_value)
        loss = -(labels * F.log_softmax(pred.float(), dim=1)).sum(1)
        return loss.mean(0, dtype=torch.float32)


def _conv_padding(kernel, padding):
    if padding is None:
        return kernel // 2 if isinstance(kernel, int) else [k // 2 for k in kernel]
    return padding


class _FocusConv(nn.Module):
    """YOLOv5's Conv: conv (no bias), BatchNorm, LeakyReLU(0.1)."""

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, _conv_padding(k, p), groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.LeakyReLU(0.1, inplace=True) if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))

    def fuseforward(self, x):
        return self.act(self.conv(x))


class Focus(nn.Module):
    """YOLOv5's Focus: the four pixel-parity slices of the image concatenated on channels
    ([::2, ::2], [1::2, ::2], [::2, 1::2], [1::2, 1::2]), then conv + BN + LeakyReLU.

    Args: c1 (input channels), c2 (output channels), k=1, s=1, p=None, g=1, act=True.
    """

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, act=True):
        super().__init__()
        self.conv = _FocusConv(c1 * 4, c2, k, s, p, g, act)

    def forward(self, x):
        slices = [x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]]
        return self.conv(torch.cat(slices, 1))


class BiLSTM(nn.Module):
    """A bidirectional LSTM made of two unidirectional ones (the second over the reversed
    sequence); output (seq_len, batch, 2 * hidden_size)."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        warnings.warn("torch_npu.contrib.BiLSTM is deprecated. Please check the documentation for a replacement.",
                      FutureWarning, stacklevel=2)
        self.fw_rnn = nn.LSTM(input_size, hidden_size, bidirectional=False)
        self.bw_rnn = nn.LSTM(input_size, hidden_size, bidirectional=False)

    def forward(self, inputs):
        forward_out, _ = self.fw_rnn(inputs)
        backward_out, _ = self.bw_rnn(torch.flip(inputs, [0]))
        return torch.cat((forward_out, torch.flip(backward_out, [0])), 2)


class _Int32CountMixin:
    """torch_npu's fast batch norms count batches in an int32 buffer (int64 ops are slow on NPU)."""

    def _int32_count(self):
        if getattr(self, "num_batches_tracked", None) is not None:
            self.num_batches_tracked = self.num_batches_tracked.to(torch.int32)


class FastBatchNorm1d(_Int32CountMixin, nn.BatchNorm1d):
    """nn.BatchNorm1d with an int32 num_batches_tracked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._int32_count()


class FastBatchNorm2d(_Int32CountMixin, nn.BatchNorm2d):
    """nn.BatchNorm2d with an int32 num_batches_tracked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._int32_count()


class FastBatchNorm3d(_Int32CountMixin, nn.BatchNorm3d):
    """nn.BatchNorm3d with an int32 num_batches_tracked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._int32_count()


class FastSyncBatchNorm(_Int32CountMixin, nn.SyncBatchNorm):
    """nn.SyncBatchNorm with an int32 num_batches_tracked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._int32_count()


# ---- ROIAlign --------------------------------------------------------------------------------------

def _bilinear(features_flat, height, width, y, x):
    """torchvision's roi_align bilinear sample of (K, C, H*W) features at (K, P) points: points
    more than one pixel outside the map are 0, coordinates clamp to the last row/column."""
    outside = (y < -1.0) | (y > height) | (x < -1.0) | (x > width)
    y = y.clamp(min=0)
    x = x.clamp(min=0)
    y_low = y.floor().clamp(max=height - 1)
    x_low = x.floor().clamp(max=width - 1)
    y = torch.where(y_low >= height - 1, y_low, y)
    x = torch.where(x_low >= width - 1, x_low, x)
    y_high = (y_low + 1).clamp(max=height - 1)
    x_high = (x_low + 1).clamp(max=width - 1)
    ly, lx = y - y_low, x - x_low
    hy, hx = 1 - ly, 1 - lx
    channels = features_flat.shape[1]

    def corner(yy, xx):
        index = (yy * width + xx).long().unsqueeze(1).expand(-1, channels, -1)
        return features_flat.gather(2, index)

    value = ((hy * hx).unsqueeze(1) * corner(y_low, x_low) + (hy * lx).unsqueeze(1) * corner(y_low, x_high)
             + (ly * hx).unsqueeze(1) * corner(y_high, x_low) + (ly * lx).unsqueeze(1) * corner(y_high, x_high))
    return torch.where(outside.unsqueeze(1), 0.0, value)


def roi_align(features, rois, output_size, spatial_scale, sampling_ratio, aligned):
    """Detectron2/torchvision RoIAlign of NCHW features for (K, 5) rois [batch index, x1, y1, x2,
    y2]: the mean of sampling_ratio^2 bilinear samples per bin (an adaptive ceil(roi / bin) grid per
    RoI when sampling_ratio <= 0), the box shifted by -0.5 pixel when aligned. Differentiable."""
    pooled_h, pooled_w = _pair(output_size)
    _, channels, height, width = features.shape
    offset = 0.5 if aligned else 0.0
    boxes = rois[:, 1:].to(features.dtype) * spatial_scale - offset
    x1, y1, x2, y2 = boxes.unbind(1)
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:  # legacy Detectron: boxes at least one pixel wide
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
    bin_h, bin_w = roi_h / pooled_h, roi_w / pooled_w
    if sampling_ratio > 0:
        grid_h = torch.full_like(bin_h, float(sampling_ratio))
        grid_w = torch.full_like(bin_w, float(sampling_ratio))
        samples_h = samples_w = int(sampling_ratio)
    else:
        grid_h, grid_w = torch.ceil(roi_h / pooled_h).clamp(min=1), torch.ceil(roi_w / pooled_w).clamp(min=1)
        # one grid as large as the largest RoI's, the samples beyond each RoI's own grid masked out
        samples_h, samples_w = int(grid_h.max()), int(grid_w.max())
    device = features.device
    # coordinates (K, pooled, samples) of each bin's sample rows and columns
    ph = torch.arange(pooled_h, device=device, dtype=features.dtype).view(1, -1, 1)
    pw = torch.arange(pooled_w, device=device, dtype=features.dtype).view(1, -1, 1)
    iy = torch.arange(samples_h, device=device, dtype=features.dtype).view(1, 1, -1)
    ix = torch.arange(samples_w, device=device, dtype=features.dtype).view(1, 1, -1)
    ys = y1.view(-1, 1, 1) + ph * bin_h.view(-1, 1, 1) + (iy + 0.5) * (bin_h / grid_h).view(-1, 1, 1)
    xs = x1.view(-1, 1, 1) + pw * bin_w.view(-1, 1, 1) + (ix + 0.5) * (bin_w / grid_w).view(-1, 1, 1)
    count = len(rois)
    y_grid = ys.view(count, pooled_h, samples_h, 1, 1).expand(count, pooled_h, samples_h, pooled_w, samples_w)
    x_grid = xs.view(count, 1, 1, pooled_w, samples_w).expand(count, pooled_h, samples_h, pooled_w, samples_w)
    features_flat = features.reshape(features.shape[0], channels, height * width)[rois[:, 0].long()]
    values = _bilinear(features_flat, height, width, y_grid.reshape(count, -1), x_grid.reshape(count, -1))
    values = values.view(count, channels, pooled_h, samples_h, pooled_w, samples_w)
    valid = ((iy < grid_h.view(-1, 1, 1)).view(count, 1, 1, samples_h, 1, 1)
             & (ix < grid_w.view(-1, 1, 1)).view(count, 1, 1, 1, 1, samples_w))
    values = values * valid.to(values.dtype)
    total = values.sum(dim=(3, 5))
    return total / (grid_h * grid_w).view(-1, 1, 1, 1)


class ROIAlign(nn.Module):
    """RoIAlign (Detectron2's semantics): (K, C, output_h, output_w) fp32 features of (K, 5) rois
    [batch index, x1, y1, x2, y2] on NCHW input.

    Args: output_size (h, w), spatial_scale, sampling_ratio (0: adaptive), aligned=True.
    """

    def __init__(self, output_size, spatial_scale, sampling_ratio, aligned=True):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input_tensor, rois):
        if rois.dim() != 2 or rois.size(1) != 5:
            raise ValueError(f"ROIAlign: expected rois of shape (K, 5), got {tuple(rois.shape)}")
        return roi_align(input_tensor.float(), rois, self.output_size, self.spatial_scale, self.sampling_ratio,
                         self.aligned)

    def __repr__(self):
        return (f"{type(self).__name__}(output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
                f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned})")


# ---- quantized linears ---------------------------------------------------------------------------

class LinearQuant(nn.Module):
    """A quantized linear layer: y = npu_quant_matmul(x, weight^T, scale, offset, pertoken_scale,
    bias, output_dtype) for int8 x int8 or int4 x int4 (int32-packed) inputs and weights. Without
    pertoken_scale, a float32 scale (and offset) is first packed by npu_trans_quant_param, as
    torch_npu does, unless the output is bfloat16 or int32.

    Args: in_features, out_features, *, bias=True (int32), offset=False, pertoken_scale=False,
    device=None, dtype=None, output_dtype=None. weight (out_features, in_features), scale
    (out_features,) are set by assigning their .data.
    """

    _name = "LinearQuant"

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, offset: bool = False,
                 pertoken_scale: bool = False, device=None, dtype=None, output_dtype=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(torch.empty((out_features, in_features)), False)
        self.scale = Parameter(torch.empty(out_features), False)
        self.output_dtype = output_dtype
        self.offset = Parameter(torch.empty(out_features, dtype=torch.float32), False) if offset else None
        self.pertoken_scale = (Parameter(torch.empty(out_features, dtype=torch.float32), False)
                               if pertoken_scale else None)
        self.bias = Parameter(torch.empty(out_features, dtype=torch.int32), False) if bias else None

    def _check(self, x):
        if not ((x.dtype == torch.int32 and self.weight.dtype == torch.int32)
                or (x.dtype == torch.int8 and self.weight.dtype == torch.int8)):
            raise ValueError(f"{self._name}: input and weight should be both torch.int32 or both torch.int8, but "
                             f"input is {x.dtype} and weight is {self.weight.dtype}")

    def forward(self, x):
        self._check(x)
        scale = self.scale
        if (self.pertoken_scale is None and scale.dtype == torch.float32
                and self.output_dtype not in (torch.bfloat16, torch.int32)):
            scale = torch.ops.npu.npu_trans_quant_param(scale, self.offset)
        return torch.ops.npu.npu_quant_matmul(x, self.weight.transpose(-2, -1), scale, offset=self.offset,
                                              pertoken_scale=self.pertoken_scale, bias=self.bias,
                                              output_dtype=self.output_dtype)


class LinearA8W8Quant(LinearQuant):
    """LinearQuant's predecessor (deprecated in torch_npu), with its dtype checks."""

    _name = "LinearA8W8Quant"

    def __init__(self, in_features: int, out_features: int, **kwargs) -> None:
        warnings.warn("torch_npu.contrib.module.LinearA8W8Quant is deprecated and will be removed in a future "
                      "version. Use torch_npu.contrib.module.LinearQuant instead.", FutureWarning, stacklevel=2)
        super().__init__(in_features, out_features, **kwargs)

    def _check(self, x):
        super()._check(x)
        checks = (("scale", self.scale, (torch.int64, torch.float32, torch.bfloat16)),
                  ("offset", self.offset, (torch.float32,)),
                  ("bias", self.bias, (torch.int32, torch.bfloat16, torch.float16, torch.float32)),
                  ("pertoken_scale", self.pertoken_scale, (torch.float32,)))
        for name, tensor, allowed in checks:
            if tensor is not None and tensor.dtype not in allowed:
                raise ValueError(f"LinearA8W8Quant: {name} should be one of {allowed}, but it is {tensor.dtype}")
        if self.output_dtype not in (None, torch.int8, torch.float16, torch.bfloat16):
            raise ValueError(f"LinearA8W8Quant: output_dtype should be torch.int8, torch.float16 or torch.bfloat16, "
                             f"but it is {self.output_dtype}")


class LinearWeightQuant(nn.Module):
    """A weight-only quantized linear layer: y = x @ ((weight + antiquant_offset) *
    antiquant_scale)^T + bias through npu_weight_quant_batchmatmul (int8 or int32-packed int4
    weight, per-channel or per-group scales; int8 output when quant_scale is set).

    Args: in_features, out_features, bias=True, device=None, dtype=None, antiquant_offset=False,
    quant_scale=False, quant_offset=False, antiquant_group_size=0, inner_precise=0, weight_dtype=None.
    """

    def __init__(self, in_features, out_features, bias: bool = True, device=None, dtype=None,
                 antiquant_offset: bool = False, quant_scale: bool = False, quant_offset: bool = False,
                 antiquant_group_size: int = 0, inner_precise: int = 0, weight_dtype=None) -> None:
        super().__init__()
        self.weight = Parameter(torch.empty((out_features, in_features), device=device), False)
        self.antiquant_scale = Parameter(torch.empty(out_features, device=device), False)
        self.antiquant_offset = (Parameter(torch.empty(out_features, device=device), False)
                                 if antiquant_offset else None)
        self.quant_scale = Parameter(torch.empty(out_features, device=device), False) if quant_scale else None
        self.quant_offset = Parameter(torch.empty(out_features, device=device), False) if quant_offset else None
        self.bias = Parameter(torch.empty(out_features, device=device), False) if bias else None
        self.antiquant_group_size = antiquant_group_size
        self.inner_precise = inner_precise
        self.weight_dtype = weight_dtype

    def forward(self, x):
        # 2-D per-group parameters are stored (out_features, groups), the op takes (groups, N)
        scale = self.antiquant_scale.transpose(-1, -2) if self.antiquant_scale.dim() == 2 else self.antiquant_scale
        offset = self.antiquant_offset
        if offset is not None and offset.dim() == 2:
            offset = offset.transpose(-1, -2)
        return torch.ops.npu.npu_weight_quant_batchmatmul(
            x, self.weight.transpose(-1, -2), scale, offset, self.quant_scale, self.quant_offset, self.bias,
            self.antiquant_group_size, self.inner_precise, weight_dtype=self.weight_dtype)


# ---- not emulated --------------------------------------------------------------------------------

def _not_emulated_module(name: str, equivalent: str) -> type:
    message = f"torch_npu.contrib.module.{name} is not emulated by npukit; use {equivalent} instead"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(message)

    return type(name, (nn.Module,), {"__init__": __init__, "__doc__": message, "npukit_missing": True,
                                     "__module__": __name__})


ModulatedDeformConv = _not_emulated_module("ModulatedDeformConv", "torchvision.ops.DeformConv2d (with its mask argument)")
DCNv2 = _not_emulated_module("DCNv2", "torchvision.ops.DeformConv2d (with its mask argument)")
PSROIPool = _not_emulated_module("PSROIPool", "torchvision.ops.PSRoIPool")
MultiheadAttention = _not_emulated_module("MultiheadAttention", "torch.nn.MultiheadAttention")
QuantConv2d = _not_emulated_module("QuantConv2d", "torch.nn.Conv2d on dequantized weights (torch_npu.npu_anti_quant)")
FusedColorJitter = _not_emulated_module("FusedColorJitter", "torchvision.transforms.ColorJitter")
