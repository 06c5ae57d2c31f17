"""What `npu-profile` does once the CLI has parsed its options."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from npukit.console import make_console
from npukit.errors import UserError
from npukit.files import write_text_atomic
from npukit.profiler.report import (
    cluster_csv_tables,
    estimates_to_rows,
    print_cluster,
    print_estimates,
    print_summary,
    rows_to_csv,
    to_json,
)
from npukit.profiler.roofline import get_chip
from npukit.profiler.summary import GROUPINGS, estimate_table, find_profile, summarize
from npukit.profiler.table import EVENTS_FILE, EventTable


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


def wants_cluster(path: Path, rank: int | None, ranks: str | None) -> bool:
    """The cluster view: asked for with --ranks, or DIR holds several ranks and no --rank picks one."""
    if ranks is not None:
        if rank is not None:
            raise UserError("--rank N shows one rank, --ranks several: give one of them")
        return True
    if rank is not None or (Path(path) / EVENTS_FILE).is_file():
        return False
    from npukit.profiler.cluster import rank_directories

    return len(rank_directories(Path(path))) >= 2


def run_cluster(
    path: Path,
    *,
    ranks: str | None = None,
    top: int = 20,
    advise: bool = False,
    csv_path: Path | None = None,
    json_path: Path | None = None,
    trace_path: Path | None = None,
    console: Console | None = None,
) -> dict:
    """Every rank of DIR at once: per-rank step split, slowest rank, collectives, p2p matrix."""
    from npukit.profiler.cluster import cluster_summary, cluster_trace, load_ranks, parse_ranks

    console = console or make_console()
    loaded = load_ranks(Path(path), parse_ranks(ranks) if ranks is not None else None)
    cluster = cluster_summary(loaded)
    print_cluster(cluster, str(path), console, top)
    payload: dict = {"profile": str(path), "view": "cluster", **cluster.as_dict()}
    if advise:
        from npukit.profiler.advisor import advise as run_advisor
        from npukit.profiler.advisor import advise_cluster, print_findings

        findings = advise_cluster(cluster)
        print_findings(findings, console)
        payload["advice"] = [finding.as_dict() for finding in findings]
        if cluster.slowest:
            rank = cluster.slowest["rank"]
            console.print(f"\n[bold]rank {rank}[/] (the slowest), its own profile:")
            own = run_advisor(loaded.tables[rank])
            print_findings(own, console)
            payload["slowest_rank_advice"] = [finding.as_dict() for finding in own]
    if csv_path is not None:
        tables = cluster_csv_tables(cluster)
        write_text_atomic(csv_path, rows_to_csv(tables["ranks"]))
        console.print(f"wrote {csv_path}")
        for name in ("collectives", "p2p"):
            if tables[name]:
                extra = csv_path.with_name(f"{csv_path.stem}.{name}{csv_path.suffix or '.csv'}")
                write_text_atomic(extra, rows_to_csv(tables[name]))
                console.print(f"wrote {extra}")
    if json_path is not None:
        write_text_atomic(json_path, to_json(payload))
        console.print(f"wrote {json_path}")
    if trace_path is not None:
        import json

        write_text_atomic(trace_path, json.dumps(cluster_trace(loaded, cluster), separators=(",", ":")))
        console.print(f"wrote {trace_path} (a process per rank; open in https://ui.perfetto.dev or chrome://tracing)")
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
