"""Checks that a CUDA kernel library is installed, guarding code `npu-migrate --fused` rewrote."""

from __future__ import annotations

import re

import libcst as cst

from npukit.migrate.codemods.base import EDITS_KEY, NpuCodemod, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.rules import Flag

# a package name as an install check spells it: "flash-attn>=2.0.0.post1", "flash_attn", "xformers", "apex"
_PACKAGE = re.compile(r"^\s*(flash[-_]attn|xformers|apex)\s*(?:[<>=!~].*)?$", re.I)
# helper functions that answer the same question (transformers, diffusers, accelerate)
_CHECK_FUNCTIONS = frozenset({"is_flash_attn_available", "is_flash_attn_2_available", "is_flash_attn_3_available",
                              "is_flash_attn_greater_or_equal", "is_flash_attn_greater_or_equal_2_10",
                              "is_xformers_available", "is_apex_available"})
# the rewrites of --fused that take a library's calls away (fused-import only removes what they left unused)
_FUSED_REWRITES = ("fused-attention", "fused-rotary", "fused-norm", "fused-layer", "fused-optimizer",
                   "fused-multi-tensor")
FUSED_UNREACHABLE = Flag(
    "fused-unreachable", "warning",
    "this asks whether a CUDA kernel library is installed; it is not on an NPU host, so the code it guards, "
    "which --fused moved onto torch / torch_npu, may never run (the fallback runs instead)",
    "make the check true on the NPU (e.g. `... or torch.npu.is_available()`) or drop it where it only guards "
    "the rewritten call")


def _is_install_check(call: cst.Call) -> bool:
    function = call.func
    name = function.attr.value if isinstance(function, cst.Attribute) else \
        function.value if isinstance(function, cst.Name) else None
    if name in _CHECK_FUNCTIONS:
        return True
    positional = split_arguments(call)[0]
    value = literal_string(positional[0].value) if positional else None
    return value is not None and _PACKAGE.match(value) is not None


class FusedInstallChecks(NpuCodemod):
    """`RequirementCache("flash-attn>=2")`, `importlib.util.find_spec("flash_attn")`,
    `is_flash_attn_2_available()` (and xformers'/apex's) in a file where `--fused` rewrote that kind of
    call are reported: on an NPU host the library is not installed, so the branch holding the
    rewritten call is likely never taken. Runs after the --fused concerns (it reads their edits)."""

    DESCRIPTION = "install checks of flash-attn / xformers / apex guarding code --fused rewrote, reported"
    WHOLE_FILE = True
    FILES_CONTAINING = ("flash", "xformers", "apex")

    @classmethod
    def candidates(cls, model) -> list:
        if any(_PACKAGE.match(node.value) for node in model.strings if isinstance(node.value, str)) or any(
                (model.qualname(call.func) or "").rsplit(".", 1)[-1] in _CHECK_FUNCTIONS for call in model.calls):
            return [model.tree]
        return []

    def visit_Module(self, node: cst.Module) -> None:
        self._checks: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if _is_install_check(node):
            self._checks.append(node)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> None:
        if any(edit.rule in _FUSED_REWRITES for edit in self.context.scratch.get(EDITS_KEY, [])):
            for call in self._checks:
                self.flag(call, FUSED_UNREACHABLE)
