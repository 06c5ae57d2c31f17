"""The emulated NPU in every Python process that npu-run or `pytest --npu` starts.

On an Ascend host every Python process has the NPU: torch_npu registers itself as a torch device
backend (the `torch.backends` entry point group), which `import torch` loads. Scripts and test
suites rely on that in the processes they start themselves: `accelerate launch`, `deepspeed`,
`subprocess.run([sys.executable, "train.py"])`, multiprocessing's spawn.

npukit registers `autoload` in the same group. It does nothing unless NPUKIT_EMULATE=1, which
npu-run and the pytest plugin set when they install the emulator, so their child processes get
the emulated NPU and `torch_npu` when they import torch (with the device count and numerics the
parent passed on in NPUKIT_DEVICE_COUNT, NPUKIT_GOLDEN ...). TORCH_DEVICE_BACKEND_AUTOLOAD=0
turns torch's autoloading off altogether, as for torch_npu. This module lives outside
`npukit.npu_backend`, whose import installs the device: torch imports it in every process.
"""

from __future__ import annotations

import os

ENV_SWITCH = "NPUKIT_EMULATE"


def requested() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "on", "yes")


def pass_on_to_child_processes() -> None:
    """Processes started from this one get the emulated NPU too (called once it is installed)."""
    os.environ[ENV_SWITCH] = "1"


def autoload() -> None:
    """torch's device-backend hook: install the emulated NPU and `torch_npu` if asked for."""
    if not requested():
        return
    import torch

    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "npu"):
        return  # another backend (a real torch_npu loaded first) has the device: leave it
    from npukit.npu_backend import numerics
    from npukit.npu_backend.torch_npu_shim import install_torch_npu

    install_torch_npu()
    if numerics.golden_locked():  # NPUKIT_GOLDEN=1 from a golden parent: its autocast regions in fp32 too
        from npukit.run import golden_autocast

        golden_autocast()
