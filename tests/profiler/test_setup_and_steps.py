"""A whole-run profile (no --profile-steps): the steps are found, the setup before them is no step."""

from __future__ import annotations

import numpy as np
import torch

import npukit.profiler
from npukit.profiler.advisor import advise
from npukit.profiler.summary import summarize
from npukit.profiler.table import KIND_OP, EventTable

from .conftest import MatmulNet


def _line_of(tag: str) -> int:
    source = open(__file__).read().splitlines()
    return next(i for i, text in enumerate(source, 1) if text.rstrip().endswith(f"# {tag}"))


def _rows_at(table: EventTable, tag: str) -> np.ndarray:
    stacks = table.string_array()[table.stack_id].astype(str)
    return (table.kind == KIND_OP) & (np.char.find(stacks, f":{_line_of(tag)} ") >= 0)


def test_setup_before_the_first_optimizer_step_is_no_step(tmp_path, npu_device):
    """Weight loading and the copy to the device ran before the loop: they were step 0's work."""
    torch.manual_seed(0)
    state = MatmulNet().state_dict()
    with npukit.profiler.profile(tmp_path, trace=False):
        model = MatmulNet()
        model.load_state_dict(state)
        model = model.to(npu_device)  # SETUP COPY
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(16, 384, device=npu_device)
        for _ in range(4):
            loss = model(x)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["steps"] == [1, 2, 3]  # the range up to the first optimizer step is setup
    setup = _rows_at(table, "SETUP COPY")
    assert setup.any() and (table.step[setup] == -1).all()
    summary = summarize(table, "op")  # the per-step figures are the steps': no copy to the device in them
    assert "aten::to" not in {row["group"] for row in summary.rows} and summary.outside_steps_us > 0


INFERENCE_STEPS = 20


def test_without_optimizer_steps_each_forward_of_the_model_is_a_step(tmp_path, npu_device):
    """Inference: the whole run was one 'step' holding the model's loading and its copy to the
    device, which the advisor listed as per-step copies (real-repos bug 17)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    with npukit.profiler.profile(tmp_path, trace=False):
        model = torch.nn.Sequential(*layers)
        model = model.to(npu_device).eval()  # INFERENCE SETUP
        x = torch.randn(8, 64, device=npu_device)
        with torch.no_grad():
            for _ in range(INFERENCE_STEPS):
                x = torch.tanh(model(x))  # INFERENCE LINE
        print(x.sum().item())  # RESULT LINE
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["step_source"] == "forward"
    # a step from one call to the next (its forward and the tanh after it); the last call's step has
    # no known end (the run's end follows it): it is left out, as the end after the last optimizer step
    assert table.meta["steps"] == list(range(INFERENCE_STEPS - 1))
    assert (table.step[_rows_at(table, "INFERENCE SETUP")] == -1).all()
    names = table.lookup(table.name_id)
    tanh = _rows_at(table, "INFERENCE LINE") & (names == "aten::tanh")
    assert (table.step[tanh] == [*range(INFERENCE_STEPS - 1), -1]).all()
    setup_line, result_line = (f":{_line_of(tag)} " for tag in ("INFERENCE SETUP", "RESULT LINE"))
    for finding in advise(table):
        assert not any(setup_line in text or result_line in text for text in finding.evidence), finding
        assert finding.rule != "host-device-copies"
