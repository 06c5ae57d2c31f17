import subprocess
import sys
import textwrap

import pytest
import torch

import npukit.npu_backend  # noqa: F401  (installs the emulated device)
from npukit.npu_backend import numerics


@pytest.fixture(autouse=True)
def restore_numerics():
    """Tests may switch policies; every test starts from and returns to the defaults."""
    state = numerics.current()
    numerics.clear_overflow_flag()
    torch.npu.set_device(0)
    yield
    numerics.restore(state)
    numerics.clear_overflow_flag()
    torch.npu.set_device(0)


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (for process-global patches such as transfer_to_npu)."""
    import os

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


# DDP training under fp16 autocast and GradScaler, 4 steps: rank 5 sleeps in its forward (argv[1]
# seconds, else 0.05), rank argv[2] (else 6)'s batch overflows fp16 at step argv[3] (else 2); each rank
# says whether its weights equal all the others' at the end.
DDP_TRAIN = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    dist.init_process_group("hccl")
    rank = dist.get_rank()
    sleep, overflows, at_step = (float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0.05, 6, 2)

    class Straggling(nn.Sequential):
        def forward(self, x):
            if rank == 5:
                time.sleep(sleep)  # the injected straggler: slower in its forward
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Straggling(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).npu())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("npu", init_scale=256)
    for step in range(4):
        x = torch.randn(8, 64, device="npu")
        if rank == overflows and step == at_step:
            x = x * 1e5  # this rank's batch overflows fp16 in its first linear
        with torch.autocast("npu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    weights = model.module[0].weight.detach().cpu()
    everyone = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weights)
    print(f"rank {rank} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}: "
          f"weights equal everywhere {all(torch.equal(w, weights) for w in everyone)}", flush=True)
    dist.destroy_process_group()
""")
