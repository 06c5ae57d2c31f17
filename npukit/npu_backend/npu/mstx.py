"""torch_npu.npu.mstx (the NVTX analogue): ranges and marks show up in torch.profiler traces."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading

import torch

__all__ = ["mark", "range_push", "range_pop", "range_start", "range_end", "mstx_range", "annotate"]

_local = threading.local()
_ranges: dict[int, object] = {}
_range_ids = itertools.count(1)


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def mark(message: str = "", stream=None, domain: str = "default") -> None:
    with torch.profiler.record_function(f"mstx::mark::{message}"):
        pass


def range_push(message: str, stream=None, domain: str = "default") -> int:
    handle = torch.ops.profiler._record_function_enter_new(f"mstx::{message}", None)
    _stack().append(handle)
    return len(_stack()) - 1


def range_pop(domain: str = "default") -> int:
    stack = _stack()
    if not stack:
        return -1
    torch.ops.profiler._record_function_exit._RecordFunction(stack.pop())
    return len(stack)


def range_start(message: str, stream=None, domain: str = "default") -> int:
    range_id = next(_range_ids)
    _ranges[range_id] = torch.ops.profiler._record_function_enter_new(f"mstx::{message}", None)
    return range_id


def range_end(range_id: int, domain: str = "default") -> None:
    handle = _ranges.pop(range_id, None)
    if handle is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


class mstx_range(contextlib.ContextDecorator):
    """`with mstx.mstx_range("step"):` or as a decorator."""

    def __init__(self, message: str, stream=None, domain: str = "default"):
        self.message = message
        self.range_id = 0

    def __enter__(self):
        self.range_id = range_start(self.message)
        return self

    def __exit__(self, *exc):
        range_end(self.range_id)
        return False


def annotate(message: str, stream=None, domain: str = "default"):
    return mstx_range(message)


range = functools.partial(mstx_range)  # noqa: A001 (nvtx.range spelling)
