"""What makes an expression a CUDA device or an NCCL backend value, for the codemods that read them."""

from __future__ import annotations

import ast
import functools
import itertools
import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import FileFacts, _children, called_name, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import string_expression, string_value

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
    text = facts.positions.text[start:end]
    if "cuda" not in text:  # (spelled with escapes it could not be rewritten anyway)
        return False
    joined = string_expression(text)
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


def is_int_ordinal(expr: cst.BaseExpression, facts: FileFacts) -> bool:
    """An int that names a device ordinal where a device is expected: `0`, `int(x)`, `local_rank`,
    `args.gpu` (a name of rules.INT_ORDINAL_NAMES that is not an import)."""
    if isinstance(expr, cst.Integer):
        return True
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "int":
        return True
    name = variable_name(expr)
    return name is not None and name in rules.INT_ORDINAL_NAMES and facts.qualname(expr) is None


def device_positions(call: cst.Call, facts: FileFacts) -> list[tuple[cst.BaseExpression, bool]]:
    """The arguments of a call that are devices, each with whether an int ordinal may stand there:
    keywords named like a device (`device=`, `map_location=`, `device_type=` ...), the first argument
    of torch.device, torch.autocast ... (rules.DEVICE_FIRST_ARG) and of a value's `.to()` /
    `.to_empty()`, torch.load's second, and the arguments of the tree's own functions, classes and
    methods whose parameter takes a device (device_signatures: named like one, or a device default)."""
    positional, keywords = split_arguments(call)
    positions = [(arg.value, arg.keyword.value == "device") for arg in keywords
                 if arg.keyword is not None and rules.DEVICE_KEYWORD.match(arg.keyword.value)]
    if positional and not positional[0].star:
        qualified = facts.qualname(call.func)
        if qualified in rules.DEVICE_FIRST_ARG:
            positions.append((positional[0].value, False))
        elif qualified is None and isinstance(call.func, cst.Attribute) and \
                call.func.attr.value in rules.DEVICE_FIRST_ARG_METHODS:
            positions.append((positional[0].value, True))
        elif qualified == rules.TORCH_LOAD and len(positional) >= 2:
            positions.append((positional[1].value, False))
    takes_device = _callee_device_parameters(call, facts)
    positions += [(arg.value, False) for arg, is_device in zip(positional, takes_device) if is_device and not arg.star]
    return positions


def _callee_device_parameters(call: cst.Call, facts: FileFacts) -> tuple[bool, ...]:
    """Which positional parameters of the called function, class or method take a device, when the
    tree defines it (device_signatures): a name of this file or imported from the tree's own
    packages (`from lingua.metrics import GPUMemoryMonitor`), or a method of no import (`self.start`)."""
    func = call.func
    if isinstance(func, cst.Name):
        name, bound = func.value, facts.bindings.get(func.value)
    elif isinstance(func, cst.Attribute):
        name, bound = func.attr.value, facts.qualname(func)
    else:
        return ()
    if bound is not None and bound.split(".")[0] not in facts.tree.local_packages:
        return ()  # a library's: its parameters are not known here
    return facts.local_signatures.get(name) or facts.tree.device_signatures.get(name, ())


_DEF_HEADER = re.compile(r"def[ \t]+(\w+)[ \t]*\(")  # (a literal first: re skips to it, unlike a ^ anchor)
_CLASS_HEADER = re.compile(r"class[ \t]+(\w+)")
_HEADER_END = re.compile(r":[ \t]*(?:#[^\n]*)?$", re.MULTILINE)  # a line ending a def header (or another ':' line)
_MAY_TAKE_DEVICE = re.compile(r"dev|cuda", re.IGNORECASE)
_SELF_NAMES = frozenset({"self", "cls", "mcs"})


@functools.lru_cache(maxsize=4)  # a file's windows and its ast screen ask for the same text
def device_signatures(text: str) -> dict[str, tuple[bool, ...]]:
    """Which positional parameters take a device, by the name a call uses, for each function, method
    (after self/cls) and class (its __init__'s, after self) of a Python source that has one: a
    parameter named like a device or whose default holds a device literal (`where="cuda:0"`; such a
    default is rewritten to "npu:0", so a "cuda" its callers pass must be too). Read from the def
    headers alone (each parsed by itself), so a file the running Python cannot parse still gives
    them. A name defined twice with different device parameters is ambiguous: none."""
    signatures: dict[str, tuple[bool, ...]] = {}
    classes: list[tuple[int, int, str]] | None = None  # (offset, indent, name), read when an __init__ needs them
    for match in _DEF_HEADER.finditer(text):
        indent = _statement_indent(text, match.start(), ("", "async"))
        function = _def_header(text, match.start()) if indent is not None else None
        if function is None:
            continue
        arguments = function.args
        positional = [*arguments.posonlyargs, *arguments.args]
        defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
        takes = [_takes_device(arg.arg, default) for arg, default in zip(positional, defaults)]
        if indent and positional and positional[0].arg in _SELF_NAMES:
            takes = takes[1:]  # a method: callers do not pass self
        name = function.name
        if name == "__init__" and any(takes):
            if classes is None:
                classes = [(found.start(), at, found.group(1)) for found in _CLASS_HEADER.finditer(text)
                           if (at := _statement_indent(text, found.start(), ("",))) is not None]
            owner = [cls for cls in classes if cls[0] < match.start() and cls[1] < indent]
            if not owner:
                continue
            name = owner[-1][2]
        if any(takes) and signatures.setdefault(name, tuple(takes)) != tuple(takes):
            signatures[name] = ()
    return signatures


def _statement_indent(text: str, at: int, leads: tuple[str, ...]) -> int | None:
    """The indent of the line a keyword at `at` starts, when only whitespace (or one of `leads`,
    e.g. "async") stands before it on its line; None otherwise (inside an expression or a string)."""
    line_start = text.rfind("\n", 0, at) + 1
    before = text[line_start:at]
    if before.strip() not in leads:
        return None
    return len(before.expandtabs()) - len(before.expandtabs().lstrip())


def merge_signatures(per_file: list[dict[str, tuple[bool, ...]]]) -> dict[str, tuple[bool, ...]]:
    """device_signatures of several files as one: a name with different device parameters in two
    files is ambiguous (none)."""
    merged: dict[str, tuple[bool, ...]] = {}
    for signatures in per_file:
        for name, takes in signatures.items():
            if merged.setdefault(name, takes) != takes:
                merged[name] = ()
    return merged


def _def_header(text: str, start: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The def whose header starts at `start`, parsed alone (up to the first ':' line that closes
    it); None unless it may take a device."""
    for ending in itertools.islice(_HEADER_END.finditer(text, start), 30):
        header = text[start:ending.end()]
        if not _MAY_TAKE_DEVICE.search(header):
            if header.count("(") == header.count(")"):
                return None  # the whole header (parentheses closed), without a device
            continue
        try:
            parsed = ast.parse(header + "\n pass")
        except (SyntaxError, ValueError):
            continue  # a ':' of an annotation or a default: the header goes on
        node = parsed.body[0] if parsed.body else None
        return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return None


def _takes_device(name: str, default: ast.AST | None) -> bool:
    lowered = name.lower()
    if "device" in lowered or lowered == "dev":
        return True
    return default is not None and any(
        rules.DEVICE_TEMPLATE.match(value or "") for value in map(string_value, ast.walk(default)))


class Flows:
    """Which variables and attributes of a file flow into a device use and which into a
    process-group backend argument, a fact the device and backend codemods share (FileFacts.flows).

    A use is a name or attribute standing in a device position (device_positions; an int ordinal
    where one may stand is an ordinal, not a flow) or a backend one (backend_arguments). It is keyed
    by the scope that binds the name (or the attribute's source text), as `key` keys a binding:
    `device = "cuda"` ... `x.to(device)` is a flow when both keys meet."""

    def __init__(self, facts: FileFacts) -> None:
        self.facts = facts
        self.device: set[tuple] = set()
        self.backend: set[tuple] = set()
        stack: list[cst.CSTNode] = [facts.module]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Call):
                for expr, ints_allowed in device_positions(node, facts):
                    if not (ints_allowed and is_int_ordinal(expr, facts)):
                        self._note(self.device, expr)
                for expr in backend_arguments(node, facts)[0]:
                    if not backend_literals(expr) and variable_name(expr) is not None:
                        self._note(self.backend, expr)
            stack.extend(_children(node))

    def _note(self, uses: set[tuple], expr: cst.BaseExpression) -> None:
        facts = self.facts
        if isinstance(expr, cst.Name) and expr.value not in facts.bindings:
            scopes = facts.scopes
            uses.add((scopes.defining_scope(expr.value, scopes.scope_of.get(expr, scopes.module)), expr.value))
        elif isinstance(expr, cst.Attribute) and facts.qualname(expr) is None:
            uses.add(("attr", source(expr, facts)))

    def key(self, binder: cst.CSTNode, name: str) -> tuple:
        """The key of a binding: an attribute assigned (binder: the Attribute), a variable assigned
        (binder: the Assign / AnnAssign) or a parameter with a default (binder: its function)."""
        if isinstance(binder, cst.Attribute):
            return "attr", source(binder, self.facts)
        if isinstance(binder, (cst.Assign, cst.AnnAssign)):
            scopes = self.facts.scopes
            return scopes.scope_of.get(binder, scopes.module), name
        return binder, name


def backend_arguments(call: cst.Call, facts: FileFacts) -> tuple[list[cst.BaseExpression], bool]:
    """(the backend arguments of a call: `backend=` of any call, init_process_group's first; whether
    it is init_process_group)."""
    positional, keywords = split_arguments(call)
    qualified = facts.qualname(call.func)
    method = call.func.attr.value if isinstance(call.func, cst.Attribute) else None
    values = [arg.value for arg in keywords if arg.keyword is not None and arg.keyword.value == "backend"]
    is_init = ((qualified or "").rsplit(".", 1)[-1] or method) == "init_process_group"
    if is_init and positional and not positional[0].star:
        values.append(positional[0].value)
    return values, is_init


def source(node: cst.CSTNode, facts: FileFacts) -> str:
    """The node's source text."""
    start, end = facts.span(node)
    return facts.positions.text[start:end]


class ValuePlaces:
    """visit_ methods noting where a module's values are used and bound, for a codemod that decides
    on its whole window in leave_Module (mixed in before StringPlaces): `calls`, `comparisons`,
    `assignments` (with a value), `functions` (defs and lambdas: their defaults) and `dicts`."""

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.calls: list[cst.Call] = []
        self.comparisons: list[cst.Comparison] = []
        self.assignments: list[cst.Assign | cst.AnnAssign] = []
        self.functions: list[cst.FunctionDef | cst.Lambda] = []
        self.dicts: list[cst.Dict] = []

    def visit_Call(self, node: cst.Call) -> None:
        super().visit_Call(node)
        self.calls.append(node)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self.comparisons.append(node)

    def visit_Assign(self, node: cst.Assign) -> None:
        self.assignments.append(node)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self.assignments.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        self.functions.append(node)

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self.functions.append(node)

    def visit_Dict(self, node: cst.Dict) -> None:
        self.dicts.append(node)

    def bound_values(self) -> tuple[list[tuple[cst.CSTNode, str, cst.BaseExpression]],
                                    list[tuple[cst.BaseExpression, cst.BaseExpression]]]:
        """(binder, name, value) of each variable and attribute assigned and each parameter with a
        default (binder as Flows.key takes it); (key, value) of each dict entry and item assignment
        (`kwargs["device"] = ...`), dict entries first."""
        bound: list[tuple[cst.CSTNode, str, cst.BaseExpression]] = []
        items: list[tuple[cst.BaseExpression, cst.BaseExpression]] = []
        for node in self.assignments:
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            for target in targets:
                if isinstance(target, cst.Name):
                    bound.append((node, target.value, node.value))
                elif isinstance(target, cst.Attribute):
                    bound.append((target, target.attr.value, node.value))
                elif isinstance(target, cst.Subscript) and len(target.slice) == 1 and \
                        target.slice[0].comma is cst.MaybeSentinel.DEFAULT and isinstance(target.slice[0].slice, cst.Index):
                    items.append((target.slice[0].slice.value, node.value))
        for function in self.functions:
            params = function.params
            for param in (*params.posonly_params, *params.params, *params.kwonly_params):
                if param.default is not None:
                    bound.append((function, param.name.value, param.default))
        keyed = [(element.key, element.value) for node in self.dicts for element in node.elements
                 if isinstance(element, cst.DictElement)]
        return bound, keyed + items
