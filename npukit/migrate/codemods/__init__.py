"""npu-migrate's Python rewrite as libcst codemods, for libcst's codemod tool too.

One built-in concern, on its own:

    python -m libcst.tool codemod --no-format npukit.migrate.codemods.CudaEnvironment path/

The whole built-in set (the order npu-migrate uses), next to codemods of your own:

    python -m libcst.tool codemod --no-format -x npukit.migrate.codemods.MigrateToNpu path/
    python -m libcst.tool codemod --no-format -x npukit.migrate.codemods.MigrateToNpu --fused path/   # npu-migrate --fused

What a codemod does not migrate is printed as the tool's warnings, `line:col: severity kind: reason`.
npu-migrate itself adds the tree-wide facts, the other file kinds and the reports (docs/migrate.md).
"""

from __future__ import annotations

import argparse

import libcst as cst
from libcst.codemod import CodemodCommand, CodemodContext

from npukit.migrate.codemods.amp_upgrade import AmpUpgrade
from npukit.migrate.codemods.apex_fused import ApexAdamToTorch, ApexNormsToTorch, ApexSgdToTorch
from npukit.migrate.codemods.apex_multi_tensor import ApexMultiTensorToTorch
from npukit.migrate.codemods.autocast_dtype import AutocastGpuDtype
from npukit.migrate.codemods.backends import DistributedBackends
from npukit.migrate.codemods.bf16_autocast import Bf16Autocast
from npukit.migrate.codemods.cli_flags import CudaCliFlags
from npukit.migrate.codemods.compile_modes import CompileModes
from npukit.migrate.codemods.cuda_methods import CudaMethods
from npukit.migrate.codemods.cuda_namespace import CudaNamespace
from npukit.migrate.codemods.custom_ops import CustomCudaOps
from npukit.migrate.codemods.ddp_set_device import DdpSetDevice
from npukit.migrate.codemods.default_devices import CudaDefaultDevices
from npukit.migrate.codemods.default_tensor_type import DefaultTensorType
from npukit.migrate.codemods.device_model import DeviceModelChecks
from npukit.migrate.codemods.device_strings import DeviceStrings
from npukit.migrate.codemods.dual_target import DualTargetCode
from npukit.migrate.codemods.environment import CudaEnvironment
from npukit.migrate.codemods.flash_attention import FlashAttentionToNpu, FlashRotaryToNpu
from npukit.migrate.codemods.flash_attn_layers import FlashLayersToTorch, FlashNormFunctionsToNpu
from npukit.migrate.codemods.fused import FusedImports
from npukit.migrate.codemods.fused_checks import FusedInstallChecks
from npukit.migrate.codemods.infinite_fills import InfiniteFills
from npukit.migrate.codemods.int_ordinals import IntDeviceOrdinals
from npukit.migrate.codemods.leftovers import CudaLeftovers
from npukit.migrate.codemods.lightning import LightningAccelerators
from npukit.migrate.codemods.quantisation import BitsAndBytesQuantisation
from npukit.migrate.codemods.third_party import ThirdPartyCuda
from npukit.migrate.codemods.torch_load import TorchLoadMapLocation
from npukit.migrate.codemods.unsupported_apis import UnsupportedApis
from npukit.migrate.codemods.unsupported_methods import UnsupportedTensorMethods
from npukit.migrate.codemods.xformers_attention import XformersAttentionToNpu

# npu-migrate --fused's concerns (CUDA kernel libraries -> torch_npu fused ops / torch equivalents):
# only under --fused (TreeFacts.fused), or when libcst's tool is asked for one by name
FUSED_CODEMODS = (FlashAttentionToNpu, FlashRotaryToNpu, XformersAttentionToNpu, ApexNormsToTorch, ApexAdamToTorch, ApexSgdToTorch,
                  ApexMultiTensorToTorch, FlashNormFunctionsToNpu, FlashLayersToTorch, FusedImports,
                  FusedInstallChecks)
# The concerns ported from the ast engine so far, in the order they run (each on the original parse).
BUILTIN_CODEMODS = (DualTargetCode, *FUSED_CODEMODS, LightningAccelerators, DeviceStrings, IntDeviceOrdinals, AmpUpgrade, CudaNamespace, UnsupportedApis, CudaEnvironment, CudaDefaultDevices, InfiniteFills, TorchLoadMapLocation, CustomCudaOps,
                    Bf16Autocast, DdpSetDevice, ThirdPartyCuda, BitsAndBytesQuantisation, DeviceModelChecks,
                    DefaultTensorType, CompileModes, UnsupportedTensorMethods, AutocastGpuDtype, CudaMethods,
                    DistributedBackends, CudaCliFlags, CudaLeftovers)

__all__ = ["BUILTIN_CODEMODS", "FUSED_CODEMODS", "AmpUpgrade", "ApexAdamToTorch", "ApexMultiTensorToTorch", "ApexNormsToTorch", "ApexSgdToTorch", "FlashAttentionToNpu", "FlashLayersToTorch", "FlashNormFunctionsToNpu", "FlashRotaryToNpu", "FusedImports", "FusedInstallChecks", "AutocastGpuDtype", "Bf16Autocast", "BitsAndBytesQuantisation", "CompileModes", "CudaCliFlags", "CudaDefaultDevices", "CudaEnvironment", "CudaLeftovers",
           "CudaMethods", "CudaNamespace", "CustomCudaOps", "DdpSetDevice", "DefaultTensorType", "DeviceModelChecks", "DeviceStrings", "DistributedBackends", "DualTargetCode",
           "InfiniteFills", "IntDeviceOrdinals", "LightningAccelerators", "MigrateToNpu", "ThirdPartyCuda", "TorchLoadMapLocation", "UnsupportedApis", "UnsupportedTensorMethods", "XformersAttentionToNpu"]


class MigrateToNpu(CodemodCommand):
    DESCRIPTION = "CUDA -> torch_npu: npu-migrate's built-in rules on one Python file (--fused: npu-migrate --fused's)"

    def __init__(self, context: CodemodContext, fused: bool = False) -> None:
        super().__init__(context)
        self.fused = fused

    @staticmethod
    def add_args(arg_parser: argparse.ArgumentParser) -> None:
        arg_parser.add_argument("--fused", action="store_true", default=False,
                                help="also rewrite flash_attn / apex calls, as npu-migrate --fused does")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        from npukit.migrate.model import TreeFacts
        from npukit.migrate.pysource import migrate_python

        code = tree.code
        outcome = migrate_python(code, self.context.filename or "<module>", facts=TreeFacts(fused=self.fused))
        for finding in outcome.findings:
            self.warn(f"{finding.line}:{finding.col}: {finding.severity} {finding.kind}: {finding.reason}"
                      f" ({finding.suggestion})")
        return tree if outcome.text == code else cst.parse_module(outcome.text)
