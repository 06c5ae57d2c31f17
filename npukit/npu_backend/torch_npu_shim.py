"""A `torch_npu` module backed by the emulated device, so migrated code runs unmodified.

`install_torch_npu()` puts `torch_npu`, `torch_npu.npu` (= torch.npu), `torch_npu.npu.utils`,
`torch_npu.npu.amp`, `torch_npu.contrib.transfer_to_npu` and `torch_npu.profiler` in
sys.modules. Importing `torch_npu.contrib.transfer_to_npu` applies the transfer patches, as the
real one does. torch_npu's fused `npu_*` ops are the emulator's (`npukit.npu_backend.fused`): each
is `torch.ops.npu.<name>`; an op of the wheel's docs not emulated raises one clear error naming it.
Every module has a `__spec__`, as an imported package does: `importlib.util.find_spec("torch_npu")`
(transformers, accelerate, deepspeed detect the NPU with it) raises ValueError on a module without.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

import npukit.npu_backend  # (installs the device)

# Python submodules of torch_npu that fused families provide: torch_npu name -> npukit module
# (imported at install when present).
SUBMODULES = {
    "torch_npu.optim": "npukit.npu_backend.fused.optim",
    "torch_npu.contrib.module": "npukit.npu_backend.fused.contrib_module",
    "torch_npu.contrib.function": "npukit.npu_backend.fused.contrib_function",
}


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


def _module(name: str, doc: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__file__ = __file__
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=__file__, is_package=package)
    module.__spec__.has_location = True
    if package:
        module.__path__ = []  # so `import torch_npu.x` works
        module.__spec__.submodule_search_locations = []
    sys.modules[name] = module
    return module


def _alias(name: str, module: types.ModuleType) -> None:
    """`name` in sys.modules is the existing `module` (torch_npu.npu is torch.npu), with a spec
    whose name is the module's own, as importlib gives a module imported under another name."""
    if getattr(module, "__spec__", None) is None:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, origin=getattr(module, "__file__", None))
    sys.modules[name] = module


def _install_fused_ops(root: types.ModuleType) -> None:
    from npukit.npu_backend import fused
    from npukit.npu_backend.fused.wheel_ops import WHEEL_DOCUMENTED_OPS, what_to_run_instead

    # Every op of torch.ops.npu is an attribute of torch_npu, its grad ops too (the wheel's
    # _export_ops: `for name in dir(torch.ops.npu): globals_dict[name] = ...`): code written for
    # Ascend calls torch_npu.npu_rms_norm_backward ... in its own autograd.Functions.
    for name in fused.load():
        packet = name.partition(".")[0]  # an overload ("npu_apply_adam.out") is its op's
        setattr(root, packet, getattr(torch.ops.npu, packet))
    for family in fused.FAMILIES:  # plain Python attributes a family adds (torch_npu.get_npu_format ...)
        module = sys.modules.get(f"{fused.__name__}.{family}")
        for name, value in getattr(module, "TORCH_NPU_ATTRIBUTES", {}).items():
            setattr(root, name, value)
    for name in WHEEL_DOCUMENTED_OPS:
        if not hasattr(root, name):
            setattr(root, name, fused.missing_op(name, what_to_run_instead(name)))
    for public, implementation in SUBMODULES.items():
        if importlib.util.find_spec(implementation) is None:
            continue
        module = importlib.import_module(implementation)
        _alias(public, module)
        parent, _, child = public.rpartition(".")
        setattr(sys.modules[parent], child, module)
        # names the real package re-exports from this submodule (torch_npu.contrib.ROIAlign ...)
        for name in getattr(module, "PARENT_EXPORTS", ()):
            setattr(sys.modules[parent], name, getattr(module, name))
        # the wheel's modules inside this package (torch_npu.optim.npu_fused_adamw ...)
        for child_name, names in getattr(module, "WHEEL_SUBMODULES", {}).items():
            submodule = _module(f"{public}.{child_name}", f"{public}.{child_name} (emulated)")
            for name in names:
                setattr(submodule, name, getattr(module, name))
            if not hasattr(module, child_name):  # a function named as its file (roll) stays the attribute, as in the wheel
                setattr(module, child_name, submodule)


def install_torch_npu() -> types.ModuleType:
    """Register the emulated `torch_npu` package in sys.modules (idempotent)."""
    existing = sys.modules.get("torch_npu")
    if existing is not None and getattr(existing, "__npukit__", False):
        return existing
    npu = torch.npu
    root = _module("torch_npu", "torch_npu, emulated by npukit (no Ascend hardware needed)", package=True)
    root.__npukit__ = True
    root.__version__ = torch.__version__.split("+")[0] + "+npukit"
    root.npu = npu
    _alias("torch_npu.npu", npu)
    for sub in npu.SUBMODULES:
        _alias(f"torch_npu.npu.{sub}", getattr(npu, sub))

    contrib = _module("torch_npu.contrib", "torch_npu.contrib (emulated)", package=True)
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
    _install_fused_ops(root)
    # CANN's set_env.sh exports ASCEND_HOME_PATH wherever torch_npu imports; tools read it without a
    # default (DeepSpeed's NPU op builders: KeyError in deepspeed.init_distributed). The emulator is
    # the toolkit here: the path is npukit's device package, where no CANN version is installed, so
    # such tools find no CANN to compile kernels against, as is the case.
    os.environ.setdefault("ASCEND_HOME_PATH", os.path.dirname(os.path.abspath(npukit.npu_backend.__file__)))
    return root
