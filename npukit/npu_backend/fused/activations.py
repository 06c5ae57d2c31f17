"""Activations: npu_swiglu, npu_geglu, fast_gelu / npu_fast_gelu, npu_silu (+ npu_silu_), npu_mish,
each with the backward op torch_npu defines for it.

The vector kernels read fp16/bf16 inputs, compute in fp32 and round each output once to the input
dtype (the GLUs' gelu output too: torch_npu returns it in the input dtype and its backward reads
that rounded value back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npukit.npu_backend.fused import fused_op, register_autograd, upcast

# FastGelu's constant: fast_gelu(x) = x / (1 + exp(-1.702 x)) = x * sigmoid(1.702 x) (torch_npu's docs;
# the training-series form x / (1 + exp(-1.702|x|)) * exp(0.851 x (x - |x|)) is the same function).
FAST_GELU_ALPHA = 1.702
GELU_APPROXIMATIONS = {0: "none", 1: "tanh"}


def _glu_halves(op: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"torch_npu.{op}: dim={dim} is out of range for an input of {x.dim()} dims")
    if x.shape[dim] % 2:
        raise ValueError(f"torch_npu.{op}: the input's size {x.shape[dim]} along dim={dim} must be even "
                         "(it is split into two halves)")
    first, second = x.chunk(2, dim)
    return first, second


# ---- SwiGLU --------------------------------------------------------------------------------------

@fused_op("npu_swiglu(Tensor input, int dim=-1) -> Tensor",
          unfused="a, b = x.chunk(2, dim); torch.nn.functional.silu(a) * b")
def npu_swiglu(x, dim=-1):
    a, b = _glu_halves("npu_swiglu", x, dim)
    return (F.silu(upcast(a)) * upcast(b)).to(x.dtype)


@fused_op("npu_swiglu_backward(Tensor grad_output, Tensor input, int dim=-1) -> Tensor",
          unfused="autograd of npu_swiglu's decomposition", public=False)
def npu_swiglu_backward(grad_output, x, dim=-1):
    a, b = _glu_halves("npu_swiglu_backward", x, dim)
    a32, b32, dy = upcast(a), upcast(b), upcast(grad_output)
    sig = torch.sigmoid(a32)
    silu_grad = sig * (1 + a32 * (1 - sig))
    return torch.cat([dy * b32 * silu_grad, dy * a32 * sig], dim).to(x.dtype)


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


def _gelu_derivative(x32: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "tanh":
        inner_scale = (2 / torch.pi) ** 0.5
        inner = inner_scale * (x32 + 0.044715 * x32.pow(3))
        tanh = torch.tanh(inner)
        return 0.5 * (1 + tanh) + 0.5 * x32 * (1 - tanh * tanh) * inner_scale * (1 + 3 * 0.044715 * x32 * x32)
    cdf = 0.5 * (1 + torch.erf(x32 * 2 ** -0.5))
    return cdf + x32 * torch.exp(-0.5 * x32 * x32) * (2 * torch.pi) ** -0.5


@fused_op("npu_geglu(Tensor input, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)",
          unfused="a, b = x.chunk(2, dim); g = gelu(b); (a * g, g)  (gelu(a) * b with activate_left)")
def npu_geglu(x, dim=-1, approximate=1, activate_left=False):
    mode = _gelu_mode("npu_geglu", approximate)
    a, b = _glu_halves("npu_geglu", x, dim)
    activated, linear = (a, b) if activate_left else (b, a)
    gelu = F.gelu(upcast(activated), approximate=mode)
    return (gelu * upcast(linear)).to(x.dtype), gelu.to(x.dtype)


@fused_op("npu_geglu_grad(Tensor grad_output, Tensor input, Tensor gelu, int dim=-1, int approximate=1, "
          "bool activate_left=False) -> Tensor",
          unfused="autograd of npu_geglu's decomposition", public=False)
def npu_geglu_grad(grad_output, x, gelu, dim=-1, approximate=1, activate_left=False):
    mode = _gelu_mode("npu_geglu_grad", approximate)
    a, b = _glu_halves("npu_geglu_grad", x, dim)
    activated, linear = (a, b) if activate_left else (b, a)
    dy = upcast(grad_output)
    d_activated = dy * upcast(linear) * _gelu_derivative(upcast(activated), mode)
    d_linear = dy * upcast(gelu)
    halves = [d_activated, d_linear] if activate_left else [d_linear, d_activated]
    return torch.cat(halves, dim).to(x.dtype)


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
    return (upcast(x) * torch.sigmoid(FAST_GELU_ALPHA * upcast(x))).to(x.dtype)


@fused_op("fast_gelu(Tensor self) -> Tensor", unfused="x * torch.sigmoid(1.702 * x)")
def fast_gelu(x):
    return _fast_gelu(x)


@fused_op("npu_fast_gelu(Tensor input) -> Tensor", unfused="x * torch.sigmoid(1.702 * x)")
def npu_fast_gelu(x):
    return _fast_gelu(x)


@fused_op("npu_fast_gelu_backward(Tensor grad, Tensor input) -> Tensor",
          unfused="autograd of x * torch.sigmoid(1.702 * x)", public=False)
def npu_fast_gelu_backward(grad, x):
    x32 = upcast(x)
    sig = torch.sigmoid(FAST_GELU_ALPHA * x32)
    return (upcast(grad) * (sig + FAST_GELU_ALPHA * x32 * sig * (1 - sig))).to(x.dtype)


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
    return F.silu(upcast(x)).to(x.dtype)


@fused_op("npu_silu_(Tensor(a!) input) -> Tensor(a!)", unfused="torch.nn.functional.silu(x, inplace=True)")
def npu_silu_(x):
    return x.copy_(F.silu(upcast(x)))


@fused_op("npu_silu_backward(Tensor grad_output, Tensor x0, Tensor x1) -> Tensor",
          unfused="autograd of torch.nn.functional.silu", public=False)
def npu_silu_backward(grad_output, x0, x1):
    """x0 is the input, x1 the forward's output (torch_npu's derivative passes both): with
    s = sigmoid(x0), d silu / dx = s + x0 s (1 - s) = s + x1 (1 - s)."""
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
    x32 = upcast(x)
    return (x32 * torch.tanh(F.softplus(x32))).to(x.dtype)


@fused_op("npu_mish_backward(Tensor grad, Tensor input) -> Tensor",
          unfused="autograd of x * torch.tanh(torch.nn.functional.softplus(x))", public=False)
def npu_mish_backward(grad, x):
    x32 = upcast(x)
    tanh_sp = torch.tanh(F.softplus(x32))
    # d/dx x tanh(sp(x)) = tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)
    derivative = tanh_sp + x32 * (1 - tanh_sp * tanh_sp) * torch.sigmoid(x32)
    return (upcast(grad) * derivative).to(x.dtype)


def _mish_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_mish_backward(dy, x)


register_autograd("npu_mish", _mish_backward, _save_input)
