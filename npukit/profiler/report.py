"""Output of the summary, estimate, diff and advice: rich tables for people, CSV/JSON for machines."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from npukit.console import number_ranges
from npukit.profiler.cluster import peer_order
from npukit.profiler.summary import EstimateRow, Summary


def rows_to_csv(rows: list[dict]) -> str:
    import io

    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buffer.getvalue()


def _us(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.2f} ms"
    return f"{value:.1f} us"


def _count(value: float) -> str:
    """1234567 -> 1.23 M (FLOPs and bytes)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}" if value else ""


def _compact_dtypes(text: str) -> str:
    """'float32, float32, int64' -> 'float32 x2, int64'."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    out: list[str] = []
    count = 0
    for i, part in enumerate(parts):
        count += 1
        if i + 1 == len(parts) or parts[i + 1] != part:
            out.append(part if count == 1 else f"{part} x{count}")
            count = 0
    return ", ".join(out)


def print_summary(summary: Summary, console: Console, top: int) -> None:
    title = (
        f"Top {min(top, len(summary.rows))} of {len(summary.rows)} by self time, grouped by {summary.group_by}"
        f" ({summary.op_events:,} op events, {summary.steps} step(s), total self {_us(summary.total_self_us)}"
        + (f"; {_us(summary.outside_steps_us)} before the first step (setup) and after the last not counted"
           if summary.outside_steps_us else "") + ")"
    )
    table = Table(title=title, title_justify="left")
    first = {"op": "op", "shape": "op", "module": "module", "stack": "user line"}[summary.group_by]
    table.add_column(first, overflow="fold", max_width=48)
    for name in ("calls", "self", "%", "total", "avg"):
        table.add_column(name, justify="right")
    if summary.group_by in ("module", "stack"):
        table.add_column("top op", overflow="fold", max_width=28)
    else:
        table.add_column("input shapes (most common)", overflow="fold", max_width=40)
        table.add_column("dtypes", overflow="fold", max_width=24)
    table.add_column("FLOP", justify="right")
    if summary.chip:
        table.add_column(f"est. {summary.chip}", justify="right")
    for row in summary.rows[:top]:
        cells = [
            escape(row["group"]), f"{row['calls']:,}", _us(row["self_us"]), f"{row['self_pct']:.1f}",
            _us(row["total_us"]), _us(row["avg_us"]),
        ]
        if summary.group_by in ("module", "stack"):
            cells.append(row["top_op"])
        else:
            shapes = row["shapes"] + (f"  (+{row['distinct_shapes'] - 1} more)" if row["distinct_shapes"] > 1 else "")
            cells += [escape(shapes), _compact_dtypes(row["dtypes"])]
        cells.append(_count(row["flops"]))
        if summary.chip:
            # Estimates exist for top-level calls only (a sub-op like linear's addmm is inside its caller's).
            cells.append(_us(row["est_npu_us"]) if row["top_level_calls"] else "-")
        table.add_row(*cells)
    console.print(table)
    if summary.phase_self_us:
        total = sum(summary.phase_self_us.values()) or 1.0
        parts = [f"{name} {100 * us / total:.0f}%" for name, us in summary.phase_self_us.items()]
        console.print("op time by phase: " + " | ".join(parts))
    if summary.communication:
        steps = max(summary.steps, 1)
        parts = [f"{row['collective']} {row['calls']:,} calls {_us(row['total_us'])}" for row in summary.communication]
        total = sum(row["total_us"] for row in summary.communication)
        console.print(f"collectives (on the process group's threads, not in the ops above): {_us(total / steps)} per step"
                      f", {_us(summary.communication_exposed_us / steps)} of it while no op ran (waiting): "
                      + " | ".join(parts))
    for warning in summary.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def print_estimates(rows: list[EstimateRow], per_step_us: float, chip_text: str, console: Console, top: int) -> None:
    table = Table(
        title=f"Estimated NPU time (roofline estimate, not a measurement): {chip_text}",
        title_justify="left",
        caption=f"estimated total per step: {_us(per_step_us)}",
        caption_justify="left",
    )
    for name, justify in (("op", "left"), ("input shapes", "left"), ("dtype", "left"), ("calls", "right"),
                          ("FLOP", "right"), ("bytes", "right"), ("est. NPU", "right"),
                          ("bound", "left"), ("measured here", "right")):
        if name == "input shapes":  # one line per op: a foreach's shape list is cut, the CSV/JSON keep it
            table.add_column(name, justify=justify, overflow="ellipsis", no_wrap=True, max_width=48)
        else:
            table.add_column(name, justify=justify, overflow="fold")
    for row in rows[:top]:
        table.add_row(
            row.op, escape(row.shapes), row.dtype, f"{row.calls:,}", _count(row.gflops * 1e9), _count(row.mbytes * 1e6) + "B",
            _us(row.est_us), row.bound, _us(row.measured_us),
        )
    console.print(table)


def estimates_to_rows(rows: list[EstimateRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def to_json(payload: dict) -> str:
    return json.dumps(payload, indent=2)


def print_cluster(cluster, source: str, console: Console, top: int) -> None:
    """The cluster view (npukit.profiler.cluster.Cluster): per-rank split, slowest rank, collectives, p2p."""
    steps = cluster.steps
    left_out = (f"; step {cluster.start_step_left_out} (the start-up: imports, model, rendezvous) left out"
                if cluster.start_step_left_out is not None else "")
    shown_steps = f"steps {number_ranges(steps)}" if steps else "each rank's own steps"
    console.print(f"cluster: {escape(source)} ({len(cluster.ranks)} ranks: {number_ranges(cluster.ranks)}), "
                  f"{shown_steps}{left_out}")
    slowest = cluster.slowest["rank"] if cluster.slowest else None
    table = Table(title="Per rank, per step (compute + exposed comm + host gaps = step)", title_justify="left")
    for name in ("rank", "step", "compute", "comm", "exposed comm", "waiting", "host gaps", "step - waiting"):
        table.add_column(name, justify="left" if name == "rank" else "right")
    for row in cluster.per_rank:
        mark = " slowest" if row["rank"] == slowest else ""
        table.add_row(f"{row['rank']}{mark}", *(_us(row[key]) for key in (
            "step_us", "compute_us", "comm_us", "comm_exposed_us", "waiting_us", "host_gap_us", "busy_us")),
            style="bold" if mark else None)
    console.print(table)
    console.print("comm: collectives and send/recv running; exposed: of it, while no op ran; waiting: of that, "
                  "the wait for a slower rank to join (a call's time beyond the shortest rank's); host gaps: "
                  "nothing recorded ran (Python, sleeps, input outside ops)", style="dim")
    if cluster.slowest:
        s = cluster.slowest
        if s["basis"] == "collectives":
            console.print(
                f"[bold]slowest rank: {s['rank']}[/]: the other ranks wait {_us(s['wait_caused_us'])} per step for it"
                f" in collectives (it joined last in {s['last_in_calls']} of {s['calls']} calls); its step without "
                f"waiting {_us(s['busy_us'])}, the other ranks' median {_us(s['median_other_busy_us'])}")
        else:
            console.print(f"[bold]slowest rank: {s['rank']}[/] (no collective matched across ranks): its step "
                          f"{_us(s['busy_us'])}, the other ranks' median {_us(s['median_other_busy_us'])}")
    if cluster.collectives:
        ranks = cluster.ranks
        table = Table(title=f"Collectives, time per rank over all recorded calls (top {min(top, len(cluster.collectives))}"
                            f" of {len(cluster.collectives)})", title_justify="left")
        table.add_column("collective")
        for name in ("calls", "bytes/call", *(f"rank {r}" for r in ranks), "skew", "max skew", "waited for"):
            table.add_column(name, justify="right")
        for row in cluster.collectives[:top]:
            waited = (f"rank {row['waited_for_rank']} ({row['waited_for_calls']}x)"
                      if row["waited_for_rank"] is not None else "")
            table.add_row(escape(row["collective"]), f"{row['calls']:,}", _count(row["bytes_per_call"]) + "B",
                          *(_us(row["total_us"][str(r)]) for r in ranks), _us(row["skew_us"]), _us(row["max_skew_us"]),
                          waited)
        console.print(table)
        console.print("skew: per call, the longest rank's time minus the shortest's (the wait the others spend on "
                      "the last to join), summed; waited for: the rank that joined last most (by wait caused)",
                      style="dim")
    if cluster.p2p:
        sources = sorted({c["src"] for c in cluster.p2p}, key=peer_order)
        targets = sorted({c["dst"] for c in cluster.p2p}, key=peer_order)
        cells = {(c["src"], c["dst"]): c for c in cluster.p2p}
        table = Table(title="Point-to-point (send/recv) matrix: bytes, calls, send time / recv time",
                      title_justify="left")
        table.add_column("src \\ dst")
        for dst in targets:
            table.add_column(f"-> {dst}", justify="right")
        for src in sources:
            row = []
            for dst in targets:
                c = cells.get((src, dst))
                row.append(f"{_count(c['bytes'])}B x{max(c['sends'], c['recvs'])}\n{_us(c['send_us'])} / "
                           f"{_us(c['recv_us'])}" if c else "")
            table.add_row(f"{src}", *row)
        console.print(table)
    for warning in cluster.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")


def cluster_csv_tables(cluster) -> dict[str, list[dict]]:
    """Flat rows per table for CSV: ranks, collectives (a column per rank) and p2p."""
    ranks = [{k: v for k, v in row.items() if not isinstance(v, dict)} for row in cluster.per_rank]
    collectives = []
    for row in cluster.collectives:
        flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for rank in cluster.ranks:
            flat[f"rank{rank}_us"] = row["total_us"][str(rank)]
            flat[f"rank{rank}_wait_us"] = row["wait_us"][str(rank)]
        collectives.append(flat)
    return {"ranks": ranks, "collectives": collectives, "p2p": list(cluster.p2p)}
