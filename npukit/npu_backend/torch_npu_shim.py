"""A `torch_npu` module backed by the emulated device, so migrated code runs unmodified.

`install_torch_npu()` puts `torch_npu`, `torch_npu.npu` (= torch.npu), `torch_npu.npu.utils`,
`torch_npu.npu.amp`, `torch_npu.contrib.transfer_to_npu` and `torch_npu.profiler` in
sys.modules. Importing `torch_npu.contrib.transfer_to_npu` applies the transfer patches, as the
real one does. torch_npu's fused `npu_*` ops need the real device and raise NotImplementedError.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch

import npukit.npu_backend  # noqa: F401  (installs the device)

# The migration-relevant fused ops of torch_npu (shared/reference/torch_npu_api.md).
FUSED_OPS = (
    "npu_fusion_attention", "npu_fused_infer_attention_score", "npu_prompt_flash_attention",
    "npu_incre_flash_attention", "npu_rms_norm", "npu_rotary_mul", "npu_apply_rotary_pos_emb",
    "npu_swiglu", "npu_geglu", "npu_grouped_matmul", "npu_quant_matmul", "npu_weight_quant_batchmatmul",
    "npu_dropout_with_add_softmax", "npu_scaled_masked_softmax", "npu_roi_align", "npu_format_cast",
    "npu_confusion_transpose", "npu_bmmV2", "npu_layer_norm_eval", "npu_silu",
)


def _fused_op(name: str):
    def raiser(*args, **kwargs):
        raise NotImplementedError(
            f"torch_npu.{name} is a fused Ascend kernel that the npukit emulator does not provide; "
            "use the equivalent PyTorch ops when running on the emulator")

    raiser.__name__ = name
    return raiser


class _TransferFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import torch_npu.contrib.transfer_to_npu` apply the patches on first import."""

    name = "torch_npu.contrib.transfer_to_npu"

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from npukit.npu_backend import transfer

        transfer.apply()
        module.__doc__ = transfer.__doc__
        module.to_npu_device = transfer.to_npu_device


def _module(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__file__ = __file__
    sys.modules[name] = module
    return module


def install_torch_npu() -> types.ModuleType:
    """Register the emulated `torch_npu` package in sys.modules (idempotent)."""
    existing = sys.modules.get("torch_npu")
    if existing is not None and getattr(existing, "__npukit__", False):
        return existing
    npu = torch.npu
    root = _module("torch_npu", "torch_npu, emulated by npukit (no Ascend hardware needed)")
    root.__npukit__ = True
    root.__version__ = torch.__version__.split("+")[0] + "+npukit"
    root.__path__ = []  # a package, so `import torch_npu.x` works
    root.npu = npu
    sys.modules["torch_npu.npu"] = npu
    for sub in npu.SUBMODULES:
        sys.modules[f"torch_npu.npu.{sub}"] = getattr(npu, sub)
    for name in FUSED_OPS:
        setattr(root, name, _fused_op(name))

    contrib = _module("torch_npu.contrib", "torch_npu.contrib (emulated)")
    contrib.__path__ = []
    root.contrib = contrib
    if not any(isinstance(finder, _TransferFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TransferFinder())

    profiler = _module("torch_npu.profiler", "torch_npu.profiler: torch.profiler on the emulated device")
    for name in ("profile", "schedule", "tensorboard_trace_handler", "ProfilerAction", "record_function"):
        setattr(profiler, name, getattr(torch.profiler, name))
    # Device work of the emulator runs on the host timeline, so NPU activity is CPU activity.
    profiler.ProfilerActivity = types.SimpleNamespace(CPU=torch.profiler.ProfilerActivity.CPU,
                                                      NPU=torch.profiler.ProfilerActivity.CPU)
    root.profiler = profiler
    return root
