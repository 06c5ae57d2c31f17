"""A backward-first divergence (forward equal, gradients off) is named at the backward op whose own
error is largest: each suspect backward op re-run on the golden run's inputs in the target's numerics
(npukit/accuracy/own_error.py), the verdict giving its own error and the error it inherited.

Each case is a small model trained one step under a golden run (fp32, NPU numerics off) and an fp16
NPU run, both dumped in tensor mode as `npu-run --golden --dump` and `npu-run --dump` would; the
compare is npu-compare's (compare_dirs), so plain `npu-compare GOLDEN NPU` and `--localize` say the same.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from npukit.accuracy.compare import ERROR, PASS
from tests.accuracy.test_diagnosis import _dumps


def _compare(tmp_path, make_model, inputs_shape):
    def loss_of(model):
        return model(torch.randn(*inputs_shape, device="npu")).float().pow(2).mean()

    return _dumps(tmp_path, make_model, loss_of, dtype=torch.float16)


def _figure(text: str, pattern: str) -> float:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return float(found.group(1))


class _Attention(nn.Module):
    """Query and key weights `scale` times their initial size: attention logits in the hundreds at 16."""

    def __init__(self, scale: float = 16.0):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(scale)
            self.k.weight.mul_(scale)

    def forward(self, x):
        att = (self.q(x) @ self.k(x).transpose(-1, -2)) * 0.25
        return self.out(att.softmax(-1) @ self.v(x))


def test_an_fp16_softmax_backward_over_large_logits_is_named_with_its_own_and_inherited_error(tmp_path, npu):
    """The forward is within fp16's limits; the softmax backward's gradient is 4% off. Re-run on the
    golden inputs and incoming gradient in fp16, that error is its own (>1%), while the gradient it
    received carried 5e-4: the verdict says so with both figures, and that no other op re-run comes near."""
    result = _compare(tmp_path, _Attention, (2, 8, 16))
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Tensor.softmax.0.backward"
    reason = divergence.reason
    own = _figure(reason, r"its gradient for input\.0 has an own error of ([\d.e+-]+)")
    inherited = _figure(reason, r"while what it received carried ([\d.e+-]+) \(inherited\)")
    assert own > 0.005 > inherited and own > 10 * inherited
    assert "The largest own error of the" in reason
    others = re.search(r"\(next: (.*?)\)", reason).group(1)
    assert all(float(figure) < own / 10 for figure in re.findall(r"backward ([\d.e+-]+)", others))
    assert divergence.input_error < 0.005 < divergence.output_error  # the table's figures: inherited, in the run
    # the table agrees: the gradient it made (1e-4 of the one it received) is judged, not "negligible"
    [row] = [row for row in result.pairs[0].rows if row.name == "Tensor.softmax.0.backward.output.0"]
    assert row.verdict != PASS and not row.negligible


class _ScaledLogits(_Attention):
    """The logits scaled down by 1e-4 and back up by 2500: in fp16 the gradient of the scaling down
    (the saturated softmax's gradient, times 2500, times 1e-4) is below fp16's smallest values."""

    def forward(self, x):
        att = ((self.q(x) @ self.k(x).transpose(-1, -2)) * 1e-4) * 2500
        return self.out(att.softmax(-1) @ self.v(x))


def test_an_fp16_gradient_that_underflows_is_named_at_the_op_that_made_it(tmp_path, npu):
    """The forward is equal, the query and key weights' gradients 100% off, and npu-compare said 'no
    divergence' (exit 0): no op's error was 10x the error it received in the dump (the gradient 1e-4
    times smaller was 'negligible' beside the one it came from). Re-run on the golden inputs, the
    scaling's backward makes the whole error itself; the matmul after it only receives zeros."""
    result = _compare(tmp_path, lambda: _ScaledLogits(scale=24.0), (2, 8, 16))
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Tensor.__mul__.0.backward"
    reason = divergence.reason
    assert reason.startswith("this backward makes the error: re-run on the golden run's inputs")
    assert _figure(reason, r"has an own error of ([\d.e+-]+) \(error limit 0\.3\)") > 0.9
    assert _figure(reason, r"while what it received carried ([\d.e+-]+) \(inherited\)") < 0.5
    assert "the first gradient over its limits is at Tensor.__matmul__.0.backward" in reason
    assert "Tensor.__matmul__.0.backward" not in re.search(r"\(next: (.*?)\)", reason).group(1)
    [row] = [row for row in result.pairs[0].rows if row.name == "Tensor.__mul__.0.backward.output.0"]
    assert row.verdict == ERROR  # the table agrees with the headline


class _Offset(torch.autograd.Function):
    """Exact forward (x * 2); the backward adds and removes 64: in fp16 the gradient's low bits are lost
    (fp16's step at 64 is 1/16), in the golden run's fp32 they are kept."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return ((grad + 64) - 64) * 2


class _UnseenOffset(_Offset):
    """The same backward as a kernel no watcher sees (a C++ extension's, called below Python)."""

    @staticmethod
    def backward(ctx, grad):
        with torch._C.DisableTorchFunction():
            return _Offset.backward(ctx, grad)


class _WithOffset(nn.Module):
    def __init__(self, offset=_Offset):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.offset = offset

    def forward(self, x):
        return self.fc2(self.offset.apply(torch.tanh(self.fc1(x))))


def test_a_custom_function_whose_fp16_backward_cancels_is_named_at_the_op_in_its_backward(tmp_path, npu):
    """The Python of a custom Function's backward is dumped (as msprobe dumps it on an NPU: MindSpeed's
    grouped matmul calls npu_grouped_matmul there) and judged as forward values: the addition of 64
    whose fp16 rounding the subtraction reveals is named, with the fix. It read 'made between the
    dumped ops' at tanh's backward while the ops ran unseen, and with them seen, the subtraction's
    output 100% off passed as 'negligible' beside the addition's 64."""
    result = _compare(tmp_path, _WithOffset, (64, 16))
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Tensor.__add__.0.forward"
    assert "Tensor.__sub__.0.forward subtracts nearly equal values" in divergence.reason
    assert "Compute this op and the cancellation in fp32" in divergence.reason
    row = next(row for row in result.pairs[0].rows if row.name == "Tensor.__sub__.0.forward.output.0")
    assert row.verdict == ERROR and row.error > 0.5


def test_a_custom_function_whose_fp16_backward_is_unseen_is_found_between_the_dumped_ops(tmp_path, npu):
    """Its backward's ops are not dumped: the first dumped op after it (tanh's backward) gets a gradient
    100% off. Re-run on the golden inputs, tanh's own error is fp16's rounding and its error inherited:
    named where the gradient arrives, as made between the dumped ops, with the figures (it read
    'from the one  computed for it (error 0)', no op named, no figures)."""
    result = _compare(tmp_path, lambda: _WithOffset(_UnseenOffset), (64, 16))
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Torch.tanh.0.backward"
    reason = divergence.reason
    assert "no dumped op's backward computed it" in reason and "custom autograd Function's backward" in reason
    assert "No dumped op makes it" in reason and "the error was made between the dumped ops" in reason
    own = _figure(reason, r"this op: own error ([\d.e+-]+)")
    inherited = _figure(reason, r"this op: own error [\d.e+-]+, inherited ([\d.e+-]+)")
    assert own < 0.005 and inherited > 0.5
    largest = _figure(reason, r"\(largest: \S+, ([\d.e+-]+)\)")
    assert largest < 0.005


def test_a_clean_fp16_run_names_no_op(tmp_path, npu):
    """The same attention with logits of ordinary size: nothing named, nothing re-run named."""
    result = _compare(tmp_path, lambda: _Attention(scale=2.0), (2, 8, 16))
    assert not result.failed() and result.pairs[0].divergence is None
