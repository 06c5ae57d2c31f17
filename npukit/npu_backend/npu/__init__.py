"""`torch.npu` / `torch_npu.npu` for the emulated device: the surface of torch_npu.npu 2.14.

Work on the emulated device is synchronous, so streams and events complete immediately and
synchronize() returns at once. Names of torch_npu.npu that have no meaning without the real
device runtime exist and raise NotImplementedError saying so (never AttributeError).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from npukit.npu_backend import _C, numerics
from npukit.npu_backend.npu import amp, memory, mstx, random, storage, utils  # noqa: F401 (submodules)
from npukit.npu_backend.npu._device import device_index
from npukit.npu_backend.npu.memory import (  # noqa: F401 (re-exported API)
    caching_allocator_alloc,
    caching_allocator_delete,
    empty_cache,
    get_allocator_backend,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_cached,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_cached,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from npukit.npu_backend.npu.random import (  # noqa: F401 (re-exported API)
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from npukit.npu_backend.npu.storage import STORAGE_CLASSES

globals().update(STORAGE_CLASSES)  # torch.npu.FloatStorage & co.

# Submodules importable as torch.npu.<name> and torch_npu.npu.<name>.
SUBMODULES = ("amp", "utils", "memory", "random", "mstx", "storage")

default_generators: tuple = ()


def _refresh_default_generators() -> None:
    global default_generators
    default_generators = tuple(_C.default_generator(i) for i in range(_C.device_count()))


# ---------------------------------------------------------------- device / init
def is_available() -> bool:
    return _C.device_count() > 0


def is_initialized() -> bool:
    return True


def init() -> None:
    """The emulated device needs no runtime initialisation."""


def _lazy_init() -> None:
    """Called by torch internals (e.g. torch._utils._get_device_index) before device use."""


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device) -> None:
    index = device_index(device)
    if index >= _C.device_count():
        raise RuntimeError(f"Invalid device id: npu:{index} (device count is {_C.device_count()})")
    _C.set_device(index)


class device:
    """Context manager that changes the current NPU: `with torch.npu.device(1): ...`."""

    def __init__(self, device):
        self.index = -1 if device is None else device_index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = _C.current_device()
        if self.index >= 0:
            _C.set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.index >= 0:
            _C.set_device(self.previous)
        return False


class device_of(device):
    """Context manager that makes the device of tensor `obj` current."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.is_npu else -1)


CHIP_NAME = os.environ.get("NPUKIT_CHIP", "Ascend910B2")

# Published core counts of the chips npukit can emulate (cube = AI cores).
_CHIP_CORES = {"Ascend910B1": (24, 48), "Ascend910B2": (24, 48), "Ascend910B3": (20, 40),
               "Ascend910B4": (20, 40), "Ascend910A": (32, 32), "Ascend910_9391": (24, 48)}


@dataclass(frozen=True)
class _NPUDeviceProperties:
    name: str
    total_memory: int
    cube_core_num: int
    vector_core_num: int
    L2_cache_size: int

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory={self.total_memory // (1 << 20)}MB, "
                f"cube_core_num={self.cube_core_num}, vector_core_num={self.vector_core_num}, "
                f"L2_cache_size={self.L2_cache_size // (1 << 20)}MB)")


def get_device_name(device=None) -> str:
    device_index(device)
    return f"{CHIP_NAME} (emulated)"


def get_device_properties(device=None) -> _NPUDeviceProperties:
    index = device_index(device)
    cube, vector = _CHIP_CORES.get(CHIP_NAME, (24, 48))
    return _NPUDeviceProperties(name=get_device_name(index), total_memory=memory._total(index),
                                cube_core_num=cube, vector_core_num=vector, L2_cache_size=192 << 20)


def get_device_capability(device=None):
    """Like torch_npu: None unless TORCH_NPU_DEVICE_CAPABILITY="major.minor" is set (always warns)."""
    warnings.warn("torch.npu.get_device_capability is not meaningful on NPU: it returns None unless "
                  "TORCH_NPU_DEVICE_CAPABILITY is set", stacklevel=2)
    value = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY")
    if not value:
        return None
    major, _, minor = value.partition(".")
    return int(major), int(minor or 0)


def can_device_access_peer(device, peer_device) -> bool:
    device_index(device)
    device_index(peer_device)
    return True


def utilization(device=None) -> int:
    device_index(device)
    return 0


def synchronize(device=None) -> None:
    """Work on the emulated device is synchronous: nothing to wait for."""
    if device is not None:
        device_index(device)


def ipc_collect() -> None:
    """Nothing to collect: emulated memory is host memory freed on release."""


def get_amp_supported_dtype() -> list:
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = False) -> bool:
    return not CHIP_NAME.startswith("Ascend910A")


def is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("npu")


def set_autocast_enabled(enabled: bool) -> None:
    torch.set_autocast_enabled("npu", enabled)


def get_autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("npu")


def set_autocast_dtype(dtype: torch.dtype) -> None:
    torch.set_autocast_dtype("npu", dtype)


# ---------------------------------------------------------------- streams / events
class Stream(torch.Stream):
    """An NPU stream. Work is synchronous on the emulated device, so a stream is always idle."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if kwargs:
            return super().__new__(cls, **kwargs)
        index = device_index(device)
        return super().__new__(cls, device=torch.device("npu", index), priority=priority)

    def wait_event(self, event) -> None:
        """Events complete when recorded: nothing to wait for."""

    def wait_stream(self, stream) -> None:
        """Streams are always idle: nothing to wait for."""

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Streams are always idle."""

    @property
    def npu_stream(self) -> int:
        return self.stream_id


class Event:
    """An NPU event; elapsed_time() measures host time between two record() calls."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._event = torch.Event(device=torch.device("npu", current_device()), enable_timing=enable_timing,
                                  blocking=blocking, interprocess=interprocess)

    def record(self, stream=None) -> None:
        self._event.record(stream if stream is not None else current_stream())

    def wait(self, stream=None) -> None:
        """Events complete when recorded: nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Events complete when recorded."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record() and `end_event`'s."""
        return self._event.elapsed_time(end_event._event)

    @property
    def device(self) -> torch.device:
        return self._event.device

    def __repr__(self) -> str:
        return f"<torch.npu.Event device={self.device}>"


_PRIVATEUSE1_DEVICE_TYPE = 20  # c10::DeviceType::PrivateUse1


def default_stream(device=None) -> Stream:
    return Stream(stream_id=0, device_index=device_index(device), device_type=_PRIVATEUSE1_DEVICE_TYPE)


_current_streams: dict[int, Stream] = {}


def current_stream(device=None) -> Stream:
    index = device_index(device)
    return _current_streams.get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    if stream is not None:
        _current_streams[stream.device_index] = stream


class StreamContext:
    """Context manager that makes `stream` current on its device."""

    def __init__(self, stream):
        self.stream = stream
        self.previous = None

    def __enter__(self):
        if self.stream is not None:
            self.previous = current_stream(self.stream.device_index)
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            set_stream(self.previous)
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)


_sync_debug_mode = 0


def set_sync_debug_mode(debug_mode) -> None:
    global _sync_debug_mode
    modes = {"default": 0, "warn": 1, "error": 2}
    _sync_debug_mode = modes[debug_mode] if isinstance(debug_mode, str) else int(debug_mode)


def get_sync_debug_mode() -> int:
    return _sync_debug_mode


# ---------------------------------------------------------------- overflow flag
get_npu_overflow_flag = utils.get_npu_overflow_flag
clear_npu_overflow_flag = utils.clear_npu_overflow_flag


# ---------------------------------------------------------------- precision knobs
class CubeMathType:
    KEEP_DTYPE = 0
    ALLOW_FP32_DOWN_PRECISION = 1
    USE_FP16 = 2
    USE_HF32 = 3
    USE_FP32_ADD = 4


class _MatmulConfig:
    """torch.npu.matmul: `allow_hf32` rounds fp32 matmul inputs to HF32 (default False)."""

    @property
    def allow_hf32(self) -> bool:
        return _C.get_matmul_hf32()

    @allow_hf32.setter
    def allow_hf32(self, value: bool) -> None:
        numerics.script_switch("torch.npu.matmul.allow_hf32", value, _C.set_matmul_hf32)

    @property
    def cube_math_type(self) -> int:
        return CubeMathType.USE_HF32 if _C.get_matmul_hf32() else CubeMathType.KEEP_DTYPE

    @cube_math_type.setter
    def cube_math_type(self, value: int) -> None:
        numerics.script_switch("torch.npu.matmul.cube_math_type",
                               int(value) in (CubeMathType.USE_HF32, CubeMathType.ALLOW_FP32_DOWN_PRECISION),
                               _C.set_matmul_hf32)


class _ConvConfig:
    """torch.npu.conv: `allow_hf32` rounds fp32 conv inputs to HF32 (default True, as torch_npu)."""

    @property
    def allow_hf32(self) -> bool:
        return _C.get_conv_hf32()

    @allow_hf32.setter
    def allow_hf32(self, value: bool) -> None:
        numerics.script_switch("torch.npu.conv.allow_hf32", value, _C.set_conv_hf32)


class _NPUConfig:
    """torch.npu.config: accepts torch_npu's options (the emulator keeps ND format always)."""

    allow_internal_format = False


matmul = _MatmulConfig()
conv = _ConvConfig()
config = _NPUConfig()

_ACL_OPTIONS = {
    "ACL_PRECISION_MODE": ("allow_fp32_to_fp16", "must_keep_origin_dtype"),
    "ACL_OP_SELECT_IMPL_MODE": ("high_performance", "high_precision"),
    "ACL_AICORE_NUM": None, "ACL_OPTYPELIST_FOR_IMPLMODE": None, "ACL_OP_DEBUG_LEVEL": None,
    "ACL_DEBUG_DIR": None, "ACL_OP_COMPILER_CACHE_MODE": ("disable", "enable", "force"),
    "ACL_OP_COMPILER_CACHE_DIR": None, "ACL_OP_DEBUG_OPTION": None,
}
_options: dict = {}


def set_option(option: dict) -> None:
    if not isinstance(option, dict):
        raise TypeError("npu option must be a dict.")
    for key, value in option.items():
        if key not in _ACL_OPTIONS:
            raise ValueError(f"invalid npu option name: {key}")
        allowed = _ACL_OPTIONS[key]
        if allowed and str(value) not in allowed:
            raise ValueError(f"invalid value {value!r} for npu option {key}; expected one of {allowed}")
        _options[key] = value


_jit_compile = False


def set_compile_mode(jit_compile: bool = False) -> None:
    global _jit_compile
    _jit_compile = bool(jit_compile)


def is_jit_compile_false() -> bool:
    return not _jit_compile


def set_aoe(dump_path) -> None:
    """AOE tuning needs the device compiler; the setting is accepted and has no effect here."""
    _options["aoe_dump_path"] = str(dump_path)


_mm_bmm_format_nd = True


def set_mm_bmm_format_nd(is_nd: bool = True) -> None:
    global _mm_bmm_format_nd
    _mm_bmm_format_nd = bool(is_nd)


def get_mm_bmm_format_nd() -> bool:
    return _mm_bmm_format_nd


# ---------------------------------------------------------------- legacy typed tensors
# Real legacy tensor types, made as torch_npu makes them (csrc/tensor_types.cpp): a
# "torch.tensortype" metaclass, torch's legacy constructor for the npu dispatch key, named
# torch.npu.<Scalar>Tensor and added to torch._tensor_classes. As with torch_npu, torch's
# set_default_tensor_type does not accept them: `torch.set_default_tensor_type(torch.npu.HalfTensor)`
# raises TypeError ("invalid type object: only floating-point types are supported as the default
# type"), because torch only accepts its own CPU and CUDA type objects.
_LEGACY_TENSOR_TYPES = {tensor_type.__name__: tensor_type for tensor_type in _C.legacy_tensor_types()}
torch._tensor_classes.update(_LEGACY_TENSOR_TYPES.values())

FloatTensor = _LEGACY_TENSOR_TYPES["FloatTensor"]
DoubleTensor = _LEGACY_TENSOR_TYPES["DoubleTensor"]
HalfTensor = _LEGACY_TENSOR_TYPES["HalfTensor"]
BFloat16Tensor = _LEGACY_TENSOR_TYPES["BFloat16Tensor"]
ByteTensor = _LEGACY_TENSOR_TYPES["ByteTensor"]
CharTensor = _LEGACY_TENSOR_TYPES["CharTensor"]
ShortTensor = _LEGACY_TENSOR_TYPES["ShortTensor"]
IntTensor = _LEGACY_TENSOR_TYPES["IntTensor"]
LongTensor = _LEGACY_TENSOR_TYPES["LongTensor"]
BoolTensor = _LEGACY_TENSOR_TYPES["BoolTensor"]


# ---------------------------------------------------------------- not emulated
_NOT_EMULATED = {
    "stop_device": "device fault handling", "restart_device": "device fault handling",
    "check_uce_in_memory": "device fault handling", "stress_detect": "hardware stress detection",
    "set_device_limit": "per-device core limits", "get_device_limit": "per-device core limits",
    "npurt": "the NPU runtime bindings", "SyncLaunchStream": "synchronous-launch streams",
    "ExternalStream": "streams created by the ACL runtime", "ExternalEvent": "events created by the ACL runtime",
    "set_task_queue_enable": "the task queue", "get_task_queue_enable": "the task queue",
    "set_stream_limit": "stream core limits", "reset_stream_limit": "stream core limits",
    "get_stream_limit": "stream core limits", "set_op_timeout_ms": "op timeouts",
    "empty_virt_addr_cache": "virtual-address caching", "MemPool": "memory pools", "use_mem_pool": "memory pools",
    "NPUPluggableAllocator": "pluggable allocators", "change_current_allocator": "pluggable allocators",
    "host_empty_cache": "the host caching allocator", "host_memory_stats": "the host caching allocator",
    "host_memory_stats_as_nested_dict": "the host caching allocator",
    "reset_accumulated_host_memory_stats": "the host caching allocator",
    "reset_peak_host_memory_stats": "the host caching allocator",
    "set_deterministic_level": "deterministic-level control", "enable_deterministic_with_backward": "deterministic-level control",
    "disable_deterministic_with_backward": "deterministic-level control", "use_compatible_impl": "compatible op implementations",
    "are_compatible_impl_enabled": "compatible op implementations", "current_blas_handle": "BLAS handles",
    "set_dump": "CANN data dump (use npu-run --dump)", "init_dump": "CANN data dump (use npu-run --dump)",
    "finalize_dump": "CANN data dump (use npu-run --dump)",
    "NPUGraph": "graph capture", "graph": "graph capture", "graph_pool_handle": "graph capture",
    "make_graphed_callables": "graph capture", "graph_task_group_begin": "graph capture",
    "graph_task_group_end": "graph capture", "graph_task_update_begin": "graph capture",
    "graph_task_update_end": "graph capture", "NpuGraphOpHandler": "graph capture",
    "register_npu_graph_handler": "graph capture", "super_kernel_scope_begin": "super kernels",
    "super_kernel_scope_end": "super kernels", "obfuscation_initialize": "model obfuscation",
    "obfuscation_finalize": "model obfuscation", "obfuscation_calculate": "model obfuscation",
}


def is_current_stream_capturing() -> bool:
    return False


def _not_emulated(name: str, what: str):
    def raiser(*args, **kwargs):
        raise NotImplementedError(
            f"torch.npu.{name} is not available on the npukit emulated NPU ({what} needs the real Ascend "
            "runtime); run on an Ascend host with torch_npu for this API")

    raiser.__name__ = name
    raiser.__qualname__ = name
    return raiser


for _name, _what in _NOT_EMULATED.items():
    globals()[_name] = _not_emulated(_name, _what)

__all__ = [
    "is_initialized", "init", "is_available", "device_count", "set_device", "current_device",
    "get_device_name", "get_device_properties", "get_device_capability", "can_device_access_peer",
    "device", "device_of", "utilization", "mem_get_info", "ipc_collect", "synchronize", "Stream",
    "Event", "StreamContext", "stream", "set_stream", "current_stream", "default_stream",
    "set_sync_debug_mode", "get_sync_debug_mode", "get_amp_supported_dtype", "is_autocast_enabled",
    "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype", "is_bf16_supported",
    "set_option", "set_aoe", "set_compile_mode", "is_jit_compile_false", "set_mm_bmm_format_nd",
    "get_mm_bmm_format_nd", "CubeMathType", "config", "matmul", "conv", "get_npu_overflow_flag",
    "clear_npu_overflow_flag", "is_current_stream_capturing", "mstx",
    "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
    "ShortTensor", "IntTensor", "LongTensor", "BoolTensor",
    *memory.__all__, *random.__all__, *storage.__all__, *_NOT_EMULATED,
]

