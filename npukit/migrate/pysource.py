"""CUDA -> NPU rewrite of one Python source: the built-in libcst codemods, composed.

The rules are libcst codemods (npukit.migrate.codemods), the audit of what they leave too
(CudaLeftovers). This module screens the file with the stdlib `ast` parser (C speed, ~10x cheaper
than libcst's): which codemods a file concerns, the nodes they could act on and so the windows of
the file libcst parses; then it composes the codemods' edits (each the replacement of one node's
exact span, so everything else - comments, formatting, quotes, line endings - stays byte-for-byte),
runs the audit, inserts `import torch_npu` and checks that the result parses. Names are resolved
through a per-file alias table built from the file's imports; there is no whole-program analysis.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import re
from dataclasses import dataclass

from npukit.migrate.model import Change, Edit, Finding, TreeFacts
from npukit.migrate.pysource_model import (
    MigrationSyntaxError,
    Positions,
    SourceModel,
    apply_edits,
    drop_overlaps,
    newline_of,
    parse_python,
    string_value,
)
from npukit.migrate.pysource_names import NameRules

__all__ = ["MigrationSyntaxError", "PythonMigrator", "PythonOutcome", "apply_edits", "migrate_python", "remap_changes",
           "remap_findings"]

# rules whose effect torch_npu's runtime transfer_to_npu also achieves (used by --runtime)
TRANSFER_TO_NPU_COVERS = frozenset(
    {"cuda-namespace", "cuda-import", "cuda-method", "is-cuda", "device-string", "device-variable", "amp-upgrade",
     "cuda-graph", "cuda-renamed", "backend-string", "int-ordinal", "import-torch-npu", "default-tensor-type"}
)


@dataclass
class PythonOutcome:
    text: str  # the new source (== input when nothing changed)
    changes: list[Change]
    findings: list[Finding]
    edits: list[Edit]  # what turned the input into text (offsets into the input)


class PythonMigrator(NameRules, SourceModel):
    """Analyses one module and produces non-overlapping edits plus findings."""

    def analyse(self, *, audit: bool = True) -> tuple[list[Edit], list[Finding]]:
        """Edits and findings; with audit, every CUDA use the edits leave is reported (not for --runtime)."""
        self._build_bindings()
        scratch = self._run_builtin_codemods()
        edits = sorted(self.edits.values(), key=lambda e: (e.start, e.end))
        edits = drop_overlaps(edits)
        edits = self._audit(scratch, edits, leftovers=audit)
        if audit and self.respelled:  # strings of a newer Python's f-strings the codemods could not see
            from npukit.migrate.codemods.leftovers import hidden_cuda_strings

            for finding in hidden_cuda_strings(self.pos, self.respelled, self.path):
                self.findings.setdefault((finding.line, finding.col - 1, finding.kind), finding)
        findings = sorted(self.findings.values(), key=lambda f: (f.line, f.col, f.kind))
        return edits, findings

    def _run_builtin_codemods(self) -> dict:
        """The built-in libcst codemods (npukit.migrate.codemods) on this file: their edits, composed,
        go to the audit; no edit is kept inside the spans they freeze. Returns the codemod context's
        scratch (what the audit collected).
        libcst parses only the statements that hold a candidate of a codemod, with the context the
        codemod asks for (its parse costs ~10x ast's: `windows`), unless one of them needs the whole
        file. The audit (CudaLeftovers) runs in every window too: it keeps the conditions around the
        other codemods' findings whole."""
        from libcst.codemod import CodemodContext

        from npukit.migrate.codemods import BUILTIN_CODEMODS, CudaLeftovers
        from npukit.migrate.codemods.base import run_builtin_codemods

        concerned, candidates, whole_file = [], [], False
        # the text pre-filter, once per file (a codemod's words are looked for in all of the text)
        for codemod in (codemod for codemod in BUILTIN_CODEMODS if codemod.concerns(self.text)):
            found = codemod.candidates(self)
            if found:
                concerned.append(codemod)
                candidates.append((codemod, found))
                whole_file = whole_file or codemod.WHOLE_FILE or any(node is self.tree for node in found)
        if not concerned:
            return {}
        if CudaLeftovers not in concerned:
            concerned.append(CudaLeftovers)
        windows = None
        if not whole_file:
            windows = [window._replace(codemods=(*window.codemods, CudaLeftovers))
                       if CudaLeftovers not in window.codemods else window for window in self.windows(candidates)]
        context = CodemodContext(filename=self.path)
        edits, findings, frozen = run_builtin_codemods(self.text, self.path, tuple(concerned), self.facts,
                                                       windows=windows, bindings=self.bindings, context=context)
        if frozen:  # dual-target code: what the ast rules wrote there goes
            self.frozen.extend(frozen)
            self.edits = {span: edit for span, edit in self.edits.items()
                          if not any(a <= edit.start and edit.end <= b for a, b in frozen)}
        for edit in edits:
            self._edit((edit.start, edit.end), edit.text, edit.rule, needs_torch_npu=edit.needs_torch_npu)
        for finding in findings:
            self.findings.setdefault((finding.line, finding.col - 1, finding.kind), finding)
        return context.scratch

    def _audit(self, scratch: dict, edits: list[Edit], *, leftovers: bool) -> list[Edit]:
        """The audit of the composed edits (codemods.leftovers.audit): conditions kept whole, and with
        leftovers every CUDA use they leave reported."""
        from npukit.migrate.codemods.leftovers import audit

        edits, findings = audit(scratch, edits, list(self.findings.values()), self.frozen, leftovers=leftovers)
        for finding in findings:
            self.findings.setdefault((finding.line, finding.col - 1, finding.kind), finding)
        return edits

    def windows(self, found: list[tuple[type, list[ast.AST]]]) -> list:
        """The windows libcst parses for the codemods' candidates ((codemod, its candidates) pairs):
        for each candidate the statement its codemod's context() asks for (NpuCodemod.CONTEXT), or
        the nearest statement around it that stands alone (`_stands_alone`); only the header of a
        def or class when the candidate is in it (a decorator, an annotation, a base: `_window_of`).
        Whole top-level statements are joined as `_statement_windows` joins them; a window inside
        another is part of it. Each window runs the codemods with a candidate in it, and only those."""
        from npukit.migrate.codemods import BUILTIN_CODEMODS
        from npukit.migrate.codemods.base import Window

        top: list[tuple[ast.AST, type]] = []
        parts: dict[tuple[int, int, bool, str], set] = {}  # (first line, last line, nested, suffix) -> codemods
        for codemod, nodes in found:
            for node in nodes:
                part = self._window_of(node, codemod.context(self, node))
                if part is None:
                    top.append((node, codemod))
                else:
                    parts.setdefault(part, set()).add(codemod)
        starts = self.pos.line_starts
        windows = [[start, end, set(), False, ""] for start, end in self._statement_windows([node for node, _ in top])]
        firsts = [window[0] for window in windows]
        for node, codemod in top:
            windows[bisect.bisect_right(firsts, starts[node.lineno - 1]) - 1][2].add(codemod)
        for (first, last, nested, suffix), codemods in sorted(parts.items(), key=lambda item: (item[0][0], -item[0][1])):
            start = starts[first - 1]
            end = starts[last] if last < len(starts) else len(self.text)
            index = bisect.bisect_right(firsts, start) - 1
            holder = windows[index] if index >= 0 else None
            if holder is not None and end <= holder[1]:  # inside a window already chosen
                holder[2].update(codemods)
                continue
            windows.insert(index + 1, [start, end, set(codemods), nested, suffix])
            firsts.insert(index + 1, start)
        return [Window(start, end, tuple(c for c in BUILTIN_CODEMODS if c in codemods), nested, suffix)
                for start, end, codemods, nested, suffix in windows]

    def _window_of(self, node: ast.AST, context: str) -> tuple[int, int, bool, str] | None:
        """(first line, last line, nested, suffix) of the window a candidate needs for its context
        ("statement", "function", "class", "module"); None for the whole top-level statement holding
        it. For a candidate in the header of the def or class its context asks for, the window is the
        header (decorators to the line of its colon), closed by the suffix: a synthetic `pass` body."""
        holders = []  # the statements holding the node, the innermost first
        below = []  # for each, what in it holds the node
        current, child = node, node
        while current is not self.tree:
            if isinstance(current, ast.stmt):
                holders.append(current)
                below.append(child)
            child, current = current, self.parent[id(current)]
        if context == "module":
            return None
        if context == "function":  # the def whose body holds it (not one whose header does: that is the scope around)
            index = next((i for i, statement in enumerate(holders) if isinstance(statement, _FUNCTIONS) and
                          any(below[i] is inner for inner in statement.body)), len(holders) - 1)
        else:
            wanted = ast.ClassDef if context == "class" else ast.stmt
            index = next((i for i, statement in enumerate(holders) if isinstance(statement, wanted)), len(holders) - 1)
        while index < len(holders) - 1 and not self._stands_alone(holders[index], holders[index + 1]):
            index += 1
        statement = holders[index]
        if context == "statement" and isinstance(statement, _DEFINITIONS[2:]) and statement is not node and \
                not any(below[index] is inner for inner in statement.body):
            header = self._header_lines(statement)
            if header is not None:
                line = self.pos.line_text(header[0])
                indent = line[:len(line) - len(line.lstrip(" \t"))]
                return header[0], header[1], index < len(holders) - 1, f"{indent} pass{newline_of(self.text)}"
        if index == len(holders) - 1:
            return None
        return _first_line(statement), statement.end_lineno, True, ""

    def _header_lines(self, statement: ast.stmt) -> tuple[int, int] | None:
        """(first line, last line) of a def's or class's header when its body starts on a line of its
        own (the header then ends on the line before, a comment line or two included)."""
        last = _first_line(statement.body[0]) - 1
        if last < statement.lineno or self.pos.line_text(last).endswith("\\"):
            return None
        return _first_line(statement), last

    def _stands_alone(self, statement: ast.stmt, holder: ast.stmt) -> bool:
        """A nested statement whose lines parse alone (under `if 1:`) as it is in the file: it starts
        its first line (no `x = 1; y = 2`, `if a: b`, `else: b`, nor a line continued by `\\` above),
        it is not an `elif`, and no statement follows it on its last line."""
        first = _first_line(statement)
        line = self.pos.line_text(first)
        rest = line.lstrip(" \t")
        if (not rest.startswith("@") if first < statement.lineno else len(line) - len(rest) != statement.col_offset) or \
                _ELIF.match(rest) or first > 1 and self.pos.line_text(first - 1).endswith("\\"):
            return False
        for statements in _statement_lists(holder):
            for index, sibling in enumerate(statements):
                if sibling is statement:
                    return index + 1 == len(statements) or _first_line(statements[index + 1]) > statement.end_lineno
        return False

    def _statement_windows(self, nodes: list[ast.AST]) -> list[tuple[int, int]]:
        """(start, end) offsets of the runs of whole lines holding the top-level statements that
        contain `nodes`, each closed over the statements sharing its lines (`x = f(\n  1); y = 2`).
        A window never begins with a bare string statement other than the module's first (parsed
        alone it would read as a module docstring): it takes the statement before too."""
        body = self.tree.body
        firsts = [min([statement.lineno, *(d.lineno for d in getattr(statement, "decorator_list", ()))])
                  for statement in body]
        lasts = [statement.end_lineno for statement in body]
        chosen = sorted({max(bisect.bisect_right(firsts, node.lineno) - 1, 0) for node in nodes})
        groups: list[list[int]] = []  # [first index, last index] of each window
        for index in chosen:
            if groups and index <= groups[-1][1] + 1 and firsts[index] <= lasts[groups[-1][1]]:
                groups[-1][1] = max(groups[-1][1], index)
            else:
                groups.append([index, index])
        for group in groups:
            while group[0] > 0 and (lasts[group[0] - 1] >= firsts[group[0]] or (
                    isinstance(body[group[0]], ast.Expr) and string_value(body[group[0]].value) is not None)):
                group[0] -= 1
            while group[1] + 1 < len(body) and firsts[group[1] + 1] <= lasts[group[1]]:
                group[1] += 1
        starts = self.pos.line_starts
        windows: list[tuple[int, int]] = []
        for first, last in groups:
            start = starts[firsts[first] - 1]
            end = starts[lasts[last]] if lasts[last] < len(starts) else len(self.text)
            if windows and start <= windows[-1][1]:
                windows[-1] = (windows[-1][0], max(end, windows[-1][1]))
            else:
                windows.append((start, end))
        return windows

    def insertion_point(self) -> int | None:
        """Offset where `import torch_npu` goes: after the docstring and `from __future__` imports."""
        body = self.tree.body
        if not body:
            return None
        index = 0
        if isinstance(body[0], ast.Expr) and string_value(body[0].value) is not None:
            index = 1
        while index < len(body) and isinstance(body[index], ast.ImportFrom) and body[index].module == "__future__":
            index += 1
        if index < len(body) and body[index].lineno > (body[index - 1].end_lineno if index else 0):
            return self.pos.line_starts[body[index].lineno - 1]  # right before the first real statement
        last = body[index - 1]
        if last.end_lineno < len(self.pos.line_starts):
            return self.pos.line_starts[last.end_lineno]
        return len(self.text)


_ELIF = re.compile(r"elif\b")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _first_line(statement: ast.stmt) -> int:
    """The line a statement starts on, its decorators included."""
    return min([statement.lineno, *(decorator.lineno for decorator in getattr(statement, "decorator_list", ()))])


def _statement_lists(holder: ast.stmt):
    """The statement lists directly in a compound statement: its bodies, else, finally, handlers, cases."""
    for name in ("body", "orelse", "finalbody"):
        statements = getattr(holder, name, None)
        if isinstance(statements, list):
            yield statements
    for part in (*getattr(holder, "handlers", ()), *getattr(holder, "cases", ())):
        yield part.body


_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _runs_code(statement: ast.stmt) -> bool:
    """A module-level statement that does work (a library module only defines things)."""
    if isinstance(statement, _DEFINITIONS):
        return False
    if isinstance(statement, ast.Expr) and string_value(statement.value) is not None:
        return False  # a docstring
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):  # constants vs. `model = Net().cuda()`
        return statement.value is not None and any(isinstance(n, ast.Call) for n in ast.walk(statement.value))
    return True


def _is_entry_point(tree: ast.Module, path: str, imported_modules: frozenset[str] | None) -> bool:
    """Run directly: a `__main__` guard, or a script (module-level code) that no other file imports."""
    for statement in tree.body:
        if isinstance(statement, ast.If) and isinstance(statement.test, ast.Compare):
            text = ast.dump(statement.test)
            if "__name__" in text and "__main__" in text:
                return True
    if imported_modules is None:
        return False
    module = path.replace("\\", "/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return module not in imported_modules and module != "__init__" and any(_runs_code(s) for s in tree.body)


def remap_findings(findings: list[Finding], text: str, edits: list[Edit]) -> list[Finding]:
    """Move findings to their line numbers in the rewritten text (edits may add lines)."""
    growth = [(e.start, e.text.count("\n") - text.count("\n", e.start, e.end)) for e in edits]
    growth = [(start, delta) for start, delta in growth if delta]
    if not growth:
        return findings
    positions = Positions(text)
    remapped = []
    for finding in findings:
        offset = positions.line_starts[min(finding.line, len(positions.line_starts)) - 1]
        shift = sum(delta for start, delta in growth if start <= offset)
        end_line = finding.end_line + shift if finding.end_line is not None else None
        remapped.append(dataclasses.replace(finding, line=finding.line + shift, end_line=end_line))
    return remapped


def remap_changes(changes: list[Change], edits: list[Edit], new_text: str) -> list[Change]:
    """Move changes to where their new code is in the rewritten text (line and column).

    changes[i] must describe edits[i] (as migrate_python returns them: sorted, non-overlapping).
    An edit's new code starts at its old offset plus the growth of every edit applied before it
    (an inserted `import torch_npu` above pushes everything below it down one line).
    """
    if len(changes) != len(edits) or not edits:
        return changes
    positions = Positions(new_text)
    remapped, growth = [], 0
    for change, edit in zip(changes, edits):
        start = edit.start + growth
        start += len(edit.text) - len(edit.text.lstrip("\r\n"))  # an inserted line after a newline prefix
        line = bisect.bisect_right(positions.line_starts, start)
        col = start - positions.line_starts[line - 1] + 1
        remapped.append(Change(change.path, line, col, change.rule, change.before, change.after))
        growth += len(edit.text) - (edit.end - edit.start)
    return remapped


def migrate_python(text: str, path: str, *, runtime: bool = False, entry_point: bool | None = None,
                   facts: TreeFacts = TreeFacts(), codemods: tuple = (), builtin_rules: bool = True) -> PythonOutcome:
    """Rewrite one Python source. Raises MigrationSyntaxError if it does not parse.

    facts: what the rest of the tree says (custom CUDA ops, classes with their own cuda()).
    codemods: users' libcst codemods (user_codemods.CodemodSpec), run on the rewritten code.
    builtin_rules=False: the codemods only (a file the built-in rules' text pre-filter rules out).
    Changes and findings carry the line numbers of the input; remap_changes and remap_findings move
    them to the output.
    """
    if builtin_rules:
        outcome = _builtin_rewrite(text, path, runtime, entry_point, facts)
        if runtime or not codemods:
            return outcome
        edits, findings = outcome.edits, outcome.findings
    else:
        edits, findings = [], []
    from npukit.migrate.user_codemods import run_user_codemods

    edits, user_findings = run_user_codemods(text, edits, path, codemods)
    findings = sorted([*findings, *user_findings], key=lambda f: (f.line, f.col, f.kind))
    changes = [Change(path, e.line, e.col, e.rule, text[e.start:e.end], e.text.strip("\r\n")) for e in edits]
    return PythonOutcome(apply_edits(text, edits), changes, findings, edits)


def _builtin_rewrite(text: str, path: str, runtime: bool, entry_point: bool | None,
                     facts: TreeFacts) -> PythonOutcome:
    """The built-in rules' rewrite (or, for --runtime, transfer_to_npu's insertion)."""
    migrator = PythonMigrator(text, path, facts)
    edits, findings = migrator.analyse(audit=not runtime)
    newline = newline_of(text)
    if runtime:
        is_entry = _is_entry_point(migrator.tree, path, facts.imported_modules) if entry_point is None else entry_point
        return _runtime_outcome(migrator, edits, findings, newline, is_entry)
    if edits and any(e.needs_torch_npu for e in edits) and migrator.imports_torch and not migrator.has_torch_npu_import:
        at = migrator.insertion_point()
        if at is not None:
            prefix = newline if at == len(text) and text and not text.endswith(("\n", "\r")) else ""
            line = text.count("\n", 0, at) + 1
            edits = sorted([*edits, Edit(at, at, f"{prefix}import torch_npu{newline}", "import-torch-npu", line, 1)],
                           key=lambda e: (e.start, e.end))
    new_text = apply_edits(text, edits)
    if new_text != text:
        try:
            parse_python(new_text, path)
        except MigrationSyntaxError as exc:  # a bug in a rule must never corrupt a user's file
            finding = Finding(path, 1, 1, "internal-error", "error", "", f"the rewrite would not parse ({exc}); file left unchanged",
                              "please report this file to the npukit maintainers")
            return PythonOutcome(text, [], [*findings, finding], [])
    changes = [Change(path, e.line, e.col, e.rule, text[e.start:e.end], e.text.strip("\r\n")) for e in edits]
    return PythonOutcome(new_text, changes, findings, edits)


def _runtime_outcome(migrator: PythonMigrator, edits: list[Edit], findings: list[Finding], newline: str,
                     is_entry: bool) -> PythonOutcome:
    """--runtime: keep the source, insert transfer_to_npu at entry points, report what it does not cover."""
    text = migrator.text
    extra = []
    for edit in edits:
        if edit.rule not in TRANSFER_TO_NPU_COVERS:
            extra.append(Finding(migrator.path, edit.line, edit.col, "not-covered-by-transfer_to_npu", "warning",
                                 migrator.pos.line_text(edit.line).strip(),
                                 f"transfer_to_npu does not handle this ({edit.rule})",
                                 f"change it by hand: {text[edit.start:edit.end]!r} -> {edit.text!r}"))
    findings = sorted([*findings, *extra], key=lambda f: (f.line, f.col, f.kind))
    uses_torch = any(q == "torch" or q.startswith("torch.") for q in migrator.bindings.values()) and "torch" in text
    if migrator.has_transfer_to_npu or not is_entry or not uses_torch:
        return PythonOutcome(text, [], findings, [])
    at = migrator.insertion_point()
    lines = [] if migrator.has_torch_npu_import else ["import torch_npu"]
    lines.append("from torch_npu.contrib import transfer_to_npu")
    insertion = "".join(line + newline for line in lines)
    line = text.count("\n", 0, at) + 1
    edit = Edit(at, at, insertion, "runtime-transfer-to-npu", line, 1)
    change = Change(migrator.path, line, 1, edit.rule, "", insertion.strip())
    return PythonOutcome(apply_edits(text, [edit]), [change], findings, [edit])
