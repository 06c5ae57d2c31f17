"""Shared fixtures: small recorded profiles (recorded once per test session to stay fast)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import npukit.profiler
from npukit.profiler.table import EventTable


class MatmulNet(torch.nn.Module):
    """One big matmul (the known dominant op) next to a small linear head and elementwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(384, 384) / 20)
        self.head = torch.nn.Linear(384, 8)

    def forward(self, x):
        h = torch.mm(x, self.weight)  # the dominant op: [batch, 384] x [384, 384]
        return self.head(torch.relu(h)).sum()


def train_steps(model, steps: int, batch: int = 256) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 384)
    for _ in range(steps):
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()


# Large enough that the matmuls take ~10 ms a step: far above any elementwise op even when a
# busy machine delays one of them by a few milliseconds.
PROFILED_BATCH = 1024


@pytest.fixture(scope="session")
def matmul_profile(tmp_path_factory):
    """(profile root, loaded rank-0 table) of 4 MatmulNet training steps, schedule 1,1,2."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("matmul_prof")
    model = MatmulNet()
    with npukit.profiler.profile(root, steps="1,1,2"):
        train_steps(model, 4, batch=PROFILED_BATCH)
    return root, EventTable.load(root / "rank0")


def _import_backend() -> str | None:
    """Import the emulated device now, before any backward pass: the autograd engine sizes its
    per-device queues on first use, so (as under npu-run) the device must exist by then.
    Returns why it is unavailable, or None."""
    try:
        backend = importlib.import_module("npukit.npu_backend")
    except Exception as exc:  # a half-built backend raises more than ImportError
        return f"npukit.npu_backend not importable: {type(exc).__name__}: {exc}"
    if getattr(backend, "__file__", None) is None:  # a bare directory (namespace package): not built yet
        return "npukit.npu_backend has no __init__.py yet"
    return None


_BACKEND_MISSING = _import_backend()


@pytest.fixture
def npu_device():
    """The emulated npu device; skips only when npukit.npu_backend cannot be imported."""
    if _BACKEND_MISSING:
        pytest.skip(_BACKEND_MISSING)
    return torch.device("npu:0")


REPO = Path(__file__).resolve().parents[2]
# The straggler fixture's rank 1 sleeps this long before each forward: long against what a busy
# shared machine adds to an all_reduce of 1 MB (10-20 ms seen), which the sleeping rank pays too
# (at 100 ms that was 10% of its step, the collective-wait rule's threshold, once the start-up was
# no longer counted as a step).
SLEEP_US = 200_000
DDP_SCRIPT = f"""
import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("hccl")
straggler = int(sys.argv[1])
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).npu()
ddp = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(16, 256, device="npu")
    if dist.get_rank() == straggler:
        time.sleep({SLEEP_US / 1e6})  # a slower input pipeline on one rank
    loss = ddp(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()  # with DDP still alive, as users write it (this hung at exit before)
"""


def npu_run_profile(tmp_path: Path, script: str, nproc: int, *args: str, timeout: float = 240) -> Path:
    """`npu-run --nproc-per-node N --profile DIR script.py args`, the profile directory returned."""
    path = tmp_path / "script.py"
    path.write_text(script)
    out = tmp_path / "prof"
    npu_run_ranks(tmp_path, nproc, "--profile", str(out), str(path), *args, timeout=timeout)
    return out


def npu_run_ranks(folder: Path, nproc: int, *arguments: str, timeout: float = 240) -> str:
    """`npu-run --nproc-per-node N ARGUMENTS` in folder (npu-run's options, the script and its
    arguments); its output (stdout and stderr). A run that does not end in time is killed, with
    every rank."""
    # its own process group, so a hang kills torchrun and every rank (not only the launcher: the
    # ranks would keep torchrun's port for the next run)
    run = subprocess.Popen([sys.executable, "-m", "npukit.run", "--nproc-per-node", str(nproc), *arguments],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder,
                           env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    try:
        stdout, stderr = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(run.pid), run.pid]:  # torchrun starts each rank in a session of its own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _, stderr = run.communicate(timeout=60)
        pytest.fail(f"the {nproc}-rank run did not finish in {timeout} s: {stderr[-3000:]}")
    assert run.returncode == 0, stderr[-3000:]
    return stdout + stderr


def _descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), children before their parents."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found = children + found
        frontier = children
    return found


@pytest.fixture(scope="session")
def straggler_profile(tmp_path_factory):
    """A 2-rank DDP run recorded by npu-run; rank 1 sleeps SLEEP_US before each forward."""
    return npu_run_profile(tmp_path_factory.mktemp("ddp"), DDP_SCRIPT, 2, "1")
