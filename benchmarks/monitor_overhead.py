"""Training monitor cost: step time with `npu-run --monitor` on vs off, on the GPT block of
benchmarks/backend_overhead.py (npu device, AdamW: every statistic the monitor takes, Adam's
state and update ratio included, CSV and TensorBoard files written each step).

Interleaved runs (off, monitored every step, every 10 steps; repeated, each first in turn), medians, 1 thread. Wall
time and process CPU time are both measured: on a shared machine the CPU time of this process is
the steadier of the two (it includes the monitor's writer thread). Exits 1 when monitoring every
step costs more than the target.

Then memory: the process's peak resident size after 20 monitored steps and after --memory-steps
(bounded: nothing of a written step is kept). Then, on the CPU device where msprobe's monitor
runs, the same step unmonitored, under npukit's monitor and under msprobe's (TrainerMon with the
same statistics: activations and their gradients, weights and gradients, Adam's moments and
update ratio, every step, CSV), interleaved.

    python benchmarks/monitor_overhead.py [--repeats 15] [--steps 5] [--memory-steps 200]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import gpt_case  # noqa: E402  (the shared benchmark model)

TARGET = 1.05


def time_steps(case, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per training step: the monitor's writer thread is part of its
    cost (backend_overhead.time_steps counts the calling thread only)."""
    model, optimizer, loss_fn = case
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def against_msprobe(args, out_dir: Path, monitor) -> None:
    import json
    import os

    try:
        from msprobe.pytorch import TrainerMon
    except ImportError:
        print("msprobe (mindstudio-probe) not installed: no comparison with its monitor")
        return
    config = out_dir / "msprobe_monitor.json"
    config.write_text(json.dumps({"targets": {}, "xy_distribution": True, "mv_distribution": True,
                                  "ur_distribution": True, "wg_distribution": True, "step_interval": 1,
                                  "ops": ["min", "max", "mean", "norm", "nans"], "format": "csv"}))
    os.environ["MONITOR_OUTPUT_DIR"] = str(out_dir / "msprobe")
    # msprobe's full backward hooks warn at every step of a model whose input needs no gradient
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.manual_seed(0)
    plain = gpt_case("cpu")
    torch.manual_seed(0)
    watched = gpt_case("cpu")  # msprobe's hooks stay on its model: a model of its own
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        TrainerMon(str(config), params_have_main_grad=False).set_monitor(watched[0], grad_acc_steps=1,
                                                                        optimizer=watched[1])
        configs = {"off": (plain, contextlib.nullcontext), "npukit": (plain, monitor(1)),
                   "msprobe": (watched, contextlib.nullcontext)}
        for case, make in configs.values():
            with make():
                time_steps(case, 2)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, (case, make) in configs.items():
                with make():
                    times[name].append(time_steps(case, args.steps)[1])
    base = statistics.median(times["off"])
    print(f"\non the CPU device (msprobe's monitor runs there), CPU time per step, medians of {args.repeats}:")
    for name in configs:
        print(f"{name:<15} {statistics.median(times[name]) * 1e3:>9.2f} ms {statistics.median(times[name]) / base:>7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=200)
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    if args.memory_steps <= 20:
        parser.error(f"--memory-steps must be more than 20 (the first reading is taken after 20), got {args.memory_steps}")
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
    # A sample is a session of its own: one of every N steps monitors one step in N only when its
    # sample holds a multiple of N steps (5 steps each monitored one in 5).
    sample_steps = {name: args.steps for name in configs}
    sample_steps["every 10 steps"] = -(-args.steps // 10) * 10
    for make in configs.values():
        with make():
            time_steps(case, 2)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    names = list(configs)
    for repeat in range(args.repeats):
        # each configuration first in turn: a machine whose speed drifts within a round favours none
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            with configs[name]():
                times[name].append(time_steps(case, sample_steps[name]))
    with open(out_dir / "run0" / "rank0" / "monitor.csv") as table:
        records = sum(1 for line in table if line.startswith("0,"))

    def median(name: str, column: int) -> float:
        return statistics.median(sample[column] for sample in times[name])

    print(f"torch {torch.__version__}, GPT block + AdamW on npu, 1 thread, {args.repeats} interleaved repeats "
          f"x {args.steps} steps ({sample_steps['every 10 steps']} monitored every 10), medians")
    print(f"{'monitor':<15} {'wall ms':>9} {'ratio':>7} {'cpu ms':>9} {'ratio':>7}")
    for name in configs:
        print(f"{name:<15} {median(name, 0) * 1e3:>9.2f} {median(name, 0) / median('off', 0):>7.3f} "
              f"{median(name, 1) * 1e3:>9.2f} {median(name, 1) / median('off', 1):>7.3f}")
    print(f"({records} records of 6 statistics a step, each in monitor.csv and the TensorBoard file)")
    wall_ratio = median("every step", 0) / median("off", 0)
    cpu_ratio = median("every step", 1) / median("off", 1)

    with monitor(1)():
        time_steps(case, 20)
        early = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        time_steps(case, args.memory_steps - 20)
        late = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory, monitored every step: {early:.0f} MB after 20 steps, {late:.0f} MB after "
          f"{args.memory_steps}")
    against_msprobe(args, out_dir, monitor)
    scratch.cleanup()
    met = max(wall_ratio, cpu_ratio) <= TARGET
    print(f"monitored every step: wall {wall_ratio:.3f}x, cpu {cpu_ratio:.3f}x (target <= {TARGET}): "
          f"{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
