"""An update lost inside optimizer.step(): a weight the NPU run keeps in bf16, whose update is below
half its rounding unit, is written back unchanged. The weight it writes is within bf16's tolerance
(the update is 1e-4 of it), so the compare judges the change the in-place op makes (output - input)
against the golden run's: most of it lost names that op. The model is tests/accuracy/test_trend.py's
(fc2 kept in bf16), one step from the same weights, as --trend --localize re-runs it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from npukit.accuracy.compare import ERROR, PASS, compare_dirs
from npukit.accuracy.dump import DumpSession
from npukit.npu_backend import numerics

pytestmark = pytest.mark.usefixtures("npu")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(16, 32), nn.Tanh()
        self.fc2, self.act2 = nn.Linear(32, 32), nn.Tanh()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.act1(self.fc1(x))
        return self.fc3(self.act2(self.fc2(h.to(self.fc2.weight.dtype)).float()))  # fc2 may be kept in bf16


def step(out: Path, run: str, optimizer: str = "sgd", bf16_fc2: bool = False, mode: str = "tensor",
         foreach: bool = False, clip: bool = False) -> None:
    """One dumped training step of the MLP. `run`: "golden" (NPU numerics off, fp32) or "npu" (bf16
    autocast); bf16_fc2: fc2's weights kept in bf16, so its update runs in pure bf16. The optimizer
    runs per tensor (foreach=False: `Tensor.add_` per parameter) or, as it does by default on the npu,
    foreach (`torch._foreach_add_` over each dtype's list of parameters); "by hand": no optimizer,
    `weight -= lr * weight.grad`. clip: clip_grad_norm_ before the step (foreach too, by default)."""
    torch.manual_seed(0)
    model = MLP().to("npu")
    if bf16_fc2:
        model.fc2.to(torch.bfloat16)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to("npu")
    y = torch.randn(16, 4, generator=torch.Generator().manual_seed(2)).to("npu")
    update = None
    if optimizer == "sgd":
        update = torch.optim.SGD(model.parameters(), lr=2e-3, foreach=foreach)
    elif optimizer == "adamw":
        update = torch.optim.AdamW(model.parameters(), lr=2e-3, foreach=foreach)
    with contextlib.ExitStack() as stack:
        if run == "golden":
            stack.enter_context(numerics.golden())
        with DumpSession(out, level="mix", mode=mode):
            with torch.autocast("npu", dtype=torch.bfloat16, enabled=run != "golden"):
                loss = (model(x).float() - y).square().mean()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)
            if update is not None:
                update.step()
            elif foreach:  # a script without an optimizer, updating every weight in one call
                with torch.no_grad():
                    weights = list(model.parameters())
                    torch._foreach_add_(weights, [weight.grad for weight in weights], alpha=-2e-3)
            else:  # a script without an optimizer
                with torch.no_grad():
                    for weight in model.parameters():
                        weight -= 2e-3 * weight.grad


@pytest.mark.parametrize(("optimizer", "foreach", "named", "kept"), [
    ("sgd", False, "Tensor.add_.2.forward", "keeps 9% of the golden run's"),  # fc2.weight -= lr * grad
    ("adamw", False, "Tensor.mul_.4.forward", "keeps 0% of the golden run's"),  # AdamW's decay, 2e-5 of the weight
    ("by hand", False, "Tensor.__isub__.2.forward", "keeps 9% of the golden run's"),  # weight -= lr * weight.grad
    # foreach: one op updates each dtype's parameters (the golden run's six in one call, the NPU run's
    # fc2 pair in a call of its own); each element is recorded as its parameter's (fc2.weight: the 3rd)
    ("sgd", True, "Torch._foreach_add_.2.forward", "keeps 9% of the golden run's"),
    ("adamw", True, "Torch._foreach_mul_.2.forward", "keeps 0% of the golden run's"),
    # by hand, one foreach call over every weight: its elements recorded as the modules' parameters
    ("by hand", True, "Torch._foreach_add_.2.forward", "keeps 9% of the golden run's"),
])
def test_an_update_lost_in_a_bf16_optimizer_step_is_named_at_the_op_that_lost_it(tmp_path, optimizer, foreach, named,
                                                                                   kept):
    step(tmp_path / "golden", "golden", optimizer, foreach=foreach)
    step(tmp_path / "npu", "npu", optimizer, bf16_fc2=True, foreach=foreach)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    divergence = result.pairs[0].divergence
    assert divergence is not None and divergence.entry == named, divergence
    assert divergence.module_path == "fc2"  # the weight's module, not the optimizer's
    assert "below bfloat16's rounding unit (0.0078), so most of the update is lost" in divergence.reason
    assert kept in divergence.reason and "is kept in bfloat16" in divergence.reason
    assert "fp32 master copy" in divergence.reason
    assert any(("update.step()" if optimizer != "by hand" else "torch._foreach_add_(" if foreach else "weight -= ")
               in line for line in divergence.stack)
    # the weight it writes passes: what the compare judged alone before
    rows = [row for row in result.pairs[0].rows if row.target_entry == named and row.role == "output"]
    assert rows and all(row.verdict != ERROR and row.error < 0.01 for row in rows)


def test_a_foreach_step_after_clip_grad_norm_names_the_lost_update_not_the_norms_merged_in_another_order(tmp_path):
    """The default of a training script on the npu: clip_grad_norm_ and AdamW, both foreach. The NPU
    run keeps fc2 in bf16: each foreach op runs once per dtype, and clip_grad_norm_ stacks the norms
    in another order than the golden run (its fp32 ones first). Each norm is compared with the golden
    norm of the same parameter, the stack by its statistics; the lost update is named."""
    step(tmp_path / "golden", "golden", "adamw", foreach=True, clip=True)
    step(tmp_path / "npu", "npu", "adamw", bf16_fc2=True, foreach=True, clip=True)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    divergence = result.pairs[0].divergence
    # clip_grad_norm_'s foreach mul_ took indices 0-5 (one per parameter); the decay of fc2.weight is 6 + 2
    assert divergence is not None and divergence.entry == "Torch._foreach_mul_.8.forward", divergence
    assert divergence.module_path == "fc2" and "keeps 0% of the golden run's" in divergence.reason
    stacked = [row for row in result.pairs[0].rows if row.target_entry == "Torch.stack.0.forward"]
    assert len(stacked) == 7 and all(row.verdict == PASS for row in stacked), stacked
    assert all(row.by_statistics for row in stacked if row.role == "output")
    # each norm against the golden norm of its parameter: fc2.weight's is 32x32's
    norms = {row.target_entry: row for row in result.pairs[0].rows
             if row.target_entry and row.target_entry.startswith("Torch._foreach_norm.") and row.role == "input"}
    assert sorted(norms) == [f"Torch._foreach_norm.{k}.forward" for k in range(6)]
    assert all(row.golden.shape == row.target.shape for row in norms.values())


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clean_runs_name_no_lost_update(tmp_path, optimizer, foreach):
    """bf16 autocast with fp32 weights: every update kept, its change a few percent apart as the
    gradients are; and fc2 in bf16 in the golden run too: its updates are lost alike (AdamW's decay
    in both: no golden change to lose), the rest rounded alike."""
    step(tmp_path / "golden", "golden", optimizer, foreach=foreach)
    step(tmp_path / "npu", "npu", optimizer, foreach=foreach)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    assert result.pairs[0].divergence is None and result.counts()[ERROR] == 0
    step(tmp_path / "golden_bf16", "golden", optimizer, bf16_fc2=True, foreach=foreach)
    step(tmp_path / "npu_bf16", "npu", optimizer, bf16_fc2=True, foreach=foreach)
    assert compare_dirs(tmp_path / "golden_bf16", tmp_path / "npu_bf16", workers=1).pairs[0].divergence is None

