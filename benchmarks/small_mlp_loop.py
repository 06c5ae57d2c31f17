"""N training steps of one of backend_overhead.py's cases on one device, for an instruction count.

    OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0 PYTHONMALLOC=malloc valgrind --tool=callgrind \\
        --toggle-collect=functools_reduce python benchmarks/small_mlp_loop.py npu 100 ["Adam MLP"]

Wall-clock ratios of a dispatch-bound case move with the machine's load and with the process;
instructions do not. The steps run inside functools.reduce, so --toggle-collect=functools_reduce
counts them alone (after three warm-up steps): no start-up, no interpreter shutdown, whose counts
moved by a few hundred thousand instructions from run to run when runs of 20 and 220 steps were
subtracted instead. OPENBLAS_NUM_THREADS=1 keeps numpy's BLAS threads (imported with npukit's
dependencies) from spinning into the count (docs/npu-backend-extras.md).
"""

from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import CASES  # noqa: E402


def main() -> int:
    device, steps = sys.argv[1], int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "small MLP"
    torch.set_num_threads(1)
    import npukit.npu_backend  # noqa: F401

    torch.manual_seed(0)
    model, optimizer, loss_fn = CASES[name](device)

    def step(carry, _):  # backend_overhead.time_steps' step
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
        return carry

    for _ in range(3):
        step(None, None)
    gc.collect()
    functools.reduce(step, range(steps), None)  # what --toggle-collect=functools_reduce counts
    return 0


if __name__ == "__main__":
    sys.exit(main())
