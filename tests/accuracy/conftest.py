import importlib

import pytest

# The emulated device must be registered before the first backward of the process: the autograd
# engine sizes its per-device queues when it starts.
try:
    importlib.import_module("npukit.npu_backend")
    _NPU_ERROR = None
except ImportError as exc:
    _NPU_ERROR = exc


@pytest.fixture
def npu():
    """The emulated NPU device; skips only when npukit.npu_backend cannot be imported."""
    if _NPU_ERROR is not None:
        pytest.skip(f"npukit.npu_backend not importable: {_NPU_ERROR}")
    return "npu"
