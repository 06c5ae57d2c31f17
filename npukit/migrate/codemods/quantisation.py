"""bitsandbytes quantisation asked for through transformers' keywords (load_in_8bit, BitsAndBytesConfig)."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, called_name, split_arguments
from npukit.migrate.codemods.device_values import source
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import last_name, string_value
from npukit.migrate.rules import Flag

CONFIG = "BitsAndBytesConfig"
_KEYWORDS = ("load_in_8bit", "load_in_4bit")
_KEYWORD_PREFIXES = ("bnb_4bit_", "llm_int8_")  # BitsAndBytesConfig's options, also taken by from_pretrained
_SUGGESTION = ("on Ascend load the weights in bf16/fp16 instead (torch_dtype=torch.bfloat16, no load_in_*bit / "
               "quantization_config), or quantise with Ascend's tools (msModelSlim; torch_npu's "
               "npu_weight_quant_batchmatmul / npu_quant_matmul run int8/int4 weights)")
BNB_KEYWORD = Flag(
    "bitsandbytes", "error",
    "asks transformers to quantise the weights with bitsandbytes, whose int8/4-bit kernels are CUDA kernels: "
    "an NPU has none (loading fails or does not quantise)", _SUGGESTION)
BNB_CONFIG = Flag(
    "bitsandbytes", "error",
    "a BitsAndBytesConfig quantises the weights with bitsandbytes, whose int8/4-bit kernels are CUDA kernels: "
    "an NPU has none (loading fails or does not quantise)", _SUGGESTION)


def is_quantisation_keyword(name: str | None) -> bool:
    return name is not None and (name in _KEYWORDS or name.startswith(_KEYWORD_PREFIXES))


def _turned_off(text: str) -> bool:
    return text in ("False", "None")


class BitsAndBytesQuantisation(NpuCodemod):
    """transformers quantises through bitsandbytes when asked by `load_in_8bit=True` /
    `load_in_4bit=True` (and `bnb_4bit_*` / `llm_int8_*` options) in a call, a dict entry or an item
    assigned into a kwargs dict (`kw["load_in_8bit"] = True`, then `from_pretrained(**kw)`), or by a
    `BitsAndBytesConfig(...)`: each is reported at its line (one finding per call or entry), with
    what to do on Ascend, even in a file with no bitsandbytes import or requirement. A keyword given
    a literal False or None asks for nothing and is left."""

    DESCRIPTION = "bitsandbytes quantisation asked through load_in_8bit / load_in_4bit / BitsAndBytesConfig reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = (*_KEYWORDS, *_KEYWORD_PREFIXES, CONFIG)

    @classmethod
    def candidates(cls, model) -> list:
        found = [call for call in model.calls if last_name(call.func) == CONFIG or any(
            is_quantisation_keyword(keyword.arg) and not _is_off(keyword.value) for keyword in call.keywords)]
        found += [node for node in model.dicts if any(
            is_quantisation_keyword(string_value(key)) and not _is_off(value)
            for key, value in zip(node.keys, node.values) if key is not None)]
        for node in model.assigns:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and not _is_off(node.value) and any(
                    isinstance(target, ast.Subscript) and is_quantisation_keyword(string_value(target.slice))
                    for target in targets):
                found.append(node)
        return found

    def visit_Call(self, node: cst.Call) -> None:
        if called_name(node.func) == CONFIG:
            self.flag(node, BNB_CONFIG)
            return
        for arg in split_arguments(node)[1]:
            name = arg.keyword.value if arg.keyword is not None else None
            if is_quantisation_keyword(name) and not _turned_off(source(arg.value, self.facts)):
                self.flag(arg, BNB_KEYWORD, reason=f"`{name}` {BNB_KEYWORD.reason}")
                return  # one finding per call

    def visit_DictElement(self, node: cst.DictElement) -> None:
        key = literal_string(node.key)
        if is_quantisation_keyword(key) and not _turned_off(source(node.value, self.facts)):
            self.flag(node, BNB_KEYWORD, reason=f"`{key}` {BNB_KEYWORD.reason}")

    def visit_Assign(self, node: cst.Assign) -> None:
        if _turned_off(source(node.value, self.facts)):
            return
        for target in node.targets:
            subscript = target.target
            if isinstance(subscript, cst.Subscript) and len(subscript.slice) == 1 and \
                    isinstance(subscript.slice[0].slice, cst.Index):
                key = literal_string(subscript.slice[0].slice.value)
                if is_quantisation_keyword(key):
                    self.flag(node, BNB_KEYWORD, reason=f"`{key}` {BNB_KEYWORD.reason}")


def _is_off(value: ast.AST) -> bool:
    return isinstance(value, ast.Constant) and (value.value is False or value.value is None)
