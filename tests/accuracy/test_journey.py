"""The user journey end to end: npu-run --golden/--dump/--replay (subprocesses), then the comparison."""

import os
import subprocess
import sys
from pathlib import Path

from npukit.accuracy.compare import compare_dirs

SCRIPT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu  # noqa: F401

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width, eps=EPS)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4)).to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1):
    x = torch.randn(4, 8, device="npu")
    y = torch.randint(0, 4, (4,), device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def npukit(entry_point, *args, cwd):
    """Run a console entry point (`run_main` is npu-run) in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), COLUMNS="160")
    code = f"from npukit.cli import {entry_point}; {entry_point}()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_golden_and_npu_runs_compare_quietly_and_a_bug_is_named(tmp_path, npu):
    (tmp_path / "train.py").write_text(SCRIPT.replace("EPS", "1e-5"))
    (tmp_path / "train_bug.py").write_text(SCRIPT.replace("EPS", "0.5"))
    common = ["--seed", "0", "--replay", "replay", "--dump-mode", "tensor"]
    golden = npukit("run_main", "--golden", *common, "--dump", "golden", "train.py", cwd=tmp_path)
    assert golden.returncode == 0, golden.stderr
    target = npukit("run_main", *common, "--dump", "npu", "train.py", cwd=tmp_path)
    assert target.returncode == 0, target.stderr
    buggy = npukit("run_main", *common, "--dump", "bug", "train_bug.py", cwd=tmp_path)
    assert buggy.returncode == 0, buggy.stderr

    quiet = compare_dirs(tmp_path / "golden", tmp_path / "npu")
    assert [pair.divergence for pair in quiet.pairs] == [None] and quiet.counts()["error"] == 0

    found = compare_dirs(tmp_path / "golden", tmp_path / "bug").pairs[0].divergence
    assert found.entry == "Functional.layer_norm.0.forward" and found.module_path == "1.norm"
    assert any("train_bug.py" in line for line in found.stack)  # the user's line
    assert not any("runpy" in line or "site-packages" in line for line in found.stack)  # not the launcher's
