"""Recording: a context manager around (unmodified) user code that writes a profile per rank.

    with ProfileSession(Path("prof"), steps="1,1,3"):
        train()          # steps are found from optimizer.step(); no prof.step() needed

writes prof/rank{RANK}/: events.npz (the compact event table) and meta.json, and a Chrome /
Perfetto trace per recorded cycle named and placed as torch.profiler.tensorboard_trace_handler
does, all ranks' in prof/ itself: prof/rank{RANK}.{time_ns}.pt.trace.json (worker name
"rank{RANK}"). So TensorBoard's profiler plugin (`--logdir prof`, its distributed view: one run
whose workers are the ranks) and HolisticTraceAnalysis (`TraceAnalysis(trace_dir="prof")`, which
reads every .json there as a trace) open the folder as written.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import os
import re
import sys
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

from npukit.errors import UserError
from npukit.files import check_output_location, output_folder, refuse_links_inside
from npukit.profiler.device_trace import device_events
from npukit.profiler.extract import (
    FORWARD_CALLS,
    GC_ANNOTATION_PREFIX,
    RENAMED_COLLECTIVES,
    assign_forward_steps,
    table_from_profiler,
)
from npukit.profiler.table import EVENTS_FILE, META_FILE, EventTable, write_meta
from npukit.watch.process import rank_from_env
from npukit.watch.steps import TrainingSteps

LARGE_PROFILE_EVENTS = 100_000
# A whole-run profile (no schedule) ends its recording cycle at a step boundary once the process has
# grown by this much since the cycle began: torch holds every event of a cycle until it ends (a
# compiled nanoGPT's whole run: minutes at 7 GB once training was over). The cycle is read into the
# compact table and its trace written, and the next one starts.
CYCLE_GROWTH_BYTES = 2 << 30
# and stops recording once the tables hold this many events (about 100 bytes each)
MAX_EVENTS = 5_000_000
# A run without step boundaries (a server loop: no optimizer, no prof.step()) cannot end a cycle, so
# its growth is checked at module calls, at most this often, and recording stops at the same bound.
GROWTH_CHECK_SECONDS = 1.0
TRACE_SUFFIX = ".pt.trace.json"  # torch.profiler.tensorboard_trace_handler's, which the viewers look for


def export_trace(prof, target: Path, rank: int, world_size: int, renamed: list | None = None,
                 table: EventTable | None = None) -> None:
    """prof's Chrome trace written to `target` whole or not at all, naming `target` inside
    (`traceName`) and, when torch did not (the profiler started before init_process_group, as
    under npu-run), the rank (`distributedInfo`), which HolisticTraceAnalysis needs to tell the
    ranks' traces apart. With the cycle's table, the emulated NPU's kernels are added
    (device_trace.py: estimated times, on device streams, which HTA's device analyses read). The
    trace goes to a sibling whose name has the same length (.part for .json), is patched at its
    end, then renamed."""
    partial = target.with_name(target.name[: -len("json")] + "part")
    try:
        partial.unlink(missing_ok=True)  # never written through a link left there
        prof.export_chrome_trace(str(partial))
        if renamed:
            _rename_collectives(partial, renamed)
        device = _device_events(partial, table) if table is not None else []
        _patch_trace_end(partial, target, {"rank": rank, "world_size": world_size}, device)
        os.replace(partial, target)
    except OSError as exc:
        raise UserError(f"{target}: cannot write the trace ({exc.strerror or exc})") from None
    finally:
        partial.unlink(missing_ok=True)


def _trace_base_ns(trace: Path) -> int | None:
    """The trace's baseTimeNanoseconds (kineto writes its ts as microseconds since then), from its head."""
    with open(trace, "rb") as handle:
        base = re.search(rb'"baseTimeNanoseconds": (\d+)', handle.read(65536))
    return None if base is None else int(base.group(1))


def _device_events(trace: Path, table: EventTable) -> list[str]:
    """The emulated device's events for the trace, or none (said once) when they cannot be made:
    the trace is written either way."""
    base = _trace_base_ns(trace)
    if base is None or not isinstance(table.meta.get("origin_ns"), int):
        return []
    try:
        return device_events(table, base, os.getpid())
    except Exception as error:  # the device view is an addition: never the cost of the trace
        print(f"npukit.profiler: {trace.name[: -len('part')]}json has no device events ({type(error).__name__}: "
              f"{error})", file=sys.stderr)
        return []


_GLOO_WORK = re.compile(rb'"name": "(gloo:\w+)",(\s*"pid": -?\d+,\s*"tid": -?\d+,\s*"ts": )(\d+\.\d+)')


def _rename_collectives(trace: Path, renamed: list) -> None:
    """Give the gloo works the profile names by the collective asked for (extract.RENAMED_COLLECTIVES:
    FSDP's reduce_scatter, which gloo records as an all_reduce) their names in the trace too, found
    by name and start (kineto writes ts as microseconds since baseTimeNanoseconds, 3 decimals)."""
    origin = _trace_base_ns(trace)
    if origin is None:
        return
    data = trace.read_bytes()
    names = {(f"{(start - origin) // 1000}.{(start - origin) % 1000:03d}".encode(), old.encode()): new.encode()
             for start, old, new in renamed}  # integer arithmetic: a float has too few digits here

    def rename(match: re.Match) -> bytes:
        new = names.get((match.group(3), match.group(1)))
        return match.group(0) if new is None else b'"name": "' + new + b'",' + match.group(2) + match.group(3)

    trace.write_bytes(_GLOO_WORK.sub(rename, data))


def _patch_trace_end(trace: Path, final: Path, distributed_info: dict, events: list[str] | None = None) -> None:
    """Kineto ends the file with `], "traceName": "<path written>" }` (the end of traceEvents, its
    metadata at the start); `events` (JSON texts) are appended to traceEvents."""
    with open(trace, "r+b") as handle:
        has_distributed_info = b'"distributedInfo"' in handle.read(65536)
        size = handle.seek(0, os.SEEK_END)
        start = max(0, size - 65536)
        handle.seek(start)
        tail = handle.read()
        key = tail.rfind(b'"traceName"')
        if key < 0:
            return
        old, new = trace.name.encode(), final.name.encode()
        at = tail.find(old, key)
        if at >= 0 and len(old) == len(new):
            tail = tail[:at] + new + tail[at + len(old):]
        if not has_distributed_info:
            tail = tail[:key] + b'"distributedInfo": ' + json.dumps(distributed_info).encode() + b", " + tail[key:]
        end_of_events = tail.rfind(b"]", 0, key)
        if events and end_of_events >= 0:
            first = b"" if tail[:end_of_events].rstrip().endswith(b"[") else b",\n"
            tail = tail[:end_of_events] + first + ",\n".join(events).encode() + b"\n" + tail[end_of_events:]
        handle.seek(start)
        handle.write(tail)


# c10's CPU allocator logs this once per process, when a block allocated before a recording of
# allocations started is freed during it: a note about the profiler's bookkeeping, not the user's run
_UNKNOWN_BLOCK_NOTE = b"Memory block of unknown size was allocated before the profiling started"


@contextlib.contextmanager
def _without_kineto_markers():
    """libkineto writes `USDT: ... profiler_start` / `profiler_stop` trace markers to stderr each
    time a recording starts or stops; no KINETO_LOG_LEVEL hides them without hiding its errors too.
    Around those calls stderr is caught and every other line passed on; c10's once-per-process note
    about blocks allocated before a recording (see _recording_may_start) is dropped too."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not line.startswith(b"USDT:") and _UNKNOWN_BLOCK_NOTE not in line]
            if kept:
                os.write(2, b"".join(kept))


def _resident_bytes() -> int | None:
    """The process's resident memory (Linux); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def _recording_may_start():
    """Around a call that may start recording allocations: a block allocated before it is freed after
    it, so that c10's note about such blocks is written (once per process) where it is caught."""
    import torch

    older = torch.empty(1)
    with _without_kineto_markers():
        yield
        del older


P2P_PREFIX = "npukit.p2p:"  # "npukit.p2p:send:3", "npukit.p2p:recv:0", "npukit.p2p:recv:any"


class _P2PMarker:
    """Names the peer of each point-to-point op in the profile. A process group records its sends
    and receives (gloo:send, gloo:recv) without the peer rank, which the cluster view's
    communication matrix needs: while a session records, the send/recv/recv_anysource methods of
    ProcessGroup and of its subclasses (npukit's hccl group is one), where torch.distributed.send,
    isend, recv, irecv and batch_isend_irecv end, run inside a range
    `npukit.p2p:<send|recv>:<global peer rank|any>`. The methods are patched, not the
    torch.distributed functions, whose identity P2POp and batch_isend_irecv compare."""

    _METHODS = ("send", "recv", "recv_anysource")

    def __init__(self) -> None:
        self._saved: list[tuple[type, str, object]] = []

    def install(self) -> None:
        try:
            from torch._C._distributed_c10d import ProcessGroup
        except ImportError:  # a torch built without distributed support
            return
        from torch.autograd.profiler import record_function

        inside = threading.local()  # a subclass's send calling its base's is one op
        classes, pending = [], [ProcessGroup]
        while pending:
            cls = pending.pop()
            classes.append(cls)
            pending.extend(cls.__subclasses__())
        for cls in classes:
            for method in self._METHODS:
                entry = cls.__dict__.get(method)  # what puts the method back as it was
                if entry is None:
                    continue
                self._saved.append((cls, method, entry))
                setattr(cls, method, _p2p_wrapper(getattr(cls, method), method, record_function, inside))

    def remove(self) -> None:
        for cls, method, entry in reversed(self._saved):
            setattr(cls, method, entry)
        self._saved.clear()


def _p2p_wrapper(original, method: str, record_function, inside: threading.local):
    direction = "send" if method == "send" else "recv"

    def wrapper(group, tensors, *args, **kwargs):
        if getattr(inside, "active", False):
            return original(group, tensors, *args, **kwargs)
        peer = "any"
        if method != "recv_anysource":
            peer = _global_rank(group, args[0] if args else next(iter(kwargs.values()), "?"))
        inside.active = True
        try:
            with record_function(f"{P2P_PREFIX}{direction}:{peer}"):
                return original(group, tensors, *args, **kwargs)
        finally:
            inside.active = False

    wrapper.__name__ = method
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _global_rank(group, local) -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_global_rank(group, int(local)))
    except Exception:  # a group torch.distributed does not know: its own rank numbering
        return str(local)


@dataclass(frozen=True)
class StepSchedule:
    wait: int
    warmup: int
    active: int
    repeat: int = 1

    def describe(self) -> str:
        return f"wait={self.wait}, warmup={self.warmup}, active={self.active}, repeat={self.repeat}"


def parse_steps(text: str | None) -> StepSchedule | None:
    """Parse --profile-steps "wait,warmup,active[,repeat]" (e.g. "1,1,3")."""
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (3, 4) or any(n < 0 for n in numbers) or numbers[2] < 1:
        raise UserError(
            f"--profile-steps {text!r}: expected wait,warmup,active[,repeat] as non-negative integers"
            " with active >= 1, e.g. 1,1,3"
        )
    return StepSchedule(*numbers)


class _ModuleNamer:
    """Names every called nn.Module by attribute path (Net.encoder.0) for the module grouping.

    A global forward pre-hook sees the outermost module first and names its whole subtree.
    """

    def __init__(self, on_call=None) -> None:
        self.names: dict[int, str] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._handle = None
        self._on_call = on_call  # called at every module call (the growth check of a run without steps)

    def install(self) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._is_compiling = torch.compiler.is_compiling
        self._handle = register_module_forward_pre_hook(self._pre_hook)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre_hook(self, module, args) -> None:
        # not while torch.compile traces the call: the check's time.monotonic would break its graph
        if self._on_call is not None and not self._is_compiling():
            self._on_call()
        ref = self._refs.get(id(module))
        if ref is not None and ref() is module:
            return
        for name, sub in module.named_modules(prefix=type(module).__name__):
            ref = self._refs.get(id(sub))
            if ref is None or ref() is not sub:
                self.names[id(sub)] = name
                self._refs[id(sub)] = weakref.ref(sub)


class _SwapPause:
    """Lets torch.utils.swap_tensors work while a profile records.

    torch.profiler keeps weak references to the tensors it records (each op input's, with shapes;
    each called module's parameters, with stacks), and swap_tensors refuses a tensor that has any
    (pytorch/pytorch#170137). nn.Module._apply swaps parameters that way for tensor subclasses,
    so FSDP2's `model.to_empty(device=...)` after a meta-device init failed under `npu-run
    --profile` and ran without it. The first swap while recording ends the recording cycle (its
    table and trace are kept; ending it frees the references) and the swap goes ahead; recording
    starts again at the next step boundary. (Started again from inside a module call instead, at
    the next forward, torch's Python tracer grew by gigabytes as it stopped, on that example.)"""

    def __init__(self, recording, pause) -> None:
        self._recording, self._pause = recording, pause
        self._original = None

    def install(self) -> None:
        import torch.utils

        self._original = torch.utils.swap_tensors
        torch.utils.swap_tensors = self._swap

    def remove(self) -> None:
        import torch.utils

        if self._original is not None:
            torch.utils.swap_tensors = self._original
            self._original = None

    def _swap(self, t1, t2) -> None:
        if self._recording():
            self._pause()
        self._original(t1, t2)


class _CompilePause:
    """Pauses the recording while torch.compile compiles. torch's Python tracer records every Python
    call of Dynamo's and Inductor's tracing (millions for a small transformer) at about 20 bytes each,
    and reading them at the cycle's end takes about 1.5 KB each: a compiled nanoGPT-like trainer's
    whole-run profile grew from 1 GB to more than 17 GB once training was over, for minutes, and wrote
    nothing. Dynamo's compile-start callback ends the recording cycle (its table and trace are kept);
    recording starts again at the next step boundary. torch._dynamo is slow to import: its callbacks
    are registered when it is already loaded, else by the first torch.compile call."""

    def __init__(self, pause) -> None:
        self._pause = pause
        self._handler = None
        self._compile = None

    def install(self) -> None:
        import torch

        if "torch._dynamo.callback" in sys.modules:
            self._register()
            return
        original = self._compile = torch.compile

        @functools.wraps(original)
        def compile(*args, **kwargs):
            self._register()
            return original(*args, **kwargs)

        torch.compile = compile

    def _register(self) -> None:
        if self._handler is None:
            from torch._dynamo.callback import callback_handler

            self._handler = callback_handler
            callback_handler.register_start_callback(self._on_compile_start)

    def remove(self) -> None:
        import torch

        if self._compile is not None:
            torch.compile, self._compile = self._compile, None
        if self._handler is not None:
            with contextlib.suppress(ValueError):
                self._handler.remove_start_callback(self._on_compile_start)
            self._handler = None

    def _on_compile_start(self, args) -> None:
        try:
            self._pause()
        except Exception as error:  # an error here would fail the compile, and so the user's run
            print(f"npukit.profiler: could not pause the recording for torch.compile ({type(error).__name__}: "
                  f"{error}); its tracing is recorded", file=sys.stderr)


class _GcMarker:
    """Marks Python garbage-collection pauses as "Python GC gen<N>" ranges in the profile.

    The callback imports nothing, not even through record_function's lazily loaded ops (warmed up
    at install, after the profiler's own start): a collection can start in the middle of an import
    (torch's lazy imports as the profiler starts), and an import from inside it corrupts the import
    locks (`KeyError` in `_find_and_load`, then "import ... halted; None in sys.modules")."""

    def __init__(self) -> None:
        self._open = None
        self._record_function = None
        self._is_compiling = None
        self._in_dispatch_mode = None

    def prepare(self) -> None:
        """Before the profiler starts: everything the callback uses, loaded (outside any profile)."""
        import torch
        from torch.autograd.profiler import record_function
        from torch.utils._python_dispatch import is_in_torch_dispatch_mode

        self._record_function = record_function
        self._is_compiling = torch.compiler.is_compiling
        self._in_dispatch_mode = is_in_torch_dispatch_mode
        with record_function("npukit warm-up"):  # its ops load lazily: load them now
            pass

    def install(self) -> None:
        """After the profiler's start, which imports much of torch lazily."""
        gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start" and self._open is None:
            # A collection can start while torch.compile traces (fake/proxy tensor modes): a range
            # opened there would be traced as an op. Those pauses are left unmarked.
            if self._is_compiling() or self._in_dispatch_mode():
                return
            marker = self._record_function(f"{GC_ANNOTATION_PREFIX} gen{info.get('generation', '?')}")
            try:
                marker.__enter__()
            except Exception:  # marking is a nicety: never an error in the user's run
                return
            self._open = marker
        elif phase == "stop" and self._open is not None:
            marker, self._open = self._open, None
            with contextlib.suppress(Exception):
                marker.__exit__(None, None, None)


class ProfileSession:
    """Profile the code inside `with`; step boundaries come from optimizer.step() unless the
    user calls `.step()` themselves (pass auto_steps=False when the loop calls .step() itself).

    out_dir: profile root; this process writes out_dir/rank{RANK}/.
    steps: "wait,warmup,active[,repeat]" schedule, or None to record everything.
    """

    def __init__(
        self,
        out_dir: Path,
        steps: str | None = None,
        *,
        with_stack: bool = True,
        record_shapes: bool = True,
        trace: bool = True,
        rank: int | None = None,
        auto_steps: bool = True,
    ) -> None:
        self.root = Path(out_dir)
        self.schedule = parse_steps(steps)
        self.rank = rank_from_env() if rank is None else rank
        self.directory = self.root / f"rank{self.rank}"
        self.worker_name = f"rank{self.rank}"  # the trace files' worker name, as TensorBoard shows it
        check_output_location(self.root, "--profile")
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"--profile {self.root}: {self.directory} exists and is not a directory")
        self.with_stack = with_stack
        self.record_shapes = record_shapes
        self.write_trace = trace
        self.tables: list[EventTable] = []
        self.traces: list[str] = []
        self.steps_taken = 0
        self.auto_steps = auto_steps
        self._explicit_steps = False
        self._auto_steps_taken = 0
        self._profiler = None
        self._namer = _ModuleNamer(self._check_growth_without_steps)
        self._next_growth_check = 0.0
        self._first_call_bytes: int | None = None  # the process's size at the first module call
        self._gc = _GcMarker()
        self._p2p = _P2PMarker()
        # optimizer.step, or under GradScaler when GradScaler.update returns (its ops are the step's)
        self._training_steps = TrainingSteps(self._end_auto_step)
        self._stopping = False
        self._cycle_note_filter = None  # the warning filter the session adds for the run
        self._pausing = False
        self._run_failed = False  # the run ended early (an error, Ctrl-C, SIGTERM): say where its profile is
        self._cycle_start_bytes: int | None = None  # the process's size when the recording cycle began
        self._stopped: str | None = None  # why a whole-run profile stopped recording
        self._not_recorded: list[int] = []  # the steps between two of its recording cycles
        self._new_profiler = None
        self._swaps = _SwapPause(lambda: self._profiler is not None, self._pause_recording)
        self._compiles = _CompilePause(self._pause_for_compile)
        self._compile_pauses = 0

    # -- user API ------------------------------------------------------------------------
    def step(self) -> None:
        """Mark the end of a training step (turns off automatic steps from optimizer.step())."""
        if not self._explicit_steps and self._auto_steps_taken:
            print(
                f"npukit.profiler: step() called after optimizer.step() already marked {self._auto_steps_taken}"
                " step(s); from now on only step() marks steps (pass auto_steps=False to use step() alone)",
                file=sys.stderr,
            )
        self._explicit_steps = True
        self._training_steps.counting = False
        self._advance()

    def __enter__(self) -> ProfileSession:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

        refuse_links_inside(self.root, "--profile", depth=1)
        self._clear_previous_output()
        if self.schedule is not None:
            s = self.schedule
            step_schedule = schedule(wait=s.wait, warmup=s.warmup, active=s.active, repeat=s.repeat)
        else:
            # An explicit always-record schedule: without one torch does not mark ProfilerStep ranges.
            # (Until the recording is stopped at its bound: see _bound_recording.)
            def step_schedule(step: int) -> ProfilerAction:
                stopped = self._stopped or step in self._not_recorded
                return ProfilerAction.NONE if stopped else ProfilerAction.RECORD

        def new_profiler():
            return profile(
                activities=[ProfilerActivity.CPU],
                record_shapes=self.record_shapes,
                with_stack=self.with_stack,
                with_flops=True,
                profile_memory=True,  # the allocations: which op's output each op reads (data flow)
                on_trace_ready=self._on_trace_ready,
                schedule=step_schedule,
            )

        self._new_profiler = new_profiler
        self._training_steps.counting = self.auto_steps
        self._training_steps.install()
        self._namer.install()
        self._p2p.install()
        self._swaps.install()
        self._compiles.install()
        self._gc.prepare()
        # torch's note for key_averages() users as each cycle starts (each cycle is read as it ends here):
        # silenced once for the run, not in a catch_warnings() per step, whose filter change would make
        # every warn-once warning of the user's (and torch's) repeat at each step
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        self._cycle_note_filter = warnings.filters[0]
        self._start_recording()
        self._gc.install()
        return self

    def mark_run_failed(self) -> None:
        """npu-run: the script did not finish (it failed, or Ctrl-C or SIGTERM stopped it)."""
        self._run_failed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stopping = True
        ended_early = self._run_failed or exc_type is not None
        try:
            try:
                if self._profiler is not None:
                    with _without_kineto_markers():
                        self._profiler.__exit__(exc_type, exc, tb)
            finally:
                self._swaps.remove()
                self._compiles.remove()
                self._training_steps.remove()
                self._namer.remove()
                self._p2p.remove()
                self._gc.remove()
                if self._cycle_note_filter in warnings.filters:
                    warnings.filters.remove(self._cycle_note_filter)
                    warnings._filters_mutated()
            written = self._write_table()
        except Exception as error:
            if not ended_early:
                raise
            # how the run ended is what the user must see: the profile's failure is said once, beside it
            print(f"npukit.profiler: no profile written to {self.directory}: {error}", file=sys.stderr)
            return
        if ended_early and written:
            print(f"npukit.profiler: the run did not finish; the profile of what it ran is in {self.directory}",
                  file=sys.stderr)

    # -- internals -----------------------------------------------------------------------
    def _clear_previous_output(self) -> None:
        """Output of an earlier run in the same directory would be taken for this run's."""
        if self.directory.is_dir():
            for old in [*self.directory.glob("trace_*.json"), self.directory / EVENTS_FILE, self.directory / META_FILE]:
                old.unlink(missing_ok=True)
        if self.root.is_dir():
            for old in self.root.glob(f"{self.worker_name}.*{TRACE_SUFFIX}"):
                old.unlink(missing_ok=True)

    def _end_auto_step(self, optimizer, skipped: bool, loss_scale: float | None) -> None:
        self._auto_steps_taken += 1
        self._advance()

    def _advance(self) -> None:
        self.steps_taken += 1
        if self._profiler is None:  # paused (a tensor swap, a compile): the next step is recorded again
            if not self._stopped:
                self._start_recording()
            return
        ends_cycle = self.schedule is None and self._bound_recording()
        with _recording_may_start():
            self._profiler.step()
        if ends_cycle:  # the cycle's events are freed: the next one grows from here
            self._cycle_start_bytes = _resident_bytes()

    def _bound_recording(self) -> bool:
        """At a step's end in a whole-run profile: True when the process grew by CYCLE_GROWTH_BYTES since
        the recording cycle began; the step that ends here then ends the cycle (torch reads it, it goes
        into the table, its trace is written) and the step starting now is not recorded: the next cycle
        starts after it. (Restarting at once, inside optimizer.step's profiler range, crashes torch.)
        Once the tables hold MAX_EVENTS events, recording stops at this step, saying why."""
        from torch.profiler import ProfilerAction

        events = sum(len(table) for table in self.tables)
        if self._stopped is None and events > MAX_EVENTS:
            self._stopped = (f"at step {self.steps_taken}: the profile holds {events:,} events (npukit keeps at "
                             f"most {MAX_EVENTS:,})")
            print(f"npukit.profiler: stopped recording {self._stopped}; what was recorded is kept. Record a window "
                  "of the run with --profile-steps wait,warmup,active (e.g. 5,1,3)", file=sys.stderr)
        recording = self._profiler.current_action == ProfilerAction.RECORD
        size = _resident_bytes()
        if self._stopped or not recording or size is None or self._cycle_start_bytes is None:
            return False
        if size - self._cycle_start_bytes <= CYCLE_GROWTH_BYTES:
            return False
        self._profiler.current_action = ProfilerAction.RECORD_AND_SAVE
        self._not_recorded.append(self.steps_taken)
        return True

    def _pause_for_compile(self) -> None:
        """torch.compile starts compiling while a cycle records: end the cycle here (see _CompilePause);
        the step in progress is not recorded."""
        from torch.profiler import ProfilerAction

        if self._profiler is None or self._stopping or self._profiler.current_action not in (
                ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            return
        whole_run_setup = self.schedule is None and not self._explicit_steps and not self.steps_taken
        if not whole_run_setup:
            self._not_recorded.append(self.steps_taken)
        if not self._compile_pauses:
            print(f"npukit.profiler: torch.compile is compiling (step {self.steps_taken}): recording pauses until "
                  "the step ends (its tracing is not profiled)", file=sys.stderr)
        self._compile_pauses += 1
        self._pause_recording()

    def _check_growth_without_steps(self) -> None:
        """At a module call of a run that has taken no step yet (a server loop): once the process has grown
        by CYCLE_GROWTH_BYTES since its first module call, recording stops, saying why: with no step boundary
        the cycle cannot end and start again (see _bound_recording). Checked at most every
        GROWTH_CHECK_SECONDS."""
        now = time.monotonic()
        if now < self._next_growth_check:
            return
        self._next_growth_check = now + GROWTH_CHECK_SECONDS
        if self.steps_taken or self._profiler is None or self._stopped or self._stopping or self._pausing:
            return
        size = _resident_bytes()
        if size is None:
            return
        if self._first_call_bytes is None:  # from the first module call on: loading the model is no recording
            self._first_call_bytes = size
            return
        if size - self._first_call_bytes <= CYCLE_GROWTH_BYTES:
            return
        grown = (size - self._first_call_bytes) / 2**20
        self._stopped = (f"without a step: the process grew by {grown:,.0f} MiB from its first module call (npukit ends a "
                         f"recording at {CYCLE_GROWTH_BYTES / 2**20:,.0f} MiB, and a run without steps has no "
                         "boundary to start the next one at)")
        print(f"npukit.profiler: stopped recording {self._stopped}; what was recorded is kept. Mark steps with "
              "the Python API's prof.step() (e.g. one per request) to profile the whole run in bounded cycles",
              file=sys.stderr)
        self._pause_recording()

    def _start_recording(self) -> None:
        """Start a recording cycle whose steps are numbered on from the steps already taken."""
        self._profiler = self._new_profiler()
        self._profiler.step_num = self.steps_taken
        self._profiler.current_action = self._profiler.schedule(self.steps_taken)
        self._cycle_start_bytes = _resident_bytes()
        with _recording_may_start():
            self._profiler.__enter__()

    def _pause_recording(self) -> None:
        """End the recording cycle (its table and trace are kept) and drop torch's profiler, with
        the references it holds to the tensors it recorded."""
        profiler, self._profiler = self._profiler, None
        self._pausing = True
        try:
            with _without_kineto_markers():
                profiler.__exit__(None, None, None)
        finally:
            self._pausing = False
        del profiler
        gc.collect()

    def _on_trace_ready(self, prof) -> None:
        table = table_from_profiler(prof, self._namer.names)
        renamed = table.meta.pop(RENAMED_COLLECTIVES, [])
        if self._pausing or self._stopping and self.steps_taken:
            # The range open when recording stops is no training step: it runs from the last step's
            # end to the end of the script (saving, destroy_process_group ...) or to a tensor swap.
            table.step[table.step == self.steps_taken] = -1
        self.tables.append(table)
        if table.meta.get("unreadable_events"):
            print(f"npukit.profiler: {table.meta['unreadable_events']} profiler event(s) could not be read and were "
                  f"left out of the table (first: {table.meta['unreadable_error']}); the rest is kept",
                  file=sys.stderr)
        if len(table) > LARGE_PROFILE_EVENTS:
            print(
                f"npukit.profiler: {len(table):,} events in one recording; summaries stay fast, but the trace is"
                " large. Record fewer steps with --profile-steps wait,warmup,active (e.g. 5,1,3).",
                file=sys.stderr,
            )
        if self.write_trace:
            output_folder(self.root)
            target = self.root / f"{self.worker_name}.{time.time_ns()}{TRACE_SUFFIX}"
            export_trace(prof, target, self.rank, int(os.environ.get("WORLD_SIZE", "1")), renamed, table)
            self.traces.append(target.name)

    def _write_table(self) -> bool:
        """Write the table and meta.json; False (and why, on stderr) when nothing was recorded."""
        import torch

        if not self.tables:
            why = (
                f"the schedule ({self.schedule.describe()}) never reached an active step: "
                f"{self.steps_taken} step(s) seen"
                if self.schedule
                else "nothing was recorded"
            )
            hint = "" if self.steps_taken else " (no optimizer.step() call; use the Python API and call .step())"
            print(f"npukit.profiler: no profile written to {self.directory}: {why}{hint}", file=sys.stderr)
            return False
        forward_calls = [call for part in self.tables for call in part.meta.pop(FORWARD_CALLS, [])]
        table = EventTable.concat(self.tables)
        step_source = "explicit" if self._explicit_steps or not self.auto_steps else "optimizer.step"
        setup_step = None
        if self.schedule is None and step_source == "optimizer.step":  # a whole run, its steps found
            if self.steps_taken:
                # up to the first optimizer step: building and loading the model, moving it to the
                # device, the first step's one-time costs. It is setup, no step.
                setup_step = 0
                table.step[table.step == setup_step] = -1
            elif assign_forward_steps(table, forward_calls):
                step_source = "forward"
        steps = table.op_steps()
        meta = {
            "schema": 1,
            "rank": self.rank,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": sys.argv,
            "schedule": None if self.schedule is None else self.schedule.__dict__,
            "steps": steps,
            "step_source": step_source,
            "setup_step": setup_step,
            "events": len(table),
            "traces": self.traces,
            "with_stack": self.with_stack,
            "data_flow": all(part.meta.get("data_flow") for part in self.tables),
            "recording_stopped": self._stopped,
            "steps_not_recorded": self._not_recorded,
            "compile_pauses": self._compile_pauses,
            # the clock of start_ns 0 (the profiler's, ns since the epoch): lines the ranks up in time
            "origin_ns": table.meta.get("origin_ns"),
        }
        table.meta = meta
        output_folder(self.root, self.directory.name)
        table.save(self.directory)
        write_meta(self.directory, meta)
        return True


def profile(out_dir: str | os.PathLike, steps: str | None = None, **options) -> ProfileSession:
    """Python API: `with npukit.profiler.profile("prof", steps="1,1,3") as prof: ... prof.step()`."""
    return ProfileSession(Path(out_dir), steps, **options)
