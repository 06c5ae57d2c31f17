"""Estimated NPU time per op from a roofline model of a named Ascend chip.

    peak FLOP/s (fp16/bf16) = AI cores x clock x 8192 FLOP/cycle (the cube unit: a 16x16x16
                              fp16 matmul = 4096 multiply-adds per cycle per core)
    estimated time          = max(flops / peak(dtype), bytes / memory bandwidth)

This is an estimate, not a measurement: it ignores launch overhead, format conversion
(TransData), vector-unit limits and overlap. Figures are public spec-sheet values; the memory
bandwidth is a setting (`--bandwidth GB/s`) because it varies with the HBM configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npukit.errors import UserError

CUBE_FLOP_PER_CYCLE_FP16 = 8192

# Throughput relative to fp16 on the cube unit. fp32 matmuls run as HF32 on the cube (910B) at
# half rate; int8 runs at double rate. float64 has no cube/vector path: it runs on the AI CPU,
# modelled here at 1/256 of the cube rate so such ops show up as the outliers they are.
DTYPE_RATE = {
    "float16": 1.0, "bfloat16": 1.0, "float32": 0.5, "int8": 2.0, "uint8": 2.0,
    "float64": 1 / 256, "complex128": 1 / 256, "complex64": 0.5,
}


@dataclass(frozen=True)
class Chip:
    name: str
    ai_cores: int
    clock_ghz: float
    bandwidth_gbs: float  # HBM bandwidth, GB/s (default; overridable)

    def peak_flops(self, dtype: str = "float16") -> float:
        rate = DTYPE_RATE.get(dtype, 0.5)
        return self.ai_cores * self.clock_ghz * 1e9 * CUBE_FLOP_PER_CYCLE_FP16 * rate

    def describe(self) -> str:
        return (
            f"{self.name}: {self.ai_cores} AI cores x {self.clock_ghz:g} GHz x {CUBE_FLOP_PER_CYCLE_FP16} FLOP/cycle"
            f" = {self.peak_flops() / 1e12:.0f} TFLOPS fp16/bf16, memory {self.bandwidth_gbs:g} GB/s"
        )


CHIPS = {
    "910B2": Chip("910B2", ai_cores=24, clock_ghz=1.8, bandwidth_gbs=1600.0),
    "910B3": Chip("910B3", ai_cores=20, clock_ghz=1.8, bandwidth_gbs=1600.0),
    "910B4": Chip("910B4", ai_cores=20, clock_ghz=1.65, bandwidth_gbs=800.0),
    "910A": Chip("910A", ai_cores=32, clock_ghz=1.0, bandwidth_gbs=1200.0),
}


def get_chip(name: str, bandwidth_gbs: float | None = None) -> Chip:
    chip = CHIPS.get(name.upper().removeprefix("ASCEND"))
    if chip is None:
        raise UserError(f"--chip {name!r}: unknown chip; choose one of {', '.join(CHIPS)}")
    if bandwidth_gbs is not None:
        if bandwidth_gbs <= 0:
            raise UserError(f"--bandwidth {bandwidth_gbs}: must be a positive number of GB/s")
        chip = Chip(chip.name, chip.ai_cores, chip.clock_ghz, bandwidth_gbs)
    return chip


def estimate_seconds(chip: Chip, flops: np.ndarray, nbytes: np.ndarray, dtypes: np.ndarray) -> np.ndarray:
    """Roofline time per op (vectorized): max(flops / peak(dtype), bytes / bandwidth)."""
    unique, inverse = np.unique(np.asarray(dtypes, dtype=str), return_inverse=True)
    peaks = np.array([chip.peak_flops(d) for d in unique], dtype=np.float64)[inverse.reshape(-1)]
    compute = np.divide(np.asarray(flops, dtype=np.float64), peaks, out=np.zeros(len(peaks)), where=peaks > 0)
    memory = np.asarray(nbytes, dtype=np.float64) / (chip.bandwidth_gbs * 1e9)
    return np.maximum(compute, memory)
