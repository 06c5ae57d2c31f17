"""Safety of a whole-tree migration: what is written, what is left alone, and the modes."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from npukit.errors import UserError
from npukit.migrate import MigrateOptions, run_migration
from npukit.migrate.runner import unified_diff

TRAIN = 'import torch\nmodel = Net().cuda()\ntorch.cuda.synchronize()\n'
PLAIN = '"""No CUDA here."""\nimport torch\nx = torch.zeros(3)\n'


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text(TRAIN)
    (root / "pkg" / "plain.py").write_text(PLAIN)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "run.sh").write_text("CUDA_VISIBLE_DEVICES=0 python train.py --device cuda\n")
    (root / "README.md").write_text("Runs on cuda.\n")
    return root


def test_in_place_rewrites_and_leaves_the_rest_byte_identical(repo: Path) -> None:
    before = _snapshot(repo)
    run = run_migration(MigrateOptions(target=repo, quiet=True))
    after = _snapshot(repo)
    assert {r.path for r in run.changed} == {"train.py", "run.sh"}
    assert after["train.py"] == b'import torch_npu\nimport torch\nmodel = Net().npu()\ntorch.npu.synchronize()\n'
    for name in ("pkg/plain.py", "pkg/__init__.py", "README.md"):
        assert after[name] == before[name]
    # a second run changes nothing
    assert run_migration(MigrateOptions(target=repo, quiet=True)).changed == []
    assert _snapshot(repo) == after


def test_dry_run_diff_and_check_write_nothing(repo: Path) -> None:
    before = _snapshot(repo)
    for options in (MigrateOptions(target=repo, dry_run=True), MigrateOptions(target=repo, diff=True),
                    MigrateOptions(target=repo, check=True)):
        run = run_migration(options)
        assert len(run.changed) == 2
    assert _snapshot(repo) == before
    diff = unified_diff(run_migration(MigrateOptions(target=repo, diff=True)))
    assert "--- a/train.py\n+++ b/train.py\n" in diff
    assert "\n-model = Net().cuda()\n" in diff and "\n+model = Net().npu()\n" in diff


def test_out_copies_the_tree_and_keeps_the_source(repo: Path, tmp_path: Path) -> None:
    before = _snapshot(repo)
    out = tmp_path / "migrated"
    run_migration(MigrateOptions(target=repo, out=out, quiet=True))
    assert _snapshot(repo) == before
    copied = _snapshot(out)
    assert set(copied) == set(before)
    assert b".npu()" in copied["train.py"]
    assert copied["README.md"] == before["README.md"]


def test_out_refuses_a_non_empty_or_nested_folder(repo: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(UserError, match="not an empty folder"):
        run_migration(MigrateOptions(target=repo, out=busy))
    with pytest.raises(UserError, match="must not be inside"):
        run_migration(MigrateOptions(target=repo, out=repo / "migrated"))


def test_missing_target_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        run_migration(MigrateOptions(target=tmp_path / "nope"))


def test_encoding_bom_crlf_and_file_mode_are_kept(tmp_path: Path) -> None:
    latin = tmp_path / "latin.py"
    latin.write_bytes('# -*- coding: latin-1 -*-\nimport torch\nname = "é"\nx = t.cuda()\n'.encode("latin-1"))
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfimport torch\r\nx = t.cuda()\r\n")
    script = tmp_path / "tool.py"
    script.write_text("#!/usr/bin/env python\nimport torch\nx = t.cuda()\n")
    script.chmod(0o755)
    run_migration(MigrateOptions(target=tmp_path, quiet=True))
    assert latin.read_bytes() == '# -*- coding: latin-1 -*-\nimport torch_npu\nimport torch\nname = "é"\nx = t.npu()\n'.encode("latin-1")
    assert bom.read_bytes() == b"\xef\xbb\xbfimport torch_npu\r\nimport torch\r\nx = t.npu()\r\n"
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp files left


BAD_FILES = {
    "py2.py": b"import torch\nprint 'x'\nx = t.cuda()\n",
    "syntax.py": b"import torch\ndef f(:\n    t.cuda()\n",
    "binary.py": b"\x00\x01cuda\x02\x00",
    "undecodable.py": b"import torch\nx = '\xff\xfe cuda'\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_are_reported_and_left_alone(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(BAD_FILES[name])
    run = run_migration(MigrateOptions(target=tmp_path, quiet=True))
    assert path.read_bytes() == BAD_FILES[name]
    (result,) = run.results
    assert result.error and not result.changed
    assert any(f.kind == "unparsable" and f.path == name for f in run.findings)


def test_symlinks_are_not_followed_and_nothing_is_written_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.py").write_text(TRAIN)
    root = tmp_path / "repo"
    root.mkdir()
    (root / "link.py").symlink_to(outside / "victim.py")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    run = run_migration(MigrateOptions(target=root, quiet=True))
    assert (outside / "victim.py").read_text() == TRAIN
    reasons = dict(run.skipped)
    assert "outside the target" in reasons["link.py"]
    assert "symlinked folder" in reasons["linkdir"]


def test_gitignore_and_vendored_folders_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    for folder in ("src", "third_party/lib", "venv/lib", "generated", "node_modules/x"):
        (root / folder).mkdir(parents=True)
        (root / folder / "m.py").write_text(TRAIN)
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (root / "custom_env").mkdir()
    (root / "custom_env" / "pyvenv.cfg").write_text("home = /usr\n")
    (root / "custom_env" / "m.py").write_text(TRAIN)
    (root / ".gitignore").write_text("generated/\n*.tmp.py\n")
    (root / "src" / "scratch.tmp.py").write_text(TRAIN)
    run = run_migration(MigrateOptions(target=root, dry_run=True))
    assert {r.path for r in run.changed} == {"src/m.py"}
    # a copy still contains ignored (data, generated) and vendored files, unmigrated; not virtualenvs
    out = tmp_path / "copy"
    run_migration(MigrateOptions(target=root, out=out, quiet=True))
    assert (out / "generated" / "m.py").read_text() == TRAIN
    assert (out / "third_party" / "lib" / "m.py").read_text() == TRAIN
    assert ".npu()" in (out / "src" / "m.py").read_text()
    assert not (out / "venv").exists() and not (out / "custom_env").exists()


def test_gitignore_is_honoured_through_git_in_a_work_tree(repo: Path) -> None:
    (repo / "build_out").mkdir()
    (repo / "build_out" / "gen.py").write_text(TRAIN)
    (repo / ".gitignore").write_text("build_out/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    run = run_migration(MigrateOptions(target=repo, dry_run=True))
    assert "build_out/gen.py" not in {r.path for r in run.changed}
    assert "train.py" in {r.path for r in run.changed}


def test_dirty_git_tree_is_refused_unless_forced(repo: Path) -> None:
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    (repo / "train.py").write_text(TRAIN + "# local edit\n")
    with pytest.raises(UserError, match="uncommitted changes.*train.py"):
        run_migration(MigrateOptions(target=repo))
    assert (repo / "train.py").read_text() == TRAIN + "# local edit\n"
    run_migration(MigrateOptions(target=repo, force=True, quiet=True))
    assert ".npu()" in (repo / "train.py").read_text()


def test_dirty_tree_is_refused_for_a_relative_target_too(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    (repo / "README.md").write_text("edited\n")
    monkeypatch.chdir(repo.parent)
    with pytest.raises(UserError, match="uncommitted changes.*README.md"):
        run_migration(MigrateOptions(target=Path(repo.name)))
    monkeypatch.chdir(repo / "pkg")
    with pytest.raises(UserError, match="uncommitted changes"):
        run_migration(MigrateOptions(target=Path("..")))


def test_single_file_target(tmp_path: Path) -> None:
    path = tmp_path / "one.py"
    path.write_text(TRAIN)
    (tmp_path / "other.py").write_text(TRAIN)
    run_migration(MigrateOptions(target=path, quiet=True))
    assert ".npu()" in path.read_text()
    assert (tmp_path / "other.py").read_text() == TRAIN


def test_parallel_and_serial_runs_agree(tmp_path: Path) -> None:
    for index in range(40):
        (tmp_path / f"m{index}.py").write_text(TRAIN if index % 2 else PLAIN)
    serial = run_migration(MigrateOptions(target=tmp_path, dry_run=True, jobs=1))
    parallel = run_migration(MigrateOptions(target=tmp_path, dry_run=True, jobs=2))
    assert [(r.path, r.new_bytes) for r in serial.results] == [(r.path, r.new_bytes) for r in parallel.results]
    assert len(serial.changed) == 20


def test_whole_test_corpus_is_idempotent_and_parses(tmp_path: Path) -> None:
    """Every source in this test suite's corpora, migrated twice: the second pass changes nothing."""
    import ast

    from tests.migrate.test_python_rules import REWRITES, UNCHANGED
    from tests.migrate.test_tricky_cases import CASES

    sources = [c[1] for c in CASES] + [c[1] for c in REWRITES] + [c[1] for c in UNCHANGED]
    for index, source in enumerate(sources):
        (tmp_path / f"case{index}.py").write_text(source, newline="")
    run_migration(MigrateOptions(target=tmp_path, quiet=True))
    for path in tmp_path.glob("*.py"):
        ast.parse(path.read_text())
    assert run_migration(MigrateOptions(target=tmp_path, dry_run=True)).changed == []


def test_runtime_mode_treats_unimported_scripts_as_entry_points(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import torch\nfrom model import Net\nnet = Net().cuda()\n")
    (tmp_path / "model.py").write_text("import torch\nclass Net(torch.nn.Module):\n    pass\nx = torch.zeros(1).cuda()\n")
    run = run_migration(MigrateOptions(target=tmp_path, runtime=True, quiet=True))
    assert [r.path for r in run.changed] == ["train.py"]  # model.py is imported by train.py


def test_runtime_mode_only_touches_entry_points(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("import lib\n" + TRAIN + 'if __name__ == "__main__":\n    pass\n')
    (tmp_path / "lib.py").write_text(TRAIN)
    (tmp_path / "run.sh").write_text("CUDA_VISIBLE_DEVICES=0 python main.py\n")
    run = run_migration(MigrateOptions(target=tmp_path, runtime=True, quiet=True))
    assert [r.path for r in run.changed] == ["main.py"]
    assert "from torch_npu.contrib import transfer_to_npu\n" in (tmp_path / "main.py").read_text()
    assert (tmp_path / "lib.py").read_text() == TRAIN
    assert (tmp_path / "run.sh").read_text() == "CUDA_VISIBLE_DEVICES=0 python main.py\n"
    (uncovered,) = [f for f in run.findings if f.path == "run.sh" and f.kind == "not-covered-by-transfer_to_npu"]
    assert "ASCEND_RT_VISIBLE_DEVICES" in uncovered.suggestion


def test_files_without_changes_are_never_rewritten(repo: Path) -> None:
    plain = repo / "pkg" / "plain.py"
    os.utime(plain, ns=(1_000_000_000, 1_000_000_000))
    inode = plain.stat().st_ino
    run_migration(MigrateOptions(target=repo, quiet=True))
    assert plain.stat().st_mtime_ns == 1_000_000_000  # not even re-written with the same bytes
    assert plain.stat().st_ino == inode


def test_report_folder_inside_the_target_is_not_migrated_later(repo: Path) -> None:
    from npukit.migrate import write_reports

    report = repo / "npu-report"
    run = run_migration(MigrateOptions(target=repo, dry_run=True, report_dir=report))
    write_reports(run, report)
    written = _snapshot(report)
    again = run_migration(MigrateOptions(target=repo, dry_run=True, report_dir=report))
    assert not any(r.path.startswith("npu-report/") for r in again.results)
    assert _snapshot(report) == written


def test_a_failing_rule_costs_one_file_not_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from npukit.migrate import runner

    (tmp_path / "a.py").write_text(TRAIN)
    (tmp_path / "run.sh").write_text("CUDA_VISIBLE_DEVICES=0 python a.py\n")

    def broken(*_args, **_kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(runner, "migrate_python", broken)
    run = run_migration(MigrateOptions(target=tmp_path, quiet=True, jobs=1))
    assert (tmp_path / "a.py").read_text() == TRAIN
    assert "ASCEND_RT_VISIBLE_DEVICES" in (tmp_path / "run.sh").read_text()
    (failed,) = [r for r in run.results if r.path == "a.py"]
    assert "npu-migrate bug" in failed.error


def test_a_target_ignored_by_the_enclosing_repository_is_still_migrated(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("scratch/\n")
    (tmp_path / "scratch" / "sub").mkdir(parents=True)
    (tmp_path / "scratch" / "sub" / "a.py").write_text(TRAIN)
    assert run_migration(MigrateOptions(target=tmp_path, dry_run=True)).changed == []
    assert [r.path for r in run_migration(MigrateOptions(target=tmp_path / "scratch", dry_run=True)).changed] == ["sub/a.py"]


def test_conda_environment_file_is_scanned(tmp_path: Path) -> None:
    (tmp_path / "environment.yml").write_text("dependencies:\n  - pip:\n    - flash-attn\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    assert [(f.path, f.kind) for f in run.findings] == [("environment.yml", "flash-attn")]


def test_custom_cuda_op_call_sites_are_reported(tmp_path: Path) -> None:
    """Case 52: ops bound from CUDA sources by pybind are flagged where Python calls them."""
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "gelu_kernel.cu").write_text("__global__ void gelu(float* x) {}\n")
    (tmp_path / "csrc" / "bind.cpp").write_text(
        '#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.def("fused_gelu", &fused_gelu);\n}\n')
    (tmp_path / "setup.py").write_text(
        "from torch.utils.cpp_extension import CUDAExtension\next = CUDAExtension('my_ext', ['csrc/bind.cpp'])\n")
    (tmp_path / "model.py").write_text("import torch\nimport my_ext\ny = my_ext.fused_gelu(torch.ones(2))\nz = obj.fused_gelu()\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    found = {(f.path, f.line, f.kind) for f in run.findings}
    assert ("model.py", 3, "custom-cuda-op") in found
    assert ("model.py", 4, "custom-cuda-op") not in found  # a method of some object, not the extension
    assert ("csrc/gelu_kernel.cu", 1, "cuda-kernel") in found  # built with bind.cpp, its folder's named source
    assert ("setup.py", 2, "cuda-extension") in found


def test_a_file_that_cannot_be_written_is_reported_and_the_rest_migrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from npukit.migrate import files

    (tmp_path / "a.py").write_text(TRAIN)
    (tmp_path / "b.py").write_text(TRAIN)
    real_write = files.atomic_write

    def refuse_a(path: Path, data: bytes, **kwargs) -> None:
        if path.name == "a.py":
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, data, **kwargs)

    monkeypatch.setattr(files, "atomic_write", refuse_a)
    run = run_migration(MigrateOptions(target=tmp_path, quiet=True, jobs=1))
    assert (tmp_path / "a.py").read_text() == TRAIN
    assert ".npu()" in (tmp_path / "b.py").read_text()
    assert any(f.kind == "unwritable" and f.path == "a.py" for f in run.findings)
    assert [r.path for r in run.changed] == ["b.py"]


def test_a_class_with_its_own_cuda_method_in_another_file_is_respected(tmp_path: Path) -> None:
    (tmp_path / "pool.py").write_text("class Pool:\n    def cuda(self):\n        return 'pinned'\n")
    (tmp_path / "train.py").write_text("import torch\nfrom pool import Pool\np = Pool().cuda()\nq = Pool()\nr = q.cuda()\nx = t.cuda()\n")
    run_migration(MigrateOptions(target=tmp_path, quiet=True))
    assert (tmp_path / "train.py").read_text() == (
        "import torch_npu\nimport torch\nfrom pool import Pool\np = Pool().cuda()\nq = Pool()\nr = q.cuda()\nx = t.npu()\n")


def test_real_corpus_torch_distributed_migrates_cleanly_and_idempotently() -> None:
    """The installed torch/distributed package (hundreds of real files): output parses, a rerun is a no-op."""
    import ast

    import torch

    from npukit.migrate import migrate_python

    source = Path(torch.__file__).parent / "distributed"
    run = run_migration(MigrateOptions(target=source, dry_run=True))
    assert len(run.changed) > 10 and not [r for r in run.results if r.error]
    for result in run.changed:
        text = result.new_bytes.decode("utf-8")
        ast.parse(text)
        assert migrate_python(text, result.path).text == text, result.path


def _tree(root: Path, count: int) -> list[Path]:
    root.mkdir()
    paths = [root / f"train{i}.py" for i in range(count)]
    for path in paths:
        path.write_text(TRAIN)
    return paths


def test_a_read_only_file_in_the_middle_is_reported_and_the_others_are_migrated(tmp_path: Path) -> None:
    paths = _tree(tmp_path / "tree", 3)
    paths[1].chmod(0o444)
    run = run_migration(MigrateOptions(target=tmp_path / "tree"))
    assert paths[1].read_text() == TRAIN and stat.S_IMODE(paths[1].stat().st_mode) == 0o444
    assert ".npu()" in paths[0].read_text() and ".npu()" in paths[2].read_text()
    unwritable = [f for r in run.results for f in r.findings if f.kind == "unwritable"]
    assert [(f.path, f.severity) for f in unwritable] == [("train1.py", "error")]
    assert "read-only" in unwritable[0].reason


def test_an_interrupt_while_writing_says_what_was_written_and_a_rerun_finishes(tmp_path: Path, monkeypatch,
                                                                                capsys) -> None:
    from npukit.migrate import files as fs
    from npukit.migrate.cli_support import main

    paths = _tree(tmp_path / "tree", 4)
    real_write, writes = fs.atomic_write, []

    def interrupted_write(path, data, **kwargs):
        if len(writes) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the second and the third file
        writes.append(path)
        real_write(path, data, **kwargs)

    monkeypatch.setattr(fs, "atomic_write", interrupted_write)
    assert main(target=tmp_path / "tree") == 130
    message = " ".join(capsys.readouterr().err.split())
    assert "interrupted while writing: 2 of 4 changed files were written (each whole)" in message
    assert "train2.py, train3.py" in message and "Run the same command again to finish" in message
    assert [".npu()" in p.read_text() for p in paths] == [True, True, False, False]
    monkeypatch.setattr(fs, "atomic_write", real_write)
    assert main(target=tmp_path / "tree") == 0
    assert all(".npu()" in p.read_text() for p in paths)
    assert paths[0].read_text() == paths[3].read_text()  # the written ones were left as they were


def test_undecodable_config_and_oversized_sources_are_reported_not_skipped(tmp_path: Path, monkeypatch) -> None:
    from npukit.migrate import files as fs

    root = tmp_path / "tree"
    root.mkdir()
    (root / "conf.yaml").write_bytes(b"device: cuda\nname: \xff\xfe\n")
    (root / "generated.py").write_text("import torch\n" + "x = torch.zeros(1).cuda()\n" * 50)
    monkeypatch.setattr(fs, "MAX_SOURCE_BYTES", 1000)  # the real bound is 8 MB
    run = run_migration(MigrateOptions(target=root, dry_run=True))
    reported = {f.path: f.reason for r in run.results for f in r.findings if f.kind == "unparsable"}
    assert set(reported) == {"conf.yaml", "generated.py"}
    assert "cannot be decoded as utf-8" in reported["conf.yaml"]
    assert "larger than 0 MB (generated code?): not analysed" in reported["generated.py"]


def test_a_file_name_that_is_not_utf8_is_written_in_every_report(tmp_path: Path) -> None:
    from npukit.migrate.cli_support import main

    root = tmp_path / "tree"
    root.mkdir()
    with open(os.path.join(os.fsencode(root), b"n\xffame.py"), "wb") as handle:
        handle.write(TRAIN.encode())
    assert main(target=root, dry_run=True, report_dir=tmp_path / "report", quiet=True) == 0
    texts = {report.name: report.read_text(encoding="utf-8") for report in (tmp_path / "report").iterdir()}
    assert len(texts) == 5  # every report written, each valid UTF-8
    assert all("ame.py" in texts[name] for name in ("change_list.csv", "report.json"))


def test_cuda_c_the_pytorch_path_does_not_build_is_estimated_apart(tmp_path: Path) -> None:
    """A CUDA C trainer beside the PyTorch code (llm.c-style) and kernel experiments: counted per kernel,
    in their own group, outside the total; the extension setup.py builds is the PyTorch path's."""
    from npukit.migrate.report import effort

    (tmp_path / "ext" / "csrc").mkdir(parents=True)
    (tmp_path / "ext" / "setup.py").write_text(
        "import os\nfrom torch.utils.cpp_extension import CUDAExtension\nhere = os.path.dirname(__file__)\n"
        "ext = CUDAExtension('e', [os.path.join(here, 'csrc', 'bind.cpp')])\n")
    (tmp_path / "ext" / "csrc" / "bind.cpp").write_text('#include <torch/extension.h>\n#include "../common/act.cuh"\n')
    (tmp_path / "ext" / "csrc" / "act.cu").write_text("__global__ void act(float* x) {}\n")
    (tmp_path / "ext" / "common").mkdir()
    (tmp_path / "ext" / "common" / "act.cuh").write_text("#include <cuda_runtime.h>\n__device__ float f(float x);\n")
    (tmp_path / "llmc").mkdir()
    (tmp_path / "llmc" / "train.cu").write_text(
        "#include <cuda_runtime.h>\n__global__ void a(float* x) {}\n// __global__ void old(float* x)\n"
        "template <typename T>\n__global__ void b(T* x) {}\n")
    (tmp_path / "llmc" / "common.h").write_text("#include <cublas_v2.h>\nvoid setup();\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    found = sorted((f.path, f.line, f.kind) for f in run.findings if "cuda-" in f.kind and f.kind != "cuda-extension")
    assert found == [("ext/common/act.cuh", 1, "cuda-header"), ("ext/csrc/act.cu", 1, "cuda-kernel"),
                     ("llmc/common.h", 1, "standalone-cuda-header"), ("llmc/train.cu", 2, "standalone-cuda-kernel"),
                     ("llmc/train.cu", 5, "standalone-cuda-kernel")]
    estimate = effort(run)
    assert set(estimate["by_kind"]) == {"cuda-extension", "cuda-kernel", "cuda-header"}
    assert estimate["standalone_cuda"]["items"] == 3
    assert estimate["standalone_cuda"]["estimated_minutes"] == 2 * 4 * 60 + 15
    assert estimate["estimated_minutes"] == 60 + 4 * 60 + 15



def test_a_cuda_only_library_is_estimated_once_per_file_not_per_call(tmp_path: Path) -> None:
    """One xformers import and three calls were four 2-hour items ("about 8 h"); the calls are the
    same port. Each @triton.jit kernel stays a port of its own; and the compiled extension modules
    mamba-style code imports directly are reported."""
    from npukit.migrate.report import effort

    (tmp_path / "attn.py").write_text(
        "import torch\nfrom xformers.ops import fmha\n"
        "def a(q, k, v):\n    return fmha.memory_efficient_attention(q, k, v)\n"
        "def b(q, k, v):\n    return fmha.memory_efficient_attention(q, k, v)\n"
        "def c(q, k, v):\n    return fmha.memory_efficient_attention(q, k, v)\n")
    (tmp_path / "mamba.py").write_text("import causal_conv1d_cuda\nimport selective_scan_cuda\n"
                                       "y = causal_conv1d_cuda.causal_conv1d_fwd(x, w, None, None, True)\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    estimate = effort(run)
    xformers = estimate["by_kind"]["xformers"]
    assert xformers["items"] == 4 and xformers["minutes"] == 2 * 60 + 3 * 15
    assert [(f.line, f.kind) for f in run.findings if f.path == "mamba.py"][:2] == [
        (1, "cuda-only-library"), (2, "cuda-only-library")]


def test_a_launcher_without_torch_is_still_read_for_job_templates_and_nvidia_tools(tmp_path: Path) -> None:
    """A file with no torch or CUDA word was never parsed: its sbatch template and nvcc call were silent."""
    (tmp_path / "launch.py").write_text('T = """#!/bin/bash\n#SBATCH --gres=gpu:{n}\nsrun python train.py\n"""\n')
    (tmp_path / "build.py").write_text("import subprocess\nsubprocess.run(['nvcc', '-O3', 'k.cu'])\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True))
    assert sorted((f.path, f.kind) for f in run.findings) == [("build.py", "nvcc"), ("launch.py", "job-gpu-request")]
