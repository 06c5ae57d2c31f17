"""torch_npu's fused ops (`torch_npu.npu_*`) on the emulated NPU.

Each op is a `torch.library` op in the `npu` namespace with the schema of the real torch_npu 2.13
wheel, so `torch.ops.npu.X` and `torch_npu.X` are the same op, a dump names it `NPU.X` (as msprobe
names torch_npu's ops) and torch.compile sees its fake (meta) kernel. One module per family
(`FAMILIES`) defines its ops with
`fused_op`; semantics come from torch_npu's own op docs (`_op_plugin_docs.py` in the wheel).

One Python kernel serves both devices and decides the numerics from where it runs:
- on an npu tensor with the device's numerics on, it computes the reference decomposition the way
  the fused kernel does (`npu_numerics(x)` is true): low-precision inputs are computed in fp32 and
  rounded where the kernel rounds (its documented output dtype, and intermediates the kernel keeps
  in the input dtype), through the device's own ops, so fp16 saturation and HF32 apply;
- on a CPU tensor, or in a golden run (`npu-run --golden`: every policy off), it is the golden
  reference: the same decomposition in fp32 with no intermediate rounding.

Backward is registered with `torch.library.register_autograd` and calls the op's grad op where
torch_npu defines one (`npu_rms_norm_backward` ...), so the grad op is an op of its own too. An op
torch_npu defines no backward for raises when backpropagated through, as on the device
(`register_no_derivative`).

An op of the wheel's docs that is not emulated is still an attribute of `torch_npu` and raises one
`NotImplementedError` naming it and its unfused equivalent (`missing_op`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from npukit.npu_backend import _C

NAMESPACE = "npu"
# The families, in the order their modules are imported (each defines its ops at import).
FAMILIES = ("norms", "activations", "rotary", "softmax", "layout", "attention", "matmul", "moe", "quant", "optim",
            "status")

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # noqa: TOR901 (ops live as long as the process)


@dataclass(frozen=True)
class FusedOp:
    name: str          # torch_npu's name: torch_npu.<name>, torch.ops.npu.<name>
    family: str        # the module under npukit/npu_backend/fused that defines it
    unfused: str       # the PyTorch ops it stands for, as a user would write them
    public: bool       # an op users call (grad ops are torch_npu attributes too, as in the wheel, but called by backward)

    @property
    def packet(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.npu, self.name)


REGISTRY: dict[str, FusedOp] = {}
# Each op's kernel for the npu and CPU keys (one function for both), by op name ("op" or "op.overload").
BACKEND_KERNELS: dict[str, Callable] = {}


def fused_op(schema: str, *, unfused: str, fake: Callable | bool = True, public: bool = True,
             family: str | None = None, tags: tuple[torch.Tag, ...] = ()) -> Callable:
    """Define `npu::<schema>` and register the decorated function as its kernel for npu and CPU.

    `fake`: True when the kernel itself runs on fake tensors (no data-dependent shapes, no
    `.item()`), a function for the fake kernel otherwise, False for none (the op then cannot be
    traced by torch.compile; say why where it is defined).
    `tags`: the op's torch.Tag's; an in-place op (`x_(Tensor(a!) self) -> Tensor(a!)`) needs
    torch.Tag.inplace for torch.compile to functionalize it.
    """
    name = schema.split("(", 1)[0]

    def register(kernel: Callable) -> Callable:
        if name in REGISTRY:
            raise RuntimeError(f"npu::{name} is defined twice")
        _LIBRARY.define(schema, tags=tags)
        qualified = f"{NAMESPACE}::{name}"
        for key in ("PrivateUse1", "CPU"):
            _LIBRARY.impl(name, kernel, key)
        if fake is True:
            torch.library.register_fake(qualified, kernel, lib=_LIBRARY)
        elif fake:
            torch.library.register_fake(qualified, fake, lib=_LIBRARY)
        REGISTRY[name] = FusedOp(name, family or kernel.__module__.rsplit(".", 1)[-1], unfused, public)
        BACKEND_KERNELS[name] = kernel
        return kernel

    return register


def register_autograd(name: str, backward: Callable, setup_context: Callable) -> None:
    torch.library.register_autograd(f"{NAMESPACE}::{name}", unwatched_backward(backward),
                                    setup_context=setup_context, lib=_LIBRARY)


def unwatched_backward(backward: Callable) -> Callable:
    """A fused op's backward as torch-function watchers (the dump, the overflow detector, a user's
    mode) see it on Ascend: one kernel its libtorch_npu autograd node calls below Python, not the
    torch ops (or the npu::*_backward op) this emulation computes it with, as for its forward.
    The watchers do see a backward Python code calls itself (a custom autograd Function's)."""

    def run(ctx, *grads):
        with torch._C.DisableTorchFunction():
            return backward(ctx, *grads)

    run.__name__ = run.__qualname__ = getattr(backward, "__name__", "backward")
    return run


# Ops torch_npu gives no backward (`register_no_derivative`).
NO_DERIVATIVE: set[str] = set()


def register_no_derivative(name: str, kernel: Callable | None = None) -> None:
    """Backward of an op torch_npu gives no autograd formula (its libtorch_npu has no
    Npu<Op>Backward0): the real op's grad_fn raises "the derivative ... is not implemented" when
    backpropagated through, so the emulator raises too instead of differentiating its Python
    decomposition (which would train here and fail on the device).

    `kernel`: the op's npu/CPU kernel when `fused_op` did not register it (an overload)."""

    packet_name, _, overload = name.partition(".")  # an overload ("op.List") is named by its op
    message = (f"the derivative for torch_npu.{packet_name} is not implemented: torch_npu defines no backward for it "
               f"(on Ascend the backward pass fails the same way); call it under torch.no_grad() or use its "
               f"unfused PyTorch equivalent where gradients are needed")

    def setup(ctx, inputs, output, keyword_only_inputs=None):  # (ops with keyword-only arguments get those too)
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(message)

    op = getattr(getattr(torch.ops.npu, packet_name), overload or "default")
    if torch._library.utils.has_kwarg_only_tensors(op._schema):
        # torch.library.register_autograd refuses keyword-only tensors: the same, by hand
        _LIBRARY.impl(name, _raising_autograd_kernel(op, message, kernel or BACKEND_KERNELS.get(name)), "Autograd",
                      with_keyset=True)
    else:
        register_autograd(name, backward, setup)
    NO_DERIVATIVE.add(name)


class _NoDerivative(torch.autograd.Function):
    """Outputs computed below autograd, tied to the inputs that require grad by a node whose
    backward raises."""

    @staticmethod
    def forward(ctx, message, outputs, *inputs):
        ctx.message = message
        ctx.mark_non_differentiable(*[out for out in outputs if not out.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


# The keys below autograd that a call to an op with no derivative may pass through on its way to the
# op's own npu/CPU kernel (BACKEND_KERNELS) and still have it called directly.
_BELOW_AUTOGRAD = torch._C._after_autograd_keyset.remove(torch._C.DispatchKey.ADInplaceOrView)
_BACKEND_KEYS = (torch._C.DispatchKey.PrivateUse1, torch._C.DispatchKey.CPU)
_reaches_backend_directly: dict[int, bool] = {}  # by the call's dispatch key set (its raw bits)
_Tensor = torch.Tensor


def _calls_backend_directly(keyset: torch._C.DispatchKeySet) -> bool:
    """Nothing sits between autograd and the npu/CPU kernel in this call: no dispatch mode, tensor
    subclass, functionalization or tracing (each adds its key) and no meta tensor."""
    bits = keyset.raw_repr()
    direct = _reaches_backend_directly.get(bits)
    if direct is None:
        direct = _reaches_backend_directly[bits] = (keyset & _BELOW_AUTOGRAD).highestPriorityTypeId() in _BACKEND_KEYS
    return direct


def _inputs_requiring_grad(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments that require grad (a schema's arguments nest one level at most: Tensor[])."""
    inputs = []
    for values in (args, kwargs.values()):
        for value in values:
            if value is None:  # most optional arguments: skipped first, this runs on every call
                continue
            if isinstance(value, _Tensor):
                if value.requires_grad:
                    inputs.append(value)
            elif isinstance(value, (list, tuple)):
                for leaf in value:
                    if isinstance(leaf, _Tensor) and leaf.requires_grad:
                        inputs.append(leaf)
    return inputs


def _raising_autograd_kernel(op: torch._ops.OpOverload, message: str, backend_kernel: Callable | None) -> Callable:
    def kernel(keyset, *args, **kwargs):
        inputs = _inputs_requiring_grad(args, kwargs) if torch.is_grad_enabled() else ()
        if backend_kernel is not None and _calls_backend_directly(keyset):
            # the npu/CPU kernel is called here, as the dispatcher would call it, without a second trip
            # through the dispatcher (each converts all the schema's arguments); with no input to track
            # there is no autograd history to keep out of it either
            if not inputs:
                return backend_kernel(*args, **kwargs)
            with torch._C._AutoDispatchBelowAutograd():
                outputs = backend_kernel(*args, **kwargs)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                outputs = op(*args, **kwargs)
        if not inputs:
            return outputs
        single = isinstance(outputs, torch.Tensor)
        tracked = _NoDerivative.apply(message, (outputs,) if single else tuple(outputs), *inputs)
        if single:
            return tracked[0]
        return list(tracked) if isinstance(outputs, list) else tuple(tracked)

    return kernel


# ---- numerics ------------------------------------------------------------------------------------

LOW_PRECISION = (torch.float16, torch.bfloat16)
KERNEL_FLOATS = (*LOW_PRECISION, torch.float32)


def allowed_floats(tensor: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The float dtypes a matrix kernel's argument may have: the kernel's on npu; also float64 on the
    CPU, the pre-check's float64 reference run."""
    return KERNEL_FLOATS if tensor.device.type == "npu" else (*KERNEL_FLOATS, torch.float64)


def npu_numerics(tensor: torch.Tensor) -> bool:
    """Does this kernel call compute with the NPU's numerics (rather than as the golden reference)?

    True on an npu tensor unless the device's policies are off (a golden run, `numerics.golden()`).
    """
    if tensor.device.type != "npu":
        return False
    return bool(_C.get_fp32_accumulate() or _C.get_saturation())


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a fused kernel computes in: fp32 for fp16/bf16/fp32 inputs (its vector units and cube
    accumulators are fp32), the dtype itself otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def upcast(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor in the kernel's compute dtype (no copy when it is already)."""
    if tensor is None:
        return None
    return tensor.to(compute_dtype(tensor.dtype))


def round_intermediate(tensor: torch.Tensor, dtype: torch.dtype, npu: bool) -> torch.Tensor:
    """An intermediate the fused kernel keeps in `dtype` (e.g. the attention probabilities it feeds
    its second matmul in the input dtype): rounded with the NPU's numerics, kept exact in the golden
    reference."""
    if npu and dtype in LOW_PRECISION and tensor.dtype != dtype:
        return tensor.to(dtype).to(tensor.dtype)
    return tensor


def cube_matmul(a: torch.Tensor, b: torch.Tensor, in_dtype: torch.dtype, npu: bool) -> torch.Tensor:
    """A cube-unit matmul of the fused kernel: inputs in `in_dtype` (fp16/bf16 inputs as the kernel
    reads them), accumulated in fp32, the result in fp32. On the NPU the device's own matmul runs
    (fp32 accumulation, HF32 when allowed); the golden reference multiplies the fp32 values."""
    if npu and in_dtype in LOW_PRECISION:
        return torch.matmul(a.to(in_dtype), b.to(in_dtype)).float()
    return torch.matmul(a, b)


# ---- missing ops ---------------------------------------------------------------------------------

def missing_op(name: str, instead: str) -> Callable:
    """torch_npu.<name> for an op of the wheel that the emulator does not provide; `instead` is the
    sentence saying what to run in its place (wheel_ops.what_to_run_instead)."""

    def raiser(*args, **kwargs):
        raise NotImplementedError(
            f"torch_npu.{name} is a fused Ascend kernel that the npukit emulator does not provide yet; "
            f"on the emulator {instead} (docs/fused-ops.md lists every op and its state)")

    raiser.__name__ = name
    raiser.__qualname__ = name
    raiser.npukit_missing = True
    return raiser


_loaded = False


def load() -> dict[str, FusedOp]:
    """Import every family module (idempotent): their ops are then in torch.ops.npu."""
    global _loaded
    if not _loaded:
        _loaded = True
        for family in FAMILIES:
            if importlib.util.find_spec(f"{__name__}.{family}") is not None:
                importlib.import_module(f"{__name__}.{family}")
    return REGISTRY


def public_ops() -> Iterator[FusedOp]:
    return (op for op in load().values() if op.public)
