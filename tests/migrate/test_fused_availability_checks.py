"""A check that flash-attn is installed, guarding the call `npu-migrate --fused` rewrote (#33).

TinyLlama guards its flash_attn_func call with `RequirementCache("flash-attn>=2.0.0.post1")`: --fused
rewrote the call to torch_npu.npu_fusion_attention, but on an NPU host flash-attn is not installed, so
the rewritten branch never ran and nothing said so.
"""

from __future__ import annotations

from pathlib import Path

from npukit.migrate import MigrateOptions, run_migration

GUARDED = (
    "import importlib.util\n"
    "import torch\n"
    "from lightning_utilities.core.imports import RequirementCache\n"
    "from flash_attn import flash_attn_func\n"
    "FlashAttention2Available = RequirementCache('flash-attn>=2.0.0.post1')\n"
    "HAS_FLASH = importlib.util.find_spec('flash_attn') is not None\n"
    "def attention(q, k, v):\n"
    "    if FlashAttention2Available and HAS_FLASH and q.dtype == torch.bfloat16:\n"
    "        return flash_attn_func(q, k, v, dropout_p=0.0, causal=True)\n"
    "    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),\n"
    "                                                            v.transpose(1, 2), is_causal=True)\n")


def _checks(tmp_path: Path, text: str, fused: bool) -> list:
    (tmp_path / "attn.py").write_text(text)
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True, fused=fused))
    return [(f.line, f.severity) for f in run.findings if f.kind == "fused-unreachable"]


def test_a_flash_attn_install_check_guarding_a_rewritten_call_is_reported_and_only_then(tmp_path: Path) -> None:
    for name in ("fused", "plain", "kept"):
        (tmp_path / name).mkdir()
    assert _checks(tmp_path / "fused", GUARDED, fused=True) == [(5, "warning"), (6, "warning")]
    # without --fused the guarded call is flash-attn's own (reported as such); a call --fused keeps too
    assert _checks(tmp_path / "plain", GUARDED, fused=False) == []
    kept = GUARDED.replace("flash_attn_func(q, k, v, dropout_p=0.0, causal=True)", "flash_attn_func(*qkv)")
    assert _checks(tmp_path / "kept", kept, fused=True) == []
