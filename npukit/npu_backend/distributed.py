"""The `hccl` process-group backend of the emulated NPU: gloo collectives on npu memory, zero-copy.

`install()` registers "hccl" with `torch.distributed.Backend.register_backend(..., devices=["npu"])`
and adds `torch.distributed.is_hccl_available()`, so `init_process_group("hccl")`,
`init_process_group("npu:hccl,cpu:gloo")`, DDP and FSDP run unchanged under torchrun.

An npu tensor's storage is host memory, so every collective runs gloo directly on a CPU tensor
that aliases the same bytes (same shape, strides and offset): results land in the npu tensor
with no copy. CPU tensors passed to the group go to gloo as they are, which is what a
"npu:hccl,cpu:gloo" group does.

The group follows torch_npu's ProcessGroupHCCL, not gloo, where they differ: all_gather_into_tensor
and reduce_scatter_tensor take any output (input) of world_size times the other's elements (flat,
stacked or concatenated, as NCCL and HCCL do); all_gather takes outputs of any shape and uneven
sizes (HCCL's AllGatherV); AVG and PREMUL_SUM work (HCCL sums, then divides, or scales first);
BAND/BOR/BXOR, the dtypes HCCL cannot reduce, any_source recv and allgather_coalesced are refused
with HCCL's own messages; int16, uint16/32/64 and float8 move (and int16 reduces) although gloo
has no such types.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import os
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from npukit.watch.collectives import COLLECTIVE_MARK

BACKEND_NAME = "hccl"


def cpu_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor viewing the same memory as `tensor` (npu or CPU; CPU tensors are returned as is)."""
    if tensor.device.type != "npu":
        return tensor
    if tensor._is_zerotensor():  # sgn's gradient, say: no memory; read as the zeros it stands for
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
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
    collective asked for and the one gloo runs for it (npukit.watch.collectives.COLLECTIVE_MARK)."""
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


# ------------------------------------------------------------------ what HCCL accepts
# From torch_npu's ProcessGroupHCCL (HCCLUtils.cpp's dtype map, ProcessGroupHCCL.cpp's
# checkSupportedDataType and getHcclReduceOp) and torch_npu's error format.

# Every dtype HCCL has a type for, with the name its errors give it; others cannot be communicated.
_HCCL_TYPE_NAMES = {
    torch.uint8: "at::kByte/at::kBool", torch.bool: "at::kByte/at::kBool", torch.int8: "at::kChar",
    torch.int16: "at::kShort", torch.int32: "at::kInt", torch.int64: "at::kLong", torch.float16: "at::kHalf",
    torch.float32: "at::kFloat", torch.float64: "at::kDouble", torch.bfloat16: "at::kBFloat16",
    torch.uint16: "at::ScalarType::UInt16", torch.uint32: "at::ScalarType::UInt32",
    torch.uint64: "at::ScalarType::UInt64", torch.float8_e4m3fn: "at::ScalarType::Float8_e4m3fn",
    torch.float8_e5m2: "at::ScalarType::Float8_e5m2",
}
# The dtypes HCCL reduces (all_reduce, reduce, reduce_scatter) on the chips npukit emulates (Atlas A5,
# Ascend950, adds uint64 and float64).
_HCCL_REDUCIBLE = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
# all_reduce and reduce (not reduce_scatter) first cast these to int32, reduce, and copy back.
_REDUCED_AS_INT32 = {torch.bool, torch.uint8}
_PREMUL_SUM_DTYPES = {torch.float16, torch.float32, torch.bfloat16, torch.float64}
_REFUSED_OPS = {dist.ReduceOp.BAND: "BAND", dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR"}
_HCCL_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX}

# torch_npu's error codes: ERR02xxx (DIST), the code naming the kind of error.
_ERROR_KINDS = {"PARAM": (1, "invalid parameter"), "TYPE": (2, "invalid type"), "VALUE": (3, "invalid value"),
                "NOT_SUPPORT": (7, "feature not supported"), "NOT_FOUND": (8, "resource not found")}

# gloo has no int16/uint16/32/64/float8: data movement runs on a same-width view of the bits.
_GLOO_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.complex128}
_SAME_WIDTH = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def hccl_error(message: str, kind: str, error: type = RuntimeError) -> Exception:
    """The error torch_npu raises: its message, then the line naming the process, device, rank and code."""
    code, meaning = _ERROR_KINDS[kind]
    device = torch.npu.current_device() if hasattr(torch, "npu") else -1
    return error(f"{message}\n[ERROR] {time.strftime('%Y-%m-%d-%H:%M:%S')} (PID:{os.getpid()}, Device:{device}, "
                 f"RankID:{os.environ.get('RANK', -1)}) ERR02{code:03d} DIST {meaning}")


def _on_npu(tensors) -> bool:
    """Whether HCCL's rules apply: CPU tensors go to gloo as they are (a "cpu:gloo" backend's rules)."""
    return any(tensor.device.type == "npu" for tensor in tensors)


def _check_hccl_type(tensors) -> None:
    """Every collective maps its dtype to HCCL's (complex, quantized and sub-byte types have none)."""
    for tensor in tensors:
        if tensor.device.type == "npu" and tensor.dtype not in _HCCL_TYPE_NAMES:
            raise hccl_error("Unsupported data type for HCCL process group", "NOT_SUPPORT")


def _check_reduction(collective: str, dtype: torch.dtype, op) -> None:
    """The checks HCCL makes before a reduction, in its order: the dtype HCCL can reduce, then the op."""
    if dtype not in _HCCL_TYPE_NAMES:
        raise hccl_error("Unsupported data type for HCCL process group", "NOT_SUPPORT")
    if dtype not in _HCCL_REDUCIBLE:
        raise hccl_error(f"HCCL {collective}: Unsupported data type {_HCCL_TYPE_NAMES[dtype]}", "NOT_SUPPORT")
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    if kind == dist.ReduceOp.PREMUL_SUM and dtype not in _PREMUL_SUM_DTYPES:
        raise hccl_error("PreMulSum Data type must be half, float, bfloat16 or double", "TYPE")
    if kind in _REFUSED_OPS:
        raise hccl_error(f"Cannot use ReduceOp.{_REFUSED_OPS[kind]} with HCCL", "NOT_SUPPORT")
    if kind not in _HCCL_OPS and kind not in (dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
        raise hccl_error("Unhandled ReduceOp", "NOT_FOUND")
    if kind == dist.ReduceOp.AVG and not dtype.is_floating_point:
        # HCCL sums, then divides in place with torch's true division, which an integer tensor refuses.
        name = {torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long"}[dtype]
        raise RuntimeError(f"result type Float can't be cast to the desired output type {name}")


def _gloo_bits(alias: torch.Tensor) -> torch.Tensor:
    """The tensor gloo moves: itself, or a same-width view of its bits where gloo lacks its dtype."""
    if alias.dtype in _GLOO_DTYPES:
        return alias
    return alias.view(_SAME_WIDTH[alias.element_size()])


def _flat(alias: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor (HCCL refuses others: it reads them as flat buffers)."""
    if not alias.is_contiguous():
        raise hccl_error("Tensors must be contiguous", "TYPE")
    return alias.view(-1)


def _gloo_options(opts, op):
    """A copy of a collective's options for gloo, reducing with `op`."""
    copy = type(opts)()
    for name in ("timeout", "rootRank", "rootTensor", "asyncOp"):
        if hasattr(opts, name):
            setattr(copy, name, getattr(opts, name))
    copy.reduceOp = op
    return copy


class _Reduction:
    """A reduction as HCCL runs it, on the tensors gloo reduces for the caller's.

    HCCL reduces bool and uint8 (in all_reduce and reduce, not reduce_scatter) as int32 and copies
    the result back; PREMUL_SUM scales the input in place (as torch_npu does: the caller's input
    holds the scaled values afterwards), then sums; AVG (floating dtypes only) sums then divides.
    gloo has no int16: that is reduced as int32, and copied back, too.
    """

    def __init__(self, collective: str, dtype: torch.dtype, op, casts_small_ints: bool,
                 hccl: bool = True):
        self.hccl = hccl
        if not hccl:  # CPU tensors: gloo's own reduction
            self.dtype, self.factor = dtype, None
            return
        reduced = torch.int32 if casts_small_ints and dtype in _REDUCED_AS_INT32 else dtype
        _check_reduction(collective, reduced, op)
        self.dtype = torch.int32 if reduced == torch.int16 else reduced
        kind = op.op if isinstance(op, dist.ReduceOp) else op
        factor = op.factor if kind == dist.ReduceOp.PREMUL_SUM else None
        self.factor = factor.item() if isinstance(factor, torch.Tensor) else factor
        # AVG (of the floating dtypes HCCL averages) is gloo's own: a sum then a division, as HCCL's.
        self.gloo_op = dist.ReduceOp.SUM if kind == dist.ReduceOp.PREMUL_SUM else kind

    def options(self, opts):
        return _gloo_options(opts, self.gloo_op) if self.hccl else opts

    def scale(self, tensor: torch.Tensor) -> None:
        if self.factor is not None:
            with torch._C.DisableTorchFunction():
                tensor.mul_(self.factor)

    def working(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor gloo reduces for `tensor`: itself, or a copy in the dtype reduced."""
        if tensor.dtype == self.dtype:
            return tensor
        with torch._C.DisableTorchFunction():
            return tensor.to(self.dtype)

    @staticmethod
    def finish(working: torch.Tensor, output: torch.Tensor) -> None:
        """Once gloo has reduced into `working`, a copy standing in for `output`: the copy back."""
        with torch._C.DisableTorchFunction():
            output.copy_(working)


def _then(*steps):
    """One callable running the steps (None: nothing to do once the collective completes)."""
    steps = [step for step in steps if step is not None]
    if not steps:
        return None

    def run():
        for step in steps:
            step()

    return run


class _AliasWork(dist.Work):
    """The gloo work(s) of one collective, whose result and future yield the caller's (npu) tensors."""

    def __init__(self, gloo_works, result, watch=None, finish=None):
        super().__init__()
        self._gloo_works = gloo_works if isinstance(gloo_works, list) else [gloo_works]
        self._result = result
        self._watch = watch  # (collective, output aliases) to check once it completes
        # What HCCL does after the transfer and gloo does not (the copy from a working tensor, int32
        # for a bool, to the caller's): run once, by whichever of wait() and the future comes first.
        self._finish = finish
        self._finishing = threading.Lock()

    def _completed(self) -> None:
        with self._finishing:
            finish, self._finish = self._finish, None
            if finish is not None:
                finish()
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


class _HandedTensors:
    """Holds every tensor handed to gloo until gloo has let it go, so that a gloo thread never touches Python.

    A tensor that has a Python object (every one made in Python) ties that object's refcount to its C++
    one (torch's PyObject preservation): when a C++ reference takes the count from 1 to 2 the Python object
    is incref'd, and when one takes it from 2 back to 1 it is decref'd, which needs the GIL. A gloo thread
    retiring a finished collective drops its references to the tensors it was given: where the caller has
    dropped its own (a collective awaited, its work dropped, before the gloo thread has retired it), that
    drop is the 2 -> 1 and the gloo thread takes the GIL (gdb: TensorImpl::decref_pyobject from
    ~AsyncAllgatherWork in ProcessGroupGloo::runLoop). During the interpreter's finalization a thread
    that asks for the GIL is ended in place (pthread_exit), which aborts the process as it unwinds
    through that noexcept decref: "terminate called without an active exception", after the script ended
    correctly (a 2-rank accelerate script that leaves its group to the interpreter's exit: 1 run in 8 on a
    loaded machine before the tensors were held at all; 1 in 40 while they were held only by their
    Python objects, which is exactly what makes gloo's drop the 2 -> 1).

    So each tensor is held here twice before gloo takes it: by its Python object (the memory it views,
    a CPU alias's buffer, stays alive) and by a C++ reference in a TorchScript List[Tensor], which keeps
    the count at 2 or more whatever gloo drops. An entry is let go by the thread that calls a later
    collective (holding the GIL) once every tensor's use count is back to what it was before gloo took
    it; what is still held at exit is never let go (the container itself is made immortal), as the
    process ends anyway."""

    # Entries older than this many later hand-overs are let go even if something else still holds
    # their tensors (a CPU tensor the caller keeps in C++): memory stays bounded in any run.
    _MOST_KEPT = 4096

    def __init__(self) -> None:
        # [serial, tensors, use counts before gloo, handed to gloo yet]; oldest first
        self._entries: collections.deque = collections.deque()
        # The C++ references: the entries' tensors, in the entries' order (a typed list: no Python objects).
        self._pinned = torch._C.ScriptList([torch.empty(0)])
        self._pinned.clear()
        self._serial = 0
        self._scan_at = 64  # a full scan once this many are held (entries retire out of order)
        # collectives called from several threads keep pins and entries in step (reentrant: letting a
        # tensor go may run a finalizer that calls a collective)
        self._lock = threading.RLock()

    def before(self, tensors: list) -> list:
        """Hold `tensors` before gloo takes them; call taken() with the result once the call returned."""
        with self._lock:
            self._pinned.extend(tensors)  # first: the counts below include this reference
            self._serial += 1
            entry = [self._serial, tensors, [t._use_count() for t in tensors], False]
            self._entries.append(entry)
            return entry

    def taken(self, entry: list) -> None:
        """gloo has the tensors (or refused them): from now on the entry may be let go."""
        with self._lock:
            entry[3] = True
            self._let_go()

    def _let_go(self) -> None:
        entries = self._entries
        while entries and self._retired(entries[0]):
            for _ in entries.popleft()[1]:
                del self._pinned[0]
        if len(entries) >= self._scan_at:
            kept = [entry for entry in entries if not self._retired(entry)]
            # the new list holds the kept tensors before the old one lets them go: never one C++ reference less
            pinned = torch._C.ScriptList([torch.empty(0)])
            pinned.clear()
            pinned.extend([tensor for entry in kept for tensor in entry[1]])
            self._pinned = pinned
            entries.clear()
            entries.extend(kept)
            self._scan_at = max(64, 2 * len(entries))

    def _retired(self, entry) -> bool:
        serial, tensors, counts, handed = entry
        if not handed:  # another thread's collective, still handing its tensors to gloo
            return False
        if self._serial - serial > self._MOST_KEPT:
            return True
        return all(t._use_count() <= count for t, count in zip(tensors, counts, strict=True))


_HANDED = _HandedTensors()
# Never freed, not even when the interpreter tears modules down: the tensors it still holds then may be
# held by a gloo thread too (see _HandedTensors).
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_HANDED))


def _tensors_in(values) -> list:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(_tensors_in(value))
    return found


class _GlooHanding:
    """The group's gloo backend, whose collectives register the tensors they are given (_HANDED)."""

    def __init__(self, gloo: dist.ProcessGroupGloo) -> None:
        self._gloo = gloo

    def __getattr__(self, name: str):
        method = getattr(self._gloo, name)
        if not callable(method):
            return method

        def handing(*args):
            entry = _HANDED.before(_tensors_in(args))
            try:
                return method(*args)
            finally:
                _HANDED.taken(entry)

        # Kept on the instance: __getattr__ is not called again for this name (one closure per collective
        # kind, not per call).
        setattr(self, name, handing)
        return handing


def _finish_callbacks_at_exit(seconds: float = 10.0) -> None:
    """At interpreter exit, before finalization: collectives still to run a Python callback (a future's)
    finish now, when their gloo thread can still take the GIL (see _HandedTensors for what a thread that
    asks for it during finalization does). Bounded: a peer that never joins does not hold the exit."""
    deadline = time.monotonic() + seconds
    for work in list(_WITH_PYTHON_CALLBACKS):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        with contextlib.suppress(Exception):  # failed or timed out: its waiter has been or will not be told
            work.wait(timedelta(seconds=remaining))


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
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # The group's name (which functional collectives resolve groups by) is kept by its
        # registered backends; gloo is the real one for CPU tensors.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        # init_process_group(device_id=torch.device("npu", i)) asks the group for its npu backend
        # (whether it supports splitting); so do DeviceMesh and split_group. Collectives do not go
        # through it: the overrides below take npu tensors to gloo as CPU aliases.
        self._register_backend(torch.device("npu"), dist.ProcessGroup.BackendType.CUSTOM, gloo)
        self._gloo = _GlooHanding(gloo)

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

    # Each override hands gloo the CPU aliases (or tensors standing in for them where HCCL's rules
    # differ from gloo's) and returns a work whose result is the caller's tensors.
    def broadcast(self, tensors, opts):
        _check_hccl_type(tensors)
        aliases = _aliases(tensors)
        watch = _watch("broadcast", aliases, aliases)
        return _AliasWork(self._gloo.broadcast([_gloo_bits(a) for a in aliases], opts), tensors, watch)

    def _all_reduce_in_place(self, collective, start, tensors, opts, watched=True):
        """all_reduce, its coalesced form and reduce: in place, on working tensors where HCCL casts
        (watched: the overflow detector is told of the all_reduces, not of reduce)."""
        aliases, hccl = _aliases(tensors), _on_npu(tensors)
        reductions = [_Reduction(collective, a.dtype, opts.reduceOp, casts_small_ints=True, hccl=hccl)
                      for a in aliases]
        for reduction, alias in zip(reductions, aliases, strict=True):
            reduction.scale(alias)  # PREMUL_SUM: the tensor reduced in place is scaled in place
        watch = _watch("all_reduce", aliases, aliases) if watched else None
        working = [r.working(a) for r, a in zip(reductions, aliases, strict=True)]
        work = start(working, reductions[0].options(opts))
        finish = _then(*[(lambda r=r, w=w, a=a: r.finish(w, a))
                         for r, w, a in zip(reductions, working, aliases, strict=True)
                         if w is not a])
        return _AliasWork(work, tensors, watch, finish)

    def allreduce(self, tensors, opts):
        # marked too: the all_reduces gloo runs are named in order, those asked for and the others
        def start(working, gloo_opts):
            return _started("all_reduce", "all_reduce", self._gloo.allreduce, working, gloo_opts)

        return self._all_reduce_in_place("allreduce", start, tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        def start(working, gloo_opts):
            return _started("all_reduce", "all_reduce", self._gloo.allreduce_coalesced, working, gloo_opts)

        return self._all_reduce_in_place("allreduce_coalesced", start, tensors, opts)

    def reduce(self, tensors, opts):
        return self._all_reduce_in_place("reduce", self._gloo.reduce, tensors, opts, watched=False)

    def allgather(self, output_lists, input_tensors, opts):
        _check_hccl_type(input_tensors + [t for tensors in output_lists for t in tensors])
        outputs, inputs = _nested_aliases(output_lists), _aliases(input_tensors)
        watch = _watch("all_gather", inputs, [alias for aliases in outputs for alias in aliases])
        if not _on_npu(input_tensors) or all(o.shape == inputs[0].shape and o.dtype == inputs[0].dtype
                                             for o in outputs[0]):
            gloo_outputs = [[_gloo_bits(o) for o in aliases] for aliases in outputs]
            work = self._gloo.allgather(gloo_outputs, [_gloo_bits(i) for i in inputs], opts)
            return _AliasWork(work, output_lists, watch)
        work, finish = self._allgather_uneven(outputs[0], inputs[0], opts)
        return _AliasWork(work, output_lists, watch, finish)

    def _allgather_uneven(self, outputs, input, opts):
        """all_gather into outputs of other shapes than the input's, or of uneven sizes (HCCL's
        AllGatherV): each rank's input padded to the longest, gathered flat, and cut into the outputs."""
        if len(outputs) != self.size():
            raise hccl_error("Tensor list input to scatter/gather must match number of collective participants",
                             "PARAM")
        sizes = [o.numel() for o in outputs]
        if sizes[self.rank()] != input.numel():
            raise hccl_error("All tensor operands to scatter/gather must have the same size", "PARAM")
        if any(o.dtype != input.dtype for o in outputs):
            raise hccl_error("output tensor must have the same type as input tensor", "PARAM")
        longest = max(sizes)
        with torch._C.DisableTorchFunction():
            padded = input.new_zeros(longest)
            padded[:input.numel()] = input.reshape(-1)
            gathered = input.new_empty(self.size() * longest)
        work = self._gloo._allgather_base(_gloo_bits(gathered), _gloo_bits(padded), opts)

        def cut():
            with torch._C.DisableTorchFunction():
                for rank, (output, size) in enumerate(zip(outputs, sizes, strict=True)):
                    output.copy_(gathered[rank * longest:rank * longest + size].view(output.shape))

        return work, cut

    def _allgather_base_pair(self, output, input):
        """The flat gloo tensors of one all_gather_into_tensor: HCCL takes any output of world_size
        times the input's elements (flat, stacked or concatenated); gloo only the concatenation."""
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        if not _on_npu([output, input]):
            return output_alias, input_alias, output_alias, input_alias
        _check_hccl_type([input, output])
        if input.dtype != output.dtype:
            raise hccl_error("output tensor must have the same type as input tensor", "PARAM")
        if input.numel() * self.size() != output.numel():
            raise hccl_error("output tensor size must be equal to world_size times input tensor size", "PARAM")
        return output_alias, input_alias, _gloo_bits(_flat(output_alias)), _gloo_bits(_flat(input_alias))

    def _allgather_base(self, output, input, opts):
        output_alias, input_alias, gloo_output, gloo_input = self._allgather_base_pair(output, input)
        watch = _watch("all_gather", [input_alias], [output_alias])
        return _AliasWork(self._gloo._allgather_base(gloo_output, gloo_input, opts), [output], watch)

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        if not _on_npu(input_tensors):
            return _AliasWork(self._gloo.allgather_coalesced(output_lists, input_tensors, opts), output_lists)
        # ProcessGroupHCCL does not implement it: the c10d Backend's refusal
        raise RuntimeError(f"Backend {BACKEND_NAME} does not support allgather_coalesced")

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        # gloo has no coalesced form: one collective per pair, in order, awaited together.
        pairs = [self._allgather_base_pair(output, input) for output, input in zip(outputs, inputs, strict=True)]
        watch = _watch("all_gather", [pair[1] for pair in pairs], [pair[0] for pair in pairs])
        works = [self._gloo._allgather_base(gloo_output, gloo_input, opts) for _, _, gloo_output, gloo_input in pairs]
        return _AliasWork(works, outputs, watch)

    def gather(self, output_lists, input_tensors, opts):
        # torch_npu has no HCCL gather: its torch.distributed.gather runs an all_gather, and says so on dst.
        if self.rank() == opts.rootRank and _on_npu(input_tensors):
            warnings.warn("HCCL doesn't support gather at the moment. Implemented with allgather instead.",
                          stacklevel=2)
        _check_hccl_type(input_tensors + [t for tensors in output_lists for t in tensors])
        gloo_outputs = [[_gloo_bits(a) for a in aliases] for aliases in _nested_aliases(output_lists)]
        work = self._gloo.gather(gloo_outputs, [_gloo_bits(a) for a in _aliases(input_tensors)], opts)
        return _AliasWork(work, output_lists)

    def scatter(self, output_tensors, input_lists, opts):
        _check_hccl_type(output_tensors + [t for tensors in input_lists for t in tensors])
        gloo_inputs = [[_gloo_bits(a) for a in aliases] for aliases in _nested_aliases(input_lists)]
        work = self._gloo.scatter([_gloo_bits(a) for a in _aliases(output_tensors)], gloo_inputs, opts)
        return _AliasWork(work, output_tensors)

    def reduce_scatter(self, output_tensors, input_lists, opts):
        outputs, inputs = _aliases(output_tensors), _nested_aliases(input_lists)
        reduction = _Reduction("reduce_scatter", outputs[0].dtype, opts.reduceOp, casts_small_ints=False,
                               hccl=_on_npu(output_tensors))
        watch = _watch("reduce_scatter", [alias for aliases in inputs for alias in aliases], outputs)
        # HCCL scales its flat copy of the inputs for PREMUL_SUM, not the caller's tensors.
        if reduction.factor is not None:
            with torch._C.DisableTorchFunction():
                inputs = [[alias.clone() for alias in aliases] for aliases in inputs]
            for aliases in inputs:
                for alias in aliases:
                    reduction.scale(alias)
        working_inputs = [[reduction.working(alias) for alias in aliases] for aliases in inputs]
        working_outputs = [reduction.working(alias) for alias in outputs]
        work = _started("reduce_scatter", "all_reduce", self._gloo.reduce_scatter, working_outputs, working_inputs,
                        reduction.options(opts))
        finish = _then(*[(lambda w=w, a=a: reduction.finish(w, a))
                         for w, a in zip(working_outputs, outputs, strict=True) if w is not a])
        return _AliasWork(work, output_tensors, watch, finish)

    def _reduce_scatter_base_pair(self, collective, output, input, opts):
        """The gloo tensors of one reduce_scatter_tensor: HCCL takes any input of world_size times the
        output's elements (flat, stacked or concatenated); gloo only the concatenation."""
        if not _on_npu([output, input]):
            reduction = _Reduction(collective, input.dtype, opts.reduceOp, casts_small_ints=False, hccl=False)
            return output, input, output, input, reduction, None
        if input.dtype != output.dtype:
            raise hccl_error("input tensor must be the same type as the output tensor.", "TYPE")
        if input.numel() != output.numel() * self.size():
            raise hccl_error("input tensor must be the same size as output size times world size", "PARAM")
        reduction = _Reduction(collective, input.dtype, opts.reduceOp, casts_small_ints=False)
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        flat_output, flat_input = _flat(output_alias), _flat(input_alias)
        reduction.scale(flat_input)  # PREMUL_SUM: torch_npu scales the caller's input in place
        working_output = reduction.working(flat_output)
        finish = (lambda: reduction.finish(working_output, flat_output)) \
            if working_output is not flat_output else None
        return output_alias, input_alias, working_output, reduction.working(flat_input), reduction, finish

    def _reduce_scatter_base(self, output, input, opts):
        output_alias, input_alias, gloo_output, gloo_input, reduction, finish = self._reduce_scatter_base_pair(
            "_reduce_scatter_base", output, input, opts)
        watch = _watch("reduce_scatter", [input_alias], [output_alias])
        work = _started("reduce_scatter", "all_reduce", self._gloo._reduce_scatter_base, gloo_output, gloo_input,
                        reduction.options(opts))
        return _AliasWork(work, [output], watch, finish)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        pairs = [self._reduce_scatter_base_pair("reduce_scatter_tensor_coalesced", output, input, opts)
                 for output, input in zip(outputs, inputs, strict=True)]
        watch = _watch("reduce_scatter", [pair[1] for pair in pairs], [pair[0] for pair in pairs])
        works = [_started("reduce_scatter", "all_reduce", self._gloo._reduce_scatter_base, gloo_output, gloo_input,
                          reduction.options(opts))
                 for _, _, gloo_output, gloo_input, reduction, _ in pairs]
        return _AliasWork(works, outputs, watch, _then(*[pair[5] for pair in pairs]))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        _check_hccl_type([output, input])
        output_alias, input_alias = cpu_alias(output), cpu_alias(input)
        watch = _watch("all_to_all", [input_alias], [output_alias])
        work = self._gloo.alltoall_base(_gloo_bits(output_alias), _gloo_bits(input_alias), output_split_sizes,
                                        input_split_sizes, opts)
        return _AliasWork(work, [output], watch)

    def alltoall(self, output_tensors, input_tensors, opts):
        _check_hccl_type(output_tensors + input_tensors)
        outputs, inputs = _aliases(output_tensors), _aliases(input_tensors)
        watch = _watch("all_to_all", inputs, outputs)
        work = self._gloo.alltoall([_gloo_bits(a) for a in outputs], [_gloo_bits(a) for a in inputs], opts)
        return _AliasWork(work, output_tensors, watch)

    def send(self, tensors, dst_rank: int, tag: int):
        _check_hccl_type(tensors)
        return _AliasWork(self._gloo.send([_gloo_bits(a) for a in _aliases(tensors)], dst_rank, tag), tensors)

    def recv(self, tensors, src_rank: int, tag: int):
        _check_hccl_type(tensors)
        return _AliasWork(self._gloo.recv([_gloo_bits(a) for a in _aliases(tensors)], src_rank, tag), tensors)

    def recv_anysource(self, tensors, tag: int):
        if not _on_npu(tensors):
            return _AliasWork(self._gloo.recv_anysource(tensors, tag), tensors)
        # HCCL receives from a named rank only (dist.recv without src)
        raise hccl_error("ProcessGroupHCCL does not support recv", "NOT_SUPPORT")

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
        atexit.register(_finish_callbacks_at_exit)
    dist.is_hccl_available = is_hccl_available
