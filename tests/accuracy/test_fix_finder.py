"""npu-compare --find-fix: injected precision problems, each with the fix the finder must propose
and the error it must restore, in at most 2*log2(K)+4 runs of the step; the search itself on
made-up verdicts; npu-run --precision-fix on its own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy.compare import Thresholds
from npukit.accuracy.fix_finder import Trial, find_fix
from npukit.accuracy.fixes import FixChange, PrecisionFix, PrecisionFixSession
from npukit.errors import UserError

REPO = Path(__file__).resolve().parents[2]

HEADER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu  # noqa: F401
'''

# A small signal riding on a large offset (fc1's bias), centred by the next line: fp16 rounding of
# fc1's output under autocast loses the signal, and the subtraction reveals it.
OFFSET_LINEAR = HEADER + '''
class Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.fc1, self.head = nn.Linear(64, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.fc1.bias.fill_(3000.0)

    def forward(self, x):
        h = self.fc1(torch.relu(self.embed(x)))
        return self.head(h - h.mean(-1, keepdim=True))


model = Offset().to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 32, device="npu"), torch.randint(0, 16, (8,), device="npu")
with torch.autocast("npu", dtype=torch.float16):
    loss = F.cross_entropy(model(x), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
'''

# fp32 matmuls in HF32 (the user turned it on for speed), over inputs on a large offset whose share
# is taken out after: HF32's 10-bit mantissa loses the signal the subtraction reveals.
HF32_LINEAR = HEADER + '''
torch.npu.matmul.allow_hf32 = True


class Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(F.relu(self.embed(x)) + 10000.0)
        return self.head(h - 10000.0 * self.fc.weight.sum(1))


model = Centred().to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 16, device="npu"), torch.randint(0, 4, (8,), device="npu")
loss = F.cross_entropy(model(x), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
'''


def _npukit(entry_point: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    code = f"from npukit.cli import {entry_point}; {entry_point}()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _find_fix(tmp_path: Path, script: str) -> tuple[dict, subprocess.CompletedProcess]:
    (tmp_path / "train.py").write_text(script)
    common = ["--seed", "0", "--replay", "replay"]
    for extra in (["--golden", "--dump", "golden"], ["--dump", "npu"]):
        run = _npukit("run_main", *extra, *common, "train.py", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    found = _npukit("compare_main", "golden", "npu", "--top", "0", "--find-fix", "--find-fix-json", "fix.json",
                    "--", "npu-run", *common, "--dump", "npu", "train.py", cwd=tmp_path)
    assert "Traceback" not in found.stderr, found.stderr
    return json.loads((tmp_path / "fix.json").read_text()), found


def _line_of(script: str, text: str) -> str:
    return f"train.py:{next(n for n, line in enumerate(script.splitlines(), 1) if text in line)}"


def _within_runs(result: dict) -> None:
    k = len(result["candidates"])
    assert result["runs"] <= 2 * math.log2(max(k, 2)) + 4, result["runs"]


def test_a_linear_losing_a_small_signal_is_kept_in_fp32(tmp_path):
    result, run = _find_fix(tmp_path, OFFSET_LINEAR)
    line = _line_of(OFFSET_LINEAR, "h = self.fc1(")
    assert [(c["kind"], c["api"], c["module"], c["line"]) for c in result["fix"]] == \
        [("fp32", "Functional.linear", "fc1", line)]
    before, after = result["before"], result["after"]
    assert before["divergence_error"] > Thresholds().fp16.warn_rel_l2 / 100 and not before["fixed"]
    assert after["fixed"] and after["divergence_error"] < Thresholds().fp32.warn_rel_l2
    assert after["loss_error"] < Thresholds().fp16.pass_rel_l2 < before["loss_error"]
    _within_runs(result)
    # the fix as code at the user's line, and as a file npu-run applies
    assert "with torch.autocast(\"npu\", enabled=False)" in run.stdout and "h = self.fc1(" in run.stdout
    fix_file = tmp_path / "npu.find-fix" / "fix.json"
    applied = _npukit("run_main", "--seed", "0", "--replay", "replay", "--precision-fix", str(fix_file),
                      "--dump", "fixed", "train.py", cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    again = _npukit("compare_main", "golden", "fixed", cwd=tmp_path)
    assert again.returncode == 0 and "No divergence found" in again.stdout, again.stdout


def test_an_hf32_matmul_where_fp32_is_required_gets_hf32_off(tmp_path):
    result, _ = _find_fix(tmp_path, HF32_LINEAR)
    line = _line_of(HF32_LINEAR, "h = self.fc(")
    assert [(c["kind"], c["api"], c["module"], c["line"]) for c in result["fix"]] == \
        [("hf32_off", "Functional.linear", "fc", line)]
    assert result["before"]["loss_error"] > 0.01 and result["after"]["loss_error"] < Thresholds().fp32.warn_rel_l2 * 10
    assert result["after"]["fixed"]
    _within_runs(result)


def test_a_correct_run_has_nothing_to_fix(tmp_path):
    script = OFFSET_LINEAR.replace("fill_(3000.0)", "fill_(0.1)")
    (tmp_path / "train.py").write_text(script)
    for extra in (["--golden", "--dump", "golden"], ["--dump", "npu"]):
        assert _npukit("run_main", *extra, "--seed", "0", "--replay", "replay", "train.py", cwd=tmp_path).returncode == 0
    found = _npukit("compare_main", "golden", "npu", "--find-fix", "--", "npu-run", "--replay", "replay", "train.py",
                    cwd=tmp_path)
    assert found.returncode == 2 and "nothing to fix" in found.stderr, found.stderr
    assert not (tmp_path / "npu.find-fix").exists()  # no run was made


# ---------------------------------------------------------------------------- the search alone
class FakeRunner:
    """Judges a set of changes as fixed when it holds every culprit."""

    def __init__(self, culprits) -> None:
        self.culprits = set(culprits)
        self.trials: list[Trial] = []

    def run(self, changes):
        trial = Trial(list(changes), self.culprits <= set(changes), None, None)
        self.trials.append(trial)
        return trial


CANDIDATES = [FixChange("fp32", "Functional.linear", f"layer{i}") for i in range(16)]


@pytest.mark.parametrize("culprit", range(16))
def test_one_culprit_among_sixteen_is_found_in_at_most_two_log2_k_plus_four_runs(culprit):
    runner = FakeRunner([CANDIDATES[culprit]])
    assert find_fix(CANDIDATES, runner, max_runs=50) == [CANDIDATES[culprit]]
    assert len(runner.trials) <= 2 * math.log2(16) + 4


def test_two_culprits_in_different_halves_are_both_kept():
    runner = FakeRunner([CANDIDATES[2], CANDIDATES[13]])
    assert find_fix(CANDIDATES, runner, max_runs=50) == [CANDIDATES[2], CANDIDATES[13]]


def test_nothing_is_proposed_when_all_candidates_together_do_not_fix_it():
    runner = FakeRunner([FixChange("hf32_off", "Functional.conv2d", "stem")])
    assert find_fix(CANDIDATES, runner, max_runs=50) is None and len(runner.trials) == 1


def test_the_run_cap_is_kept():
    runner = FakeRunner([CANDIDATES[5]])
    fix = find_fix(CANDIDATES, runner, max_runs=3)
    assert len(runner.trials) == 3 and CANDIDATES[5] in fix  # a fix, larger than it could be


# ---------------------------------------------------------------------------- --precision-fix
class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def test_a_precision_fix_changes_only_the_op_it_names(npu):
    model = TwoLinears().to(npu)
    outputs = {}

    def keep(name):
        return lambda module, args, output: outputs.__setitem__(name, output.dtype)

    model.a.register_forward_hook(keep("a"))
    model.b.register_forward_hook(keep("b"))
    fix = PrecisionFix([FixChange("fp32", "Functional.linear", "a")])
    with PrecisionFixSession(fix), torch.autocast(npu, dtype=torch.float16):
        model(torch.randn(2, 4, device=npu))
    assert outputs == {"a": torch.float32, "b": torch.float16}
    with torch.autocast(npu, dtype=torch.float16):  # the session is gone with its block
        model(torch.randn(2, 4, device=npu))
    assert outputs == {"a": torch.float16, "b": torch.float16}


def test_a_finite_fill_replaces_infinity_by_the_dtypes_extreme(npu):
    scores = torch.zeros(2, 3, device=npu, dtype=torch.float16)
    mask = torch.tensor([[True, False, False], [False, False, True]], device=npu)
    with PrecisionFixSession(PrecisionFix([FixChange("finite_fill", "Tensor.masked_fill", "")])):
        filled = scores.masked_fill(mask, float("-inf"))
    assert filled.min().item() == torch.finfo(torch.float16).min and torch.isfinite(filled).all()


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "fix.json"),
    ('{"changes": [{"kind": "fp64", "api": "Functional.linear"}]}', "change 0: kind must be one of"),
    ('{"changes": [{"kind": "fp32", "api": "Functional.linear", "modul": "fc"}]}', "unknown field(s) modul"),
])
def test_a_bad_precision_fix_file_is_refused_naming_the_file_and_change(tmp_path, content, message):
    path = tmp_path / "fix.json"
    path.write_text(content)
    with pytest.raises(UserError, match="fix.json") as raised:
        PrecisionFix.load(path)
    assert message in str(raised.value)
