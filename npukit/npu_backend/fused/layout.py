"""Layout: npu_format_cast (+ npu_format_cast_), torch_npu.get_npu_format, npu_confusion_transpose
(+ its backward), npu_transpose and npu_broadcast.

The emulated NPU keeps every tensor in plain row-major memory: a format cast moves no data into
another layout, but the tensor reports the format it was cast to, as on the device
(`torch_npu.get_npu_format`). The format belongs to the memory (a storage), so it survives what users
do with the cast tensor: views of it, `param.data = torch_npu.npu_format_cast(param.data, 29)`
(the parameter then shares the cast storage), passing it around. An untagged tensor reports its
natural format: NCHW for 4 dims, NCDHW for 5, ND otherwise (torch_npu's base formats).
"""

from __future__ import annotations

import weakref

import torch

from npukit.npu_backend.fused import _LIBRARY, NAMESPACE, fused_op, register_autograd, register_no_derivative

# torch_npu's aclFormat values (torch_npu.npu.Format).
ACL_FORMATS = {
    -1: "UNDEFINED", 0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 12: "NC1HWC0_C04",
    16: "HWCN", 27: "NDHWC", 29: "FRACTAL_NZ", 30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D", 35: "NC",
    47: "NCL", 50: "FRACTAL_NZ_C0_16", 51: "FRACTAL_NZ_C0_32", 52: "FRACTAL_NZ_C0_2", 53: "FRACTAL_NZ_C0_4",
    54: "FRACTAL_NZ_C0_8",
}
ACL_FORMAT_NCHW, ACL_FORMAT_ND, ACL_FORMAT_NCDHW = 0, 2, 30

# Storage (its StorageImpl address) -> the format cast to. An entry leaves with its storage: torch
# keeps one Python object per live storage, and a finalizer on it drops the entry when the memory is
# freed (so a later allocation at the same address starts untagged).
_STORAGE_FORMATS: dict[int, int] = {}


def natural_format(tensor: torch.Tensor) -> int:
    return {4: ACL_FORMAT_NCHW, 5: ACL_FORMAT_NCDHW}.get(tensor.dim(), ACL_FORMAT_ND)


def _storage(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers ...)
        return None


def get_npu_format(tensor: torch.Tensor) -> int:
    """torch_npu.get_npu_format: the aclFormat the tensor was cast to, or its natural format."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_npu.get_npu_format expects a tensor, got {type(tensor).__name__}")
    storage = _storage(tensor)
    if storage is not None:
        tagged = _STORAGE_FORMATS.get(storage._cdata)
        if tagged is not None:
            return tagged
    return natural_format(tensor)


def _tag(tensor: torch.Tensor, acl_format: int) -> None:
    storage = _storage(tensor)
    if storage is None:
        return
    key = storage._cdata
    if acl_format == natural_format(tensor):
        _STORAGE_FORMATS.pop(key, None)
        return
    if key not in _STORAGE_FORMATS:
        weakref.finalize(storage, _STORAGE_FORMATS.pop, key, None)
    _STORAGE_FORMATS[key] = acl_format


def _check_format(op: str, acl_format: int) -> int:
    if acl_format not in ACL_FORMATS or acl_format < 0:
        known = ", ".join(f"{name}={value}" for value, name in ACL_FORMATS.items() if value >= 0)
        raise ValueError(f"torch_npu.{op}: unknown acl_format {acl_format} (aclFormat values: {known})")
    return acl_format


def _format_cast_fake(x, acl_format, *, customize_dtype=None, input_dtype=None):
    _check_format("npu_format_cast", acl_format)
    return torch.empty_like(x)


@fused_op("npu_format_cast(Tensor input, int acl_format, *, int? customize_dtype=None, int? input_dtype=None) "
          "-> Tensor",
          unfused="the tensor itself (formats are the device's internal memory layouts)", fake=_format_cast_fake)
def npu_format_cast(x, acl_format, *, customize_dtype=None, input_dtype=None):
    _check_format("npu_format_cast", acl_format)
    # The device copies the data into the new layout, so the result is new memory and the input keeps
    # its format; on the emulator the copy keeps the row-major data and carries the tag.
    result = x.clone(memory_format=torch.contiguous_format)
    _tag(result, acl_format)
    return result


def _format_cast_setup(ctx, inputs, keyword_only_inputs, output):
    pass


def _format_cast_backward(ctx, grad):
    # The cast moves no values: the gradient passes through (torch_npu's NpuFormatCastBackward0).
    return grad, None


register_autograd("npu_format_cast", _format_cast_backward, _format_cast_setup)


def _format_cast_in_place(x, acl_format):
    _tag(x, _check_format("npu_format_cast_", acl_format))
    return x


@fused_op("npu_format_cast_(Tensor(a!) input, Tensor src, *, int? customize_dtype=None, int? input_dtype=None) "
          "-> Tensor(a!)",
          unfused="the tensor itself (formats are the device's internal memory layouts)", tags=(torch.Tag.inplace,))
def npu_format_cast_(x, src, *, customize_dtype=None, input_dtype=None):
    """Casts x in place to src's format (the .acl_format overload takes the format itself)."""
    return _format_cast_in_place(x, get_npu_format(src))


def _define_overload(schema: str, kernel, tags: tuple[torch.Tag, ...] = ()) -> None:
    """An overload of an op fused_op defined (the op's registry entry covers its packet)."""
    _LIBRARY.define(schema, tags=tags)
    name = schema.split("(", 1)[0]
    for key in ("PrivateUse1", "CPU"):
        _LIBRARY.impl(name, kernel, key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", kernel, lib=_LIBRARY)


def _format_cast_acl_format_(x, acl_format, *, customize_dtype=None, input_dtype=None):
    return _format_cast_in_place(x, acl_format)


_define_overload("npu_format_cast_.acl_format(Tensor(a!) input, int acl_format, *, int? customize_dtype=None, "
                 "int? input_dtype=None) -> Tensor(a!)", _format_cast_acl_format_, tags=(torch.Tag.inplace,))


# ---- transposes and broadcast --------------------------------------------------------------------

def _check_perm(op: str, x: torch.Tensor, perm) -> list[int]:
    perm = list(perm)
    if sorted(p % x.dim() if x.dim() else p for p in perm) != list(range(x.dim())):
        raise ValueError(f"torch_npu.{op}: perm {perm} is not a permutation of the input's {x.dim()} dims")
    return perm


def _check_numel(op: str, shape, numel: int) -> list[int]:
    shape = list(shape)
    count = 1
    for size in shape:
        count *= size
    if count != numel:
        raise ValueError(f"torch_npu.{op}: shape {shape} holds {count} elements, the input has {numel}")
    return shape


@fused_op("npu_confusion_transpose(Tensor input, int[] perm, int[] shape, bool transpose_first) -> Tensor",
          unfused="x.permute(perm).reshape(shape) (transpose_first) or x.reshape(shape).permute(perm)")
def npu_confusion_transpose(x, perm, shape, transpose_first):
    op = "npu_confusion_transpose"
    shape = _check_numel(op, shape, x.numel())
    if transpose_first:
        return x.permute(_check_perm(op, x, perm)).reshape(shape).contiguous()
    if sorted(perm) != list(range(len(shape))):
        raise ValueError(f"torch_npu.{op}: perm {list(perm)} is not a permutation of shape {shape}'s dims")
    return x.reshape(shape).permute(list(perm)).contiguous()


@fused_op("npu_confusion_transpose_backward(Tensor grad, int[] perm, SymInt[] shape, bool transpose_first) -> Tensor",
          unfused="autograd of npu_confusion_transpose", public=False)
def npu_confusion_transpose_backward(grad, perm, shape, transpose_first):
    """The inverse of a confusion transpose: `shape` is the forward input's shape, `perm` the forward's
    permutation and `transpose_first` the order of this op (the forward's, negated): True permutes the
    gradient back and reshapes it to `shape`; False reshapes it to the permuted `shape` first."""
    perm = list(perm)
    inverse = [0] * len(perm)
    for position, axis in enumerate(perm):
        inverse[axis] = position
    if transpose_first:
        return grad.permute(inverse).reshape(list(shape)).contiguous()
    return grad.reshape([shape[axis] for axis in perm]).permute(inverse).contiguous()


def _confusion_transpose_setup(ctx, inputs, output):
    x, perm, _, transpose_first = inputs
    ctx.perm, ctx.input_shape, ctx.transpose_first = list(perm), list(x.shape), transpose_first


def _confusion_transpose_backward(ctx, grad):
    # The inverse runs the two steps in the other order.
    dx = torch.ops.npu.npu_confusion_transpose_backward(grad, ctx.perm, ctx.input_shape, not ctx.transpose_first)
    return dx, None, None, None


register_autograd("npu_confusion_transpose", _confusion_transpose_backward, _confusion_transpose_setup)


@fused_op("npu_transpose(Tensor input, int[] perm, bool require_contiguous=True) -> Tensor",
          unfused="x.permute(perm).contiguous()")
def npu_transpose(x, perm, require_contiguous=True):
    # require_contiguous=False only skips the device's copy of an input it knows to be contiguous or
    # transposed: the result is the same.
    return x.permute(_check_perm("npu_transpose", x, perm)).contiguous()


register_no_derivative("npu_transpose")


@fused_op("npu_broadcast(Tensor input, int[] size) -> Tensor", unfused="x.expand(size).contiguous()")
def npu_broadcast(x, size):
    size = list(size)
    try:
        return x.expand(size).contiguous()
    except RuntimeError as error:
        raise ValueError(f"torch_npu.npu_broadcast: cannot broadcast shape {tuple(x.shape)} to {size}: {error}") from None


register_no_derivative("npu_broadcast")


def _transpose_out(x, perm, require_contiguous=True, *, out):
    return out.copy_(npu_transpose(x, perm, require_contiguous))


def _broadcast_out(x, size, *, out):
    return out.copy_(npu_broadcast(x, size))


_define_overload("npu_transpose.out(Tensor input, int[] perm, bool require_contiguous=True, *, Tensor(a!) out) "
                 "-> Tensor(a!)", _transpose_out)
_define_overload("npu_broadcast.out(Tensor input, int[] size, *, Tensor(a!) out) -> Tensor(a!)", _broadcast_out)


# Plain attributes of torch_npu (the shim sets them).
TORCH_NPU_ATTRIBUTES = {"get_npu_format": get_npu_format}


def _install_tensor_methods() -> None:
    """torch_npu adds Tensor.npu_format_cast and Tensor.npu_format_cast_ (models call
    `weight.data.npu_format_cast(29)`); added only where torch has no such method."""
    if not hasattr(torch.Tensor, "npu_format_cast"):
        torch.Tensor.npu_format_cast = lambda self, acl_format: torch.ops.npu.npu_format_cast(self, acl_format)
    if not hasattr(torch.Tensor, "npu_format_cast_"):
        torch.Tensor.npu_format_cast_ = lambda self, src: torch.ops.npu.npu_format_cast_(self, src)


_install_tensor_methods()
