"""NPU numeric policies of the emulated device, each switchable from Python or the environment.

| policy            | default  | env var                         | what it does                                   |
|-------------------|----------|---------------------------------|------------------------------------------------|
| fp16_mode         | inf_nan  | NPUKIT_FP16_MODE / INF_NAN_MODE_ENABLE=0 | "saturation": fp16 results clamp to +-65504, NaN -> 0, sticky overflow flag set (Ascend 910A / saturation CANN default); "inf_nan": IEEE inf/nan (910B) |
| fp32_accumulate   | on       | NPUKIT_FP32_ACCUMULATE=0        | fp16/bf16 matmul and conv computed in fp32, rounded once |
| matmul_hf32       | off      | torch.npu.matmul.allow_hf32     | fp32 matmul inputs rounded to HF32 (10-bit mantissa) |
| conv_hf32         | on       | torch.npu.conv.allow_hf32       | fp32 conv inputs rounded to HF32 (torch_npu default: on) |
| reject_fp64       | on       | NPUKIT_REJECT_FP64=0            | float64 matmul/conv raise an error naming the op |

`disable_all()` turns every policy off (the golden run): the device then computes exactly
like the CPU.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from npukit.errors import UserError
from npukit.npu_backend import _C

FP16_MODES = ("inf_nan", "saturation")


@dataclass(frozen=True)
class Numerics:
    fp16_mode: str
    fp32_accumulate: bool
    matmul_hf32: bool
    conv_hf32: bool
    reject_fp64: bool

    def as_dict(self) -> dict:
        return asdict(self)


def current() -> Numerics:
    return Numerics(
        fp16_mode="saturation" if _C.get_saturation() else "inf_nan",
        fp32_accumulate=_C.get_fp32_accumulate(),
        matmul_hf32=_C.get_matmul_hf32(),
        conv_hf32=_C.get_conv_hf32(),
        reject_fp64=_C.get_reject_fp64(),
    )


def configure(
    fp16_mode: str | None = None,
    fp32_accumulate: bool | None = None,
    matmul_hf32: bool | None = None,
    conv_hf32: bool | None = None,
    reject_fp64: bool | None = None,
) -> Numerics:
    """Set the given policies (None leaves one as it is) and return the previous state."""
    previous = current()
    if fp16_mode is not None:
        if fp16_mode not in FP16_MODES:
            raise UserError(f"fp16 mode must be one of {', '.join(FP16_MODES)}, got {fp16_mode!r}")
        _C.set_saturation(fp16_mode == "saturation")
    if fp32_accumulate is not None:
        _C.set_fp32_accumulate(bool(fp32_accumulate))
    if matmul_hf32 is not None:
        _C.set_matmul_hf32(bool(matmul_hf32))
    if conv_hf32 is not None:
        _C.set_conv_hf32(bool(conv_hf32))
    if reject_fp64 is not None:
        _C.set_reject_fp64(bool(reject_fp64))
    return previous


def restore(state: Numerics) -> None:
    configure(**state.as_dict())


def set_fp16_mode(mode: str) -> None:
    configure(fp16_mode=mode)


def fp16_mode() -> str:
    return current().fp16_mode


def disable_all() -> Numerics:
    """Golden-run numerics: the device computes exactly as the CPU does. Returns the old state."""
    return configure(fp16_mode="inf_nan", fp32_accumulate=False, matmul_hf32=False,
                     conv_hf32=False, reject_fp64=False)


@contextlib.contextmanager
def policies(**settings) -> Iterator[Numerics]:
    """Temporarily set policies: `with policies(fp16_mode="saturation"): ...`."""
    previous = configure(**settings)
    try:
        yield current()
    finally:
        restore(previous)


_golden_locked = False


def lock_golden() -> None:
    """Golden run (`npu-run --golden`, NPUKIT_GOLDEN=1): every policy off, and the script's own
    switches (`torch.npu.matmul.allow_hf32 = True` ...) are ignored, so the run stays fp32."""
    global _golden_locked
    disable_all()
    _golden_locked = True


def golden_locked() -> bool:
    return _golden_locked


def script_switch(name: str, value: bool, setter) -> None:
    """Apply a torch.npu precision switch set by user code, unless a golden run locks numerics."""
    if _golden_locked:
        if value:
            warnings.warn(f"golden run: ignoring {name} = {value} (NPU numerics stay off)", stacklevel=3)
        return
    setter(bool(value))


@contextlib.contextmanager
def golden() -> Iterator[None]:
    previous = disable_all()
    try:
        yield
    finally:
        restore(previous)


# Overflow flag (the device's sticky float-status register).
def overflow_flag() -> bool:
    return _C.get_overflow_flag()


def clear_overflow_flag() -> None:
    _C.set_overflow_flag(False)


def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    lowered = value.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise UserError(f"environment variable {name}={value!r}: expected 1/0, true/false or on/off")


def apply_environment() -> None:
    """Read the NPUKIT_* (and CANN's INF_NAN_MODE_ENABLE) variables at install time."""
    mode = os.environ.get("NPUKIT_FP16_MODE")
    inf_nan = _env_bool("INF_NAN_MODE_ENABLE")
    if mode is None and inf_nan is not None:
        mode = "inf_nan" if inf_nan else "saturation"
    if mode is not None:
        if mode not in FP16_MODES:
            raise UserError(f"environment variable NPUKIT_FP16_MODE={mode!r}: expected one of {', '.join(FP16_MODES)}")
        configure(fp16_mode=mode)
    configure(fp32_accumulate=_env_bool("NPUKIT_FP32_ACCUMULATE"),
              reject_fp64=_env_bool("NPUKIT_REJECT_FP64"))
    if _env_bool("NPUKIT_GOLDEN"):
        lock_golden()
