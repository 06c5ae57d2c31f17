"""What the dump.json writers (the dump, and the overflow detector's event dumps) put in a leaf:
statistics under msprobe's field names, and non-tensor arguments as msprobe describes them."""

from __future__ import annotations

import re

import torch

_STAT_NAMES = ("Max", "Min", "Mean", "Norm")
_INTEGER_DTYPE = re.compile(r"torch\.u?int\d+")


def fill_stats(leaf: dict, values) -> None:
    """Put resolved statistics into a dump.json leaf (msprobe field names, null when empty).

    By the leaf's dtype and shape, as msprobe 26.2 writes them: a bool tensor's Max/Min are
    true/false (any, all) and an integer tensor's are integers, both with Mean and Norm null; a 0-d
    tensor (not bool, not complex) gives its value as all four (Norm too, sign kept)."""
    if values is None:
        for key in _STAT_NAMES:
            leaf[key] = None
        return
    dtype = leaf.get("dtype", "")
    if dtype == "torch.bool":
        values = [bool(values[0]), bool(values[1]), None, None, *values[4:]]
    elif _INTEGER_DTYPE.fullmatch(dtype):
        value = int(values[0]) if leaf.get("shape") == [] else None
        values = [int(values[0]), int(values[1]), value, value, *values[4:]]
    elif leaf.get("shape") == [] and "complex" not in dtype:
        values = [values[0]] * 4 + list(values[4:])
    for key, value in zip(_STAT_NAMES, values):
        leaf[key] = value  # a non-finite one is written bare (NaN, Infinity), as msprobe's json.dump does
    if values[4] or values[5]:
        leaf["nan_count"] = int(values[4])
        leaf["inf_count"] = int(values[5])


def describe_value(value) -> object:
    """JSON description of a non-tensor argument (msprobe style {"type", "value"})."""
    if value is None:
        return None
    if isinstance(value, bool | int | float | str):
        return {"type": type(value).__name__, "value": value}
    if isinstance(value, torch.dtype | torch.device | torch.Size | torch.memory_format | torch.layout):
        return {"type": f"torch.{type(value).__name__}", "value": str(value) if not isinstance(value, torch.Size) else list(value)}
    if isinstance(value, slice):
        return {"type": "slice", "value": [value.start, value.stop, value.step]}
    return {"type": type(value).__name__}
