"""Activations: npu_swiglu, npu_geglu, fast_gelu / npu_fast_gelu, npu_silu (+ npu_silu_), npu_mish,
each with the backward op torch_npu defines for it.

The vector kernels read fp16/bf16 inputs, compute in fp32 and round each output once to the input
dtype (the GLUs' gelu output too: torch_npu returns it in the input dtype and its backward reads
that rounded value back).

Speed: npu_swiglu and its backward are one-pass C++ kernels (fp16/bf16 converted in registers). The
others compute a low-precision input on one fp32 working copy updated in place (the fused kernel's
registers), not through a chain of fresh fp32 temporaries; a single PyTorch op whose
reduced-precision kernel already computes in fp32 and rounds once (silu, mish, silu_backward: the
results are bit-identical) runs on the input directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npukit.npu_backend import _C
from npukit.npu_backend.fused import (
    LOW_PRECISION,
    fused_op,
    npu_numerics,
    register_autograd,
    round_intermediate,
    upcast,
)
from npukit.npu_backend.fused.norms import check_float_dtypes

# FastGelu's constant: fast_gelu(x) = x / (1 + exp(-1.702 x)) = x * sigmoid(1.702 x) (torch_npu's docs;
# the training-series form x / (1 + exp(-1.702|x|)) * exp(0.851 x (x - |x|)) is the same function).
FAST_GELU_ALPHA = 1.702
GELU_APPROXIMATIONS = {0: "none", 1: "tanh"}


def _glu_dim(op: str, x: torch.Tensor, dim: int) -> int:
    """The dim the input is split along (non-negative), checked: in range, of even size."""
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"torch_npu.{op}: dim={dim} is out of range for an input of {x.dim()} dims")
    if x.shape[dim] % 2:
        raise ValueError(f"torch_npu.{op}: the input's size {x.shape[dim]} along dim={dim} must be even "
                         "(it is split into two halves)")
    return dim % x.dim()


def _glu_halves(op: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = x.chunk(2, _glu_dim(op, x, dim))
    return first, second


# ---- SwiGLU --------------------------------------------------------------------------------------
# One pass each way in C++ (csrc/fused_kernels_impl.h): silu(a) * b, and the gradient of both halves,
# computed in fp32 from the fp16/bf16 values in registers and rounded once, bit for bit the
# composition silu_(a.float()).mul_(b.float()).to(x.dtype) (and silu_backward(b * dy, a), silu(a) * dy
# for the backward) on fp32 working copies.

def _swiglu_fake(x, dim=-1):
    dim = _glu_dim("npu_swiglu", x, dim)
    return x.new_empty(x.shape[:dim] + (x.shape[dim] // 2,) + x.shape[dim + 1:])


@fused_op("npu_swiglu(Tensor input, int dim=-1) -> Tensor",
          unfused="a, b = x.chunk(2, dim); torch.nn.functional.silu(a) * b", fake=_swiglu_fake)
def npu_swiglu(x, dim=-1):
    check_float_dtypes("npu_swiglu", input=x)
    return _C.swiglu_forward(x, _glu_dim("npu_swiglu", x, dim))


def _swiglu_backward_fake(grad_output, x, dim=-1):
    _glu_dim("npu_swiglu_backward", x, dim)
    return x.new_empty(x.shape)


@fused_op("npu_swiglu_backward(Tensor grad_output, Tensor input, int dim=-1) -> Tensor",
          unfused="autograd of npu_swiglu's decomposition", public=False, fake=_swiglu_backward_fake)
def npu_swiglu_backward(grad_output, x, dim=-1):
    dim = _glu_dim("npu_swiglu_backward", x, dim)
    expected = x.shape[:dim] + (x.shape[dim] // 2,) + x.shape[dim + 1:]
    if grad_output.shape != expected:
        raise ValueError(f"torch_npu.npu_swiglu_backward: grad_output's shape {tuple(grad_output.shape)} must be "
                         f"the forward's output shape {tuple(expected)}")
    return _C.swiglu_backward(grad_output, x, dim)


def _swiglu_setup(ctx, inputs, output):
    x, dim = inputs
    ctx.dim = dim
    ctx.save_for_backward(x)


def _swiglu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(dy, x, ctx.dim), None


register_autograd("npu_swiglu", _swiglu_backward, _swiglu_setup)


# ---- GeGLU ---------------------------------------------------------------------------------------

def _gelu_mode(op: str, approximate: int) -> str:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"torch_npu.{op}: approximate must be 0 ('none', erf) or 1 ('tanh'), got {approximate}")
    return GELU_APPROXIMATIONS[approximate]


@fused_op("npu_geglu(Tensor input, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)",
          unfused="a, b = x.chunk(2, dim); g = gelu(b); (a * g, g)  (gelu(a) * b with activate_left)")
def npu_geglu(x, dim=-1, approximate=1, activate_left=False):
    check_float_dtypes("npu_geglu", input=x)
    mode = _gelu_mode("npu_geglu", approximate)
    a, b = _glu_halves("npu_geglu", x, dim)
    activated, linear = (a, b) if activate_left else (b, a)
    gelu = F.gelu(upcast(activated), approximate=mode)
    if x.dtype not in LOW_PRECISION:
        return gelu * linear, gelu
    # CANN's GeGluV2: the fp16 kernel multiplies the gelu output it rounded to fp16 by the fp16 half; the
    # bf16 kernel multiplies the fp32 gelu and rounds once.
    product_gelu = round_intermediate(gelu, torch.float16, npu_numerics(x)) if x.dtype == torch.float16 else gelu
    return linear.float().mul_(product_gelu).to(x.dtype), gelu.to(x.dtype)


@fused_op("npu_geglu_grad(Tensor grad_output, Tensor input, Tensor gelu, int dim=-1, int approximate=1, "
          "bool activate_left=False) -> Tensor",
          unfused="autograd of npu_geglu's decomposition", public=False)
def npu_geglu_grad(grad_output, x, gelu, dim=-1, approximate=1, activate_left=False):
    mode = _gelu_mode("npu_geglu_grad", approximate)
    a, b = _glu_halves("npu_geglu_grad", x, dim)
    activated, linear = (a, b) if activate_left else (b, a)
    dy = upcast(grad_output)
    dx = torch.empty(x.shape, dtype=dy.dtype, device=x.device)
    d_first, d_second = dx.chunk(2, dim)
    d_activated, d_linear = (d_first, d_second) if activate_left else (d_second, d_first)
    # gelu'(activated) * linear * dy through torch's fused gelu backward; the linear half's gradient
    # reads the forward's (rounded) gelu output, as the kernel does.
    torch.ops.aten.gelu_backward.grad_input(dy * upcast(linear), upcast(activated), approximate=mode,
                                            grad_input=d_activated)
    torch.mul(dy, upcast(gelu), out=d_linear)
    return dx.to(x.dtype)


def _geglu_setup(ctx, inputs, output):
    x, dim, approximate, activate_left = inputs
    ctx.args = (dim, approximate, activate_left)
    ctx.save_for_backward(x, output[1])


def _geglu_backward(ctx, dy, _dgelu):
    x, gelu = ctx.saved_tensors
    # torch_npu differentiates the product output only (the gelu output is returned for the backward).
    return torch.ops.npu.npu_geglu_grad(dy, x, gelu, *ctx.args), None, None, None


register_autograd("npu_geglu", _geglu_backward, _geglu_setup)


# ---- FastGelu ------------------------------------------------------------------------------------

def _fast_gelu(x):
    if x.dtype not in LOW_PRECISION:
        return x * torch.sigmoid(FAST_GELU_ALPHA * x)
    x32 = x.float()
    return torch.mul(x32, FAST_GELU_ALPHA).sigmoid_().mul_(x32).to(x.dtype)


@fused_op("fast_gelu(Tensor self) -> Tensor", unfused="x * torch.sigmoid(1.702 * x)")
def fast_gelu(x):
    check_float_dtypes("fast_gelu", input=x)
    return _fast_gelu(x)


@fused_op("npu_fast_gelu(Tensor input) -> Tensor", unfused="x * torch.sigmoid(1.702 * x)")
def npu_fast_gelu(x):
    check_float_dtypes("npu_fast_gelu", input=x)
    return _fast_gelu(x)


@fused_op("npu_fast_gelu_backward(Tensor grad, Tensor input) -> Tensor",
          unfused="autograd of x * torch.sigmoid(1.702 * x)", public=False)
def npu_fast_gelu_backward(grad, x):
    # fast_gelu(x) = silu(1.702 x) / 1.702, so its derivative is silu'(1.702 x) = s + 1.702 x s (1 - s)
    # with s = sigmoid(1.702 x): torch's fused silu backward at 1.702 x.
    return torch.ops.aten.silu_backward(upcast(grad), FAST_GELU_ALPHA * upcast(x)).to(x.dtype)


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _fast_gelu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_fast_gelu_backward(dy, x)


register_autograd("fast_gelu", _fast_gelu_backward, _save_input)
register_autograd("npu_fast_gelu", _fast_gelu_backward, _save_input)


# ---- SiLU ----------------------------------------------------------------------------------------

@fused_op("npu_silu(Tensor input) -> Tensor", unfused="torch.nn.functional.silu(x)")
def npu_silu(x):
    check_float_dtypes("npu_silu", input=x)
    return F.silu(x)  # fp16/bf16: computed in fp32, rounded once (see the module's docstring)


@fused_op("npu_silu_(Tensor(a!) input) -> Tensor(a!)", unfused="torch.nn.functional.silu(x, inplace=True)",
          tags=(torch.Tag.inplace,))
def npu_silu_(x):
    check_float_dtypes("npu_silu_", input=x)
    return F.silu(x, inplace=True)


@fused_op("npu_silu_backward(Tensor grad_output, Tensor x0, Tensor x1) -> Tensor",
          unfused="autograd of torch.nn.functional.silu", public=False)
def npu_silu_backward(grad_output, x0, x1):
    """x0 is the input, x1 the forward's output (torch_npu's derivative passes both): with
    s = sigmoid(x0), d silu / dx = s + x0 s (1 - s) = s + x1 (1 - s)."""
    if grad_output.dtype == x0.dtype:
        return torch.ops.aten.silu_backward(grad_output, x0)
    sig = torch.sigmoid(upcast(x0))
    return (upcast(grad_output) * (sig + upcast(x1) * (1 - sig))).to(grad_output.dtype)


def _silu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _silu_backward(ctx, dy):
    x, y = ctx.saved_tensors
    return torch.ops.npu.npu_silu_backward(dy, x, y)


register_autograd("npu_silu", _silu_backward, _silu_setup)


# ---- Mish ----------------------------------------------------------------------------------------

@fused_op("npu_mish(Tensor input) -> Tensor", unfused="x * torch.tanh(torch.nn.functional.softplus(x))")
def npu_mish(x):
    check_float_dtypes("npu_mish", input=x)
    return F.mish(x)  # fp16/bf16: computed in fp32, rounded once (see the module's docstring)


@fused_op("npu_mish_backward(Tensor grad, Tensor input) -> Tensor",
          unfused="autograd of x * torch.tanh(torch.nn.functional.softplus(x))", public=False)
def npu_mish_backward(grad, x):
    # d/dx x tanh(softplus(x)) = tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x): torch's fused mish backward,
    # on fp32 values (its fp16 kernel rounds inside).
    return torch.ops.aten.mish_backward(upcast(grad), upcast(x)).to(x.dtype)


def _mish_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_mish_backward(dy, x)


register_autograd("npu_mish", _mish_backward, _save_input)
