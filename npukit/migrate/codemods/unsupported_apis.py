"""torch APIs on Ascend's list of what torch_npu does not support."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.cuda_namespace import TorchNameChains, _ast_entry, ast_chain_candidates
from npukit.migrate.rules import Flag
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS


def _unsupported_call(qualified: str | None) -> bool:
    return qualified is not None and qualified in UNSUPPORTED_TORCH_APIS and qualified not in rules.CUDA_FLAGGED


class UnsupportedApis(TorchNameChains, NpuCodemod):
    """A torch API on Ascend's published list of APIs torch_npu does not support
    (`unsupported_apis.UNSUPPORTED_TORCH_APIS`: `torch.backends.cuda.sdp_kernel`, `torch.cuda.comm.gather`,
    `torch.nn.utils.rnn.PackedSequence.is_cuda` ...) is reported where it is used, called or not,
    through any import. Not where it is only a type: `isinstance(m, X)`, `except X`, an annotation.
    (The list's Tensor methods, whose receiver a codemod cannot know, are UnsupportedTensorMethods'.)"""

    DESCRIPTION = "uses of torch APIs torch_npu does not support reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = tuple(sorted({name.rsplit(".", 1)[-1] for name in UNSUPPORTED_TORCH_APIS}))

    @classmethod
    def candidates(cls, model) -> list:
        found = [call for call in model.calls if _unsupported_call(model.qualname(call.func))]
        found += [node for node in ast_chain_candidates(model) if _ast_entry(model, node)[2] == "unsupported"]
        if any(isinstance(node, ast.Attribute) and node.attr in ("cuda", "is_cuda") and
               model.module_attribute_by_binding(node) for node in found):
            return [model.tree]  # `PackedSequence.is_cuda`: a class's attribute by the bindings that reach it
        return found

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.type_references: set[int] = set()
        self.reported: set[int] = set()  # where a finding starts: a call and its name start at one place

    def chain(self, node: cst.BaseExpression, qualified: str, kind: str) -> None:
        if kind == "unsupported":
            self._report(node, qualified)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value in ("isinstance", "issubclass"):
            positional = split_arguments(node)[0]
            if len(positional) == 2:
                self._types_in(positional[1].value, nested=False)
        qualified = self.facts.qualname(node.func)
        if _unsupported_call(qualified):
            self._report(node, qualified)

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.type is not None:
            self._types_in(node.type, nested=False)

    def visit_Annotation(self, node: cst.Annotation) -> None:
        self._types_in(node.annotation, nested=True)

    def _types_in(self, node: cst.BaseExpression, *, nested: bool) -> None:
        """Note the nodes that are only types: the expression, or a tuple's items; in an annotation,
        also what subscripts, `|` unions, tuples and attribute chains are made of."""
        self.type_references.add(id(node))
        if isinstance(node, cst.Tuple):
            for element in node.elements:
                if nested:
                    self._types_in(element.value, nested=True)
                else:
                    self.type_references.add(id(element.value))
        elif nested and isinstance(node, cst.Subscript):
            self._types_in(node.value, nested=True)
            for element in node.slice:
                if isinstance(element.slice, cst.Index):
                    self._types_in(element.slice.value, nested=True)
        elif nested and isinstance(node, cst.BinaryOperation):
            self._types_in(node.left, nested=True)
            self._types_in(node.right, nested=True)
        elif nested and isinstance(node, cst.Attribute):
            self._types_in(node.value, nested=True)

    def _report(self, node: cst.CSTNode, qualified: str) -> None:
        start = self.facts.span(node)[0]
        if id(node) in self.type_references or start in self.reported:
            return  # a type check runs the API nowhere
        self.reported.add(start)
        generic = rules.UNSUPPORTED_GENERIC
        self.flag(node, Flag("unsupported-api", generic.severity, f"{qualified}: {generic.reason}",
                             rules.UNSUPPORTED_SUGGESTIONS.get(qualified, generic.suggestion)))
