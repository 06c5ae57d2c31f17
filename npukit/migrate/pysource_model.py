"""The `ast` screen of one Python source, from which the codemods' candidates are chosen.

`SourceModel` parses the text with the stdlib `ast` parser (C speed), collects in one pass the nodes
the codemods' `candidates()` look at (calls, attributes, strings, comparisons, assignments, imports,
scopes) and composes the edits the codemods record (`_edit`: one node's exact source span replaced,
so everything else stays byte-for-byte).
"""

from __future__ import annotations

import ast
import bisect
import re
import warnings

from npukit.migrate.model import Edit, Finding, TreeFacts

_NEWLINE = re.compile(r"\r\n|\r|\n")

_SCOPE_NODES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class MigrationSyntaxError(Exception):
    """The source does not parse; carries a message naming the line."""


class Positions:
    """Maps ast positions (1-based line, UTF-8 byte column) to offsets in the decoded text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.line_starts = [0] + [m.end() for m in _NEWLINE.finditer(text)]

    def offset(self, line: int, col: int) -> int:
        start = self.line_starts[line - 1]
        end = self.line_starts[line] if line < len(self.line_starts) else len(self.text)
        line_text = self.text[start:end]
        if line_text.isascii():
            return start + col
        return start + len(line_text.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset))

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_text(self, line: int) -> str:
        start = self.line_starts[line - 1]
        end = self.line_starts[line] if line < len(self.line_starts) else len(self.text)
        return self.text[start:end].rstrip("\r\n")


def parse_python(text: str, path: str) -> ast.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are the user's business
            return ast.parse(text, filename=path)
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        raise MigrationSyntaxError(f"does not parse as Python 3 ({where}: {exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise MigrationSyntaxError(f"does not parse as Python 3 ({type(exc).__name__}: {exc})") from None


def string_value(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names an absolute import statement names: `import a.b` -> [a.b]; `from a import b` -> [a.b, a]."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0 and node.module:
        return [*(f"{node.module}.{alias.name}" for alias in node.names), node.module]
    return []


def defines_is_cuda(node: ast.ClassDef) -> bool:
    """A class with its own `is_cuda`: a method or property of that name, a class attribute, or
    `self.is_cuda = ...` in one of its methods (Tensor.is_cuda is read-only, so it is the class's)."""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name == "is_cuda":
                return True
            for sub in ast.walk(item):
                if isinstance(sub, ast.Attribute) and sub.attr == "is_cuda" and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    return True
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            if any(isinstance(t, ast.Name) and t.id == "is_cuda" for t in targets):
                return True
    return False


def last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}

_NOT_CHILDREN = frozenset({"ctx", "op", "ops", "type_ignores"})  # singletons and operators: no rule needs them


def _child_fields(kind: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(kind)
    if fields is None:
        fields = tuple(f for f in kind._fields if f not in _NOT_CHILDREN)
        _CHILD_FIELDS[kind] = fields
    return fields


def _all_args(arguments: ast.arguments) -> list[ast.arg]:
    result = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
    if arguments.vararg:
        result.append(arguments.vararg)
    if arguments.kwarg:
        result.append(arguments.kwarg)
    return result


def newline_of(text: str) -> str:
    match = _NEWLINE.search(text)
    return match.group(0) if match else "\n"


def drop_overlaps(edits: list[Edit]) -> list[Edit]:
    """Keep edits that do not overlap an earlier one (insertions at one point are all kept)."""
    kept: list[Edit] = []
    last_end = -1
    for edit in edits:
        if edit.start < last_end and not (edit.start == edit.end == kept[-1].end):
            continue
        kept.append(edit)
        last_end = max(last_end, edit.end)
    return kept


def apply_edits(text: str, edits: list[Edit]) -> str:
    pieces = []
    position = 0
    for edit in edits:
        pieces.append(text[position:edit.start])
        pieces.append(edit.text)
        position = edit.end
    pieces.append(text[position:])
    return "".join(pieces)


class SourceModel:
    """One parsed module: positions, the collected nodes, and the edits and findings made so far."""

    def __init__(self, text: str, path: str, facts: TreeFacts = TreeFacts()) -> None:
        self.text = text
        self.path = path
        self.facts = facts
        self.custom_ops = facts.custom_ops  # names of custom CUDA ops bound from this tree's native code
        self.pos = Positions(text)
        self.tree = parse_python(text, path)
        self.edits: dict[tuple[int, int], Edit] = {}
        self.findings: dict[tuple[int, int, str], Finding] = {}
        self.frozen: list[tuple[int, int]] = []  # spans never edited (the CUDA branch of dual-target code)
        self._qualname_cache: dict[int, str | None] = {}
        self._binding_site_cache: dict[tuple[str, int], list[tuple[int, bool]]] = {}
        self._collect()

    def _collect(self) -> None:
        self.parent: dict[int, ast.AST] = {}
        self.scope_of: dict[int, ast.AST] = {}
        self.assigned: dict[int, set[str]] = {}  # scope id -> names bound there
        self.calls: list[ast.Call] = []
        self.attributes: list[ast.Attribute] = []
        self.strings: list[ast.Constant] = []
        self.compares: list[ast.Compare] = []
        self.fstrings: list[ast.JoinedStr] = []
        self.assigns: list[ast.AST] = []
        self.imports: list[ast.AST] = []
        self.functions: list[ast.AST] = []
        self.cuda_method_classes: set[str] = set(self.facts.cuda_method_classes)  # + this file's, below
        self.is_cuda_classes: set[str] = set(self.facts.is_cuda_classes)  # + this file's, below
        self.docstrings: set[int] = set()
        self.ifs: list[ast.If] = []
        self.conditionals: list[ast.IfExp] = []
        self.dicts: list[ast.Dict] = []
        self.decorators: list[ast.AST] = []
        self.loads: dict[str, list[ast.Name]] = {}
        self.stores: dict[str, list[ast.Name]] = {}  # names assigned (not by import or def)
        self.definitions: list[ast.AST] = []  # functions and classes

        module = self.tree
        self.assigned[id(module)] = set()
        stack: list[tuple[ast.AST, ast.AST]] = [(module, module)]
        parent = self.parent
        scope_of = self.scope_of
        loads = self.loads
        while stack:
            node, scope = stack.pop()
            kind = type(node)
            inner_scope = scope
            if kind is ast.Name:
                scope_of[id(node)] = scope
                if type(node.ctx) is ast.Load:
                    loads.setdefault(node.id, []).append(node)
                else:
                    self.assigned[id(scope)].add(node.id)
                    self.stores.setdefault(node.id, []).append(node)
            elif kind is ast.Attribute:
                self.attributes.append(node)
            elif kind is ast.Call:
                self.calls.append(node)
            elif kind is ast.Constant:
                if type(node.value) is str:
                    self.strings.append(node)
            elif kind is ast.Compare:
                self.compares.append(node)
            elif kind is ast.JoinedStr:
                self.fstrings.append(node)
            elif kind is ast.Dict:
                self.dicts.append(node)
            elif kind is ast.Assign or kind is ast.AnnAssign:
                self.assigns.append(node)
                scope_of[id(node)] = scope
            elif kind is ast.Import or kind is ast.ImportFrom:
                self.imports.append(node)
                scope_of[id(node)] = scope
                for alias in node.names:
                    self.assigned[id(scope)].add((alias.asname or alias.name).split(".")[0])
            elif kind is ast.If:
                self.ifs.append(node)
            elif kind is ast.IfExp:
                self.conditionals.append(node)
            elif kind in _SCOPE_NODES:
                inner_scope = self._enter_scope(node, scope)
            for name in _child_fields(kind):
                value = getattr(node, name)
                # a function's decorators, defaults and annotations belong to the enclosing scope
                child_scope = inner_scope if name == "body" else scope
                if type(value) is list:
                    for child in value:
                        if isinstance(child, ast.AST):
                            parent[id(child)] = node
                            stack.append((child, child_scope))
                elif isinstance(value, ast.AST):
                    parent[id(value)] = node
                    stack.append((value, child_scope))

    def _enter_scope(self, node: ast.AST, scope: ast.AST) -> ast.AST:
        kind = type(node)
        if kind is ast.Module:
            inner = scope
        else:
            self.assigned[id(scope)].add(getattr(node, "name", ""))
            self.scope_of[id(node)] = scope
            self.definitions.append(node)
            self.decorators.extend(getattr(node, "decorator_list", ()))
            inner = node
        body = node.body
        if type(body) is list and body:
            first = body[0]
            if isinstance(first, ast.Expr) and string_value(first.value) is not None:
                self.docstrings.add(id(first.value))
        if kind is ast.ClassDef:
            self.assigned[id(node)] = set()
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "cuda":
                    self.cuda_method_classes.add(node.name)
            if "is_cuda" in self.text and defines_is_cuda(node):
                self.is_cuda_classes.add(node.name)
        elif kind is not ast.Module:
            self.functions.append(node)
            self.assigned[id(node)] = {a.arg for a in _all_args(node.args)}
        return inner

    def _defining_scope(self, name: str, scope: ast.AST) -> ast.AST:
        """The scope whose binding of `name` a read in `scope` sees (the module when none does)."""
        current = scope
        while current is not None:
            if name in self.assigned.get(id(current), ()):
                return current
            if current is self.tree:
                break
            current = self.scope_of.get(id(current), self.tree)
            while isinstance(current, ast.ClassDef):  # class bodies are not enclosing scopes for functions
                current = self.scope_of.get(id(current), self.tree)
        return self.tree

    def qualname(self, node: ast.AST) -> str | None:
        key = id(node)
        if key in self._qualname_cache:
            return self._qualname_cache[key]
        result = None
        if isinstance(node, ast.Name):
            result = self.bindings.get(node.id)
        elif isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            if base is not None:
                result = f"{base}.{node.attr}"
        self._qualname_cache[key] = result
        return result

    def _edit(self, node_or_span, text: str, rule: str, *, needs_torch_npu: bool = True) -> None:
        """Replace a node's source (or a (start, end) span) with text."""
        if isinstance(node_or_span, tuple):
            start, end = node_or_span
        else:
            start, end = self.pos.span(node_or_span)
        if self.text[start:end] == text or any(a <= start and end <= b for a, b in self.frozen):
            return
        line = bisect.bisect_right(self.pos.line_starts, start)
        col = start - self.pos.line_starts[line - 1] + 1  # where the replaced text itself starts
        self.edits.setdefault((start, end), Edit(start, end, text, rule, line, col, needs_torch_npu))
