"""The cluster view: every rank of a profile directory at once (`npu-profile DIR` with several ranks).

Per rank, the recorded steps' time split into compute (ops of the compute threads), collectives
that ran while no op ran (exposed), the part of those spent waiting for a slower rank, and host
gaps (nothing recorded ran: Python, sleeps, data loading outside ops). Per collective, its time
on each rank and its skew.

How waits are measured. Collectives are matched across ranks by name and order (the n-th
gloo:all_reduce of every rank is one collective: a process group runs them in the same order on
all its ranks). The last rank to arrive waits least, so a collective's shortest duration over the
ranks is its own cost, and what a rank spends beyond it is the time it waited for the slowest
(skew = longest - shortest). Durations need no common clock, so ranks on other hosts compare as
well; the wait is placed at the start of the rank's collective. The rank the others wait for most
is the slowest. Point-to-point ops (send/recv) are not matched: they make the communication
matrix, src -> dst, with the peer npukit names while it records (`npukit.p2p:send:3`).

Every figure is a numpy pass over each rank's table; ranks load in a thread pool.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npukit.console import number_ranges
from npukit.errors import UserError
from npukit.profiler.extract import STEP_PREFIX
from npukit.profiler.record import P2P_PREFIX
from npukit.profiler.summary import compute_rows, covered_ns, interval_union
from npukit.profiler.table import EVENTS_FILE, KIND_ANNOTATION, KIND_COMM, EventTable

P2P_SUFFIXES = (":send", ":recv", ":recvAnysource", ":recv_anysource")


def rank_directories(path: Path) -> list[tuple[int, Path]]:
    """(rank, directory) of every rank{R} folder holding an events.npz, by rank."""
    return sorted(
        (int(p.name[4:]), p) for p in Path(path).glob("rank*")
        if p.name[4:].isdigit() and (p / EVENTS_FILE).is_file()
    )


def parse_ranks(text: str) -> set[int] | None:
    """`all` -> None (every rank); `0,2-3` -> {0, 2, 3}."""
    if text.strip().lower() == "all":
        return None
    chosen: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            chosen.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        chosen = set()
    if not chosen:
        raise UserError(f"--ranks {text!r}: expected `all` or rank numbers and ranges, e.g. 0,2-3")
    return chosen


@dataclass
class LoadedRanks:
    tables: dict[int, EventTable]
    directories: dict[int, Path]
    skipped: list[dict] = field(default_factory=list)  # {"rank", "error"}: a rank whose files are unreadable
    warnings: list[str] = field(default_factory=list)


def load_ranks(path: Path, ranks: set[int] | None = None) -> LoadedRanks:
    """Every rank's table (in parallel). A rank whose table cannot be read is skipped with its
    error (which names the file); only when no rank can be read is that an error."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such profile directory")
    found = rank_directories(path)
    if not found:
        raise UserError(f"{path}: no rank*/{EVENTS_FILE} here; record one with "
                        f"`npu-run --nproc-per-node N --profile {path} script.py`")
    chosen = [(rank, directory) for rank, directory in found if ranks is None or rank in ranks]
    if ranks is not None and len(chosen) < len(ranks):
        missing = sorted(ranks - {rank for rank, _ in chosen})
        raise UserError(f"--ranks: no profile of rank(s) {number_ranges(missing)} in {path} "
                        f"(it has ranks {number_ranges([rank for rank, _ in found])})")

    def load(item: tuple[int, Path]) -> EventTable | UserError:
        try:
            return EventTable.load(item[1])
        except UserError as exc:
            return exc

    workers = max(1, min(len(chosen), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(load, chosen))
    loaded = LoadedRanks(tables={}, directories={})
    for (rank, directory), result in zip(chosen, results):
        if isinstance(result, UserError):
            loaded.skipped.append({"rank": rank, "error": str(result)})
        else:
            loaded.tables[rank] = result
            loaded.directories[rank] = directory
    if not loaded.tables:
        raise UserError("no rank of the profile could be read:\n" + "\n".join(s["error"] for s in loaded.skipped))
    for skipped in loaded.skipped:
        loaded.warnings.append(f"rank {skipped['rank']} left out: {skipped['error']}")
    if ranks is None:
        sizes = {t.meta.get("world_size") for t in loaded.tables.values()}
        size = max((s for s in sizes if isinstance(s, int)), default=0)
        absent = sorted(set(range(size)) - {rank for rank, _ in found})
        if absent:
            loaded.warnings.append(f"rank(s) {number_ranges(absent)} of a world of {size} wrote no profile in {path}")
    return loaded


def peer_order(text: str) -> tuple[int, str]:
    """Sort key of a peer: a rank number, else ("?", "any") after the ranks."""
    return (int(text), "") if text.isdigit() else (1 << 30, text)


# --------------------------------------------------------------------------- one rank's columns
@dataclass
class _RankData:
    """What the cluster needs of one table, computed once (numpy arrays)."""

    rank: int
    table: EventTable
    steps: list[int]
    step_start: dict[int, int]
    step_end: dict[int, int]
    comm_rows: np.ndarray  # collectives (not point-to-point), by start
    comm_names: np.ndarray  # their names (str)
    p2p_rows: np.ndarray
    computing: tuple[np.ndarray, np.ndarray]  # union of compute-op intervals

    @classmethod
    def of(cls, rank: int, table: EventTable) -> _RankData:
        strings = table.string_array()
        step_ids = [i for i, text in enumerate(table.strings) if text.startswith(STEP_PREFIX)]
        step_rows = np.flatnonzero((table.kind == KIND_ANNOTATION) & np.isin(table.name_id, step_ids))
        numbers = [int(n) if n.isdigit() else -1 for n in (strings[table.name_id[r]][len(STEP_PREFIX):] for r in step_rows)]
        step_start = {n: int(table.start_ns[r]) for n, r in zip(numbers, step_rows.tolist())}
        step_end = {n: int(table.start_ns[r] + table.dur_ns[r]) for n, r in zip(numbers, step_rows.tolist())}
        comm = np.flatnonzero(table.kind == KIND_COMM)
        comm = comm[np.argsort(table.start_ns[comm], kind="stable")]
        names = strings[table.name_id[comm]].astype(str)
        is_p2p = np.char.endswith(names, P2P_SUFFIXES[0])
        for suffix in P2P_SUFFIXES[1:]:
            is_p2p |= np.char.endswith(names, suffix)
        ops = np.flatnonzero(compute_rows(table))
        return cls(
            rank=rank, table=table, steps=table.op_steps(), step_start=step_start, step_end=step_end,
            comm_rows=comm[~is_p2p], comm_names=names[~is_p2p], p2p_rows=comm[is_p2p],
            computing=interval_union(table.start_ns[ops], table.start_ns[ops] + table.dur_ns[ops]),
        )

    def in_steps(self, rows: np.ndarray, steps: list[int]) -> np.ndarray:
        return rows[np.isin(self.table.step[rows], steps)]

    def clipped(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of rows, the end cut at the end of the step each row started in."""
        table = self.table
        start, end = table.start_ns[rows], table.start_ns[rows] + table.dur_ns[rows]
        return start, np.minimum(end, _lookup(self.step_end, table.step[rows]))


def _lookup(mapping: dict[int, int], keys: np.ndarray) -> np.ndarray:
    """mapping[key] for every key (vectorized); keys without a value map to int64 max."""
    if not mapping:
        return np.full(len(keys), np.iinfo(np.int64).max, dtype=np.int64)
    known = np.array(sorted(mapping), dtype=np.int64)
    values = np.array([mapping[k] for k in known.tolist()], dtype=np.int64)
    at = np.clip(np.searchsorted(known, keys), 0, len(known) - 1)
    return np.where(known[at] == keys, values[at], np.iinfo(np.int64).max)


# --------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    """Times in microseconds; per-rank figures are per step (averaged over the steps all ranks recorded)."""

    ranks: list[int]
    steps: list[int]
    per_rank: list[dict]
    collectives: list[dict]  # per collective name, aggregated over its calls
    calls: list[dict]  # every matched collective call: durations and waits per rank
    p2p: list[dict]  # src -> dst of point-to-point ops
    slowest: dict | None
    warnings: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    start_step_left_out: int | None = None  # step 0 of a run recorded from its start (start-up, not a step)

    def as_dict(self) -> dict:
        return {
            "ranks": self.ranks, "steps": self.steps, "start_step_left_out": self.start_step_left_out, "per_rank": self.per_rank, "slowest": self.slowest,
            "collectives": self.collectives, "collective_calls": self.calls, "p2p": self.p2p,
            "warnings": self.warnings, "skipped_ranks": self.skipped,
        }


def cluster_summary(loaded: LoadedRanks) -> Cluster:
    ranks = sorted(loaded.tables)
    data = [_RankData.of(rank, loaded.tables[rank]) for rank in ranks]
    warnings = list(loaded.warnings)
    common = sorted(set.intersection(*(set(d.steps) for d in data))) if data else []
    if not common and any(d.steps for d in data):
        warnings.append("the ranks recorded no step in common: each rank's figures are over its own steps")
    left_out = None
    if len(common) >= 2 and common[0] == 0 and all(t.meta.get("schedule") is None for t in loaded.tables.values()):
        # Recorded from the start of the run (no --profile-steps): step 0 holds the imports, the model's
        # building and the rendezvous, whose length differs by rank and is no step time.
        left_out, common = 0, common[1:]
    elif data and all(t.meta.get("setup_step") == 0 for t in loaded.tables.values()):
        left_out = 0  # the recording left it out already (npukit since #32: setup is no step)
    calls, collective_rows, waits = _match_collectives(data, warnings)
    per_rank = [_rank_split(d, common or d.steps, waits[i]) for i, d in enumerate(data)]
    in_steps = [call for call in calls if not common or call["step"] in common]
    slowest = _slowest(ranks, per_rank, in_steps, max(len(common), 1))
    return Cluster(
        ranks=ranks, steps=common, per_rank=per_rank, collectives=collective_rows, calls=calls,
        p2p=_p2p_matrix(data), slowest=slowest, warnings=warnings, skipped=list(loaded.skipped),
        start_step_left_out=left_out,
    )


def _match_collectives(data: list[_RankData], warnings: list[str]) -> tuple[list[dict], list[dict], list[dict]]:
    """Calls matched by (name, n-th call of that name); returns the calls, the per-name rows and,
    per rank, {"rows": its row of each matched call, "wait": its wait in ns}."""
    n_ranks = len(data)
    waits = [{"rows": [], "wait": []} for _ in data]
    calls: list[dict] = []
    rows_out: list[dict] = []
    names = sorted(set().union(*(set(d.comm_names.tolist()) for d in data))) if data else []
    for name in names:
        per_rank_rows = [d.comm_rows[d.comm_names == name] for d in data]
        counts = [len(r) for r in per_rank_rows]
        n = min(counts)
        if len(set(counts)) > 1:
            warnings.append(f"{name}: {'/'.join(str(c) for c in counts)} calls on ranks "
                            f"{'/'.join(str(d.rank) for d in data)}; the first {n} of each are compared")
        if n == 0:
            continue
        rows = np.stack([r[:n] for r in per_rank_rows])  # [ranks, calls]
        dur = np.stack([d.table.dur_ns[rows[i]] for i, d in enumerate(data)]).astype(np.int64)
        shortest = dur.min(axis=0)
        wait = dur - shortest  # [ranks, calls]
        last = dur.argmin(axis=0)  # the rank that arrived last: the others waited for it
        # of each wait, the time no op of the waiting rank ran: what waiting cost it (a collective DDP
        # runs beside the backward costs nothing while the compute goes on), as the per-rank split counts it
        starts = np.stack([d.table.start_ns[rows[i]] for i, d in enumerate(data)]).astype(np.int64)
        exposed = np.stack([_uncovered_ns(starts[i], starts[i] + wait[i], d.computing) for i, d in enumerate(data)])
        skew = dur.max(axis=0) - shortest
        nbytes = np.stack([d.table.bytes[rows[i]] for i, d in enumerate(data)]).max(axis=0)
        steps = data[0].table.step[rows[0]]
        for i in range(n_ranks):
            waits[i]["rows"].append(rows[i])
            waits[i]["wait"].append(wait[i])
        rank_ids = np.array([d.rank for d in data])
        waited_for = np.bincount(last, weights=exposed.sum(axis=0) / max(n_ranks - 1, 1), minlength=n_ranks)
        most = int(np.argmax(waited_for))
        rows_out.append({
            "collective": name, "calls": n, "bytes_per_call": float(np.median(nbytes)),
            "total_us": {str(d.rank): round(float(dur[i].sum()) / 1e3, 3) for i, d in enumerate(data)},
            "wait_us": {str(d.rank): round(float(wait[i].sum()) / 1e3, 3) for i, d in enumerate(data)},
            "skew_us": round(float(skew.sum()) / 1e3, 3),
            "max_skew_us": round(float(skew.max()) / 1e3, 3),
            "waited_for_rank": int(rank_ids[most]) if n_ranks > 1 else None,
            "waited_for_calls": int((last == most).sum()),
        })
        for j in range(n):
            calls.append({
                "collective": name, "call": j, "step": int(steps[j]), "bytes": float(nbytes[j]),
                "dur_us": [round(float(v) / 1e3, 3) for v in dur[:, j]],
                "wait_us": [round(float(v) / 1e3, 3) for v in wait[:, j]],
                "exposed_wait_us": [round(float(v) / 1e3, 3) for v in exposed[:, j]],
                "last_rank": int(rank_ids[last[j]]), "skew_us": round(float(skew[j]) / 1e3, 3),
            })
    rows_out.sort(key=lambda row: -max(row["total_us"].values()))
    for w in waits:
        w["rows"] = np.concatenate(w["rows"]) if w["rows"] else np.zeros(0, np.int64)
        w["wait"] = np.concatenate(w["wait"]) if w["wait"] else np.zeros(0, np.int64)
    return calls, rows_out, waits


def _rank_split(d: _RankData, steps: list[int], waits: dict) -> dict:
    table = d.table
    n_steps = max(len(steps), 1)
    step_ns = sum(d.step_end[s] - d.step_start[s] for s in steps if s in d.step_start)
    windows = interval_union(np.array([d.step_start[s] for s in steps if s in d.step_start], dtype=np.int64),
                             np.array([d.step_end[s] for s in steps if s in d.step_start], dtype=np.int64))
    computing = _within(d.computing, windows)
    comm = d.in_steps(d.comm_rows, steps)
    p2p = d.in_steps(d.p2p_rows, steps)
    all_comm = np.concatenate([comm, p2p])
    running = interval_union(*d.clipped(all_comm))
    busy_ns = covered_ns(computing, running)
    compute_ns = covered_ns(computing)
    exposed_ns = busy_ns - compute_ns
    # the wait of each matched call: its first `wait` ns; what of it no op overlapped
    in_steps = np.isin(table.step[waits["rows"]], steps)
    wait_rows, wait_ns = waits["rows"][in_steps], waits["wait"][in_steps]
    starts = table.start_ns[wait_rows]
    waiting = _within(interval_union(starts, starts + wait_ns), windows)
    waiting_ns = covered_ns(computing, waiting) - compute_ns
    gaps_ns = max(step_ns - busy_ns, 0)

    def per_step(ns: float) -> float:
        return round(ns / 1e3 / n_steps, 3)

    return {
        "rank": d.rank, "steps": len(steps), "events": len(table),
        "step_us": per_step(step_ns), "compute_us": per_step(compute_ns),
        "comm_us": per_step(covered_ns(running)), "comm_exposed_us": per_step(exposed_ns),
        "waiting_us": per_step(waiting_ns), "collective_wait_us": per_step(float(wait_ns.sum())),
        "host_gap_us": per_step(gaps_ns), "busy_us": per_step(step_ns - waiting_ns),
        "p2p_us": per_step(float(table.dur_ns[p2p].sum())),
        "step_us_by_step": {str(s): round((d.step_end[s] - d.step_start[s]) / 1e3, 3) for s in d.steps if s in d.step_start},
    }


def _within(intervals: tuple[np.ndarray, np.ndarray], windows: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals cut to disjoint sorted windows (the recorded steps)."""
    starts, ends = intervals
    if not len(starts) or not len(windows[0]):
        return starts[:0], ends[:0]
    # each interval against the window its start falls in, and the windows it spans
    first = np.searchsorted(windows[1], starts, side="right")
    last = np.searchsorted(windows[0], ends, side="left") - 1
    spans = np.maximum(last - first + 1, 0)
    owner = np.repeat(np.arange(len(starts)), spans)
    window = np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans) + np.repeat(first, spans)
    return np.maximum(starts[owner], windows[0][window]), np.minimum(ends[owner], windows[1][window])


def _slowest(ranks: list[int], per_rank: list[dict], calls: list[dict], steps: int) -> dict | None:
    """The rank the others wait for in the collectives (most wait caused: the waits while the waiting
    rank ran no op, which the per-rank split counts as waiting); without collectives, the rank with
    the longest step."""
    if len(ranks) < 2:
        return None
    caused = dict.fromkeys(ranks, 0.0)
    for call in calls:
        others = len(ranks) - 1
        caused[call["last_rank"]] += sum(call["exposed_wait_us"]) / others
    busy = {row["rank"]: row["busy_us"] for row in per_rank}
    if any(caused.values()):
        rank = max(ranks, key=lambda r: caused[r])
        basis = "collectives"
    else:
        rank = max(ranks, key=lambda r: busy[r])
        basis = "step time"
    others = [busy[r] for r in ranks if r != rank]
    median_other = float(np.median(others))
    waits_of_others = {str(row["rank"]): row["waiting_us"] for row in per_rank if row["rank"] != rank}
    return {
        "rank": rank, "basis": basis,
        # the average wait one other rank spent on it per step, in the collectives it was last to join
        "wait_caused_us": round(caused[rank] / steps, 3),
        "busy_us": busy[rank], "median_other_busy_us": round(median_other, 3),
        "busy_over_median_us": round(busy[rank] - median_other, 3),
        "others_waiting_us": waits_of_others,
        "last_in_calls": sum(1 for call in calls if call["last_rank"] == rank), "calls": len(calls),
    }


def _uncovered_ns(starts: np.ndarray, ends: np.ndarray, covered: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per interval [start, end): its length outside `covered` (sorted disjoint intervals), vectorized."""
    low, high = covered
    if not len(low):
        return ends - starts
    lengths = high - low
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # covered length before each covered interval

    def covered_until(times: np.ndarray) -> np.ndarray:
        k = np.searchsorted(low, times, side="right") - 1
        at = np.maximum(k, 0)
        return np.where(k >= 0, before[at] + np.clip(times - low[at], 0, lengths[at]), 0)

    return (ends - starts) - (covered_until(ends) - covered_until(starts))


def _p2p_matrix(data: list[_RankData]) -> list[dict]:
    """src -> dst: calls, bytes and time of the sends (on src) and receives (on dst)."""
    cells: dict[tuple[str, str], dict] = {}
    for d in data:
        table = d.table
        if not len(d.p2p_rows):
            continue
        strings = table.string_array()
        names = strings[table.name_id[d.p2p_rows]].astype(str)
        parents = table.parent[d.p2p_rows]
        labels = np.where(parents >= 0, strings[table.name_id[np.maximum(parents, 0)]], "").astype(str)
        for row, name, label in zip(d.p2p_rows.tolist(), names.tolist(), labels.tolist()):
            peer = label.rsplit(":", 1)[-1] if label.startswith(P2P_PREFIX) else "?"
            sending = name.endswith(":send")
            key = (str(d.rank), peer) if sending else (peer, str(d.rank))
            cell = cells.setdefault(key, {"src": key[0], "dst": key[1], "sends": 0, "recvs": 0, "bytes": 0.0,
                                          "send_us": 0.0, "recv_us": 0.0})
            side = "send" if sending else "recv"
            cell[side + "s"] += 1
            cell[side + "_us"] = round(cell[side + "_us"] + float(table.dur_ns[row]) / 1e3, 3)
            if sending or not cell["sends"]:
                cell["bytes"] += float(table.bytes[row]) if sending else 0.0
            if not sending:
                cell["recv_bytes"] = cell.get("recv_bytes", 0.0) + float(table.bytes[row])
    out = []
    for cell in cells.values():
        received = cell.pop("recv_bytes", 0.0)
        if not cell["sends"]:  # only the receiving side was recorded
            cell["bytes"] = received
        out.append(cell)
    return sorted(out, key=lambda c: (peer_order(c["src"]), peer_order(c["dst"])))


# --------------------------------------------------------------------------- one Chrome trace
def cluster_trace(loaded: LoadedRanks, cluster: Cluster) -> dict:
    """One Chrome/Perfetto trace with a process per rank (its threads as rows), built from the
    event tables. Ranks are placed on the common clock when every table has it (meta origin_ns,
    recorded since 2026-11), otherwise each rank starts at 0. A collective's args hold its wait."""
    origins = {rank: t.meta.get("origin_ns") for rank, t in loaded.tables.items()}
    aligned = all(isinstance(o, int) for o in origins.values())
    base = min(origins.values()) if aligned else 0
    rank_index = {rank: i for i, rank in enumerate(cluster.ranks)}
    data_rows: dict[int, np.ndarray] = {}
    for rank, table in loaded.tables.items():
        comm = np.flatnonzero(table.kind == KIND_COMM)
        data_rows[rank] = comm[np.argsort(table.start_ns[comm], kind="stable")]
    events: list[dict] = []
    for rank in cluster.ranks:
        table = loaded.tables[rank]
        strings = table.string_array()
        offset = (origins[rank] - base) if aligned else 0
        ts = (table.start_ns + offset) / 1e3
        dur = table.dur_ns / 1e3
        names = strings[table.name_id]
        shapes = strings[table.shapes_id]
        modules = strings[table.module_id]
        stacks = strings[table.stack_id]
        kinds = ("op", "annotation", "autograd", "gc", "collective")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        comm_threads = set(np.unique(table.thread[table.kind == KIND_COMM]).tolist()) - set(
            np.unique(table.thread[compute_rows(table)]).tolist())
        for thread in np.unique(table.thread).tolist():
            label = "collectives" if thread in comm_threads else "ops"
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": thread,
                           "args": {"name": f"thread {thread} ({label})"}})
        waits = _call_waits(cluster, rank_index[rank], data_rows[rank], table)
        for row, (t, d, name, kind, thread, shape, module, stack) in enumerate(zip(
                ts.tolist(), dur.tolist(), names.tolist(), table.kind.tolist(), table.thread.tolist(),
                shapes.tolist(), modules.tolist(), stacks.tolist())):
            args = {}
            if shape:
                args["shapes"] = shape
            if module:
                args["module"] = module
            if stack:
                args["line"] = stack
            if row in waits:
                args.update(waits[row])
            events.append({"ph": "X", "name": name, "cat": kinds[kind] if 0 <= kind < len(kinds) else "event",
                           "pid": rank, "tid": thread, "ts": round(t, 3), "dur": round(d, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"npukit": "cluster view", "ranks": cluster.ranks, "aligned_clock": aligned}}


def _call_waits(cluster: Cluster, index: int, comm_rows: np.ndarray, table: EventTable) -> dict[int, dict]:
    """Row -> {"wait_us", "last_rank", "call"} for this rank's matched collective calls."""
    strings = table.string_array()
    by_name: dict[str, list[int]] = {}
    for row in comm_rows.tolist():
        by_name.setdefault(str(strings[table.name_id[row]]), []).append(row)
    out = {}
    for call in cluster.calls:
        rows = by_name.get(call["collective"], [])
        if call["call"] < len(rows):
            out[rows[call["call"]]] = {"wait_us": call["wait_us"][index], "last_rank": call["last_rank"],
                                       "skew_us": call["skew_us"], "call": call["call"]}
    return out
