"""torch.npu memory API over the emulated device's allocation counters.

The emulated allocator does not cache: reserved memory equals allocated memory, and
empty_cache() has nothing to release.
"""

from __future__ import annotations

import collections
import warnings

from npukit.npu_backend import _C
from npukit.npu_backend.npu._device import device_index

__all__ = [
    "empty_cache", "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "memory_snapshot", "memory_summary", "mem_get_info",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "get_allocator_backend",
    "caching_allocator_alloc", "caching_allocator_delete",
]

_total_capacity: dict[int, int] = {}
_caching_allocator_blocks: dict[int, object] = {}


def _total(index: int) -> int:
    return _total_capacity.get(index, _C.capacity(index))


def set_total_memory(nbytes: int, device=None) -> None:
    """Set the emulated device's total memory (default 64 GiB); device=None sets every device."""
    if nbytes <= 0:
        raise ValueError(f"NPU memory capacity must be positive, got {nbytes}")
    indices = range(_C.device_count()) if device is None else [device_index(device)]
    for index in indices:
        _total_capacity[index] = nbytes
        _C.set_capacity(index, nbytes)


def empty_cache() -> None:
    """Nothing is cached by the emulated allocator: freed memory is returned at once."""


def memory_allocated(device=None) -> int:
    return _C.memory_allocated(device_index(device))


def max_memory_allocated(device=None) -> int:
    return _C.max_memory_allocated(device_index(device))


def memory_reserved(device=None) -> int:
    return _C.memory_allocated(device_index(device))


def max_memory_reserved(device=None) -> int:
    return _C.max_memory_allocated(device_index(device))


def memory_cached(device=None) -> int:
    return memory_reserved(device)


def max_memory_cached(device=None) -> int:
    return max_memory_reserved(device)


def memory_stats(device=None) -> dict:
    stats = _C.memory_stats(device_index(device))
    return collections.OrderedDict(sorted(stats.items()))


def memory_stats_as_nested_dict(device=None) -> dict:
    nested: dict = {}
    for key, value in _C.memory_stats(device_index(device)).items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory_stats(device_index(device))


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None) -> None:
    reset_peak_memory_stats(device)


def mem_get_info(device=None) -> tuple[int, int]:
    index = device_index(device)
    total = _total(index)
    return total - _C.memory_allocated(index), total


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    if not 0 < fraction <= 1:
        raise ValueError(f"Invalid memory fraction {fraction}: must be in (0, 1]")
    index = device_index(device)
    _C.set_capacity(index, max(1, int(_total(index) * fraction)))


def get_per_process_memory_fraction(device=None) -> float:
    index = device_index(device)
    return _C.capacity(index) / _total(index)


def memory_snapshot() -> list:
    """The emulated allocator keeps no segment history; an empty snapshot, like an idle device."""
    return []


def get_allocator_backend() -> str:
    return "native"


def memory_summary(device=None, abbreviated: bool = False) -> str:
    index = device_index(device)
    stats = _C.memory_stats(index)
    rows = [
        ("Allocated memory", stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"]),
        ("Reserved memory", stats["reserved_bytes.all.current"], stats["reserved_bytes.all.peak"]),
        ("Allocations", stats["allocation.all.current"], stats["allocation.all.peak"]),
    ]
    lines = [f"|  NPU memory summary, device {index} (npukit emulated)", "|  metric            current        peak"]
    for name, current, peak in rows:
        lines.append(f"|  {name:<18}{current:>10}{peak:>12}")
    lines.append(f"|  Capacity          {_C.capacity(index):>10}")
    lines.append(f"|  OOMs              {stats['num_ooms']:>10}")
    return "\n".join(lines)


def caching_allocator_alloc(size: int, device=None, stream=None) -> int:
    import torch

    index = device_index(device)
    block = torch.empty(int(size), dtype=torch.uint8, device=f"npu:{index}")
    pointer = block.data_ptr()
    _caching_allocator_blocks[pointer] = block
    return pointer


def caching_allocator_delete(mem_ptr: int) -> None:
    if _caching_allocator_blocks.pop(mem_ptr, None) is None:
        warnings.warn(f"caching_allocator_delete: {mem_ptr:#x} was not allocated by caching_allocator_alloc", stacklevel=2)
