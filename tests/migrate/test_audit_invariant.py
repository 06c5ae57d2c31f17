"""The invariant: after npu-migrate, every CUDA use left in code is reported at its line.

Checked on the migrated *output* of every case the test-suite knows (reference tricky cases, rule
cases, real-code classes, the example project, the fixtures), two ways: by re-reading the output
with the migrator's own use detector, and by a plain token scan for the commonest leftovers
(`.cuda(` and bare device/backend literals) that shares no code with the migrator.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from npukit.migrate.codemods.leftovers import cuda_uses
from npukit.migrate.pysource import migrate_python, remap_findings
from tests.migrate.test_python_rules import REWRITES, UNCHANGED
from tests.migrate.test_real_code_classes import CASES as CLASS_CASES
from tests.migrate.test_tricky_cases import CASES as TRICKY_CASES

REPO = Path(__file__).resolve().parents[2]
FILES = sorted([*REPO.glob("examples/**/*.py"), *REPO.glob("tests/migrate/fixtures/**/*.py")])

SOURCES = [(case[0], case[1]) for case in [*TRICKY_CASES, *REWRITES, *UNCHANGED, *CLASS_CASES]]
SOURCES += [(str(path.relative_to(REPO)), path.read_text()) for path in FILES]

_DEVICE_LITERAL = re.compile(r"""^[rbuRBU]?(['"])(cuda(:\d+)?|nccl)\1$""")
_TEXT_LINE = re.compile(r"\b(print|log\w*|warn\w*|info|debug|error|help|raise|assert)\b")


def _migrated(source: str):
    outcome = migrate_python(source, "case.py")
    findings = remap_findings(outcome.findings, source, outcome.edits)
    return outcome.text, {line for f in findings for line in range(f.line, (f.end_line or f.line) + 1)}


@pytest.mark.parametrize("case_id, source", SOURCES, ids=[s[0] for s in SOURCES])
def test_every_cuda_use_left_in_the_output_is_reported(case_id: str, source: str) -> None:
    text, reported = _migrated(source)
    left = cuda_uses(text, "case.py")  # the output, read afresh
    silent = [(line, what) for line, what in left if line not in reported]
    assert not silent, f"{case_id}: silent CUDA uses in the output: {silent}\n{text}"


@pytest.mark.parametrize("case_id, source", SOURCES, ids=[s[0] for s in SOURCES])
def test_token_scan_finds_no_unreported_cuda_call_or_literal(case_id: str, source: str) -> None:
    text, reported = _migrated(source)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = text.splitlines()
    silent = []
    for index, token in enumerate(tokens[1:-1], start=1):
        line = token.start[0]
        if line in reported:
            continue
        before, after = tokens[index - 1], tokens[index + 1]
        if token.type == tokenize.NAME and token.string == "cuda" and before.string == "." and after.string == "(":
            silent.append((line, lines[line - 1]))
        elif token.type == tokenize.STRING and _DEVICE_LITERAL.match(token.string) \
                and not _TEXT_LINE.search(lines[line - 1]):
            silent.append((line, lines[line - 1]))
    assert not silent, f"{case_id}: {silent}"


def test_the_checks_can_fail() -> None:
    """A silent leftover is seen by both checks (the audit switched off)."""
    text = "import torch\nimport helpers\nhelpers.cuda()\nx = 'cuda'\n"
    assert {line for line, _ in cuda_uses(text, "case.py")} == {3, 4}
    tokens = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)]
    assert "cuda" in tokens and "'cuda'" in tokens


def test_a_kept_block_spans_its_lines_in_the_reports(tmp_path: Path) -> None:
    import csv
    import io as _io

    from npukit.migrate import MigrateOptions, run_migration
    from npukit.migrate.report import sarif, unsupported_csv

    (tmp_path / "t.py").write_text("import torch\nif torch.cuda.is_available():\n    dev = 'cuda'\n    x = 1\n"
                                   "elif torch.npu.is_available():\n    dev = 'npu'\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True, quiet=True))
    rows = [r for r in csv.DictReader(_io.StringIO(unsupported_csv(run))) if r["API/Kind"] == "dual-target"]
    assert [(r["Start Line"], r["End Line"]) for r in rows] == [("2", "4")]
    (result,) = [r for r in sarif(run)["runs"][0]["results"] if r["ruleId"] == "dual-target"]
    assert result["locations"][0]["physicalLocation"]["region"]["endLine"] == 4
