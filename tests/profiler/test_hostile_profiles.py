"""Profiles from elsewhere: a broken or crafted events.npz / meta.json is named, never a traceback,
never another op's name shown for a row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npukit.errors import UserError
from npukit.profiler.table import EVENTS_FILE, META_FILE, EventTable, TableBuilder, write_meta


def _profile(directory: Path) -> None:
    builder = TableBuilder()
    step = builder.add("ProfilerStep#0", start_ns=0, dur_ns=1000, step=0)
    builder.add("aten::mm", start_ns=10, dur_ns=500, parent=step, step=0, top_level=True, shapes="[[8, 8], [8, 8]]")
    builder.add("aten::add", start_ns=600, dur_ns=100, parent=step, step=0, top_level=True)
    builder.build().save(directory)
    write_meta(directory, {"steps": 1})


def _rewrite(directory: Path, **changes) -> None:
    with np.load(directory / EVENTS_FILE, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    for name, change in changes.items():
        arrays[name] = change(arrays[name])
    with open(directory / EVENTS_FILE, "wb") as handle:
        np.savez(handle, **arrays)


def _truncate(directory: Path) -> None:
    path = directory / EVENTS_FILE
    path.write_bytes(path.read_bytes()[:200])


CASES = {
    "truncated events.npz": (_truncate, r"not a readable npukit event table"),
    "empty events.npz": (lambda d: (d / EVENTS_FILE).write_bytes(b""), r"not a readable npukit event table"),
    "negative name_id": (lambda d: _rewrite(d, name_id=lambda c: c - 5), r"column name_id refers to strings outside"),
    "name_id past the pool": (lambda d: _rewrite(d, name_id=lambda c: c + 1000), r"column name_id refers to strings"),
    "parent past the table": (lambda d: _rewrite(d, parent=lambda c: c + 99), r"column parent refers to rows outside"),
    "float column of text": (lambda d: _rewrite(d, dur_ns=lambda c: c.astype(str)), r"column dur_ns holds"),
    "short column": (lambda d: _rewrite(d, step=lambda c: c[:1]), r"column step has 1 rows"),
    "meta.json a list": (lambda d: (d / META_FILE).write_text("[1, 2]"), r"meta.json: expected an object"),
    "meta.json not text": (lambda d: (d / META_FILE).write_bytes(b"\xff\xfe\x00"), r"meta.json: (not a text file|invalid JSON)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_profile_is_named(tmp_path, case):
    _profile(tmp_path)
    assert len(EventTable.load(tmp_path)) == 3  # the unbroken profile loads
    breaker, message = CASES[case]
    breaker(tmp_path)
    with pytest.raises(UserError, match=message):
        EventTable.load(tmp_path)


def test_a_profile_recorded_before_the_framework_column_loads_with_none_marked(tmp_path):
    _profile(tmp_path)
    with np.load(tmp_path / EVENTS_FILE, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files if name != "framework"}
    with open(tmp_path / EVENTS_FILE, "wb") as handle:
        np.savez(handle, **arrays)
    table = EventTable.load(tmp_path)
    assert len(table) == 3 and table.framework.dtype == np.bool_ and not table.framework.any()
    CASES["float column of text"][0](tmp_path)  # the other columns are still checked
    with pytest.raises(UserError, match=CASES["float column of text"][1]):
        EventTable.load(tmp_path)


@pytest.mark.parametrize("case", ["empty events.npz", "negative name_id"])
def test_npu_profile_exits_2_with_the_file_named(tmp_path, case):
    _profile(tmp_path / "prof")
    CASES[case][0](tmp_path / "prof")
    run = subprocess.run([str(Path(sys.executable).with_name("npu-profile")), "prof"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert run.returncode == 2 and "events.npz" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr and "Aborted" not in run.stderr + run.stdout


@pytest.mark.parametrize("option", ["--profile", "--dump", "--replay"])
def test_an_output_that_is_a_file_is_refused_before_the_script_runs(tmp_path, option):
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "train.py").write_text("print('RAN')\n")
    run = subprocess.run([str(Path(sys.executable).with_name("npu-run")), option, "afile", "train.py"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "afile" in run.stderr and "not a directory" in run.stderr
    assert "RAN" not in run.stdout and "Traceback" not in run.stderr


@pytest.mark.parametrize("option", ["--profile", "--dump", "--replay", "--overflow-dir"])
def test_an_output_below_a_file_is_refused_before_the_script_runs(tmp_path, option):
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "train.py").write_text("print('RAN')\n")
    extra = ["--detect-overflow"] if option == "--overflow-dir" else []
    run = subprocess.run([str(Path(sys.executable).with_name("npu-run")), *extra, option, "afile/sub", "train.py"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "afile/sub cannot be created: afile is not a directory" in run.stderr
    assert "RAN" not in run.stdout and "Traceback" not in run.stderr


def test_an_output_on_a_read_only_file_system_is_refused_at_once(tmp_path, monkeypatch):
    import os

    from npukit.accuracy.dump import DumpSession
    from npukit.accuracy.replay import ReplaySession
    from npukit.profiler.record import ProfileSession

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    for make, option in ((lambda: DumpSession(tmp_path / "d"), "--dump"), (lambda: ProfileSession(tmp_path / "p"), "--profile"),
                         (lambda: ReplaySession(tmp_path / "r"), "--replay")):
        with pytest.raises(UserError, match=rf"{option}: .* cannot be written \(.* is read-only or not writable\)"):
            make()
