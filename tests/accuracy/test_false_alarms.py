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

from npukit.accuracy.compare import ERROR, compare_dirs

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
    assert "Tensor.sub.0.forward subtracts nearly equal values" in divergence.reason
    assert any("h - h.mean(-1, keepdim=True)" in line or "self.fc1(x)" in line for line in divergence.stack)
