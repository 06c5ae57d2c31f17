"""npu-compare --trend --localize's parts: npu-run --stop-after-step and --replay-step, and the re-run
commands built from the user's npu-run command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from npukit.accuracy.localize import rerun_commands
from npukit.errors import UserError

TRAIN = '''\
import sys
import torch
import torch.nn as nn
torch.manual_seed(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to("npu")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(int(sys.argv[1]))
for step in range(6):
    x = torch.randn(4, 8, generator=data).to("npu")
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print("step", step, "loss", repr(loss.item()), flush=True)
print("finished")
'''


def npu_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npukit.run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)}


def test_stop_after_step_ends_the_run_once_that_step_ended_and_its_dump_is_written(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    run = npu_run("--stop-after-step", "2", "--dump", "dump", "--dump-steps", "2", "train.py", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(losses(run.stdout)) == [0, 1, 2] and "finished" not in run.stdout
    assert "stopped after step 2 (--stop-after-step)" in run.stderr
    assert [path.name for path in (tmp_path / "dump").iterdir()] == ["step2"]
    assert (tmp_path / "dump" / "step2" / "rank0" / "dump.json").is_file()


def test_replay_step_gives_the_npu_run_the_golden_runs_state_at_that_step(tmp_path):
    """The golden run records the state at step 3's start; a run seeded otherwise (its own weights,
    data and Adam moments for steps 0-2) computes step 3 as the golden run did."""
    (tmp_path / "train.py").write_text(TRAIN)
    golden = npu_run("--golden", "--replay", "state", "--replay-step", "3", "train.py", "0", cwd=tmp_path)
    other = npu_run("--replay", "state", "--replay-step", "3", "train.py", "1", cwd=tmp_path)
    assert golden.returncode == 0 and other.returncode == 0, golden.stderr + other.stderr
    golden_losses, other_losses = losses(golden.stdout), losses(other.stdout)
    assert all(golden_losses[step] != other_losses[step] for step in range(3))
    assert golden_losses[3] == other_losses[3]
    mismatch = npu_run("--replay", "state", "--replay-step", "2", "train.py", "1", cwd=tmp_path)
    assert mismatch.returncode != 0 and "recorded at the start of step 3" in mismatch.stderr
    alone = npu_run("--replay-step", "2", "train.py", "1", cwd=tmp_path)
    assert alone.returncode != 0 and "--replay-step N goes with --replay DIR" in alone.stderr


def test_the_reruns_replace_the_users_watching_options_and_keep_the_rest(tmp_path):
    command = ["npu-run", "--seed", "0", "--monitor", "mon/npu", "--monitor-every", "2", "--dump", "old", "--devices",
               "2", "train.py", "--epochs", "3", "--dump", "scripts-own"]
    golden, npu = rerun_commands(command, 40, "blocks.1.mlp", "weight", tmp_path)
    for rerun in (golden, npu):
        options = rerun[rerun.index("npukit.run") + 1:rerun.index("train.py")]
        assert "--monitor" not in options and "--monitor-every" not in options and "old" not in options
        assert options[:4] == ["--seed", "0", "--devices", "2"]
        assert rerun[rerun.index("train.py"):] == ["train.py", "--epochs", "3", "--dump", "scripts-own"]
        for option, value in (("--replay-step", "40"), ("--dump-steps", "40"), ("--stop-after-step", "40"),
                              ("--dump-mode", "tensor"), ("--dump-scope", "blocks.1.mlp,optimizer")):
            assert options[options.index(option) + 1] == value
    assert "--golden" in golden and "--golden" not in npu
    assert golden[golden.index("--dump") + 1] == str(tmp_path / "golden")
    activation = rerun_commands(command, 40, "blocks.1.mlp", "activation", tmp_path)[1]
    assert activation[activation.index("--dump-scope") + 1] == "blocks.1.mlp"  # no optimizer ops for an output
    with pytest.raises(UserError, match="names no script"):
        rerun_commands(["npu-run", "--seed", "0"], 1, "", "loss", tmp_path)
