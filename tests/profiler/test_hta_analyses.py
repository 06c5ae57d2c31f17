"""HolisticTraceAnalysis's device analyses on npukit's traces (#32). The emulated NPU records no device
activity, so its traces held no kernels: HTA's temporal breakdown raised IndexError, its idle-time
breakdown ValueError ("No objects to concatenate") and its communication/computation overlap was NaN.
Each trace now carries the device's kernels (device_trace.py: the ops' estimated NPU time, the
collectives as run, on streams of their own): HTA's three breakdowns are numbers, the figures of
the kernels in the trace, which are npukit's own estimates."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from npukit.profiler.advisor import VIEW_OPS
from npukit.profiler.roofline import estimate_seconds, get_chip
from npukit.profiler.summary import op_dtypes
from npukit.profiler.table import KIND_COMM, KIND_OP, EventTable

from .conftest import npu_run_ranks

pytestmark = pytest.mark.slow  # two recorded DDP runs under npu-run, and HTA: about 50 s

# DDP in buckets of about one layer each: the all_reduce of the last layers' gradients runs while
# the backward of the first ones goes on (overlap), beside the launch of the next kernels.
DDP_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("hccl")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).npu()
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.3)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
for step in range(6):
    x = torch.randn(64, 256, device="npu")
    loss = ddp(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
"""
# HTA analyses the steps before the last recorded one: two of the three
STEPS = "1,1,3"
COMMUNICATION_KERNEL = re.compile(r"nccl.*Kernel")  # how HTA tells a communication kernel


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def ddp_profile(request, tmp_path_factory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp(f"hta{request.param}")
    (folder / "train.py").write_text(DDP_SCRIPT)
    npu_run_ranks(folder, request.param, "--profile-steps", STEPS, "--profile", "prof", "train.py")
    return folder / "prof", request.param


def hta_breakdowns(profile: Path) -> dict:
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("hta_breakdowns.py")), str(profile)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [line for line in run.stdout.splitlines() if line.startswith("BREAKDOWNS ")]
    return json.loads(line.removeprefix("BREAKDOWNS "))


def trace_events(profile: Path, rank: int) -> list[dict]:
    [trace] = profile.glob(f"rank{rank}.*.pt.trace.json")
    return json.loads(trace.read_text())["traceEvents"]


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return sum(max(0, min(a_end, b_end) - max(a_start, b_start)) for a_start, a_end in a for b_start, b_end in b)


def analysed_kernels(events: list[dict]) -> list[dict]:
    """The device kernels HTA analyses: those launched before the last recorded step began (HTA reads
    whole microseconds, starts rounded up)."""
    launches = {event["args"]["correlation"]: event for event in events if event.get("cat") == "cuda_runtime"}
    last_step = max(math.ceil(event["ts"]) for event in events if event["name"].startswith("ProfilerStep#"))
    return [event for event in events
            if event.get("cat") == "kernel" and launches[event["args"]["correlation"]]["ts"] < last_step]


def test_hta_breakdowns_are_the_figures_of_the_device_kernels(ddp_profile):
    """Temporal breakdown, idle time per stream and communication/computation overlap: finite, and what
    the kernels in each rank's trace add up to."""
    profile, ranks = ddp_profile
    found = hta_breakdowns(profile)
    assert isinstance(found["temporal"], dict), found["temporal"]  # IndexError before
    assert sorted(found["temporal"]) == [str(rank) for rank in range(ranks)]
    for rank in range(ranks):
        events = trace_events(profile, rank)
        kernels = analysed_kernels(events)
        interval = {id(k): (int(k["ts"]), int(k["ts"] + k["dur"])) for k in kernels}
        every = union(list(interval.values()))
        compute = union([interval[id(k)] for k in kernels if not COMMUNICATION_KERNEL.match(k["name"])])
        communication = union([interval[id(k)] for k in kernels if COMMUNICATION_KERNEL.match(k["name"])])
        assert compute and communication  # DDP's all_reduce runs on one rank too
        span = every[-1][1] - every[0][0]

        temporal = found["temporal"][str(rank)]
        assert all(math.isfinite(value) for value in temporal.values()), temporal
        assert temporal["kernel_time(us)"] == span
        assert temporal["idle_time(us)"] == span - length(every)
        assert temporal["compute_time(us)"] == length(compute)
        assert temporal["non_compute_time(us)"] == length(every) - length(compute)
        assert temporal["idle_time_pctg"] + temporal["compute_time_pctg"] + temporal["non_compute_time_pctg"] == \
            pytest.approx(100, abs=0.05)

        idle = found["idle"][str(rank)]
        assert isinstance(idle, list), idle  # ValueError before
        for stream in (1, 2):
            rows = [row for row in idle if row["stream"] == stream]
            on_stream = sorted(interval[id(k)] for k in kernels if k["args"]["stream"] == stream)
            gaps = sum(start - previous_end for (_, previous_end), (start, _) in zip(on_stream, on_stream[1:]))
            assert all(math.isfinite(row["idle_time"]) for row in rows), rows
            assert sum(row["idle_time"] for row in rows) == gaps

        shared = overlap(communication, compute) / length(communication)
        assert 0 <= shared <= 1
        assert found["overlap_pctg"][str(rank)] == pytest.approx(100 * shared, abs=0.006)  # NaN before
    if ranks == 2:  # the bucket all_reduces overlap the backward of the layers before them
        assert any(found["overlap_pctg"][str(rank)] > 0 for rank in range(ranks)), found["overlap_pctg"]


def test_the_device_kernels_are_npukits_estimates_and_the_collectives_as_run(ddp_profile):
    """A kernel per top-level op on the NPU but view ops, lasting its estimated NPU time (npu-profile
    --chip's roofline of the emulated chip) rounded up to whole microseconds; a communication kernel
    per collective, lasting what it took; each stream runs its kernels one at a time, in launch order,
    each after its launch."""
    profile, ranks = ddp_profile
    chip = get_chip("910B2")  # the emulated device's chip (NPUKIT_CHIP's default)
    for rank in range(ranks):
        table = EventTable.load(profile / f"rank{rank}")
        events = trace_events(profile, rank)
        labels = [event["args"]["labels"] for event in events if event["name"] == "process_labels" and event["pid"] == rank]
        assert labels == [f"NPU {rank}: kernel times estimated for 910B2"]

        names, devices = table.lookup(table.name_id), table.lookup(table.devices_id)
        rows = np.flatnonzero((table.kind == KIND_OP) & table.top_level
                              & np.array(["npu" in text for text in devices]) & ~np.isin(names, list(VIEW_OPS)))
        seconds = estimate_seconds(chip, table.flops[rows], table.bytes[rows], op_dtypes(table, rows))
        expected = Counter((names[row], max(1, math.ceil(round(s * 1e6, 6)))) for row, s in zip(rows, seconds) if s > 0)
        kernels = [event for event in events if event.get("cat") == "kernel"]
        computed = [k for k in kernels if not COMMUNICATION_KERNEL.match(k["name"])]
        assert Counter((k["name"], k["dur"]) for k in computed) == expected
        assert sum(k["args"]["estimated_us"] for k in computed) == pytest.approx(seconds.sum() * 1e6, abs=1e-3 * len(rows))
        assert "aten::t" in names[table.top_level] and "aten::t" not in {k["name"] for k in computed}

        collectives = np.flatnonzero(table.kind == KIND_COMM)
        communicated = [k for k in kernels if COMMUNICATION_KERNEL.match(k["name"])]
        assert sorted(k["dur"] for k in communicated) == sorted(max(1, math.ceil(ns / 1e3)) for ns in table.dur_ns[collectives])
        assert {k["name"] for k in communicated} == {"ncclKernel_all_reduce"}

        launches = {event["args"]["correlation"]: event for event in events if event.get("cat") == "cuda_runtime"}
        assert len(launches) == len(kernels)
        for stream in (1, 2):
            in_order = sorted((k for k in kernels if k["args"]["stream"] == stream), key=lambda k: k["args"]["correlation"])
            for before, after in zip(in_order, in_order[1:]):
                assert after["ts"] >= before["ts"] + before["dur"]
            launch_ends = [launches[k["args"]["correlation"]] for k in in_order]
            assert all(k["ts"] >= launch["ts"] + launch["dur"] for k, launch in zip(in_order, launch_ends))
