"""Shared fixtures: small recorded profiles (recorded once per test session to stay fast)."""

from __future__ import annotations

import importlib

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
