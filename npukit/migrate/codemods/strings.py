"""Where a string literal is, as the codemods that read strings need it: code or a docstring, a
value of its own or a part of a larger literal, a dict key, message text."""

from __future__ import annotations

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import called_name

STRINGS = (cst.SimpleString, cst.ConcatenatedString)


def literal_string(node: cst.BaseExpression) -> str | None:
    """The str a literal evaluates to, ast's Constant value: adjacent literals joined; None for
    bytes, f-strings (or a concatenation holding one) and anything else."""
    value = node.evaluated_value if isinstance(node, STRINGS) else None
    return value if isinstance(value, str) else None


class StringPlaces:
    """visit_ methods noting where the strings of a module are, for a codemod mixing it in:
    `_not_code` (docstrings, the parts of adjacent literals and `f"{'...'}"`: the outermost literal
    is the unit), `_dict_keys`, and `_text_depth` (above 0 inside a print/log call or a raise, where
    a string is a message)."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self._not_code: set[int] = set()
        self._dict_keys: set[int] = set()
        self._text_depth = 0

    def _note_docstring(self, body: cst.BaseSuite | tuple) -> None:
        statements = body if isinstance(body, tuple) else body.body
        first = statements[0] if statements else None
        if isinstance(first, cst.SimpleStatementLine):
            first = first.body[0]
        if isinstance(first, cst.Expr) and literal_string(first.value) is not None:
            self._not_code.add(id(first.value))

    def visit_Module(self, node: cst.Module) -> None:
        self._note_docstring(tuple(node.body))

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._note_docstring(node.body)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._note_docstring(node.body)

    def visit_ConcatenatedString(self, node: cst.ConcatenatedString) -> None:
        self._not_code.update((id(node.left), id(node.right)))

    def visit_FormattedStringExpression(self, node: cst.FormattedStringExpression) -> None:
        if isinstance(node.expression, STRINGS):
            self._not_code.add(id(node.expression))

    def visit_DictElement(self, node: cst.DictElement) -> None:
        self._dict_keys.add(id(node.key))

    def visit_Call(self, node: cst.Call) -> None:
        if called_name(node.func) in rules.LOG_CALLS:
            self._text_depth += 1

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if called_name(original_node.func) in rules.LOG_CALLS:
            self._text_depth -= 1
        return updated_node

    def visit_Raise(self, node: cst.Raise) -> None:
        self._text_depth += 1

    def leave_Raise(self, original_node: cst.Raise, updated_node: cst.Raise) -> cst.Raise:
        self._text_depth -= 1
        return updated_node
