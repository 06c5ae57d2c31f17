"""Calls of custom ops that this tree's CUDA native code binds for Python."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.pysource_model import last_name
from npukit.migrate.rules import Flag


class CustomCudaOps(NpuCodemod):
    """`my_ext.fused_adam(...)`, where the tree's C++/CUDA sources bind `fused_adam` for Python
    (PYBIND11_MODULE, TORCH_LIBRARY: npu-migrate reads them before the Python files), is reported as
    an error: the kernel has to be ported (Ascend C / op-plugin) or replaced with torch ops. Only calls
    through an imported name count (`ext.op()`, `from ext import op; op()`), not a method of any
    object that happens to share the op's name; an op imported under another name counts. Needs the tree's facts: under libcst's own tool,
    which sees one file at a time, it reports nothing."""

    DESCRIPTION = "calls of this tree's custom CUDA ops reported (their kernels need porting)"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports

    @classmethod
    def candidates(cls, model) -> list:
        ops = model.facts.custom_ops
        return [call for call in model.calls if ops and
                (model.qualname(call.func) or last_name(call.func) or "").rsplit(".", 1)[-1] in ops]

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        func = original_node.func
        qualified = self.facts.qualname(func)  # through an import: `from ext import op as alias`
        name = qualified.rsplit(".", 1)[-1] if qualified else None
        if name in self.facts.tree.custom_ops:
            self.flag(original_node, Flag("custom-cuda-op", "error",
                                          f"`{name}` is a custom op bound from this tree's CUDA native code",
                                          "port its kernel (Ascend C / op-plugin) or replace it with torch ops; "
                                          "see the cuda-source findings"))
        return updated_node
