"""The tensors a hook is handed: found in nested arguments, told apart by version, read as plain values.

tensors_in      the tensors of a (nested) argument structure, in order
tensor_version  a tensor's version counter (inference tensors: a number that changes with every op),
                with ops_ran, which the op and module hooks call to count the ops run
real_view       a complex tensor's values as real numbers
local_shard     what this rank holds of a DTensor or an in-flight functional collective's result
strided_form    the same values as a plain strided tensor (sparse, mkldnn, quantized, DTensor)
"""

from __future__ import annotations

import sys

import torch


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a (nested) argument structure, in order. A loop, not a recursive
    generator: it runs for every op's arguments and outputs."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(item.values()))
    return found


# Ops run so far (counted by the op hooks and the readers' module forward hooks). An inference
# tensor has no version counter: what was recorded of it holds only until the next op runs, which
# may write it in place (a KV cache under torch.inference_mode: cache.add_(x) was recorded with its
# input's values).
_ops_run = 0


def ops_ran() -> None:
    global _ops_run
    _ops_run += 1


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter; for an inference tensor, a number that changes with every op."""
    try:
        return tensor._version
    except RuntimeError:  # inference tensors carry no version counter
        return -1 - _ops_run


def real_view(data: torch.Tensor) -> torch.Tensor:
    """A complex tensor's values as real numbers (its real view: real and imaginary parts side by
    side). Made outside inference mode: under it, a view of an npu tensor made outside it (a rotary
    freqs_cis buffer) fails on the emulated device ("Cannot set version_counter for inference tensor")."""
    with torch.inference_mode(False):
        return torch.view_as_real(data.resolve_conj())


def local_shard(tensor):
    """What this rank holds, as a tensor with data of its own: a DTensor's local shard (FSDP2's
    sharded parameters and their gradients, what DTensor ops return), the result of a functional
    collective still in flight (tensor parallelism's outputs: AsyncCollectiveTensor, waited for);
    any other tensor as it is."""
    distributed_tensor = sys.modules.get("torch.distributed.tensor")
    if distributed_tensor is not None and isinstance(tensor, distributed_tensor.DTensor):
        tensor = tensor._local_tensor
    functional = sys.modules.get("torch.distributed._functional_collectives")
    if functional is not None and isinstance(tensor, functional.AsyncCollectiveTensor):
        tensor = tensor.trigger_wait()
    return tensor


def strided_form(data):
    """The same values as a plain strided tensor: sparse and mkldnn tensors made dense (the
    implicit zeros are values too), quantized ones dequantized, a DTensor's local shard; None for
    nested tensors."""
    data = local_shard(data)
    if data.is_nested:
        return None
    if data.is_quantized:
        return data.dequantize()
    if data.layout != torch.strided:
        return data.to_dense()
    return data
