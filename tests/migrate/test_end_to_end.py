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
