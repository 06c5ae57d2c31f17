"""The audit as a libcst codemod (CudaLeftovers): on its own (libcst's CodemodTest and its tool) and
inside npu-migrate, after every other rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest
from libcst.codemod import CodemodContext, CodemodTest

from npukit.migrate.codemods import BUILTIN_CODEMODS, CudaLeftovers
from npukit.migrate.codemods.base import run_builtin_codemods
from npukit.migrate.codemods.leftovers import AUDIT_KEY, cuda_uses
from npukit.migrate.pysource import PythonMigrator, migrate_python

REPO = Path(__file__).resolve().parents[2]
_STILL = "is still CUDA after the migration and no rule handled it"
_SUGGESTION = ("(if it is a device use, change it to the NPU spelling (.npu(), 'npu', torch.npu.X, 'hccl'); "
               "if it must stay CUDA, make sure it is never reached on an NPU host)")


def _leftover(line: int, col: int, what: str) -> str:
    return f"{line}:{col}: warning cuda-leftover: {what} {_STILL} {_SUGGESTION}"


class CudaLeftoversCase(CodemodTest):
    TRANSFORM = CudaLeftovers

    def runTest(self):  # noqa: N802 (unittest's name)
        # alone, nothing is rewritten: every CUDA use is reported, one per line, the code unchanged
        code = ('import torch\nimport flash_attn\nx = y.cuda()\nif t.is_cuda: d = "cuda:0"\n'
                'torch.backends.cudnn.benchmark = True\ns = torch.amp.GradScaler()\ne = f"cuda:{rank}"\n'
                'os.environ["NCCL_DEBUG"] = "INFO"\n')
        self.assertCodemod(code, code, expected_warnings=[
            _leftover(2, 1, "the CUDA-only import of flash_attn"),
            _leftover(3, 5, "`y.cuda()`"),
            _leftover(4, 4, "`t.is_cuda`"),
            _leftover(5, 1, "`torch.backends.cudnn.benchmark`"),
            _leftover(6, 5, "`torch.amp.GradScaler(...)` without a device (it defaults to CUDA)"),
            _leftover(7, 5, 'the string f"cuda:{rank}"'),
            _leftover(8, 12, 'the string "NCCL_DEBUG"'),
        ])
        unchanged = [
            '"""Runs on cuda:0."""\nimport torch\n',  # a docstring
            'print("cuda")\nlogger.info(f"cuda:{rank}")\nraise ValueError("nccl")\n',  # messages
            'p.add_argument("--gpu", help="cuda")\nassert ok, "cuda"\n',
            'use_cuda = args.cuda\nx.is_cuda = True\n',  # a user's flag, an attribute assigned
            'import torch\ntorch.amp.GradScaler("npu")\ns = torch.amp.GradScaler(*a)\nx = b"cuda"\n',
        ]
        for code in unchanged:
            self.assertCodemod(code, code, expected_warnings=[])
        # numba.cuda is the CUDA-only import's (not a `.cuda` method); a name split over literals is one string
        code = 'import numba.cuda\nx = numba.cuda.jit\ny = "CUDA_VISIBLE" "_DEVICES"\n'
        self.assertCodemod(code, code, expected_warnings=[
            _leftover(1, 1, "the CUDA-only import of numba.cuda"),
            _leftover(3, 5, 'the string "CUDA_VISIBLE" "_DEVICES"')])


def test_cuda_leftovers_as_a_libcst_codemod_test():
    CudaLeftoversCase().runTest()


def test_a_condition_with_a_cuda_call_left_as_cuda_is_kept_whole_and_reported():
    """The mixed condition: the availability test has an NPU answer, the capability test none."""
    code = ("import torch\nif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:\n"
            "    pass\nok = (torch.cuda.is_available() and\n      torch.cuda.get_device_capability()[0] >= 8)\n"
            "x = torch.cuda.get_device_capability() if torch.cuda.is_available() else None\n")
    outcome = migrate_python(code, "train.py")
    # both conditions as they were, and the conditional expression too: its rewritten test would let
    # the capability call it guards run (and crash) on every NPU host
    assert outcome.text == code
    assert [(f.line, f.col, f.kind, f.end_line) for f in outcome.findings if f.kind in ("mixed-condition", "mixed-guard")] == [
        (2, 4, "mixed-condition", None), (4, 7, "mixed-condition", 5), (6, 5, "mixed-guard", None)]
    assert not [f for f in outcome.findings if f.kind == "cuda-leftover"]


def test_the_audit_sees_every_rules_edits_and_findings():
    """Inside npu-migrate a use an edit touched (of either engine) is gone; a line a finding names is
    reported; what is left gets one cuda-leftover per line, at the use the ast engine listed first."""
    code = ('import torch\nimport helpers\nx = torch.randn(2).cuda()\ndevice = torch.device("cuda")\n'
            'm = mock.patch("torch.cuda.synchronize"), mock.patch("torch.cuda.empty_cache")\n'
            'd = {"torch.cuda.a": "torch.cuda.b"}\nh = helpers.cuda(); k = "torch.cuda.c"\n')
    outcome = migrate_python(code, "train.py")
    leftovers = [(f.line, f.col, f.reason.split(" is still")[0]) for f in outcome.findings if f.kind == "cuda-leftover"]
    assert leftovers == [(5, 54, 'the string "torch.cuda.empty_cache"'), (6, 22, 'the string "torch.cuda.b"'),
                         (7, 5, "`helpers.cuda()`")]
    assert 'torch.device("npu")' in outcome.text and "randn(2).npu()" in outcome.text


def test_libcsts_tool_runs_the_audit(tmp_path):
    code = 'import torch\nx = y.cuda()\nprint("cuda")\n'
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          "npukit.migrate.codemods.CudaLeftovers", "src"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "src" / "train.py").read_text() == code
    assert "2:5: warning cuda-leftover: `y.cuda()` is still CUDA" in run.stderr
    assert "3:" not in run.stderr.split("2:5:")[1]


def test_the_audit_after_other_codemods_of_one_pass_sees_their_edits():
    """Run with the other codemods in one pass (as npu-migrate runs them), the audit reports only what
    none of them rewrote or reported."""
    code = "import torch\nx = y.cuda()\nz = w.cuda(); v = u.is_cuda\nt = torch.cuda.synchronize\n"
    context = CodemodContext(filename="train.py")
    results = run_builtin_codemods(code, "train.py", BUILTIN_CODEMODS, context=context)
    from npukit.migrate.codemods.leftovers import audit

    edits, found = audit(context.scratch, sorted(results.edits, key=lambda e: (e.start, e.end)), results.findings,
                         results.frozen)
    assert [e.rule for e in edits] == ["cuda-method", "cuda-method", "is-cuda", "cuda-namespace"]
    assert found == []
    _, found = audit(context.scratch, [], results.findings, results.frozen)  # without the edits
    assert [(f.line, f.col) for f in found] == [(2, 5), (3, 19), (4, 5)]


def test_cuda_uses_lists_the_detector_s_uses():
    assert cuda_uses("import torch\nx = y.cuda()\nz = 'nccl'\nprint('cuda')\n") == [
        (2, "`y.cuda()`"), (3, "the string 'nccl'")]


@pytest.mark.slow  # (runs on this repository's own files, which grow: a real-code suite, run in CI's slow stage)
@pytest.mark.parametrize("folder", ["npukit", "tests", "examples"])
def test_the_audits_windows_hold_every_cuda_use_of_a_file(folder):
    """npu-migrate parses only the statements holding the audit's candidates (an ast screen): the uses
    found there are the uses of the whole file."""
    compared = 0
    for path in sorted((REPO / folder).rglob("*.py")):
        code = path.read_text(encoding="utf-8")
        migrator = PythonMigrator(code, str(path))
        migrator._build_bindings()
        nodes = CudaLeftovers.candidates(migrator)
        whole = CodemodContext(filename=str(path))
        run_builtin_codemods(code, str(path), (CudaLeftovers,), context=whole)
        parts = CodemodContext(filename=str(path))
        if nodes:
            run_builtin_codemods(code, str(path), (CudaLeftovers,), windows=migrator._statement_windows(nodes),
                                 bindings=migrator.bindings, context=parts)
        uses = [[(use.kind, use.start, use.span, use.what) for use in context.scratch[AUDIT_KEY].uses]
                if AUDIT_KEY in context.scratch else [] for context in (whole, parts)]
        assert sorted(uses[0]) == sorted(uses[1]), path
        compared += bool(uses[0])
    assert compared >= 2


def test_a_file_without_cuda_is_not_parsed_for_the_audit():
    migrator = PythonMigrator("import torch\nx = torch.ones(2)\nprint('cpu')\n", "train.py")
    migrator._build_bindings()
    assert CudaLeftovers.candidates(migrator) == []
    assert cst.parse_module("x = 1\n")  # (libcst imported for the CodemodTest above)
