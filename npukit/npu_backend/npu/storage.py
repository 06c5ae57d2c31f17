"""torch.npu.<Scalar>Storage: the legacy typed storage classes, as torch.cuda has them.

`tensor.storage_type()` and `TypedStorage._get_legacy_storage_class()` look them up on the
device's module; torch_npu defines them too. Their module is `torch.npu`: torch reads a legacy
storage's device from the last part of its class's module name (`torch.npu.FloatStorage(4)` is an
npu storage, and `isinstance(t.storage(), torch.npu.FloatStorage)` holds).
"""

from __future__ import annotations

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal


class _NpuLegacyStorage(_LegacyStorage):
    @classmethod
    def from_buffer(cls, *args, **kwargs):
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: Not available for NPU storage")

    @classmethod
    def _new_with_weak_ptr(cls, *args, **kwargs):
        raise RuntimeError("_new_with_weak_ptr: Not available for NPU storage")

    @classmethod
    def _new_shared_filename(cls, manager, obj, size, *, device=None, dtype=None):
        raise RuntimeError("_new_shared_filename: Not available for NPU storage")


def _storage_class(name: str, dtype: torch.dtype) -> type:
    def dtype_property(cls):
        _warn_typed_storage_removal()
        return cls._dtype

    return type(name, (_NpuLegacyStorage,), {
        "__module__": "torch.npu",
        "__qualname__": name,
        "dtype": classproperty(dtype_property),
        "_dtype": classproperty(lambda cls: dtype),
    })


STORAGE_DTYPES = {
    "ByteStorage": torch.uint8, "DoubleStorage": torch.double, "FloatStorage": torch.float,
    "HalfStorage": torch.half, "LongStorage": torch.long, "IntStorage": torch.int,
    "ShortStorage": torch.short, "CharStorage": torch.int8, "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.cdouble,
    "ComplexFloatStorage": torch.cfloat,
}
STORAGE_CLASSES = {name: _storage_class(name, dtype) for name, dtype in STORAGE_DTYPES.items()}
globals().update(STORAGE_CLASSES)
__all__ = list(STORAGE_CLASSES)
