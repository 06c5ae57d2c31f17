"""xformers.ops.memory_efficient_attention -> torch_npu.npu_fusion_attention (npu-migrate --fused).

memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None,
output_dtype=None) takes [batch, seq, heads, head_dim] tensors (BSND), or [batch, seq, head_dim]
without heads: the rewrite chooses the layout when it runs (`"BSND" if q.dim() == 4 else "BSH"`, one
head in BSH), so both keep working. scale defaults to 1/sqrt(head_dim) as in xformers; p -> keep_prob
= 1 - p; op (a kernel choice) is dropped. attn_bias: None, `LowerTriangularMask()` (causal with the
diagonal at the top-left corner: torch_npu's sparse_mode=2, leftUpCausal) and
`LowerTriangularFromBottomRightMask()` (bottom-right: sparse_mode=3), written in the call, with the
2048x2048 compressed mask torch_npu takes for them. A tensor of additive biases written in the call (a
`torch.*` call, or a slice such as `table[:, :, :n]`) becomes `npu_fusion_attention_v2`'s pse with
pse_type=0, the one torch_npu documents as added after the scale (scale * q @ k^T + pse, as xformers
adds it; the default pse_type=1 computes scale * (q @ k^T + pse)): expanded to the [B, N, Sq, Skv] pse
takes (xformers broadcasts a bias of fewer or size-1 dimensions; a 3-D call's [B, Sq, Skv] bias gets
the one head axis), so its gradient reaches the bias as xformers' does. Kept, with the reason: a
variable (it may hold a tensor or a mask object: which one is known only when it runs), any other
attn_bias (BlockDiagonalMask and the other varlen or windowed bias kinds), output_dtype, unpacked
arguments, a query computed in the call, a key computed in the call beside a tensor bias.
"""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import FileFacts
from npukit.migrate.codemods.flash_attention import compressed_mask, keep_prob
from npukit.migrate.codemods.fused import (
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

_PARAMETERS = ("query", "key", "value", "attn_bias", "p", "scale", "op", "output_dtype")
_MODULES = ("xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias")
# causal bias kinds -> torch_npu's sparse mode for them
_CAUSAL_BIASES = {f"{module}.{name}": mode for module in _MODULES
                  for name, mode in (("LowerTriangularMask", "2"), ("LowerTriangularFromBottomRightMask", "3"))}
_ONLY = {"output_dtype": ((None,), "output_dtype: npu_fusion_attention returns the inputs' dtype")}


class XformersAttentionToNpu(FusedCodemod):
    """xformers.ops.memory_efficient_attention becomes `torch_npu.npu_fusion_attention(...)[0]`
    (`npu_fusion_attention_v2` for a tensor bias; the module docstring says how each argument maps); what cannot be mapped stays and is reported with the
    reason. Under `npu-migrate --fused`."""

    DESCRIPTION = "xformers.ops.memory_efficient_attention -> torch_npu.npu_fusion_attention(...)[0]"
    RULES = ("fused-attention", "fused-import")
    RULE = "fused-attention"
    LIBRARY = "xformers"
    FILES_CONTAINING = ("xformers",)
    TARGETS = {f"{module}.memory_efficient_attention": "memory_efficient_attention" for module in _MODULES[:2]}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        bound = bind_arguments(call, _PARAMETERS, function, required=("query", "key", "value"))
        require_values(bound, _ONLY, facts)
        if not is_pure(bound["query"]):
            raise Unmappable(f"its query `{source(bound['query'], facts)}` is computed in the call: the rewrite reads "
                             "its shape too and would compute it again; assign it to a variable first")
        q = source(bound["query"], facts)
        keywords = {}
        bias = bound.get("attn_bias")
        if bias is not None and literal(bias, facts) is not None:
            mode = _CAUSAL_BIASES.get(facts.qualname(bias.func)) if isinstance(bias, cst.Call) and not bias.args else None
            if mode is not None:
                keywords["atten_mask"] = compressed_mask(call, q, facts)
            elif _is_tensor(bias, facts):
                keywords["pse"] = _pse(bias, q, bound["key"], facts)
            else:
                raise Unmappable(f"attn_bias `{source(bias, facts)}`: only None, LowerTriangularMask(), "
                                 "LowerTriangularFromBottomRightMask() and a tensor (a torch.* call or a slice) written "
                                 "in the call are mapped; a variable may hold a mask object or a tensor (write the "
                                 "tensor's slice in the call, e.g. `bias[:]`, when it is a tensor)")
        scale = bound.get("scale")
        keywords["scale"] = f"{q}.shape[-1] ** -0.5" if scale is None or literal(scale, facts) is None \
            else source(scale, facts)
        keep = keep_prob(bound.get("p"), facts)
        if keep is not None:
            keywords["keep_prob"] = keep
        if "atten_mask" in keywords:
            keywords["sparse_mode"] = mode
        if "pse" in keywords:  # v2: the pse_type under which pse is added after the scale, as xformers adds it
            keywords["pse_type"] = "0"
        arguments = [q, source(bound["key"], facts), source(bound["value"], facts),
                     f"{q}.shape[2] if {q}.dim() == 4 else 1", f'"BSND" if {q}.dim() == 4 else "BSH"',
                     *(f"{name}={value}" for name, value in keywords.items())]
        op = "torch_npu.npu_fusion_attention_v2" if "pse" in keywords else "torch_npu.npu_fusion_attention"
        text = call_text(spell(op, call, facts), arguments, call, facts, suffix="[0]")
        kept_bias = "pse" in keywords  # its text is in the rewrite: only a mask object goes
        dropped = tuple(node for node in (None if kept_bias else bias, bound.get("op")) if node is not None)
        return FusedPlan(text, f"{op}(...)[0] (BSND, or BSH for 3-D inputs)", dropped)


def _is_tensor(bias: cst.BaseExpression, facts: FileFacts) -> bool:
    """attn_bias written as a tensor: a torch.* call (torch.zeros(...), torch.tanh(b)) or a slice
    (`table[:, :, :n]`, `b[..., :n]`); xformers' mask objects are neither."""
    if isinstance(bias, cst.Call):
        name = facts.qualname(bias.func)
        return name is not None and name.startswith("torch.")
    return isinstance(bias, cst.Subscript) and any(
        isinstance(element.slice, cst.Slice) or (isinstance(element.slice, cst.Index)
                                                 and isinstance(element.slice.value, cst.Ellipsis))
        for element in bias.slice)


def _pse(bias: cst.BaseExpression, q: str, key: cst.BaseExpression, facts: FileFacts) -> str:
    """The bias expanded to the [B, N, Sq, Skv] pse (BSND), or [B, 1, Sq, Skv] for a 3-D call
    (BSH, one head), as xformers broadcasts it; evaluated once (one branch runs)."""
    if not is_pure(key):
        raise Unmappable(f"its key `{source(key, facts)}` is computed in the call: the tensor bias is expanded to "
                         "its length, which would compute it again; assign it to a variable first")
    b, k = atomic(bias, facts), source(key, facts)
    return (f"{b}.expand({q}.shape[0], {q}.shape[2], {q}.shape[1], {k}.shape[1]) if {q}.dim() == 4 "
            f"else {b}.expand({q}.shape[0], {q}.shape[1], {k}.shape[1])[:, None]")
