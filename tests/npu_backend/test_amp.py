"""GradScaler on npu skips overflowing steps and lowers the scale, in INF_NAN and saturation modes."""

import pytest
import torch
import torch.nn as nn

from npukit.npu_backend import numerics

SCALERS = {
    "torch.amp.GradScaler('npu')": lambda **kw: torch.amp.GradScaler("npu", **kw),
    "torch.npu.amp.GradScaler": lambda **kw: torch.npu.amp.GradScaler(**kw),
}


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).npu()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(model, scaler, scale_input: float) -> None:
    x = torch.full((8, 4), scale_input, device="npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def unchanged(before, model) -> bool:
    return all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS.keys())
def test_overflow_skips_the_step_and_halves_the_scale(mode, make_scaler):
    numerics.configure(fp16_mode=mode)
    model, optimizer = make_model()
    scaler = make_scaler(init_scale=2.0**16)
    before = snapshot(model)
    backward(model, scaler, 100.0)  # scaled fp16 gradients overflow
    grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
    # The device's behaviour, not the scaler's: saturation clamps (finite) and raises the flag.
    assert grads_finite == (mode == "saturation")
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(before, model)
    assert scaler.get_scale() == 2.0**15
    assert not numerics.overflow_flag()  # consumed by update(): the next step starts clean

    optimizer.zero_grad()
    backward(model, scaler, 0.01)
    scaler.step(optimizer)
    scaler.update()
    assert not unchanged(before, model)
    assert scaler.get_scale() == 2.0**15


def test_saturation_overflow_in_any_accumulated_micro_batch_skips_the_step():
    numerics.configure(fp16_mode="saturation")
    model, optimizer = make_model()
    scaler = torch.amp.GradScaler("npu", init_scale=2.0**16)
    before = snapshot(model)
    backward(model, scaler, 100.0)  # overflows
    backward(model, scaler, 0.01)  # clean micro-batch: must not hide the first one's overflow
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(before, model) and scaler.get_scale() == 2.0**15


def test_saturation_clean_steps_are_taken_and_the_scale_grows():
    numerics.configure(fp16_mode="saturation")
    model, optimizer = make_model()
    torch.ones(1, dtype=torch.float16, device="npu").mul(1e5)  # a stale overflow before training started
    assert numerics.overflow_flag()
    scaler = torch.amp.GradScaler("npu", init_scale=4.0, growth_interval=2)
    for _ in range(2):
        before = snapshot(model)
        optimizer.zero_grad()
        backward(model, scaler, 0.01)
        scaler.step(optimizer)
        scaler.update()
        assert not unchanged(before, model)
    assert scaler.get_scale() == 8.0


def test_saturation_overflow_in_the_first_forward_skips_the_first_step():
    numerics.configure(fp16_mode="saturation")
    model, optimizer = make_model()
    scaler = torch.amp.GradScaler("npu", init_scale=1.0)  # so small that only the forward can overflow
    before = snapshot(model)
    backward(model, scaler, 1e6)  # the input saturates when autocast casts it to fp16
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(before, model) and scaler.get_scale() == 0.5


def test_static_scale_skips_overflow_but_keeps_the_scale():
    numerics.configure(fp16_mode="saturation")
    model, optimizer = make_model()
    scaler = torch.npu.amp.GradScaler(init_scale=2.0**16, dynamic=False)
    before = snapshot(model)
    backward(model, scaler, 100.0)
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(before, model) and scaler.get_scale() == 2.0**16


def test_cpu_scaler_ignores_the_npu_flag():
    numerics.configure(fp16_mode="saturation")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    torch.ones(1, dtype=torch.float16, device="npu").mul(1e5)  # npu overflow, unrelated to this model
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 4.0 and numerics.overflow_flag()


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("hccl", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_fsdp_sharded_grad_scaler_skips_overflow_in_both_modes(mode, one_rank_group):
    # ShardedGradScaler overrides _unscale_grads_ and update: the flag must reach it too.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    numerics.configure(fp16_mode=mode)
    model, optimizer = make_model()
    scaler = ShardedGradScaler("npu", init_scale=2.0**16)
    before = snapshot(model)
    backward(model, scaler, 100.0)
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(before, model) and scaler.get_scale() == 2.0**15
    assert not numerics.overflow_flag()

    optimizer.zero_grad()
    backward(model, scaler, 0.01)
    scaler.step(optimizer)
    scaler.update()
    assert not unchanged(before, model) and scaler.get_scale() == 2.0**15
