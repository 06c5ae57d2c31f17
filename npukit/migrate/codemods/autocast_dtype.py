"""torch.get_autocast_gpu_dtype / set_autocast_gpu_dtype: CUDA's autocast dtype."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.rules import Flag

_DEVICE_GENERIC = {"torch.get_autocast_gpu_dtype": "torch.get_autocast_dtype",
                   "torch.set_autocast_gpu_dtype": "torch.set_autocast_dtype"}


class AutocastGpuDtype(NpuCodemod):
    """`torch.get_autocast_gpu_dtype()` (CUDA's autocast dtype, deprecated) becomes
    `torch.get_autocast_dtype("npu")`, and `torch.set_autocast_gpu_dtype(d)` becomes
    `torch.set_autocast_dtype("npu", d)`, through any import alias. Where torch itself may not be
    named (the function imported with `from torch import ...` and torch never imported), the call is
    reported instead."""

    DESCRIPTION = "get/set_autocast_gpu_dtype -> get/set_autocast_dtype('npu', ...)"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    RULES = ("amp-upgrade",)
    FILES_CONTAINING = ("autocast_gpu_dtype",)

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if model.qualname(call.func) in _DEVICE_GENERIC]

    def visit_Call(self, node: cst.Call) -> None:
        new = _DEVICE_GENERIC.get(self.facts.qualname(node.func) or "")
        if new is None:
            return
        self.claim(node.func)
        text = self.facts.replacement_text(node.func, new)
        if text is None:
            self.flag(node, Flag("amp-upgrade", "warning",
                                 f"{self.facts.qualname(node.func)} means CUDA's autocast dtype; torch is not "
                                 "imported by name here, so it was not rewritten",
                                 f"import torch and call {new}(\"npu\", ...)"))
            return
        self.replace_with_text(node.func, text, "amp-upgrade")
        self.insert_first_argument(node, '"npu"', "amp-upgrade")
