"""apex's fused norms and FusedAdam -> their torch equivalents (npu-migrate --fused).

- `apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)` computes
  torch.nn.LayerNorm; `FusedRMSNorm(...)` computes torch.nn.RMSNorm (x * rsqrt(mean(x^2) + eps) *
  weight). Both torch modules have the same parameters (`weight`, `bias`), so checkpoints load as
  they are; RMSNorm's eps is written out (torch's default is the dtype's machine epsilon, apex's
  1e-5). apex's memory_efficient only trades memory for recomputation: dropped. On an NPU both run
  as torch_npu's norm kernels.
- `apex.optimizers.FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode=True,
  weight_decay=0.0, ...)` is Adam with decoupled weight decay (adam_w_mode=True) -> torch.optim.AdamW,
  with weight_decay written out (AdamW's default is 1e-2, apex's 0); adam_w_mode=False is the L2
  penalty -> torch.optim.Adam. torch's optimizers use the multi-tensor (foreach) kernels on an NPU.
  torch_npu.optim.NpuFusedAdamW is not chosen: it takes float32/float16 parameters only and refuses
  zero_grad(set_to_none=True). set_grad_none is dropped (torch's zero_grad sets gradients to None by
  default, as set_grad_none=True does). Kept, with the reason: bias_correction=False, amsgrad=True
  (apex refuses it), capturable / master_weights, a non-literal adam_w_mode.
"""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import FileFacts
from npukit.migrate.codemods.fused import (
    NOT_LITERAL,
    FusedCodemod,
    FusedPlan,
    Unmappable,
    bind_arguments,
    call_text,
    literal,
    require_values,
    source,
    spell,
)

_NORMS = {"FusedLayerNorm": "torch.nn.LayerNorm", "FusedRMSNorm": "torch.nn.RMSNorm"}
_NORM_PARAMETERS = ("normalized_shape", "eps", "elementwise_affine", "memory_efficient")
_ADAM_PARAMETERS = ("params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad",
                    "set_grad_none", "capturable", "master_weights")
# FusedAdam's options the rewrite can do without, with the values it can (anything else keeps the call)
_ADAM_ONLY = {
    "bias_correction": ((True,), "bias_correction=False: torch.optim.Adam(W) always corrects the moments' bias"),
    "amsgrad": ((False,), "amsgrad: apex's FusedAdam refuses the AMSGrad variant"),
    "capturable": ((False,), "capturable (CUDA graph capture of the step) has no NPU counterpart here"),
    "master_weights": ((False,), "master_weights (fp32 master copies of fp16 parameters kept by the optimizer): "
                                 "keep fp32 parameters and autocast instead"),
}


def _spelled(qualified: str, call: cst.Call, facts: FileFacts) -> str:
    name = spell(qualified, call, facts)
    if name is None:
        raise Unmappable(f"the file does not import torch, which {qualified} is reached through")
    return name


class ApexNormsToTorch(FusedCodemod):
    """apex.normalization's FusedLayerNorm / FusedRMSNorm become torch.nn.LayerNorm / torch.nn.RMSNorm
    (same arguments and parameters; RMSNorm's eps written out). Under `npu-migrate --fused`."""

    DESCRIPTION = "apex FusedLayerNorm / FusedRMSNorm -> torch.nn.LayerNorm / torch.nn.RMSNorm"
    RULES = ("fused-norm", "fused-import")
    RULE = "fused-norm"
    NEEDS_TORCH_NPU = False
    LIBRARY = "apex"
    FILES_CONTAINING = ("apex",)
    TARGETS = {f"{module}.{name}": name for name in _NORMS
               for module in ("apex.normalization", "apex.normalization.fused_layer_norm")}
    KEPT = {f"{module}.Mixed{name}": f"apex's Mixed{name} takes fp16/bf16 inputs with weights of another dtype "
            "(fp32), which torch.nn's norms do not: keep the weights in the input's dtype (or run under autocast) "
            f"and use {_NORMS[name]}"
            for name in _NORMS for module in ("apex.normalization", "apex.normalization.fused_layer_norm")}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        bound = bind_arguments(call, _NORM_PARAMETERS, function, required=("normalized_shape",))
        module = _NORMS[function]
        arguments = [source(bound["normalized_shape"], facts)]
        arguments.append(f"eps={source(bound['eps'], facts)}" if "eps" in bound else "eps=1e-5")
        if "elementwise_affine" in bound:
            arguments.append(f"elementwise_affine={source(bound['elementwise_affine'], facts)}")
        return FusedPlan(call_text(_spelled(module, call, facts), arguments, call, facts), module)


class ApexAdamToTorch(FusedCodemod):
    """apex.optimizers.FusedAdam becomes torch.optim.AdamW (adam_w_mode=True, apex's default) or
    torch.optim.Adam (adam_w_mode=False), weight_decay written out. Under `npu-migrate --fused`."""

    DESCRIPTION = "apex FusedAdam -> torch.optim.AdamW / torch.optim.Adam"
    RULES = ("fused-optimizer", "fused-import")
    RULE = "fused-optimizer"
    NEEDS_TORCH_NPU = False
    LIBRARY = "apex"
    FILES_CONTAINING = ("apex",)
    TARGETS = {f"{module}.FusedAdam": "FusedAdam" for module in ("apex.optimizers", "apex.optimizers.fused_adam")}
    KEPT = {f"{module}.FusedLAMB": "LAMB: no torch optimizer computes it, and torch_npu.optim.NpuFusedLamb is "
            "another LAMB (no bias correction, the weight norm of its trust ratio capped at 10, no max_grad_norm "
            "clipping unless use_global_grad_norm): port apex's update as a torch optimizer of your own"
            for module in ("apex.optimizers", "apex.optimizers.fused_lamb")}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        bound = bind_arguments(call, _ADAM_PARAMETERS, function, required=("params",))
        require_values(bound, _ADAM_ONLY, facts)
        decoupled = literal(bound["adam_w_mode"], facts) if "adam_w_mode" in bound else True
        if decoupled is NOT_LITERAL or not isinstance(decoupled, (bool, int)):
            raise Unmappable(f"adam_w_mode `{source(bound['adam_w_mode'], facts)}` is not a literal: it decides "
                             "between torch.optim.AdamW and torch.optim.Adam")
        optimizer = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
        arguments = [source(bound["params"], facts)]
        arguments += [f"{name}={source(bound[name], facts)}" for name in ("lr", "betas", "eps") if name in bound]
        arguments.append(f"weight_decay={source(bound['weight_decay'], facts)}" if "weight_decay" in bound
                         else "weight_decay=0.0")
        return FusedPlan(call_text(_spelled(optimizer, call, facts), arguments, call, facts), optimizer)


_SGD_PARAMETERS = ("params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "wd_after_momentum",
                   "materialize_master_grads", "set_grad_none")
_SGD_ONLY = {"wd_after_momentum": ((False,), "wd_after_momentum=True adds the weight decay after the momentum, "
                                             "which torch.optim.SGD does not")}


class ApexSgdToTorch(FusedCodemod):
    """apex.optimizers.FusedSGD (documented as a drop-in torch.optim.SGD) becomes torch.optim.SGD with
    the same arguments; materialize_master_grads and set_grad_none are dropped. Under `npu-migrate --fused`."""

    DESCRIPTION = "apex FusedSGD -> torch.optim.SGD"
    RULES = ("fused-optimizer", "fused-import")
    RULE = "fused-optimizer"
    NEEDS_TORCH_NPU = False
    LIBRARY = "apex"
    FILES_CONTAINING = ("apex",)
    TARGETS = {f"{module}.FusedSGD": "FusedSGD" for module in ("apex.optimizers", "apex.optimizers.fused_sgd")}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        bound = bind_arguments(call, _SGD_PARAMETERS, function, required=("params", "lr"))
        require_values(bound, _SGD_ONLY, facts)
        arguments = [source(bound["params"], facts), f"lr={source(bound['lr'], facts)}"]
        arguments += [f"{name}={source(bound[name], facts)}" for name in ("momentum", "dampening", "weight_decay",
                                                                           "nesterov") if name in bound]
        return FusedPlan(call_text(_spelled("torch.optim.SGD", call, facts), arguments, call, facts), "torch.optim.SGD")
