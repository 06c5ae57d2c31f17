"""torch APIs whose device argument defaults to CUDA, called without one."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, keyword_names, split_arguments


def lacks_device_argument(call: cst.Call, qualified: str, *, starred_may_give_it: bool = True) -> bool:
    """rules.lacks_device_argument for a libcst call."""
    positional, keywords = split_arguments(call)
    return rules.lacks_device_argument(qualified, len(positional), any(arg.star == "*" for arg in positional),
                                       keyword_names(keywords), starred_may_give_it=starred_may_give_it)


class CudaDefaultDevices(NpuCodemod):
    """`torch.amp.GradScaler()` is a CUDA scaler (on an NPU host it disables itself): it becomes
    `GradScaler("npu")`; so do `ShardedGradScaler()`, `torch.is_autocast_enabled()`,
    `torch.set_autocast_enabled(True)` and `DefaultDeviceType.set_device_type()`.
    `torch.random.fork_rng()` forks the CUDA generators unless told otherwise: it gets
    `device_type="npu"`. Names are resolved through the file's imports (`from torch.amp import
    GradScaler as GS; GS()`); a call passing `*args` or `**kwargs` may give the device and is left.
    """

    DESCRIPTION = "torch APIs whose device defaults to CUDA (GradScaler(), fork_rng() ...) get 'npu'"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    RULES = ("cuda-default-device", "fork-rng-device-type")
    FILES_CONTAINING = ("GradScaler", "autocast_enabled", "set_device_type", "fork_rng")  # in a call or its import

    @classmethod
    def candidates(cls, model) -> list:  # calls of these APIs without their device, through the imports
        found = []
        for call in model.calls:
            qualified = model.qualname(call.func)
            keywords = {keyword.arg for keyword in call.keywords}
            if (qualified == "torch.random.fork_rng" and "device_type" not in keywords) or (
                    qualified in rules.CUDA_DEFAULT_DEVICE_APIS and rules.lacks_device_argument(
                        qualified, len(call.args), any(isinstance(a, ast.Starred) for a in call.args), keywords)):
                found.append(call)
        return found

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        qualified = self.facts.qualname(original_node.func)
        if qualified in rules.CUDA_DEFAULT_DEVICE_APIS:
            if lacks_device_argument(original_node, qualified):
                self.insert_first_argument(original_node, '"npu"', "cuda-default-device")
        elif qualified == "torch.random.fork_rng" and "device_type" not in keyword_names(split_arguments(original_node)[1]):
            self.append_keyword(original_node, 'device_type="npu"', "fork-rng-device-type")
        return updated_node
