"""Training monitor cost: step time with `npu-run --monitor` on vs off, on the GPT block of
benchmarks/backend_overhead.py (npu device, AdamW: every statistic the monitor takes, Adam's
state and update ratio included, CSV and TensorBoard files written each step).

Interleaved runs (off, monitored every step, every 10 steps; repeated), medians, 1 thread. Wall
time and process CPU time are both measured: on a shared machine the CPU time of this process is
the steadier of the two (it includes the monitor's writer thread). Exits 1 when monitoring every
step costs more than the target.

    python benchmarks/monitor_overhead.py [--repeats 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import gpt_case  # noqa: E402  (the shared benchmark model)

TARGET = 1.05


def time_steps(case, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per training step."""
    model, optimizer, loss_fn = case
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import npukit.npu_backend  # noqa: F401
    from npukit.accuracy.monitor import MonitorSession

    torch.manual_seed(0)
    case = gpt_case("npu")
    scratch = tempfile.TemporaryDirectory(prefix="npukit-monitor-bench-")
    out_dir = Path(scratch.name)
    runs = iter(range(1_000_000))

    def monitor(every):
        return lambda: MonitorSession(out_dir / f"run{next(runs)}", every=every, rank=0)

    configs = {"off": contextlib.nullcontext, "every step": monitor(1), "every 10 steps": monitor(10)}
    for make in configs.values():
        with make():
            time_steps(case, 2)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, make in configs.items():
            with make():
                times[name].append(time_steps(case, args.steps))
    with open(out_dir / "run0" / "rank0" / "monitor.csv") as table:
        records = sum(1 for line in table if line.startswith("0,"))

    def median(name: str, column: int) -> float:
        return statistics.median(sample[column] for sample in times[name])

    print(f"torch {torch.__version__}, GPT block + AdamW on npu, 1 thread, {args.repeats} interleaved repeats "
          f"x {args.steps} steps, medians")
    print(f"{'monitor':<15} {'wall ms':>9} {'ratio':>7} {'cpu ms':>9} {'ratio':>7}")
    for name in configs:
        print(f"{name:<15} {median(name, 0) * 1e3:>9.2f} {median(name, 0) / median('off', 0):>7.3f} "
              f"{median(name, 1) * 1e3:>9.2f} {median(name, 1) / median('off', 1):>7.3f}")
    print(f"({records} records of 6 statistics a step, each in monitor.csv and the TensorBoard file)")
    wall_ratio = median("every step", 0) / median("off", 0)
    cpu_ratio = median("every step", 1) / median("off", 1)
    scratch.cleanup()
    met = max(wall_ratio, cpu_ratio) <= TARGET
    print(f"monitored every step: wall {wall_ratio:.3f}x, cpu {cpu_ratio:.3f}x (target <= {TARGET}): "
          f"{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
