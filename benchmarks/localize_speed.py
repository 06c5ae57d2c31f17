"""`npu-compare --trend --localize`'s re-runs at a late step: from the golden monitor's checkpoint
and fast-forwarded, against from the script's beginning.

A regressor (Linear 512 -> W -> LayerNorm -> W -> 1, batch 256, AdamW; `--width W`, default 2048, and
`--dtype` the NPU run's autocast dtype, default none: fp32; what the fast-forward saves is the matrix
products' and the optimizer's share of a step) trains `--steps` steps under
`npu-run --golden --monitor golden --monitor-checkpoint-every K`. Then the two re-runs --localize
makes for step S = steps - 3 are timed (the compare and fix finder that follow are the same in
every variant, and not timed), interleaved, `--repeats` times each:

  checkpoint   the golden re-run fast-forwards to the checkpoint of the latest K-multiple <= S and
               computes from there; the NPU re-run fast-forwards to S (what --localize does when the
               golden monitor wrote checkpoints)
  no-checkpoint the golden re-run computes steps 0-S; the NPU re-run fast-forwards to S (a golden
               monitor without checkpoints)
  full         both compute steps 0-S (--localize before the fast-forward)

Prints the medians (wall seconds) and the ratios full / checkpoint and full / no-checkpoint, with the
load average.

    python benchmarks/localize_speed.py [--steps 200] [--every 25] [--repeats 3] [--width 2048] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = '''\
import sys
import torch
import torch.nn as nn

torch.manual_seed(0)
width, dtype = int(sys.argv[2]), getattr(torch, sys.argv[3])
model = nn.Sequential(nn.Linear(512, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                      nn.Linear(width, 1)).to("npu")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[1])):
    x = torch.randn(256, 512, generator=data).to("npu")
    with torch.autocast("npu", dtype=dtype, enabled=dtype != torch.float32):
        loss = (model(x).float() - x[:, :1].sin()).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048, help="the hidden layers' width")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the NPU run's autocast dtype (float32: none)")
    options = parser.parse_args()

    from npukit.accuracy.localize import rerun_commands, run_rerun
    from npukit.accuracy.step_checkpoints import latest_checkpoint

    step = options.steps - 3
    with tempfile.TemporaryDirectory(prefix="npukit-localize-speed-") as folder:
        os.chdir(folder)
        Path("train.py").write_text(SCRIPT)
        arguments = [str(options.steps), str(options.width), options.dtype]
        command = [sys.executable, "-m", "npukit.run", "train.py", *arguments]
        start = time.perf_counter()
        run_rerun([sys.executable, "-m", "npukit.run", "--golden", "--monitor", "golden",
                   "--monitor-checkpoint-every", str(options.every), "train.py", *arguments], "golden monitor")
        print(f"golden monitor run of {options.steps} steps with checkpoints every {options.every}: "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        checkpoint, checkpoint_folder = latest_checkpoint(Path("golden"), step)
        variants = {
            "checkpoint": rerun_commands(command, step, Path("work"), checkpoint_folder, True),
            "no-checkpoint": (rerun_commands(command, step, Path("work"))[0],
                              rerun_commands(command, step, Path("work"), None, True)[1]),
            "full": rerun_commands(command, step, Path("work")),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(options.repeats):
            names = list(variants)
            names = names[repeat % len(names):] + names[:repeat % len(names)]  # each first in turn
            for name in names:
                shutil.rmtree("work", ignore_errors=True)
                start = time.perf_counter()
                for rerun, what in zip(variants[name], ("golden", "NPU")):
                    run_rerun(rerun, what)
                times[name].append(time.perf_counter() - start)
                print(f"  {name}: {times[name][-1]:.1f} s", flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"\nlocalizing step {step} of {options.steps} (width {options.width}, {options.dtype}; golden checkpoint of "
          f"step {checkpoint}), the two re-runs, medians of {options.repeats}:")
    for name, value in median.items():
        print(f"  {name:14} {value:6.1f} s   (full / this {median['full'] / value:.2f}x)")
    print(f"load average {' '.join(f'{value:.1f}' for value in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
