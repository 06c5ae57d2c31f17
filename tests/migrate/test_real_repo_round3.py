"""Bugs 8, 12 and 14 of docs/real-repos.md (round 3, issue #32), as minimal reproductions: a device
string passed to a parameter whose default npu-migrate rewrote, bitsandbytes quantisation requested
through from_pretrained keywords, and a file valid only on Python >= 3.12."""

from __future__ import annotations

from pathlib import Path

import pytest

from npukit.migrate import MigrateOptions, run_migration
from npukit.migrate.pysource import migrate_python


# ------------------------------------------------------------------------------ bug 12
@pytest.mark.parametrize("source, lines", [
    # basaran's model.py: keywords into a dict, under a CUDA guard npu-migrate rewrites
    ('import torch\nfrom transformers import AutoModelForCausalLM\nkw = {}\nif torch.cuda.is_available():\n'
     '    kw["device_map"] = "auto"\n    kw["load_in_8bit"] = True\n'
     'm = AutoModelForCausalLM.from_pretrained("x", **kw)\n', [6]),
    # keyword arguments of the call, and a dict literal
    ('from transformers import AutoModelForCausalLM\n'
     'm = AutoModelForCausalLM.from_pretrained("x", load_in_4bit=True, device_map="auto")\n'
     'opts = {"load_in_8bit": True}\n', [2, 3]),
    # a BitsAndBytesConfig: one finding for the call, not one per bnb_4bit_* keyword
    ('import torch\nfrom transformers import AutoModelForCausalLM, BitsAndBytesConfig\n'
     'q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)\n'
     'm = AutoModelForCausalLM.from_pretrained("x", quantization_config=q)\n', [3]),
])
def test_bitsandbytes_quantisation_requested_through_keywords_is_reported(source: str, lines: list[int]) -> None:
    findings = [f for f in migrate_python(source, "load.py").findings if f.kind == "bitsandbytes"]
    assert [f.line for f in findings] == lines
    assert all(f.severity == "error" and "bf16" in f.suggestion for f in findings)


def test_quantisation_turned_off_is_not_reported() -> None:
    source = 'from transformers import AutoModel\nm = AutoModel.from_pretrained("x", load_in_8bit=False)\n'
    assert not [f for f in migrate_python(source, "load.py").findings if f.kind == "bitsandbytes"]


def test_a_file_whose_only_hint_is_load_in_8bit_is_read(tmp_path: Path) -> None:
    (tmp_path / "load.py").write_text('from transformers import AutoModel\n'
                                      'm = AutoModel.from_pretrained("x", load_in_8bit=True)\n')
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    assert [(f.line, f.kind) for f in run.findings] == [(2, "bitsandbytes")]
