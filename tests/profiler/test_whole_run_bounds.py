"""A whole-run profile ends with its profile or a reason, at a cost bounded by what it recorded:
torch.compile's tracing is not recorded, and a run without steps stops recording at the bound."""

from __future__ import annotations

import pytest
import torch

import npukit.profiler
from npukit.profiler import record
from npukit.profiler.table import EventTable


class TinyGPT(torch.nn.Module):
    """Embedding, one pre-norm attention + MLP block, a tied head: nanoGPT's shape, tiny."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm(x))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_compiled(steps: int, eval_every: int) -> None:
    """nanoGPT's loop: a compiled model, AdamW, and an evaluation under no_grad / eval() every few steps."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)

    @torch.no_grad()
    def evaluate():
        compiled.eval()
        loss = compiled(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).item()
        compiled.train()
        return loss

    for step in range(steps):
        if step % eval_every == 0:
            evaluate()
        compiled(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.slow  # torch.compile of the model: about a minute on a loaded 2-core machine
def test_a_compiled_trainers_whole_run_profile_leaves_out_compilation_and_is_written(tmp_path, capsys):
    """torch's Python tracer recorded every Python call of Dynamo's and Inductor's tracing: a compiled
    nanoGPT-like trainer's whole-run profile took minutes and more than 17 GB to read once training
    was over (one Linear compiled: 5.5 GB). Compilation now pauses the recording until the step ends."""
    with npukit.profiler.profile(tmp_path):
        _train_compiled(steps=6, eval_every=3)
    err = capsys.readouterr().err
    assert "torch.compile is compiling (step 0)" in err
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["compile_pauses"] >= 1
    assert table.meta["steps"] == [1, 2, 3, 4, 5]  # step 0 (setup, the compiles) is no step
    names = table.lookup(table.name_id)
    # the compiled steps' ops are there; Dynamo's fake-tensor tracing of the model is not
    assert (names[table.step >= 1] == "aten::mm").sum() > 0
    assert len(table) < 100_000


def _serve(requests: int) -> None:
    """A server loop: no optimizer, each request runs a different root module."""
    heads = [torch.nn.Linear(16, 16), torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())]
    with torch.no_grad():
        for request in range(requests):
            heads[request % 2](torch.randn(4, 16))


def test_a_run_without_steps_stops_recording_at_the_bound_and_says_why(tmp_path, monkeypatch, capsys):
    """A run with no step boundary was one recording cycle, however much it held (cycles end only at
    steps). Its growth is now checked at module calls and recording stops at the bound, saying why."""
    monkeypatch.setattr(record, "CYCLE_GROWTH_BYTES", -1)  # past it at the first check
    monkeypatch.setattr(record, "GROWTH_CHECK_SECONDS", 0.0, raising=False)  # (absent before the check)
    with npukit.profiler.profile(tmp_path, trace=False):
        _serve(6)
    err = capsys.readouterr().err
    assert "stopped recording without a step" in err and "prof.step()" in err
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["recording_stopped"].startswith("without a step")
    # the first request's call is where growth is counted from; recording stopped at the second's
    assert (table.lookup(table.name_id) == "aten::addmm").sum() == 1


def test_a_run_without_steps_below_the_bound_is_recorded_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "GROWTH_CHECK_SECONDS", 0.0, raising=False)  # (absent before the check)
    with npukit.profiler.profile(tmp_path, trace=False):
        _serve(6)
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["recording_stopped"] is None
    assert (table.lookup(table.name_id) == "aten::addmm").sum() == 6
