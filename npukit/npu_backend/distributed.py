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


def _aliases(tensors):
    return [cpu_alias(t) for t in tensors]


def _nested_aliases(tensor_lists):
    return [_aliases(tensors) for tensors in tensor_lists]


class _AliasWork(dist.Work):
    """The gloo work(s) of one collective, whose result and future yield the caller's (npu) tensors."""

    def __init__(self, gloo_works, result):
        super().__init__()
        self._gloo_works = gloo_works if isinstance(gloo_works, list) else [gloo_works]
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._gloo_works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
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
        return _AliasWork(self._gloo.broadcast(_aliases(tensors), opts), tensors)

    def allreduce(self, tensors, opts):
        return _AliasWork(self._gloo.allreduce(_aliases(tensors), opts), tensors)

    def allreduce_coalesced(self, tensors, opts):
        return _AliasWork(self._gloo.allreduce_coalesced(_aliases(tensors), opts), tensors)

    def reduce(self, tensors, opts):
        return _AliasWork(self._gloo.reduce(_aliases(tensors), opts), tensors)

    def allgather(self, output_lists, input_tensors, opts):
        work = self._gloo.allgather(_nested_aliases(output_lists), _aliases(input_tensors), opts)
        return _AliasWork(work, output_lists)

    def _allgather_base(self, output, input, opts):
        return _AliasWork(self._gloo._allgather_base(cpu_alias(output), cpu_alias(input), opts), [output])

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        work = self._gloo.allgather_coalesced(_nested_aliases(output_lists), _aliases(input_tensors), opts)
        return _AliasWork(work, output_lists)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        # gloo has no coalesced form: one collective per pair, in order, awaited together.
        works = [self._gloo._allgather_base(cpu_alias(output), cpu_alias(input), opts)
                 for output, input in zip(outputs, inputs, strict=True)]
        return _AliasWork(works, outputs)

    def gather(self, output_lists, input_tensors, opts):
        work = self._gloo.gather(_nested_aliases(output_lists), _aliases(input_tensors), opts)
        return _AliasWork(work, output_lists)

    def scatter(self, output_tensors, input_lists, opts):
        work = self._gloo.scatter(_aliases(output_tensors), _nested_aliases(input_lists), opts)
        return _AliasWork(work, output_tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts):
        work = self._gloo.reduce_scatter(_aliases(output_tensors), _nested_aliases(input_lists), opts)
        return _AliasWork(work, output_tensors)

    def _reduce_scatter_base(self, output, input, opts):
        return _AliasWork(self._gloo._reduce_scatter_base(cpu_alias(output), cpu_alias(input), opts), [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        works = [self._gloo._reduce_scatter_base(cpu_alias(output), cpu_alias(input), opts)
                 for output, input in zip(outputs, inputs, strict=True)]
        return _AliasWork(works, outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        work = self._gloo.alltoall_base(cpu_alias(output), cpu_alias(input), output_split_sizes,
                                        input_split_sizes, opts)
        return _AliasWork(work, [output])

    def alltoall(self, output_tensors, input_tensors, opts):
        work = self._gloo.alltoall(_aliases(output_tensors), _aliases(input_tensors), opts)
        return _AliasWork(work, output_tensors)

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
