"""Training on npu: autograd + SGD/Adam/AdamW (for-loop, foreach and fused paths) match CPU."""

import pytest
import torch

from npukit.npu_backend import numerics


def _train(device: str, optimizer_factory, steps: int = 5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    data = torch.randn(steps, 8, 16)
    target = torch.randint(0, 4, (steps, 8))
    model = model.to(device)
    optimizer = optimizer_factory(model.parameters())
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(model(data[step].to(device)), target[step].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_trains_exactly_like_cpu(name):
    factory = OPTIMIZERS[name]
    cpu_losses, cpu_params = _train("cpu", factory)
    with numerics.golden():
        npu_losses, npu_params = _train("npu", factory)
    assert npu_losses == cpu_losses
    assert cpu_losses[-1] < cpu_losses[0]
    for cpu_param, npu_param in zip(cpu_params, npu_params):
        assert torch.equal(cpu_param, npu_param)


def test_memory_returns_to_steady_value_after_1000_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).npu()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(16, 32, device="npu")

    def step():
        loss = model(data).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(5):
        step()
    steady = torch.npu.memory_allocated()
    for _ in range(1000):
        step()
    assert torch.npu.memory_allocated() == steady


def test_conv_bn_dropout_network_trains_on_second_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 2)).to("npu:1")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, 8, 8, device="npu:1")
    y = torch.randint(0, 2, (8,), device="npu:1")
    first = None
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    assert all(p.device == torch.device("npu", 1) for p in model.parameters())
    assert model[1].running_mean.device == torch.device("npu", 1)
