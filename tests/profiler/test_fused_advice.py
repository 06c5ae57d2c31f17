"""What the advisor recommends runs as printed: every fused-op `code` of the advisor, evaluated
with tensors of the shapes its `where` describes, on the emulated NPU, equals the unfused sequence
the rule detects (written here as a user writes it)."""

import pytest
import torch
import torch.nn.functional as F

from npukit.npu_backend import fused
from npukit.npu_backend.torch_npu_shim import install_torch_npu
from npukit.profiler.advisor import FUSED_PATTERNS

torch_npu = install_torch_npu()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cases():
    torch.manual_seed(0)
    b, n, s, d = 2, 4, 16, 32
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = torch.randn(b, n, 32, 32)  # the kernel's q_len, kv_len: multiples of 32
    causal32 = torch.ones(1, 1, 32, 32, dtype=torch.bool).triu(1)  # 4-dim, as the kernel takes it
    x = torch.randn(b, s, 64)
    weight = torch.randn(64)
    gate, up = torch.randn(b, s, 64), torch.randn(b, s, 64)
    angles = torch.randn(1, 1, s, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    xr = torch.randn(b, n, s, d)
    return {
        "fused-masked-softmax": (dict(scores=scores, mask=causal32, scale=0.125),
                                 torch.softmax((scores * 0.125).masked_fill(causal32, float("-inf")), -1)),
        "fused-rms-norm": (dict(x=x, weight=weight, eps=1e-6),
                           x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight),
        "fused-swiglu": (dict(gate=gate, up=up), F.silu(gate) * up),
        "fused-attention": (dict(q=q, k=k, v=v, mask=causal),
                            torch.softmax((q @ k.transpose(-1, -2) * d ** -0.5).masked_fill(causal, float("-inf")),
                                          -1) @ v),
        "fused-rotary": (dict(x=xr, cos=cos, sin=sin), xr * cos + _rotate_half(xr) * sin),
    }


CASES = _cases()


def test_every_fused_rule_has_a_case_and_recommends_an_emulated_op():
    assert {pattern.rule for pattern in FUSED_PATTERNS} == set(CASES)
    for pattern in FUSED_PATTERNS:
        assert pattern.op in fused.load(), f"{pattern.rule} recommends {pattern.op}, which the emulator lacks"
        assert pattern.code in pattern.change


@pytest.mark.parametrize("pattern", FUSED_PATTERNS, ids=lambda p: p.rule)
def test_recommended_code_runs_as_printed_and_equals_the_sequence(pattern):
    names, expected = CASES[pattern.rule]
    namespace = {"torch": torch, "torch_npu": torch_npu}
    namespace.update({name: value.npu() if isinstance(value, torch.Tensor) else value
                      for name, value in names.items()})
    result = eval(pattern.code, namespace)  # exactly the text the advisor prints
    assert result.device.type == "npu"
    torch.testing.assert_close(result.cpu(), expected, rtol=1e-4, atol=1e-5)
