"""npu-run runs scripts as python would, on the emulated NPU; transfer_to_npu runs CUDA code."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CNN = REPO / "examples" / "cuda_project" / "train_cnn.py"


def npu_run(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "npukit.run", *args], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def losses(output: str) -> list[str]:
    return re.findall(r"step \d+ loss (\S+)", output)


def test_script_sees_argv_main_and_its_directory_and_exit_code(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 41\n")
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, torch, torch_npu\n"
        "from helper_mod import VALUE\n"
        "assert __name__ == '__main__'\n"
        "x = torch.ones(2).npu()\n"
        "print('argv', sys.argv[1:], 'device', x.device, 'value', VALUE + 1)\n"
        "print('torch_npu', torch_npu.npu.get_device_name())\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    result = npu_run(str(script), "3", "--flag")
    assert result.returncode == 3, result.stderr
    assert "argv ['3', '--flag'] device npu:0 value 42" in result.stdout
    assert "torch_npu Ascend910B2 (emulated)" in result.stdout


def test_devices_option_and_script_errors(tmp_path):
    script = tmp_path / "count.py"
    script.write_text("import torch\nprint(torch.npu.device_count())\nraise ValueError('boom in user code')\n")
    result = npu_run("--devices", "2", str(script))
    assert result.stdout.strip() == "2"
    assert result.returncode == 1
    assert "ValueError: boom in user code" in result.stderr
    assert 'count.py", line 3' in result.stderr


def test_missing_script_is_a_clear_error(tmp_path):
    result = npu_run(str(tmp_path / "nope.py"))
    assert result.returncode == 2
    assert "script not found" in result.stderr and "nope.py" in result.stderr
    assert "Traceback" not in result.stderr


def test_refuses_when_real_torch_npu_is_installed(tmp_path):
    fake = tmp_path / "site" / "torch_npu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not really')\n")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    refused = npu_run(str(script), env=env)
    assert refused.returncode == 2 and "a real torch_npu is installed" in refused.stderr
    assert "--emulate" in refused.stderr
    allowed = npu_run("--emulate", str(script), env=env)
    assert allowed.returncode == 0 and "ran" in allowed.stdout


def test_cuda_script_runs_unmodified_with_transfer_to_npu_and_matches_cpu_in_golden_mode():
    args = [str(CNN), "--steps", "4"]
    cpu = subprocess.run([sys.executable, *args, "--device", "cpu"], capture_output=True, text=True, timeout=300)
    golden = npu_run("--golden", "--transfer-to-npu", *args)
    assert golden.returncode == 0, golden.stderr
    assert "max memory allocated" in golden.stdout  # the CUDA branch of the script ran, on npu
    assert losses(golden.stdout) == losses(cpu.stdout) and len(losses(cpu.stdout)) == 4
    default = npu_run("--transfer-to-npu", *args)  # NPU numerics on (conv HF32): close, not equal
    npu_losses = [float(v) for v in losses(default.stdout)]
    cpu_losses = [float(v) for v in losses(cpu.stdout)]
    assert npu_losses != cpu_losses
    assert all(abs(a - b) < 1e-2 for a, b in zip(npu_losses, cpu_losses))


def test_cuda_script_without_transfer_fails_like_on_an_npu_host():
    result = npu_run(str(CNN), "--steps", "1", "--device", "cuda")
    assert result.returncode == 1
    assert "Torch not compiled with CUDA enabled" in result.stderr


def test_migrated_script_runs_under_npu_run(tmp_path):
    migrated_dir = tmp_path / "migrated"
    migrate = subprocess.run([str(Path(sys.executable).parent / "npu-migrate"), str(CNN.parent), "--out",
                              str(migrated_dir), "--quiet"], capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr
    migrated = (migrated_dir / CNN.name).read_text()
    assert "torch.cuda.amp.GradScaler(" not in migrated and "model.npu()" in migrated
    cpu = subprocess.run([sys.executable, str(CNN), "--steps", "3", "--device", "cpu"], capture_output=True,
                         text=True, timeout=300)
    result = npu_run("--golden", str(migrated_dir / CNN.name), "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "max memory allocated" in result.stdout  # the npu branch ran
    assert losses(result.stdout) == losses(cpu.stdout)


@pytest.mark.parametrize("option", ["--nproc-per-node", "--nnodes", "--rdzv-endpoint"])
def test_strip_option_keeps_script_arguments(option):
    from npukit.run import strip_option

    argv = ["--golden", option, "2", "train.py", option, "5", "--x"]
    assert strip_option(argv, option) == ["--golden", "train.py", option, "5", "--x"]
    assert strip_option([f"{option}=2", "t.py"], option) == ["t.py"]
    # after options with values (`--seed 0`): `npu-run --seed 0 --nproc-per-node 2 t.py` relaunched
    # itself under torchrun in every rank (the 0 was taken for the script's name) and hung
    argv = ["--seed", "0", "--dump", "d", option, "2", "-m", "pkg.train", option, "3"]
    assert strip_option(argv, option) == ["--seed", "0", "--dump", "d", "-m", "pkg.train", option, "3"]


def test_transfer_to_npu_runs_cuda_distributed_code_on_hccl(tmp_path):
    script = tmp_path / "cuda_dist.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1)\n"
        "t = torch.ones(3).cuda()\n"
        "dist.broadcast(t, 0)\n"  # PyTorch itself reads torch.cuda.get_device_capability() here
        "dist.all_reduce(t)\n"
        "print('backend', dist.get_backend(), 'device', t.device, 'capability', torch.cuda.get_device_capability())\n"
    )
    result = npu_run("--transfer-to-npu", str(script))
    assert result.returncode == 0, result.stderr
    assert "backend hccl device npu:0 capability (0, 0)" in result.stdout


def test_module_mode_finds_packages_in_the_current_directory_as_python_m_does(tmp_path):
    """`npu-run -m scripts.train` from a repo root: python -m puts the current directory on sys.path."""
    package = tmp_path / "scripts"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import sys, torch\n"
        "from scripts import helper\n"
        "print('ran', __name__, sys.argv[1:], torch.ones(1, device='npu').device, helper.VALUE)\n"
    )
    (package / "helper.py").write_text("VALUE = 7\n")
    console_script = Path(sys.executable).with_name("npu-run")  # not `python -m`, which adds the cwd itself
    result = subprocess.run([str(console_script), "-m", "scripts.train", "--lr", "1"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ran __main__ ['--lr', '1'] npu:0 7" in result.stdout


def test_a_failing_rank_is_named_last_with_its_own_error(tmp_path):
    """torchrun's ChildFailedError report buries the script's error: npu-run repeats it at the end."""
    script = tmp_path / "ddp_fail.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('hccl')\n"
                      "if dist.get_rank() == 1:\n    raise ValueError('bad batch on rank 1')\ndist.barrier()\n")
    result = npu_run("--nproc-per-node", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    last = [line for line in result.stderr.splitlines() if line.strip()][-2:]
    assert any("npu-run: rank 1 failed" in line and "ValueError: bad batch on rank 1 (ddp_fail.py, line 4)" in line
               for line in last), result.stderr[-2000:]
