import subprocess
import sys
import textwrap

import pytest
import torch

import npukit.npu_backend  # noqa: F401  (installs the emulated device)
from npukit.npu_backend import numerics


@pytest.fixture(autouse=True)
def restore_numerics():
    """Tests may switch policies; every test starts from and returns to the defaults."""
    state = numerics.current()
    numerics.clear_overflow_flag()
    torch.npu.set_device(0)
    yield
    numerics.restore(state)
    numerics.clear_overflow_flag()
    torch.npu.set_device(0)


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (for process-global patches such as transfer_to_npu)."""
    import os

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
