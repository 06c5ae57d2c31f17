"""Profiles of real training scripts: the launcher is never user code; foreach ops stay one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from npukit.profiler.extract import _list_shapes

SCRIPT = textwrap.dedent("""
    import torch
    w = torch.randn(128, 128, device="npu", requires_grad=True)
    data = torch.randn(512, 128, device="npu")
    opt = torch.optim.AdamW([w], lr=0.1, foreach=True)
    for step in range(3):
        x = data[torch.randint(0, 512, (256,), device="npu")]
        loss = (x @ w).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_top_level_script_ops_belong_to_the_script_not_the_launcher(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    bin_dir = Path(sys.executable).parent
    run = subprocess.run([str(bin_dir / "npu-run"), "--profile", "prof", "train.py"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "USDT:" not in run.stderr and "profiler_start" not in run.stderr  # libkineto's trace markers
    shown = subprocess.run([str(bin_dir / "npu-profile"), "prof", "--group-by", "stack", "--json", "p.json"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "npu-run" not in shown.stdout
    stacks = json.loads((tmp_path / "p.json").read_text())
    text = json.dumps(stacks)
    assert "npu-run:" not in text and "train.py in <module>" in text  # x @ w: the script, line unknown
    assert "train.py:8 in <module>" in text  # .square() is a call: its line is known


def test_only_the_trace_markers_are_taken_from_stderr_around_a_recording_start(capfd):
    import os

    from npukit.profiler.record import _without_kineto_markers

    with _without_kineto_markers():
        os.write(2, b"USDT:2026-11-24 12:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR: something the user must see\n")
        print("a Python warning", file=sys.stderr)
    err = capfd.readouterr().err
    assert "USDT" not in err
    assert "ERROR: something the user must see" in err and "a Python warning" in err


def test_a_long_tensor_list_is_summarised_on_one_line():
    assert _list_shapes(["[2]", "[3]"]) == "([2], [3])"
    shapes = ["[64, 64]"] * 20 + ["[64]"] * 18 + ["[3]", "[5]"]
    assert _list_shapes(shapes) == "(40 tensors: [64, 64] x20, [64] x18, +2 more shapes)"


def test_a_garbage_collection_during_the_profilers_start_costs_nothing(tmp_path):
    """Collections as often as possible: one lands inside torch's lazy imports as the profiler
    starts. The GC marker must not import there (it corrupted the import locks: KeyError in
    _find_and_load, the run and its profile lost)."""
    (tmp_path / "train.py").write_text("import gc\ngc.set_threshold(3, 1, 1)\n" + SCRIPT)
    run = subprocess.run([str(Path(sys.executable).parent / "npu-run"), "--profile", "prof", "train.py"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "halted" not in run.stderr and (tmp_path / "prof" / "rank0" / "events.npz").is_file()
