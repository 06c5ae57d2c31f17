"""The pytest plugin npukit.testing, exercised on small migrated-looking projects.

Every project runs in its own pytest subprocess (runpytest_subprocess): installing the emulated
NPU or a torch_npu module is process-wide, and this session must stay as it is.
"""

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUBPROCESS_TIMEOUT = 120

# What a project looks like after npu-migrate: torch_npu imported by the conftest and the tests.
MIGRATED_CONFTEST = """
import pytest
import torch
import torch_npu  # noqa: F401

@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).npu()
"""

MIGRATED_TESTS = """
import torch
import torch_npu

def test_tensor_moves_to_the_npu():
    x = torch.ones(2).npu()
    assert x.device == torch.device("npu:0") and x.sum().item() == 2.0
    assert torch_npu.npu.is_available() and torch.npu.device_count() == 8

def test_training_step_under_autocast(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = model(torch.randn(3, 4, device="npu")).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert next(model.parameters()).grad.device.type == "npu"

def test_saturation_sets_the_overflow_flag(npu_device, npu_numerics):
    npu_numerics.configure(fp16_mode="saturation")
    x = torch.full((2,), 60000.0, dtype=torch.float16, device=npu_device) * 2
    assert x.max().item() == 65504.0 and npu_numerics.overflow_flag()

def test_numerics_were_restored_after_the_previous_test(npu_numerics):
    assert npu_numerics.fp16_mode() == "inf_nan" and not npu_numerics.overflow_flag()
    x = torch.full((2,), 60000.0, dtype=torch.float16, device="npu") * 2
    assert torch.isinf(x).all()

def test_npu_device_restores_the_current_device(npu_device):
    torch.npu.set_device(3)
    assert torch.npu.current_device() == 3

def test_current_device_is_back_to_zero():
    assert torch.npu.current_device() == 0
"""
MIGRATED_OUTCOMES = {"passed": 6}

# Reports the plugin's state without needing it: must also pass while the plugin is inactive.
PROBE_TESTS = """
import importlib.util
import sys

def test_probe(request):
    assert request.config.pluginmanager.has_plugin("npukit.testing")
    print("PROBE torch imported:", "torch" in sys.modules)
    print("PROBE emulator installed:", "npukit.npu_backend" in sys.modules)
    print("PROBE torch_npu importable:", importlib.util.find_spec("torch_npu") is not None)
"""


@pytest.fixture
def pytester(pytester, monkeypatch):
    """A pytester whose subprocesses see npukit but none of the caller's npukit/pytest switches."""
    for name in ("NPUKIT_PYTEST", "PYTEST_PLUGINS", "NPUKIT_DEVICE_COUNT", "ASCEND_RT_VISIBLE_DEVICES",
                 "NPUKIT_GOLDEN", "NPUKIT_FP16_MODE", "INF_NAN_MODE_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    checkout = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])))
    return pytester


def install_entry_point(pytester, monkeypatch):
    """Make the pytest11 entry point visible, exactly as `pip install npukit` does, from a dist-info."""
    site = pytester.mkdir("site")
    dist_info = site / "npukit_entry_point_probe-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: npukit-entry-point-probe\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[pytest11]\nnpukit.testing = npukit.testing\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))


def install_fake_real_torch_npu(pytester, monkeypatch):
    """A `torch_npu` package on sys.path that is not npukit's, as on an Ascend host."""
    packages = pytester.mkdir("ascend_site")
    (packages / "torch_npu").mkdir()
    (packages / "torch_npu" / "__init__.py").write_text("raise ImportError('the real torch_npu needs CANN')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(packages), os.environ["PYTHONPATH"]]))


def probe(result) -> dict[str, bool]:
    # With -s the first line shares its line with pytest's progress output.
    facts = [line[line.index("PROBE ") + len("PROBE "):] for line in result.outlines if "PROBE " in line]
    return {fact.rsplit(":", 1)[0]: fact.rsplit(":", 1)[1].strip() == "True" for fact in facts}


def test_explicit_plugin_runs_a_migrated_suite_on_the_emulated_npu(pytester):
    pytester.makeconftest(MIGRATED_CONFTEST)
    pytester.makepyfile(test_model=MIGRATED_TESTS)
    result = pytester.runpytest_subprocess("-p", "npukit.testing", timeout=SUBPROCESS_TIMEOUT)
    result.assert_outcomes(**MIGRATED_OUTCOMES)
    result.stdout.fnmatch_lines(["npukit: NPU emulated on the host CPU, 8 devices npu:0-7 (-p npukit.testing)*"])


@pytest.mark.parametrize(("switch", "named"), [
    ("--npu", "--npu"),
    ("NPUKIT_PYTEST=1", "NPUKIT_PYTEST=1"),
    ("ini", "npukit_emulate = true in */tox.ini"),
    ("ini, NPUKIT_PYTEST empty", "npukit_emulate = true in */tox.ini"),
])
def test_installed_entry_point_is_activated_by_each_switch(pytester, monkeypatch, switch, named):
    # Activation is observed through the real-torch_npu refusal, which names the switch and comes
    # before the emulator is imported; the full runs are in the tests above and below.
    install_entry_point(pytester, monkeypatch)
    install_fake_real_torch_npu(pytester, monkeypatch)
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    args = []
    if switch == "--npu":
        args.append("--npu")
    elif switch.startswith("ini"):
        pytester.makeini("[pytest]\nnpukit_emulate = true\n")
        if "empty" in switch:
            monkeypatch.setenv("NPUKIT_PYTEST", "")
    else:
        monkeypatch.setenv("NPUKIT_PYTEST", "1")
    result = pytester.runpytest_subprocess(*args, timeout=SUBPROCESS_TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*the emulated NPU was requested ({named})*"])


@pytest.mark.parametrize("case", ["not asked", "--no-npu beats NPUKIT_PYTEST=1", "NPUKIT_PYTEST=0 beats the ini"])
def test_installed_entry_point_stays_inactive_unless_asked(pytester, monkeypatch, case):
    install_entry_point(pytester, monkeypatch)
    pytester.makepyfile(test_probe=PROBE_TESTS)
    args = ["-s"]
    if case.startswith("--no-npu"):
        monkeypatch.setenv("NPUKIT_PYTEST", "1")
        args.append("--no-npu")
    elif case.startswith("NPUKIT_PYTEST=0"):
        monkeypatch.setenv("NPUKIT_PYTEST", "0")
        pytester.makeini("[pytest]\nnpukit_emulate = true\n")
    result = pytester.runpytest_subprocess(*args, timeout=SUBPROCESS_TIMEOUT)
    result.assert_outcomes(passed=1)
    assert probe(result) == {"torch imported": False, "emulator installed": False, "torch_npu importable": False}
    assert "npukit: NPU emulated" not in result.stdout.str()


def test_fixtures_fail_clearly_without_an_npu(pytester, monkeypatch):
    install_entry_point(pytester, monkeypatch)
    pytester.makepyfile(test_fixture="def test_needs_device(npu_device):\n    pass\n")
    result = pytester.runpytest_subprocess(timeout=SUBPROCESS_TIMEOUT)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*npu_device: no NPU in this session; run pytest with --npu (or NPUKIT_PYTEST=1)*"])


def test_refuses_to_shadow_a_real_torch_npu_unless_told(pytester, monkeypatch):
    install_fake_real_torch_npu(pytester, monkeypatch)
    pytester.makepyfile(test_shim="import torch_npu\n\ndef test_shim():\n    assert torch_npu.__npukit__\n")
    refused = pytester.runpytest_subprocess("-p", "npukit.testing", timeout=SUBPROCESS_TIMEOUT)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*a real torch_npu is installed, but the emulated NPU was requested "
                                  "(-p npukit.testing)*--no-npu*--npu-ignore-real-torch-npu*"])
    assert "Traceback" not in refused.stderr.str() + refused.stdout.str()
    forced = pytester.runpytest_subprocess("-p", "npukit.testing", "--npu-ignore-real-torch-npu",
                                           timeout=SUBPROCESS_TIMEOUT)
    forced.assert_outcomes(passed=1)


def test_devices_golden_and_transfer_to_npu_options(pytester, monkeypatch):
    install_entry_point(pytester, monkeypatch)
    pytester.makepyfile(test_cuda_code="""
        import torch
        from npukit.npu_backend import numerics

        def test_unmigrated_cuda_code_lands_on_the_npu():
            assert torch.ones(2).cuda().device.type == "npu"

        def test_device_count():
            assert torch.npu.device_count() == 2

        def test_golden_numerics_and_no_autocast():
            assert numerics.current() == numerics.Numerics("inf_nan", False, False, False, False)
            with torch.autocast("npu", dtype=torch.float16):
                assert (torch.ones(2, 2, device="npu") @ torch.ones(2, 2, device="npu")).dtype == torch.float32
    """)
    pytester.makeini("[pytest]\nnpukit_emulate = true\n")
    result = pytester.runpytest_subprocess("--npu-devices", "2", "--npu-golden", "--npu-transfer-to-npu",
                                           timeout=SUBPROCESS_TIMEOUT)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["npukit: NPU emulated on the host CPU, 2 devices npu:0-1 (npukit_emulate = true in "
                                 "*tox.ini)*transfer_to_npu applied*golden numerics*"])


@pytest.mark.parametrize(("args", "env", "ini", "message"), [
    (["--npu", "--npu-devices", "99"], {}, None, "--npu-devices must be from 0 to 64, got 99"),
    ([], {"NPUKIT_PYTEST": "maybe"}, None, "environment variable NPUKIT_PYTEST='maybe': expected 1 or 0*"),
    ([], {}, "maybe", "ini option npukit_emulate in *tox.ini: invalid truth value 'maybe' (expected true or false)"),
    ([], {"NPUKIT_PYTEST": "1", "NPUKIT_DEVICE_COUNT": "lots"}, None,
     "npukit: NPUKIT_DEVICE_COUNT='lots': expected a whole number*"),
], ids=["devices", "env", "ini", "emulator-env"])
def test_bad_settings_are_usage_errors(pytester, monkeypatch, args, env, ini, message):
    install_entry_point(pytester, monkeypatch)
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if ini is not None:
        pytester.makeini(f"[pytest]\nnpukit_emulate = {ini}\n")
    result = pytester.runpytest_subprocess(*args, timeout=SUBPROCESS_TIMEOUT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])
    assert "Traceback" not in result.stderr.str()


def test_the_session_says_how_many_tests_touched_the_npu_and_that_fp64_matmuls_are_refused(pytester):
    pytester.makeconftest(MIGRATED_CONFTEST)
    pytester.makepyfile(test_model=MIGRATED_TESTS)
    result = pytester.runpytest_subprocess("-p", "npukit.testing", timeout=SUBPROCESS_TIMEOUT)
    result.stdout.fnmatch_lines(["npukit: NPU emulated*float64 matmul/conv refused as on the device*"])
    ran = sum(MIGRATED_OUTCOMES.values())
    touching = [line for line in result.outlines if "put a tensor on the emulated NPU" in line]
    assert len(touching) == 1 and f"of {ran} test(s)" in touching[0] and not touching[0].startswith("npukit: 0 ")


def test_a_suite_that_never_touches_the_npu_is_told_so(pytester):
    pytester.makepyfile(test_cpu="import torch\n\ndef test_cpu_only():\n"
                                  "    dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                                  "    assert torch.ones(2, device=dev).sum() == 2\n")
    result = pytester.runpytest_subprocess("-p", "npukit.testing", timeout=SUBPROCESS_TIMEOUT)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["npukit: 0 of 1 test(s) put a tensor on the emulated NPU: none did*"])
