"""Python rewrite rules beyond the reference cases: (input, expected) pairs, unchanged inputs included."""

from __future__ import annotations

import pytest

from npukit.migrate import rules
from npukit.migrate.pysource import MigrationSyntaxError, migrate_python, remap_findings

NPU = "import torch_npu\n"

REWRITES = [
    ("attribute-device-flows",
     'import torch\nclass T:\n    def __init__(self):\n        self.device = "cuda"\n    def go(self, x):\n        return x.to(self.device)\n',
     NPU + 'import torch\nclass T:\n    def __init__(self):\n        self.device = "npu"\n    def go(self, x):\n        return x.to(self.device)\n'),
    ("param-default-device",
     'import torch\ndef run(model, device="cuda"):\n    return model.to(device)\n',
     NPU + 'import torch\ndef run(model, device="npu"):\n    return model.to(device)\n'),
    ("bool-op-default",
     'import torch\nx = t.to(args.device or "cuda")\n',
     NPU + 'import torch\nx = t.to(args.device or "npu")\n'),
    ("dict-config-device-and-backend",
     'import torch\ncfg = {"device": "cuda:0", "dist_backend": "nccl", "cuda": True}\n',
     NPU + 'import torch\ncfg = {"device": "npu:0", "dist_backend": "hccl", "cuda": True}\n'),
    ("single-quotes-and-prefixes-kept",
     "import torch\na = torch.device('cuda')\nb = torch.device(r'cuda:1')\nc = torch.device(u'cuda')\n",
     NPU + "import torch\na = torch.device('npu')\nb = torch.device(r'npu:1')\nc = torch.device(u'npu')\n"),
    ("from-torch-cuda-import-names",
     'from torch.cuda import synchronize, CUDAGraph, device_count as n\nsynchronize()\n',
     NPU + 'from torch_npu.npu import synchronize, NPUGraph as CUDAGraph, device_count as n\nsynchronize()\n'),
    ("from-torch-import-split",
     'from torch import nn, cuda\ncuda.synchronize()\n',
     NPU + 'from torch import nn\nfrom torch_npu import npu as cuda\ncuda.synchronize()\n'),
    ("nvtx-module-alias",
     'from torch.cuda import nvtx\nnvtx.range_push("a")\nwith nvtx.range("b"):\n    pass\n',
     NPU + 'from torch_npu.npu import mstx as nvtx\nnvtx.range_push("a")\nwith nvtx.mstx_range("b"):\n    pass\n'),
    ("custom-fwd-imported-name",
     'from torch.cuda.amp import custom_fwd\n@custom_fwd\ndef f(x):\n    return x\n',
     NPU + 'from torch.amp import custom_fwd\n@custom_fwd(device_type="npu")\ndef f(x):\n    return x\n'),
    ("out-of-memory-error-no-torch-npu-needed",
     'import torch\ntry:\n    pass\nexcept torch.cuda.OutOfMemoryError:\n    pass\n',
     'import torch\ntry:\n    pass\nexcept torch.OutOfMemoryError:\n    pass\n'),
    ("autocast-set-gpu-dtype",
     'import torch\ntorch.set_autocast_gpu_dtype(torch.bfloat16)\n',
     NPU + 'import torch\ntorch.set_autocast_dtype("npu", torch.bfloat16)\n'),
    ("backend-enum",
     'import torch.distributed as dist\nif dist.get_backend() == dist.Backend.NCCL:\n    pass\n',
     NPU + 'import torch.distributed as dist\nif dist.get_backend() == dist.Backend.HCCL:\n    pass\n'),
    ("torch-load-whole-model-goes-to-npu",
     'import torch\nwith open(path, "rb") as f:\n    model = torch.load(f)\nnet.load_state_dict(torch.load(p))\n',
     NPU + 'import torch\nwith open(path, "rb") as f:\n    model = torch.load(f, map_location="npu")\n'
     'net.load_state_dict(torch.load(p, map_location="cpu"))\n'),
    ("cuda-defaulting-grad-scaler-gets-the-npu",
     'import torch\nscaler = torch.amp.GradScaler(enabled=use_fp16)\n',
     NPU + 'import torch\nscaler = torch.amp.GradScaler("npu", enabled=use_fp16)\n'),
    ("torch-load-trailing-comma-multiline",
     'import torch\nsd = torch.load(\n    path,\n    weights_only=True,\n)\nnet.load_state_dict(sd)\n',
     'import torch\nsd = torch.load(\n    path,\n    weights_only=True, map_location="cpu",\n)\nnet.load_state_dict(sd)\n'),
    ("crlf-line-endings-kept",
     'import torch\r\nx = t.cuda()\r\n',
     'import torch_npu\r\nimport torch\r\nx = t.npu()\r\n'),
    ("non-ascii-columns",
     'import torch\nnom = "données"; x = torch.zeros(1, device="cuda")\n',
     NPU + 'import torch\nnom = "données"; x = torch.zeros(1, device="npu")\n'),
    ("shebang-and-coding-stay-first",
     '#!/usr/bin/env python\n# -*- coding: utf-8 -*-\nimport torch\nx = t.cuda()\n',
     '#!/usr/bin/env python\n# -*- coding: utf-8 -*-\nimport torch_npu\nimport torch\nx = t.npu()\n'),
    ("cuda-method-on-imported-object",
     'import torch\nfrom mymodule import model\nmodel.cuda()\n',
     NPU + 'import torch\nfrom mymodule import model\nmodel.npu()\n'),
    ("tensor-class-method-reference",
     'import torch\nmove = torch.Tensor.cuda\n',
     NPU + 'import torch\nmove = torch.Tensor.npu\n'),
    ("device-keyword-family",
     'import torch\np = profile(use_device="cuda")\nm = load(name, device_map="cuda", offload_device="cuda:1")\n',
     NPU + 'import torch\np = profile(use_device="npu")\nm = load(name, device_map="npu", offload_device="npu:1")\n'),
    ("fstring-embedded-expressions",
     'import torch\nprint(f"{{x}} é {y.cuda()} {torch.cuda.device_count()!r} {t.to(\'cuda\')}")\n',
     NPU + 'import torch\nprint(f"{{x}} é {y.npu()} {torch.npu.device_count()!r} {t.to(\'npu\')}")\n'),
    ("multiline-import-keeps-comments",
     'from torch.cuda import (\n    synchronize,  # sync\n    CUDAGraph,\n)\nsynchronize()\n',
     NPU + 'from torch_npu.npu import (\n    synchronize,  # sync\n    NPUGraph as CUDAGraph,\n)\nsynchronize()\n'),
    ("availability-choice-anywhere",
     'import torch\ndef get_device():\n    return "cuda" if torch.cuda.is_available() else "cpu"\n',
     NPU + 'import torch\ndef get_device():\n    return "npu" if torch.npu.is_available() else "cpu"\n'),
    ("own-function-device-parameter",
     'import torch\ndef train(model, device):\n    model.to(device)\ntrain(net, "cuda")\nlog(net, "cuda")\n',
     NPU + 'import torch\ndef train(model, device):\n    model.to(device)\ntrain(net, "npu")\nlog(net, "cuda")\n'),
    ("profiler-activity",
     'from torch.profiler import ProfilerActivity\nacts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]\n',
     NPU + 'from torch.profiler import ProfilerActivity\nacts = [ProfilerActivity.CPU, ProfilerActivity.NPU]\n'),
]

UNCHANGED = [
    ("no-torch-at-all", 'import os\nprint(os.getcwd())\n'),
    ("log-strings", 'import logging\nlogging.warning("cuda:0 is busy")\nprint(f"moved to cuda:{rank}")\n'),
    ("numba-cuda-is-not-torch", 'from numba import cuda\narr = cuda.to_device(x)\n'),
    ("numba-module-attribute", 'import numba\nkernel = numba.cuda.jit(f)\n'),
    ("user-variable-named-cuda", 'import torch\ncuda = torch.zeros(1)\nprint(cuda.sum())\n'),
    ("cuda-word-in-identifiers", 'import torch\nuse_cuda = False\ndef cuda_kernel_name():\n    return "k"\n'),
    ("config-flag-attribute", 'import torch\nif args.cuda:\n    pass\nuse = opt.cuda and flag\n'),
    ("to-dtype-and-device-objects", 'import torch\ny = x.to(torch.float16)\nz = x.to(other.device)\n'),
    ("already-migrated", 'import torch\nimport torch_npu\nx = torch.zeros(1).npu()\ntorch.npu.synchronize()\n'),
    ("comments-only", '# torch.cuda.synchronize()\n# x.cuda()\n'),
    ("empty-file", ''),
    ("mixed-import-with-comment-is-flagged-not-split",
     'from torch import (nn,  # layers\n    cuda)\n'),
    ("cuda-attribute-that-is-a-flag",
     'class T:\n    def __init__(self, use):\n        self.cuda = use\n    def f(self):\n        enabled = self.cuda\n        return enabled\n'),
    ("dual-target-conditional-expression",
     'import torch\nd = "cuda" if torch.cuda.is_available() else "npu" if torch.npu.is_available() else "cpu"\n'),
    ("help-text", 'p.add_argument("--device", default="cpu", help="cuda or cpu")\n'),
]


@pytest.mark.parametrize(("case_id", "source", "expected"), REWRITES, ids=[c[0] for c in REWRITES])
def test_rewrite(case_id: str, source: str, expected: str) -> None:
    assert migrate_python(source, "m.py").text == expected


@pytest.mark.parametrize(("case_id", "source"), UNCHANGED, ids=[c[0] for c in UNCHANGED])
def test_unchanged(case_id: str, source: str) -> None:
    outcome = migrate_python(source, "m.py")
    assert outcome.text == source
    assert outcome.changes == []


@pytest.mark.parametrize(("case_id", "source", "expected"), REWRITES, ids=[c[0] for c in REWRITES])
def test_rewrite_is_idempotent(case_id: str, source: str, expected: str) -> None:
    assert migrate_python(expected, "m.py").text == expected


def test_change_records_name_rule_and_text() -> None:
    outcome = migrate_python('import torch\nx = t.cuda()\n', "m.py")
    by_rule = {c.rule: c for c in outcome.changes}
    assert by_rule["cuda-method"].before == "cuda"
    assert by_rule["cuda-method"].after == "npu"
    assert by_rule["cuda-method"].line == 2
    assert by_rule["import-torch-npu"].after == "import torch_npu"


def test_findings_carry_location_code_reason_and_suggestion() -> None:
    source = 'import torch\n\nif torch.cuda.get_device_capability()[0] >= 8:\n    pass\n'
    (finding,) = [f for f in migrate_python(source, "m.py").findings if f.kind == "device-capability"]
    assert (finding.path, finding.line, finding.col) == ("m.py", 3, 4)
    assert finding.code == "if torch.cuda.get_device_capability()[0] >= 8:"
    assert finding.severity == "error"
    assert "None" in finding.reason and "is_bf16_supported" in finding.suggestion


INFINITE_FILLS = [
    'scores.masked_fill(mask, float("-inf"))',
    "scores.masked_fill_(mask, -float('inf'))",
    "x.fill_(-math.inf)",
    "torch.full((4, 4), -torch.inf)",
    "torch.full_like(x, fill_value=np.inf)",
    "x.new_full((2,), float('-Infinity'))",
]


@pytest.mark.parametrize("call", INFINITE_FILLS)
def test_an_infinite_fill_is_reported_for_saturation_mode_devices(call: str) -> None:
    source = f"import math\nimport numpy as np\nimport torch\ny = {call}\n"
    assert rules.worth_parsing(source)  # a file with no CUDA in it is still looked at
    outcome = migrate_python(source, "attention.py")
    (finding,) = [f for f in outcome.findings if f.kind == "inf-fill"]
    assert finding.line == 4 and finding.severity == "info"
    assert "910A" in finding.reason and "torch.finfo" in finding.suggestion
    assert outcome.text == source  # reported, not rewritten: fine as it is on 910B


@pytest.mark.parametrize("call", [
    "scores.masked_fill(mask, torch.finfo(scores.dtype).min)",
    "scores.masked_fill(mask, -1e4)",
    "x.fill_(float('nan'))",
    "torch.clamp(x, min=-math.inf)",  # not a fill
])
def test_finite_fills_and_other_calls_with_inf_are_not_reported(call: str) -> None:
    source = f"import math\nimport torch\ny = {call}\n"
    assert not [f for f in migrate_python(source, "m.py").findings if f.kind == "inf-fill"]


def test_findings_can_be_moved_to_rewritten_lines() -> None:
    source = 'import torch\nx = t.cuda()\nif torch.version.cuda:\n    pass\n'
    outcome = migrate_python(source, "m.py")
    (gate,) = [f for f in outcome.findings if f.kind == "version-gate"]
    assert gate.line == 3
    (moved,) = [f for f in remap_findings(outcome.findings, source, outcome.edits) if f.kind == "version-gate"]
    assert outcome.text.splitlines()[moved.line - 1] == "if torch.version.cuda:"


@pytest.mark.parametrize("source", [
    "print 'python 2'\n",
    "def f(:\n    pass\n",
    "x = 1\x00\n",
])
def test_unparsable_source_raises_a_clear_error(source: str) -> None:
    with pytest.raises(MigrationSyntaxError, match="does not parse as Python 3"):
        migrate_python(source, "bad.py")


def test_runtime_mode_inserts_transfer_to_npu_at_entry_points_only() -> None:
    entry = 'import torch\nx = torch.zeros(1).cuda()\nif __name__ == "__main__":\n    pass\n'
    outcome = migrate_python(entry, "main.py", runtime=True)
    assert outcome.text == NPU + "from torch_npu.contrib import transfer_to_npu\n" + entry
    library = 'import torch\nx = torch.zeros(1).cuda()\n'
    assert migrate_python(library, "lib.py", runtime=True).text == library
    # what transfer_to_npu does not cover is reported instead
    uncovered = 'import os\nimport torch\nos.environ["CUDA_VISIBLE_DEVICES"] = "0"\nif __name__ == "__main__":\n    pass\n'
    kinds = {f.kind for f in migrate_python(uncovered, "main.py", runtime=True).findings}
    assert "not-covered-by-transfer_to_npu" in kinds
    once = migrate_python(entry, "main.py", runtime=True).text
    assert migrate_python(once, "main.py", runtime=True).text == once


def test_prefilter_never_skips_a_source_that_has_something_to_report() -> None:
    from npukit.migrate.rules import worth_parsing
    from tests.migrate.test_tricky_cases import CASES

    sources = [c[1] for c in CASES] + [c[1] for c in REWRITES] + [
        "from torch.nn import GRU\nrnn = GRU(4, 4)\n",
        "import torch\nq = torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)\n",
        "from torch import export\nexport.save(ep, 'f')\n",
        "import torch\nsd = torch.load('x.pt')\n",
    ]
    for source in sources:
        outcome = migrate_python(source, "m.py")
        if outcome.changes or outcome.findings:
            assert worth_parsing(source), source
    assert not worth_parsing("import os\nprint(os.getcwd())\n")


def test_prefilter_covers_every_rule_table_entry() -> None:
    """Each flagged/renamed/unsupported API, written the usual way, gets past the pre-filter."""
    from npukit.migrate import rules

    names = set(rules.CUDA_FLAGGED) | set(rules.CUDA_RENAMED) | set(rules.UNSUPPORTED_TORCH_APIS)
    for name in sorted(n for n in names if "." in n and not rules._is_class_member(n) and ".Tensor." not in n):
        module, _, member = name.rpartition(".")
        assert rules.worth_parsing(f"from {module} import {member}\n{member}()\n"), name
        assert rules.worth_parsing(f"import torch\n{name}()\n"), name


def test_every_rewrite_rule_has_before_after_cases_and_no_rule_is_unnamed() -> None:
    from npukit.migrate import rules
    from npukit.migrate.codemods import FUSED_CODEMODS
    from tests.migrate.test_tricky_cases import CASES

    emitted = {change.rule for case in [*CASES, *REWRITES] for change in migrate_python(case[1], "m.py").changes}
    assert emitted <= set(rules.REWRITE_RULES)
    fused = {rule for codemod in FUSED_CODEMODS for rule in codemod.RULES}  # --fused's: test_fused_codemods.py
    assert set(rules.REWRITE_RULES) - emitted == {"runtime-transfer-to-npu", *fused}  # tested in the runtime test
