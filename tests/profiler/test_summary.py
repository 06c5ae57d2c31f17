"""Summary, cost model, roofline estimate and the npu-profile command."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

from npukit.errors import UserError
from npukit.profiler.commands import run_summary
from npukit.profiler.cost import op_cost
from npukit.profiler.roofline import CHIPS, estimate_seconds, get_chip
from npukit.profiler.summary import estimate_table, find_profile, summarize
from npukit.profiler.table import KIND_ANNOTATION, EventTable, TableBuilder


def _synthetic() -> EventTable:
    """linear (100 us) -> addmm (80 us) -> copy_ (10 us); relu 20 us; a nested sum in sum."""
    b = TableBuilder()
    step = b.add("ProfilerStep#0", start_ns=0, dur_ns=1_000_000, kind=KIND_ANNOTATION, step=0)
    lin = b.add("aten::linear", start_ns=10, dur_ns=100_000, parent=step, step=0, shapes="[8, 16], [32, 16]",
                dtypes="float32, float32", module="Net.fc", stack="model.py:10 in forward", top_level=True,
                flops=2 * 8 * 16 * 32, nbytes=1000.0)
    mm = b.add("aten::addmm", start_ns=20, dur_ns=80_000, parent=lin, step=0, shapes="[32], [8, 16], [16, 32]",
               dtypes="float32, float32, float32", module="Net.fc", stack="model.py:10 in forward",
               flops=2 * 8 * 16 * 32)
    b.add("aten::copy_", start_ns=30, dur_ns=10_000, parent=mm, step=0, shapes="[8, 32], [8, 32]",
          dtypes="float32, float32", module="Net.fc", stack="model.py:10 in forward")
    b.add("aten::relu", start_ns=200_000, dur_ns=20_000, parent=step, step=0, shapes="[8, 32]", dtypes="float32",
          module="Net", stack="model.py:11 in forward", top_level=True, nbytes=2048.0)
    outer = b.add("aten::sum", start_ns=300_000, dur_ns=30_000, parent=step, step=0, shapes="[8, 32]",
                  dtypes="float32", module="Net", stack="model.py:12 in forward", top_level=True)
    b.add("aten::sum", start_ns=300_010, dur_ns=20_000, parent=outer, step=0, shapes="[8, 32]", dtypes="float32",
          module="Net", stack="model.py:12 in forward")
    return b.build()


def _rows(summary):
    return {row["group"]: row for row in summary.rows}


def test_self_total_calls_and_share_by_op():
    rows = _rows(summarize(_synthetic(), "op"))
    assert rows["aten::linear"]["self_us"] == 20.0 and rows["aten::linear"]["total_us"] == 100.0
    assert rows["aten::addmm"]["self_us"] == 70.0
    assert rows["aten::copy_"]["self_us"] == 10.0
    # The nested aten::sum is not counted twice in total time, but both calls count.
    assert rows["aten::sum"]["calls"] == 2 and rows["aten::sum"]["total_us"] == 30.0
    assert rows["aten::sum"]["self_us"] == 30.0
    total_self = sum(r["self_us"] for r in rows.values())
    assert rows["aten::addmm"]["self_pct"] == pytest.approx(100 * 70 / total_self, abs=0.01)
    assert list(rows)[0] == "aten::addmm"  # sorted by self time


def test_time_by_phase(matmul_profile):
    _, table = matmul_profile
    phases = summarize(table, "op").phase_self_us
    assert {"forward", "backward", "optimizer"} <= set(phases)
    assert sum(phases.values()) == pytest.approx(summarize(table, "op").total_self_us, rel=1e-6)


def test_grouping_by_module_stack_and_shape():
    table = _synthetic()
    modules = _rows(summarize(table, "module"))
    assert modules["Net.fc"]["self_us"] == 100.0 and modules["Net.fc"]["top_op"] == "aten::addmm"
    # FLOPs of a module count top-level ops only (linear includes its addmm).
    assert modules["Net.fc"]["flops"] == 2 * 8 * 16 * 32
    lines = _rows(summarize(table, "stack"))
    assert lines["model.py:12 in forward"]["self_us"] == 30.0
    shapes = summarize(table, "shape")
    assert {(r["group"], r["shapes"]) for r in shapes.rows} >= {("aten::addmm", "[32], [8, 16], [16, 32]")}


def test_bad_grouping_is_a_user_error():
    with pytest.raises(UserError, match="--group-by"):
        summarize(_synthetic(), "thread")


@pytest.mark.parametrize(
    "name, tensors, flops",
    [
        ("aten::mm", [((64, 32), "float32"), ((32, 16), "float32")], 2 * 64 * 32 * 16),
        ("aten::addmm", [((16,), "float32"), ((64, 32), "float32"), ((32, 16), "float32")], 2 * 64 * 32 * 16),
        ("aten::bmm", [((4, 64, 32), "float16"), ((4, 32, 16), "float16")], 2 * 4 * 64 * 32 * 16),
        ("aten::linear", [((2, 8, 32), "bfloat16"), ((16, 32), "bfloat16")], 2 * 16 * 32 * 16),
        ("aten::matmul", [((3, 64, 32), "float32"), ((32, 16), "float32")], 2 * 3 * 64 * 32 * 16),
        # conv 3->8, 3x3, 16x16 input, stride unknown: stride 1 "same" upper bound.
        ("aten::convolution", [((2, 3, 16, 16), "float32"), ((8, 3, 3, 3), "float32")], 2 * 2 * 8 * 256 * 27),
        # conv backward from grad_output [2, 8, 7, 7]: grad_input + grad_weight = 2 forward passes.
        ("aten::convolution_backward", [((2, 8, 7, 7), "float32"), ((2, 3, 16, 16), "float32"),
                                        ((8, 3, 3, 3), "float32")], 2 * (2 * 2 * 8 * 49 * 27)),
        ("aten::_scaled_dot_product_flash_attention_for_cpu",
         [((2, 4, 10, 8), "float32"), ((2, 4, 12, 8), "float32"), ((2, 4, 12, 8), "float32")], 2 * 8 * 10 * 12 * 16),
    ],
)
def test_flops_formulas(name, tensors, flops):
    assert op_cost(name, tensors)[0] == flops


def test_conv_flops_use_torch_count_for_stride():
    # torch's with_flops count for a stride-2 conv: output 7x7 instead of 16x16.
    known = 2 * 2 * 8 * 49 * 27
    flops, nbytes = op_cost("aten::conv2d", [((2, 3, 16, 16), "float32"), ((8, 3, 3, 3), "float32")], known)
    assert flops == known
    assert nbytes == 4 * (2 * 3 * 256 + 8 * 27 + 2 * 8 * 49)


def test_bytes_are_inputs_plus_output():
    flops, nbytes = op_cost("aten::mm", [((64, 32), "float16"), ((32, 16), "float16")])
    assert nbytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)
    _, nbytes = op_cost("aten::add", [((100,), "float32"), ((100,), "float32")])
    assert nbytes == 4 * 300


def test_chip_peaks_follow_cores_clock_and_8192():
    chip = get_chip("910B2")
    assert chip.peak_flops("float16") == 24 * 1.8e9 * 8192
    assert 350e12 < chip.peak_flops("bfloat16") < 360e12
    assert get_chip("ascend910a").peak_flops() == 32 * 1.0e9 * 8192
    assert set(CHIPS) == {"910B2", "910B3", "910B4", "910A"}
    with pytest.raises(UserError, match="--chip"):
        get_chip("H100")
    with pytest.raises(UserError, match="--bandwidth"):
        get_chip("910B2", -1)


def test_estimate_is_the_roofline_max():
    chip = get_chip("910B3", bandwidth_gbs=1000.0)
    flops = np.array([1e12, 1e6, 0.0])
    nbytes = np.array([1e6, 1e9, 4e3])
    got = estimate_seconds(chip, flops, nbytes, np.array(["float16", "bfloat16", "float32"]))
    peak = 20 * 1.8e9 * 8192
    expected = [max(1e12 / peak, 1e6 / 1e12), max(1e6 / peak, 1e9 / 1e12), 4e3 / 1e12]
    assert got == pytest.approx(expected)


def test_estimate_table_uses_top_level_ops():
    rows, per_step = estimate_table(_synthetic(), get_chip("910B2"))
    assert {r.op for r in rows} == {"aten::linear", "aten::relu", "aten::sum"}
    linear = next(r for r in rows if r.op == "aten::linear")
    peak_fp32 = 24 * 1.8e9 * 8192 * 0.5
    assert linear.est_us == pytest.approx(1e6 * max(8192 / peak_fp32, 1000 / 1.6e12))
    assert per_step == pytest.approx(sum(r.est_us for r in rows))


def test_summary_cli_writes_csv_and_json(matmul_profile, tmp_path, capsys):
    root, _ = matmul_profile
    payload = run_summary(root, chip="910B4", csv_path=tmp_path / "ops.csv", json_path=tmp_path / "ops.json", top=5)
    out = capsys.readouterr().out
    assert "aten::mm" in out and "estimate" in out.lower()
    with open(tmp_path / "ops.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["group"] == payload["rows"][0]["group"]
    data = json.loads((tmp_path / "ops.json").read_text())
    assert data["estimate"]["label"].startswith("estimated")
    assert data["rows"][0]["self_us"] > 0


def test_find_profile_errors_name_the_path(tmp_path, matmul_profile):
    with pytest.raises(UserError, match="no such profile directory"):
        find_profile(tmp_path / "missing")
    with pytest.raises(UserError, match="no profile here"):
        find_profile(tmp_path)
    root, _ = matmul_profile
    with pytest.raises(UserError, match="has ranks 0"):
        find_profile(root, rank=5)
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "events.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="events.npz"):
        EventTable.load(tmp_path / "rank0")


def test_cli_user_errors_exit_2(monkeypatch, capsys, matmul_profile):
    from npukit.cli import profile_main

    root, _ = matmul_profile
    for argv, message in (
        ([str(root), "--group-by", "thread"], "--group-by"),
        ([str(root), "--chip", "A100"], "--chip"),
        (["diff", str(root)], "npu-profile diff A B"),
        ([str(root / "nope")], "no such profile directory"),
    ):
        monkeypatch.setattr(sys, "argv", ["npu-profile", *argv])
        with pytest.raises(SystemExit) as exit_info:
            profile_main()
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
