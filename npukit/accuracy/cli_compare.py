"""The body of `npu-compare`: compare two dump directories, print, write the requested reports."""

from __future__ import annotations

from pathlib import Path

from npukit.accuracy.compare import Thresholds, compare_dirs
from npukit.accuracy.report import print_terminal, write_csv, write_html, write_json
from npukit.errors import UserError


def run_compare(golden: Path, target: Path, csv_path: Path | None, json_path: Path | None,
                html_path: Path | None, top: int, overrides: list[str], workers: int | None, console) -> int:
    """Returns the exit code: 1 when a divergence is found (or error rows no search judged), else 0."""
    if top < 0:
        raise UserError("--top: must be >= 0")
    if workers is not None and workers < 1:
        raise UserError("--workers: must be >= 1")
    for option, path in (("--csv", csv_path), ("--json", json_path), ("--html", html_path)):
        if path is not None and not path.parent.exists():
            raise UserError(f"{option}: directory {path.parent} does not exist")
    thresholds = Thresholds().with_overrides(overrides)
    result = _compare_with_progress(golden, target, thresholds, workers, console)
    print_terminal(result, console, top)
    for path, writer in ((csv_path, write_csv), (json_path, write_json), (html_path, write_html)):
        if path is not None:
            writer(result, path)
            console.print(f"wrote {path}")
    return 1 if result.failed() else 0


def _compare_with_progress(golden, target, thresholds, workers, console):
    if not console.is_terminal:
        return compare_dirs(golden, target, thresholds, workers)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("comparing tensors"), BarColumn(), TextColumn("{task.completed:.3g} elements"),
                  TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("compare", total=None)
        return compare_dirs(golden, target, thresholds, workers,
                            progress=lambda done: progress.advance(task, done))
