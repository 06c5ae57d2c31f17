"""NCCL process-group backend strings -> "hccl"."""

from __future__ import annotations

import ast
import re

import libcst as cst
import libcst.matchers as m

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.device_values import (
    ValuePlaces,
    backend_arguments,
    backend_literal,
    backend_literals,
    device_literals,
    is_device_like,
    source,
)
from npukit.migrate.codemods.strings import StringPlaces, literal_string
from npukit.migrate.pysource_model import last_name, string_value
from npukit.migrate.rules import Flag

_EQUALITY = (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot)
_MEMBERSHIP = (cst.In, cst.NotIn)
_DISPLAYS = (cst.List, cst.Tuple, cst.Set)

BACKEND_CHOICE = Flag(
    "backend-choice", "warning", "", "change it to 'hccl' if it names the process-group backend")
UNPLACED_BACKEND = Flag(
    "backend-string", "info", "", "change it to 'hccl' by hand if it names the process-group backend")
BACKEND_FROM = Flag(
    "backend-string", "info", "",
    "make sure it resolves to 'hccl' (argparse/config defaults of 'nccl' were rewritten)")


def _is_backend_value(node: ast.AST) -> bool:
    value = string_value(node)
    return value is not None and "nccl" in value and bool(rules.BACKEND_VALUE.match(value))


def _holds_backend(value: ast.AST) -> bool:
    """A backend string, or a conditional one of whose branches is (ast's view, for the screen)."""
    if isinstance(value, ast.IfExp):
        return _holds_backend(value.body) or _holds_backend(value.orelse)
    return _is_backend_value(value)


def _backend_arguments(model) -> list[ast.AST]:
    """The backend arguments of the file's calls (ast's view, for the screen): backend= of any
    call, init_process_group's first."""
    found = []
    for call in model.calls:
        found += [keyword.value for keyword in call.keywords if keyword.arg == "backend"]
        qualified = model.qualname(call.func)
        method = call.func.attr if isinstance(call.func, ast.Attribute) else None
        if call.args and ((qualified or "").rsplit(".", 1)[-1] or method) == "init_process_group":
            found.append(call.args[0])
    return found


class DistributedBackends(ValuePlaces, StringPlaces, NpuCodemod):
    """"nccl" (and "cuda:nccl,cpu:gloo"-style pairs) becomes "hccl" ("npu:hccl,cpu:gloo") where it
    is a process-group backend: `init_process_group("nccl")`, any `backend=` argument, a comparison
    with an expression (`backend == "nccl"`, `x in ("nccl", "gloo")`), an argparse default or
    choice, a `device.startswith(...)` choice, a dict entry or `dict(...)` keyword named like a
    backend, and a variable or attribute that is named like one or flows into a `backend=` /
    init_process_group argument in this file (`backend = "nccl"` ... `init_process_group(backend)`);
    the branches of a conditional count. Left as they are and reported: any other "nccl" (a
    warning when a CUDA availability test, which is migrated to the NPU one, picks it), and an
    init_process_group backend read from an attribute (`args.dist_backend`). Docstrings, dict keys
    and print/log/raise text are not backend values. Literals spelled with escapes are left."""

    DESCRIPTION = "'nccl' process-group backends -> 'hccl' where they are backends; the rest reported"
    RULES = ("backend-string", "backend-compare", "argparse-default", "device-compare")
    FILES_CONTAINING = ("nccl", "init_process_group")
    # a literal's place (argument, comparison, assignment, dict, conditional) is in its statement;
    # a flow between statements makes candidates() ask for the whole file
    CONTEXT = "statement"

    @classmethod
    def candidates(cls, model) -> list:
        """The backend strings, and the init_process_group backends read from an attribute; the whole
        file when a variable holding a backend string may flow into a backend argument elsewhere."""
        literals = [node for node in model.strings if id(node) not in model.docstrings and _is_backend_value(node)]
        if not literals:
            return [sink for sink in _backend_arguments(model) if isinstance(sink, ast.Attribute)]
        sinks = [value for value in _backend_arguments(model) if last_name(value) is not None]
        holders = {last_name(target) for node in model.assigns if node.value is not None and _holds_backend(node.value)
                   for target in (node.targets if isinstance(node, ast.Assign) else [node.target])}
        for function in model.functions:
            arguments = function.args
            positional = arguments.posonlyargs + arguments.args
            defaults = zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults)
            holders.update(arg.arg for arg, default in (*defaults, *zip(arguments.kwonlyargs, arguments.kw_defaults))
                           if default is not None and _holds_backend(default))
        if holders & {last_name(sink) for sink in sinks}:
            return [model.tree]
        return literals + [sink for sink in sinks if isinstance(sink, ast.Attribute)]

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.claimed: set[int] = set()  # literals rewritten (by the first rule that reaches them)
        self.strings: list[tuple[cst.BaseExpression, bool]] = []  # (literal, in message text)
        self.branch_of: dict[int, cst.IfExp] = {}  # id of a conditional's branch -> the conditional
        self.attribute_sinks: list[cst.Attribute] = []

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.branch_of[id(node.body)] = self.branch_of[id(node.orelse)] = node

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self._note_string(node)

    def visit_ConcatenatedString(self, node: cst.ConcatenatedString) -> None:
        super().visit_ConcatenatedString(node)
        self._note_string(node)

    def _note_string(self, node: cst.BaseExpression) -> None:
        if id(node) not in self._not_code and id(node) not in self._dict_keys and backend_literal(node) is not None:
            self.strings.append((node, self._text_depth > 0))

    # ------------------------------------------------------------------ decided on the whole window
    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for call in self.calls:
            self._call(call)
        for comparison in self.comparisons:
            self._comparison(comparison)
        self._assignments()
        for node, in_text in self.strings:
            if id(node) in self.claimed or in_text:
                continue
            value = literal_string(node)
            if self._chosen_by_cuda_test(node):
                self.flag(node, BACKEND_CHOICE, reason=(
                    f"'{value}' is chosen by a CUDA availability test that was migrated to NPU, so the migrated "
                    "code picks it exactly on NPU hosts (where NCCL does not exist); it was not seen flowing into "
                    "a process-group backend, so it was left unchanged"))
            else:
                self.flag(node, UNPLACED_BACKEND,
                          reason=f"'{value}' is not in a recognised backend position and was left unchanged")
        for sink in self.attribute_sinks:
            self.flag(sink, BACKEND_FROM, reason=f"the process-group backend comes from {source(sink, self.facts)}")
        return updated_node

    def _call(self, call: cst.Call) -> None:
        positional, keywords = split_arguments(call)
        method = call.func.attr.value if isinstance(call.func, cst.Attribute) else None
        values, is_init = backend_arguments(call, self.facts)
        for value in values:
            literals = backend_literals(value)
            for literal in literals:
                self._rewrite(literal, "backend-string")
            if is_init and not literals and isinstance(value, cst.Attribute) and self.facts.qualname(value) is None:
                self.attribute_sinks.append(value)
        if method == "add_argument":
            for arg in keywords:
                name = arg.keyword.value if arg.keyword is not None else None
                if name == "default":
                    literal = backend_literal(arg.value)  # a plain backend string is never a device value
                    if literal is not None:
                        self._rewrite(literal, "argparse-default")
                elif name == "choices":
                    self._rewrite_choices(arg.value, "argparse-default")
        elif method == "startswith" and positional and is_device_like(call.func.value, self.facts):
            if not positional[0].star:
                self._rewrite_choices(positional[0].value, "device-compare")
        if isinstance(call.func, cst.Name) and call.func.value == "dict":  # dict(backend="nccl")
            for arg in keywords:
                if arg.keyword is not None and "backend" in arg.keyword.value.lower():
                    for literal in backend_literals(arg.value):
                        self._rewrite(literal, "backend-string")

    def _rewrite_choices(self, expr: cst.BaseExpression, rule: str) -> None:
        items = [element.value for element in expr.elements if isinstance(element, cst.Element)] \
            if isinstance(expr, _DISPLAYS) else [expr]
        for item in items:
            if backend_literal(item) is not None:
                self._rewrite(item, rule)

    def _comparison(self, node: cst.Comparison) -> None:
        operands = [node.left, *(target.comparator for target in node.comparisons)]
        for index, target in enumerate(node.comparisons):
            left, right = operands[index], operands[index + 1]
            if isinstance(target.operator, _EQUALITY):
                for const, other in ((left, right), (right, left)):
                    if backend_literal(const) is not None and literal_string(other) is None:
                        self._rewrite(const, "backend-compare")
            elif isinstance(target.operator, _MEMBERSHIP) and isinstance(right, _DISPLAYS):
                for element in right.elements:
                    if isinstance(element, cst.Element) and backend_literal(element.value) is not None:
                        self._rewrite(element.value, "backend-compare")

    def _assignments(self) -> None:
        """Variables and attributes holding a backend string: rewritten when named like a backend or
        seen flowing into a backend argument; dict entries keyed like a backend."""
        bound, keyed = self.bound_values()
        for binder, name, value in bound:
            literals = backend_literals(value)
            if not literals or device_literals(value, self.facts):
                continue  # a device value ("cuda" if x else "nccl"): the device rules' business
            if "backend" in name.lower() or self.facts.flows.key(binder, name) in self.facts.flows.backend:
                for literal in literals:
                    self._rewrite(literal, "backend-string")
        for key, value in keyed:  # {"backend": "nccl"}, kwargs["dist_backend"] = "nccl"
            key_text = literal_string(key)
            if key_text is not None and "device" not in key_text.lower() and "backend" in key_text.lower():
                for literal in backend_literals(value):
                    self._rewrite(literal, "backend-string")

    def _chosen_by_cuda_test(self, node: cst.BaseExpression) -> bool:
        """A branch of a conditional expression whose test calls torch.cuda.is_available() (nested
        conditionals too)."""
        conditional = self.branch_of.get(id(node))
        while conditional is not None:
            if any(self.facts.qualname(call.func) == "torch.cuda.is_available"
                   for call in m.findall(conditional.test, m.Call())):
                return True
            conditional = self.branch_of.get(id(conditional))
        return False

    def _rewrite(self, literal: cst.BaseExpression, rule: str) -> None:
        """The whole literal's value as a backend, prefix and quotes kept; a literal spelled with
        escapes or over adjacent literals is left (the audit or the strings' report names it)."""
        if id(literal) in self.claimed or not isinstance(literal, cst.SimpleString):
            return
        value = literal.evaluated_value
        if literal.raw_value != value or "\\" in value:
            return
        self.claimed.add(id(literal))
        new = re.sub(r"\bnccl\b", "hccl", re.sub(r"\bcuda\b", "npu", value))
        self.replace_with_text(literal, f"{literal.prefix}{literal.quote}{new}{literal.quote}", rule)
