"""torch.compile modes that capture CUDA graphs."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import string_value
from npukit.migrate.rules import Flag

_GRAPH_MODES = ("reduce-overhead", "max-autotune")
CUDA_GRAPH_MODE = Flag("compile", "warning", "mode='reduce-overhead'/'max-autotune' uses CUDA graphs",
                       "use backend='npugraph_ex' (torchair) for graph capture on NPU")


class CompileModes(NpuCodemod):
    """`torch.compile(model, mode="reduce-overhead")` (or "max-autotune") is reported: those modes
    capture CUDA graphs; on an NPU graph capture is torchair's backend="npugraph_ex". (Any other
    torch.compile gets the general `compile` note from the names rules.)"""

    DESCRIPTION = "torch.compile modes that capture CUDA graphs reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = ("compile",)  # not the modes: a mode may be spelled as adjacent literals

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if model.qualname(call.func) == "torch.compile" and any(
            keyword.arg == "mode" and string_value(keyword.value) in _GRAPH_MODES for keyword in call.keywords)]

    def visit_Call(self, node: cst.Call) -> None:
        if self.facts.qualname(node.func) == "torch.compile" and any(
                arg.keyword is not None and arg.keyword.value == "mode" and literal_string(arg.value) in _GRAPH_MODES
                for arg in split_arguments(node)[1]):
            self.flag(node, CUDA_GRAPH_MODE)
            self.claim(node.func)  # CudaNamespace's general torch.compile note would take this finding's place
