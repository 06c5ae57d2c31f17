"""Code that decides on the GPU model: its name parsed, its compute capability read."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.rules import Flag

_NAME = "torch.cuda.get_device_name"
_PROPERTIES = "torch.cuda.get_device_properties"

DEVICE_NAME_PARSED = Flag("device-name", "warning",
                          "the device name is parsed (e.g. for 'A100'/'H100'); an NPU reports e.g. 'Ascend910B...'",
                          "decide on a feature (torch.npu.is_bf16_supported(), memory size) instead of a GPU model")
PROPERTY_MISSING = Flag("device-properties", "error",
                        "NPU device properties have no major/minor/multi_processor_count (name and total_memory are fine)",
                        "gate on torch.npu.get_device_name() or a feature check")


class DeviceModelChecks(NpuCodemod):
    """`torch.cuda.get_device_name()` compared or parsed (`"A100" in ...`, `.startswith(...)`, also
    through a variable it is assigned to) is reported: an NPU's name is e.g. 'Ascend910B2'. A field
    that NPU device properties lack (`get_device_properties(0).major`, `minor`,
    `multi_processor_count`, also read from a variable holding the properties) is reported as an
    error: the condition it sits in is kept as it is (npu-migrate rewrites none of it). The
    `torch.cuda` calls themselves are renamed by the namespace rule."""

    DESCRIPTION = "GPU-model checks reported: the device name parsed, compute-capability fields read"
    FILES_CONTAINING = ("get_device_name", "get_device_properties")

    @classmethod
    def candidates(cls, model) -> list:
        found = []
        for call in model.calls:
            if model.qualname(call.func) in (_NAME, _PROPERTIES):
                if isinstance(model.parent.get(id(call)), ast.Assign):
                    return [model.tree]  # its reads may be in any statement of the file
                found.append(call)
        return found

    def visit_Module(self, node: cst.Module) -> None:
        self.assigned: list[tuple[cst.Call, str, str]] = []  # (call, qualified name, variable)
        self.compared_names: set[int] = set()  # ids of Name nodes compared or used as an attribute's receiver
        self.missing_field_of: dict[int, cst.Attribute] = {}  # id of a Name -> `name.major`

    def _query(self, node: cst.BaseExpression) -> str | None:
        if isinstance(node, cst.Call):
            qualified = self.facts.qualname(node.func)
            if qualified in (_NAME, _PROPERTIES):
                return qualified
        return None

    def visit_Comparison(self, node: cst.Comparison) -> None:
        for operand in (node.left, *(target.comparator for target in node.comparisons)):
            if self._query(operand) == _NAME:
                self.flag(operand, DEVICE_NAME_PARSED)
            elif isinstance(operand, cst.Name):
                self.compared_names.add(id(operand))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        receiver = node.value
        query = self._query(receiver)
        if query == _NAME:
            self.flag(receiver, DEVICE_NAME_PARSED)
        elif query == _PROPERTIES and node.attr.value in rules.DEVICE_PROPERTY_FIELDS_MISSING:
            self.flag(node, PROPERTY_MISSING)
        elif isinstance(receiver, cst.Name):
            self.compared_names.add(id(receiver))
            if node.attr.value in rules.DEVICE_PROPERTY_FIELDS_MISSING:
                self.missing_field_of[id(receiver)] = node

    def visit_Assign(self, node: cst.Assign) -> None:
        query = self._query(node.value)
        if query is not None and len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            self.assigned.append((node.value, query, node.targets[0].target.value))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        # every read of the variable in the file, as the ast engine's loads (not only those after it)
        for call, query, variable in self.assigned:
            reads = self.facts.scopes.reads.get(variable, ())
            if query == _NAME:
                if any(id(read) in self.compared_names for read in reads):
                    self.flag(call, DEVICE_NAME_PARSED)
            else:
                for read in reads:
                    if id(read) in self.missing_field_of:
                        self.flag(self.missing_field_of[id(read)], PROPERTY_MISSING)
        return updated_node
