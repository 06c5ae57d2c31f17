"""The monitor's checkpoints and npu-run --fast-forward under torchrun: each rank writes its own
state (DIR/checkpoints/step-N/rank{R}) and a run fast-forwarded to a checkpoint computes, on every
rank, what the recorded run computed from that step on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# DDP over hccl, dropout on the npu, a DistributedSampler: each rank's weights, optimizer state, data
# order and masks come from the script's own loop
_TWO_RANKS = """
import json, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("hccl")
rank = dist.get_rank()
torch.npu.set_device(rank)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 2)).npu())
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
losses = []
for x, y in DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=3)):
    loss = F.mse_loss(model(x.npu()), y.npu())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
with open(f"losses.{sys.argv[1]}.rank{rank}", "w") as out:
    json.dump(losses, out)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two 2-rank runs (~35 s)
def test_on_two_ranks_a_run_fast_forwarded_to_a_checkpoint_computes_what_each_rank_did(tmp_path):
    (tmp_path / "train.py").write_text(_TWO_RANKS)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    def npu_run(*options):
        run = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", *options],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stderr

    npu_run("--monitor", "mon", "--monitor-checkpoint-every", "3", "train.py", "recorded")
    for step in (3, 6):
        assert sorted(path.name for path in (tmp_path / "mon" / "checkpoints" / f"step-{step}").iterdir()) == \
            ["rank0", "rank1"]
    printed = npu_run("--fast-forward", "mon/checkpoints/step-6", "train.py", "fast")
    assert printed.count("npu-run: fast-forwarded steps 0-5") == 2  # each rank says it
    for rank in (0, 1):
        recorded, fast = (json.loads((tmp_path / f"losses.{run}.rank{rank}").read_text()) for run in ("recorded", "fast"))
        assert len(recorded) == len(fast) == 8
        assert fast[:6] != recorded[:6]  # computed on zeros
        assert fast[6:] == recorded[6:], rank  # from the checkpoint on: that rank's run exactly
