"""Tensor data files: `.pt` as torch.save writes them (msprobe's format) or `.npy`, exact for every dtype.

numpy has no bfloat16 or float8, so those tensors are read (and written to .npy) as their raw bits
(uint16 / uint8), the real dtype recorded next to the file name in dump.json. Reading gives back
the raw array plus a function that widens a chunk of it to float64, so compare never needs torch:
a .pt holding one tensor is read by decoding its data.pkl's opcodes (never unpickling) and
memory-mapping its storage; any other .pt goes to torch.load(weights_only=True).

TensorFileWriter writes a dump's files behind the training thread. Torch is imported lazily:
compare worker processes use only numpy.
"""

from __future__ import annotations

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
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from npukit.errors import UserError
from npukit.files import atomic_open, atomic_path

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

        with torch._C.DisableTorchFunction():
            compact = strided_form(tensor.detach()).to("cpu")  # the values the .npy form keeps too
            if compact.untyped_storage().nbytes() != compact.numel() * compact.element_size() \
                    or not compact.is_contiguous():
                compact = compact.contiguous().clone()  # torch.save writes a view's whole storage
        with atomic_open(path, "wb") as handle:
            torch.save(compact, handle)
        return
    array = tensor_to_numpy(tensor)
    with atomic_open(path, "wb") as handle:
        np.lib.format.write_array(handle, array, allow_pickle=False)


class TensorFileWriter:
    """Tensor files of a dump, written on a writer thread while training goes on (as msprobe's
    async dump does): `copy` runs on the training thread, `write` and `link` on the writer thread.

    copy() takes the tensor's values as they are when recorded (a later in-place change never
    reaches the file) into a host buffer reused from earlier steps: a fresh buffer of a few MB costs
    page faults that took most of the copy's time. At most `max_bytes` of copies wait for the
    writer: beyond that, copy() waits for it (memory stays bounded when the disk is slower than
    training). write() and link() never raise: the first file that cannot be written (a full disk,
    a name too long) is reported once on stderr, and the dump goes on without it.
    """

    _POOLED_BYTES = 64 << 10  # smaller copies come from the allocator's free lists: no page faults

    def __init__(self, max_bytes: int | None = None) -> None:
        import threading

        self.max_bytes = max_bytes if max_bytes is not None else _default_pending_bytes()
        self.failed: list[Path] = []  # files that could not be written
        self._free: dict[int, list] = {}  # nbytes -> reusable uint8 buffers
        self._free_bytes = 0
        self._pending_bytes = 0
        self._room = threading.Condition()

    def copy(self, tensor) -> tuple:
        """(host copy of the tensor, its pooled buffer or None): what write() takes."""
        import torch

        with torch._C.DisableTorchFunction():
            tensor = tensor.detach()
            nbytes = tensor.numel() * tensor.element_size()
            plain = (type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized
                     and not tensor.is_nested)
            with self._room:
                while self._pending_bytes > 0 and self._pending_bytes + nbytes > self.max_bytes:
                    self._room.wait()
                self._pending_bytes += nbytes
                buffer = None
                if plain and nbytes >= self._POOLED_BYTES:
                    reusable = self._free.get(nbytes)
                    if reusable:
                        buffer = reusable.pop()
                        self._free_bytes -= nbytes
            if not plain:  # sparse, quantized, nested, subclasses: write_tensor makes them plain
                return tensor.to("cpu", copy=True), None, nbytes
            if buffer is None and nbytes >= self._POOLED_BYTES:
                buffer = torch.empty(nbytes, dtype=torch.uint8)
            snapshot = (buffer.view(tensor.dtype).view(tensor.shape) if buffer is not None
                        else torch.empty(tensor.shape, dtype=tensor.dtype))
            snapshot.copy_(tensor)
        return snapshot, buffer, nbytes

    def write(self, path: Path, copied: tuple) -> None:
        """Write a copy() to `path` (writer thread), then give its buffer back."""
        snapshot, buffer, nbytes = copied
        try:
            write_tensor(path, snapshot)
        except Exception as exc:  # never the run's end: reported once
            self._failed(path, exc)
        finally:
            del snapshot
            self._release(buffer, nbytes)

    def link(self, path: Path, written: Path) -> None:
        """`path` holding the bytes of the file `written` before it (the same tensor, unchanged):
        a hard link, or a copy where the file system has none; nothing if `written` failed."""
        if written in self.failed:
            self.failed.append(path)
            return
        try:
            with atomic_path(path) as temporary:
                temporary.unlink()
                try:
                    os.link(written, temporary)
                except OSError:
                    shutil.copyfile(written, temporary)
        except Exception as exc:
            self._failed(path, exc)

    def _failed(self, path: Path, exc: Exception) -> None:
        self.failed.append(path)
        if len(self.failed) == 1:
            reason = str(exc) if isinstance(exc, UserError) else f"{path}: {type(exc).__name__}: {exc}"
            print(f"npukit: cannot write tensor data ({reason}). The dump goes on without this file and any other "
                  "that cannot be written (npu-compare names them as missing); the run goes on.", file=sys.stderr)

    def _release(self, buffer, nbytes: int) -> None:
        with self._room:
            self._pending_bytes -= nbytes
            if buffer is not None and self._free_bytes + nbytes <= self.max_bytes:
                self._free.setdefault(nbytes, []).append(buffer)
                self._free_bytes += nbytes
            self._room.notify_all()


def _default_pending_bytes() -> int:
    """Copies waiting for the writer: an eighth of the host memory, at most 2 GB."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return max(64 << 20, min(2 << 30, memory // 8))


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
    import torch

    data = local_shard(data)
    if data.is_nested:
        return None
    if data.is_quantized:
        return data.dequantize()
    if data.layout != torch.strided:
        return data.to_dense()
    return data


def tensor_to_numpy(tensor):
    """Host numpy array holding the tensor's exact bits (bf16/float8 as raw unsigned integers)."""
    import torch

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


def read_tensor(path: Path, dtype_name: str | None = None, shape: list[int] | None = None) -> np.ndarray:
    """Open a tensor file read-only (memory-mapped for .npy); `.pt` files (msprobe) load with weights_only.

    Raises UserError naming the file when it is missing, truncated, corrupt or disagrees with the
    dtype/shape recorded in dump.json.
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
                f"{path}: holds {array.dtype} data but dump.json says {dtype_name} (stored as {expected})"
            )
    if shape is not None and list(array.shape) != list(shape):
        raise UserError(f"{path}: holds shape {list(array.shape)} but dump.json says {list(shape)}")
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
