"""The built-in concerns ported to libcst codemods: each on its own (libcst's CodemodTest and its
tool), and the positions npu-migrate takes from them."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from libcst.codemod import CodemodContext, CodemodTest
from libcst.metadata import MetadataWrapper, PositionProvider

from npukit.migrate import rules
from npukit.migrate.codemods import (
    BUILTIN_CODEMODS,
    AmpUpgrade,
    AutocastGpuDtype,
    Bf16Autocast,
    CompileModes,
    CudaCliFlags,
    CudaDefaultDevices,
    CudaEnvironment,
    CudaMethods,
    CudaNamespace,
    CustomCudaOps,
    DdpSetDevice,
    DefaultTensorType,
    DeviceModelChecks,
    DeviceStrings,
    DistributedBackends,
    DualTargetCode,
    IntDeviceOrdinals,
    ThirdPartyCuda,
    TorchLoadMapLocation,
    UnsupportedApis,
    UnsupportedTensorMethods,
)
from npukit.migrate.codemods.base import FACTS_KEY, FileFacts, _OnePass, run_builtin_codemods
from npukit.migrate.codemods.cuda_methods import USER_CUDA_ATTRIBUTE, USER_CUDA_METHOD
from npukit.migrate.model import TreeFacts
from npukit.migrate.pysource import PythonMigrator, migrate_python

REPO = Path(__file__).resolve().parents[2]


def _warnings(code: str) -> list[str]:
    """'line:col kind' of each warning CudaEnvironment gives on code (the code itself unchanged)."""
    context = CodemodContext(filename="train.py")
    CudaEnvironment(context).transform_module(cst.parse_module(code))
    return [f"{w.split()[0].rstrip(':')} {w.split()[2].rstrip(':')}" for w in context.warnings]


class CudaEnvironmentCase(CodemodTest):
    TRANSFORM = CudaEnvironment

    def runTest(self):  # noqa: N802 (unittest's name)
        self.assertCodemod('import os\nos.environ["CUDA_VISIBLE_DEVICES"] = "0,1"\n',
                           'import os\nos.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0,1"\n',
                           expected_warnings=None)
        # the prefix and quotes stay; every spelling of the renamed variables
        self.assertCodemod("os.getenv(r'PYTORCH_CUDA_ALLOC_CONF')\nenv = {'CUDA_LAUNCH_BLOCKING': '1'}\n"
                           "os.environ.get('''NCCL_SOCKET_IFNAME''')\n",
                           "os.getenv(r'PYTORCH_NPU_ALLOC_CONF')\nenv = {'ASCEND_LAUNCH_BLOCKING': '1'}\n"
                           "os.environ.get('''HCCL_SOCKET_IFNAME''')\n")
        unchanged = [
            '"""Set CUDA_VISIBLE_DEVICES before you start."""\nimport os\n',  # a docstring
            'key = "CUDA_VISIBLE" "_DEVICES"\n',  # split over literals: the audit reports it
            'key = "CUDA\\x5fVISIBLE_DEVICES"\n',  # spelled with an escape
            'key = b"CUDA_VISIBLE_DEVICES"\n',  # bytes
            'print("no CUDA here")\n',  # a file that does not concern the codemod
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_cuda_environment_as_a_libcst_codemod_test():
    CudaEnvironmentCase().runTest()


def test_cuda_environment_reports_what_it_does_not_rename():
    code = textwrap.dedent('''\
        import os, subprocess
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        subprocess.run(f"nvidia-smi -i {rank}", shell=True)
        cmd = "CUDA_VISIBLE_DEVICES=0 python train.py"
        print("CUDA_VISIBLE_DEVICES=0 python train.py", "backend:cudaMallocAsync")
        ''')
    assert _warnings(code) == ["2:23 env-var", "3:12 env-var", "4:41 env-var", "5:16 nvidia-smi", "6:7 env-var"]


def _libcst_tool(tmp_path: Path, codemod: str, code: str) -> tuple[str, str]:
    """(the file's new text, the tool's stderr) after `python -m libcst.tool codemod` ran one built-in
    codemod on a folder holding `code`."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "launch.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          f"npukit.migrate.codemods.{codemod}", "src"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    return (tmp_path / "src" / "launch.py").read_text(), run.stderr


def test_libcsts_tool_runs_one_builtin_codemod(tmp_path):
    text, warnings = _libcst_tool(tmp_path, "CudaEnvironment", 'import os\nos.environ["CUDA_VISIBLE_DEVICES"] = "3"\n'
                                                               'os.environ["NCCL_IB_DISABLE"] = "1"\n')
    assert text == 'import os\nos.environ["ASCEND_RT_VISIBLE_DEVICES"] = "3"\nos.environ["NCCL_IB_DISABLE"] = "1"\n'
    assert "2:12: warning visible-devices:" in warnings
    assert "3:12: warning env-var: NCCL_IB_DISABLE: NCCL_* variables have no effect" in warnings


def test_npu_migrate_reports_the_codemods_edits_and_findings_under_their_rules():
    code = 'import os\nimport torch\nos.environ["CUDA_VISIBLE_DEVICES"] = "0"\nx = torch.ones(1).cuda()\n'
    outcome = migrate_python(code, "train.py")
    assert outcome.text == ('import torch_npu\nimport os\nimport torch\nos.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0"\n'
                            'x = torch.ones(1).npu()\n')
    assert [(c.line, c.col, c.rule, c.before, c.after) for c in outcome.changes if c.rule == "env-var"] == [
        (3, 12, "env-var", '"CUDA_VISIBLE_DEVICES"', '"ASCEND_RT_VISIBLE_DEVICES"')]
    assert [(f.line, f.col, f.kind) for f in outcome.findings] == [(3, 12, "visible-devices")]


def test_an_env_rename_inside_the_cuda_branch_of_dual_target_code_is_not_made():
    # the ast engine keeps the CUDA branch of `if torch.cuda.is_available() ... else` code whole
    # when the other branch already handles NPU; the codemods' edits obey the same frozen spans
    code = textwrap.dedent('''\
        import os
        import torch
        if hasattr(torch, "npu") and torch.npu.is_available():
            os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0"
        elif torch.cuda.is_available():
            os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        ''')
    outcome = migrate_python(code, "train.py")
    assert 'os.environ["CUDA_VISIBLE_DEVICES"] = "0"' in outcome.text
    assert not [c for c in outcome.changes if c.rule == "env-var"]


def test_findings_count_columns_in_utf8_bytes_like_every_other_finding():
    code = 'label = "é"; os.environ["NCCL_DEBUG"] = "INFO"; x = y.cuda_helper\n'
    edits, findings, _ = run_builtin_codemods(code, "a.py", BUILTIN_CODEMODS)
    assert [(f.line, f.col) for f in findings] == [(1, len('label = "é"; os.environ['.encode()) + 1)]


@pytest.mark.parametrize("source", [
    "examples/cuda_project/train_gpt.py",
    "npukit/migrate/codemods/environment.py",
    "npukit/migrate/codemods/device_strings.py",
])
def test_the_codemods_positions_are_libcsts_positions(source):
    """FileFacts.span (a counting code generation) gives PositionProvider's extent for every node."""
    text = (REPO / source).read_text()
    module = cst.parse_module(text)
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    facts = FileFacts(source, module, text)
    for node, where in positions.items():
        start, end = facts.span(node)
        if end == len(text) + 1 and not text.endswith("\n"):
            continue  # the newline libcst generates for a last line without one, and drops
        assert facts.line_col(start) == (where.start.line, where.start.column + 1), node
        assert facts.line_col(end) == (where.end.line, where.end.column + 1), node


class CudaDefaultDevicesCase(CodemodTest):
    TRANSFORM = CudaDefaultDevices

    def runTest(self):  # noqa: N802 (unittest's name)
        self.assertCodemod("import torch\nscaler = torch.amp.GradScaler()\n",
                           'import torch\nscaler = torch.amp.GradScaler("npu")\n')
        # through an import alias, before the first keyword
        self.assertCodemod("from torch.amp import GradScaler as GS\ns = GS(enabled=True)\n",
                           'from torch.amp import GradScaler as GS\ns = GS("npu", enabled=True)\n')
        self.assertCodemod("import torch\ntorch.set_autocast_enabled(True)\n",
                           'import torch\ntorch.set_autocast_enabled("npu", True)\n')
        # after a trailing comma; and before the `)` whatever the parentheses hold
        self.assertCodemod("import torch\nwith torch.random.fork_rng(devices=[0],):\n    pass\n",
                           'import torch\nwith torch.random.fork_rng(devices=[0], device_type="npu",):\n    pass\n')
        self.assertCodemod("import torch\nwith torch.random.fork_rng(\n    # all ranks\n):\n    pass\n",
                           'import torch\nwith torch.random.fork_rng(\n    # all ranks\ndevice_type="npu"):\n    pass\n')
        unchanged = [
            'import torch\ns = torch.amp.GradScaler("npu")\n',
            'import torch\ns = torch.amp.GradScaler(device="cpu")\n',
            "import torch\ns = torch.amp.GradScaler(*options)\n",  # may pass the device
            "import torch\ns = torch.amp.GradScaler(**options)\n",
            'import torch\nwith torch.random.fork_rng(device_type="cpu"):\n    pass\n',
            "from apex.amp import GradScaler\ns = GradScaler()\n",  # not torch's
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_cuda_default_devices_as_a_libcst_codemod_test():
    CudaDefaultDevicesCase().runTest()


@functools.cache
def _both_models(path: Path) -> tuple[PythonMigrator, FileFacts]:
    """One file as the ast engine models it (with its import table) and as the codemods' facts do;
    parsed once for the tests that compare the two."""
    text = path.read_text(encoding="utf-8")
    migrator = PythonMigrator(text, str(path))
    migrator._build_bindings()
    return migrator, FileFacts(str(path), cst.parse_module(text), text)


@pytest.mark.slow  # (runs on this repository's own files, which grow: a real-code suite, run in CI's slow stage)
@pytest.mark.parametrize("folder", ["npukit", "tests"])
def test_the_import_table_fact_is_the_ast_engines(folder):
    """The bindings the codemods share (FileFacts.bindings) are the ones the ast rules resolve names with."""
    compared = 0
    for path in sorted((REPO / folder).rglob("*.py")):
        migrator, facts = _both_models(path)
        assert facts.bindings == migrator.bindings, path
        compared += 1
    assert compared > 50


def test_the_import_table_keeps_the_first_binding_of_a_name_and_knows_a_module_level_torch():
    def bindings(code):
        return FileFacts("a.py", cst.parse_module(code), code).bindings

    assert bindings("import numpy as np\nimport torch as np\n") == {"np": "numpy", "torch": "torch"}
    assert bindings("from torch import cuda as c, nn\nimport torch.distributed as dist\n") == {
        "c": "torch.cuda", "nn": "torch.nn", "dist": "torch.distributed", "torch": "torch"}
    assert "torch" not in bindings("torch = load_backend()\n")
    assert bindings("def f():\n    torch = 1\n") == {"torch": "torch"}  # a local, not the module's
    assert bindings("from . import torch_utils\nfrom x import *\n") == {"torch": "torch"}


@pytest.mark.parametrize("fill", ['t.masked_fill(m, float("-INF"))', "torch.full((2,), -(torch.inf))",
                                  "t.fill_(big)", "t.new_full((3,), value=-np.inf)"])
def test_infinite_fills_are_reported_however_the_infinity_is_spelled(fill):
    code = f"import torch\nimport numpy as np\nfrom math import inf as big\nx = {fill}\n"
    findings = [(f.line, f.col, f.kind) for f in migrate_python(code, "attention.py").findings]
    assert findings == [(4, 5, "inf-fill")]
    assert migrate_python(code.replace(fill, "t.masked_fill(m, float('nan'))"), "attention.py").findings == []


class TorchLoadCase(CodemodTest):
    TRANSFORM = TorchLoadMapLocation

    def runTest(self):  # noqa: N802 (unittest's name)
        # only into load_state_dict (directly, through a key, through a name read nowhere else): cpu
        self.assertCodemod('import torch\nm.load_state_dict(torch.load("a.pt"))\n',
                           'import torch\nm.load_state_dict(torch.load("a.pt", map_location="cpu"))\n')
        self.assertCodemod('import torch\nckpt = torch.load(p)\nm.load_state_dict(ckpt["model"])\n',
                           'import torch\nckpt = torch.load(p, map_location="cpu")\nm.load_state_dict(ckpt["model"])\n')
        # a read after the load, in a function that sees the module's name
        self.assertCodemod('import torch\nsd = torch.load(p)\ndef restore():\n    m.load_state_dict(sd)\n',
                           'import torch\nsd = torch.load(p, map_location="cpu")\ndef restore():\n    m.load_state_dict(sd)\n')
        # used whole, or rebound: npu
        self.assertCodemod('import torch\nckpt = torch.load(p)\nstep = ckpt["step"]\n',
                           'import torch\nckpt = torch.load(p, map_location="npu")\nstep = ckpt["step"]\n')
        self.assertCodemod('import torch\ndef f(p):\n    s = torch.load(p)\n    s = fix(s)\n    m.load_state_dict(s)\n',
                           'import torch\ndef f(p):\n    s = torch.load(p, map_location="npu")\n    s = fix(s)\n'
                           '    m.load_state_dict(s)\n')
        unchanged = [
            'import torch\nx = torch.load(p, map_location="cpu")\n',
            'import torch\nx = torch.load(p, "cpu")\n',
            "import torch\nx = torch.load(p, **options)\n",
            "import pickle\nx = pickle.load(p)\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_torch_load_as_a_libcst_codemod_test():
    TorchLoadCase().runTest()


@pytest.mark.parametrize("folder", ["npukit/migrate", "tests/migrate"])
def test_the_scopes_fact_is_the_ast_engines(folder):
    """For every name read in these files: the scope whose binding it sees, and how many statements
    bind the name there, as the ast engine decides them."""
    compared = 0
    for path in sorted((REPO / folder).rglob("*.py")):
        migrator, facts = _both_models(path)

        expected = {}
        for name, uses in migrator.loads.items():
            for use in uses:
                scope = migrator._defining_scope(name, migrator.scope_of.get(id(use), migrator.tree))
                expected[(name, migrator.pos.offset(use.lineno, use.col_offset))] = (
                    getattr(scope, "lineno", 0), len(migrator._binding_sites(name, scope)))
        scopes = facts.scopes
        found = {}
        for name, uses in scopes.reads.items():
            for use in uses:
                scope = scopes.defining_scope(name, scopes.scope_of[use])
                found[(name, facts.span(use)[0])] = (_scope_line(facts, scope), scopes.binding_count(name, scope))
        assert found == expected, path
        compared += len(found)
    assert compared > 1000


def _scope_line(facts: FileFacts, scope: cst.CSTNode) -> int:
    """The line ast gives a scope: 0 for the module, the `def` / `class` / `lambda` line otherwise."""
    if isinstance(scope, cst.Module):
        return 0
    return facts.line_col(facts.span(scope.name if hasattr(scope, "name") else scope)[0])[0]


def test_a_lambda_in_default_values_does_not_bind_its_parameter_in_the_function():
    # the ast engine counted `step` twice here (ast.walk over the arguments reached the lambda's)
    code = "def train(model, batch=lambda step: step):\n    for step in range(3):\n        batch(step)\n"
    facts = FileFacts("a.py", cst.parse_module(code), code)
    function = facts.module.body[0]
    assert facts.scopes.binding_count("step", function) == 1
    reads = facts.scopes.reads["step"]
    assert [facts.scopes.defining_scope("step", facts.scopes.scope_of[read]) for read in reads] == [
        function.params.params[1].default, function]  # the lambda's own read, the loop's


def test_custom_ops_come_from_the_tree_facts_through_the_codemod_context():
    code = "import my_ext\nfrom my_ext import fused_gelu as fg\ny = my_ext.fused_gelu(x)\nz = fg(x)\nw = obj.fused_gelu()\n"
    tree = TreeFacts(custom_ops=frozenset({"fused_gelu"}))
    _, findings, _ = run_builtin_codemods(code, "model.py", (CustomCudaOps,), tree)
    # the op by its module, and imported under another name; not a method of some object
    assert [(f.line, f.kind) for f in findings] == [(3, "custom-cuda-op"), (4, "custom-cuda-op")]
    assert run_builtin_codemods(code, "model.py", (CustomCudaOps,))[1] == []  # one file alone knows no ops


WINDOW_CASES = '''\
"""Module docstring: CUDA_VISIBLE_DEVICES."""
import os, torch
x = f(
    "CUDA_VISIBLE_DEVICES"); y = torch.amp.GradScaler()
"a bare string statement naming NCCL_DEBUG"
os.environ["NCCL_SOCKET_IFNAME"] = "eth0"

@decorate(os.environ["CUDA_LAUNCH_BLOCKING"])
def f():
    """CUDA_VISIBLE_DEVICES in a docstring."""
    if True:
        return scores.masked_fill(mask, float("-inf"))
'''


def _both_ways(code: str, path: str, tree: TreeFacts = TreeFacts()):
    """The built-in codemods' (edits, findings) on the whole file and on the windows npu-migrate parses."""
    migrator = PythonMigrator(code, path, tree)
    migrator._build_bindings()
    found = {codemod: codemod.candidates(migrator) for codemod in BUILTIN_CODEMODS if codemod.concerns(code)}
    # the codemods npu-migrate may give windows of this file
    local = tuple(codemod for codemod in BUILTIN_CODEMODS if not codemod.WHOLE_FILE and not any(
        node is migrator.tree for node in found.get(codemod, ())))
    nodes = [(codemod, found[codemod]) for codemod in local if found.get(codemod)]
    whole = run_builtin_codemods(code, path, local, tree)
    windows = migrator.windows(nodes) if nodes else []
    parts = run_builtin_codemods(code, path, local, tree, windows=windows, bindings=migrator.bindings)
    return whole, parts, windows


def test_statement_windows_give_what_the_whole_file_gives():
    whole, parts, windows = _both_ways(WINDOW_CASES, "train.py")
    assert sorted(whole[0], key=str) == sorted(parts[0], key=str)
    assert [(e.line, e.rule) for e in whole[0]] == [(4, "env-var"), (4, "cuda-default-device"), (6, "env-var"),
                                                    (8, "env-var")]
    assert sorted(whole[1], key=str) == sorted(parts[1], key=str)
    # the bare string statement is code to the ast engine too; the docstrings are not
    assert [(f.line, f.kind) for f in whole[1]] == [(4, "visible-devices"), (5, "env-var"), (12, "inf-fill")]
    # statements 2-6 (sharing lines, and the bare string taking the statement before), the def's
    # header with its decorator and the return statement in its `if`; not the module docstring, the
    # import nor the blank line
    lines = [(WINDOW_CASES.count("\n", 0, start) + 1, WINDOW_CASES.count("\n", 0, end)) for start, end, *_ in windows]
    assert lines == [(3, 6), (8, 9), (12, 12)]


NESTED_CASES = [
    # (code, the (first line, last line, nested) of each window): a statement in a method
    ("import torch\nclass Net:\n    def step(self):\n        x = 1\n        torch.cuda.synchronize()\n        return x\n",
     [(5, 5, True)]),
    # tabs, and a string whose lines are less indented than the statement (no dedent: the bytes stay)
    ("import os, torch\nclass Net:\n\tdef step(self):\n\t\tdoc = '''\nNCCL_DEBUG\n'''\n"
     "\t\tos.environ['CUDA_VISIBLE_DEVICES'] = '0'\n\t\treturn torch.cuda.current_device()\n",
     [(4, 6, True), (7, 7, True), (8, 8, True)]),
    # a decorator holding a candidate: the def's header from its first decorator (a synthetic body
    # closes it), nested or at the top level; a body on the header's line: the whole def
    ("import torch\nclass Net:\n    @decorate(1)\n    @torch.cuda.nvtx.range('step')\n    def step(self,\n"
     "             x):\n        # a comment\n        return x\n", [(3, 7, True)]),
    ("import torch\n@torch.jit.script\nclass Net:\n    def step(self, x: torch.cuda.Stream):\n        return x\n"
     "    @torch.cuda.nvtx.range('go')\n    def go(self): return 1\n", [(2, 3, False), (4, 4, True), (6, 7, True)]),
    # an else clause's statement; an elif's test takes the whole if
    ("import torch\ndef f(a):\n    if a:\n        pass\n    else:\n        torch.cuda.synchronize()\n"
     "    if a:\n        pass\n    elif torch.cuda.is_available():\n        pass\n", [(6, 6, True), (7, 10, True)]),
    # statements that do not start their line, or share their last line, take the statement around them
    ("import torch\ndef f(a):\n    if a: torch.cuda.synchronize()\n    b = 1; torch.cuda.synchronize()\n"
     "    else_ = torch.cuda.is_available(); c = 2\n", [(2, 5, False)]),
    # a line continued into the statement's first line: the statement around it
    ("import torch\ndef f(a):\n    if a: \\\n        torch.cuda.synchronize()\n", [(3, 4, True)]),
    # a bare string statement is not a docstring inside a window
    ("import torch\ndef f():\n    '''doc: NCCL_DEBUG'''\n    'NCCL_DEBUG'\n    x = 1\n", [(4, 4, True)]),
    # CRLF line endings; a candidate in a nested function
    ("import torch\r\ndef f():\r\n    def g():\r\n        return torch.cuda.current_device()\r\n    return g\r\n",
     [(4, 4, True)]),
]


@pytest.mark.parametrize(("code", "lines"), NESTED_CASES)
def test_nested_windows_give_what_the_whole_file_gives(code, lines):
    whole, parts, windows = _both_ways(code, "train.py")
    assert [sorted(found, key=str) for found in whole] == [sorted(found, key=str) for found in parts]
    assert whole[0] or whole[1]
    assert [(code.count("\n", 0, w.start) + 1, code.count("\n", 0, w.end), w.nested) for w in windows] == lines


def test_nested_windows_map_edits_back_exactly():
    code = "import os\nclass Net:\n\tdef step(self):\n\t\tdoc = '''\nx\n'''\n\t\tos.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"
    whole, parts, windows = _both_ways(code, "train.py")
    assert [w.nested for w in windows] == [True]
    assert [(e.line, e.col, code[e.start:e.end], e.text) for e in parts[0]] == \
        [(7, 14, "'CUDA_VISIBLE_DEVICES'", "'ASCEND_RT_VISIBLE_DEVICES'")]
    assert migrate_python(code, "train.py").text == code.replace("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def test_a_window_runs_only_the_codemods_with_a_candidate_in_it():
    code = "import os, torch\ndef f():\n    os.environ['NCCL_DEBUG'] = 'INFO'\n    torch.cuda.synchronize()\n"
    migrator = PythonMigrator(code, "train.py")
    migrator._build_bindings()
    found = [(codemod, codemod.candidates(migrator)) for codemod in (CudaNamespace, CudaEnvironment)]
    assert [(w.codemods, w.nested) for w in migrator.windows(found)] == [((CudaEnvironment,), True),
                                                                          ((CudaNamespace,), True)]


@pytest.mark.parametrize(("code", "windows"), [
    # self.cuda() of a class of the tree's: the class around it decides, so the window is the class
    ("import torch\nif True:\n    class Box2(Box):\n        def go(self):\n            return self.cuda()\n",
     [(3, 5, True)]),
    # a name bound in an enclosing function to one of those classes: the whole file decides
    ("import torch\ndef outer():\n    model = Box()\n    def inner():\n        return model.cuda()\n    return inner\n",
     None),
    # bound to anything else: the statement
    ("import torch\ndef outer():\n    model = Net()\n    def inner():\n        return model.cuda()\n    return inner\n",
     [(5, 5, True)]),
])
def test_cuda_methods_windows_with_the_trees_classes(code, windows):
    tree = TreeFacts(cuda_method_classes=frozenset({"Box"}))
    migrator = PythonMigrator(code, "train.py", tree)
    migrator._build_bindings()
    found = CudaMethods.candidates(migrator)
    if windows is None:
        assert found == [migrator.tree]
        return
    assert [(code.count("\n", 0, w.start) + 1, code.count("\n", 0, w.end), w.nested)
            for w in migrator.windows([(CudaMethods, found)])] == windows
    whole, parts, _ = _both_ways(code, "train.py", tree)
    assert [sorted(f, key=str) for f in whole] == [sorted(f, key=str) for f in parts]
    assert whole[0] or whole[1]


@pytest.mark.parametrize(("code", "windows"), [
    # in a function: the function (the scope that binds what it loads), its reads followed there
    ("import torch\nclass Net:\n    def restore(self, path):\n        ckpt = torch.load(path)\n"
     "        self.load_state_dict(ckpt)\n        return torch.load(path)\n", [(3, 6, True)]),
    # the name bound in the enclosing function is read in a nested one: the whole def that binds it
    ("import torch\ndef outer(path):\n    state = torch.load(path)\n    def inner(m):\n        m.load_state_dict(state)\n"
     "    return inner\n", [(2, 6, False)]),
    # in a lambda or a default value: the scope around it is not a function's body
    ("import torch\nload = lambda p: torch.load(p)\n", None),
    ("import torch\ndef f(state=torch.load('a.pt')):\n    return state\n", None),
    # at the top level, or where torch.save may have written the same file: the whole file
    ("import torch\nckpt = torch.load('a.pt')\ndef f(m):\n    m.load_state_dict(ckpt)\n", None),
    ("import torch\ndef save(x, path):\n    torch.save(x, path)\ndef load(path):\n    return torch.load(path)\n", None),
])
def test_torch_load_windows(code, windows):
    migrator = PythonMigrator(code, "train.py")
    migrator._build_bindings()
    found = TorchLoadMapLocation.candidates(migrator)
    whole, parts, chosen = _both_ways(code, "train.py")
    if windows is None:
        assert found == [migrator.tree]
    else:
        assert [(code.count("\n", 0, w.start) + 1, code.count("\n", 0, w.end), w.nested) for w in chosen] == windows
        assert [sorted(f, key=str) for f in whole] == [sorted(f, key=str) for f in parts]
        assert len(whole[0]) == code.count("torch.load(")


@pytest.mark.slow  # (runs on this repository's own files, which grow: a real-code suite, run in CI's slow stage)
@pytest.mark.parametrize("folder", ["npukit", "tests"])
def test_statement_windows_agree_with_the_whole_file_on_this_repository(folder):
    compared = 0
    for path in sorted((REPO / folder).rglob("*.py")):
        code = path.read_text(encoding="utf-8")
        whole, parts, windows = _both_ways(code, str(path), TreeFacts(custom_ops=frozenset({"fused_gelu", "launch"})))
        assert [sorted(found, key=str) for found in whole] == [sorted(found, key=str) for found in parts], path
        compared += bool(windows)
    assert compared >= 3


@pytest.mark.parametrize(("code", "kinds"), [
    ("import torch\nwith torch.autocast('npu', dtype=torch.bfloat16):\n    pass\n", ["bf16"]),
    ("from torch import bfloat16 as bf\nimport torch.amp as amp\nwith amp.autocast('npu', dtype=bf):\n    pass\n",
     ["bf16"]),
    ("import torch\nwith torch.autocast('npu', dtype=torch.float16):\n    pass\nx = torch.bfloat16\n", []),
    ("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model)\n",
     ["ddp-set-device"]),
    ("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.npu.set_device(r)\n"
     "m = DDP(model)\n", []),
])
def test_flag_only_codemods_under_libcsts_tool(code, kinds):
    context = CodemodContext(filename="train.py")
    for codemod in (Bf16Autocast, DdpSetDevice):
        assert codemod(context).transform_module(cst.parse_module(code)).code == code  # reported, not rewritten
    assert [warning.split()[2].rstrip(":") for warning in context.warnings] == kinds


def _warned(codemod, code: str) -> list[str]:
    """'line:col kind' of each warning a codemod gives under libcst's tool; the code must stay as it was."""
    context = CodemodContext(filename="train.py")
    assert codemod(context).transform_module(cst.parse_module(code)).code == code  # reported, not rewritten
    return [f"{w.split()[0].rstrip(':')} {w.split()[2].rstrip(':')}" for w in context.warnings]


@pytest.mark.parametrize(("code", "expected"), [
    # imports: one finding per statement, for its first CUDA-only name; from-imports by module or name
    ("import os, cupy, pynvml\nfrom flash_attn import flash_attn_func\nfrom numba import cuda\n",
     ["1:1 cupy", "2:1 flash-attn", "3:1 numba-cuda"]),
    ("from . import triton\nimport numba\nimport tritonclient\n", []),  # relative; numba alone; a longer name
    # calls into the libraries whose call sites are reported, through import aliases
    ("import xformers.ops as xops\nimport triton\ny = xops.memory_efficient_attention(q, k, v)\ntriton.cdiv(8, 2)\n",
     ["1:1 xformers", "2:1 triton", "3:5 xformers"]),
    # kernel decorators, bare or called
    ("import triton\nfrom numba import cuda\n@triton.autotune(configs=[])\n@triton.jit\ndef k(x):\n    pass\n"
     "@cuda.jit\ndef g():\n    pass\n",
     ["1:1 triton", "2:1 numba-cuda", "3:2 triton", "4:2 triton", "7:2 numba-cuda"]),
])
def test_third_party_cuda_libraries_are_reported_where_used(code, expected):
    assert _warned(ThirdPartyCuda, code) == expected


@pytest.mark.parametrize(("code", "expected"), [
    ('import torch\nif "A100" in torch.cuda.get_device_name(0):\n    pass\n', ["2:14 device-name"]),
    ("from torch.cuda import get_device_name as gdn\nhopper = gdn().lower().startswith('nvidia h')\n",
     ["2:10 device-name"]),
    # through a variable: its reads anywhere in the file, also before the assignment
    ("import torch\ndef big():\n    return name.startswith('NVIDIA A100')\nname = torch.cuda.get_device_name(0)\n",
     ["4:8 device-name"]),
    ("import torch\nname = torch.cuda.get_device_name(0)\nprint(name)\n", []),  # shown, not parsed
    ("import torch\nok = torch.cuda.get_device_properties(0).major >= 8\n", ["2:6 device-properties"]),
    ("import torch\np = torch.cuda.get_device_properties(0)\nsm = (p.major, p.minor)\nmem = p.total_memory\n",
     ["3:7 device-properties", "3:16 device-properties"]),
    ("import torch\np, q = torch.cuda.get_device_properties(0), 1\nsm = p.major\n", []),  # not a plain assignment
])
def test_device_model_checks_are_reported(code, expected):
    assert _warned(DeviceModelChecks, code) == expected


def test_a_capability_field_from_a_codemod_keeps_its_condition_whole():
    """A finding that leaves a CUDA call in the code (device-properties) comes from a codemod, and the
    condition holding it is still left as it was, with a mixed-condition error."""
    code = ("import torch\nbf16 = torch.cuda.is_available() and torch.cuda.get_device_properties(0).major >= 8\n"
            "x = torch.randn(2).cuda()\n")
    outcome = migrate_python(code, "train.py")
    assert outcome.text.splitlines()[2] == code.splitlines()[1]  # no half-rewritten condition
    assert outcome.text.splitlines()[3] == "x = torch.randn(2).npu()"
    assert [(f.line, f.col, f.kind) for f in outcome.findings] == [(2, 8, "mixed-condition"), (2, 38, "device-properties")]


DUAL_TARGET = """\
import torch
if torch.cuda.is_available():
    x = torch.randn(2).cuda();  # the branch ends before the semicolon and the comment
elif torch.npu.is_available():
    x = torch.randn(2).npu()
def pick():
    if not use_npu:
        return "cpu"
    else:
        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            for i in range(2):
                y = torch.zeros(2, device="cuda")
                # closing the loop
        elif torch.npu.is_available():
            pass
device = ("cuda" if torch.cuda.is_available()
          else "npu")
plain = "cuda" if torch.cuda.is_available() else "cpu"
"""


def test_dual_target_code_is_reported_and_frozen():
    """The CUDA branch of code that already has an NPU branch is reported (with the lines it covers)
    and frozen: npu-migrate rewrites nothing in it, and only there."""
    edits, findings, frozen = run_builtin_codemods(DUAL_TARGET, "train.py", (DualTargetCode,))
    assert edits == []
    assert [(f.line, f.col, f.kind, f.end_line) for f in findings] == [
        (2, 4, "dual-target", 3), (10, 12, "dual-target", 12), (16, 11, "dual-target", 17)]
    assert [DUAL_TARGET[start:end] for start, end in frozen] == [
        "torch.cuda.is_available():\n    x = torch.randn(2).cuda()",
        'torch.cuda.is_available() and torch.cuda.device_count() > 1:\n            for i in range(2):\n'
        '                y = torch.zeros(2, device="cuda")',
        '"cuda" if torch.cuda.is_available()\n          else "npu"']
    migrated = migrate_python(DUAL_TARGET, "train.py").text.splitlines()
    assert migrated[1:] == DUAL_TARGET.splitlines()[:-1] + ['plain = "npu" if torch.npu.is_available() else "cpu"']


class DefaultTensorTypeCase(CodemodTest):
    TRANSFORM = DefaultTensorType

    def runTest(self):  # noqa: N802 (unittest's name)
        self.assertCodemod("import torch as th\nif cuda:\n    th.set_default_tensor_type(th.cuda.HalfTensor)\n",
                           'import torch as th\nif cuda:\n    th.set_default_device("npu")\n'
                           "    th.set_default_dtype(th.float16)\n",
                           expected_warnings=["3:5: warning legacy-constructor: " + LEGACY_DEFAULT])
        self.assertCodemod("import torch\r\ntorch.set_default_tensor_type('torch.cuda.DoubleTensor')\r\n",
                           'import torch\r\ntorch.set_default_device("npu")\r\ntorch.set_default_dtype(torch.float64)\r\n')
        for code in ["import torch\nx = 1; torch.set_default_tensor_type(torch.cuda.FloatTensor)\n",  # not on its own line
                     "import torch\nold = torch.set_default_tensor_type(torch.cuda.FloatTensor)\n",  # not a statement
                     "import torch\ntorch.set_default_tensor_type(torch.FloatTensor)\n"]:  # a CPU type
            self.assertCodemod(code, code)
        # torch neither imported nor named there: `torch` would be a new name, so it is reported
        code = "from torch import set_default_tensor_type as sdt\nsdt('torch.cuda.FloatTensor')\n"
        self.assertCodemod(code, code, expected_warnings=[
            "2:1: warning default-tensor-type: a CUDA default tensor type set where torch itself is not imported: "
            "not rewritten (import torch, then torch.set_default_device('npu') and "
            "torch.set_default_dtype(torch.float32))"])
        # a notebook cell or snippet that names torch: torch is there
        self.assertCodemod("torch.set_default_tensor_type(torch.cuda.FloatTensor)\n",
                           'torch.set_default_device("npu")\ntorch.set_default_dtype(torch.float32)\n')


LEGACY_DEFAULT = __import__("npukit.migrate.rules", fromlist=["rules"]).LEGACY_CONSTRUCTOR_DEFAULT.reason + \
    " (" + __import__("npukit.migrate.rules", fromlist=["rules"]).LEGACY_CONSTRUCTOR_DEFAULT.suggestion + ")"


def test_default_tensor_type_as_a_libcst_codemod_test():
    DefaultTensorTypeCase().runTest()


def test_legacy_constructors_are_reported_where_the_default_tensor_type_was_cuda():
    code = ("import torch\ntorch.set_default_tensor_type(torch.cuda.DoubleTensor)\nw = torch.Tensor(4, 4)\n"
            "b = torch.FloatTensor()\n")
    assert _warned_kinds(code) == ["2:1 legacy-constructor", "2:1 fp64", "3:5 legacy-constructor"]
    # another file of a tree where one file made a CUDA type the default: npu-migrate's tree facts
    other = "import torch\nw = torch.nn.Parameter(torch.Tensor(8, 8))\n"
    assert run_builtin_codemods(other, "layers.py", (DefaultTensorType,))[1] == []
    _, findings, _ = run_builtin_codemods(other, "layers.py", (DefaultTensorType,), TreeFacts(cuda_default_tensor_type=True))
    assert [(f.line, f.col, f.kind) for f in findings] == [(2, 24, "legacy-constructor")]
    # the tensor type it rewrites is left to it: no other rule renames or reports it
    migrated = migrate_python(code, "train.py")
    assert sorted((f.line, f.kind) for f in migrated.findings) == [(2, "fp64"), (2, "legacy-constructor"),
                                                                   (3, "legacy-constructor")]


def _warned_kinds(code: str) -> list[str]:
    context = CodemodContext(filename="train.py")
    DefaultTensorType(context).transform_module(cst.parse_module(code))
    return [f"{w.split()[0].rstrip(':')} {w.split()[2].rstrip(':')}" for w in context.warnings]


@pytest.mark.parametrize(("code", "expected"), [
    ('import torch\nm = torch.compile(model, mode="reduce-overhead")\nn = torch.compile(model)\n', ["2:5 compile"]),
    ("from torch import compile as tc\nm = tc(model, fullgraph=True, mode='max-' 'autotune')\n", ["2:5 compile"]),
    ('import torch\nm = torch.compile(model, mode="default")\nmode = "reduce-overhead"\n', []),
])
def test_cuda_graph_compile_modes_are_reported(code, expected):
    assert _warned(CompileModes, code) == expected


def test_a_cuda_graph_mode_is_reported_as_such_not_as_torch_compile_in_general():
    """The names rules' general torch.compile note would take the same place: the codemod claims the name."""
    code = 'import torch\nm = torch.compile(model, mode="max-autotune")\nn = torch.compile(model)\n'
    findings = [(f.line, f.kind, f.severity) for f in migrate_python(code, "train.py").findings]
    assert findings == [(2, "compile", "warning"), (3, "compile", "info")]


@pytest.mark.parametrize(("code", "expected"), [
    ("import torch\nd = x.to_dense()\ns = torch.randn(3).to_sparse(sparse_dim=1)\nu = x.unique_consecutive\n",
     ["2:5 unsupported-api", "3:5 unsupported-api"]),  # a reference is not a call
    ("import torch\nimport mylib\nd = mylib.to_dense(x)\nv = x.to(device)\n", []),  # a module's function
])
def test_unsupported_tensor_methods_are_reported(code, expected):
    assert _warned(UnsupportedTensorMethods, code) == expected


def test_third_party_cuda_under_libcsts_tool_knows_the_projects_own_packages(tmp_path):
    """With no tree facts, the project's own packages are those absolute imports find between the
    file and the project's root: `mamba_ssm` is the project's, `triton` is not, although the project
    has a sub-package named triton."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'm'\n")
    for package in ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    code = "import triton\nfrom mamba_ssm.ops.triton import layer_norm\nimport causal_conv1d\n"
    for path in (tmp_path / "tests" / "test_norm.py", tmp_path / "mamba_ssm" / "ops" / "triton" / "k.py"):
        path.write_text(code)
        context = CodemodContext(filename=str(path))
        ThirdPartyCuda(context).transform_module(cst.parse_module(code))
        assert [w.split()[2].rstrip(":") for w in context.warnings] == ["triton", "cuda-only-library"], path
    assert len(_warned(ThirdPartyCuda, code)) == 3  # a file of a project without mamba_ssm: all three reported


class AutocastGpuDtypeCase(CodemodTest):
    TRANSFORM = AutocastGpuDtype

    def runTest(self):  # noqa: N802 (unittest's name)
        self.assertCodemod("import torch\nd = torch.get_autocast_gpu_dtype()\ntorch.set_autocast_gpu_dtype(d)\n",
                           'import torch\nd = torch.get_autocast_dtype("npu")\ntorch.set_autocast_dtype("npu", d)\n')
        self.assertCodemod("import torch as th\nfrom torch import get_autocast_gpu_dtype as g\nd = g()\n",
                           'import torch as th\nfrom torch import get_autocast_gpu_dtype as g\nd = th.get_autocast_dtype("npu")\n')
        # torch never imported: `torch` would be a new name, so the call is reported and left
        code = "from torch import get_autocast_gpu_dtype as g\nd = g()\n"
        self.assertCodemod(code, code, expected_warnings=[
            "2:5: warning amp-upgrade: torch.get_autocast_gpu_dtype means CUDA's autocast dtype; torch is not "
            'imported by name here, so it was not rewritten (import torch and call torch.get_autocast_dtype("npu", ...))'])


def test_autocast_gpu_dtype_as_a_libcst_codemod_test():
    AutocastGpuDtypeCase().runTest()


class CudaMethodsCase(CodemodTest):
    TRANSFORM = CudaMethods

    def runTest(self):  # noqa: N802 (unittest's name)
        # called, referenced, the property; on any value, also `torch.Tensor.cuda` itself
        self.assertCodemod("x = x.cuda()\nf = model.cuda\nif x.is_cuda:\n    y = batch[0].cuda(non_blocking=True)\n"
                           "import torch\nm = torch.Tensor.cuda\n",
                           "x = x.npu()\nf = model.npu\nif x.is_npu:\n    y = batch[0].npu(non_blocking=True)\n"
                           "import torch\nm = torch.Tensor.npu\n")
        # an uncalled `.cuda` as a condition, a configuration flag, or in a file where `cuda` is data
        self.assertCodemod("if net.cuda and args.cuda:\n    net = net.cuda()\nuse = opt.cuda\n",
                           "if net.cuda and args.cuda:\n    net = net.npu()\nuse = opt.cuda\n")
        self.assertCodemod("p.add_argument('--cuda')\nf = model.cuda\nmodel.cuda()\n",
                           "p.add_argument('--cuda')\nf = model.cuda\nmodel.npu()\n")
        self.assertCodemod("self.cuda = True\nf = model.cuda\n", "self.cuda = True\nf = model.cuda\n")
        unchanged = [
            "import torch\ntorch.cuda.synchronize()\n",  # the namespace rules' business
            "import numba\n@numba.cuda.jit\ndef k():\n    pass\n",  # another module's attribute
            "x.is_cuda = True\ndel y.is_cuda\n",  # Tensor.is_cuda cannot be set: the user's attribute
            "print('no CUDA here')\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)
        # the user's own cuda() and is_cuda: on self, super(), C(...) and a name assigned C(...)
        code = ("class Box:\n    def cuda(self):\n        return self\n    def go(self):\n        return self.cuda()\n"
                "class Flag:\n    def __init__(self):\n        self.is_cuda = False\n"
                "b = Box()\nb.cuda()\nBox().cuda()\nFlag().is_cuda\nt.cuda()\n")
        self.assertCodemod(code, code.replace("t.cuda()", "t.npu()"), expected_warnings=[
            f"{line}:{col}: info {flag.kind}: {flag.reason} ({flag.suggestion})"
            for line, col, flag in [
                (5, 16, USER_CUDA_METHOD), (10, 1, USER_CUDA_METHOD), (11, 1, USER_CUDA_METHOD),
                (12, 1, USER_CUDA_ATTRIBUTE)]])
        # a module name rebound to a value: decided by the binding that reaches the use
        code = ("import model\nmodel = model.Net()\nmodel = model.cuda()\n"
                "def f():\n    model.cuda(0, True, x)\n    return model.cuda()\n")
        self.assertCodemod(code, code.replace("model = model.cuda()", "model = model.npu()")
                           .replace("return model.cuda()", "return model.npu()"), expected_warnings=[
            "5:5: warning ambiguous-cuda: `model.cuda`: `model` is both an imported module and a variable in this "
            "file, so this may or may not be the tensor/module .cuda() method; it was left unchanged (change it to "
            ".npu() if it moves a tensor or module to the device)"])
        code = "import model\nnet = model.cuda\n"  # a module's attribute, the module never rebound
        self.assertCodemod(code, code)


def test_cuda_methods_as_a_libcst_codemod_test():
    CudaMethodsCase().runTest()


def test_the_trees_classes_with_their_own_cuda_come_through_the_codemod_context():
    code = "from lib import Box\nb = Box()\nb.cuda()\nx.cuda()\n"
    tree = TreeFacts(cuda_method_classes=frozenset({"Box"}))
    edits, findings, _ = run_builtin_codemods(code, "train.py", (CudaMethods,), tree)
    assert [(e.line, e.text) for e in edits] == [(4, "npu")]
    assert [(f.line, f.kind) for f in findings] == [(3, "user-cuda-method")]
    assert [e.line for e in run_builtin_codemods(code, "train.py", (CudaMethods,))[0]] == [3, 4]  # one file alone


@pytest.mark.parametrize(("code", "whole_file"), [
    ("import torch\nx = torch.ones(2)\ny = x.cuda()\n", False),  # decided by its statement alone
    ("import torch\nclass Box:\n    def cuda(self):\n        pass\ny = x.cuda()\n", True),  # the file's classes
    ("import torch\nself_cuda = 1\nx.cuda = f\ny = z.cuda()\n", True),  # `cuda` is data
    ("import numba\ny = x.cuda()\nk = numba.cuda.jit\n", True),  # whether numba is still the module
    ("import torch\ntorch.cuda.synchronize()\n", None),  # nothing of its own: no parse
])
def test_cuda_methods_ask_for_the_whole_file_only_when_the_file_decides(code, whole_file):
    assert _asks_for_whole_file(CudaMethods, code) is whole_file


def _asks_for_whole_file(codemod, code: str) -> bool | None:
    """Whether npu-migrate parses all of the file for this codemod (None: none of it)."""
    migrator = PythonMigrator(code, "train.py")
    migrator._build_bindings()
    found = codemod.candidates(migrator)
    return None if not found else any(node is migrator.tree for node in found)


class DistributedBackendsCase(CodemodTest):
    TRANSFORM = DistributedBackends

    def runTest(self):  # noqa: N802 (unittest's name)
        # the backend argument, through the imports; prefix and quotes kept; device:backend pairs
        self.assertCodemod("import torch.distributed as dist\nfrom torch.distributed import init_process_group as ipg\n"
                           "dist.init_process_group(backend='nccl')\nipg(r\"cuda:nccl,cpu:gloo\")\n"
                           "dist.new_group(backend='gloo' if cpu else \"\"\"nccl\"\"\")\n",
                           "import torch.distributed as dist\nfrom torch.distributed import init_process_group as ipg\n"
                           "dist.init_process_group(backend='hccl')\nipg(r\"npu:hccl,cpu:gloo\")\n"
                           "dist.new_group(backend='gloo' if cpu else \"\"\"hccl\"\"\")\n")
        # comparisons with an expression, argparse defaults and choices, a device's startswith
        self.assertCodemod("if args.backend == 'nccl' or b in ('nccl', 'gloo'):\n    pass\n"
                           "p.add_argument('--dist', default='nccl', choices=['nccl', 'gloo'])\n"
                           "ok = device.startswith(('cuda', 'nccl'))\n",
                           "if args.backend == 'hccl' or b in ('hccl', 'gloo'):\n    pass\n"
                           "p.add_argument('--dist', default='hccl', choices=['hccl', 'gloo'])\n"
                           "ok = device.startswith(('cuda', 'hccl'))\n")
        # variables: named like a backend, or flowing into a backend argument (scopes respected)
        self.assertCodemod("import torch.distributed as dist\ndist_backend = 'nccl'\npg = 'nccl'\nother = 'nccl'\n"
                           "def setup(kind='nccl'):\n    other = 'gloo'\n    dist.init_process_group(pg, rank=0)\n"
                           "    dist.new_group(backend=kind)\n    dist.new_group(backend=other)\n"
                           "cfg = {'backend': 'nccl'}\nkw['dist_backend'] = 'nccl'\nd = dict(backend='nccl')\n",
                           "import torch.distributed as dist\ndist_backend = 'hccl'\npg = 'hccl'\nother = 'nccl'\n"
                           "def setup(kind='hccl'):\n    other = 'gloo'\n    dist.init_process_group(pg, rank=0)\n"
                           "    dist.new_group(backend=kind)\n    dist.new_group(backend=other)\n"
                           "cfg = {'backend': 'hccl'}\nkw['dist_backend'] = 'hccl'\nd = dict(backend='hccl')\n",
                           expected_warnings=["4:9: info backend-string: 'nccl' is not in a recognised backend position "
                                              "and was left unchanged (change it to 'hccl' by hand if it names the "
                                              "process-group backend)"])
        unchanged = [
            '"""Uses nccl."""\nimport torch\n',  # a docstring
            "import torch\nprint('nccl')\nlogger.info('backend %s', 'nccl')\nraise ValueError('nccl')\n",  # messages
            "import torch\ntable = {'nccl': 1}\n",  # a dict key
            "import torch\nb = 'nccl' if x else 'cuda'\n",  # a device value: the device rules' business
            "import torch.distributed as dist\ndist.init_process_group(backend='n\\x63cl')\n",  # escapes: left
            "import torch.distributed as dist\ndist.init_process_group(backend=b'nccl')\n",  # bytes
            "print('no backend here')\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


class CudaNamespaceCase(CodemodTest):
    TRANSFORM = CudaNamespace

    def runTest(self):  # noqa: N802 (unittest's name)
        # chains through any alias; renamed names; same-name submodule members
        self.assertCodemod("import torch as th\nth.cuda.synchronize()\ng = th.cuda.CUDAGraph()\n"
                           "th.cuda.memory._record_memory_history()\nth.cuda.nvtx.range_push('a')\n",
                           "import torch as th\nth.npu.synchronize()\ng = th.npu.NPUGraph()\n"
                           "th.npu.memory._record_memory_history()\nth.npu.mstx.range_push('a')\n")
        # imports of torch.cuda retargeted in place: the names they bind keep their spelling
        self.assertCodemod("import torch.cuda as tc\nfrom torch.cuda import Stream, CUDAGraph as G\ntc.synchronize()\n"
                           "s = Stream()\n",
                           "import torch_npu.npu as tc\nfrom torch_npu.npu import Stream, NPUGraph as G\ntc.synchronize()\n"
                           "s = Stream()\n")
        # a from-import that now needs two modules is split, each statement on a line of its own
        self.assertCodemod("if x:\n    from torch.cuda import synchronize, comm\n",
                           "if x:\n    from torch_npu.npu import synchronize\n    from torch.cuda import comm\n",
                           expected_warnings=[f"2:5: error no-equivalent: {NO_COMM.reason} ({NO_COMM.suggestion})"])
        # allow_tf32 becomes allow_hf32, with the precision note
        tf32 = rules.RENAME_NOTES["torch.backends.cuda.matmul.allow_tf32"]
        self.assertCodemod("import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n",
                           "import torch\ntorch.npu.matmul.allow_hf32 = True\n",
                           expected_warnings=[f"2:1: {tf32.severity} {tf32.kind}: {tf32.reason} ({tf32.suggestion})"])
        unchanged = [
            "import torch\nx = torch.npu.synchronize()\n",
            "import numba\nk = numba.cuda.jit\n",  # another library's cuda
            "x = y.cuda()\n",  # a value's: CudaMethods'
            "print('no CUDA here')\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_distributed_backends_as_a_libcst_codemod_test():
    DistributedBackendsCase().runTest()


@pytest.mark.parametrize(("code", "expected"), [
    # a backend a CUDA availability test picks, which the migration turns into the NPU's test
    ("import torch\nname = 'gloo' if not torch.cuda.is_available() else 'nccl'\nprint(name)\n",
     ["2:53 backend-choice"]),
    ("import torch\nname = ('nccl' if ok else 'mpi') if torch.cuda.is_available() else 'gloo'\n",
     ["2:9 backend-choice"]),
    # the backend read from the user's configuration: where it comes from is reported
    ("import torch.distributed as dist\ndist.init_process_group(backend=args.dist_backend)\n",
     ["2:33 backend-string"]),
    ("import torch.distributed as dist\ndist.init_process_group(backend=dist.Backend.NCCL)\n", []),  # torch's own
    # a backend spelled over adjacent literals is not rewritten: reported with the other "nccl"s
    ("import torch\nb = 'nccl'\nbackend = 'nc' 'cl'\n", ["2:5 backend-string", "3:11 backend-string"]),
])
def test_distributed_backends_reports_what_it_leaves(code, expected):
    assert _warned(DistributedBackends, code) == expected


@pytest.mark.parametrize(("code", "whole_file"), [
    ("import torch.distributed as dist\nb = 'nccl'\ndist.init_process_group(backend='nccl')\n", False),
    # `pg` may flow from one statement into another's backend argument
    ("import torch.distributed as dist\npg = 'nccl'\ndef f():\n    dist.init_process_group(pg)\n", True),
    ("import torch.distributed as dist\ndist.init_process_group(args.backend)\n", False),  # reported: its statement
    ("import torch.distributed as dist\ndist.init_process_group(backend)\n", None),  # nothing of its own: no parse
])
def test_distributed_backends_ask_for_the_whole_file_only_for_flows(code, whole_file):
    assert _asks_for_whole_file(DistributedBackends, code) is whole_file


def test_libcsts_tool_runs_distributed_backends(tmp_path):
    text, warnings = _libcst_tool(tmp_path, "DistributedBackends", "import torch.distributed as dist\nbackend = 'nccl'\n"
                                                                   "dist.init_process_group(backend)\nx = 'nccl'\n")
    assert text == "import torch.distributed as dist\nbackend = 'hccl'\ndist.init_process_group(backend)\nx = 'nccl'\n"
    assert "4:5: info backend-string: 'nccl' is not in a recognised backend position" in warnings


@pytest.mark.parametrize(("code", "expected"), [
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--no-cuda', '--CUDA', action='store_true')\n"
     "p.add_argument('-c', '--use_' 'cuda', type=int)\n",
     ["3:16 cli-flag", "3:29 cli-flag", "4:22 cli-flag"]),  # every spelling of a flag, adjacent literals too
    ("p.add_argument('cuda')\np.add_argument('--device', default='cuda')\np.add_argument(*['--cuda'])\n"
     "p.add_option('--cuda')\nadd_argument('--cuda')\n", []),  # a positional's name, a value, not argparse's
])
def test_cuda_cli_flags_are_reported_and_keep_their_names(code, expected):
    assert _warned(CudaCliFlags, code) == expected


NO_COMM = rules.CUDA_FLAGGED["torch.cuda.comm"]


def test_cuda_namespace_as_a_libcst_codemod_test():
    CudaNamespaceCase().runTest()


@pytest.mark.parametrize(("code", "expected"), [
    # names without an NPU answer: the table's kinds, or unknown-cuda-api
    ("import torch\nt = torch.cuda.temperature()\nx = torch.cuda.not_a_cuda_api\n",
     ["2:5 no-equivalent", "3:5 unknown-cuda-api"]),
    ("import torch\nif torch.version.cuda:\n    torch.backends.cudnn.benchmark = True\n", ["2:4 version-gate", "3:5 no-op"]),
    # an import of a name torch_npu.npu lacks is reported where it is; its uses through the alias too
    ("import torch.cuda._pin_memory_utils as pin\n", ["1:1 unknown-cuda-api"]),
    ("import torch.cuda as tc\nx = tc.jiterator\ny = tc.not_a_cuda_api\n", ["2:5 no-equivalent", "3:5 unknown-cuda-api"]),
    # mixing renamed names with others, with a comment inside: not split, reported
    ("from torch.cuda import (synchronize,  # wait\n    comm)\n", ["1:1 no-equivalent", "1:1 import-split"]),
    ("import torch\nf = torch.npu.synchronize\n", []),
])
def test_cuda_namespace_reports_what_it_does_not_rewrite(code, expected):
    context = CodemodContext(filename="train.py")
    CudaNamespace(context).transform_module(cst.parse_module(code))
    assert [f"{w.split()[0].rstrip(':')} {w.split()[2].rstrip(':')}" for w in context.warnings] == expected


class AmpUpgradeCase(CodemodTest):
    TRANSFORM = AmpUpgrade

    def runTest(self):  # noqa: N802 (unittest's name)
        # autocast's positional arguments become keywords: torch.amp.autocast's first parameter is the device
        self.assertCodemod("import torch\nwith torch.cuda.amp.autocast(True, torch.float16):\n    pass\n"
                           "s = torch.cuda.amp.GradScaler(init_scale=2.0)\n",
                           'import torch\nwith torch.amp.autocast("npu", enabled=True, dtype=torch.float16):\n    pass\n'
                           's = torch.amp.GradScaler("npu", init_scale=2.0)\n')
        # custom_fwd / custom_bwd: called or bare decorators get device_type
        self.assertCodemod("import torch\n@torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)\ndef f(x):\n    pass\n"
                           "@torch.cuda.amp.custom_bwd\ndef g(x):\n    pass\n",
                           'import torch\n@torch.amp.custom_fwd(cast_inputs=torch.float32, device_type="npu")\n'
                           'def f(x):\n    pass\n@torch.amp.custom_bwd(device_type="npu")\ndef g(x):\n    pass\n')
        # torch.cuda.amp.GradScaler has no device: values unpacked into it come after the NPU
        self.assertCodemod("import torch\ns = torch.cuda.amp.GradScaler(*options)\n",
                           'import torch\ns = torch.amp.GradScaler("npu", *options)\n')
        unchanged = [
            'import torch\nwith torch.amp.autocast("npu"):\n    pass\n',
            "import torch\ns = torch.amp.GradScaler\n",
            "from apex import amp\nm, o = amp.initialize(m, o)\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)
        # autocast(*args): the unpacked values cannot be given their names; reported, not rewritten
        # (it became `enabled=*args`, which does not parse: an internal error, the file left alone)
        code = "import torch\nwith torch.cuda.amp.autocast(*args):\n    pass\n"
        self.assertCodemod(code, code, expected_warnings=[
            "2:6: warning amp-upgrade: autocast's arguments are unpacked from a sequence (`*args`): torch.amp.autocast "
            "takes the device first and dtype before enabled, so the call was left as it is (pass them by name: "
            'torch.amp.autocast("npu", enabled=..., dtype=..., cache_enabled=...))'])


def test_amp_upgrade_as_a_libcst_codemod_test():
    AmpUpgradeCase().runTest()


def test_a_grad_scaler_imported_from_torch_cuda_amp_gets_the_npu_before_unpacked_arguments():
    """It became `GradScaler(*options)` of torch.amp, whose first parameter is the device."""
    outcome = migrate_python("from torch.cuda.amp import GradScaler\ns = GradScaler(*options)\n", "train.py")
    assert outcome.text == 'import torch_npu\nfrom torch.amp import GradScaler\ns = GradScaler("npu", *options)\n'


@pytest.mark.parametrize(("code", "expected"), [
    # every use of the imported name can be given the device: the import becomes torch.amp's
    ("from torch.cuda.amp import autocast, GradScaler\nwith autocast():\n    pass\ns = GradScaler()\n",
     'from torch.amp import autocast, GradScaler\nwith autocast("npu"):\n    pass\ns = GradScaler("npu")\n'),
    ("from torch.cuda.amp import custom_fwd\n@custom_fwd\ndef f(x):\n    pass\n",
     'from torch.amp import custom_fwd\n@custom_fwd(device_type="npu")\ndef f(x):\n    pass\n'),
    # one use cannot be (a value passed around): torch_npu.npu.amp's, which defaults to the NPU
    ("from torch.cuda.amp import autocast\nctx = autocast\nwith autocast():\n    pass\n",
     "from torch_npu.npu.amp import autocast\nctx = autocast\nwith autocast():\n    pass\n"),
])
def test_amp_imports_are_retargeted_by_how_their_names_are_used(code, expected):
    assert migrate_python(code, "train.py").text == "import torch_npu\n" + expected


@pytest.mark.parametrize(("code", "expected"), [
    ("import torch\nwith torch.backends.cuda.sdp_kernel(enable_flash=True):\n    pass\n", ["2:6 unsupported-api"]),
    ("from torch.cuda import comm\nout = comm.gather(xs)\n", ["2:7 unsupported-api"]),
    # only a type: isinstance, except, annotations
    ("from torch.nn.utils.rnn import PackedSequence as P\nimport torch\n"
     "ok = isinstance(x, (P, int)) or torch.cuda.comm.scatter\n"
     "def f(x: 'int', y: Optional[torch.cuda.comm.gather] = None) -> None:\n    pass\n",
     ["3:33 unsupported-api"]),
    ("import torch\nx = torch.nn.DataParallel(m)\n", []),  # in CUDA_FLAGGED: CudaNamespace's finding
])
def test_unsupported_apis_are_reported_where_they_are_used(code, expected):
    assert _warned(UnsupportedApis, code) == expected


def test_a_flagged_name_from_an_import_keeps_its_condition_whole_called_or_not():
    """A name imported from torch.cuda that has no NPU answer (get_device_capability) leaves its
    condition as it was, whether it is called there or only named."""
    code = ("import torch\nfrom torch.cuda import get_device_capability as cap\n"
            "bf16 = torch.cuda.is_available() and cap()[0] >= 8\nprobe = torch.cuda.is_available() and cap\n")
    outcome = migrate_python(code, "train.py")
    assert outcome.text == code
    assert [(f.line, f.col, f.kind) for f in outcome.findings] == [
        (2, 1, "device-capability"), (3, 8, "mixed-condition"), (3, 38, "device-capability"),
        (4, 9, "mixed-condition"), (4, 39, "device-capability")]


@pytest.mark.parametrize("codemod", ["CudaNamespace", "AmpUpgrade", "UnsupportedApis"])
def test_libcsts_tool_runs_the_name_codemods(tmp_path, codemod):
    (tmp_path / "src").mkdir()
    code = ("import torch\ntorch.cuda.synchronize()\nwith torch.cuda.amp.autocast():\n    pass\n"
            "torch.backends.cuda.enable_flash_sdp(False)\n")
    (tmp_path / "src" / "train.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "-x",
                          f"npukit.migrate.codemods.{codemod}", "src"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    # alone, CudaNamespace gives amp's autocast torch_npu.npu.amp's (AmpUpgrade, before it, claims it)
    expected = {"CudaNamespace": code.replace("torch.cuda.", "torch.npu."),
                "AmpUpgrade": code.replace("torch.cuda.amp.autocast()", 'torch.amp.autocast("npu")'),
                "UnsupportedApis": code}[codemod]
    assert (tmp_path / "src" / "train.py").read_text() == expected
    assert ("5:1: warning unsupported-api" in run.stderr) == (codemod == "UnsupportedApis")


class _Order(cst.CSTVisitor):
    def __init__(self) -> None:
        self.order: list[tuple[str, int]] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.order.append(("visit", id(node)))
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.order.append(("leave", id(original_node)))


class _OrderOfThePass(_OnePass):
    """The built-in codemods' pass, with one handler for every node that notes the order."""

    def __init__(self) -> None:
        super().__init__([])
        self.noted = _Order()

    def _handlers(self, node_type: type) -> tuple[list, list]:
        return [self.noted.on_visit], [lambda node, _: self.noted.on_leave(node)]


@pytest.mark.parametrize("folder", ["npukit/migrate", "tests/migrate"])
def test_the_codemods_pass_visits_nodes_in_libcsts_order(folder):
    """The built-in codemods' pass walks the tree itself (libcst's visit rebuilds every node): it
    calls their visit_ and leave_ methods in the order libcst's own visit would."""
    for path in sorted((REPO / folder).rglob("*.py")):
        module = cst.parse_module(path.read_text(encoding="utf-8"))
        libcsts = _Order()
        module.visit(libcsts)
        walked = _OrderOfThePass()
        walked.walk(module)
        assert walked.noted.order == libcsts.order, path


@pytest.mark.parametrize(("code", "with_torch"), [
    ("from torch.backends import cudnn\ncudnn.allow_tf32 = True\n", "torch.npu.conv.allow_hf32 = True"),
    ("from torch.cuda.amp import custom_fwd\n@custom_fwd\ndef f(x):\n    pass\nwrap(custom_fwd)\n",
     '@torch.amp.custom_fwd(device_type="npu")'),
])
def test_a_name_is_not_rewritten_through_torch_where_the_file_never_imports_torch(code, with_torch):
    """`torch.npu.conv.allow_hf32` / `@torch.amp.custom_fwd(...)` written into a file that reaches torch
    only through `from torch... import` would be a NameError (the ast engine wrote them); the line is
    left (the audit reports what stays CUDA). With torch imported, it is rewritten."""
    migrated = migrate_python(code, "train.py").text
    assert "torch." not in migrated.replace("from torch", "").replace("torch_npu.", "")
    assert with_torch in migrate_python("import torch\n" + code, "train.py").text


def test_custom_fwd_with_a_line_break_in_its_parentheses_gets_its_device_type():
    """torch.amp.custom_fwd's device_type is a required keyword: the ast engine renamed
    `@torch.cuda.amp.custom_fwd(\\n)` without adding it (a TypeError when the module is imported)."""
    code = "import torch\n@torch.cuda.amp.custom_fwd(  # half\n)\ndef f(x):\n    pass\n"
    assert migrate_python(code, "train.py").text == ('import torch_npu\nimport torch\n@torch.amp.custom_fwd(  # half\n'
                                                     'device_type="npu")\ndef f(x):\n    pass\n')


class DeviceStringsCase(CodemodTest):
    TRANSFORM = DeviceStrings

    def runTest(self):  # noqa: N802 (unittest's name)
        # device arguments, through the imports; prefix and quotes kept; templates, formats, conditionals
        self.assertCodemod("import torch as th\nx = th.device('cuda')\ny = t.to(r\"cuda:1\")\nz = th.zeros(2, device=f'cuda:{rank}')\n"
                           "m = th.load(f, map_location={'cuda:1': 'cuda:0'})\nw = t.to('cuda:%d' % i)\n"
                           "v = t.to('cuda:{}'.format(i))\nu = t.to('cuda' if ok else 'cpu')\n",
                           "import torch as th\nx = th.device('npu')\ny = t.to(r\"npu:1\")\nz = th.zeros(2, device=f'npu:{rank}')\n"
                           "m = th.load(f, map_location={'npu:1': 'npu:0'})\nw = t.to('npu:%d' % i)\n"
                           "v = t.to('npu:{}'.format(i))\nu = t.to('npu' if ok else 'cpu')\n")
        # comparisons with a device, startswith, argparse, a conditional on CUDA's availability
        self.assertCodemod("import torch\nif x.device.type == 'cuda' or args.device in ('cuda', 'cpu'):\n    pass\n"
                           "ok = dev.startswith('cuda')\np.add_argument('--d', default='cuda', choices=['cuda', 'cpu'])\n"
                           "name = 'cuda' if torch.cuda.is_available() else 'cpu'\n",
                           "import torch\nif x.device.type == 'npu' or args.device in ('npu', 'cpu'):\n    pass\n"
                           "ok = dev.startswith('npu')\np.add_argument('--d', default='npu', choices=['npu', 'cpu'])\n"
                           "name = 'npu' if torch.cuda.is_available() else 'cpu'\n")
        # variables: named like a device, or flowing into a device use (scopes respected); dict entries
        self.assertCodemod("import torch\ndevice = 'cuda'\nkind = 'cuda'\nother = 'cuda'\n"
                           "def run(where='cuda', *, dev='cuda'):\n    other = 'cpu'\n    t.to(kind)\n    t.to(where)\n"
                           "    t.to(other)\ncfg = {'device': 'cuda'}\nkw['device_type'] = 'cuda'\nself.gpu_dev = 'cuda'\n",
                           "import torch\ndevice = 'npu'\nkind = 'npu'\nother = 'cuda'\n"
                           "def run(where='npu', *, dev='npu'):\n    other = 'cpu'\n    t.to(kind)\n    t.to(where)\n"
                           "    t.to(other)\ncfg = {'device': 'npu'}\nkw['device_type'] = 'npu'\nself.gpu_dev = 'npu'\n",
                           expected_warnings=["4:9: info device-string: 'cuda' is assigned to `other` but not seen flowing "
                                              "into a device use (if it is a device, change it to 'npu' by hand)"])
        # a "cuda:0" says by itself it is a device: rewritten, and not also reported as a "cuda" left
        # unchanged (it was both)
        self.assertCodemod("import torch\nname = 'cuda:0'\n", "import torch\nname = 'npu:0'\n", expected_warnings=[])
        # this file's own functions' device parameters; "cuda:..." texts anywhere in code
        self.assertCodemod("def setup(model, device):\n    return model\nsetup(m, 'cuda')\nparts = ['cuda:0']\n"
                           "where = f'cuda:{rank}'\n",
                           "def setup(model, device):\n    return model\nsetup(m, 'npu')\nparts = ['npu:0']\n"
                           "where = f'npu:{rank}'\n")
        unchanged = [
            '"""Runs on cuda."""\nimport torch\n',  # a docstring
            "import torch\nprint('cuda:0')\nlogger.info('on %s', 'cuda')\nraise ValueError('cuda:0')\n",  # messages
            "import torch\ntable = {'cuda:0': 1, f'cuda:{i}': 2}\n",  # dict keys
            "import torch\nx = t.to('cu\\x64a')\n",  # escapes: left
            "import torch\nx = t.to(b'cuda')\n",  # bytes
            "import torch\nx = t.to('cuda' 'x')\n",  # not a device value
            "x = t.to(0)\n",  # an ordinal: IntDeviceOrdinals'
            "print('no device here')\n",
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_device_strings_as_a_libcst_codemod_test():
    DeviceStringsCase().runTest()


@pytest.mark.parametrize(("code", "expected"), [
    # a bare "cuda" seen nowhere near a device use; a variable holding one that flows nowhere
    ("import torch\nbackends = ['cuda', 'cpu']\nkind = 'cuda'\n", ["3:8 device-string", "2:13 device-string"]),
    # a device string meant for a CUDA-only library the file imports
    ("import torch\nfrom isaacgym import gymapi\nargs.sim_device = 'cuda:0'\n", ["3:19 cuda-only-device"]),
    ("import torch\nimport warp as wp\nwp.zeros(3, device='cuda')\n", ["3:20 cuda-only-device"]),
    ("import torch\nprint('cuda')\n", []),
])
def test_device_strings_reports_what_it_leaves(code, expected):
    assert _warned(DeviceStrings, code) == expected


@pytest.mark.parametrize(("code", "whole_file"), [
    ("import torch\nx = t.to('cuda')\ny = 'cuda:0'\n", False),
    ("import torch\ndevice = 'cuda'\ndef f():\n    t.to(device)\n", False),  # named like a device: no flow needed
    # `kind` may flow from one statement into another's device use
    ("import torch\nkind = 'cuda'\ndef f():\n    t.to(kind)\n", True),
    # a device literal may be passed to a function defined in another statement
    ("import torch\ndef setup(device):\n    pass\nsetup('cuda')\n", True),
    ("import torch\nx = t.to(device)\n", None),  # no device literal: no parse
    # a dict holding one is not a device value; the file's function called without one
    ("import torch\nopts = {'a': 'cuda'}\ndef g():\n    t.to(opts)\n", False),
    ("import torch\ndef f(model, device):\n    pass\nf(m, d)\nx = t.to('cuda')\n", False),
    ("import torch\ndef f(model, device):\n    pass\nkind = 'cuda' if ok else 'cpu'\nf(m, kind)\n", True),
])
def test_device_strings_ask_for_the_whole_file_only_for_flows(code, whole_file):
    assert _asks_for_whole_file(DeviceStrings, code) is whole_file


@pytest.mark.parametrize(("code", "whole_file"), [
    ("import torch\nx = t.to(rank)\ny = torch.zeros(1, device=0)\nz = torch.device(args.local_rank)\n", False),
    ("import torch\nx = t.to(y)\nz = torch.zeros(1, device=dev)\nw = t.to(torch.float16)\n", None),
])
def test_int_device_ordinals_parse_only_the_statements_with_an_ordinal(code, whole_file):
    assert _asks_for_whole_file(IntDeviceOrdinals, code) is whole_file


def test_one_flows_fact_serves_the_device_and_backend_codemods():
    code = ("import torch\nimport torch.distributed as dist\nkind = 'cuda'\npg = 'nccl'\nt.to(kind)\n"
            "dist.init_process_group(pg)\n")
    context = CodemodContext(filename="train.py")
    edits, findings, _ = run_builtin_codemods(code, "train.py", (DeviceStrings, DistributedBackends), context=context)
    facts = context.scratch[FACTS_KEY]
    assert {name for _, name in facts.flows.device} == {"kind"} and {name for _, name in facts.flows.backend} == {"pg"}
    assert sorted((e.rule, e.text) for e in edits) == [("backend-string", "'hccl'"), ("device-variable", "npu")]
    assert findings == []


class IntDeviceOrdinalsCase(CodemodTest):
    TRANSFORM = IntDeviceOrdinals

    def runTest(self):  # noqa: N802 (unittest's name)
        self.assertCodemod("import torch\nx = t.to(0)\ny = t.to(args.local_rank)\nz = torch.zeros(1, device=int(r))\n"
                           "d = torch.device(local_rank)\nm.to_empty(device=0x1)\n",
                           "import torch\nx = t.to(\"npu:0\")\ny = t.to(f\"npu:{args.local_rank}\")\n"
                           "z = torch.zeros(1, device=f\"npu:{int(r)}\")\nd = torch.device(\"npu\", local_rank)\n"
                           "m.to_empty(device=\"npu:1\")\n")
        self.assertCodemod("x = t.to(cfg['rank'])\ny = t.to(ranks[\"gpu\"].rank)\n",
                           "x = t.to(cfg['rank'])\ny = t.to(f'npu:{ranks[\"gpu\"].rank}')\n")
        unchanged = [
            "import torch\nx = torch.device(0)\n",  # torch.device(0) is left: the device rules' literal
            "import torch\nx = t.to(step)\n",  # not named like an ordinal
            "import torch\nx = torch.ones(3).to(torch.float16)\n",  # a dtype
            "import torch\nx = torch.load(f, map_location=0)\n",  # only device= takes an ordinal
            "import torch\nfrom x import rank\ny = t.to(rank)\n",  # an import, not an ordinal
            "x = t.to(a['x' + \"y\"].rank)\n",  # no quote left for an f-string
        ]
        for code in unchanged:
            self.assertCodemod(code, code)


def test_int_device_ordinals_as_a_libcst_codemod_test():
    IntDeviceOrdinalsCase().runTest()


@pytest.mark.parametrize("codemod", ["DeviceStrings", "IntDeviceOrdinals"])
def test_libcsts_tool_runs_the_device_codemods(tmp_path, codemod):
    text, warnings = _libcst_tool(tmp_path, codemod, "import torch\nkind = 'cuda'\nx = t.to(kind)\ny = t.to(0)\n"
                                                     "z = 'cuda'\n")
    if codemod == "DeviceStrings":
        assert text == "import torch\nkind = 'npu'\nx = t.to(kind)\ny = t.to(0)\nz = 'cuda'\n"
        assert "5:5: info device-string: 'cuda' is assigned to `z` but not seen flowing into a device use" in warnings
    else:
        assert text == "import torch\nkind = 'cuda'\nx = t.to(kind)\ny = t.to(\"npu:0\")\nz = 'cuda'\n"
