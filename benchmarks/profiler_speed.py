"""Profiler speed, measured side by side in one run.

1. Summary of a ~100k-event profile: npukit (load events.npz + one vectorized pass) vs
   torch.profiler's key_averages() on the very same recording (target: <= 1.5 s, >= 5x faster).
2. Recording overhead per training step: no profiler vs torch.profiler (same settings) vs
   npukit's ProfileSession, plus the one-off cost of writing the event table and trace.

Run: PYTHONPATH=. .venv/bin/python benchmarks/profiler_speed.py [--events 100000]
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
from npukit.profiler.table import EventTable


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000, help="approximate op events to record")
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

    # --- recording overhead: the three settings alternate so machine load hits them alike ---
    from torch.profiler import ProfilerActivity, profile

    overhead_steps = 10
    baseline_runs, torch_runs, npukit_runs = [], [], []
    for attempt in range(3):
        baseline_runs.append(per_step_seconds(step, overhead_steps))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, with_flops=True):
            torch_runs.append(per_step_seconds(step, overhead_steps))
        with ProfileSession(probe_dir / f"overhead{attempt}", trace=False):
            npukit_runs.append(per_step_seconds(step, overhead_steps))
    baseline, torch_rec, npukit_rec = (statistics.median(r) for r in (baseline_runs, torch_runs, npukit_runs))

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
    print(f"  npukit ProfileSession {npukit_rec * 1e3:8.2f} ms  ({npukit_rec / baseline:.2f}x, "
          f"{npukit_rec / torch_rec:.2f}x torch.profiler)")
    print(f"  writing table + trace at exit: {write_cost:.2f} s ({write_cost / n_events * 1e6:.1f} us/event)")


if __name__ == "__main__":
    main()
