"""npu-migrate --fused: xformers.ops.memory_efficient_attention with a tensor attn_bias becomes
torch_npu.npu_fusion_attention_v2 with pse (pse_type=0: added after the scale, as xformers adds it).
Each program runs twice: the original on the CPU with the pure-torch xformers reference
(tests/migrate/fused_stubs), the rewrite on the emulated NPU without xformers; outputs and the
gradients of query, key, value and the bias agree within the NPU dtype's tolerance."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from npukit.migrate.model import TreeFacts
from npukit.migrate.pysource import migrate_python
from tests.migrate import test_fused_codemods
from tests.migrate.test_fused_codemods import REPO, _compare, _joined

FUSED = TreeFacts(fused=True)
programs = test_fused_codemods.programs  # the fixture: original and migrated programs, the libraries gone for the latter

BIASES = textwrap.dedent('''\
    import torch
    import xformers.ops as xops
    from xformers.ops import memory_efficient_attention


    def full_bias(q, k, v, bias):
        return memory_efficient_attention(q, k, v, attn_bias=bias[:, :, : q.shape[1]])


    def broadcast_bias(q, k, v, bias):
        return xops.memory_efficient_attention(q, k, v, bias[..., : k.shape[1]], 0.0, 0.3)


    def headless_bias(q, k, v, bias):
        return memory_efficient_attention(q, k, v, attn_bias=bias[:, :, :])


    def computed_bias(q, k, v, bias):
        return memory_efficient_attention(q, k, v, attn_bias=torch.tanh(bias))
''')

_GENERATOR = torch.Generator().manual_seed(33)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GENERATOR)


BIAS_CASES = {
    # [B, H, Sq, Skv], sliced in the call
    "full_bias": lambda: [_randn(2, 5, 2, 16), _randn(2, 7, 2, 16), _randn(2, 7, 2, 16), _randn(2, 2, 6, 7)],
    # [1, H, 1, Skv]: broadcast over the batch and the queries, as xformers allows; scale given
    "broadcast_bias": lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16), _randn(1, 2, 1, 8)],
    # 3-D inputs (BSH, one head): the bias is [B, Sq, Skv]
    "headless_bias": lambda: [_randn(3, 5, 16), _randn(3, 6, 16), _randn(3, 6, 16), _randn(3, 5, 6)],
    "computed_bias": lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16), _randn(2, 2, 4, 6)],
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_tensor_bias_becomes_pse_added_after_the_scale_with_the_same_outputs_and_gradients(programs, dtype):
    original, migrated, text = programs(BIASES, f"xformers_biases_{str(dtype)[6:]}")
    assert "import xformers" not in text and "from xformers" not in text  # every call was taken
    for name, make_inputs in BIAS_CASES.items():
        _compare(getattr(original, name), getattr(migrated, name), make_inputs(), dtype, name)


def test_the_tensor_bias_rewrite_reads_as_torch_npu_documents_it():
    outcome = migrate_python(BIASES, "biases.py", facts=FUSED)
    assert not outcome.findings
    joined = _joined(outcome.text)
    # pse is expanded to the [B, N, Sq, Skv] torch_npu takes (a 3-D call: [B, 1, Sq, Skv]), once
    assert ('torch_npu.npu_fusion_attention_v2(q, k, v, q.shape[2] if q.dim() == 4 else 1, '
            '"BSND" if q.dim() == 4 else "BSH", pse=torch.tanh(bias).expand(q.shape[0], q.shape[2], q.shape[1], '
            'k.shape[1]) if q.dim() == 4 else torch.tanh(bias).expand(q.shape[0], q.shape[1], k.shape[1])[:, None], '
            'scale=q.shape[-1] ** -0.5, pse_type=0)[0]') in joined
    assert "scale=0.3, pse_type=0)[0]" in joined


VARLEN = textwrap.dedent('''\
    import torch
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask, BlockDiagonalCausalMask


    def blocks(q, k, v):
        return xops.memory_efficient_attention(q, k, v, attn_bias=xops.fmha.BlockDiagonalMask.from_seqlens([3, 5, 2]))


    def causal_blocks(q, k, v, lengths):
        return xops.memory_efficient_attention(q, k, v, BlockDiagonalCausalMask.from_seqlens(lengths), 0.0, 0.3)


    def causal_blocks_longer_keys(q, k, v, q_lengths, kv_lengths):
        return xops.memory_efficient_attention(q, k, v, BlockDiagonalCausalMask.from_seqlens(q_lengths, kv_lengths))


    def bottom_right_blocks(q, k, v, q_lengths, kv_lengths):
        return xops.memory_efficient_attention(q, k, v, BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            q_lengths, kv_seqlen=kv_lengths))
''')
VARLEN_CASES = {  # batch 1, three sequences concatenated
    "blocks": (lambda: [_randn(1, 10, 2, 16), _randn(1, 10, 2, 16), _randn(1, 10, 2, 16)], ()),
    # 3-D inputs: one head; the causal diagonal at each sequence's top-left corner (sparse_mode 2)
    "causal_blocks": (lambda: [_randn(1, 10, 16), _randn(1, 10, 16), _randn(1, 10, 16)], ([4, 4, 2],)),
    "causal_blocks_longer_keys": (lambda: [_randn(1, 10, 2, 16), _randn(1, 12, 2, 16), _randn(1, 12, 2, 16)],
                                  ([3, 5, 2], [4, 6, 2])),
    # keys longer than queries per sequence: the diagonal at each bottom-right corner (sparse_mode 3)
    "bottom_right_blocks": (lambda: [_randn(1, 10, 2, 16), _randn(1, 12, 2, 16), _randn(1, 12, 2, 16)],
                            ([3, 5, 2], [4, 6, 2])),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_diagonal_masks_become_tnd_with_cumulative_lengths_and_the_same_gradients(programs, dtype):
    original, migrated, text = programs(VARLEN, f"xformers_varlen_{str(dtype)[6:]}")
    assert "import xformers" not in text and "from xformers" not in text  # the mask objects went with the calls
    _compare_cases(original, migrated, VARLEN_CASES, dtype)


def _compare_cases(original, migrated, cases: dict, dtype) -> None:
    """Each function of the original and migrated programs on its case's tensors, then its lengths."""
    for name, (make_inputs, lengths) in cases.items():
        def reference(*tensors, function=getattr(original, name), lengths=lengths):
            return function(*tensors, *lengths)

        def rewrite(*tensors, function=getattr(migrated, name), lengths=lengths):
            return function(*tensors, *lengths)
        _compare(reference, rewrite, make_inputs(), dtype, name)


def test_the_block_diagonal_rewrite_reads_as_torch_npu_documents_it():
    joined = _joined(migrate_python(VARLEN, "varlen.py", facts=FUSED).text)
    tnd = "{0}.flatten(0, 1) if q.dim() == 4 else {0}.flatten(0, 1)[:, None]"
    assert (f"torch_npu.npu_fusion_attention({tnd.format('q')}, {tnd.format('k')}, {tnd.format('v')}, "
            'q.shape[2] if q.dim() == 4 else 1, "TND", scale=q.shape[-1] ** -0.5, '
            "actual_seq_qlen=torch.tensor([3, 5, 2]).cumsum(0).tolist(), "
            "actual_seq_kvlen=torch.tensor([3, 5, 2]).cumsum(0).tolist())[0].reshape(*q.shape[:-1], -1)") in joined
    assert ("scale=0.3, actual_seq_qlen=torch.tensor(lengths).cumsum(0).tolist(), "
            "actual_seq_kvlen=torch.tensor(lengths).cumsum(0).tolist(), sparse_mode=2)[0]") in joined
    assert ("actual_seq_qlen=torch.tensor(q_lengths).cumsum(0).tolist(), "
            "actual_seq_kvlen=torch.tensor(kv_lengths).cumsum(0).tolist(), sparse_mode=3)[0]") in joined


CAUSAL_AND_HELD = textwrap.dedent('''\
    import torch
    import xformers.ops as xops
    from xformers.ops import LowerTriangularMaskWithTensorBias, memory_efficient_attention
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask


    def causal_with_bias(q, k, v, bias):
        return xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask().add_bias(bias))


    def causal_with_bias_class(q, k, v, bias):
        return memory_efficient_attention(q, k, v, LowerTriangularMaskWithTensorBias(torch.tanh(bias)))


    def causal_held(q, k, v):
        mask = xops.LowerTriangularMask()
        return xops.memory_efficient_attention(q, k, v, attn_bias=mask)


    def causal_with_bias_held(q, k, v, bias):
        attn_bias = xops.LowerTriangularMask().add_bias(bias * 0.5)
        out = xops.memory_efficient_attention(q, k, v, attn_bias)
        return out


    def blocks_held(q, k, v, q_lengths, kv_lengths):
        mask = BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lengths, kv_lengths)
        if q.requires_grad:
            return xops.memory_efficient_attention(q, k, v, mask)
        return None


    def tensor_held(q, k, v, bias):
        full = torch.tanh(bias)
        return memory_efficient_attention(q, k, v, attn_bias=full)
''')
CAUSAL_AND_HELD_CASES = {  # inputs, lengths
    # [B, H, Sq, Skv] bias under the top-left causal mask, keys longer than queries
    "causal_with_bias": (lambda: [_randn(2, 5, 2, 16), _randn(2, 7, 2, 16), _randn(2, 7, 2, 16), _randn(2, 2, 5, 7)], ()),
    # 3-D inputs (BSH, one head): the bias is [B, Sq, Skv]
    "causal_with_bias_class": (lambda: [_randn(3, 5, 16), _randn(3, 6, 16), _randn(3, 6, 16), _randn(3, 5, 6)], ()),
    "causal_held": (lambda: [_randn(2, 5, 2, 16), _randn(2, 7, 2, 16), _randn(2, 7, 2, 16)], ()),
    "causal_with_bias_held": (lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16),
                                       _randn(1, 2, 1, 6)], ()),  # broadcast over the batch and the queries
    "blocks_held": (lambda: [_randn(1, 10, 2, 16), _randn(1, 12, 2, 16), _randn(1, 12, 2, 16)],
                    ([3, 5, 2], [4, 6, 2])),
    "tensor_held": (lambda: [_randn(2, 4, 2, 16), _randn(2, 6, 2, 16), _randn(2, 6, 2, 16), _randn(2, 2, 4, 6)], ()),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_causal_mask_with_a_tensor_bias_and_biases_held_in_variables_equal_xformers(programs, dtype):
    original, migrated, text = programs(CAUSAL_AND_HELD, f"xformers_held_{str(dtype)[6:]}")
    assert "xformers" not in text and "xops" not in text  # every call, mask object and import went
    _compare_cases(original, migrated, CAUSAL_AND_HELD_CASES, dtype)


def test_the_held_biases_rewrite_reads_as_torch_npu_documents_it():
    text = migrate_python(CAUSAL_AND_HELD, "held.py", facts=FUSED).text
    joined = _joined(text)
    # the mask with a tensor: pse (after the scale) and the causal mode together
    assert ("pse=bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1]) if q.dim() == 4 else "
            "bias.expand(q.shape[0], q.shape[1], k.shape[1])[:, None], scale=q.shape[-1] ** -0.5, sparse_mode=2, "
            "pse_type=0)[0]") in joined
    assert "mask = " not in joined  # the mask objects' assignments went with their calls
    assert "    attn_bias = bias * 0.5\n    out = torch_npu.npu_fusion_attention_v2(\n" in text  # the mask's tensor
    assert ("actual_seq_qlen=torch.tensor(q_lengths).cumsum(0).tolist(), "
            "actual_seq_kvlen=torch.tensor(kv_lengths).cumsum(0).tolist(), sparse_mode=3)[0]") in joined
    assert "    full = torch.tanh(bias)\n    return torch_npu.npu_fusion_attention_v2(\n" in text  # a tensor stays


HELD_BUT_KEPT = {  # a function body whose call stays -> the reason given
    "def f(q, k, v, mask):\n    return xops.memory_efficient_attention(q, k, v, mask)\n":
        "attn_bias `mask` is a variable that may hold a mask object or a tensor, which one is known only when it "
        "runs: it is a parameter of `f`",
    "def f(q, k, v, causal):\n    mask = xops.LowerTriangularMask()\n    if not causal:\n        mask = None\n"
    "    return xops.memory_efficient_attention(q, k, v, mask)\n": "it is bound more than once in `f`",
    "def f(q, k, v, causal):\n    if causal:\n        mask = xops.LowerTriangularMask()\n"
    "    return xops.memory_efficient_attention(q, k, v, mask)\n":
        "its one assignment in `f` is not a statement of its own before the call in the call's block",
    "def f(q, k, v):\n    mask = xops.LowerTriangularMask()\n    a = xops.memory_efficient_attention(q, k, v, mask)\n"
    "    return a, mask\n": "holds the mask object `xops.LowerTriangularMask()` (line 4), read elsewhere too (line 6)",
    "def f(q, k, v):\n    mask = make_mask(q)\n    return xops.memory_efficient_attention(q, k, v, mask)\n":
        "attn_bias `mask` holds `make_mask(q)` (line 4): only None",
    "def f(q, k, v, lengths):\n    mask = xops.fmha.BlockDiagonalMask.from_seqlens(lengths)\n    lengths = [3]\n"
    "    return xops.memory_efficient_attention(q, k, v, mask)\n":
        "`lengths`, a length of `xops.fmha.BlockDiagonalMask.from_seqlens(lengths)` (line 4), is assigned again at "
        "line 5: moved into the call, it could read the new value",
    "def f(q, k, v, lengths):\n    mask = xops.fmha.BlockDiagonalMask.from_seqlens(lengths.tolist())\n"
    "    return xops.memory_efficient_attention(q, k, v, mask)\n": "are computed there",
    "def f(q, k, v, bias):\n    mask = xops.LowerTriangularFromBottomRightMask().add_bias(bias)\n"
    "    return xops.memory_efficient_attention(q, k, v, mask)\n": "holds `xops.LowerTriangularFromBottomRightMask()",
}


@pytest.mark.parametrize("body", list(HELD_BUT_KEPT), ids=[
    "parameter", "bound twice", "another block", "read elsewhere", "unknown kind", "lengths assigned again",
    "lengths computed", "bottom-right add_bias"])
def test_a_variable_bias_that_cannot_be_resolved_stays_with_its_reason(body):
    source = f"import torch\nimport xformers.ops as xops\n{body}"
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert outcome.text == source  # nothing of it changes: not the call, not the assignment, not the import
    call_line = next(n for n, line in enumerate(source.splitlines(), 1) if "memory_efficient_attention" in line)
    assert [f for f in outcome.findings if f.kind == "xformers" and f.line == call_line
            and HELD_BUT_KEPT[body] in f.reason], [f.reason for f in outcome.findings]


@pytest.mark.parametrize(("argument", "reason"), [
    ("attn_bias=bias", "a variable that may hold a mask object or a tensor"),
    ("attn_bias=make_bias(q)", "attn_bias `make_bias(q)`: only None"),
    ("attn_bias=xops.fmha.BlockDiagonalMask.from_seqlens(lengths())", "q_seqlen `lengths()` is computed in the call"),
    ("attn_bias=xops.fmha.BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen=[3], kv_padding=4, kv_seqlen=[2])",
     "attn_bias `xops.fmha.BlockDiagonalPaddedKeysMask"),
])
def test_a_bias_fused_cannot_tell_is_a_tensor_stays_with_its_reason(argument, reason):
    source = f"import torch\nimport xformers.ops as xops\nout = xops.memory_efficient_attention(q, k, v, {argument})\n"
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert f"out = xops.memory_efficient_attention(q, k, v, {argument})\n" in outcome.text
    assert [f for f in outcome.findings if f.kind == "xformers" and f.line == 3 and reason in f.reason]


def test_a_key_computed_in_the_call_beside_a_tensor_bias_stays():
    source = "import xformers.ops as xops\nout = xops.memory_efficient_attention(q, k * 2, v, bias[:])\n"
    outcome = migrate_python(source, "model.py", facts=FUSED)
    assert "out = xops.memory_efficient_attention(q, k * 2, v, bias[:])\n" in outcome.text
    [kept] = [f for f in outcome.findings if f.kind == "xformers" and f.line == 2]
    assert "its key `k * 2` is computed in the call" in kept.reason


def test_a_second_run_changes_nothing_and_libcsts_tool_gives_the_same_bytes(tmp_path):
    sources = {"biases.py": BIASES, "varlen.py": VARLEN, "held.py": CAUSAL_AND_HELD}
    (tmp_path / "src").mkdir()
    for name, source in sources.items():
        once = migrate_python(source, name, facts=FUSED).text
        assert once != source and migrate_python(once, name, facts=FUSED).text == once
        (tmp_path / "src" / name).write_text(source)
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          "npukit.migrate.codemods.MigrateToNpu", "--fused", "src"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    for name, source in sources.items():
        assert (tmp_path / "src" / name).read_text() == migrate_python(source, name, facts=FUSED).text, name


def test_run_alone_by_libcst_the_concern_removes_the_held_masks_assignments_too():
    import libcst as cst
    from libcst.codemod import CodemodContext

    from npukit.migrate import codemods

    alone = codemods.XformersAttentionToNpu(CodemodContext(filename="held.py")).transform_module(
        cst.parse_module(CAUSAL_AND_HELD))
    assert alone.code == migrate_python(CAUSAL_AND_HELD, "held.py", facts=FUSED).text.replace("import torch_npu\n", "", 1)
