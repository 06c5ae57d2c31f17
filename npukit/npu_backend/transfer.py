"""`torch_npu.contrib.transfer_to_npu` for the emulated device: unmigrated CUDA code runs on npu.

Follows torch_npu 2.14's patch list (shared/reference/torch_npu_api.md, section 1): torch.cuda.*
becomes torch.npu.*, "cuda" device arguments of factories, `.to()`, `torch.load(map_location=)`
and friends become "npu", `.cuda()`/`.is_cuda` become `.npu()`/`.is_npu`, autocast/GradScaler
on "cuda" run on "npu", and "nccl" process groups become "hccl".
"""

from __future__ import annotations

import functools
import re

import torch

_applied = False

_TORCH_FACTORIES = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like", "randperm",
    "arange", "frombuffer", "normal", "empty_strided", "empty_like", "scalar_tensor", "tril_indices",
    "bartlett_window", "ones", "sparse_coo_tensor", "randn", "kaiser_window", "tensor", "triu_indices",
    "as_tensor", "zeros", "randint_like", "full", "eye", "empty", "blackman_window", "zeros_like",
    "range", "sparse_csr_tensor", "randn_like", "from_file", "linspace", "hamming_window", "load",
    "set_default_device", "get_device_module", "sparse_compressed_tensor",
)
_TENSOR_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros",
                   "to", "pin_memory")
_MODULE_METHODS = ("to", "to_empty")
_DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")
_CUDA_RE = re.compile(r"\bcuda\b")


def to_npu_device(value, replace_int: bool = False):
    """Translate one device-like value: "cuda:1" -> "npu:1", torch.device("cuda") -> npu, dicts too."""
    if isinstance(value, str):
        return _CUDA_RE.sub("npu", value) if "cuda" in value else value
    if isinstance(value, torch.device):
        return torch.device("npu", value.index) if value.type == "cuda" else value
    if isinstance(value, dict):
        return {to_npu_device(k): to_npu_device(v) for k, v in value.items()}
    if replace_int and isinstance(value, int) and not isinstance(value, bool):
        return f"npu:{value}"
    return value


def _translate_call(args, kwargs, replace_int_positional: bool):
    args = tuple(to_npu_device(a, replace_int_positional) for a in args)
    for key in _DEVICE_KWARGS:
        if key in kwargs:
            kwargs[key] = to_npu_device(kwargs[key], replace_int=key == "device")
    if "device_ids" in kwargs and isinstance(kwargs["device_ids"], (list, tuple)):
        kwargs["device_ids"] = [to_npu_device(d) for d in kwargs["device_ids"]]
    return args, kwargs


def _wrap_device_args(fn, replace_int_positional: bool = False):
    if getattr(fn, "_npukit_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = _translate_call(args, kwargs, replace_int_positional)
        return fn(*args, **kwargs)

    wrapper._npukit_wrapped = True
    return wrapper


def _wrap_backend(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        def fix(value):
            if isinstance(value, str):
                return value.replace("nccl", "hccl").replace("cuda", "npu")
            return value

        args = tuple(fix(a) for a in args)
        if "backend" in kwargs:
            kwargs["backend"] = fix(kwargs["backend"])
        return fn(*args, **kwargs)

    return wrapper


def _cuda_capability_for_npu(device=None) -> tuple[int, int]:
    """torch.cuda.get_device_capability() under transfer_to_npu.

    torch_npu answers None (an NPU has no CUDA compute capability) unless
    TORCH_NPU_DEVICE_CAPABILITY is set, and PyTorch's own code (e.g. dist.broadcast on a tensor
    whose is_cuda is now True) indexes the answer. (0, 0) keeps such code working and makes
    `capability >= (8, 0)` checks take their conservative branch.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capability = torch.npu.get_device_capability(to_npu_device(device))
    return capability if capability is not None else (0, 0)


def apply() -> None:
    """Apply the patches once (importing torch_npu.contrib.transfer_to_npu calls this)."""
    global _applied
    if _applied:
        return
    import torch.cuda
    import torch.utils._device

    npu = torch.npu
    for name in npu.__all__:
        setattr(torch.cuda, name, getattr(npu, name))
    for name in ("is_available", "device_count", "current_device", "set_device", "synchronize",
                 "get_device_name", "get_device_properties", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda, name, _wrap_device_args(getattr(npu, name)))
    torch.cuda.get_device_capability = _cuda_capability_for_npu
    torch.cuda.amp.autocast = npu.amp.autocast
    torch.cuda.amp.GradScaler = npu.amp.GradScaler
    torch.cuda.amp.custom_fwd = npu.amp.custom_fwd
    torch.cuda.amp.custom_bwd = npu.amp.custom_bwd
    torch.cuda.DoubleTensor = npu.FloatTensor  # as torch_npu: fp64 is not supported on the device
    torch.cuda.default_generators = npu.default_generators

    for name in _TORCH_FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _wrap_device_args(getattr(torch, name)))
    for name in _TENSOR_METHODS:
        setattr(torch.Tensor, name, _wrap_device_args(getattr(torch.Tensor, name), replace_int_positional=name == "to"))
    for name in _MODULE_METHODS:
        setattr(torch.nn.Module, name, _wrap_device_args(getattr(torch.nn.Module, name),
                                                          replace_int_positional=True))
    torch.Tensor.cuda = torch.Tensor.npu
    torch.Tensor.is_cuda = torch.Tensor.is_npu
    torch.nn.Module.cuda = torch.nn.Module.npu
    torch.UntypedStorage.cuda = torch.UntypedStorage.npu

    autocast_cls = torch.amp.autocast_mode.autocast
    autocast_cls.__init__ = _wrap_device_args(autocast_cls.__init__, replace_int_positional=False)
    scaler_cls = torch.amp.GradScaler
    scaler_cls.__init__ = _wrap_device_args(scaler_cls.__init__)
    original_is_autocast_enabled = torch.is_autocast_enabled

    @functools.wraps(original_is_autocast_enabled)
    def is_autocast_enabled(device_type=None):
        return original_is_autocast_enabled("npu" if device_type in (None, "cuda") else device_type)

    torch.is_autocast_enabled = is_autocast_enabled
    torch.get_autocast_gpu_dtype = npu.get_autocast_dtype
    torch.set_autocast_gpu_dtype = npu.set_autocast_dtype
    torch.amp.custom_fwd = _wrap_device_args(torch.amp.custom_fwd)
    torch.amp.custom_bwd = _wrap_device_args(torch.amp.custom_bwd)

    device_context = torch.utils._device.DeviceContext
    device_context.__init__ = _wrap_device_args(device_context.__init__, replace_int_positional=False)

    generator_cls = torch.Generator

    class _GeneratorMeta(type(generator_cls)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, generator_cls)

    def _generator(device="cpu"):
        return generator_cls(device=to_npu_device(device))

    torch.Generator = _GeneratorMeta("Generator", (), {"__new__": lambda cls, device="cpu": _generator(device)})

    import torch.distributed as dist

    if dist.is_available():
        dist.init_process_group = _wrap_backend(_wrap_device_args(dist.init_process_group))
        dist.new_group = _wrap_backend(dist.new_group)
        dist.is_nccl_available = getattr(dist, "is_hccl_available", lambda: True)
        ddp = torch.nn.parallel.DistributedDataParallel
        ddp.__init__ = _wrap_device_args(ddp.__init__)
    _applied = True
