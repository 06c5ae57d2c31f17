"""Tensor methods torch_npu does not support."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.rules import Flag


class UnsupportedTensorMethods(NpuCodemod):
    """A call of a method that Ascend's list says torch_npu does not support for tensors
    (`x.to_sparse()`, `x.unique_consecutive()`, `q.int_repr()` ... `rules.UNSUPPORTED_TENSOR_METHODS`) is
    reported when the receiver is not a module or class the imports name (then it is the torch API
    rules' business): the receiver is probably a tensor, which is all a codemod can tell."""

    DESCRIPTION = "calls of tensor methods torch_npu does not support reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = tuple(sorted(rules.UNSUPPORTED_TENSOR_METHODS))

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if isinstance(call.func, ast.Attribute)
                and call.func.attr in rules.UNSUPPORTED_TENSOR_METHODS and model.qualname(call.func) is None]

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in rules.UNSUPPORTED_TENSOR_METHODS and \
                self.facts.qualname(func) is None:
            self.flag(node, Flag("unsupported-api", "warning",
                                 f"Tensor.{func.attr.value} is not supported by torch_npu (if the receiver is a tensor)",
                                 rules.UNSUPPORTED_GENERIC.suggestion))
