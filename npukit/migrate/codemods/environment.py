"""CUDA's process environment in Python strings: variable names, allocator settings, nvidia-smi."""

from __future__ import annotations

import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.codemods.strings import StringPlaces

_NCCL_VARIABLE = re.compile(r"(TORCH_)?NCCL_[A-Z0-9_]+")
_ALLOC_OPTION_WORDS = ("cudaMallocAsync", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                       "release_lock_on_cudamalloc", "pinned_use_background_threads")


class CudaEnvironment(StringPlaces, NpuCodemod):
    """`os.environ["CUDA_VISIBLE_DEVICES"]` -> `os.environ["ASCEND_RT_VISIBLE_DEVICES"]` (and the
    allocator, launch-blocking and NCCL socket variables); reported: CUDA-only variables (NCCL_*,
    CUBLAS_WORKSPACE_CONFIG), a project's own variable named like CUDA's (CUDA_MEMORY_FRACTION), CUDA-only
    allocator options, command lines of NVIDIA's tools (nvidia-smi,
    nvcc, nsys, ncu ...: a string a command starts with, as os.system, subprocess or a list's first
    word holds it), and variable
    names inside longer strings. Docstrings are left alone; so is text passed to print, a logger or
    raise, except a whole variable name, which is the variable wherever it is.
    """

    DESCRIPTION = "CUDA/NCCL environment variables in strings -> their Ascend names; the rest reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    RULES = ("env-var",)
    # the names ENV_RENAMES, ENV_FLAGGED and ENV_NAME know, and the prefixes of a project's own
    # variable named like CUDA's (rules.project_cuda_variable)
    FILES_CONTAINING = ("CUDA_VISIBLE_DEVICES", "CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING",
                        "CUBLAS_WORKSPACE_CONFIG", "NCCL_", "CUDA_", "NVIDIA_", "CUDNN_", "CUBLAS_",
                        "nvidia-smi", *_ALLOC_OPTION_WORDS,
                        *rules.NVIDIA_TOOLS, "#SBATCH", "#PBS", "#BSUB")

    @classmethod
    def candidates(cls, model) -> list:  # strings, not docstrings, holding one of the names
        return [node for node in model.strings
                if id(node) not in model.docstrings and any(word in node.value for word in cls.FILES_CONTAINING)]

    # ------------------------------------------------------------------ the strings
    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.BaseExpression:
        if id(original_node) in self._not_code:
            return updated_node
        value = original_node.evaluated_value
        if not isinstance(value, str):
            return updated_node
        new_name = rules.ENV_RENAMES.get(value)
        if new_name is not None:
            raw = original_node.raw_value
            if raw != value or "\\" in raw:  # spelled with escapes: reported by the audit, not guessed
                return updated_node
            quote = original_node.quote
            renamed = updated_node.with_changes(value=f"{original_node.prefix}{quote}{new_name}{quote}")
            self.replace(original_node, renamed, "env-var", needs_torch_npu=False)
            if value in rules.ENV_RENAME_NOTES:
                self.flag(original_node, rules.ENV_RENAME_NOTES[value])
            return renamed
        self._check_value(original_node, value)
        return updated_node

    def leave_ConcatenatedString(self, original_node: cst.ConcatenatedString,
                                 updated_node: cst.ConcatenatedString) -> cst.BaseExpression:
        if id(original_node) in self._not_code:
            return updated_node
        value = original_node.evaluated_value
        if isinstance(value, str):
            if value not in rules.ENV_RENAMES:  # a name split over literals: the audit reports it
                self._check_value(original_node, value)
        elif value is None and self._leading_text(original_node).lstrip().startswith("nvidia-smi"):
            self._flag_command(original_node)  # an f-string among the parts
        return updated_node

    def leave_FormattedString(self, original_node: cst.FormattedString,
                              updated_node: cst.FormattedString) -> cst.BaseExpression:
        if id(original_node) not in self._not_code and self._leading_text(original_node).lstrip().startswith("nvidia-smi"):
            self._flag_command(original_node)
        elif id(original_node) not in self._not_code and not self._text_depth:
            # f"#SBATCH --gres=gpu:{n}": its literal text, a placeholder where a value goes
            text = "".join(part.value if isinstance(part, cst.FormattedStringText) else "{}" for part in original_node.parts)
            if rules.JOB_GPU_REQUEST.search(text):
                self.flag(original_node, rules.JOB_GPU_FLAG)
        return updated_node

    def _check_value(self, node: cst.BaseExpression, value: str) -> None:
        """A string that is not a variable to rename: what in it is CUDA's environment."""
        if value in rules.ENV_FLAGGED:
            self.flag(node, rules.ENV_FLAGGED[value])
        elif _NCCL_VARIABLE.fullmatch(value):
            self.flag(node, rules.NCCL_ENV_FLAG, reason=f"{value}: {rules.NCCL_ENV_FLAG.reason}")
        elif value.lstrip().startswith("nvidia-smi"):
            self.flag(node, rules.NVIDIA_SMI)
        elif self._text_depth:
            return
        elif rules.project_cuda_variable(value):  # os.environ.get("CUDA_MEMORY_FRACTION"), an env dict's key
            self.flag(node, rules.project_cuda_variable_flag(value))
        elif (tool := rules.nvidia_tool(value)) is not None:  # a command run (os.system, subprocess, a list's first word)
            self.flag(node, tool[1])
        elif rules.JOB_GPU_REQUEST.search(value):  # the template of a job script the code writes
            self.flag(node, rules.JOB_GPU_FLAG)
        elif rules.CUDA_ONLY_ALLOC_OPTIONS.search(value):
            self.flag(node, rules.ALLOC_OPTION_FLAG)
        elif rules.ENV_NAME.search(value) and not self._device_rules_take(node, value):
            self.flag(node, rules.Flag("env-var", "warning", "a CUDA/NCCL environment variable inside a string",
                                       "ASCEND_RT_VISIBLE_DEVICES / PYTORCH_NPU_ALLOC_CONF / ASCEND_LAUNCH_BLOCKING; "
                                       "NCCL_* have HCCL_* counterparts with other knobs"))

    def _device_rules_take(self, node: cst.BaseExpression, value: str) -> bool:
        """A device or backend string ("cuda:{...}", "nccl"): the device rules deal with it."""
        if id(node) in self._dict_keys:
            return False
        return bool((value != "cuda" and rules.DEVICE_TEMPLATE.match(value)) or rules.DEVICE_VALUE.match(value)
                    or (rules.BACKEND_VALUE.match(value) and "nccl" in value))

    def _flag_command(self, node: cst.BaseExpression) -> None:
        if not self._text_depth and id(node) not in self._dict_keys:
            self.flag(node, rules.NVIDIA_SMI)

    @staticmethod
    def _leading_text(node: cst.BaseExpression) -> str:
        """The literal text an f-string (or a concatenation holding one) starts with."""
        parts = [node] if not isinstance(node, cst.ConcatenatedString) else []
        while isinstance(node, cst.ConcatenatedString):
            parts.append(node.left)
            node = node.right
        if parts[-1] is not node:
            parts.append(node)
        text = ""
        for part in parts:
            if isinstance(part, cst.SimpleString):
                text += str(part.evaluated_value)
                continue
            for piece in part.parts:
                if not isinstance(piece, cst.FormattedStringText):
                    return text
                text += piece.value
        return text
