"""Command-line flags named after CUDA (`--cuda`, `--no-cuda`)."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, split_arguments
from npukit.migrate.codemods.strings import literal_string
from npukit.migrate.pysource_model import string_value
from npukit.migrate.rules import Flag


def _cuda_flag(name: str | None) -> bool:
    return bool(name) and name.startswith("-") and "cuda" in name.lower()


class CudaCliFlags(NpuCodemod):
    """`parser.add_argument("--cuda", ...)` is reported, not renamed: the flag is the script's
    interface (its users' command lines and launch files say it); the `.cuda()` calls it guards are
    the other rules' business."""

    DESCRIPTION = "argparse flags named after CUDA reported (they keep their names)"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    FILES_CONTAINING = ("add_argument",)

    @classmethod
    def candidates(cls, model) -> list:
        return [call for call in model.calls if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
                and any(_cuda_flag(string_value(arg)) for arg in call.args)]

    def visit_Call(self, node: cst.Call) -> None:
        if not (isinstance(node.func, cst.Attribute) and node.func.attr.value == "add_argument"):
            return
        for arg in split_arguments(node)[0]:
            name = None if arg.star else literal_string(arg.value)
            if _cuda_flag(name):
                self.flag(arg.value, Flag("cli-flag", "info", f"the CLI flag {name} keeps its name (it is your interface)",
                                          "only the .cuda() calls it guards were rewritten; consider renaming the flag"))
