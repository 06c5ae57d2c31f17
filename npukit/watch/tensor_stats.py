"""Tensor statistics, as every reader measures them: max, min, mean, norm, nan and inf counts.

tensor_stats  one tensor's statistics, computed on its own device (one pass over host memory)
StatsBuffer   a step's statistics, fetched from the device with one copy

The one-pass kernels are the compiled modules npukit.watch._stats and _tensor_stats (built from
npukit/watch/csrc/, which the compare's metrics and the event-file writer use too).
"""

from __future__ import annotations

import math

import torch

from npukit.watch._stats import stats as one_pass_stats
from npukit.watch._tensor_stats import host_stats
from npukit.watch.process import host_memory, npu_in_host_memory
from npukit.watch.tensors import real_view, strided_form


def tensor_stats(tensor: torch.Tensor):
    """Max, Min, Mean, Norm, nan count, inf count of a tensor, computed on its own device.

    Returns a list of floats on host-memory devices (no sync cost there), otherwise a float
    tensor of 6 values still on the device, to be fetched with the rest of the step
    (StatsBuffer). None for empty tensors. A complex tensor is measured as its real view (real and
    imaginary parts side by side): Norm is its 2-norm, Max/Min/Mean are over both parts.
    """
    # a plain float tensor in host memory, read in place, its fields read in C++: the conversions
    # below, and even reading those fields from Python in a cache-cold hook, are most of the cost of
    # the hundreds of small tensors a monitored or dumped step measures
    values = host_stats(tensor, npu_in_host_memory())
    if values is not None:
        return values
    with torch._C.DisableTorchFunction():
        data = strided_form(tensor.detach())
        if data is None or data.numel() == 0:
            return None
        if data.is_complex():
            data = real_view(data)
        if not data.is_floating_point():
            data = data.to(torch.float64)
        if host_memory(data):
            return _host_stats(data)
        accumulate = torch.float64 if data.dtype == torch.float64 else torch.float32
        low, high = torch.aminmax(data)
        mean = data.mean(dtype=accumulate)
        norm = torch.linalg.vector_norm(data, dtype=accumulate)
        return torch.stack([
            high.to(accumulate), low.to(accumulate), mean, norm,
            torch.isnan(data).sum().to(accumulate), torch.isinf(data).sum().to(accumulate),
        ]).to(torch.float64)


_ONE_PASS_KINDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _finite_stats(result: tuple, count: int) -> list[float]:
    """tensor_stats' values from one_pass_stats' (max, min, sum, sum of squares, finite)."""
    return [result[0], result[1], result[2] / count, math.sqrt(result[3]), 0.0, 0.0]


def _host_stats(data: torch.Tensor) -> list[float]:
    kind = _ONE_PASS_KINDS.get(data.dtype)
    if kind is not None and data.data_ptr():  # a tensor subclass without data of its own: torch's path
        # One read of the data instead of torch's four reductions (3-10x faster, and summed more
        # exactly); slices and transposes are read in place. The kernel skips NaN in max/min,
        # so data with nan or inf takes torch's path below.
        result = one_pass_stats(data.data_ptr(), kind, data.shape, data.stride())
        if result is None:  # overlapping or finely strided: cheaper copied than reduced four times
            dense = data.contiguous()
            result = one_pass_stats(dense.data_ptr(), kind, dense.shape, dense.stride())
        if result[4]:
            return _finite_stats(result, data.numel())
    # float64, integers (as float64) and data with nan/inf. One intra-op thread: these
    # reductions are memory-bound, and a parallel region per small reduction waits for a busy
    # second core (measured 16 ms instead of 0.3 ms under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # amax + amin: two vectorised passes, 40% faster than aminmax on CPU. Sums in float64:
        # squares of large finite float32 values overflow float32.
        high, low = data.amax(), data.amin()
        values = [float(high), float(low), float(data.mean(dtype=torch.float64)),
                  float(torch.linalg.vector_norm(data, dtype=torch.float64)), 0.0, 0.0]
        # max and min are finite exactly when no element is nan or inf (nan propagates).
        if not (abs(values[0]) < float("inf") and abs(values[1]) < float("inf")):
            values[4] = float(torch.isnan(data).sum())
            values[5] = float(torch.isinf(data).sum())
        return values
    finally:
        torch.set_num_threads(threads)


class StatsBuffer:
    """Collects tensor_stats results of one step and resolves them with one device->host copy."""

    def __init__(self) -> None:
        self._values: list = []
        self._device_slots: list[int] = []

    def add(self, tensor: torch.Tensor) -> int:
        return self.add_values(tensor_stats(tensor))

    def add_values(self, stats) -> int:
        """A slot for statistics already computed (tensor_stats' result)."""
        if isinstance(stats, torch.Tensor):
            self._device_slots.append(len(self._values))
        self._values.append(stats)
        return len(self._values) - 1

    def resolve(self) -> list:
        if self._device_slots:
            with torch._C.DisableTorchFunction():
                fetched = torch.stack([self._values[i] for i in self._device_slots]).cpu().tolist()
            for slot, values in zip(self._device_slots, fetched):
                self._values[slot] = values
            self._device_slots = []
        return self._values
