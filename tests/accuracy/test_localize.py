"""npu-compare --trend --localize's parts: npu-run --stop-after-step and --replay-step, and the re-run
commands built from the user's npu-run command."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from npukit.accuracy.localize import rerun_commands
from npukit.errors import UserError

TRAIN = '''\
import sys
import torch
import torch.nn as nn
torch.manual_seed(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to("npu")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(int(sys.argv[1]))
for step in range(6):
    x = torch.randn(4, 8, generator=data).to("npu")
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print("step", step, "loss", repr(loss.item()), flush=True)
print("finished")
'''


def npu_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npukit.run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)}


def test_stop_after_step_ends_the_run_once_that_step_ended_and_its_dump_is_written(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    run = npu_run("--stop-after-step", "2", "--dump", "dump", "--dump-steps", "2", "train.py", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(losses(run.stdout)) == [0, 1, 2] and "finished" not in run.stdout
    assert "stopped after step 2 (--stop-after-step)" in run.stderr
    assert [path.name for path in (tmp_path / "dump").iterdir()] == ["step2"]
    assert (tmp_path / "dump" / "step2" / "rank0" / "dump.json").is_file()


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_replay_step_gives_the_npu_run_the_golden_runs_state_at_that_step(tmp_path):
    """The golden run records the state at step 3's start; a run seeded otherwise (its own weights,
    data and Adam moments for steps 0-2) computes step 3 as the golden run did."""
    (tmp_path / "train.py").write_text(TRAIN)
    golden = npu_run("--golden", "--replay", "state", "--replay-step", "3", "train.py", "0", cwd=tmp_path)
    other = npu_run("--replay", "state", "--replay-step", "3", "train.py", "1", cwd=tmp_path)
    assert golden.returncode == 0 and other.returncode == 0, golden.stderr + other.stderr
    golden_losses, other_losses = losses(golden.stdout), losses(other.stdout)
    assert all(golden_losses[step] != other_losses[step] for step in range(3))
    assert golden_losses[3] == other_losses[3]
    mismatch = npu_run("--replay", "state", "--replay-step", "2", "train.py", "1", cwd=tmp_path)
    assert mismatch.returncode != 0 and "recorded at the start of step 3" in mismatch.stderr
    alone = npu_run("--replay-step", "2", "train.py", "1", cwd=tmp_path)
    assert alone.returncode != 0 and "--replay-step N goes with --replay DIR" in alone.stderr


@pytest.mark.slow  # (a whole-run e2e)
def test_after_an_evaluation_before_training_the_monitor_the_dump_and_the_replay_agree_on_step_2(tmp_path):
    """Trainer.evaluate() before train(): the monitor and the dump counted its forwards as steps,
    --replay-step and --stop-after-step did not, so --localize's re-run dumped another step than the
    one the trend named."""
    create_optimizer = "optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
    evaluate_first = TRAIN.replace(create_optimizer, "").replace(  # the optimizer made by train(), after it
        "for step in range(6):", "with torch.no_grad():\n    for _ in range(4):\n        model(torch.randn(4, 8, "
        "generator=data).to('npu'))\n" + create_optimizer + "for step in range(6):")
    assert evaluate_first.count(create_optimizer) == 1
    (tmp_path / "train.py").write_text(evaluate_first)
    run = npu_run("--monitor", "mon", "--replay", "state", "--replay-step", "2", "--dump", "dump", "--dump-steps",
                  "2", "--stop-after-step", "2", "train.py", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(losses(run.stdout)) == [0, 1, 2]
    monitored = (tmp_path / "mon" / "rank0" / "scalars.csv").read_text().splitlines()[1:]
    assert [float(line.split(",")[1]) for line in monitored] == [float(loss) for loss in losses(run.stdout).values()]
    assert [line.split(",")[0] for line in monitored] == ["0", "1", "2"]
    import json

    dumped = json.loads((tmp_path / "dump" / "step2" / "rank0" / "dump.json").read_text())["data"]
    assert any(name.endswith(".backward") for name in dumped)  # a training step, not an evaluation forward



def dumped_modules(rank_dump: Path) -> set[str]:
    """The module path of every entry of a dump (a module's own, an api's module; "(root)" for an api
    outside every module), the optimizer's foreach entries left out (foreach_entries)."""
    from npukit.accuracy.compare import entry_module_path
    from npukit.accuracy.dumpfile import OPTIMIZER, load_rank_dump

    dump = load_rank_dump(rank_dump, rank_dump.name)
    return {entry_module_path(entry, dump) for entry in dump.entries if entry.parent != OPTIMIZER}


def foreach_entries(rank_dump: Path) -> dict[str, object]:
    """The optimizer's foreach elements of a dump (`Torch._foreach_add_.2.forward`: parameter 2's) and
    their tensors' values."""
    import json

    data = json.loads((rank_dump / "dump.json").read_text())["data"]
    return {name: record for name, record in data.items() if name.startswith("Torch._foreach_")}

BY_HAND = '''\
import sys
import torch
import torch.nn as nn
torch.manual_seed(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to("npu")
data = torch.Generator().manual_seed(int(sys.argv[1]))
with torch.no_grad():  # an evaluation before training
    for _ in range(2):
        model(torch.randn(4, 8, generator=data).to("npu"))
for step in range(6):
    x = torch.randn(4, 8, generator=data).to("npu")
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():  # no optimizer: the weights updated by hand
        for p in model.parameters():
            p -= 1e-2 * p.grad
            p.grad = None
    print("step", step, "loss", repr(loss.item()), flush=True)
print("finished")
'''


@pytest.mark.slow  # (two whole runs, ~5 s)
def test_without_an_optimizer_the_monitor_the_dump_the_replay_and_the_stop_agree_on_step_2(tmp_path):
    """A script that updates its weights by hand: the monitor and the dump end a step as the model starts
    its next forward with gradients; --replay-step and --stop-after-step counted optimizer steps only,
    found none, and the re-run ran to the end and failed ("the run ended after 0 training steps")."""
    (tmp_path / "train.py").write_text(BY_HAND)
    golden = npu_run("--golden", "--monitor", "mon", "--replay", "state", "--replay-step", "2", "--dump", "dump",
                     "--dump-steps", "2", "--stop-after-step", "2", "train.py", "0", cwd=tmp_path)
    assert golden.returncode == 0, golden.stderr
    assert sorted(losses(golden.stdout)) == [0, 1, 2] and "stopped after step 2 (--stop-after-step)" in golden.stderr
    monitored = (tmp_path / "mon" / "rank0" / "scalars.csv").read_text().splitlines()[1:]
    assert [line.split(",")[0] for line in monitored] == ["0", "1", "2"]
    assert [float(line.split(",")[1]) for line in monitored] == [float(v) for v in losses(golden.stdout).values()]
    import json

    assert [path.name for path in (tmp_path / "dump").iterdir()] == ["step2"]
    dumped = json.loads((tmp_path / "dump" / "step2" / "rank0" / "dump.json").read_text())["data"]
    assert any(name.endswith(".backward") for name in dumped)  # a training step, not an evaluation forward
    # another seed (its own weights and data for steps 0-1) computes step 2 from the golden state
    other = npu_run("--replay", "state", "--replay-step", "2", "--stop-after-step", "2", "train.py", "1",
                    cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    golden_losses, other_losses = losses(golden.stdout), losses(other.stdout)
    assert sorted(other_losses) == [0, 1, 2]
    assert golden_losses[0] != other_losses[0] and golden_losses[1] != other_losses[1]
    assert golden_losses[2] == other_losses[2]


def test_the_reruns_replace_the_users_watching_options_and_keep_the_rest(tmp_path):
    command = ["npu-run", "--seed", "0", "--monitor", "mon/npu", "--monitor-every", "2", "--dump", "old", "--devices",
               "2", "--dump-scope", "fc", "train.py", "--epochs", "3", "--dump", "scripts-own"]
    golden, npu = rerun_commands(command, 40, tmp_path)
    for rerun in (golden, npu):
        options = rerun[rerun.index("npukit.run") + 1:rerun.index("train.py")]
        for dropped in ("--monitor", "--monitor-every", "old", "--dump-scope"):  # the user's scope is not the step's
            assert dropped not in options
        assert options[:4] == ["--seed", "0", "--devices", "2"]
        assert rerun[rerun.index("train.py"):] == ["train.py", "--epochs", "3", "--dump", "scripts-own"]
        for option, value in (("--replay-step", "40"), ("--dump-steps", "40"), ("--stop-after-step", "40"),
                              ("--dump-mode", "tensor")):
            assert options[options.index(option) + 1] == value
    assert "--golden" in golden and "--golden" not in npu
    for rerun in rerun_commands(command, 40, tmp_path, scope="blocks.1"):  # the departure's module: its subtree
        options = rerun[rerun.index("npukit.run") + 1:rerun.index("train.py")]
        assert options.count("--dump-scope") == 1 and options[options.index("--dump-scope") + 1] == "blocks.1"
    assert golden[golden.index("--dump") + 1] == str(tmp_path / "golden")
    assert npu[npu.index("--dump") + 1] == str(tmp_path / "npu")
    with pytest.raises(UserError, match="names no script"):
        rerun_commands(["npu-run", "--seed", "0"], 1, tmp_path)
    # `--localize DIR -- npu-run ...` (--localize takes no value): the error names --localize, not --find-fix
    with pytest.raises(UserError, match=r"^--localize: 'loc npu-run train.py' is not an npu-run command"):
        rerun_commands(["loc", "npu-run", "train.py"], 1, tmp_path)


ELAPSED_TIME = '''\
"""A regressor over sensor readings and the time elapsed, in fp16 (autocast, GradScaler): the elapsed
time, unnormalized, grows argv[2] a step (3500: embed's output passes fp16's largest value at step 19;
35: at step 1872)."""
import sys
import torch
import torch.nn as nn

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(9, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


model = Regressor().to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
scaler = torch.amp.GradScaler("npu", init_scale=1024.0)
data = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[1])):
    readings = torch.randn(16, 8, generator=data)
    x = torch.cat([readings, torch.full((16, 1), float(sys.argv[2]) * step)], dim=1).to("npu")
    y = readings[:, :1].sin().to("npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = (model(x).float() - y).square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
print("final loss", loss.item())
'''


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 2,000 steps: three monitored runs, the re-runs to step 1872 and the fixed run (~5 min quiet)
@pytest.mark.parametrize(("steps", "growth", "departs"), [(25, "3500", 19), (2000, "35", 1872)])
def test_from_the_trend_to_the_op_and_a_fix_that_keeps_the_run_inside_the_band(tmp_path, steps, growth, departs):
    """As a user runs it: a golden monitor, a perturbed one and the NPU run's (the golden runs raise no
    alert, the NPU run only the overflow's forecast before it); --trend names embed's output leaving the band at step 19 (of 25; 1872 of 2,000: inf,
    outside any band); --localize re-runs to that step (the NPU run from the golden state) and names
    embed's linear and the fix computing it in fp32; the run with that fix, monitored again, stays
    inside the band over every step and raises no alert."""
    import json

    def compare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from npukit.cli import compare_main; compare_main()", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "COLUMNS": "200"})

    (tmp_path / "train.py").write_text(ELAPSED_TIME)
    script = ["train.py", str(steps), growth]
    for options in (["--golden", "--monitor", "golden"], ["--golden-perturb", "fp16", "--monitor", "perturbed"],
                    ["--monitor", "npu"]):
        run = npu_run(*options, *script, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        alerts = [line for line in run.stderr.splitlines() if line.startswith("npukit monitor: step")]
        early = [line for line in alerts if int(line.split()[3].rstrip(":")) < departs]
        if "golden" in options[0]:
            assert alerts == [], run.stderr
        else:  # before the inf, only the forecast of it
            assert all("fp16 overflow in about" in line for line in early) and len(early) < len(alerts), run.stderr
    assert "final loss nan" in run.stdout  # the NPU run
    trend = compare("--trend", "golden", "npu", "--perturbed", "perturbed")
    assert trend.returncode == 1, trend.stdout + trend.stderr
    assert f"leaves the golden band at step {departs}, in embed" in " ".join(trend.stdout.split())

    localized = compare("--trend", "golden", "npu", "--perturbed", "perturbed", "--localize", "--localize-dir", "loc",
                        "--", sys.executable, "-m", "npukit.run", "--monitor", "npu", *script)
    assert localized.returncode == 1, localized.stdout + localized.stderr
    report = json.loads((tmp_path / "loc" / "compare.json").read_text())
    named = report["pairs"][0]["first_divergence"]
    assert (named["entry"], named["module_path"]) == ("Functional.linear.0.forward", "embed")
    fix = json.loads((tmp_path / "loc" / "find-fix.json").read_text())["fix"]
    assert [(change["kind"], change["api"], change["module"]) for change in fix] == [("fp32", "Functional.linear", "embed")]

    fixed = npu_run("--precision-fix", "loc/find-fix/fix.json", "--monitor", "fixed", *script, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert "npukit monitor: step" not in fixed.stderr
    final = float(fixed.stdout.split("final loss")[1])
    assert math.isfinite(final) and final < 10  # it trained through step 19
    inside = compare("--trend", "golden", "fixed", "--perturbed", "perturbed")
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert f"No trend divergence: over steps 0-{steps - 1}" in " ".join(inside.stdout.split())


BY_HAND_ELAPSED_TIME = '''\
"""ELAPSED_TIME's regressor with no optimizer and no GradScaler: its weights updated by hand."""
import sys
import torch
import torch.nn as nn

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(9, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


model = Regressor().to("npu")
data = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[1])):
    readings = torch.randn(16, 8, generator=data)
    x = torch.cat([readings, torch.full((16, 1), float(sys.argv[2]) * step)], dim=1).to("npu")
    y = readings[:, :1].sin().to("npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = (model(x).float() - y).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-2 * p.grad
            p.grad = None
print("final loss", loss.item())
'''


@pytest.mark.slow  # (three monitored runs and the two re-runs: ~40 s)
def test_localize_a_script_without_an_optimizer(tmp_path):
    """#34: the trend names step 19 of a run whose weights are updated by hand; --localize's re-runs
    recorded and replayed step 19's start and stopped after it (they counted optimizer steps, found
    none, and failed), so the compare names embed's linear and the fix computes it in fp32."""
    import json

    def compare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from npukit.cli import compare_main; compare_main()", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "COLUMNS": "200"})

    (tmp_path / "train.py").write_text(BY_HAND_ELAPSED_TIME)
    script = ["train.py", "25", "3500"]
    for options in (["--golden", "--monitor", "golden"], ["--golden-perturb", "fp16", "--monitor", "perturbed"],
                    ["--monitor", "npu"]):
        run = npu_run(*options, *script, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    assert "final loss nan" in run.stdout  # the NPU run
    localized = compare("--trend", "golden", "npu", "--perturbed", "perturbed", "--localize", "--localize-dir", "loc",
                        "--", sys.executable, "-m", "npukit.run", "--monitor", "npu", *script)
    assert localized.returncode == 1, localized.stdout + localized.stderr
    assert "leaves the golden band at step 19, in embed" in " ".join(localized.stdout.split())
    said = " ".join(localized.stdout.split())
    assert "localize: dumping step 19's embed subtree (npu-run --dump-scope embed)" in said
    assert "localize: the first divergence is inside embed's subtree" in said and "whole" not in said
    assert json.loads((tmp_path / "loc" / "replay" / "replay.json").read_text())["start_step"] == 19
    for side in ("golden", "npu"):
        assert [path.name for path in (tmp_path / "loc" / side).iterdir()] == ["step19"]
        # embed's forward and backward and its linear's: nothing of norm, head or the loss
        assert dumped_modules(tmp_path / "loc" / side / "step19" / "rank0") == {"embed"}
        dumped = json.loads((tmp_path / "loc" / side / "step19" / "rank0" / "dump.json").read_text())["data"]
        assert {"Module.embed.Linear.forward.0", "Functional.linear.0.forward", "Functional.linear.0.backward",
                "Module.embed.Linear.backward.0"} <= set(dumped)
    assert not (tmp_path / "loc" / "subtree").exists()
    report = json.loads((tmp_path / "loc" / "compare.json").read_text())
    named = report["pairs"][0]["first_divergence"]
    assert (named["entry"], named["module_path"]) == ("Functional.linear.0.forward", "embed")
    fix = json.loads((tmp_path / "loc" / "find-fix.json").read_text())["fix"]
    assert [(change["kind"], change["api"], change["module"]) for change in fix] == [("fp32", "Functional.linear", "embed")]


def test_the_reruns_fast_forward_from_the_checkpoint_and_the_golden_state(tmp_path):
    command = ["npu-run", "--monitor", "mon/npu", "--monitor-checkpoint-every", "5", "--fast-forward", "old",
               "train.py"]
    golden, npu = rerun_commands(command, 40, tmp_path, tmp_path / "mon" / "checkpoints" / "step-35", True)
    for rerun in (golden, npu):
        options = rerun[rerun.index("npukit.run") + 1:rerun.index("train.py")]
        assert "--monitor-checkpoint-every" not in options and "old" not in options
        assert options.count("--fast-forward") == 1
    assert golden[golden.index("--fast-forward") + 1] == str(tmp_path / "mon" / "checkpoints" / "step-35")
    assert npu[npu.index("--fast-forward") + 1] == npu[npu.index("--replay") + 1] == str(tmp_path / "replay")
    full_golden, full_npu = rerun_commands(command, 40, tmp_path)
    assert "--fast-forward" not in full_golden + full_npu


class Printed:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str) -> None:
        self.lines.append(text)


def same_dumps(first: Path, second: Path) -> list[str]:
    """The tensor files two dumps do not share with equal values (NaN equal to NaN)."""
    import torch

    names = sorted(str(path.relative_to(first)) for path in first.rglob("*.pt"))
    assert names and names == sorted(str(path.relative_to(second)) for path in second.rglob("*.pt"))
    differ = []
    for name in names:
        one, other = torch.load(first / name), torch.load(second / name)
        if not (one.dtype == other.dtype and one.shape == other.shape
                and torch.equal(one.isnan(), other.isnan()) and torch.equal(one.nan_to_num(), other.nan_to_num())):
            differ.append(name)
    return differ


@pytest.mark.slow  # (a script that asserts on its loss: three re-runs, ~30 s)
def test_a_script_failing_on_the_fast_forwards_zeros_is_re_run_from_its_beginning(tmp_path, monkeypatch):
    from npukit.accuracy.localize import fast_forwarded_rerun, run_rerun

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN.replace("    loss.backward()\n",
                                                     "    assert loss.item() > 0, 'a zero loss'\n    loss.backward()\n"))
    command = [sys.executable, "-m", "npukit.run", "train.py", "0"]
    golden, npu_full = rerun_commands(command, 3, tmp_path / "loc")
    _, npu_fast = rerun_commands(command, 3, tmp_path / "loc", None, True)
    run_rerun(golden, "golden")
    console = Printed()
    assert fast_forwarded_rerun(npu_fast, npu_full, "NPU", console, [tmp_path / "loc" / "npu"]) == npu_full
    assert console.lines == ["localize: the fast-forwarded NPU re-run failed (exit 1) (AssertionError: a zero "
                             "loss): re-running it from the script's beginning, every step computed"]
    assert [path.name for path in (tmp_path / "loc" / "npu").iterdir()] == ["step3"]
    assert same_dumps(tmp_path / "loc" / "golden", tmp_path / "loc" / "npu") == []  # fp32: the NPU computes as golden


@pytest.mark.slow  # (two runs, ~20 s)
def test_a_checkpoint_of_another_script_is_an_error_naming_it(tmp_path, monkeypatch):
    from npukit.accuracy.localize import fast_forwarded_rerun

    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.py").write_text(TRAIN.replace("nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))",
                                                     "nn.Sequential(nn.Linear(8, 1))"))
    run = npu_run("--golden", "--monitor", "mon", "--monitor-checkpoint-every", "2", "other.py", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    (tmp_path / "train.py").write_text(TRAIN)
    checkpoint = Path("mon") / "checkpoints" / "step-2"
    golden_fast, golden_full = (rerun_commands([sys.executable, "-m", "npukit.run", "train.py", "0"], 3, Path("loc"),
                                               *start)[0] for start in ((checkpoint,), ()))
    with pytest.raises(UserError, match=r"checkpoint mon/checkpoints/step-2 does not fit this run(.|\n)*replay: "
                                        r"mon/checkpoints/step-2 has no saved value for Sequential.2.bias"):
        fast_forwarded_rerun(golden_fast, golden_full, "golden", Printed(), [Path("loc")], checkpoint)


@pytest.mark.slow
@pytest.mark.timeout(900)  # three monitored runs, the re-runs from the checkpoint and the full ones (~70 s quiet)
def test_localize_from_the_golden_monitors_checkpoint_dumps_what_the_full_reruns_dump(tmp_path):
    """The golden monitor wrote checkpoints every 5 steps: --localize of the departure at step 19 starts
    the golden re-run from step 15's (steps 0-14 fast-forwarded) and fast-forwards the NPU re-run to
    step 19; both dump step 19 tensor for tensor as the re-runs from the script's beginning do, and
    the compare names embed's linear as it does from those. Both dump embed's subtree: the golden
    step's SGD foreach update of embed's weight and bias, not of norm's and head's."""
    import json

    (tmp_path / "train.py").write_text(ELAPSED_TIME)
    script = ["train.py", "25", "3500"]
    for options in (["--golden", "--monitor", "golden", "--monitor-checkpoint-every", "5"],
                    ["--golden-perturb", "fp16", "--monitor", "perturbed"], ["--monitor", "npu"]):
        run = npu_run(*options, *script, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        if "golden" in options:  # steps 5, 10, 15, 20 and 25 (the trained weights)
            assert "5 checkpoint(s) of the state at a step's start" in run.stderr
    command = [sys.executable, "-m", "npukit.run", "--monitor", "npu", *script]
    localized = subprocess.run([sys.executable, "-c", "from npukit.cli import compare_main; compare_main()",
                                "--trend", "golden", "npu", "--perturbed", "perturbed", "--localize", "--localize-dir",
                                "loc", "--", *command], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "COLUMNS": "400"})
    assert localized.returncode == 1, localized.stdout + localized.stderr
    said = " ".join(localized.stdout.split())
    assert ("re-running the golden run to step 19 (where embed departs) from its monitor's checkpoint "
            "golden/checkpoints/step-15: steps 0-14 fast-forwarded, steps 15-19 computed") in said
    assert "re-running the NPU run to step 19 (where embed departs): steps 0-18 fast-forwarded" in said
    assert "could not fast-forward" not in said and "failed" not in said
    named = json.loads((tmp_path / "loc" / "compare.json").read_text())["pairs"][0]["first_divergence"]
    assert (named["entry"], named["module_path"]) == ("Functional.linear.0.forward", "embed")

    assert "localize: the first divergence is inside embed's subtree" in said
    # from the script's beginning, every step computed, dumping embed's subtree as --localize did
    for rerun in rerun_commands(command, 19, tmp_path / "full", scope="embed"):
        completed = subprocess.run(rerun, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr
    for side in ("golden", "npu"):
        assert same_dumps(tmp_path / "loc" / side, tmp_path / "full" / side) == []
        assert dumped_modules(tmp_path / "loc" / side / "step19" / "rank0") == {"embed"}
    # the golden step's momentum and update elements of parameters 0 and 1 (embed's weight and bias) of 6; the
    # NPU run's GradScaler skipped the step (its gradients inf)
    updated = foreach_entries(tmp_path / "loc" / "golden" / "step19" / "rank0")
    assert {int(name.split(".")[2]) % 6 for name in updated} == {0, 1} and len(updated) == 6, updated.keys()
    assert foreach_entries(tmp_path / "loc" / "npu" / "step19" / "rank0") == {}


def test_the_departures_module_is_the_subtree_localize_dumps():
    """The trend's record names the module --localize gives --dump-scope: a parameter's module, a module
    output's (a later call, one of several outputs); the loss, the gradient norm and a root module's own
    parameter name none (the whole step is dumped)."""
    from npukit.accuracy.trend import module_scope

    records = [("weight", "blocks.0.fc.weight"), ("weight", "attn.weight"), ("weight", "pos"),
               ("weight", "param_group0.3"), ("activation", "blocks.0.fc"), ("activation", "blocks.0"),
               ("activation", "blocks.0.call1"), ("activation", "attn.0"), ("activation", "attn.1"),
               ("activation", "attn.call1.0"), ("loss", ""), ("grad_norm", "")]

    def scope(kind: str, name: str) -> str | None:
        return module_scope(kind, name, records)

    assert scope("weight", "blocks.0.fc.weight") == scope("exp_avg", "blocks.0.fc.weight") == "blocks.0.fc"
    assert scope("grad", "attn.weight") == "attn"
    assert scope("weight", "pos") is None  # the root module's own: its subtree is the whole step
    assert scope("weight", "param_group0.3") is None  # a tensor of no module
    assert scope("activation", "blocks.0") == "blocks.0"  # a module: blocks.0.fc's weight is under it
    assert scope("activation_grad", "blocks.0.call1") == "blocks.0"
    assert scope("activation", "attn.0") == scope("activation", "attn.call1.0") == "attn"  # attn's first output
    assert scope("loss", "") is None and scope("grad_norm", "") is None


@pytest.mark.slow  # (two runs, ~15 s)
def test_a_scoped_dump_keeps_the_optimizers_foreach_elements_of_its_modules_parameters_only(tmp_path):
    """--localize dumps the departure's module's subtree: Adam's foreach update (torch's default on the
    npu) was recorded for every parameter under any --dump-scope; now for the scope's modules' parameters,
    named and valued as in the whole step's dump."""
    (tmp_path / "train.py").write_text(TRAIN)
    for folder, scope in (("whole", []), ("scoped", ["--dump-scope", "2"])):
        run = npu_run("--dump", folder, "--dump-mode", "tensor", "--dump-steps", "1", "--stop-after-step", "1",
                      *scope, "train.py", "0", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    whole, scoped = (foreach_entries(tmp_path / folder / "step1" / "rank0") for folder in ("whole", "scoped"))
    # Adam's 4 parameters, an element each per call: 0-1 the first Linear's weight and bias, 2-3 the last one's
    kept = [name for name in whole if int(name.split(".")[2]) % 4 in (2, 3)]
    assert kept and len(kept) < len(whole)
    assert sorted(scoped) == sorted(kept)
    assert all(scoped[name]["output"] == whole[name]["output"] for name in kept)
    assert dumped_modules(tmp_path / "scoped" / "step1" / "rank0") == {"2"}


INHERITED = '''\
"""A regressor under fp16 autocast whose loss is scaled by argv[2] (1e-5) with no GradScaler: head's
backward computes the gradient for its input below fp16's normal range (subnormal), and the modules
before it (norm) receive that gradient."""
import sys
import torch
import torch.nn as nn

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


model = Regressor().to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[1])):
    x = torch.randn(16, 8, generator=data).to("npu")
    y = x[:, :1].sin()
    with torch.autocast("npu", dtype=torch.float16):
        loss = (model(x).float() - y).square().mean() * float(sys.argv[2])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("final loss", loss.item())
'''


@pytest.mark.slow  # (four re-runs and two fix-finder trials: ~60 s)
def test_a_gradient_reaching_the_module_from_outside_widens_the_dump_to_the_whole_step(tmp_path, monkeypatch):
    """The departure names norm's output gradient at step 2, made by head's fp16 backward after it: the
    compare of norm's subtree sees the gradient arriving at norm's backward off with every gradient
    before it matched (none of them dumped), so --localize says the difference reaches norm from outside
    it, re-runs both sides dumping step 2 whole, names head's linear's backward and the fix computing it
    in fp32."""
    import json

    from rich.console import Console

    from npukit.accuracy.localize import localize
    from npukit.accuracy.trend import Departure, module_scope

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(INHERITED)
    records = [("weight", "embed.weight"), ("activation", "embed"), ("activation", "norm"), ("activation", "head"),
               ("activation_grad", "head"), ("activation_grad", "norm")]
    departure = Departure(0, "activation_grad", "norm", "norm", 2, 3, 1e-6, 1e-6, 8e-7, 1e-8,
                          scope=module_scope("activation_grad", "norm", records))
    console = Console(record=True, width=400)
    code = localize(departure, [sys.executable, "-m", "npukit.run", "train.py", "4", "1e-5"], tmp_path / "loc",
                    console, 2, 5, None)
    assert code == 1
    said = " ".join(console.export_text().split())
    assert "localize: dumping step 2's norm subtree (npu-run --dump-scope norm)" in said
    assert ("localize: the difference reaches norm from outside it (Functional.layer_norm.0.backward: the gradient "
            "arriving at this backward differs") in said
    assert "while every gradient before it matched): dumping step 2 whole" in said
    assert said.count("localize: re-running the NPU run to step 2") == 2
    # the subtree's dumps, kept: norm's entries alone; the whole step's: every module's
    assert dumped_modules(tmp_path / "loc" / "subtree" / "npu" / "step2" / "rank0") == {"norm"}
    assert {"embed", "norm", "head"} <= dumped_modules(tmp_path / "loc" / "npu" / "step2" / "rank0")
    named = json.loads((tmp_path / "loc" / "compare.json").read_text())["pairs"][0]["first_divergence"]
    assert (named["entry"], named["module_path"]) == ("Functional.linear.1.backward", "head")
    fix = json.loads((tmp_path / "loc" / "find-fix.json").read_text())["fix"]
    assert [(change["kind"], change["api"], change["module"]) for change in fix] == [("fp32", "Functional.linear", "head")]


def test_a_departing_weight_is_localized_at_the_step_whose_update_wrote_it(tmp_path, monkeypatch):
    """A weight is recorded as its step's optimizer starts: a weight departing at step 3 holds what step
    2's update wrote. --localize re-ran step 3 from the golden state, which loads that very weight back:
    "no divergence of its own" (karpathy/minGPT, an fp16 run's attention bias). It localizes step 2;
    every other record is its own step's."""
    from rich.console import Console

    from npukit.accuracy import localize as localize_module
    from npukit.accuracy.trend import Departure

    def departure(kind: str, step: int) -> Departure:
        return Departure(0, kind, "attn.bias" if kind != "activation" else "attn", "norm", step, step + 4,
                         1.0, 1.0, 1.5, 0.1, scope="attn")

    made = localize_module.made_in_step
    assert made(departure("weight", 3)) == 2
    assert made(departure("weight", 0)) == 0  # the initial weight: nothing before it
    for kind in ("grad", "exp_avg", "exp_avg_sq", "update_ratio", "activation", "activation_grad"):
        assert made(departure(kind, 3)) == 3, kind

    class Stop(Exception):
        pass

    rerun_steps = []

    def rerun_commands(command, step, work, *args, **kwargs):
        rerun_steps.append(step)
        raise Stop

    monkeypatch.setattr(localize_module, "rerun_commands", rerun_commands)
    console = Console(record=True, width=400)
    with pytest.raises(Stop):
        localize_module.localize(departure("weight", 3), ["npu-run", "train.py"], tmp_path / "loc", console, 2, 5, None)
    assert rerun_steps == [2]
    said = " ".join(console.export_text().split())
    assert "localize: weight attn.bias at step 3 is the weight step 2's update wrote: localizing step 2" in said
    assert "dumping step 2's attn subtree" in said
