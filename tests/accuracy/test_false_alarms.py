"""A correct mixed-precision run gets no divergence; a real precision loss is named where it arises.

Seven small models (transformer, CNN with BatchNorm, LSTM, actor-critic policy, a gain a norm
cancels, a signal on a large offset, and pytorch/examples' one-state-per-call actor-critic whose
advantages `R - value.item()` cancel) train two steps in fp16 (with GradScaler) and bf16 autocast,
under `npu-run` and `npu-run --golden`, each dumped in tensor and statistics mode
(mixed_precision_suite.py). What used to be reported as first divergences of these correct runs:
a relu's backward whose mask flips where its input crosses 0, conv biases before a BatchNorm and a
cancelled gain whose gradients are ~0 by cancellation (relative errors of 1000), and the LSTM's
weight gradients summed over the last time steps only; in the episode, the subtraction of a Python
float taken from a bf16 tensor ("inputs match exactly"), the 128->1 value head's output near 0, and
the gradient of a loss term near 0 (smooth_l1 of a critic that predicts its return well).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from npukit.accuracy.compare import ERROR, UNMATCHED, WARN, compare_dirs

REPO = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).with_name("mixed_precision_suite.py")
CORRECT = ("transformer", "cnn", "lstm", "policy", "gain", "episode")
MODES = ("tensor", "stats")


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def dumps(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for side, options in (("npu", []), ("golden", ["--golden"])):
        run = subprocess.run([sys.executable, "-m", "npukit.run", *options, str(SUITE), str(root / side),
                              request.param], capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    return root


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", CORRECT)
def test_a_correct_mixed_precision_run_has_no_divergence(dumps, kind, mode):
    result = compare_dirs(dumps / "golden" / kind / mode, dumps / "npu" / kind / mode, workers=1)
    assert [pair.pair for pair in result.pairs] == ["step0/rank0", "step1/rank0"]
    assert [pair.divergence for pair in result.pairs] == [None, None], \
        [pair.divergence.reason for pair in result.pairs if pair.divergence]
    # Step 0 starts from the same weights: nothing may be an error. (From step 1 on, a parameter
    # whose gradient is pure noise -- an attention key bias, which softmax ignores -- can differ
    # after AdamW normalised that noise; it reaches no output.)
    step0 = result.pairs[0]
    assert [row.name for row in step0.rows if row.verdict == ERROR] == []
    assert sum(row.metrics is not None or row.stat_diffs is not None for row in step0.rows) > 20


@pytest.mark.parametrize("mode", MODES)
def test_a_signal_lost_on_a_large_offset_is_named_where_it_was_rounded(dumps, mode):
    step0 = compare_dirs(dumps / "golden" / "offset" / mode, dumps / "npu" / "offset" / mode, workers=1).pairs[0]
    divergence = step0.divergence
    assert divergence is not None
    assert divergence.entry == "Functional.linear.0.forward" and divergence.module_path == "fc1"
    assert "Tensor.__sub__.0.forward subtracts nearly equal values" in divergence.reason
    assert any("h - h.mean(-1, keepdim=True)" in line or "self.fc1(x)" in line for line in divergence.stack)


class _Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.ConvTranspose2d(8, 4, 4, 2, 1), torch.nn.BatchNorm2d(4),
                                        torch.nn.ReLU(), torch.nn.ConvTranspose2d(4, 3, 4, 2, 1), torch.nn.Tanh())

    def forward(self, z):
        return self.main(z)


class _Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 4, 2, 1), torch.nn.LeakyReLU(0.2),
                                        torch.nn.Conv2d(4, 1, 4, 2, 1), torch.nn.Flatten(), torch.nn.Sigmoid())

    def forward(self, x):
        return self.main(x).mean(1)


def _train_gan(out, golden_run: bool):
    """pytorch/examples' dcgan in fp32, shrunk: two models whose layers are both at `main.N`."""
    import contextlib

    import torch.nn.functional as F

    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend import numerics

    torch.manual_seed(0)
    generator, discriminator = _Generator().npu(), _Discriminator().npu()
    opt_g = torch.optim.Adam(generator.parameters(), 1e-3)
    opt_d = torch.optim.Adam(discriminator.parameters(), 1e-3)
    # every api: the HF32 counterfactual below names the convolution found with every api recorded
    with numerics.golden() if golden_run else contextlib.nullcontext(), DumpSession(out, mode="tensor", ops="all"):
        for _ in range(2):
            real, z = torch.randn(4, 3, 8, 8, device="npu"), torch.randn(4, 8, 2, 2, device="npu")
            discriminator.zero_grad()
            F.binary_cross_entropy(discriminator(real), torch.ones(4, device="npu")).backward()
            fake = generator(z)
            F.binary_cross_entropy(discriminator(fake.detach()), torch.zeros(4, device="npu")).backward()
            opt_d.step()
            generator.zero_grad()
            F.binary_cross_entropy(discriminator(fake), torch.ones(4, device="npu")).backward()
            opt_g.step()


def test_two_models_with_the_same_layer_paths_keep_apart_and_fp32_convolutions_in_hf32_pass(tmp_path, npu):
    """dcgan: netG and netD both hold `main.0`. Their layers were paired across models (a Conv2d's
    gradient against a ConvTranspose2d's: shape errors, 'op streams differ'), and the NPU default
    conv HF32 (on in torch_npu) was a first divergence 'while its inputs match exactly' by fp32
    limits. The second model's layers are numbered as msprobe numbers a model list (`1.main.0`)."""
    import json as json_module

    _train_gan(tmp_path / "golden", golden_run=True)
    _train_gan(tmp_path / "npu", golden_run=False)
    dump = json_module.loads((tmp_path / "npu" / "step1" / "rank0" / "dump.json").read_text())
    assert dump["hf32"] == ["conv"]
    grads = sorted(name for name in dump["data"] if ".parameters_grad." in name)
    assert grads == ["Module.1.main.0.ConvTranspose2d.parameters_grad.0", "Module.1.main.1.BatchNorm2d.parameters_grad.0",
                     "Module.1.main.3.ConvTranspose2d.parameters_grad.0", "Module.main.0.Conv2d.parameters_grad.0",
                     "Module.main.2.Conv2d.parameters_grad.0"]
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    assert [pair.divergence for pair in result.pairs] == [None] * 4, \
        [pair.divergence.reason for pair in result.pairs if pair.divergence]
    assert not any(pair.aligned for pair in result.pairs)  # same op streams: paired one to one
    assert [row.message for row in result.rows if row.verdict == ERROR] == []
    conv_rows = [row for row in result.rows if row.target_entry.startswith("Functional.conv") and row.metrics]
    assert conv_rows and {row.dtype_class for row in conv_rows} == {"hf32"}
    # Judged by fp32 limits again (as before the dump recorded HF32), the same convolution is named.
    for side in ("golden", "npu"):
        for path in (tmp_path / side).glob("step*/rank0/dump.json"):
            data = json_module.loads(path.read_text())
            del data["hf32"]
            path.write_text(json_module.dumps(data))
    divergence = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1).pairs[0].divergence
    assert divergence is not None and divergence.entry == "Functional.conv_transpose2d.0.forward"


def _reinforce_episode(out, golden_run: bool):
    """pytorch/examples' REINFORCE policy, shrunk: one state per forward, bf16 autocast. At one
    state a hidden unit's pre-activation is 1e-4 in fp32 and exactly 0 in bf16 (the state rounds
    to [1, -1]), so the relu passes that unit's gradient in the golden run only. The loss is cast to
    fp32 as pytorch/examples' VAE casts its reconstruction."""
    import contextlib

    import torch.nn as nn
    import torch.nn.functional as F

    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend import numerics

    torch.manual_seed(0)
    hidden, head = nn.Linear(2, 4).npu(), nn.Linear(4, 1).npu()
    with torch.no_grad():
        hidden.weight[0] = torch.tensor([1.0, 1.0])
        hidden.bias[0] = 0.0
        head.weight[0, 0] = 4.0  # the flipped unit carries most of that state's gradient
    states = torch.rand(30, 2, generator=torch.Generator().manual_seed(1)) + 0.5
    states[7] = torch.tensor([1.0, -0.9999])
    optimizer = torch.optim.SGD([*hidden.parameters(), *head.parameters()], lr=1e-2)
    # every api: the cast (Tensor.float, left out by default as msprobe leaves it out) is a subject here
    with numerics.golden() if golden_run else contextlib.nullcontext(), DumpSession(out, mode="tensor", ops="all"):
        outputs = []
        for state in states.npu():
            with torch.autocast("npu", dtype=torch.float32 if golden_run else torch.bfloat16):  # as --golden
                outputs.append(head(F.relu(hidden(state.unsqueeze(0)))))
        loss = torch.cat(outputs).float().sum()  # a no-op in the golden run: fp32 already
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_correct_bf16_episode_shows_a_relu_mask_flip_and_a_noop_cast_as_what_they_are_and_exits_0(tmp_path, npu, capsys):
    """pytorch/examples' reinforce in bf16 (seed 0): one state's relu gradient 32% apart (an element
    whose input is ~0 is in the golden mask only) while the weights' gradients are 3-4% apart, and
    no op amplified an error. npu-compare said 'no divergence' and exited 1 for those error rows.
    pytorch/examples' VAE in bf16: 'op streams differ' for a cast only one run needed."""
    from npukit.accuracy.cli_compare import run_compare
    from npukit.console import make_console

    _reinforce_episode(tmp_path / "golden", golden_run=True)
    _reinforce_episode(tmp_path / "npu", golden_run=False)
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    [pair] = result.pairs
    assert pair.divergence is None, pair.divergence.reason
    errors = {row.name for row in pair.rows if row.verdict == ERROR}
    assert "Functional.relu.7.backward.output.0" in errors  # the flip is shown, as it is
    # two models of one class called on their own: both are dumped, the second as msprobe numbers
    # a model list (they were both Module.Linear, and one's gradients overwrote the other's)
    grads = {row.name: row.verdict for row in pair.rows if ".parameters_grad." in row.name}
    assert sorted(grads) == ["Module.1.Linear.parameters_grad.0.bias", "Module.1.Linear.parameters_grad.0.weight",
                             "Module.Linear.parameters_grad.0.bias", "Module.Linear.parameters_grad.0.weight"]
    assert ERROR not in grads.values() and grads["Module.Linear.parameters_grad.0.weight"] == WARN
    assert result.unexplained_errors() == [] and not result.failed()
    assert run_compare(tmp_path / "golden", tmp_path / "npu", None, None, None, 5, [], 1, make_console()) == 0
    out = capsys.readouterr().out
    assert "No divergence found" in out and "no op amplified it" in out
    # the VAE's recon.float(): its backward exists in the bf16 run only. Said as what it is, not
    # "op streams differ"
    assert pair.noop_casts == ["Tensor.float.0.backward"]
    assert {row.message for row in pair.rows if row.verdict == UNMATCHED} == \
        {"only in target: the cast changed nothing in the golden run (torch.float32 already), so it has no backward there"}
    assert "op streams differ" not in out and "Tensor.float.0.backward: a cast that changed nothing" in out
