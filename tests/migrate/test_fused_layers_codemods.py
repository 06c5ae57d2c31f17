"""npu-migrate --fused: apex's multi-tensor kernels (amp_C through multi_tensor_applier) and
flash_attn's fused layers rewritten to torch / torch_npu. As in test_fused_codemods.py, each program
is written against the CUDA library (stubbed by the pure-torch reference in tests/migrate/fused_stubs),
migrated, and run twice: the original on the CPU with the reference, the rewrite on the emulated NPU
where the library cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from npukit.migrate.codemods import FUSED_CODEMODS
from npukit.migrate.model import TreeFacts
from npukit.migrate.pysource import migrate_python
from tests.migrate import test_fused_codemods
from tests.migrate.test_fused_codemods import FUSED_PROGRAMS, REPO
from tests.npu_backend.fused.reference import assert_close_to_reference

FUSED = TreeFacts(fused=True)
programs = test_fused_codemods.programs  # the fixture: original and migrated programs, the libraries gone for the latter

_GENERATOR = torch.Generator().manual_seed(33)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_GENERATOR).to(dtype)


MULTI_TENSOR = textwrap.dedent('''\
    """Gradient clipping and loss scaling as Megatron-LM and apex-based trainers write them."""
    import torch
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier


    def grad_norm(grads):
        dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=grads[0].device)
        norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, dummy_overflow_buf, [grads], False)
        return norm, per_tensor


    def clip(grads, clip_coeff):
        multi_tensor_applier(amp_C.multi_tensor_scale, torch.tensor([0], dtype=torch.int), [grads, grads], clip_coeff)


    def unscale(model_grads, master_grads, overflow_buf, scale):
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [model_grads, master_grads], 1.0 / scale)
        return overflow_buf.item()


    def copy(this, that):
        dummy_overflow_buf = torch.tensor([0], dtype=torch.int)
        dummy_overflow_buf.fill_(0)
        multi_tensor_applier(amp_C.multi_tensor_scale, dummy_overflow_buf, [this, that], 1.0)


    def blend(x, y, out, overflow_buf):
        multi_tensor_applier(amp_C.multi_tensor_axpby, overflow_buf, [x, y, out], 0.5, 2.0, 1)
''')


def _pair(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same values on the CPU (for the reference) and on the emulated NPU (for the rewrite)."""
    return [t.clone() for t in tensors], [t.to("npu") for t in tensors]


def test_amp_c_kernels_become_torch_with_the_same_results_dtypes_and_overflow_flag(programs):
    original, migrated, text = programs(MULTI_TENSOR, "multi_tensor")
    assert "import amp_C" not in text and "from apex" not in text  # every call taken: both imports gone
    assert "torch._foreach_mul_(grads, clip_coeff)" in text and "torch._foreach_copy_(that, this)" in text
    # the dummy buffers nothing reads are dropped; the one the caller reads is set as apex sets it
    assert "overflow_buf.masked_fill_(~torch.stack([t.isfinite().all() for t in model_grads]).all(), 1)" in text
    assert "dummy_overflow_buf, [" not in text

    # l2norm: a 1-element fp32 total accumulated in fp32 from bf16 and fp16 tensors (a bf16 norm would
    # be off by ~2e-3, beyond fp32's tolerance), and an empty fp32 per-tensor result on the device
    cpu, npu = _pair([_randn(300, dtype=torch.bfloat16) * 3, _randn(7, 5, dtype=torch.float16), _randn(40)])
    (expected, expected_empty), (actual, actual_empty) = original.grad_norm(cpu), migrated.grad_norm(npu)
    assert (actual.shape, actual.dtype, actual.device.type) == ((1,), torch.float32, "npu")
    assert expected.shape == (1,) and expected_empty.numel() == 0
    assert (actual_empty.shape, actual_empty.dtype, actual_empty.device.type) == ((0,), torch.float32, "npu")
    assert_close_to_reference(actual, expected, torch.float32, "l2norm")

    # scale in place (Megatron's clipping of its fp32 main gradients: the same values; a bf16 list within
    # bf16's rounding, torch's CPU foreach kernel rounding the scale to bf16 as it multiplies)
    cpu, npu = _pair([_randn(64), _randn(3, 9), _randn(128, dtype=torch.bfloat16)])
    original.clip(cpu, 0.3)
    migrated.clip(npu, 0.3)
    assert [t.dtype for t in npu] == [torch.float32, torch.float32, torch.bfloat16]
    assert torch.equal(npu[0].cpu(), cpu[0]) and torch.equal(npu[1].cpu(), cpu[1])
    assert_close_to_reference(npu[2].float(), cpu[2].float(), torch.bfloat16, "bf16 scale")

    # unscale fp16 model gradients into fp32 master gradients: the product in fp32 (in fp16 these
    # gradients / 65536 would underflow), and the overflow flag set only by a non-finite gradient
    for poisoned in (False, True):
        model = [_randn(50, dtype=torch.float16) * 1e-3, _randn(4, 4, dtype=torch.float16)]
        if poisoned:
            model[1][2, 3] = float("inf")
        cpu_model, npu_model = _pair(model)
        cpu_master, npu_master = _pair([torch.zeros(50), torch.zeros(4, 4)])
        flags = [torch.tensor([0], dtype=torch.int), torch.tensor([0], dtype=torch.int).to("npu")]
        expected_flag = original.unscale(cpu_model, cpu_master, flags[0], 65536.0)
        actual_flag = migrated.unscale(npu_model, npu_master, flags[1], 65536.0)
        assert expected_flag == actual_flag == int(poisoned)
        for want, got in zip(cpu_master, npu_master):
            assert got.dtype == torch.float32 and torch.equal(got.cpu(), want) and want[:1].abs().sum() > 0

    # a copy (scale 1.0) from fp32 master weights into bf16 model weights
    cpu_this, npu_this = _pair([_randn(33), _randn(2, 8)])
    cpu_that, npu_that = _pair([torch.zeros(33, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)])
    original.copy(cpu_this, cpu_that)
    migrated.copy(npu_this, npu_that)
    assert all(torch.equal(got.cpu(), want) for want, got in zip(cpu_that, npu_that))

    # axpby: out = 0.5 x + 2 y in fp32, the flag from y only (arg_to_check=1)
    for poison in ("x", "y"):
        inputs = {"x": [_randn(20, dtype=torch.bfloat16)], "y": [_randn(20, dtype=torch.float16)]}
        inputs[poison][0][5] = float("nan")
        cpu_x, npu_x = _pair(inputs["x"])
        cpu_y, npu_y = _pair(inputs["y"])
        cpu_out, npu_out = _pair([torch.zeros(20)])
        flags = [torch.tensor([0], dtype=torch.int), torch.tensor([0], dtype=torch.int).to("npu")]
        original.blend(cpu_x, cpu_y, cpu_out, flags[0])
        migrated.blend(npu_x, npu_y, npu_out, flags[1])
        assert flags[1].item() == flags[0].item() == int(poison == "y")
        assert torch.equal(npu_out[0].cpu().isnan(), cpu_out[0].isnan())
        finite = ~cpu_out[0].isnan()
        assert_close_to_reference(npu_out[0].cpu()[finite], cpu_out[0][finite], torch.float32, "axpby")


@pytest.mark.parametrize(("call", "reason"), [
    ("multi_tensor_applier(l2_norm_impl, buf, [grads], False)",
     "the kernel `l2_norm_impl` is not one of amp_C's written in the call"),
    ("multi_tensor_applier(amp_C.multi_tensor_adam, buf, [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)",
     "amp_C.multi_tensor_adam is an optimizer step"),
    ("multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [grads], True)", "per_tensor is not False"),
    ("multi_tensor_applier(amp_C.multi_tensor_l2norm, self.overflow_buf, [grads], False)",
     "its overflow buffer `self.overflow_buf` may be read after the call"),
    ("multi_tensor_applier(amp_C.multi_tensor_scale, buf, lists, 0.5)", "write them as a list in the call"),
    ("multi_tensor_applier(amp_C.multi_tensor_l2norm, torch.zeros(1, dtype=torch.int), [[p.grad for p in params]], False)",
     "the tensor list `[p.grad for p in params]` is computed in the call"),
])
def test_amp_c_calls_fused_cannot_map_stay_with_the_reason(call, reason):
    source = f"import torch\nimport amp_C\nfrom apex.multi_tensor_apply import multi_tensor_applier\nout = {call}\n"
    for facts in (TreeFacts(), FUSED):
        outcome = migrate_python(source, "model.py", facts=facts)
        assert f"out = {call}\n" in outcome.text and "import amp_C\n" in outcome.text
        [finding] = [f for f in outcome.findings if f.line == 4]
        assert "`npu-migrate --fused` keeps it: " in finding.reason and reason in finding.reason


def test_without_fused_the_report_says_what_fused_makes_of_amp_c_calls():
    findings = {f.line: f.reason for f in migrate_python(MULTI_TENSOR, "model.py").findings if f.kind == "apex"}
    assert findings[9].endswith("`npu-migrate --fused` rewrites this call to torch.nn.utils.get_total_norm over "
                                "fp32 per-tensor norms (1-element fp32 total, empty per-tensor norms)")
    assert "rewrites this call to torch._foreach_mul_ / torch._foreach_copy_" in findings[14]


LAYERS = textwrap.dedent("""\
    import torch
    from flash_attn.ops.rms_norm import RMSNorm, rms_norm
    from flash_attn.ops.triton.layer_norm import RMSNorm as TritonRMSNorm, layer_norm_fn, rms_norm_fn
    from flash_attn.losses.cross_entropy import CrossEntropyLoss
    from flash_attn.ops.fused_dense import FusedDense


    class Head(torch.nn.Module):
        def __init__(self, width, vocab):
            super().__init__()
            self.norm = RMSNorm(width)
            self.triton_norm = TritonRMSNorm(width, eps=1e-6)
            self.proj = FusedDense(width, vocab, bias=True)
            self.loss = CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1, inplace_backward=True)

        def forward(self, x, labels):
            return self.loss(self.proj(self.triton_norm(self.norm(x))), labels)


    def plain(x, weight):
        return rms_norm(x, weight, 1e-5)


    def prenorm(x, residual, weight):
        return rms_norm_fn(x, weight, None, residual=residual, prenorm=True, residual_in_fp32=True, eps=1e-5)


    def first_prenorm(x, weight):
        return rms_norm_fn(x, weight, None, prenorm=True, residual_in_fp32=True)


    def layer(x, residual, weight, bias):
        return layer_norm_fn(x, weight, bias, residual, eps=1e-5)
""")


def _grads(outputs, inputs, upstreams):
    """Every floating input's gradient under the upstream gradients of the outputs."""
    torch.autograd.backward(list(outputs), [u.to(o.device, o.dtype) for o, u in zip(outputs, upstreams)])
    return [t.grad for t in inputs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_norm_functions_become_npu_rms_norm_and_layer_norm(programs, dtype):
    original, migrated, text = programs(LAYERS, f"layers_{str(dtype)[6:]}")
    assert "flash_attn" not in text and text.count("torch_npu.npu_rms_norm(") == 3
    assert "return torch_npu.npu_rms_norm(x, weight, 1e-5)[0]" in text
    assert "(torch_npu.npu_rms_norm(x + residual, weight, 1e-5)[0].to(x.dtype), x + residual)" in text
    assert "return (torch_npu.npu_rms_norm(x, weight, 1e-6)[0], x.float())" in text
    cases = {  # (inputs, their dtypes on the NPU: a residual kept in fp32, as residual_in_fp32 makes it)
        "plain": ([_randn(3, 5, 16) * 2, _randn(16)], [dtype, dtype]),
        "prenorm": ([_randn(3, 5, 16), _randn(3, 5, 16) * 4, _randn(16)], [dtype, torch.float32, dtype]),
        "first_prenorm": ([_randn(4, 16), _randn(16)], [dtype, dtype]),
        "layer": ([_randn(6, 16), _randn(6, 16), _randn(16), _randn(16)], [dtype, dtype, dtype, dtype]),
    }
    for name, (inputs, dtypes) in cases.items():
        cpu = [t.to(d).float().requires_grad_() for t, d in zip(inputs, dtypes)]  # the same values
        npu = [t.detach().to("npu", d).requires_grad_() for t, d in zip(inputs, dtypes)]
        expected, actual = getattr(original, name)(*cpu), getattr(migrated, name)(*npu)
        expected, actual = (expected, actual) if isinstance(actual, tuple) else ((expected,), (actual,))
        assert actual[0].dtype == dtype  # the norm in x's dtype; the residual sum in the residual's
        if len(actual) == 2:
            assert actual[1].dtype == torch.float32
        for index, (want, got) in enumerate(zip(expected, actual)):
            assert_close_to_reference(got.float(), want, dtype, f"{name} output {index}")
        upstreams = [_randn(*t.shape) for t in expected]
        for index, (want, got) in enumerate(zip(_grads(expected, cpu, upstreams), _grads(actual, npu, upstreams))):
            assert_close_to_reference(got.float(), want, dtype, f"{name} gradient of input {index}", factor=2)


def test_flash_attn_modules_become_torch_modules_with_the_same_state_dict_loss_and_gradients(programs):
    original, migrated, text = programs(LAYERS, "layers_modules")
    assert "self.norm = torch.nn.RMSNorm(width, eps=1e-5)" in text
    assert "self.triton_norm = torch.nn.RMSNorm(width, eps=1e-6)" in text
    assert "self.proj = torch.nn.Linear(width, vocab, bias=True)" in text
    assert "self.loss = torch.nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)" in text
    torch.manual_seed(0)
    reference = original.Head(16, 11)
    with torch.no_grad():  # weights away from their ones start, so a lost weight shows
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape) * 0.5)
    head = migrated.Head(16, 11)
    head.load_state_dict(reference.state_dict())  # same parameter names: checkpoints load unchanged
    head = head.to("npu", torch.bfloat16)
    x = (_randn(8, 16) * 3).to(torch.bfloat16).float().requires_grad_()
    labels = torch.tensor([3, -1, 0, 10, 5, -1, 7, 2])  # two rows ignored
    x_npu = x.detach().to("npu", torch.bfloat16).requires_grad_()
    expected, actual = reference(x, labels), head(x_npu, labels.to("npu"))
    assert_close_to_reference(actual.float(), expected, torch.bfloat16, "loss")
    expected.backward()
    actual.backward()
    assert_close_to_reference(x_npu.grad.float(), x.grad, torch.bfloat16, "input gradient", factor=2)
    for (name, want), got in zip(reference.named_parameters(), head.parameters()):
        assert_close_to_reference(got.grad.float(), want.grad, torch.bfloat16, f"{name}'s gradient", factor=2)


@pytest.mark.parametrize(("line", "reason"), [
    ("rms_norm_fn(x, w, b)", "a bias `b` added after the RMS norm: npu_rms_norm has none"),
    ("rms_norm_fn(x, w, None, x1=x2, weight1=w2)", "x1 / weight1 / bias1"),
    ("rms_norm_fn(x, w, None, dropout_p=0.1)", "dropout inside the norm"),
    ("layer_norm_fn(x, w, b, prenorm=args.prenorm)", "prenorm `args.prenorm` is not True or False"),
    ("rms_norm_fn(x, w, None, residual=r, prenorm=True, zero_centered_weight=True)", "zero_centered_weight"),
    ("rms_norm_fn(x.float(), w, None, residual=r)", "its x `x.float()` is computed in the call"),
    ("TritonRMSNorm(64, dropout_p=0.1)", "dropout_p"),
    ("CrossEntropyLoss(process_group=group)", "process_group (a vocabulary split over tensor-parallel ranks)"),
    ("CrossEntropyLoss(lse_square_scale=1e-4, return_z_loss=True)", "z-loss"),
    ("FusedDense(64, 64, return_residual=True)", "return_residual=True"),
    ("RotaryEmbedding(64)", "flash_attn's RotaryEmbedding rotates q and k (or packed qkv) with its own cos/sin cache, "
                            "XPos scaling and KV-cache offsets: no torch or torch_npu module does"),
    ("MHA(256, 4, rotary_emb_dim=32, causal=True)",
     "torch.nn.MultiheadAttention (in_proj_weight) and torch_npu.contrib.module.MultiheadAttention (fairseq's q_proj/"
     "k_proj/v_proj) take (query, key, value) and return (output, weights), so neither the model's calls nor its "
     "state dict would carry over"),
])
def test_flash_attn_layer_calls_fused_cannot_map_stay_with_the_reason(line, reason):  # with or without --fused
    source = textwrap.dedent("""\
        import torch
        from flash_attn.ops.triton.layer_norm import RMSNorm as TritonRMSNorm, layer_norm_fn, rms_norm_fn
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
        from flash_attn.ops.fused_dense import FusedDense
        from flash_attn.layers.rotary import RotaryEmbedding
        from flash_attn.modules.mha import MHA
        out = """) + line + "\n"
    for facts in (TreeFacts(), FUSED):
        outcome = migrate_python(source, "model.py", facts=facts)
        assert f"out = {line}\n" in outcome.text
        [finding] = [f for f in outcome.findings if f.line == 7]
        assert "`npu-migrate --fused` keeps it: " in finding.reason and reason in finding.reason


def test_without_fused_the_report_says_what_fused_makes_of_flash_attn_layers():
    findings = {f.line: f.reason for f in migrate_python(LAYERS, "model.py").findings if f.kind == "flash-attn"}
    made = {11: "torch.nn.RMSNorm", 13: "torch.nn.Linear", 14: "torch.nn.CrossEntropyLoss",
            21: "torch_npu.npu_rms_norm(x, weight, epsilon)[0]", 33: "torch.nn.functional.layer_norm(...)"}
    for line, rewrite in made.items():
        assert findings[line].endswith(f"`npu-migrate --fused` rewrites this call to {rewrite}")


def test_a_flash_attn_norm_class_used_other_than_by_calling_it_is_kept():
    source = textwrap.dedent("""\
        import torch
        from flash_attn.ops.triton.layer_norm import RMSNorm
        norm = RMSNorm(64)
        is_rms = isinstance(norm, RMSNorm)
        """)
    assert migrate_python(source, "model.py", facts=FUSED).text == migrate_python(source, "model.py").text
    for facts in (TreeFacts(), FUSED):  # said alike with and without --fused
        [finding] = [f for f in migrate_python(source, "model.py", facts=facts).findings if f.line == 3]
        assert "`npu-migrate --fused` keeps it: flash_attn's RMSNorm is also used here other than by calling it" \
            in finding.reason


SOURCES = {"multi_tensor.py": MULTI_TENSOR, "layers.py": LAYERS}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_second_fused_run_changes_nothing(name):
    once = migrate_python(SOURCES[name], name, facts=FUSED).text
    assert once != SOURCES[name]
    assert migrate_python(once, name, facts=FUSED).text == once


def test_libcsts_tool_gives_npu_migrate_fuseds_bytes(tmp_path):
    (tmp_path / "src").mkdir()
    for name, source in SOURCES.items():
        (tmp_path / "src" / name).write_text(source)
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          "npukit.migrate.codemods.MigrateToNpu", "--fused", "src"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr
    for name, source in SOURCES.items():
        assert (tmp_path / "src" / name).read_text() == migrate_python(source, name, facts=FUSED).text, name


def test_every_fused_rule_is_made_by_this_files_programs_or_test_fused_codemods():
    sources = [*FUSED_PROGRAMS, *SOURCES.values()]
    made = {change.rule for source in sources for change in migrate_python(source, "model.py", facts=FUSED).changes}
    assert made == {rule for codemod in FUSED_CODEMODS for rule in codemod.RULES} | {"import-torch-npu"}
    assert all(codemod.DESCRIPTION and codemod.__doc__ for codemod in FUSED_CODEMODS)


def test_the_amp_c_concern_run_alone_by_libcst_also_removes_both_imports():
    import libcst as cst
    from libcst.codemod import CodemodContext

    from npukit.migrate.codemods import ApexMultiTensorToTorch

    alone = ApexMultiTensorToTorch(CodemodContext(filename="model.py")).transform_module(cst.parse_module(MULTI_TENSOR))
    assert "import amp_C" not in alone.code and "from apex" not in alone.code
    assert alone.code == migrate_python(MULTI_TENSOR, "model.py", facts=FUSED).text.replace("import torch_npu\n", "", 1)
