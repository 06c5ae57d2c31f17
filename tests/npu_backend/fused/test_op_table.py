"""The fused-op surface as a user meets it: torch_npu.X is torch.ops.npu.X, a missing op says so
by name, and docs/fused-ops.md states what is emulated now."""

import sys
from pathlib import Path

import pytest
import torch
import torch_npu

from npukit.npu_backend import fused
from npukit.npu_backend.fused import table
from npukit.npu_backend.fused.wheel_ops import NO_UNFUSED_EQUIVALENT, UNFUSED, WHEEL_DOCUMENTED_OPS

DOC = Path(__file__).resolve().parents[3] / "docs" / "fused-ops.md"


def test_the_docs_table_is_current():
    assert DOC.read_text() == table.render(), (
        "docs/fused-ops.md is stale: python -m npukit.npu_backend.fused.table > docs/fused-ops.md")


def test_every_emulated_op_is_one_op_under_both_names():
    """torch_npu.X is torch.ops.npu.X, except where a family gives torch_npu a Python function of its
    own for the op (npu_apply_rotary_pos_emb writes into its arguments in eager mode, as the kernel does)."""
    python_functions = {name for family in fused.FAMILIES
                        for name in getattr(sys.modules.get(f"{fused.__name__}.{family}"), "TORCH_NPU_ATTRIBUTES", {})}
    for op in fused.public_ops():
        if op.name not in python_functions:
            assert getattr(torch_npu, op.name) is getattr(torch.ops.npu, op.name), op.name


def test_a_missing_op_raises_one_error_naming_it():
    missing = [name for name in WHEEL_DOCUMENTED_OPS
               if getattr(getattr(torch_npu, name), "npukit_missing", False)]
    assert missing == [name for name in WHEEL_DOCUMENTED_OPS if table.rows()[WHEEL_DOCUMENTED_OPS.index(name)][1] == "missing"]
    for name in missing:
        with pytest.raises(NotImplementedError, match=rf"torch_npu\.{name} is a fused Ascend kernel") as raised:
            getattr(torch_npu, name)(torch.zeros(1, device="npu"))
        # the error names what to run instead: the op's own unfused equivalent, or why there is none
        instead = UNFUSED.get(name) or NO_UNFUSED_EQUIVALENT.get(name)
        assert instead and instead in str(raised.value), name


def test_every_hint_is_for_a_documented_op_the_emulator_lacks():
    """A hint for an op that is emulated (or misspelled) would never be shown, and an op in both tables
    would get two answers."""
    missing = {name for name in WHEEL_DOCUMENTED_OPS if getattr(getattr(torch_npu, name), "npukit_missing", False)}
    assert not UNFUSED.keys() & NO_UNFUSED_EQUIVALENT.keys()
    assert set(UNFUSED) | set(NO_UNFUSED_EQUIVALENT) == missing
