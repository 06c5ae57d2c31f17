"""Lightning's Fabric and Trainer, which have no NPU accelerator."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import string_value
from npukit.migrate.rules import Flag

LIGHTNING_ENTRIES = frozenset({
    "lightning.Fabric", "lightning.fabric.Fabric", "lightning.fabric.fabric.Fabric", "lightning_fabric.Fabric",
    "lightning.Trainer", "lightning.pytorch.Trainer", "lightning.pytorch.trainer.Trainer",
    "lightning.pytorch.trainer.trainer.Trainer", "pytorch_lightning.Trainer", "pytorch_lightning.trainer.Trainer",
    "pytorch_lightning.trainer.trainer.Trainer"})
# what Lightning would pick a CUDA GPU for; any other accelerator (an object, "cpu", "tpu") is the code's choice
_GPU_CHOICES = ("auto", "gpu", "cuda")
LIGHTNING_ACCELERATOR = Flag(
    "lightning-accelerator", "warning",
    "Lightning has no NPU accelerator: with accelerator 'auto' it finds no CUDA and trains on the CPU, "
    "'gpu'/'cuda' fail, and 'npu' is not a name it knows",
    "pass accelerator=NPUAccelerator(), a lightning Accelerator subclass for 'npu' (setup_device: "
    "torch.npu.set_device; get_parallel_devices: [torch.device('npu', i) ...]; auto_device_count/is_available: "
    "torch.npu), with strategy=SingleDeviceStrategy(device='npu:0') on one device (else Lightning puts it on "
    "the CPU) or DDPStrategy/FSDPStrategy(process_group_backend='hccl') on many, and for a '-mixed' precision "
    "plugins=MixedPrecision(precision, device='npu') instead of precision= (Lightning's own autocasts 'cuda' "
    "and turns itself off)")


def _looks_for_cuda(keywords: list[cst.Arg]) -> bool:
    """Lightning would look for a CUDA GPU: no accelerator given, or "auto"/"gpu"/"cuda" (`**kwargs` may
    give one: no)."""
    for keyword in keywords:
        if keyword.keyword is None:
            return False
        if keyword.keyword.value == "accelerator":
            return literal_string(keyword.value) in _GPU_CHOICES
    return True


class LightningAccelerators(NpuCodemod):
    """`L.Fabric(...)` and the Trainer (lightning, lightning_fabric, pytorch_lightning) built without an
    accelerator or with "auto"/"gpu"/"cuda" are reported: Lightning knows no NPU, so "auto" trains on
    the CPU under an NPU without a word and "cuda" cannot become "npu". The suggestion is the custom
    accelerator, strategy and precision plugin that make Fabric run on the NPU. The "cuda" given is
    this finding's, not a device string to change by hand."""

    DESCRIPTION = "Lightning Fabric/Trainer without an NPU accelerator reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = ("lightning",)

    @classmethod
    def candidates(cls, model) -> list:
        found = []
        for call in model.calls:
            if model.qualname(call.func) not in LIGHTNING_ENTRIES:
                continue
            if any(k.arg is None for k in call.keywords):
                continue
            given = [k for k in call.keywords if k.arg == "accelerator"]
            if not given or string_value(given[0].value) in _GPU_CHOICES:
                found.append(call)
        return found

    def visit_Call(self, node: cst.Call) -> None:
        if self.facts.qualname(node.func) not in LIGHTNING_ENTRIES:
            return
        keywords = split_arguments(node)[1]
        if not _looks_for_cuda(keywords):
            return
        self.flag(node, LIGHTNING_ACCELERATOR)
        for keyword in keywords:
            if keyword.keyword is not None and keyword.keyword.value == "accelerator":
                self.claim(keyword.value)  # DeviceStrings would ask for "npu" by hand, which Lightning refuses
