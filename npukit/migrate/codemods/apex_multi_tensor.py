"""apex's multi-tensor kernels (amp_C) called through multi_tensor_applier -> torch (npu-migrate --fused).

`multi_tensor_applier(op, overflow_buf, tensor_lists, *args)` runs `op(chunk_size, overflow_buf,
tensor_lists, *args)`, one CUDA launch over every tensor of the lists (apex csrc/multi_tensor_*.cu):
- `amp_C.multi_tensor_l2norm, buf, [tensors], per_tensor=False` returns (the total L2 norm as a
  1-element fp32 tensor, an empty fp32 tensor), the squares accumulated in fp32 whatever the tensors'
  dtype -> `(torch.nn.utils.get_total_norm([torch.linalg.vector_norm(t, dtype=torch.float32) for t in
  tensors]).reshape(1), torch.empty(0, device=tensors[0].device))`. get_total_norm alone computes each
  tensor's norm in the tensor's own dtype (a bf16 gradient's norm rounded to bf16): the per-tensor norms
  are given to it in fp32, written with torch.linalg.vector_norm(dtype=float32), torch's public
  fp32-accumulating norm;
- `amp_C.multi_tensor_scale, buf, [src, dst], scale` writes dst = src * scale (the product in fp32,
  rounded once to dst's dtype). torch has no public multi-tensor scale or copy, so the rewrite calls the
  foreach kernels torch's own optimizers and clip_grads_with_norm_ use: `torch._foreach_mul_(grads,
  scale)` when src and dst are the same list (Megatron's clipping), `torch._foreach_copy_(dst, src)`
  for a literal scale of 1 (a copy), else `torch._foreach_copy_(dst, torch._foreach_mul([t.float() for t
  in src], scale))`;
- `amp_C.multi_tensor_axpby, buf, [x, y, out], a, b, arg_to_check` writes out = a * x + b * y in fp32
  -> `torch._foreach_copy_(out, torch._foreach_add(torch._foreach_mul([t.float() for t in x], a),
  [t.float() for t in y], alpha=b))`.
The overflow buffer: the kernels set it to 1 when they see a non-finite value (scale and axpby: in the
inputs arg_to_check names; l2norm: a non-finite sum of squares). A buffer nothing can read after the
call (an expression made in the call, or a function's local variable used only as this argument and
reset with fill_/zero_, as Megatron's dummy_overflow_buf) is dropped; any other (an attribute, a
parameter, a variable read elsewhere) keeps its meaning: scale and axpby are preceded by
`buf.masked_fill_(~torch.stack([t.isfinite().all() for t in inputs]).all(), 1)`, and l2norm is kept
(an expression cannot both return the norm and test it). Kept, with the reason: a kernel chosen in a
variable (Megatron's `l2_norm_impl`), the optimizer kernels (multi_tensor_adam, _lamb, _sgd, ...),
l2norm's per_tensor=True, tensor lists that are not written as a list in the call.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as matchers

from npukit.migrate.codemods.base import FileFacts, split_arguments
from npukit.migrate.codemods.fused import (
    NOT_LITERAL,
    FusedCodemod,
    FusedPlan,
    Unmappable,
    call_text,
    is_pure,
    literal,
    source,
    spell,
)

_APPLIER = ("op", "noop_flag_buffer", "tensor_lists")
# the kernels the rewrite maps: name -> (the tensor lists, the op's own arguments: (name, default))
_MAPPED = {
    "multi_tensor_l2norm": (("tensors",), (("per_tensor", False),)),
    "multi_tensor_scale": (("src", "dst"), (("scale", None),)),
    "multi_tensor_axpby": (("x", "y", "out"), (("a", None), ("b", None), ("arg_to_check", None))),
}
_OPTIMIZER_KERNELS = ("multi_tensor_adam", "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
                      "multi_tensor_lamb", "multi_tensor_lamb_mp", "multi_tensor_lamb_stage1_cuda",
                      "multi_tensor_lamb_stage2_cuda", "multi_tensor_sgd", "multi_tensor_adagrad",
                      "multi_tensor_novograd")
_RESETS = ("fill_", "zero_")  # what a dummy buffer may be called with and still be unread


def _unmapped_kernel(name: str) -> str:
    if name in _OPTIMIZER_KERNELS:
        return (f"amp_C.{name} is an optimizer step whose hyperparameters and mode flags are positional: use the "
                "torch.optim optimizer it implements (torch.optim.Adam / AdamW / SGD / Adagrad with foreach=True), "
                "or apex's FusedAdam / FusedSGD, which --fused rewrites")
    return (f"amp_C.{name} is not mapped (--fused maps multi_tensor_l2norm, multi_tensor_scale and "
            "multi_tensor_axpby)")


def _buffer_unread(buffer: cst.BaseExpression, facts: FileFacts) -> bool:
    """Nothing can read the overflow buffer after the call: an expression made in it (`torch.tensor([0])`),
    or a function's local variable read only as an applier's buffer argument or to reset it."""
    if isinstance(buffer, cst.Call):
        return True
    if not isinstance(buffer, cst.Name):
        return False
    scopes, name = facts.scopes, buffer.value
    scope = scopes.defining_scope(name, scopes.scope_of[buffer])
    if not isinstance(scope, (cst.FunctionDef, cst.Lambda)) or name in scopes.parameters.get(scope, ()):
        return False
    harmless: set[int] = set()
    for call in matchers.findall(facts.module, matchers.Call()):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in _RESETS:
            harmless.add(id(call.func.value))
        elif facts.qualname(call.func) in ApexMultiTensorToTorch.TARGETS and len(call.args) > 1:
            harmless.add(id(call.args[1].value))
    return all(id(read) in harmless for read in scopes.reads.get(name, ())
               if scopes.defining_scope(name, scopes.scope_of[read]) is scope)


class ApexMultiTensorToTorch(FusedCodemod):
    """`multi_tensor_applier(amp_C.multi_tensor_l2norm / multi_tensor_scale / multi_tensor_axpby, ...)`
    (apex.multi_tensor_apply) becomes the torch code computing the same (the module docstring says how,
    and when the overflow buffer is kept); the optimizer kernels and a kernel chosen in a variable stay,
    with the reason. Under `npu-migrate --fused`."""

    DESCRIPTION = ("apex multi_tensor_applier(amp_C.multi_tensor_l2norm / _scale / _axpby) -> "
                   "torch.nn.utils.get_total_norm / torch._foreach_*")
    RULES = ("fused-multi-tensor", "fused-import")
    RULE = "fused-multi-tensor"
    NEEDS_TORCH_NPU = False
    LIBRARY = "apex"
    ALSO_REMOVES = ("amp_C",)
    FILES_CONTAINING = ("amp_C",)
    TARGETS = {"apex.multi_tensor_apply.multi_tensor_applier": "multi_tensor_applier"}

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        positional, keywords = split_arguments(call)
        if any(arg.star for arg in call.args) or any(arg.keyword.value not in _APPLIER for arg in keywords):
            raise Unmappable("multi_tensor_applier's arguments are unpacked or named unusually: which value goes to "
                             "which parameter cannot be seen")
        bound = {name: arg.value for name, arg in zip(_APPLIER, positional)}
        bound.update((arg.keyword.value, arg.value) for arg in keywords)
        extra = [arg.value for arg in positional[len(_APPLIER):]]
        if any(name not in bound for name in _APPLIER):
            raise Unmappable("multi_tensor_applier is not given op, noop_flag_buffer and tensor_lists")
        op = bound["op"]
        kernel = facts.qualname(op) or ""
        module, _, name = kernel.rpartition(".")
        if module != "amp_C":
            raise Unmappable(f"the kernel `{source(op, facts)}` is not one of amp_C's written in the call (a variable "
                             "chosen when the code runs, as Megatron's l2_norm_impl): rewrite the call where the "
                             "kernel is chosen, or write amp_C.multi_tensor_l2norm / _scale in it")
        if name not in _MAPPED:
            raise Unmappable(_unmapped_kernel(name))
        list_names, option_names = _MAPPED[name]
        lists = bound["tensor_lists"]
        if not isinstance(lists, cst.List) or len(lists.elements) != len(list_names) or \
                any(isinstance(element, cst.StarredElement) for element in lists.elements):
            raise Unmappable(f"amp_C.{name} takes {len(list_names)} tensor list(s) ({', '.join(list_names)}), "
                             f"here `{source(lists, facts)}`: write them as a list in the call")
        tensors = dict(zip(list_names, (element.value for element in lists.elements)))
        if len(extra) > len(option_names):
            raise Unmappable(f"amp_C.{name} is given {len(extra)} arguments after the tensor lists, more than its "
                             f"{len(option_names)}")
        options = {option: extra[index] if index < len(extra) else default
                   for index, (option, default) in enumerate(option_names)}
        if any(value is None for value in options.values()):
            raise Unmappable(f"amp_C.{name} is not given {', '.join(o for o, v in options.items() if v is None)}")
        torch = spell("torch", call, facts)
        if torch is None:
            raise Unmappable("the file does not import torch, which the rewrite calls")
        buffer = bound["noop_flag_buffer"]
        unread = _buffer_unread(buffer, facts)
        dropped = (op, buffer) if unread else (op,)
        function, arguments, about = _REWRITES[name](tensors, options, buffer if not unread else None, torch, facts)
        return FusedPlan(call_text(function, arguments, call, facts), about, dropped)


def _fp32(tensors: str) -> str:
    return f"[t.float() for t in {tensors}]"


def _flagged(buffer: cst.BaseExpression | None, checked: list[cst.BaseExpression], function: str,
             arguments: list[str], torch: str, facts: FileFacts) -> tuple[str, list[str]]:
    """The rewrite (a call: function, arguments) preceded by the overflow buffer's update (set to 1 when
    an input tensor holds a non-finite value), as the kernel does: a tuple of the two; the call alone
    when nothing reads the buffer."""
    if buffer is None:
        return function, arguments
    for node in (buffer, *checked):
        if not is_pure(node):
            raise Unmappable(f"`{source(node, facts)}` is computed in the call and the overflow buffer is read "
                             "afterwards: the rewrite reads it twice (the finite check, the kernel's work); assign "
                             "it to a variable first")
    inputs = source(checked[0], facts) if len(checked) == 1 else \
        "(" + ", ".join(f"*{source(node, facts)}" for node in checked) + ")"
    finite = f"{torch}.stack([t.isfinite().all() for t in {inputs}]).all()"
    return "", [f"{source(buffer, facts)}.masked_fill_(~{finite}, 1)", f"{function}({', '.join(arguments)})"]


def _l2norm(tensors, options, buffer, torch, facts):
    per_tensor = options["per_tensor"] if options["per_tensor"] is False else literal(options["per_tensor"], facts)
    if per_tensor is NOT_LITERAL or per_tensor:
        raise Unmappable("per_tensor is not False: the per-tensor norms and their total would be two expressions "
                         "over one computation; write `norms = torch.stack([torch.linalg.vector_norm(t, dtype="
                         "torch.float32) for t in tensors])` and `torch.linalg.vector_norm(norms).reshape(1)`")
    if buffer is not None:
        raise Unmappable(f"its overflow buffer `{source(buffer, facts)}` may be read after the call (it is not a "
                         "local variable used only here): multi_tensor_l2norm sets it when the norm is not finite, "
                         "which one expression cannot both return and test; write `norm = torch.nn.utils."
                         "get_total_norm(...)` and `buf.masked_fill_(~norm.isfinite(), 1)`")
    listed = tensors["tensors"]
    if not is_pure(listed):
        raise Unmappable(f"the tensor list `{source(listed, facts)}` is computed in the call: the rewrite reads it "
                         "twice (the norms, the empty per-tensor result's device); assign it to a variable first")
    text = source(listed, facts)
    norms = f"[{torch}.linalg.vector_norm(t, dtype={torch}.float32) for t in {text}]"
    total = f"{torch}.nn.utils.get_total_norm({norms}).reshape(1)"
    return "", [total, f"{torch}.empty(0, device={text}[0].device)"], \
        "torch.nn.utils.get_total_norm over fp32 per-tensor norms (1-element fp32 total, empty per-tensor norms)"


def _scale(tensors, options, buffer, torch, facts):
    src, dst, scale = tensors["src"], tensors["dst"], options["scale"]
    source_text, target_text = source(src, facts), source(dst, facts)
    if source_text == target_text:
        if not is_pure(src):
            raise Unmappable(f"src and dst `{source_text}` are computed in the call: assign the list to a variable first")
        function, arguments = f"{torch}._foreach_mul_", [source_text, source(scale, facts)]
    elif literal(scale, facts) == 1:
        function, arguments = f"{torch}._foreach_copy_", [target_text, source_text]
    else:
        product = f"{torch}._foreach_mul({_fp32(source_text)}, {source(scale, facts)})"
        function, arguments = f"{torch}._foreach_copy_", [target_text, product]
    return *_flagged(buffer, [src], function, arguments, torch, facts), \
        "torch._foreach_mul_ / torch._foreach_copy_ (torch has no public multi-tensor scale)"


def _axpby(tensors, options, buffer, torch, facts):
    x, y, out = (source(tensors[name], facts) for name in ("x", "y", "out"))
    a, b = source(options["a"], facts), source(options["b"], facts)
    combined = f"{torch}._foreach_add({torch}._foreach_mul({_fp32(x)}, {a}), {_fp32(y)}, alpha={b})"
    checked = []
    if buffer is not None:
        which = literal(options["arg_to_check"], facts)
        if which not in (-1, 0, 1):
            raise Unmappable(f"arg_to_check `{source(options['arg_to_check'], facts)}` is not -1, 0 or 1 written in "
                             "the call: it says which inputs the overflow check reads")
        checked = [tensors["x"], tensors["y"]] if which == -1 else [tensors["x" if which == 0 else "y"]]
    return *_flagged(buffer, checked, f"{torch}._foreach_copy_", [out, combined], torch, facts), \
        "torch._foreach_mul / _foreach_add / _foreach_copy_ (torch has no public multi-tensor axpby)"


_REWRITES = {"multi_tensor_l2norm": _l2norm, "multi_tensor_scale": _scale, "multi_tensor_axpby": _axpby}
