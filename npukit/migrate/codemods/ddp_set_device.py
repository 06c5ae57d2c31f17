"""DistributedDataParallel in a file that never sets the process's device."""

from __future__ import annotations

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.rules import Flag

_DDP_CLASSES = frozenset({"torch.nn.parallel.DistributedDataParallel",
                          "torch.nn.parallel.distributed.DistributedDataParallel"})


class DdpSetDevice(NpuCodemod):
    """`DistributedDataParallel(model, ...)` in a file that never calls `set_device` is reported
    (info): on an NPU every process must select its device (`torch.npu.set_device(local_rank)`)
    before building DDP, or all ranks use device 0."""

    DESCRIPTION = "DDP built in a file that never calls set_device reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports

    @classmethod
    def concerns(cls, code: str) -> bool:
        return "DistributedDataParallel" in code and "set_device" not in code

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if model.qualname(call.func) in _DDP_CLASSES]

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self.facts.qualname(original_node.func) in _DDP_CLASSES:
            reason = "DDP on NPU needs the process's device set first; this file never calls set_device"
            # a module of the tree this file imports that calls it (mae: misc.init_distributed_mode)
            helpers = [path for module, path in self.facts.tree.set_device_modules
                       if any(module in name.split(".") for name in self.facts.bindings.values())]
            if helpers:
                reason += f" (the tree's {', '.join(helpers[:3])}, which it imports, does: make sure that runs first)"
            self.flag(original_node, Flag("ddp-set-device", "info", reason,
                                          "call torch.npu.set_device(local_rank) before building DDP"))
        return updated_node
