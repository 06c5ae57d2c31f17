"""Collectives in the profile of a DDP run: gloo runs them on its own threads, so the ops of the
training threads did not show them (a 2-rank step with 70 ms of all_reduce showed no communication).
They are reported per collective, with the time the step waited for them, and a rank that waits
for a slower one gets the advisor's collective-wait finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from npukit.profiler.advisor import advise
from npukit.profiler.summary import load_profile, summarize

from .conftest import SLEEP_US

REPO = Path(__file__).resolve().parents[2]


def test_collectives_of_every_rank_are_in_its_summary(straggler_profile):
    for rank in (0, 1):
        summary = summarize(load_profile(straggler_profile / f"rank{rank}"))
        collectives = {row["collective"]: row for row in summary.communication}
        # one all_reduce bucket per step at least, as gloo ran it (steps 1-3: step 0 is the setup);
        # DDP's start, where it checks the parameters' shapes across ranks, is setup, not a step's
        assert collectives["gloo:all_reduce"]["calls"] >= 3
        assert collectives["gloo:all_reduce"]["total_us"] > 0
        assert "gloo:all_gather" not in collectives
        assert all(row["group"] != "gloo:all_reduce" for row in summary.rows)  # not an op of the step's threads


def test_the_rank_that_waits_for_a_straggler_is_told_so(straggler_profile):
    waiting = summarize(load_profile(straggler_profile / "rank0"))
    sleeping = summarize(load_profile(straggler_profile / "rank1"))
    # rank 0 waits about the sleep each step in the all_reduce for rank 1, which sleeps before its forward
    assert waiting.communication_exposed_us / waiting.steps > 0.6 * SLEEP_US
    assert sleeping.communication_exposed_us / sleeping.steps < waiting.communication_exposed_us / waiting.steps / 3
    findings = {finding.rule: finding for finding in advise(load_profile(straggler_profile / "rank0"))}
    assert findings["collective-wait"].severity == "high"
    assert "straggler" in findings["collective-wait"].change
    assert "collective-wait" not in {finding.rule for finding in advise(load_profile(straggler_profile / "rank1"))}


def test_npu_profile_prints_and_writes_the_collectives(straggler_profile):
    written = straggler_profile.parent / "summary.json"
    printed = subprocess.run([sys.executable, "-c", "from npukit.cli import profile_main; profile_main()",
                              str(straggler_profile / "rank0"), "--json", str(written)], capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200"))
    assert printed.returncode == 0, printed.stderr
    assert "collectives (on the process group's threads" in printed.stdout
    assert "gloo:all_reduce" in printed.stdout
    payload = json.loads(written.read_text())
    assert payload["communication"][0]["collective"] == "gloo:all_reduce"
    assert payload["communication_exposed_us"] > 0


def test_the_trace_viewers_open_every_rank_of_the_profile_folder(straggler_profile):
    """TensorBoard's profiler plugin (torch-tb-profiler) and HolisticTraceAnalysis read the folder
    as written: a trace per rank named as tensorboard_trace_handler names it, one run whose workers
    are the ranks (TensorBoard's distributed view), each rank told apart by HTA (the rank written
    into the trace: torch did not, the profiler started before init_process_group)."""
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("viewers_read.py")), str(straggler_profile)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [line for line in run.stdout.splitlines() if line.startswith("VIEWERS ")]
    viewers = json.loads(line.removeprefix("VIEWERS "))
    assert viewers["tensorboard"] == {"rank0": "RunProfile", "rank1": "RunProfile", "All": "DistributedRunProfile"}
    assert sorted(viewers["hta"]) == ["0", "1"]
    assert all({"gloo:all_reduce", "gloo:broadcast"} <= set(names) for names in viewers["hta"].values())
