"""CUDA device strings -> "npu" where they are device uses; the other "cuda" strings reported."""

from __future__ import annotations

import ast
import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, _children, split_arguments
from npukit.migrate.codemods.device_values import (
    ValuePlaces,
    device_literals,
    device_positions,
    device_signatures,
    is_device_like,
    source,
    variable_name,
)
from npukit.migrate.codemods.strings import StringPlaces, literal_string
from npukit.migrate.pysource_model import last_name, string_value
from npukit.migrate.rules import Flag

_STRING_HEAD = re.compile(r"([A-Za-z]*)('''|\"\"\"|'|\")")
_EQUALITY = (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot)
_MEMBERSHIP = (cst.In, cst.NotIn)
_DISPLAYS = (cst.List, cst.Tuple, cst.Set)
_STAR_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\w+)[\w.]*[ \t]+import[ \t]+\*", re.MULTILINE)
_STATEMENTS = (cst.BaseSmallStatement, cst.BaseCompoundStatement)

UNPLACED_DEVICE = Flag("device-string", "info", "", "change it to 'npu' by hand if it names the device")
# a device string given to a function whose parameters npu-migrate cannot read (a library's): it
# most likely is a device there, so it needs a look (counted in the estimate), not only a note
PASSED_DEVICE = Flag("device-string", "warning", "",
                     "if that function uses it as a device (most do), change it to 'npu' by hand")
UNUSED_DEVICE = Flag("device-string", "info", "", "if it is a device, change it to 'npu' by hand")
CUDA_ONLY_DEVICE = Flag(
    "cuda-only-device", "warning", "",
    "on an NPU host run that library on the CPU (e.g. 'cpu'), or keep that part on a CUDA host; see the "
    "cuda-only-library finding at its import")


def _device_named(name: str) -> bool:
    lowered = name.lower()
    return "device" in lowered or lowered in ("dev", "accelerator") or lowered.endswith("_dev")


def _is_device_text(node: ast.AST) -> bool:
    """A literal that may be (the start of) a device value (ast's view, for the screen)."""
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and (string_value(node.values[0]) or "").startswith("cuda")
    value = string_value(node)
    return value is not None and bool(rules.DEVICE_TEMPLATE.match(value))


def _holds_device(expr: ast.AST, literals: set[int]) -> bool:
    """Whether one of `literals` (ids) may make `expr` a device value: the value itself, or reached
    through conditionals, boolean operators, the left of `%` / `+` and a `.format` receiver (ast's
    view of device_literals, for the screen)."""
    if id(expr) in literals:
        return True
    if isinstance(expr, ast.IfExp):
        return _holds_device(expr.body, literals) or _holds_device(expr.orelse, literals)
    if isinstance(expr, ast.BoolOp):
        return any(_holds_device(value, literals) for value in expr.values)
    if isinstance(expr, ast.BinOp):
        return _holds_device(expr.left, literals)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        return expr.func.attr == "format" and _holds_device(expr.func.value, literals)
    return False


class DeviceStrings(ValuePlaces, StringPlaces, NpuCodemod):
    """"cuda" (and "cuda:0", f"cuda:{rank}", "cuda:%d" % i, "cuda:{}".format(i)) becomes "npu"
    where it is a device use: a device argument (device_positions: `torch.device(...)`, `device=`,
    `.to(...)`, `map_location=` and the entries of a map_location dict, torch.cuda.X(device), the
    device parameters of the tree's own functions, classes and methods ...), a comparison or membership test with an expression that holds a device
    (`x.device.type == "cuda"`), a value's `.startswith(...)`, an argparse default or choice, a
    conditional on `torch.cuda.is_available()`, a variable, attribute or parameter default named like
    a device or flowing into a device use in this file (FileFacts.flows), a dict entry or item keyed
    like a device; a "cuda:..." text anywhere in code names a device by itself. Prefixes and quotes
    are kept. Left as they are and reported: a bare "cuda" seen nowhere near a device use (a
    warning when it is passed to a function npu-migrate cannot read, e.g. a library's), and a
    device string meant for a CUDA-only library the file imports (Isaac Gym's sim_device ...).
    Docstrings, dict keys and print/log/raise text are not device values; literals spelled with
    escapes are left."""

    DESCRIPTION = "'cuda' device strings -> 'npu' where they are device uses; the rest reported"
    RULES = ("device-string", "device-variable", "device-compare", "argparse-default")
    FILES_CONTAINING = ("cuda",)

    @classmethod
    def candidates(cls, model) -> list:
        """The device literals; the whole file when a variable holding one may flow into a device use
        in another statement, or one may be passed to a function of the file with a device parameter."""
        literals = [node for node in (*model.strings, *model.fstrings)
                    if id(node) not in model.docstrings and _is_device_text(node)]
        if not literals:
            return []
        inside = {id(node) for node in literals}
        holders = set()  # names not named like a device given a device value: they need the flows
        for node in model.assigns:
            if node.value is not None and _holds_device(node.value, inside):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                holders.update(name for name in map(last_name, targets) if name and not _device_named(name))
        for function in model.functions:
            arguments = function.args
            positional = arguments.posonlyargs + arguments.args
            defaults = [*zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults),
                        *zip(arguments.kwonlyargs, arguments.kw_defaults)]
            holders.update(arg.arg for arg, default in defaults
                           if default is not None and not _device_named(arg.arg) and _holds_device(default, inside))
        signatures = {**model.facts.device_signatures, **device_signatures(model.text)}
        for call in model.calls:
            sinks = [keyword.value for keyword in call.keywords if keyword.arg and rules.DEVICE_KEYWORD.match(keyword.arg)]
            callee = call.func.id if isinstance(call.func, ast.Name) else \
                call.func.attr if isinstance(call.func, ast.Attribute) else None
            if any(signatures.get(callee, ())):
                if any(_holds_device(arg, inside) for arg in call.args):
                    return [model.tree]
                sinks += call.args
            else:
                sinks += call.args[:2]
            if holders and holders & {last_name(sink) for sink in sinks}:
                return [model.tree]
        return literals

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.rewritten: set[int] = set()  # literals dealt with (by the first rule that reaches them)
        self.reported: set[int] = set()  # literals reported as assigned but not flowing (one finding each)
        self.conditionals: list[cst.IfExp] = []
        self.strings: list[cst.BaseExpression] = []  # code strings outside messages
        self.formatted: list[cst.BaseExpression] = []  # f-strings (and adjacent literals holding one) outside messages
        self._parents: dict[int, cst.CSTNode] | None = None

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.conditionals.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self._note_string(node)

    def visit_ConcatenatedString(self, node: cst.ConcatenatedString) -> None:
        super().visit_ConcatenatedString(node)
        self._note_string(node)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        self._note_string(node)

    def _note_string(self, node: cst.BaseExpression) -> None:
        if id(node) in self._not_code or id(node) in self._dict_keys or self._text_depth > 0:
            return
        if literal_string(node) is not None:
            self.strings.append(node)
        elif isinstance(node, cst.FormattedString) or isinstance(node, cst.ConcatenatedString) and \
                not isinstance(node.evaluated_value, bytes):
            self.formatted.append(node)

    # ------------------------------------------------------------------ decided on the whole window
    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for call in self.calls:
            self._call(call)
        for comparison in self.comparisons:
            self._comparison(comparison)
        for conditional in self.conditionals:  # "cuda" if torch.cuda.is_available() else "cpu"
            if any(self.facts.qualname(call.func) == "torch.cuda.is_available"
                   for call in _calls_in(conditional.test)):
                self._rewrite_value(conditional, "device-string")
        self._assignments()
        for node in self.strings:
            if id(node) in self.rewritten or id(node) in self.facts.claimed:
                continue
            value = literal_string(node)
            if value != "cuda" and rules.DEVICE_TEMPLATE.match(value):
                # "cuda:0", "cuda:%d", "cuda:{}": the text itself says it is a device
                self._rewrite(node, "device-string")
            elif rules.DEVICE_VALUE.match(value) and id(node) not in self.reported:
                callee = self._callee_of_argument(node)
                if callee is not None:
                    self.flag(node, PASSED_DEVICE, reason=f"'{value}' is passed to {callee}, whose parameters "
                                                          "npu-migrate cannot see, and was left unchanged")
                else:
                    self.flag(node, UNPLACED_DEVICE,
                              reason=f"'{value}' is not in a recognised device position and was left unchanged")
        for node in self.formatted:  # f"cuda:{rank}" says by itself that it is a device
            if id(node) not in self.rewritten and id(node) not in self.facts.claimed and \
                    device_literals(node, self.facts):
                self._rewrite(node, "device-string")
        return updated_node

    def _call(self, call: cst.Call) -> None:
        for expr, _ in device_positions(call, self.facts):  # int ordinals: IntDeviceOrdinals'
            if self._rewrite_value(expr, "device-string"):
                continue
            if isinstance(expr, cst.Dict):  # map_location={"cuda:1": "cuda:0"}
                elements = [element for element in expr.elements if isinstance(element, cst.DictElement)]
                for item in [element.key for element in elements] + [element.value for element in elements]:
                    self._rewrite_value(item, "device-string")
        positional, keywords = split_arguments(call)
        method = call.func.attr.value if isinstance(call.func, cst.Attribute) else None
        if method == "add_argument":
            for arg in keywords:
                name = arg.keyword.value if arg.keyword is not None else None
                if name == "default":
                    self._rewrite_value(arg.value, "argparse-default")
                elif name == "choices":
                    self._rewrite_choices(arg.value, "argparse-default")
        elif method == "startswith" and positional and is_device_like(call.func.value, self.facts):
            if not positional[0].star:
                self._rewrite_choices(positional[0].value, "device-compare")

    def _rewrite_choices(self, expr: cst.BaseExpression, rule: str) -> None:
        items = [element.value for element in expr.elements if isinstance(element, cst.Element)] \
            if isinstance(expr, _DISPLAYS) else [expr]
        for item in items:
            value = literal_string(item)
            if value is not None and rules.DEVICE_TEMPLATE.match(value):
                self._rewrite(item, rule)

    def _comparison(self, node: cst.Comparison) -> None:
        operands = [node.left, *(target.comparator for target in node.comparisons)]
        for index, target in enumerate(node.comparisons):
            left, right = operands[index], operands[index + 1]
            if isinstance(target.operator, _EQUALITY):
                for const, other in ((left, right), (right, left)):
                    if _is_device_value(const) and is_device_like(other, self.facts):
                        self._rewrite(const, "device-compare")
            elif isinstance(target.operator, _MEMBERSHIP):
                if isinstance(right, _DISPLAYS):
                    for element in right.elements:
                        if isinstance(element, cst.Element) and _is_device_value(element.value) and \
                                is_device_like(left, self.facts):
                            self._rewrite(element.value, "device-compare")
                elif _is_device_value(left) and is_device_like(right, self.facts):
                    self._rewrite(left, "device-compare")

    def _assignments(self) -> None:
        """Variables, attributes and parameter defaults holding a device value: rewritten when named
        like a device or seen flowing into a device use (else a plain string is reported); dict
        entries and item assignments keyed like a device."""
        bound, keyed = self.bound_values()
        for binder, name, value in bound:
            literals = device_literals(value, self.facts)
            if not literals:
                continue
            if _device_named(name) or self.facts.flows.key(binder, name) in self.facts.flows.device:
                for literal in literals:
                    self._rewrite(literal, "device-variable")
            elif literal_string(value) == "cuda" and id(value) not in self.reported:
                # ("cuda:0", "cuda:{}" say by themselves they are devices: rewritten as strings, below)
                self.reported.add(id(value))
                self.flag(value, UNUSED_DEVICE, reason=f"'{literal_string(value)}' is assigned to `{name}` but not "
                                                       "seen flowing into a device use")
        for key, value in keyed:  # {"device": "cuda"}, kwargs["device_type"] = "cuda"
            key_text = literal_string(key)
            if key_text is not None and "device" in key_text.lower():
                self._rewrite_value(value, "device-variable")

    def _rewrite_value(self, expr: cst.BaseExpression, rule: str) -> bool:
        """The device literals of a value rewritten; whether it has any."""
        literals = device_literals(expr, self.facts)
        for literal in literals:
            self._rewrite(literal, rule)
        return bool(literals)

    def _rewrite(self, literal: cst.BaseExpression, rule: str) -> None:
        """The leading "cuda" of a literal (plain or f-string) -> "npu", prefix and quotes kept; not
        when the literal starts otherwise (escapes) or goes to a CUDA-only library (reported)."""
        if id(literal) in self.rewritten or id(literal) in self.facts.claimed or self._for_cuda_only_library(literal):
            return
        start, end = self.facts.span(literal)
        segment = self.facts.positions.text[start:end]
        head = _STRING_HEAD.match(segment)
        if head is None or not segment.startswith("cuda", head.end()):
            return
        self.rewritten.add(id(literal))
        at = start + head.end()
        self._record(at, at + len("cuda"), "npu", rule, True)

    def _callee_of_argument(self, literal: cst.BaseExpression) -> str | None:
        """The source of the function a literal is passed to as an argument, if it is one."""
        if self._parents is None:
            self._parents = _parents(self.facts.module)
        arg = self._parents.get(id(literal))
        call = self._parents.get(id(arg)) if isinstance(arg, cst.Arg) else None
        return source(call.func, self.facts) if isinstance(call, cst.Call) else None

    def _for_cuda_only_library(self, literal: cst.BaseExpression) -> bool:
        """A device string meant for a CUDA-only library this file imports (Isaac Gym's sim_device ...):
        theirs, not torch's; kept and reported, never rewritten to "npu"."""
        libraries = self._cuda_only_device_libraries()
        if not libraries:
            return False
        names = frozenset().union(*(rules.CUDA_ONLY_DEVICE_LIBRARIES[library] for library in libraries))
        text = self.facts.positions.text
        mentions = [name for name in names if name in text]

        def carrier(name: str | None) -> str | None:  # sim_device, args.sim_device, sim_device_type ...
            return name if name and any(known in name for known in names) else None

        if self._parents is None:
            self._parents = _parents(self.facts.module)
        current, up = literal, self._parents.get(id(literal))
        owner = None
        while up is not None:
            if isinstance(up, cst.Call) and current is not up.func:
                qualified = self.facts.qualname(up.func) or ""
                if qualified.split(".")[0] in libraries:
                    owner = qualified
            elif isinstance(up, cst.Arg) and up.keyword is not None:
                owner = owner or carrier(up.keyword.value)
            elif isinstance(up, cst.Comparison):  # sim_device_type == "cuda"
                side_of_current = current.comparator if isinstance(current, cst.ComparisonTarget) else current
                sides = (up.left, *(target.comparator for target in up.comparisons))
                owner = owner or next((carrier(variable_name(side)) for side in sides
                                       if side is not side_of_current and carrier(variable_name(side))), None)
            elif isinstance(up, (cst.Assign, cst.AnnAssign)):
                targets = [t.target for t in up.targets] if isinstance(up, cst.Assign) else [up.target]
                owner = owner or next((carrier(variable_name(t)) for t in targets if carrier(variable_name(t))), None)
            elif isinstance(up, cst.Dict) and mentions:
                values = [element.value for element in up.elements if isinstance(element, cst.DictElement)]
                owner = owner or next((m for m in mentions for v in values if m in (literal_string(v) or "")), None)
            if owner or isinstance(up, _STATEMENTS):
                break
            current, up = up, self._parents.get(id(up))
        if owner is None:
            return False
        self.rewritten.add(id(literal))
        self.flag(literal, CUDA_ONLY_DEVICE, reason=(
            f"this device string goes to a CUDA-only library ({owner}, from {', '.join(sorted(libraries))}); "
            "it was not rewritten to 'npu'"))
        return True

    def _cuda_only_device_libraries(self) -> frozenset[str]:
        """The CUDA-only libraries taking device strings that this file imports (isaacgym, warp ...)."""
        text = self.facts.positions.text
        if not any(library in text for library in rules.CUDA_ONLY_DEVICE_LIBRARIES):
            return frozenset()
        roots = {name.split(".")[0] for name in self.facts.bindings.values()}
        roots.update(_STAR_IMPORT.findall(text))  # `from isaacgym import *` binds no name of its own
        return frozenset(roots & set(rules.CUDA_ONLY_DEVICE_LIBRARIES))


def _is_device_value(node: cst.BaseExpression) -> bool:
    value = literal_string(node)
    return value is not None and bool(rules.DEVICE_VALUE.match(value))


def _calls_in(node: cst.CSTNode):
    """The calls in an expression, itself included."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Call):
            yield current
        stack.extend(_children(current))


def _parents(module: cst.Module) -> dict[int, cst.CSTNode]:
    parents: dict[int, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        for child in _children(node):
            parents[id(child)] = node
            stack.append(child)
    return parents
