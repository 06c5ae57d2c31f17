"""Compiled CUDA extension modules imported directly, and xformers' SwiGLU (#32).

TinyLlama's lit_gpt imports flash-attention's csrc extensions by their module names (`rotary_emb`,
`dropout_layer_norm`, `xentropy_cuda_lib`): npu-migrate said nothing, and the migrated code died
at import on the NPU. Its `xformers.ops.SwiGLU` MLP was told to use scaled_dot_product_attention.
"""

from __future__ import annotations

from pathlib import Path

from npukit.migrate import MigrateOptions, run_migration


def _findings(tmp_path: Path, files: dict[str, str]) -> dict[tuple[str, int], object]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    return {(f.path, f.line): f for f in run.findings}


def test_flash_attention_and_apex_extension_modules_are_reported_with_their_npu_counterpart(tmp_path: Path) -> None:
    found = _findings(tmp_path, {"ops.py": (
        "import torch\n"
        "import rotary_emb\n"
        "import dropout_layer_norm\n"
        "import xentropy_cuda_lib\n"
        "from fused_layer_norm_cuda import forward_affine\n"
        "import fused_dense_lib as fdl\n"
        "def rope(x1, x2, cos, sin, o1, o2):\n"
        "    rotary_emb.apply_rotary(x1, x2, cos, sin, o1, o2, False)\n")})
    expected = {2: "npu_rotary_mul", 3: "npu_rms_norm", 4: "cross_entropy", 5: "layer_norm", 6: "Linear"}
    for line, counterpart in expected.items():
        finding = found.get(("ops.py", line))
        assert finding is not None, f"ops.py:{line} is silent"
        assert (finding.kind, finding.severity) == ("cuda-only-library", "error")
        assert counterpart in finding.suggestion, finding.suggestion


def test_an_unknown_module_named_as_a_cuda_extension_is_reported_but_the_trees_own_is_not(tmp_path: Path) -> None:
    found = _findings(tmp_path, {
        "train.py": "import torch\nimport my_attention_cuda\nimport local_cuda_ops\nfrom cuda_kernels_v2 import f\n",
        "local_cuda_ops.py": "import torch\n"})
    reported = {line: f for (path, line), f in found.items() if path == "train.py"}
    assert sorted(reported) == [2, 4]
    assert "my_attention_cuda" in reported[2].reason and reported[2].severity == "error"


def test_xformers_swiglu_is_told_about_an_mlp_not_attention(tmp_path: Path) -> None:
    found = _findings(tmp_path, {"mlp.py": (
        "import torch\n"
        "from xformers.ops import SwiGLU\n"
        "class MLP(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.swiglu = SwiGLU(64, 128, bias=False, _pack_weights=False)\n")})
    for line in (2, 6):
        finding = found[("mlp.py", line)]
        assert "scaled_dot_product_attention" not in finding.suggestion
        assert "npu_swiglu" in finding.suggestion and "silu" in finding.suggestion
