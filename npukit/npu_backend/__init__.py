"""The embedded emulated Ascend NPU: a real PyTorch device named "npu" on host memory.

`import npukit.npu_backend` installs it: PrivateUse1 is renamed to "npu" (as torch_npu does),
`torch.npu` is registered, Tensor/Module/Storage get `.npu()` and `.is_npu`, and every op runs
the CPU kernel on the same memory under the NPU numeric policies (see `numerics`).

Configuration (environment, read at install): NPUKIT_DEVICE_COUNT (default 8),
ASCEND_RT_VISIBLE_DEVICES (ids, strictly ascending, as on the device), NPUKIT_MEMORY_CAPACITY
(per device, e.g. "16GiB"; default 64 GiB), NPUKIT_CHIP (default Ascend910B2), and the numerics
variables documented in `npukit.npu_backend.numerics`.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import torch

from npukit.errors import UserError

try:
    from npukit.npu_backend import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "npukit's emulated NPU extension (npukit/npu_backend/_C) is not built; run `make install` "
        f"(or `pip install --no-build-isolation -e .`) in the npukit checkout: {exc}"
    ) from exc

DEFAULT_DEVICE_COUNT = 8
_installed = False

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str, what: str) -> int:
    """"16GiB", "512MB", "1073741824" -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise UserError(f"{what}={text!r}: expected a size such as 16GiB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _device_count_from_environment() -> int:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if not all(part.isdigit() for part in ids):
            raise UserError(f"ASCEND_RT_VISIBLE_DEVICES={visible!r}: expected comma-separated device ids")
        numbers = [int(part) for part in ids]
        if numbers != sorted(set(numbers)):
            # torch_npu reports no device at all in this case; say why instead of failing later.
            warnings.warn(f"ASCEND_RT_VISIBLE_DEVICES={visible!r} is not strictly ascending: the NPU runtime "
                          "sees no device (torch.npu.device_count() == 0)", stacklevel=3)
            return 0
        return len(numbers)
    count = os.environ.get("NPUKIT_DEVICE_COUNT")
    if count is None:
        return DEFAULT_DEVICE_COUNT
    if not count.strip().isdigit() or not 0 <= int(count) <= 64:
        raise UserError(f"NPUKIT_DEVICE_COUNT={count!r}: expected a whole number from 0 to 64")
    return int(count)


def install(device_count: int | None = None) -> None:
    """Install the emulated NPU into this process (idempotent)."""
    global _installed
    if device_count is not None:
        if not 0 <= device_count <= 64:
            raise UserError(f"device count must be from 0 to 64, got {device_count}")
        _C.set_device_count(device_count)
    if _installed:
        return
    backend_name = torch._C._get_privateuse1_backend_name()
    if backend_name not in ("privateuseone", "npu"):
        raise RuntimeError(f"PrivateUse1 is already claimed by backend {backend_name!r}; cannot install the npu emulator")
    if device_count is None:
        _C.set_device_count(_device_count_from_environment())
    _C.install()
    _C.route_composite_ops_to_cpu_kernels()
    from npukit.npu_backend import aten_kernels

    aten_kernels.install()  # the few aten ops whose CPU kernel refuses what the device takes
    if backend_name != "npu":
        torch.utils.rename_privateuse1_backend("npu")

    from npukit.npu_backend import npu as npu_module
    from npukit.npu_backend import numerics

    capacity = os.environ.get("NPUKIT_MEMORY_CAPACITY")
    if capacity:
        npu_module.memory.set_total_memory(parse_size(capacity, "NPUKIT_MEMORY_CAPACITY"))
    numerics.apply_environment()
    npu_module._refresh_default_generators()
    torch._register_device_module("npu", npu_module)
    for name in npu_module.SUBMODULES:
        sys.modules[f"torch.npu.{name}"] = getattr(npu_module, name)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    _run_backward_in_calling_thread()
    from npukit.npu_backend import compile as dynamo_backend
    from npukit.npu_backend import distributed

    distributed.install()
    dynamo_backend.install()
    _installed = True


def _run_backward_in_calling_thread() -> None:
    """Backward of npu tensors runs in the calling thread, as for CPU tensors, in every thread.

    Autograd's per-device worker threads are sized when the engine first runs: after a CPU
    backward that ran before install they do not exist for npu (an engine assert), and the
    thread-local state they keep can hold Python objects released during interpreter
    shutdown, which aborts the process at exit.
    """
    import torch.autograd.graph as graph

    torch._C._set_multithreading_enabled(False)
    original = graph._engine_run_backward

    def _engine_run_backward(*args, **kwargs):
        if not torch._C._is_multithreading_enabled():
            return original(*args, **kwargs)
        torch._C._set_multithreading_enabled(False)
        try:
            return original(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(True)

    graph._engine_run_backward = _engine_run_backward
    torch.autograd._engine_run_backward = _engine_run_backward


def is_installed() -> bool:
    return _installed


install()
