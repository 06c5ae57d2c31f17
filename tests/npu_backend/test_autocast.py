"""torch.autocast("npu") follows PyTorch's published CUDA autocast op lists, op by op."""

import pytest
import torch
import torch.nn.functional as F


def t(*shape, dtype=torch.float32):
    return torch.rand(*shape, device="npu", dtype=dtype) + 0.5


# "CUDA Ops that can autocast to float16" (torch.amp docs), fp32 inputs -> lower precision.
LOWER_PRECISION = {
    "__matmul__": lambda: t(4, 4) @ t(4, 4),
    "addbmm": lambda: torch.addbmm(t(4, 4), t(2, 4, 4), t(2, 4, 4)),
    "addmm": lambda: torch.addmm(t(4, 4), t(4, 4), t(4, 4)),
    "addmv": lambda: torch.addmv(t(4), t(4, 4), t(4)),
    "addr": lambda: torch.addr(t(4, 4), t(4), t(4)),
    "baddbmm": lambda: torch.baddbmm(t(2, 4, 4), t(2, 4, 4), t(2, 4, 4)),
    "bmm": lambda: torch.bmm(t(2, 4, 4), t(2, 4, 4)),
    "chain_matmul": lambda: torch.linalg.multi_dot([t(4, 4), t(4, 4), t(4, 4)]),
    "conv1d": lambda: F.conv1d(t(1, 2, 8), t(3, 2, 3)),
    "conv2d": lambda: F.conv2d(t(1, 2, 8, 8), t(3, 2, 3, 3)),
    "conv3d": lambda: F.conv3d(t(1, 2, 4, 4, 4), t(3, 2, 3, 3, 3)),
    "conv_transpose1d": lambda: F.conv_transpose1d(t(1, 2, 8), t(2, 3, 3)),
    "conv_transpose2d": lambda: F.conv_transpose2d(t(1, 2, 8, 8), t(2, 3, 3, 3)),
    "conv_transpose3d": lambda: F.conv_transpose3d(t(1, 2, 4, 4, 4), t(2, 3, 3, 3, 3)),
    "linear": lambda: F.linear(t(4, 4), t(3, 4), t(3)),
    "matmul": lambda: torch.matmul(t(4, 4), t(4, 4)),
    "mm": lambda: torch.mm(t(4, 4), t(4, 4)),
    "mv": lambda: torch.mv(t(4, 4), t(4)),
    "prelu": lambda: F.prelu(t(2, 3), t(1)),
    "GRUCell": lambda: torch.nn.GRUCell(4, 4).npu()(t(2, 4)),
    "LSTMCell": lambda: torch.nn.LSTMCell(4, 4).npu()(t(2, 4))[0],
    "RNNCell": lambda: torch.nn.RNNCell(4, 4).npu()(t(2, 4)),
}

# "CUDA Ops that can autocast to float32", fed fp16 inputs -> float32.
FP32 = {
    "__pow__": lambda: t(4, dtype=torch.half) ** 2,
    "__rdiv__": lambda: 1 / t(4, dtype=torch.half),
    "__rpow__": lambda: 2 ** t(4, dtype=torch.half),
    "acos": lambda: torch.acos(t(4, dtype=torch.half) - 0.5),
    "asin": lambda: torch.asin(t(4, dtype=torch.half) - 0.5),
    "cosh": lambda: torch.cosh(t(4, dtype=torch.half)),
    "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(
        t(4, dtype=torch.half), t(4, dtype=torch.half) - 0.5),
    "cdist": lambda: torch.cdist(t(3, 4, dtype=torch.half), t(3, 4, dtype=torch.half)),
    "cosine_similarity": lambda: F.cosine_similarity(t(3, 4, dtype=torch.half), t(3, 4, dtype=torch.half)),
    "cross_entropy": lambda: F.cross_entropy(t(3, 4, dtype=torch.half), torch.tensor([0, 1, 2], device="npu")),
    "cumprod": lambda: torch.cumprod(t(4, dtype=torch.half), 0),
    "cumsum": lambda: torch.cumsum(t(4, dtype=torch.half), 0),
    "dist": lambda: torch.dist(t(4, dtype=torch.half), t(4, dtype=torch.half)),
    "erfinv": lambda: torch.erfinv(t(4, dtype=torch.half) - 0.9),
    "exp": lambda: torch.exp(t(4, dtype=torch.half)),
    "expm1": lambda: torch.expm1(t(4, dtype=torch.half)),
    "group_norm": lambda: F.group_norm(t(2, 4, 3, dtype=torch.half), 2),
    "kl_div": lambda: F.kl_div(t(4, dtype=torch.half), t(4, dtype=torch.half), reduction="sum"),
    "l1_loss": lambda: F.l1_loss(t(4, dtype=torch.half), t(4, dtype=torch.half)),
    "layer_norm": lambda: F.layer_norm(t(2, 4, dtype=torch.half), (4,)),
    "log": lambda: torch.log(t(4, dtype=torch.half)),
    "log_softmax": lambda: F.log_softmax(t(2, 4, dtype=torch.half), -1),
    "log10": lambda: torch.log10(t(4, dtype=torch.half)),
    "log1p": lambda: torch.log1p(t(4, dtype=torch.half)),
    "log2": lambda: torch.log2(t(4, dtype=torch.half)),
    "mse_loss": lambda: F.mse_loss(t(4, dtype=torch.half), t(4, dtype=torch.half)),
    "nll_loss": lambda: F.nll_loss(t(3, 4, dtype=torch.half), torch.tensor([0, 1, 2], device="npu")),
    "norm": lambda: torch.norm(t(4, dtype=torch.half)),
    "normalize": lambda: F.normalize(t(2, 4, dtype=torch.half)),
    "pdist": lambda: F.pdist(t(3, 4, dtype=torch.half)),
    "pow": lambda: torch.pow(t(4, dtype=torch.half), 2),
    "prod": lambda: torch.prod(t(4, dtype=torch.half)),
    "reciprocal": lambda: torch.reciprocal(t(4, dtype=torch.half)),
    "rsqrt": lambda: torch.rsqrt(t(4, dtype=torch.half)),
    "sinh": lambda: torch.sinh(t(4, dtype=torch.half)),
    "smooth_l1_loss": lambda: F.smooth_l1_loss(t(4, dtype=torch.half), t(4, dtype=torch.half)),
    "softmax": lambda: F.softmax(t(2, 4, dtype=torch.half), -1),
    "softmin": lambda: F.softmin(t(2, 4, dtype=torch.half), -1),
    "softplus": lambda: F.softplus(t(4, dtype=torch.half)),
    "sum": lambda: torch.sum(t(4, dtype=torch.half)),
    "renorm": lambda: torch.renorm(t(2, 4, dtype=torch.half), 2, 0, 1.0),
    "tan": lambda: torch.tan(t(4, dtype=torch.half)),
}

# "CUDA Ops that promote to the widest input type": mixed fp16/fp32 inputs -> float32.
PROMOTE = {
    "addcdiv": lambda: torch.addcdiv(t(4), t(4, dtype=torch.half), t(4)),
    "addcmul": lambda: torch.addcmul(t(4), t(4, dtype=torch.half), t(4)),
    "atan2": lambda: torch.atan2(t(4, dtype=torch.half), t(4)),
    "cross": lambda: torch.cross(t(2, 3, dtype=torch.half), t(2, 3), dim=1),
    "dot": lambda: torch.dot(t(4, dtype=torch.half), t(4)),
    "scatter_add": lambda: torch.scatter_add(t(4), 0, torch.tensor([0, 1], device="npu"), t(2, dtype=torch.half)),
    "tensordot": lambda: torch.tensordot(t(2, 3, dtype=torch.half), t(3, 2), dims=1),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", LOWER_PRECISION)
def test_lower_precision_ops_run_in_the_autocast_dtype(name, dtype):
    with torch.autocast("npu", dtype=dtype):
        assert LOWER_PRECISION[name]().dtype == dtype
    assert LOWER_PRECISION[name]().dtype == torch.float32  # outside autocast nothing changes


@pytest.mark.parametrize("name", FP32)
def test_fp32_ops_run_in_float32(name):
    with torch.autocast("npu", dtype=torch.float16):
        assert FP32[name]().dtype == torch.float32


@pytest.mark.parametrize("name", PROMOTE)
def test_promote_ops_take_the_widest_input_type(name):
    with torch.autocast("npu", dtype=torch.float16):
        assert PROMOTE[name]().dtype == torch.float32


def test_every_spelling_of_npu_autocast_and_its_dtype():
    for region in (torch.amp.autocast("npu", dtype=torch.bfloat16), torch.npu.amp.autocast(dtype=torch.bfloat16)):
        with region:
            assert torch.is_autocast_enabled("npu")
            assert torch.get_autocast_dtype("npu") == torch.bfloat16
            assert (t(2, 2) @ t(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("npu")


def test_binary_cross_entropy_is_refused_as_on_cuda():
    with torch.autocast("npu", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(torch.sigmoid(t(4)), t(4) - 0.5)


def test_custom_fwd_and_bwd_with_device_type_npu():
    class Scale(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="npu", cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.dtype_seen = x.dtype
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="npu")
        def backward(ctx, grad):
            return grad * 2

    x = t(3, dtype=torch.half).requires_grad_()
    with torch.autocast("npu", dtype=torch.float16):
        y = Scale.apply(x)
    assert y.dtype == torch.float32  # cast_inputs ran forward in fp32 with autocast off
    y.sum().backward()
    assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    assert torch.npu.amp.custom_fwd is not None and torch.npu.amp.custom_bwd is not None
