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
import sys
import warnings
from typing import NamedTuple

from npukit.migrate.model import Edit, Finding, TreeFacts

_NEWLINE = re.compile(r"\r\n|\r|\n")

_SCOPE_NODES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class MigrationSyntaxError(Exception):
    """The source does not parse; carries a message naming the line."""


class Positions:
    """Maps ast positions (1-based line, UTF-8 byte column) to offsets in the decoded text.
    parsed: the text ast read when it is not `text` but a char-for-char stand-in (newer_grammar_screen):
    its byte columns are counted on its own lines."""

    def __init__(self, text: str, parsed: str | None = None) -> None:
        self.text = text
        self._parsed = text if parsed is None else parsed
        self.line_starts = [0] + [m.end() for m in _NEWLINE.finditer(text)]

    def offset(self, line: int, col: int) -> int:
        start = self.line_starts[line - 1]
        end = self.line_starts[line] if line < len(self.line_starts) else len(self.text)
        line_text = self._parsed[start:end]
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


class Screen(NamedTuple):
    """What ast read of a file only a newer Python reads (newer_grammar_screen)."""

    text: str  # the file, char for char, its newer strings respelled
    tuples: list[tuple[int, int]]  # (start, end) of the string groups respelled as tuples (their text unseen)


def parse_python(text: str, path: str) -> ast.Module:
    return parse_source(text, path)[0]


def parse_source(text: str, path: str) -> tuple[ast.Module, Screen | None]:
    """(the module's ast, the screen ast read when it is not `text`). A file the running Python
    cannot parse but libcst's newest grammar can (valid only on a newer Python: PEP 701 f-strings)
    is read through newer_grammar_screen, which keeps every offset."""
    try:
        return _ast_parse(text, path), None
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        screen = newer_grammar_screen(text)
        if screen is not None:
            try:
                return _ast_parse(screen.text, path), screen
            except (SyntaxError, ValueError):
                pass  # newer syntax outside strings (PEP 695 type parameters ...)
        running = ".".join(map(str, sys.version_info[:2]))
        raise MigrationSyntaxError(f"does not parse as Python {running} nor with libcst's Python {NEWEST_GRAMMAR} "
                                   f"grammar ({where}: {exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise MigrationSyntaxError(f"does not parse as Python 3 ({type(exc).__name__}: {exc})") from None


def string_expression(text: str) -> ast.expr | None:
    """The ast of a string literal's (or adjacent literals') source text, also when only a newer
    Python reads it (a PEP 701 f-string: through newer_grammar_screen, then possibly not a JoinedStr);
    None if unreadable."""
    wrapped = f"(\n{text}\n)"
    try:
        return ast.parse(wrapped, mode="eval").body
    except (SyntaxError, ValueError):
        screened = newer_grammar_screen(wrapped)
    try:
        return None if screened is None else ast.parse(screened.text, mode="eval").body
    except (SyntaxError, ValueError):
        return None


def _ast_parse(text: str, path: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences etc. are the user's business
        return ast.parse(text, filename=path)


def _newest_grammar() -> str:
    """The newest Python grammar the installed libcst knows."""
    try:
        from libcst._parser.types.config import KNOWN_PYTHON_VERSION_STRINGS
    except ImportError:  # (a private name: a libcst without it still parses the newer f-strings)
        return "3.12"
    return max(KNOWN_PYTHON_VERSION_STRINGS, key=lambda version: tuple(map(int, version.split("."))))


NEWEST_GRAMMAR = _newest_grammar()


def newer_grammar_screen(text: str) -> Screen | None:
    """For a file libcst's newest grammar parses: the same text, char for char, with each string the
    running Python cannot read by itself (a PEP 701 f-string, `f"{d["k"]}"`) respelled so that ast
    reads the file and finds every expression (a `.cuda()` inside the f-string) at its offset: with
    the other quote when that is enough (`f'{d["k"]}'`: still an f-string, "cuda:{...}" still seen),
    else as the tuple of its replacement fields' expressions, each in its own place (`( d["k"], )`).
    None when libcst cannot parse the file either, or nothing in it needs this."""
    import libcst as cst

    from npukit.migrate.codemods.base import FileFacts

    try:
        module = cst.parse_module(text, config=cst.PartialParserConfig(python_version=NEWEST_GRAMMAR))
    except (cst.ParserSyntaxError, ValueError, RecursionError):
        return None
    facts = FileFacts("<screen>", module, text)
    chars = list(text)
    tuples: list[tuple[int, int]] = []
    groups = (cst.FormattedString, cst.ConcatenatedString)

    def readable_alone(node: cst.CSTNode, spelled: str | None = None) -> bool:
        start, end = facts.span(node)
        try:
            _ast_parse(f"({''.join(chars[start:end]) if spelled is None else spelled})", "<string>")
        except (SyntaxError, ValueError):
            return False
        return True

    def requoted(node: cst.FormattedString) -> bool:
        """Spelled with the other quote (`f"{d["k"]}"` -> `f'{d["k"]}'`) when that reads alone."""
        start, end = facts.span(node)
        quote = node.start[len(node.prefix):]
        other = ("'" if quote[0] == '"' else '"') * len(quote)
        spelled = node.prefix + other + "".join(chars[start + len(node.start):end - len(quote)]) + other
        if not readable_alone(node, spelled):
            return False
        chars[start:end] = spelled
        return True

    def fields(node: cst.CSTNode):
        if isinstance(node, cst.ConcatenatedString):
            yield from fields(node.left)
            yield from fields(node.right)
        elif isinstance(node, cst.FormattedString):
            for part in node.parts:
                if isinstance(part, cst.FormattedStringExpression):
                    yield part
                    yield from fields(cst.FormattedString(parts=part.format_spec or ()))

    def visit(node: cst.CSTNode) -> bool:
        if isinstance(node, groups) and not readable_alone(node):
            if isinstance(node, cst.FormattedString) and requoted(node):
                return True  # still an f-string for ast, with its literal text
            if isinstance(node, cst.ConcatenatedString):
                visit(node.left)
                visit(node.right)
                if readable_alone(node):
                    return True
            spell_as_tuple(node)
            return True
        screened = False
        for child in node.children:
            screened = visit(child) or screened
        return screened

    def spell_as_tuple(group: cst.CSTNode) -> None:
        start, end = facts.span(group)
        tuples.append((start, end))
        for index in range(start, end):
            if chars[index] not in "\r\n":
                chars[index] = " "
        chars[start], chars[end - 1] = "(", ")"
        for field in fields(group):
            first, after = facts.span(field.expression)
            chars[first:after] = text[first:after]
            visit(field.expression)
            while chars[after] in "\r\n":  # (a field may go on on the next line)
                after += 1
            chars[after] = ","

    return Screen("".join(chars), tuples) if visit(module) else None


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
        self.tree, screen = parse_source(text, path)
        self.pos = Positions(text, screen and screen.text)
        self.respelled = screen.tuples if screen else []  # string groups ast saw as tuples (newer_grammar_screen)
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
