"""flash_attn's fused layers -> torch_npu's fused norm and torch modules (npu-migrate --fused).

Functions (flash_attn/ops/rms_norm.py, flash_attn/ops/triton/layer_norm.py):
- `rms_norm(x, weight, epsilon)` -> `torch_npu.npu_rms_norm(x, weight, epsilon)[0]` (both compute in
  fp32 and round once to x's dtype);
- `rms_norm_fn(x, weight, None, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False)` and
  `layer_norm_fn(x, weight, bias, ..., is_rms_norm=False)`: the norm of x, or of the sum x + residual
  (kept in the residual's dtype), rounded to x's dtype -> `torch_npu.npu_rms_norm(x + residual, weight,
  eps)[0].to(x.dtype)` / `torch.nn.functional.layer_norm(x + residual, x.shape[-1:], weight, bias,
  eps).to(x.dtype)` (torch_npu's npu_layer_norm_eval has no backward; torch_npu runs layer_norm with its
  fused kernel); prenorm=True also returns the sum (written twice: one more elementwise add), or x
  itself without a residual (`x.float()` with residual_in_fp32=True). The triton kernel adds in fp32 and
  normalizes the unrounded sum: a bf16 residual's sum is rounded first here (within bf16's tolerance).
Modules (the same parameters, so state dicts load unchanged):
- `flash_attn.ops.rms_norm.RMSNorm(hidden_size, eps=1e-5, device, dtype)` and the triton
  `RMSNorm(hidden_size, eps, dropout_p=0.0, zero_centered_weight=False, ...)` -> `torch.nn.RMSNorm`
  (eps written out: torch's default is the dtype's epsilon). The triton module's forward also takes
  residual / prenorm / residual_in_fp32, which torch.nn.RMSNorm's does not: such a call raises a TypeError
  naming the argument (use rms_norm_fn, which --fused rewrites);
- `flash_attn.losses.cross_entropy.CrossEntropyLoss(ignore_index, reduction, label_smoothing, ...)` ->
  `torch.nn.CrossEntropyLoss` (flash_attn's smoothing is torch's; inplace_backward, a memory saving
  that overwrites the logits' gradient buffer, is dropped). flash_attn returns the loss in fp32
  whatever the logits' dtype, torch in the logits' dtype;
- `flash_attn.ops.fused_dense.FusedDense(in_features, out_features, bias, return_residual=False, ...)`
  (an nn.Linear subclass) -> `torch.nn.Linear`.
Kept, with the reason: a bias in rms_norm_fn, x1 / weight1 / bias1 (two norms of one sum), dropout,
rowscale, zero_centered_weight, out / residual_out / out_dtype / return_dropout_mask, flags that are
not literals; CrossEntropyLoss's z-loss (lse_square_scale, return_z_loss), logit_scale and
process_group (vocab-parallel); FusedDense's return_residual; a module class also used other than by
calling it (isinstance, a base class); RotaryEmbedding and MHA (no torch / torch_npu module computes
them with their parameters and forward: KEPT says why, for each).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as matchers

from npukit.migrate.codemods.base import FileFacts
from npukit.migrate.codemods.fused import (
    NOT_LITERAL,
    FusedCodemod,
    FusedPlan,
    Unmappable,
    atomic,
    bind_arguments,
    call_text,
    is_pure,
    literal,
    require_values,
    source,
    spell,
)

_TRITON = "flash_attn.ops.triton.layer_norm"
_NORM_FN = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1", "eps", "dropout_p", "rowscale", "prenorm",
            "residual_in_fp32", "zero_centered_weight")
_NORM_FN_TAIL = ("return_dropout_mask", "out_dtype", "out", "residual_out")
_NORM_FN_PARAMETERS = {"rms_norm_fn": (*_NORM_FN, *_NORM_FN_TAIL),
                       "layer_norm_fn": (*_NORM_FN, "is_rms_norm", *_NORM_FN_TAIL)}
_NORM_FN_ONLY = {
    **{name: ((None,), "x1 / weight1 / bias1 (a second input and a second norm of the same sum) have no fused "
                       "counterpart: write the two norms by hand") for name in ("x1", "weight1", "bias1")},
    "dropout_p": ((0, 0.0), "dropout inside the norm: apply torch.nn.functional.dropout to x first, then the norm"),
    "rowscale": ((None,), "rowscale (x scaled per row before the norm) has no fused counterpart"),
    "zero_centered_weight": ((False,), "zero_centered_weight (weights stored minus one): "
                                       "torch_npu.npu_gemma_rms_norm computes it but has no backward"),
    "return_dropout_mask": ((False,), "return_dropout_mask: there is no dropout mask to return"),
    **{name: ((None,), f"{name}: the rewrite returns new tensors in x's dtype")
       for name in ("out_dtype", "out", "residual_out")},
}


def _flag(bound: dict, name: str, facts: FileFacts) -> bool:
    value = literal(bound[name], facts) if name in bound else False
    if value is NOT_LITERAL or not isinstance(value, bool):
        raise Unmappable(f"{name} `{source(bound[name], facts)}` is not True or False written in the call: it decides "
                         "what the call returns")
    return value


def _torch(call: cst.Call, facts: FileFacts) -> str:
    torch = spell("torch", call, facts)
    if torch is None:
        raise Unmappable("the file does not import torch, which the rewrite calls")
    return torch


class FlashNormFunctionsToNpu(FusedCodemod):
    """flash_attn's `rms_norm` (ops.rms_norm) and the triton `rms_norm_fn` / `layer_norm_fn` (with a
    residual and prenorm) become torch_npu.npu_rms_norm / torch.nn.functional.layer_norm (the module
    docstring says how); what cannot be mapped stays, with the reason. Under `npu-migrate --fused`."""

    DESCRIPTION = "flash_attn rms_norm / rms_norm_fn / layer_norm_fn -> torch_npu.npu_rms_norm / F.layer_norm"
    RULES = ("fused-norm", "fused-import")
    RULE = "fused-norm"
    LIBRARY = "flash_attn"
    FILES_CONTAINING = ("flash_attn",)
    TARGETS = {"flash_attn.ops.rms_norm.rms_norm": "rms_norm", f"{_TRITON}.rms_norm_fn": "rms_norm_fn",
               f"{_TRITON}.layer_norm_fn": "layer_norm_fn"}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        npu_rms_norm = spell("torch_npu.npu_rms_norm", call, facts)
        if function == "rms_norm":
            bound = bind_arguments(call, ("x", "weight", "epsilon"), function, required=("x", "weight", "epsilon"))
            arguments = [source(bound[name], facts) for name in ("x", "weight", "epsilon")]
            return FusedPlan(call_text(npu_rms_norm, arguments, call, facts, suffix="[0]"),
                             "torch_npu.npu_rms_norm(x, weight, epsilon)[0]")
        bound = bind_arguments(call, _NORM_FN_PARAMETERS[function], function, required=("x", "weight", "bias"))
        require_values(bound, _NORM_FN_ONLY, facts)
        prenorm, in_fp32 = _flag(bound, "prenorm", facts), _flag(bound, "residual_in_fp32", facts)
        rms = function == "rms_norm_fn" or _flag(bound, "is_rms_norm", facts)
        if rms and literal(bound["bias"], facts) is not None:
            raise Unmappable(f"a bias `{source(bound['bias'], facts)}` added after the RMS norm: npu_rms_norm has none")
        residual = bound.get("residual")
        if residual is not None and literal(residual, facts) is None:
            residual = None
        x = source(bound["x"], facts)
        for name, needed in (("x", residual is not None or prenorm or not rms), ("residual", prenorm)):
            if needed and name in bound and not is_pure(bound[name]):
                raise Unmappable(f"its {name} `{source(bound[name], facts)}` is computed in the call: the rewrite "
                                 "reads it more than once; assign it to a variable first")
        normed = x if residual is None else f"{atomic(bound['x'], facts)} + {atomic(residual, facts)}"
        eps = source(bound["eps"], facts) if "eps" in bound else "1e-6"
        to_x = "" if residual is None else f".to({x}.dtype)"
        if rms:
            y = call_text(npu_rms_norm, [normed, source(bound["weight"], facts), eps], call, facts, suffix=f"[0]{to_x}")
            about = "torch_npu.npu_rms_norm(...)[0]"
        else:
            layer_norm = f"{_torch(call, facts)}.nn.functional.layer_norm"
            y = call_text(layer_norm, [normed, f"{x}.shape[-1:]", source(bound["weight"], facts),
                                       source(bound["bias"], facts), eps], call, facts, suffix=to_x)
            about = "torch.nn.functional.layer_norm(...)"
        if not prenorm:
            return FusedPlan(y, about)
        sum_out = normed if residual is not None else f"{atomic(bound['x'], facts)}.float()" if in_fp32 else x
        return FusedPlan(f"({y}, {sum_out})", f"({about}, the residual sum)")


# flash_attn's module classes: qualified name -> (torch module, its parameters, the required ones)
_RMS_NORM = ("torch.nn.RMSNorm", ("hidden_size", "eps", "device", "dtype"), ("hidden_size",))
_MODULES = {
    "flash_attn.ops.rms_norm.RMSNorm": _RMS_NORM,
    f"{_TRITON}.RMSNorm": ("torch.nn.RMSNorm", ("hidden_size", "eps", "dropout_p", "zero_centered_weight", "device",
                                                "dtype"), ("hidden_size",)),
    "flash_attn.losses.cross_entropy.CrossEntropyLoss": (
        "torch.nn.CrossEntropyLoss", ("ignore_index", "reduction", "label_smoothing", "logit_scale", "lse_square_scale",
                                      "inplace_backward", "process_group", "return_z_loss"), ()),
    "flash_attn.ops.fused_dense.FusedDense": (
        "torch.nn.Linear", ("in_features", "out_features", "bias", "return_residual", "device", "dtype"),
        ("in_features", "out_features")),
}
_MODULE_ONLY = {
    "dropout_p": ((0, 0.0), "dropout_p: the triton RMSNorm's dropout before the norm has no torch.nn.RMSNorm "
                            "counterpart: put a torch.nn.Dropout before it"),
    "zero_centered_weight": ((False,), "zero_centered_weight (weights stored minus one): torch.nn.RMSNorm multiplies "
                                       "by the weight itself; torch_npu.npu_gemma_rms_norm has no backward"),
    "logit_scale": ((1, 1.0), "logit_scale: torch.nn.CrossEntropyLoss does not scale the logits: scale them first"),
    "lse_square_scale": ((0, 0.0), "lse_square_scale (z-loss) has no torch.nn.CrossEntropyLoss counterpart"),
    "return_z_loss": ((False,), "return_z_loss: torch.nn.CrossEntropyLoss returns the loss only"),
    "process_group": ((None,), "process_group (a vocabulary split over tensor-parallel ranks): "
                               "torch.nn.CrossEntropyLoss sees the whole vocabulary"),
    "return_residual": ((False,), "return_residual=True: FusedDense also returns its input, torch.nn.Linear does not"),
}
_DROPPED = frozenset({"dropout_p", "zero_centered_weight", "logit_scale", "lse_square_scale", "return_z_loss",
                      "process_group", "return_residual", "inplace_backward"})
_EPS = {"torch.nn.RMSNorm": "1e-5"}  # flash_attn's default, written out where torch's differs


def _class_uses(call: cst.Call, qualified: str, facts: FileFacts) -> bool:
    """The class `qualified` is used in the file other than by calling it (isinstance, a base class,
    a value passed on): torch's instances would not be its. Decided on the whole file, also where
    npu-migrate gave a codemod only the statement around the call (ThirdPartyCuda's hint)."""
    if not facts.whole_file:
        text = facts.positions.text
        facts = FileFacts(facts.path, cst.parse_module(text), text, facts.tree)
    called = {id(node.func) for node in matchers.findall(facts.module, matchers.Call())}
    return any(id(node) not in called and facts.qualname(node) == qualified
               for node in matchers.findall(facts.module, matchers.Name() | matchers.Attribute())
               if not (isinstance(node, cst.Name) and not facts.is_read(node)))


class FlashLayersToTorch(FusedCodemod):
    """flash_attn's RMSNorm modules, CrossEntropyLoss and FusedDense become torch.nn.RMSNorm,
    torch.nn.CrossEntropyLoss and torch.nn.Linear with the same parameters (the module docstring says
    what each keeps); RotaryEmbedding and MHA stay, with the reason. Under `npu-migrate --fused`."""

    DESCRIPTION = "flash_attn RMSNorm / CrossEntropyLoss / FusedDense -> torch.nn.RMSNorm / CrossEntropyLoss / Linear"
    RULES = ("fused-layer", "fused-import")
    RULE = "fused-layer"
    NEEDS_TORCH_NPU = False
    LIBRARY = "flash_attn"
    FILES_CONTAINING = ("flash_attn",)
    TARGETS = {qualified: qualified.rsplit(".", 1)[1] for qualified in _MODULES}
    KEPT = {
        "flash_attn.layers.rotary.RotaryEmbedding": "flash_attn's RotaryEmbedding rotates q and k (or packed qkv) with "
        "its own cos/sin cache, XPos scaling and KV-cache offsets: no torch or torch_npu module does (torch_npu's rotary "
        "is the function npu_rotary_mul, given the cos/sin tables), and the module's forward runs where the module is "
        "used, not where it is built; compute cos and sin and call apply_rotary_emb (which --fused rewrites to "
        "torch_npu.npu_rotary_mul)",
        "flash_attn.modules.mha.MHA": "flash_attn's MHA (Wqkv or Wq/Wkv and out_proj projections, rotary, GQA, causal "
        "flash attention, a depthwise conv and a KV cache in one module, forward(x, ...) -> output) has no torch or "
        "torch_npu counterpart: torch.nn.MultiheadAttention (in_proj_weight) and torch_npu.contrib.module."
        "MultiheadAttention (fairseq's q_proj/k_proj/v_proj) take (query, key, value) and return (output, weights), so "
        "neither the model's calls nor its state dict would carry over; build it from torch.nn.Linear and the "
        "attention functions --fused rewrites",
    }

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        qualified = facts.qualname(call.func)
        module, parameters, required = _MODULES[qualified]
        bound = bind_arguments(call, parameters, function, required=required)
        require_values(bound, _MODULE_ONLY, facts)
        if _class_uses(call, qualified, facts):
            raise Unmappable(f"flash_attn's {function} is also used here other than by calling it (isinstance, a base "
                             f"class, a value passed on): {module}'s instances would not be {function}'s; rewrite "
                             "those uses together by hand")
        positional = [name for name in required]
        arguments = [source(bound[name], facts) for name in positional]
        for name in parameters:
            if name in bound and name not in positional and name not in _DROPPED:
                arguments.append(f"{name}={source(bound[name], facts)}")
            elif name == "eps" and module in _EPS:
                arguments.append(f"eps={_EPS[module]}")
        name = spell(module, call, facts)
        if name is None:
            raise Unmappable(f"the file does not import torch, which {module} is reached through")
        return FusedPlan(call_text(name, arguments, call, facts), module)
