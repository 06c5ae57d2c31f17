"""The fp32_master precision fix: a weight kept in bf16 whose optimizer updates are below half its
rounding unit loses them (tests/accuracy/test_lost_update.py); with an fp32 master copy that every
optimizer.step() updates, it follows the run that keeps it in fp32. npu-run --precision-fix applies
it without code edits, the code it prints does the same, and the fix finder proposes it for a lost
update and proves it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from npukit.accuracy.fixes import FixChange, PrecisionFix, PrecisionFixSession, fix_code
from npukit.errors import UserError
from tests.accuracy.test_lost_update import MLP

pytestmark = pytest.mark.usefixtures("npu")

STEPS = 12
MASTER_FC2 = PrecisionFix([FixChange("fp32_master", module="fc2")])


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 16, generator=generator).to("npu"), torch.randn(16, 4, generator=generator).to("npu"))
            for _ in range(STEPS)]


class TiedMLP(MLP):
    """The MLP with a second middle layer that shares fc2's weight (its own bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc2b = nn.Linear(32, 32)
        self.fc2b.weight = self.fc2.weight

    def forward(self, x):
        h = self.act1(self.fc1(x)).to(self.fc2.weight.dtype)
        return self.fc3(self.act2(self.fc2b(self.act2(self.fc2(h)))).float())


def _train(optimizer: str, foreach: bool, bf16_fc2: bool, fix: PrecisionFix | None = None, scaler: bool = False,
           model_class=MLP, code: str = ""):
    """STEPS steps of the MLP under bf16 autocast, the model and optimizer. fc2 (and fc2b) start from bf16
    weights and are kept in bf16 (bf16_fc2) or fp32. `code`: run once the optimizer is built (a fix's code)."""
    torch.manual_seed(0)
    model = model_class().to("npu")
    middle = [module for name, module in model.named_children() if name.startswith("fc2")]
    for module in middle:
        module.to(torch.bfloat16)
    if not bf16_fc2:
        for module in middle:
            module.to(torch.float32)
    # learning rates whose updates to fc2 are mostly below half a bf16 rounding unit of its weights
    kinds = {"sgd": (torch.optim.SGD, 2e-3), "adamw": (torch.optim.AdamW, 2e-5)}
    kind, lr = kinds[optimizer]
    update = kind(model.parameters(), lr=lr, foreach=foreach)
    if code:
        exec(code, {"model": model, "optimizer": update})  # noqa: S102 (the fix's code, as a user pastes it)
    grad_scaler = torch.amp.GradScaler("npu", init_scale=256.0) if scaler else None
    with PrecisionFixSession(fix) if fix is not None else torch.enable_grad():
        for x, y in _batches():
            update.zero_grad()
            with torch.autocast("npu", dtype=torch.bfloat16):
                loss = (model(x).float() - y).square().mean()
            if grad_scaler is None:
                loss.backward()
                update.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(update)
                grad_scaler.update()
    return model, update


@pytest.mark.parametrize("scaler", [False, True], ids=["", "grad-scaler"])
@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bf16_weights_with_an_fp32_master_follow_the_fp32_run(optimizer, foreach, scaler):
    """Under autocast, a weight kept in fp32 is cast to bf16 for the forward: the bf16 weight the
    master is rounded to is the same, and so is every gradient. So the fixed run is the fp32 run,
    bit for bit: fc2's weights are the fp32 run's rounded to bf16, every other parameter is the fp32
    run's. Without the fix fc2 loses its updates."""
    reference, _ = _train(optimizer, foreach, bf16_fc2=False, scaler=scaler)
    lost, _ = _train(optimizer, foreach, bf16_fc2=True, scaler=scaler)
    fixed, update = _train(optimizer, foreach, bf16_fc2=True, fix=MASTER_FC2, scaler=scaler)
    torch.manual_seed(0)
    start = MLP().to("npu").fc2.to(torch.bfloat16)  # fc2's weights before training
    for name, parameter in fixed.named_parameters():
        wanted = dict(reference.named_parameters())[name]
        if name.startswith("fc2."):
            assert parameter.dtype == torch.bfloat16 and parameter.grad.dtype == torch.bfloat16, name
            assert torch.equal(parameter.cpu(), wanted.detach().to(torch.bfloat16).cpu()), name
            # the optimizer's state for it is fp32, as a real master copy's
            assert all(value.dtype == torch.float32 for value in update.state[parameter].values()
                       if isinstance(value, torch.Tensor) and value.dim()), name
        else:  # untouched: fp32, and the fp32 run's
            assert parameter.dtype == torch.float32 and torch.equal(parameter.cpu(), wanted.detach().cpu()), name
    # without the fix fc2's change over the steps is far from the fp32 run's (its updates lost)
    change = reference.fc2.weight.detach().float() - start.weight.detach().float()
    lost_change = lost.fc2.weight.detach().float() - start.weight.detach().float()
    assert (lost_change - change).norm() > 0.5 * change.norm()


def _same_parameters(model, reference) -> None:
    wanted = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.dtype == wanted[name].dtype or parameter.dtype == torch.bfloat16, name
        assert torch.equal(parameter.detach().cpu(), wanted[name].detach().to(parameter.dtype).cpu()), name


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_a_weight_two_modules_share_gets_one_master(foreach):
    """fc2's weight is fc2b's too: the whole model's fix ("") keeps one master of it (and of the two
    bf16 biases), updated once a step: the run is the fp32 run's."""
    reference, _ = _train("adamw", foreach, bf16_fc2=False, model_class=TiedMLP)
    fixed, _ = _train("adamw", foreach, bf16_fc2=True, model_class=TiedMLP,
                      fix=PrecisionFix([FixChange("fp32_master", module="")]))
    assert fixed.fc2.weight is fixed.fc2b.weight and fixed.fc2.weight.dtype == torch.bfloat16
    _same_parameters(fixed, reference)


def test_the_printed_code_keeps_the_same_master_copy():
    """keep_fp32_master(), pasted once the model and optimizer are built, trains as npu-run
    --precision-fix did: the fp32 run's weights, fc2's rounded to bf16."""
    code = fix_code(MASTER_FC2.changes)
    assert 'keep_fp32_master(model, optimizer, r"fc2")' in code
    reference, _ = _train("adamw", True, bf16_fc2=False)
    pasted, update = _train("adamw", True, bf16_fc2=True, code=code)
    assert pasted.fc2.weight.dtype == torch.bfloat16
    _same_parameters(pasted, reference)
    assert update.state[pasted.fc2.weight]["exp_avg"].dtype == torch.float32


def test_a_script_updating_its_weights_by_hand_is_told_the_fix_cannot_apply(tmp_path):
    """No optimizer.step(): nowhere to update a master copy. The run says so, naming the fix file and
    change, instead of ending as if fixed."""
    path = tmp_path / "fix.json"
    path.write_text(MASTER_FC2.to_json())
    torch.manual_seed(0)
    model = MLP().to("npu")
    model.fc2.to(torch.bfloat16)
    x, y = _batches()[0]
    with pytest.raises(UserError, match="updates its weights by hand") as raised:
        with PrecisionFixSession(PrecisionFix.load(path)):
            with torch.autocast("npu", dtype=torch.bfloat16):
                (model(x).float() - y).square().mean().backward()
            with torch.no_grad():
                for weight in model.parameters():
                    weight -= 2e-3 * weight.grad
    assert f"--precision-fix {path}: change 0 (keep an fp32 master copy of fc2's" in str(raised.value)


@pytest.mark.parametrize(("change", "message"), [
    (FixChange("fp32_master", module="fc9"), "the run called no module 'fc9'"),
    (FixChange("fp32_master", module="fc1"), "holds no fp16/bf16 parameter"),  # fc1 is fp32
])
def test_a_master_fix_that_changes_nothing_is_an_error(change, message):
    with pytest.raises(UserError, match=message):
        _train("sgd", False, bf16_fc2=True, fix=PrecisionFix([change]))


def test_a_master_fix_naming_an_op_is_refused(tmp_path):
    path = tmp_path / "fix.json"
    path.write_text('{"changes": [{"kind": "fp32_master", "api": "Functional.linear", "module": "fc2"}]}')
    with pytest.raises(UserError, match=r"fix.json: change 0: fp32_master names a module"):
        PrecisionFix.load(path)


# The lost update as a script: the NPU port keeps fc2 in bf16, the reference (npu-run --golden, which
# sets NPUKIT_GOLDEN) every weight in fp32. One step of SGD (per tensor: the dump records its update ops).
LOST_UPDATE = '''
import os

import torch
import torch.nn as nn
import torch_npu  # noqa: F401


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(16, 32), nn.Tanh()
        self.fc2, self.act2 = nn.Linear(32, 32), nn.Tanh()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.act1(self.fc1(x))
        return self.fc3(self.act2(self.fc2(h.to(self.fc2.weight.dtype)).float()))


torch.manual_seed(0)
model = MLP().to("npu")
if os.environ.get("NPUKIT_GOLDEN") != "1":
    model.fc2.to(torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=2e-3, foreach=False)
data = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 16, generator=data).to("npu"), torch.randn(16, 4, generator=data).to("npu")
with torch.autocast("npu", dtype=torch.bfloat16):
    loss = (model(x).float() - y).square().mean()
loss.backward()
optimizer.step()
'''


@pytest.mark.slow  # (whole runs of a script: golden, NPU, the finder's trials: ~15 s)
def test_the_fix_finder_keeps_an_fp32_master_of_the_module_whose_update_was_lost(tmp_path):
    import json

    from tests.accuracy.test_fix_finder import _npukit

    (tmp_path / "train.py").write_text(LOST_UPDATE)
    common = ["--seed", "0", "--replay", "replay", "--dump-mode", "tensor"]  # (the change is judged from tensors)
    for options in (["--golden", "--dump", "golden"], ["--dump", "npu"]):
        run = _npukit("run_main", *options, *common, "train.py", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    found = _npukit("compare_main", "golden", "npu", "--find-fix", "--find-fix-json", "fix.json", "--", "npu-run",
                    *common, "--dump", "npu", "train.py", cwd=tmp_path)
    assert "Traceback" not in found.stderr, found.stderr
    assert "First divergence: Tensor.add_.2.forward  (module fc2)" in found.stdout, found.stdout
    result = json.loads((tmp_path / "fix.json").read_text())
    # the master copy first: the update op computed in fp32 is still written into the bf16 weight
    assert [(c["kind"], c["module"]) for c in result["candidates"][:2]] == [("fp32_master", "fc2"),
                                                                           ("fp32_master", "")]
    assert [(c["kind"], c["api"], c["module"]) for c in result["fix"]] == [("fp32_master", "", "fc2")], found.stdout
    assert result["after"]["fixed"] and not result["before"]["fixed"]
    assert 'keep_fp32_master(model, optimizer, r"fc2")' in found.stdout
    assert "pasted once the model and its optimizer are built" in " ".join(found.stdout.split())
    # applied by hand, the fix file brings the step within tolerance
    applied = _npukit("run_main", *common, "--precision-fix", "npu.find-fix/fix.json", "--dump", "fixed", "train.py",
                      cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    again = _npukit("compare_main", "golden", "fixed", cwd=tmp_path)
    assert again.returncode == 0 and "No divergence found" in again.stdout, again.stdout


@pytest.mark.parametrize(("optimizer", "first"), [("sgd", [("fp32_master", "fc2"), ("fp32_master", "")]),
                                                  ("adamw", [("fp32_master", "fc2"), ("fp32_master", "")]),
                                                  ("by hand", [])])
def test_a_lost_update_gets_master_copy_candidates_only_inside_an_optimizer_step(tmp_path, optimizer, first):
    """The compare's lost update (kind "lost-update") inside optimizer.step(): the master copy of the
    weight's module first, then of the model's; updated by hand (`weight -= lr * weight.grad`), no
    optimizer step updates a master: no such candidate."""
    from npukit.accuracy.compare import compare_dirs
    from npukit.accuracy.fix_finder import candidates_from
    from npukit.accuracy.report import result_json
    from tests.accuracy.test_lost_update import step

    step(tmp_path / "golden", "golden", optimizer)
    step(tmp_path / "npu", "npu", optimizer, bf16_fc2=True)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    assert result.pairs[0].divergence.kind == "lost-update"
    assert result_json(result)["pairs"][0]["first_divergence"]["kind"] == "lost-update"  # compare.json says it too
    candidates = candidates_from(result)
    masters = [(change.kind, change.module) for change in candidates if change.kind == "fp32_master"]
    assert masters == first and [(change.kind, change.module) for change in candidates[:len(first)]] == first


LOST_LATE = '''\
"""An MLP whose middle layer the NPU port keeps in bf16 (the reference, npu-run --golden, which sets
NPUKIT_GOLDEN, keeps every weight in fp32; both start from the same bf16 weights, as from a bf16
checkpoint), trained by AdamW under bf16 autocast. The learning rate drops from 1e-2 to 3e-4 at half
the run (argv[1] steps): from then on most of the middle layer's updates are below half a bf16
rounding unit of its weights, and lost."""
import os
import sys

import torch
import torch.nn as nn

torch.set_num_threads(1)
torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x)).to(self.mid.weight.dtype)
        return self.out(torch.tanh(self.mid(h)).float())


model = MLP().to("npu")
model.mid.to(torch.bfloat16)
if os.environ.get("NPUKIT_GOLDEN") == "1":
    model.mid.to(torch.float32)
steps = int(sys.argv[1])
# (beta2 0.95: a bf16 state's 0.999 decay would be lost too, from the first step)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)  # foreach on npu
# PASTE HERE
schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [steps // 2], gamma=3e-2)
data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to("npu")
target = torch.randn(64, 4, generator=torch.Generator().manual_seed(2)).to("npu")
for step in range(steps):
    start = (step * 16) % 64
    with torch.autocast("npu", dtype=torch.bfloat16):
        loss = (model(data[start:start + 16]).float() - target[start:start + 16]).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()
print("final loss", loss.item())
'''


@pytest.mark.slow
@pytest.mark.timeout(900)  # 120 steps: three monitored runs, the re-runs to the departure, four trials, two fixed runs (~80 s)
def test_from_the_trend_to_the_lost_update_and_a_master_copy_that_keeps_the_run_inside_the_band(tmp_path):
    """As a user runs it: golden, perturbed and NPU monitors; --trend names mid leaving the band after
    step 60 (of 120: the updates lost since the learning rate dropped there); --localize re-runs to that
    step and names AdamW's update of mid's weight (its element of the foreach
    torch._foreach_addcdiv_, inside optimizer.step(): torch's default on the npu) and the fix keeping
    an fp32 master copy of mid; the run with that fix file, and the run with the printed code pasted
    after the optimizer is built, stay inside the band."""
    import json
    import os
    import subprocess
    import sys

    from tests.accuracy.test_fix_finder import _printed_code
    from tests.accuracy.test_localize import npu_run

    def compare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from npukit.cli import compare_main; compare_main()", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "COLUMNS": "200"})

    (tmp_path / "train.py").write_text(LOST_LATE)
    script = ["train.py", "120"]
    for options in (["--golden", "--monitor", "golden"], ["--golden-perturb", "bf16", "--monitor", "perturbed"],
                    ["--monitor", "npu"]):
        run = npu_run(*options, *script, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    localized = compare("--trend", "golden", "npu", "--perturbed", "perturbed", "--localize", "--localize-dir", "loc",
                        "--", sys.executable, "-m", "npukit.run", "--monitor", "npu", *script)
    assert localized.returncode == 1, localized.stdout + localized.stderr
    # where in mid the departure is first seen depends on the CPU's bf16 arithmetic (step 93, mid's
    # weight norm, on an AVX512-BF16 CPU; step 61, mid's exp_avg_sq norm, on one with AMX): after the
    # learning rate dropped at step 60, when the updates began to be lost, and never before
    departure = re.search(r"leaves the golden band at step (\d+), in (\w+)", " ".join(localized.stdout.split()))
    assert departure and departure[2] == "mid" and 60 <= int(departure[1]) < 120, localized.stdout
    named = json.loads((tmp_path / "loc" / "compare.json").read_text())["pairs"][0]["first_divergence"]
    # AdamW's foreach update of mid's weight (the 3rd parameter), inside optimizer.step()
    assert (named["entry"], named["module_path"]) == ("Torch._foreach_addcdiv_.2.forward", "mid"), named
    assert "most of the update is lost" in named["reason"]
    fix = json.loads((tmp_path / "loc" / "find-fix.json").read_text())["fix"]
    assert [(change["kind"], change["module"]) for change in fix] == [("fp32_master", "mid")]

    fixed = npu_run("--precision-fix", "loc/find-fix/fix.json", "--monitor", "fixed", *script, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    inside = compare("--trend", "golden", "fixed", "--perturbed", "perturbed")
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert "No trend divergence: over steps 0-119" in " ".join(inside.stdout.split())
    # the printed code, pasted once the optimizer is built, does what the fix file did
    (tmp_path / "pasted.py").write_text(LOST_LATE.replace("# PASTE HERE", _printed_code(localized.stdout)))
    pasted = npu_run("--monitor", "pasted", "pasted.py", "120", cwd=tmp_path)
    assert pasted.returncode == 0, pasted.stderr
    assert pasted.stdout == fixed.stdout  # the same final loss
    inside = compare("--trend", "golden", "pasted", "--perturbed", "perturbed")
    assert inside.returncode == 0 and "No trend divergence" in inside.stdout, inside.stdout
