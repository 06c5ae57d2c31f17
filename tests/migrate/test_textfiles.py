"""Beyond .py: notebooks, shell scripts, YAML/JSON configs, requirements, CUDA sources (cases 44, 63)."""

from __future__ import annotations

import json

import pytest

from npukit.migrate.pysource import MigrationSyntaxError
from npukit.migrate.textfiles import (
    migrate_dockerfile,
    migrate_json,
    migrate_notebook,
    migrate_shell,
    migrate_yaml,
    scan_native_source,
    scan_requirements,
)

SHELL_CASES = [
    ("env-prefix-and-launcher",
     "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 train.py\n",
     "ASCEND_RT_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 train.py\n"),
    ("export-and-reference",
     'export CUDA_VISIBLE_DEVICES=0\necho_devices "$CUDA_VISIBLE_DEVICES"\nexport PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n',
     'export ASCEND_RT_VISIBLE_DEVICES=0\necho_devices "$ASCEND_RT_VISIBLE_DEVICES"\nexport PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n'),
    ("device-and-backend-options",
     "python train.py --device cuda:0 --dist-backend nccl --device_type=cuda \\\n    --lr 1\n",
     "python train.py --device npu:0 --dist-backend hccl --device_type=npu \\\n    --lr 1\n"),
    ("comments-and-echo-untouched",
     "# export CUDA_VISIBLE_DEVICES=0\necho \"set CUDA_VISIBLE_DEVICES=0 for --device cuda\"\npython a.py  # --device cuda\n",
     "# export CUDA_VISIBLE_DEVICES=0\necho \"set CUDA_VISIBLE_DEVICES=0 for --device cuda\"\npython a.py  # --device cuda\n"),
    ("other-devices-untouched",
     "python train.py --device cpu --device cudagraph_x\n",
     "python train.py --device cpu --device cudagraph_x\n"),
]


@pytest.mark.parametrize(("case_id", "source", "expected"), SHELL_CASES, ids=[c[0] for c in SHELL_CASES])
def test_shell(case_id: str, source: str, expected: str) -> None:
    text, _changes, _findings = migrate_shell(source, "run.sh")
    assert text == expected
    assert migrate_shell(text, "run.sh")[0] == text


def test_shell_flags_nvidia_smi_and_nccl_knobs() -> None:
    _text, _changes, findings = migrate_shell("nvidia-smi -L\nexport NCCL_IB_DISABLE=1\n", "run.sh")
    assert {(f.kind, f.line) for f in findings} == {("nvidia-smi", 1), ("env-var", 2)}


YAML_CASES = [
    ("device-and-backend-keys",
     "trainer:\n  device: cuda\n  dist_backend: 'nccl'\n  eval_device: \"cuda:1\"  # gpu\n",
     "trainer:\n  device: npu\n  dist_backend: 'hccl'\n  eval_device: \"npu:1\"  # gpu\n"),
    ("env-in-k8s-and-compose",
     "env:\n  - name: CUDA_VISIBLE_DEVICES\n    value: \"0\"\nenvironment:\n  - CUDA_LAUNCH_BLOCKING=1\n",
     "env:\n  - name: ASCEND_RT_VISIBLE_DEVICES\n    value: \"0\"\nenvironment:\n  - ASCEND_LAUNCH_BLOCKING=1\n"),
    ("command-strings",
     "command: python train.py --device cuda\n",
     "command: python train.py --device npu\n"),
    ("unrelated-values-untouched",
     "name: cuda-demo\nnote: runs on cuda\n# device: cuda\ndevices: [0, 1]\nhint: set CUDA_VISIBLE_DEVICES by hand\n",
     "name: cuda-demo\nnote: runs on cuda\n# device: cuda\ndevices: [0, 1]\nhint: set CUDA_VISIBLE_DEVICES by hand\n"),
    ("env-as-key-assignment-and-reference",
     "env:\n  CUDA_VISIBLE_DEVICES: \"0\"\nrun: CUDA_LAUNCH_BLOCKING=1 python a.py\nargs: [\"${CUDA_VISIBLE_DEVICES}\"]\n",
     "env:\n  ASCEND_RT_VISIBLE_DEVICES: \"0\"\nrun: ASCEND_LAUNCH_BLOCKING=1 python a.py\nargs: [\"${ASCEND_RT_VISIBLE_DEVICES}\"]\n"),
]


@pytest.mark.parametrize(("case_id", "source", "expected"), YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_yaml(case_id: str, source: str, expected: str) -> None:
    assert migrate_yaml(source, "cfg.yaml")[0] == expected


def test_invalid_yaml_is_reported_not_rewritten() -> None:
    with pytest.raises(MigrationSyntaxError, match="YAML"):
        migrate_yaml("device: cuda\n  bad: [\n", "cfg.yaml")


def test_json_config() -> None:
    source = ('{\n  "device": "cuda:0",\n  "backend": "nccl",\n  "comment": "cuda",\n  "env": {"CUDA_VISIBLE_DEVICES": "0"},\n'
              '  "note": "set CUDA_VISIBLE_DEVICES by hand"\n}\n')
    text, changes, _ = migrate_json(source, "cfg.json")
    assert text == ('{\n  "device": "npu:0",\n  "backend": "hccl",\n  "comment": "cuda",\n  "env": {"ASCEND_RT_VISIBLE_DEVICES": "0"},\n'
                    '  "note": "set CUDA_VISIBLE_DEVICES by hand"\n}\n')
    assert len(changes) == 3
    assert json.loads(text)["device"] == "npu:0"


def test_invalid_json_is_reported_not_rewritten() -> None:
    with pytest.raises(MigrationSyntaxError, match="JSON"):
        migrate_json('{"device": "cuda",}', "cfg.json")


def test_requirements_are_flagged_never_edited() -> None:
    source = (
        "--extra-index-url https://download.pytorch.org/whl/cu121\n"
        "torch==2.1.0+cu121\nflash-attn>=2.5  # fast attention\nxformers\nnvidia-cudnn-cu12\ncupy-cuda12x\n"
        "bitsandbytes\nnumpy>=1.24\ntransformers\n"
    )
    findings = scan_requirements(source, "requirements.txt")
    flagged = {(f.line, f.kind) for f in findings if f.kind != "torch-npu-missing"}
    assert flagged == {(1, "cuda-wheel"), (2, "cuda-wheel"), (3, "flash-attn"), (4, "xformers"),
                       (5, "cuda-wheel"), (6, "cupy"), (7, "bitsandbytes")}
    assert any(f.kind == "torch-npu-missing" for f in findings)


def test_requirements_with_torch_npu_need_no_hint() -> None:
    assert scan_requirements("torch==2.6.0\ntorch_npu==2.6.0\n", "requirements.txt") == []


def test_cuda_sources_are_flagged() -> None:
    (finding,) = scan_native_source("__global__ void k(float* x) {}\n", "k.cu")
    assert finding.kind == "cuda-kernel" and finding.severity == "error" and "`k`" in finding.reason
    (header_use,) = scan_native_source('#include <vector>\n#include <cuda_runtime.h>\n', "ops.cpp")
    assert header_use.line == 2
    assert scan_native_source("#include <vector>\nint main() {}\n", "main.cpp") == []


def _notebook(*cells: tuple[str, list[str]]) -> str:
    return json.dumps({
        "cells": [{"cell_type": kind, "metadata": {}, "source": source, **({"outputs": [], "execution_count": None}
                                                                        if kind == "code" else {})}
                  for kind, source in cells],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }, indent=1, ensure_ascii=False) + "\n"


def test_notebook_cells_migrated_as_one_module() -> None:
    source = _notebook(
        ("markdown", ["Train on `cuda`: `model.cuda()`\n"]),
        ("code", ["import torch\n", "!nvidia-smi\n", "%env CUDA_VISIBLE_DEVICES=0\n"]),
        ("code", ["device = torch.device('cuda')\n", "x = torch.zeros(1).cuda()"]),
    )
    text, changes, findings = migrate_notebook(source, "nb.ipynb")
    cells = json.loads(text)["cells"]
    assert cells[0]["source"] == ["Train on `cuda`: `model.cuda()`\n"]
    assert cells[1]["source"] == ["import torch_npu\n", "import torch\n", "!nvidia-smi\n",
                                  "%env ASCEND_RT_VISIBLE_DEVICES=0\n"]
    assert cells[2]["source"] == ["device = torch.device('npu')\n", "x = torch.zeros(1).npu()"]
    assert any(f.kind == "nvidia-smi" for f in findings)
    assert changes
    assert migrate_notebook(text, "nb.ipynb")[0] == text


def test_notebook_without_cuda_is_returned_unchanged() -> None:
    source = _notebook(("code", ["print(1)\n"]))
    assert migrate_notebook(source, "nb.ipynb")[0] == source


def test_broken_notebook_is_reported() -> None:
    with pytest.raises(MigrationSyntaxError, match="notebook"):
        migrate_notebook("{not json", "nb.ipynb")


def test_notebook_runtime_mode_imports_transfer_to_npu_in_the_first_code_cell() -> None:
    source = _notebook(("markdown", ["# demo\n"]), ("code", ["import torch\n", "x = torch.zeros(1).cuda()"]))
    text, _changes, _findings = migrate_notebook(source, "nb.ipynb", runtime=True)
    cells = json.loads(text)["cells"]
    assert cells[1]["source"][:3] == ["import torch_npu\n", "from torch_npu.contrib import transfer_to_npu\n",
                                      "import torch\n"]
    assert cells[1]["source"][3] == "x = torch.zeros(1).cuda()"


@pytest.mark.parametrize("cells, expected", [
    # a Python cell magic first: the import goes below it (above, IPython says "Line magic function
    # %%time not found" and the cell fails)
    ([["%%time\n", "import torch\n", "x = torch.zeros(1).cuda()"]],
     [["%%time\n", "import torch_npu\n", "import torch\n", "x = torch.zeros(1).npu()"]]),
    # a cell that is not Python of the notebook (shell, a magic's own language) is no place for it
    ([["%%capture\n", "!pip install diffusers"], ["import torch\n", "x = torch.zeros(1).cuda()"]],
     [["%%capture\n", "!pip install diffusers"], ["import torch_npu\n", "import torch\n", "x = torch.zeros(1).npu()"]]),
    ([["%%bash\n", "echo ready"], ["import torch\n", "x = torch.zeros(1).cuda()"]],
     [["%%bash\n", "echo ready"], ["import torch_npu\n", "import torch\n", "x = torch.zeros(1).npu()"]]),
    ([["%%html\n", "<b>cuda</b>"], ["import torch\n", "x = torch.zeros(1).cuda()"]],
     [["%%html\n", "<b>cuda</b>"], ["import torch_npu\n", "import torch\n", "x = torch.zeros(1).npu()"]]),
])
def test_notebook_cell_magics_keep_the_first_line_of_their_cell(cells, expected) -> None:
    text, _changes, _findings = migrate_notebook(_notebook(*(("code", cell) for cell in cells)), "nb.ipynb")
    assert [cell["source"] for cell in json.loads(text)["cells"]] == expected
    assert migrate_notebook(text, "nb.ipynb")[0] == text


def test_a_script_the_notebook_writes_is_migrated_as_its_own_module() -> None:
    """`%%writefile train.py`: its CUDA uses were neither rewritten nor reported (and a second run,
    with the import inserted above the magic, rewrote them)."""
    source = _notebook(("code", ["%%writefile train.py\n", "import torch\n", "x = torch.zeros(1).cuda()\n",
                                 "major = torch.cuda.get_device_capability()[0]\n"]),
                       ("code", ["!python train.py"]))
    text, changes, findings = migrate_notebook(source, "nb.ipynb")
    cells = json.loads(text)["cells"]
    assert cells[0]["source"] == ["%%writefile train.py\n", "import torch_npu\n", "import torch\n",
                                  "x = torch.zeros(1).npu()\n", "major = torch.cuda.get_device_capability()[0]\n"]
    assert [(c.line, c.rule) for c in changes] == [(2, "import-torch-npu"), (3, "cuda-method")]
    assert [(f.line, f.kind) for f in findings] == [(4, "device-capability")]
    assert findings[0].reason.startswith("[cell 1] ")
    assert migrate_notebook(text, "nb.ipynb")[0] == text


def test_conda_environment_packages_are_flagged() -> None:
    source = ("name: train\nchannels: [pytorch, nvidia]\ndependencies:\n  - python=3.10\n  - pytorch-cuda=12.1\n"
              "  - nvidia::cuda-toolkit\n  - pip:\n    - flash-attn==2.5.0\n    - numpy\n")
    text, changes, findings = migrate_yaml(source, "environment.yml")
    assert text == source and changes == []
    assert {(f.line, f.kind) for f in findings} == {(5, "cuda-wheel"), (6, "cuda-wheel"), (8, "flash-attn")}


def test_dockerfile_env_and_base_image() -> None:
    source = "FROM nvidia/cuda:12.1.0-devel-ubuntu22.04\nENV CUDA_VISIBLE_DEVICES=0\nRUN pip install torch\n"
    text, changes, findings = migrate_dockerfile(source, "Dockerfile")
    assert text == "FROM nvidia/cuda:12.1.0-devel-ubuntu22.04\nENV ASCEND_RT_VISIBLE_DEVICES=0\nRUN pip install torch\n"
    assert [c.rule for c in changes] == ["env-var"]
    assert ("cuda-base-image", 1) in {(f.kind, f.line) for f in findings}


def test_notebook_question_marks_in_code_are_not_mistaken_for_help_syntax() -> None:
    source = _notebook(("code", ["import torch\n", "torch.zeros?\n", "x = f(\n", "    'ready?',\n", ")\n", "y = t.cuda()"]))
    text, _changes, _findings = migrate_notebook(source, "nb.ipynb")
    cell = json.loads(text)["cells"][0]["source"]
    assert cell[-1] == "y = t.npu()"
    assert "    'ready?',\n" in cell and "torch.zeros?\n" in cell


# ---- a repository's other files: job scripts, build files, cluster manifests, NVIDIA's tools (#32)

def _kinds(findings) -> list[tuple[int, str]]:
    return [(f.line, f.kind) for f in findings]


def test_nvidia_tools_and_cuda_links_in_shell_lines_are_reported() -> None:
    source = ("watch -n1 nvidia-smi\nX=$(which nvcc)\n/usr/local/cuda/bin/nvcc -O3 k.cu -lcublas -lcudart\n"
              "srun nsys profile python t.py\nncu --set full python t.py\nexport NVCC_FLAGS=-O3\n"
              "echo nvcc missing\npython run.py --profiler=nsys-free\n")
    text, changes, findings = migrate_shell(source, "run.sh")
    assert text == source and not changes
    assert _kinds(findings) == [(1, "nvidia-smi"), (2, "nvcc"), (3, "nvcc"), (3, "cuda-link"), (3, "cuda-link"),
                                (4, "nvidia-profiler"), (5, "nvidia-profiler")]


def test_a_job_scripts_gpu_request_is_reported() -> None:
    source = "#!/bin/bash\n#SBATCH --gres=gpu:8\n#SBATCH --gpus-per-node=4\n#PBS -l select=1:ngpus=2\n# gres=gpu:8\n"
    _, _, findings = migrate_shell(source, "train.sbatch")
    assert _kinds(findings) == [(2, "job-gpu-request"), (3, "job-gpu-request"), (4, "job-gpu-request")]


def test_makefile_recipes_get_the_shell_rules_and_cmake_files_are_reported() -> None:
    from npukit.migrate.textfiles import migrate_build

    makefile = ("NVCC ?= nvcc\nkernels: k.cu\n\t$(NVCC) -O3 -o k.so --shared k.cu -lcublas\n"
                "train:\n\tCUDA_VISIBLE_DEVICES=0 python train.py\n")
    text, changes, findings = migrate_build(makefile, "Makefile")
    assert text == makefile.replace("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")  # a recipe is shell
    assert _kinds(findings) == [(1, "nvcc"), (3, "cuda-link"), (5, "visible-devices")]
    cmake = ("project(k LANGUAGES CXX CUDA)\nfind_package(CUDAToolkit REQUIRED)\nadd_library(k k.cpp k.cu)\n"
             "target_link_libraries(k CUDA::cublas)\n# enable_language(CUDA)\nadd_library(plain plain.cpp)\n")
    text, changes, findings = migrate_build(cmake, "csrc/CMakeLists.txt")
    assert text == cmake and not changes
    assert _kinds(findings) == [(1, "cuda-build"), (2, "cuda-build"), (3, "cuda-build"), (4, "cuda-build")]


def test_kubernetes_gpu_resources_and_cuda_images_are_reported() -> None:
    manifest = ("apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n      containers:\n"
                "      - name: train\n        image: nvcr.io/nvidia/pytorch:24.01-py3\n        resources:\n"
                "          limits:\n            nvidia.com/gpu: 8\n      - name: side\n        image: busybox\n")
    text, _, findings = migrate_yaml(manifest, "k8s/job.yaml")
    assert text == manifest
    assert _kinds(findings) == [(8, "cuda-base-image"), (11, "k8s-gpu-resource")]


def test_job_scripts_and_shebang_scripts_are_migrated_with_the_tree(tmp_path) -> None:
    """A Slurm script or an extension-less launcher is a shell script: before, they stayed CUDA while the
    identical .sh was rewritten."""
    from npukit.migrate.files import discover, file_kind

    script = "#!/bin/bash\n#SBATCH --gres=gpu:8\nexport CUDA_VISIBLE_DEVICES=0,1\n"
    for name in ("train.sbatch", "train.slurm", "job.pbs", "launch", "run.job1"):
        (tmp_path / name).write_text(script)
    (tmp_path / "serve").write_text("#!/usr/bin/env -S python3 -u\nimport torch\nx = torch.zeros(1).cuda()\n")
    (tmp_path / "notes").write_text("export CUDA_VISIBLE_DEVICES=0\n")  # no #! line: not a script
    (tmp_path / "tool.pl").write_text("#!/usr/bin/perl\n")
    found = discover(tmp_path)
    assert sorted(found.files) == ["job.pbs", "launch", "run.job1", "serve", "train.sbatch", "train.slurm"]
    assert file_kind(tmp_path, "serve") == "python" and file_kind(tmp_path, "launch") == "shell"


def test_a_compose_files_gpu_reservation_is_reported() -> None:
    compose = ("services:\n  api:\n    image: basaran\n    deploy:\n      resources:\n        reservations:\n"
               "          devices:\n            - driver: nvidia\n              count: 1\n"
               "              capabilities: [gpu]\n  old:\n    runtime: nvidia\n")
    text, _, findings = migrate_yaml(compose, "docker-compose.yml")
    assert text == compose
    assert _kinds(findings) == [(8, "container-gpu-request"), (12, "container-gpu-request")]


def test_a_compose_gpu_capability_without_a_driver_is_reported_once_per_device() -> None:
    """basaran's docker-compose.gpu.yml reserves `capabilities: [gpu]` with no driver line (compose
    hands NVIDIA's GPUs over without one): it was silent."""
    compose = ("services:\n  api:\n    deploy:\n      resources:\n        reservations:\n          devices:\n"
               "            - capabilities: [gpu]\n  worker:\n    deploy:\n      resources:\n        reservations:\n"
               "          devices:\n            - count: all\n              capabilities:\n                - gpu\n"
               "  named:\n    deploy:\n      resources:\n        reservations:\n          devices:\n"
               "            - driver: nvidia\n              capabilities: ['gpu', 'utility']\n"
               "  other:\n    deploy:\n      resources:\n        reservations:\n          devices:\n"
               "            - capabilities: [tpu]\n")
    _, _, findings = migrate_yaml(compose, "docker-compose.gpu.yml")
    assert _kinds(findings) == [(7, "container-gpu-request"), (14, "container-gpu-request"),
                                (21, "container-gpu-request")]

