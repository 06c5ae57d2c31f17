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
output reshaped back to the query's [1, T, H, D]. `LowerTriangularMask().add_bias(t)` (and
`LowerTriangularMaskWithTensorBias(t)`, what it returns: t added after the scale, then the causal mask at
the top-left) becomes npu_fusion_attention_v2 with both: t as pse (pse_type=0, expanded as above) and
sparse_mode=2.

An attn_bias variable is resolved when the function around the call assigns it once, before the call in
the same block (`bias = xops.LowerTriangularMask()` two lines up), to one of the kinds above, and
nothing else reads it: the assignment of a mask object goes with the call (a block-diagonal mask's
lengths, names or literals not assigned again before the call, move into it), `bias =
LowerTriangularMask().add_bias(t)` becomes `bias = t`, a tensor stays where it is. Kept, with the
reason: any other variable (a parameter, one assigned twice or in another block, a mask read elsewhere
too: what it holds is known only when it runs), any other attn_bias (the padded-keys, paged and
windowed block kinds, a bias built by another function), output_dtype, unpacked arguments, a query
computed in the call, a key computed in the call beside a tensor bias, q_seqlen computed in the call
when it gives both lengths.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as matchers

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
    statement_lines,
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
# causal masks with an additive tensor bias: the class, called with the tensor (LowerTriangularMask().add_bias(t)
# returns one)
_CAUSAL_TENSOR_BIASES = {f"{module}.LowerTriangularMaskWithTensorBias" for module in _MODULES}
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
        mode, sequences, dropped, edits = None, None, [bound.get("op")], []
        if bias is not None and literal(bias, facts) is not None:
            variable = bias if isinstance(bias, cst.Name) else None
            assignment, value = _assigned_bias(variable, call, facts) if variable is not None else (None, bias)
            kind = _bias_kind(value, facts)
            if kind is None:
                raise Unmappable(f"attn_bias `{source(bias, facts)}`" + (
                    f" holds `{source(value, facts)}` (line {_line(value, facts)})"
                    if variable is not None else "") +
                    ": only None, LowerTriangularMask() (or its .add_bias(tensor)), "
                    "LowerTriangularFromBottomRightMask(), BlockDiagonal[Causal[FromBottomRight]]Mask"
                    ".from_seqlens(...) and a tensor (a torch.* call or a slice) are mapped, written in the call "
                    "or assigned once before it in the same function")
            if variable is not None and kind != "tensor":  # a mask object: its assignment goes with the call
                _only_read_here(variable, value, assignment, facts)
            tensor = _causal_tensor(value, facts) if kind == "causal with tensor" else None
            if kind == "block diagonal":
                if variable is not None:
                    _lengths_unchanged(value, assignment, call, facts)
                mode = _BLOCK_DIAGONAL_BIASES[facts.qualname(value.func)]
                sequences = _sequence_ends(value, call, facts)
                if mode != "0":
                    keywords["atten_mask"] = compressed_mask(call, q, facts)
            elif kind == "causal":
                mode, keywords["atten_mask"] = _CAUSAL_BIASES[facts.qualname(value.func)], compressed_mask(call, q, facts)
            elif kind == "causal with tensor":  # the tensor added after the scale, then the top-left causal mask
                mode, keywords["atten_mask"] = "2", compressed_mask(call, q, facts)
                keywords["pse"] = _pse(variable or tensor, q, bound["key"], facts)
            else:
                keywords["pse"] = _pse(bias, q, bound["key"], facts)
            if variable is None and kind != "tensor":
                dropped.append(value.func if tensor is not None else value)  # the mask object (its tensor stays)
            elif variable is not None and kind == "causal with tensor":  # `bias = <mask>.add_bias(t)` -> `bias = t`
                dropped.append(value.func)
                edits.append((value, source(tensor, facts)))
            elif variable is not None and kind != "tensor":  # the assignment of the mask object goes
                dropped.append(value)
                edits.append((assignment, ""))
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
        layout = "TND" if sequences is not None else "BSND, or BSH for 3-D inputs"
        return FusedPlan(text, f"{op}(...)[0] ({layout})", tuple(node for node in dropped if node is not None),
                         tuple(edits))


def _bias_kind(bias: cst.BaseExpression, facts: FileFacts) -> str | None:
    """"causal" (LowerTriangular[FromBottomRight]Mask()), "causal with tensor" (LowerTriangularMask()
    .add_bias(t), LowerTriangularMaskWithTensorBias(t)), "block diagonal" (BlockDiagonal*.from_seqlens),
    "tensor", or None for anything else."""
    if not isinstance(bias, cst.Call):
        return "tensor" if _is_tensor(bias, facts) else None
    called = facts.qualname(bias.func)
    if called in _BLOCK_DIAGONAL_BIASES:
        return "block diagonal"
    if called in _CAUSAL_BIASES and not bias.args:
        return "causal"
    if _causal_tensor(bias, facts) is not None:
        return "causal with tensor"
    return "tensor" if _is_tensor(bias, facts) else None


def _causal_tensor(bias: cst.Call, facts: FileFacts) -> cst.BaseExpression | None:
    """The tensor of `LowerTriangularMask().add_bias(t)` or `LowerTriangularMaskWithTensorBias(t)`, else None."""
    if len(bias.args) != 1 or bias.args[0].star or bias.args[0].keyword not in (None,) and \
            bias.args[0].keyword.value != "bias":
        return None
    func = bias.func
    add_bias_of_causal = isinstance(func, cst.Attribute) and func.attr.value == "add_bias" and \
        isinstance(func.value, cst.Call) and not func.value.args and \
        _CAUSAL_BIASES.get(facts.qualname(func.value.func)) == "2"  # LowerTriangularMask's: top-left
    return bias.args[0].value if add_bias_of_causal or facts.qualname(func) in _CAUSAL_TENSOR_BIASES else None


def _line(node: cst.CSTNode, facts: FileFacts) -> int:
    return facts.line_col(facts.span(node)[0])[0]


def _only_read_here(variable: cst.Name, value: cst.BaseExpression, assignment: cst.SimpleStatementLine,
                    facts: FileFacts) -> None:
    """Unmappable unless this call's attn_bias is the only read of the variable: the mask object's
    assignment goes with the call."""
    scopes = facts.scopes
    scope = scopes.scope_of[variable]
    others = [read for read in scopes.reads.get(variable.value, ())
              if read is not variable and scopes.defining_scope(variable.value, scopes.scope_of[read]) is scope]
    if others:
        raise Unmappable(f"attn_bias `{variable.value}` holds the mask object `{source(value, facts)}` (line "
                         f"{_line(assignment, facts)}), read elsewhere too (line {_line(others[0], facts)}): its "
                         "assignment cannot go with this call; write the mask in the call")


def _lengths_unchanged(value: cst.Call, assignment: cst.SimpleStatementLine, call: cst.Call, facts: FileFacts) -> None:
    """Unmappable unless the block-diagonal mask's lengths can move from its assignment into the call:
    names or literals, none of their names bound again in the function after the assignment (after the
    call too: in a loop that runs before the call's next turn)."""
    scopes = facts.scopes
    lengths = [arg.value for arg in value.args if arg.keyword is None or arg.keyword.value != "device"]
    if not all(is_pure(length) or literal(length, facts) is not NOT_LITERAL for length in lengths):
        raise Unmappable(f"the lengths of `{source(value, facts)}` (line {_line(assignment, facts)}) are computed "
                         "there: they would be computed at the call instead; assign them to variables first")
    assigned_at = _line(assignment, facts)
    for length in lengths:
        for name in (node for node in matchers.findall(length, matchers.Name()) if facts.is_read(node)):
            scope = scopes.defining_scope(name.value, scopes.scope_of[name])
            rebound = [store for store in scopes.stores.get(name.value, ())
                       if scopes.scope_of[store] is scope and assigned_at < _line(store, facts)]
            if rebound:
                raise Unmappable(f"`{name.value}`, a length of `{source(value, facts)}` (line {assigned_at}), is "
                                 f"assigned again at line {_line(rebound[0], facts)}: moved into the call, it could "
                                 "read the new value")


def _assigned_bias(variable: cst.Name, call: cst.Call, facts: FileFacts) -> tuple[cst.SimpleStatementLine,
                                                                                   cst.BaseExpression]:
    """(the statement line, the value) of the one assignment `variable = value` of the function around
    the call, in the block of the call's statement or one enclosing it, before that statement; Unmappable
    otherwise (what the variable holds is known only when it runs)."""
    scopes, name = facts.scopes, variable.value
    used_in = scopes.scope_of.get(variable, scopes.module)
    scope = scopes.defining_scope(name, used_in)
    unknown = (f"attn_bias `{name}` is a variable that may hold a mask object or a tensor, which one is known only "
               "when it runs")
    if scope is not used_in or not isinstance(scope, cst.FunctionDef):
        raise Unmappable(f"{unknown}: it is not assigned in the function around the call")
    if name in scopes.parameters.get(scope, ()):
        raise Unmappable(f"{unknown}: it is a parameter of `{scope.name.value}`")
    if scopes.binding_count(name, scope) != 1 or not isinstance(scope.body, cst.IndentedBlock):
        raise Unmappable(f"{unknown}: it is bound more than once in `{scope.name.value}`")
    call_start = facts.span(call)[0]
    for line, block in statement_lines(scope.body.body):
        for statement in line.body:
            if isinstance(statement, cst.Assign) and len(statement.targets) == 1 \
                    and isinstance(statement.targets[0].target, cst.Name) and statement.targets[0].target.value == name:
                after = block[block.index(line) + 1:]
                if any(facts.span(later)[0] <= call_start < facts.span(later)[1] for later in after) \
                        and len(line.body) == 1:
                    return line, statement.value
    raise Unmappable(f"{unknown}: its one assignment in `{scope.name.value}` is not a statement of its own before "
                     "the call in the call's block or one enclosing it")


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
