"""Fills with +-inf, which a saturation-mode NPU turns into an overflow on every fp16 step."""

from __future__ import annotations

import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, called_name, split_arguments
from npukit.migrate.pysource_model import last_name

_INFINITIES = frozenset({"math.inf", "torch.inf", "numpy.inf"})
_INF = re.compile("inf", re.IGNORECASE)  # no lowered copy of the file


class InfiniteFills(NpuCodemod):
    """`scores.masked_fill(mask, float("-inf"))` (and fill_, index_fill, full, full_like, new_full
    with -math.inf, torch.inf, np.inf ...) is reported, not rewritten: on a 910A in saturation mode
    an fp16 inf becomes +-65504 and sets the overflow flag, so GradScaler skips every step, while the
    same code is right in INF_NAN mode (910B). The finding suggests torch.finfo(dtype).min."""

    DESCRIPTION = "fills with +-inf reported (fp16 overflow on a saturation-mode NPU)"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    @classmethod
    def concerns(cls, code: str) -> bool:  # float("Infinity"), float("INF") ...
        return _INF.search(code) is not None

    @classmethod
    def candidates(cls, model) -> list:
        """Fill calls whose text says inf; every fill call where an infinity is imported under a name
        that does not (`from math import inf as big`)."""
        fills = [call for call in model.calls if last_name(call.func) in rules.INFINITE_FILL_CALLS]
        if any(qualified in _INFINITIES and "inf" not in local.lower() for local, qualified in model.bindings.items()):
            return fills
        return [call for call in fills if "inf" in model.pos.segment(call).lower()]

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if called_name(original_node.func) in rules.INFINITE_FILL_CALLS and any(self._is_infinite(arg.value) for arg in original_node.args):
            self.flag(original_node, rules.INFINITE_FILL)
        return updated_node

    def _is_infinite(self, node: cst.BaseExpression) -> bool:
        """float("-inf"), -math.inf, torch.inf, np.inf."""
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
            return self._is_infinite(node.expression)
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "float":
            positional, _ = split_arguments(node)
            if positional and not positional[0].star and isinstance(positional[0].value, (cst.SimpleString,
                                                                                          cst.ConcatenatedString)):
                text = positional[0].value.evaluated_value
                return isinstance(text, str) and text.strip().lower().lstrip("+-") in ("inf", "infinity")
            return False
        return self.facts.qualname(node) in _INFINITIES
