"""The cluster view, `npu-profile DIR` over every rank: per-rank step split, the slowest rank and the
wait it causes in each collective, the send/recv matrix, one trace of all ranks; on profiles
recorded by `npu-run --nproc-per-node N` (2 ranks; 8 in tests/npu_backend/test_eight_ranks.py), and
with a rank whose table is broken."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npukit.errors import UserError
from npukit.profiler.advisor import advise, advise_cluster
from npukit.profiler.cluster import _uncovered_ns, _within, cluster_summary, load_ranks, parse_ranks
from npukit.profiler.commands import run_cluster
from npukit.profiler.summary import covered_ns, interval_union
from npukit.profiler.table import EVENTS_FILE, KIND_COMM, KIND_OP, EventTable

from .conftest import REPO, SLEEP_US, npu_run_profile


def npu_profile(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from npukit.cli import profile_main; profile_main()", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200"))


def test_the_sleeping_rank_is_named_slowest_with_the_wait_it_causes(straggler_profile):
    cluster = cluster_summary(load_ranks(straggler_profile))
    assert cluster.ranks == [0, 1] and cluster.start_step_left_out == 0 and cluster.steps == [1, 2, 3]
    assert cluster.slowest["rank"] == 1 and cluster.slowest["basis"] == "collectives"
    per_rank = {row["rank"]: row for row in cluster.per_rank}
    # rank 0 waits about the sleep each step, doing nothing else; rank 1 sleeps instead (a host gap)
    assert 0.6 * SLEEP_US < per_rank[0]["waiting_us"] < 3 * SLEEP_US
    assert per_rank[1]["waiting_us"] < per_rank[0]["waiting_us"] / 3
    assert per_rank[1]["host_gap_us"] > 0.8 * SLEEP_US > per_rank[0]["host_gap_us"]
    assert 0.6 * SLEEP_US < cluster.slowest["wait_caused_us"] < 3 * SLEEP_US
    for row in cluster.per_rank:  # the split adds up to the step
        assert row["compute_us"] + row["comm_exposed_us"] + row["host_gap_us"] == pytest.approx(row["step_us"], rel=1e-3)
    # in each all_reduce after DDP's first steps, rank 0 waits for rank 1 about the sleep
    late = [call for call in cluster.calls if call["collective"] == "gloo:all_reduce" and call["step"] >= 2]
    assert late and all(call["last_rank"] == 1 for call in late)
    assert 0.6 * SLEEP_US < statistics.median(call["wait_us"][0] for call in late) < 3 * SLEEP_US
    assert all(call["wait_us"][1] == 0 for call in late)
    [all_reduce] = [row for row in cluster.collectives if row["collective"] == "gloo:all_reduce"]
    assert all_reduce["waited_for_rank"] == 1 and all_reduce["bytes_per_call"] == 4 * (4 * 256 * 256 + 4 * 256)
    assert all_reduce["wait_us"]["0"] > 2 * SLEEP_US and all_reduce["skew_us"] >= all_reduce["wait_us"]["0"]
    assert not cluster.p2p and not cluster.warnings


def test_the_advisor_names_the_straggler(straggler_profile):
    findings = {f.rule: f for f in advise_cluster(cluster_summary(load_ranks(straggler_profile)))}
    straggler = findings["straggler-rank"]
    assert straggler.severity == "high" and straggler.extra["rank"] == 1
    assert "Rank 1" in straggler.title and "--rank 1" in straggler.change
    assert any(line.startswith("rank 0 waits") for line in straggler.evidence)


def test_npu_profile_shows_every_rank_and_writes_csv_json_and_one_trace(straggler_profile, tmp_path):
    run = npu_profile(str(straggler_profile), "--advise", "--json", "c.json", "--csv", "c.csv", "--trace", "t.json",
                      cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cluster: " in run.stdout and "(2 ranks: 0-1)" in run.stdout
    assert "slowest rank: 1" in run.stdout and "1 slowest" in run.stdout
    assert "straggler-rank" in run.stdout and "rank 1 (the slowest), its own profile" in run.stdout
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["view"] == "cluster" and payload["slowest"]["rank"] == 1
    assert {row["rank"] for row in payload["per_rank"]} == {0, 1}
    assert payload["advice"][0]["rule"] == "straggler-rank"
    header = (tmp_path / "c.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["rank", "steps", "events", "step_us"]
    assert "rank1_wait_us" in (tmp_path / "c.collectives.csv").read_text().splitlines()[0]
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"} and trace["otherData"]["aligned_clock"]
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "collective" and e["pid"] == 0
             and e["name"] == "gloo:all_reduce"]
    assert waits and max(e["args"]["wait_us"] for e in waits) > 0.6 * SLEEP_US
    # the ranks share the host's clock: rank 1's all_reduce ends close to rank 0's
    ends = {pid: max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("name") == "gloo:all_reduce"
                     and e["pid"] == pid) for pid in (0, 1)}
    assert abs(ends[0] - ends[1]) < 0.5 * SLEEP_US


def test_one_rank_is_still_shown_alone(straggler_profile, tmp_path):
    run = npu_profile(str(straggler_profile), "--rank", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"profile: {straggler_profile / 'rank1'}" in run.stdout and "cluster:" not in run.stdout
    run = npu_profile(str(straggler_profile), "--ranks", "1", "--json", "one.json", cwd=tmp_path)
    assert run.returncode == 0 and json.loads((tmp_path / "one.json").read_text())["ranks"] == [1]
    for args, message in ((["--rank", "0", "--ranks", "all"], "give one of them"),
                          (["--chip", "910B2"], "add --rank N"), (["--rank", "0", "--trace", "t.json"], "--ranks"),
                          (["--ranks", "0,7"], "no profile of rank(s) 7"), (["--ranks", "x"], "expected `all`")):
        run = npu_profile(str(straggler_profile), *args, cwd=tmp_path)
        assert run.returncode == 2 and message in run.stderr + run.stdout, (args, run.stderr)


def _copy(profile: Path, target: Path) -> Path:
    shutil.copytree(profile, target, ignore=shutil.ignore_patterns("*.json"))
    return target


def test_a_rank_with_a_broken_table_is_named_and_the_others_shown(straggler_profile, tmp_path):
    prof = _copy(straggler_profile, tmp_path / "prof")
    (prof / "rank1" / EVENTS_FILE).write_bytes(b"PK\x03\x04 not a zip")
    loaded = load_ranks(prof)
    assert sorted(loaded.tables) == [0] and loaded.skipped[0]["rank"] == 1
    run = npu_profile("prof", "--ranks", "all", "--json", "c.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 1 left out" in run.stdout and f"rank1/{EVENTS_FILE}" in run.stdout
    assert "not a readable npukit event table" in run.stdout and "Traceback" not in run.stderr
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["ranks"] == [0] and payload["skipped_ranks"][0]["rank"] == 1 and payload["slowest"] is None
    (prof / "rank0" / EVENTS_FILE).write_bytes(b"")
    run = npu_profile("prof", cwd=tmp_path)
    assert run.returncode == 2 and "no rank of the profile could be read" in run.stderr
    assert f"rank0/{EVENTS_FILE}" in run.stderr and f"rank1/{EVENTS_FILE}" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_rank_that_wrote_no_profile_is_reported(straggler_profile, tmp_path):
    prof = _copy(straggler_profile, tmp_path / "prof")
    shutil.copytree(prof / "rank1", prof / "rank2")  # three folders of a world of 2 ...
    (prof / "rank2" / "meta.json").write_text(json.dumps({"world_size": 4}))  # ... one says 4
    cluster = cluster_summary(load_ranks(prof))
    assert cluster.ranks == [0, 1, 2]
    assert any("rank(s) 3 of a world of 4 wrote no profile" in w for w in cluster.warnings)


P2P_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("hccl")
rank = dist.get_rank()
x = torch.ones(1000, device="npu")
for step in range(3):
    if rank == 0:
        dist.send(x, 1)
        dist.irecv(x, 1).wait()
    else:
        dist.recv(x, 0)
        dist.isend(x * 2, 0).wait()
    ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, torch.empty_like(x), 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    dist.all_reduce(x)
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).step()
dist.destroy_process_group()
"""


def test_send_and_recv_make_the_communication_matrix(tmp_path):
    prof = npu_run_profile(tmp_path, P2P_SCRIPT, 2)
    cluster = cluster_summary(load_ranks(prof))
    cells = {(c["src"], c["dst"]): c for c in cluster.p2p}
    assert set(cells) == {("0", "1"), ("1", "0")}
    for cell in cells.values():  # 3 steps x (send or isend + batched isend) of 1000 float32
        assert cell["sends"] == cell["recvs"] == 6 and cell["bytes"] == 6 * 4000
        assert cell["send_us"] > 0 and cell["recv_us"] > 0
    run = run_cluster(prof, console=_quiet())
    assert run["p2p"] == cluster.p2p
    [all_reduce] = cluster.collectives
    assert all_reduce["collective"] == "gloo:all_reduce" and all_reduce["calls"] == 3


def _quiet():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)  # noqa: SIM115 (closed with the process)


def test_interval_helpers_match_a_brute_force_count():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 1000, 200)
    ends = starts + rng.integers(0, 40, 200)
    merged = interval_union(starts, ends)
    covered = np.zeros(1100, dtype=bool)
    for s, e in zip(starts, ends):
        covered[s:e] = True
    assert covered_ns(merged) == covered.sum()
    windows = interval_union(np.array([100, 500]), np.array([300, 520]))
    cut = _within(merged, windows)
    in_windows = np.zeros(1100, dtype=bool)
    in_windows[100:300] = in_windows[500:520] = True
    assert covered_ns(cut) == (covered & in_windows).sum()
    assert np.all(cut[1] > cut[0])
    probes = rng.integers(0, 1050, 50)
    probe_ends = probes + rng.integers(0, 60, 50)
    assert _uncovered_ns(probes, probe_ends, merged).tolist() == [int((~covered[a:b]).sum())
                                                                  for a, b in zip(probes, probe_ends)]


def test_rank_selections():
    assert parse_ranks("all") is None
    assert parse_ranks("0,2-3") == {0, 2, 3}
    with pytest.raises(UserError, match="expected `all`"):
        parse_ranks("1-")


# A correct FSDP2 run under GradScaler, with work after its training loop (an evaluation pass).
FSDP2_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
dist.init_process_group("hccl")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).npu()
fully_shard(model[0])
fully_shard(model[2])
fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("npu")
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(4):
    x, y = torch.randn(4, 16, generator=g).npu(), torch.randn(4, 4, generator=g).npu()
    with torch.autocast("npu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
with torch.no_grad():
    model(x)
dist.destroy_process_group()
"""


def test_fsdp2_ranks_get_advice_on_their_own_code_only_and_work_after_the_loop_is_no_step(tmp_path):
    """FSDP2's own Python works on CPU tensors at lazy init and views its flat all-gather buffer
    in many shapes (one call site: the module's forward): neither is the user's to change. The
    evaluation after the last step is not a fifth step."""
    prof = npu_run_profile(tmp_path, FSDP2_SCRIPT, 2)
    cluster = cluster_summary(load_ranks(prof))
    assert cluster.steps == [1, 2, 3]  # 4 steps, the first (start-up) left out; not [1, 2, 3, 4]
    for rank in (0, 1):
        table = EventTable.load(prof / f"rank{rank}")
        assert table.framework[table.kind == KIND_OP].any()  # FSDP's ops are there, marked
        fired = {finding.rule: finding for finding in advise(table)}
        assert not {"host-ops", "dynamic-shapes"} & set(fired), [fired[r].evidence for r in fired]
        # each step moves its batch (x, y) to the NPU; model.npu() before the loop is not per step
        copies = fired["host-device-copies"]
        assert "2/step host-to-device and 0/step device-to-host" in copies.summary, copies.summary
        assert all("script.py:14" in line for line in copies.evidence), copies.evidence
        # the rank's Chrome trace names FSDP's reduce_scatter as the table does (gloo records it as an
        # all_reduce; the trace said so)
        strings = table.string_array()
        in_table = sorted(strings[table.name_id[table.kind == KIND_COMM]].tolist())
        [trace] = prof.glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        assert sorted(e["name"] for e in events if str(e.get("name", "")).startswith("gloo:")) == in_table
        assert "gloo:reduce_scatter" in in_table


MS = 1_000_000


def _rank_table(rank: int, sleeper: int, early: int) -> EventTable:
    """Three 100 ms steps of one rank. The sleeper sleeps 30 ms, then computes 60 ms; the others compute
    60 ms at once. The step ends in an all_reduce (at 95 ms everywhere) the others join at 60 ms and the
    sleeper at 90 ms: they wait 30 ms with nothing else to do. Two more all_reduces (DDP's buckets) run
    during the compute, rank `early` joining them last by 24 ms: waits no one notices, the compute
    goes on."""
    from npukit.profiler.table import KIND_ANNOTATION, TableBuilder

    builder = TableBuilder()
    for step in (1, 2, 3):
        base = step * 100 * MS
        builder.add(f"ProfilerStep#{step}", start_ns=base, dur_ns=100 * MS, kind=KIND_ANNOTATION, step=step)
        compute_at = base + (30 * MS if rank == sleeper else 0)
        builder.add("aten::mm", start_ns=compute_at, dur_ns=60 * MS, step=step, top_level=True)
        joined = base + (90 if rank == sleeper else 60) * MS
        builder.add("gloo:all_reduce", start_ns=joined, dur_ns=base + 95 * MS - joined, kind=KIND_COMM, thread=1,
                    step=step)
        for bucket_end in (45, 58):
            joined = base + (bucket_end - 3 if rank == early else bucket_end - 27) * MS
            builder.add("gloo:all_reduce", start_ns=joined, dur_ns=base + bucket_end * MS - joined, kind=KIND_COMM,
                        thread=1, step=step)
    table = builder.build({"rank": rank, "world_size": 8, "schedule": None, "origin_ns": 0})
    order = np.argsort(table.start_ns, kind="stable")
    for name in EventTable.column_names():
        setattr(table, name, getattr(table, name)[order])
    return table


def test_the_slowest_rank_is_the_one_the_others_lose_time_for_as_the_table_shows(tmp_path):
    """8 ranks, rank 1 sleeping 30 ms a step: the cluster summary named rank 5 slowest, whose lateness to
    collectives running beside the compute cost no one anything, while its own table showed rank 1 with
    the largest host gaps and the largest step without waiting."""
    from npukit.profiler.table import write_meta

    for rank in range(8):
        table = _rank_table(rank, sleeper=1, early=5)
        table.save(tmp_path / f"rank{rank}")
        write_meta(tmp_path / f"rank{rank}", table.meta)
    cluster = cluster_summary(load_ranks(tmp_path))
    assert cluster.steps == [1, 2, 3]
    per_rank = {row["rank"]: row for row in cluster.per_rank}
    assert max(per_rank, key=lambda r: per_rank[r]["host_gap_us"]) == 1
    assert max(per_rank, key=lambda r: per_rank[r]["busy_us"]) == 1
    assert cluster.slowest["rank"] == 1 and cluster.slowest["basis"] == "collectives"
    assert cluster.slowest["wait_caused_us"] == pytest.approx(30_000, rel=0.01)  # per step, no more
    [all_reduce] = cluster.collectives
    assert all_reduce["waited_for_rank"] == 1
