"""Change locations (change_list.csv, report.json changes[]) in the file as it is after the run.

docs/real-repos.md bug 2: with --out (or in place) the changes kept the input's line numbers, one
line above the new code once `import torch_npu` had been inserted. When the run writes, changes and
findings both point into the written file; --dry-run/--diff/--check point into the file on disk.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from npukit.migrate import MigrateOptions, run_migration, write_reports
from npukit.migrate.pysource import migrate_python, remap_changes

# (id, input, expected [(line, col, after)] in the rewritten text, import-torch-npu first)
CASES = [
    ("import-inserted-above",
     'import torch\ndevice = "cuda"\ntorch.cuda.synchronize()\n',
     [(1, 1, "import torch_npu"), (3, 11, "npu"), (4, 1, "torch.npu.synchronize")]),
    ("after-the-docstring",
     '"""Benchmark."""\nimport torch\ndevice = "cuda"\n',
     [(2, 1, "import torch_npu"), (4, 11, "npu")]),
    ("two-rewrites-on-one-line-shift-the-second-column",
     'import torch\nx = torch.cuda.FloatTensor(2).cuda(); y = torch.device("cuda:1")\n',
     [(1, 1, "import torch_npu"), (3, 5, "torch.npu.FloatTensor"), (3, 30, "npu"), (3, 55, "npu")]),
    ("crlf-line-endings",
     'import torch\r\ndevice = "cuda"\r\ntorch.cuda.synchronize()\r\n',
     [(1, 1, "import torch_npu"), (3, 11, "npu"), (4, 1, "torch.npu.synchronize")]),
    ("import-already-there-nothing-moves",
     'import torch\nimport torch_npu\ndevice = "cuda"\n',
     [(3, 11, "npu")]),
    ("no-trailing-newline-import-at-the-end",
     '"""Doc."""\nimport torch',
     []),
]


def _located(source: str) -> tuple[str, list]:
    outcome = migrate_python(source, "f.py")
    changes = remap_changes(outcome.changes, outcome.edits, outcome.text)
    return outcome.text, changes


@pytest.mark.parametrize(("case_id", "source", "expected"), CASES, ids=[c[0] for c in CASES])
def test_changes_are_located_in_the_rewritten_text(case_id: str, source: str, expected: list) -> None:
    text, changes = _located(source)
    got = [(c.line, c.col, c.after) for c in changes]
    assert got == expected
    lines = text.splitlines()
    for line, col, after in got:  # each change's new code is where it says
        assert lines[line - 1][col - 1:].startswith(after), (line, col, after, lines)


def test_column_of_a_second_rewrite_on_a_line_follows_the_first() -> None:
    text, changes = _located('import torch\nx = torch.cuda.FloatTensor(2).cuda(); y = torch.device("cuda:1")\n')
    # `torch.cuda.` and `.cuda()` each lose a character: "cuda:1" (column 57 in the input) is now at 55
    assert [(c.line, c.col) for c in changes] == [(1, 1), (3, 5), (3, 30), (3, 55)]
    assert text.splitlines()[2] == 'x = torch.npu.FloatTensor(2).npu(); y = torch.device("npu:1")'


def test_remap_without_edits_keeps_the_changes() -> None:
    assert remap_changes([], [], "x = 1\n") == []


SHIFTED = '"""Benchmark."""\nimport torch\ndevice = "cuda"\ntorch.backends.cuda.matmul.allow_tf32 = True\n'


def _run(tmp_path: Path, **options) -> tuple:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "bench.py").write_text(SHIFTED)
    run = run_migration(MigrateOptions(target=repo, quiet=True, **options))
    write_reports(run, tmp_path / "report")
    return run, tmp_path / "report"


def test_out_copy_reports_agree_with_the_copy(tmp_path: Path) -> None:
    _run(tmp_path, out=tmp_path / "copy")
    copy = (tmp_path / "copy" / "bench.py").read_text().splitlines()
    report = tmp_path / "report"
    rows = list(csv.reader((report / "change_list.csv").open()))[1:]
    assert [(r[1], r[2], r[4], r[5]) for r in rows] == [
        ("2", "2", "import torch_npu", "import-torch-npu"),
        ("4", "4", "npu", "device-variable"),
        ("5", "5", "torch.npu.matmul.allow_hf32", "tf32-to-hf32"),
    ]
    for row in rows:
        assert copy[int(row[1]) - 1][int(row[6]) - 1:].startswith(row[4]), (row, copy)
    data = json.loads((report / "report.json").read_text())
    changes = data["files"][0]["changes"]
    assert [(c["line"], c["col"]) for c in changes] == [(int(r[1]), int(r[6])) for r in rows]
    # the tf32 change and its precision finding name the same line, in every report
    precision = [f for f in data["files"][0]["findings"] if f["kind"] == "precision"]
    assert [f["line"] for f in precision] == [5]
    findings_csv = list(csv.reader((report / "unsupported_api.csv").open()))[1:]
    assert [r[1] for r in findings_csv if r[4] == "precision"] == ["5"]
    sarif = json.loads((report / "report.sarif").read_text())
    regions = [r["locations"][0]["physicalLocation"]["region"] for r in sarif["runs"][0]["results"]]
    assert [r["startLine"] for r in regions] == [5]
    assert "bench.py:5:" in (report / "report.md").read_text()


def test_in_place_run_reports_the_lines_of_the_rewritten_file(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, force=True)
    written = (tmp_path / "repo" / "bench.py").read_text().splitlines()
    for change in run.results[0].changes:
        assert written[change.line - 1][change.col - 1:].startswith(change.after)


def test_dry_run_reports_the_lines_of_the_file_on_disk(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, dry_run=True)
    assert [(c.line, c.rule) for c in run.results[0].changes] == [
        (2, "import-torch-npu"), (3, "device-variable"), (4, "tf32-to-hf32")]
    assert [f.line for f in run.results[0].findings if f.kind == "precision"] == [4]


NOTEBOOK = {
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": ["# title\n"]},
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
         "source": ["import torch\n", "device = \"cuda\"\n", "torch.backends.cuda.matmul.allow_tf32 = True"]},
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
         "source": ["x = torch.zeros(2).cuda()"]},
    ],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
}


def test_notebook_copy_reports_cell_lines_of_the_copy(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "nb.ipynb").write_text(json.dumps(NOTEBOOK, indent=1))
    run = run_migration(MigrateOptions(target=repo, out=tmp_path / "copy", quiet=True))
    cells = [c for c in json.loads((tmp_path / "copy" / "nb.ipynb").read_text())["cells"] if c["cell_type"] == "code"]
    result = run.results[0]
    for change in result.changes:
        number = int(change.after.rsplit("[code cell ", 1)[1].rstrip("]"))
        after = change.after.rsplit("  [code cell ", 1)[0]
        lines = "".join(cells[number - 1]["source"]).splitlines()
        assert lines[change.line - 1][change.col - 1:].startswith(after), (change, lines)
    assert [f.line for f in result.findings if f.kind == "precision"] == [4]
