"""Report formats (JSON, Markdown, GA-style CSVs, SARIF) and the npu-migrate command line."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from npukit.migrate import MigrateOptions, run_migration, write_reports
from npukit.migrate.report import CHANGE_LIST_COLUMNS, UNSUPPORTED_COLUMNS

REPO = Path(__file__).resolve().parents[2]
SOURCE = (
    'import torch\n'
    'from flash_attn import flash_attn_func\n'
    'model = Net().cuda()\n'
    'if torch.cuda.get_device_capability()[0] >= 8:\n'
    '    out = flash_attn_func(q, k, v)\n'
    'torch.backends.cudnn.benchmark = True\n'
)


@pytest.fixture
def reports(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(SOURCE)
    (source / "requirements.txt").write_text("torch\nflash-attn\n")
    run = run_migration(MigrateOptions(target=source, dry_run=True))
    out = tmp_path / "report"
    write_reports(run, out)
    return source, out


def test_report_json(reports: tuple[Path, Path]) -> None:
    _, out = reports
    data = json.loads((out / "report.json").read_text())
    assert data["mode"] == "dry-run"
    summary = data["summary"]
    assert summary["files_changed"] == 1
    assert summary["rewrites_by_rule"] == {"import-torch-npu": 1, "cuda-method": 1}
    assert summary["findings_by_severity"]["error"] == 4  # flash-attn x2 (import, call), capability, requirement
    effort = data["effort"]
    assert effort["by_kind"]["flash-attn"]["items"] == 3
    assert effort["items_needing_a_human"] == 4
    train = next(f for f in data["files"] if f["path"] == "train.py")
    assert {c["rule"] for c in train["changes"]} == {"import-torch-npu", "cuda-method"}


def test_change_list_and_unsupported_csv(reports: tuple[Path, Path]) -> None:
    _, out = reports
    changes = list(csv.reader(io.StringIO((out / "change_list.csv").read_text())))
    assert changes[0] == CHANGE_LIST_COLUMNS
    assert ["train.py", "3", "3", "cuda", "npu", "cuda-method", "15"] in changes
    rows = list(csv.DictReader(io.StringIO((out / "unsupported_api.csv").read_text())))
    assert list(rows[0]) == UNSUPPORTED_COLUMNS
    capability = next(r for r in rows if r["API/Kind"] == "device-capability")
    assert capability["File"] == "train.py" and capability["Start Line"] == "4"
    assert capability["Code"] == "if torch.cuda.get_device_capability()[0] >= 8:"
    assert capability["Suggestion"]


def test_sarif(reports: tuple[Path, Path]) -> None:
    _, out = reports
    sarif = json.loads((out / "report.sarif").read_text())
    assert sarif["version"] == "2.1.0"
    (run,) = sarif["runs"]
    assert run["tool"]["driver"]["name"] == "npu-migrate"
    rule_ids = {r["id"] for r in run["tool"]["driver"]["rules"]}
    levels = {(r["ruleId"], r["level"]) for r in run["results"]}
    assert ("flash-attn", "error") in levels and ("no-op", "note") in levels
    assert {r["ruleId"] for r in run["results"]} <= rule_ids
    location = next(r for r in run["results"] if r["ruleId"] == "device-capability")["locations"][0]
    assert location["physicalLocation"]["artifactLocation"]["uri"] == "train.py"
    assert location["physicalLocation"]["region"]["startLine"] == 4


def test_markdown(reports: tuple[Path, Path]) -> None:
    _, out = reports
    text = (out / "report.md").read_text()
    assert "| cuda-method | 1 |" in text
    assert "| train.py:4:4 | error | device-capability |" in text
    assert "## Effort estimate" in text


def test_markdown_with_nothing_for_a_human_says_so(tmp_path: Path) -> None:
    """An empty table's header was printed alone (facebookresearch/mae: all findings info)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("import torch\nx = torch.zeros(1).cuda()\ntorch.backends.cudnn.benchmark = True\n")
    write_reports(run_migration(MigrateOptions(target=source, dry_run=True)), tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Items needing a human\n\nNone.\n" in text and "| where | severity |" not in text


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def _cli(*args: str) -> CliResult:
    """Run `npu-migrate ARGS` in this process, as the console script does (exit code, stdout, stderr)."""
    from npukit.cli import migrate_main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["npu-migrate", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            migrate_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return CliResult(code, out.getvalue(), err.getvalue())


def test_cli_check_mode_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SOURCE)
    result = _cli(str(tmp_path), "--check")
    assert result.returncode == 1
    assert "would change" in result.stderr
    assert (tmp_path / "train.py").read_text() == SOURCE
    migrated = _cli(str(tmp_path), "--force", "--quiet")
    assert migrated.returncode == 0 and migrated.stderr == ""
    assert _cli(str(tmp_path), "--check", "--quiet").returncode == 0


def test_cli_user_errors_are_one_clean_line(tmp_path: Path) -> None:
    result = _cli(str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'missing'}: no such file or directory"
    conflicting = _cli(str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run")
    assert conflicting.returncode == 2 and "Traceback" not in conflicting.stderr


def test_cli_diff_prints_a_unified_diff_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SOURCE)
    result = _cli(str(tmp_path), "--diff")
    assert result.returncode == 0
    assert result.stdout.startswith("--- a/train.py\n+++ b/train.py\n")
    assert "+model = Net().npu()" in result.stdout
    assert (tmp_path / "train.py").read_text() == SOURCE


def test_cli_help_does_not_import_heavy_modules() -> None:
    code = ("import sys\nfrom npukit.cli import migrate_main\nsys.argv=['npu-migrate','--help']\n"
            "try:\n    migrate_main()\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'libcst', 'npukit.migrate.pysource') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert "--dry-run" in result.stdout
    assert "HEAVY []" in result.stdout


def test_cli_json_goes_to_stdout_and_summary_to_stderr(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SOURCE)
    result = _cli(str(tmp_path), "--dry-run", "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["summary"]["files_changed"] == 1
    assert "would change" in result.stderr and "Rewrites by rule" in result.stderr
