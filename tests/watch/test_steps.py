"""RunSteps, what --replay-step and --stop-after-step count: the monitor's steps, whatever the script."""

import gc

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from npukit.accuracy.monitor import MonitorSession
from npukit.watch.steps import RunSteps


def by_hand(model, loader):
    """No optimizer: an evaluation before training and after each update (no gradients)."""
    with torch.no_grad():
        model(torch.randn(4, 4))
    for (x,) in loader:
        model(x).square().mean().backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.1 * parameter.grad
                parameter.grad = None
            model(x)
        yield


def optimizer_after_a_dry_run(model, loader):
    """A forward (lazy modules' shapes) and a batch taken before the optimizer is made."""
    batches = iter(loader)
    model(next(batches)[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x,) in batches:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def accumulated(model, loader):
    """Two forwards a step before its optimizer's step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x,) in loader:
        for half in x.chunk(2):
            model(half).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def lbfgs_after_forwards(model, loader):
    """Two forwards before the optimizer exists (the second ends a step), then LBFGS, whose closure
    runs forwards inside its step: from the first optimizer step on, forwards end no step."""
    batches = iter(loader)
    model(next(batches)[0])
    model(next(batches)[0])
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    for (x,) in batches:
        def closure(x=x):
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss
        optimizer.step(closure)
        yield


@pytest.mark.parametrize("script", [by_hand, optimizer_after_a_dry_run, accumulated, lbfgs_after_forwards])
def test_steps_end_where_the_monitors_steps_end(tmp_path, script):
    """After each training step RunSteps and the monitor have ended as many steps. The dry run's batch
    asks whether steps end at forwards before the optimizer exists: that answer is not kept, or the
    first training forward would end a step the monitor does not end."""
    gc.collect()  # an optimizer of an earlier test, left in a reference cycle, is one the scan would find
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    loader = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=4)
    ends = []
    steps = RunSteps(lambda optimizer, skipped, scale: ends.append(optimizer))

    def asking(loader):  # as --replay-step asks at each batch whether steps end at forwards
        for batch in loader:
            steps.by_forwards()
            yield batch

    steps.install()
    try:
        with MonitorSession(tmp_path / "mon", rank=0, tensorboard=False) as monitor:
            counted = []
            for _ in script(model, asking(loader)):
                counted.append((len(ends), monitor.step_index))
    finally:
        steps.remove()
    assert [mine for mine, _ in counted] == [theirs for _, theirs in counted]
    assert counted[-1][0] >= 4
    assert all(optimizer is None for optimizer in ends) == (script is by_hand)
