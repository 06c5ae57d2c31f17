"""xformers.ops.memory_efficient_attention -> torch_npu.npu_fusion_attention (npu-migrate --fused).

memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None,
output_dtype=None) takes [batch, seq, heads, head_dim] tensors (BSND), or [batch, seq, head_dim]
without heads: the rewrite chooses the layout when it runs (`"BSND" if q.dim() == 4 else "BSH"`, one
head in BSH), so both keep working. scale defaults to 1/sqrt(head_dim) as in xformers; p -> keep_prob
= 1 - p; op (a kernel choice) is dropped. attn_bias: None, `LowerTriangularMask()` (causal with the
diagonal at the top-left corner: torch_npu's sparse_mode=2, leftUpCausal) and
`LowerTriangularFromBottomRightMask()` (bottom-right: sparse_mode=3), written in the call, with the
2048x2048 compressed mask torch_npu takes for them. Kept, with the reason: any other attn_bias (a
tensor of additive biases, a variable, BlockDiagonalMask and the other varlen or windowed bias kinds),
output_dtype, unpacked arguments, a query computed in the call.
"""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import FileFacts
from npukit.migrate.codemods.flash_attention import compressed_mask, keep_prob
from npukit.migrate.codemods.fused import (
    FusedCodemod,
    FusedPlan,
    Unmappable,
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
    """xformers.ops.memory_efficient_attention becomes `torch_npu.npu_fusion_attention(...)[0]` (the
    module docstring says how each argument maps); what cannot be mapped stays and is reported with the
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
            if mode is None:
                raise Unmappable(f"attn_bias `{source(bias, facts)}`: only None, LowerTriangularMask() and "
                                 "LowerTriangularFromBottomRightMask() written in the call are mapped (a tensor bias "
                                 "would be npu_fusion_attention_v2's pse with pse_type=0: check its shape)")
            keywords["atten_mask"] = compressed_mask(call, q, facts)
        scale = bound.get("scale")
        keywords["scale"] = f"{q}.shape[-1] ** -0.5" if scale is None or literal(scale, facts) is None \
            else source(scale, facts)
        keep = keep_prob(bound.get("p"), facts)
        if keep is not None:
            keywords["keep_prob"] = keep
        if "atten_mask" in keywords:
            keywords["sparse_mode"] = mode
        arguments = [q, source(bound["key"], facts), source(bound["value"], facts),
                     f"{q}.shape[2] if {q}.dim() == 4 else 1", f'"BSND" if {q}.dim() == 4 else "BSH"',
                     *(f"{name}={value}" for name, value in keywords.items())]
        text = call_text(spell("torch_npu.npu_fusion_attention", call, facts), arguments, call, facts, suffix="[0]")
        dropped = tuple(node for node in (bias, bound.get("op")) if node is not None)
        return FusedPlan(text, "torch_npu.npu_fusion_attention(...)[0] (BSND, or BSH for 3-D inputs)", dropped)
