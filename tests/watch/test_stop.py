"""--stop-after-step counts steps as the monitor and --dump-steps number them: optimizer steps, or in
a script without an optimizer, each new forward (with gradients) of its model."""

import contextlib
import gc
import json

import pytest
import torch
import torch.nn as nn

from npukit.watch.stop import StopAfterStep, StoppedAfterStep


def train_by_hand(steps: list, stop_after: int | None, evaluations: bool = True) -> None:
    """SGD written out (no torch.optim): an evaluation forward before training and after each step
    (stop_after None: the caller stops it)."""
    gc.collect()  # an optimizer of an earlier test, left in a reference cycle, is one the scan would find
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    with StopAfterStep(stop_after) if stop_after is not None else contextlib.nullcontext():
        if evaluations:
            with torch.no_grad():
                model(x)
        for step in range(6):
            loss = model(x).square().mean()
            loss.backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.1 * parameter.grad
                    parameter.grad = None
            steps.append(step)
            if evaluations:
                with torch.no_grad():
                    model(x)


@pytest.mark.parametrize("stop_after", [0, 2])
def test_without_an_optimizer_the_run_stops_once_that_steps_forwards_ended(stop_after):
    steps: list[int] = []
    with pytest.raises(StoppedAfterStep, match=f"stopped after step {stop_after}"):
        train_by_hand(steps, stop_after)
    assert steps == list(range(stop_after + 1))  # the evaluation forwards (no gradients) count no step


def test_forwards_end_steps_only_without_an_optimizer():
    """The same model run twice a step (two micro-batches): without an optimizer each forward is a
    step; with one, its steps are."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = None

    def train(steps: list) -> None:
        for step in range(6):
            for _ in range(2):
                model(torch.randn(4, 4)).square().mean().backward()
                steps.append(step)
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()

    by_hand: list[int] = []
    with pytest.raises(StoppedAfterStep), StopAfterStep(1):
        train(by_hand)
    assert by_hand == [0, 0]  # forwards 0 and 1: steps 0 and 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulated: list[int] = []
    with pytest.raises(StoppedAfterStep), StopAfterStep(1):
        train(accumulated)
    assert accumulated == [0, 0, 1, 1]


def test_a_dump_beside_it_numbers_steps_as_it_stops(tmp_path):
    """npu-run --dump --stop-after-step 1 (no --monitor, no --replay) on a script that evaluates (no
    gradients) before training: the dump numbered each evaluation forward as a step, so its steps were
    not the ones the run stopped after (step0 the evaluation, step2 the last training step)."""
    from npukit.run import RunOptions, _session_contexts

    options = RunOptions(script="train.py", dump=tmp_path / "dump", stop_after_step=1)
    steps: list[int] = []
    with pytest.raises(StoppedAfterStep), contextlib.ExitStack() as stack:
        _session_contexts(options, stack)
        train_by_hand(steps, None)
    assert steps == [0, 1]
    dumped = sorted(path.name for path in (tmp_path / "dump").iterdir())
    assert dumped == ["step0", "step1"]
    for step in dumped:  # each a training step: its forward with gradients, and its backward
        names = json.loads((tmp_path / "dump" / step / "rank0" / "dump.json").read_text())["data"]
        assert any(name.endswith(".backward") for name in names), step
