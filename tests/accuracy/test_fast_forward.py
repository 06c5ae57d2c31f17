"""The monitor's checkpoints (npu-run --monitor-checkpoint-every) and npu-run --fast-forward: a run that
skips the heavy compute of its first steps and loads a checkpoint computes from there what the
recorded run computed."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from npukit.accuracy.fast_forward import FastForwardSession
from npukit.accuracy.step_checkpoints import StepCheckpoints, checkpoint_folders, latest_checkpoint
from npukit.errors import UserError


def training(seed, sessions=(), steps=7):
    """Adam under a StepLR schedule over a shuffled DataLoader, with dropout on the npu: weights, data
    order, learning rate, optimizer state and dropout masks all come from the script's own loop."""
    torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:
        entered = [stack.enter_context(session) for session in sessions]
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 2)).to("npu")
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
        loader = DataLoader(TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 2)), batch_size=4,
                            shuffle=True)
        losses, starts = [], []
        for x, y in loader:
            starts.append(model[0].weight.detach().cpu().clone())  # the weights the step starts from
            loss = F.mse_loss(model(x.to("npu")), y.to("npu"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    return losses, starts, entered


@pytest.fixture
def recorded(tmp_path, npu, capsys):
    """A run of 7 steps whose monitor folder holds checkpoints of steps 3 and 6 (and what it printed)."""
    losses, starts, (checkpoints,) = training(1, [StepCheckpoints(tmp_path / "mon", 3)])
    return tmp_path / "mon", losses, starts, checkpoints, capsys.readouterr().err


def test_checkpoints_hold_every_kth_steps_start_and_replace_an_earlier_runs(recorded):
    monitor, _, _, checkpoints, printed = recorded
    assert sorted(checkpoint_folders(monitor)) == [3, 6]
    manifest = json.loads((monitor / "checkpoints" / "step-6" / "replay.json").read_text())
    assert manifest["start_step"] == 6 and len(manifest["modules"]) == 1 and len(manifest["optimizers"]) == 1
    assert manifest["batches"] == [] and "rng" in manifest  # the re-run's own loader yields the batches
    assert f"2 checkpoint(s) of the state at a step's start ({round(checkpoints.bytes_written / 2 / 1024)} KiB each) " \
           f"in {monitor / 'checkpoints'}/step-N" in printed
    training(1, [StepCheckpoints(monitor, 2)], steps=4)
    assert sorted(checkpoint_folders(monitor)) == [2, 4]  # step-3 and step-6 were the earlier run's


def test_writing_checkpoints_does_not_change_the_run(recorded):
    """The monitor must not change the run it watches: reading the npu generator's state as
    torch.npu.get_rng_state() does makes it continue from (seed, offset), and a checkpointed run drew
    other dropout masks from its first checkpoint on than the same run without checkpoints."""
    _, losses, starts, _, _ = recorded
    plain_losses, plain_starts, _ = training(1)
    assert plain_losses == losses
    assert all(torch.equal(plain, start) for plain, start in zip(plain_starts, starts))


def test_a_run_fast_forwarded_to_a_checkpoint_computes_what_the_recorded_run_did(recorded):
    monitor, losses, starts, _, _ = recorded
    fast_losses, fast_starts, (session,) = training(1, [FastForwardSession(monitor / "checkpoints" / "step-3")])
    assert session.skipped_ops > 0 and not session.skipping
    assert torch.equal(fast_starts[1], fast_starts[0])  # the first steps' updates were skipped
    assert fast_losses[:3] != losses[:3]  # computed on zeros
    assert torch.equal(fast_starts[3], starts[3])
    # from step 3 on exactly the recorded run's: weights, Adam's state, the schedule, the data order, dropout
    # (past step 6 too, where the recorded run recorded its next checkpoint)
    assert len(fast_losses) == len(losses) == 7 and fast_losses[3:] == losses[3:]


def test_skipped_ops_return_zeros_of_their_shape_and_writes_keep_their_target(recorded):
    monitor = recorded[0]
    with pytest.raises(UserError, match="--replay-step 3: the run ended after 0 training step"):
        with FastForwardSession(monitor / "checkpoints" / "step-3"):
            a, b = torch.randn(3, 5, device="npu"), torch.randn(5, 4, device="npu")
            product = a @ b
            assert product.shape == (3, 4) and product.dtype == torch.float32 and product.device.type == "npu"
            assert torch.equal(product.cpu(), torch.zeros(3, 4))
            out = torch.full((3, 4), 7.0, device="npu")
            assert torch.mm(a, b, out=out) is out
            transposed = product.t()  # a view: computed, still a view of the product
            assert transposed.data_ptr() == product.data_ptr()
            assert torch.equal((a + 1).cpu(), a.cpu() + 1)  # elementwise ops run
            assert torch.nonzero(a).shape[0] == int((a != 0).sum())  # a shape that depends on values
            half = torch.randn(2, 8, device="npu", dtype=torch.float16)
            assert F.linear(half, torch.randn(3, 8, device="npu", dtype=torch.float16)).dtype == torch.float16


def test_a_broken_or_foreign_checkpoint_is_named(recorded):
    monitor = recorded[0]
    assert latest_checkpoint(monitor, 2) is None
    assert latest_checkpoint(monitor, 5) == (3, monitor / "checkpoints" / "step-3")
    assert latest_checkpoint(monitor, 6)[0] == 6
    shutil.move(monitor / "checkpoints" / "step-6", monitor / "checkpoints" / "step-7")
    with pytest.raises(UserError, match=r"step-7/replay.json: holds the state at step 6's start, not step 7's"):
        latest_checkpoint(monitor, 8)
    (monitor / "checkpoints" / "step-3" / "replay.json").write_text('{"version": 2, "modules": 3}')
    with pytest.raises(UserError, match=r"step-3/replay.json: modules: must be a list"):
        latest_checkpoint(monitor, 5)
    (monitor / "checkpoints" / "step-3" / "replay.json").unlink()
    with pytest.raises(UserError, match=r"step-3/replay.json: no such file"):
        latest_checkpoint(monitor, 5)
    with pytest.raises(UserError, match=r"step-3/replay.json: no such file"):
        FastForwardSession(monitor / "checkpoints" / "step-3")


def amp_training(seed, sessions=(), steps=7):
    """fp16 autocast on the npu under a GradScaler that starts too high (its first steps' fp16 gradients
    overflow and it backs off) and grows every 2 steps: the scale and growth tracker each step starts
    with (and the losses) depend on what the steps before computed."""
    torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:
        entered = [stack.enter_context(session) for session in sessions]
        # no biases: all gradients come from matrix products, zero-filled while fast-forwarded
        model = nn.Sequential(nn.Linear(4, 16, bias=False), nn.Tanh(), nn.Linear(16, 2, bias=False)).to("npu")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("npu", init_scale=2.0**18, growth_interval=2)
        data = torch.Generator().manual_seed(seed)
        losses, scales = [], []
        for _ in range(steps):
            scales.append((scaler.get_scale(), scaler._get_growth_tracker()))
            x, y = torch.randn(4, 4, generator=data).to("npu"), torch.randn(4, 2, generator=data).to("npu")
            with torch.autocast("npu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    return losses, scales, entered


def test_a_run_fast_forwarded_under_a_grad_scaler_starts_the_step_with_the_recorded_scale(tmp_path, npu):
    """The fast-forwarded steps' zero gradients overflow otherwise than the real ones: the checkpoint's
    loss scale and growth tracker, loaded at its step, make steps 3 on scale and skip as recorded."""
    losses, scales, _ = amp_training(1, [StepCheckpoints(tmp_path / "mon", 3)])
    assert len(set(scales[:4])) == 4  # the state changes step by step (backed off twice, then counting)
    manifest = json.loads((tmp_path / "mon" / "checkpoints" / "step-3" / "replay.json").read_text())
    assert len(manifest["scalers"]) == 1
    fast_losses, fast_scales, (session,) = amp_training(
        1, [FastForwardSession(tmp_path / "mon" / "checkpoints" / "step-3")])
    assert session.skipped_ops > 0 and fast_losses[:3] != losses[:3]
    assert fast_scales[:3] != scales[:3]  # zero gradients never overflow: the scale grew instead
    assert fast_scales[3:] == scales[3:]
    assert fast_losses[3:6] == losses[3:6]
