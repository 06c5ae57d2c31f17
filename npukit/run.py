"""`npu-run` / `python -m npukit.run`: run a script on the emulated NPU, unmodified.

The backend is installed, `torch_npu` answers from npukit, then the script runs exactly as
`python script.py args...` would (argv, `__main__`, sys.path[0], exit code). Options add a
golden run, per-layer dumps, overflow detection, a training monitor and profiling around it. With
`--nproc-per-node N` the same command is relaunched under torchrun.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from npukit.errors import UserError
from npukit.launch_options import rename_option, strip_option
from npukit.watch.stop import StoppedAfterStep


@dataclass
class RunOptions:
    script: str
    args: list[str] = field(default_factory=list)
    module: bool = False
    devices: int = 8
    emulate: bool = False
    transfer_to_npu: bool = False
    nproc_per_node: int | None = None
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous, with nnodes > 1
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf (is_host=1 on the node that hosts the store ...)
    local_addr: str | None = None  # torchrun's --local-addr: the address other nodes reach this one at
    golden: bool = False
    golden_perturb: str | None = None  # a perturbed golden run at this precision (perturb.MANTISSA_BITS)
    perturb_seed: int = 0  # its rounding grid's seed (another seed: another draw of the band)
    seed: int | None = None
    dump: Path | None = None
    dump_level: str = "mix"
    dump_mode: str = "stats"
    dump_tensor_format: str = "pt"
    dump_steps: str | None = None
    dump_scope: str | None = None
    dump_list: str | None = None
    dump_ops: str | None = None  # msprobe_config.OP_SETS; None: DumpSession's default (msprobe's)
    dump_config: Path | None = None  # msprobe's config.json
    replay: Path | None = None
    replay_step: int = 0  # record/replay at the start of this training step (replay.py)
    stop_after_step: int | None = None  # end the run once this training step ended (watch/stop.py)
    precision_fix: Path | None = None
    detect_overflow: bool = False
    overflow_action: str = "report"
    overflow_max: int = 20
    overflow_dir: Path = Path("overflow")
    overflow_level: str = "api"
    overflow_underflow: bool = False
    profile: Path | None = None
    profile_steps: str | None = None
    monitor: Path | None = None
    monitor_every: int = 1
    monitor_modules: str | None = None  # a regular expression module paths must contain
    monitor_config: Path | None = None  # msprobe monitor's config.json
    monitor_checkpoint_every: int | None = None  # record the state at every K-th step's start (step_checkpoints.py)
    fast_forward: Path | None = None  # a recorded step's state: skip the heavy compute until it, load it (fast_forward.py)


def real_torch_npu_installed() -> bool:
    spec = importlib.util.find_spec("torch_npu")
    return spec is not None and spec.origin is not None and "npukit" not in spec.origin


def _err(message: str) -> None:
    print(f"npu-run: {message}", file=sys.stderr)


def _launch_torchrun(options: RunOptions) -> int:

    if options.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {options.nproc_per_node}")
    import tempfile

    argv = sys.argv[1:]
    for name in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-conf", "--local-addr"):
        argv = strip_option(argv, name)
    argv = rename_option(argv, "--monitor", "--monitor-dir")
    if options.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {options.nnodes}")
    if options.nnodes == 1:
        where = ["--master-addr", "127.0.0.1"]
    elif not options.rdzv_endpoint or ":" not in options.rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the address every node reaches, where "
                        "the first node to start hosts the rendezvous)")
    else:  # torchrun's c10d rendezvous: ranks by the order nodes join, the store on the endpoint's host
        where = ["--nnodes", str(options.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", options.rdzv_endpoint,
                 "--rdzv-id", os.environ.get("NPUKIT_RDZV_ID", "npukit")]
        if options.rdzv_conf:
            where += ["--rdzv-conf", options.rdzv_conf]
        if options.local_addr:  # else the node is known by its host name, which another node may not resolve
            where += ["--local-addr", options.local_addr]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(options.nproc_per_node),
               *where, "-m", "npukit.run", *argv]
    with tempfile.TemporaryDirectory(prefix="npu-run-failures-") as failures:
        launcher = subprocess.Popen(command, env=dict(os.environ, **{FAILURE_DIR_ENV: failures}))
        with _PassOnTermination(launcher) as termination:
            code = launcher.wait()
        if termination.received:
            return 128 + signal.SIGTERM
        if code:
            # torchrun's ChildFailedError report buries the script's own error: say it again, last
            # in the order they failed: the first is usually the cause, the others its consequence
            reports = sorted(Path(failures).glob("rank*.txt"), key=lambda p: p.stat().st_mtime_ns)
            for index, report in enumerate(reports):
                when = "failed first" if index == 0 and len(reports) > 1 else "failed"
                _err(f"{report.stem.replace('rank', 'rank ')} {when}: {report.read_text().strip()}")
    return code


FAILURE_DIR_ENV = "NPUKIT_FAILURE_DIR"


class _PassOnTermination:
    """SIGTERM to the launching npu-run (how `kill`, `docker stop` and Kubernetes stop a job: they signal
    one process) goes on to torchrun, which stops its ranks with it: each rank's npu-run then ends
    its script and writes what it recorded, as Ctrl-C (sent to the whole process group) does."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child
        self.received = False
        self._previous = None

    def __enter__(self) -> _PassOnTermination:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._pass_on)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _pass_on(self, signum, frame) -> None:
        if not self.received:
            _err("SIGTERM: passed on to the ranks, which end their scripts and write what they recorded")
        self.received = True
        with contextlib.suppress(OSError):
            self.child.send_signal(signum)


def _note_failure(exc: BaseException, tb) -> None:
    """Under npu-run --nproc-per-node: leave this rank's error where the launcher reads it."""
    directory = os.environ.get(FAILURE_DIR_ENV)
    if not directory:
        return
    frames = [f for f in traceback.extract_tb(tb) if not _is_runner_frame(f.filename)]
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    rank = os.environ.get("RANK", "0")
    with contextlib.suppress(OSError):
        Path(directory, f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}{where}\n")


def golden_autocast() -> None:
    """Golden run: every autocast region still runs, with float32 as its compute dtype.

    Removing the regions would break programs that rely on autocast to mix dtypes (an fp16 module
    called with fp32 inputs fails with "mat1 and mat2 must have the same dtype" without it). CPU
    autocast has no float32 target: CPU regions are switched off, which is fp32 there too.
    """
    import torch

    autocast_cls = torch.amp.autocast_mode.autocast
    original_init = autocast_cls.__init__

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cpu":
            original_init(self, device_type, dtype=dtype, enabled=False, cache_enabled=cache_enabled)
        else:
            original_init(self, device_type, dtype=torch.float32, enabled=enabled, cache_enabled=cache_enabled)

    autocast_cls.__init__ = init


def watch_golden_precision():
    """Golden run: warn once at the first fp16/bf16 matmul or conv computed outside autocast.

    Code that casts to a compute dtype itself (`model.to(torch.bfloat16)`, or FSDP2's
    MixedPrecisionPolicy(param_dtype=torch.bfloat16), which casts the parameters it gathers) runs in
    low precision under --golden too; the user must know the reference is not fp32. Returns the mode to enter.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from npukit.accuracy.stacks import CallStacks

    watched = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
               F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
               torch.einsum, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm}
    low = (torch.float16, torch.bfloat16)

    class GoldenPrecisionWatch(TorchFunctionMode):
        warned = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.warned and func in watched:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if any(t.dtype in low for t in tensors) and not any(
                        torch.is_autocast_enabled(t.device.type) for t in tensors[:1]):
                    self.warned = True
                    stacks = CallStacks(max_frames=1)  # the user's innermost frame, as the dump records it
                    frames = stacks.frames(stacks.capture(1))  # past this handler (run.py stops the walk)
                    where = f" at {frames[0][0]}:{frames[0][1]}" if frames else ""
                    _err(f"warning: the golden run is not fp32: {getattr(func, '__name__', func)} computes in "
                         f"{next(t.dtype for t in tensors if t.dtype in low)}{where} (the code, or a wrapper such "
                         "as FSDP2's MixedPrecisionPolicy(param_dtype=...), casts to a compute dtype itself; "
                         "--golden only runs autocast regions in fp32)")
            return func(*args, **kwargs)

    return GoldenPrecisionWatch()


class _Terminated(BaseException):
    """SIGTERM while npukit watches the run, raised in the script like Ctrl-C's KeyboardInterrupt
    (a BaseException: the script's `except Exception` lets it through)."""

    def __str__(self) -> str:
        return "stopped by SIGTERM"


class _TerminateLikeInterrupt:
    """While sessions watch the run, SIGTERM (how `kill`, `docker stop` and Kubernetes stop a process)
    ends the script as Ctrl-C does, so the sessions write what they recorded: by default the process
    died at once and a whole-run profile was lost without a word. Arriving while the sessions write,
    it is only noted. A second SIGTERM stops the process at once. A script that sets its own SIGTERM
    handler keeps it."""

    def __init__(self) -> None:
        self.received = False
        self.raising = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # only the main thread sets handlers
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self.raising = True

    def remove(self) -> None:
        self.raising = False
        if self._previous is not None and signal.getsignal(signal.SIGTERM) in (self._handle, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _err("SIGTERM: ending the run and writing what was recorded (a second SIGTERM stops at once)")
        if self.raising:
            self.raising = False
            raise _Terminated()


def _seed_everything(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)


def _select_local_device() -> None:
    """Under torchrun each rank starts on npu:LOCAL_RANK, as Ascend launch scripts arrange."""
    import torch

    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) < torch.npu.device_count():
        torch.npu.set_device(int(local_rank))


def _session_contexts(options: RunOptions, stack: contextlib.ExitStack) -> list:
    """Enter the sessions the options ask for; returns them (each is also on the stack)."""
    sessions: list = []
    _enter_sessions(options, stack, sessions)
    return sessions


def _enter_sessions(options: RunOptions, stack: contextlib.ExitStack, sessions: list) -> None:
    if options.golden_perturb is not None:  # first: the other sessions watch the perturbed run
        from npukit.accuracy.perturb import PerturbSession

        sessions.append(stack.enter_context(PerturbSession(options.golden_perturb, seed=options.perturb_seed)))
    if options.fast_forward is not None:  # before --replay: the state it loads at step N is there when --replay records
        from npukit.accuracy.fast_forward import FastForwardSession

        sessions.append(stack.enter_context(FastForwardSession(options.fast_forward)))
    if options.replay is not None:
        from npukit.accuracy.replay import ReplaySession

        sessions.append(stack.enter_context(ReplaySession(options.replay, start_step=options.replay_step)))
    elif options.replay_step:
        raise UserError("--replay-step N goes with --replay DIR (the state recorded, or replayed, at step N's start)")
    if options.stop_after_step is not None:
        from npukit.watch.stop import StopAfterStep

        sessions.append(stack.enter_context(StopAfterStep(options.stop_after_step)))
    if options.precision_fix is not None:  # before the dump: the dump sees the user's op, with the fix's result
        from npukit.accuracy.fixes import PrecisionFix, PrecisionFixSession

        sessions.append(stack.enter_context(PrecisionFixSession(PrecisionFix.load(options.precision_fix))))
    dump_options = _dump_options(options)
    if dump_options is not None:
        from npukit.accuracy.dump import DumpSession

        # step S of --dump-steps is step S of the monitor, --replay-step and --stop-after-step (--localize's
        # re-runs): forwards without gradients before the first optimizer step start no step
        dump_options["training_steps"] = (options.replay is not None or options.monitor is not None
                                          or options.stop_after_step is not None)

        sessions.append(stack.enter_context(DumpSession(**dump_options)))
    if options.detect_overflow:
        from npukit.accuracy.overflow import OverflowSession

        sessions.append(stack.enter_context(OverflowSession(options.overflow_dir, action=options.overflow_action,
                                            max_events=options.overflow_max, level=options.overflow_level,
                                            underflow=options.overflow_underflow)))
    if options.monitor is not None or options.monitor_config is not None:
        from npukit.accuracy.monitor import MonitorSession

        sessions.append(stack.enter_context(MonitorSession(**_monitor_options(options))))
    if options.monitor_checkpoint_every is not None:
        if options.monitor is None:
            raise UserError("--monitor-checkpoint-every goes with --monitor DIR (the checkpoints go into DIR/checkpoints)")
        from npukit.accuracy.step_checkpoints import StepCheckpoints

        sessions.append(stack.enter_context(StepCheckpoints(options.monitor, options.monitor_checkpoint_every)))
    if options.profile is not None:
        from npukit.profiler.record import ProfileSession

        sessions.append(stack.enter_context(ProfileSession(options.profile, steps=options.profile_steps)))


def _run_target(options: RunOptions) -> int:
    if options.module:
        sys.argv = [options.script, *options.args]
        sys.path[0:0] = [os.getcwd()]  # as `python -m` does: `npu-run -m scripts.train` finds ./scripts
        _free_script_globals(runpy.run_module(options.script, run_name="__main__", alter_sys=True))
        return 0
    script = Path(options.script)
    if not script.is_file():
        raise UserError(f"script not found: {options.script}")
    sys.argv = [str(script), *options.args]
    sys.path[0:0] = [str(script.resolve().parent)]
    _free_script_globals(runpy.run_path(str(script), run_name="__main__"))
    return 0


# What needs the emulated device (its numerics, its overflow flag, its host-side timeline)
_EMULATOR_ONLY = {"golden": "--golden (the golden run turns the emulator's numerics off: record it with --emulate)",
                  "detect_overflow": "--detect-overflow (it reads the emulator's overflow flag: on an Ascend host "
                                     "use msprobe's overflow check)",
                  "profile": "--profile (it records the emulator's host timeline: on an Ascend host use "
                             "torch_npu.profiler)"}


def _use_the_real_device(options: RunOptions) -> None:
    """On an Ascend host (a real torch_npu installed, no --emulate): the script runs on the real NPU,
    and the options that work the same there come along: --replay, --dump, --precision-fix (what
    npu-compare --find-fix's trials use), --seed, torchrun's launch."""
    refused = [text for option, text in _EMULATOR_ONLY.items() if getattr(options, option)]
    if refused:
        raise UserError("a real torch_npu is installed, so the script runs on the Ascend device, where "
                        + "; ".join(refused) + " does not apply; or pass --emulate for npukit's emulated NPU")
    try:
        import torch_npu  # noqa: F401  (the real one: registers the Ascend device)
    except ImportError as exc:
        raise UserError(f"a real torch_npu is installed, but it does not import ({exc}): on an Ascend host set "
                        "up CANN (source set_env.sh); elsewhere pass --emulate for npukit's emulated NPU") from None


def _free_script_globals(namespace: dict) -> None:
    """Frees what the finished script left in its globals once torch.distributed's threads had the
    GIL. A gloo thread destroying a collective it has just finished needs the GIL (to free its
    tensors' Python objects), and freeing a DDP model runs its process group's destructor, which
    joins that thread while holding the GIL: 1 run in 3 of 2 nodes x 4 ranks hung at exit so."""
    if _gloo_threads_may_run():
        time.sleep(0.5)  # the GIL released: a gloo thread waiting for it gets it and finishes
    namespace.clear()


def _gloo_threads_may_run() -> bool:
    """The run made a process group whose gloo threads may still be finishing a collective: an hccl
    group (npukit's, run by gloo), or a group still initialized (a gloo one of the script's own)."""
    distributed = sys.modules.get("npukit.npu_backend.distributed")
    if distributed is not None and distributed.groups_made:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_runner_frame(filename: str) -> bool:
    """Frames of npu-run itself and of runpy, hidden from the user's traceback."""
    if filename.startswith("<frozen runpy"):
        return True
    return os.path.abspath(filename) in {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}


def _dump_options(options: RunOptions) -> dict | None:
    """DumpSession's arguments: from --dump and the --dump-* options, or from --dump-config (msprobe's
    config.json, with --dump or its dump_path). None without a dump."""
    from npukit.accuracy.msprobe_config import check_op_set, load_dump_config

    if options.dump_ops is not None:
        check_op_set(options.dump_ops)
    if options.dump_config is None:
        if options.dump is None:
            return None
        return {"out_dir": options.dump, "level": options.dump_level, "mode": options.dump_mode,
                "steps": options.dump_steps, "scope": options.dump_scope, "names": options.dump_list,
                "tensor_format": options.dump_tensor_format, "ops": options.dump_ops}
    config = load_dump_config(options.dump_config)
    defaults = RunOptions(script="")
    given = [flag for flag, field in (("--dump-level", "dump_level"), ("--dump-mode", "dump_mode"),
                                      ("--dump-steps", "dump_steps"), ("--dump-scope", "dump_scope"),
                                      ("--dump-list", "dump_list"))
             if getattr(options, field) != getattr(defaults, field)]
    if given:
        raise UserError(f"--dump-config {options.dump_config} says what {', '.join(given)} would: give one or the other")
    out_dir = options.dump or config.dump_path
    if out_dir is None:
        raise UserError(f"--dump-config {options.dump_config} has no dump_path: give --dump DIR")
    session = config.session_options()
    if options.dump_ops is not None:  # more (or fewer) apis than the config's risk level
        session["ops"] = options.dump_ops
    return {"out_dir": out_dir, "tensor_format": options.dump_tensor_format, **session}


def _monitor_options(options: RunOptions) -> dict:
    """MonitorSession's arguments: from --monitor and its options, or msprobe's --monitor-config."""
    if options.monitor is None:
        raise UserError("--monitor-config needs --monitor DIR (where the statistics go)")
    if options.monitor_config is None:
        return {"out_dir": options.monitor, "every": options.monitor_every, "modules": options.monitor_modules}
    from npukit.accuracy.monitor import load_monitor_config

    given = [flag for flag, value in (("--monitor-every", options.monitor_every != 1),
                                      ("--monitor-modules", options.monitor_modules is not None)) if value]
    if given:
        raise UserError(f"--monitor-config {options.monitor_config} says what {', '.join(given)} would: give one "
                        "or the other")
    return {"out_dir": options.monitor, **load_monitor_config(options.monitor_config)}


def main(options: RunOptions) -> int:
    if options.golden_perturb is not None:
        from npukit.accuracy.perturb import check_precision

        check_precision(options.golden_perturb)
        options.golden = True
    if options.perturb_seed != 0 and options.golden_perturb is None:
        raise UserError("--perturb-seed goes with --golden-perturb PRECISION (the seed of its rounding grid)")
    if options.perturb_seed < 0:
        raise UserError(f"--perturb-seed {options.perturb_seed}: expected a seed >= 0")
    _dump_options(options)  # a bad --dump-config or --dump-ops fails here, before any rank starts
    if options.nproc_per_node is not None:
        return _launch_torchrun(options)
    if options.nnodes != 1 or any(value is not None for value in (options.rdzv_endpoint, options.rdzv_conf,
                                                                   options.local_addr)):
        raise UserError("--nnodes, --rdzv-endpoint, --rdzv-conf and --local-addr go with --nproc-per-node "
                        "(torchrun's launch)")
    if real_torch_npu_installed() and not options.emulate:
        _use_the_real_device(options)
    else:
        if not 0 <= options.devices <= 64:
            raise UserError(f"--devices must be from 0 to 64, got {options.devices}")
        if "NPUKIT_DEVICE_COUNT" not in os.environ and "ASCEND_RT_VISIBLE_DEVICES" not in os.environ:
            os.environ["NPUKIT_DEVICE_COUNT"] = str(options.devices)
        if options.golden:
            os.environ["NPUKIT_GOLDEN"] = "1"

        import npukit.npu_backend  # noqa: F401  (installs the device)
        from npukit import autoload
        from npukit.npu_backend.torch_npu_shim import install_torch_npu

        install_torch_npu()
        autoload.pass_on_to_child_processes()  # python processes the script starts emulate too
    if options.transfer_to_npu:
        import torch_npu.contrib.transfer_to_npu  # noqa: F401  (applies the patches)
    if options.golden:
        golden_autocast()
    _select_local_device()
    if options.seed is not None:
        _seed_everything(options.seed)

    exit_code = 0
    with contextlib.ExitStack() as stack:
        if options.golden:
            stack.enter_context(watch_golden_precision())
        termination = _TerminateLikeInterrupt()
        stack.callback(termination.remove)  # removed last, once the sessions wrote
        sessions = _session_contexts(options, stack)
        if sessions:  # without any, SIGTERM stops the process as it would without npu-run
            termination.install()
        try:
            exit_code = _run_target(options)
        except SystemExit as exc:
            code = exc.code
            exit_code = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        except UserError:
            raise
        except StoppedAfterStep as stopped:
            print(f"npu-run: {stopped}", file=sys.stderr)
        except KeyboardInterrupt:
            exit_code = 130
        except _Terminated:
            exit_code = 128 + signal.SIGTERM  # the status a shell reports for a process SIGTERM ended
        except BaseException:
            # The user's script failed: show its traceback without npu-run's own frames.
            exc_type, exc, tb = sys.exc_info()
            while tb is not None and tb.tb_next is not None and _is_runner_frame(tb.tb_frame.f_code.co_filename):
                tb = tb.tb_next
            traceback.print_exception(exc_type, exc, tb)
            _note_failure(exc, tb)
            exit_code = 1
        finally:
            termination.raising = False  # from here on the sessions write: SIGTERM is only noted
        if termination.received:
            exit_code = 128 + signal.SIGTERM
        if exit_code:
            for session in sessions:  # their summaries must not describe a finished run
                if hasattr(session, "mark_run_failed"):
                    session.mark_run_failed()
    # Free the finished script's reference cycles (DDP/FSDP modules, process groups, collective
    # futures) while the interpreter is whole: freed during its shutdown instead, gloo's threads
    # aborted 1 two-rank run in 10 with "terminate called without an active exception".
    gc.collect()
    if termination.received:  # also when it came while the sessions wrote
        exit_code = 128 + signal.SIGTERM
    return exit_code


if __name__ == "__main__":
    from npukit.cli import run_main

    run_main()
