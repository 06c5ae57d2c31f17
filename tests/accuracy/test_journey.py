"""The user journey end to end: npu-run --golden/--dump/--replay, then npu-compare (subprocesses)."""

import os
import subprocess
import sys
from pathlib import Path

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
for step in range(2):
    x = torch.randn(4, 8, device="npu")
    y = torch.randint(0, 4, (4,), device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def npukit(entry_point, *args, cwd):
    """Run a console entry point (`run_main` is npu-run, `compare_main` npu-compare) in a fresh process."""
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

    quiet = npukit("compare_main", "golden", "npu", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "No divergence found" in quiet.stdout

    found = npukit("compare_main", "golden", "bug", "--html", "bug.html", cwd=tmp_path)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "First divergence" in found.stdout and "Functional.layer_norm.0.forward" in found.stdout
    assert "train_bug.py" in found.stdout  # the user's line, from the stack
    assert (tmp_path / "bug.html").is_file()

