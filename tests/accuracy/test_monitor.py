"""npu-run --monitor: per-step statistics written as the run goes, alerts, the overflow forecast."""

from __future__ import annotations

import csv
import gc
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from npukit.accuracy.event_file import crc32c
from npukit.accuracy.monitor import MonitorSession, _StepLayout
from npukit.errors import UserError

pytestmark = pytest.mark.usefixtures("npu")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _stats(tensor: torch.Tensor) -> dict[str, float]:
    data = tensor.detach().double().cpu()
    return {"max": float(data.max()), "min": float(data.min()), "mean": float(data.mean()),
            "norm": float(data.norm()), "nan": float(data.isnan().sum()), "inf": float(data.isinf().sum())}


def _close(row: dict, expected: dict[str, float]) -> None:
    for stat, value in expected.items():
        assert float(row[stat]) == pytest.approx(value, rel=1e-5, abs=1e-6), (row["kind"], row["name"], stat)


def test_files_hold_each_steps_statistics_recomputed_from_the_tensors(tmp_path):
    torch.manual_seed(0)
    model = TwoLayers().to("npu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(5, 4, device="npu")
    expected: list[dict] = []
    with MonitorSession(tmp_path / "mon", rank=0) as session:
        for _ in range(3):
            hidden = model.act(model.fc1(x))
            hidden.retain_grad()
            out = model.fc2(hidden)
            out.retain_grad()
            loss = out.square().mean()
            loss.backward()
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
            optimizer.step()
            expected.append({"loss": loss.item(), "hidden": hidden.detach().clone(), "out": out.detach().clone(),
                             "hidden_grad": hidden.grad.clone(), "out_grad": out.grad.clone(),
                             "weights": weights, "grads": grads,
                             "exp_avg": {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()},
                             "ratio": {n: _adam_ratio(optimizer, p, weights[n]) for n, p in model.named_parameters()}})
            optimizer.zero_grad()
    assert session.raised == []
    folder = tmp_path / "mon" / "rank0"
    rows = _rows(folder / "monitor.csv")
    assert not [r for r in rows if r["kind"] == "grad_local"]  # one rank: no reduce, one gradient
    by_key = {(int(r["step"]), r["kind"], r["name"]): r for r in rows}
    for step, seen in enumerate(expected):
        _close(by_key[(step, "activation", "act")], _stats(seen["hidden"]))
        _close(by_key[(step, "activation", "fc2")], _stats(seen["out"]))
        _close(by_key[(step, "activation_grad", "act")], _stats(seen["hidden_grad"]))
        _close(by_key[(step, "activation_grad", "fc2")], _stats(seen["out_grad"]))
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            _close(by_key[(step, "weight", name)], _stats(seen["weights"][name]))
            _close(by_key[(step, "grad", name)], _stats(seen["grads"][name]))
            _close(by_key[(step, "exp_avg", name)], _stats(seen["exp_avg"][name]))
            assert float(by_key[(step, "update_ratio", name)]["mean"]) == pytest.approx(seen["ratio"][name], rel=1e-5)
    scalars = _rows(folder / "scalars.csv")
    assert [int(r["step"]) for r in scalars] == [0, 1, 2]
    for row, seen in zip(scalars, expected):
        assert float(row["loss"]) == pytest.approx(seen["loss"], rel=1e-6)
        total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in seen["grads"].values()))
        assert float(row["grad_norm"]) == pytest.approx(total, rel=1e-6)
        assert row["loss_scale"] == ""

    # TensorBoard reads the same numbers from the event file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([s["loss"] for s in expected], rel=1e-6)
    norms = events.Scalars("grad/fc1.weight/norm")
    assert [e.value for e in norms] == pytest.approx(
        [float(s["grads"]["fc1.weight"].double().norm()) for s in expected], rel=1e-6)


@pytest.mark.parametrize("odd_name", ['50%,"odd"', "nul\x00name"])
def test_rows_are_written_as_csv_writer_writes_them_whatever_the_module_names(tmp_path, odd_name):
    """monitor.csv's rows are formatted per step from a template (the step, then each record's
    fields): a name with %, a comma, quotes or a NUL character is written as csv.writer writes it."""
    torch.manual_seed(0)
    model = nn.ModuleDict({odd_name: nn.Linear(3, 2), "plain": nn.Linear(2, 1)}).to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, device="npu")
    with MonitorSession(tmp_path / "mon", rank=0):
        for _ in range(3):
            model["plain"](model[odd_name](x)).square().mean().backward()
            before_update = float(model[odd_name].weight.detach().double().norm())
            optimizer.step()
            optimizer.zero_grad()
    path = tmp_path / "mon" / "rank0" / "monitor.csv"
    text = path.read_bytes().decode()
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    rewritten = io.StringIO()
    csv.writer(rewritten).writerows(rows)
    assert text == rewritten.getvalue()
    assert rows[0] == ["step", "kind", "name", "dtype", "max", "min", "mean", "norm", "nan", "inf"]
    names = {(row[0], row[1], row[2]) for row in rows[1:]}
    for step in ("0", "1", "2"):
        assert {(step, "weight", f"{odd_name}.weight"), (step, "activation", odd_name)} <= names
    weight = next(row for row in rows[1:] if row[:3] == ["2", "weight", f"{odd_name}.weight"])
    assert float(weight[7]) == pytest.approx(before_update, rel=1e-6)


def _adam_ratio(optimizer, parameter, weight_before) -> float:
    """lr x |m^ / (sqrt(v^) + eps)| / |the weight before the update|"""
    state, group = optimizer.state[parameter], optimizer.param_groups[0]
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    m_hat = state["exp_avg"].double().cpu() / (1 - beta1 ** step)
    v_hat = state["exp_avg_sq"].double().cpu() / (1 - beta2 ** step)
    update = group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
    return float(update.norm() / weight_before.double().cpu().norm())


def test_crc32c_is_castagnolis_on_short_and_long_data():
    import random

    def bitwise(data: bytes) -> int:
        crc = 0xFFFFFFFF
        for byte in data:
            crc ^= byte
            for _ in range(8):
                crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        return crc ^ 0xFFFFFFFF

    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    generator = random.Random(3)
    for size in (0, 1, 3, 4, 5, 256, 257, 1000, 4099, 20000):
        data = bytes(generator.randrange(256) for _ in range(size))
        assert crc32c(data) == bitwise(data), size



def _tricky_floats() -> list[float]:
    """Values whose repr takes each of Python's layouts: positional with ".0", positional with leading
    zeros, exponent (e-05, e+16, e+308), signed zero, subnormals, float32-rounded numbers, inf/nan,
    random bit patterns."""
    import random
    import struct

    generator = random.Random(11)
    values = [0.0, -0.0, 1.0, -2.5, 0.1, 0.30000000000000004, 1e-4, 1e-5, 1.234e-4, 9999999999999998.0, 1e15, 1e16,
              1e17, 123456789012345678.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e22, -1.5e-10,
              float("inf"), float("-inf"), float("nan"), 3.4028234663852886e38, 1e39, -1e39, 1e-46]
    for _ in range(3000):
        values.append(struct.unpack("<d", struct.pack("<Q", generator.getrandbits(64)))[0])
        values.append(struct.unpack("<f", struct.pack("<I", generator.getrandbits(32)))[0])
        values.append(generator.uniform(-1, 1) * 10.0 ** generator.randint(-30, 30))
    return values + [1.0] * (-len(values) % 6)


def test_monitor_csv_rows_are_what_csv_writer_writes():
    """monitor.csv's rows are made in C++ (csv_rows): byte for byte csv.writer's, floats as their repr."""
    from npukit.watch._tensor_stats import csv_rows

    values = _tricky_floats()
    keys = [("activation", f"blocks.{i}.mlp" if i % 3 else 'odd "name", quoted', "float32") for i in range(len(values) // 6)]
    layout = _StepLayout(keys)
    expected = io.StringIO()
    writer = csv.writer(expected)
    for row, (kind, name, dtype) in enumerate(keys):
        writer.writerow([12, kind, name, dtype, *values[6 * row:6 * row + 6]])
    assert csv_rows("12", layout.csv_prefixes, values, 6) == expected.getvalue()
    with pytest.raises(ValueError, match="5 values for 1 rows of 6"):
        csv_rows("0", layout.csv_prefixes[:1], values[:5], 6)


def test_tensorboard_summary_rounds_to_float32_as_numpy_does():
    """The Summary of a step's values in one C call (fill_float32): the bytes of each tag's own
    Summary.Value, values rounded to float32 as numpy rounds them (beyond its range: inf)."""
    from npukit.accuracy import event_file
    from npukit.watch._stats import fill_float32

    values = _tricky_floats()
    tags = [f"activation/layer{i}/max" for i in range(len(values))]
    assert event_file.SummaryLayout(tags).summary(values) == event_file._summary(list(zip(tags, values)))
    with pytest.raises(ValueError, match="2 values for 1 holes"):
        fill_float32(bytes(8), (0).to_bytes(8, "little"), [1.0, 2.0])
    with pytest.raises(ValueError, match="outside the template"):
        fill_float32(bytes(8), (6).to_bytes(8, "little"), [1.0])


def _train(session: MonitorSession, steps: int, model: nn.Module, batch: torch.Tensor, dtype=torch.float32,
           scaler: torch.amp.GradScaler | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with session:
        for _ in range(steps):
            loss = model(batch).float().square().mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()


def test_a_clean_run_raises_no_alert(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 1)).to("npu")
    session = MonitorSession(tmp_path / "mon", rank=0)
    _train(session, 40, model, torch.randn(16, 8, device="npu"))
    assert session.raised == []
    assert not (tmp_path / "mon" / "rank0" / "alerts.csv").exists()
    assert len(_rows(tmp_path / "mon" / "rank0" / "scalars.csv")) == 40


class Growing(nn.Module):
    """An fp16 block whose output grows 15% a step (its weight is scaled by the training loop)
    until it overflows fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.proj(x))


def test_the_forecast_names_the_growing_module_ten_steps_before_its_first_inf(tmp_path):
    gc.collect()  # no optimizer of an earlier test left: steps end at each new forward of the model
    torch.manual_seed(2)
    model = Growing().to("npu", torch.float16)
    with torch.no_grad():
        model.proj.weight.copy_(torch.eye(8))
        model.out.weight.fill_(0.01)  # the head's output stays well inside fp16's range
    batch = torch.full((4, 8), 2.0, device="npu", dtype=torch.float16)
    proj_overflowed: list[bool] = []  # per step: proj's output holds an inf
    model.proj.register_forward_hook(lambda module, args, out: proj_overflowed.append(bool(out.isinf().any())))
    session = MonitorSession(tmp_path / "mon", rank=0)
    with session:
        for _ in range(100):  # updated by hand, no optimizer: proj's output is 2 * 1.15**step
            model(batch).float().mean().backward()
            with torch.no_grad():
                model.proj.weight.mul_(1.15)
            model.zero_grad()
    first_inf = proj_overflowed.index(True)
    assert first_inf > 60
    forecasts = [a for a in session.raised if a.rule == "overflow forecast"]
    assert forecasts, session.raised
    assert forecasts[0].name == "proj:activation"
    assert forecasts[0].step <= first_inf - 10
    assert "fp16 overflow in about" in forecasts[0].message
    nan_alerts = [a for a in session.raised if a.rule == "nan/inf"]
    assert nan_alerts and nan_alerts[0].step == first_inf and nan_alerts[0].name == "proj"
    written = _rows(tmp_path / "mon" / "rank0" / "alerts.csv")
    assert [row["rule"] for row in written] == [a.rule for a in session.raised]
    assert len(_rows(tmp_path / "mon" / "rank0" / "scalars.csv")) == 100


def test_evaluation_forwards_are_not_the_training_steps(tmp_path):
    torch.manual_seed(8)
    model = TwoLayers().to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with MonitorSession(tmp_path / "mon", rank=0):
        for _ in range(2):
            model(torch.randn(4, 4, device="npu")).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():  # evaluation between steps, 1000 times the values
                model(1000 * torch.ones(4, 4, device="npu"))
    rows = _rows(tmp_path / "mon" / "rank0" / "monitor.csv")
    activations = [r for r in rows if r["kind"] == "activation"]
    assert sorted((int(r["step"]), r["name"]) for r in activations) == [
        (step, name) for step in (0, 1) for name in ("TwoLayers", "act", "fc1", "fc2")]
    assert all(abs(float(r["max"])) < 100 for r in activations)


def test_the_nan_alert_names_the_first_module_with_a_nan(tmp_path):
    class Poisoned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)
            self.third = nn.Linear(4, 1)

        def forward(self, x):
            hidden = self.second(self.first(x))
            return self.third(torch.log(hidden))  # log of a negative value: nan from here on

    torch.manual_seed(3)
    model = Poisoned().to("npu")
    session = MonitorSession(tmp_path / "mon", rank=0)
    _train(session, 2, model, torch.randn(8, 4, device="npu"))
    first = [a for a in session.raised if a.rule == "nan/inf"]
    assert len(first) == 1 and first[0].step == 0 and first[0].name == "third"
    assert "nan" in first[0].message


def test_the_nan_alert_names_a_weight_an_update_made_non_finite_not_the_output_computed_from_it(tmp_path):
    """A pure-fp16 AdamW step (eps underflows: 0/0) left nan in MindSpeed-LLM's GPT-OSS weights; the
    next step's alert named the first module output computed from them ('nan value(s) in
    model.embed_tokens output, the first module with a non-finite value'), as if the forward made it."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1)).to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4, device="npu")
    with MonitorSession(tmp_path / "mon", rank=0) as session:
        for step in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                with torch.no_grad():
                    model[2].weight[1, 2] = float("nan")  # what a broken update leaves
    [alert] = [a for a in session.raised if a.rule == "nan/inf"]
    assert (alert.step, alert.name, alert.statistic, alert.value) == (1, "2.weight", "nan", 1.0)
    assert "a weight this step's forward used" in alert.message


def test_grad_scaler_runs_unscale_and_skipped_steps_raise_no_alert(tmp_path):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to("npu")
    scaler = torch.amp.GradScaler("npu", init_scale=2.0 ** 24)  # fp32 grads: the first steps overflow
    session = MonitorSession(tmp_path / "mon", rank=0)
    batch = torch.randn(8, 8, device="npu")
    with torch.autocast("npu", dtype=torch.float16):
        _train(session, 12, model, batch, scaler=scaler)
    scalars = _rows(tmp_path / "mon" / "rank0" / "scalars.csv")
    assert [float(r["loss_scale"]) > 0 for r in scalars] == [True] * 12
    assert scalars[0]["skipped_by_grad_scaler"] == "1"  # fp16 gradients at 2**24 overflow
    assert float(scalars[-1]["loss_scale"]) < 2.0 ** 24
    with torch.no_grad():
        plain = float(model(batch).float().square().mean())  # about the last losses: the loss is unscaled
    assert float(scalars[-1]["loss"]) == pytest.approx(plain, rel=0.2)
    assert session.raised == []  # the inf gradients of the skipped steps are GradScaler's business


def test_every_and_module_filter(tmp_path):
    torch.manual_seed(5)
    model = TwoLayers().to("npu")
    session = MonitorSession(tmp_path / "mon", every=3, modules=r"^fc2", rank=0)
    _train(session, 7, model, torch.randn(4, 4, device="npu"))
    rows = _rows(tmp_path / "mon" / "rank0" / "monitor.csv")
    assert sorted({int(r["step"]) for r in rows}) == [0, 3, 6]
    assert {r["name"] for r in rows} == {"fc2", "fc2.weight", "fc2.bias"}


def test_the_run_survives_a_monitor_failure(tmp_path, monkeypatch, capfd):
    def broken(self, *args):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(MonitorSession, "_on_activation_grad", broken)
    torch.manual_seed(6)
    model = TwoLayers().to("npu")
    before = [p.detach().clone() for p in model.parameters()]
    session = MonitorSession(tmp_path / "mon", rank=0)
    _train(session, 3, model, torch.randn(4, 4, device="npu"))
    assert session.broken
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))  # it trained
    err = capfd.readouterr().err
    assert err.count("disk on fire") == 1 and "monitoring stopped" in err


def test_npu_run_monitor_end_to_end(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(4, 1).npu()\n"
        "optimizer = torch.optim.Adam(model.parameters())\n"
        "for _ in range(3):\n"
        "    model(torch.randn(2, 4).npu()).sum().backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n")
    result = subprocess.run([sys.executable, "-m", "npukit.run", "--monitor", str(tmp_path / "mon"),
                             "--monitor-every", "2", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    scalars = _rows(tmp_path / "mon" / "rank0" / "scalars.csv")
    assert [int(r["step"]) for r in scalars] == [0, 2]


def test_a_bad_option_is_named():
    with pytest.raises(UserError, match=r"--monitor-modules '\(' is not a regular expression"):
        MonitorSession(Path("unused"), modules="(")
    with pytest.raises(UserError, match="--monitor-every must be at least 1"):
        MonitorSession(Path("unused"), every=0)


def test_msprobe_monitor_config_keys_mean_what_they_mean_in_msprobe(tmp_path, capsys):
    from npukit.accuracy.monitor import load_monitor_config

    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps({
        "targets": {"fc2": {}}, "step_interval": 2, "start_step": 1, "format": "csv", "xy_distribution": True,
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}))
    options = load_monitor_config(config)
    assert "xy_distribution not applied" in capsys.readouterr().err
    assert options["rules"].turbulence == 0.5
    torch.manual_seed(7)
    session = MonitorSession(tmp_path / "mon", rank=0, **options)
    _train(session, 6, TwoLayers().to("npu"), torch.randn(4, 4, device="npu"))
    rows = _rows(tmp_path / "mon" / "rank0" / "monitor.csv")
    assert sorted({int(r["step"]) for r in rows}) == [1, 3, 5]
    assert {r["name"] for r in rows} == {"fc2", "fc2.weight", "fc2.bias"}
    assert not list((tmp_path / "mon" / "rank0").glob("events.out.tfevents.*"))  # format csv: no TensorBoard

    config.write_text('{"step_interval": 0}')
    with pytest.raises(UserError, match=r"monitor_config.json: step_interval must be an integer >= 1, got 0"):
        load_monitor_config(config)
    config.write_text('{"format": "api"}')
    with pytest.raises(UserError, match="format 'api'"):
        load_monitor_config(config)
    config.write_text('{\n"targets": }')
    with pytest.raises(UserError, match=r"monitor_config.json, line 2: not JSON"):
        load_monitor_config(config)


def test_npu_run_takes_the_config_or_the_options_not_both(tmp_path):
    from npukit.run import RunOptions, _monitor_options

    config = tmp_path / "monitor_config.json"
    config.write_text('{"step_interval": 5}')
    assert _monitor_options(RunOptions(script="train.py", monitor=tmp_path, monitor_config=config))["every"] == 5
    with pytest.raises(UserError, match="--monitor-config needs --monitor DIR"):
        _monitor_options(RunOptions(script="train.py", monitor_config=config))
    with pytest.raises(UserError, match="says what --monitor-every would"):
        _monitor_options(RunOptions(script="train.py", monitor=tmp_path, monitor_config=config, monitor_every=3))


def test_files_are_written_as_the_run_goes_with_at_most_two_steps_waiting(tmp_path, monkeypatch):
    import time

    write_step = MonitorSession._write_step

    def slow_disk(self, *args):
        time.sleep(0.05)
        write_step(self, *args)

    monkeypatch.setattr(MonitorSession, "_write_step", slow_disk)
    torch.manual_seed(9)
    model = TwoLayers().to("npu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = MonitorSession(tmp_path / "mon", rank=0)
    written_while_training = []
    with session:
        for _ in range(8):
            model(torch.randn(4, 4, device="npu")).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            assert len(session._pending) <= 2  # what waits for the writer is bounded
            scalars = tmp_path / "mon" / "rank0" / "scalars.csv"
            written_while_training.append(len(_rows(scalars)) if scalars.exists() else 0)
    assert all(count >= step - 1 for step, count in enumerate(written_while_training)), written_while_training
    assert len(_rows(tmp_path / "mon" / "rank0" / "scalars.csv")) == 8


def test_a_file_that_cannot_be_written_stops_the_monitor_not_the_run(tmp_path, monkeypatch, capfd):
    def full_disk(self, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MonitorSession, "_write_step", full_disk)
    torch.manual_seed(10)
    model = TwoLayers().to("npu")
    session = MonitorSession(tmp_path / "mon", rank=0)
    _train(session, 6, model, torch.randn(4, 4, device="npu"))
    assert session.broken
    err = capfd.readouterr().err
    assert err.count("No space left on device") == 1 and err.count("could not write into") == 1


def test_under_torchrun_the_monitor_option_reaches_each_rank(monkeypatch):
    """torchrun reads `--monitor` as an abbreviation of its --monitor-interval: each rank's npu-run
    gets it under its other name."""
    import subprocess as subprocess_module

    from torch.distributed.run import get_args_parser

    from npukit.run import RunOptions, _launch_torchrun

    commands = []

    class Launched:  # torchrun, as npu-run starts it (it waits for it, passing SIGTERM on)
        def __init__(self, command, env):
            commands.append(command)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess_module, "Popen", Launched)
    monkeypatch.setattr(sys, "argv", ["npu-run", "--nproc-per-node", "2", "--monitor", "mon", "--monitor-every=5",
                                      "train.py", "--steps", "3"])
    assert _launch_torchrun(RunOptions(script="train.py", nproc_per_node=2)) == 0
    torchrun_args = commands[0][commands[0].index("torch.distributed.run") + 1:]
    parsed = get_args_parser().parse_args(torchrun_args)
    assert parsed.training_script == "npukit.run"
    assert parsed.training_script_args == ["--monitor-dir", "mon", "--monitor-every=5", "train.py", "--steps", "3"]


def test_a_second_run_into_the_same_folder_leaves_nothing_of_the_first(tmp_path):
    model = Growing().to("npu")
    folder = tmp_path / "mon" / "rank0"
    folder.mkdir(parents=True)
    (folder / "alerts.csv").write_text("step,rule,name,statistic,value,message\n3,nan/inf,x,nan,1,old\n")
    (folder / "events.out.tfevents.1.old.1").write_bytes(b"")
    _train(MonitorSession(tmp_path / "mon", rank=0), 2, model, torch.ones(2, 8, device="npu"))
    assert not (folder / "alerts.csv").exists()
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1


def test_a_run_whose_every_step_grad_scaler_skips_is_told_it_does_not_train(tmp_path):
    class Overflowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * 1e4  # its gradient overflows fp16 at any loss scale GradScaler tries

    torch.manual_seed(11)
    model = Overflowing().to("npu")
    session = MonitorSession(tmp_path / "mon", rank=0)
    with torch.autocast("npu", dtype=torch.float16):
        _train(session, 12, model, 1e4 * torch.ones(8, 4, device="npu"), scaler=torch.amp.GradScaler("npu"))
    scalars = _rows(tmp_path / "mon" / "rank0" / "scalars.csv")
    assert all(row["skipped_by_grad_scaler"] == "1" for row in scalars)
    skipped = [a for a in session.raised if a.rule == "skipped steps"]
    assert len(skipped) == 1 and skipped[0].step == 9
    assert "GradScaler skipped every step since step 0 (loss scale 65536 ->" in skipped[0].message


# Two models on 2 ranks, each rank its own data: one under DDP (small buckets: several reduces inside
# backward), one whose gradients the script all-reduces itself after backward, as some trainers do.
_TWO_RANK_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
dist.init_process_group("hccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
bucketed = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).npu()
by_hand = nn.Sequential(nn.Linear(8, 4)).npu()
ddp = nn.parallel.DistributedDataParallel(bucketed, bucket_cap_mb=0.0001)
optimizer = torch.optim.SGD([*ddp.parameters(), *by_hand.parameters()], lr=0.1)
generator = torch.Generator().manual_seed(rank)
for _ in range(2):
    x, y = torch.randn(4, 8, generator=generator).npu(), torch.randn(4, 4, generator=generator).npu()
    loss = F.mse_loss(ddp(x), y) + F.mse_loss(by_hand(x), y)
    optimizer.zero_grad()
    loss.backward()
    for parameter in by_hand.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= world
    optimizer.step()
dist.destroy_process_group()
"""


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_on_two_ranks_each_gradient_is_recorded_before_and_after_the_reduce(tmp_path):
    import os

    (tmp_path / "train.py").write_text(_TWO_RANK_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", "--monitor", "mon", "train.py"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [{(int(r["step"]), r["kind"], r["name"]): r for r in _rows(tmp_path / "mon" / f"rank{rank}" / "monitor.csv")}
             for rank in (0, 1)]
    reduced = {key for key in ranks[0] if key[1] == "grad"}
    assert len(reduced) == 2 * 6  # 2 steps, the 4 parameters of the DDP model and the 2 reduced by hand
    for step, _, name in reduced:
        local = [ranks[rank][(step, "grad_local", name)] for rank in (0, 1)]
        after = [ranks[rank][(step, "grad", name)] for rank in (0, 1)]
        assert local[0]["norm"] != local[1]["norm"], name  # each rank's own data, its own gradient
        assert {k: after[0][k] for k in ("max", "min", "mean", "norm")} == \
            {k: after[1][k] for k in ("max", "min", "mean", "norm")}, name  # the same after the reduce
        # the reduce averages: so are the means
        assert float(after[0]["mean"]) == pytest.approx((float(local[0]["mean"]) + float(local[1]["mean"])) / 2,
                                                        rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("order", ["gan", "groups"])
def test_each_of_several_optimizers_has_its_state_recorded_in_its_training_step(tmp_path, order):
    """A GAN (D steps, then G's forward through D, backward and step) and two optimizers over parameter
    groups stepping one after the other: a step per training step, each optimizer's parameters once in
    it, with the state its own step left."""
    torch.manual_seed(12)
    generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).to("npu")
    critic = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to("npu")
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=1e-2)
    d_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    seen: list[dict] = []
    with MonitorSession(tmp_path / "mon", rank=0):
        for _ in range(4):
            z, real = torch.randn(5, 4, device="npu"), torch.randn(5, 6, device="npu")
            fake = generator(z)
            if order == "gan":
                d_loss = critic(real).mean() - critic(fake.detach()).mean()
                d_optimizer.zero_grad()
                d_loss.backward()
                d_optimizer.step()
                g_optimizer.zero_grad()
                (-critic(fake).mean()).backward()
                g_optimizer.step()
            else:
                d_loss = critic(fake).square().mean()
                d_loss.backward()
                d_optimizer.step()
                g_optimizer.step()
                d_optimizer.zero_grad()
                g_optimizer.zero_grad()
            seen.append({"loss": d_loss.item(),
                         **{(model, i): optimizer.state[p]["exp_avg"].clone()
                            for model, optimizer in (("g", g_optimizer), ("d", d_optimizer))
                            for i, p in enumerate((generator if model == "g" else critic).parameters())}})
    rows = _rows(tmp_path / "mon" / "rank0" / "monitor.csv")
    scalars = _rows(tmp_path / "mon" / "rank0" / "scalars.csv")
    assert [int(r["step"]) for r in scalars] == [0, 1, 2, 3]  # once per training step, none left over
    assert [float(r["loss"]) for r in scalars] == pytest.approx([s["loss"] for s in seen], rel=1e-6)
    for step, expected in enumerate(seen):
        state = [r for r in rows if int(r["step"]) == step and r["kind"] == "exp_avg"]
        assert len(state) == 8  # each optimizer's 4 parameters, once
        by_norm = sorted(float(r["norm"]) for r in state)
        assert by_norm == pytest.approx(sorted(float(t.double().norm()) for t in list(expected.values())[1:]),
                                        rel=1e-5)
        kinds = {r["kind"] for r in rows if int(r["step"]) == step}
        assert {"weight", "grad", "exp_avg_sq", "update_ratio"} <= kinds
        activations = [r["name"] for r in rows if int(r["step"]) == step and r["kind"] == "activation"]
        assert len(activations) == len(set(activations))
        # the same modules each step, named alike
        assert activations == [r["name"] for r in rows if int(r["step"]) == 0 and r["kind"] == "activation"]


def test_adam_state_the_one_pass_kernel_does_not_read_is_measured_by_torch(tmp_path):
    """bf16 state (a pure-bf16 model) takes torch's ops: the same records as fp32 state's one read."""
    torch.manual_seed(13)
    model = TwoLayers().to("npu", torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4, device="npu", dtype=torch.bfloat16)
    with MonitorSession(tmp_path / "mon", rank=0):
        for _ in range(2):
            model(x).float().square().mean().backward()
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    rows = {(r["kind"], r["name"]): r for r in _rows(tmp_path / "mon" / "rank0" / "monitor.csv") if r["step"] == "1"}
    for name, parameter in model.named_parameters():
        assert rows[("exp_avg_sq", name)]["dtype"] == "bfloat16"
        _close(rows[("exp_avg", name)], {"norm": float(optimizer.state[parameter]["exp_avg"].double().norm())})
        ratio = float(rows[("update_ratio", name)]["mean"])
        assert ratio == pytest.approx(_adam_ratio(optimizer, parameter, weights[name]), rel=0.03), name


def test_fp16_adam_states_update_ratio_is_finite_where_the_update_is(tmp_path):
    """fp16 Adam state takes torch's ops, which computed m / (sqrt(v) + eps / sqrt(c2)) in fp16: eps
    rounded to 0 and a weight whose gradient is 0 (m = v = 0) gave 0 / 0, so the update_ratio was nan
    while fused Adam's update (computed in fp32) is finite (MindSpeed-LLM's GPT-OSS, fp16)."""
    torch.manual_seed(14)
    model = TwoLayers().to("npu", torch.float16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(5, 4, device="npu", dtype=torch.float16) * 3
    x[:, 0] = 0  # fc1.weight's first column gets no gradient
    with MonitorSession(tmp_path / "mon", rank=0):
        for _ in range(2):
            model(x).float().square().sum().backward()
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            assert all(p.isfinite().all() for p in model.parameters())
    rows = {(r["kind"], r["name"]): r for r in _rows(tmp_path / "mon" / "rank0" / "monitor.csv") if r["step"] == "1"}
    for name, parameter in model.named_parameters():
        row = rows[("update_ratio", name)]
        assert (row["nan"], row["inf"]) == ("0.0", "0.0"), name
        assert float(row["mean"]) == pytest.approx(_adam_ratio(optimizer, parameter, weights[name]), rel=0.03), name


def test_a_nan_update_ratio_counts_one_nan(tmp_path):
    """The update_ratio record is one value: a nan ratio has max nan and counts 1 nan (it counted 0,
    the record contradicting itself)."""
    torch.manual_seed(15)
    model = TwoLayers().to("npu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4, device="npu")
    with MonitorSession(tmp_path / "mon", rank=0):
        for step in range(2):
            model(x).square().mean().backward()
            if step == 1:
                with torch.no_grad():
                    model.fc2.weight[0, 0] = float("nan")  # its norm, and so its ratio, is nan
            optimizer.step()
            optimizer.zero_grad()
    rows = {(r["kind"], r["name"]): r for r in _rows(tmp_path / "mon" / "rank0" / "monitor.csv") if r["step"] == "1"}
    nan_ratio = rows[("update_ratio", "fc2.weight")]
    assert math.isnan(float(nan_ratio["max"])) and (nan_ratio["nan"], nan_ratio["inf"]) == ("1.0", "0.0")
    finite_ratio = rows[("update_ratio", "fc1.bias")]
    assert math.isfinite(float(finite_ratio["max"])) and (finite_ratio["nan"], finite_ratio["inf"]) == ("0.0", "0.0")


def test_fsdp2s_adam_state_is_measured_on_this_ranks_shard(tmp_path):
    """FSDP2 (fully_shard) keeps the parameters and Adam's state as DTensors, wrappers without data of
    their own: the one-pass Adam kernel was handed a null address ("adam_stats: no data"), the
    optimizer hook switched off at step 0 and no file was written (MindSpeed-LLM's fsdp2 GPT-OSS under
    npu-run --nproc-per-node 2 --monitor). The state is read from this rank's shard, as its weights and
    gradients are."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("hccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = TwoLayers().to("npu")
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 4, device="npu")
        with MonitorSession(tmp_path / "mon", rank=0):
            for _ in range(2):
                model(x).square().mean().backward()
                weights = {name: p.detach().to_local().clone() for name, p in model.named_parameters()}
                optimizer.step()
                optimizer.zero_grad()
    finally:
        dist.destroy_process_group()
    rows = {(r["kind"], r["name"]): r for r in _rows(tmp_path / "mon" / "rank0" / "monitor.csv") if r["step"] == "1"}
    lr, (beta1, beta2), eps = 1e-2, (0.9, 0.999), 1e-8
    for name, parameter in model.named_parameters():
        m, v = (optimizer.state[parameter][key].to_local().double().cpu() for key in ("exp_avg", "exp_avg_sq"))
        _close(rows[("exp_avg", name)], _stats(m))
        _close(rows[("exp_avg_sq", name)], _stats(v))
        update = lr * (m / (1 - beta1 ** 2)) / ((v / (1 - beta2 ** 2)).sqrt() + eps)
        expected_ratio = float(update.norm() / weights[name].double().cpu().norm())
        assert float(rows[("update_ratio", name)]["mean"]) == pytest.approx(expected_ratio, rel=1e-4), name


def test_a_value_growing_by_a_steady_amount_is_forecast_at_that_amount_not_at_its_early_rate():
    """An unnormalized feature rising 330 a step: at step 5 it grows 24% a step, which at that rate
    overflows fp16 in ~22 steps; at 330 a step it is ~190 steps away (no alert yet). Near the top the
    same ramp is forecast at its steady amount; a value growing by a steady *rate* keeps its forecast."""
    from npukit.accuracy.monitor_alerts import Alerts, Record

    def forecasts(values):
        alerts = Alerts()
        found = []
        for step, value in enumerate(values):
            record = Record("activation", "embed", torch.float16, [value, -value, 0.0, value, 0.0, 0.0])
            found += [a for a in alerts.judge(step, [record], None, None, False, None) if a.rule == "overflow forecast"]
        return found

    assert forecasts([300.0 + 330.0 * step for step in range(12)]) == []
    near_the_top = forecasts([60000.0 + 330.0 * step for step in range(8)])
    assert near_the_top and "growing by 330 a step: fp16 overflow in about" in near_the_top[0].message
    steps_left = int(near_the_top[0].message.rsplit("about ", 1)[1].split()[0])
    assert abs(steps_left - (65504 - (60000 + 330 * near_the_top[0].step)) / 330) <= 1
    exponential = forecasts([300.0 * 1.2 ** step for step in range(30)])
    assert exponential and "20% a step" in exponential[0].message
    # 12 a step at 64.8k is 0.02% a step, under the 0.5% a trend needs, yet fp16's top is 59 steps away:
    # a steady amount is a trend however slow in proportion; named 50 steps ahead
    slow = forecasts([64800.0 + 12.0 * step for step in range(60)])
    assert [alert.step for alert in slow] == [9] and "growing by 12 a step" in slow[0].message
    # near the top but not growing by a steady amount: no trend
    assert forecasts([64800.0 + 12.0 * step + 30.0 * (step % 2) for step in range(60)]) == []


def _train_compiled(session_dir: Path, compile_model, steps: int = 3) -> list[dict]:
    torch.manual_seed(0)
    model = TwoLayers().to("npu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 4, device="npu")
    with MonitorSession(session_dir, rank=0):
        run = compile_model(model)  # as under npu-run --monitor: the script compiles once it watches
        for _ in range(steps):
            run(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return _rows(session_dir / "rank0" / "monitor.csv")


def test_a_compiled_model_trains_under_the_monitor_with_its_layers_named_as_without_compile(tmp_path, capfd):
    """Dynamo cannot trace the monitor's global module hooks (it raised "... is already tracked for
    mutation" inside the user's forward): the compiled model runs eagerly, said once, and every record
    is named as in the same run without torch.compile."""
    plain = _train_compiled(tmp_path / "plain", lambda model: model)
    capfd.readouterr()  # (code an earlier test compiled gets the notice at any session's start)
    compiled = _train_compiled(tmp_path / "compiled", lambda model: torch.compile(model))
    assert [(row["step"], row["kind"], row["name"]) for row in compiled] == \
        [(row["step"], row["kind"], row["name"]) for row in plain]
    assert {row["kind"] for row in compiled} >= {"activation", "activation_grad", "weight", "grad", "exp_avg"}
    assert capfd.readouterr().err.count("torch.compile regions run eagerly while the monitor is active") == 1


@pytest.mark.slow
def test_a_fullgraph_compiled_model_runs_compiled_and_its_parameters_keep_their_names(tmp_path):
    """fullgraph=True promises one graph: it runs compiled, its layers' activations unseen, its weights,
    gradients and Adam state still recorded under the layers' names."""
    compiled = _train_compiled(tmp_path / "fullgraph", lambda model: torch.compile(model, fullgraph=True))
    names = {(row["kind"], row["name"]) for row in compiled}
    assert {("weight", "fc1.weight"), ("grad", "fc2.bias"), ("exp_avg", "fc1.weight")} <= names
    assert not any(name.startswith("param_group") for _, name in names)
    assert not any(kind == "activation" and name.startswith("fc") for kind, name in names)


def test_evaluation_before_training_starts_no_step_so_steps_are_numbered_as_replay_numbers_them(tmp_path):
    """Trainer.evaluate() before train(): its forwards ran before any optimizer existed and were each
    counted as a step, so the first training step was written as step 3 here while --replay-step and
    --stop-after-step (and so --localize) call it step 0."""
    torch.manual_seed(0)
    model = TwoLayers().to("npu")
    x = torch.randn(5, 4, device="npu")
    with MonitorSession(tmp_path / "mon", rank=0):
        with torch.no_grad():
            for _ in range(3):
                model(x)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    scalars = _rows(tmp_path / "mon" / "rank0" / "scalars.csv")
    assert [row["step"] for row in scalars] == ["0", "1"]
    records = _rows(tmp_path / "mon" / "rank0" / "monitor.csv")
    assert {row["step"] for row in records} == {"0", "1"}


def test_adams_second_moment_is_judged_in_gradient_units():
    """exp_avg_sq sums squared gradients: in Adam's first steps a layer's gradient 5x its usual size
    (seen in a clean Hugging Face Trainer run's layer norm at step 5) moved it 13x its running mean, a
    turbulence alert, while the gradient itself stayed below its 10x. It is judged on the square of the
    threshold now; a gradient 30x its size alerts on both."""
    from npukit.accuracy.monitor_alerts import Alerts, Record

    def turbulence(gradient_norms):
        alerts, found, v = Alerts(), [], 0.0
        for step, g in enumerate(gradient_norms):
            v = 0.999 * v + 0.001 * g * g  # Adam's exp_avg_sq of a one-element weight (beta2 0.999)
            records = [Record("grad", "norm.weight", torch.float32, [g, g, g, g, 0.0, 0.0]),
                       Record("exp_avg_sq", "norm.weight", torch.float32, [v, v, v, v, 0.0, 0.0])]
            found += [a.name for a in alerts.judge(step, records, None, None, False, None) if a.rule == "turbulence"]
        return found

    assert turbulence([1.0] * 6 + [5.0] + [1.0] * 3) == []
    assert turbulence([1.0] * 6 + [30.0] + [1.0] * 3) == ["norm.weight:grad", "norm.weight:exp_avg_sq"]


def test_a_weight_growing_from_zero_is_not_turbulence_a_jump_is():
    """A LayerNorm's bias starts at zero; under SGD with momentum its norm doubled each step (0, 0.00068,
    0.0011 ... 0.0085 at step 5): against a running mean that began at zero, 11.7x its mean, an alert on
    a clean run. A zero norm carries no scale now; a weight that then jumps 30x still alerts."""
    from npukit.accuracy.monitor_alerts import Alerts, Record

    def turbulence(norms):
        alerts, found = Alerts(), []
        for step, norm in enumerate(norms):
            record = Record("weight", "norm.bias", torch.float32, [norm, -norm, 0.0, norm, 0.0, 0.0])
            found += [(a.step, a.name) for a in alerts.judge(step, [record], None, None, False, None)
                      if a.rule == "turbulence"]
        return found

    growing = [0.0, 0.000675, 0.00109, 0.00205, 0.00404, 0.00847, 0.00956, 0.0104, 0.0111, 0.0117]
    assert turbulence(growing) == []
    assert turbulence(growing + [0.35]) == [(10, "norm.bias:weight")]


def test_a_loss_spike_stands_out_of_the_losses_own_variation():
    """A small batch's loss varies by itself: over 2,000 steps of a regression on 16 random rows (a
    mean of 16 squared errors) the loss reached 2.7x its running mean with no cause, and was called a
    spike. A spike is now also 8 running standard deviations above the mean; a loss 6x its level is."""
    import random

    from npukit.accuracy.monitor_alerts import Alerts

    def spikes(losses):
        alerts = Alerts()
        return [alert.step for step, loss in enumerate(losses)
                for alert in alerts.judge(step, [], loss, None, False, None) if alert.rule == "loss spike"]

    draw = random.Random(0)
    noisy = [0.43 * sum(draw.gauss(0, 1) ** 2 for _ in range(16)) / 16 for _ in range(2000)]
    assert max(loss / (sum(noisy[:100]) / 100) for loss in noisy) > 2.4  # as noisy as the run was
    assert spikes(noisy) == []
    spiked = noisy[:1500] + [6 * 0.43] + noisy[1501:]
    assert spikes(spiked) == [1500]
    steady = [2.0 + 0.01 * draw.gauss(0, 1) for _ in range(200)]  # a language model's loss, 0.5% noise
    assert spikes(steady[:150] + [4.2] + steady[151:]) == [150]
