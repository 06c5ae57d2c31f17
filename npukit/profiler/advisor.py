"""Advisor: rules that read a profile and name what to change for the Ascend NPU.

Each rule looks for one pattern that costs time on the NPU, and reports the evidence (ops,
counts per step, user lines, shapes) and a concrete change. Rules are checked on the
emulator's profile the same way as on a real one: they use op names, shapes, dtypes, devices
and sequences, not hardware counters. The fused-API rules follow the patterns msprof-analyze
maps to torch_npu fused APIs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np
from rich.console import Console
from rich.markup import escape

from npukit.profiler.cost import CONV_OPS, MATMUL_OPS, matmul_dims, numel
from npukit.profiler.extract import DATALOADER_PREFIX, STEP_PREFIX
from npukit.profiler.table import (
    KIND_ANNOTATION,
    KIND_GC,
    KIND_OP,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_OPTIMIZER,
    EventTable,
)

SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}


@dataclass
class Finding:
    rule: str
    title: str
    severity: str
    summary: str
    evidence: list[str]
    change: str
    est_us_per_step: float = 0.0  # time at stake per step in this profile (measured here)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _split_top_level(text: str) -> list[str]:
    """Split 'float32, (float32, int64), int64' at top-level commas."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if current:
        parts.append("".join(current).strip())
    return parts


def _parse_inputs(shapes: str, dtypes: str) -> list[tuple[list, list[str]]]:
    """Per tensor input: (its shapes, its dtypes); a tensor-list input holds several of each."""
    if not shapes:
        return []
    try:
        parsed = json.loads("[" + shapes.replace("(", "[").replace(")", "]") + "]")
    except json.JSONDecodeError:
        return []
    dtype_parts = _split_top_level(dtypes)
    out = []
    for index, entry in enumerate(parsed):
        entry_shapes = entry if entry and isinstance(entry[0], list) else [entry]
        part = dtype_parts[index] if index < len(dtype_parts) else ""
        out.append((entry_shapes, [d.strip() for d in part.strip("()").split(",") if d.strip()]))
    return out


class ProfileView:
    """Per-row views of the table that several rules share (computed once, vectorized)."""

    def __init__(self, table: EventTable) -> None:
        self.table = table
        self.strings = table.string_array()
        self.names = self.strings[table.name_id]
        # Advice is about the steps: the setup before them (weights loaded, the model moved to the
        # device) and the end after them (saving, a final print) are not per-step work
        self.in_steps = table.in_steps()
        self.is_op = (table.kind == KIND_OP) & self.in_steps
        # The ops the user's code issued: every rule's advice is a change to their code, and the ops
        # torch.distributed's Python runs (FSDP's copy-in/out views of a flat buffer, its CPU-side
        # sharding at lazy init) are not theirs to change.
        self.user_op = self.is_op & ~table.framework
        self.top = self.user_op & table.top_level
        self.steps = max(len(table.op_steps()), 1)
        self.self_ns = table.self_ns()
        self.op_time_ns = float(self.self_ns[self.is_op].sum()) or 1.0

    @cached_property
    def inputs_by_key(self) -> dict[tuple[int, int], list[tuple[list, list[str]]]]:
        keys = set(zip(self.table.shapes_id[self.is_op].tolist(), self.table.dtypes_id[self.is_op].tolist()))
        return {key: _parse_inputs(self.strings[key[0]], self.strings[key[1]]) for key in keys}

    def inputs(self, row: int) -> list[tuple[list, list[str]]]:
        return self.inputs_by_key.get((int(self.table.shapes_id[row]), int(self.table.dtypes_id[row])), [])

    def devices(self, row: int) -> list[str]:
        text = self.strings[self.table.devices_id[row]]
        return [d.strip() for d in text.split(",")] if text else []

    @cached_property
    def device_run(self) -> bool:
        """True when ops ran on an accelerator (npu/cuda); host-device rules only apply then."""
        texts = self.strings[np.unique(self.table.devices_id[self.is_op])]
        return any(t and any(not d.strip().startswith("cpu") for d in t.split(",")) for t in texts)

    @cached_property
    def data_flow(self) -> bool:
        """The profile recorded which op's output each top-level op reads (the sources_id column)."""
        return bool(self.table.meta.get("data_flow"))

    def sources(self, row: int) -> set[int]:
        """The top-level rows whose outputs this top-level op reads."""
        text = self.strings[self.table.sources_id[row]]
        return {row - int(d) for d in text.split(",") if d} if text else set()

    @cached_property
    def autocast_scope(self) -> str:
        """What autocast should wrap: forward and loss in training; the forward alone without a backward."""
        return "forward and loss" if (self.is_op & (self.table.phase == PHASE_BACKWARD)).any() else "the forward"

    def line(self, row: int) -> str:
        return self.strings[self.table.stack_id[row]] or "(no user line)"

    def per_step(self, count: float) -> str:
        return f"{count / self.steps:.3g}/step"

    def top_lines(self, rows, limit: int = 3) -> list[str]:
        counts = Counter(self.line(r) for r in rows)
        return [f"{line} ({self.per_step(n)})" for line, n in counts.most_common(limit)]

    def time_us(self, rows) -> float:
        rows = np.asarray(list(rows), dtype=np.int64)
        return float(self.table.dur_ns[rows].sum()) / 1e3 / self.steps if len(rows) else 0.0


# ----------------------------------------------------------------------------- rules
def rule_float64(view: ProfileView) -> Finding | None:
    rows = []
    for row in np.flatnonzero(view.top).tolist():
        for shapes, dtypes in view.inputs(row):
            if "float64" in dtypes and any(numel(s) > 1 for s in shapes):
                rows.append(row)
                break
    if not rows:
        return None
    ops = Counter(view.names[r] for r in rows)
    return Finding(
        rule="float64-ops", title="float64 ops run on the NPU's AI CPU", severity="high",
        summary=f"{len(rows)} float64 op call(s) ({view.per_step(len(rows))}); the AI cores have no float64 units",
        evidence=[f"{op}: {n} call(s)" for op, n in ops.most_common(5)] + view.top_lines(rows),
        change="Create or cast these tensors as float32 (x.float(), dtype=torch.float32, torch.set_default_dtype"
               "(torch.float32)); keep float64 only for host-side bookkeeping.",
        est_us_per_step=view.time_us(rows),
    )


SYNC_OPS = {
    "aten::_local_scalar_dense": ".item() / float() / int() / bool() on a device tensor",
    "aten::nonzero": "nonzero() (output size depends on the data)",
    "aten::masked_select": "boolean-mask indexing x[mask]",
    "aten::unique": "unique()", "aten::_unique2": "unique()", "aten::unique_consecutive": "unique_consecutive()",
    "aten::is_nonzero": "Python truth test of a device tensor (if t: ...)",
}


def rule_host_sync(view: ProfileView) -> Finding | None:
    if not view.device_run:
        return None
    rows = [
        r for r in np.flatnonzero(view.user_op).tolist()
        if view.names[r] in SYNC_OPS and any(not d.startswith("cpu") for d in view.devices(r))
    ]
    # Count each user-visible sync once (item -> _local_scalar_dense are one sync).
    rows = [r for r in rows if not (view.table.parent[r] >= 0 and view.names[view.table.parent[r]] in SYNC_OPS)]
    # Fewer than one per step is a logging-interval sync: the pattern this rule recommends.
    if len(rows) < view.steps:
        return None
    ops = Counter(view.names[r] for r in rows)
    return Finding(
        rule="host-sync", title="Host-device synchronizations in the loop", severity="high",
        summary=f"{len(rows)} sync point(s) ({view.per_step(len(rows))}): the host waits for the NPU queue to drain each time",
        evidence=[f"{op} [{SYNC_OPS[op]}]: {view.per_step(n)}" for op, n in ops.most_common()] + view.top_lines(rows),
        change="Keep values on the device: accumulate losses/metrics as tensors and call .item() once per logging "
               "interval; replace nonzero()/x[mask] with torch.where or multiplication by the mask.",
        est_us_per_step=view.time_us(rows),
    )


COPY_OPS = {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}


def rule_host_device_copies(view: ProfileView) -> Finding | None:
    if not view.device_run:
        return None
    h2d, d2h = [], []
    parent = view.table.parent
    for r in np.flatnonzero(view.user_op).tolist():
        if view.names[r] not in COPY_OPS or parent[r] >= 0 and view.names[parent[r]] in COPY_OPS:
            continue  # one transfer: a backend's copy_ runs it as _copy_from(src, dst) inside
        devices = view.devices(r)
        if len(devices) < 2 or devices[0].split(":")[0] == devices[1].split(":")[0]:
            continue
        # copy_(dst, src), but _copy_from(src, dst) and _copy_from_and_resize(src, dst)
        destination = devices[0] if view.names[r] == "aten::copy_" else devices[1]
        (d2h if destination.startswith("cpu") else h2d).append(r)
    if view.steps > 1:  # a copy made in one step only (model.to('npu') before the loop) is not per step
        steps_of_site: dict[int, set[int]] = defaultdict(set)
        for r in h2d + d2h:
            steps_of_site[int(view.table.stack_id[r])].add(int(view.table.step[r]))
        h2d, d2h = ([r for r in rows if len(steps_of_site[int(view.table.stack_id[r])]) > 1] for rows in (h2d, d2h))
    rows = h2d + d2h
    if not rows:
        return None
    mbytes = sum(view.table.bytes[r] for r in rows) / 2 / 1e6 / view.steps
    return Finding(
        rule="host-device-copies", title="Host<->device copies every step", severity="medium",
        summary=f"{view.per_step(len(h2d))} host-to-device and {view.per_step(len(d2h))} device-to-host copies, "
                f"~{mbytes:.2f} MB/step",
        evidence=view.top_lines(rows, 5),
        change="Create tensors on the device (torch.zeros(..., device='npu')), move each batch once with "
               "pin_memory=True and .to('npu', non_blocking=True), and keep intermediate results on the device.",
        est_us_per_step=view.time_us(rows),
    )


_LOW_PRECISION = ("float16", "bfloat16", "Half", "BFloat16")


def _is_matmul_or_conv(name: str) -> bool:
    return name in MATMUL_OPS or name in CONV_OPS or name.endswith(("::matmul", "::einsum", "::conv2d"))


def _autocast_parents(view: ProfileView) -> set[int]:
    """Ops with a fp16/bf16 matmul or conv under them: autocast's outer `aten::linear` takes fp32 tensors
    and runs its matmul in low precision inside; it is not a float32 matmul."""
    parents: set[int] = set()
    table = view.table
    for r in np.flatnonzero(view.is_op).tolist():
        if not _is_matmul_or_conv(view.names[r]):
            continue
        inputs = view.inputs(r)
        if not inputs or not any(dtype in _LOW_PRECISION for _, dtypes in inputs[:2] for dtype in dtypes):
            continue
        up = int(table.parent[r])
        while up >= 0 and up not in parents:
            parents.add(up)
            up = int(table.parent[up])
    return parents


def rule_fp32_matmul(view: ProfileView) -> Finding | None:
    matmuls, convs = [], []
    low_precision_inside = None
    for r in np.flatnonzero(view.top).tolist():
        name = view.names[r]
        if not _is_matmul_or_conv(name):
            continue
        inputs = view.inputs(r)
        if not (inputs and "float32" in inputs[0][1] and view.table.flops[r] > 0):
            continue
        if low_precision_inside is None:
            low_precision_inside = _autocast_parents(view)
        if r in low_precision_inside:
            continue  # autocast already runs it in fp16/bf16
        (convs if name in CONV_OPS or "conv" in name else matmuls).append(r)
    rows = matmuls + convs
    if not rows:
        return None
    share = 100 * float(sum(view.table.dur_ns[r] for r in rows)) / view.op_time_ns
    if share < 5:
        return None
    ops = Counter(view.names[r] for r in rows)
    # torch_npu computes float32 convolutions in HF32 by default (torch.npu.conv.allow_hf32 = True) and
    # float32 matmuls in full fp32 (torch.npu.matmul.allow_hf32 = False): only matmuls gain from HF32
    if matmuls:
        title = "float32 matmuls could run in bf16 or HF32"
        gain = ("the cube unit is 2x faster in HF32 and 4x in fp16/bf16 than in fp32 (roofline model)"
                + ("; the convolutions already run in HF32 (torch_npu's default), 2x faster in bf16" if convs else ""))
        change = (f"Wrap {view.autocast_scope} in torch.autocast('npu', dtype=torch.bfloat16), or allow HF32 for "
                  "matmuls: torch.npu.matmul.allow_hf32 = True (convolutions use HF32 by default already).")
    else:
        title = "float32 convolutions could run in bf16"
        gain = ("torch_npu already runs float32 convolutions in HF32 (torch.npu.conv.allow_hf32 is True by "
                "default); fp16/bf16 would be 2x faster again (roofline model)")
        change = f"Wrap {view.autocast_scope} in torch.autocast('npu', dtype=torch.bfloat16)."
    return Finding(
        rule="fp32-matmul", title=title, severity="medium",
        summary=f"{len(rows)} float32 matmul/conv call(s) take {share:.0f}% of op time; {gain}",
        evidence=[f"{op}: {view.per_step(n)}" for op, n in ops.most_common(5)] + view.top_lines(rows),
        change=change,
        est_us_per_step=view.time_us(rows),
    )


TINY_NUMEL = 4096
TINY_OPS_PER_STEP = 300
VIEW_OPS = {"aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute", "aten::expand",
            "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::detach",
            "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::size", "aten::zeros",
            "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::lift_fresh"}


def rule_tiny_ops(view: ProfileView) -> Finding | None:
    rows = []
    for r in np.flatnonzero(view.top).tolist():
        if view.names[r] in VIEW_OPS:
            continue
        inputs = view.inputs(r)
        if inputs and max(numel(s) for shapes, _ in inputs for s in shapes) <= TINY_NUMEL:
            rows.append(r)
    per_step = len(rows) / view.steps
    if per_step < TINY_OPS_PER_STEP:
        return None
    ops = Counter(view.names[r] for r in rows)
    return Finding(
        rule="tiny-ops", title="Many tiny ops: launch-bound on the NPU (fusion candidates)", severity="medium",
        summary=f"{per_step:.0f} compute ops/step work on <= {TINY_NUMEL} elements; each is a separate kernel launch "
                "(several us on the NPU) doing almost no work",
        evidence=[f"{op}: {view.per_step(n)}" for op, n in ops.most_common(5)] + view.top_lines(rows),
        change="Batch the work into fewer, larger tensors (stack per-item loops, use torch._foreach_* ops), use the "
               "torch_npu fused APIs, or compile the block (torch.compile with the npu backend).",
        est_us_per_step=view.time_us(rows),
    )


def rule_dynamic_shapes(view: ProfileView) -> Finding | None:
    """The same op at the same user line sees a different set of shapes from one step to the next."""
    if view.steps < 2:
        return None
    table = view.table
    rows = np.flatnonzero(view.top & (table.stack_id >= 0) & (table.step >= 0) & (table.phase == PHASE_FORWARD))
    shapes_by_site_step: dict[tuple[int, int], dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for r in rows.tolist():
        site = (int(table.name_id[r]), int(table.stack_id[r]))
        shapes_by_site_step[site][int(table.step[r])].add(int(table.shapes_id[r]))
    recorded = sorted({int(step) for step in table.step[rows].tolist()})
    # The first recorded step is warm-up when two more follow: its first-call work (lazy
    # initialisation, caches filled once) is not a shape that changes from step to step.
    warm_up = recorded[0] if len(recorded) >= 3 else None
    changing = []
    for site, per_step in shapes_by_site_step.items():
        variants = {frozenset(s) for step, s in per_step.items() if step != warm_up}
        if len(variants) > 1:
            changing.append((site, set().union(*variants)))
    if not changing:
        return None
    changing.sort(key=lambda item: -len(item[1]))
    evidence = []
    for (name_id, stack_id), shapes in changing[:5]:
        examples = ", ".join(sorted(view.strings[s] for s in shapes)[:3])
        evidence.append(f"{view.strings[name_id]} at {view.strings[stack_id]}: {len(shapes)} shapes, e.g. {examples}")
    return Finding(
        rule="dynamic-shapes", title="Input shapes change between steps (recompilation on the NPU)", severity="high",
        summary=f"{len(changing)} op call site(s) see different shapes from step to step; each new shape compiles a "
                "new kernel on the NPU",
        evidence=evidence,
        change="Pad inputs to a few fixed sizes (bucket sequence lengths, drop_last=True in the DataLoader), or "
               "disable online compilation: torch.npu.set_compile_mode(jit_compile=False).",
    )


def rule_matmul_alignment(view: ProfileView) -> Finding | None:
    bad: dict[tuple[str, tuple[int, int, int]], list[int]] = defaultdict(list)
    for r in np.flatnonzero(view.top).tolist():
        name = view.names[r]
        if name not in MATMUL_OPS:
            continue
        inputs = view.inputs(r)
        tensors = [(tuple(s), d[0] if d else "float32") for shapes, d in inputs for s in shapes]
        dims = matmul_dims(name, tensors)
        if dims is None:
            continue
        _, m, k, n = dims
        if name == "aten::linear":
            m = numel(tensors[0][0][:-1])
        if any(x % 16 for x in (m, k, n) if x > 1) or (k >= 256 and k % 256):
            bad[(name, (m, k, n))].append(r)
    if not bad:
        return None
    rows = [r for rs in bad.values() for r in rs]
    evidence = []
    for (name, (m, k, n)), rs in sorted(bad.items(), key=lambda item: -len(item[1]))[:5]:
        issues = [f"{axis}={v}" for axis, v in (("M", m), ("K", k), ("N", n)) if v > 1 and v % 16]
        if k >= 256 and k % 256:
            issues.append(f"K={k} not a multiple of 256")
        evidence.append(f"{name} M={m} K={k} N={n}: {', '.join(issues)} ({view.per_step(len(rs))}, {view.line(rs[0])})")
    return Finding(
        rule="matmul-alignment", title="Matmul dimensions not aligned to the cube unit", severity="medium",
        summary=f"{len(bad)} matmul shape(s) have M/K/N not a multiple of 16 (the cube's fractal) or an inner axis K "
                "not a multiple of 256; the NPU pads them and wastes cube cycles",
        evidence=evidence,
        change="Choose hidden sizes, vocab sizes and batch*sequence products that are multiples of 16 (inner axis: "
               "256), e.g. pad the vocabulary to a multiple of 128 and the FFN width to a multiple of 256.",
        est_us_per_step=view.time_us(rows),
    )


def rule_conv_channels(view: ProfileView) -> Finding | None:
    bad: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in np.flatnonzero(view.top).tolist():
        if view.names[r] not in CONV_OPS or view.names[r].endswith(("_backward", "backward_overrideable")):
            continue
        inputs = view.inputs(r)
        if len(inputs) < 2 or len(inputs[1][0][0]) < 3:
            continue
        weight = inputs[1][0][0]
        c_out, c_in = weight[0], weight[1]
        # A first layer reading 1-4 image channels is normal; only wider layers are worth padding.
        if c_out % 16 or (c_in > 4 and c_in % 16):
            bad[(c_in, c_out)].append(r)
    if not bad:
        return None
    rows = [r for rs in bad.values() for r in rs]
    evidence = [
        f"conv with {c_in} -> {c_out} channels ({view.per_step(len(rs))}, {view.line(rs[0])})"
        for (c_in, c_out), rs in sorted(bad.items(), key=lambda item: -len(item[1]))[:5]
    ]
    return Finding(
        rule="conv-channels", title="Convolution channels not a multiple of 16", severity="low",
        summary=f"{len(bad)} convolution shape(s) have channel counts the NPU must pad (its NC1HWC0 layout splits "
                "channels into blocks of 16)",
        evidence=evidence,
        change="Use channel counts that are multiples of 16 (e.g. 48 instead of 40, 64 instead of 60).",
        est_us_per_step=view.time_us(rows),
    )


@dataclass(frozen=True)
class FusedPattern:
    rule: str
    title: str
    steps: tuple[frozenset[str], ...]  # each step: op names that may appear there
    op: str                            # the torch_npu op recommended (npukit's emulator runs it)
    code: str                          # the replacement, runnable as printed with the names `where` gives
    where: str                         # what each name of `code` is, in the user's terms
    max_gap: int = 2  # unrelated ops tolerated between two pattern steps
    # each step reads the previous step's output (the data flow, where the profile records it): without
    # it a SiLU feeding a Linear, then an unrelated multiply, matched by name and order alone
    follows_data: bool = False

    @property
    def change(self) -> str:
        return f"Replace the sequence with `{self.code}`, where {self.where}."


def _ops(*names: str) -> frozenset[str]:
    return frozenset(f"aten::{n}" for n in names)


# Each recommendation runs as printed on npukit's emulator and on a real NPU, and equals the sequence
# it replaces (tests/profiler/test_fused_advice.py runs every `code` against its unfused sequence).
FUSED_PATTERNS = (
    FusedPattern(
        "fused-masked-softmax", "Masked softmax -> torch_npu.npu_scaled_masked_softmax",
        (_ops("masked_fill", "masked_fill_", "add", "add_", "where"), _ops("softmax", "_softmax")),
        "npu_scaled_masked_softmax", "torch_npu.npu_scaled_masked_softmax(scores, mask, scale)",
        "scores are the unscaled attention scores [batch, heads, q_len, kv_len] (the kernel takes q_len "
        "and kv_len that are multiples of 32, from 32 to 4096), mask a 4-dim bool tensor [batch or 1, heads "
        "or 1, q_len, kv_len] (True = masked out; a 2-dim mask: mask[None, None]) and scale the factor the "
        "scores were multiplied by",
        max_gap=1,
    ),
    FusedPattern(
        "fused-rms-norm", "RMSNorm written out -> torch_npu.npu_rms_norm",
        (_ops("pow", "square", "mul"), _ops("mean"), _ops("add", "add_"), _ops("rsqrt"), _ops("mul")),
        "npu_rms_norm", "torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]",
        "x is the normalised input, weight the norm's scale over x's last dim and eps its epsilon",
    ),
    FusedPattern(
        "fused-swiglu", "SiLU(x) * y -> torch_npu.npu_swiglu",
        (_ops("silu", "silu_"), _ops("mul")),
        "npu_swiglu", "torch_npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)",
        "gate is the tensor under SiLU and up the one it multiplies (better still: one Linear of twice "
        "the width computing both, so the cat goes)",
        follows_data=True,
    ),
    FusedPattern(
        "fused-attention", "Attention written out (matmul-softmax-matmul) -> torch_npu.npu_fusion_attention",
        (_ops("matmul", "bmm", "baddbmm"), _ops("softmax", "_softmax"), _ops("matmul", "bmm")),
        "npu_fusion_attention",
        "torch_npu.npu_fusion_attention(q, k, v, q.shape[1], \"BNSD\", atten_mask=mask, "
        "scale=q.shape[-1] ** -0.5)[0]",
        "q, k, v are [batch, heads, seq, head_dim] and mask a bool [q_len, kv_len] tensor, True where a "
        "position is masked out (None for none); F.scaled_dot_product_attention also runs fused",
        max_gap=4,
    ),
    FusedPattern(
        "fused-rotary", "Rotary embedding written out -> torch_npu.npu_rotary_mul",
        (_ops("neg"), _ops("cat"), _ops("mul"), _ops("mul"), _ops("add")),
        "npu_rotary_mul", "torch_npu.npu_rotary_mul(x, cos, sin)",
        "x is [batch, heads, seq, head_dim] and cos, sin are [1, 1, seq, head_dim] (rotate_half's layout)",
        max_gap=3,
    ),
)


def _find_pattern(names: list[str], pattern: FusedPattern, linked=None) -> list[int]:
    """Start positions where the pattern's steps occur in order, each within max_gap ops (and, given
    linked(i, j), each step's op at j reading the output of the previous one's at i)."""
    starts = []
    first = pattern.steps[0]
    i = 0
    while i < len(names):
        if names[i] in first:
            pos, ok = i, True
            for allowed in pattern.steps[1:]:
                nxt = next((j for j in range(pos + 1, min(pos + 2 + pattern.max_gap, len(names)))
                            if names[j] in allowed and (linked is None or linked(pos, j))), None)
                if nxt is None:
                    ok = False
                    break
                pos = nxt
            if ok:
                starts.append(i)
                i = pos
        i += 1
    return starts


def rule_fused_patterns(view: ProfileView) -> list[Finding]:
    table = view.table
    rows = np.flatnonzero(view.top & (table.phase == PHASE_FORWARD))
    findings = []
    by_thread: dict[int, list[int]] = defaultdict(list)
    for r in rows.tolist():
        by_thread[int(table.thread[r])].append(r)
    for pattern in FUSED_PATTERNS:
        by_data = pattern.follows_data and view.data_flow
        hits: list[int] = []
        for thread_rows in by_thread.values():
            names = [view.names[r] for r in thread_rows]
            linked = (lambda i, j, rows=thread_rows: rows[i] in view.sources(rows[j])) if by_data else None
            hits += [thread_rows[s] for s in _find_pattern(names, pattern, linked)]
        if not hits:
            continue
        order_only = (" (matched by op order only: this profile records no data flow; re-record it to check that "
                      "each op reads the previous one's output)" if pattern.follows_data and not by_data else "")
        findings.append(Finding(
            rule=pattern.rule, title=pattern.title, severity="medium",
            summary=f"{len(hits)} occurrence(s) ({view.per_step(len(hits))}) of "
                    + " -> ".join("/".join(sorted(n.split("::")[1] for n in step)) for step in pattern.steps)
                    + order_only,
            evidence=view.top_lines(hits, 5),
            change=pattern.change,
        ))
    return findings


FOREACH_PREFIX = "aten::_foreach_"
OPTIMIZER_OPS_PER_STEP = 40


def rule_fused_optimizer(view: ProfileView) -> Finding | None:
    table = view.table
    rows = np.flatnonzero(view.top & (table.phase == PHASE_OPTIMIZER))
    if not len(rows):
        return None
    names = view.names[rows]
    if any(str(n).startswith((FOREACH_PREFIX, "aten::_fused_")) for n in names):
        return None
    per_step = len(rows) / view.steps
    if per_step < OPTIMIZER_OPS_PER_STEP:
        return None
    optimizers = sorted({
        str(n).split("#")[1].split(".")[0] for n in view.names[table.kind == KIND_ANNOTATION]
        if str(n).startswith("Optimizer.step#")
    })
    ops = Counter(names.tolist())
    return Finding(
        rule="fused-optimizer", title="Per-parameter optimizer step -> fused optimizer", severity="medium",
        summary=f"the optimizer step ({', '.join(optimizers) or 'unknown'}) runs {per_step:.0f} separate ops/step, "
                "one small kernel per parameter tensor",
        evidence=[f"{op}: {view.per_step(n)}" for op, n in ops.most_common(5)],
        change="Use torch_npu's fused optimizers (torch_npu.optim.NpuFusedAdamW / NpuFusedSGD ...) or "
               "foreach=True (fused=True where supported) on the torch optimizer.",
        est_us_per_step=view.time_us(rows),
    )


def _step_time_ns(view: ProfileView, only_step: int | None = None) -> float:
    """Time of the recorded steps (their ProfilerStep ranges), or of one of them."""
    table = view.table
    is_step = (table.kind == KIND_ANNOTATION) & np.char.startswith(view.names.astype(str), STEP_PREFIX)
    is_step &= table.step >= 0  # not the setup's range before the first step, nor the end's after the last
    if only_step is not None:
        is_step &= table.step == only_step
    return float(table.dur_ns[is_step].sum())


def rule_dataloader_wait(view: ProfileView) -> Finding | None:
    table = view.table
    names = view.names.astype(str)
    rows = np.flatnonzero((table.kind == KIND_ANNOTATION) & np.char.startswith(names, DATALOADER_PREFIX)
                          & view.in_steps)
    step_ns = _step_time_ns(view)
    if not len(rows) or step_ns <= 0:
        return None
    wait_ns = float(table.dur_ns[rows].sum())
    share = 100 * wait_ns / step_ns
    if share < 10:
        return None
    iterators = sorted({n.split("#", 1)[1] for n in names[rows]})
    return Finding(
        rule="dataloader-wait", title="The training loop waits for the DataLoader", severity="high",
        summary=f"{share:.0f}% of step time is spent in DataLoader.__next__ ({wait_ns / 1e3 / view.steps:.0f} us/step)",
        evidence=[f"iterator: {it}" for it in iterators] + view.top_lines(rows),
        change="Load in worker processes: DataLoader(num_workers=4-8, pin_memory=True, persistent_workers=True, "
               "prefetch_factor=2-4); move CPU-heavy preprocessing into the dataset or ahead of training.",
        est_us_per_step=wait_ns / 1e3 / view.steps,
    )


def rule_gc_pauses(view: ProfileView) -> Finding | None:
    table = view.table
    is_gc = (table.kind == KIND_GC) & view.in_steps
    steps = view.steps
    step_ns = _step_time_ns(view)
    # The first recorded step is warm-up when two more follow, as for dynamic-shapes: under npu-run
    # --profile it holds the script's imports and model building (transformers' import collects
    # hundreds of times), which are not pauses of the loop.
    recorded = table.op_steps()
    if len(recorded) >= 3 and table.meta.get("setup_step") is None:  # else the recording left it out already
        warm_up = recorded[0]
        is_gc &= table.step != warm_up
        steps -= 1
        step_ns -= _step_time_ns(view, only_step=warm_up)
    rows = np.flatnonzero(is_gc)
    if not len(rows):
        return None
    gc_ns = float(table.dur_ns[rows].sum())
    step_ns = step_ns or float(table.dur_ns[(table.parent < 0) & view.in_steps].sum()) or 1.0
    longest = float(table.dur_ns[rows].max())
    share = 100 * gc_ns / step_ns
    # Young-generation collections are short and frequent: only a real share or one long pause counts.
    if not ((share >= 5 and gc_ns / steps >= 1e6) or longest >= 20e6):
        return None
    generations = Counter(view.names[r] for r in rows)
    return Finding(
        rule="gc-pauses", title="Python garbage collection pauses the loop", severity="medium",
        summary=f"{len(rows)} collection(s), {share:.1f}% of step time, longest {longest / 1e6:.1f} ms; the NPU idles "
                "while the host collects",
        evidence=[f"{name}: {n}" for name, n in generations.most_common()] + view.top_lines(rows),
        change="Call gc.freeze() after building the model and data pipeline, and/or gc.disable() in the loop with "
               "gc.collect() every N steps; avoid creating many short-lived Python objects per step.",
        est_us_per_step=gc_ns / 1e3 / steps,
    )


def rule_collective_wait(view: ProfileView) -> Finding | None:
    from npukit.profiler.summary import communication

    collectives, exposed_us = communication(view.table)
    step_ns = _step_time_ns(view)
    if not collectives or step_ns <= 0:
        return None
    share = 100 * exposed_us * 1e3 / step_ns
    if share < 10:
        return None
    per_step = exposed_us / view.steps
    return Finding(
        rule="collective-wait", title="The step waits for collectives", severity="high" if share >= 25 else "medium",
        summary=f"{share:.0f}% of step time ({per_step:.0f} us/step) a collective ran while no op ran: the ranks "
                "waited for it",
        evidence=[f"{row['collective']}: {row['calls']} call(s), {row['total_us'] / 1e3:.2f} ms, longest "
                  f"{row['max_us'] / 1e3:.2f} ms" for row in collectives],
        change="First compare the ranks (npu-profile DIR, the view of every rank, names the slowest and the "
               "wait it causes): a slower rank (a straggler: more data, a slower input pipeline, extra work on "
               "rank 0) makes the others wait in every collective. If the ranks are even, overlap communication "
               "with the backward: "
               "DistributedDataParallel(bucket_cap_mb=...) tuned to the model, gradient_as_bucket_view=True, "
               "and model.no_sync() on gradient-accumulation steps.",
        est_us_per_step=per_step,
    )


def rule_host_ops_in_device_run(view: ProfileView) -> Finding | None:
    """Compute ops on host tensors inside forward/backward of a device run: a tensor left on the CPU."""
    if not view.device_run:
        return None
    table = view.table
    rows = []
    for r in np.flatnonzero(view.top & np.isin(table.phase, [PHASE_FORWARD, PHASE_BACKWARD])).tolist():
        devices = view.devices(r)
        if devices and all(d.startswith("cpu") for d in devices) and view.names[r] not in VIEW_OPS | COPY_OPS:
            inputs = view.inputs(r)
            if inputs and max(numel(s) for shapes, _ in inputs for s in shapes) > 1:
                rows.append(r)
    if not rows:
        return None
    ops = Counter(view.names[r] for r in rows)
    return Finding(
        rule="host-ops", title="Ops running on the host inside the model", severity="high",
        summary=f"{len(rows)} op call(s) in forward/backward ran on CPU tensors while the model runs on the NPU",
        evidence=[f"{op}: {view.per_step(n)}" for op, n in ops.most_common(5)] + view.top_lines(rows),
        change="Move these tensors to the NPU (register constants as buffers so model.to('npu') moves them; create "
               "new tensors with device=x.device).",
        est_us_per_step=view.time_us(rows),
    )


RULES = (
    rule_float64, rule_host_sync, rule_host_device_copies, rule_host_ops_in_device_run, rule_fp32_matmul,
    rule_tiny_ops, rule_dynamic_shapes, rule_matmul_alignment, rule_conv_channels, rule_fused_optimizer,
    rule_dataloader_wait, rule_gc_pauses, rule_collective_wait,
)
RULE_IDS = (
    "float64-ops", "host-sync", "host-device-copies", "host-ops", "fp32-matmul", "tiny-ops", "dynamic-shapes",
    "matmul-alignment", "conv-channels", "fused-optimizer", "dataloader-wait", "gc-pauses", "collective-wait",
    *(p.rule for p in FUSED_PATTERNS),
)


def advise(table: EventTable) -> list[Finding]:
    view = ProfileView(table)
    findings: list[Finding] = []
    for rule in RULES:
        found = rule(view)
        if found is not None:
            findings.append(found)
    findings += rule_fused_patterns(view)
    # the recorded steps' wall time; a profile without step ranges has its op time
    return rank_by_time_at_stake(findings, (_step_time_ns(view) or view.op_time_ns) / 1e3 / view.steps)


# A finding's severity is at most what its share of the step time warrants: a host sync of 0.02 ms in a
# 1 s step is not "high", whatever the rule says.
HIGH_SHARE, MEDIUM_SHARE = 10.0, 2.0  # % of the step


def rank_by_time_at_stake(findings: list[Finding], step_us: float) -> list[Finding]:
    """Most time at stake first; a finding's severity lowered to its share of the step. Findings whose
    time is not measured (0: an effect the emulator cannot time, such as recompilation) keep the rule's
    severity and come after the timed ones."""
    for finding in findings:
        if finding.est_us_per_step > 0 and step_us > 0:
            share = 100 * finding.est_us_per_step / step_us
            earned = "high" if share >= HIGH_SHARE else "medium" if share >= MEDIUM_SHARE else "low"
            if SEVERITY_ORDER[earned] > SEVERITY_ORDER[finding.severity]:
                finding.severity = earned
    return sorted(findings, key=lambda f: (f.est_us_per_step <= 0, -f.est_us_per_step, SEVERITY_ORDER[f.severity]))


STRAGGLER_SHARE = 5  # % of the median step the others wait for the slowest rank


def rule_straggler(cluster) -> Finding | None:
    """Cluster view: the rank the others wait for in the collectives, and how long they wait."""
    slowest = cluster.slowest
    if not slowest or slowest["basis"] != "collectives" or slowest["wait_caused_us"] <= 0:
        return None
    rank, wait_us = slowest["rank"], slowest["wait_caused_us"]
    step_us = float(np.median([row["step_us"] for row in cluster.per_rank])) or 1.0
    share = 100 * wait_us / step_us
    if share < STRAGGLER_SHARE:
        return None
    evidence = [f"rank {r} waits {waited / 1e3:.2f} ms/step for a slower rank (while no op ran)"
                for r, waited in slowest["others_waiting_us"].items()]
    for row in cluster.collectives:
        if row["waited_for_rank"] == rank:
            evidence.append(f"{row['collective']}: rank {rank} joined last in {row['waited_for_calls']} of "
                            f"{row['calls']} call(s); skew {row['skew_us'] / 1e3:.2f} ms in all, up to "
                            f"{row['max_skew_us'] / 1e3:.2f} ms in one call")
    return Finding(
        rule="straggler-rank", title=f"Rank {rank} is a straggler: the other ranks wait for it",
        severity="high" if share >= 25 else "medium",
        summary=f"the other ranks wait {wait_us / 1e3:.2f} ms per step ({share:.0f}% of the median step) in the "
                f"collectives rank {rank} joins last; without its waits, its step is "
                f"{slowest['busy_over_median_us'] / 1e3:.2f} ms longer than the median rank's",
        evidence=evidence,
        change=f"Find what rank {rank} does more (npu-profile DIR --rank {rank} --advise; compare its host gaps, "
               "compute and dataloader time with another rank's): uneven batches or sequence lengths (balance "
               "them, or bucket by length), a slower input pipeline (more DataLoader workers), logging, "
               "checkpointing or evaluation on that rank alone (move it off the step or out of the loop), or a "
               "slower device or host.",
        est_us_per_step=wait_us,
        extra={"rank": rank},
    )


CLUSTER_RULES = (rule_straggler,)


def advise_cluster(cluster) -> list[Finding]:
    """The rules of the view of all ranks (npukit.profiler.cluster.Cluster)."""
    findings = [found for rule in CLUSTER_RULES if (found := rule(cluster)) is not None]
    return rank_by_time_at_stake(findings, 0.0)


def print_findings(findings: list[Finding], console: Console) -> None:
    if not findings:
        console.print(f"advisor: no findings ({len(RULE_IDS)} rules checked)")
        return
    console.print(f"advisor: {len(findings)} finding(s) ({len(RULE_IDS)} rules checked)")
    colors = {"high": "red", "medium": "yellow", "low": "cyan"}
    for number, f in enumerate(findings, 1):
        at_stake = f"  [{f.est_us_per_step / 1e3:.2f} ms/step here]" if f.est_us_per_step else ""
        console.print(
            f"\n[bold]{number}. [{colors[f.severity]}]{f.severity}[/] {escape(f.title)}[/bold] ({f.rule}){at_stake}"
        )
        console.print(f"   {escape(f.summary)}")
        for item in f.evidence:
            console.print(f"   - {escape(item)}", highlight=False)
        console.print(f"   change: {escape(f.change)}")
