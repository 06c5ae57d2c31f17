"""Tensor data files: `.pt` as torch.save writes them (msprobe's format) or `.npy`, exact for every dtype.

numpy has no bfloat16 or float8, so those tensors are read (and written to .npy) as their raw bits
(uint16 / uint8), the real dtype recorded next to the file name in dump.json. Reading gives back
the raw array plus a function that widens a chunk of it to float64, so compare never needs torch:
a .pt holding one tensor is read by decoding its data.pkl's opcodes (never unpickling) and
memory-mapping its storage; any other .pt goes to torch.load(weights_only=True).

Writing a .pt lays out torch.save's zip itself (torch's own pickle of the tensor, its records,
checksums) around the tensor's bytes, so that they are written once, with one call.
TensorFileWriter writes a dump's files behind the training thread. Torch is imported lazily:
compare worker processes use only numpy.
"""

from __future__ import annotations

import errno
import functools
import math
import mmap
import os
import pickle
import pickletools
import re
import shutil
import struct
import sys
import threading
import uuid
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from npukit.errors import UserError
from npukit.files import atomic_open, atomic_path
from npukit.watch._stats import crc32  # zlib.crc32, folded with carry-less multiplies: the data's checksum

# torch dtype name (as written in dump.json, "torch.float32") -> (numpy storage dtype, raw bits?)
_STORAGE = {
    "torch.float64": ("float64", False),
    "torch.float32": ("float32", False),
    "torch.float16": ("float16", False),
    "torch.bfloat16": ("uint16", True),
    "torch.float8_e4m3fn": ("uint8", True),
    "torch.float8_e5m2": ("uint8", True),
    "torch.float8_e4m3fnuz": ("uint8", True),
    "torch.float8_e5m2fnuz": ("uint8", True),
    "torch.int64": ("int64", False),
    "torch.int32": ("int32", False),
    "torch.int16": ("int16", False),
    "torch.int8": ("int8", False),
    "torch.uint8": ("uint8", False),
    "torch.uint16": ("uint16", False),
    "torch.uint32": ("uint32", False),
    "torch.uint64": ("uint64", False),
    "torch.bool": ("bool", False),
    "torch.complex64": ("complex64", False),
    "torch.complex128": ("complex128", False),
}

# Significand precision in bits (implicit bit included): the size of one ULP relative to 2**exponent.
FLOAT_PRECISION_BITS = {
    "torch.float64": 53,
    "torch.float32": 24,
    "torch.float16": 11,
    "torch.bfloat16": 8,
    "torch.float8_e4m3fn": 4,
    "torch.float8_e5m2": 3,
}
# Smallest positive subnormal exponent per dtype (ULP floor for tiny values).
FLOAT_MIN_EXPONENT = {
    "torch.float64": -1074,
    "torch.float32": -149,
    "torch.float16": -24,
    "torch.bfloat16": -133,
    "torch.float8_e4m3fn": -9,
    "torch.float8_e5m2": -16,
}


_MMAP_MIN_BYTES = 4 << 20


def is_floating(dtype_name: str) -> bool:
    return dtype_name in FLOAT_PRECISION_BITS


def write_tensor(path: Path, tensor) -> None:
    """Write one tensor (any device) to `path`, as .npy or, for a `.pt` path, as a bare CPU tensor
    (torch.load(weights_only=True) reads it, as msprobe does); atomically, so a crash leaves no
    partial file."""
    if path.suffix == ".pt":
        import torch

        from npukit.watch.tensors import strided_form

        with torch._C.DisableTorchFunction():
            compact = strided_form(tensor.detach()).to("cpu")  # the values the .npy form keeps too
            if compact.untyped_storage().nbytes() != compact.numel() * compact.element_size() \
                    or not compact.is_contiguous():
                compact = compact.contiguous().clone()  # torch.save writes a view's whole storage
        records = _pt_records(compact.dtype, tuple(compact.shape))
        data = _data_bytes(compact)
        if records is None or data.nbytes > _ZIP_LIMIT - _HEAD - _TAIL:  # torch.save must write it (zip64)
            with atomic_open(path, "wb") as handle:
                torch.save(compact, handle)
            return
        head, tail = _zip_frame(records, data.nbytes, crc32(data), None)
        _write_file(path, (head, data, tail))
        return
    array = tensor_to_numpy(tensor)
    _write_file(path, (_npy_head(array, None), _data_bytes(array), b""))


# A tensor file as the dump's writer thread writes it: one buffer, [head | data | tail], whose data
# the training thread copied in, written whole with one call, bypassing the page cache (O_DIRECT)
# where the file system allows: the page cache's fresh pages cost 5-10x the copy on some hosts,
# and the dump is read back later if at all. The data starts on a block; the head ends with a
# padding field (zip: an extra field, as torch.save pads; .npy: header spaces) to reach it.
_BLOCK = 4096
_HEAD = 4096  # room for what comes before the data (a .pt's zip records, a .npy's header)
_TAIL = 1024  # room for what comes after it (a .pt's last records and zip directory)
_PT_PREFIX = "archive/"  # the folder torch.save names its records in when writing to a file object
_PT_AFTER = ((f"{_PT_PREFIX}version", b"3\n"),)  # torch's writer's records after the data, but its id
_ZIP_TIME, _ZIP_DATE = 0, (0 << 9) | (1 << 5) | 1  # 1980-01-01 00:00, as torch.save dates its records


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@functools.lru_cache(maxsize=4096)  # a dump writes the same shapes every step
def _pt_records(dtype, shape: tuple) -> tuple | None:
    """The records torch.save writes before a contiguous tensor's storage, [(name, bytes)] ending
    with the storage's ("data/0", None), as torch's own _save makes them (its pickle of the
    tensor, which an empty tensor of that shape gives: its memory is never touched); None when
    torch lays the tensor out otherwise."""
    import pickle

    import torch
    from torch import serialization

    records: list = []

    class Records:  # what torch's _save hands its zip writer
        def write_record(self, name, data, size):
            records.append((name, data.encode() if isinstance(data, str) else data if isinstance(data, bytes) else None))

        def write_record_metadata(self, name, size):
            records.append((name, None))

    try:
        with torch._C.DisableTorchFunction():
            serialization._save(torch.empty(shape, dtype=dtype), Records(), pickle, 2, False)
    except Exception:  # another torch's private API: torch.save writes it
        return None
    if [name for name, data in records if data is None] != ["data/0"] or records[-1][1] is not None:
        return None
    return tuple((_PT_PREFIX + name, data) for name, data in records)


def _zip_frame(records, nbytes: int, crc: int, data_at: int | None) -> tuple[bytes, bytes] | None:
    """(head, tail) of a zip holding `records` ((name, bytes), the data's bytes None), uncompressed,
    the data's `nbytes` at byte `data_at` of the file (None: the next multiple of 64), reached with
    an "FB" extra field as torch.save pads. None when the head does not fit before data_at."""
    layout = _zip_layout(records, nbytes, data_at)
    if layout is None:
        return None
    head, tail, crc_at = layout
    checksum = struct.pack("<L", crc)
    head = bytearray(head)
    head[crc_at[0]:crc_at[0] + 4] = checksum
    tail = bytearray(tail)
    tail[crc_at[1]:crc_at[1] + 4] = checksum
    return bytes(head), bytes(tail)


@functools.lru_cache(maxsize=4096)  # the same records and sizes every step: only the checksum changes
def _zip_layout(records, nbytes: int, data_at: int | None) -> tuple[bytes, bytes, tuple[int, int]] | None:
    """_zip_frame's head and tail with the data's checksum left 0, and where it goes in each."""
    head = bytearray()
    directory = []
    crc_at = [0, 0]
    for name, data in records:
        encoded = name.encode()
        size = nbytes if data is None else len(data)
        checksum = 0 if data is None else zlib.crc32(data)
        offset = len(head)
        extra = b""
        if data is None:
            crc_at[0] = offset + 14
            start = offset + _LOCAL.size + len(encoded) + 4
            target = _round_up(start, 64) if data_at is None else data_at
            if target < start:
                return None
            extra = b"FB" + struct.pack("<H", target - start) + b"Z" * (target - start)
        head += _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, _ZIP_TIME, _ZIP_DATE, checksum, size, size, len(encoded),
                            len(extra)) + encoded + extra
        directory.append((encoded, checksum, size, offset, data is None))
        if data is not None:
            head += data
    tail = bytearray()
    # torch's writer names each file with a random id; one per process here (only torch reads it)
    after = (*_PT_AFTER, (f"{_PT_PREFIX}.data/serialization_id", _SERIALIZATION_ID))
    position = len(head) + nbytes
    for name, data in after:
        encoded = name.encode()
        checksum = zlib.crc32(data)
        directory.append((encoded, checksum, len(data), position + len(tail), False))
        tail += _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, _ZIP_TIME, _ZIP_DATE, checksum, len(data), len(data),
                            len(encoded), 0) + encoded + data
    start = position + len(tail)
    for encoded, checksum, size, offset, is_data in directory:
        if is_data:
            crc_at[1] = len(tail) + 16
        tail += _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, 0, _ZIP_TIME, _ZIP_DATE, checksum, size, size, len(encoded),
                              0, 0, 0, 0, 0, offset) + encoded
    tail += _EOCD.pack(b"PK\x05\x06", 0, 0, len(directory), len(directory), position + len(tail) - start, start, 0)
    return bytes(head), bytes(tail), tuple(crc_at)


_SERIALIZATION_ID = f"{uuid.uuid4().int:040d}"[:40].encode()


def _npy_head(array: np.ndarray, data_at: int | None) -> bytes | None:
    """A .npy (version 1.0) header for `array` ending at byte `data_at` (None: at the next
    multiple of 64, as numpy.save pads it); None when it does not fit."""
    text = (f"{{'descr': {np.lib.format.dtype_to_descr(array.dtype)!r}, 'fortran_order': False, "
            f"'shape': {tuple(array.shape)!r}, }}").encode()
    start = 10 + len(text) + 1  # magic, version, length; the text; its newline
    end = _round_up(start, 64) if data_at is None else data_at
    if end < start or end - 10 > 0xFFFF:
        return None
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", end - 10) + text + b" " * (end - start) + b"\n"


def _data_bytes(data):
    """The bytes of a contiguous tensor or array, without a copy."""
    if not isinstance(data, np.ndarray):
        data = tensor_to_numpy(data)
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


_direct_io = [hasattr(os, "O_DIRECT")]  # False once a file system refused it


def _write_file(path: Path, pieces, direct: bool = False, length: int | None = None) -> None:
    """`pieces` (bytes-like, written in order) as `path`, atomically (a temporary file renamed over
    it). direct: pieces is one block-aligned buffer of whole blocks, written with O_DIRECT where
    the file system takes it, then cut to `length`. An OS error names `path` in a UserError."""
    temporary = path.with_name(f".{path.name}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        for use_direct in ((True, False) if direct and _direct_io[0] else (False,)):
            try:
                handle = os.open(temporary, flags | (os.O_DIRECT if use_direct else 0), 0o666)  # less the umask
            except OSError as exc:
                if use_direct and exc.errno == errno.EINVAL:  # tmpfs and others: no direct I/O
                    _direct_io[0] = False
                    continue
                raise
            try:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while view:
                        view = view[os.write(handle, view):]
                if length is not None:
                    os.ftruncate(handle, length)
            except OSError as exc:
                if use_direct and exc.errno == errno.EINVAL:  # opened, but refused on write
                    _direct_io[0] = False
                    continue
                raise
            finally:
                os.close(handle)
            os.replace(temporary, path)
            return
    except OSError as exc:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise UserError(f"{path}: cannot write ({exc.strerror or exc})") from None


class TensorFileWriter:
    """Tensor files of a dump, written on a writer thread while training goes on (as msprobe's
    async dump does): `copy` runs on the training thread, `write` and `link` on the writer thread.

    copy() takes the tensor's values as they are when recorded (a later in-place change never
    reaches the file) into a host buffer reused from earlier steps (a fresh buffer of a few MB
    costs page faults that took most of the copy's time), laid out as the file will be: the
    writer adds the file's head and tail around the data and writes it whole, once (see
    _write_file). At most `max_bytes` of copies wait for the writer: beyond that, copy() waits for
    it (memory stays bounded when the disk is slower than training; nothing is dropped) and says
    once on stderr that the run waits. write() and link() never raise: the first file that cannot
    be written (a full disk, a name too long) is reported once on stderr, and the dump goes on
    without it.
    """

    _POOLED_BYTES = 64 << 10  # smaller copies come from the allocator's free lists: no page faults

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes if max_bytes is not None else _default_pending_bytes()
        self.failed: list[Path] = []  # files that could not be written
        self.waited = 0.0  # seconds copy() waited for the writer to catch up
        self._free: dict[int, list] = {}  # frame size -> reusable block-aligned uint8 buffers
        self._free_bytes = 0
        self._pending_bytes = 0
        self._room = threading.Condition()

    def copy(self, tensor, before_waiting=None) -> tuple:
        """(host copy of the tensor, its pooled frame or None, its bytes): what write() takes.
        before_waiting(): called when the copy is about to wait for the writer (the caller hands
        the writer what it holds back)."""
        import torch

        with torch._C.DisableTorchFunction():
            tensor = tensor.detach()
            nbytes = tensor.numel() * tensor.element_size()
            plain = (type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized
                     and not tensor.is_nested)
            framed = plain and nbytes >= self._POOLED_BYTES
            size = _HEAD + _round_up(nbytes + _TAIL, _BLOCK) if framed else 0
            # only this thread adds pending bytes: a copy with room now has room below
            if before_waiting is not None and self._pending_bytes > 0 and self._pending_bytes + nbytes > self.max_bytes:
                before_waiting()
            with self._room:
                if self._pending_bytes > 0 and self._pending_bytes + nbytes > self.max_bytes:
                    self._wait_for_room(nbytes)
                self._pending_bytes += nbytes
                frame = None
                if framed:
                    reusable = self._free.get(size)
                    if reusable:
                        frame = reusable.pop()
                        self._free_bytes -= size
            if not plain:  # sparse, quantized, nested, subclasses: write_tensor makes them plain
                return tensor.to("cpu", copy=True), None, nbytes
            if framed and frame is None:
                raw = torch.empty(size + _BLOCK, dtype=torch.uint8)
                skip = -raw.data_ptr() % _BLOCK  # O_DIRECT writes from a block-aligned address
                frame = raw[skip:skip + size]
            snapshot = (frame[_HEAD:_HEAD + nbytes].view(tensor.dtype).view(tensor.shape) if frame is not None
                        else torch.empty(tensor.shape, dtype=tensor.dtype))
            snapshot.copy_(tensor)
        return snapshot, frame, nbytes

    def _wait_for_room(self, nbytes: int) -> None:
        """Wait (holding _room's lock) until the writer has written enough; said once."""
        import time

        if not self.waited:
            print(f"npukit: the dump's tensor files are written slower than the run makes them: "
                  f"{self._pending_bytes / 2**20:.0f} MB of copies wait for the writer, at most {self.max_bytes / 2**20:.0f} MB "
                  "(an eighth of the host memory); the run waits for it: nothing is dropped",
                  file=sys.stderr)
        start = time.perf_counter()
        while self._pending_bytes > 0 and self._pending_bytes + nbytes > self.max_bytes:
            self._room.wait()
        self.waited += max(time.perf_counter() - start, 1e-9)

    def write(self, path: Path, copied: tuple) -> None:
        """Write a copy() to `path` (writer thread), then give its buffer back."""
        snapshot, frame, nbytes = copied
        try:
            if frame is None or not self._write_framed(path, snapshot, frame, nbytes):
                write_tensor(path, snapshot)
        except Exception as exc:  # never the run's end: reported once
            self._failed(path, exc)
        finally:
            del snapshot
            self._release(frame, nbytes)

    @staticmethod
    def _write_framed(path: Path, snapshot, frame, nbytes: int) -> bool:
        """The file written from its frame: its head and tail put around the data, one write;
        False when the layout does not fit (write_tensor writes it)."""
        buffer = frame.numpy()
        data = memoryview(buffer)[_HEAD:_HEAD + nbytes]
        if path.suffix == ".pt":
            records = _pt_records(snapshot.dtype, tuple(snapshot.shape))
            framed = records and _zip_frame(records, nbytes, crc32(data), _HEAD)
            if not framed or len(framed[1]) > _TAIL:
                return False
            head, tail = framed
        else:
            head, tail = _npy_head(tensor_to_numpy(snapshot), _HEAD), b""
            if head is None:
                return False
        buffer[:_HEAD] = np.frombuffer(head, dtype=np.uint8)
        end = _HEAD + nbytes + len(tail)
        buffer[_HEAD + nbytes:end] = np.frombuffer(tail, dtype=np.uint8)
        _write_file(path, (memoryview(buffer)[:_round_up(end, _BLOCK)],), direct=True, length=end)
        return True

    def link(self, path: Path, written: Path) -> None:
        """`path` holding the bytes of the file `written` before it (the same tensor, unchanged):
        a hard link (atomic by itself), or a copy where the file system has none; nothing if
        `written` failed."""
        if written in self.failed:
            self.failed.append(path)
            return
        try:
            try:
                os.link(written, path)
            except FileExistsError:  # a dump folder written before
                os.unlink(path)
                os.link(written, path)
        except OSError:
            try:
                with atomic_path(path) as temporary:
                    shutil.copyfile(written, temporary)
            except Exception as exc:
                self._failed(path, exc)

    def _failed(self, path: Path, exc: Exception) -> None:
        self.failed.append(path)
        if len(self.failed) == 1:
            reason = str(exc) if isinstance(exc, UserError) else f"{path}: {type(exc).__name__}: {exc}"
            print(f"npukit: cannot write tensor data ({reason}). The dump goes on without this file and any other "
                  "that cannot be written (npu-compare names them as missing); the run goes on.", file=sys.stderr)

    def _release(self, frame, nbytes: int) -> None:
        with self._room:
            self._pending_bytes -= nbytes
            if frame is not None and self._free_bytes + frame.numel() <= self.max_bytes:
                self._free.setdefault(frame.numel(), []).append(frame)
                self._free_bytes += frame.numel()
            self._room.notify_all()


WRITER_NICE = 10  # nice levels a dump's writer thread runs below the training


def lower_thread_priority(levels: int | None = None) -> None:
    """Run the calling thread `levels` nice levels below the rest of the process (Linux keeps a
    nice value per thread; elsewhere nothing changes). The dump's writer then takes the cores the
    training leaves idle rather than sharing them: torch cuts a parallel op into one piece per
    core, so a writer sharing a core stretched every such op to twice its time."""
    levels = WRITER_NICE if levels is None else levels
    if not sys.platform.startswith("linux"):
        return  # there PRIO_PROCESS with a thread id would name a process
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + levels))
    except OSError:  # a sandbox refusing it: the writer keeps the training's priority
        pass


def _default_pending_bytes() -> int:
    """Copies waiting for the writer: an eighth of the host memory, at most 2 GB."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return max(64 << 20, min(2 << 30, memory // 8))


def tensor_to_numpy(tensor):
    """Host numpy array holding the tensor's exact bits (bf16/float8 as raw unsigned integers)."""
    import torch

    from npukit.watch.tensors import strided_form

    data = strided_form(tensor.detach())
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.uint16)
    elif data.dtype.is_floating_point and data.element_size() == 1:
        data = data.view(torch.uint8)
    return data.numpy()


_NPY_HEADER = re.compile(
    rb"\{'descr': '(?P<descr>[<>|=][a-zA-Z]\d+)', 'fortran_order': False, 'shape': \((?P<shape>[\d, ]*)\), \}")


def _read_small_npy(path: Path) -> np.ndarray | None:
    """A small .npy as numpy.save writes it, read in one call with its header parsed by a regex.

    numpy.load parses each header with ast.literal_eval (~0.1 ms a file): a dump of thousands of
    small tensors spent most of npu-compare there. Anything unusual (other header layouts, object
    arrays, Fortran order) returns None and goes through numpy.load, which checks it all.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read tensor file ({exc.strerror or exc})") from None
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        return None
    major = data[6]
    if major == 1:
        header_len, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        header_len, start = int.from_bytes(data[8:12], "little"), 12
    else:
        return None
    match = _NPY_HEADER.match(data, start, start + header_len)
    if match is None:
        return None
    dtype = np.dtype(match.group("descr").decode())
    if dtype.hasobject:
        return None
    shape = tuple(int(item) for item in match.group("shape").split(b",") if item.strip())
    offset = start + header_len
    count = 1
    for item in shape:
        count *= item
    if len(data) - offset != count * dtype.itemsize:
        raise UserError(f"{path}: corrupt or truncated tensor file (holds {len(data) - offset} data bytes, "
                        f"its header says {count * dtype.itemsize})")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def read_tensor(path: Path, dtype_name: str | None = None, shape: list[int] | None = None,
                recorded_in: str = "dump.json") -> np.ndarray:
    """Open a tensor file read-only (memory-mapped for .npy); `.pt` files (msprobe) load with weights_only.

    Raises UserError naming the file when it is missing, truncated, corrupt or disagrees with the
    dtype/shape recorded in `recorded_in` (dump.json; a replay's replay.json).
    """
    if not path.is_file():
        raise UserError(f"{path}: tensor data file is missing")
    if path.suffix == ".pt":
        array = _read_pt_without_torch(path)
        if array is None:  # a layout the parser does not know: torch's own loader, tensors only
            if not _torch_allowed:
                raise TorchNeeded(str(path))
            array = _read_torch_file(path)
    else:
        # Small files are read outright: setting up a memory map costs more than reading them.
        size = path.stat().st_size
        array = _read_small_npy(path) if size <= _MMAP_MIN_BYTES else None
        if array is None:
            try:
                array = np.load(path, mmap_mode="r" if size > _MMAP_MIN_BYTES else None, allow_pickle=False)
            except ValueError as exc:
                if "pickle" in str(exc):  # numpy's message advises allow_pickle: never for a file from elsewhere
                    raise UserError(f"{path}: holds pickled Python objects, which npukit never loads "
                                    "(a tensor file holds one plain array)") from None
                raise UserError(f"{path}: corrupt or truncated tensor file ({exc})") from None
            except (OSError, EOFError) as exc:
                raise UserError(f"{path}: corrupt or truncated tensor file ({exc})") from None
        if not isinstance(array, np.ndarray):
            raise UserError(f"{path}: expected one array, found an archive")
    if dtype_name is not None and dtype_name in _STORAGE:
        expected = np.dtype(_STORAGE[dtype_name][0])
        if array.dtype != expected:
            raise UserError(
                f"{path}: holds {array.dtype} data but {recorded_in} says {dtype_name} (stored as {expected})"
            )
    if shape is not None and list(array.shape) != list(shape):
        raise UserError(f"{path}: holds shape {list(array.shape)} but {recorded_in} says {list(shape)}")
    return array


class TorchNeeded(Exception):
    """A .pt file only torch can read, met where torch must not be imported (a forked compare worker)."""


_torch_allowed = True  # False in forked compare workers: torch's thread pools do not survive a fork


def forbid_torch() -> None:
    """Make read_tensor raise TorchNeeded rather than import torch (process pool initializer)."""
    global _torch_allowed
    _torch_allowed = False


# What torch.save writes for one tensor, parsed without unpickling (no object is ever built from
# the file: the opcodes are only decoded, and only these globals are recognized).
# Storage classes of torch._utils._rebuild_tensor_v2 -> dtype (torch.storage's own table).
_STORAGE_CLASSES = {
    "DoubleStorage": "torch.float64", "FloatStorage": "torch.float32", "HalfStorage": "torch.float16",
    "BFloat16Storage": "torch.bfloat16", "LongStorage": "torch.int64", "IntStorage": "torch.int32",
    "ShortStorage": "torch.int16", "CharStorage": "torch.int8", "ByteStorage": "torch.uint8",
    "BoolStorage": "torch.bool", "ComplexDoubleStorage": "torch.complex128", "ComplexFloatStorage": "torch.complex64",
}
_REBUILD_V2 = ("torch._utils", "_rebuild_tensor_v2")  # storage typed by its class
_REBUILD_V3 = ("torch._utils", "_rebuild_tensor_v3")  # untyped storage, dtype as an argument (float8, uint16 ...)
_ORDERED_DICT = ("collections", "OrderedDict")
_UNTYPED_STORAGE = ("torch.storage", "UntypedStorage")
_EOCD = struct.Struct("<4s4H2LH")  # zip end of central directory
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # zip central directory entry
_LOCAL = struct.Struct("<4s5H3L2H")  # zip local file header
_ZIP_LIMIT = 0xFFFFFFFF  # a zip64 field: left to torch's loader


class _Storage(tuple):
    """(dtype name, record key, element count) from a BINPERSID."""


class _Tensor(tuple):
    """(dtype name, storage key, storage elements, offset, shape, strides) from a REDUCE."""


@functools.lru_cache(maxsize=4096)  # a golden and a target file of one tensor have the same data.pkl
def _parse_tensor_pickle(data: bytes) -> _Tensor | None:
    """The tensor a single-tensor data.pkl describes, or None for anything else (not an error:
    torch's weights_only loader then decides). Never builds an object the file names."""
    stack: list = []
    marks: list[int] = []
    memo: dict = {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("PROTO", "FRAME"):
                continue
            if name in ("BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1"):
                stack.append(arg)
            elif name == "GLOBAL":
                stack.append(tuple(arg.split(" ", 1)))
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "TUPLE":
                start = marks.pop()
                stack[start:] = [tuple(stack[start:])]
            elif name in ("EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
                count = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}[name]
                items = tuple(stack[len(stack) - count:])
                del stack[len(stack) - count:]
                stack.append(items)
            elif name in ("NEWTRUE", "NEWFALSE"):
                stack.append(name == "NEWTRUE")
            elif name == "NONE":
                stack.append(None)
            elif name == "BINPERSID":
                kind, storage_class, key, _location, count = stack.pop()
                if kind != "storage" or not isinstance(key, str) or not isinstance(count, int):
                    return None
                if storage_class == _UNTYPED_STORAGE:
                    dtype_name = None
                elif storage_class[0] == "torch" and storage_class[1] in _STORAGE_CLASSES:
                    dtype_name = _STORAGE_CLASSES[storage_class[1]]
                else:
                    return None
                stack.append(_Storage((dtype_name, key, count)))
            elif name == "REDUCE":
                args = stack.pop()
                function = stack.pop()
                if function == _ORDERED_DICT and args == ():
                    stack.append({})
                elif function in (_REBUILD_V2, _REBUILD_V3):
                    stack.append(_rebuilt_tensor(function, args))
                else:
                    return None
            elif name == "STOP":
                result = stack.pop()
                return result if isinstance(result, _Tensor) and not stack else None
            else:
                return None
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):  # malformed, or not this shape
        return None
    return None


def _rebuilt_tensor(function, args) -> _Tensor:
    storage, offset, shape, strides, _requires_grad, hooks = args[:6]
    rest = args[6:]
    dtype_name, key, count = storage
    if function == _REBUILD_V3:
        dtype = rest[0]
        if dtype_name is not None or dtype[0] != "torch":
            raise ValueError
        dtype_name = f"torch.{dtype[1]}"
        if dtype_name not in _STORAGE:
            raise ValueError
        count //= np.dtype(_STORAGE[dtype_name][0]).itemsize  # an untyped storage counts bytes
        rest = rest[1:]
    if dtype_name is None or hooks != {} or any(item is not None and item != {} for item in rest):
        raise ValueError  # backward hooks or metadata: not a plain dumped tensor
    if not (isinstance(offset, int) and all(isinstance(item, int) for item in (*shape, *strides))
            and len(shape) == len(strides)):
        raise ValueError
    return _Tensor((dtype_name, key, count, offset, tuple(shape), tuple(strides)))


def _zip_records(data) -> dict[str, tuple[int, int, int]] | None:
    """name -> (data offset, size, compression method) of every record of a zip held in `data`."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 65557))
    if end < 0 or end + _EOCD.size > len(data):
        return None
    _, _, _, _, entries, size, offset, _ = _EOCD.unpack_from(data, end)
    if _ZIP_LIMIT in (size, offset) or entries == 0xFFFF or offset + size > end:
        return None
    records = {}
    position = offset
    for _ in range(entries):
        if position + _CENTRAL.size > end:
            return None
        (signature, _, _, flags, method, _, _, _, packed, unpacked, name_length, extra_length, comment_length,
         _, _, _, local) = _CENTRAL.unpack_from(data, position)
        if signature != b"PK\x01\x02" or flags & 1 or _ZIP_LIMIT in (packed, unpacked, local):
            return None  # encrypted or zip64
        name = bytes(data[position + _CENTRAL.size:position + _CENTRAL.size + name_length]).decode("utf-8", "replace")
        position += _CENTRAL.size + name_length + extra_length + comment_length
        if local + _LOCAL.size > len(data):
            return None
        header = _LOCAL.unpack_from(data, local)
        if header[0] != b"PK\x03\x04":
            return None
        start = local + _LOCAL.size + header[9] + header[10]
        if start + packed > len(data):
            return None
        records[name] = (start, packed if method else unpacked, method)
    return records


def _read_pt_without_torch(path: Path) -> np.ndarray | None:
    """The tensor of a .pt file torch.save wrote (npukit's and msprobe's dumps), read with numpy
    only, its storage memory-mapped for large files: no unpickling, no torch. None for any other
    layout (torch's weights_only loader then reads it, or refuses it)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > _MMAP_MIN_BYTES:
                data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                data = handle.read()
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read tensor file ({getattr(exc, 'strerror', None) or exc})") from None
    records = _zip_records(data)
    if records is None:
        return None
    pickle_name = next((name for name in records if name.endswith("/data.pkl") and name.count("/") == 1), None)
    if pickle_name is None:
        return None
    prefix = pickle_name[:-len("data.pkl")]
    start, length, method = records[pickle_name]
    byteorder = records.get(prefix + "byteorder")
    if method != 0 or length > 4096 or (byteorder is not None and bytes(
            data[byteorder[0]:byteorder[0] + byteorder[1]]) != b"little"):
        return None
    tensor = _parse_tensor_pickle(bytes(data[start:start + length]))
    if tensor is None:
        return None
    dtype_name, key, count, offset, shape, strides = tensor
    record = records.get(f"{prefix}data/{key}")
    dtype = np.dtype(_STORAGE[dtype_name][0])
    if record is None or record[2] != 0 or record[1] != count * dtype.itemsize:
        return None
    storage = np.frombuffer(data, dtype=dtype, count=count, offset=record[0])
    return _view(storage, offset, shape, strides)


def _view(storage: np.ndarray, offset: int, shape: tuple, strides: tuple) -> np.ndarray | None:
    """The tensor's elements in its storage (a view, read-only), or None when they fall outside it."""
    numel = math.prod(shape)
    if offset < 0 or any(item < 0 for item in (*shape, *strides)):
        return None
    if numel == 0:
        return np.empty(shape, dtype=storage.dtype)
    last = offset + sum((length - 1) * stride for length, stride in zip(shape, strides))
    if last >= storage.size:
        return None
    contiguous, expected = True, 1
    for length, stride in zip(reversed(shape), reversed(strides)):
        if length != 1 and stride != expected:
            contiguous = False
        expected *= length
    if contiguous:
        return storage[offset:offset + numel].reshape(shape)
    return np.lib.stride_tricks.as_strided(storage[offset:], shape, [stride * storage.itemsize for stride in strides],
                                           writeable=False)


def _read_torch_file(path: Path) -> np.ndarray:
    import torch

    if not zipfile.is_zipfile(path):
        raise UserError(f"{path}: corrupt or truncated .pt file (not a zip archive)")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: never for a file from elsewhere
        raise UserError(f"{path}: holds Python objects other than tensors, which npukit never unpickles "
                        "(a tensor file from a dump holds one tensor)") from None
    except Exception as exc:  # torch raises many types for corrupt archives
        raise UserError(f"{path}: cannot load tensor ({type(exc).__name__}: {exc})") from None
    if not isinstance(loaded, torch.Tensor):
        raise UserError(f"{path}: expected a tensor, found {type(loaded).__name__}")
    return tensor_to_numpy(loaded)


def float64_converter(dtype_name: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """Function writing a chunk of a stored array (see read_tensor) into a float64 buffer, exactly.

    Writing into a caller-owned buffer, not allocating: fresh large arrays cost page faults that
    dominate the comparison time.
    """
    if dtype_name == "torch.bfloat16":
        def bf16(chunk, out):
            bits = np.left_shift(chunk, 16, dtype=np.uint32)  # bf16 is the top half of an fp32
            np.copyto(out, bits.view(np.float32))
        return bf16
    if dtype_name in ("torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz"):
        table = _float8_table(dtype_name)
        return lambda chunk, out: np.take(table, chunk, out=out)
    return lambda chunk, out: np.copyto(out, chunk, casting="unsafe")


def _float8_table(dtype_name: str) -> np.ndarray:
    import torch

    return torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype_name.split(".")[1])).double().numpy()
