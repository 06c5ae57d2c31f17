"""Users' own libcst codemods (`npu-migrate --codemod`), and npukit's rules under libcst's own tool.

The codemod is the one docs/migrate.md shows, taken from the page: what a user copies works."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NPU_MIGRATE = Path(sys.executable).with_name("npu-migrate")
RULE = "mypkg.rules.HomeGrownCudaHelpers"

TRAIN = """import torch
import utils

model = torch.nn.Linear(4, 4).cuda()
x = utils.to_gpu(torch.randn(2, device="cuda"))
device = utils.cuda_device()
y = utils.launch("my_kernel", x)
"""
# no CUDA use npu-migrate knows: its text pre-filter would skip the file, the codemod must not
HELPERS_ONLY = "import utils\n\n\ndef prepare(t):\n    return utils.to_gpu(t)\n"


def _docs_codemod() -> str:
    page = (REPO / "docs" / "migrate.md").read_text()
    block = page.split("<!-- user-codemod-example -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text(_docs_codemod())
    (package / "failing.py").write_text(
        "from libcst.codemod import VisitorBasedCodemodCommand\n\n\n"
        "class Failing(VisitorBasedCodemodCommand):\n"
        "    def leave_Name(self, original_node, updated_node):\n"
        "        if updated_node.value == 'prepare':\n"
        "            raise RuntimeError('cannot handle prepare()')\n"
        "        return updated_node\n")
    (package / "stamp.py").write_text(
        "import libcst as cst\nfrom libcst.codemod import Codemod\n\n\n"
        "class Stamp(Codemod):\n"
        "    FILES_CONTAINING = ('to_gpu',)\n\n"
        "    def transform_module_impl(self, tree):\n"
        "        return tree.with_changes(footer=[*tree.footer, cst.EmptyLine(comment=cst.Comment('# stamped'))])\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(TRAIN)
    (repo / "helpers.py").write_text(HELPERS_ONLY)
    (repo / "crlf.py").write_bytes(b'import torch\r\nimport utils\r\nx = utils.to_gpu(torch.ones(2))\r\n')
    notebook = {"cells": [{"cell_type": "code", "source": ["import torch\n", "import utils\n"], "metadata": {},
                           "outputs": [], "execution_count": None},
                          {"cell_type": "code", "source": ["x = utils.to_gpu(torch.ones(2))\n", "y = x.cuda()"],
                           "metadata": {}, "outputs": [], "execution_count": None}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (repo / "demo.ipynb").write_text(json.dumps(notebook, indent=1) + "\n")
    return tmp_path


def _migrate(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """npu-migrate as the console script runs it, from the folder that holds mypkg."""
    return subprocess.run([str(NPU_MIGRATE), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def _changes(report_dir: Path) -> list[dict]:
    with (report_dir / "change_list.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def _findings(report_dir: Path) -> list[dict]:
    report = json.loads((report_dir / "report.json").read_text())
    return [finding for entry in report["files"] for finding in entry["findings"]]


def test_a_users_codemod_runs_after_the_built_in_rules_and_reports_under_its_name(workspace):
    run = _migrate(workspace, "repo", "--dry-run", "--codemod", RULE, "--report", "dry")
    assert run.returncode == 0, run.stderr
    changes = {(row["File"], row["Start Line"], row["Rule"]): (row["Original Code"], row["Modified Code"])
               for row in _changes(workspace / "dry")}
    # a line both changed is one change under both names; lines of the file on disk (dry run)
    assert changes[("train.py", "5", f"device-string+{RULE}")] == \
        ('x = utils.to_gpu(torch.randn(2, device="cuda"))', 'x = torch.randn(2, device="npu").npu()')
    assert changes[("train.py", "6", RULE)] == ("device = utils.cuda_device()", 'device = torch.device("npu")')
    assert changes[("train.py", "4", "cuda-method")] == ("cuda", "npu")
    assert changes[("helpers.py", "5", RULE)] == ("    return utils.to_gpu(t)", "    return t.npu()")
    assert changes[("crlf.py", "3", RULE)] == ("x = utils.to_gpu(torch.ones(2))", "x = torch.ones(2).npu()")
    assert ("demo.ipynb", "1", RULE) in changes  # line 1 of its code cell 2
    [launch] = [f for f in _findings(workspace / "dry") if f["kind"] == RULE]
    assert (launch["path"], launch["line"], launch["col"], launch["severity"]) == ("train.py", 7, 5, "warning")
    assert launch["reason"] == "utils.launch runs a hand-written CUDA kernel"
    assert launch["code"] == 'y = utils.launch("my_kernel", x)'
    assert (workspace / "repo" / "train.py").read_text() == TRAIN  # a dry run writes nothing
    sarif = json.loads((workspace / "dry" / "report.sarif").read_text())
    assert RULE in {rule["id"] for rule in sarif["runs"][0]["tool"]["driver"]["rules"]}

    # in place: the files, and lines of the written files (below the inserted import torch_npu)
    written = _migrate(workspace, "repo", "--force", "--codemod", RULE, "--report", "wet")
    assert written.returncode == 0, written.stderr
    assert (workspace / "repo" / "train.py").read_text() == (
        "import torch_npu\nimport torch\nimport utils\n\nmodel = torch.nn.Linear(4, 4).npu()\n"
        'x = torch.randn(2, device="npu").npu()\ndevice = torch.device("npu")\ny = utils.launch("my_kernel", x)\n')
    assert (workspace / "repo" / "helpers.py").read_text() == HELPERS_ONLY.replace("utils.to_gpu(t)", "t.npu()")
    assert (workspace / "repo" / "crlf.py").read_bytes() == b"import torch\r\nimport utils\r\nx = torch.ones(2).npu()\r\n"
    cells = [cell["source"] for cell in json.loads((workspace / "repo" / "demo.ipynb").read_text())["cells"]]
    assert cells == [["import torch_npu\n", "import torch\n", "import utils\n"],
                     ["x = torch.ones(2).npu()\n", "y = x.npu()"]]
    [launch] = [f for f in _findings(workspace / "wet") if f["kind"] == RULE]
    assert (launch["path"], launch["line"]) == ("train.py", 8)
    # idempotent: nothing left to change
    assert _migrate(workspace, "repo", "--check", "--quiet", "--codemod", RULE).returncode == 0


def test_a_failing_codemod_costs_that_file_that_codemod_only(workspace):
    run = _migrate(workspace, "repo", "--dry-run", "--codemod", "mypkg.failing.Failing", "--codemod", RULE,
                   "--report", "out")
    assert run.returncode == 0, run.stderr
    [failure] = [f for f in _findings(workspace / "out") if f["kind"] == "mypkg.failing.Failing"]
    assert failure["path"] == "helpers.py" and failure["severity"] == "error"
    assert "RuntimeError: cannot handle prepare()" in failure["reason"]
    changed = {(row["File"], row["Rule"]) for row in _changes(workspace / "out")}
    assert ("helpers.py", RULE) in changed  # the next codemod still ran on that file
    assert ("train.py", "cuda-method") in changed


@pytest.mark.parametrize("option, message", [
    ("mypkg.rules.Missing", "--codemod mypkg.rules.Missing: mypkg.rules has no Missing"),
    ("nopkg.rules.X", "--codemod nopkg.rules.X: cannot import nopkg.rules"),
    ("json.JSONDecoder", "--codemod json.JSONDecoder: JSONDecoder is not a libcst codemod"),
    ("HomeGrownCudaHelpers", "--codemod HomeGrownCudaHelpers: expected a dotted path to a class"),
])
def test_a_bad_codemod_option_stops_the_run_before_any_file_is_read(workspace, option, message):
    run = _migrate(workspace, "repo", "--force", "--codemod", option)
    assert run.returncode == 2
    assert run.stderr.startswith(f"error: {message}") and "Traceback" not in run.stderr
    assert (workspace / "repo" / "train.py").read_text() == TRAIN


def test_codemod_and_runtime_exclude_each_other(workspace):
    run = _migrate(workspace, "repo", "--runtime", "--codemod", RULE)
    assert run.returncode == 2 and "--codemod rewrites code and --runtime does not" in run.stderr


def test_worker_processes_load_the_users_codemod(workspace):
    for index in range(30):  # above the size where npu-migrate uses a process pool
        (workspace / "repo" / f"part{index}.py").write_text(HELPERS_ONLY)
    run = _migrate(workspace, "repo", "--dry-run", "--jobs", "2", "--codemod", RULE, "--report", "pool")
    assert run.returncode == 0, run.stderr
    changed = {row["File"] for row in _changes(workspace / "pool") if row["Rule"] == RULE}
    assert {f"part{index}.py" for index in range(30)} <= changed


def test_libcsts_own_tool_runs_npukits_rules_and_writes_what_npu_migrate_writes(workspace):
    for name in ("tool", "ours"):
        shutil.copytree(workspace / "repo", workspace / name)
    (workspace / "tool" / "demo.ipynb").unlink()  # libcst's tool reads .py files only
    (workspace / "ours" / "demo.ipynb").unlink()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(workspace)]))
    tool = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                           "npukit.migrate.codemods.MigrateToNpu", "tool"], cwd=workspace, capture_output=True,
                          text=True, timeout=300, env=env)
    assert tool.returncode == 0, tool.stderr
    assert "Failed to codemod 0 files" in tool.stderr
    ours = _migrate(workspace, "ours", "--force", "--quiet")
    assert ours.returncode == 0, ours.stderr
    for path in (workspace / "ours").iterdir():
        assert (workspace / "tool" / path.name).read_bytes() == path.read_bytes(), path.name
    # and the user's codemod under the same tool, its report() one of the tool's warnings
    users = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x", RULE, "tool"],
                           cwd=workspace, capture_output=True, text=True, timeout=300, env=env)
    assert users.returncode == 0, users.stderr
    assert "8:5: warning: utils.launch runs a hand-written CUDA kernel" in users.stderr
    assert 'x = torch.randn(2, device="npu").npu()' in (workspace / "tool" / "train.py").read_text()


def test_migrate_to_npu_as_a_libcst_codemod_test():
    from libcst.codemod import CodemodContext, CodemodTest

    from npukit.migrate.codemods import MigrateToNpu

    class Case(CodemodTest):
        TRANSFORM = MigrateToNpu

        def runTest(self):  # noqa: N802 (unittest's name)
            self.assertCodemod("import torch\nx = torch.ones(2).cuda()\n",
                               "import torch_npu\nimport torch\nx = torch.ones(2).npu()\n")
            self.assertCodemod("import math\nprint(math.pi)\n", "import math\nprint(math.pi)\n")
            # flagged, not rewritten: a CUDA compute capability means nothing on an NPU
            context = CodemodContext(filename="train.py")
            capability = "import torch\nok = torch.cuda.get_device_capability()[0] >= 8\n"
            self.assertCodemod(capability, capability, context_override=context, expected_warnings=None)
            assert [warning.split(":")[:2] for warning in context.warnings if "capability" in warning] == [["2", "6"]]

    Case().runTest()


def test_files_containing_limits_the_files_a_codemod_is_given(workspace):
    (workspace / "repo" / "unrelated.py").write_text("import os\nprint(os.sep)\n")
    run = _migrate(workspace, "repo", "--dry-run", "--codemod", "mypkg.stamp.Stamp", "--report", "out")
    assert run.returncode == 0, run.stderr
    # (in the notebook the stamp lands next to the built-ins' `.npu()`: one change, rule cuda-method+...)
    stamped = {row["File"] for row in _changes(workspace / "out") if "mypkg.stamp.Stamp" in row["Rule"]}
    assert stamped == {"train.py", "helpers.py", "crlf.py", "demo.ipynb"}  # not unrelated.py


def test_a_codemod_change_across_two_notebook_cells_is_reported_not_applied(tmp_path, monkeypatch):
    from npukit.migrate.textfiles import migrate_notebook
    from npukit.migrate.user_codemods import CodemodSpec

    (tmp_path / "merging.py").write_text(
        "import libcst as cst\nfrom libcst.codemod import Codemod\n\n\n"
        "class MergeAll(Codemod):\n"
        "    def transform_module_impl(self, tree):\n"
        "        return cst.parse_module('merged = 1\\n')\n")
    notebook = {"cells": [{"cell_type": "code", "source": "import torch\nx = torch.ones(2).cuda()", "metadata": {},
                           "outputs": [], "execution_count": None},
                          {"cell_type": "code", "source": "y = x + 1", "metadata": {}, "outputs": [],
                           "execution_count": None}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    text = json.dumps(notebook, indent=1) + "\n"
    new_text, changes, findings = migrate_notebook(text, "nb.ipynb", codemods=(CodemodSpec("merging.MergeAll",
                                                                                          str(tmp_path)),))
    cells = [cell["source"] for cell in json.loads(new_text)["cells"]]
    assert cells == ["import torch_npu\nimport torch\nx = torch.ones(2).npu()", "y = x + 1"]  # the built-ins only
    assert {change.rule for change in changes} == {"import-torch-npu", "cuda-method"}
    [refused] = [finding for finding in findings if "merging.MergeAll" in finding.kind]
    assert refused.severity == "error" and "spans two code cells" in refused.reason
