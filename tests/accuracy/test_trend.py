"""npu-compare --trend: where an NPU run's monitored statistics leave the band two golden runs spread
over (a golden run and one rounded at the NPU run's precision: npu-run --golden-perturb)."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from npukit.accuracy.monitor import MonitorSession
from npukit.accuracy.perturb import PerturbSession
from npukit.accuracy.trend import PAIRING_EXIT_CODE, MonitorsDoNotPair, compare_trend
from npukit.cli import compare_app
from npukit.errors import UserError
from npukit.npu_backend import numerics

pytestmark = pytest.mark.usefixtures("npu")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(16, 32), nn.Tanh()
        self.fc2, self.act2 = nn.Linear(32, 32), nn.Tanh()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


@contextlib.contextmanager
def _one_thread():
    """A tiny model's ops are fastest on one thread (several spin against each other on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(out: Path, steps: int, run: str, lost_from: int | None = None, perturb: str | None = None, **monitor):
    """`run`: "golden" (NPU numerics off, fp32), "npu" (bf16 autocast on the emulated NPU: benign mixed
    precision) or "lost" (that, and from step `lost_from` on fc2's optimizer step runs in pure bf16: its
    weights kept in bf16, so updates smaller than half an ulp of them are lost). The learning rate drops
    20x at half the run, so late updates are small. Returns the monitor's alerts."""
    torch.manual_seed(0)
    model = MLP().to("npu")
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to("npu")
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(2)).to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [steps // 2], gamma=0.05)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_one_thread())
        if run == "golden":
            stack.enter_context(numerics.golden())
        session = stack.enter_context(MonitorSession(out, rank=0, tensorboard=False, **monitor))
        if perturb:
            stack.enter_context(PerturbSession(perturb, rank=0))
        for step in range(steps):
            start = (step * 16) % 64
            x, y = data[start:start + 16], target[start:start + 16]
            with torch.autocast("npu", dtype=torch.bfloat16, enabled=run != "golden"):
                loss = (model(x).float() - y).square().mean()
            loss.backward()
            weight = model.fc2.weight
            if run == "lost" and step >= lost_from:
                with torch.no_grad():
                    lr = optimizer.param_groups[0]["lr"]
                    kept = (weight.to(torch.bfloat16) - (lr * weight.grad).to(torch.bfloat16)).float()
            optimizer.step()
            if run == "lost" and step >= lost_from:
                with torch.no_grad():
                    weight.copy_(kept)
            optimizer.zero_grad()
            schedule.step()
    return session.raised


def golden_pair(folder: Path, steps: int) -> Path:
    """The golden run and, beside it (GOLDEN.perturbed), the one rounded at bf16."""
    assert train(folder / "golden", steps, "golden") == []
    assert train(folder / "golden.perturbed", steps, "golden", perturb="bf16") == []
    return folder / "golden"


@pytest.fixture(scope="module")
def golden_300(tmp_path_factory) -> Path:
    return golden_pair(tmp_path_factory.mktemp("trend"), 300)


def _check_late_departure(golden: Path, steps: int) -> None:
    lost_from = steps * 3 // 4
    npu = golden.parent / "npu_lost"
    train(npu, steps, "lost", lost_from=lost_from)
    result = compare_trend(golden, npu)
    first = result.first()
    assert result.exit_code() == 1
    # fc2's weights, from just after the first pure-bf16 update (recorded at the next step) to the run's end
    assert (first.module(), first.kind, first.last_step) == ("fc2", "weight", steps - 1)
    assert lost_from < first.first_step <= lost_from + steps // 20  # within 5% of the run (other seeds: 36-43 of 2,000)
    assert f"step {first.first_step}" in result.headline() and "in fc2 " in result.headline()
    assert all(d.first_step > lost_from for d in result.departures)  # nothing before it, however benign


def _check_clean(golden: Path, steps: int) -> None:
    npu = golden.parent / "npu_clean"
    assert train(npu, steps, "npu") == []  # no monitor alert either
    result = compare_trend(golden, npu)
    assert result.departures == [] and result.exit_code() == 0
    assert result.headline().startswith(f"No trend divergence: over steps 0-{steps - 1}")


def test_updates_lost_late_in_a_pure_bf16_optimizer_step_are_named_at_their_step_and_module(golden_300):
    _check_late_departure(golden_300, 300)


def test_a_clean_bf16_autocast_run_stays_inside_the_band(golden_300):
    _check_clean(golden_300, 300)


@pytest.mark.slow
def test_2000_steps_late_departure_and_clean_pair(tmp_path):
    golden = golden_pair(tmp_path, 2000)
    _check_late_departure(golden, 2000)
    _check_clean(golden, 2000)


def test_the_perturbed_run_rounds_arithmetic_at_the_precision_but_not_the_optimizer_nor_the_rng():
    torch.manual_seed(3)
    x, w = torch.randn(64, 32), torch.randn(32, 16)
    exact = x @ w
    parameter, unwatched = nn.Parameter(torch.randn(100)), nn.Parameter(torch.empty(100))
    parameter.grad = torch.randn(100)
    with torch.no_grad():
        unwatched.copy_(parameter)
    unwatched.grad = parameter.grad.clone()
    torch.optim.SGD([unwatched], lr=0.1).step()
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    torch.manual_seed(4)
    with PerturbSession("bf16", rank=0):
        rounded = x @ w
        optimizer.step()
        drawn = torch.rand(5)
    relative = ((rounded - exact).abs() / exact.abs().clamp_min(1e-3)).median()
    assert 2 ** -12 < relative < 2 ** -5  # a bf16 rounding's size, not fp32's and not a coarser one
    assert torch.equal(parameter.detach(), unwatched.detach())  # the optimizer's arithmetic is left exact
    torch.manual_seed(4)
    assert torch.equal(drawn, torch.rand(5))  # the script's random stream is its own


def test_grad_scalers_loss_scale_stays_a_power_of_two_in_the_perturbed_run():
    model = nn.Linear(4, 2).to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("npu")
    with PerturbSession("fp16", rank=0):
        for _ in range(3):
            with torch.autocast("npu", dtype=torch.float16):
                loss = model(torch.randn(8, 4, device="npu")).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert math.log2(scaler.get_scale()).is_integer()  # unscaling by it stays exact


def test_hf32_rounds_only_the_cube_units_inputs_and_a_bad_precision_is_named():
    torch.manual_seed(3)
    x, w = torch.randn(64, 32), torch.randn(32, 16)
    with PerturbSession("hf32", rank=0):
        product, shifted = x @ w, x + 1.0
    relative = ((product - x @ w).abs() / (x @ w).abs().clamp_min(1e-3)).median()
    assert 2 ** -16 < relative < 2 ** -9  # HF32's 10 mantissa bits, on the inputs
    assert torch.equal(shifted, x + 1.0)  # the vector unit computes in fp32 under HF32
    with pytest.raises(UserError, match="--golden-perturb 'fp8': expected one of fp16, bf16, hf32, fp32"):
        PerturbSession("fp8")


def _write_monitor(folder: Path, norms: list[float], rank: int = 0) -> Path:
    """A one-record monitor (npu-run --monitor's files) whose fc1 output norm takes these values."""
    (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    rows = ["step,kind,name,dtype,max,min,mean,norm,nan,inf"]
    rows += [f"{step},activation,fc1,float32,1.0,-1.0,0.0,{norm!r},0.0,0.0" for step, norm in enumerate(norms)]
    (folder / f"rank{rank}" / "monitor.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_one_noisy_step_is_not_a_departure_five_in_a_row_are(tmp_path):
    golden = _write_monitor(tmp_path / "golden", [10.0] * 100)
    _write_monitor(tmp_path / "golden.perturbed", [10.0 + 0.001 * (-1) ** step for step in range(100)])
    spike = [10.0] * 100
    spike[60] = 10.1  # 20x the band's half-width (5 x 0.001), for one step
    assert compare_trend(golden, _write_monitor(tmp_path / "spike", spike)).departures == []
    drift = [10.0] * 60 + [10.1] * 5 + [10.0] * 35
    first = compare_trend(golden, _write_monitor(tmp_path / "drift", drift)).first()
    assert (first.name, first.statistic, first.first_step, first.last_step) == ("fc1", "norm", 60, 64)
    inside = [10.0 + 0.004 * (-1) ** step for step in range(100)]  # 4x the golden runs' spread: inside 5x
    assert compare_trend(golden, _write_monitor(tmp_path / "inside", inside)).departures == []


def test_the_rank_that_departs_first_a_nan_and_a_run_that_stopped_early(tmp_path):
    golden_norms, perturbed_norms = [10.0] * 100, [10.0 + 0.001 * (-1) ** step for step in range(100)]
    for rank in (0, 1):
        _write_monitor(tmp_path / "golden", golden_norms, rank)
        _write_monitor(tmp_path / "golden.perturbed", perturbed_norms, rank)
    _write_monitor(tmp_path / "npu", [10.0] * 50 + [10.5] * 50, rank=0)
    _write_monitor(tmp_path / "npu", [10.0] * 40 + [math.nan] * 20, rank=1)  # nan from step 40, then it stopped
    result = compare_trend(tmp_path / "golden", tmp_path / "npu")
    first = result.first()
    assert (first.rank, first.first_step, first.last_step) == (1, 40, 59)
    assert "at step 40 on rank 1" in result.headline() and "beyond any multiple of its half-width" in result.headline()
    # rank 0's departure follows; the steps compared are those rank 1 monitored too, and a note says so
    assert [(d.rank, d.first_step, d.last_step) for d in result.departures] == [(1, 40, 59), (0, 50, 59)]
    assert result.steps == list(range(60)) and any("steps 0-59 compared" in note for note in result.notes)
    # a nan is out of any band: no second draw of the rounding would widen it to that
    assert not any("--perturb-seed" in note for note in result.notes)


def test_a_second_perturbed_run_is_a_second_draw_of_the_band(tmp_path):
    """One perturbed run is one draw of benign rounding: an NPU run whose Adam update took the other sign
    on a gradient element within rounding of zero stays 4e-3 off (a carried offset) where that draw took
    none. A second perturbed run that did (GOLDEN.perturbed.1, found beside GOLDEN) widens the band."""
    golden = _write_monitor(tmp_path / "golden", [10.0] * 40)
    _write_monitor(tmp_path / "golden.perturbed", [10.0 + 1e-4 * (-1) ** step for step in range(40)])
    npu = _write_monitor(tmp_path / "npu", [10.0] + [10.004] * 39)
    one = compare_trend(golden, npu, tmp_path / "golden.perturbed")
    assert (one.first().first_step, one.first().statistic) == (1, "norm")
    assert any("--perturb-seed 1 --monitor " + str(tmp_path / "golden.perturbed.1") in note for note in one.notes)
    _write_monitor(tmp_path / "golden.perturbed.1", [10.0] + [9.997] * 39)  # the other draw: a flip of its own
    both = compare_trend(golden, npu)
    assert both.departures == [] and both.perturbed == [tmp_path / "golden.perturbed", tmp_path / "golden.perturbed.1"]
    # the wider draw is the band; a larger offset still leaves it (5 x 3e-3)
    assert compare_trend(golden, _write_monitor(tmp_path / "far", [10.0] + [10.02] * 39)).first().first_step == 1
    # as npu-compare is told: --perturbed, once per run, and the report names them all
    code, output = _trend_cli(golden, npu, "--perturbed", tmp_path / "golden.perturbed", "--perturbed",
                              tmp_path / "golden.perturbed.1")
    assert code == 0 and "No trend divergence" in output and "golden.perturbed.1" in output
    code, output = _trend_cli(golden, npu, "--perturbed", tmp_path / "golden.perturbed")
    assert code == 1 and "Trend divergence" in output


def test_a_second_perturbed_run_of_the_same_seed_is_refused(tmp_path):
    golden = _write_monitor(tmp_path / "golden", [10.0] * 20)
    _write_monitor(tmp_path / "golden.perturbed", [10.0 + 1e-4 * (-1) ** step for step in range(20)])
    shutil.copytree(tmp_path / "golden.perturbed", tmp_path / "golden.perturbed.1")
    with pytest.raises(MonitorsDoNotPair, match="the same --perturb-seed"):
        compare_trend(golden, _write_monitor(tmp_path / "npu", [10.0] * 20))


def test_perturb_seed_draws_another_rounding_grid():
    import contextlib

    from npukit.accuracy.perturb import PerturbSession
    from npukit.run import RunOptions, _session_contexts, main

    scales = []
    for seed in (0, 1):
        with contextlib.ExitStack() as stack:
            session, = _session_contexts(RunOptions(script="", golden_perturb="bf16", perturb_seed=seed), stack)
            scales.append(session.scale)
    assert scales[1] != scales[0] and scales == [PerturbSession("bf16", seed=s, rank=0).scale for s in (0, 1)]
    with pytest.raises(UserError, match="--perturb-seed goes with --golden-perturb"):
        main(RunOptions(script="train.py", perturb_seed=1))


# ----------------------------------------------------------------------------- pairing
@pytest.fixture(scope="module")
def short_pair(tmp_path_factory) -> Path:
    return golden_pair(tmp_path_factory.mktemp("short"), 20)


def _trend_cli(*args) -> tuple[int, str]:
    """npu-compare --trend ARGS: its exit code and what it printed (a UserError as npu-compare says it: exit 2)."""
    result = CliRunner().invoke(compare_app, ["--trend", *map(str, args)])
    if isinstance(result.exception, UserError):
        return 2, str(result.exception)
    return result.exit_code, result.output


def test_monitors_that_do_not_pair_are_refused_with_their_own_exit_code(short_pair, tmp_path):
    other_modules = tmp_path / "modules"
    train(other_modules, 20, "npu", modules=r"fc1")
    code, output = _trend_cli(short_pair, other_modules)
    assert code == PAIRING_EXIT_CODE and "do not pair" in output and "--monitor-modules" in output
    sampled = tmp_path / "every2"
    train(sampled, 20, "npu", every=2)
    code, output = _trend_cli(short_pair, sampled)
    assert code == PAIRING_EXIT_CODE and "monitored step 2 where the golden run's monitored step 1" in output
    two_ranks = tmp_path / "ranks"
    train(two_ranks, 20, "npu")
    shutil.copytree(two_ranks / "rank0", two_ranks / "rank1")
    code, output = _trend_cli(short_pair, two_ranks)
    assert code == PAIRING_EXIT_CODE and "rank(s) 0, the NPU run rank(s) 0,1" in output
    # a 'perturbed' golden run that is the golden run again has no band
    unperturbed = tmp_path / "golden"
    shutil.copytree(short_pair, unperturbed)
    shutil.copytree(short_pair, tmp_path / "golden.perturbed")
    with pytest.raises(MonitorsDoNotPair, match="band has no width"):
        compare_trend(unperturbed, two_ranks / "rank0")


def test_a_record_one_run_lacks_is_left_out_and_said_the_others_are_compared(short_pair, tmp_path):
    """A Hugging Face Trainer's fp16 run lacks the logits' gradient its fp32 golden run records (the
    logits it returns are an fp32 copy the loss does not use): the trend refused the whole pair."""
    npu = tmp_path / "npu"
    train(npu, 20, "npu")
    every_record = compare_trend(short_pair, npu).records
    table = npu / "rank0" / "monitor.csv"
    lines = table.read_text().splitlines(keepends=True)
    table.write_text("".join(line for line in lines if ",activation_grad,fc3," not in line))
    code, output = _trend_cli(short_pair, npu)
    text = " ".join(output.split())
    assert code == 0 and "No trend divergence" in text
    assert "1 golden record(s) it lacks (activation_grad fc3): not compared" in text
    assert compare_trend(short_pair, npu).records == every_record - 1


def test_a_missing_perturbed_run_says_how_to_record_it(short_pair, tmp_path):
    code, output = _trend_cli(tmp_path / "nowhere", short_pair)
    assert code == 2 and "nowhere.perturbed" in output
    lonely = tmp_path / "lonely"
    shutil.copytree(short_pair, lonely)
    code, output = _trend_cli(lonely, short_pair)
    assert code == 2 and "--golden-perturb" in output and "lonely.perturbed" in output
    # named with --perturbed (the golden run compared with itself: inside the band)
    code, output = _trend_cli(lonely, short_pair, "--perturbed", short_pair.with_name("golden.perturbed"))
    assert code == 0 and "No trend divergence" in output


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_npu_run_golden_perturb_and_the_trend_report(tmp_path):
    """The journey: npu-run writes the three monitors, npu-compare --trend writes the page and the plot."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).npu()\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x, y = torch.randn(32, 8).npu(), torch.randn(32, 2).npu()\n"
        "for step in range(30):\n"
        "    with torch.autocast('npu', dtype=torch.bfloat16, enabled=sys.argv[1] == 'npu'):\n"
        "        loss = (model(x).float() - y).square().mean()\n"
        "    loss.backward(); optimizer.step(); optimizer.zero_grad()\n")
    for options, folder, run in ((["--golden"], "golden", "golden"), (["--golden-perturb", "bf16"], "golden.perturbed",
                                                                        "golden"), ([], "npu", "npu")):
        subprocess.run([sys.executable, "-m", "npukit.run", *options, "--monitor", str(tmp_path / folder), str(script),
                        run], check=True, cwd=tmp_path, timeout=300)
    page = tmp_path / "trend.html"
    code, output = _trend_cli(tmp_path / "golden", tmp_path / "npu", "--html", page, "--json", tmp_path / "trend.json")
    assert code == 0, output
    assert "No trend divergence: over steps 0-29" in output
    svg = (tmp_path / "trend.svg").read_text()
    assert svg.startswith("<svg") and "golden" in svg
    text = page.read_text()
    assert svg in text and "No trend divergence" in text


def test_golden_runs_agreeing_to_the_last_bit_leave_a_band_of_an_fp32_ulp_not_of_zero():
    """Adam's early updates are nearly the sign of the gradient: both golden runs can hold the very same
    weight minimum, and an NPU run one fp32 ulp off is not a departure (it was named at step 3)."""
    import numpy as np

    from npukit.accuracy.trend import MARGIN, band_half_width, outside_band, widest_spread

    golden = np.full((1, 20, 1), -0.3347, dtype=np.float64)
    npu = golden + np.spacing(np.float32(0.3347))
    spread = widest_spread(golden, [golden.copy()])
    half = band_half_width(golden, spread)
    assert np.all(half == MARGIN * np.spacing(np.float32(0.3347)))
    assert not outside_band(golden, spread, npu, half).any()
    assert outside_band(golden, spread, golden + 1e-4, half).all()  # a real difference still is


def _write_scaled_monitor(folder: Path, weights: list[float], grads: list[float], skipped: set[int]) -> Path:
    folder.mkdir(parents=True)
    rows = ["step,kind,name,dtype,max,min,mean,norm,nan,inf"]
    for step, (weight, grad) in enumerate(zip(weights, grads)):
        rows.append(f"{step},weight,fc.weight,float32,{weight},{weight},{weight},{weight},0.0,0.0")
        rows.append(f"{step},grad,fc.weight,float32,{grad},{grad},{grad},{grad},0.0,0.0")
    (folder / "monitor.csv").write_text("\n".join(rows) + "\n")
    lines = ["step,loss,grad_norm,loss_scale,skipped_by_grad_scaler"]
    lines += [f"{step},1.0,{grads[step]},1024.0,{int(step in skipped)}" for step in range(len(weights))]
    (folder / "scalars.csv").write_text("\n".join(lines) + "\n")
    return folder


def test_gradients_of_the_steps_grad_scaler_skipped_are_not_judged_but_the_weights_they_held_back_are(tmp_path):
    """fp16 under GradScaler skips its first steps while the loss scale finds its level (scaled gradients
    overflow): inf gradients there are GradScaler's way, not a departure; weights held back are."""
    steps = 40
    weights = [1.0 - 0.01 * step for step in range(steps)]
    grads = [0.5 + 0.001 * step for step in range(steps)]
    golden = _write_scaled_monitor(tmp_path / "golden", weights, grads, set())
    _write_scaled_monitor(tmp_path / "golden.perturbed", [w * (1 + 1e-4) for w in weights], [g * (1 + 1e-4) for g in grads],
                   set())
    skipped = {0, 1, 2, 3, 4, 5, 6}
    npu_grads = [math.inf if step in skipped else grad for step, grad in enumerate(grads)]
    npu = _write_scaled_monitor(tmp_path / "npu", weights, npu_grads, skipped)
    result = compare_trend(golden, npu)
    assert result.first() is None, result.headline()
    assert any("7 step(s) GradScaler skipped (from step 0)" in note for note in result.notes)
    held_back = _write_scaled_monitor(tmp_path / "held_back", [weights[0]] * 7 + weights[:-7], npu_grads, skipped)
    first = compare_trend(golden, held_back).first()
    assert first is not None and first.kind == "weight"  # the updates the skipped steps did not make show


def test_gradients_of_skipped_steps_do_not_widen_the_band(tmp_path):
    """A perturbed run whose GradScaler skipped its first steps recorded scaled gradients there (finite,
    200x): they are not judged, and they do not widen the gradients' band for the steps after either."""
    steps = 40
    weights = [1.0 - 0.01 * step for step in range(steps)]
    grads = [0.5 + 0.001 * step for step in range(steps)]
    golden = _write_scaled_monitor(tmp_path / "golden", weights, grads, set())
    skipped = set(range(7))
    scaled = [100.0 if step in skipped else g * (1 + 1e-4) for step, g in enumerate(grads)]
    _write_scaled_monitor(tmp_path / "golden.perturbed", [w * (1 + 1e-4) for w in weights], scaled, skipped)
    npu = _write_scaled_monitor(tmp_path / "npu", weights, [g * (1.01 if step >= 10 else 1) for step, g in
                                                             enumerate(grads)], set())
    first = compare_trend(golden, npu).first()
    assert first is not None and (first.kind, first.first_step) == ("grad", 10), first


class ElapsedRegressor(nn.Module):
    """Sensor readings and the time elapsed (unnormalized) -> one value, through a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Linear(9, 32), nn.LayerNorm(32), nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


def train_elapsed_regressor(out: Path, steps: int, run: str) -> None:
    """`run`: "golden", "perturbed" (the golden run rounded at fp16) or "npu" (fp16 autocast); SGD with
    momentum under GradScaler. The elapsed-time feature grows 40 a step: fp16 holds it for ~200 steps."""
    torch.manual_seed(0)
    model = ElapsedRegressor().to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("npu", init_scale=1024.0)
    data = torch.Generator().manual_seed(1)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_one_thread())
        if run != "npu":
            stack.enter_context(numerics.golden())
        stack.enter_context(MonitorSession(out, rank=0, tensorboard=False))
        if run == "perturbed":
            stack.enter_context(PerturbSession("fp16", rank=0))
        for step in range(steps):
            readings = torch.randn(16, 8, generator=data)
            x = torch.cat([readings, torch.full((16, 1), 40.0 * step)], dim=1).to("npu")
            with torch.autocast("npu", dtype=torch.float16, enabled=run == "npu"):
                loss = (model(x).float() - readings[:, :1].sin().to("npu")).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


@pytest.mark.slow  # (three short runs: 3-5 s on the shared machine; the pooled drift's unit test below is fast)
def test_a_clean_fp16_run_whose_weights_drift_more_than_the_one_perturbed_sample_stays_inside(tmp_path):
    """A weight's drift is one slow sample per run: the perturbed run's rounding left embed.bias's minimum
    within 1-3 fp32 ulps of the golden run's (other seeds of it: up to 50x more), the clean fp16 run's
    drifted 15 ulps, and with a band of 5x that one sample the trend named a departure at step 2. The
    band of a weight is at least the drift per movement the golden pair shows over all the weights."""
    for run in ("golden", "perturbed", "npu"):
        train_elapsed_regressor(tmp_path / {"perturbed": "golden.perturbed"}.get(run, run), 12, run)
    result = compare_trend(tmp_path / "golden", tmp_path / "npu")
    assert result.departures == [] and result.exit_code() == 0, result.headline()


def test_a_carried_records_band_is_at_least_the_pooled_drift_of_the_golden_pair():
    """Three weights move alike; the golden pair spread one of them by 1e-7 per unit moved, another by
    1e-5, the third not at all (a lucky sample): its band is the weights' pooled (upper-quartile) rate
    times its movement, not zero; a gradient (not carried from step to step) keeps its own spread."""
    import numpy as np

    from npukit.accuracy.trend import MARGIN, STATS, band_half_width, widest_spread

    steps = 20
    path = np.linspace(1.0, 1.19, steps)  # each step moves the extreme elements 0.01
    golden = np.repeat(np.repeat(path[None, :, None], 4, axis=0), len(STATS), axis=2)
    perturbed = golden.copy()
    movement = 0.01 * np.arange(steps)
    perturbed[0] += 1e-7 * movement[:, None]
    perturbed[1] += 1e-5 * movement[:, None]
    perturbed[3] += 1e-6  # a gradient's own spread
    half = band_half_width(golden, widest_spread(golden, [perturbed]), ["weight", "weight", "weight", "grad"])
    # where the envelope (which looks ahead) has reached the run's end, each rate is the final spread per
    # unit moved so far: the upper quartile of the three, times the lucky weight's own movement
    late = np.arange(steps // 2, steps)
    rate = np.quantile([1e-7, 1e-5, 0.0], 0.75) * movement[-1] / movement[late]
    values = slice(0, STATS.index("nan"))  # (the counts of non-finite elements are not a drift)
    assert np.allclose(half[2, late, values], MARGIN * (rate * movement[late])[:, None], rtol=1e-6)
    assert np.allclose(half[3], MARGIN * np.maximum(1e-6, np.spacing(np.float32(path))[:, None]), rtol=1e-3)
    assert np.all(half[1] >= MARGIN * 1e-5 * movement[:, None] * (1 - 1e-9))  # its own spread, where larger


def _write_weight_and_copy(folder: Path, weight_mean: list[float], other_mean: list[float]) -> Path:
    """A monitor of a position embedding whose output is its whole table (wpe.weight's statistics, the
    activation wpe's the same) and of another weight (fc.weight), both moving 0.01 a step at their
    extremes; `*_mean`: each one's mean per step."""
    (folder / "rank0").mkdir(parents=True, exist_ok=True)
    rows = ["step,kind,name,dtype,max,min,mean,norm,nan,inf"]
    for step, (mean, other) in enumerate(zip(weight_mean, other_mean)):
        extremes = f"{1 + 0.01 * step!r},{-1 - 0.01 * step!r}"
        rows += [f"{step},activation,wpe,float32,{extremes},{mean!r},10.0,0.0,0.0",
                 f"{step},weight,wpe.weight,float32,{extremes},{mean!r},10.0,0.0,0.0",
                 f"{step},weight,fc.weight,float32,{extremes},{other!r},10.0,0.0,0.0"]
    (folder / "rank0" / "monitor.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_an_output_that_is_its_modules_weight_is_judged_with_the_weights_band(tmp_path):
    """A learned position embedding over all its positions outputs its weight as it is (makemore's and
    GPT-2's wpe with the sequence at block_size): the activation carries the weight's drift from step to
    step, so its band is the weight's (the pooled drift of the golden pair's weights), not its own spread:
    on makemore's clean bf16 run wpe's output mean was named at 1.56x its band, the weight at 0.13x."""
    steps = 40
    golden = _write_weight_and_copy(tmp_path / "golden", [0.0] * steps, [0.0] * steps)
    # the golden pair drifted fc.weight's mean 1e-4 per step (0.01 per unit its extremes moved) and,
    # by luck, wpe's 1e-9
    _write_weight_and_copy(tmp_path / "golden.perturbed", [1e-9 * t for t in range(steps)],
                           [1e-4 * t for t in range(steps)])
    clean = compare_trend(golden, _write_weight_and_copy(tmp_path / "npu", [1e-4 * t for t in range(steps)],
                                                         [0.0] * steps))
    assert clean.departures == [], clean.headline()
    # a weight that really departs is still named, the weight before its output
    far = compare_trend(golden, _write_weight_and_copy(tmp_path / "far", [1e-2 * t for t in range(steps)],
                                                       [0.0] * steps))
    assert [(d.record(), d.statistic) for d in far.departures[:2]] == [("weight wpe.weight", "mean"),
                                                                      ("activation wpe", "mean")]


def test_the_npu_and_golden_values_are_printed_to_the_digits_that_tell_them_apart(tmp_path):
    """makemore's wpe output norm left its band (+-5.4e-05) with 'NPU 31.64, golden 31.64': 4 significant
    digits could not show the difference the verdict was about."""
    golden = _write_monitor(tmp_path / "golden", [31.64] * 40)
    _write_monitor(tmp_path / "golden.perturbed", [31.64 + 1e-6 * (-1) ** step for step in range(40)])
    result = compare_trend(golden, _write_monitor(tmp_path / "npu", [31.64] * 10 + [31.64006] * 30))
    assert "NPU 31.64006, golden 31.64, band" in result.headline()
    code, output = _trend_cli(golden, tmp_path / "npu")
    assert code == 1 and "31.64006" in output


def _write_weight(folder: Path, maxima: list[float], norms: list[float]) -> Path:
    """A monitor of one weight (fc.weight) whose largest element and norm take these values."""
    (folder / "rank0").mkdir(parents=True, exist_ok=True)
    rows = ["step,kind,name,dtype,max,min,mean,norm,nan,inf"]
    rows += [f"{step},weight,fc.weight,float32,{largest!r},-1.0,0.0,{norm!r},0.0,0.0"
             for step, (largest, norm) in enumerate(zip(maxima, norms))]
    (folder / "rank0" / "monitor.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_a_weights_largest_element_may_change_hands_as_far_as_the_norm_says_its_elements_moved(tmp_path):
    """makemore's attention key bias gets rounding noise for a gradient (softmax ignores a shift), which
    Adam turns into steps of its learning rate: on each low-precision run its elements walked (0.01 rms on
    the perturbed run as on the NPU run), and on the NPU run one walked past the bias's largest element
    (c_attn.bias max, 2x its band at step 290; in 3 of 3 clean runs at some layer's max or min), where the
    perturbed runs' largest stayed the same element. The norm's spread shows how far the elements move."""
    steps = 40
    golden = _write_weight(tmp_path / "golden", [1.0] * steps, [10.0] * steps)
    _write_weight(tmp_path / "golden.perturbed", [1.0] * steps, [10.0 + 1e-3 * (-1) ** step for step in range(steps)])
    crossed = compare_trend(golden, _write_weight(tmp_path / "npu", [1.0] * 20 + [1.003] * 20, [10.0] * steps))
    assert crossed.departures == [], crossed.headline()
    # a largest element far beyond what the elements moved still leaves the band
    far = compare_trend(golden, _write_weight(tmp_path / "far", [1.0] * 20 + [1.02] * 20, [10.0] * steps))
    assert (far.first().statistic, far.first().first_step) == ("max", 20)


def test_a_localized_step_without_a_divergence_of_its_own_leaves_the_trend_divergence_standing(tmp_path, monkeypatch):
    """makemore's block kept in bf16 by its optimizer left the band at step 151; that step re-run from the
    golden state compared clean (the lost update is far within tolerance of the weight it is added to), and
    --trend --localize exited 0 under the trend's divergence: a script would read the run as sound."""
    import npukit.accuracy.localize as localize_module
    from npukit.accuracy.cli_compare import FindFixOptions, run_trend_command
    from npukit.console import make_console

    golden = _write_monitor(tmp_path / "golden", [10.0] * 40)
    _write_monitor(tmp_path / "golden.perturbed", [10.0 + 1e-3 * (-1) ** step for step in range(40)])
    npu = _write_monitor(tmp_path / "npu", [10.0] * 20 + [10.5] * 20)
    localized = []
    monkeypatch.setattr(localize_module, "localize", lambda departure, *rest: localized.append(departure) or 0)
    console = make_console()
    with console.capture() as captured:
        code = run_trend_command(golden, npu, None, None, None, None, 5, console,
                                 localize=FindFixOptions(["npu-run", "train.py"], work=tmp_path / "localize"))
    assert [d.first_step for d in localized] == [20]
    assert code == 1 and "the trend divergence above stands (exit 1)" in captured.get()
    monkeypatch.setattr(localize_module, "localize", lambda *args: 2)  # otherwise the compare's exit code
    assert run_trend_command(golden, npu, None, None, None, None, 5, console,
                             localize=FindFixOptions(["npu-run", "train.py"], work=tmp_path / "again")) == 2
