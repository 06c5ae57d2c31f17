"""bfloat16 autocast, which not every Ascend SoC has."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.rules import Flag

_AUTOCAST_CALLS = frozenset({"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast"})


class Bf16Autocast(NpuCodemod):
    """`torch.autocast(..., dtype=torch.bfloat16)` (also `torch.amp.autocast`, `torch.cuda.amp.autocast`)
    is reported (info): the 910A has no bf16; check `torch.npu.is_bf16_supported()` and fall back to
    float16."""

    DESCRIPTION = "bfloat16 autocast reported (not every Ascend SoC has bf16)"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = ("bfloat16",)

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if model.qualname(call.func) in _AUTOCAST_CALLS and any(
            keyword.arg == "dtype" and model.qualname(keyword.value) == "torch.bfloat16" for keyword in call.keywords)]

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self.facts.qualname(original_node.func) in _AUTOCAST_CALLS and any(
                arg.keyword is not None and arg.keyword.value == "dtype" and self.facts.qualname(arg.value) == "torch.bfloat16"
                for arg in split_arguments(original_node)[1]):
            self.flag(original_node, Flag("bf16", "info", "bfloat16 autocast: not every Ascend SoC has bf16 (e.g. 910A)",
                                          "check torch.npu.is_bf16_supported() and fall back to float16"))
        return updated_node
