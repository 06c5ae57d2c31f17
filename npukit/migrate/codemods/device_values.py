"""What makes an expression a CUDA device or an NCCL backend value, for the codemods that read them."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import FileFacts, called_name, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import string_value

_CONSTANT_NAMES = frozenset({"None", "True", "False"})


def device_literals(expr: cst.BaseExpression, facts: FileFacts) -> list[cst.BaseExpression]:
    """The literals that make `expr` a CUDA device value ("cuda", f"cuda:{i}", "cuda:%d" % i,
    "cuda:{}".format(i), and the branches of a conditional or a boolean operation)."""
    value = literal_string(expr)
    if value is not None:
        return [expr] if rules.DEVICE_TEMPLATE.match(value) else []
    if isinstance(expr, (cst.FormattedString, cst.ConcatenatedString)):
        return [expr] if _formatted_device(expr, facts) else []
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Modulo, cst.Add)):
        left = expr.left
        while isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Add):
            left = left.left
        value = literal_string(left)
        if value is not None and rules.DEVICE_TEMPLATE.match(value) and (value != "cuda" or isinstance(expr.operator, cst.Modulo)):
            return [left]
        return []
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "format":
        value = literal_string(expr.func.value)
        return [expr.func.value] if value is not None and rules.DEVICE_TEMPLATE.match(value) else []
    if isinstance(expr, cst.IfExp):
        return device_literals(expr.body, facts) + device_literals(expr.orelse, facts)
    if isinstance(expr, cst.BooleanOperation):
        return device_literals(expr.left, facts) + device_literals(expr.right, facts)
    return []


def _formatted_device(expr: cst.FormattedString | cst.ConcatenatedString, facts: FileFacts) -> bool:
    """An f-string (or adjacent literals holding one) that is "cuda" or "cuda:" and placeholders
    only: its parts as Python joins them (ast's JoinedStr), from the literal's own text."""
    start, end = facts.span(expr)
    joined = ast.parse(f"({facts.positions.text[start:end]})", mode="eval").body
    if not isinstance(joined, ast.JoinedStr) or not joined.values:
        return False
    first = string_value(joined.values[0])
    return first is not None and bool(rules.DEVICE_TEMPLATE.match(first)) and all(
        isinstance(part, ast.FormattedValue) for part in joined.values[1:]) and (len(joined.values) == 1 or first.endswith(":"))


def backend_literal(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """`expr` itself when it is an NCCL backend string ("nccl", "cuda:nccl,cpu:gloo")."""
    value = literal_string(expr)
    return expr if value is not None and rules.BACKEND_VALUE.match(value) and "nccl" in value else None


def backend_literals(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The NCCL backend strings an expression can evaluate to: the literal itself, or the branches of
    a conditional (`"gloo" if not torch.cuda.is_available() else "nccl"`), nested ones included."""
    if isinstance(expr, cst.IfExp):
        return backend_literals(expr.body) + backend_literals(expr.orelse)
    literal = backend_literal(expr)
    return [literal] if literal is not None else []


def is_device_like(expr: cst.BaseExpression, facts: FileFacts) -> bool:
    """An expression that evidently holds a device or device type (x.device.type, args.device ...)."""
    if isinstance(expr, cst.Call):
        name = called_name(expr.func)
        positional = split_arguments(expr)[0]
        if name in ("str", "repr") and positional:
            return not positional[0].star and is_device_like(positional[0].value, facts)
        return name in ("get_device_type", "get_backend")
    name = variable_name(expr)
    if name is None:
        return False
    lowered = name.lower()
    return "device" in lowered or lowered in ("dev", "type", "accelerator") or \
        facts.qualname(expr) is None and lowered.endswith("_dev")


def variable_name(expr: cst.BaseExpression) -> str | None:
    """The last name of a name or attribute (ast's: None, True and False are constants)."""
    if isinstance(expr, cst.Name):
        return None if expr.value in _CONSTANT_NAMES else expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    return None
