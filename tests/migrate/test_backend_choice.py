"""A process-group backend chosen by a conditional expression (docs/real-repos.md bug 5).

improved-diffusion's `backend = "gloo" if not th.cuda.is_available() else "nccl"` had its test
migrated to `th.npu.is_available()` while "nccl" was kept, so the migrated code picked NCCL exactly
on NPU hosts. A "nccl" branch of a conditional now follows the same rules as a plain "nccl": it is
rewritten when the value is a backend (a backend sink, a variable named or flowing like one, a
backend key); otherwise, when a CUDA availability test chooses it, it is a warning.
"""

from __future__ import annotations

import pytest

from npukit.migrate.pysource import migrate_python

NPU = "import torch_npu\n"
HEAD = "import torch as th\nimport torch.distributed as dist\n"

# (id, input, expected output)
REWRITES = [
    ("improved-diffusion-dist-util",
     HEAD + 'def setup_dist():\n    backend = "gloo" if not th.cuda.is_available() else "nccl"\n'
            '    dist.init_process_group(backend=backend)\n',
     NPU + HEAD + 'def setup_dist():\n    backend = "gloo" if not th.npu.is_available() else "hccl"\n'
                  '    dist.init_process_group(backend=backend)\n'),
    ("variable-named-backend-not-seen-in-a-sink",
     HEAD + 'backend = "nccl" if th.cuda.is_available() else "gloo"\n',
     NPU + HEAD + 'backend = "hccl" if th.npu.is_available() else "gloo"\n'),
    ("other-name-flowing-into-init-process-group",
     HEAD + 'pg = "nccl" if th.cuda.is_available() else "gloo"\ndist.init_process_group(pg)\n',
     NPU + HEAD + 'pg = "hccl" if th.npu.is_available() else "gloo"\ndist.init_process_group(pg)\n'),
    ("conditional-directly-in-the-sink",
     HEAD + 'dist.init_process_group(backend="nccl" if th.cuda.is_available() else "gloo")\n',
     NPU + HEAD + 'dist.init_process_group(backend="hccl" if th.npu.is_available() else "gloo")\n'),
    ("conditional-first-positional-argument",
     HEAD + 'dist.init_process_group("gloo" if args.cpu else "nccl", rank=0)\n',
     NPU + HEAD + 'dist.init_process_group("gloo" if args.cpu else "hccl", rank=0)\n'),
    ("nested-conditional",
     HEAD + 'backend = "gloo" if args.cpu else ("nccl" if th.cuda.is_available() else "mpi")\n',
     NPU + HEAD + 'backend = "gloo" if args.cpu else ("hccl" if th.npu.is_available() else "mpi")\n'),
    ("self-attribute-named-backend",
     HEAD + 'class T:\n    def __init__(self):\n        self.backend = "gloo" if args.cpu else "nccl"\n',
     NPU + HEAD + 'class T:\n    def __init__(self):\n        self.backend = "gloo" if args.cpu else "hccl"\n'),
    ("dict-backend-key",
     HEAD + 'cfg = {"dist_backend": "gloo" if args.cpu else "nccl"}\n',
     NPU + HEAD + 'cfg = {"dist_backend": "gloo" if args.cpu else "hccl"}\n'),
    ("dict-call-backend-keyword",
     HEAD + 'cfg = dict(backend="gloo" if args.cpu else "nccl")\n',
     NPU + HEAD + 'cfg = dict(backend="gloo" if args.cpu else "hccl")\n'),
    ("compound-backend-string-in-a-branch",
     HEAD + 'backend = "cuda:nccl,cpu:gloo" if th.cuda.is_available() else "gloo"\n',
     NPU + HEAD + 'backend = "npu:hccl,cpu:gloo" if th.npu.is_available() else "gloo"\n'),
]


@pytest.mark.parametrize(("case_id", "source", "expected"), REWRITES, ids=[c[0] for c in REWRITES])
def test_backend_branch_is_rewritten(case_id: str, source: str, expected: str) -> None:
    outcome = migrate_python(source, "dist_util.py")
    assert outcome.text == expected
    assert not [f for f in outcome.findings if f.kind in ("backend-string", "backend-choice")]
    assert migrate_python(expected, "dist_util.py").text == expected  # a second run changes nothing


# (id, input, expected output, (severity, kind, line) of the "nccl" literal)
FLAGGED = [
    ("availability-choice-not-seen-as-a-backend-is-a-warning",
     HEAD + 'name = "gloo" if not th.cuda.is_available() else "nccl"\nprint(name)\n',
     NPU + HEAD + 'name = "gloo" if not th.npu.is_available() else "nccl"\nprint(name)\n',
     ("warning", "backend-choice", 3)),
    ("nested-availability-choice-is-a-warning",
     HEAD + 'name = ("nccl" if args.fast else "gloo") if th.cuda.is_available() else "gloo"\n',
     NPU + HEAD + 'name = ("nccl" if args.fast else "gloo") if th.npu.is_available() else "gloo"\n',
     ("warning", "backend-choice", 3)),
    ("choice-by-another-test-stays-info",
     HEAD + 'name = "gloo" if args.cpu else "nccl"\nprint(name)\n',
     HEAD + 'name = "gloo" if args.cpu else "nccl"\nprint(name)\n',
     ("info", "backend-string", 3)),
    ("plain-string-stays-info",
     HEAD + 'store("nccl")\n',
     HEAD + 'store("nccl")\n',
     ("info", "backend-string", 3)),
]


@pytest.mark.parametrize(("case_id", "source", "expected", "flag"), FLAGGED, ids=[c[0] for c in FLAGGED])
def test_unproven_backend_branch_is_flagged(case_id: str, source: str, expected: str, flag: tuple) -> None:
    outcome = migrate_python(source, "dist_util.py")
    assert outcome.text == expected
    flagged = [(f.severity, f.kind, f.line) for f in outcome.findings if f.kind in ("backend-string", "backend-choice")]
    assert flagged == [flag]


def test_backend_choice_warning_counts_in_the_effort_estimate() -> None:
    outcome = migrate_python(FLAGGED[0][1], "dist_util.py")
    finding = next(f for f in outcome.findings if f.kind == "backend-choice")
    assert finding.severity == "warning" and "hccl" in finding.suggestion and finding.col == 50
