"""Bugs found by running real repositories through npukit (docs/real-repos.md, bugs 1, 2, 3 and 5).

Each test states the behaviour a user needs and is a strict xfail while the bug is open: when the
bug is fixed the test passes, pytest reports XPASS as a failure, and the fixer removes the marker.
"""

import os
import subprocess
import sys
from pathlib import Path

from npukit.migrate import MigrateOptions, run_migration
from npukit.migrate.pysource import migrate_python

ROOT = Path(__file__).resolve().parents[2]


def _npu_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "npukit.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# nanoGPT's `torch.backends.cuda.matmul.allow_tf32 = True`, as npu-migrate writes it.
HF32_SCRIPT = """
import torch, torch_npu
torch.npu.matmul.allow_hf32 = True
torch.manual_seed(0)
layer = torch.nn.Linear(64, 64).npu()
x = torch.randn(8, 64)
expected = torch.nn.functional.linear(x, layer.weight.detach().cpu(), layer.bias.detach().cpu())
print("max abs difference", (layer(x.npu()).detach().cpu() - expected).abs().max().item())
"""


def test_golden_run_stays_fp32_when_the_script_enables_hf32(tmp_path):
    (tmp_path / "train.py").write_text(HF32_SCRIPT)
    golden = _npu_run(tmp_path, "--golden", "train.py")
    assert golden.returncode == 0, golden.stderr
    assert "max abs difference 0.0\n" in golden.stdout


# word_language_model's shape: the loss is an nn.Module called on the model's output.
LOSS_MODULE_SCRIPT = """
import torch, torch_npu
model = torch.nn.Linear(4, 2).npu()
criterion = torch.nn.MSELoss()
x, y = torch.randn(8, 4).npu(), torch.randn(8, 2).npu()
criterion(model(x), y).backward()
print("weight has a gradient:", model.weight.grad is not None)
"""


def test_replayed_run_still_backpropagates_through_a_loss_module(tmp_path):
    (tmp_path / "train.py").write_text(LOSS_MODULE_SCRIPT)
    for run in ("records", "replays"):
        result = _npu_run(tmp_path, "--seed", "0", "--replay", "replay", "train.py")
        assert result.returncode == 0, result.stderr
        assert "weight has a gradient: True" in result.stdout, f"the run that {run}: {result.stdout}"


# improved-diffusion's improved_diffusion/dist_util.py:30.
BACKEND_SOURCE = """import torch as th
import torch.distributed as dist


def setup_dist():
    backend = "gloo" if not th.cuda.is_available() else "nccl"
    dist.init_process_group(backend=backend)
"""


def test_backend_selected_by_an_availability_test_is_migrated_or_flagged_as_an_error():
    outcome = migrate_python(BACKEND_SOURCE, "dist_util.py")
    assert "th.npu.is_available()" in outcome.text
    migrated = '"hccl"' in outcome.text and '"nccl"' not in outcome.text
    flagged = any(f.severity == "error" and f.line == 6 for f in outcome.findings)
    assert migrated or flagged, [(f.severity, f.kind, f.line) for f in outcome.findings]


# nanoGPT's bench.py shape: `import torch_npu` goes in above the rewritten lines.
SHIFTED_SOURCE = '''"""Benchmark."""
import torch
device = "cuda"
torch.cuda.synchronize()
'''


def test_reported_change_lines_point_at_the_rewritten_code_in_the_copy(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "bench.py").write_text(SHIFTED_SOURCE)
    run = run_migration(MigrateOptions(target=tmp_path / "repo", out=tmp_path / "copy", quiet=True))
    migrated = (tmp_path / "copy" / "bench.py").read_text().splitlines()
    changes = [change for result in run.results for change in result.changes if change.before]
    assert changes
    for change in changes:
        assert migrated[change.line - 1][change.col - 1:].startswith(change.after), (change, migrated)
