"""Nothing silent: after the rules ran, every CUDA use still in the code is rewritten or reported.

Rules decide what to rewrite; this pass checks their result. It lists the CUDA uses of the
module (`x.cuda()`, `.is_cuda`, `torch.cuda.*` and other CUDA-named torch APIs, "cuda"/"nccl"
device and backend strings, CUDA/NCCL env var names, torch APIs whose device defaults to CUDA,
CUDA-only libraries) and keeps those that survive into the output: a use survives when no edit
touches its span (edits replace exact spans, so an untouched span is byte-identical in the output,
and edits never write CUDA spellings). A surviving use that no finding reports on its line gets a
`cuda-leftover` finding. Comments, docstrings, log/print/raise/help text and user identifiers
(`args.cuda`, `use_cuda`) are not uses.

A condition that mixes rewritten CUDA checks with a CUDA call that has no NPU answer
(`not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8`) is kept whole:
half-migrated, it would crash on every host instead of taking its no-CUDA branch.
"""

from __future__ import annotations

import ast
import re

from npukit.migrate import rules
from npukit.migrate.model import Edit
from npukit.migrate.pysource_calls import lacks_device_argument
from npukit.migrate.pysource_model import imported_names, last_name, string_value
from npukit.migrate.rules import Flag, third_party_flag

# findings about a CUDA call that stays in the code (no NPU answer): a condition holding one is kept whole
LEFT_AS_CUDA = frozenset({"device-capability", "device-properties", "no-equivalent", "unknown-cuda-api",
                           "version-gate", "ambiguous-cuda"})

_CUDA_SEGMENT = re.compile(r"cuda|cudnn|nccl|nvtx", re.IGNORECASE)
_CUDA_ENV = re.compile(r"(TORCH_)?(CUDA|NCCL|CUBLAS|CUDNN|CUBLASLT|NVIDIA|PYTORCH_CUDA)_[A-Z0-9_]+\Z|PYTORCH_ALLOC_CONF\Z")
# a torch CUDA name in a string: a mock.patch / monkeypatch target, a module name compared
_CUDA_DOTTED_NAME = re.compile(r"torch\.(cuda|backends\.cudnn|backends\.cuda)(\.\w+)*")
_MAYBE_CUDA_STRING = re.compile(r"cuda|nccl|CUDA|NCCL|CUBLAS|CUDNN|NVIDIA|ALLOC_CONF|nvidia")
_TEXT_KEYWORDS = frozenset({"help", "description", "epilog", "msg", "message", "reason", "doc", "usage", "metavar"})
_FLAG_RECEIVERS = frozenset({"args", "opt", "opts", "cfg", "config", "conf", "flags", "FLAGS", "hparams", "hp",
                             "options", "params", "settings", "self", "cls"})

LEFTOVER = "cuda-leftover"
_CUDA_DEFAULTING_NAMES = frozenset(name.rsplit(".", 1)[1] for name in rules.CUDA_DEFAULT_DEVICE_APIS)


class AuditRules:
    """Mixin for PythonMigrator: whole conditions, then the audit of what is left."""

    def _keep_mixed_conditions_whole(self, edits: list[Edit]) -> list[Edit]:
        """Drop the edits inside a condition that also holds a CUDA call left as it is (and report it)."""
        kept_spans: list[tuple[int, int]] = []
        for kind, node in self.flag_nodes:
            if kind not in LEFT_AS_CUDA:
                continue
            condition = self._condition_around(node)
            if condition is None:
                continue
            span = self.pos.span(condition)
            if span in kept_spans or not any(span[0] <= e.start and e.end <= span[1] for e in edits):
                continue
            kept_spans.append(span)
            self._flag(condition, Flag(
                "mixed-condition", "error",
                "this condition combines CUDA checks that have an NPU answer with a CUDA call that has none; "
                "rewriting only part of it would crash on every host, so it was left as it was: on an NPU host "
                "torch.cuda.is_available() is False and the condition takes its no-CUDA branch",
                "rewrite the whole condition by hand with an NPU feature test (e.g. torch.npu.is_available() and "
                "torch.npu.is_bf16_supported() instead of a compute-capability check)"), end_line=condition.end_lineno)
        if not kept_spans:
            return edits
        self.reported_spans.extend(kept_spans)
        return [e for e in edits if not any(a <= e.start and e.end <= b for a, b in kept_spans)]

    def _condition_around(self, node: ast.AST) -> ast.AST | None:
        """The outermost boolean expression (or if/while/assert test) holding node, below its statement."""
        found = None
        current = node
        up = self.parent.get(id(current))
        while up is not None and not isinstance(up, ast.stmt):
            if isinstance(up, ast.BoolOp) or (isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.Not)):
                found = up
            if isinstance(up, ast.IfExp) and up.test is current:
                found = found or current
            current, up = up, self.parent.get(id(up))
        if found is None and isinstance(up, (ast.If, ast.While, ast.Assert)) and up.test is current:
            found = current
        return found

    # ------------------------------------------------------------------ the audit
    def audit_leftovers(self, edits: list[Edit]) -> None:
        """Report every CUDA use that survives into the output and that no finding names on its line."""
        edit_spans = sorted((e.start, e.end) for e in edits)
        reported_lines = {key[0] for key in self.findings}
        for node, span, what in self._cuda_uses():
            if node.lineno in reported_lines or _touched(span, edit_spans) or \
                    any(a <= span[0] and span[1] <= b for a, b in (*self.frozen, *self.reported_spans)):
                continue
            self._flag(node, Flag(LEFTOVER, "warning", f"{what} is still CUDA after the migration and no rule handled it",
                                  _LEFTOVER_SUGGESTION))
            reported_lines.add(node.lineno)

    def _cuda_uses(self):
        """(node, span that must be edited for the use to be gone, description) of each CUDA use in code."""
        for node in self.attributes:
            if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load):
                yield node, self._attr_name_span(node), f"`{self.pos.segment(node)}`"
            elif node.attr == "cuda" and isinstance(node.ctx, ast.Load) and self._is_method_reference(node):
                up = self.parent.get(id(node))
                called = isinstance(up, ast.Call) and up.func is node
                receiver = self._root_name(node.value)
                if called or not (receiver in _FLAG_RECEIVERS and isinstance(node.value, ast.Name)):
                    yield node, self._attr_name_span(node), f"`{self.pos.segment(node)}{'()' if called else ''}`"
        for node in self._cuda_named_chains():
            yield node, self.pos.span(node), f"`{self.pos.segment(node)}`"
        for node in self.strings:
            if id(node) in self.docstrings or isinstance(self.parent.get(id(node)), (ast.JoinedStr, ast.FormattedValue)):
                continue
            value = node.value
            if len(value) > 200 or not _MAYBE_CUDA_STRING.search(value):
                continue
            if (rules.DEVICE_TEMPLATE.match(value) or value.startswith("cuda:") or rules.BACKEND_VALUE.match(value)
                    or _CUDA_ENV.match(value) or value.lstrip().startswith("nvidia-smi")
                    or _CUDA_DOTTED_NAME.fullmatch(value)) and not self._is_text(node):
                yield node, self.pos.span(node), f"the string {self.pos.segment(node)}"
        for node in self.fstrings:
            first = string_value(node.values[0]) if node.values else None
            if first is not None and (first.startswith("cuda") or first.lstrip().startswith("nvidia-smi")) \
                    and not self._is_text(node):
                yield node, self.pos.span(node), f"the string {self.pos.segment(node)}"
        for call in self.calls:
            if last_name(call.func) not in _CUDA_DEFAULTING_NAMES:
                continue
            qualified = self.qualname(call.func)
            if qualified in rules.CUDA_DEFAULT_DEVICE_APIS and lacks_device_argument(call, qualified, starred_may_give_it=False):
                yield call, (self.pos.span(call.func)[1], self.pos.span(call)[1]), \
                    f"`{self.pos.segment(call.func)}(...)` without a device (it defaults to CUDA)"
        for node in self.imports:
            for name in imported_names(node):
                if third_party_flag(name, self.facts.local_packages) is not None:
                    yield node, self.pos.span(node), f"the CUDA-only import of {name}"
                    break

    def _cuda_named_chains(self):
        """Outermost torch name chains with a CUDA-named part: torch.cuda.X, torch.backends.cudnn.X, Backend.NCCL."""
        starts = [node for node in self.attributes if _CUDA_SEGMENT.search(node.attr)]
        starts += [use for name, uses in self.loads.items() if _CUDA_SEGMENT.search(self.bindings.get(name, ""))
                   for use in uses]
        seen: set[int] = set()
        for node in starts:
            up = self.parent.get(id(node))
            while isinstance(up, ast.Attribute) and up.value is node:  # to the outermost part of its chain
                node, up = up, self.parent.get(id(up))
            if id(node) in seen:
                continue
            seen.add(id(node))
            qualified = self.qualname(node)
            if qualified is None or not (qualified == "torch" or qualified.startswith("torch.")):
                continue
            if self._root_name(node) in self.rebound:
                continue  # its import was rewritten to the NPU module
            if any(_CUDA_SEGMENT.search(part) for part in qualified.split(".")[1:]):
                yield node

    def _is_method_reference(self, node: ast.Attribute) -> bool:
        """`x.cuda` that is not a module attribute (torch.cuda: a chain; numba.cuda: a CUDA-only import)."""
        qualified = self.qualname(node)
        if qualified is None:
            return True
        return not (qualified.startswith("torch.cuda") or third_party_flag(qualified, self.facts.local_packages) is not None)

    def _attr_name_span(self, node: ast.Attribute) -> tuple[int, int]:
        _, end = self.pos.span(node)
        return end - len(node.attr), end

    def _is_text(self, node: ast.AST) -> bool:
        """Part of a message: a log/print/raise argument, help= text, an assert message, or a docstring."""
        if self._in_log_call(node):
            return True
        current, up = node, self.parent.get(id(node))
        while up is not None and not isinstance(up, ast.stmt):
            if isinstance(up, ast.keyword) and up.arg in _TEXT_KEYWORDS:
                return True
            if isinstance(up, ast.Call) and last_name(up.func) in ("warn", "print", "RuntimeError", "ValueError"):
                return True
            current, up = up, self.parent.get(id(up))
        return isinstance(up, ast.Assert) and up.msg is current


_LEFTOVER_SUGGESTION = ("if it is a device use, change it to the NPU spelling (.npu(), 'npu', torch.npu.X, 'hccl'); "
                        "if it must stay CUDA, make sure it is never reached on an NPU host")


def _touched(span: tuple[int, int], edit_spans: list[tuple[int, int]]) -> bool:
    start, end = span
    return any(a < end and start < b or (a == b and start <= a <= end) for a, b in edit_spans)
