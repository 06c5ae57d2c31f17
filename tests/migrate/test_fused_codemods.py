"""npu-migrate --fused: flash_attn and apex calls rewritten to torch_npu's fused attention and torch's
modules. Each program is written against the CUDA library (stubbed by the pure-torch reference in
tests/migrate/fused_stubs, flash_attn and apex do not install on a CPU host), migrated, and run twice:
the original on the CPU in fp32 with the reference, the rewrite on the emulated NPU without the
library; outputs and gradients agree within the NPU dtype's tolerance."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from npukit.migrate import rules
from npukit.migrate.codemods import FUSED_CODEMODS
from npukit.migrate.model import TreeFacts
from npukit.migrate.pysource import migrate_python
from npukit.npu_backend.torch_npu_shim import install_torch_npu
from tests.npu_backend.fused.reference import assert_close_to_reference

STUBS = Path(__file__).parent / "fused_stubs"
REPO = Path(__file__).resolve().parents[2]
FUSED = TreeFacts(fused=True)

ATTENTION = textwrap.dedent('''\
    """Attention through flash_attn's CUDA kernels."""
    import torch
    import flash_attn
    from flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                            flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func)


    def causal_gqa(q, k, v):
        return flash_attn_func(q, k, v, causal=True)


    def scaled_window(q, k, v):
        return flash_attn_func(q, k, v, 0.0, 0.5, False, (2, 1))


    def causal_window(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(1, -1))


    def causal_flag(q, k, v, is_causal=True):
        return flash_attn_func(q, k, v, dropout_p=0.0, causal=is_causal)


    def qkv_packed(qkv):
        return flash_attn_qkvpacked_func(qkv, causal=True)


    def kv_packed(q, kv):
        return flash_attn_kvpacked_func(q, kv)


    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, 5, 6, causal=True)
        return out


    def varlen_window(q, k, v, cu_seqlens):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=5, max_seqlen_k=5,
                                      window_size=(1, 1))


    def varlen_qkv_packed(qkv, cu_seqlens):
        return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 5, causal=True)
''')

ATTENTION_MIGRATED = textwrap.dedent('''\
    """Attention through flash_attn's CUDA kernels."""
    import torch_npu
    import torch


    def causal_gqa(q, k, v):
        return torch_npu.npu_fusion_attention(
            q, k, v, q.shape[2], "BSND",
            atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1),
            scale=q.shape[-1] ** -0.5, sparse_mode=3)[0]


    def scaled_window(q, k, v):
        return torch_npu.npu_fusion_attention(
            q, k, v, q.shape[2], "BSND",
            atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=q.device), diagonal=1),
            scale=0.5, pre_tockens=2, next_tockens=1, sparse_mode=4)[0]
''')


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def programs(tmp_path, monkeypatch):
    """programs(source) -> (the original module run with the reference library, the migrated module
    run where the library cannot be imported), and the migrated text."""
    install_torch_npu()

    def load(source: str, name: str):
        migrated = migrate_python(source, f"{name}.py", facts=FUSED).text
        (tmp_path / f"{name}_cuda.py").write_text(source)
        (tmp_path / f"{name}_npu.py").write_text(migrated)
        with monkeypatch.context() as patched:
            patched.syspath_prepend(str(STUBS))
            original = _load(tmp_path / f"{name}_cuda.py", f"{name}_cuda")
        for library in ("flash_attn", "apex", "xformers", "amp_C"):  # the migrated program must not need them
            for module in [m for m in sys.modules if m == library or m.startswith(library + ".")]:
                del sys.modules[module]  # the reference: gone for good, not back after the test
            monkeypatch.setitem(sys.modules, library, None)  # `import flash_attn` raises ImportError
        return original, _load(tmp_path / f"{name}_npu.py", f"{name}_npu"), migrated

    return load


def _npu(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to("npu", dtype).requires_grad_(tensor.is_floating_point())


def _compare(reference_fn, npu_fn, inputs: list, dtype: torch.dtype, what: str) -> None:
    """The reference (CPU fp32) and the rewrite (emulated NPU, dtype): output and every floating
    input's gradient, under the same upstream gradient."""
    cpu_inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    npu_inputs = [_npu(x, dtype) if x.is_floating_point() else x.to("npu") for x in inputs]
    expected = reference_fn(*cpu_inputs)
    actual = npu_fn(*npu_inputs)
    assert actual.device.type == "npu" and actual.shape == expected.shape and actual.dtype == dtype
    assert_close_to_reference(actual.float(), expected, dtype, f"{what} output")
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected.backward(upstream)
    actual.backward(upstream.to("npu", dtype))
    for index, (cpu, npu) in enumerate(zip(cpu_inputs, npu_inputs)):
        if cpu.is_floating_point():
            assert_close_to_reference(npu.grad.float(), cpu.grad, dtype, f"{what} gradient of input {index}", factor=2)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GENERATOR)


_GENERATOR = torch.Generator().manual_seed(33)
_CU = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # three sequences: 3, 5 and 2 tokens
_CU_K = torch.tensor([0, 4, 10, 12], dtype=torch.int32)  # their keys: 4, 6 and 2 tokens
ATTENTION_CASES = {
    "causal_gqa": lambda: [_randn(2, 6, 4, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16)],
    "scaled_window": lambda: [_randn(2, 5, 2, 16), _randn(2, 7, 2, 16), _randn(2, 7, 2, 16)],
    "causal_window": lambda: [_randn(1, 6, 2, 32), _randn(1, 6, 2, 32), _randn(1, 6, 2, 32)],
    "causal_flag": lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16)],
    "qkv_packed": lambda: [_randn(2, 5, 3, 2, 16)],
    "kv_packed": lambda: [_randn(2, 5, 4, 16), _randn(2, 7, 2, 2, 16)],
    "varlen": lambda: [_randn(10, 2, 16), _randn(12, 2, 16), _randn(12, 2, 16), _CU, _CU_K],
    "varlen_window": lambda: [_randn(10, 2, 16), _randn(10, 2, 16), _randn(10, 2, 16), _CU],
    "varlen_qkv_packed": lambda: [_randn(10, 3, 2, 16), _CU],
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_rewrites_equal_flash_attn_on_the_emulated_npu(programs, dtype):
    original, migrated, text = programs(ATTENTION, f"attention_{str(dtype)[6:]}")
    assert "import flash_attn" not in text and "from flash_attn" not in text  # every use was taken: the imports too
    for name, make_inputs in ATTENTION_CASES.items():
        _compare(getattr(original, name), getattr(migrated, name), make_inputs(), dtype, name)


def _joined(text: str) -> str:
    """The text with the rewrite's wrapped argument lists joined into single lines."""
    return re.sub(r"\(\s*\n\s*", "(", re.sub(r",\s*\n\s*", ", ", text))


def test_the_flash_attention_rewrite_reads_as_torch_npu_documents_it():
    outcome = migrate_python(ATTENTION, "attention.py", facts=FUSED)
    assert not outcome.findings  # every call and import was rewritten: nothing of flash_attn is left to report
    text = outcome.text
    assert text.startswith(ATTENTION_MIGRATED)
    joined = _joined(text)
    mask = "torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device={}.device), diagonal=1)"
    assert ("return torch_npu.npu_fusion_attention(q, k, v, q.shape[2], \"BSND\", atten_mask=" + mask.format("q") +
            ", scale=0.3, pre_tockens=1, next_tockens=0, sparse_mode=4)[0]") in joined  # causal + window: a band
    # a causal flag known at run time chooses the mask and the sparse mode
    assert f"atten_mask={mask.format('q')} if is_causal else None, scale=q.shape[-1] ** -0.5, " \
           "sparse_mode=3 if is_causal else 0)[0]" in joined
    assert f"torch_npu.npu_fusion_attention(*qkv.unbind(2), qkv.shape[3], \"BSND\", atten_mask={mask.format('qkv')}" \
        in joined
    assert "torch_npu.npu_fusion_attention(q, *kv.unbind(2), q.shape[2], \"BSND\", scale=q.shape[-1] ** -0.5)[0]" in joined
    # varlen: TND, cumulative ends (cu_seqlens without its leading 0) as int lists
    assert ('q, k, v, q.shape[1], "TND", atten_mask=' + mask.format("q") + ", scale=q.shape[-1] ** -0.5, "
            "actual_seq_qlen=cu_seqlens_q[1:].tolist(), actual_seq_kvlen=cu_seqlens_k[1:].tolist(), "
            "sparse_mode=3)[0]") in joined
    assert "pre_tockens=1, next_tockens=1, actual_seq_qlen=cu_seqlens[1:].tolist()" in joined
    assert '*qkv.unbind(1), qkv.shape[2], "TND"' in joined


XFORMERS = textwrap.dedent('''\
    import torch
    import xformers.ops as xops
    from xformers.ops import LowerTriangularFromBottomRightMask, memory_efficient_attention


    def causal_top_left(q, k, v):
        return xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask(), op=None)


    def causal_bottom_right(q, k, v):
        return memory_efficient_attention(q, k, v, LowerTriangularFromBottomRightMask())


    def scaled(q, k, v):
        return memory_efficient_attention(q, k, v, None, 0.0, 0.25)
''')
XFORMERS_CASES = {
    "causal_top_left": lambda: [_randn(2, 5, 2, 16), _randn(2, 7, 2, 16), _randn(2, 7, 2, 16)],
    "causal_bottom_right": lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16)],
    "scaled": lambda: [_randn(3, 5, 16), _randn(3, 6, 16), _randn(3, 6, 16)],  # no head axis: BSH, one head
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_xformers_attention_rewrites_equal_xformers_on_the_emulated_npu(programs, dtype):
    original, migrated, text = programs(XFORMERS, f"xformers_{str(dtype)[6:]}")
    assert "import xformers" not in text and "from xformers" not in text  # the mask objects went with the calls
    assert "sparse_mode=2)[0]" in text and "sparse_mode=3)[0]" in text
    for name, make_inputs in XFORMERS_CASES.items():
        _compare(getattr(original, name), getattr(migrated, name), make_inputs(), dtype, name)


def test_an_xformers_bias_other_than_the_causal_masks_stays_with_its_reason():
    source = ("import torch\nimport xformers.ops as xops\n"
              "out = xops.memory_efficient_attention(q, k, v, attn_bias=bias)\n"
              "causal = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())\n")
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert "out = xops.memory_efficient_attention(q, k, v, attn_bias=bias)\n" in outcome.text
    assert "import xformers.ops as xops\n" in outcome.text and "causal = torch_npu.npu_fusion_attention(" in outcome.text
    [kept] = [f for f in outcome.findings if f.kind == "xformers" and f.line == 3]
    assert "`npu-migrate --fused` keeps it: attn_bias `bias`" in kept.reason
    assert not [f for f in outcome.findings if f.line == 4]  # the rewritten call and its mask object are not reported

ROTARY = textwrap.dedent('''\
    import torch
    from flash_attn.layers.rotary import apply_rotary_emb


    def neox(x, cos, sin):
        return apply_rotary_emb(x, cos, sin)


    def gptj(x, cos, sin):
        return apply_rotary_emb(x, cos, sin, interleaved=True)
''')


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_rotary_becomes_npu_rotary_mul_on_the_rotated_features(programs, dtype):
    original, migrated, text = programs(ROTARY, f"rotary_{str(dtype)[6:]}")
    assert "flash_attn" not in text and text.count("torch_npu.npu_rotary_mul(") == 2
    for name in ("neox", "gptj"):
        # 12 of 16 features rotated; tables for 8 positions, the sequence has 6
        inputs = [_randn(2, 6, 3, 16), _randn(8, 6), _randn(8, 6)]
        _compare(getattr(original, name), getattr(migrated, name), inputs, dtype, name)

NORMS = textwrap.dedent('''\
    import torch
    from apex.normalization import FusedLayerNorm, FusedRMSNorm


    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = FusedLayerNorm(width, 1e-6)
            self.proj = torch.nn.Linear(width, width)
            self.rms = FusedRMSNorm([width], memory_efficient=True)

        def forward(self, x):
            return self.rms(self.proj(self.norm(x)))
''')


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apex_norms_become_torch_norms_with_the_same_output_gradients_and_state_dict(programs, dtype):
    original, migrated, text = programs(NORMS, f"norms_{str(dtype)[6:]}")
    assert "self.norm = torch.nn.LayerNorm(width, eps=1e-6)" in text
    assert "self.rms = torch.nn.RMSNorm([width], eps=1e-5)" in text and "apex" not in text
    torch.manual_seed(0)
    reference = original.Block(16)
    with torch.no_grad():  # weights away from their ones/zeros start, so a lost weight or bias shows
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape) * 0.5)
    block = migrated.Block(16)
    block.load_state_dict(reference.state_dict())  # same parameter names: checkpoints load unchanged
    block = block.to("npu", dtype)
    x = _randn(4, 16) * 3 + 1
    expected = reference(x.requires_grad_())
    x_npu = _npu(x, dtype)
    actual = block(x_npu)
    assert_close_to_reference(actual.float(), expected, dtype, "norms output")
    expected.sum().backward()
    actual.sum().backward()
    assert_close_to_reference(x_npu.grad.float(), x.grad, dtype, "norms input gradient", factor=2)
    for (name, want), got in zip(reference.named_parameters(), block.parameters()):
        assert_close_to_reference(got.grad.float(), want.grad, dtype, f"{name}'s gradient", factor=2)


ADAM = textwrap.dedent('''\
    import torch
    from apex.optimizers import FusedAdam, FusedSGD


    def decoupled(params):
        return FusedAdam(params, lr=0.05, weight_decay=0.1)


    def l2_penalty(params):
        return FusedAdam(params, 0.05, True, (0.8, 0.99), 1e-6, False, 0.1)


    def nesterov(params):
        return FusedSGD(params, 0.01, 0.9, weight_decay=0.05, nesterov=True, set_grad_none=True)
''')


def test_apex_fused_adam_and_sgd_become_torch_optimizers_with_the_same_steps(programs):
    original, migrated, text = programs(ADAM, "adam")
    assert "return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)" in text
    assert "return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)" in text
    assert "return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=0.05, nesterov=True)" in text
    assert "apex" not in text
    for name in ("decoupled", "l2_penalty", "nesterov"):
        start = _randn(8, 4)
        weights = {"cpu": start.clone().requires_grad_(), "npu": start.to("npu").requires_grad_()}
        optimizers = {"cpu": getattr(original, name)([weights["cpu"]]), "npu": getattr(migrated, name)([weights["npu"]])}
        for step in range(4):
            for device, weight in weights.items():
                optimizers[device].zero_grad()
                ((weight - step) ** 3).sum().backward()
                optimizers[device].step()
        assert_close_to_reference(weights["npu"].detach(), weights["cpu"].detach(), torch.float32, f"{name} weights")


KEPT = textwrap.dedent('''\
    import torch
    from flash_attn import flash_attn_func


    def capped(q, k, v):
        return flash_attn_func(q, k, v, softcap=30.0)


    def alibi(q, k, v, slopes):
        return flash_attn_func(q, k, v, alibi_slopes=slopes)


    def transposed(q, k, v):
        return flash_attn_func(q.transpose(1, 2), k, v)


    def unpacked(*args):
        return flash_attn_func(*args)


    def plain(q, k, v):
        return flash_attn_func(q, k, v)
''')


def test_calls_the_rewrite_cannot_map_stay_and_are_reported_with_the_reason():
    outcome = migrate_python(KEPT, "model.py", facts=FUSED)
    assert "from flash_attn import flash_attn_func\n" in outcome.text  # still needed by the kept calls
    assert "return torch_npu.npu_fusion_attention(q, k, v, q.shape[2], \"BSND\", scale=q.shape[-1] ** -0.5)[0]" \
        in outcome.text
    reasons = {f.line: f.reason for f in outcome.findings if f.kind == "flash-attn"}
    assert set(reasons) == {2, 6, 10, 14, 18}  # the import and the four kept calls; not the rewritten one
    assert "softcap" in reasons[6] and "ALiBi" in reasons[10]
    assert "`q.transpose(1, 2)` is computed in the call" in reasons[14] and "unpacked" in reasons[18]
    assert all("`npu-migrate --fused` keeps it" in reasons[line] for line in (6, 10, 14, 18))


def test_without_fused_nothing_changes_and_the_report_says_what_fused_would_take():
    outcome = migrate_python(KEPT, "model.py")
    assert outcome.text == KEPT
    reasons = {f.line: f.reason for f in outcome.findings if f.kind == "flash-attn"}
    assert reasons[22].endswith('`npu-migrate --fused` rewrites this call to '
                                'torch_npu.npu_fusion_attention(..., input_layout="BSND")[0]')
    assert "`npu-migrate --fused` keeps it: softcap" in reasons[6]
    assert "--fused" not in reasons[2]  # the import: kept without --fused


@pytest.mark.parametrize("source", [
    # a use that is not a call: the import stays, the call is rewritten
    "import torch\nfrom flash_attn import flash_attn_func\nHAVE_FLASH = flash_attn_func is not None\n"
    "def f(q, k, v):\n    return flash_attn_func(q, k, v)\n",
    # an optional import: the try keeps a body
    "import torch\ntry:\n    from flash_attn import flash_attn_func\nexcept ImportError:\n    flash_attn_func = None\n"
    "def f(q, k, v):\n    return flash_attn_func(q, k, v)\n",
    # one name of several
    "import torch\nfrom flash_attn import flash_attn_func, flash_attn_with_kvcache\n"
    "def f(q, k, v):\n    return flash_attn_func(q, k, v), flash_attn_with_kvcache\n",
])
def test_imports_go_only_with_their_last_use(source):
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert "torch_npu.npu_fusion_attention(q, k, v, q.shape[2]" in outcome.text
    assert ("flash_attn_func is not None" in outcome.text) == ("from flash_attn import flash_attn_func\n" in outcome.text)
    assert "try:\n    pass\nexcept ImportError:" in outcome.text or "try" not in source
    if "with_kvcache" in source:
        assert "from flash_attn import flash_attn_with_kvcache\n" in outcome.text
    assert migrate_python(outcome.text, "model.py", facts=FUSED).text == outcome.text


def test_cuda_code_in_an_argument_is_migrated_inside_the_rewrite_or_keeps_the_call():
    source = textwrap.dedent('''\
        import torch
        from flash_attn import flash_attn_func
        from apex.normalization import FusedRMSNorm


        def scaled(q, k, v):
            return flash_attn_func(q, k, v, softmax_scale=torch.cuda.device_count() * 0.5)


        def moved(q, k, v):
            return flash_attn_func(q, k, v.to("cuda"))


        norm = FusedRMSNorm(torch.cuda.device_count()).cuda()
        ''')
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert "q, k, v, q.shape[2], \"BSND\", scale=torch.npu.device_count() * 0.5)[0]" in _joined(outcome.text)
    assert "norm = torch.nn.RMSNorm(torch.npu.device_count(), eps=1e-5).npu()" in outcome.text
    # a device string the audit's device flows migrate in place: the call stays (migrated), and says why
    assert "return flash_attn_func(q, k, v.to(\"npu\"))" in outcome.text and "from flash_attn import" in outcome.text
    [kept] = [f for f in outcome.findings if f.line == 11]
    assert "keeps it: an argument holds CUDA code" in kept.reason
    assert "cuda" not in outcome.text  # nothing of CUDA left anywhere

def test_a_call_in_code_kept_for_cuda_keeps_its_import():
    # dual-target code: the CUDA branch is kept as it is (DualTargetCode), so it still needs flash_attn
    source = textwrap.dedent('''\
        import torch
        import torch.nn.functional as F
        from flash_attn import flash_attn_func


        def attend(q, k, v):
            if torch.cuda.is_available():
                return flash_attn_func(q, k, v, causal=True)
            elif torch.npu.is_available():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)


        def plain(q, k, v):
            return flash_attn_func(q, k, v)
        ''')
    text = migrate_python(source, "model.py", facts=FUSED).text
    assert "from flash_attn import flash_attn_func\n" in text and "return flash_attn_func(q, k, v, causal=True)\n" in text
    assert "return torch_npu.npu_fusion_attention(q, k, v, q.shape[2]" in text  # the call outside it is rewritten

@pytest.mark.parametrize("source", [
    "import torch\nfrom flash_attn import flash_attn_with_kvcache\nout = flash_attn_with_kvcache(q, k, v)\n",
    "import torch\nfrom apex.normalization import MixedFusedRMSNorm\nnorm = MixedFusedRMSNorm(64)\n",
    "import torch\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(params, amsgrad=True)\n",
    "import torch\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(params, bias_correction=False)\n",
    "import torch\nfrom apex.optimizers import FusedAdam\nopt = FusedAdam(params, adam_w_mode=args.adamw)\n",
    "import torch\nimport apex\nclass Norm(apex.normalization.FusedRMSNorm):\n    pass\n",
    "import torch\n\ndef flash_attn_func(q, k, v):\n    return q\nout = flash_attn_func(q, k, v)\n",  # the user's own
])
def test_what_fused_does_not_take_is_left_byte_identical(source):
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert outcome.text == migrate_python(source, "model.py").text


@pytest.mark.parametrize(("source", "reason"), [
    ("from flash_attn import flash_attn_with_kvcache\nout = flash_attn_with_kvcache(q, k_cache, v_cache)\n",
     "flash_attn_with_kvcache is an inference kernel"),
    ("from apex.optimizers import FusedLAMB\nopt = FusedLAMB(params)\n", "LAMB: no torch optimizer computes it"),
    ("import apex\nnorm = apex.normalization.MixedFusedRMSNorm(64)\n", "apex's MixedFusedRMSNorm takes fp16/bf16 inputs"),
    ("from flash_attn import flash_attn_func\nout = flash_attn_func(q, k)\n", "flash_attn_func is not given v"),
])
def test_calls_fused_does_not_take_say_why_with_or_without_it(source, reason):
    for facts in (TreeFacts(), FUSED):
        outcome = migrate_python("import torch\n" + source, "model.py", facts=facts)
        [call] = [f for f in outcome.findings if f.line == 3]
        assert f"`npu-migrate --fused` keeps it: {reason}" in call.reason


@pytest.mark.parametrize("source", [ATTENTION, XFORMERS, ROTARY, NORMS, ADAM, KEPT])
def test_a_second_fused_run_changes_nothing(source):
    once = migrate_python(source, "model.py", facts=FUSED).text
    assert once != source
    assert migrate_python(once, "model.py", facts=FUSED).text == once


def test_libcsts_tool_gives_npu_migrate_fuseds_bytes(tmp_path):
    sources = {"attention.py": ATTENTION, "xformers_attention.py": XFORMERS, "rotary.py": ROTARY, "norms.py": NORMS, "adam.py": ADAM, "kept.py": KEPT}
    (tmp_path / "src").mkdir()
    for name, source in sources.items():
        (tmp_path / "src" / name).write_text(source)
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          "npukit.migrate.codemods.MigrateToNpu", "--fused", "src"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    for name, source in sources.items():
        assert (tmp_path / "src" / name).read_text() == migrate_python(source, name, facts=FUSED).text, name


FUSED_PROGRAMS = (ATTENTION, XFORMERS, ROTARY, NORMS, ADAM)  # the rest: test_fused_layers_codemods.py's


def test_every_fused_rule_is_named_and_made_by_these_programs():
    made = {change.rule for source in FUSED_PROGRAMS for change in migrate_python(source, "model.py", facts=FUSED).changes}
    # every --fused rule is made by these programs or test_fused_layers_codemods.py's (checked there)
    assert made <= {rule for codemod in FUSED_CODEMODS for rule in codemod.RULES} | {"import-torch-npu"}
    assert made <= set(rules.REWRITE_RULES)
    assert all(codemod.DESCRIPTION and codemod.__doc__ for codemod in FUSED_CODEMODS)



def test_the_summary_says_how_many_calls_fused_would_rewrite(tmp_path):
    from rich.console import Console

    from npukit.migrate.report import print_summary
    from npukit.migrate.runner import MigrateOptions, run_migration

    (tmp_path / "model.py").write_text(KEPT)
    for fused, expected in ((False, "npu-migrate --fused would rewrite 1 call of flash_attn / xformers / apex"),
                            (True, None)):
        console = Console(record=True, width=200)
        print_summary(run_migration(MigrateOptions(target=tmp_path, dry_run=True, fused=fused)), console)
        said = console.export_text()
        assert (expected in said) if expected else "--fused would rewrite" not in said


@pytest.mark.parametrize(("codemod", "source"), [("FlashRotaryToNpu", ROTARY), ("ApexNormsToTorch", NORMS)])
def test_one_concern_run_alone_by_libcst_writes_npu_migrates_bytes_but_the_torch_npu_import(codemod, source):
    import libcst as cst
    from libcst.codemod import CodemodContext

    from npukit.migrate import codemods

    alone = getattr(codemods, codemod)(CodemodContext(filename="model.py")).transform_module(cst.parse_module(source))
    assert alone.code == migrate_python(source, "model.py", facts=FUSED).text.replace("import torch_npu\n", "", 1)
