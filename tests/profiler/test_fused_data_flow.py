"""Fused-op advice follows the data: the SiLU's output must be what the multiply reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import npukit.profiler
from npukit.profiler.advisor import advise
from npukit.profiler.table import EventTable


class SiluIntoLinear(torch.nn.Module):
    """score_sde's time embedding (real-repos bug 15): SiLU feeds a Linear; a multiply nearby is unrelated."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, t, x):
        temb = self.lin(F.silu(t))
        h = 2 * x - 1
        return temb + h


class SwiGLU(torch.nn.Module):
    """LLaMA's MLP: silu(gate(x)) * up(x), the up projection computed between the SiLU and the multiply."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(64, 64) for _ in range(3))
        self.inplace = inplace

    def forward(self, t, x):
        return self.down(F.silu(self.gate(x), inplace=self.inplace) * self.up(x)) + t


def _profile(tmp_path, model, device) -> EventTable:
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with npukit.profiler.profile(tmp_path, trace=False):
        for _ in range(4):
            t, x = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
            model(t, x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return EventTable.load(tmp_path / "rank0")


def _swiglu(table: EventTable):
    return next((f for f in advise(table) if f.rule == "fused-swiglu"), None)


def test_a_silu_feeding_a_linear_next_to_an_unrelated_multiply_is_no_swiglu(tmp_path, npu_device):
    table = _profile(tmp_path, SiluIntoLinear(), npu_device)
    assert table.meta["data_flow"] is True
    names = table.lookup(table.name_id)
    assert (names == "aten::silu").any() and (names == "aten::mul").any()  # the op names alone matched
    assert _swiglu(table) is None


@pytest.mark.parametrize("inplace", [False, True], ids=["silu", "silu_"])
def test_a_real_swiglu_is_still_advised(tmp_path, npu_device, inplace):
    finding = _swiglu(_profile(tmp_path, SwiGLU(inplace), npu_device))
    assert finding is not None and "data flow" not in finding.summary
    assert any("test_fused_data_flow.py" in line for line in finding.evidence)


def test_without_recorded_data_flow_the_advice_says_it_matched_op_order_only(tmp_path, npu_device):
    """A profile an earlier npukit recorded has no allocations to follow: the op order is all there is."""
    table = _profile(tmp_path, SwiGLU(), npu_device)
    table.meta["data_flow"] = False
    table.sources_id[:] = -1
    finding = _swiglu(table)
    assert finding is not None and "op order only" in finding.summary


def test_an_op_reads_the_output_of_the_op_that_wrote_it(tmp_path, npu_device):
    """The sources column: rows back from an op to the op whose output each of its inputs is."""
    table = _profile(tmp_path, SwiGLU(), npu_device)
    names, sources = table.lookup(table.name_id), table.lookup(table.sources_id)
    mul = np.flatnonzero((names == "aten::mul") & table.top_level)[0]
    producers = {names[mul - int(d)] for d in str(sources[mul]).split(",") if d}
    assert producers == {"aten::silu", "aten::linear"}
