"""The emulated NPU's side of a recorded cycle's Chrome trace: kernels on device streams.

torch.profiler sees the emulated device as CPU work (each op runs its CPU kernel inside the op:
there is no device activity to record), so a trace holds no device events, and the analyses of
HolisticTraceAnalysis that read device kernels (temporal breakdown, idle time, communication /
computation overlap) failed or returned NaN. `device_events` lays out what the NPU would run, in
the layout kineto gives a GPU, which HTA and TensorBoard read:

- a kernel per top-level op with an input on an NPU (what the user's code called; view ops launch
  none) on stream COMPUTE_STREAM of that device (its pid is the device index, as kineto writes a
  GPU's; a second NPU in the process has streams 3 and 4), lasting the op's roofline estimate for the emulated chip (roofline.py: an estimate, not a
  measurement; ops with no estimate, such as a random fill without tensor inputs, get no kernel).
  The kernels run in launch order, each when its op launches it or when the one before it ends.
- a kernel per collective the process group ran (gloo's ranges, on its own threads) on stream
  COLLECTIVE_STREAM, named `ncclKernel_<collective>`: HTA takes a kernel for communication by the
  name (`^nccl.*Kernel`). It lasts as long as the emulation's collective took (measured).
- a launch (cat "cuda_runtime", name "cudaLaunchKernel", the names the readers know) at each op's or
  collective's start on its thread, its `correlation` the kernel's: HTA pairs them by it, and
  analyses only the kernels launched before the last recorded step begins. The kernel starts once
  its launch (LAUNCH_US) is over. Flow events draw the arrow from launch to kernel in Perfetto.

Device times are whole microseconds, starts and durations rounded up (a duration to at least 1 us):
HTA reads a trace in whole microseconds, rounding each event's start up and its end down, which
would shorten most of these kernels (a few hundred nanoseconds each for a small model) to nothing.
The gaps between kernels are the emulated run's host time: the emulator's host is much slower
than a real host launching kernels, so idle time measures this run, not an NPU's.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from npukit.errors import UserError
from npukit.profiler.advisor import VIEW_OPS
from npukit.profiler.extract import THREAD_IDS
from npukit.profiler.roofline import Chip, estimate_seconds, get_chip
from npukit.profiler.summary import op_dtypes
from npukit.profiler.table import KIND_COMM, KIND_OP, EventTable

# The streams of the first NPU the process drives; a second NPU's are 3 and 4, and so on: HTA tells
# streams apart by number alone, not by device.
COMPUTE_STREAM = 1
COLLECTIVE_STREAM = 2
STREAM_KINDS = {COMPUTE_STREAM: "ops, estimated", COLLECTIVE_STREAM: "collectives, as run"}
COMMUNICATION_KERNEL_PREFIX = "ncclKernel_"  # HTA's communication kernels match ^nccl.*Kernel
LAUNCH_CATEGORY, LAUNCH_NAME = "cuda_runtime", "cudaLaunchKernel"
DEFAULT_CHIP = "910B2"  # the emulated device's default (npu_backend: NPUKIT_CHIP)
# The first launch/kernel correlation id. HTA stores the trace's row index of each linked event in a
# column of the correlation's integer type, which pandas narrows to the smallest that holds the ids:
# with ids below 32768 (int8, int16) linking a trace of more events than that raised TypeError.
FIRST_CORRELATION = 1 << 16
LAUNCH_US = 1  # a launch's duration: the trace's resolution (see the note on whole microseconds)


def emulated_chip() -> Chip:
    """The roofline chip of the device the run used (torch.npu.get_device_name(), "Ascend910B2
    (emulated)"), or the default one when there is none or the roofline has no figures for it."""
    import torch

    try:
        return get_chip(torch.npu.get_device_name().split()[0])
    except (AttributeError, RuntimeError, IndexError, UserError):
        return get_chip(DEFAULT_CHIP)


def _npu_index(devices: str) -> int | None:
    """The index of the first NPU in an op's input devices ("npu:1, npu:1, cpu"), None without one."""
    for part in devices.split(","):
        kind, _, index = part.strip().partition(":")
        if kind == "npu":
            return int(index or 0)
    return None


def estimated_kernels(table: EventTable, chip: Chip) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, NPU index, estimated seconds) of the kernels the device runs: top-level ops with an
    input on an NPU, no view op, with an estimate."""
    strings = table.string_array()
    candidates = np.flatnonzero((table.kind == KIND_OP) & table.top_level
                                & ~np.isin(strings[table.name_id], list(VIEW_OPS)))
    index_by_text = {text: _npu_index(text) for text in set(strings[table.devices_id[candidates]].tolist())}
    devices = np.array([index_by_text[text] for text in strings[table.devices_id[candidates]].tolist()], dtype=object)
    on_npu = np.array([device is not None for device in devices], dtype=bool)
    rows, devices = candidates[on_npu], devices[on_npu].astype(np.int64)
    if not len(rows):
        return rows, devices, np.zeros(0)
    seconds = estimate_seconds(chip, table.flops[rows], table.bytes[rows], op_dtypes(table, rows))
    keep = seconds > 0
    return rows[keep], devices[keep], seconds[keep]


def kernel_microseconds(seconds: np.ndarray) -> np.ndarray:
    """Device durations in whole microseconds, rounded up, at least one (see the module's note)."""
    return np.maximum(1, np.ceil(np.asarray(seconds, dtype=np.float64) * 1e6 - 1e-9)).astype(np.int64)


def device_events(table: EventTable, base_ns: int, pid: int, chip: Chip | None = None) -> list[str]:
    """The JSON texts of the device's trace events for one recorded cycle (its table, before it is
    joined to others), the trace's times counting from base_ns; [] when no op ran on an NPU."""
    chip = chip or emulated_chip()
    rows, devices, seconds = estimated_kernels(table, chip)
    if not len(rows):
        return []
    strings = table.string_array()
    names = strings[table.name_id]
    kernels = [(row, device, COMPUTE_STREAM, duration, names[row],
                {"estimated_us": round(estimate * 1e6, 3), "estimate": f"roofline, {chip.name}"})
               for row, device, duration, estimate in zip(rows.tolist(), devices.tolist(),
                                                          kernel_microseconds(seconds).tolist(), seconds.tolist())]
    # the collectives on the NPU the rank drives: the one most of its kernels run on
    collective_device = Counter(devices.tolist()).most_common(1)[0][0]
    collectives = np.flatnonzero(table.kind == KIND_COMM)
    kernels += [(row, collective_device, COLLECTIVE_STREAM, duration,
                 COMMUNICATION_KERNEL_PREFIX + names[row].split(":", 1)[-1],
                 {"collective": names[row], "measured_us": round(int(table.dur_ns[row]) / 1e3, 3)})
                for row, duration in zip(collectives.tolist(), kernel_microseconds(table.dur_ns[collectives] / 1e9).tolist())]

    events = []
    for device in sorted({kernel[1] for kernel in kernels}):
        events += [
            _metadata("process_name", device, 0, {"name": f"npu:{device} (emulated)"}),
            _metadata("process_labels", device, 0, {"labels": f"NPU {device}: kernel times estimated for {chip.name}"}),
            _metadata("process_sort_index", device, 0, {"sort_index": 0x10000000 + device}),
        ]
    order = {device: position for position, device in enumerate(sorted({kernel[1] for kernel in kernels}))}
    kernels = [(row, device, kind + 2 * order[device], *rest) for row, device, kind, *rest in kernels]
    streams = sorted({(kernel[1], kernel[2]) for kernel in kernels})
    events += [_metadata("thread_name", device, stream, {"name": f"stream {stream} ({STREAM_KINDS[COMPUTE_STREAM if stream % 2 else COLLECTIVE_STREAM]})"})
               for device, stream in streams]

    origin = int(table.meta["origin_ns"]) - base_ns
    thread_ids = table.meta.get(THREAD_IDS) or []
    free_at = dict.fromkeys(streams, 0)  # microseconds since base: a stream runs one kernel at a time
    for correlation, (row, device, stream, duration, name, details) in enumerate(kernels, FIRST_CORRELATION):
        launch = -(-(origin + int(table.start_ns[row])) // 1000)  # microseconds, rounded up
        start = max(launch + LAUNCH_US, free_at[device, stream])
        free_at[device, stream] = start + duration
        thread = int(table.thread[row])
        host = {"pid": pid, "tid": thread_ids[thread] if thread < len(thread_ids) else thread}
        on_device = {"pid": device, "tid": stream}
        events += [json.dumps(event) for event in (
            {"ph": "X", "cat": LAUNCH_CATEGORY, "name": LAUNCH_NAME, **host, "ts": launch, "dur": LAUNCH_US,
             "args": {"correlation": correlation}},
            {"ph": "X", "cat": "kernel", "name": name, **on_device, "ts": start, "dur": duration,
             "args": {"device": device, "stream": stream, "correlation": correlation, **details}},
            {"ph": "s", "id": correlation, **host, "ts": launch, "cat": "ac2g", "name": "ac2g"},
            {"ph": "f", "id": correlation, **on_device, "ts": start, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        )]
    return events


def _metadata(name: str, pid: int, tid: int, args: dict) -> str:
    return json.dumps({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})
