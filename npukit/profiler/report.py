"""Output of the summary, estimate, diff and advice: rich tables for people, CSV/JSON for machines."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
        f" ({summary.op_events:,} op events, {summary.steps} step(s), total self {_us(summary.total_self_us)})"
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
