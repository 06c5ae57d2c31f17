"""Overflow detection cost: training-step time with OverflowSession on vs off, and vs
torch.autograd.detect_anomaly, on the GPT block of benchmarks/backend_overhead.py (npu device).

Interleaved runs (off, op level, module level, detect_anomaly; repeated), medians, 1 thread.

    python benchmarks/overflow_overhead.py [--repeats 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import gpt_case, time_steps  # noqa: E402  (the shared benchmark model)

TARGET_OP_LEVEL = 1.10


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
    out_dir = Path(tempfile.mkdtemp(prefix="npukit-overflow-bench-"))
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
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, make in configs.items():
            with make():
                times[name].append(time_steps(case, args.steps))
    base = statistics.median(times["off"])
    print(f"torch {torch.__version__}, GPT block on npu, 1 thread, {args.repeats} interleaved repeats "
          f"x {args.steps} steps, medians")
    print(f"{'mode':<15} {'ms/step':>9} {'ratio':>7}")
    for name in configs:
        median = statistics.median(times[name])
        print(f"{name:<15} {median * 1e3:>9.2f} {median / base:>7.3f}")
    op_ratio = statistics.median(times["op level"]) / base
    anomaly = statistics.median(times["detect_anomaly"])
    print(f"\nop level vs detect_anomaly: {statistics.median(times['op level']) / anomaly:.3f}x the time")
    met = op_ratio <= TARGET_OP_LEVEL
    print(f"op-level ratio {op_ratio:.3f} (target <= {TARGET_OP_LEVEL}): {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
