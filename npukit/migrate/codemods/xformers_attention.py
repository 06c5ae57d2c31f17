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
the one head axis), so its gradient reaches the bias as xformers' does. The varlen kinds
`BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen=None)` (batch 1, the sequences concatenated;
`BlockDiagonalCausalMask`: causal per sequence, top-left, sparse_mode=2;
`BlockDiagonalCausalFromBottomRightMask`: bottom-right, sparse_mode=3) become TND: q, k, v
`.flatten(0, 1)` ([1, T, H, D] -> [T, H, D]; a 3-D call gets its one head axis), the per-sequence
lengths the cumulative ends `torch.tensor(lengths).cumsum(0).tolist()` actual_seq_qlen/kvlen take, the
output reshaped back to the query's [1, T, H, D]. Kept, with the reason: a variable (it may hold a tensor
or a mask object: which one is known only when it runs), any other attn_bias (the padded-keys, paged and
windowed block kinds, a bias built outside the call), output_dtype, unpacked arguments, a query computed
in the call, a key computed in the call beside a tensor bias, q_seqlen computed in the call when it
gives both lengths.
"""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import FileFacts
from npukit.migrate.codemods.flash_attention import compressed_mask, keep_prob
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

_PARAMETERS = ("query", "key", "value", "attn_bias", "p", "scale", "op", "output_dtype")
_MODULES = ("xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias")
# causal bias kinds -> torch_npu's sparse mode for them
_CAUSAL_BIASES = {f"{module}.{name}": mode for module in _MODULES
                  for name, mode in (("LowerTriangularMask", "2"), ("LowerTriangularFromBottomRightMask", "3"))}
# varlen bias kinds (batch 1, the sequences concatenated) -> torch_npu's sparse mode for them, per sequence
_BLOCK_DIAGONAL_BIASES = {f"{module}.{name}.from_seqlens": mode for module in _MODULES
                          for name, mode in (("BlockDiagonalMask", "0"), ("BlockDiagonalCausalMask", "2"),
                                             ("BlockDiagonalCausalFromBottomRightMask", "3"))}
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
        mode, sequences = None, None
        if bias is not None and literal(bias, facts) is not None:
            called = facts.qualname(bias.func) if isinstance(bias, cst.Call) else None
            mode = _CAUSAL_BIASES.get(called) if not (isinstance(bias, cst.Call) and bias.args) else None
            if called in _BLOCK_DIAGONAL_BIASES:
                mode, sequences = _BLOCK_DIAGONAL_BIASES[called], _sequence_ends(bias, call, facts)
                if mode != "0":
                    keywords["atten_mask"] = compressed_mask(call, q, facts)
            elif mode is not None:
                keywords["atten_mask"] = compressed_mask(call, q, facts)
            elif _is_tensor(bias, facts):
                keywords["pse"] = _pse(bias, q, bound["key"], facts)
            else:
                raise Unmappable(f"attn_bias `{source(bias, facts)}`: only None, LowerTriangularMask(), "
                                 "LowerTriangularFromBottomRightMask(), BlockDiagonal[Causal[FromBottomRight]]Mask"
                                 ".from_seqlens(...) and a tensor (a torch.* call or a slice) written in the call are "
                                 "mapped; a variable may hold a mask object or a tensor (write the tensor's slice in "
                                 "the call, e.g. `bias[:]`, when it is a tensor)")
        scale = bound.get("scale")
        keywords["scale"] = f"{q}.shape[-1] ** -0.5" if scale is None or literal(scale, facts) is None \
            else source(scale, facts)
        keep = keep_prob(bound.get("p"), facts)
        if keep is not None:
            keywords["keep_prob"] = keep
        if sequences is not None:
            keywords["actual_seq_qlen"], keywords["actual_seq_kvlen"] = sequences
        if "atten_mask" in keywords:
            keywords["sparse_mode"] = mode
        if "pse" in keywords:  # v2: the pse_type under which pse is added after the scale, as xformers adds it
            keywords["pse_type"] = "0"
        heads = f"{q}.shape[2] if {q}.dim() == 4 else 1"
        tensors = [source(bound[name], facts) for name in ("query", "key", "value")]
        if sequences is None:
            arguments = [*tensors, heads, f'"BSND" if {q}.dim() == 4 else "BSH"']
        else:  # [1, T, H, D] (or [1, T, D], one head) -> TND [T, H, D]; the output back to the query's shape
            arguments = [f"{atomic(t, facts)}.flatten(0, 1) if {q}.dim() == 4 else {atomic(t, facts)}.flatten(0, 1)[:, None]"
                         for t in (bound[name] for name in ("query", "key", "value"))] + [heads, '"TND"']
        arguments += [f"{name}={value}" for name, value in keywords.items()]
        op = "torch_npu.npu_fusion_attention_v2" if "pse" in keywords else "torch_npu.npu_fusion_attention"
        suffix = "[0]" if sequences is None else f"[0].reshape(*{q}.shape[:-1], -1)"
        text = call_text(spell(op, call, facts), arguments, call, facts, suffix=suffix)
        kept_bias = "pse" in keywords  # its text is in the rewrite: only a mask object goes
        dropped = tuple(node for node in (None if kept_bias else bias, bound.get("op")) if node is not None)
        layout = "TND" if sequences is not None else "BSND, or BSH for 3-D inputs"
        return FusedPlan(text, f"{op}(...)[0] ({layout})", dropped)


def _sequence_ends(bias: cst.Call, call: cst.Call, facts: FileFacts) -> tuple[str, str]:
    """actual_seq_qlen / actual_seq_kvlen, the cumulative ends torch_npu takes, from
    from_seqlens(q_seqlen, kv_seqlen=None)'s per-sequence lengths (kv_seqlen: q_seqlen's by default)."""
    bound = bind_arguments(bias, ("q_seqlen", "kv_seqlen", "device"), "from_seqlens", required=("q_seqlen",))
    torch = spell("torch", call, facts)
    if torch is None:
        raise Unmappable("the file does not import torch, which the cumulative sequence lengths are computed with")
    lengths = bound["q_seqlen"]
    kv_lengths = bound.get("kv_seqlen")
    if (kv_lengths is None or literal(kv_lengths, facts) is None) and not is_pure(lengths) \
            and literal(lengths, facts) is NOT_LITERAL:  # a literal list may be written twice
        raise Unmappable(f"q_seqlen `{source(lengths, facts)}` is computed in the call and gives both "
                         "actual_seq_qlen and actual_seq_kvlen; assign it to a variable first")
    if kv_lengths is None or literal(kv_lengths, facts) is None:
        kv_lengths = lengths
    ends = "{torch}.tensor({lengths}).cumsum(0).tolist()"
    return (ends.format(torch=torch, lengths=source(lengths, facts)),
            ends.format(torch=torch, lengths=source(kv_lengths, facts)))


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
