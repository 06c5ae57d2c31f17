"""Profiler speed, measured side by side in one run.

1. Summary of a ~100k-event profile: npukit (load events.npz + one vectorized pass) vs
   torch.profiler's key_averages() on the very same recording (target: <= 1.5 s, >= 5x faster).
2. Recording overhead per training step: no profiler vs torch.profiler (same settings, without and
   with the allocations npukit records) vs npukit's ProfileSession, plus the one-off cost of writing the event table and trace.
3. Cluster view of 8 ranks x ~100k events (`npu-profile DIR` over every rank): the recorded table
   copied to 8 rank folders, each with a gloo all_reduce per step on its own thread whose length
   differs by rank (rank 5 the straggler); load + summary (target <= 5 s), and the one-trace export.

Run: PYTHONPATH=. .venv/bin/python benchmarks/profiler_speed.py [--events 100000] [--only cluster]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from npukit.profiler.record import ProfileSession
from npukit.profiler.summary import summarize
from npukit.profiler.table import KIND_COMM, EventTable, TableBuilder, write_meta


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def make_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(32) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 32)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def per_step_seconds(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cluster_profile(table: EventTable, root: Path, ranks: int = 8, straggler: int = 5) -> None:
    """`ranks` rank folders, each the recorded table plus an all_reduce per recorded step on a thread
    of its own, starting 1 ms before the step's end; the straggler's is the shortest (the others wait)."""
    steps = table.op_steps()
    step_end = {}
    for row in range(len(table)):
        if table.step[row] >= 0:
            step_end[int(table.step[row])] = max(step_end.get(int(table.step[row]), 0),
                                                 int(table.start_ns[row] + table.dur_ns[row]))
    comm_thread = int(table.thread.max()) + 1
    for rank in range(ranks):
        builder = TableBuilder()
        for step in steps:
            length = 200_000 if rank == straggler else 200_000 + 50_000 * (1 + rank)
            builder.add("gloo:all_reduce", start_ns=step_end[step] - length, dur_ns=length, kind=KIND_COMM,
                        thread=comm_thread, step=step, shapes="[1048576]", dtypes="float32", nbytes=4 * 2**20)
        joined = EventTable.concat([table, builder.build()])
        joined.meta = dict(table.meta, rank=rank, world_size=ranks)
        directory = root / f"rank{rank}"
        joined.save(directory)
        write_meta(directory, joined.meta)


def cluster_case(table: EventTable, root: Path) -> None:
    from npukit.profiler.cluster import cluster_summary, cluster_trace, load_ranks

    cluster_profile(table, root)
    result = {}

    def summary() -> None:
        result["cluster"] = cluster_summary(load_ranks(root))

    seconds = best_of(summary)
    load_s = best_of(lambda: load_ranks(root))
    cluster = result["cluster"]
    start = time.perf_counter()
    trace = cluster_trace(load_ranks(root), cluster)
    trace_s = time.perf_counter() - start
    events = sum(row["events"] for row in cluster.per_rank)
    print(f"cluster view: {len(cluster.ranks)} ranks x {events // len(cluster.ranks):,} events ({events:,} in all)")
    print(f"  load + cluster summary {seconds:8.3f} s   (target <= 5 s: {5 / seconds:.1f}x under; "
          f"of it loading {load_s:.3f} s)")
    print(f"  slowest rank found: {cluster.slowest['rank']} (the injected straggler: 5), the others wait "
          f"{cluster.slowest['wait_caused_us'] / 1e3:.2f} ms/step for it")
    print(f"  one Chrome trace of all ranks: {trace_s:.2f} s to build ({len(trace['traceEvents']):,} events)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000, help="approximate op events to record")
    parser.add_argument("--only", choices=["cluster"], help="only the cluster view case")
    args = parser.parse_args()

    step = make_step()
    for _ in range(3):
        step()
    probe_dir = Path(tempfile.mkdtemp(prefix="npukit-bench-"))
    with ProfileSession(probe_dir / "probe", trace=False):
        step()
        step()
    events_per_step = len(EventTable.load(probe_dir / "probe" / "rank0")) / 2
    steps = max(int(args.events / events_per_step), 1)

    if args.only == "cluster":
        with ProfileSession(probe_dir / "prof", trace=False):
            per_step_seconds(step, steps)
        cluster_case(EventTable.load(probe_dir / "prof" / "rank0"), probe_dir / "cluster")
        return

    # --- recording overhead: the three settings alternate so machine load hits them alike ---
    from torch.profiler import ProfilerActivity, profile

    overhead_steps = 10
    baseline_runs, torch_runs, memory_runs, npukit_runs = [], [], [], []
    for attempt in range(3):
        baseline_runs.append(per_step_seconds(step, overhead_steps))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, with_flops=True):
            torch_runs.append(per_step_seconds(step, overhead_steps))
        # what npukit records: the allocations too (profile_memory), for the data flow between ops
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, with_flops=True,
                     profile_memory=True):
            memory_runs.append(per_step_seconds(step, overhead_steps))
        with ProfileSession(probe_dir / f"overhead{attempt}", trace=False):
            npukit_runs.append(per_step_seconds(step, overhead_steps))
    baseline, torch_rec, memory_rec, npukit_rec = (statistics.median(r) for r in
                                                   (baseline_runs, torch_runs, memory_runs, npukit_runs))

    # --- one large recording (~--events events) for the summary comparison ------------------
    session = ProfileSession(probe_dir / "prof", trace=True)
    with session:
        per_step_seconds(step, steps)
        exit_start = time.perf_counter()
    write_cost = time.perf_counter() - exit_start  # extraction + events.npz + trace, at the end

    # --- summary speed on the same recording ----------------------------------------------
    rank_dir = probe_dir / "prof" / "rank0"
    table = EventTable.load(rank_dir)
    n_events = len(table)

    def ours() -> None:
        summarize(EventTable.load(rank_dir), "op")

    def ours_shape() -> None:
        summarize(EventTable.load(rank_dir), "shape")

    ours_s = best_of(ours)
    ours_shape_s = best_of(ours_shape)
    torch_prof = session._profiler
    start = time.perf_counter()
    torch_prof.key_averages()  # first call parses the events (what a user waits for)
    torch_s = time.perf_counter() - start
    start = time.perf_counter()
    torch_prof.key_averages(group_by_input_shape=True)
    torch_shape_s = time.perf_counter() - start

    print(f"profile: {n_events:,} events ({steps} steps of {events_per_step:,.0f} events)")
    print("summary (load + group by op):")
    print(f"  npukit      {ours_s:8.3f} s   ({ours_s / n_events * 1e6:.2f} us/event)")
    print(f"  key_averages{torch_s:8.3f} s   ({torch_s / n_events * 1e6:.2f} us/event)")
    print(f"  speedup     {torch_s / ours_s:8.1f} x   (target >= 5x, npukit <= 1.5 s)")
    print("summary by op + input shape:")
    print(f"  npukit      {ours_shape_s:8.3f} s")
    print(f"  key_averages(group_by_input_shape=True) {torch_shape_s:8.3f} s (events already parsed)")
    print(f"  speedup     {torch_shape_s / ours_shape_s:8.1f} x")
    print("recording, per training step:")
    print(f"  no profiler           {baseline * 1e3:8.2f} ms")
    print(f"  torch.profiler        {torch_rec * 1e3:8.2f} ms  ({torch_rec / baseline:.2f}x)")
    print(f"  + profile_memory      {memory_rec * 1e3:8.2f} ms  ({memory_rec / baseline:.2f}x)")
    print(f"  npukit ProfileSession {npukit_rec * 1e3:8.2f} ms  ({npukit_rec / baseline:.2f}x, "
          f"{npukit_rec / memory_rec:.2f}x torch.profiler with profile_memory)")
    print(f"  writing table + trace at exit: {write_cost:.2f} s ({write_cost / n_events * 1e6:.1f} us/event)")
    cluster_case(table, probe_dir / "cluster")


if __name__ == "__main__":
    main()
