"""What npu-migrate's built-in libcst codemods share, and how npu-migrate runs them.

Each built-in concern is a `NpuCodemod`: a libcst `VisitorBasedCodemodCommand` that rewrites its
nodes and says what it did and what it left, through the codemod context:
- `replace(original, new, rule)` returns the new node (libcst's own tool writes it) and records the
  exact edit of the original text (npu-migrate composes every rule's edits, reports each change
  under its rule name and keeps everything else byte-for-byte);
- `flag(node, Flag)` records a finding at file:line:col (and, under libcst's tool, prints a warning
  `line:col: severity kind: reason (suggestion)`).
The per-file facts several codemods need are computed once and kept in `context.scratch`
(`file_facts`), so codemods run one after the other on one parse, with one position pass.

A codemod declares `FILES_CONTAINING` (words one of which a file must contain for the codemod to
concern it): the other files are not parsed for it, as for users' codemods.
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst._nodes.internal import CodegenState
from libcst.metadata import MetadataWrapper

from npukit.migrate.model import Edit, Finding
from npukit.migrate.pysource_model import MigrationSyntaxError, Positions
from npukit.migrate.rules import Flag

FACTS_KEY = "npukit.file_facts"
EDITS_KEY = "npukit.builtin_edits"
BUILTIN_FINDINGS_KEY = "npukit.builtin_findings"


class FileFacts:
    """One file's parse, text and positions, shared by every codemod run on it."""

    def __init__(self, path: str, module: cst.Module, text: str) -> None:
        self.path = path
        self.module = module
        self.positions = Positions(text)
        self._spans: dict[cst.CSTNode, tuple[int, int]] | None = None

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        """The node's syntactic extent as offsets into the text (libcst's PositionProvider extent)."""
        if self._spans is None:
            state = _SpanRecordingState(default_indent=self.module.default_indent,
                                        default_newline=self.module.default_newline)
            self.module._codegen(state)
            self._spans = state.spans
        return self._spans[node]

    def line_col(self, offset: int) -> tuple[int, int]:
        """(1-based line, 1-based column in characters) of an offset."""
        line = bisect.bisect_right(self.positions.line_starts, offset)
        return line, offset - self.positions.line_starts[line - 1] + 1

    def byte_column(self, line: int, column: int) -> int:
        """A 1-based column as ast counts it (UTF-8 bytes), which every finding of the report uses."""
        line_text = self.positions.line_text(line)
        return column if line_text.isascii() else len(line_text[:column - 1].encode("utf-8")) + 1


@dataclass
class _SpanRecordingState(CodegenState):
    """Code generation that only counts characters and notes each node's (start, end) offsets: the
    extents libcst's PositionProvider gives, at a quarter of its cost (no line/column objects)."""

    length: int = 0
    spans: dict = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.starts.append(self.length)

    def after_codegen(self, node: cst.CSTNode) -> None:  # nodes without a syntactic extent: the whole
        start = self.starts.pop()
        if node not in self.spans:
            self.spans[node] = (start, self.length)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self.length += len(value)

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        self.length += sum(map(len, self.indent_tokens))

    def pop_trailing_newline(self) -> None:
        if self.tokens:
            self.length -= len(self.tokens.pop())

    @contextmanager
    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        start = self.length
        yield
        self.spans[node] = (self.spans[start_node][0] if start_node is not None else start,
                            self.spans[end_node][1] if end_node is not None else self.length)


def file_facts(context: CodemodContext, module: cst.Module) -> FileFacts:
    facts = context.scratch.get(FACTS_KEY)
    if facts is None or facts.module is not module:
        facts = FileFacts(context.filename or "<module>", module, module.code)
        context.scratch[FACTS_KEY] = facts
    return facts


class NpuCodemod(VisitorBasedCodemodCommand):
    """Base of the built-in codemods: node replacement with exact edits, findings, the pre-filter."""

    FILES_CONTAINING: tuple[str, ...] = ()  # a file without any of these does not concern the codemod
    RULES: tuple[str, ...] = ()  # the rewrite rules (rules.REWRITE_RULES) it writes

    @classmethod
    def concerns(cls, code: str) -> bool:
        return not cls.FILES_CONTAINING or any(word in code for word in cls.FILES_CONTAINING)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        code = tree.code
        if not self.concerns(code):
            return tree
        self.facts = file_facts(self.context, tree)
        return tree.visit(self)

    def replace(self, original: cst.CSTNode, new: cst.CSTNode, rule: str, *, needs_torch_npu: bool = True) -> cst.CSTNode:
        """`original` becomes `new`: the node to return from a leave_ method, and the edit recorded."""
        start, end = self.facts.span(original)
        line, col = self.facts.line_col(start)
        edit = Edit(start, end, self.facts.module.code_for_node(new), rule, line, col, needs_torch_npu)
        self.context.scratch.setdefault(EDITS_KEY, []).append(edit)
        return new

    def flag(self, node: cst.CSTNode, flag: Flag, *, reason: str | None = None) -> None:
        """`node` is reported, not (or not only) rewritten."""
        line, col = self.facts.line_col(self.facts.span(node)[0])
        col = self.facts.byte_column(line, col)
        reason = reason or flag.reason
        finding = Finding(self.facts.path, line, col, flag.kind, flag.severity,
                          self.facts.positions.line_text(line).strip(), reason, flag.suggestion)
        self.context.scratch.setdefault(BUILTIN_FINDINGS_KEY, []).append(finding)
        self.warn(f"{line}:{col}: {flag.severity} {flag.kind}: {reason} ({flag.suggestion})")


def run_builtin_codemods(text: str, path: str, codemods: tuple[type[NpuCodemod], ...]) -> tuple[list[Edit], list[Finding]]:
    """The edits (offsets into `text`) and findings of the built-in codemods that concern this file:
    one parse of the original text, one position pass, one traversal for them all."""
    concerned = [codemod for codemod in codemods if codemod.concerns(text)]
    if not concerned:
        return [], []
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise MigrationSyntaxError(f"does not parse as Python 3 for libcst (line {exc.raw_line}: {exc.message})") from None
    context = CodemodContext(filename=path, wrapper=MetadataWrapper(module, unsafe_skip_copy=True))
    facts = context.scratch[FACTS_KEY] = FileFacts(path, module, text)
    instances = [codemod_class(context) for codemod_class in concerned]
    for codemod in instances:
        codemod.facts = facts
    module.visit(_OnePass(instances))
    return context.scratch.get(EDITS_KEY, []), context.scratch.get(BUILTIN_FINDINGS_KEY, [])


class _OnePass(cst.CSTVisitor):
    """Calls the codemods' visit_X / leave_X methods in one read-only traversal. libcst's own driver
    (the matcher-decoratable transformer) rebuilds the tree and looks up handlers for every node and
    attribute: 5x the cost of this pass, for edits npu-migrate records itself. Built-in codemods
    therefore see every node (their visit_ methods return None) and use matchers inside handlers."""

    def __init__(self, codemods: list[NpuCodemod]) -> None:
        self.codemods = codemods
        self.handlers: dict[type, tuple[list, list]] = {}

    def _handlers(self, node_type: type) -> tuple[list, list]:
        found = self.handlers.get(node_type)
        if found is None:
            name = node_type.__name__
            found = ([getattr(c, f"visit_{name}") for c in self.codemods if hasattr(c, f"visit_{name}")],
                     [getattr(c, f"leave_{name}") for c in self.codemods if hasattr(c, f"leave_{name}")])
            self.handlers[node_type] = found
        return found

    def on_visit(self, node: cst.CSTNode) -> bool:
        for handler in self._handlers(type(node))[0]:
            handler(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        for handler in self._handlers(type(original_node))[1]:
            handler(original_node, original_node)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass
