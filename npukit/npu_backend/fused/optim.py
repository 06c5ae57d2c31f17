"""Optimizers: the ops npu_apply_adam_w (+ npu_apply_adam_w_out) and npu_apply_adam, and the Python
module `torch_npu.optim` (NpuFusedSGD, NpuFusedAdam, NpuFusedAdamW, NpuFusedAdadelta, NpuFusedLamb,
NpuFusedAdamP, NpuFusedBertAdam, NpuFusedRMSprop, NpuFusedRMSpropTF).

The wheel's fused optimizers copy every parameter, gradient and state of one dtype into one
contiguous buffer and update it with a few large kernels. Here each optimizer updates the
parameters' own tensors with torch._foreach_* ops (one multi-tensor op per step of the formula),
which computes the same per-element arithmetic in the parameters' dtype. Their constructor
arguments, defaults, state names ('step', 'exp_avg', ...) and restrictions (float32/float16
parameters only, dense gradients, `zero_grad(set_to_none=True)` refused as the combined gradient
buffer would be lost) are the wheel's; `clip_grad_norm_fused_(max_norm, norm_type)` clips all
gradients by their total norm in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.optimizer import Optimizer, required

from npukit.npu_backend.fused import fused_op

__all__ = [
    "NpuFusedOptimizerBase", "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedLamb", "NpuFusedAdam", "NpuFusedAdamW",
    "NpuFusedAdamP", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF",
]

# The wheel's torch_npu.optim is a package with a module per optimizer, which code imports from
# (`from torch_npu.optim.npu_fused_adamw import NpuFusedAdamW`): module name -> its names.
WHEEL_SUBMODULES = {
    "npu_fused_optim_base": ("NpuFusedOptimizerBase",), "npu_fused_sgd": ("NpuFusedSGD",),
    "npu_fused_adadelta": ("NpuFusedAdadelta",), "npu_fused_lamb": ("NpuFusedLamb",),
    "npu_fused_adam": ("NpuFusedAdam",), "npu_fused_adamw": ("NpuFusedAdamW",), "npu_fused_adamp": ("NpuFusedAdamP",),
    "npu_fused_bert_adam": ("NpuFusedBertAdam",), "npu_fused_rmsprop": ("NpuFusedRMSprop",),
    "npu_fused_rmsprop_tf": ("NpuFusedRMSpropTF",),
}


# ---- ops -----------------------------------------------------------------------------------------

def _check_out(op: str, grad: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(out) != 3:
        raise ValueError(f"torch_npu.{op}: out must be (var, m, v), got {len(out)} tensors")
    var, m, v = out
    for name, tensor in (("var", var), ("m", m), ("v", v)):
        if tensor.shape != grad.shape or tensor.dtype != grad.dtype:
            raise ValueError(f"torch_npu.{op}: {name} must have grad's shape {tuple(grad.shape)} and dtype "
                             f"{grad.dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
    if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"torch_npu.{op}: grad must be float32, float16 or bfloat16, got {grad.dtype}")
    return var, m, v


def _needs_out(op: str) -> Callable:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"torch_npu.{op} updates var, m and v in place: pass them as out=(var, m, v)")
    refuse.__name__ = op
    return refuse


@fused_op("npu_apply_adam_w(Scalar beta1_power, Scalar beta2_power, Scalar lr, Scalar weight_decay, Scalar beta1, "
          "Scalar beta2, Scalar epsilon, Tensor grad, Tensor? max_grad_norm, bool? amsgrad, bool? maximize) "
          "-> (Tensor, Tensor, Tensor)",
          unfused="torch.optim.AdamW's update of one parameter (call it with out=(var, m, v))")
def npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm,
                     amsgrad, maximize):
    _needs_out("npu_apply_adam_w")()


@fused_op("npu_apply_adam_w.out(Scalar beta1_power, Scalar beta2_power, Scalar lr, Scalar weight_decay, "
          "Scalar beta1, Scalar beta2, Scalar epsilon, Tensor grad, Tensor? max_grad_norm, bool? amsgrad, "
          "bool? maximize, *, Tensor[] out) -> (Tensor, Tensor, Tensor)",
          unfused="torch.optim.AdamW's update of one parameter", public=False, family="optim")
def npu_apply_adam_w_out_kernel(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad,
                                max_grad_norm, amsgrad, maximize, *, out):
    """The documented AdamW step, var, m, v updated in place (beta*_power are beta^(t-1)):
    g = -grad if maximize; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; var -= lr * (m / (1 - b1^t)) /
    (sqrt(v' / (1 - b2^t)) + eps) + lr * weight_decay * var, where v' = max(max_grad_norm, v) with
    amsgrad (the returned v stays the moving average, as msprobe's reference of this op has it; the
    caller keeps the running maximum in max_grad_norm). Computed in fp32, each result rounded once
    to var's dtype."""
    op = "npu_apply_adam_w"
    var, m, v = _check_out(op, grad, out)
    if amsgrad and max_grad_norm is None:
        raise ValueError(f"torch_npu.{op}: amsgrad=True needs max_grad_norm")
    # fp32 states are updated in place; fp16/bf16 ones through fp32 copies, rounded once at the end
    var32, m32, v32, g = (t.float() for t in (var, m, v, grad))
    if maximize:
        g = -g
    m32.mul_(beta1).add_(g, alpha=1 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    second_moment = torch.maximum(v32, max_grad_norm.float()) if amsgrad else v32
    # a bias correction of exactly 0 (beta^t == 1) becomes eps instead of a division by 0
    bias_correction1 = (1 - float(beta1_power) * float(beta1)) or epsilon
    bias_correction2 = (1 - float(beta2_power) * float(beta2)) or epsilon
    # var - lr * m_hat / (sqrt(v_hat) + eps) - lr * weight_decay * var
    denominator = second_moment.div(bias_correction2).sqrt_().add_(epsilon)
    var32.mul_(1 - lr * weight_decay).addcdiv_(m32, denominator, value=-lr / bias_correction1)
    for target, result in ((var, var32), (m, m32), (v, v32)):
        if target is not result:
            target.copy_(result)
    return var, m, v


@fused_op("npu_apply_adam(Scalar beta1_power, Scalar beta2_power, Scalar lr, Scalar beta1, Scalar beta2, "
          "Scalar epsilon, Tensor grad, bool? use_locking, bool? use_nesterov) -> (Tensor, Tensor, Tensor)",
          unfused="TensorFlow's ApplyAdam update of one parameter (call it with out=(var, m, v))")
def npu_apply_adam(beta1_power, beta2_power, lr, beta1, beta2, epsilon, grad, use_locking, use_nesterov):
    _needs_out("npu_apply_adam")()


@fused_op("npu_apply_adam.out(Scalar beta1_power, Scalar beta2_power, Scalar lr, Scalar beta1, Scalar beta2, "
          "Scalar epsilon, Tensor grad, bool? use_locking, bool? use_nesterov, *, Tensor[] out) "
          "-> (Tensor, Tensor, Tensor)",
          unfused="TensorFlow's ApplyAdam update of one parameter", public=False, family="optim")
def npu_apply_adam_out_kernel(beta1_power, beta2_power, lr, beta1, beta2, epsilon, grad, use_locking,
                              use_nesterov, *, out):
    """CANN's ApplyAdam (TensorFlow's; beta*_power are beta^t): lr_t = lr sqrt(1 - b2^t) / (1 - b1^t);
    m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); var -= lr_t m / (sqrt(v) + eps), with Nesterov
    var -= lr_t (b1 m + (1 - b1) g) / (sqrt(v) + eps)."""
    var, m, v = _check_out("npu_apply_adam", grad, out)
    var32, m32, v32, g = (t.float() for t in (var, m, v, grad))
    m32.add_(g - m32, alpha=1 - beta1)
    v32.add_(g * g - v32, alpha=1 - beta2)
    lr_t = lr * math.sqrt(1 - float(beta2_power)) / (1 - float(beta1_power))
    numerator = m32 * beta1 + (1 - beta1) * g if use_nesterov else m32
    var32.addcdiv_(numerator, v32.sqrt().add_(epsilon), value=-lr_t)
    for target, result in ((var, var32), (m, m32), (v, v32)):
        if target is not result:
            target.copy_(result)
    return var, m, v


def npu_apply_adam_w_out(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm,
                         amsgrad, maximize, var, m, v):
    """torch_npu.npu_apply_adam_w_out: npu_apply_adam_w with var, m, v as arguments."""
    return torch.ops.npu.npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad,
                                          max_grad_norm, amsgrad, maximize, out=(var, m, v))


TORCH_NPU_ATTRIBUTES = {"npu_apply_adam_w_out": npu_apply_adam_w_out}


# ---- optimizers ----------------------------------------------------------------------------------

def _check_range(name: str, value: float, low: float = 0.0, high: float | None = None, closed_high=False):
    if value < low or (high is not None and (value > high if closed_high else value >= high)):
        raise ValueError(f"Invalid {name}: {value}")


class NpuFusedOptimizerBase(Optimizer):
    """What every NpuFused optimizer shares: parameter checks, step over each group's parameters
    that have gradients (`_group_step`), zero_grad and clip_grad_norm_fused_."""

    is_fused_optimizer = True
    # group options a state_dict saved before they existed lacks: filled in when it is loaded
    _GROUP_DEFAULTS: dict = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._GROUP_DEFAULTS.items():
                group.setdefault(key, value)

    def _parameters_with_grads(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params, grads = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if p.dtype not in (torch.float32, torch.float16):
                raise TypeError(f"{type(self).__name__}: fused optimizers' parameters must be float32 or float16, "
                                f"got {p.dtype}")
            params.append(p)
            grads.append(p.grad)
        return params, grads

    def _state_list(self, params: list[torch.Tensor], key: str, init: Callable) -> list[torch.Tensor]:
        result = []
        for p in params:
            state = self.state[p]
            if key not in state:
                state[key] = init(p)
            result.append(state[key])
        return result

    def _advance_steps(self, params: list[torch.Tensor]) -> list[int]:
        steps = []
        for p in params:
            state = self.state[p]
            state["step"] = int(state.get("step", 0)) + 1
            steps.append(state["step"])
        return steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_steps()
        for group in self.param_groups:
            params, grads = self._parameters_with_grads(group)
            if params:
                self._group_step(group, params, grads)
        return loss

    def _before_steps(self) -> None:
        """Work over all groups before their steps (Lamb's global gradient norm)."""

    def _group_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _group_step")

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = False):
        if set_to_none:
            raise ValueError(f"{type(self).__name__}.zero_grad: set_to_none=True is not supported by torch_npu's "
                             f"fused optimizers (their gradients live in one combined buffer); call zero_grad()")
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _all_grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_fused_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their total norm (computed in fp32), as
        torch.nn.utils.clip_grad_norm_ with eps 1e-6; returns the total norm."""
        grads = self._all_grads()
        if not grads:
            return torch.tensor(0.0)
        max_norm, norm_type = float(max_norm), float(norm_type)
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], coefficient.to(dtype))
        return total

    def get_combined_params(self):
        raise NotImplementedError(f"{type(self).__name__}.get_combined_params: the emulator updates parameters in "
                                  f"place and keeps no combined buffer; iterate group['params'] instead")

    def get_combined_grads(self):
        raise NotImplementedError(f"{type(self).__name__}.get_combined_grads: the emulator keeps no combined "
                                  f"gradient buffer; iterate p.grad over group['params'] instead")


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _ones(p: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p, memory_format=torch.preserve_format)


def _moments(optimizer, params, grads, beta1, beta2):
    """exp_avg = b1 exp_avg + (1-b1) g; exp_avg_sq = b2 exp_avg_sq + (1-b2) g^2 (in place)."""
    exp_avgs = optimizer._state_list(params, "exp_avg", _zeros)
    exp_avg_sqs = optimizer._state_list(params, "exp_avg_sq", _zeros)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    return exp_avgs, exp_avg_sqs


def _adam_update(optimizer, group, params, grads, beta1, beta2):
    """Adam's bias-corrected step (shared by Adam and AdamW), AMSGrad when the group asks."""
    steps = optimizer._advance_steps(params)
    exp_avgs, exp_avg_sqs = _moments(optimizer, params, grads, beta1, beta2)
    second = exp_avg_sqs
    if group["amsgrad"]:
        second = optimizer._state_list(params, "max_exp_avg_sq", _zeros)
        torch._foreach_maximum_(second, exp_avg_sqs)
    denominators = torch._foreach_sqrt(second)
    torch._foreach_div_(denominators, [math.sqrt(1 - beta2 ** step) for step in steps])
    torch._foreach_add_(denominators, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denominators, [-group["lr"] / (1 - beta1 ** step) for step in steps])


class _AdamArguments(NpuFusedOptimizerBase):
    """The constructor checks and the amsgrad default Adam and AdamW share (they differ in weight
    decay: added to the gradient, or decoupled)."""

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad):
        _check_range("learning rate", lr)
        _check_range("epsilon value", eps)
        _check_range("beta parameter at index 0", betas[0], high=1.0)
        _check_range("beta parameter at index 1", betas[1], high=1.0)
        _check_range("weight_decay value", weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    _GROUP_DEFAULTS = {"amsgrad": False}


class NpuFusedAdam(_AdamArguments):
    """Adam (torch.optim.Adam's update; weight_decay is an L2 penalty added to the gradient).

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False):
        _AdamArguments.__init__(self, params, lr, betas, eps, weight_decay, amsgrad)

    def _group_step(self, group, params, grads):
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        _adam_update(self, group, params, grads, *group["betas"])


class NpuFusedAdamW(_AdamArguments):
    """AdamW (torch.optim.AdamW's update: decoupled weight decay, p *= 1 - lr * weight_decay).

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        _AdamArguments.__init__(self, params, lr, betas, eps, weight_decay, amsgrad)

    def _group_step(self, group, params, grads):
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        _adam_update(self, group, params, grads, *group["betas"])


class NpuFusedSGD(NpuFusedOptimizerBase):
    """SGD with momentum, dampening, L2 weight decay and Nesterov (torch.optim.SGD's update: the first
    step's momentum buffer is the gradient itself).

    Args: params, lr (required), momentum=0, dampening=0, weight_decay=0, nesterov=False.
    """

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if lr is not required:
            _check_range("learning rate", lr)
        _check_range("momentum value", momentum)
        _check_range("weight_decay value", weight_decay)
        if nesterov and (momentum <= 0 or not math.isclose(dampening, 0.0, abs_tol=1e-15)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov))

    _GROUP_DEFAULTS = {"nesterov": False}

    def _group_step(self, group, params, grads):
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            fresh = [i for i, p in enumerate(params) if "momentum_buffer" not in self.state[p]]
            for i in fresh:
                self.state[params[i]]["momentum_buffer"] = torch.clone(grads[i]).detach()
            kept = [i for i in range(len(params)) if i not in set(fresh)]
            if kept:
                buffers = [self.state[params[i]]["momentum_buffer"] for i in kept]
                torch._foreach_mul_(buffers, momentum)
                torch._foreach_add_(buffers, [grads[i] for i in kept], alpha=1 - group["dampening"])
            buffers = [self.state[p]["momentum_buffer"] for p in params]
            if group["nesterov"]:
                grads = torch._foreach_add(grads, buffers, alpha=momentum)
            else:
                grads = buffers
        torch._foreach_add_(params, grads, alpha=-group["lr"])


class NpuFusedAdadelta(NpuFusedOptimizerBase):
    """Adadelta (torch.optim.Adadelta's update).

    Args: params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.
    """

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0):
        _check_range("learning rate", lr)
        _check_range("rho value", rho, high=1.0, closed_high=True)
        _check_range("epsilon value", eps)
        _check_range("weight_decay value", weight_decay)
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay))

    def _group_step(self, group, params, grads):
        rho, eps = group["rho"], group["eps"]
        self._advance_steps(params)
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        square_avgs = self._state_list(params, "square_avg", _zeros)
        acc_deltas = self._state_list(params, "acc_delta", _zeros)
        torch._foreach_mul_(square_avgs, rho)
        torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - rho)
        std = torch._foreach_add(square_avgs, eps)
        torch._foreach_sqrt_(std)
        deltas = torch._foreach_add(acc_deltas, eps)
        torch._foreach_sqrt_(deltas)
        torch._foreach_div_(deltas, std)
        torch._foreach_mul_(deltas, grads)
        torch._foreach_add_(params, deltas, alpha=-group["lr"])
        torch._foreach_mul_(acc_deltas, rho)
        torch._foreach_addcmul_(acc_deltas, deltas, deltas, value=1 - rho)


class NpuFusedRMSprop(NpuFusedOptimizerBase):
    """RMSprop (torch.optim.RMSprop's update: eps added after the square root).

    Args: params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False.
    """

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False):
        for name, value in (("learning rate", lr), ("epsilon value", eps), ("momentum value", momentum),
                            ("weight_decay value", weight_decay), ("alpha value", alpha)):
            _check_range(name, value)
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered,
                                      weight_decay=weight_decay))

    _GROUP_DEFAULTS = {"momentum": 0, "centered": False}

    def _group_step(self, group, params, grads):
        alpha = group["alpha"]
        self._advance_steps(params)
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        square_avgs = self._state_list(params, "square_avg", _zeros)
        torch._foreach_mul_(square_avgs, alpha)
        torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
        if group["centered"]:
            grad_avgs = self._state_list(params, "grad_avg", _zeros)
            torch._foreach_lerp_(grad_avgs, grads, 1 - alpha)
            averages = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1)
            torch._foreach_sqrt_(averages)
        else:
            averages = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(averages, group["eps"])
        if group["momentum"] > 0:
            buffers = self._state_list(params, "momentum_buffer", _zeros)
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_addcdiv_(buffers, grads, averages)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])
        else:
            torch._foreach_addcdiv_(params, grads, averages, value=-group["lr"])


class NpuFusedRMSpropTF(NpuFusedOptimizerBase):
    """RMSprop in TensorFlow's form (timm's RMSpropTF): square_avg starts at 1, eps inside the square
    root, square_avg += (1 - alpha)(g^2 - square_avg); with momentum, lr_in_momentum accumulates
    lr * g / avg in the buffer (TensorFlow) instead of scaling the buffer by lr (PyTorch);
    decoupled_decay multiplies the parameter by 1 - weight_decay instead of adding an L2 gradient.

    Args: params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0, centered=False,
    decoupled_decay=False, lr_in_momentum=True.
    """

    def __init__(self, params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0.0, centered=False,
                 decoupled_decay=False, lr_in_momentum=True):
        for name, value in (("learning rate", lr), ("epsilon value", eps), ("momentum value", momentum),
                            ("weight_decay value", weight_decay), ("alpha value", alpha)):
            _check_range(name, value)
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered,
                                      weight_decay=weight_decay, decoupled_decay=decoupled_decay,
                                      lr_in_momentum=lr_in_momentum))

    _GROUP_DEFAULTS = {"momentum": 0, "centered": False}

    def _group_step(self, group, params, grads):
        one_minus_alpha = 1.0 - group["alpha"]
        self._advance_steps(params)
        if group["weight_decay"] != 0:
            if group.get("decoupled_decay", False):
                torch._foreach_mul_(params, 1 - group["weight_decay"])
            else:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        square_avgs = self._state_list(params, "square_avg", _ones)
        torch._foreach_lerp_(square_avgs, torch._foreach_mul(grads, grads), one_minus_alpha)
        if group["centered"]:
            grad_avgs = self._state_list(params, "grad_avg", _zeros)
            torch._foreach_lerp_(grad_avgs, grads, one_minus_alpha)
            averages = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1)
        else:
            averages = [s.clone() for s in square_avgs]
        torch._foreach_add_(averages, group["eps"])
        torch._foreach_sqrt_(averages)
        if group["momentum"] > 0:
            buffers = self._state_list(params, "momentum_buffer", _zeros)
            torch._foreach_mul_(buffers, group["momentum"])
            if group.get("lr_in_momentum", True):
                torch._foreach_addcdiv_(buffers, grads, averages, value=group["lr"])
                torch._foreach_sub_(params, buffers)
            else:
                torch._foreach_addcdiv_(buffers, grads, averages)
                torch._foreach_add_(params, buffers, alpha=-group["lr"])
        else:
            torch._foreach_addcdiv_(params, grads, averages, value=-group["lr"])


class NpuFusedLamb(NpuFusedOptimizerBase):
    """LAMB (torch_npu's form: no bias correction). adam_step = exp_avg / (sqrt(exp_avg_sq) + eps)
    (+ weight_decay * p); each parameter moves by lr * trust_ratio * adam_step with trust_ratio =
    min(||p||, 10) / ||adam_step|| (1 if either norm is 0, always 1 with adam=True). With
    use_global_grad_norm, gradients are divided by their global L2 norm when it exceeds 1.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
    use_global_grad_norm=False.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False,
                 use_global_grad_norm=False):
        _check_range("learning rate", lr)
        _check_range("beta parameter at index 0", betas[0], high=1.0)
        _check_range("beta parameter at index 1", betas[1], high=1.0)
        _check_range("epsilon value", eps)
        self.adam = adam
        self.use_global_grad_norm = use_global_grad_norm
        self.global_grad_norm = None
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _before_steps(self):
        self.global_grad_norm = None
        if self.use_global_grad_norm:
            grads = self._all_grads()
            if grads:
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
                self.global_grad_norm = torch.linalg.vector_norm(torch.stack(norms))

    def _group_step(self, group, params, grads):
        beta1, beta2 = group["betas"]
        self._advance_steps(params)
        if self.global_grad_norm is not None and float(self.global_grad_norm) > 1:
            grads = [g / self.global_grad_norm.to(g.dtype) for g in grads]
        exp_avgs, exp_avg_sqs = _moments(self, params, grads, beta1, beta2)
        adam_steps = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(adam_steps, group["eps"])
        adam_steps = torch._foreach_div(exp_avgs, adam_steps)
        if group["weight_decay"] != 0:
            torch._foreach_add_(adam_steps, params, alpha=group["weight_decay"])
        if self.adam:
            ratios = [1.0] * len(params)
        else:
            weight_norms = torch.stack(torch._foreach_norm(params, 2.0, dtype=torch.float32)).clamp(0, 10)
            step_norms = torch.stack(torch._foreach_norm(adam_steps, 2.0, dtype=torch.float32))
            trusted = (weight_norms > 0) & (step_norms > 0)
            ratios = torch.where(trusted, weight_norms / torch.where(trusted, step_norms, 1.0), 1.0).tolist()
        torch._foreach_mul_(adam_steps, [-group["lr"] * ratio for ratio in ratios])
        torch._foreach_add_(params, adam_steps)


class NpuFusedAdamP(NpuFusedOptimizerBase):
    """AdamP (Heo et al., 2021): Adam whose step is projected off the weight direction for
    scale-invariant weights (those whose gradient's cosine similarity with the weight, per output
    channel or over the whole layer, stays below delta / sqrt(dim)), their weight decay scaled by
    wd_ratio. Weight decay is decoupled: p *= 1 - lr * weight_decay * wd_ratio.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, delta=0.1, wd_ratio=0.1,
    nesterov=False.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, delta=0.1, wd_ratio=0.1,
                 nesterov=False):
        _check_range("learning rate", lr)
        _check_range("epsilon value", eps)
        _check_range("beta parameter at index 0", betas[0], high=1.0)
        _check_range("beta parameter at index 1", betas[1], high=1.0)
        _check_range("weight_decay value", weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, delta=delta,
                                      wd_ratio=wd_ratio, nesterov=nesterov))

    @staticmethod
    def _projection(p, grad, perturb, delta, wd_ratio, eps):
        """(perturb, weight-decay ratio): perturb without its component along p when p is
        scale-invariant (per output channel, then over the whole layer)."""
        expand = [-1] + [1] * (p.dim() - 1)
        for view in (lambda t: t.reshape(t.shape[0], -1), lambda t: t.reshape(1, -1)):
            p_view, g_view = view(p), view(grad)
            cosine = (p_view * g_view).sum(1).abs() / (g_view.norm(dim=1) + eps) / (p_view.norm(dim=1) + eps)
            if cosine.max() < delta / math.sqrt(p_view.shape[1]):
                p_unit = p / (p_view.norm(dim=1).reshape(expand) + eps)
                perturb = perturb - p_unit * view(p_unit * perturb).sum(1).reshape(expand)
                return perturb, wd_ratio
        return perturb, 1.0

    def _group_step(self, group, params, grads):
        beta1, beta2 = group["betas"]
        steps = self._advance_steps(params)
        exp_avgs, exp_avg_sqs = _moments(self, params, grads, beta1, beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [math.sqrt(1 - beta2 ** step) for step in steps])
        torch._foreach_add_(denominators, group["eps"])
        if group["nesterov"]:
            numerators = torch._foreach_mul(exp_avgs, beta1)
            torch._foreach_add_(numerators, grads, alpha=1 - beta1)
        else:
            numerators = exp_avgs
        perturbs = list(torch._foreach_div(numerators, denominators))
        ratios = [1.0] * len(params)
        for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
            if p.dim() > 1:  # the projection is per parameter (its own norms)
                perturbs[i], ratios[i] = self._projection(p, grad, perturbs[i], group["delta"], group["wd_ratio"],
                                                          group["eps"])
        if group["weight_decay"] > 0:
            torch._foreach_mul_(params, [1 - group["lr"] * group["weight_decay"] * ratio for ratio in ratios])
        torch._foreach_mul_(perturbs, [-group["lr"] / (1 - beta1 ** step) for step in steps])
        torch._foreach_add_(params, perturbs)


def _warmup_cosine(x, warmup):
    return x / warmup if x < warmup else 0.5 * (1.0 + math.cos(math.pi * x))


def _warmup_constant(x, warmup):
    return x / warmup if x < warmup else 1.0


def _warmup_linear(x, warmup):
    return x / warmup if x < warmup else max((x - 1.0) / (warmup - 1.0), 0.0)


def _warmup_poly(x, warmup, degree=0.5):
    return x / warmup if x < warmup else (1.0 - x) ** degree


BERT_ADAM_SCHEDULES = {"warmup_cosine": _warmup_cosine, "warmup_constant": _warmup_constant,
                       "warmup_linear": _warmup_linear, "warmup_poly": _warmup_poly}


class NpuFusedBertAdam(NpuFusedOptimizerBase):
    """BERT's Adam (pytorch-pretrained-bert's BertAdam): no bias correction, decoupled weight decay
    added to the update (update = exp_avg / (sqrt(exp_avg_sq) + e) + weight_decay * p), the
    gradients of each group clipped to max_grad_norm first, and lr scheduled by
    `schedule(step / t_total, warmup)` when t_total != -1 (warmup=-1: no warmup).

    Args: params, lr (required), warmup=-1, t_total=-1, schedule='warmup_linear', b1=0.9, b2=0.999,
    e=1e-6, weight_decay=0.01, max_grad_norm=1.0 (-1: no clipping).
    """

    def __init__(self, params, lr=required, warmup=-1, t_total=-1, schedule="warmup_linear", b1=0.9, b2=0.999,
                 e=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        if lr is not required:
            _check_range("learning rate", lr)
        if (warmup < 0.0 and warmup != -1) or warmup >= 1.0:
            raise ValueError(f"Invalid warmup: {warmup}")
        if schedule not in BERT_ADAM_SCHEDULES:
            raise ValueError(f"Invalid schedule parameter: {schedule}")
        _check_range("b1 parameter", b1, high=1.0)
        _check_range("b2 parameter", b2, high=1.0)
        _check_range("epsilon value", e)
        self.max_grad_norm = max_grad_norm
        super().__init__(params, dict(lr=lr, schedule=schedule, warmup=warmup, t_total=t_total, b1=b1, b2=b2, e=e,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm))

    def _group_step(self, group, params, grads):
        if self.max_grad_norm > 0:
            # the wheel clips each dtype's combined gradients of the group by their own norm
            for dtype in {g.dtype for g in grads}:
                same = [g for g in grads if g.dtype == dtype]
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(same, 2.0, dtype=torch.float32)))
                torch._foreach_mul_(same, (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0).to(dtype))
        steps = [int(self.state[p].get("step", 0)) for p in params]
        exp_avgs, exp_avg_sqs = _moments(self, params, grads, group["b1"], group["b2"])
        updates = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(updates, group["e"])
        updates = torch._foreach_div(exp_avgs, updates)
        if group["weight_decay"] > 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if group["t_total"] != -1:
            schedule = BERT_ADAM_SCHEDULES[group["schedule"]]
            warmup = max(group["warmup"], 0.0)
            rates = [group["lr"] * schedule(step / group["t_total"], warmup) for step in steps]
        else:
            rates = [group["lr"]] * len(params)
        torch._foreach_mul_(updates, [-rate for rate in rates])
        torch._foreach_add_(params, updates)
        self._advance_steps(params)
