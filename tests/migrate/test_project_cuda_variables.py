"""A project's own environment variable named like CUDA's (basaran's CUDA_MEMORY_FRACTION) is reported
where it is set or read, in every kind of file, and never rewritten; the variables CUDA reads keep
their rewrites (issue #32)."""

from __future__ import annotations

from pathlib import Path

from npukit.migrate import MigrateOptions, run_migration

# file -> (text, the lines where the project's variable is set or read)
FILES = {
    "serve.py": (
        "import os\n"                                                                  # 1
        "import subprocess\n"                                                          # 2
        "import torch\n"                                                               # 3
        "import torch_npu  # already there: no line is inserted\n"  # 4
        'fraction = float(os.environ.get("CUDA_MEMORY_FRACTION", "0.9"))\n'            # 5
        'workers = os.getenv("NVIDIA_SERVER_WORKERS")\n'                               # 6
        'os.environ["CUDA_VISIBLE_DEVICES"] = "0"\n'                                   # 7
        'os.putenv("CUDNN_SERVER_MODE", "fast")\n'                                     # 8
        'subprocess.run(["python", "w.py"], env={"CUBLAS_SERVER_OPT": "1"})\n'         # 9
        "model = torch.nn.Linear(2, 2).cuda()\n",                                      # 10
        [5, 6, 8, 9],
    ),
    "run.sh": (
        "#!/bin/bash\n"                                                                # 1
        "export CUDA_MEMORY_FRACTION=0.9\n"                                            # 2
        "export CUDA_VISIBLE_DEVICES=0,1\n"                                            # 3
        "echo using CUDA_MEMORY_FRACTION\n"                                            # 4
        "CUDA_MEMORY_FRACTION=0.5 python serve.py\n",                                  # 5
        [2, 5],
    ),
    "job.sbatch": (
        "#!/bin/bash\n"                                                                # 1
        "#SBATCH --nodes=1\n"                                                          # 2
        "export CUDA_VISIBLE_DEVICES=0\n"                                              # 3
        'python serve.py --fraction "${CUDA_MEMORY_FRACTION}"\n',                      # 4
        [4],
    ),
    "Dockerfile": (
        "FROM python:3.11\n"                                                           # 1
        "ARG CUDNN_SERVER_MODE\n"                                                      # 2
        "ENV CUDA_MEMORY_FRACTION=0.9\n"                                               # 3
        "ENV CUDA_VISIBLE_DEVICES 0\n",                                                # 4
        [2, 3],
    ),
    "docker-compose.yml": (
        "services:\n"                                                                  # 1
        "  api:\n"                                                                     # 2
        "    image: python:3.11\n"                                                     # 3
        "    environment:\n"                                                           # 4
        "      - CUDA_MEMORY_FRACTION=0.9\n"                                           # 5
        "      - CUDA_VISIBLE_DEVICES=0\n"                                             # 6
        "  worker:\n"                                                                  # 7
        "    image: python:3.11\n"                                                     # 8
        "    environment:\n"                                                           # 9
        '      CUDNN_SERVER_MODE: "fast"\n',                                            # 10
        [5, 10],
    ),
    "deploy.yaml": (
        "kind: Pod\n"                                                                  # 1
        "spec:\n"                                                                      # 2
        "  containers:\n"                                                              # 3
        "    - name: api\n"                                                            # 4
        "      env:\n"                                                                 # 5
        "        - name: CUDA_MEMORY_FRACTION\n"                                       # 6
        '          value: "0.8"\n'                                                     # 7
        "        - name: CUDA_VISIBLE_DEVICES\n"                                       # 8
        '          value: "0"\n',                                                      # 9
        [6],
    ),
    "worker.yml": (  # no other CUDA word in the file: still read
        "environment:\n"                                                              # 1
        "  CUBLAS_SERVER_OPT: 1\n",                                                   # 2
        [2],
    ),
}
# where CUDA_VISIBLE_DEVICES is, in each file: it is still renamed there
VISIBLE_DEVICES_AT = {"serve.py": 7, "run.sh": 3, "job.sbatch": 3, "Dockerfile": 4, "docker-compose.yml": 6,
                      "deploy.yaml": 8}
PROJECT_NAMES = ("CUDA_MEMORY_FRACTION", "NVIDIA_SERVER_WORKERS", "CUDNN_SERVER_MODE", "CUBLAS_SERVER_OPT")


def _migrate(tmp_path: Path):
    for name, (text, _) in FILES.items():
        (tmp_path / name).write_text(text)
    run = run_migration(MigrateOptions(target=tmp_path, quiet=True))
    return {result.path: result for result in run.results}


def test_project_variables_are_reported_at_each_place_and_never_rewritten(tmp_path: Path) -> None:
    results = _migrate(tmp_path)
    for name, (_, lines) in FILES.items():
        result = results[name]
        reported = sorted({f.line for f in result.findings if f.kind == "project-cuda-variable"})
        assert reported == lines, name
        for finding in result.findings:
            if finding.kind == "project-cuda-variable":
                variable = next(v for v in PROJECT_NAMES if v in finding.code)
                assert finding.severity == "warning"
                assert finding.reason.startswith(f"{variable} is this project's own variable named like CUDA's")
                assert "check what it controls on the NPU" in finding.reason
        # the generic audit does not report the same string again
        assert not [f for f in result.findings if f.kind == "cuda-leftover" and f.line in lines], name
        assert not [c for c in result.changes if any(v in c.before for v in PROJECT_NAMES)], name
        new_text = (tmp_path / name).read_text()
        for variable in PROJECT_NAMES:
            assert new_text.count(variable) == FILES[name][0].count(variable), (name, variable)


def test_known_variables_keep_their_rewrite_and_finding(tmp_path: Path) -> None:
    results = _migrate(tmp_path)
    for name, line in VISIBLE_DEVICES_AT.items():
        result = results[name]
        assert [(c.line, c.after.strip("\"'")) for c in result.changes if c.rule == "env-var"] == \
            [(line, "ASCEND_RT_VISIBLE_DEVICES")], name
        assert [f.line for f in result.findings if f.kind == "visible-devices"] == [line], name
        assert not [f for f in result.findings if f.kind == "project-cuda-variable" and f.line == line], name
        assert "ASCEND_RT_VISIBLE_DEVICES" in (tmp_path / name).read_text()


def test_names_cuda_itself_reads_are_not_called_the_projects_own(tmp_path: Path) -> None:
    (tmp_path / "build.sh").write_text(
        "#!/bin/bash\n"
        "export CUDA_HOME=/usr/local/cuda\n"
        "export NVIDIA_VISIBLE_DEVICES=all\n"
        "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
        "export CUBLAS_WORKSPACE_CONFIG=:4096:8\n"
        "export NCCL_DEBUG=INFO\n"
        "export TORCH_CUDA_ARCH_LIST=8.0\n")
    result = run_migration(MigrateOptions(target=tmp_path, quiet=True)).results[0]
    assert not [f for f in result.findings if f.kind == "project-cuda-variable"]
    assert {f.kind for f in result.findings} == {"env-var"}  # CUBLAS_WORKSPACE_CONFIG, NCCL_DEBUG as before
