"""Turn torch.profiler's recorded event tree into an EventTable.

torch's own `with_stack` grouping needs a verbose experimental config and never names module
paths, so stacks and modules are derived here from the Python tracer events in the tree:
the stack line of an op is the innermost call made from the user's own code (not torch,
npukit, the standard library or site-packages), and its module path is the innermost
nn.Module call, named by attribute path (Net.encoder.0.fc1) through `module_names`.
Backward ops inherit the stack line and module path of the forward op that created their
autograd node (matched by sequence number), so "by module" and "by line" cover backward too.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

from npukit.profiler.cost import CONV_OPS, element_size, numel, op_cost
from npukit.profiler.table import (
    KIND_ANNOTATION,
    KIND_AUTOGRAD,
    KIND_COMM,
    KIND_GC,
    KIND_OP,
    PHASE_BACKWARD,
    PHASE_DATALOADER,
    PHASE_FORWARD,
    PHASE_OPTIMIZER,
    PHASE_OTHER,
    EventTable,
    TableBuilder,
)
from npukit.watch.collectives import COLLECTIVE_MARK

GC_ANNOTATION_PREFIX = "Python GC"
STEP_PREFIX = "ProfilerStep#"
DATALOADER_PREFIX = "enumerate(DataLoader)#"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function: "
# The ranges a process group's backend records around each collective it runs, on its own threads
# (gloo) or streams: the time the collective took, which the calling thread does not show.
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "hccl:")
# table.meta key (never saved): [(start ns since the epoch, gloo's name, the name asked for)]
RENAMED_COLLECTIVES = "renamed_collectives"
# table.meta key (never saved): [(start, end ns since the epoch, thread, module)] of each outermost
# nn.Module call (one not inside another module's call), from the Python tracer (module: its address)
FORWARD_CALLS = "forward_calls"
# table.meta key (never saved): the OS thread id (the Chrome trace's "tid") of each value of the
# thread column, where record.export_trace puts the emulated device's launch events
THREAD_IDS = "thread_ids"


@lru_cache(maxsize=4096)
def is_user_file(file_name: str) -> bool:
    """True for the user's own source files (the tracer shortens paths relative to sys.path). A
    name that is no Python file is never one: torch's tracer has handed back a frame whose file
    name was a string of the program ("'class_to_index' must have at least one entry"), which the
    GC-pause advice then printed as a location."""
    if not file_name or file_name.startswith("<") or not file_name.endswith((".py", ".pyw")):
        return False
    path = Path(file_name)
    candidates = [path] if path.is_absolute() else [Path(entry or ".") / path for entry in sys.path]
    library_roots = _library_roots()
    for candidate in candidates:
        if candidate.is_file():
            resolved = os.path.realpath(candidate)
            return not any(resolved.startswith(root) for root in library_roots)
    # Unresolvable: only torch's and npukit's own trees are known not to be user code.
    return path.parts[0] not in ("torch", "npukit", "torchgen", "functorch", "typing.py")


# Python whose ops are the framework's doing, not the model's: torch.distributed (FSDP's sharding,
# gathering and copy-in/out, DDP's helpers), the emulated hccl group (its CPU aliases of npu memory)
# and the emulator's Python kernels (torch_npu's fused ops, integer histc): on a device each is one
# kernel reading its inputs there, so the host reads and copies of their emulation are not the
# user's syncs (a grouped matmul's group_list check, histc's host copy). The op the user called
# stays theirs: its row is recorded before its kernel's Python runs.
_FRAMEWORK_DIRS = (
    ("torch", "distributed"),
    ("npukit", "npu_backend", "distributed.py"),
    ("npukit", "npu_backend", "fused"),
    ("npukit", "npu_backend", "aten_kernels.py"),
)


@lru_cache(maxsize=4096)  # once per file: called for every Python call event
def _is_framework_file(file_name: str) -> bool:
    parts = Path(file_name).parts
    return any(parts[i:i + len(marker)] == marker for marker in _FRAMEWORK_DIRS
               for i in range(len(parts) - len(marker) + 1))


@lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    import torch

    paths = sysconfig.get_paths()
    # "scripts": console-script launchers (npu-run, torchrun) are never the user's code
    roots = {
        os.path.realpath(paths[key]) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib", "scripts") if key in paths
    }
    roots.add(os.path.realpath(Path(torch.__file__).parent) + os.sep)
    roots.add(os.path.realpath(Path(__file__).parents[1]) + os.sep)  # npukit itself
    return tuple(sorted(roots))


def _list_shapes(texts: list[str]) -> str:
    """A tensor list's shapes on one line: `([8, 8], [8])`, or for a long list (a foreach op over every
    parameter) `(50 tensors: [256, 256] x30, [256] x20)`, the two commonest shapes first."""
    if len(texts) <= 3:
        return "(" + ", ".join(texts) + ")"
    counts: dict[str, int] = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    common = sorted(counts.items(), key=lambda item: -item[1])
    shown = ", ".join(f"{text} x{count}" for text, count in common[:2])
    rest = f", +{len(common) - 2} more shapes" if len(common) > 2 else ""
    return f"({len(texts)} tensors: {shown}{rest})"


def _describe_inputs(inputs) -> tuple[list[tuple[tuple[int, ...], str]], list[str], str, str]:
    """(tensors as (shape, dtype), devices, shapes text, dtypes text) for an op's inputs."""
    tensors: list[tuple[tuple[int, ...], str]] = []
    devices: list[str] = []
    shape_parts: list[str] = []
    dtype_parts: list[str] = []
    for item in inputs:
        group = item if isinstance(item, list) else [item]
        metas = [m for m in group if hasattr(m, "sizes")]
        if not metas:
            continue
        texts = []
        for meta in metas:
            shape = tuple(meta.sizes)
            dtype = str(meta.dtype).removeprefix("torch.")
            tensors.append((shape, dtype))
            devices.append(str(meta.device))
            texts.append(str(list(shape)))
        if isinstance(item, list):
            shape_parts.append(_list_shapes(texts))
            dtype_parts.append("(" + ", ".join(sorted({d for _, d in tensors[-len(metas):]})) + ")")
        else:
            shape_parts.append(texts[0])
            dtype_parts.append(tensors[-1][1])
    return tensors, devices, ", ".join(shape_parts), ", ".join(dtype_parts)


def _kineto_event_facts(kineto_results) -> tuple[dict[tuple[int, str], float], dict[int, int]]:
    """torch's own FLOP counts (with_flops) keyed by (start ns, name), which know conv2d strides,
    and the OS thread id of each thread number the event tree uses (its start_tid)."""
    counts: dict[tuple[int, str], float] = {}
    thread_ids: dict[int, int] = {}
    for event in kineto_results.events():
        thread = event.start_thread_id()
        if thread not in thread_ids:
            thread_ids[thread] = event.device_resource_id()
        flops = event.flops()
        if flops:
            try:
                counts[(event.start_ns(), event.name())] = float(flops)
            except UnicodeDecodeError:
                continue
    return counts, thread_ids


def _frame_of(caller) -> tuple[str, int, str] | None:
    """(file, line, function) of a Python event's frame; None when torch cannot decode its strings
    (frames of code that Dynamo generated, under torch.compile, come back as invalid UTF-8)."""
    try:
        return caller.file_name, caller.line_number, caller.function_name
    except UnicodeDecodeError:
        return None


def table_from_profiler(prof, module_names: dict[int, str] | None = None, meta: dict | None = None) -> EventTable:
    """Build the event table of one finished torch.profiler.profile cycle."""
    from torch._C._profiler import _EventType

    results = prof.profiler.kineto_results
    roots = results.experimental_event_tree()
    torch_flops, thread_ids = _kineto_event_facts(results)
    module_names = module_names or {}
    builder = TableBuilder()
    threads: dict[int, int] = {}
    cost_cache: dict[tuple, tuple[float, float]] = {}
    # sequence number -> (thread, row) of the forward ops that recorded it, in order (see _node_creators)
    forward_by_seq: dict[int, list[tuple[int, int]]] = {}
    backward_rows: list[tuple[int, int]] = []  # (row, sequence number of its autograd node)
    inherited_flops: dict[int, float] = {}  # top-level row -> FLOPs of its costed descendants
    step_ranges: list[tuple[int, int, int]] = []
    forward_calls: list[tuple[int, int, int, int]] = []
    # data flow (see _resolve_sources): storages written (time, pointer, top-level row) and read
    # (time, top-level row, tensor input index, pointer)
    writes: list[tuple[int, int, int]] = []
    reads: list[tuple[int, int, int, int]] = []
    torch_op, py_call, py_ccall = _EventType.TorchOp, _EventType.PyCall, _EventType.PyCCall
    allocation = _EventType.Allocation
    unreadable, first_error = 0, ""

    # Context per pending event: (parent row, stack, module, phase, top row, costed, autograd seq,
    # torch's FLOP count of the enclosing conv call, which its conv-family children share, and
    # whether the innermost Python function around it is torch.distributed's or the hccl group's).
    pending = [(root, (-1, None, None, PHASE_OTHER, -1, False, -1, 0.0, False)) for root in reversed(roots)]
    while pending:
        event, (parent, stack, module, phase, top_row, costed, node_seq, conv_flops, framework) = pending.pop()
        context = (parent, stack, module, phase, top_row, costed, node_seq, conv_flops, framework)
        try:
            tag = event.tag
            if tag == py_call or tag == py_ccall:
                fields = event.extra_fields
                caller = _frame_of(fields.caller)
                if caller is not None and is_user_file(caller[0]):
                    stack = f"{caller[0]}:{caller[1]} in {caller[2]}"
                elif tag == py_call:
                    # Called from a launcher or library (runpy's exec of a script): ops directly in
                    # the called user code (`x @ w` at a script's top level makes no Python call
                    # event) belong to it; the profiler does not record their line.
                    callee = _frame_of(fields.callsite)
                    if callee is not None and is_user_file(callee[0]):
                        stack = f"{callee[0]} in {callee[2]}"
                if tag == py_call:
                    callee = _frame_of(fields.callsite)
                    if callee is not None and not callee[0].startswith("<"):
                        # Python of torch's own (nn, autograd, amp ...) neither starts nor ends it
                        if _is_framework_file(callee[0]):
                            framework = True
                        elif is_user_file(callee[0]):
                            framework = False
                if tag == py_call and fields.module is not None:
                    if module is None:
                        forward_calls.append((event.start_time_ns, event.end_time_ns,
                                              threads.setdefault(event.start_tid, len(threads)),
                                              fields.module.self_ptr))
                    module = module_names.get(fields.module.self_ptr, fields.module.cls_name)
                    if phase == PHASE_OTHER:
                        phase = PHASE_FORWARD
            elif tag == allocation:
                fields = event.extra_fields
                if fields.alloc_size > 0 and fields.ptr:
                    writes.append((event.start_time_ns, fields.ptr, top_row))
            elif tag == torch_op:
                fields = event.extra_fields
                try:
                    name = event.name
                except UnicodeDecodeError:  # seen with torch 2.13 on rare events; keep the row
                    name = "<undecodable name>"
                scope = str(fields.scope)
                seq = int(fields.sequence_number)
                thread = threads.setdefault(event.start_tid, len(threads))
                start, duration = event.start_time_ns, event.duration_time_ns
                if name.startswith(AUTOGRAD_NODE_PREFIX) or scope.endswith("BACKWARD_FUNCTION"):
                    kind, phase, node_seq = KIND_AUTOGRAD, PHASE_BACKWARD, seq
                elif scope.endswith("USER_SCOPE") or name.startswith((STEP_PREFIX, DATALOADER_PREFIX, *OPTIMIZER_PREFIXES)):
                    kind = KIND_GC if name.startswith(GC_ANNOTATION_PREFIX) else KIND_ANNOTATION
                    if name.startswith(COLLECTIVE_PREFIXES):
                        kind = KIND_COMM
                    if name.startswith(STEP_PREFIX):
                        step_ranges.append((start, start + duration, int(name[len(STEP_PREFIX):] or -1)))
                    elif name.startswith(OPTIMIZER_PREFIXES):
                        phase = PHASE_OPTIMIZER
                    elif name.startswith(DATALOADER_PREFIX):
                        phase = PHASE_DATALOADER
                else:
                    kind = KIND_OP
                row_args: dict = {}
                if kind == KIND_OP:
                    tensors, devices, shapes, dtypes = _describe_inputs(fields.inputs)
                    key = (name, shapes, dtypes)
                    cost = cost_cache.get(key)
                    known = torch_flops.get((start, name), 0.0) or (conv_flops if name in CONV_OPS else 0.0)
                    if name in CONV_OPS:
                        conv_flops = known
                    if cost is None or known:
                        cost = op_cost(name, tensors, known)
                        cost_cache[key] = cost
                    is_top = top_row < 0
                    flops = cost[0]
                    row_args = dict(
                        shapes=shapes, dtypes=dtypes, devices=", ".join(devices), flops=flops, nbytes=cost[1],
                        top_level=is_top,
                    )
                elif kind == KIND_COMM:
                    # the tensors the collective moves (its bytes for the cluster view's matrix)
                    tensors, devices, shapes, dtypes = _describe_inputs(fields.inputs)
                    row_args = dict(shapes=shapes, dtypes=dtypes, devices=", ".join(devices),
                                    nbytes=float(sum(numel(shape) * element_size(dtype) for shape, dtype in tensors)))
                row = builder.add(
                    name, start_ns=start, dur_ns=duration, kind=kind, phase=phase, parent=parent,
                    thread=thread, stack=stack, module=module, seq=seq, framework=framework and kind == KIND_OP,
                    **row_args,
                )
                if kind == KIND_OP:
                    if seq >= 0 and phase != PHASE_BACKWARD:
                        forward_by_seq.setdefault(seq, []).append((thread, row))
                    if is_top:
                        _note_storages(row, name, start, start + duration, fields.inputs, writes, reads)
                        top_row, costed = row, flops > 0
                    elif flops > 0 and not costed:
                        inherited_flops[top_row] = inherited_flops.get(top_row, 0.0) + flops
                        costed = True
                else:
                    top_row, costed = -1, False
                if node_seq >= 0 and phase == PHASE_BACKWARD:
                    backward_rows.append((row, node_seq))
                parent = row
        except Exception as exc:  # one bad event (undecodable strings of a dynamo frame ...) never costs the recording
            unreadable += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            (parent, stack, module, phase, top_row, costed, node_seq, conv_flops, framework) = context
        context = (parent, stack, module, phase, top_row, costed, node_seq, conv_flops, framework)
        pending.extend((child, context) for child in reversed(event.children))

    for row, flops in inherited_flops.items():
        builder.set(row, "flops", flops)
    creators = _node_creators(forward_by_seq)
    for row, seq in backward_rows:
        forward = creators.get(seq)
        if forward is not None:
            for column in ("stack_id", "module_id"):
                if builder.get(forward, column) >= 0:
                    builder.set(row, column, builder.get(forward, column))

    meta = dict(meta or {}, **{FORWARD_CALLS: forward_calls,
                               THREAD_IDS: [thread_ids.get(thread, thread) for thread in threads]})
    if unreadable:
        meta.update(unreadable_events=unreadable, unreadable_error=first_error)
    meta["data_flow"] = bool(getattr(prof, "profile_memory", False))  # allocations recorded
    table = builder.build(meta)
    _assign_steps(table, step_ranges)
    new_index = _sort_by_start(table)
    _set_sources(table, _resolve_sources(writes, reads), new_index)
    _name_collectives_as_asked(table)
    _nest_in_annotations(table)
    return table


def _note_storages(row: int, name: str, start: int, end: int, inputs, writes: list, reads: list) -> None:
    """A top-level op's reads of its tensor inputs' storages (by input index, as the shapes text counts
    them; a tensor list is not followed) and, for an in-place op (aten::silu_), its write of its first
    input's storage at its end. Its outputs' storages are the allocations made inside it."""
    index = 0
    for item in inputs:
        group = item if isinstance(item, list) else [item]
        metas = [m for m in group if hasattr(m, "sizes")]
        if not metas:
            continue
        if not isinstance(item, list) and metas[0].storage_data_ptr:
            pointer = metas[0].storage_data_ptr
            reads.append((start, row, index, pointer))
            if index == 0 and name.endswith("_") and not name.startswith("aten::_"):
                writes.append((end, pointer, row))
        index += 1


def _resolve_sources(writes: list[tuple[int, int, int]], reads: list[tuple[int, int, int, int]]) -> dict[int, dict[int, int]]:
    """{row: {input index: the top-level row that last wrote the storage it read}}, in time order: an
    address is reused once freed, so the writer is the last one before the read. A view shares its
    base's storage, so data flows through views."""
    events = sorted([(time, 1, pointer, writer, 0) for time, pointer, writer in writes]
                    + [(time, 0, pointer, row, index) for time, row, index, pointer in reads])
    writer_of: dict[int, int] = {}
    sources: dict[int, dict[int, int]] = {}
    for _, is_write, pointer, row, index in events:
        if is_write:
            writer_of[pointer] = row  # -1: allocated outside any op (a Python scalar wrapped)
        else:
            writer = writer_of.get(pointer, -1)
            if writer >= 0 and writer != row:
                sources.setdefault(row, {})[index] = writer
    return sources


def _set_sources(table: EventTable, sources: dict[int, dict[int, int]], new_index: np.ndarray | None) -> None:
    """The sources_id column: per top-level op, "d1,d2,...", d rows back to each input's writer."""
    if not sources or new_index is None:
        return
    pool = {text: i for i, text in enumerate(table.strings)}
    for row, by_input in sources.items():
        at = int(new_index[row])
        text = ",".join(str(at - int(new_index[by_input[i]])) if i in by_input else ""
                        for i in range(max(by_input) + 1))
        if text not in pool:
            pool[text] = len(table.strings)
            table.strings.append(text)
        table.sources_id[at] = pool[text]


def _node_creators(forward_by_seq: dict[int, list[tuple[int, int]]]) -> dict[int, int]:
    """The forward op whose autograd node has each sequence number. Every op that passes autograd
    records the counter's current value, and only creating a node advances it: `loss.item()` at a
    print records the number the next step's first node will take. So the creator is the last op
    that recorded the number, on the thread that ran the forward passes (the counter is per
    thread): the one that recorded the most numbers."""
    counts: dict[int, int] = {}
    for entries in forward_by_seq.values():
        for thread, _ in entries:
            counts[thread] = counts.get(thread, 0) + 1
    creators = {}
    for seq, entries in forward_by_seq.items():
        thread = max({t for t, _ in entries}, key=lambda t: counts[t])
        creators[seq] = [row for t, row in entries if t == thread][-1]
    return creators


def _name_collectives_as_asked(table: EventTable) -> None:
    """Name each gloo work by the collective its caller asked for, from the COLLECTIVE_MARK range
    the hccl group recorded around its start: gloo runs a reduce_scatter as an all_reduce and
    records it as one. A group's works start in the order they were asked for, each at or after
    its range began: the n-th range naming works of a kind takes the first such work not yet taken
    that starts at or after it. Works no range names (another group's) keep gloo's name."""
    marks = {i: text[len(COLLECTIVE_MARK):].split(":") for i, text in enumerate(table.strings)
             if text.startswith(COLLECTIVE_MARK)}
    if not marks:
        return
    ranges: dict[str, list[tuple[int, str]]] = {}
    for row in np.flatnonzero(np.isin(table.name_id, list(marks))).tolist():  # rows are in start order
        asked, runs = marks[int(table.name_id[row])]
        ranges.setdefault(runs, []).append((int(table.start_ns[row]), asked))
    for runs, started in ranges.items():
        if f"gloo:{runs}" not in table.strings or all(asked == runs for _, asked in started):
            continue
        works = np.flatnonzero((table.kind == KIND_COMM) & (table.name_id == table.strings.index(f"gloo:{runs}")))
        position = 0
        for start, asked in started:
            while position < len(works) and table.start_ns[works[position]] < start:
                position += 1
            if position == len(works):
                break
            if asked != runs:
                if f"gloo:{asked}" not in table.strings:
                    table.strings.append(f"gloo:{asked}")
                table.name_id[works[position]] = table.strings.index(f"gloo:{asked}")
                # for the Chrome trace of this cycle (record.export_trace), which keeps gloo's names
                table.meta.setdefault(RENAMED_COLLECTIVES, []).append(
                    (int(table.start_ns[works[position]]) + table.meta["origin_ns"], f"gloo:{runs}", f"gloo:{asked}"))
            position += 1


def _nest_in_annotations(table: EventTable) -> None:
    """Parent rows the tree left as roots by time containment on their thread, then inherit phase.

    torch's event tree does not nest ops under record_function ranges (ProfilerStep#,
    Optimizer.step#, DataLoader), so those links are rebuilt here from start/end times.
    Everything under a DataLoader range is the data pipeline's (phase dataloader).
    """
    end = (table.start_ns + table.dur_ns).tolist()
    parent = table.parent.tolist()
    phase = table.phase.tolist()
    open_by_thread: dict[int, list[int]] = {}
    for row, thread in enumerate(table.thread.tolist()):
        stack = open_by_thread.setdefault(thread, [])
        start = int(table.start_ns[row])
        while stack and end[stack[-1]] <= start:
            stack.pop()
        if parent[row] < 0 and stack:
            parent[row] = stack[-1]
        if parent[row] >= 0 and (phase[row] == PHASE_OTHER or phase[parent[row]] == PHASE_DATALOADER):
            # whatever runs inside DataLoader.__next__ is the data pipeline's, even an nn.Module
            # transform a Dataset calls (its module call alone would have made it "forward")
            phase[row] = phase[parent[row]]
        stack.append(row)
    table.parent[:] = parent
    table.phase[:] = phase


def _assign_steps(table: EventTable, step_ranges: list[tuple[int, int, int]]) -> None:
    """Step of each row = the ProfilerStep range containing its start (any thread)."""
    if not step_ranges or not len(table):
        return
    step_ranges.sort()
    starts = np.array([s for s, _, _ in step_ranges], dtype=np.int64)
    ends = np.array([e for _, e, _ in step_ranges], dtype=np.int64)
    numbers = np.array([n for _, _, n in step_ranges], dtype=np.int32)
    slot = np.searchsorted(starts, table.start_ns, side="right") - 1
    inside = (slot >= 0) & (table.start_ns < ends[np.maximum(slot, 0)])
    table.step[:] = np.where(inside, numbers[np.maximum(slot, 0)], -1)


def assign_forward_steps(table: EventTable, calls: list[tuple[int, int, int, int]]) -> bool:
    """Steps of a run without optimizer steps (inference, serving), from the model's calls (FORWARD_CALLS):
    a step runs from the start of one call to the start of the next; what runs before the first call
    (loading the weights, moving the model to the device) is no step, nor what runs from the last call
    on (its step's end is not known: the run's end follows it, a final print or saving). The model is
    the module called outermost most often (the first called of equals; a loss module called beside it
    is not the model), never inside DataLoader.__next__ (a Dataset's nn.Module transform runs per
    sample). False, the table unchanged, when no module was called."""
    origin = table.meta.get("origin_ns")
    if not calls or not isinstance(origin, int) or not len(table):
        return False
    names = table.string_array()[table.name_id].astype(str)
    pipeline = np.flatnonzero((table.kind == KIND_ANNOTATION) & np.char.startswith(names, DATALOADER_PREFIX))
    ranges = [(int(table.thread[r]), int(table.start_ns[r]), int(table.start_ns[r] + table.dur_ns[r])) for r in pipeline]
    kept = [(start - origin, end - origin, module) for start, end, thread, module in calls
            if not any(t == thread and low <= start - origin < high for t, low, high in ranges)]
    if not kept:
        return False
    counts: dict[int, int] = {}
    for _, _, module in kept:
        counts[module] = counts.get(module, 0) + 1
    first_called = {module: index for index, (_, _, module) in reversed(list(enumerate(kept)))}
    model = max(counts, key=lambda module: (counts[module], -first_called[module]))
    starts = np.array(sorted(start for start, _, module in kept if module == model), dtype=np.int64)
    slot = np.searchsorted(starts, table.start_ns, side="right") - 1
    table.step[:] = np.where((slot >= 0) & (slot < len(starts) - 1), slot, -1)
    return True


def _sort_by_start(table: EventTable) -> np.ndarray | None:
    """Order rows by start time, remap parents, and make times relative to the first event. Returns
    each old row's new index."""
    if not len(table):
        return None
    order = np.argsort(table.start_ns, kind="stable")  # stable: a parent stays before its children
    new_index = np.empty_like(order)
    new_index[order] = np.arange(len(order))
    for name in EventTable.column_names():
        setattr(table, name, getattr(table, name)[order])
    table.parent[:] = np.where(table.parent >= 0, new_index[np.maximum(table.parent, 0)], -1)
    origin = int(table.start_ns[0])
    table.meta["origin_ns"] = origin
    table.start_ns -= origin
    return new_index
