"""npu-compare of multi-rank dumps (`npu-run --nproc-per-node N --dump DIR`): every rank pair
compared (a pair per process), a summary per rank, and where a divergence began across ranks: a
bug on one rank is named at that rank, not at the ranks DDP's gradient all_reduce carried it to."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from npukit.accuracy.cli_compare import run_compare
from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.report import print_terminal
from npukit.console import number_ranges

ROOT = Path(__file__).resolve().parents[2]

# A small DDP model, one step, each rank its own batch. `input R` scales rank R's batch, `eps R`
# gives rank R's LayerNorm another eps, `hook R` zeroes rank R's share of a weight's gradient: a bug
# on one rank only.
SCRIPT = """
import sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
dist.init_process_group("hccl")
rank = dist.get_rank()
bug, bug_rank = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else (None, -1)
torch.manual_seed(0)
eps = 0.5 if bug == "eps" and rank == bug_rank else 1e-5
model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16, eps=eps), nn.Tanh(), nn.Linear(16, 4)).npu()
ddp = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(4, 8, generator=g).npu(), torch.randn(4, 4, generator=g).npu()
if bug == "input" and rank == bug_rank:
    x = x * 3
if bug == "hook" and rank == bug_rank:  # this rank's share of the first weight's gradient, zeroed
    model[0].weight.register_hook(lambda grad: grad * 0)
loss = F.mse_loss(ddp(x), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
dist.destroy_process_group()
"""


def npu_run(folder: Path, nproc: int, dump: str, *args: str) -> float:
    """`npu-run --nproc-per-node N [--golden] --dump DIR train.py args` (statistics dumps); seconds taken."""
    started = time.perf_counter()
    golden = ["--golden"] if dump == "golden" else []
    run = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", str(nproc), *golden,
                          "--dump", dump, "train.py", *args], capture_output=True, text=True, cwd=folder,
                         timeout=400, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """golden, a correct NPU run, and one whose rank 3 has its input scaled: 4 ranks each."""
    folder = tmp_path_factory.mktemp("four_ranks")
    (folder / "train.py").write_text(SCRIPT)
    seconds = [npu_run(folder, 4, "golden"), npu_run(folder, 4, "npu"), npu_run(folder, 4, "bug", "input", "3")]
    print(f"4-rank runs: {', '.join(f'{s:.1f} s' for s in seconds)}")
    return folder


def test_a_correct_run_diverges_on_no_rank(four_ranks):
    result = compare_dirs(four_ranks / "golden", four_ranks / "npu")
    assert [pair.pair for pair in result.pairs] == [f"step0/rank{rank}" for rank in range(4)]
    assert not result.failed() and result.across_ranks is None
    assert all(pair.divergence is None for pair in result.pairs) and result.counts()["error"] == 0


def test_the_rank_whose_input_was_scaled_is_where_it_began(four_ranks, tmp_path):
    console_out = io.StringIO()
    from rich.console import Console

    console = Console(file=console_out, width=220, force_terminal=True)  # the progress bar runs too
    code = run_compare(four_ranks / "golden", four_ranks / "bug", tmp_path / "rows.csv", tmp_path / "r.json", None,
                       5, [], 2, console)
    assert code == 1
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console_out.getvalue())
    assert ("it began on rank 3, step 0 at Functional.linear.0.forward (module module.0), in the forward; it reached"
            " ranks 0-2 through DDP's gradient all_reduce (first seen there at Module.module.0.Linear.parameters_grad.0)"
            ) in " ".join(text.split())
    report = json.loads((tmp_path / "r.json").read_text())
    began = report["across_ranks"]
    assert (began["ranks"], began["entry"], began["phase"], began["reached"], began["clean"]) == (
        [3], "Functional.linear.0.forward", "forward", [0, 1, 2], [])
    ranks = {record["Rank"]: record for record in report["ranks"]}
    assert ranks[3]["First Divergence"] == "Functional.linear.0.forward" and ranks[3]["Across Ranks"] == "source"
    for rank in range(3):  # their own ops match: only the gradients the all_reduce averaged differ
        assert ranks[rank]["First Divergence"] is None and ranks[rank]["Across Ranks"] == "reached"
        assert ranks[rank]["First Difference"] == "Module.module.0.Linear.parameters_grad.0"
    with open(tmp_path / "rows.ranks.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["Step/Rank"], row["First Divergence"], row["Across Ranks"]) for row in rows] == [
        ("step0/rank0", "", "reached"), ("step0/rank1", "", "reached"), ("step0/rank2", "", "reached"),
        ("step0/rank3", "Functional.linear.0.forward", "source")]
    assert int(rows[3]["error"]) > 0 and sum(int(row[key]) for row in rows for key in ("pass", "warn", "error")) \
        == sum(report["summary"][key] for key in ("pass", "warn", "error"))


def test_the_html_page_says_where_it_began_as_the_terminal_does(four_ranks, tmp_path):
    import html

    from npukit.accuracy.report import write_html

    result = compare_dirs(four_ranks / "golden", four_ranks / "bug")
    write_html(result, tmp_path / "page.html")
    page = html.unescape((tmp_path / "page.html").read_text())
    assert f"First divergence across ranks:</b> {result.across_ranks.line()}" in page
    assert "it began on rank 3, step 0 at Functional.linear.0.forward" in page and "it reached ranks 0-2" in page


def test_pairs_in_a_process_pool_give_what_one_process_gives(four_ranks):
    pooled = compare_dirs(four_ranks / "golden", four_ranks / "bug", workers=2)
    alone = compare_dirs(four_ranks / "golden", four_ranks / "bug", workers=1)
    assert [(pair.pair, pair.divergence, [(row.name, row.verdict, row.error) for row in pair.rows])
            for pair in pooled.pairs] == [(pair.pair, pair.divergence, [(row.name, row.verdict, row.error)
                                                                       for row in pair.rows]) for pair in alone.pairs]
    assert pooled.across_ranks == alone.across_ranks


def test_the_same_op_diverging_on_every_rank_is_a_shared_cause(four_ranks, tmp_path):
    """Every rank given rank 3's buggy dump: they all diverge at the same first op; none is named alone."""
    target = tmp_path / "all"
    shutil.copytree(four_ranks / "bug", target)
    for rank in range(3):
        shutil.copy(target / "step0" / "rank3" / "dump.json", target / "step0" / f"rank{rank}" / "dump.json")
    began = compare_dirs(four_ranks / "golden", target).across_ranks
    assert (began.ranks, began.entry, began.reached) == ([0, 1, 2, 3], "Functional.linear.0.forward", [])
    assert began.line().startswith("it began on ranks 0-3, step 0 at Functional.linear.0.forward")
    assert "a cause they share" in began.line()


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_a_gradient_share_one_rank_changed_before_the_all_reduce_is_named_on_that_rank(tmp_path):
    """Rank 1 zeroes its share of module.0's weight gradient: DDP averages it into the same wrong
    gradient on both ranks, while each rank's backward computed its share as the golden run did. It
    was "No divergence found ... 2 error" (exit 0): the parameter-gradient check was off with
    several ranks, as the reduction legitimately brings the other ranks' differences. Then both ranks
    were named ("the dumps ... cannot say which rank"); the hook's multiply, dumped where autograd
    runs it, is on rank 1 alone: rank 1 is named, and rank 0 as reached through the all_reduce."""
    (tmp_path / "train.py").write_text(SCRIPT)
    npu_run(tmp_path, 2, "golden")
    npu_run(tmp_path, 2, "bug", "hook", "1")
    result = compare_dirs(tmp_path / "golden", tmp_path / "bug")
    assert result.failed()
    assert [pair.divergence and pair.divergence.entry for pair in result.pairs] == [
        None, "Module.module.0.Linear.parameters_grad.0"]
    reason = result.pairs[1].divergence.reason
    assert "this rank alone ran Tensor.__mul__.0.forward (not in the golden run) in its backward" in reason
    began = result.across_ranks
    assert (began.ranks, began.reached) == ([1], [0])
    assert "it reached rank 0 through DDP's gradient all_reduce" in began.line()


# A residual block whose inner projection's output gradient a hook zeroes (on every rank, with an argument).
BLOCK_SCRIPT = """
import sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
dist.init_process_group("hccl")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.qkv, self.proj = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        x = x + self.proj(torch.tanh(self.qkv(self.norm1(x))))
        return self.fc2(F.gelu(self.fc1(self.norm2(x))))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 4)).npu()
if len(sys.argv) > 1:
    model[1].proj.register_forward_hook(lambda module, args, out: out.register_hook(lambda grad: grad * 0) and None)
ddp = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(4, 8, generator=g).npu(), torch.randn(4, 4, generator=g).npu()
F.mse_loss(ddp(x), y).backward()
optimizer.step()
dist.destroy_process_group()
"""


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_a_hook_inside_a_block_is_named_at_the_op_not_at_the_block_whose_backward_entry_comes_first(tmp_path):
    """Under DDP the block's backward entry is placed before the backwards of the ops inside it; its
    output gradient (the residual's plus the zeroed branch's) was named as amplified there, not
    where the gradient was changed: proj's linear backward."""
    (tmp_path / "train.py").write_text(BLOCK_SCRIPT)
    npu_run(tmp_path, 2, "golden")
    npu_run(tmp_path, 2, "bug", "hook")
    began = compare_dirs(tmp_path / "golden", tmp_path / "bug").across_ranks
    assert (began.entry, began.module_path, began.ranks) == ("Functional.linear.2.backward", "module.1.proj", [0, 1])


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_eight_ranks_name_the_rank_whose_layer_norm_eps_changed(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    seconds = npu_run(tmp_path, 8, "golden") + npu_run(tmp_path, 8, "bug", "eps", "5")
    started = time.perf_counter()
    result = compare_dirs(tmp_path / "golden", tmp_path / "bug")
    compared = time.perf_counter() - started
    began = result.across_ranks
    assert (began.ranks, began.entry, began.reached) == ([5], "Functional.layer_norm.0.forward", [0, 1, 2, 3, 4, 6, 7])
    assert "its argument" in result.pairs[5].divergence.reason  # eps: 1e-05 in the golden run, 0.5 here
    assert ", step 0 at Functional.layer_norm.0.forward (module module.1), in the forward; it reached ranks 0-4, 6-7" \
        " through DDP's gradient all_reduce" in began.line()
    print(f"8-rank runs {seconds:.1f} s, compare {compared:.2f} s")


def test_number_ranges():
    assert number_ranges([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6-7" and number_ranges([3]) == "3" and number_ranges([]) == ""


def test_many_steps_show_the_step_where_it_began(four_ranks, tmp_path):
    """5 steps x 4 ranks: the earliest step with a divergence is reported; the terminal lists that step's ranks."""
    for side in ("golden", "bug"):
        for step in range(5):
            shutil.copytree(four_ranks / side / "step0", tmp_path / side / f"step{step}")
    shutil.rmtree(tmp_path / "bug" / "step0")  # step 0 matches: the golden run's own dump
    shutil.copytree(four_ranks / "golden" / "step0", tmp_path / "bug" / "step0")
    result = compare_dirs(tmp_path / "golden", tmp_path / "bug")
    assert (result.across_ranks.step, result.across_ranks.ranks) == (1, [3])
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    print_terminal(result, console, top=0)
    text = console.file.getvalue()
    assert "step1/rank0" in text and "step2/rank0" not in text and "... 16 more step/rank pairs" in text
    assert "it began on rank 3, step 1 at Functional.linear.0.forward" in text
