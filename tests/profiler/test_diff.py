"""npu-profile diff: alignment by op sequence finds inserted ops and per-op ratios."""

from __future__ import annotations

import random

import pytest
import torch

import npukit.profiler
from npukit.profiler.commands import run_diff
from npukit.profiler.diff import diff_profiles, myers_alignment
from npukit.profiler.table import EventTable


def _lcs_length(a, b) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_myers_alignment_is_a_longest_common_subsequence():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 25))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 25))]
        pairs = myers_alignment(a, b)
        assert all(a[i] == b[j] for i, j in pairs)
        assert all(p[0] < q[0] and p[1] < q[1] for p, q in zip(pairs, pairs[1:]))
        assert len(pairs) == _lcs_length(a, b)


def test_alignment_gives_up_beyond_the_distance_limit():
    assert myers_alignment(list("a" * 50), list("b" * 50), max_distance=10) is None


class Net(torch.nn.Module):
    def __init__(self, insert_cast: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.insert_cast = insert_cast

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.insert_cast:
            h = h.to(torch.float64).to(torch.float32)  # what a careless migration inserts
        return self.fc2(h).sum()


def _record(path, insert_cast: bool) -> EventTable:
    torch.manual_seed(0)
    model = Net(insert_cast)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(16, 64)
    with npukit.profiler.profile(path, trace=False):
        for _ in range(3):
            loss = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return EventTable.load(path / "rank0")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    return root / "a", _record(root / "a", False), root / "b", _record(root / "b", True)


def test_diff_finds_the_inserted_cast(two_runs):
    _, a, _, b = two_runs
    result = diff_profiles(a, b)
    assert result.aligned
    inserted = [c for c in result.changes if c.side == "inserted"]
    to_calls = [c for c in inserted if c.op == "aten::to"]
    assert to_calls, inserted
    # Two casts per step forward, and their two backward casts.
    assert sum(c.per_step for c in to_calls) == pytest.approx(4)
    assert all("test_diff.py" in c.line for c in to_calls)
    assert not [c for c in result.changes if c.side == "removed"]
    ops = {o.op: o for o in result.ops}
    assert ops["aten::to"].calls_per_step_a == 0 and ops["aten::to"].calls_per_step_b == 4
    assert ops["aten::to"].share_change_pct > 0
    assert ops["aten::linear"].matched_calls == ops["aten::linear"].calls_per_step_a * 2  # 3 steps, the first setup
    assert ops["aten::linear"].ratio_b_over_a > 0


def test_identical_runs_have_no_changes(two_runs):
    _, a, _, _ = two_runs
    result = diff_profiles(a, a)
    assert result.changes == []
    assert all(o.ratio_b_over_a == pytest.approx(1.0) for o in result.ops if o.matched_calls)


def test_diff_command_output(two_runs, tmp_path, capsys):
    path_a, _, path_b, _ = two_runs
    payload = run_diff(path_a, path_b, json_path=tmp_path / "diff.json", csv_path=tmp_path / "diff.csv")
    out = capsys.readouterr().out
    assert "New in B" in out and "aten::to" in out
    assert (tmp_path / "diff.json").read_text().count("aten::to") >= 1
    assert payload["aligned"] is True
    assert (tmp_path / "diff.csv").read_text().startswith("op,")
