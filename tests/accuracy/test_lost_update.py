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

from npukit.accuracy.compare import ERROR, compare_dirs
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


def step(out: Path, run: str, optimizer: str = "sgd", bf16_fc2: bool = False, mode: str = "tensor") -> None:
    """One dumped training step of the MLP. `run`: "golden" (NPU numerics off, fp32) or "npu" (bf16
    autocast); bf16_fc2: fc2's weights kept in bf16, so its update runs in pure bf16. The optimizer
    runs per tensor (foreach=False): its update ops are what the dump records (a foreach step's
    `torch._foreach_add_` is not recorded); "by hand": no optimizer, `weight -= lr * weight.grad`."""
    torch.manual_seed(0)
    model = MLP().to("npu")
    if bf16_fc2:
        model.fc2.to(torch.bfloat16)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to("npu")
    y = torch.randn(16, 4, generator=torch.Generator().manual_seed(2)).to("npu")
    update = None
    if optimizer == "sgd":
        update = torch.optim.SGD(model.parameters(), lr=2e-3, foreach=False)
    elif optimizer == "adamw":
        update = torch.optim.AdamW(model.parameters(), lr=2e-3, foreach=False)
    with contextlib.ExitStack() as stack:
        if run == "golden":
            stack.enter_context(numerics.golden())
        with DumpSession(out, level="mix", mode=mode):
            with torch.autocast("npu", dtype=torch.bfloat16, enabled=run != "golden"):
                loss = (model(x).float() - y).square().mean()
            loss.backward()
            if update is not None:
                update.step()
            else:  # a script without an optimizer
                with torch.no_grad():
                    for weight in model.parameters():
                        weight -= 2e-3 * weight.grad


@pytest.mark.parametrize(("optimizer", "named", "kept"), [
    ("sgd", "Tensor.add_.2.forward", "keeps 9% of the golden run's"),  # fc2.weight -= lr * grad
    ("adamw", "Tensor.mul_.4.forward", "keeps 0% of the golden run's"),  # AdamW's decay, 2e-5 of the weight
    ("by hand", "Tensor.__isub__.2.forward", "keeps 9% of the golden run's"),  # weight -= lr * weight.grad
])
def test_an_update_lost_in_a_bf16_optimizer_step_is_named_at_the_op_that_lost_it(tmp_path, optimizer, named, kept):
    step(tmp_path / "golden", "golden", optimizer)
    step(tmp_path / "npu", "npu", optimizer, bf16_fc2=True)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    divergence = result.pairs[0].divergence
    assert divergence is not None and divergence.entry == named, divergence
    assert divergence.module_path == "fc2"  # the weight's module, not the optimizer's
    assert "below bfloat16's rounding unit (0.0078), so most of the update is lost" in divergence.reason
    assert kept in divergence.reason and "is kept in bfloat16" in divergence.reason
    assert "fp32 master copy" in divergence.reason
    assert any(("update.step()" if optimizer != "by hand" else "weight -= ") in line for line in divergence.stack)
    # the weight it writes passes: what the compare judged alone before
    rows = [row for row in result.pairs[0].rows if row.target_entry == named and row.role == "output"]
    assert rows and all(row.verdict != ERROR and row.error < 0.01 for row in rows)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clean_runs_name_no_lost_update(tmp_path, optimizer):
    """bf16 autocast with fp32 weights: every update kept, its change a few percent apart as the
    gradients are; and fc2 in bf16 in the golden run too: its updates are lost alike (AdamW's decay
    in both: no golden change to lose), the rest rounded alike."""
    step(tmp_path / "golden", "golden", optimizer)
    step(tmp_path / "npu", "npu", optimizer)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    assert result.pairs[0].divergence is None and result.counts()[ERROR] == 0
    step(tmp_path / "golden_bf16", "golden", optimizer, bf16_fc2=True)
    step(tmp_path / "npu_bf16", "npu", optimizer, bf16_fc2=True)
    assert compare_dirs(tmp_path / "golden_bf16", tmp_path / "npu_bf16", workers=1).pairs[0].divergence is None
