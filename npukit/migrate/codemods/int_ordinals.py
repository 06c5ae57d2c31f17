"""Int device ordinals (`.to(0)`, `device=local_rank`, `torch.device(rank)`) -> NPU devices."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.device_values import device_positions, is_int_ordinal, source
from npukit.migrate.pysource_model import last_name


def _may_be_ordinal(expr: ast.AST) -> bool:
    """What is_int_ordinal could say yes to (ast's view, for the screen)."""
    if isinstance(expr, ast.Constant):
        return type(expr.value) is int
    if isinstance(expr, ast.Call):
        return isinstance(expr.func, ast.Name) and expr.func.id == "int"
    return last_name(expr) in rules.INT_ORDINAL_NAMES


class IntDeviceOrdinals(NpuCodemod):
    """An int standing for a GPU where a device is expected becomes an NPU device: `x.to(0)` ->
    `x.to("npu:0")`, `device=local_rank` -> `device=f"npu:{local_rank}"` (a value's `.to()` /
    `.to_empty()` and `device=` keywords: there a bare int means the current CUDA device type), and
    `torch.device(local_rank)` -> `torch.device("npu", local_rank)`. An ordinal is a literal int,
    `int(...)` or a name or attribute named like one (`rank`, `local_rank`, `args.gpu` ...:
    rules.INT_ORDINAL_NAMES) that is not an import. Code an f-string cannot hold is left."""

    DESCRIPTION = "int device ordinals (.to(0), device=local_rank, torch.device(rank)) -> NPU devices"
    RULES = ("int-ordinal",)
    FILES_CONTAINING = (".to", "device")

    @classmethod
    def candidates(cls, model) -> list:
        found = []
        for call in model.calls:
            func = call.func
            if any(keyword.arg == "device" and _may_be_ordinal(keyword.value) for keyword in call.keywords) or \
                    call.args and _may_be_ordinal(call.args[0]) and (
                        isinstance(func, ast.Attribute) and func.attr in rules.DEVICE_FIRST_ARG_METHODS or
                        len(call.args) == 1 and model.qualname(func) == "torch.device"):
                found.append(call)
        return found

    def visit_Call(self, node: cst.Call) -> None:
        positional = split_arguments(node)[0]
        if len(positional) == 1 and not positional[0].star and self.facts.qualname(node.func) == "torch.device" and \
                not isinstance(positional[0].value, cst.Integer) and is_int_ordinal(positional[0].value, self.facts):
            self.insert_first_argument(node, '"npu"', "int-ordinal")
        for expr, ints_allowed in device_positions(node, self.facts):
            if ints_allowed and is_int_ordinal(expr, self.facts):
                self._rewrite(expr)

    def _rewrite(self, expr: cst.BaseExpression) -> None:
        if isinstance(expr, cst.Integer):
            self.replace_with_text(expr, f'"npu:{expr.evaluated_value}"', "int-ordinal")
            return
        text = source(expr, self.facts)
        quote = '"' if '"' not in text else "'"
        if quote not in text and "\n" not in text:
            self.replace_with_text(expr, f"f{quote}npu:{{{text}}}{quote}", "int-ordinal")
