"""A CUDA tensor type made the default, and the legacy constructors that followed it."""

from __future__ import annotations

import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, called_name
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import newline_of
from npukit.migrate.rules import Flag

_CUDA_TENSOR_TYPE = re.compile(r"torch\.cuda\.(Float|Half|BFloat16|Double)Tensor")
_DTYPES = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64"}
_SET_DEFAULT = "torch.set_default_tensor_type"


def default_dtype(tensor_type: str | None) -> str | None:
    """`torch.cuda.HalfTensor` -> float16: the dtype a CUDA default tensor type stands for."""
    match = _CUDA_TENSOR_TYPE.fullmatch(tensor_type or "")
    return _DTYPES[match.group(1)] if match else None


class DefaultTensorType(NpuCodemod):
    """`torch.set_default_tensor_type(torch.cuda.HalfTensor)` (the type by name or as a string; Float,
    Half, BFloat16 or Double), a statement on its own line, becomes
    `torch.set_default_device("npu")` + `torch.set_default_dtype(torch.float16)` on two lines:
    torch_npu has no NPU default tensor type. (Where the file neither imports torch nor names it in
    that statement, `torch` would be a new name: the call is reported instead.) It is reported too: legacy constructors
    (`torch.Tensor(4, 4)`) follow no default device and now make CPU tensors; so is each legacy
    constructor call with arguments in a file that sets a default tensor type, or anywhere in a tree
    where a file made a CUDA type the default (npu-migrate's tree facts)."""

    DESCRIPTION = "set_default_tensor_type(torch.cuda.XTensor) -> set_default_device('npu') + set_default_dtype"
    RULES = ("default-tensor-type",)
    FILES_CONTAINING = ("set_default_tensor_type", "Tensor(")

    @classmethod
    def candidates(cls, model) -> list:
        legacy = model.facts.cuda_default_tensor_type or "set_default_tensor_type" in model.text
        return [call for call in model.calls if model.qualname(call.func) == _SET_DEFAULT or (
            legacy and model.qualname(call.func) in rules.LEGACY_CONSTRUCTORS and (call.args or call.keywords))]

    def visit_Expr(self, node: cst.Expr) -> None:
        call = node.value
        if not (isinstance(call, cst.Call) and self.facts.qualname(call.func) == _SET_DEFAULT and len(call.args) == 1
                and not call.args[0].keyword and not call.args[0].star):
            return
        arg = call.args[0].value
        dtype = default_dtype(self.facts.qualname(arg) or literal_string(arg))
        torch = self.facts.torch_alias
        start, _ = self.facts.span(node)
        text = self.facts.positions.text
        indent = text[self.facts.positions.line_starts[self.facts.line_col(start)[0] - 1]:start]
        if dtype is None or torch is None or indent.strip():
            return
        self.claim(arg)  # the tensor type: no other rule renames or reports it
        if not self.facts.names_torch(node):
            # `torch` would be a new name here (the call made through `from torch import ...`)
            self.flag(call, Flag("default-tensor-type", "warning",
                                 "a CUDA default tensor type set where torch itself is not imported: not rewritten",
                                 f"import torch, then torch.set_default_device('npu') and "
                                 f"torch.set_default_dtype(torch.{dtype})"))
            return
        self.replace_with_text(node, f'{torch}.set_default_device("npu"){newline_of(text)}{indent}'
                                     f'{torch}.set_default_dtype({torch}.{dtype})', "default-tensor-type")
        self.flag(call, rules.LEGACY_CONSTRUCTOR_DEFAULT)
        if dtype == "float64":
            self.flag(call, rules.RENAME_NOTES["torch.cuda.DoubleTensor"])

    def visit_Call(self, node: cst.Call) -> None:
        if called_name(node.func) in _LEGACY_NAMES and node.args and \
                self.facts.qualname(node.func) in rules.LEGACY_CONSTRUCTORS and \
                (self.facts.tree.cuda_default_tensor_type or "set_default_tensor_type" in self.facts.positions.text):
            self.flag(node, rules.LEGACY_CONSTRUCTOR_CALL)


_LEGACY_NAMES = frozenset(name.rsplit(".", 1)[1] for name in rules.LEGACY_CONSTRUCTORS)
