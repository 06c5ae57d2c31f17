"""Tensor data files: one `.npy` per tensor, pickle-free, memory-mappable, exact for every dtype.

numpy has no bfloat16 or float8, so those tensors are written as their raw bits (uint16 / uint8)
and the real dtype is recorded next to the file name in dump.json. Reading gives back the raw
array plus a function that widens a chunk of it to float64, so compare never needs torch.

Torch is imported lazily: compare worker processes use only numpy.
"""

from __future__ import annotations

import pickle
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from npukit.errors import UserError
from npukit.files import atomic_open

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
