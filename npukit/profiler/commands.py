"""What `npu-profile` does once the CLI has parsed its options."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from npukit.console import make_console
from npukit.errors import UserError
from npukit.files import write_text_atomic
from npukit.profiler.report import (
    estimates_to_rows,
    print_estimates,
    print_summary,
    rows_to_csv,
    to_json,
)
from npukit.profiler.roofline import get_chip
from npukit.profiler.summary import GROUPINGS, estimate_table, find_profile, summarize
from npukit.profiler.table import EventTable


def run_summary(
    path: Path,
    *,
    group_by: str = "op",
    top: int = 20,
    chip: str | None = None,
    bandwidth: float | None = None,
    advise: bool = False,
    rank: int | None = None,
    csv_path: Path | None = None,
    json_path: Path | None = None,
    console: Console | None = None,
) -> dict:
    if group_by not in GROUPINGS:
        raise UserError(f"--group-by {group_by!r}: choose one of {', '.join(GROUPINGS)}")
    if bandwidth is not None and chip is None:
        raise UserError("--bandwidth needs --chip (the bandwidth belongs to a chip's roofline)")
    console = console or make_console()
    directory = find_profile(path, rank)
    table = EventTable.load(directory)
    chip_spec = get_chip(chip, bandwidth) if chip else None
    summary = summarize(table, group_by, chip_spec)
    console.print(f"profile: {directory}")
    print_summary(summary, console, top)
    payload: dict = {
        "profile": str(directory), "group_by": group_by, "steps": summary.steps, "events": summary.events,
        "op_events": summary.op_events, "total_self_us": summary.total_self_us,
        "phase_self_us": summary.phase_self_us, "rows": summary.rows,
        "communication": summary.communication, "communication_exposed_us": summary.communication_exposed_us,
        "warnings": summary.warnings,
    }
    if chip_spec is not None:
        estimates, per_step = estimate_table(table, chip_spec)
        print_estimates(estimates, per_step, chip_spec.describe(), console, top)
        payload["estimate"] = {
            "label": "estimated (roofline), not measured", "chip": chip_spec.describe(),
            "bandwidth_gbs": chip_spec.bandwidth_gbs, "per_step_us": per_step, "rows": estimates_to_rows(estimates),
        }
    if advise:
        from npukit.profiler.advisor import advise as run_advisor
        from npukit.profiler.advisor import print_findings

        findings = run_advisor(table)
        print_findings(findings, console)
        payload["advice"] = [finding.as_dict() for finding in findings]
    if csv_path is not None:
        write_text_atomic(csv_path, rows_to_csv(summary.rows))
        console.print(f"wrote {csv_path}")
    if json_path is not None:
        write_text_atomic(json_path, to_json(payload))
        console.print(f"wrote {json_path}")
    return payload


def run_diff(
    a: Path,
    b: Path,
    *,
    top: int = 20,
    rank: int | None = None,
    csv_path: Path | None = None,
    json_path: Path | None = None,
    console: Console | None = None,
) -> dict:
    from npukit.profiler.diff import diff_profiles, print_diff

    console = console or make_console()
    dir_a, dir_b = find_profile(a, rank), find_profile(b, rank)
    result = diff_profiles(EventTable.load(dir_a), EventTable.load(dir_b))
    print_diff(result, str(dir_a), str(dir_b), console, top)
    payload = {"a": str(dir_a), "b": str(dir_b), **result.as_dict()}
    if csv_path is not None:
        write_text_atomic(csv_path, rows_to_csv(payload["ops"]))
        console.print(f"wrote {csv_path}")
    if json_path is not None:
        write_text_atomic(json_path, to_json(payload))
        console.print(f"wrote {json_path}")
    return payload
