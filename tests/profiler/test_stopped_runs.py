"""A run stopped from outside still ends with its profile, or says why it has none."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import torch

import npukit.profiler
from npukit.profiler import record
from npukit.profiler.table import EventTable

from .conftest import REPO

SERVER = textwrap.dedent("""
    import sys, time, torch
    x = torch.randn(64, 64, device="npu")
    for served in range(10**9):  # a server: runs until it is stopped
        y = x @ x
        if served == 5:
            print("serving", flush=True)
        time.sleep(0.02)
""")


def test_sigterm_during_a_whole_run_profile_writes_it_says_so_and_exits_143(tmp_path):
    """How `docker stop`, Kubernetes and `kill` stop a server: the profile was lost without a word
    (Ctrl-C wrote it). Now SIGTERM ends the run as Ctrl-C does, with the shell's status for it."""
    (tmp_path / "srv.py").write_text(SERVER)
    import os

    run = subprocess.Popen([sys.executable, "-m", "npukit.run", "--profile", "prof", "srv.py"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert run.stdout.readline().strip() == "serving"
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    table = EventTable.load(tmp_path / "prof" / "rank0")
    names = set(table.lookup(table.name_id))
    assert "aten::mm" in names
    assert "SIGTERM" in stderr and "prof/rank0" in stderr  # what stopped it, where the profile is
    assert "Traceback" not in stderr


RANKS_SERVER = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("hccl")
    x = torch.randn(64, 64, device="npu")
    for served in range(10**9):
        y = x @ x
        if served == 5:
            os.write(1, f"serving {dist.get_rank()}\\n".encode())  # one write: the ranks share the pipe
        time.sleep(0.02)
""")


def test_sigterm_to_the_launching_npu_run_reaches_every_rank_and_each_writes_its_profile(tmp_path):
    """`kill` and `docker stop` signal one process, the launcher: torchrun and the ranks ran on, and a
    stopped container lost every rank's profile. Ctrl-C reaches the whole process group."""
    (tmp_path / "srv.py").write_text(RANKS_SERVER)
    import os

    run = subprocess.Popen([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", "--profile", "prof",
                            "srv.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    try:
        serving = {run.stdout.readline().strip(), run.stdout.readline().strip()}
        assert serving == {"serving 0", "serving 1"}
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    for rank in (0, 1):
        table = EventTable.load(tmp_path / "prof" / f"rank{rank}")
        assert "aten::mm" in set(table.lookup(table.name_id))
        assert f"the profile of what it ran is in prof/rank{rank}" in stderr


def _train(steps: int) -> None:
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_whole_run_profile_that_grows_is_read_and_written_as_it_goes(tmp_path, monkeypatch):
    """A long whole-run profile held every step's events until the run ended (a compiled nanoGPT: minutes
    at 7 GB after training, then nothing). When the process has grown by the bound since its recording
    cycle began, the cycle ends at the step boundary, is read into the table and its trace written;
    the next cycle starts a step later."""
    monkeypatch.setattr(record, "CYCLE_GROWTH_BYTES", -1)  # every recorded step grows past it
    with npukit.profiler.profile(tmp_path) as session:
        _train(5)
    table = EventTable.load(tmp_path / "rank0")
    # step 0, the setup, one cycle; step 1 between cycles; step 2 a cycle; step 3 between; step 4 a cycle
    assert table.meta["steps"] == [2, 4] and table.meta["steps_not_recorded"] == [1, 3, 5]
    assert len(session.traces) == 3 and all((tmp_path / name).is_file() for name in session.traces)
    names = table.lookup(table.name_id)
    assert [(names[table.step == step] == "aten::addmm").sum() for step in (2, 4)] == [1, 1]


def test_a_whole_run_profile_past_its_event_bound_stops_recording_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(record, "CYCLE_GROWTH_BYTES", -1)
    monkeypatch.setattr(record, "MAX_EVENTS", 1)  # past it once the first cycle (step 0) is read
    with npukit.profiler.profile(tmp_path, trace=False):
        _train(5)
    err = capsys.readouterr().err
    assert "stopped recording at step 2" in err and "--profile-steps" in err
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["recording_stopped"].startswith("at step 2")
    assert (table.lookup(table.name_id) == "aten::addmm").sum() == 1  # step 0's, kept
