"""Nothing silent: after the rules ran, every CUDA use still in the code is rewritten or reported.

Rules decide what to rewrite; this codemod checks their result. In the codemods' pass it lists the
CUDA uses of the code (`x.cuda()`, `.is_cuda`, `torch.cuda.*` and other CUDA-named torch APIs,
"cuda"/"nccl" device and backend strings, CUDA/NCCL env var names, nvidia-smi, torch APIs whose
device defaults to CUDA, CUDA-only libraries) and the conditions of the code; once the edits of
every rule are composed, `audit` keeps the uses that survive into the output: a use survives when no
edit touches its span (edits replace exact spans, so an untouched span is byte-identical in the
output, and edits never write CUDA spellings). A surviving use that no finding reports on its line
gets a `cuda-leftover` finding. Comments, docstrings, log/print/raise/help text and user
identifiers (`args.cuda`, `use_cuda`) are not uses.

A condition that mixes rewritten CUDA checks with a CUDA call that has no NPU answer (a finding of
a LEFT_AS_CUDA kind: `not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8`)
is kept whole: half-migrated, it would crash on every host instead of taking its no-CUDA branch.
So is a statement whose rewritten CUDA check guards such a call (`if torch.cuda.is_available():
cap = torch.cuda.get_device_capability()`: `mixed-guard`): the guard would let it run on the NPU.

Under libcst's own tool the codemod audits what that run's codemods recorded (alone: every CUDA use
of the file is reported); it never edits.
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import tokenize
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext

from npukit.migrate import rules
from npukit.migrate.codemods.base import (
    BUILTIN_FINDINGS_KEY,
    EDITS_KEY,
    FROZEN_KEY,
    NpuCodemod,
    _children,
    called_name,
    run_builtin_codemods,
    split_arguments,
)
from npukit.migrate.codemods.cuda_namespace import RETARGETED_KEY
from npukit.migrate.codemods.default_devices import lacks_device_argument
from npukit.migrate.codemods.scopes import BindingTargets, assigned_targets
from npukit.migrate.codemods.strings import StringPlaces, literal_string
from npukit.migrate.codemods.third_party import imported_dotted_names
from npukit.migrate.model import Edit, Finding
from npukit.migrate.pysource_model import (
    Positions,
    drop_overlaps,
    imported_names,
    last_name,
    string_expression,
    string_value,
)
from npukit.migrate.rules import third_party_flag

AUDIT_KEY = "npukit.audit"  # what the audit collected in the pass (an _Audit)

# findings about a CUDA call that stays in the code (no NPU answer): a condition holding one is kept whole
LEFT_AS_CUDA = frozenset({"device-capability", "device-properties", "no-equivalent", "unknown-cuda-api",
                           "version-gate", "ambiguous-cuda"})
LEFTOVER = "cuda-leftover"

_CUDA_SEGMENT = re.compile(r"cuda|cudnn|nccl|nvtx", re.IGNORECASE)
_CUDA_ENV = re.compile(r"(TORCH_)?(CUDA|NCCL|CUBLAS|CUDNN|CUBLASLT|NVIDIA|PYTORCH_CUDA)_[A-Z0-9_]+\Z|PYTORCH_ALLOC_CONF\Z")
# a torch CUDA name in a string: a mock.patch / monkeypatch target, a module name compared
_CUDA_DOTTED_NAME = re.compile(r"torch\.(cuda|backends\.cudnn|backends\.cuda)(\.\w+)*")
_MAYBE_CUDA_STRING = re.compile(r"cuda|nccl|CUDA|NCCL|CUBLAS|CUDNN|NVIDIA|ALLOC_CONF|nvidia")
_TEXT_KEYWORDS = frozenset({"help", "description", "epilog", "msg", "message", "reason", "doc", "usage", "metavar"})
_TEXT_CALLS = rules.LOG_CALLS | {"warn", "print", "RuntimeError", "ValueError"}
_FLAG_RECEIVERS = frozenset({"args", "opt", "opts", "cfg", "config", "conf", "flags", "FLAGS", "hparams", "hp",
                             "options", "params", "settings", "self", "cls"})
_CUDA_DEFAULTING_NAMES = frozenset(name.rsplit(".", 1)[1] for name in rules.CUDA_DEFAULT_DEVICE_APIS)
_LEFTOVER_SUGGESTION = ("if it is a device use, change it to the NPU spelling (.npu(), 'npu', torch.npu.X, 'hccl'); "
                        "if it must stay CUDA, make sure it is never reached on an NPU host")
_MIXED_CONDITION = rules.Flag(
    "mixed-condition", "error",
    "this condition combines CUDA checks that have an NPU answer with a CUDA call that has none; "
    "rewriting only part of it would crash on every host, so it was left as it was: on an NPU host "
    "torch.cuda.is_available() is False and the condition takes its no-CUDA branch",
    "rewrite the whole condition by hand with an NPU feature test (e.g. torch.npu.is_available() and "
    "torch.npu.is_bf16_supported() instead of a compute-capability check)")
_GUARD_KEPT = rules.Flag(
    "mixed-guard", "error",
    "this statement's CUDA check guards a CUDA call that has no NPU answer (reported inside it); rewriting "
    "the check alone would run that call on every NPU host and crash, so the whole statement was left as "
    "it was: on an NPU host torch.cuda.is_available() is False and it takes its no-CUDA path, as the "
    "original did on any host without CUDA",
    "rewrite the guarded code by hand with an NPU answer (e.g. torch.npu.is_bf16_supported() instead of a "
    "compute-capability check), then the check itself")

# the kinds of CUDA use, in the order the audit weighs the uses of one line (the first unreported one is reported)
_METHOD, _CHAIN, _NAME_CHAIN, _STRING, _FSTRING, _CALL, _IMPORT = range(7)


def is_cuda_string(value: str) -> bool:
    """A string value that is a CUDA use where it is code: a device or backend, an env var name, a
    nvidia-smi command line, a torch CUDA module name."""
    return len(value) <= 200 and bool(_MAYBE_CUDA_STRING.search(value)) and bool(
        rules.DEVICE_TEMPLATE.match(value) or value.startswith("cuda:") or rules.BACKEND_VALUE.match(value)
        or _CUDA_ENV.match(value) or value.lstrip().startswith("nvidia-smi") or _CUDA_DOTTED_NAME.fullmatch(value))


def is_cuda_fstring_start(first: str | None) -> bool:
    """The literal text an f-string starts with makes it a CUDA use ("cuda:{rank}", "nvidia-smi ...")."""
    return first is not None and (first.startswith("cuda") or first.lstrip().startswith("nvidia-smi"))


def is_cuda_named(qualified: str | None) -> bool:
    """A torch name with a CUDA-named part: torch.cuda.X, torch.backends.cudnn.X, ...Backend.NCCL."""
    return qualified is not None and (qualified == "torch" or qualified.startswith("torch.")) and \
        any(_CUDA_SEGMENT.search(part) for part in qualified.split(".")[1:])


def _ast_chain(model, node: ast.AST) -> ast.AST:
    """The outermost name chain of the file's `ast` model that node is part of."""
    up = model.parent.get(id(node))
    while isinstance(up, ast.Attribute) and up.value is node:
        node, up = up, model.parent.get(id(up))
    return node


@dataclass
class _Use:
    kind: int
    start: int  # where the finding goes (the use's node)
    span: tuple[int, int]  # what an edit must touch for the use to be gone
    what: str
    node: cst.CSTNode
    facts: object  # the FileFacts of its window
    root: str | None = None  # a name chain's root name (the imports' rewrite may rebind it)


@dataclass
class _Audit:
    """What the audit collected over a file's windows (offsets into the whole file)."""

    path: str
    positions: Positions
    uses: list[_Use]
    # (FileFacts, node): their spans are only needed around a LEFT_AS_CUDA finding
    conditions: list[tuple[object, cst.CSTNode]]  # boolean operations and `not`
    conditional_tests: list[tuple[object, cst.CSTNode]]  # the tests of `a if test else b`
    statement_tests: list[tuple[object, cst.CSTNode]]  # the tests of if / elif / while / assert
    # if / while statements and `a if test else b`: a CUDA call left in what their test guards keeps them whole
    guards: list[tuple[object, cst.CSTNode]] = field(default_factory=list)


class CudaLeftovers(BindingTargets, StringPlaces, NpuCodemod):
    """The audit (see the module docstring): every CUDA use left in the code is reported
    (`cuda-leftover`) and a condition mixing rewritten CUDA checks with a CUDA call left as it is
    stays whole (`mixed-condition`). It runs after the rewriting codemods, on what they recorded."""

    DESCRIPTION = "the audit: every CUDA use no rule rewrote or reported is reported (cuda-leftover)"
    # a use, whether it is message text, and the condition around it are all in its statement
    CONTEXT = "statement"

    @classmethod
    def candidates(cls, model) -> list:
        """The CUDA uses of the file's `ast` model, by the audit's own tests short of where a string is
        (text or code): the top-level statements holding them are the ones to audit."""
        found = [node for node in model.attributes if node.attr in ("cuda", "is_cuda") or (
            _CUDA_SEGMENT.search(node.attr) and is_cuda_named(model.qualname(_ast_chain(model, node))))]
        found += [use for name, uses in model.loads.items() if _CUDA_SEGMENT.search(model.bindings.get(name, ""))
                  for use in uses if is_cuda_named(model.qualname(_ast_chain(model, use)))]
        found += [node for node in model.strings if id(node) not in model.docstrings and is_cuda_string(node.value)]
        found += [node for node in model.fstrings if node.values and is_cuda_fstring_start(string_value(node.values[0]))]
        found += [call for call in model.calls if last_name(call.func) in _CUDA_DEFAULTING_NAMES]
        local = model.facts.local_packages
        found += [node for node in model.imports
                  if any(third_party_flag(name, local) is not None for name in imported_names(node))]
        return found

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        """Under libcst's own tool: the pass, then the audit of what this run recorded (warnings only)."""
        self.context.scratch.pop(AUDIT_KEY, None)
        super().transform_module_impl(tree)
        scratch = self.context.scratch
        if AUDIT_KEY in scratch:
            edits = drop_overlaps(sorted(scratch.get(EDITS_KEY, []), key=lambda e: (e.start, e.end)))
            _, found = audit(scratch, edits, scratch.get(BUILTIN_FINDINGS_KEY, []), scratch.get(FROZEN_KEY, []))
            for finding in found:
                self.warn(f"{finding.line}:{finding.col}: {finding.severity} {finding.kind}: {finding.reason}"
                          f" ({finding.suggestion})")
        return tree

    # ------------------------------------------------------------------ the pass
    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        facts = self.facts
        state = self.context.scratch.get(AUDIT_KEY)
        if state is None:
            state = self.context.scratch[AUDIT_KEY] = _Audit(facts.path, facts.positions, [], [], [], [])
        self.state = state
        self.inner: set[int] = set()  # attributes' values: not the outermost part of a name chain
        self.not_read: set[int] = set()  # attributes' and keywords' names (the cheap part of FileFacts.is_read)
        self.called: set[int] = set()  # the callees of calls
        self.targets: set[int] = set()  # attributes assigned or deleted
        self.parts: set[int] = set()  # the literals of an implicit concatenation
        self.import_depth = 0
        self.message_depth = 0  # inside a print/log/warning call, a raise, or a help=/msg= ... argument
        self.assert_message: cst.BaseExpression | None = None

    def _bind(self, target: cst.CSTNode, deleted: bool) -> None:
        self.targets.update(id(node) for node in assigned_targets(target) if isinstance(node, cst.Attribute))

    def _use(self, kind: int, node: cst.CSTNode, span: tuple[int, int], what: str, root: str | None = None) -> None:
        self.state.uses.append(_Use(kind, self.facts.span(node)[0], span, what, node, self.facts, root))

    def _text(self, node: cst.CSTNode) -> str:
        start, end = self.facts.span(node)
        return self.facts.positions.text[start:end]

    def _is_message(self, node: cst.CSTNode) -> bool:
        if self.message_depth:
            return True
        if self.assert_message is None:
            return False
        start, end = self.facts.span(node)
        message = self.facts.span(self.assert_message)
        return message[0] <= start and end <= message[1]

    def visit_Import(self, node: cst.Import) -> None:
        self.import_depth += 1
        self._import(node)

    def leave_Import(self, original_node: cst.Import, updated_node: cst.Import) -> cst.Import:
        self.import_depth -= 1
        return updated_node

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self.import_depth += 1
        self._import(node)

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        self.import_depth -= 1
        return updated_node

    def _import(self, node: cst.Import | cst.ImportFrom) -> None:
        local = self.facts.tree.local_packages
        for name in imported_dotted_names(node):
            if third_party_flag(name, local) is not None:
                self._use(_IMPORT, node, self.facts.span(node), f"the CUDA-only import of {name}")
                return

    def visit_Call(self, node: cst.Call) -> None:
        super().visit_Call(node)
        self.called.add(id(node.func))
        name = called_name(node.func)
        if name in _TEXT_CALLS:
            self.message_depth += 1
        if name in _CUDA_DEFAULTING_NAMES:
            qualified = self.facts.qualname(node.func)
            if qualified in rules.CUDA_DEFAULT_DEVICE_APIS and \
                    lacks_device_argument(node, qualified, starred_may_give_it=False):
                self._use(_CALL, node, (self.facts.span(node.func)[1], self.facts.span(node)[1]),
                          f"`{self._text(node.func)}(...)` without a device (it defaults to CUDA)")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if called_name(original_node.func) in _TEXT_CALLS:
            self.message_depth -= 1
        return super().leave_Call(original_node, updated_node)

    def visit_Raise(self, node: cst.Raise) -> None:
        super().visit_Raise(node)
        self.message_depth += 1

    def leave_Raise(self, original_node: cst.Raise, updated_node: cst.Raise) -> cst.Raise:
        self.message_depth -= 1
        return super().leave_Raise(original_node, updated_node)

    def visit_Arg(self, node: cst.Arg) -> None:
        self.not_read.add(id(node.keyword))
        if node.keyword is not None and node.keyword.value in _TEXT_KEYWORDS:
            self.message_depth += 1

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if original_node.keyword is not None and original_node.keyword.value in _TEXT_KEYWORDS:
            self.message_depth -= 1
        return updated_node

    # ------------------------------------------------------------------ conditions
    def visit_Assert(self, node: cst.Assert) -> None:
        self.state.statement_tests.append((self.facts, node.test))
        self.assert_message = node.msg

    def leave_Assert(self, original_node: cst.Assert, updated_node: cst.Assert) -> cst.Assert:
        self.assert_message = None
        return updated_node

    def visit_If(self, node: cst.If) -> None:
        self.state.statement_tests.append((self.facts, node.test))
        self.state.guards.append((self.facts, node))

    def visit_While(self, node: cst.While) -> None:
        self.state.statement_tests.append((self.facts, node.test))
        self.state.guards.append((self.facts, node))

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.state.conditional_tests.append((self.facts, node.test))
        self.state.guards.append((self.facts, node))

    def visit_BooleanOperation(self, node: cst.BooleanOperation) -> None:
        self.state.conditions.append((self.facts, node))

    def visit_UnaryOperation(self, node: cst.UnaryOperation) -> None:
        if isinstance(node.operator, cst.Not):
            self.state.conditions.append((self.facts, node))

    # ------------------------------------------------------------------ names
    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.inner.add(id(node.value))
        self.not_read.add(id(node.attr))
        if self.import_depth:
            return
        attr = node.attr.value
        if attr == "is_cuda" and id(node) not in self.targets:
            self._use(_METHOD, node, self._attr_span(node), f"`{self._text(node)}`")
        elif attr == "cuda" and id(node) not in self.targets and self._is_method_reference(node):
            called = id(node) in self.called
            if called or not (isinstance(node.value, cst.Name) and node.value.value in _FLAG_RECEIVERS):
                self._use(_METHOD, node, self._attr_span(node), f"`{self._text(node)}{'()' if called else ''}`")
        if id(node) not in self.inner:
            self._chain(node)

    def visit_Name(self, node: cst.Name) -> None:
        if not self.import_depth and id(node) not in self.inner and id(node) not in self.not_read and \
                _CUDA_SEGMENT.search(self.facts.bindings.get(node.value, "")) and self.facts.is_read(node):
            self._chain(node)

    def _chain(self, node: cst.BaseExpression) -> None:
        """An outermost name chain (`torch.cuda.x`, `cudnn.benchmark`) naming a CUDA part of torch."""
        qualified = self.facts.qualname(node)
        if not is_cuda_named(qualified):
            return
        root = node
        named_by_attribute = False
        while isinstance(root, cst.Attribute):
            named_by_attribute = named_by_attribute or bool(_CUDA_SEGMENT.search(root.attr.value))
            root = root.value
        self._use(_CHAIN if named_by_attribute else _NAME_CHAIN, node, self.facts.span(node), f"`{self._text(node)}`",
                  root.value)

    def _is_method_reference(self, node: cst.Attribute) -> bool:
        """`x.cuda` that is not a module attribute (torch.cuda: a chain; numba.cuda: a CUDA-only import)."""
        qualified = self.facts.qualname(node)
        if qualified is None:
            return True
        return not (qualified.startswith("torch.cuda") or
                    third_party_flag(qualified, self.facts.tree.local_packages) is not None)

    def _attr_span(self, node: cst.Attribute) -> tuple[int, int]:
        _, end = self.facts.span(node)
        return end - len(node.attr.value), end

    # ------------------------------------------------------------------ strings
    def visit_ConcatenatedString(self, node: cst.ConcatenatedString) -> None:
        super().visit_ConcatenatedString(node)
        if id(node) in self.parts:
            self.parts.update((id(node.left), id(node.right)))
            return
        self.parts.update((id(node.left), id(node.right)))
        if node.evaluated_value is None:  # an f-string among its literals
            self._fstring(node)
        else:
            self._string(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if id(node) not in self.parts:
            self._string(node)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if id(node) not in self.parts:
            self._fstring(node)

    def _string(self, node: cst.SimpleString | cst.ConcatenatedString) -> None:
        if id(node) in self._not_code:
            return
        if isinstance(node, cst.SimpleString) and "\\" not in node.value and not _MAYBE_CUDA_STRING.search(node.value):
            return  # (the value is spelled in the literal)
        value = literal_string(node)
        if value is not None and is_cuda_string(value) and not self._is_message(node):
            self._use(_STRING, node, self.facts.span(node), f"the string {self._text(node)}")

    def _fstring(self, node: cst.BaseExpression) -> None:
        literals = [part.value for part in _string_parts(node) if isinstance(part, (cst.SimpleString, cst.FormattedStringText))]
        if not any("\\" in text or "cuda" in text or "nvidia-smi" in text for text in literals):
            return  # (no literal of it could start it with those)
        text = self._text(node)
        joined = string_expression(text)  # the literal text it starts with, as Python reads it
        values = joined.values if isinstance(joined, ast.JoinedStr) else None
        if values and is_cuda_fstring_start(string_value(values[0])) and not self._is_message(node):
            self._use(_FSTRING, node, self.facts.span(node), f"the string {text}")


def _string_parts(node: cst.BaseExpression):
    """The literals of a (concatenated) f-string and the pieces of its f-strings."""
    if isinstance(node, cst.ConcatenatedString):
        yield from _string_parts(node.left)
        yield from _string_parts(node.right)
    elif isinstance(node, cst.FormattedString):
        yield from node.parts
    else:
        yield node


_UNPARSED = rules.Flag(
    "cuda-unparsed", "warning", "",
    "migrate this line by hand (.cuda() -> .npu(), torch.cuda -> torch.npu, 'cuda' -> 'npu', 'nccl' -> 'hccl'), "
    "or make the file parse and run npu-migrate again")
_CUDA_NAMES = frozenset({"cuda", "cudnn", "is_cuda", "nccl"})  # attributes and imported names
_STRING_PREFIX = re.compile(r"[A-Za-z]*")


def unparsed_cuda_uses(text: str, path: str) -> list[Finding]:
    """The CUDA uses of a Python file no grammar reads, one finding per line, from its tokens: `.cuda`
    / `.is_cuda` / `.cudnn` / `.nccl` names and CUDA strings (devices, backends, env var names; an
    f-string starting "cuda"). Comments and message text are not uses. Nothing in such a file is
    rewritten, so each needs a human."""
    found: dict[int, Finding] = {}
    lines = text.splitlines()
    for line, col, what in _cuda_tokens(text, names=True):
        if line not in found:
            found[line] = Finding(path, line, col + 1, _UNPARSED.kind, _UNPARSED.severity, lines[line - 1].strip(),
                                  f"{what} is a CUDA use in a file npu-migrate could not parse: it was not rewritten",
                                  _UNPARSED.suggestion)
    return list(found.values())


def hidden_cuda_strings(positions: Positions, spans: list[tuple[int, int]], path: str) -> list[Finding]:
    """The CUDA strings inside string groups ast could not be given as strings (respelled as tuples:
    pysource_model.newer_grammar_screen), one finding each: the codemods never saw them."""
    found = []
    for start, end in spans:
        first = _line_of(positions, start)
        indent = start - positions.line_starts[first - 1]
        for line, col, what in _cuda_tokens(positions.text[start:end], names=False):
            found.append(Finding(path, first + line - 1, col + 1 + (indent if line == 1 else 0), _UNPARSED.kind,
                                 _UNPARSED.severity, positions.line_text(first + line - 1).strip(),
                                 f"{what} is a CUDA use inside an f-string only a newer Python reads, which "
                                 "npu-migrate could not read: it was not rewritten", _UNPARSED.suggestion))
    return found


def _cuda_tokens(text: str, *, names: bool):
    """(line, 0-based column, description) of the CUDA names (with names) and strings among the
    tokens of text, up to where it stops tokenizing."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            what = None
            if names and token.type == tokenize.NAME and token.string in _CUDA_NAMES:
                what = f"`{token.string}`"
            elif token.type == tokenize.STRING:
                what = _cuda_string_token(token.string)
            if what is not None:
                yield token.start[0], token.start[1], what
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return  # (the tokens up to where the text stops making sense were read)


def _cuda_string_token(literal: str) -> str | None:
    """`the string ...` when a string token is a CUDA use (is_cuda_string, is_cuda_fstring_start)."""
    prefix = _STRING_PREFIX.match(literal).group().lower()
    body = literal[len(prefix):]
    quote = 3 if body[:3] in ('"""', "'''") else 1
    inner = body[quote:len(body) - quote]
    if "f" in prefix:
        return f"the string {literal}" if is_cuda_fstring_start(inner) else None
    return f"the string {literal}" if is_cuda_string(inner) else None


def cuda_uses(code: str, path: str = "<module>") -> list[tuple[int, str]]:
    """(line, description) of each CUDA use in code, as the audit finds them (before it weighs edits)."""
    context = CodemodContext(filename=path)
    run_builtin_codemods(code, path, (CudaLeftovers,), context=context)
    state = context.scratch[AUDIT_KEY]
    return sorted((_line_of(state.positions, use.start), use.what) for use in state.uses)


def audit(scratch: dict, edits: list[Edit], findings: list[Finding], frozen: list[tuple[int, int]], *,
          leftovers: bool = True) -> tuple[list[Edit], list[Finding]]:
    """After every rule of the file ran (edits: their composed, non-overlapping edits; findings: theirs;
    frozen: the spans no rule may edit), with what CudaLeftovers collected in scratch: the edits to
    make (without those inside a condition kept whole) and the audit's findings (mixed-condition,
    and with leftovers cuda-leftover)."""
    state: _Audit | None = scratch.get(AUDIT_KEY)
    if state is None:
        return edits, []
    new: list[Finding] = []
    keys = {(f.line, f.col, f.kind) for f in findings}
    kept_spans: list[tuple[int, int]] = []
    spans = None
    for finding in findings:
        if finding.kind not in LEFT_AS_CUDA:
            continue
        if spans is None:
            spans = [[facts.span(node) for facts, node in nodes]
                     for nodes in (state.conditions, state.conditional_tests, state.statement_tests)]
        at = state.positions.offset(finding.line, finding.col - 1)
        span, flag = _condition_around(spans, at), _MIXED_CONDITION
        if span is None or not any(span[0] <= e.start and e.end <= span[1] for e in edits):
            span, flag = _guard_around(state, at, edits), _GUARD_KEPT
        if span is None or span in kept_spans:
            continue
        kept_spans.append(span)
        found = _finding(state, span[0], flag, end=span[1])
        if (found.line, found.col, found.kind) not in keys:
            keys.add((found.line, found.col, found.kind))
            new.append(found)
    if kept_spans:
        edits = [e for e in edits if not any(a <= e.start and e.end <= b for a, b in kept_spans)]
    if leftovers:
        new += _leftovers(state, scratch.get(RETARGETED_KEY, {}), edits, [*findings, *new], [*frozen, *kept_spans])
    return edits, new


def _condition_around(spans: list[list[tuple[int, int]]], at: int) -> tuple[int, int] | None:
    """The span of the condition holding the node that starts at `at`: the outermost boolean
    operation or `not` holding it, else the test of a conditional expression, else the test of the
    if / while / assert statement, within its statement."""
    for found, pick in zip(spans, (max, min, min)):
        holding = [span for span in found if span[0] <= at < span[1]]
        if holding:
            return pick(holding, key=lambda span: span[1] - span[0])
    return None


def _guard_around(state: _Audit, at: int, edits: list[Edit]) -> tuple[int, int] | None:
    """The span of the innermost if / while statement or conditional expression that guards the node
    starting at `at` (the node is in what its test lets run, not in the test) and whose test a rule
    rewrote: `if torch.cuda.is_available(): cap = torch.cuda.get_device_capability()`."""
    best = None
    for facts, node in state.guards:
        guarded = node.body
        start, end = facts.span(guarded)
        if not start <= at < end:
            continue
        test_start, test_end = facts.span(node.test)
        if not any(test_start <= e.start and e.end <= test_end for e in edits):
            continue
        span = facts.span(node)
        if best is None or span[1] - span[0] < best[1] - best[0]:
            best = span
    return best


def _leftovers(state: _Audit, rebound: dict[str, str], edits: list[Edit], findings: list[Finding],
               spared: list[tuple[int, int]]) -> list[Finding]:
    """A cuda-leftover finding for the first surviving CUDA use of each line no finding names."""
    edit_spans = sorted((e.start, e.end) for e in edits)
    reported_lines = {f.line for f in findings}
    by_line: dict[int, list[_Use]] = {}
    for use in state.uses:
        if use.kind in (_CHAIN, _NAME_CHAIN) and use.root in rebound:
            continue  # its import was rewritten to the NPU module
        by_line.setdefault(_line_of(state.positions, use.start), []).append(use)
    found = []
    for line in sorted(by_line):
        if line in reported_lines:
            continue
        surviving = [use for use in by_line[line] if not _touched(use.span, edit_spans) and
                     not any(a <= use.span[0] and use.span[1] <= b for a, b in spared)]
        if not surviving:
            continue
        first_kind = min(use.kind for use in surviving)
        surviving = [use for use in surviving if use.kind == first_kind]
        use = surviving[0] if len(surviving) == 1 else min(surviving, key=_ast_order(surviving))
        found.append(_finding(state, use.start, rules.Flag(
            LEFTOVER, "warning", f"{use.what} is still CUDA after the migration and no rule handled it",
            _LEFTOVER_SUGGESTION)))
    return found


def _finding(state: _Audit, start: int, flag: rules.Flag, *, end: int | None = None) -> Finding:
    positions = state.positions
    line = _line_of(positions, start)
    line_text = positions.line_text(line)
    column = start - positions.line_starts[line - 1]
    column = column if line_text.isascii() else len(line_text[:column].encode("utf-8"))
    end_line = _line_of(positions, end) if end is not None else None
    return Finding(state.path, line, column + 1, flag.kind, flag.severity, line_text.strip(), flag.reason,
                   flag.suggestion, end_line=end_line if end_line is not None and end_line > line else None)


def _line_of(positions: Positions, offset: int) -> int:
    return bisect.bisect_right(positions.line_starts, offset)


def _touched(span: tuple[int, int], edit_spans: list[tuple[int, int]]) -> bool:
    start, end = span
    return any(a < end and start < b or (a == b and start <= a <= end) for a, b in edit_spans)


def _ast_order(uses: list[_Use]):
    """The order in which the ast engine listed uses of one kind (a stack walk of its tree: a node
    before what it holds, the last field first), as a sort key; for the rare line where two uses of
    one kind survive."""
    wanted = {id(use.node) for use in uses}
    rank: dict[int, int] = {}
    stack: list[tuple[cst.CSTNode, bool]] = [(uses[0].facts.module, False)]
    count = 0
    while stack and len(rank) < len(wanted):  # its postorder, left to right in ast's fields, reversed
        node, done = stack.pop()
        if done:
            count += 1
            if id(node) in wanted:
                rank[id(node)] = -count
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(_ast_fields(node)))
    return lambda use: rank.get(id(use.node), 0)


def _ast_fields(node: cst.CSTNode) -> list[cst.CSTNode]:
    """node's children in the order of ast's fields, where it is not libcst's (source) order."""
    if isinstance(node, cst.IfExp):
        return [node.test, node.body, node.orelse]
    if isinstance(node, cst.Dict):
        return [*(e.key for e in node.elements if isinstance(e, cst.DictElement)), *(e.value for e in node.elements)]
    if isinstance(node, cst.Call):
        positional, keywords = split_arguments(node)
        return [node.func, *(arg.value for arg in positional), *(arg.value for arg in keywords)]
    if isinstance(node, cst.FunctionDef):
        return [node.params, node.body, *node.decorators, *([node.returns] if node.returns else [])]
    if isinstance(node, cst.ClassDef):
        return [*(arg.value for arg in node.bases), *(arg.value for arg in node.keywords), node.body, *node.decorators]
    if isinstance(node, cst.Parameters):
        star = [node.star_arg] if isinstance(node.star_arg, cst.Param) else []
        kwarg = [node.star_kwarg] if node.star_kwarg is not None else []
        positional = [*node.posonly_params, *node.params]
        annotations = lambda params: [p.annotation for p in params if p.annotation is not None]  # noqa: E731
        return [*annotations(positional), *annotations(star), *annotations(node.kwonly_params),
                *(p.default for p in node.kwonly_params if p.default is not None), *annotations(kwarg),
                *(p.default for p in positional if p.default is not None)]
    return list(_children(node))
