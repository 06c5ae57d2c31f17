"""The body of `npu-compare`: compare two dump directories, print, write the requested reports."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from npukit.accuracy.compare import Thresholds, compare_dirs
from npukit.accuracy.ranks import several_ranks
from npukit.accuracy.report import (
    print_terminal,
    ranks_csv_path,
    write_csv,
    write_html,
    write_json,
    write_ranks_csv,
)
from npukit.errors import UserError


@dataclass
class FindFixOptions:
    command: list[str]  # the npu-run command that wrote the target dump
    max_runs: int = 20
    work: Path | None = None  # default: TARGET.find-fix beside the target dump
    json_path: Path | None = None


def run_compare(golden: Path, target: Path, csv_path: Path | None, json_path: Path | None,
                html_path: Path | None, top: int, overrides: list[str], workers: int | None, console,
                find_fix: FindFixOptions | None = None, result=None) -> int:
    """Returns the exit code: 1 when a divergence is found or the compare cannot say there is none (a
    dump an internal error switched off, less than most of either side paired, error rows no search
    judged: CompareResult.problems()), else 0. The terminal, JSON and HTML reports say the same.
    result: the compare of the two dumps, when made already (--localize judged it before)."""
    if find_fix is not None and find_fix.max_runs < 1:
        raise UserError("--find-fix-runs: must be >= 1")
    if top < 0:
        raise UserError("--top: must be >= 0")
    if workers is not None and workers < 1:
        raise UserError("--workers: must be >= 1")
    fix_json = find_fix.json_path if find_fix is not None else None
    for option, path in (("--csv", csv_path), ("--json", json_path), ("--html", html_path), ("--find-fix-json", fix_json)):
        if path is not None and not path.parent.exists():
            raise UserError(f"{option}: directory {path.parent} does not exist")
    thresholds = Thresholds().with_overrides(overrides)
    if result is None:
        result = _compare_with_progress(golden, target, thresholds, workers, console)
    print_terminal(result, console, top)
    fix = _find_fix(golden, target, result, find_fix, thresholds, console) if find_fix is not None else None
    for path, writer in ((csv_path, write_csv), (json_path, write_json)):
        if path is not None:
            writer(result, path)
            console.print(f"wrote {path}")
    if csv_path is not None and several_ranks(result):
        write_ranks_csv(result, ranks_csv_path(csv_path))
        console.print(f"wrote {ranks_csv_path(csv_path)} (per rank)")
    if html_path is not None:
        write_html(result, html_path, fix=fix)  # the fix on its module's node
        console.print(f"wrote {html_path}")
    return 1 if result.failed() else 0


def _find_fix(golden: Path, target: Path, result, options: FindFixOptions, thresholds, console) -> list | None:
    """Runs the fix finder and writes its files; the fix's records for the HTML page, if one was found."""
    import json

    from npukit.accuracy.fix_finder import grad_scaler_only, print_fix, run_find_fix
    from npukit.accuracy.fixes import PrecisionFix
    from npukit.files import write_text_atomic

    skipped = grad_scaler_only(result)
    if skipped is not None:
        console.print(f"find-fix: no run made. {skipped}")
        return None
    unseen = _unseen_runs(result)
    if unseen is not None:
        console.print(f"find-fix: no run made: {unseen}. Each trial would be judged on such a dump too;"
                      " compare complete dumps of the two runs first")
        return None
    work = options.work or target.with_name(target.name + ".find-fix")
    fix_result = run_find_fix(golden, target, result, options.command, work=work, max_runs=options.max_runs,
                              console=console, thresholds=thresholds)
    if fix_result is None:
        console.print("find-fix: nothing to fix (no divergence, and the loss is within tolerance); no run made")
        return None
    print_fix(fix_result, console)
    if fix_result.fix is not None:
        fix_file = work / "fix.json"
        write_text_atomic(fix_file, PrecisionFix(fix_result.fix).to_json())
        console.print(f"wrote {fix_file} (npu-run --precision-fix {fix_file} ... applies it)")
    if options.json_path is not None:
        write_text_atomic(options.json_path, json.dumps(fix_result.as_json(), indent=1))
        console.print(f"wrote {options.json_path}")
    return fix_result.as_json()["fix"]


def _unseen_runs(result) -> str | None:
    """Why the compare did not see the runs (a dump an internal error switched off, too little
    paired), when that is so: a fix cannot be judged on what the dumps do not hold."""
    for pair in result.pairs:
        stopped = pair.stopped_dumps()
        if stopped:
            return f"the {stopped[0][0]}'s dump is incomplete ({stopped[0][1].text()})"
        if pair.coverage is not None and pair.coverage.too_little():
            return f"too little paired ({pair.coverage.text()})"
    return None


def _compare_with_progress(golden, target, thresholds, workers, console):
    if not console.is_terminal:
        return compare_dirs(golden, target, thresholds, workers)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                  TimeRemainingColumn(), console=console, transient=True) as progress:
        tensors = progress.add_task("comparing tensors", total=None, amount="", visible=False)
        pairs = progress.add_task("comparing step/rank pairs", total=None, amount="", visible=False)

        def advance_tensors(elements: int) -> None:
            progress.advance(tensors, elements)
            progress.update(tensors, amount=f"{progress.tasks[tensors].completed:.3g} elements")

        def advance_pairs(done: int, total: int) -> None:
            # several pairs (a multi-rank run) are compared a pair per process: counted by pair
            progress.update(pairs, completed=done, total=total, amount=f"{done}/{total} pairs", visible=total > 1)
            progress.update(tensors, visible=total <= 1)

        return compare_dirs(golden, target, thresholds, workers, progress=advance_tensors, pair_progress=advance_pairs)


def run_precheck_command(dump: Path, out: Path | None, top: int, console, workers: int | None = None) -> int:
    """`npu-compare --precheck DUMP`: judge every op of DUMP on its own (npukit/accuracy/precheck.py),
    print the table and write msprobe's CSV files into `out` (default: DUMP.precheck beside the dump).
    Returns the exit code: 1 when an op failed or too few ops could be judged, else 0."""
    from npukit.accuracy.precheck import FILES, print_precheck, run_precheck, write_csvs

    if top < 0:
        raise UserError("--top: must be >= 0")
    if workers is not None and workers < 1:
        raise UserError("--workers: must be >= 1")
    out = out or dump.with_name(dump.name + ".precheck")
    if not out.parent.exists():
        raise UserError(f"--precheck-dir: directory {out.parent} does not exist")
    if console.is_terminal:
        from rich.progress import Progress, TextColumn

        with Progress(TextColumn("pre-checking ops: {task.completed}"), console=console, transient=True) as progress:
            task = progress.add_task("ops", total=None)
            result = run_precheck(dump, progress=lambda done: progress.update(task, completed=done), workers=workers)
    else:
        result = run_precheck(dump, workers=workers)
    print_precheck(result, console, top)
    written = write_csvs(result, out)
    first = written[0].parent  # one set of files per step/rank when the dump has several
    console.print(f"wrote {len(written)} CSV files into {out} (msprobe's own compare reads them: msprobe "
                  f"api_precision_compare -npu {first}/{FILES['npu_details']} -gpu {first}/{FILES['bench_details']})")
    return result.exit_code()


def run_trend_command(golden: Path, npu: Path, perturbed: list[Path] | None, csv_path: Path | None, json_path: Path | None,
                      html_path: Path | None, top: int, console, localize: FindFixOptions | None = None,
                      workers: int | None = None) -> int:
    """`npu-compare --trend GOLDEN NPU`: the first step and module where the NPU run's monitored statistics
    leave the band of the golden and perturbed golden runs (npukit/accuracy/trend.py). Returns the exit
    code: 1 on a trend divergence, 0 without, trend.PAIRING_EXIT_CODE when the monitors do not pair.
    `localize` (--localize: the NPU run's command, the find-fix runs, the folder): then re-run to the
    departure's step and compare it there (localize.py); the exit code is that compare's, and 1 still when
    that step shows no divergence of its own (the trend's divergence stands)."""
    from npukit.accuracy.trend import PAIRING_EXIT_CODE, MonitorsDoNotPair, compare_trend
    from npukit.accuracy.trend_report import print_trend, write_trend_csv, write_trend_html, write_trend_json

    if top < 0:
        raise UserError("--top: must be >= 0")
    for option, path in (("--csv", csv_path), ("--json", json_path), ("--html", html_path)):
        if path is not None and not path.parent.exists():
            raise UserError(f"{option}: directory {path.parent} does not exist")
    try:
        result = compare_trend(golden, npu, perturbed or None)
    except MonitorsDoNotPair as exc:
        print(f"error: {exc}", file=sys.stderr)
        return PAIRING_EXIT_CODE
    print_trend(result, console, top)
    for path, writer in ((csv_path, write_trend_csv), (json_path, write_trend_json)):
        if path is not None:
            writer(result, path)
            console.print(f"wrote {path}")
    if html_path is not None:
        svg = write_trend_html(result, html_path)
        console.print(f"wrote {html_path} and its plot {svg}")
    if localize is not None:
        if result.first() is None:
            console.print("localize: nothing to localize (no trend divergence); no run made")
            return result.exit_code()
        from npukit.accuracy.localize import localize as localize_departure

        code = localize_departure(result.first(), localize.command, localize.work, console, localize.max_runs, top,
                                  workers, golden)  # the golden monitor: its checkpoints
        if code == 0:  # (exit 0 would tell a script the NPU run trains as the golden one does)
            console.print(f"localize: step {result.first().first_step}, computed from the golden state, shows no "
                          "divergence of its own; the trend divergence above stands (exit 1): it built up over "
                          "steps each within tolerance, or an op's error is within tolerance of what it writes "
                          "(an update lost against the weight it is added to)")
            return result.exit_code()
        return code
    return result.exit_code()
