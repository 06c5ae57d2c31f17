"""Op hotspot summary in one vectorized pass over the event table.

Every figure is a numpy reduction (unique + bincount) over the op rows; nothing loops over
events in Python, so a 100k-event profile summarizes in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npukit.errors import UserError
from npukit.profiler.roofline import Chip, estimate_seconds
from npukit.profiler.table import EVENTS_FILE, KIND_COMM, KIND_OP, PHASE_NAMES, EventTable

GROUPINGS = ("op", "shape", "module", "stack")
LARGE_PROFILE_EVENTS = 100_000


@dataclass
class Summary:
    """Rows of one grouping, sorted by self time (largest first); times in microseconds."""

    group_by: str
    rows: list[dict]
    total_self_us: float
    steps: int
    events: int
    op_events: int
    chip: str | None = None
    warnings: list[str] = field(default_factory=list)
    phase_self_us: dict[str, float] = field(default_factory=dict)  # forward/backward/optimizer/...
    # collectives as their process group ran them, per name (on their own threads: not in `rows`)
    communication: list[dict] = field(default_factory=list)
    communication_exposed_us: float = 0.0  # time a collective ran while no op ran on any other thread
    outside_steps_us: float = 0.0  # op self time before the first step (setup) and after the last, not counted


def find_profile(path: Path, rank: int | None = None) -> Path:
    """The rank directory holding events.npz: PATH itself, or PATH/rank{R} (lowest rank by default)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such profile directory")
    if (path / EVENTS_FILE).is_file() and rank is None:
        return path
    ranks = sorted(
        (int(p.name[4:]), p) for p in path.glob("rank*") if p.name[4:].isdigit() and (p / EVENTS_FILE).is_file()
    )
    if not ranks:
        raise UserError(f"{path}: no profile here (expected {EVENTS_FILE} or rank*/{EVENTS_FILE}); "
                        f"record one with `npu-run --profile {path} script.py`")
    if rank is None:
        return ranks[0][1]
    for number, directory in ranks:
        if number == rank:
            return directory
    raise UserError(f"--rank {rank}: {path} has ranks {', '.join(str(n) for n, _ in ranks)}")


def load_profile(path: Path, rank: int | None = None) -> EventTable:
    return EventTable.load(find_profile(path, rank))


def group_keys(table: EventTable, group_by: str) -> np.ndarray:
    """One int64 key per row for a grouping (string ids combined for op+shape)."""
    if group_by == "op":
        return table.name_id.astype(np.int64)
    if group_by == "shape":
        base = len(table.strings) + 1
        return ((table.name_id.astype(np.int64) * base) + table.shapes_id + 1) * base + table.dtypes_id + 1
    if group_by == "module":
        return table.module_id.astype(np.int64)
    if group_by == "stack":
        return table.stack_id.astype(np.int64)
    raise UserError(f"--group-by {group_by!r}: choose one of {', '.join(GROUPINGS)}")


def step_count(table: EventTable) -> int:
    return max(len(table.op_steps()), 1)


def _mode_per_group(
    group: np.ndarray, values: np.ndarray, n_groups: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(value with the largest count, or weight sum, per group; number of distinct values), vectorized."""
    pairs, inverse, counts = np.unique(np.stack([group, values]), axis=1, return_inverse=True, return_counts=True)
    if weights is not None:
        counts = np.bincount(inverse.reshape(-1), weights=weights, minlength=pairs.shape[1])
    order = np.lexsort((-counts, pairs[0]))
    pairs, counts = pairs[:, order], counts[order]
    first = np.ones(pairs.shape[1], dtype=bool)
    first[1:] = pairs[0, 1:] != pairs[0, :-1]
    mode = np.full(n_groups, -1, dtype=np.int64)
    mode[pairs[0, first]] = pairs[1, first]
    distinct = np.bincount(pairs[0], minlength=n_groups)
    return mode, distinct


def summarize(table: EventTable, group_by: str = "op", chip: Chip | None = None) -> Summary:
    """Per group: calls, self and total time, average, share, FLOPs, bytes, shapes, dtypes
    (and the estimated NPU time when a chip is given)."""
    keys_all = group_keys(table, group_by)
    is_any_op = table.kind == KIND_OP
    is_op = is_any_op & table.in_steps()
    self_all = table.self_ns()
    # Total time counts a row unless its parent is in the same group (nested aten::sum in aten::sum).
    parent = table.parent
    parent_key = np.where(parent >= 0, keys_all[np.maximum(parent, 0)], np.iinfo(np.int64).min)
    parent_same = (parent >= 0) & (table.kind[np.maximum(parent, 0)] == KIND_OP) & (parent_key == keys_all)

    rows_idx = np.flatnonzero(is_op)
    keys = keys_all[rows_idx]
    uniq, group = np.unique(keys, return_inverse=True)
    group = group.reshape(-1)
    n = len(uniq)
    calls = np.bincount(group, minlength=n)
    self_ns = np.bincount(group, weights=self_all[rows_idx], minlength=n)
    outer = ~parent_same[rows_idx]
    total_ns = np.bincount(group, weights=np.where(outer, table.dur_ns[rows_idx], 0), minlength=n)
    # An op's FLOPs include its sub-ops' (linear = addmm); module and line groups hold both, so
    # they count top-level ops only.
    counted = table.top_level[rows_idx] if group_by in ("module", "stack") else np.ones(len(rows_idx), dtype=bool)
    flops = np.bincount(group, weights=np.where(counted, table.flops[rows_idx], 0.0), minlength=n)
    nbytes = np.bincount(group, weights=np.where(counted, table.bytes[rows_idx], 0.0), minlength=n)
    top_calls = np.bincount(group, weights=table.top_level[rows_idx], minlength=n).astype(np.int64)
    rep = np.zeros(n, dtype=np.int64)
    rep[group[::-1]] = rows_idx[::-1]  # first row of each group
    shape_mode, shape_distinct = _mode_per_group(group, table.shapes_id[rows_idx].astype(np.int64), n)
    dtype_mode, _ = _mode_per_group(group, table.dtypes_id[rows_idx].astype(np.int64), n)
    name_mode, name_distinct = _mode_per_group(
        group, table.name_id[rows_idx].astype(np.int64), n, weights=self_all[rows_idx].astype(np.float64)
    )

    estimate = None
    if chip is not None:
        top = table.top_level[rows_idx]
        seconds = estimate_seconds(
            chip, table.flops[rows_idx], table.bytes[rows_idx], op_dtypes(table, rows_idx)
        )
        estimate = np.bincount(group, weights=np.where(top, seconds, 0.0), minlength=n) * 1e6

    total_self = float(self_ns.sum()) or 1.0
    strings = table.string_array()
    steps = step_count(table)
    order = np.argsort(-self_ns, kind="stable")
    rows = []
    for g in order.tolist():
        key_row = rep[g]
        if group_by == "module":
            label = strings[table.module_id[key_row]] or "(no module)"
        elif group_by == "stack":
            label = strings[table.stack_id[key_row]] or "(no user code)"
        else:
            label = strings[table.name_id[key_row]]
        row = {
            "group": label,
            "calls": int(calls[g]),
            "top_level_calls": int(top_calls[g]),
            "calls_per_step": round(calls[g] / steps, 2),
            "self_us": round(self_ns[g] / 1e3, 3),
            "total_us": round(total_ns[g] / 1e3, 3),
            "avg_us": round(total_ns[g] / 1e3 / calls[g], 3),
            "self_pct": round(100.0 * self_ns[g] / total_self, 2),
            "flops": float(flops[g]),
            "bytes": float(nbytes[g]),
            "shapes": strings[shape_mode[g]] if shape_mode[g] >= 0 else "",
            "distinct_shapes": int(shape_distinct[g]),
            "dtypes": strings[dtype_mode[g]] if dtype_mode[g] >= 0 else "",
        }
        if group_by == "shape":
            row["shapes"] = strings[table.shapes_id[key_row]]
            row["dtypes"] = strings[table.dtypes_id[key_row]]
            row["distinct_shapes"] = 1
        if group_by in ("module", "stack"):
            row["top_op"] = strings[name_mode[g]]
            row["distinct_ops"] = int(name_distinct[g])
        if estimate is not None:
            row["est_npu_us"] = round(float(estimate[g]), 3)
        rows.append(row)

    warnings = []
    if len(table) > LARGE_PROFILE_EVENTS:
        warnings.append(
            f"{len(table):,} events: a profile this large slows trace viewers; record fewer steps with "
            "--profile-steps wait,warmup,active (e.g. 5,1,3)"
        )
    by_phase = np.bincount(table.phase[rows_idx], weights=self_all[rows_idx], minlength=len(PHASE_NAMES)) / 1e3
    collectives, exposed_us = communication(table)
    return Summary(
        group_by=group_by, rows=rows, total_self_us=total_self / 1e3, steps=steps, events=len(table),
        op_events=int(is_op.sum()), chip=chip.name if chip else None, warnings=warnings,
        phase_self_us={PHASE_NAMES[i]: round(float(v), 3) for i, v in enumerate(by_phase) if v > 0},
        communication=collectives, communication_exposed_us=exposed_us,
        outside_steps_us=round(float(self_all[is_any_op & ~is_op].sum()) / 1e3, 3),
    )


def communication(table: EventTable) -> tuple[list[dict], float]:
    """Per collective name: calls and time as the process group ran it; and the exposed time, when
    a collective ran and no op ran on any compute thread (the step waited for it). Over the steps: not
    the setup's collectives (DDP's first broadcast waits for the slowest rank's start)."""
    rows = np.flatnonzero((table.kind == KIND_COMM) & table.in_steps())
    if not len(rows):
        return [], 0.0
    strings = table.string_array()
    names = np.array([strings[i] for i in table.name_id[rows]])
    steps = step_count(table)
    collectives = []
    for name in sorted(set(names.tolist())):
        durations = table.dur_ns[rows[names == name]]
        collectives.append({"collective": name, "calls": int(len(durations)),
                            "calls_per_step": round(len(durations) / steps, 2),
                            "total_us": round(float(durations.sum()) / 1e3, 3),
                            "avg_us": round(float(durations.mean()) / 1e3, 3),
                            "max_us": round(float(durations.max()) / 1e3, 3)})
    collectives.sort(key=lambda row: -row["total_us"])
    ops = np.flatnonzero(compute_rows(table))
    running = interval_union(table.start_ns[rows], table.start_ns[rows] + table.dur_ns[rows])
    computing = interval_union(table.start_ns[ops], table.start_ns[ops] + table.dur_ns[ops])
    exposed_ns = covered_ns(running, computing) - covered_ns(computing)
    return collectives, round(exposed_ns / 1e3, 3)


def compute_rows(table: EventTable) -> np.ndarray:
    """Mask of the ops of the compute threads: every thread but a process group's own threads (those
    whose outermost rows are all collectives, with the ops the collectives ran inside them). A
    point-to-point op recorded on the calling thread (gloo:send) leaves that thread a compute one."""
    roots = table.parent < 0
    compute_threads = np.unique(table.thread[roots & (table.kind != KIND_COMM)])
    return (table.kind == KIND_OP) & np.isin(table.thread, compute_threads)


Intervals = tuple[np.ndarray, np.ndarray]


def interval_union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """The union of [start, end) intervals as sorted disjoint (starts, ends) arrays, vectorized."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    if not len(starts):
        return starts[:0], ends[:0]
    order = np.argsort(starts, kind="stable")
    starts, reach = starts[order], np.maximum.accumulate(ends[order])
    opens = np.ones(len(starts), dtype=bool)
    opens[1:] = starts[1:] > reach[:-1]
    first = np.flatnonzero(opens)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return starts[first], reach[last]


def covered_ns(*sets: Intervals) -> int:
    """Length of the union of interval sets (each from interval_union); the overlap of A and B is
    covered_ns(A) + covered_ns(B) - covered_ns(A, B)."""
    if len(sets) == 1:
        return int((sets[0][1] - sets[0][0]).sum())
    merged = interval_union(np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets]))
    return int((merged[1] - merged[0]).sum())


def op_dtypes(table: EventTable, rows: np.ndarray) -> np.ndarray:
    """The compute dtype of each row: the first floating dtype in its dtypes text, else float32."""
    strings = table.string_array()
    unique_ids, inverse = np.unique(table.dtypes_id[rows], return_inverse=True)
    chosen = []
    for dtype_id in unique_ids.tolist():
        names = [part.strip(" ()") for part in str(strings[dtype_id]).split(",")]
        floating = [n for n in names if n.startswith(("float", "bfloat", "complex"))]
        chosen.append(floating[0] if floating else (names[0] if names and names[0] else "float32"))
    return np.array(chosen or ["float32"], dtype=object)[inverse.reshape(-1)]


@dataclass
class EstimateRow:
    op: str
    shapes: str
    dtype: str
    calls: int
    gflops: float
    mbytes: float
    est_us: float
    bound: str  # "compute" or "memory"
    measured_us: float


def estimate_table(table: EventTable, chip: Chip) -> tuple[list[EstimateRow], float]:
    """Top-level ops grouped by (op, shapes, dtypes) with their estimated NPU time, largest first.

    Returns the rows and the estimated total per step (microseconds), over the steps' ops."""
    rows_idx = np.flatnonzero((table.kind == KIND_OP) & table.top_level & table.in_steps())
    if not len(rows_idx):
        return [], 0.0
    dtypes = op_dtypes(table, rows_idx)
    flops, nbytes = table.flops[rows_idx], table.bytes[rows_idx]
    seconds = estimate_seconds(chip, flops, nbytes, dtypes)
    compute = flops / np.array([chip.peak_flops(d) for d in dtypes]) if len(dtypes) else flops
    base = len(table.strings) + 1
    keys = (table.name_id[rows_idx].astype(np.int64) * base + table.shapes_id[rows_idx] + 1) * base + table.dtypes_id[rows_idx] + 1
    uniq, group = np.unique(keys, return_inverse=True)
    group = group.reshape(-1)
    n = len(uniq)
    est = np.bincount(group, weights=seconds, minlength=n) * 1e6
    compute_us = np.bincount(group, weights=compute, minlength=n) * 1e6
    calls = np.bincount(group, minlength=n)
    fl = np.bincount(group, weights=flops, minlength=n)
    by = np.bincount(group, weights=nbytes, minlength=n)
    measured = np.bincount(group, weights=table.dur_ns[rows_idx], minlength=n) / 1e3
    rep = np.zeros(n, dtype=np.int64)
    rep[group[::-1]] = np.arange(len(rows_idx))[::-1]
    strings = table.string_array()
    out = []
    for g in np.argsort(-est, kind="stable").tolist():
        r = rows_idx[rep[g]]
        out.append(EstimateRow(
            op=strings[table.name_id[r]], shapes=strings[table.shapes_id[r]], dtype=str(dtypes[rep[g]]),
            calls=int(calls[g]), gflops=float(fl[g] / 1e9), mbytes=float(by[g] / 1e6), est_us=float(est[g]),
            bound="compute" if compute_us[g] >= est[g] * 0.999 and fl[g] > 0 else "memory",
            measured_us=float(measured[g]),
        ))
    return out, float(est.sum()) / step_count(table)
