"""N training steps of backend_overhead.py's small MLP on one device, for an instruction count.

    PYTHONMALLOC=malloc valgrind --tool=callgrind python benchmarks/small_mlp_loop.py npu 220

Wall-clock ratios of this dispatch-bound case move with the machine's load and with the process;
instructions do not. Run it with 20 and 220 steps on each device: the differences are 200 steps'
work without the start-up (docs/npu-backend-extras.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import small_mlp_case, time_steps  # noqa: E402


def main() -> int:
    device, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    import npukit.npu_backend  # noqa: F401

    torch.manual_seed(0)
    if steps:
        time_steps(small_mlp_case(device), steps)  # the benchmark's own step loop
    return 0


if __name__ == "__main__":
    sys.exit(main())
