"""Overflow detection cost: training-step time with OverflowSession on vs off, and vs
torch.autograd.detect_anomaly, on the GPT block of benchmarks/backend_overhead.py (npu device).

Interleaved runs (off, op level, module level, detect_anomaly; repeated), medians, 1 thread.
Wall time and process CPU time are both measured: on a shared machine the CPU time of this
single-threaded process is the steadier of the two.

    python benchmarks/overflow_overhead.py [--repeats 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import gpt_case  # noqa: E402  (the shared benchmark model)

TARGET_OP_LEVEL = 1.10


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
    from npukit.accuracy.overflow import OverflowSession

    torch.manual_seed(0)
    case = gpt_case("npu")
    scratch = tempfile.TemporaryDirectory(prefix="npukit-overflow-bench-")  # the sessions' overflow.json
    out_dir = Path(scratch.name)
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

    def detector(level):
        return lambda: OverflowSession(out_dir / level, level=level, console=False)

    configs = {
        "off": contextlib.nullcontext,
        "op level": detector("api"),
        "module level": detector("module"),
        "detect_anomaly": torch.autograd.detect_anomaly,
    }
    for make in configs.values():
        with make():
            time_steps(case, 2)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, make in configs.items():
            with make():
                times[name].append(time_steps(case, args.steps))

    def median(name: str, column: int) -> float:
        return statistics.median(sample[column] for sample in times[name])

    print(f"torch {torch.__version__}, GPT block on npu, 1 thread, {args.repeats} interleaved repeats "
          f"x {args.steps} steps, medians")
    print(f"{'mode':<15} {'wall ms':>9} {'ratio':>7} {'cpu ms':>9} {'ratio':>7}")
    for name in configs:
        print(f"{name:<15} {median(name, 0) * 1e3:>9.2f} {median(name, 0) / median('off', 0):>7.3f} "
              f"{median(name, 1) * 1e3:>9.2f} {median(name, 1) / median('off', 1):>7.3f}")
    wall_ratio = median("op level", 0) / median("off", 0)
    cpu_ratio = median("op level", 1) / median("off", 1)
    print(f"\nop level takes {median('op level', 1) / median('detect_anomaly', 1):.3f}x the CPU time of "
          f"detect_anomaly")
    met = max(wall_ratio, cpu_ratio) <= TARGET_OP_LEVEL
    scratch.cleanup()
    print(f"op-level ratio wall {wall_ratio:.3f}, cpu {cpu_ratio:.3f} (target <= {TARGET_OP_LEVEL}): "
          f"{'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
