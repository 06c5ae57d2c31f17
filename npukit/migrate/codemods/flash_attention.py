"""flash_attn's attention functions -> torch_npu.npu_fusion_attention (npu-migrate --fused).

flash_attn (2.x) and torch_npu's FlashAttentionScore compute the same attention; the rewrite moves
the arguments to torch_npu's documented ones (`_op_plugin_docs.py` of the torch_npu 2.13 wheel):
- layout: q, k, v of shape (batch, seq, heads, head_dim) are input_layout "BSND" with
  head_num=q.shape[2]; the varlen functions' (tokens, heads, head_dim) are "TND", head_num=q.shape[1],
  and their cumulative cu_seqlens (0, l1, l1+l2, ...) become actual_seq_qlen / actual_seq_kvlen, the
  lists of cumulative ends torch_npu takes (cu_seqlens[1:].tolist()); max_seqlen is not needed;
- packed inputs (qkv, kv) are unbound along their packing axis into the three tensors;
- softmax_scale (default 1/sqrt(head_dim)) -> scale (torch_npu's default is 1); dropout_p -> keep_prob = 1 - p;
- causal (flash_attn >= 2.1 aligns the causal diagonal to the bottom-right corner) -> sparse_mode=3
  (rightDownCausal) with the 2048x2048 compressed mask torch.triu(ones, 1) torch_npu requires;
- window_size=(left, right) (key j seen from query i when i + Sk - Sq - left <= j <= i + Sk - Sq + right,
  -1 unbounded; causal sets right to 0) -> sparse_mode=4 (band, bottom-right origin) with
  pre_tockens=left, next_tockens=right (-1: 2147483647) and the same compressed mask;
- npu_fusion_attention returns (attention_out, softmax_max, softmax_sum, ...): the rewrite takes [0],
  what flash_attn returns.
Kept, with the reason: softcap and alibi_slopes (no such parameter; ALiBi would be a pse tensor),
return_attn_probs, a paged KV cache (block_table), arguments unpacked from `*args` / `**kwargs`, a
causal flag or window that is not a literal or a plain name, a query expression the rewrite would have
to evaluate twice (its shape gives head_num).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

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

INT_MAX = 2147483647  # torch_npu's pre_tockens / next_tockens default: unbounded
COMPRESSED_MASK = "{torch}.triu({torch}.ones(2048, 2048, dtype={torch}.bool, device={device}), diagonal=1)"
_OPTIONS = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
            "return_attn_probs")


@dataclass(frozen=True)
class _Variant:
    """One of flash_attn's functions: its leading parameters, whether it is varlen (TND) and which
    tensor packs several of q, k, v ("qkv", "kv" or none)."""

    leading: tuple[str, ...]
    varlen: bool
    packed: str = ""
    trailing: tuple[str, ...] = ()

    @property
    def parameters(self) -> tuple[str, ...]:
        return (*self.leading, *_OPTIONS, *self.trailing)


VARIANTS = {
    "flash_attn_func": _Variant(("q", "k", "v"), varlen=False),
    "flash_attn_kvpacked_func": _Variant(("q", "kv"), varlen=False, packed="kv"),
    "flash_attn_qkvpacked_func": _Variant(("qkv",), varlen=False, packed="qkv"),
    "flash_attn_varlen_func": _Variant(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
                                       varlen=True, trailing=("block_table",)),
    "flash_attn_varlen_kvpacked_func": _Variant(("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                 "max_seqlen_k"), varlen=True, packed="kv"),
    "flash_attn_varlen_qkvpacked_func": _Variant(("qkv", "cu_seqlens", "max_seqlen"), varlen=True, packed="qkv"),
}
# the values of an option the rewrite can do without (anything else keeps the call)
_ONLY = {
    "softcap": ((0, 0.0), "softcap (tanh capping of the scores) has no npu_fusion_attention counterpart"),
    "alibi_slopes": ((None,), "ALiBi slopes have no npu_fusion_attention parameter (torch_npu takes ALiBi as a "
                              "pse tensor of biases): write the bias and pass it as pse by hand"),
    "return_attn_probs": ((False,), "return_attn_probs: npu_fusion_attention does not return the attention "
                                    "probabilities (only the softmax's row max and sum)"),
    "block_table": ((None,), "a paged KV cache (block_table) is torch_npu.npu_fused_infer_attention_score's, "
                             "an inference kernel with other arguments"),
}


def _masking(causal: bool, window: tuple[int, int]) -> dict[str, str]:
    """npu_fusion_attention's sparse arguments for flash_attn's causal flag and window (the mask
    itself as the placeholder {mask})."""
    left, right = window
    if causal:
        right = 0
    left = INT_MAX if left < 0 else left
    right = INT_MAX if right < 0 else right
    if left == INT_MAX and right == INT_MAX:
        return {}
    if left == INT_MAX and right == 0:
        return {"atten_mask": "{mask}", "sparse_mode": "3"}
    return {"atten_mask": "{mask}", "pre_tockens": str(left), "next_tockens": str(right), "sparse_mode": "4"}


def compressed_mask(call: cst.Call, query: str, facts: FileFacts) -> str:
    """The 2048x2048 upper-triangular mask torch_npu's causal and band sparse modes take, on the query's device."""
    torch = spell("torch", call, facts)
    if torch is None:
        raise Unmappable("the file does not import torch, which the causal mask is built with")
    return COMPRESSED_MASK.format(torch=torch, device=f"{query}.device")


def keep_prob(dropout: cst.BaseExpression | None, facts: FileFacts) -> str | None:
    """keep_prob = 1 - the dropout probability; None for no dropout (torch_npu's default keeps everything)."""
    if dropout is None:
        return None
    value = literal(dropout, facts)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value == 0 else repr(1 - float(value))
    return f"1 - {atomic(dropout, facts)}"


_SPARSE_DEFAULTS = {"atten_mask": "None", "pre_tockens": str(INT_MAX), "next_tockens": str(INT_MAX), "sparse_mode": "0"}


class FlashAttentionToNpu(FusedCodemod):
    """flash_attn's flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func and their
    varlen forms become `torch_npu.npu_fusion_attention(...)[0]` (the module docstring says how each
    argument maps); what cannot be mapped stays and is reported with the reason. Under `npu-migrate --fused`."""

    DESCRIPTION = "flash_attn_func / flash_attn_varlen_func / packed forms -> torch_npu.npu_fusion_attention(...)[0]"
    RULES = ("fused-attention", "fused-import")
    RULE = "fused-attention"
    LIBRARY = "flash_attn"
    FILES_CONTAINING = ("flash_attn",)
    TARGETS = {f"{module}.{name}": name for name in VARIANTS
               for module in ("flash_attn", "flash_attn.flash_attn_interface")}
    KEPT = {f"{module}.flash_attn_with_kvcache": "flash_attn_with_kvcache is an inference kernel that also updates "
            "the KV cache in place (rotary, paged blocks): torch_npu's npu_fused_infer_attention_score takes other "
            "arguments; rewrite the cache update and the call by hand"
            for module in ("flash_attn", "flash_attn.flash_attn_interface")}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        variant = VARIANTS[function]
        bound = bind_arguments(call, variant.parameters, function, required=variant.leading)
        require_values(bound, _ONLY, facts)
        query = "qkv" if variant.packed == "qkv" else "q"  # the tensor whose shape gives head_num and head_dim
        if not is_pure(bound[query]):
            raise Unmappable(f"its {query} argument `{source(bound[query], facts)}` is computed in the call: "
                             "the rewrite reads its shape too and would compute it again; assign it to a variable first")
        shape = source(bound[query], facts)
        packing_axis = 1 if variant.varlen else 2  # (tokens, [2|3], heads, dim) or (batch, seq, [2|3], heads, dim)
        head_axis = packing_axis + (variant.packed == "qkv")
        if variant.packed == "qkv":
            tensors = [f"*{shape}.unbind({packing_axis})"]
        elif variant.packed == "kv":
            tensors = [shape, f"*{atomic(bound['kv'], facts)}.unbind({packing_axis})"]
        else:
            tensors = [source(bound[name], facts) for name in ("q", "k", "v")]
        keywords = cls._sparse(bound, shape, call, facts)
        scale = bound.get("softmax_scale")
        keywords["scale"] = f"{shape}.shape[-1] ** -0.5" if scale is None or literal(scale, facts) is None \
            else source(scale, facts)
        keep = keep_prob(bound.get("dropout_p"), facts)
        if keep is not None:
            keywords["keep_prob"] = keep
        if variant.varlen:
            keywords.update(cls._sequence_lengths(bound, variant, facts))
        order = ("atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens", "actual_seq_qlen",
                 "actual_seq_kvlen", "sparse_mode")
        arguments = [*tensors, f"{shape}.shape[{head_axis}]", '"TND"' if variant.varlen else '"BSND"',
                     *(f"{name}={keywords[name]}" for name in order if name in keywords)]
        function_name = spell("torch_npu.npu_fusion_attention", call, facts)
        text = call_text(function_name, arguments, call, facts, suffix="[0]")
        return FusedPlan(text, f'torch_npu.npu_fusion_attention(..., input_layout="{"TND" if variant.varlen else "BSND"}")[0]')

    @classmethod
    def _sparse(cls, bound: dict, shape: str, call: cst.Call, facts: FileFacts) -> dict[str, str]:
        """atten_mask, sparse_mode, pre_tockens / next_tockens for the call's causal and window_size."""
        window = (-1, -1)
        if "window_size" in bound:
            window = literal(bound["window_size"], facts)
            if not (isinstance(window, tuple) and len(window) == 2 and all(type(w) is int for w in window)):
                raise Unmappable(f"window_size `{source(bound['window_size'], facts)}` is not a literal (left, right) "
                                 "pair, which the rewrite needs to choose the sparse mode")
        causal_node = bound.get("causal")
        causal = False if causal_node is None else literal(causal_node, facts)
        if causal is NOT_LITERAL and not is_pure(causal_node):
            raise Unmappable(f"causal `{source(causal_node, facts)}` is computed in the call: the rewrite uses it "
                             "for the mask and the sparse mode; assign it to a variable first")
        if causal is not NOT_LITERAL:
            keywords = _masking(bool(causal), window)
        else:  # a flag known when the code runs: each argument chosen by it where the two cases differ
            flag = source(causal_node, facts)
            when_causal, otherwise = _masking(True, window), _masking(False, window)
            keywords = {}
            for name in _SPARSE_DEFAULTS:
                yes, no = when_causal.get(name, _SPARSE_DEFAULTS[name]), otherwise.get(name, _SPARSE_DEFAULTS[name])
                if yes != no:
                    keywords[name] = f"{yes} if {flag} else {no}"
                elif name in when_causal:
                    keywords[name] = yes
        if any("{mask}" in value for value in keywords.values()):
            mask = compressed_mask(call, shape, facts)
            keywords = {name: value.replace("{mask}", mask) for name, value in keywords.items()}
        return keywords

    @staticmethod
    def _sequence_lengths(bound: dict, variant: _Variant, facts: FileFacts) -> dict[str, str]:
        """actual_seq_qlen / actual_seq_kvlen: the cumulative ends cu_seqlens[1:] as Python int lists."""
        if variant.packed == "qkv":
            lengths = bound["cu_seqlens"]
            if not is_pure(lengths):
                raise Unmappable(f"cu_seqlens `{source(lengths, facts)}` is computed in the call and gives both "
                                 "actual_seq_qlen and actual_seq_kvlen; assign it to a variable first")
            ends = f"{atomic(lengths, facts)}[1:].tolist()"
            return {"actual_seq_qlen": ends, "actual_seq_kvlen": ends}
        return {"actual_seq_qlen": f"{atomic(bound['cu_seqlens_q'], facts)}[1:].tolist()",
                "actual_seq_kvlen": f"{atomic(bound['cu_seqlens_k'], facts)}[1:].tolist()"}


_ROTARY_PARAMETERS = ("x", "cos", "sin", "interleaved", "inplace", "seqlen_offsets", "cu_seqlens", "max_seqlen")
_ROTARY_ONLY = {
    "inplace": ((False,), "inplace=True: flash_attn rotates x in place and returns it, npu_rotary_mul returns a new "
                          "tensor"),
    "seqlen_offsets": ((0,), "seqlen_offsets (a KV cache's position offsets) has no npu_rotary_mul counterpart: "
                             "slice cos and sin at the offset by hand"),
    "cu_seqlens": ((None,), "varlen input (cu_seqlens): npu_rotary_mul takes 4-dim tensors"),
}


class FlashRotaryToNpu(FusedCodemod):
    """flash_attn's `apply_rotary_emb(x, cos, sin, interleaved)` (flash_attn.layers.rotary) becomes
    torch_npu.npu_rotary_mul on the rotated part of x, the rest of x passed through:
    x (batch, seq, heads, head_dim) is BSND; flash_attn's cos/sin (seq_ro, rotary_dim / 2) become the
    1S1D tables npu_rotary_mul takes (`cat((cos, cos))` for the GPT-NeoX halves, 'half' mode;
    `cos.repeat_interleave(2, -1)` for interleaved=True, 'interleave' mode), cut to x's sequence length
    as flash_attn cuts them; the first rotary_dim = 2 * cos.shape[-1] features of x are rotated, the others
    kept. Kept, with the reason: inplace=True, seqlen_offsets, varlen input, tensors computed in the call
    (each is read more than once). Under `npu-migrate --fused`."""

    DESCRIPTION = "flash_attn apply_rotary_emb -> torch_npu.npu_rotary_mul"
    RULES = ("fused-rotary", "fused-import")
    RULE = "fused-rotary"
    LIBRARY = "flash_attn"
    FILES_CONTAINING = ("flash_attn",)
    TARGETS = {f"{module}.apply_rotary_emb": "apply_rotary_emb"
               for module in ("flash_attn.layers.rotary", "flash_attn.ops.triton.rotary")}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        bound = bind_arguments(call, _ROTARY_PARAMETERS, function, required=("x", "cos", "sin"))
        require_values(bound, _ROTARY_ONLY, facts)
        for name in ("x", "cos", "sin"):
            if not is_pure(bound[name]):
                raise Unmappable(f"its {name} `{source(bound[name], facts)}` is computed in the call: the rewrite "
                                 "reads it more than once; assign it to a variable first")
        interleaved = literal(bound["interleaved"], facts) if "interleaved" in bound else False
        if not isinstance(interleaved, bool):
            raise Unmappable(f"interleaved `{source(bound['interleaved'], facts)}` is not a literal: it decides "
                             "npu_rotary_mul's rotary_mode")
        torch = spell("torch", call, facts)
        if torch is None:
            raise Unmappable("the file does not import torch, which the rotary tables are built with")
        x, cos, sin = (source(bound[name], facts) for name in ("x", "cos", "sin"))
        rotary_dim = f"{cos}.shape[-1] * 2"

        def table(half: str) -> str:  # (seq_ro, rotary_dim / 2) -> (1, seq, 1, rotary_dim)
            full = f"{half}.repeat_interleave(2, -1)" if interleaved else f"{torch}.cat(({half}, {half}), -1)"
            return f"{full}[None, :{x}.shape[1], None]"

        arguments = [f"{x}[..., :{rotary_dim}]", table(cos), table(sin)]
        if interleaved:
            arguments.append('"interleave"')
        rotated = call_text(spell("torch_npu.npu_rotary_mul", call, facts), arguments, call, facts)
        text = f"{torch}.cat(({rotated}, {x}[..., {rotary_dim}:]), -1)"
        return FusedPlan(text, "torch_npu.npu_rotary_mul on the rotated features, the others kept")
