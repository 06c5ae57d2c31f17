"""pytest plugin: run a project's own test suite on npukit's emulated NPU, `torch_npu` importable.

Installed as the pytest11 entry point `npukit.testing`, so pytest loads it in every project of an
environment where npukit is installed. Loaded that way it stays inactive (it imports nothing and
changes nothing) until it is asked for, by any one of:

- `pytest --npu`, or loading it explicitly: `pytest -p npukit.testing`
- the environment variable `NPUKIT_PYTEST=1`
- the ini option `npukit_emulate = true` (pytest.ini, tox.ini, setup.cfg or pyproject.toml)

`--no-npu` (or `NPUKIT_PYTEST=0`) turns it off again, e.g. on an Ascend host for a project whose
ini file asks for emulation. When active, the emulated NPU is installed and `import torch_npu`
answers from npukit before any conftest or test module is imported. It refuses to run over a real
torch_npu unless `--npu-ignore-real-torch-npu` is given.

Fixtures: `npu_device` (torch.device("npu:0"), current device restored afterwards) and
`npu_numerics` (the `npukit.npu_backend.numerics` module; every policy and the overflow flag are
restored afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

PLUGIN_NAME = "npukit.testing"
ENV_SWITCH = "NPUKIT_PYTEST"
INI_SWITCH = "npukit_emulate"
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass
class _Activation:
    active: bool
    reason: str  # what asked for (or against) the emulator, for messages and the header
    installed: bool = False


_ACTIVATION_KEY = pytest.StashKey[_Activation]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("npukit", "npukit emulated Ascend NPU")
    group.addoption("--npu", dest="npukit_npu", action="store_true", default=None,
                    help=f"Run the tests on npukit's emulated NPU, `import torch_npu` answered by npukit "
                         f"(also: {ENV_SWITCH}=1, ini {INI_SWITCH} = true, -p {PLUGIN_NAME}).")
    group.addoption("--no-npu", dest="npukit_npu", action="store_false",
                    help=f"Do not install the emulated NPU even if {ENV_SWITCH} or the ini file asks for it.")
    group.addoption("--npu-devices", dest="npukit_devices", type=int, default=None, metavar="N",
                    help="Number of emulated NPUs (default: NPUKIT_DEVICE_COUNT / ASCEND_RT_VISIBLE_DEVICES, else 8).")
    group.addoption("--npu-golden", dest="npukit_golden", action="store_true", default=False,
                    help="Golden numerics: NPU numeric policies off and autocast regions computed in fp32, as `npu-run --golden`.")
    group.addoption("--npu-transfer-to-npu", dest="npukit_transfer", action="store_true", default=False,
                    help="Tests still written for CUDA: apply torch_npu.contrib.transfer_to_npu first.")
    group.addoption("--npu-ignore-real-torch-npu", dest="npukit_ignore_real", action="store_true", default=False,
                    help="Use the emulated NPU even though a real torch_npu is installed.")
    parser.addini(INI_SWITCH, type="bool", default=False,
                  help=f"Run the tests on npukit's emulated NPU (see --npu; {ENV_SWITCH} and --no-npu override it).")


def _decide(config: pytest.Config, options) -> _Activation:
    """Command line first, then the environment, then the ini file."""
    flag = options.npukit_npu
    if flag is not None:
        return _Activation(flag, "--npu" if flag else "--no-npu")
    explicit_plugins = [*options.plugins, *os.environ.get("PYTEST_PLUGINS", "").split(",")]
    if PLUGIN_NAME in (spec.strip() for spec in explicit_plugins):
        return _Activation(True, f"-p {PLUGIN_NAME}")
    env_value = os.environ.get(ENV_SWITCH, "")
    if env_value.strip():  # set but empty counts as unset, as for the emulator's own variables
        lowered = env_value.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise pytest.UsageError(f"environment variable {ENV_SWITCH}={env_value!r}: expected 1 or 0 "
                                    "(true/false, on/off)")
        return _Activation(lowered in _TRUE, f"{ENV_SWITCH}={env_value}")
    try:
        from_ini = config.getini(INI_SWITCH)
    except (ValueError, pytest.UsageError) as exc:  # pytest < 9 raises ValueError for a bad bool
        raise pytest.UsageError(f"ini option {INI_SWITCH} in {config.inipath}: {exc} (expected true or false)") from exc
    if from_ini:
        return _Activation(True, f"{INI_SWITCH} = true in {config.inipath}")
    return _Activation(False, "not requested")


def _install(options, activation: _Activation) -> None:
    from npukit.errors import UserError
    from npukit.run import golden_autocast, real_torch_npu_installed

    if real_torch_npu_installed() and not options.npukit_ignore_real:
        raise pytest.UsageError(
            f"npukit: a real torch_npu is installed, but the emulated NPU was requested ({activation.reason}). "
            "On an Ascend host run the tests with --no-npu to use the real device, or pass "
            "--npu-ignore-real-torch-npu to use npukit's emulated NPU anyway.")
    devices = options.npukit_devices
    if devices is not None:
        if not 0 <= devices <= 64:
            raise pytest.UsageError(f"--npu-devices must be from 0 to 64, got {devices}")
        # Through the environment as npu-run does, so processes the tests start see the same count.
        os.environ["NPUKIT_DEVICE_COUNT"] = str(devices)
        os.environ.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    if options.npukit_golden:
        os.environ["NPUKIT_GOLDEN"] = "1"
    try:
        import npukit.npu_backend  # noqa: F401  (installs the device)
        from npukit import autoload
        from npukit.npu_backend.torch_npu_shim import install_torch_npu

        install_torch_npu()
        # python processes the tests start (`accelerate launch`, subprocess, spawn) emulate too
        autoload.pass_on_to_child_processes()
        if options.npukit_transfer:
            import torch_npu.contrib.transfer_to_npu  # noqa: F401  (applies the patches)
    except UserError as exc:
        raise pytest.UsageError(f"npukit: {exc}") from exc
    if options.npukit_golden:
        golden_autocast()
    activation.installed = True


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before the first conftest is imported: a conftest may `import torch_npu` at the top.
    options = early_config.known_args_namespace
    activation = _decide(early_config, options)
    early_config.stash[_ACTIVATION_KEY] = activation
    if activation.active:
        _install(options, activation)


def pytest_configure(config: pytest.Config) -> None:
    # Loaded from a conftest's `pytest_plugins`, the plugin missed the early hook: install now,
    # still before collection.
    if _ACTIVATION_KEY not in config.stash:
        config.stash[_ACTIVATION_KEY] = _decide(config, config.option)
    activation = config.stash[_ACTIVATION_KEY]
    if activation.active and not activation.installed:
        _install(config.option, activation)


def pytest_report_header(config: pytest.Config) -> list[str]:
    activation = config.stash.get(_ACTIVATION_KEY, None)
    if activation is None or not activation.installed:
        return []
    import torch

    from npukit.npu_backend import numerics

    policy = numerics.current()
    count = torch.npu.device_count()
    devices = {0: "no device", 1: "1 device npu:0"}.get(count, f"{count} devices npu:0-{count - 1}")
    numerics_text = "golden numerics (policies off, autocast regions in fp32)" if config.option.npukit_golden else (
        f"fp16 {policy.fp16_mode}, fp32 accumulate {'on' if policy.fp32_accumulate else 'off'}, "
        f"matmul hf32 {'on' if policy.matmul_hf32 else 'off'}, conv hf32 {'on' if policy.conv_hf32 else 'off'}"
        + (", float64 matmul/conv refused as on the device (--npu-golden or NPUKIT_REJECT_FP64=0 allow them)"
           if policy.reject_fp64 else ""))
    transfer = ", transfer_to_npu applied" if config.option.npukit_transfer else ""
    return [f"npukit: NPU emulated on the host CPU, {devices} ({activation.reason}); "
            f"import torch_npu -> npukit{transfer}; {numerics_text}"]


_TOUCH_KEY = pytest.StashKey[list]()  # [tests run, tests that allocated on the NPU]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Count the tests that put a tensor on the NPU: a green run that never touched it proves nothing."""
    if not _emulated(item.config):
        return (yield)
    import torch

    counts = item.config.stash.setdefault(_TOUCH_KEY, [0, 0])
    before = _allocations(torch)
    try:
        return (yield)
    finally:
        counts[0] += 1
        counts[1] += _allocations(torch) > before


def _allocations(torch) -> int:
    return sum(torch.npu.memory_stats(index).get("allocation.all.allocated", 0)
               for index in range(torch.npu.device_count()))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    counts = config.stash.get(_TOUCH_KEY, None)
    if counts is None or not _emulated(config):
        return
    ran, touched = counts
    line = f"npukit: {touched} of {ran} test(s) put a tensor on the emulated NPU"
    if ran and not touched:
        terminalreporter.write_line(line + ": none did, so this run says nothing about the NPU (do the tests pick "
                                    "their device with torch.cuda.is_available()? use torch.npu or the npu_device "
                                    "fixture)", yellow=True, bold=True)
    else:
        terminalreporter.write_line(line)


def _emulated(config: pytest.Config) -> bool:
    activation = config.stash.get(_ACTIVATION_KEY, None)
    return activation is not None and activation.installed


def _fail_without_npu(fixture: str) -> None:
    pytest.fail(f"{fixture}: no NPU in this session; run pytest with --npu (or {ENV_SWITCH}=1) to use "
                "npukit's emulated NPU", pytrace=False)


@pytest.fixture
def npu_device(request: pytest.FixtureRequest):
    """torch.device("npu:0") made current; the previous current device is restored afterwards.

    With the plugin off on a host whose real torch_npu is installed: the real npu:0.
    """
    if not _emulated(request.config):
        from npukit.run import real_torch_npu_installed

        if not real_torch_npu_installed():
            _fail_without_npu("npu_device")
        import torch_npu  # noqa: F401  (the real one registers the device)
    import torch

    previous = torch.npu.current_device()
    torch.npu.set_device(0)
    try:
        yield torch.device("npu", 0)
    finally:
        torch.npu.set_device(previous)


@pytest.fixture
def npu_numerics(request: pytest.FixtureRequest):
    """`npukit.npu_backend.numerics`, to switch policies in a test; all of them are restored afterwards.

    `npu_numerics.configure(fp16_mode="saturation")`, `npu_numerics.overflow_flag()` ... The
    sticky overflow flag starts cleared and is cleared again at the end. Skipped on a real NPU:
    these are the emulator's switches.
    """
    if not _emulated(request.config):
        from npukit.run import real_torch_npu_installed

        if real_torch_npu_installed():
            pytest.skip("npu_numerics switches npukit's emulated NPU; this session uses the real torch_npu")
        _fail_without_npu("npu_numerics")
    from npukit.npu_backend import numerics

    state = numerics.current()
    numerics.clear_overflow_flag()
    try:
        yield numerics
    finally:
        numerics.restore(state)
        numerics.clear_overflow_flag()
