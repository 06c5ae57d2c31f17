"""OverflowSession: the op, module, step and direction of the first overflow, per fp16 mode."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy import overflow
from npukit.accuracy.dumpfile import load_rank_dump
from npukit.accuracy.overflow import OverflowSession, OverflowStop, merge_rank_reports
from npukit.errors import UserError
from npukit.npu_backend import numerics
from tests.npu_backend.conftest import DDP_TRAIN

from .models import Net

ROOT = Path(__file__).resolve().parents[2]


class ForwardOverflow(nn.Module):
    """fc2's output overflows float16 when `boost` is large; fine otherwise and in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.boost = 1.0

    def forward(self, x):
        h = F.gelu(self.fc1(x)) * self.boost
        return self.fc2(h)


class BackwardOverflow(nn.Module):
    """Forward stays small; the weight gradient of fc (sum over the batch of grad * x) overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def _train(model, steps, device, dtype, session, batch=lambda step: torch.randn(32, 8), loss_scale=lambda step: 1.0,
           before_step=lambda step: None):
    torch.manual_seed(0)
    model = model.to(device=device, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    with session:
        for step in range(steps):
            before_step(step)
            x = batch(step).to(device=device, dtype=dtype)
            loss = model(x).float().square().mean() * loss_scale(step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return session


def _forward_case(tmp_path, mode, npu, **options):
    from npukit.npu_backend import numerics

    model = ForwardOverflow()
    model.fc2.weight.data.fill_(0.05)

    def boost(step):
        model.boost = 1e5 if step == 2 else 1.0

    with numerics.policies(fp16_mode=mode):
        return _train(model, 4, npu, torch.float16, OverflowSession(tmp_path, console=False, **options),
                      before_step=boost)


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_forward_overflow_names_op_module_and_step(tmp_path, npu, mode):
    session = _forward_case(tmp_path, mode, npu)
    first = session.first_event
    assert (first["step"], first["direction"], first["dtype"]) == (2, "forward", "torch.float16")
    assert first["name"] == "Tensor.__mul__.0.forward" and first["module"] == ""
    assert first["kind"] == ("saturation" if mode == "saturation" else "inf_nan")
    assert any("self.boost" in line for line in first["stack"][:1]), first["stack"]
    assert all(leaf["finite"] for leaf in first["inputs"])
    if mode == "inf_nan":
        assert not first["outputs"][0]["finite"]
    else:  # clamped: finite, at the fp16 limit
        assert first["outputs"][0]["Max"] == 65504.0
    # Its consumer (fc2) only passes the overflow on: no second event in step 2.
    assert [e["name"] for e in session.events if e["step"] == 2] == ["Tensor.__mul__.0.forward"]
    report = json.loads((tmp_path / "overflow.json").read_text())
    assert report["events"][0]["name"] == "Tensor.__mul__.0.forward" and report["fp16_mode"] == mode


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_backward_overflow_names_linear_backward_in_its_module(tmp_path, npu, mode):
    from npukit.npu_backend import numerics

    model = BackwardOverflow()
    with numerics.policies(fp16_mode=mode):
        session = _train(model, 3, npu, torch.float16, OverflowSession(tmp_path, console=False),
                         batch=lambda step: torch.rand(64, 16) * 5 + 5,
                         loss_scale=lambda step: 30000.0 if step == 1 else 1.0)
    first = session.first_event
    assert first is not None, "the overflowing weight gradient was not found"
    assert (first["name"], first["module"], first["direction"], first["step"]) == (
        "Functional.linear.0.backward", "fc", "backward", 1)
    assert not [e for e in session.events if e["direction"] == "forward"]


class _GroupedMatmul(torch.autograd.Function):
    """A matmul whose backward calls the matmuls itself, as MindSpeed's GmmFunction calls
    npu_grouped_matmul in its backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return torch.matmul(grad, weight.t()), torch.matmul(x.t(), grad)


class CustomBackwardOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 4) * 0.1)

    def forward(self, x):
        return _GroupedMatmul.apply(x, self.weight)


def test_an_overflow_in_a_custom_functions_backward_is_named_there(tmp_path, npu):
    """The weight gradient overflows fp16 in the matmul the Function's backward calls: it read "no
    overflow" at api level while autograd ran that Python with the detector off the stack."""
    session = _train(CustomBackwardOverflow(), 3, npu, torch.float16, OverflowSession(tmp_path, console=False),
                     batch=lambda step: torch.rand(64, 16) * 5 + 5,
                     loss_scale=lambda step: 30000.0 if step == 1 else 1.0)
    first = session.first_event
    assert first is not None, "the overflowing weight gradient was not found"
    assert (first["name"], first["step"]) == ("Torch.matmul.2.forward", 1)
    assert any("torch.matmul(x.t(), grad)" in line for line in first["stack"]), first["stack"]
    assert all(leaf["finite"] for leaf in first["inputs"]) and not first["outputs"][0]["finite"]


def test_module_level_names_the_module(tmp_path, npu):
    session = _forward_case(tmp_path, "inf_nan", npu, level="module")
    first = session.first_event
    assert (first["name"], first["step"], first["direction"]) == ("Module.ForwardOverflow.forward.0", 2, "forward")
    # fc2 got the inf from its input and is not an event; the root reports once, not twice.
    assert [e["name"] for e in session.events if e["step"] == 2] == ["Module.ForwardOverflow.forward.0"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_healthy_low_precision_run_has_no_event(tmp_path, npu, dtype, mode):
    from npukit.npu_backend import numerics

    with numerics.policies(fp16_mode=mode):
        session = _train(Net(), 3, npu, dtype, OverflowSession(tmp_path, console=False))
    assert session.events == [] and session.skipped_steps == []
    report = json.loads((tmp_path / "overflow.json").read_text())
    assert report["events"] == [] and report["steps"] == 3


def test_the_users_overflow_flag_is_kept(tmp_path, npu):
    from npukit.npu_backend import numerics

    x = torch.full((4,), 60000.0, dtype=torch.float16, device=npu)
    with numerics.policies(fp16_mode="saturation"), OverflowSession(tmp_path, console=False) as session:
        numerics.clear_overflow_flag()
        y = x * 2  # saturates
        assert torch.npu.utils.get_npu_overflow_flag()  # as without the detector
        z = y + 0  # does not saturate: the flag stays set, but z is not an event
        assert torch.npu.utils.get_npu_overflow_flag() and z.dtype == torch.float16
        session.step()
    numerics.clear_overflow_flag()
    assert [e["name"] for e in session.events] == ["Tensor.__mul__.0.forward"]


def _amp_train(session, npu, init_scale, boost_step=None, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(npu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("npu", init_scale=init_scale)
    scales = []
    with session:
        for step in range(steps):
            x = torch.randn(8, 16, device=npu)
            with torch.autocast("npu", dtype=torch.float16):
                out = model(x)
                if step == boost_step:
                    out = out * 1e6
                loss = F.cross_entropy(out.float(), torch.zeros(8, dtype=torch.long, device=npu))
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_skipped_steps_are_reported_not_events(tmp_path, npu):
    session = OverflowSession(tmp_path, action="stop", console=False)
    scales = _amp_train(session, npu, init_scale=1e30)  # scaled gradients overflow fp16
    # Every step skipped and the scale backed off, as without the detector.
    assert scales == pytest.approx([5e29, 2.5e29, 1.25e29], rel=1e-6)
    assert session.events == []
    assert [s["step"] for s in session.skipped_steps] == [0, 1, 2]
    assert session.skipped_steps[0]["first_overflow"].endswith(".backward")
    report = json.loads((tmp_path / "overflow.json").read_text())
    assert report["skipped_steps"][0]["scale"] == pytest.approx(1e30, rel=1e-6)


def test_after_a_step_the_scaler_skipped_forwards_end_no_step(tmp_path, npu):
    """Forwards of a dry run before the optimizer exists end steps; once GradScaler.step ran, even
    skipping optimizer.step (every step here), a forward ends none, as in the dump: one step per
    training step, the skipped ones numbered one after another."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(npu)
    x = torch.randn(8, 16, device=npu)
    with OverflowSession(tmp_path, console=False) as session:
        model(x)
        model(x)  # the dry run's second forward: without an optimizer, a step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("npu", init_scale=1e30)  # scaled gradients overflow fp16: every step skipped
        for _ in range(3):
            with torch.autocast("npu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    skipped = [item["step"] for item in session.skipped_steps]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    assert session.step_index == skipped[-1] + 1


def test_forward_overflow_under_amp_is_an_event_and_stop_raises(tmp_path, npu):
    session = OverflowSession(tmp_path, action="stop", console=False)
    with pytest.raises(OverflowStop, match=r"overflow at step 1 .*Tensor\.__mul__\.0\.forward"):
        _amp_train(session, npu, init_scale=1.0, boost_step=1)
    assert session.first_event["step"] == 1
    assert json.loads((tmp_path / "overflow.json").read_text())["events"][0]["name"] == "Tensor.__mul__.0.forward"


@pytest.mark.parametrize("mode", ["inf_nan", "saturation"])
def test_forward_overflow_in_a_step_the_scaler_skips_is_reported(tmp_path, npu, mode):
    """The forward event stays an event; the step is reported as skipped, not a crash."""
    with numerics.policies(fp16_mode=mode):
        session = OverflowSession(tmp_path, action="report", console=False)
        scales = _amp_train(session, npu, init_scale=1.0, boost_step=0)
    assert session.first_event["step"] == 0 and session.first_event["direction"] == "forward"
    assert session.first_event["name"] == "Tensor.__mul__.0.forward"
    assert [s["step"] for s in session.skipped_steps] == [0]
    assert scales[0] == pytest.approx(0.5)
    report = json.loads((tmp_path / "overflow.json").read_text())
    assert report["events"][0]["step_skipped_by_grad_scaler"] is True


def test_dump_action_writes_a_replayable_dump(tmp_path, npu):
    session = _forward_case(tmp_path, "inf_nan", npu, action="dump")
    first = session.first_event
    assert first["fp32_replay"]["verdict"].startswith("real overflow")
    dump = load_rank_dump(Path(first["dump"]).parent)
    entry = dump.by_name()["Tensor.__mul__.0.forward"]
    (x_leaf,) = [leaf for leaf in entry.inputs if leaf.data_path is not None]
    from npukit.accuracy.tensor_io import read_tensor

    x = torch.from_numpy(read_tensor(x_leaf.data_path, x_leaf.dtype, list(x_leaf.shape)).copy())
    assert x.dtype == torch.float16 and torch.isfinite(x).all()
    # Replayed on the CPU in fp32 the product is finite but beyond fp16's range: a real overflow.
    reference = x.float() * 1e5
    assert torch.isfinite(reference).all() and reference.abs().max() > 65504


def test_max_events_stops_checking(tmp_path, npu, capsys):
    x = torch.full((2,), 1e4, dtype=torch.float16, device=npu)
    with OverflowSession(tmp_path, max_events=2) as session:
        for _ in range(4):
            _ = x * 10.0  # each call is a new overflow
            session.step()
    assert len(session.events) == 2
    assert json.loads((tmp_path / "overflow.json").read_text())["truncated"] is True
    # the summary does not count the unchecked steps as checked ("2 event(s) in 4 step(s)")
    assert "overflow check: 2 event(s) before checking stopped in step 1 (--overflow-max 2; the run had 4 step(s))" \
        in capsys.readouterr().err


def test_explicit_steps_and_per_rank_reports_merge_in_step_order(tmp_path, npu):
    x = torch.full((2,), 1e4, dtype=torch.float16, device=npu)
    for rank, bad_step in ((0, 2), (1, 1)):
        with OverflowSession(tmp_path, rank=rank, console=False) as session:
            for step in range(3):
                _ = x * (10.0 if step == bad_step else 1.0)
                session.step()
        assert (tmp_path / f"rank{rank}" / "overflow.json").is_file()
    merged = json.loads((tmp_path / "overflow.json").read_text())
    assert [(e["rank"], e["step"]) for e in merged["events"]] == [(1, 1), (0, 2)]
    assert merged["ranks"] == [0, 1] and merge_rank_reports(tmp_path) == merged


def _rank_report(directory: Path, rank: int, events: list[tuple[int, int, str]], skipped_steps: list[int]) -> None:
    """A rank's overflow.json as a session writes it: events (step, time_ns, name)."""
    report = {"version": 1, "ranks": [rank], "level": "api", "action": "report", "fp16_mode": "inf_nan", "steps": 3,
              "truncated": False, "underflow": None,
              "skipped_steps": [{"step": step, "rank": rank, "scale": 256.0, "first_overflow": None, "overflows": 0}
                                for step in skipped_steps],
              "events": [{"index": index, "step": step, "rank": rank, "time_ns": time_ns, "name": name,
                          "direction": "forward", "module": "fc", "module_class": "Linear"}
                         for index, (step, time_ns, name) in enumerate(events)]}
    (directory / f"rank{rank}").mkdir(parents=True)
    (directory / f"rank{rank}" / "overflow.json").write_text(json.dumps(report))


def test_across_ranks_the_earliest_overflow_of_a_step_comes_first_and_says_where_it_spread(tmp_path):
    """Rank 4 overflows first; ranks 0-2 and 5 skip the step with no overflowing op of their own
    (the inf reached them through the all-reduce); rank 3 overflows too, later in the step (by rank
    number it came first: merged reports were ordered by step, then rank)."""
    for rank in (0, 1, 2, 5):
        _rank_report(tmp_path, rank, [], skipped_steps=[1])
    _rank_report(tmp_path, 3, [(1, 9_000, "Functional.softmax.0.forward")], skipped_steps=[1])
    _rank_report(tmp_path, 4, [(1, 2_000, "Functional.linear.3.forward")], skipped_steps=[1])
    merged = merge_rank_reports(tmp_path)
    assert [(event["rank"], event["step"]) for event in merged["events"]] == [(4, 1), (3, 1)]
    began = merged["across_ranks"]
    assert (began["rank"], began["step"], began["name"]) == (4, 1, "Functional.linear.3.forward")
    assert began["ranks_with_their_own_overflow"] == [3]
    assert began["ranks_reached_through_a_collective"] == [0, 1, 2, 5]
    assert overflow.across_ranks_line(began, tmp_path / "overflow.json").startswith(
        "overflow across ranks: it began on rank 4, step 1: Functional.linear.3.forward in module fc (Linear); "
        "it reached rank(s) 0-2, 5 through a collective")


def test_across_ranks_an_earlier_step_comes_before_an_earlier_time(tmp_path):
    _rank_report(tmp_path, 0, [(2, 1_000, "Tensor.exp.0.forward")], skipped_steps=[2])
    _rank_report(tmp_path, 1, [(1, 5_000, "Functional.linear.0.forward")], skipped_steps=[1])
    began = merge_rank_reports(tmp_path)["across_ranks"]
    assert (began["rank"], began["step"]) == (1, 1) and began["ranks_reached_through_a_collective"] == []


def test_a_two_rank_ddp_run_names_the_rank_whose_batch_overflowed(tmp_path):
    """npu-run --nproc-per-node 2 --detect-overflow: rank 1's batch overflows fp16 at step 1; rank 0
    only skips the step (GradScaler saw the inf DDP's all-reduce brought). Said once, by the last rank."""
    script = tmp_path / "ddp_inf.py"
    script.write_text(DDP_TRAIN)
    run = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", "--detect-overflow",
                          str(script), "0", "1", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert output.count("overflow across ranks:") == 1
    began = json.loads((tmp_path / "overflow" / "overflow.json").read_text())["across_ranks"]
    assert (began["rank"], began["step"], began["name"]) == (1, 1, "Functional.linear.0.forward")
    assert began["ranks_reached_through_a_collective"] == [0] and began["ranks_with_their_own_overflow"] == []
    # the hccl group saw DDP's gradient all_reduce write inf/nan on rank 0 from its finite gradients
    assert began["collectives"] == ["all_reduce"] and "then it spread to rank(s) 0 through all_reduce" in output


@pytest.mark.parametrize("options, message", [
    ({"action": "explode"}, "--overflow-action"),
    ({"max_events": 0}, "--overflow-max"),
    ({"level": "tensor"}, "overflow level"),
])
def test_bad_options_are_user_errors(tmp_path, options, message):
    with pytest.raises(UserError, match=message):
        OverflowSession(tmp_path, **options)


def test_overflow_dir_that_is_a_file_is_a_user_error(tmp_path):
    target = tmp_path / "taken"
    target.write_text("")
    with pytest.raises(UserError, match="taken exists and is not a directory"):
        OverflowSession(target)


_SCRIPT = textwrap.dedent("""
    import torch, torch.nn as nn
    import torch_npu  # noqa: F401
    model = nn.Linear(8, 8).npu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        x = torch.randn(4, 8).npu()
        with torch.autocast("npu", dtype=torch.float16):
            loss = (model(x) * (1e6 if step == 1 else 1.0)).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
""")


def _npu_run(tmp_path, *options):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "npukit.run", "--detect-overflow", "--overflow-dir",
                           str(tmp_path / "overflow"), *options, str(script)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_npu_run_stop_is_a_clean_error_and_golden_run_reports_none(tmp_path):
    stopped = _npu_run(tmp_path, "--overflow-action", "stop")
    assert stopped.returncode == 2, stopped.stderr
    assert "overflow at step 1 (rank 0): Tensor.__mul__.0.forward" in stopped.stderr
    assert "train.py, line 9" in stopped.stderr and "Traceback" not in stopped.stderr
    golden = _npu_run(tmp_path, "--golden")
    assert golden.returncode == 0, golden.stderr
    assert json.loads((tmp_path / "overflow" / "overflow.json").read_text())["events"] == []
    assert "no overflow in 3 step(s)" in golden.stderr


def test_a_step_without_end_is_read_before_it_grows_without_bound(tmp_path, npu, monkeypatch):
    import npukit.accuracy.overflow as overflow

    monkeypatch.setattr(overflow, "_RESOLVE_EVERY", 16)
    x = torch.ones(4, dtype=torch.float16, device=npu)
    with OverflowSession(tmp_path, console=False) as session:
        for i in range(40):  # an evaluation loop: no optimizer, no step()
            _ = x * (1e5 if i == 30 else 1.0)
            assert len(session._state.checks.pending) <= 16 and len(session._state.ops) <= 16
        assert [e["name"] for e in session.events] == ["Tensor.__mul__.30.forward"]  # found before the session ends


def test_step_called_after_optimizer_step_does_not_add_empty_steps(tmp_path, npu):
    x = torch.full((2, 2), 1e4, dtype=torch.float16, device=npu)
    model = nn.Linear(2, 2).to(npu, torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with OverflowSession(tmp_path, console=False) as session:
        for step in range(3):
            _ = model(x * (10.0 if step == 1 else 1e-4))
            optimizer.step()
            session.step()
    assert [e["step"] for e in session.events] == [1]
    assert json.loads((tmp_path / "overflow.json").read_text())["steps"] == 3


def test_session_leaves_no_torch_function_mode_behind(tmp_path, npu):
    before = torch._C._len_torch_function_stack()
    x = torch.full((2,), 1e4, dtype=torch.float16, device=npu)
    with OverflowSession(tmp_path, action="dump", max_events=1, console=False):
        _ = x * 10.0  # the limit is reached inside the op's own handler
        _ = x * 10.0
    assert torch._C._len_torch_function_stack() == before


def test_underflow_names_the_op_that_flushes_values_to_zero(tmp_path, npu):
    layer = nn.Linear(16, 4).to(npu, torch.float16)
    with torch.no_grad():
        layer.weight.fill_(1e-4)
        layer.bias.zero_()
    x = torch.full((8, 16), 1e-5, dtype=torch.float16, device=npu)  # x @ W.T = 1.6e-8: below fp16's 6e-8
    with OverflowSession(tmp_path, underflow=True, console=False) as session:
        layer(x)
        layer(x * 1e3)  # 1.6e-5: representable, no underflow
        session.step()
    assert [(u["name"], u["module_class"], u["zero_fraction"], u["input_zero_fraction"])
            for u in session._underflow_list()] == [("Functional.linear.0.forward", "Linear", 1.0, 0.0)]
    assert json.loads((tmp_path / "overflow.json").read_text())["underflow"][0]["name"] == "Functional.linear.0.forward"


def test_zeros_by_design_are_not_underflow(tmp_path, npu):
    # bf16 has float32's exponent range: relu, dropout and masked_fill zeros are all there is.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    mask = torch.rand(32, 4, device=npu) > 0.5

    def batch(step):
        return torch.randn(32, 8)

    session = OverflowSession(tmp_path, underflow=True, console=False)
    with session:
        model = model.to(npu, torch.bfloat16)
        for step in range(2):
            out = model(batch(step).to(npu, torch.bfloat16)).masked_fill(mask, 0.0)
            out.float().square().mean().backward()
            session.step()
    assert session.underflows == {} and session.events == []


def test_module_level_finds_a_weight_gradient_overflow(tmp_path, npu):
    session = _train(BackwardOverflow(), 3, npu, torch.float16, OverflowSession(tmp_path, level="module", console=False),
                     batch=lambda step: torch.rand(64, 16) * 5 + 5,
                     loss_scale=lambda step: 30000.0 if step == 1 else 1.0)
    assert [(e["name"], e["direction"], e["step"]) for e in session.events] == [
        ("Module.fc.Linear.parameters_grad.0", "backward", 1)]


class MaskedScores(nn.Module):
    """Causal attention scores masked with float("-inf"), the way most GPT code is written."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.fc(x) @ x.transpose(-1, -2)
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool, device=x.device).triu(1)
        return F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).sum(-1)


def test_an_infinite_fill_in_saturation_mode_is_shown_once_with_the_fix(tmp_path, npu, capsys):
    torch.manual_seed(0)
    model = MaskedScores().to(npu)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("npu")
    with numerics.policies(fp16_mode="saturation"), OverflowSession(tmp_path) as session:
        for _ in range(3):
            with torch.autocast("npu", dtype=torch.float16):
                loss = model(torch.randn(2, 4, 8, device=npu)).float().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    events = session.events
    assert [event["name"] for event in events] == ["Tensor.masked_fill.0.forward"] * 3
    assert all("torch.finfo" in event["hint"] for event in events)
    err = capsys.readouterr().err
    assert err.count("Tensor.masked_fill.0.forward") == 2  # the event once, the summary's "first:" once
    assert err.count("hint:") == 1 and "2 repeat(s)" in err
    assert json.loads((tmp_path / "overflow.json").read_text())["events"][2]["hint"] == events[0]["hint"]


def test_an_overflow_from_finite_scalars_gets_no_hint(tmp_path, npu):
    x = torch.full((4, 4), 2.0, device=npu, dtype=torch.float16)
    with numerics.policies(fp16_mode="saturation"), OverflowSession(tmp_path, console=False) as session:
        nn.Identity()(x)
        x * 1e5  # saturates, but nothing here is infinite
    assert [event["name"] for event in session.events] == ["Tensor.__mul__.0.forward"]
    assert "hint" not in session.events[0]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sparse_quantized_and_nested_tensors_do_not_stop_the_detector(tmp_path):
    from .models import UnusualLayouts

    with OverflowSession(tmp_path, console=False) as session:
        UnusualLayouts()(torch.randn(3, 4)).backward()
    assert session.events == [] and (tmp_path / "overflow.json").is_file()


def test_a_log_of_exact_zeros_is_not_an_overflow_but_its_infinite_gradient_is(tmp_path, npu):
    # pytorch/examples' word_language_model builds its causal mask as torch.log(torch.tril(ones)):
    # -inf above the diagonal, as written. Differentiated at 0, the log's gradient is infinite.
    scores = torch.randn(4, 4, device=npu)
    with OverflowSession(tmp_path, console=False) as session:
        mask = torch.log(torch.tril(torch.ones(4, 4, device=npu)))
        F.softmax(scores + mask, dim=-1).sum()
    assert session.events == []

    probabilities = torch.tensor([0.0, 0.5, 1.0], device=npu, requires_grad=True)
    with OverflowSession(tmp_path / "differentiated", console=False) as session:
        torch.log(probabilities).clamp(min=-100).sum().backward()
    assert [(event["name"], event["direction"]) for event in session.events] == [("Torch.log.0.backward", "backward")]

    with OverflowSession(tmp_path / "negative", console=False) as session:
        torch.log(torch.tensor([-1.0, 1.0], device=npu))  # nan: a domain error, not a mask
    assert [event["name"] for event in session.events] == ["Torch.log.0.forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_values_whose_sum_overflows_are_not_an_overflow(tmp_path, npu, dtype):
    """transformers' eager attention mask, torch.where(mask, 0, torch.finfo(dtype).min), holds only
    finite values, but their sum is -inf: the fp32 check by a sum named it an overflow in fp32 runs
    of Hugging Face models with eager attention (MindSpeed-LLM's GPT-OSS: 'Torch.where.0.forward in
    module model (GptOssModel), torch.float32: inf/nan from finite inputs'). An inf made from finite
    values still is one, on the npu and on the CPU (torch's min/max there)."""
    for device in (npu, "cpu"):
        causal = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
        lowest, highest = torch.finfo(dtype).min, torch.finfo(dtype).max
        with OverflowSession(tmp_path / device, console=False) as session:
            mask = torch.where(causal, torch.zeros((), device=device, dtype=dtype), lowest)
            F.softmax(torch.randn(64, 64, device=device, dtype=dtype) + mask, dim=-1)
        assert session.events == [], device
        with OverflowSession(tmp_path / f"{device}-inf", console=False) as session:
            torch.full((4,), highest, device=device, dtype=dtype) * 2
        assert [event["name"] for event in session.events] == ["Tensor.__mul__.0.forward"], device
