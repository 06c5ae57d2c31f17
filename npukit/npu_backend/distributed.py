"""The `hccl` process-group backend of the emulated NPU: gloo collectives on npu memory, zero-copy.

`install()` registers "hccl" with `torch.distributed.Backend.register_backend(..., devices=["npu"])`
and adds `torch.distributed.is_hccl_available()`, so `init_process_group("hccl")`,
`init_process_group("npu:hccl,cpu:gloo")`, DDP and FSDP run unchanged under torchrun.

An npu tensor's storage is host memory, so every collective runs gloo directly on a CPU tensor
that aliases the same bytes (same shape, strides and offset): results land in the npu tensor
with no copy. CPU tensors passed to the group go to gloo as they are, which is what a
"npu:hccl,cpu:gloo" group does.
"""

from __future__ import annotations

import contextlib
import ctypes
from datetime import timedelta

import torch
import torch.distributed as dist

from npukit.profiler import COLLECTIVE_MARK

BACKEND_NAME = "hccl"


def cpu_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor viewing the same memory as `tensor` (npu or CPU; CPU tensors are returned as is)."""
    if tensor.device.type != "npu":
        return tensor
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    buffer = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    # The buffer (held by the alias) keeps the npu tensor, and so its memory, alive.
    buffer.owner = tensor
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _started(asked: str, runs: str, start, *args):
    """start(*args), a gloo work; while a profiler records, inside the range that names the
    collective asked for and the one gloo runs for it (npukit.profiler.COLLECTIVE_MARK)."""
    if not torch.autograd._profiler_enabled():
        return start(*args)
    with torch.autograd.profiler.record_function(f"{COLLECTIVE_MARK}{asked}:{runs}"):
        return start(*args)


# Told of each collective that brings inf/nan into this process: its outputs hold them although this
# rank's inputs to it were finite (the overflow detector names so how an overflow spread over ranks).
_NONFINITE_OBSERVERS: list = []


def observe_nonfinite(callback) -> None:
    """callback(collective) (all_reduce, reduce_scatter, all_gather, broadcast, all_to_all) once the
    collective has completed, when it wrote inf/nan here from finite inputs; remove it with
    forget_nonfinite. It may run on a gloo thread."""
    _NONFINITE_OBSERVERS.append(callback)


def forget_nonfinite(callback) -> None:
    if callback in _NONFINITE_OBSERVERS:
        _NONFINITE_OBSERVERS.remove(callback)


def _finite(tensors) -> bool:
    with torch._C.DisableTorchFunction():  # the CPU aliases' own check, not an op of the model
        return all(not t.is_floating_point() or bool(torch.isfinite(t).all()) for t in tensors)


def _watch(asked: str, inputs, outputs):
    """What to check when the work completes, checked before it starts: (collective, its output
    aliases) where someone observes and the inputs are finite; else None."""
    if not _NONFINITE_OBSERVERS or not _finite(inputs):
        return None
    return asked, outputs


def _aliases(tensors):
    return [cpu_alias(t) for t in tensors]


def _nested_aliases(tensor_lists):
    return [_aliases(tensors) for tensors in tensor_lists]


class _AliasWork(dist.Work):
    """The gloo work(s) of one collective, whose result and future yield the caller's (npu) tensors."""

    def __init__(self, gloo_works, result, watch=None):
        super().__init__()
        self._gloo_works = gloo_works if isinstance(gloo_works, list) else [gloo_works]
        self._result = result
        self._watch = watch  # (collective, output aliases) to check once it completes

    def _completed(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None and not _finite(watch[1]):
            for callback in list(_NONFINITE_OBSERVERS):
                callback(watch[0])

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._gloo_works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        self._completed()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._gloo_works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._gloo_works)

    def exception(self):
        for work in self._gloo_works:
            if work.exception() is not None:
                return work.exception()
        return None

    def source_rank(self) -> int:
        return self._gloo_works[0].source_rank()

    def result(self):
        return self._result

    def synchronize(self) -> None:
        for work in self._gloo_works:
            work.synchronize()

    def get_future(self) -> torch.futures.Future:
        result = self._result

        def caller_tensors(done: torch.futures.Future):
            done.wait()  # re-raises a failed collective's error, which then fails the returned future
            self._completed()
            return result

        future = torch.futures.collect_all([work.get_future() for work in self._gloo_works]).then(caller_tensors)
        _WITH_PYTHON_CALLBACKS.difference_update([work for work in _WITH_PYTHON_CALLBACKS if _settled(work)])
        _WITH_PYTHON_CALLBACKS.add(self)
        return future


# Works whose future runs a Python callback when gloo completes them (DDP asks every bucket's). A
# gloo thread completing one needs the GIL: if the group is destroyed meanwhile, the destructor
# joins that thread while holding the GIL, and the process hangs at exit (a DDP model still alive
# after destroy_process_group). shutdown() waits for them, with the GIL released, first.
_WITH_PYTHON_CALLBACKS: set = set()
# Whether this process made an hccl group (gloo threads that may still need the GIL at exit)
groups_made = 0


def _settled(work: _AliasWork) -> bool:
    try:
        return work.is_completed()
    except Exception:  # a work that cannot say: nothing to wait for
        return True


class ProcessGroupHCCL(dist.ProcessGroup):
    """ProcessGroup "hccl" for npu (and CPU) tensors, run by gloo on their zero-copy CPU aliases."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        global groups_made
        groups_made += 1
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # The group's name (which functional collectives resolve groups by) is kept by its
        # registered backends; gloo is the real one for CPU tensors.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        # init_process_group(device_id=torch.device("npu", i)) asks the group for its npu backend
        # (whether it supports splitting); so do DeviceMesh and split_group. Collectives do not go
        # through it: the overrides below take npu tensors to gloo as CPU aliases.
        self._register_backend(torch.device("npu"), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)

    def shutdown(self) -> None:
        """destroy_process_group calls this: finish what gloo threads still complete into Python."""
        for work in list(_WITH_PYTHON_CALLBACKS):
            with contextlib.suppress(Exception):  # a failed collective has been reported to its waiter
                work.wait()
        _WITH_PYTHON_CALLBACKS.clear()
        super().shutdown()

    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # Each override hands gloo the CPU aliases and returns a work whose result is the caller's tensors.
    def broadcast(self, tensors, opts):
        aliases = _aliases(tensors)
        watch = _watch("broadcast", aliases, aliases)
        return _AliasWork(self._gloo.broadcast(aliases, opts), tensors, watch)

    def allreduce(self, tensors, opts):
        aliases = _aliases(tensors)
        watch = _watch("all_reduce", aliases, aliases)
        # marked too: the all_reduces gloo runs are named in order, those asked for and the others
        return _AliasWork(_started("all_reduce", "all_reduce", self._gloo.allreduce, aliases, opts), tensors, watch)

    def allreduce_coalesced(self, tensors, opts):
        aliases = _aliases(tensors)
        watch = _watch("all_reduce", aliases, aliases)
        return _AliasWork(_started("all_reduce", "all_reduce", self._gloo.allreduce_coalesced, aliases, opts), tensors,
                          watch)

    def reduce(self, tensors, opts):
        return _AliasWork(self._gloo.reduce(_aliases(tensors), opts), tensors)

    def allgather(self, output_lists, input_tensors, opts):
        outputs, inputs = _nested_aliases(output_lists), _aliases(input_tensors)
        watch = _watch("all_gather", inputs, [alias for aliases in outputs for alias in aliases])
        return _AliasWork(self._gloo.allgather(outputs, inputs, opts), output_lists, watch)

    def _allgather_base(self, output, input, opts):
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        watch = _watch("all_gather", [input_alias], [output_alias])
        return _AliasWork(self._gloo._allgather_base(output_alias, input_alias, opts), [output], watch)

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        outputs, inputs = _nested_aliases(output_lists), _aliases(input_tensors)
        watch = _watch("all_gather", inputs, [alias for aliases in outputs for alias in aliases])
        return _AliasWork(self._gloo.allgather_coalesced(outputs, inputs, opts), output_lists, watch)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        # gloo has no coalesced form: one collective per pair, in order, awaited together.
        output_aliases, input_aliases = _aliases(outputs), _aliases(inputs)
        watch = _watch("all_gather", input_aliases, output_aliases)
        works = [self._gloo._allgather_base(output, input, opts)
                 for output, input in zip(output_aliases, input_aliases, strict=True)]
        return _AliasWork(works, outputs, watch)

    def gather(self, output_lists, input_tensors, opts):
        work = self._gloo.gather(_nested_aliases(output_lists), _aliases(input_tensors), opts)
        return _AliasWork(work, output_lists)

    def scatter(self, output_tensors, input_lists, opts):
        work = self._gloo.scatter(_aliases(output_tensors), _nested_aliases(input_lists), opts)
        return _AliasWork(work, output_tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts):
        outputs, inputs = _aliases(output_tensors), _nested_aliases(input_lists)
        watch = _watch("reduce_scatter", [alias for aliases in inputs for alias in aliases], outputs)
        work = _started("reduce_scatter", "all_reduce", self._gloo.reduce_scatter, outputs, inputs, opts)
        return _AliasWork(work, output_tensors, watch)

    def _reduce_scatter_base(self, output, input, opts):
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        watch = _watch("reduce_scatter", [input_alias], [output_alias])
        return _AliasWork(_started("reduce_scatter", "all_reduce", self._gloo._reduce_scatter_base, output_alias,
                                   input_alias, opts), [output], watch)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        output_aliases, input_aliases = _aliases(outputs), _aliases(inputs)
        watch = _watch("reduce_scatter", input_aliases, output_aliases)
        works = [_started("reduce_scatter", "all_reduce", self._gloo._reduce_scatter_base, output, input, opts)
                 for output, input in zip(output_aliases, input_aliases, strict=True)]
        return _AliasWork(works, outputs, watch)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        watch = _watch("all_to_all", [input_alias], [output_alias])
        work = self._gloo.alltoall_base(output_alias, input_alias, output_split_sizes, input_split_sizes, opts)
        return _AliasWork(work, [output], watch)

    def alltoall(self, output_tensors, input_tensors, opts):
        outputs, inputs = _aliases(output_tensors), _aliases(input_tensors)
        watch = _watch("all_to_all", inputs, outputs)
        return _AliasWork(self._gloo.alltoall(outputs, inputs, opts), output_tensors, watch)

    def send(self, tensors, dst_rank: int, tag: int):
        return _AliasWork(self._gloo.send(_aliases(tensors), dst_rank, tag), tensors)

    def recv(self, tensors, src_rank: int, tag: int):
        return _AliasWork(self._gloo.recv(_aliases(tensors), src_rank, tag), tensors)

    def recv_anysource(self, tensors, tag: int):
        return _AliasWork(self._gloo.recv_anysource(_aliases(tensors), tag), tensors)

    # The Python-level entry points that torch.distributed calls by these names (C++ callers use
    # the virtual methods above).
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def _start_coalescing(self, device) -> None:
        """Collectives inside a coalescing block run as they are issued (gloo does not batch them)."""

    def _end_coalescing(self, device):
        return None

    def barrier(self, opts):
        # gloo's barrier takes no device ids; the npu ones that dist.barrier() passes mean nothing here.
        barrier_opts = dist.BarrierOptions()
        barrier_opts.timeout = opts.timeout
        return _AliasWork(self._gloo.barrier(barrier_opts), [])


def _create_process_group(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupHCCL:
    return ProcessGroupHCCL(store, rank, size, timeout)


def is_hccl_available() -> bool:
    """True: the emulated NPU's hccl backend is always available (it needs only gloo)."""
    return dist.is_available() and dist.is_gloo_available()


def install() -> None:
    """Register the "hccl" backend for the npu device (idempotent; no-op without torch.distributed)."""
    if not dist.is_available() or not dist.is_gloo_available():
        return
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["npu"])
    dist.is_hccl_available = is_hccl_available
