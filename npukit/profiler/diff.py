"""Diff two profiles: ops aligned by sequence, not only by name.

The top-level op calls (what user code called) of the paired recorded steps form one sequence
per profile; a Myers shortest-edit alignment (O((N+M)·D), fast when the runs are similar)
matches them call by call. Unmatched calls in B are new ops (a cast, a copy, a CPU fallback
inserted by the migration), unmatched calls in A were removed. Per op name the diff reports
calls and time per step, share of step time in each profile and the B/A time ratio over
the calls matched one to one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from npukit.alignment import MAX_EDIT_DISTANCE, myers_alignment
from npukit.profiler.table import KIND_OP, EventTable


@dataclass
class OpDiff:
    op: str
    calls_per_step_a: float
    calls_per_step_b: float
    us_per_step_a: float
    us_per_step_b: float
    share_pct_a: float
    share_pct_b: float
    share_change_pct: float
    matched_calls: int
    ratio_b_over_a: float | None  # over matched calls; None when nothing matched
    inserted_calls: int
    removed_calls: int


@dataclass
class ChangedCall:
    side: str  # "inserted" (only in B) or "removed" (only in A)
    op: str
    count: int
    per_step: float
    us_per_step: float
    shapes: str
    line: str


@dataclass
class DiffResult:
    steps_a: int
    steps_b: int
    us_per_step_a: float
    us_per_step_b: float
    aligned: bool
    ops: list[OpDiff] = field(default_factory=list)
    changes: list[ChangedCall] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        return {
            "steps_a": self.steps_a, "steps_b": self.steps_b, "us_per_step_a": self.us_per_step_a,
            "us_per_step_b": self.us_per_step_b, "aligned": self.aligned, "note": self.note,
            "ops": [asdict(o) for o in self.ops], "changes": [asdict(c) for c in self.changes],
        }


def _top_level_calls(table: EventTable, steps: list[int]) -> np.ndarray:
    mask = (table.kind == KIND_OP) & table.top_level
    if steps:
        mask &= np.isin(table.step, steps)
    return np.flatnonzero(mask)


def _recorded_steps(table: EventTable) -> list[int]:
    return table.op_steps()


def diff_profiles(a: EventTable, b: EventTable) -> DiffResult:
    steps_a, steps_b = _recorded_steps(a), _recorded_steps(b)
    paired = min(len(steps_a), len(steps_b))
    # Align the same number of steps from each run (all of each when a run has no steps).
    rows_a = _top_level_calls(a, steps_a[:paired] if paired else [])
    rows_b = _top_level_calls(b, steps_b[:paired] if paired else [])
    per_a, per_b = max(paired, 1), max(paired, 1)
    names_a = a.lookup(a.name_id[rows_a]).tolist()
    names_b = b.lookup(b.name_id[rows_b]).tolist()
    dur_a, dur_b = a.dur_ns[rows_a] / 1e3, b.dur_ns[rows_b] / 1e3

    pairs = myers_alignment(names_a, names_b, MAX_EDIT_DISTANCE)
    aligned = pairs is not None
    note = "" if aligned else (
        f"the op sequences differ in more than {MAX_EDIT_DISTANCE} calls; showing per-op totals without alignment"
    )
    pairs = pairs or []
    matched_a = np.zeros(len(rows_a), dtype=bool)
    matched_b = np.zeros(len(rows_b), dtype=bool)
    matched_time: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for i, j in pairs:
        matched_a[i] = matched_b[j] = True
        entry = matched_time[names_a[i]]
        entry[0] += dur_a[i]
        entry[1] += dur_b[j]
        entry[2] += 1

    total_a, total_b = float(dur_a.sum()) or 1.0, float(dur_b.sum()) or 1.0
    calls_a, calls_b = Counter(names_a), Counter(names_b)
    time_a: dict[str, float] = defaultdict(float)
    time_b: dict[str, float] = defaultdict(float)
    for name, t in zip(names_a, dur_a.tolist()):
        time_a[name] += t
    for name, t in zip(names_b, dur_b.tolist()):
        time_b[name] += t
    inserted = Counter(n for n, hit in zip(names_b, matched_b) if not hit) if aligned else Counter()
    removed = Counter(n for n, hit in zip(names_a, matched_a) if not hit) if aligned else Counter()

    ops = []
    for name in set(calls_a) | set(calls_b):
        share_a, share_b = 100 * time_a[name] / total_a, 100 * time_b[name] / total_b
        m = matched_time.get(name)
        ops.append(OpDiff(
            op=name, calls_per_step_a=calls_a[name] / per_a, calls_per_step_b=calls_b[name] / per_b,
            us_per_step_a=time_a[name] / per_a, us_per_step_b=time_b[name] / per_b,
            share_pct_a=round(share_a, 3), share_pct_b=round(share_b, 3), share_change_pct=round(share_b - share_a, 3),
            matched_calls=m[2] if m else 0,
            ratio_b_over_a=(m[1] / m[0]) if m and m[0] > 0 else None,
            inserted_calls=inserted[name], removed_calls=removed[name],
        ))
    ops.sort(key=lambda o: -o.share_change_pct)

    changes = _changed_calls(b, rows_b, ~matched_b, "inserted", per_b) if aligned else []
    changes += _changed_calls(a, rows_a, ~matched_a, "removed", per_a) if aligned else []
    return DiffResult(
        steps_a=len(steps_a), steps_b=len(steps_b), us_per_step_a=total_a / per_a, us_per_step_b=total_b / per_b,
        aligned=aligned, ops=ops, changes=changes, note=note,
    )


def _changed_calls(table: EventTable, rows: np.ndarray, unmatched: np.ndarray, side: str, steps: int) -> list[ChangedCall]:
    """Unmatched calls grouped by (op, input shapes, user line)."""
    groups: dict[tuple, list] = {}
    strings = table.string_array()
    for row in rows[unmatched].tolist():
        key = (int(table.name_id[row]), int(table.shapes_id[row]), int(table.stack_id[row]))
        entry = groups.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += table.dur_ns[row] / 1e3
    out = [
        ChangedCall(side=side, op=strings[name], count=count, per_step=count / steps, us_per_step=float(us) / steps,
                    shapes=strings[shapes], line=strings[line])
        for (name, shapes, line), (count, us) in groups.items()
    ]
    out.sort(key=lambda c: (-c.count, -c.us_per_step))
    return out


def print_diff(result: DiffResult, name_a: str, name_b: str, console: Console, top: int) -> None:
    console.print(f"A: {name_a}  ({result.steps_a} step(s), {result.us_per_step_a / 1e3:.2f} ms of top-level ops per step)")
    console.print(f"B: {name_b}  ({result.steps_b} step(s), {result.us_per_step_b / 1e3:.2f} ms of top-level ops per step)")
    if result.note:
        console.print(f"[yellow]note:[/] {result.note}")
    for side, title in (
        ("inserted", "New in B (calls with no counterpart in A, aligned by op sequence)"),
        ("removed", "Gone in B (calls of A with no counterpart in B)"),
    ):
        changes = [c for c in result.changes if c.side == side][:top]
        if not changes:
            continue
        table = Table(title=title, title_justify="left")
        for col in ("op", "calls/step", "time/step", "input shapes", "user line"):
            table.add_column(col, overflow="fold", justify="right" if col in ("calls/step", "time/step") else "left")
        for c in changes:
            shapes = c.shapes if len(c.shapes) <= 60 else c.shapes[:57] + "..."
            table.add_row(c.op, f"{c.per_step:.3g}", f"{c.us_per_step:.1f} us", escape(shapes), escape(c.line))
        console.print(table)
    table = Table(title="Per op, sorted by growth of share of step time (B - A)", title_justify="left")
    for col in ("op", "calls/step A", "calls/step B", "share A %", "share B %", "change", "time B/A (matched)"):
        table.add_column(col, justify="left" if col == "op" else "right", overflow="fold")
    for o in result.ops[:top]:
        ratio = f"{o.ratio_b_over_a:.2f}x" if o.ratio_b_over_a is not None else "-"
        table.add_row(
            o.op, f"{o.calls_per_step_a:.3g}", f"{o.calls_per_step_b:.3g}", f"{o.share_pct_a:.1f}", f"{o.share_pct_b:.1f}",
            f"{o.share_change_pct:+.1f}", ratio,
        )
    console.print(table)
