"""Two nodes on one machine (examples/multinode/two_nodes.sh): network namespaces joined by a veth
pair, loopback-range addresses, torchrun's c10d rendezvous; 2 nodes x 4 ranks of DDP training
with a straggler and a rank whose batch overflows fp16, profiled and watched by npu-run. Run where
network namespaces can be made (root with ip netns), as CI is."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npukit.profiler.cluster import cluster_summary, load_ranks
from tests.npu_backend.conftest import DDP_TRAIN as TRAIN

# Two network namespaces of four ranks each: whole-run e2e, kept out of the 20-minute main suite and run
# in CI's slow stage.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "multinode" / "two_nodes.sh"



def _netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"npkprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


@pytest.mark.skipif(not _netns_available(), reason="needs root and ip netns (CI has both)")
def test_two_nodes_of_four_ranks_train_together_and_the_tools_name_the_straggler_and_the_overflow(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    output = _two_nodes(tmp_path, "--", "--profile", "prof", "--detect-overflow", "--", "train.py")
    # eight ranks in one world over both nodes, trained to the same weights
    for rank in range(8):
        assert f"rank {rank} of 8 on node {rank // 4}: weights equal everywhere True" in output, output[-4000:]
    # the cluster view of the profile names the sleeping rank as the one the others wait for
    cluster = cluster_summary(load_ranks(tmp_path / "prof"))
    assert cluster.slowest["rank"] == 5
    waits = {row["rank"]: row for row in cluster.per_rank}
    assert sorted(waits) == list(range(8))
    # the overflow began on rank 6 (node 1) and reached the others through the all-reduce
    began = json.loads((tmp_path / "overflow" / "overflow.json").read_text())["across_ranks"]
    assert (began["rank"], began["step"], began["name"]) == (6, 2, "Functional.linear.0.forward")
    assert began["ranks_reached_through_a_collective"] == [0, 1, 2, 3, 4, 5, 7]


COMPARED = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
    dist.init_process_group("hccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).npu())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g).npu(), torch.randn(4, 4, generator=g).npu()
    if len(sys.argv) > 1 and rank == int(sys.argv[1]):
        x = x * 3  # a bug on this rank only
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    dist.destroy_process_group()
""")


def _two_nodes(tmp_path: Path, *arguments: str) -> str:
    """examples/multinode/two_nodes.sh -n 4 ARGUMENTS in tmp_path: both nodes' output. In a session
    of its own: on a time-out the script is stopped with SIGTERM, so its trap ends both nodes'
    processes and removes the namespaces."""
    env = dict(os.environ, PYTHONPATH=str(REPO), LOGS=str(tmp_path), PORT=str(29400 + os.getpid() % 500),
               NPU_RUN=f"{sys.executable} -m npukit.run")
    run = subprocess.Popen(["bash", str(SCRIPT), "-n", "4", *arguments], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
        pytest.fail(f"the two nodes did not finish in 300 s: {output[-4000:]}")
    assert run.returncode == 0, output[-4000:]
    return output


@pytest.mark.skipif(not _netns_available(), reason="needs root and ip netns (CI has both)")
def test_over_two_nodes_a_bug_on_one_rank_is_named_there_by_npu_compare(tmp_path):
    from npukit.accuracy.compare import compare_dirs

    (tmp_path / "train.py").write_text(COMPARED)
    _two_nodes(tmp_path, "--", "--golden", "--dump", "golden", "--", "train.py")
    _two_nodes(tmp_path, "--", "--dump", "npu", "--", "train.py", "6")  # rank 6, on node 1
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu")
    assert [pair.pair for pair in result.pairs] == [f"step0/rank{rank}" for rank in range(8)]
    began = result.across_ranks
    assert (began.ranks, began.entry, began.phase) == ([6], "Functional.linear.0.forward", "forward")
    assert began.reached == [0, 1, 2, 3, 4, 5, 7]
