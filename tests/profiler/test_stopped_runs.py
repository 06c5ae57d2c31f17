"""A run stopped from outside still ends with its profile, or says why it has none."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

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
