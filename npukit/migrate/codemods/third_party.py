"""CUDA-only third-party libraries: reported where the code depends on them."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.apex_multi_tensor import ApexMultiTensorToTorch
from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.codemods.fused import fused_hint
from npukit.migrate.codemods.scopes import dotted_name
from npukit.migrate.pysource_model import imported_names

# the words a file must hold for one of these libraries to be imported by it
_LIBRARY_WORDS = tuple(sorted({name.split(".")[0] for name in rules.THIRD_PARTY}))
FLASH_ATTENTION_2 = "flash_attention_2"
_FLASH_ATTENTION_2_ROUTED = rules.Flag(
    "flash-attention-2", "info",
    'kept: on an NPU, transformers runs attn_implementation="flash_attention_2" with torch_npu.npu_fusion_attention '
    "(transformers/integrations/npu_flash_attention.py), which npu-run's emulated NPU runs too",
    "nothing to do; sdpa or eager are the alternatives if a model lacks flash_attention_2 support")
_FLASH_ATTENTION_2_OWN = rules.Flag(
    "flash-attention-2", "error",
    'this file imports flash_attn itself: its own "flash_attention_2" path calls flash_attn\'s CUDA kernels, '
    "which transformers' routing to torch_npu does not reach",
    'route that path to torch_npu.npu_fusion_attention (or F.scaled_dot_product_attention), or use '
    'attn_implementation="sdpa" on the NPU')


def imported_dotted_names(node: cst.Import | cst.ImportFrom) -> list[str]:
    """pysource_model.imported_names for a libcst import: `import a.b` -> [a.b];
    `from a import b` -> [a.b, a]; nothing for a relative import."""
    if isinstance(node, cst.Import):
        return [dotted_name(alias.name) for alias in node.names]
    if node.relative or node.module is None:
        return []
    module = dotted_name(node.module)
    names = ["*"] if isinstance(node.names, cst.ImportStar) else [dotted_name(alias.name) for alias in node.names]
    return [*(f"{module}.{name}" for name in names), module]


def _first_flag(names: list[str], local_packages: frozenset[str]) -> rules.Flag | None:
    for name in names:
        flag = rules.third_party_flag(name, local_packages)
        if flag is not None:
            return flag
    return None


def _call_flag(qualified: str | None, local_packages: frozenset[str]) -> rules.Flag | None:
    if qualified is None or not (qualified.split(".")[0] in rules.THIRD_PARTY_CALLS_REPORTED
                                 or qualified.startswith("numba.cuda.")):
        return None
    return rules.third_party_flag(qualified, local_packages)


class ThirdPartyCuda(NpuCodemod):
    """An import of a CUDA-only library (flash_attn, xformers, triton, apex, cupy, pynvml, numba.cuda,
    TensorRT, DALI, Isaac Gym ... `rules.THIRD_PARTY`) is reported with what to use on an NPU; an
    import statement gets one finding, for the first such name it imports. So is each call into the
    libraries whose every call site needs a decision (`rules.THIRD_PARTY_CALLS_REPORTED`, numba.cuda),
    and each kernel decorator (`@triton.jit`, `@triton.autotune(...)`, `@numba.cuda.jit`). Nothing is
    rewritten: these libraries have no drop-in NPU counterpart. A package of the migrated tree itself
    (npu-migrate's tree facts: mamba_ssm in mamba's own repository) is not a third party.
    `"flash_attention_2"` (transformers' attn_implementation) is kept: transformers routes it to
    torch_npu's fused attention on an NPU (info); in a file that imports flash_attn itself it is an
    error, since that file's own flash-attention path calls flash_attn. A call a `--fused` concern knows
    says what `npu-migrate --fused` makes of it (or why it keeps it); under `--fused` what was rewritten
    (the call, an import no longer needed) is not reported."""

    DESCRIPTION = "CUDA-only third-party libraries reported at their imports, calls and kernel decorators"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = (*_LIBRARY_WORDS, FLASH_ATTENTION_2)

    @classmethod
    def context(cls, model, node) -> str:
        """An apex multi_tensor_applier call: what --fused makes of it depends on whether its function
        reads the overflow buffer elsewhere (the def whole)."""
        if isinstance(node, ast.Call) and model.qualname(node.func) in ApexMultiTensorToTorch.TARGETS:
            return "function"
        return cls.CONTEXT

    @classmethod
    def candidates(cls, model) -> list:
        local = model.facts.local_packages
        found = [node for node in model.imports if _first_flag(imported_names(node), local) is not None]
        found += [call for call in model.calls if _call_flag(model.qualname(call.func), local) is not None]
        for decorator in model.decorators:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            qualified = model.qualname(target)
            if qualified in rules.THIRD_PARTY_DECORATORS and rules.third_party_flag(qualified, local):
                found.append(decorator)
        found += [node for node in model.strings if node.value == FLASH_ATTENTION_2 and id(node) not in model.docstrings]
        return found

    def visit_Module(self, node: cst.Module) -> None:
        self._deferred: list[cst.Import | cst.ImportFrom] = []

    def visit_Import(self, node: cst.Import) -> None:
        self._flag_import(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self._flag_import(node)

    def _flag_import(self, node: cst.Import | cst.ImportFrom, *, decided: bool = False) -> None:
        if self.facts.tree.fused and not decided:
            self._deferred.append(node)  # the --fused concerns say at the module's end which imports they remove
            return
        if id(node) in self.facts.claimed:
            return  # removed by a --fused concern: every use it served was rewritten
        flag = _first_flag(imported_dotted_names(node), self.facts.tree.local_packages)
        if flag is not None:
            self.flag(node, flag)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> None:
        for node in self._deferred:
            self._flag_import(node, decided=True)

    def visit_Call(self, node: cst.Call) -> None:
        if id(node) in self.facts.claimed:
            return  # rewritten by a --fused concern
        flag = _call_flag(self.facts.qualname(node.func), self.facts.tree.local_packages)
        if flag is not None:
            hint = fused_hint(node, self.facts)
            self.flag(node, flag, reason=f"{flag.reason}; {hint}" if hint else None)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if node.evaluated_value == FLASH_ATTENTION_2:
            own = any(name.split(".")[0] == "flash_attn" for name in self.facts.bindings.values())
            self.flag(node, _FLASH_ATTENTION_2_OWN if own else _FLASH_ATTENTION_2_ROUTED)

    def visit_Decorator(self, node: cst.Decorator) -> None:
        expression = node.decorator
        qualified = self.facts.qualname(expression.func if isinstance(expression, cst.Call) else expression)
        flag = rules.third_party_flag(qualified, self.facts.tree.local_packages) \
            if qualified in rules.THIRD_PARTY_DECORATORS else None
        if flag is not None:
            self.flag(expression, flag)
