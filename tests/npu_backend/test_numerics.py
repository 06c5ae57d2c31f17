"""NPU numeric policies: fp16 saturation, fp32 accumulation, HF32, float64 rejection."""

import pytest
import torch

from npukit.npu_backend import numerics


def test_inf_nan_mode_is_the_default():
    x = torch.full((3,), 60000.0, dtype=torch.float16, device="npu")
    assert torch.isinf((x + x).cpu()).all()
    assert not torch.npu.get_npu_overflow_flag()


def test_saturation_mode_clamps_and_sets_sticky_flag():
    numerics.set_fp16_mode("saturation")
    x = torch.full((3,), 60000.0, dtype=torch.float16, device="npu")
    y = x + x
    assert y.cpu().tolist() == [65504.0] * 3
    assert torch.npu.get_npu_overflow_flag()
    z = torch.ones(2, dtype=torch.float16, device="npu") * 2  # a healthy op leaves the flag set
    assert z.cpu().tolist() == [2.0, 2.0] and torch.npu.get_npu_overflow_flag()
    torch.npu.clear_npu_overflow_flag()
    assert not torch.npu.get_npu_overflow_flag()
    neg = (-x) * 2
    assert neg.cpu().tolist() == [-65504.0] * 3
    nan = torch.zeros(2, dtype=torch.float16, device="npu") / 0
    assert nan.cpu().tolist() == [0.0, 0.0]
    cast = torch.full((2,), 1e6, device="npu").half()  # fp32 -> fp16 casts saturate too
    assert cast.cpu().tolist() == [65504.0, 65504.0]


def test_saturation_in_backward_sets_flag():
    numerics.set_fp16_mode("saturation")
    w = torch.full((4,), 300.0, dtype=torch.float16, device="npu", requires_grad=True)
    (w * w * w).sum().backward()  # forward saturates (2.7e7) and so does the gradient (3 w^2 = 270000)
    assert w.grad.cpu().tolist() == [65504.0] * 4
    assert torch.npu.get_npu_overflow_flag()


def test_fp16_matmul_accumulates_in_fp32():
    torch.manual_seed(0)
    a = torch.randn(64, 512).half()
    b = torch.randn(512, 64).half()
    expected = (a.float() @ b.float()).half()
    assert torch.equal((a.npu() @ b.npu()).cpu(), expected)
    expected_bf16 = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16()
    assert torch.equal((a.bfloat16().npu() @ b.bfloat16().npu()).cpu(), expected_bf16)


def test_hf32_rounds_fp32_matmul_inputs_only_when_allowed():
    torch.manual_seed(0)
    a = torch.randn(32, 32)
    b = torch.randn(32, 32)
    exact = a @ b
    assert torch.equal((a.npu() @ b.npu()).cpu(), exact)
    torch.npu.matmul.allow_hf32 = True
    hf32 = (a.npu() @ b.npu()).cpu()
    rounded = numerics._C.round_to_hf32(a) @ numerics._C.round_to_hf32(b)
    assert torch.equal(hf32, rounded)
    assert not torch.equal(hf32, exact)
    assert (hf32 - exact).abs().max() < 1e-2


def test_hf32_rounding_keeps_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 3 * 2**-11, float("inf"), -2.5])
    rounded = numerics._C.round_to_hf32(x)
    # 1 + 2^-11 is a tie: rounds to even (1.0); 1 + 3*2^-11 rounds up to 1 + 2^-9.
    assert rounded.tolist() == [1.0 + 2**-10, 1.0, 1.0 + 2**-9, float("inf"), -2.5]


def test_conv_hf32_default_and_golden_exactness():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 16, 16)
    expected = conv(x)
    npu_conv = conv.npu()
    assert not torch.equal(npu_conv(x.npu()).cpu(), expected)  # HF32 by default, as torch_npu
    with numerics.golden():
        assert torch.equal(npu_conv(x.npu()).detach().cpu(), expected.detach())


def test_float64_matmul_and_conv_raise_naming_op():
    a = torch.randn(3, 3, dtype=torch.float64, device="npu")
    with pytest.raises(RuntimeError, match=r"aten::mm: float64 is not supported"):
        a @ a
    with pytest.raises(RuntimeError, match=r"aten::convolution: float64"):
        torch.nn.functional.conv2d(torch.randn(1, 1, 4, 4, dtype=torch.float64, device="npu"),
                                   torch.randn(1, 1, 3, 3, dtype=torch.float64, device="npu"))
    assert (a + a).dtype == torch.float64  # elementwise fp64 runs (on the AI CPU)
    numerics.configure(reject_fp64=False)
    assert (a @ a).dtype == torch.float64


def test_policies_switch_from_environment():
    from tests.npu_backend.conftest import run_python

    code = """
        import npukit.npu_backend, torch
        from npukit.npu_backend import numerics
        print(numerics.current().fp16_mode, numerics.current().fp32_accumulate)
    """
    assert run_python(code, env={"NPUKIT_FP16_MODE": "saturation"}).stdout.split() == ["saturation", "True"]
    assert run_python(code, env={"INF_NAN_MODE_ENABLE": "0"}).stdout.split()[0] == "saturation"
    assert run_python(code, env={"NPUKIT_FP32_ACCUMULATE": "0"}).stdout.split() == ["inf_nan", "False"]
    bad = run_python(code, env={"NPUKIT_FP16_MODE": "clamp"})
    assert bad.returncode != 0 and "NPUKIT_FP16_MODE='clamp'" in bad.stderr


def test_invalid_mode_names_the_value():
    from npukit.errors import UserError

    with pytest.raises(UserError, match="'half-saturation'"):
        numerics.set_fp16_mode("half-saturation")


def test_an_hf32_conv_forward_without_a_backward_leaves_nothing_for_the_next_input():
    """The HF32 copy of a conv input is kept from the forward for the backward. A forward with grad
    on and no backward (a validation loss) left its copy behind, and a new input allocated at the
    same address took it: the weight gradient was computed from the old input (9 wrong in 50)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to("npu")
    batch = torch.randn(2, 3, 8, 8)

    def weight_grad(x):
        conv.weight.grad = None
        conv(x).sum().backward()
        return conv.weight.grad.clone()

    expected = weight_grad(batch.to("npu"))
    reused, wrong = 0, 0
    for _ in range(50):
        other = torch.randn(2, 3, 8, 8).to("npu")
        conv(other)  # no backward
        address = other.data_ptr()
        del other
        x = batch.to("npu")
        reused += x.data_ptr() == address
        wrong += not torch.equal(weight_grad(x), expected)
    assert reused > 0  # the case arose
    assert wrong == 0
