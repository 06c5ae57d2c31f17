"""What npu-migrate's built-in libcst codemods share, and how npu-migrate runs them.

Each built-in concern is a `NpuCodemod`: a libcst `VisitorBasedCodemodCommand` whose visit_/leave_
methods look at nodes and say what they change and what they leave, through the codemod context:
- `replace(original, new, rule)`, `insert_first_argument(call, ...)`, `append_keyword(call, ...)`
  record exact edits of the original text (npu-migrate composes every rule's edits, reports each
  change under its rule name and keeps everything else byte-for-byte; under libcst's own tool the
  codemod returns the module with its edits applied);
- `flag(node, Flag)` records a finding at file:line:col (and, under libcst's tool, prints a warning
  `line:col: severity kind: reason (suggestion)`).
The per-file facts several codemods need (text, positions, the import table, scopes, device and backend
flows) are computed once and kept in `context.scratch` (`FileFacts`), so the codemods run on one parse, in one read-only pass.

A codemod declares `FILES_CONTAINING` (words one of which a file must contain for it to concern the
codemod) and its `candidates(model)` in the file's `ast` model: the other files are not parsed by
libcst at all, and in the others only the top-level statements holding a candidate are (unless the
codemod is WHOLE_FILE).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import libcst as cst
import libcst.matchers as matchers
from libcst._nodes.internal import CodegenState
from libcst.codemod import Codemod, CodemodContext, VisitorBasedCodemodCommand

from npukit.migrate.codemods.scopes import Scopes, dotted_name
from npukit.migrate.model import Edit, Finding, TreeFacts
from npukit.migrate.pysource_model import (
    MigrationSyntaxError,
    Positions,
    apply_edits,
    drop_overlaps,
    newline_of,
)
from npukit.migrate.rules import Flag

_IMPORT_STATEMENT = re.compile(r"^[ \t]*import[ \t]+([\w. \t,]+)", re.MULTILINE)  # `import a.b as c, d`
FACTS_KEY = "npukit.file_facts"
EDITS_KEY = "npukit.builtin_edits"
BUILTIN_FINDINGS_KEY = "npukit.builtin_findings"
FROZEN_KEY = "npukit.frozen_spans"  # (start, end) offsets no rule may edit (the CUDA branch of dual-target code)


class CodemodResults(NamedTuple):
    """What the built-in codemods found in one file (offsets into its text)."""

    edits: list[Edit]
    findings: list[Finding]
    frozen: list[tuple[int, int]]


class Window(NamedTuple):
    """A run of whole lines of a file that libcst parses alone, for some of the codemods.
    nested: the lines are statements of an indented block, parsed as the body of a synthetic
    `if 1:` (their text and offsets unchanged, no dedent); suffix: text parsed after them (a header's
    synthetic body); codemods: the ones that run on it (None: every codemod concerned by the file)."""

    start: int
    end: int
    codemods: tuple | None = None
    nested: bool = False
    suffix: str = ""  # parsed after the lines: the synthetic body of a def or class header


NESTED_HEADER = "if 1:"  # what a nested window is parsed under (no scope, no docstring, no name)


class FileFacts:
    """One file's parse, text and positions, shared by every codemod run on it."""

    def __init__(self, path: str, module: cst.Module, text: str, tree: TreeFacts = TreeFacts(), *,
                 window: tuple[int, Positions, dict[str, str]] | None = None) -> None:
        """window: (offset, the whole file's positions, its import table) when `module` is a
        window of the file (some of its top-level statements) and not the whole of it."""
        self.path = path
        self.module = module
        self.tree = tree  # what the rest of the tree says (npu-migrate gathers it; empty under libcst's tool)
        self.offset = 0
        self.whole_file = window is None
        if window is None:
            self.positions = Positions(text)
        else:
            self.offset, self.positions, self.__dict__["bindings"] = window
        self._spans: dict[cst.CSTNode, tuple[int, int]] | None = None
        self.claimed: set[int] = set()  # ids of nodes a codemod deals with wholly: the name rules leave them
        self.chain_entries: dict[int, tuple | None] = {}  # id of a name chain -> the rule governing it (cuda_namespace)

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        """The node's syntactic extent as offsets into the text (libcst's PositionProvider extent)."""
        if self._spans is None:
            state = _SpanRecordingState(default_indent=self.module.default_indent,
                                        default_newline=self.module.default_newline)
            self.module._codegen(state)
            self._spans = state.spans
        start, end = self._spans[node]
        return start + self.offset, end + self.offset

    @functools.cached_property
    def bindings(self) -> dict[str, str]:
        """Local name -> the dotted name it was imported as (`import torch as th`: th -> torch;
        `from torch import cuda`: cuda -> torch.cuda), from every import of the file, the first one of
        a name winning; `torch` means torch even without an import unless the module binds the name.
        (A window is given its file's table: it may not hold the imports.)"""
        collector = _ImportTable()
        self.module.visit(collector)
        if "torch" not in collector.bindings and "torch" not in self.scopes.assigned[self.module]:
            collector.bindings["torch"] = "torch"
        return collector.bindings

    @functools.cached_property
    def scopes(self) -> Scopes:
        """Which scope binds each name and where names are read."""
        return Scopes(self.module)

    @functools.cached_property
    def retargets(self):
        """What becomes of the file's imports of torch.cuda (cuda_namespace.ImportRetargets)."""
        from npukit.migrate.codemods.cuda_namespace import ImportRetargets

        return ImportRetargets(self)

    @functools.cached_property
    def flows(self):
        """Which variables and attributes flow into device uses and backend arguments (device_values.Flows)."""
        from npukit.migrate.codemods.device_values import Flows

        return Flows(self)

    @functools.cached_property
    def local_signatures(self) -> dict[str, tuple[bool, ...]]:
        """Which positional parameters of this file's functions, methods and classes take a device
        (device_values.device_signatures of the whole file)."""
        from npukit.migrate.codemods.device_values import device_signatures

        return device_signatures(self.positions.text)

    @functools.cached_property
    def _reads(self) -> set[int]:
        return {id(name) for names in self.scopes.reads.values() for name in names}

    def is_read(self, name: cst.Name) -> bool:
        """A Name that reads a variable (ast's Load context): not a target, an attribute's name, a keyword ..."""
        return id(name) in self._reads

    def module_binding_reaches(self, receiver: cst.BaseExpression, module_names: set[str]) -> bool:
        """The receiver's root name is bound by `import x` (module_names: the names such statements
        bind) at this use, not rebound to a value first: the last binding of the name before the use,
        in the scope that defines it (a use in a nested scope of a name bound both ways cannot be
        decided: no)."""
        root = receiver
        while isinstance(root, cst.Attribute):
            root = root.value
        if not isinstance(root, cst.Name) or root.value not in module_names:
            return False
        scopes = self.scopes
        used_in = scopes.scope_of.get(root, scopes.module)
        scope = scopes.defining_scope(root.value, used_in)
        sites = self._binding_sites(root.value, scope)
        if all(is_import for _, is_import in sites):
            return True
        if used_in is not scope:
            return False
        line = self._line(root)
        before = [is_import for site_line, is_import in sites if site_line < line]
        return bool(before) and before[-1]

    def _binding_sites(self, name: str, scope: cst.CSTNode) -> list[tuple[int, bool]]:
        """(line, is an import) of every binding of `name` directly in `scope`, in source order."""
        scopes = self.scopes
        sites = [(0, False)] if name in scopes.parameters.get(scope, ()) else []
        sites += [(self._line(node), True) for node, names in scopes.imports
                  if scopes.scope_of[node] is scope and name in names]
        sites += [(self._line(node), False) for node in scopes.stores.get(name, ()) if scopes.scope_of[node] is scope]
        sites += [(self._line(node.name), False) for node in scopes.definitions
                  if node.name.value == name and scopes.scope_of[node] is scope]
        return sorted(sites)

    def _line(self, node: cst.CSTNode) -> int:
        return self.line_col(self.span(node)[0])[0]

    @property
    def torch_alias(self) -> str | None:
        """The name torch is imported as (`import torch as th`: th); `torch` when the file uses torch
        without importing it, as the import table assumes; None when the module binds `torch` itself."""
        return next((name for name, qualified in self.bindings.items() if qualified == "torch"), None)

    def names_torch(self, node: cst.CSTNode) -> bool:
        """Whether code written at `node` may say `torch` (its alias): an import statement of the file
        binds it, or the node already names it (a notebook cell, a snippet). Else `torch` would be a new
        name there (code that reaches torch only through `from torch import ...`)."""
        alias = self.torch_alias
        if alias is None:
            return False
        for match in _IMPORT_STATEMENT.finditer(self.positions.text):
            for part in match.group(1).split(","):
                words = part.split()
                if words and (words[-1] if len(words) == 3 and words[1] == "as" else words[0].split(".")[0]) == alias:
                    return True
        return bool(matchers.findall(node, matchers.Name(alias)))

    def replacement_text(self, node: cst.BaseExpression, new_qualified: str) -> str | None:
        """Source text for a name chain (`torch.x.y`, `alias.y`, `y`) so that it means new_qualified:
        through the chain's own root name when that already leads there (as the rewritten imports bind
        it: `retargets`), else through torch's alias (only where torch may be named: names_torch);
        torch_npu names are written out."""
        root = node
        while isinstance(root, cst.Attribute):
            root = root.value
        if isinstance(root, cst.Name):
            base = self.retargets.rebound.get(root.value, self.bindings.get(root.value))
            if base is not None and (new_qualified == base or new_qualified.startswith(base + ".")):
                return root.value + new_qualified[len(base):]
        top, _, rest = new_qualified.partition(".")
        if top == "torch" and self.names_torch(node):
            return f"{self.torch_alias}.{rest}" if rest else self.torch_alias
        if top == "torch_npu":
            return new_qualified
        return None

    def qualname(self, node: cst.BaseExpression) -> str | None:
        """The dotted name an expression refers to through the import table (`th.cuda.amp` ->
        torch.cuda.amp), or None (a local variable, a call, a subscript ...)."""
        if isinstance(node, cst.Name):
            return self.bindings.get(node.value)
        if isinstance(node, cst.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr.value}" if base is not None else None
        return None

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


class _ImportTable(cst.CSTVisitor):
    """The file's import bindings (see FileFacts.bindings)."""

    def __init__(self) -> None:
        self.bindings: dict[str, str] = {}

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            name = dotted_name(alias.name)
            local = alias.asname.name.value if alias.asname else name.split(".")[0]
            self.bindings.setdefault(local, name if alias.asname else local)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        module = dotted_name(node.module)
        for alias in node.names:
            local = alias.asname.name.value if alias.asname else dotted_name(alias.name)
            self.bindings.setdefault(local, f"{module}.{dotted_name(alias.name)}")


_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


def project_packages(filename: str) -> frozenset[str]:
    """Under libcst's tool, which gives no tree facts: the packages and modules importable from the
    folders between the file and its project's root (the first folder up holding .git,
    pyproject.toml, setup.py or setup.cfg) that are not packages themselves, i.e. the project's own
    code as absolute imports find it. Empty outside a project."""
    path = Path(filename).resolve()
    folders = []
    for folder in path.parents:
        folders.append(folder)
        if any((folder / marker).exists() for marker in _PROJECT_MARKERS):
            break
    else:
        return frozenset()
    names: set[str] = set()
    for folder in folders:
        if (folder / "__init__.py").exists():
            continue  # inside a package: not where absolute imports start (mamba_ssm/ops/triton is not `triton`)
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        names |= {entry.stem for entry in entries if entry.suffix == ".py" and entry.is_file()}
        names |= {entry.name for entry in entries if entry.is_dir() and (entry / "__init__.py").exists()}
    return frozenset(names - {"setup", "__init__"})


def called_name(func: cst.BaseExpression) -> str | None:
    """The name a call is made by: `f` for `f(...)`, `g` for `x.y.g(...)`."""
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


def split_arguments(call: cst.Call) -> tuple[list[cst.Arg], list[cst.Arg]]:
    """(positional arguments, `*args` among them; keyword arguments and `**kwargs`), ast's split."""
    positional = [arg for arg in call.args if not arg.keyword and arg.star != "**"]
    return positional, [arg for arg in call.args if arg.keyword or arg.star == "**"]


def keyword_names(keywords: list[cst.Arg]) -> set[str | None]:
    """The names of keyword arguments, None for `**kwargs` (ast's keyword.arg)."""
    return {arg.keyword.value if arg.keyword else None for arg in keywords}


class NpuCodemod(VisitorBasedCodemodCommand):
    """Base of the built-in codemods: node replacement with exact edits, findings, the pre-filter."""

    FILES_CONTAINING: tuple[str, ...] = ()  # a file without any of these does not concern the codemod
    RULES: tuple[str, ...] = ()  # the rewrite rules (rules.REWRITE_RULES) it writes

    def __init__(self, context: CodemodContext) -> None:
        # Codemod's part only: a built-in codemod always runs in _OnePass (under libcst's tool too), never in the
        # matcher-decoratable driver, whose set-up introspects the class at every construction (10-35 ms, once
        # per file and codemod, more than the rest of a small file's rewrite)
        Codemod.__init__(self, context)

    @classmethod
    def concerns(cls, code: str) -> bool:
        return not cls.FILES_CONTAINING or any(word in code for word in cls.FILES_CONTAINING)

    # False: the codemod decides from the statement it acts on and the file's imports alone, so
    # npu-migrate may give it only the statements that hold its candidates (CONTEXT says which)
    WHOLE_FILE = False

    # How much code around a candidate the codemod needs to decide on it (npu-migrate parses no less):
    # "statement": the innermost statement holding it (a compound statement whole when the candidate
    #   is in its header: an `if` test, a decorator, an `except` type, a parameter's annotation);
    # "function": the innermost def whose body holds it (its scope), the def whole;
    # "class": the innermost class holding it, whole;
    # "module": the top-level statement holding it (the safe default: what it sees of its scopes is
    #   all it would see of the module's).
    # Either way the file's import table is given; a name an enclosing function binds is not seen.
    CONTEXT = "module"

    @classmethod
    def context(cls, model, node) -> str:
        """The CONTEXT a candidate (a node of `candidates()`) needs; a codemod may ask more for some."""
        return cls.CONTEXT

    @classmethod
    def candidates(cls, model) -> list:
        """Inside npu-migrate: the nodes of the file's `ast` model (pysource_model.SourceModel, from the
        C parser, ~10x cheaper than libcst's parse) this codemod could act on. None spares the libcst
        parse; otherwise only the top-level statements holding them are parsed (all of the file for a
        WHOLE_FILE codemod). A necessary condition only: the codemod itself decides."""
        return [model.tree]

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        """Under libcst's own tool: the module with this codemod's edits applied (the bytes
        npu-migrate writes for them)."""
        code = tree.code
        if not self.concerns(code):
            return tree
        for key in (EDITS_KEY, BUILTIN_FINDINGS_KEY, FROZEN_KEY):
            self.context.scratch.pop(key, None)
        filename = self.context.filename
        self.facts = self.context.scratch[FACTS_KEY] = FileFacts(
            filename or "<module>", tree, code,
            TreeFacts(local_packages=project_packages(filename) if filename else frozenset()))
        _OnePass([self]).walk(tree)
        edits = drop_overlaps(sorted(self.context.scratch.get(EDITS_KEY, []), key=lambda e: (e.start, e.end)))
        return cst.parse_module(apply_edits(code, edits)) if edits else tree

    def _record(self, start: int, end: int, text: str, rule: str, needs_torch_npu: bool) -> None:
        line, col = self.facts.line_col(start)
        self.context.scratch.setdefault(EDITS_KEY, []).append(Edit(start, end, text, rule, line, col, needs_torch_npu))

    def insert_first_argument(self, call: cst.Call, text: str, rule: str, *, needs_torch_npu: bool = True,
                              before_unpacked: bool = False) -> None:
        """`f(...)` -> `f(text, ...)`; nothing when the first argument is `*args` (it may be the one),
        unless before_unpacked (the call being rewritten had no such parameter)."""
        positional, keywords = split_arguments(call)
        if positional:
            if positional[0].star and not before_unpacked:
                return
            at = self.facts.span(positional[0])[0]
            self._record(at, at, f"{text}, ", rule, needs_torch_npu)
        elif keywords:
            at = self.facts.span(keywords[0])[0]
            self._record(at, at, f"{text}, ", rule, needs_torch_npu)
        else:
            at = self._closing_parenthesis(call)
            self._record(at, at, text, rule, needs_torch_npu)

    def append_keyword(self, call: cst.Call, text: str, rule: str, *, needs_torch_npu: bool = True) -> None:
        """`f(a)` -> `f(a, text)`, after a trailing comma if there is one."""
        closing = self._closing_parenthesis(call)
        if call.args:
            # the last value in ast's order: positional arguments, then keywords
            positional, keywords = split_arguments(call)
            last_end = self.facts.span((positional + keywords)[-1].value)[1]
            tail = self.facts.positions.text[last_end:closing]
            if "," in tail:
                comma = last_end + tail.index(",") + 1
                self._record(comma, comma, f" {text},", rule, needs_torch_npu)
            else:
                self._record(last_end, last_end, f", {text}", rule, needs_torch_npu)
        else:  # before the `)`, after any line break or comment inside the parentheses
            self._record(closing, closing, text, rule, needs_torch_npu)

    def _closing_parenthesis(self, call: cst.Call) -> int:
        """The offset of the call's own `)` (its outer parentheses are outside its span)."""
        return self.facts.span(call)[1] - 1

    def freeze(self, start: int, end: int) -> None:
        """No rule edits the text between these offsets (inside npu-migrate; a codemod run alone
        under libcst's tool edits only what it edits itself)."""
        self.context.scratch.setdefault(FROZEN_KEY, []).append((start, end))

    def claim(self, node: cst.CSTNode) -> None:
        """`node` is this codemod's wholly: the name rules (CudaNamespace, UnsupportedApis) leave it."""
        self.facts.claimed.add(id(node))

    def rewrite_name(self, node: cst.BaseExpression, new_qualified: str, rule: str) -> bool:
        """A name chain (`torch.cuda.x`, `alias.x`, `x`) rewritten to mean new_qualified
        (FileFacts.replacement_text); False where it cannot be written."""
        text = self.facts.replacement_text(node, new_qualified)
        if text is None:
            return False
        # torch.OutOfMemoryError needs no torch_npu
        needs_torch_npu = new_qualified.startswith(("torch.npu", "torch_npu")) or rule != "cuda-renamed"
        self.replace_with_text(node, text, rule, needs_torch_npu=needs_torch_npu)
        return True

    def replace(self, original: cst.CSTNode, new: cst.CSTNode, rule: str, *, needs_torch_npu: bool = True) -> cst.CSTNode:
        """`original` becomes `new`: the node to return from a leave_ method, and the edit recorded."""
        start, end = self.facts.span(original)
        self._record(start, end, self.facts.module.code_for_node(new), rule, needs_torch_npu)
        return new

    def replace_with_text(self, original: cst.CSTNode, text: str, rule: str, *, needs_torch_npu: bool = True) -> None:
        """`original`'s source becomes `text` (for code that is more than one node, such as two statements)."""
        start, end = self.facts.span(original)
        self._record(start, end, text, rule, needs_torch_npu)

    def flag(self, node: cst.CSTNode, flag: Flag, *, reason: str | None = None, end_line: int | None = None) -> None:
        """`node` is reported, not (or not only) rewritten; end_line: the last line of the code the
        finding is about, when it is more than the node's first."""
        line, col = self.facts.line_col(self.facts.span(node)[0])
        col = self.facts.byte_column(line, col)
        reason = reason or flag.reason
        finding = Finding(self.facts.path, line, col, flag.kind, flag.severity,
                          self.facts.positions.line_text(line).strip(), reason, flag.suggestion,
                          end_line=end_line if end_line is not None and end_line > line else None)
        self.context.scratch.setdefault(BUILTIN_FINDINGS_KEY, []).append(finding)
        self.warn(f"{line}:{col}: {flag.severity} {flag.kind}: {reason} ({flag.suggestion})")


def run_builtin_codemods(text: str, path: str, codemods: tuple[type[NpuCodemod], ...],
                         tree: TreeFacts = TreeFacts(), *, windows: list[tuple[int, int]] | None = None,
                         bindings: dict[str, str] | None = None, context: CodemodContext | None = None) -> CodemodResults:
    """The edits (offsets into `text`) and findings of the built-in codemods that concern this file:
    one parse, one position pass, one traversal for them all. windows: `Window`s, or (start, end)
    offsets of runs of whole top-level statements, parsed alone instead of the file (the file's
    import table, `bindings`, is then given: a window does not hold every import). context: where the
    codemods leave what else they tell (its scratch), a new one if not given."""
    concerned = [codemod for codemod in codemods if codemod.concerns(text)]
    if not concerned:
        return CodemodResults([], [], [])
    context = context or CodemodContext(filename=path)
    whole_file = Positions(text)
    for window in windows or [(0, len(text))]:
        window = Window(*window)
        start, end = window.start, window.end
        header = NESTED_HEADER + newline_of(text[start:end]) if window.nested else ""
        piece = header + text[start:end] + window.suffix
        try:
            module = cst.parse_module(piece)
        except cst.ParserSyntaxError as exc:
            line = whole_file.text.count("\n", 0, start) + exc.raw_line - header.count("\n")
            raise MigrationSyntaxError(f"does not parse as Python 3 for libcst (line {line}: {exc.message})") from None
        facts_window = None if windows is None else (start - len(header), whole_file, bindings)
        facts = context.scratch[FACTS_KEY] = FileFacts(path, module, piece, tree, window=facts_window)
        instances = [codemod_class(context) for codemod_class in concerned
                     if window.codemods is None or codemod_class in window.codemods]
        for codemod in instances:
            codemod.facts = facts
        _OnePass(instances).walk(module)
    scratch = context.scratch
    return CodemodResults(scratch.get(EDITS_KEY, []), scratch.get(BUILTIN_FINDINGS_KEY, []), scratch.get(FROZEN_KEY, []))


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

    def walk(self, node: cst.CSTNode) -> None:
        """The pass over `node`'s tree, in libcst's visiting order, without libcst's visit: that rebuilds
        every node it passes (a visitor's too), two thirds of the pass's cost."""
        visits, leaves = self._handlers(type(node))
        for handler in visits:
            handler(node)
        for child in _children(node):
            self.walk(child)
        for handler in leaves:
            handler(node, node)

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


_VISITED_FIELD = re.compile(r"visit_(?:required|optional|sequence|sentinel|body_sequence|iterable|body_iterable)"
                            r"\(\s*self,\s*\"(\w+)\"")
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _children(node: cst.CSTNode):
    """The nodes directly in `node`, in the order libcst's visit goes (its _visit_and_replace_children
    names the fields in that order)."""
    kind = type(node)
    fields = _CHILD_FIELDS.get(kind)
    if fields is None:
        visited = _VISITED_FIELD.findall(inspect.getsource(kind._visit_and_replace_children))
        fields = _CHILD_FIELDS[kind] = tuple(dict.fromkeys([*visited, *(f.name for f in dataclasses.fields(kind))]))
    for name in fields:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, cst.CSTNode):
                    yield item
