import struct

import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference


def round_half_even(values: torch.Tensor) -> torch.Tensor:
    """The documented round (CAST_RINT) in fp64: ties to the even integer."""
    return torch.round(values.double())


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """Reference int4 unpacking written element by element from the documented layout: value i of a
    word in bits 4i..4i+3, two's complement."""
    flat = []
    for word in words.reshape(-1).tolist():
        unsigned = word & 0xFFFFFFFF
        for i in range(8):
            nibble = (unsigned >> (4 * i)) & 0xF
            flat.append(nibble - 16 if nibble >= 8 else nibble)
    return torch.tensor(flat, dtype=torch.int64).reshape(*words.shape[:-1], words.shape[-1] * 8)


def dynamic_quant_fp64(x, dtype_max, smooth=None):
    values = x.double() if smooth is None else x.double() * smooth.double()
    scale = values.abs().amax(-1, keepdim=True) / dtype_max
    return round_half_even(values / scale), scale.squeeze(-1)


def assert_integers_match(actual, expected, what):
    """Quantized values equal the fp64 reference except at ties the fp32 kernel may see on the
    other side (at most one step, at most a few per thousand)."""
    diff = (actual.cpu().long() - expected.long()).abs()
    assert int(diff.max()) <= 1, f"{what}: off by {int(diff.max())}"
    assert float((diff > 0).double().mean()) < 5e-3, f"{what}: {int((diff > 0).sum())} values differ"


# ---- npu_dynamic_quant ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dynamic_quant_per_token_int8_against_fp64(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    y, scale = torch_npu.npu_dynamic_quant(x.npu())
    assert y.dtype == torch.int8 and y.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 5)
    y_ref, scale_ref = dynamic_quant_fp64(x, 127.0)
    torch.testing.assert_close(scale.cpu().double(), scale_ref, rtol=1e-6, atol=0)
    assert_integers_match(y, y_ref, "y")
    # every row's largest magnitude lands on +-127
    assert torch.equal(y.cpu().abs().amax(-1), torch.full((3, 5), 127, dtype=torch.int8))


def test_dynamic_quant_rounds_half_to_even():
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.5, -1.5, 1.25, 126.5]], dtype=torch.float16)
    y, scale = torch_npu.npu_dynamic_quant(x.npu())
    assert scale.item() == 1.0
    assert y.cpu().tolist() == [[127, 2, -2, 4, 0, -2, 1, 126]]


def test_dynamic_quant_smooth_scales_and_moe_group_index():
    torch.manual_seed(1)
    x = torch.randn(6, 32).half()
    smooth = (torch.rand(32) + 0.5).half()
    y, scale = torch_npu.npu_dynamic_quant(x.npu(), smooth_scales=smooth.npu())
    y_ref, scale_ref = dynamic_quant_fp64(x, 127.0, smooth)
    torch.testing.assert_close(scale.cpu().double(), scale_ref, rtol=1e-6, atol=0)
    assert_integers_match(y, y_ref, "smoothed y")

    experts = (torch.rand(3, 32) + 0.5).half()
    group_index = torch.tensor([2, 2, 6], dtype=torch.int32)  # rows 0-1 expert 0, none expert 1, 2-5 expert 2
    y, scale = torch_npu.npu_dynamic_quant(x.npu(), smooth_scales=experts.npu(), group_index=group_index.npu())
    per_row = experts[[0, 0, 2, 2, 2, 2]]
    y_ref, scale_ref = dynamic_quant_fp64(x, 127.0, per_row)
    torch.testing.assert_close(scale.cpu().double(), scale_ref, rtol=1e-6, atol=0)
    assert_integers_match(y, y_ref, "MoE y")


def test_dynamic_quant_int4_output_is_packed_eight_to_an_int32():
    torch.manual_seed(2)
    x = torch.randn(4, 32).half()
    y, scale = torch_npu.npu_dynamic_quant(x.npu(), dst_type=torch.quint4x2)
    assert y.dtype == torch.int32 and y.shape == (4, 4)
    y_ref, scale_ref = dynamic_quant_fp64(x, 7.0)
    torch.testing.assert_close(scale.cpu().double(), scale_ref, rtol=1e-6, atol=0)
    assert_integers_match(unpack_nibbles(y.cpu()), y_ref, "int4 y")


def test_dynamic_quant_refuses_float32_and_bad_mode():
    with pytest.raises(ValueError, match="npu_dynamic_quant: input must be float16 or bfloat16"):
        torch_npu.npu_dynamic_quant(torch.randn(2, 8).npu())
    with pytest.raises(ValueError, match="npu_dynamic_quant: quant_mode"):
        torch_npu.npu_dynamic_quant(torch.randn(2, 8).half().npu(), quant_mode="perrow")


def test_dynamic_quant_under_compile_equals_eager():
    x = torch.randn(4, 16).half().npu()
    compiled = torch.compile(lambda t: torch_npu.npu_dynamic_quant(t), backend="npu", fullgraph=True)
    y, scale = compiled(x)
    y_eager, scale_eager = torch_npu.npu_dynamic_quant(x)
    assert torch.equal(y.cpu(), y_eager.cpu()) and torch.equal(scale.cpu(), scale_eager.cpu())


@pytest.mark.parametrize(("dst_type", "low", "high"), [(torch.int8, -128, 127), (torch.quint4x2, -8, 7)])
def test_dynamic_quant_asymmetric_against_fp64(dst_type, low, high):
    torch.manual_seed(20)
    x = (torch.randn(5, 32) * 3 + 1).half()
    smooth = (torch.rand(32) + 0.5).half()
    y, scale, offset = torch_npu.npu_dynamic_quant_asymmetric(x.npu(), smooth_scales=smooth.npu(), dst_type=dst_type)
    values = x.double() * smooth.double()
    row_max, row_min = values.amax(-1, keepdim=True), values.amin(-1, keepdim=True)
    scale_ref = (row_max - row_min) / (high - low)
    offset_ref = high - row_max / scale_ref
    y_ref = round_half_even(values / scale_ref + offset_ref).clamp(low, high)
    assert scale.shape == offset.shape == (5,) and scale.dtype == offset.dtype == torch.float32
    torch.testing.assert_close(scale.cpu().double(), scale_ref.squeeze(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(offset.cpu().double(), offset_ref.squeeze(-1), rtol=1e-5, atol=1e-5)
    if dst_type == torch.quint4x2:
        assert y.dtype == torch.int32 and y.shape == (5, 4)
        y = unpack_nibbles(y.cpu())
    assert_integers_match(y, y_ref, "asymmetric y")
    # every row spans the whole range
    assert (y.cpu().long().amax(-1) == high).all() and (y.cpu().long().amin(-1) == low).all()


# ---- npu_quantize / npu_anti_quant ---------------------------------------------------------------

def test_quantize_div_mode_per_channel_with_zero_points_saturates():
    torch.manual_seed(3)
    x = torch.randn(2, 4, 5) * 50
    scales = torch.tensor([0.5, 1.0, 2.0, 0.25])
    zero_points = torch.tensor([3, -2, 0, 10], dtype=torch.int8)
    y = torch_npu.npu_quantize(x.npu(), scales.npu(), zero_points.npu(), torch.qint8, axis=1)
    assert y.dtype == torch.int8
    expected = round_half_even(x.double() / scales.double()[:, None] + zero_points.double()[:, None])
    assert torch.equal(y.cpu().long(), expected.clamp(-128, 127).long())

    y = torch_npu.npu_quantize(x.npu(), scales.npu(), None, torch.quint8, axis=1)
    assert y.dtype == torch.uint8
    expected = round_half_even(x.double() / scales.double()[:, None]).clamp(0, 255)
    assert torch.equal(y.cpu().long(), expected.long())


def test_quantize_multiply_mode_axis_and_int4():
    torch.manual_seed(4)
    x = torch.randn(3, 4, 16).half()
    scales = (torch.rand(16) * 3).half()
    offsets = torch.randn(16).half()
    y = torch_npu.npu_quantize(x.npu(), scales.npu(), offsets.npu(), torch.qint8, -1, False)
    expected = round_half_even(x.double() * scales.double() + offsets.double()).clamp(-128, 127)
    assert_integers_match(y, expected, "div_mode=False")

    row_scales = (torch.rand(4) * 3).half()
    y = torch_npu.npu_quantize(x.npu(), row_scales.npu(), None, torch.qint8, -2, False)
    expected = round_half_even(x.double() * row_scales.double()[:, None]).clamp(-128, 127)
    assert_integers_match(y, expected, "axis=-2")

    y = torch_npu.npu_quantize(x.npu(), scales.npu(), None, torch.quint4x2, -1, False)
    assert y.dtype == torch.int32 and y.shape == (3, 4, 2)
    expected = round_half_even(x.double() * scales.double()).clamp(-8, 7)
    assert_integers_match(unpack_nibbles(y.cpu()), expected, "int4")


def test_quantize_refuses_a_dtype_the_mode_does_not_support():
    with pytest.raises(ValueError, match="npu_quantize: dtype=torch.quint4x2 is not supported"):
        torch_npu.npu_quantize(torch.randn(2, 8).npu(), torch.ones(1).npu(), None, torch.quint4x2)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_anti_quant_int8_and_int4_against_fp64(out_dtype):
    torch.manual_seed(5)
    x = torch.randint(-128, 128, (3, 16), dtype=torch.int8)
    scale = torch.rand(16) * 0.1
    offset = torch.randn(16)
    y = torch_npu.npu_anti_quant(x.npu(), scale.npu(), offset=offset.npu(), dst_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    expected = (x.double() + offset.double()) * scale.double()
    assert_close_to_reference(y, expected, out_dtype, "anti_quant int8")

    values = torch.randint(-8, 8, (3, 16), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(values.npu())
    assert torch.equal(unpack_nibbles(packed.cpu()), values.long())
    y = torch_npu.npu_anti_quant(packed, scale.npu(), dst_dtype=out_dtype)
    assert y.shape == (3, 16)
    assert_close_to_reference(y, values.double() * scale.double(), out_dtype, "anti_quant int4")


# ---- npu_trans_quant_param -----------------------------------------------------------------------

def fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def test_trans_quant_param_packs_fp19_scale_offset_and_flag():
    scale = torch.tensor([0.0123456, 3.5, 1e-5])
    offset = torch.tensor([-300.0, 7.6, 255.0])
    words = torch_npu.npu_trans_quant_param(scale.npu(), offset.npu()).cpu()
    assert words.dtype == torch.int64 and words.shape == (3,)
    for word, s, o in zip(words.tolist(), scale.tolist(), offset.tolist(), strict=True):
        offset_int = max(min(round(o), 255), -256)
        expected = (fp32_bits(s) & 0xFFFFE000) | (1 << 46) | ((offset_int & 0x1FF) << 37)
        assert word == expected
    rounded = torch_npu.npu_trans_quant_param(scale.npu(), round_mode=1).cpu()
    for word, s in zip(rounded.tolist(), scale.tolist(), strict=True):
        assert word == (((fp32_bits(s) + 0x1000) & 0xFFFFE000) | (1 << 46))


# ---- npu_quant_matmul ----------------------------------------------------------------------------

def int_matmul_fp64(a, b):
    return a.double() @ b.double()  # exact: |sums| < 2**53


def test_quant_matmul_int32_output_is_the_exact_accumulator():
    torch.manual_seed(6)
    a = torch.randint(-128, 128, (2, 5, 300), dtype=torch.int8)
    b = torch.randint(-128, 128, (300, 24), dtype=torch.int8)
    bias = torch.randint(-1000, 1000, (24,), dtype=torch.int32)
    y = torch_npu.npu_quant_matmul(a.npu(), b.npu(), torch.ones(1).npu(), bias=bias.npu(), output_dtype=torch.int32)
    assert y.dtype == torch.int32 and y.shape == (2, 5, 24)
    assert torch.equal(y.cpu().double(), int_matmul_fp64(a, b) + bias.double())


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_quant_matmul_pertoken_scale_and_float_bias_against_fp64(out_dtype):
    torch.manual_seed(7)
    a = torch.randint(-128, 128, (6, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (64, 32), dtype=torch.int8)
    scale = torch.rand(32) * 1e-3
    pertoken = torch.rand(6) * 1e-2
    bias = torch.randn(32)
    y = torch_npu.npu_quant_matmul(a.npu(), b.npu(), scale.npu(), pertoken_scale=pertoken.npu(), bias=bias.npu(),
                                   output_dtype=out_dtype)
    assert y.dtype == out_dtype
    expected = int_matmul_fp64(a, b) * scale.double() * pertoken.double()[:, None] + bias.double()
    assert_close_to_reference(y, expected, out_dtype, "quant_matmul")


def test_quant_matmul_int8_output_uses_the_fp19_scale_and_rounds_half_to_even():
    torch.manual_seed(8)
    a = torch.randint(-128, 128, (8, 48), dtype=torch.int8)
    b = torch.randint(-128, 128, (48, 16), dtype=torch.int8)
    scale = torch.rand(16) * 2e-3 + 1e-4
    offset = torch.randn(16) * 3
    words = torch_npu.npu_trans_quant_param(scale.npu(), offset.npu())
    bias = torch.randint(-500, 500, (16,), dtype=torch.int32)
    y = torch_npu.npu_quant_matmul(a.npu(), b.npu(), words, bias=bias.npu())
    assert y.dtype == torch.int8
    fp19 = torch.tensor([struct.unpack("<f", struct.pack("<I", fp32_bits(s) & 0xFFFFE000))[0]
                         for s in scale.tolist()], dtype=torch.float64)
    offset_int = torch.round(offset.double()).clamp(-256, 255)
    expected = round_half_even((int_matmul_fp64(a, b) + bias.double()) * fp19 + offset_int).clamp(-128, 127)
    assert_integers_match(y, expected, "int8 out")


def test_quant_matmul_int4_with_transposed_packed_weight():
    torch.manual_seed(9)
    a_values = torch.randint(-8, 8, (4, 32), dtype=torch.int32)
    w_values = torch.randint(-8, 8, (24, 32), dtype=torch.int32)  # (n, k), as LinearQuant stores it
    a = torch_npu.npu_convert_weight_to_int4pack(a_values.npu())
    w = torch_npu.npu_convert_weight_to_int4pack(w_values.npu())  # (n, k // 8)
    scale = torch.rand(1) * 0.1
    y = torch_npu.npu_quant_matmul(a, w.t(), scale.npu(), output_dtype=torch.float16)
    assert y.shape == (4, 24) and y.dtype == torch.float16
    expected = int_matmul_fp64(a_values, w_values.t()) * scale.double()
    assert_close_to_reference(y, expected, torch.float16, "a4w4")


def test_quant_matmul_names_unsupported_arguments():
    a = torch.zeros(2, 8, dtype=torch.int8).npu()
    with pytest.raises(ValueError, match="npu_quant_matmul: x1 and x2 must both be int8"):
        torch_npu.npu_quant_matmul(a, torch.zeros(8, 4).npu(), torch.ones(1).npu())
    with pytest.raises(NotImplementedError, match="npu_quant_matmul: x1_dtype"):
        torch_npu.npu_quant_matmul(a, a.t(), torch.ones(1).npu(), x1_dtype=291)
    with pytest.raises(ValueError, match="npu_quant_matmul: x1's k"):
        torch_npu.npu_quant_matmul(a, a, torch.ones(1).npu())
    with pytest.raises(ValueError, match="npu_quant_matmul: a bfloat16 bias needs output_dtype=torch.bfloat16"):
        torch_npu.npu_quant_matmul(a, a.t(), torch.ones(1).npu(), bias=torch.ones(2).bfloat16().npu(),
                                   output_dtype=torch.float16)
    with pytest.raises(ValueError, match="npu_quant_matmul: a bfloat16 scale"):
        torch_npu.npu_quant_matmul(a, a.t(), torch.ones(1).bfloat16().npu(), output_dtype=torch.float16)


# ---- npu_weight_quant_batchmatmul ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_quant_batchmatmul_per_channel_int8_against_fp64(dtype):
    torch.manual_seed(10)
    x = torch.randn(5, 64).to(dtype)
    w = torch.randint(-128, 128, (64, 24), dtype=torch.int8)
    scale = (torch.rand(24) * 0.02).to(dtype)
    offset = torch.randn(24).to(dtype)
    bias = torch.randn(24) if dtype == torch.bfloat16 else torch.randn(24).half()
    y = torch_npu.npu_weight_quant_batchmatmul(x.npu(), w.npu(), scale.npu(), offset.npu(), bias=bias.npu())
    assert y.dtype == dtype and y.shape == (5, 24)
    expected = x.double() @ ((w.double() + offset.double()) * scale.double()) + bias.double()
    # the dequantized weight is rounded to x's dtype before the matmul, as the kernel feeds the cube
    assert_close_to_reference(y, expected, dtype, "weight_quant per-channel", factor=2)


def test_weight_quant_batchmatmul_per_group_int4_and_requant():
    torch.manual_seed(11)
    k, n, group = 128, 16, 32
    x = torch.randn(3, k).half()
    w_values = torch.randint(-8, 8, (k, n), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(w_values.npu())
    scale = (torch.rand(k // group, n) * 0.1).half()
    offset = torch.randn(k // group, n).half()
    y = torch_npu.npu_weight_quant_batchmatmul(x.npu(), packed, scale.npu(), offset.npu(), antiquant_group_size=group)
    w_ref = (w_values.double() + offset.double().repeat_interleave(group, 0)) * scale.double().repeat_interleave(group, 0)
    expected = x.double() @ w_ref
    assert y.shape == (3, n)
    assert_close_to_reference(y, expected, torch.float16, "per-group int4", factor=2)

    quant_scale = torch.rand(n) * 2
    y8 = torch_npu.npu_weight_quant_batchmatmul(x.npu(), packed, scale.npu(), offset.npu(),
                                                quant_scale=quant_scale.npu(), antiquant_group_size=group)
    assert y8.dtype == torch.int8
    requant = round_half_even(y.cpu().double() * quant_scale.double()).clamp(-128, 127)
    diff = (y8.cpu().long() - requant.long()).abs()
    assert int(diff.max()) <= 1  # requantized from the fp32 result, not the fp16-rounded one


def test_weight_quant_batchmatmul_golden_run_is_the_cpu_reference():
    torch.manual_seed(12)
    x = torch.randn(4, 64).half()
    w = torch.randint(-128, 128, (64, 8), dtype=torch.int8)
    scale = (torch.rand(8) * 0.01).half()
    with numerics.golden():
        golden = torch_npu.npu_weight_quant_batchmatmul(x.npu(), w.npu(), scale.npu()).cpu()
    cpu = torch_npu.npu_weight_quant_batchmatmul(x, w, scale)
    assert torch.equal(golden, cpu)


def test_weight_quant_batchmatmul_under_autocast():
    torch.manual_seed(13)
    w = torch.randint(-128, 128, (16, 8), dtype=torch.int8).npu()
    scale = (torch.rand(8) * 0.01).half().npu()
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(torch.randn(4, 16).npu(), torch.randn(16, 16).npu())
        y = torch_npu.npu_weight_quant_batchmatmul(h, w, scale)
    assert y.dtype == torch.float16
    expected = h.cpu().double() @ (w.cpu().double() * scale.cpu().double())
    assert_close_to_reference(y, expected, torch.float16, "autocast", factor=2)


def test_weight_quant_batchmatmul_refuses_a_float_weight():
    with pytest.raises(ValueError, match="npu_weight_quant_batchmatmul: weight must be int8"):
        torch_npu.npu_weight_quant_batchmatmul(torch.randn(2, 8).half().npu(), torch.randn(8, 4).half().npu(),
                                               torch.ones(1).half().npu())
