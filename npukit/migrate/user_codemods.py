"""Users' own libcst codemods, run by `npu-migrate --codemod pkg.module.Class` after npukit's rewrite.

Teams have their own CUDA wrappers (`utils.to_gpu(x)`, `get_cuda_device()`); a codemod of theirs
(any `libcst.codemod.Codemod`, usually a `VisitorBasedCodemodCommand`) runs on each Python file and
notebook after the built-in rules, on the code those rules wrote, in the same run. Its rewrites are
reported as changes under its own rule name (the dotted path given), what it leaves is reported
with `report()` at file:line, like the built-in findings, in every report format. A codemod class
may say which files can concern it, `FILES_CONTAINING = ("utils.to_gpu", ...)`: the others are
not parsed for it.

The rewrite is turned into edits of the original text (line hunks of the codemod's diff, composed
with the built-in edits), so everything downstream - line numbers before and after, notebooks split
back into their cells, CRLF, encodings, atomic writes - works as it does for the built-in rules.
"""

from __future__ import annotations

import bisect
import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from functools import cache

from npukit.errors import UserError
from npukit.migrate.model import Edit, Finding
from npukit.migrate.pysource_model import MigrationSyntaxError, parse_python

FINDINGS_KEY = "npukit.findings"  # CodemodContext.scratch key of report()'s findings


def report(codemod, node, reason: str, *, suggestion: str = "", severity: str = "warning") -> None:
    """From a user codemod: `node` is not migrated; npu-migrate reports it at its file:line.

    The codemod declares `METADATA_DEPENDENCIES = (PositionProvider,)` (libcst.metadata). Under
    libcst's own tool the finding is one of its warnings, `line:col: severity: reason`.
    `codemod.warn(message)`, libcst's own, works too: reported at line 1 of the file."""
    from libcst.metadata import PositionProvider

    if severity not in ("error", "warning", "info"):
        raise ValueError(f"severity must be error, warning or info, not {severity!r}")
    position = codemod.get_metadata(PositionProvider, node).start
    warning = f"{position.line}:{position.column + 1}: {severity}: {reason}" + (f" ({suggestion})" if suggestion else "")
    codemod.context.scratch.setdefault(FINDINGS_KEY, []).append(
        (position.line, position.column + 1, severity, reason, suggestion, warning))
    codemod.warn(warning)  # what libcst's own tool prints


@dataclass(frozen=True)
class CodemodSpec:
    """A codemod named on the command line and the folder its package is imported from."""

    name: str  # pkg.module.Class, as given: the rule name of its changes and findings
    search_path: str = ""


def specs_from_options(names: list[str] | tuple[str, ...]) -> tuple[CodemodSpec, ...]:
    """Check each `--codemod` now (a clear error before any file is read), importable from the
    current folder as `python -m` would."""
    specs = tuple(CodemodSpec(name, os.getcwd()) for name in names)
    for spec in specs:
        load_codemod(spec)
    return specs


@cache
def load_codemod(spec: CodemodSpec):
    import libcst.codemod as codemod_api

    module_name, _, class_name = spec.name.rpartition(".")
    if not module_name or not all(part.isidentifier() for part in spec.name.split(".")):
        raise UserError(f"--codemod {spec.name}: expected a dotted path to a class, e.g. mypkg.rules.MyCodemod")
    if spec.search_path and spec.search_path not in sys.path:
        sys.path.append(spec.search_path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"--codemod {spec.name}: cannot import {module_name} ({exc}); run npu-migrate from the "
                        "folder that holds the package, or put it on PYTHONPATH") from None
    except Exception as exc:  # its own code failed on import
        raise UserError(f"--codemod {spec.name}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    codemod_class = getattr(module, class_name, None)
    if codemod_class is None:
        raise UserError(f"--codemod {spec.name}: {module_name} has no {class_name}")
    if not (isinstance(codemod_class, type) and issubclass(codemod_class, codemod_api.Codemod)):
        raise UserError(f"--codemod {spec.name}: {class_name} is not a libcst codemod (a subclass of "
                        "libcst.codemod.Codemod, e.g. VisitorBasedCodemodCommand)")
    return codemod_class


def run_user_codemods(text: str, builtin_edits: list[Edit], path: str,
                      specs: tuple[CodemodSpec, ...]) -> tuple[list[Edit], list[Finding]]:
    """The built-in edits of `text` composed with the users' codemods' rewrites of their result:
    (edits of `text`, sorted and non-overlapping; findings at lines of `text`)."""
    from npukit.migrate.pysource import apply_edits

    intermediate = apply_edits(text, builtin_edits)
    stages: list[tuple[str, list]] = []  # (rule, line opcodes from the previous code to this one)
    code = intermediate
    findings: list[Finding] = []
    raw_findings: list[tuple[int, str, tuple]] = []  # (stage index, rule, finding)
    for spec in specs:
        new_code, messages, error = _transform(spec, code, path)
        raw_findings += [(len(stages), spec.name, message) for message in messages]
        if error:
            line = _error_line(error)
            raw_findings.append((len(stages), spec.name, (line, 1, "error", error,
                                                            "fix the codemod; this file keeps the rewrite without it")))
            continue
        if new_code != code:
            before, after = code.splitlines(keepends=True), new_code.splitlines(keepends=True)
            opcodes = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
            stages.append((spec.name, opcodes))
            code = new_code
    to_original = _OriginalPositions(text, builtin_edits)
    lines_of = _LineMap(stages)
    for stage, rule, (line, col, severity, reason, suggestion) in raw_findings:
        at = to_original.line(lines_of.to_intermediate(line, stage), intermediate)
        source_line = _line_text(text, at)
        findings.append(Finding(path, at, col, rule, severity, source_line.strip(), reason,
                                suggestion or "change it by hand"))
    if code == intermediate:
        return builtin_edits, findings
    user_edits = _line_edits(intermediate, code, lines_of)
    return to_original.compose(user_edits, intermediate), findings


def _transform(spec: CodemodSpec, code: str, path: str) -> tuple[str, list[tuple], str | None]:
    """(new code, its findings, error or None) of one codemod on one file."""
    import libcst.codemod as codemod_api

    codemod_class = load_codemod(spec)
    needles = getattr(codemod_class, "FILES_CONTAINING", None)
    if needles and not any(needle in code for needle in needles):
        return code, [], None  # a libcst parse and visit is ~30x npu-migrate's own work on a file
    context = codemod_api.CodemodContext(filename=path)
    try:
        codemod = codemod_class(context)
    except UserError:
        raise
    except Exception as exc:
        return code, [], f"{spec.name}() could not be created: {type(exc).__name__}: {exc}"
    result = codemod_api.transform_module(codemod, code)
    reported = context.scratch.get(FINDINGS_KEY, [])
    messages = [entry[:5] for entry in reported]
    from_report = {entry[5] for entry in reported}
    warnings = getattr(result, "warning_messages", None) or context.warnings
    messages += [(1, 1, "warning", str(message), "") for message in warnings if message not in from_report]
    if isinstance(result, codemod_api.TransformFailure):
        return code, messages, f"{spec.name} failed: {type(result.error).__name__}: {result.error}"
    if not isinstance(result, codemod_api.TransformSuccess):  # SkipFile, or exited: the file as it was
        return code, messages, None
    new_code = result.code
    if new_code != code:
        try:
            parse_python(new_code, path)
        except MigrationSyntaxError as exc:
            return code, messages, f"{spec.name} wrote code that {exc}"
    return new_code, messages, None


def _error_line(error: str) -> int:
    import re

    match = re.search(r"line (\d+)", error)
    return int(match.group(1)) if match else 1


def _line_text(text: str, line: int) -> str:
    lines = text.splitlines()
    return lines[line - 1] if 0 < line <= len(lines) else ""


class _LineMap:
    """Lines of a codemod's input, back through the codemods before it, to the built-ins' output."""

    def __init__(self, stages: list[tuple[str, list]]) -> None:
        self.stages = stages

    def to_intermediate(self, line: int, stage: int) -> int:
        for _, opcodes in reversed(self.stages[:stage]):
            line = _back(line, opcodes)
        return line

    def rules_touching(self, first: int, last: int) -> list[str]:
        """The codemods whose changes cover intermediate lines first..last (1-based)."""
        rules = []
        for index, (rule, opcodes) in enumerate(self.stages):
            for tag, i1, i2, _, _ in opcodes:
                if tag == "equal":
                    continue
                low, high = self.to_intermediate(i1 + 1, index), self.to_intermediate(max(i2, i1 + 1), index)
                if low <= last + 1 and high >= first - 1 and rule not in rules:
                    rules.append(rule)
        return rules


def _back(line: int, opcodes: list) -> int:
    """Line of the new text -> the line of the old text it came from (a changed line: its hunk's first)."""
    for tag, i1, _, j1, j2 in opcodes:
        if j1 < line <= j2 or (j1 == j2 and line == j1 + 1):
            return i1 + (line - j1) if tag == "equal" else i1 + 1
    return line


def _line_edits(old: str, new: str, lines_of: _LineMap) -> list[Edit]:
    """old -> new as line edits of old (one per line where a hunk keeps its line count, so a
    notebook's cells, joined line by line, each get their own)."""
    before, after = old.splitlines(keepends=True), new.splitlines(keepends=True)
    starts = [0]
    for line in before:
        starts.append(starts[-1] + len(line))
    edits = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        rule = "+".join(lines_of.rules_touching(i1 + 1, max(i2, i1 + 1))) or lines_of.stages[-1][0]
        pieces = zip(range(i1, i2), range(j1, j2)) if tag == "replace" and i2 - i1 == j2 - j1 else [(None, None)]
        for i, j in pieces:
            if i is None:
                i, i_end, j, j_end = i1, i2, j1, j2
            else:
                i_end, j_end = i + 1, j + 1
            old_text, new_text = "".join(before[i:i_end]), "".join(after[j:j_end])
            if old_text == new_text:
                continue
            end = starts[i_end]
            # the line break both keep is not part of the change (change_list.csv's End Line)
            kept = len(old_text) - len(old_text.rstrip("\r\n"))
            if kept and new_text.endswith(old_text[-kept:]) and len(new_text.rstrip("\r\n")) + kept == len(new_text):
                end -= kept
                new_text = new_text[:-kept]
            edits.append(Edit(starts[i], end, new_text, rule, i + 1, 1, needs_torch_npu=False))
    return edits


class _OriginalPositions:
    """Offsets of the built-ins' output -> offsets of the original text, and the composition of
    edits of that output with the built-in edits into edits of the original."""

    def __init__(self, text: str, builtin_edits: list[Edit]) -> None:
        self.text = text
        self.builtin = builtin_edits
        self.out_spans = []  # (start, end) of each built-in edit's text in the output
        growth = 0
        for edit in builtin_edits:
            start = edit.start + growth
            self.out_spans.append((start, start + len(edit.text)))
            growth += len(edit.text) - (edit.end - edit.start)

    def offset(self, position: int, *, end: bool = False) -> int:
        growth = 0
        for edit, (start, stop) in zip(self.builtin, self.out_spans):
            if stop > position or (end and stop == position and start == stop):
                if start < position < stop:
                    return edit.start  # inside what a rule wrote: where that rule's edit is
                break
            growth += len(edit.text) - (edit.end - edit.start)
        return position - growth

    def line(self, intermediate_line: int, intermediate: str) -> int:
        starts = [0] + [i + 1 for i, c in enumerate(intermediate) if c == "\n"]
        position = starts[min(max(intermediate_line, 1), len(starts)) - 1]
        original = self.offset(position)
        return self.text.count("\n", 0, original) + 1

    def compose(self, user_edits: list[Edit], intermediate: str) -> list[Edit]:
        """Built-in and user edits as one sorted, non-overlapping list of edits of the original."""
        items = [(start, stop, "builtin", edit) for edit, (start, stop) in zip(self.builtin, self.out_spans)]
        items += [(edit.start, edit.end, "user", edit) for edit in user_edits]
        items.sort(key=lambda item: (item[0], item[1], item[2] == "user"))
        groups: list[list] = []
        for item in items:
            if groups and _overlap(groups[-1], item):
                groups[-1].append(item)
            else:
                groups.append([item])
        line_starts = [0] + [i + 1 for i, c in enumerate(self.text) if c == "\n"]
        composed = []
        for group in groups:
            if len(group) == 1 and group[0][2] == "builtin":
                composed.append(group[0][3])
                continue
            low, high = min(item[0] for item in group), max(item[1] for item in group)
            builtins = [item[3] for item in group if item[2] == "builtin"]
            start = min([self.offset(low)] + [edit.start for edit in builtins])
            end = max([self.offset(high, end=True)] + [edit.end for edit in builtins])
            # the new text: the output span with the user edits of this group applied
            piece, position = [], low
            for item in sorted((i for i in group if i[2] == "user"), key=lambda i: (i[0], i[1])):
                piece.append(intermediate[position:item[0]])
                piece.append(item[3].text)
                position = item[1]
            piece.append(intermediate[position:high])
            rules = [edit.rule for edit in builtins] + [item[3].rule for item in group if item[2] == "user"]
            line = bisect.bisect_right(line_starts, start)
            composed.append(Edit(start, end, "".join(piece), "+".join(dict.fromkeys(rules)), line,
                                 start - line_starts[line - 1] + 1, needs_torch_npu=any(e.needs_torch_npu for e in builtins)))
        return composed


def _overlap(group: list, item: tuple) -> bool:
    start, stop = item[0], item[1]
    for other_start, other_stop, _, _ in group:
        if start < other_stop and other_start < stop:
            return True
        if (start == stop and other_start <= start <= other_stop) or \
                (other_start == other_stop and start <= other_start <= stop):
            return True  # an insertion at, or a deletion inside, the other's span: order matters
    return False
