"""A CUDA-written training script, migrated by npu-migrate, trains under npu-run on the emulated NPU."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npukit.migrate import MigrateOptions, run_migration

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "cuda_train.py"


@pytest.fixture
def npu_backend() -> None:
    """Skip only when the emulated device cannot be imported (it is built by another part of npukit)."""
    try:
        import npukit.npu_backend  # noqa: F401
    except Exception as exc:  # the extension may not be built yet
        pytest.skip(f"npukit.npu_backend cannot be imported: {exc}")
    if importlib.util.find_spec("npukit.run") is None:
        pytest.skip("npu-run (npukit.run) is not available")


def test_migrated_script_trains_on_the_emulated_npu(tmp_path: Path, npu_backend: None) -> None:
    script = tmp_path / "train.py"
    shutil.copy(FIXTURE, script)
    run = run_migration(MigrateOptions(target=tmp_path, quiet=True))
    assert [r.path for r in run.changed] == ["train.py"]
    migrated = script.read_text()
    assert "torch.cuda" not in migrated and ".cuda()" not in migrated
    result = subprocess.run([sys.executable, "-m", "npukit.run", str(script)], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    fields = dict(item.split("=") for item in result.stdout.split())
    assert fields["device"] == "npu:0"
    assert fields["is_cuda"] == "True"  # the migrated `x.is_npu`
    assert float(fields["last"]) < float(fields["first"])


# A CUDA project holding the classes of mistakes found on open-source repositories (see
# test_real_code_classes.py): a module name rebound to the model, a whole pickled model loaded
# back, a GradScaler() that defaults to CUDA, a condition with a compute-capability test.
_CLASSES_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
'''

_CLASSES_TRAIN = '''
import sys
import torch
import model

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
    dtype = torch.float32
else:
    dtype = torch.bfloat16
model = model.Net()
model = model.cuda()
scaler = torch.amp.GradScaler()
resumed = torch.load(sys.argv[1], weights_only=False) if len(sys.argv) > 1 else model
x = torch.randn(3, 4).cuda()
print("dtype", dtype, "model", next(model.parameters()).device, "scaler", scaler.is_enabled(),
      "resumed", resumed(x).device)
'''


def _save_as_on_cuda(obj, path: Path) -> None:
    """torch.save with every storage tagged "cuda:0", as a checkpoint written on a GPU host is."""
    import torch.serialization as serialization

    entry = (0, lambda storage: "cuda:0", lambda storage, location: None)
    serialization._package_registry.insert(0, entry)
    try:
        serialization.torch.save(obj, path)
    finally:
        serialization._package_registry.remove(entry)


def test_migrated_classes_run_and_take_the_runtime_routes_branch(tmp_path: Path, npu_backend: None) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "model.py").write_text(_CLASSES_MODEL)
    (project / "train.py").write_text(_CLASSES_TRAIN)
    sys.path.insert(0, str(project))
    try:
        import model as classes_model

        _save_as_on_cuda(classes_model.Net(), tmp_path / "whole_model.pt")  # a pickled model, as users resume one
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("model", None)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runtime = subprocess.run([sys.executable, "-m", "npukit.run", "--transfer-to-npu", "train.py"],
                             capture_output=True, text=True, env=env, timeout=300, cwd=project)
    run = run_migration(MigrateOptions(target=project, out=tmp_path / "migrated", quiet=True))
    kinds = {f.kind for f in run.findings}
    assert {"mixed-condition", "device-capability", "torch-load"} <= kinds
    assert "cuda-leftover" not in kinds
    migrated = subprocess.run([sys.executable, "-m", "npukit.run", "train.py", str(tmp_path / "whole_model.pt")],
                              capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path / "migrated")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    assert "dtype torch.float32 model npu:0 scaler True resumed npu:0" in migrated.stdout
    assert runtime.returncode == 0, runtime.stderr[-3000:]
    assert migrated.stdout.split()[1] == runtime.stdout.split()[1]  # the same branch by either route
