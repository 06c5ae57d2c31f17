"""torch.cuda.amp (deprecated upstream) to the device-generic torch.amp, with the NPU as device."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.cuda_namespace import PLAIN_DECORATORS
from npukit.migrate.rules import Flag

_AMP = "torch.cuda.amp."


class AmpUpgrade(NpuCodemod):
    """torch.cuda.amp's `autocast(...)`, `GradScaler(...)` and `custom_fwd` / `custom_bwd` become
    torch.amp's with the NPU as device: `torch.amp.autocast("npu", ...)` (torch.cuda.amp's positional
    `autocast(True)` becomes `enabled=True`: torch.amp's first parameter is the device),
    `torch.amp.GradScaler("npu", ...)`, `@torch.amp.custom_fwd(device_type="npu")`. Through any import:
    where the import itself becomes torch.amp (CudaNamespace retargets it when every use of the name
    can be given the device) only the device is added; names imported from torch_npu.npu.amp instead
    already default to the NPU and are left."""

    DESCRIPTION = "torch.cuda.amp.autocast/GradScaler/custom_fwd/custom_bwd -> torch.amp.* with device 'npu'"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    RULES = ("amp-upgrade",)
    FILES_CONTAINING = ("amp",)

    @classmethod
    def candidates(cls, model) -> list:
        calls = [call for call in model.calls if (model.qualname(call.func) or "").startswith(_AMP)]
        decorators = [decorator for decorator in model.decorators if not isinstance(decorator, ast.Call)
                      and (model.qualname(decorator) or "").startswith(_AMP + "custom_")]
        return calls + decorators  # an upgraded import (torch.amp through a torch.cuda.amp name) is parsed whole

    def _upgraded(self, func: cst.BaseExpression) -> bool:
        """Named through an import CudaNamespace retargets to torch.amp."""
        root = func
        while isinstance(root, cst.Attribute):
            root = root.value
        return isinstance(root, cst.Name) and \
            self.facts.retargets.rebound.get(root.value, "").startswith("torch.amp") and \
            self.facts.bindings.get(root.value, "").startswith("torch.cuda.amp")

    def visit_Decorator(self, node: cst.Decorator) -> None:
        target = node.decorator
        if isinstance(target, cst.Call):
            return  # a call: visit_Call's
        qualified = self.facts.qualname(target)
        if qualified is None:
            return
        member = qualified.rsplit(".", 1)[-1]
        upgraded = self._upgraded(target)
        if not (qualified.startswith(_AMP + "custom_") or upgraded and member in PLAIN_DECORATORS):
            return
        self.claim(target)
        start, end = self.facts.span(target)
        text = self.facts.positions.text[start:end] if upgraded else \
            self.facts.replacement_text(target, "torch.amp." + member)
        if text is not None:
            self.replace_with_text(target, text + '(device_type="npu")', "amp-upgrade")

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.facts.qualname(node.func)
        if qualified is None or not (qualified.startswith(_AMP) or qualified.startswith("torch.amp.")
                                     and self._upgraded(node.func)):
            return
        member = qualified.rsplit(".", 1)[1]
        if member not in rules.AMP_CALLS:
            return
        upgraded = self._upgraded(node.func)
        root = node.func
        while isinstance(root, cst.Attribute):
            root = root.value
        if isinstance(root, cst.Name) and root.value in self.facts.retargets.rebound and not upgraded:
            return  # imported from torch_npu.npu.amp, whose defaults are already the NPU
        self.claim(node.func)
        positional = split_arguments(node)[0][:len(rules.CUDA_AUTOCAST_POSITIONAL)]
        if member == "autocast" and any(arg.star == "*" for arg in positional):
            # autocast(*args): torch.amp.autocast takes the device first and (dtype, enabled) in the
            # other order, so the unpacked values cannot be moved to their names
            self.flag(node, Flag("amp-upgrade", "warning",
                                 "autocast's arguments are unpacked from a sequence (`*args`): torch.amp.autocast "
                                 "takes the device first and dtype before enabled, so the call was left as it is",
                                 "pass them by name: torch.amp.autocast(\"npu\", enabled=..., dtype=..., "
                                 "cache_enabled=...)"))
            return
        if not upgraded and not self.rewrite_name(node.func, "torch.amp." + member, "amp-upgrade"):
            return
        if member == "autocast":
            for index, arg in enumerate(positional):
                start, end = self.facts.span(arg.value)
                self.replace_with_text(arg.value, f"{rules.CUDA_AUTOCAST_POSITIONAL[index]}={self.facts.positions.text[start:end]}",
                                       "amp-upgrade")
            self.insert_first_argument(node, '"npu"', "amp-upgrade")
        elif member == "GradScaler":  # torch.cuda.amp.GradScaler has no device: *args start after it
            self.insert_first_argument(node, '"npu"', "amp-upgrade", before_unpacked=True)
        else:  # custom_fwd / custom_bwd used as @decorator(...)
            self.append_keyword(node, 'device_type="npu"', "amp-upgrade")
