"""Bugs 8, 12 and 14 of docs/real-repos.md (round 3, issue #32), as minimal reproductions: a device
string passed to a parameter whose default npu-migrate rewrote, bitsandbytes quantisation requested
through from_pretrained keywords, and a file valid only on Python >= 3.12."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from npukit.migrate import MigrateOptions, run_migration
from npukit.migrate.pysource import migrate_python
from npukit.migrate.report import effort

NPU = "import torch_npu\n"


def _migrated(root: Path) -> dict[str, str]:
    out = root.parent / "out"
    run_migration(MigrateOptions(target=root, out=out))
    return {p.name: p.read_text() for p in out.rglob("*.py")}


# ------------------------------------------------------------------------------ bug 8
@pytest.mark.parametrize("source, expected", [
    # a class whose __init__ takes the device (lingua's GPUMemoryMonitor("cuda"))
    ('import torch\nclass Monitor:\n    def __init__(self, device: str = "cuda:0"):\n'
     '        self.device = torch.device(device)\nmon = Monitor("cuda")\n',
     NPU + 'import torch\nclass Monitor:\n    def __init__(self, device: str = "npu:0"):\n'
     '        self.device = torch.device(device)\nmon = Monitor("npu")\n'),
    # a parameter not named like a device whose default is one
    ('import torch\ndef place(where="cuda:0"):\n    return torch.device(where)\nplace("cuda")\n',
     NPU + 'import torch\ndef place(where="npu:0"):\n    return torch.device(where)\nplace("npu")\n'),
    # a method of the file's own class
    ('import torch\nclass M:\n    def start(self, device="cuda:0"):\n        return torch.device(device)\n'
     'M().start("cuda")\n',
     NPU + 'import torch\nclass M:\n    def start(self, device="npu:0"):\n        return torch.device(device)\n'
     'M().start("npu")\n'),
    # torch.cuda's functions that take a device, given a literal or a variable holding one
    ('import torch\nn = torch.cuda.get_device_name("cuda")\nwhich = "cuda"\n'
     'm = torch.cuda.memory_allocated(which)\n',
     NPU + 'import torch\nn = torch.npu.get_device_name("npu")\nwhich = "npu"\n'
     'm = torch.npu.memory_allocated(which)\n'),
])
def test_a_cuda_string_given_to_a_device_parameter_is_rewritten(source: str, expected: str) -> None:
    outcome = migrate_python(source, "m.py")
    assert outcome.text == expected
    assert not [f for f in outcome.findings if f.kind == "device-string"]


def test_a_cuda_string_given_to_another_files_device_parameter_is_rewritten(tmp_path: Path) -> None:
    """lingua: metrics.py's GPUMemoryMonitor(device="cuda:0") became "npu:0"; train.py's
    GPUMemoryMonitor("cuda") stayed and was only info."""
    root = tmp_path / "repo"
    (root / "lingua").mkdir(parents=True)
    (root / "lingua" / "__init__.py").write_text("")
    (root / "lingua" / "metrics.py").write_text(
        'import torch\nclass GPUMemoryMonitor:\n    def __init__(self, device: str = "cuda:0"):\n'
        '        self.device = torch.device(device)\n        self.name = torch.cuda.get_device_name(self.device)\n')
    (root / "train.py").write_text('import torch\nfrom lingua.metrics import GPUMemoryMonitor\n'
                                   'monitor = GPUMemoryMonitor("cuda")\nx = torch.zeros(1).cuda()\n')
    assert 'monitor = GPUMemoryMonitor("npu")\n' in _migrated(root)["train.py"]


def test_a_cuda_string_passed_where_npu_migrate_cannot_see_is_a_warning_in_the_estimate(tmp_path: Path) -> None:
    """A "cuda" argument to a function npu-migrate cannot read is left, but as a warning that the
    estimate counts (it was an info: 0 items, 0 min)."""
    (tmp_path / "m.py").write_text('import torch\nimport somelib\nsomelib.monitor("cuda")\n')
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    found = [(f.line, f.kind, f.severity) for f in run.findings]
    assert found == [(3, "device-string", "warning")]
    assert effort(run)["items_needing_a_human"] == 1


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


# ------------------------------------------------------------------------------ bug 14
PEP_701 = 'import torch\nd = "x"\nprint(f"{str(d + "y")}")\nx = torch.zeros(1).cuda()\n'


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the running Python parses PEP 701 f-strings itself")
def test_a_python_3_12_file_is_migrated_with_a_newer_grammar() -> None:
    with pytest.raises(SyntaxError):
        ast.parse(PEP_701)  # the running Python cannot read it
    outcome = migrate_python(PEP_701, "m.py")
    assert outcome.text == NPU + 'import torch\nd = "x"\nprint(f"{str(d + "y")}")\nx = torch.zeros(1).npu()\n'
    assert "unparsable" not in {f.kind for f in outcome.findings}


def test_a_cuda_use_inside_a_pep_701_f_string_is_rewritten() -> None:
    source = 'import torch\nprint(f"{torch.cuda.device_count()} {"devices"}")\n'
    assert migrate_python(source, "m.py").text == \
        NPU + 'import torch\nprint(f"{torch.npu.device_count()} {"devices"}")\n'


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the running Python parses PEP 701 f-strings itself")
def test_a_device_in_a_pep_701_f_string_is_rewritten_or_reported() -> None:
    """An f-string naming a device with its own quotes inside is still a device string; one whose
    text cannot be read at all (both quotes inside) is reported, never passed over."""
    source = ('import torch\ncfg = {}\nx = torch.zeros(1).to(f"cuda:{cfg["rank"]}")\n'
              'y = torch.zeros(1).to(f"cuda:{\'\'.join(["1"])}")\n')
    outcome = migrate_python(source, "m.py")
    assert outcome.text.splitlines()[3] == 'x = torch.zeros(1).to(f"npu:{cfg["rank"]}")'
    assert [(f.line, f.kind) for f in outcome.findings] == [(4, "cuda-unparsed")]


def test_a_file_no_grammar_reads_lists_each_cuda_use(tmp_path: Path) -> None:
    """Not Python at all for any parser: one finding per CUDA use at its line, each needing a human,
    not one anonymous 'does not parse' warning."""
    (tmp_path / "m.py").write_text('import torch\nx = torch.zeros(1).cuda(\n'
                                   'torch.cuda.synchronize()  # cuda in a comment\n'
                                   'dev = "cuda:0" if ok else "cpu"\nprint("runs on cuda")\n')
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    found = sorted((f.line, f.kind, f.severity) for f in run.findings)
    assert found == [(1, "unparsable", "warning"), (2, "cuda-unparsed", "warning"), (3, "cuda-unparsed", "warning"),
                     (4, "cuda-unparsed", "warning")]
    assert effort(run)["items_needing_a_human"] == 4
