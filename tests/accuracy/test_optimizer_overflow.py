"""The overflow check watches optimizer.step() as one op: an update that turns finite weights into
inf/nan is where the run breaks, and the check named nothing (its update ops are not watched one by
one). Found on VeOmni's Qwen3-MoE in fp16 under npu-run --detect-overflow: the loss went nan in
step 1 and the report said 'no overflow in 2 step(s)' (AdamW's eps=1e-8 is 0 in fp16: a moment
that underflowed to 0 divides 0 by 0, as plain PyTorch does on any device)."""

from __future__ import annotations

import pytest
import torch

from npukit.accuracy.overflow import OverflowSession


def _train_fp16(device, session, optimizer_class, steps=2, **optimizer_options):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(device=device, dtype=torch.float16)
    optimizer = optimizer_class(model.parameters(), **optimizer_options)
    x = torch.randn(8, 16).to(device=device, dtype=torch.float16)
    with session:
        for _ in range(steps):
            loss = (model(x).float() * 1e-4).square().mean()  # gradients whose squares underflow fp16
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return session, model


@pytest.mark.parametrize("foreach", [False, True])
def test_an_update_that_makes_weights_nan_is_the_first_event(tmp_path, npu, foreach):
    session, model = _train_fp16(npu, OverflowSession(tmp_path, console=False), torch.optim.AdamW,
                                 foreach=foreach)
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the case is what it claims
    first = session.first_event
    assert first is not None and first["name"] == "Optimizer.AdamW.step.0.forward"
    assert first["step"] == 0 and first["kind"] == "inf_nan"
    assert any("optimizer.step()" in line for line in first["stack"])
    # the nan weights of step 1 only pass it on: no second event where the forward reads them
    assert len(session.events) == 1


def test_a_healthy_update_is_no_event(tmp_path, npu):
    session, model = _train_fp16(npu, OverflowSession(tmp_path, console=False), torch.optim.SGD, steps=3, lr=1e-3)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert session.events == []
