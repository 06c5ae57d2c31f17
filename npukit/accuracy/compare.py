"""npu-compare: pair golden and target dump entries, measure every tensor, name the first divergence.

Pairing: entries are matched by name; where the two op streams differ (a call inserted or
removed on one side, so call indices shift) they are aligned as sequences of names without
call index (Myers' diff), so the ops after the difference still pair with their counterparts.

First divergence: walking the target's execution order, the first op whose output error is
above the warn limit of its dtype and more than `amplification` times its input error -- or
whose input error is not explained by the op that produced that input (the change happened in a
call present on one side only, or outside the dumped ops).
"""

from __future__ import annotations

import gc
import math
import os
import re
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from npukit.accuracy import naming
from npukit.accuracy.dumpfile import (
    INTERNAL_ERROR,
    OPTIMIZER,
    TENSOR_DATA_DIR,
    DumpEntry,
    Incomplete,
    RankDump,
    TensorLeaf,
    find_rank_dirs,
    load_rank_dump,
)
from npukit.accuracy.metrics import (
    CHUNK,
    FLOAT32_EPS,
    FLOAT64_EPS,
    PairJob,
    PairMetrics,
    _pool_context,
    as_real_elements,
    compare_pairs,
)
from npukit.accuracy.tensor_io import float64_converter, is_floating, read_tensor
from npukit.alignment import myers_alignment
from npukit.errors import UserError
from npukit.files import ContainedPaths

PASS, WARN, ERROR = "pass", "warn", "error"
UNMATCHED = "unmatched"

# Ops whose reduction order differs by backend: reported with ULPs of the target dtype.
MATMUL_CLASS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "dot", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention", "__matmul__", "__rmatmul__", "tensordot", "bilinear",
    "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "MultiheadAttention", "Bilinear",
})


@dataclass
class DtypeLimits:
    pass_rel_l2: float
    pass_cosine: float
    warn_rel_l2: float


@dataclass
class Thresholds:
    """Verdict limits; every field can be overridden with `--set name=value` (e.g. bf16.warn_rel_l2=0.05)."""

    fp32: DtypeLimits = field(default_factory=lambda: DtypeLimits(1e-5, 0.99999, 1e-4))
    fp16: DtypeLimits = field(default_factory=lambda: DtypeLimits(1e-3, 0.9999, 5e-3))
    # fp32 matmul/conv whose inputs the NPU rounds to HF32 (10 mantissa bits, as fp16's):
    # conv.allow_hf32 is on by default in torch_npu, so an fp32 CNN's convolutions differ by ~3e-4.
    hf32: DtypeLimits = field(default_factory=lambda: DtypeLimits(1e-3, 0.9999, 5e-3))
    bf16: DtypeLimits = field(default_factory=lambda: DtypeLimits(8e-3, 0.999, 3e-2))
    error_cosine: float = 0.9
    error_rel_l2: float = 0.3
    amplification: float = 10.0
    # A gradient whose norm is below this fraction of the largest gradient norm of its backward op
    # (or of all parameters) is noise-level (e.g. the gradient of a bias that a BatchNorm cancels):
    # its relative error means nothing.
    negligible: float = 1e-3

    def limits(self, dtype_class: str) -> DtypeLimits:
        return getattr(self, dtype_class)

    def with_overrides(self, overrides: list[str] | None, option: str = "--set") -> Thresholds:
        result = replace(self, fp32=replace(self.fp32), fp16=replace(self.fp16), bf16=replace(self.bf16),
                         hf32=replace(self.hf32))
        for item in overrides or []:
            key, sep, value = item.partition("=")
            try:
                number = float(value)
            except ValueError:
                number = None
            if not sep or number is None:
                raise UserError(f"{option}: {item!r} is not NAME=NUMBER (e.g. bf16.warn_rel_l2=0.05)")
            if not math.isfinite(number) or number < 0:
                raise UserError(f"{option}: {item!r}: a threshold is a finite number >= 0")
            target, _, attr = key.strip().rpartition(".")
            holder = getattr(result, target, None) if target else result
            if holder is None or attr not in {f.name for f in fields(holder)} or isinstance(getattr(holder, attr), DtypeLimits):
                raise UserError(f"{option}: unknown threshold {key.strip()!r}; known: {', '.join(threshold_names())}")
            setattr(holder, attr, number)
        return result


def threshold_names() -> list[str]:
    names = [f"{cls}.{f.name}" for cls in ("fp32", "hf32", "fp16", "bf16") for f in fields(DtypeLimits)]
    return names + ["error_cosine", "error_rel_l2", "amplification", "negligible"]


_PRECISION = {"fp32": 3, "hf32": 2.5, "fp16": 2, "bf16": 1}


def dtype_class(dtype: str) -> str | None:
    if dtype in ("torch.float32", "torch.float64"):
        return "fp32"
    if dtype == "torch.float16":
        return "fp16"
    if is_floating(dtype) or dtype.startswith("torch.float8"):
        return "bf16"  # bf16 and float8: the loosest limits
    return None


NONFINITE_IN_TARGET_ONLY = "non-finite values in target only"
NONFINITE_IN_GOLDEN_ONLY = "non-finite values in golden only"  # an fp16 inf a saturating device clamped


@dataclass
class Row:
    """One compared tensor (msprobe: one line of the result table)."""

    pair: str  # "step0/rank0"
    order: int  # position in execution order (target side, golden for golden-only rows)
    golden_entry: str | None
    target_entry: str | None
    golden: TensorLeaf | None
    target: TensorLeaf | None
    role: str  # input / output / param
    dtype_class: str
    metrics: PairMetrics | None = None
    error: float | None = None  # relative L2 error (tensor mode) or its statistics estimate
    verdict: str = PASS
    message: str = ""
    negligible: bool = False
    stat_diffs: dict | None = None
    target_scale: float = 1.0  # 1/loss scale for loss-scaled backward tensors of the target
    # the same values as the golden run's in another order (build_rows' merges): judged by statistics
    by_statistics: bool = False
    in_optimizer: bool = False  # a tensor of an optimizer's update op (its parent is "optimizer")
    norm: float = 0.0  # larger L2 norm of the two sides: the magnitude `negligible` is judged on

    @property
    def name(self) -> str:
        leaf = self.target or self.golden
        return leaf.name


@dataclass
class Divergence:
    pair: str
    entry: str  # target entry name (or golden name for a call missing in the target)
    golden_entry: str | None
    reason: str
    module_path: str | None
    stack: list[str]
    input_error: float
    output_error: float
    side: str = "both"  # both | target-only | golden-only
    # what kind of problem, where a fix depends on it: "lost-update" (an in-place update of a weight kept
    # in fp16/bf16 lost the golden run's change: fixes.py's fp32_master); "" otherwise
    kind: str = ""
    # the difference reached the dumped ops from outside them (an input or weight no dumped op produced, a
    # gradient changed between dumped ops or made by none): a dump of one module's subtree (--localize)
    # reads what the modules around it did as such
    outside: bool = False


@dataclass
class PairingCoverage:
    """How many entries of each side's dump found a counterpart in the other (the entries compared:
    a cross-tool pair leaves out what the tools record differently, said in PairResult.cross_tool)."""

    golden_paired: int
    golden_total: int
    target_paired: int
    target_total: int
    stopped: str = ""  # what stopped pairing, when too little paired

    def too_little(self) -> bool:
        """Less than most of either side paired: the table says little about that side's run."""
        return self.golden_paired * 2 <= self.golden_total or self.target_paired * 2 <= self.target_total

    def text(self) -> str:
        counts = (f"{self.golden_paired} of the golden run's {self.golden_total} entries and {self.target_paired}"
                  f" of the target's {self.target_total} have a counterpart")
        return f"{counts}; {self.stopped}" if self.stopped else counts


@dataclass
class PairResult:
    pair: str
    golden_pair: str  # the golden step/rank compared with it (another one when both dirs hold one dump)
    golden_dir: Path
    target_dir: Path
    mode: str  # tensor | statistics | md5
    rows: list[Row]
    divergence: Divergence | None
    unmatched_golden: list[str]
    unmatched_target: list[str]
    aligned: bool  # True when sequence alignment was needed
    loss_scale: float = 1.0  # the target's backward was scaled by this (GradScaler); compared unscaled
    golden_low_precision: str | None = None  # the first fp16/bf16 matmul/conv of the golden run, if any
    # "target", "golden" or "both": GradScaler skipped that side's update (its gradients overflowed
    # under loss scaling, which GradScaler handles): the backward has no consequence and is not searched.
    skipped_by_grad_scaler: str | None = None
    cross_tool: str | None = None  # what was left out of a pair whose dumps two different tools wrote
    unsearched: str | None = None  # why no divergence was searched for (the runs' weights differ by design)
    noop_casts: list[str] = field(default_factory=list)  # one-sided backwards of casts a run needed not make
    coverage: PairingCoverage | None = None
    # One rank of several: a parameter's gradient as the optimizer got it differs while this rank's
    # backward computed its share as the golden run did. A divergence when it holds on every rank of
    # the step (the reduced gradient is the same on all): see _changed_before_the_reduce.
    changed_share: Divergence | None = None
    golden_incomplete: list[Incomplete] = field(default_factory=list)  # what each dump says it left out
    target_incomplete: list[Incomplete] = field(default_factory=list)

    def stopped_dumps(self) -> list[tuple[str, Incomplete]]:
        """(side, first internal error) of each dump an internal error switched off: the rest of its
        run is missing."""
        stopped = []
        for side, items in (("golden", self.golden_incomplete), ("target", self.target_incomplete)):
            first = next((item for item in items if item.kind == INTERNAL_ERROR), None)
            if first is not None:
                stopped.append((side, first))
        return stopped


@dataclass
class CompareResult:
    golden: Path
    target: Path
    pairs: list[PairResult]
    thresholds: Thresholds
    only_golden: list[str] = field(default_factory=list)  # step/rank dumps with no counterpart
    only_target: list[str] = field(default_factory=list)
    across_ranks: object | None = None  # ranks.AcrossRanks: where a divergence began over several ranks

    @property
    def rows(self) -> list[Row]:
        return [row for pair in self.pairs for row in pair.rows]

    def counts(self) -> dict[str, int]:
        counts = {PASS: 0, WARN: 0, ERROR: 0, UNMATCHED: 0}
        for row in self.rows:
            counts[row.verdict] = counts.get(row.verdict, 0) + 1
        return counts

    def unexplained_errors(self, pair: PairResult | None = None) -> list[Row]:
        """Error rows no divergence search has judged (of one pair, or of all). Where the search ran
        and named nothing, an error row carries its inputs' error without amplifying it (a relu's
        mask where a pre-activation near 0 has the other sign in bf16: one sample's gradient 30%
        apart, the weights' a few percent): a correct run's. Searched or not, a divergence is one."""
        unexplained = []
        for each in self.pairs if pair is None else [pair]:
            for row in each.rows:
                if row.verdict != ERROR:
                    continue
                if each.unsearched or (each.skipped_by_grad_scaler and _is_backward(row.target_entry)):
                    unexplained.append(row)
        return unexplained

    def pair_problems(self, pair: PairResult) -> list[str]:
        """Why a pair cannot be said to have no divergence, besides a divergence it names: a dump an
        internal error switched off, less than most of either side paired, error rows the search did
        not judge. One sentence each."""
        problems = []
        for side, item in pair.stopped_dumps():
            folder = pair.golden_dir if side == "golden" else pair.target_dir
            problems.append(f"the {side}'s dump is incomplete ({folder}): {item.text()}")
        if pair.coverage is not None and pair.coverage.too_little():
            problems.append(f"too little paired: {pair.coverage.text()}")
        unexplained = self.unexplained_errors(pair)
        if unexplained:
            problems.append(f"{len(unexplained)} error rows in a step or backward not searched for a divergence"
                            " (said above)")
        return problems

    def problems(self) -> list[str]:
        """pair_problems of every pair, each named by its step/rank when there are several."""
        several = len(self.pairs) > 1
        return [f"{pair.pair}: {problem}" if several else problem
                for pair in self.pairs for problem in self.pair_problems(pair)]

    def failed(self) -> bool:
        """npu-compare's exit 1: a divergence, or any of problems()."""
        return any(pair.divergence for pair in self.pairs) or bool(self.problems())


# ---------------------------------------------------------------------------- alignment
def align(golden: list[DumpEntry], target: list[DumpEntry], max_edits: int = 4000) -> tuple[list, bool]:
    """Pairs (golden or None, target or None) in execution order, and whether alignment was needed.
    Parameter gradients pair by module, after the rest but before the optimizer's update ops (which
    take them): one tool writes them as each module's backward ends (msprobe), the other when the
    optimizer starts (npukit)."""
    golden_grads = [entry for entry in golden if entry.direction == naming.PARAMETERS_GRAD]
    target_grads = [entry for entry in target if entry.direction == naming.PARAMETERS_GRAD]
    if golden_grads or target_grads:
        pairs, aligned = align([e for e in golden if e.direction != naming.PARAMETERS_GRAD],
                               [e for e in target if e.direction != naming.PARAMETERS_GRAD], max_edits)
        # By name (class included: two models' `main.0` are a Conv2d and a ConvTranspose2d); then
        # by path alone, for a module whose class differs between the runs.
        by_name = {entry.name: entry for entry in golden_grads}
        matched = [by_name.pop(entry.name, None) for entry in target_grads]
        by_key: dict[str, list[DumpEntry]] = {}
        for entry in by_name.values():
            by_key.setdefault(entry.key, []).append(entry)
        grad_pairs = []
        for golden_entry, entry in zip(matched, target_grads):
            same_path = by_key.get(entry.key) if golden_entry is None else None
            grad_pairs.append((same_path.pop(0) if same_path else golden_entry, entry))
        grad_pairs += [(entry, None) for left in by_key.values() for entry in left]
        update = next((index for index, pair in enumerate(pairs)
                       if (pair[1] or pair[0]).parent == OPTIMIZER), len(pairs))
        pairs[update:update] = grad_pairs
        # in order: the two dumps wrote what paired in the same order (an optimizer's update ops after
        # the gradients in both, say), not one tool's gradients among the backward entries
        target_order = {id(entry): index for index, entry in enumerate(target)}
        golden_order = {id(entry): index for index, entry in enumerate(golden)}
        both = sorted((golden_order[id(g)], target_order[id(t)]) for g, t in pairs if g is not None and t is not None)
        in_order = all(earlier[1] < later[1] for earlier, later in zip(both, both[1:]))
        return pairs, aligned or not in_order
    golden_keys = [entry.key for entry in golden]
    target_keys = [entry.key for entry in target]
    if golden_keys == target_keys:
        return list(zip(golden, target)), False
    matches = myers_alignment(golden_keys, target_keys, max_edits)
    if matches is None:  # streams too different to align: fall back to exact names
        by_name = {entry.name: entry for entry in golden}
        used = set()
        pairs = []
        for entry in target:
            other = by_name.get(entry.name)
            pairs.append((other, entry))
            if other is not None:
                used.add(other.name)
        pairs += [(entry, None) for entry in golden if entry.name not in used]
        return pairs, True
    pairs = []
    gi = ti = 0
    for g, t in matches:
        pairs += [(golden[i], None) for i in range(gi, g)]
        pairs += [(None, target[j]) for j in range(ti, t)]
        pairs.append((golden[g], target[t]))
        gi, ti = g + 1, t + 1
    pairs += [(golden[i], None) for i in range(gi, len(golden))]
    pairs += [(None, target[j]) for j in range(ti, len(target))]
    return pairs, True


# ---------------------------------------------------------------------------- rows
def _entry_class(entry: DumpEntry | None, hf32: frozenset = frozenset()) -> str:
    """The loosest precision of the entry's tensors; "hf32" for an fp32 conv or matmul that the run
    computed in HF32 (`hf32`: the op kinds, "conv" and/or "matmul", the dump header says were on)."""
    best = "fp32"
    if entry is None:
        return best
    for leaf in entry.leaves():
        cls = dtype_class(leaf.dtype)
        if cls is not None and _PRECISION[cls] < _PRECISION[best]:
            best = cls
    if best == "fp32" and hf32 and hf32_kind(entry.name) in hf32:
        return "hf32"
    return best


def hf32_kind(entry_name: str) -> str | None:
    """"conv" or "matmul" for the ops each of torch_npu's allow_hf32 switches governs."""
    if not _ulp_wanted_name(entry_name):
        return None
    base, _, _ = naming.split_entry_name(entry_name)
    parts = base.split(".")
    return "conv" if any(part.lower().startswith("conv") for part in parts[-1:] + parts[1:2]) else "matmul"


def _leaf_roles(entry: DumpEntry | None) -> dict[str, tuple[str, TensorLeaf]]:
    if entry is None:
        return {}
    roles = {}
    for role, leaves in (("input", entry.inputs), ("param", entry.params), ("output", entry.outputs)):
        for leaf in leaves:
            roles[leaf.suffix] = (role, leaf)
    return roles


def build_rows(pair_label: str, pairs: list, hf32: frozenset = frozenset()) -> list[Row]:
    """One row per tensor of each paired entry (and unmatched rows for one-sided entries)."""
    rows = []
    noop_casts = noop_cast_backwards(pairs)
    reordered: set[str] = set()  # target leaves holding values one run merged in another order
    for order, (golden, target) in enumerate(pairs):
        cls = _entry_class(target if target is not None else golden, hf32)
        golden_leaves = _leaf_roles(golden)
        target_leaves = _leaf_roles(target)
        if _pair_list_items_by_producer(golden_leaves, target_leaves):
            reordered.update(leaf.name for role, leaf in target_leaves.values() if role == "output")
        for suffix in list(target_leaves) + [s for s in golden_leaves if s not in target_leaves]:
            role, _ = target_leaves.get(suffix) or golden_leaves[suffix]
            row = Row(
                pair=pair_label,
                order=order,
                golden_entry=golden.name if golden else None,
                target_entry=target.name if target else None,
                golden=golden_leaves.get(suffix, (None, None))[1],
                target=target_leaves.get(suffix, (None, None))[1],
                role=role,
                dtype_class=cls,
                in_optimizer=(target or golden).parent == OPTIMIZER,
            )
            if row.golden is None or row.target is None:
                row.verdict = UNMATCHED
                row.message = "only in golden" if row.target is None else "only in target"
                if (golden or target).name in noop_casts:
                    row.message += noop_casts[(golden or target).name]
            elif row.target.name in reordered or row.target.producer in reordered:
                row.by_statistics = True
            rows.append(row)
    return rows


def _pair_list_items_by_producer(golden_leaves: dict, target_leaves: dict) -> bool:
    """Pair the items of a list input (`input.0.k`: torch.stack's tensors) by the ops that made them
    when the two runs list the same producers in another order, and say whether they did. A run that
    keeps its parameters in two dtypes runs a foreach op once per dtype, and merges the results (the
    norms clip_grad_norm_ stacks) in another order than a run that keeps them in one: each item is
    compared with the golden value from the same op, and what the merge made, the same values in
    another order, by its statistics."""
    lists: dict[str, list[str]] = {}
    for suffix, (role, leaf) in target_leaves.items():
        head, _, item = suffix.rpartition(".")
        if role == "input" and head.count(".") == 1 and item.isdigit() and leaf.producer is not None:
            lists.setdefault(head, []).append(suffix)
    permuted = False
    for suffixes in lists.values():
        golden_items = [golden_leaves.get(suffix, (None, None))[1] for suffix in suffixes]
        if any(leaf is None or leaf.producer is None for leaf in golden_items):
            continue
        target_producers = [target_leaves[suffix][1].producer for suffix in suffixes]
        golden_producers = [leaf.producer for leaf in golden_items]
        if target_producers == golden_producers or sorted(target_producers) != sorted(golden_producers):
            continue
        by_producer = {leaf.producer: leaf for leaf in golden_items}
        for suffix, producer in zip(suffixes, target_producers):
            golden_leaves[suffix] = ("input", by_producer[producer])
        permuted = True
    return permuted


_CASTS = frozenset({"Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double", "Tensor.to", "Tensor.type",
                    "Tensor.type_as"})


def noop_cast_backwards(pairs: list) -> dict[str, str]:
    """One-sided backward entries of a cast the other run made too, where it changed nothing
    (`recon.float()` of a tensor already fp32 in the golden run: autograd records no node, so
    there is no backward): name -> why, for the row message. Not an op-stream difference."""
    # a side's forward entry name -> the other run's entry it is paired with
    counterpart = ({}, {})
    for golden, target in pairs:
        if golden is not None and target is not None and golden.direction == naming.FORWARD:
            counterpart[0][golden.name] = target
            counterpart[1][target.name] = golden
    found = {}
    for golden, target in pairs:
        if (golden is None) == (target is None):
            continue
        entry, side = (golden, 0) if target is None else (target, 1)
        if entry.direction != naming.BACKWARD or naming.operator_op(entry.base) not in _CASTS:
            continue
        other = counterpart[side].get(naming.with_direction(entry.name, naming.FORWARD))
        if other is None or not other.inputs or not other.outputs:
            continue
        if other.inputs[0].dtype == other.outputs[0].dtype:
            other_side = "golden" if side else "target"
            found[entry.name] = (f": the cast changed nothing in the {other_side} run ({other.inputs[0].dtype}"
                                 " already), so it has no backward there")
    return found


def _rms(leaf: TensorLeaf | None, metrics_stats: tuple | None = None) -> float:
    norm = None
    if metrics_stats is not None:
        norm = metrics_stats[3]
    elif leaf is not None and leaf.stats is not None:
        norm = leaf.stats[3]
    if norm is None or leaf is None or leaf.numel == 0 or not math.isfinite(norm):
        return 0.0
    return norm / math.sqrt(leaf.numel * (2 if "complex" in leaf.dtype else 1))  # complex: over its parts


def _norm(leaf: TensorLeaf | None, metrics_stats: tuple | None = None) -> float:
    norm = metrics_stats[3] if metrics_stats is not None else (leaf.stats[3] if leaf is not None and leaf.stats else None)
    return norm if norm is not None and math.isfinite(norm) else 0.0


def measure_rows(rows: list[Row], workers: int | None, progress=None) -> None:
    """Fill metrics for rows with tensor data on both sides; statistics or md5 otherwise."""
    jobs, job_rows = [], []
    for row in rows:
        if row.verdict == UNMATCHED:
            continue
        golden, target = row.golden, row.target
        if golden.shape != target.shape:
            row.verdict, row.message, row.error = ERROR, f"shape {list(target.shape)} != golden {list(golden.shape)}", math.inf
            continue
        complex_pair = "complex" in golden.dtype and "complex" in target.dtype  # compared as their real views
        one_complex = ("complex" in golden.dtype) != ("complex" in target.dtype)  # compared by statistics
        if golden.uninitialized or target.uninitialized:
            continue  # garbage on at least one side: judged "not compared" without reading it
        if golden.data_path is not None and target.data_path is not None and not one_complex \
                and not row.by_statistics:
            # Missing, truncated or mislabelled files raise a UserError naming the file (from the
            # worker that opens them).
            ulp = target.dtype if row.target_entry and _ulp_wanted_name(row.target_entry) and is_floating(target.dtype) else None
            jobs.append(PairJob(str(golden.data_path), golden.dtype, str(target.data_path), target.dtype,
                                golden.numel * (2 if complex_pair else 1), ulp, tuple(golden.shape),
                                row.target_scale, _rms(golden),
                                FLOAT64_EPS if {golden.dtype, target.dtype} & _DOUBLE else FLOAT32_EPS))
            job_rows.append(row)
    if jobs:
        for row, metrics in zip(job_rows, compare_pairs(jobs, workers, progress)):
            row.metrics = metrics


_DOUBLE = frozenset({"torch.float64", "torch.complex128"})


def _first_low_precision_matmul(dump: RankDump) -> str | None:
    """`Functional.linear.0.forward (torch.bfloat16)` when the golden run computed a matmul/conv in
    fp16/bf16 (code that casts to a compute dtype itself: --golden only turns autocast to fp32)."""
    for entry in dump.entries:
        if entry.name.endswith(".backward") or not _ulp_wanted_name(entry.name):
            continue
        for leaf in entry.leaves():
            if leaf.suffix.startswith("output") and leaf.dtype in ("torch.float16", "torch.bfloat16"):
                return f"{entry.name} ({leaf.dtype})"
    return None


def _ulp_wanted_name(entry_name: str) -> bool:
    base, _, _ = naming.split_entry_name(entry_name)
    parts = base.split(".")
    return bool(MATMUL_CLASS.intersection(parts[-1:] + parts[1:2]))


def judge_rows(rows: list[Row], thresholds: Thresholds) -> None:
    """Verdict and scalar error of every measured row; marks noise-level gradients negligible."""
    scale: dict[tuple, float] = {}
    keys = _gradient_scale_keys(rows)
    for row in rows:
        if row.verdict == UNMATCHED or row.golden.uninitialized or row.target.uninitialized:
            continue  # garbage must not set the scale the entry's other tensors are judged against
        row.norm = max(_norm(row.golden, row.metrics.golden_stats if row.metrics else None),
                       _norm(row.target, row.metrics.target_stats if row.metrics else None))
        key = keys.get(id(row))
        if key is not None:
            scale[key] = max(scale.get(key, 0.0), row.norm)
    for row in rows:
        if row.verdict == UNMATCHED or row.error == math.inf and row.verdict == ERROR:
            continue
        if row.golden.uninitialized or row.target.uninitialized:
            row.verdict, row.message, row.error = PASS, "uninitialized memory (or overwritten in place): not compared", None
            continue
        limits = thresholds.limits(row.dtype_class)
        gradient_scale = scale.get(keys.get(id(row)), 0.0)
        row.negligible = gradient_scale > 0 and row.norm < thresholds.negligible * gradient_scale
        if row.metrics is not None:
            _judge_tensor(row, limits, thresholds)
        elif row.golden.md5 is not None and row.target.md5 is not None:
            same = row.golden.md5 == row.target.md5
            row.error = 0.0 if same else math.inf
            row.verdict, row.message = (PASS, "") if same else (WARN, "md5 differs")
        elif row.golden.stats is not None and row.target.stats is not None:
            _judge_stats(row, limits, thresholds)
        else:
            row.verdict, row.message = PASS, "no data to compare"
            row.error = None


def _gradient_scale_keys(rows: list[Row]) -> dict[int, tuple]:
    """What each gradient's magnitude is judged against (by id of its row): the gradients of its
    backward op (incoming and outgoing); for an op's gradient for an argument no dumped op produced
    (a weight), those of every such argument; for a parameter's gradient as the optimizer gets it,
    those of every parameter (not the backward's: under GradScaler those carry the loss scale, and
    under FSDP they are the whole unreduced gradient, not the rank's shard, so a correct shard
    looked like noise beside them); values computed from the gradients after the backward, against
    the largest of them. A gradient far below
    that (a sum that cancels: the bias before a BatchNorm, a gain a following norm removes) is
    rounding noise in both runs and reaches no update that matters. Forward values have no such
    scale: a small result of a large input (a cancellation) is what the next ops compute with."""
    sources = set()  # (pair, forward entry, input suffix) of inputs no dumped op produced
    pairs_with_producers = set()
    for row in rows:
        if row.target is not None and row.target.producer is not None:
            pairs_with_producers.add(row.pair)
    for row in rows:
        if row.role == "input" and row.target is not None and row.target.producer is None:
            sources.add((row.pair, row.target_entry, row.target.suffix))
    # pair -> order of its last backward entry: the apis dumped before it ran in a forward (a
    # micro-batch's) or inside the backward (a custom autograd Function's backward, a tensor hook, a
    # checkpoint's recompute): values the next ops compute with, judged as forward values
    last_backward: dict[str, int] = {}
    for row in rows:
        if naming.split_entry_name(row.target_entry or row.golden_entry)[1] == naming.BACKWARD:
            last_backward[row.pair] = max(last_backward.get(row.pair, row.order), row.order)
    keys = {}
    for row in rows:
        entry = row.target_entry or row.golden_entry
        direction = naming.split_entry_name(entry)[1]
        weights = (row.pair, naming.PARAMETERS_GRAD)
        if direction == naming.PARAMETERS_GRAD:
            keys[id(row)] = weights
        elif direction == naming.FORWARD and row.order > last_backward.get(row.pair, math.inf):
            # User code on the gradients between backward and the update (clip_grad_norm_'s
            # per-parameter norms): judged against the largest of those values, like gradients.
            keys[id(row)] = (row.pair, "after-backward")
        elif direction == naming.BACKWARD:
            leaf = row.target or row.golden
            argument = "input." + leaf.suffix.partition(".")[2]
            is_weight = (row.role == "output" and row.pair in pairs_with_producers
                         and (row.pair, _forward_of(entry), argument) in sources)
            keys[id(row)] = (row.pair, "weight-gradients") if is_weight else (row.pair, row.order)
    return keys


def judge_carried_gradient(row: Row, thresholds: Thresholds) -> None:
    """Judge a negligible gradient row on its error after all: another op's backward takes it on and
    carries its error (own_error.py named the op that made it)."""
    if row.negligible and row.metrics is not None:
        row.negligible = False
        _judge_tensor(row, thresholds.limits(row.dtype_class), thresholds)


def _judge_tensor(row: Row, limits: DtypeLimits, thresholds: Thresholds) -> None:
    m = row.metrics
    floating = is_floating(row.target.dtype) or is_floating(row.golden.dtype)
    if m.nan_inf_mismatch:
        row.negligible = False  # a non-finite value is never noise, whatever the magnitudes say
        row.error = math.inf
        row.verdict = ERROR
        row.message = f"{m.nan_inf_mismatch} nan/inf mismatches (target has {m.target_nonfinite} non-finite, golden {m.golden_nonfinite})"
        return
    row.error = m.rel_l2
    if not floating:
        row.verdict, row.message = (PASS, "") if m.max_abs == 0 else (WARN, "integer values differ")
        return
    if row.negligible:
        row.verdict, row.message = PASS, "negligible magnitude"
        return
    if m.rel_l2 <= limits.pass_rel_l2 and m.cosine >= limits.pass_cosine:
        row.verdict = PASS
    elif m.cosine < thresholds.error_cosine or m.rel_l2 > thresholds.error_rel_l2:
        row.verdict = ERROR
        row.message = f"cosine {m.cosine:.4g}, relative L2 {m.rel_l2:.3g}"
    else:
        row.verdict = WARN
        if m.rel_l2 > limits.warn_rel_l2:
            row.message = f"relative L2 {m.rel_l2:.3g} above the {row.dtype_class} warn limit {limits.warn_rel_l2:g}"


def _judge_stats(row: Row, limits: DtypeLimits, thresholds: Thresholds) -> None:
    """Statistics-only dumps: an error estimate from max/min/mean/norm (a lower bound of the real one)."""
    g = row.golden.stats
    t = tuple(None if value is None else value * row.target_scale for value in row.target.stats)
    golden_bad = _nonfinite(row.golden)
    target_bad = _nonfinite(row.target)
    diffs = {}
    for label, gv, tv in zip(("Max", "Min", "Mean", "Norm"), g, t):
        diffs[label] = (tv - gv) if gv is not None and tv is not None else None
    row.stat_diffs = diffs
    if golden_bad != target_bad:
        row.negligible = False
        row.error, row.verdict = math.inf, ERROR
        row.message = NONFINITE_IN_TARGET_ONLY if target_bad else NONFINITE_IN_GOLDEN_ONLY
        return
    if golden_bad:
        row.error, row.verdict, row.message = 0.0, WARN, "non-finite values on both sides"
        return
    if not is_floating(row.target.dtype):
        same = all(value == 0 for value in diffs.values() if value is not None)
        row.error = 0.0 if same else math.inf
        row.verdict, row.message = (PASS, "") if same else (WARN, "integer statistics differ")
        return
    magnitude = max((abs(v) for v in (g[0], g[1]) if v is not None), default=0.0)
    estimates = []
    if g[3] and diffs["Norm"] is not None:
        estimates.append(abs(diffs["Norm"]) / g[3])
    if magnitude > 0:
        estimates += [abs(diffs[k]) / magnitude for k in ("Max", "Min", "Mean") if diffs[k] is not None]
    row.error = max(estimates, default=0.0)
    if row.negligible:
        row.verdict, row.message = PASS, "negligible magnitude"
    elif row.error <= limits.pass_rel_l2:
        row.verdict = PASS
    elif row.error > thresholds.error_rel_l2:
        row.verdict, row.message = ERROR, f"statistics differ by {row.error:.3g} (relative)"
    else:
        row.verdict = WARN
        if row.error > limits.warn_rel_l2:
            row.message = f"statistics differ by {row.error:.3g}, above the {row.dtype_class} warn limit"


def _nonfinite(leaf: TensorLeaf) -> bool:
    if leaf.nan_count or leaf.inf_count:
        return True
    return any(value is not None and not math.isfinite(value) for value in leaf.stats[:2])


# ---------------------------------------------------------------------------- first divergence
class _Lineage:
    """Where each input tensor of one dump came from, following the dump's `producer` links."""

    def __init__(self, dump: RankDump) -> None:
        self.dump = dump
        self.leaves = {leaf.name: leaf for entry in dump.entries for leaf in entry.leaves()}
        self.entries = dump.by_name()

    def origin(self, leaf: TensorLeaf) -> TensorLeaf:
        """The output leaf that produced this tensor, or the first input that carried it (a source)."""
        seen = set()
        while leaf.producer is not None and not leaf.suffix.startswith("output") and leaf.name not in seen:
            seen.add(leaf.name)
            nxt = self.leaves.get(leaf.producer)
            if nxt is None:
                break
            leaf = nxt
        return leaf


def _err(row: Row) -> float:
    return 0.0 if row.negligible or row.error is None else row.error


def _size(row: Row) -> float:
    """The tensor's L2 norm, the target's at the golden run's scale (a loss-scaled backward)."""
    golden = _norm(row.golden, row.metrics.golden_stats if row.metrics else None)
    target = _norm(row.target, row.metrics.target_stats if row.metrics else None) * row.target_scale
    return max(golden, target)


def _absolute_error(row: Row) -> float:
    """||target - golden|| estimated from the relative error (noise-level rows included: a
    gradient too small to matter for its own op can still be all another op receives)."""
    if row.error is None:
        return 0.0
    return math.inf if row.error == math.inf else row.error * _size(row)


class _GradientFlow:
    """Where one dump's gradients flow, from its forward producer links: the gradient arriving at an
    op's output is the sum of what the backwards of the ops that used the output computed for it,
    and a weight's gradient is the sum of what the backwards of the ops that used the weight
    computed for it. Api-level links only: a module's backward lists gradients only for the
    arguments that need one, so its positions are not its arguments'."""

    def __init__(self, dump: RankDump, rows_by_target_entry: dict, uses: dict, has_api_entries: bool,
                 amplification: float) -> None:
        self.entries = dump.by_name()
        self.rows = rows_by_target_entry
        self.uses = uses if has_api_entries else {}
        self.amplification = amplification

    def computed_for(self, users: list[tuple[DumpEntry, str]]) -> list[Row] | None:
        """The rows of the gradients the backwards of `users` (entry, argument suffix) computed for
        that argument; None when one of them cannot be accounted for (its backward holds no such
        row, or it is not measured)."""
        computed = []
        for user, suffix in users:
            if user.direction != naming.FORWARD or user.parent == OPTIMIZER:
                continue  # (an optimizer's update op uses the weight after the backward)
            # a backward's `output.i` is its gradient for the i-th tensor argument
            position = next((i for i, leaf in enumerate(user.inputs) if leaf.suffix == suffix), None)
            backward = self.rows.get(naming.with_direction(user.name, naming.BACKWARD), [])
            row = next((row for row in backward if row.role == "output" and row.target is not None
                        and row.target.suffix == f"output.{position}"), None)
            if row is None:
                if any(leaf.requires_grad is not False for leaf in user.outputs):
                    return None
                continue  # no gradient flows back through it (.detach(), a comparison, .item())
            if row.error is None:
                return None
            computed.append(row)
        return computed

    def incoming(self, entry: DumpEntry, row: Row, warn: float) -> tuple[str, object] | None:
        """How the gradient `row`, arriving at backward `entry`, relates to what the ops that used that
        output computed for it: ("changed", (their names, their error)) when it differs from them by
        more than their error explains (something outside the dumped ops changed it on its way);
        ("amplified", row) when it is one op's gradient whose error is far above the error of the
        gradient that op received; ("undumped", None) when no dumped op used the output;
        ("explained", None) otherwise; None when the dump cannot tell."""
        forward = self.entries.get(_forward_of(entry.name))
        incoming = [leaf for leaf in entry.inputs]
        if forward is None or row.target is None or row.error is None or not self.uses \
                or len(forward.outputs) != len(incoming) or row.target not in incoming:
            return None
        output = forward.outputs[incoming.index(row.target)]
        users = self.uses.get(output.name, [])
        if not users:
            return "undumped", None
        computed = self.computed_for(users)
        if computed is None:
            return None
        bound = sum(_absolute_error(each) for each in computed)
        if _absolute_error(row) > self.amplification * bound + warn * _size(row):
            names = ", ".join(sorted({each.target_entry for each in computed}))
            return "changed", (names, max((each.error for each in computed), default=0.0))
        carrier = max(computed, key=_absolute_error, default=None)
        if carrier is None or carrier.error <= warn:
            return "explained", None
        received = max((each.error for each in self.rows.get(carrier.target_entry, [])
                        if each.role == "input" and each.error is not None), default=0.0)
        if carrier.error > self.amplification * received:
            return "amplified", carrier
        return "explained", None

    def for_parameter(self, entry: DumpEntry, row: Row, lineage: _Lineage) -> list[Row] | None:
        """The rows of the gradients the backward ops computed for the parameter of gradient row `row`
        (of parameters_grad entry `entry`), over every call that used it; None when unknown."""
        if not self.uses or row.target is None:
            return None
        module = entry.name.partition(f".{naming.PARAMETERS_GRAD}")[0] + f".{naming.FORWARD}."
        suffix = f"parameters.{row.target.suffix}"
        leaf = next((leaf for name, each in self.entries.items() if name.startswith(module)
                     for leaf in each.params if leaf.suffix == suffix), None)
        if leaf is None:
            return None
        root = lineage.origin(leaf)
        holder = self.entries.get(_entry_of_leaf(root.name))
        if holder is None or holder.name.startswith("Module.") or root.suffix.startswith("output"):
            return None  # no api call took the parameter itself
        computed = self.computed_for([(holder, root.suffix)] + self.uses.get(root.name, []))
        if computed is None or not computed or any(each.target.shape != row.target.shape for each in computed):
            return None  # a shard (FSDP) is not the sum of the full gradients
        return computed


_WRONG_GRADIENT = 0.5  # relative error of a weight's gradient that points its update elsewhere


def _one_of_several_ranks(dump: RankDump) -> bool:
    """Whether the dump is one rank's of a multi-rank run (its folder has rank folders beside it)."""
    if not re.fullmatch(r"rank\d+", dump.path.name):
        return False
    try:
        return any(re.fullmatch(r"rank\d+", other.name) and other != dump.path for other in dump.path.parent.iterdir())
    except OSError:
        return False


def _changed_after_backward(entry_rows: list[Row], entry: DumpEntry, gradients: _GradientFlow, lineage: _Lineage,
                            rows: list[Row], order: int, warn: float,
                            thresholds: Thresholds, computed_only: bool = False) -> tuple[str, float, float] | None:
    """(reason, input error, output error) when a parameter's gradient, as the optimizer got it,
    has an error the gradients the backward computed for it do not explain: it was changed after
    the backward (a hook on the parameter). Without the links to tell, when it is the first error
    of the step (no tensor before it was above its warn limit); computed_only: only with the links."""
    for row in entry_rows:
        if row.verdict != ERROR or row.negligible or row.error is None or row.target is None:
            continue
        computed = gradients.for_parameter(entry, row, lineage)
        if computed is not None:
            bound = sum(_absolute_error(each) for each in computed) / _loss_scale_between(computed, row)
            if _absolute_error(row) <= thresholds.amplification * bound + warn * _size(row):
                continue
            computed_error = max(each.error for each in computed)
            names = ", ".join(sorted({each.target_entry for each in computed}))
            differs = (f"the gradient of {row.target.suffix} as the optimizer got it differs (error {_fmt(row.error)})"
                       f" from the one the backward computed for it ({names}: error {_fmt(computed_error)})")
            if computed_only:  # one rank of several: _changed_before_the_reduce says why, over all of them
                return differs, computed_error, row.error
            return (differs + ": it was changed after the backward (a hook on the parameter (register_hook), code"
                    " between backward() and the optimizer step, or a gradient collective that brought another"
                    " rank's difference)", computed_error, row.error)
        if not computed_only and _first_error_here(rows, order, warn):
            return (f"the gradient of {row.target.suffix} as the optimizer got it differs (error {_fmt(row.error)})"
                    " while every tensor before it matched: it was changed after the backward (a hook on the"
                    " parameter (register_hook), code between backward() and the optimizer step)", 0.0, row.error)
    return None


def _loss_scale_between(computed: list[Row], parameter_gradient: Row) -> float:
    """The loss scale the backward's gradients carry and the optimizer's gradient does not: when both
    runs use GradScaler the backward rows compare alike (same scale) but are in scaled units, while
    GradScaler.unscale_ divided the parameter's gradient. Read off the golden norms: a ratio of 64
    or more is a loss scale, a power of two (GradScaler's are); else 1 (the ranks' shares of a reduced
    gradient, or the calls that used a parameter, differ from their sum by far less)."""
    pieces = sum(_norm(each.golden, each.metrics.golden_stats if each.metrics else None) for each in computed)
    whole = _norm(parameter_gradient.golden,
                  parameter_gradient.metrics.golden_stats if parameter_gradient.metrics else None)
    if not whole or not pieces or pieces / whole < 64:
        return 1.0
    return 2.0 ** round(math.log2(pieces / whole))


def _backward_amplifier(pair_label: str, computed: Row, its_rows: list[Row], dump: RankDump,
                        out_err: float) -> Divergence:
    """The backward whose gradient for an argument (row `computed`) has an error far above the error
    of the gradient it received: it amplifies, although its gradient is below the noise level of its
    own gradients (a softmax over saturated logits gives a gradient 1e-4 of the one it gets)."""
    entry = dump.by_name()[computed.target_entry]
    received = [row for row in its_rows if row.role == "input" and row.error is not None]
    in_err = max((row.error for row in received), default=0.0)
    size = max((_size(row) for row in received), default=0.0)
    ratio = f"{_size(computed) / size:.2g}x" if size else "a fraction of"
    times = f"{computed.error / in_err:.3g}x" if in_err else "while there is none in"
    reason = (f"this backward amplifies the error: its gradient for {computed.target.suffix.replace('output', 'input')}"
              f" has error {_fmt(computed.error)}, {times} the error of the gradient it received"
              f" ({_fmt(in_err)}). That gradient is {ratio} the size of the received one: a small"
              " difference of large forward values (a softmax over saturated logits, a norm over near-constant"
              " values, a division by a small value), which the run's precision does not resolve. Compute this op"
              " and the values it takes in fp32, or keep them in a range where it does not saturate")
    return Divergence(pair=pair_label, entry=entry.name, golden_entry=entry.name, reason=reason,
                      module_path=entry_module_path(entry, dump), stack=entry_stack(entry, dump),
                      input_error=in_err, output_error=max(out_err, computed.error))


# Ops that write tensor arguments in place besides computing their result (a batch norm's running
# statistics, while training): the dump measures those arguments after the call, so their values
# there are the op's results. base name -> (argument suffixes, the `training` flag, its default).
_WRITES_ARGUMENTS = {
    "Functional.batch_norm": (("input.1", "input.2"), "input.5", False),
    "Torch.batch_norm": (("input.3", "input.4"), "input.5", False),
    "Functional.instance_norm": (("input.1", "input.2"), "input.5", True),
    "Torch.instance_norm": (("input.3", "input.4"), "input.5", True),
}


def _written_by_call(entry: DumpEntry) -> tuple[str, ...]:
    written = _WRITES_ARGUMENTS.get(entry.base) if entry.direction == naming.FORWARD else None
    if written is None:
        return ()
    suffixes, flag, default = written
    return suffixes if entry.flags.get(flag, default) else ()


# torch.finfo(dtype).min/max/eps/tiny of the floating dtypes: a program's constant in the dtype it runs in.
_FINFO = {
    "torch.float16": {"max": 65504.0, "eps": 2.0 ** -10, "tiny": 2.0 ** -14},
    "torch.bfloat16": {"max": 3.3895313892515355e38, "eps": 2.0 ** -7, "tiny": 2.0 ** -126},
    "torch.float32": {"max": 3.4028234663852886e38, "eps": 2.0 ** -23, "tiny": 2.0 ** -126},
    "torch.float64": {"max": 1.7976931348623157e308, "eps": 2.0 ** -52, "tiny": 2.0 ** -1022},
}


def _finfo_names(value: float, dtypes: set[str]) -> set[str]:
    """Which torch.finfo(d) field of one of `dtypes` the number is ("min", "eps" ...)."""
    names = set()
    for dtype in dtypes:
        for name, constant in _FINFO.get(dtype, {}).items():
            if value == constant:
                names.add(name)
            elif name == "max" and value == -constant:
                names.add("min")
    return names


def _accept_dtype_constants(golden: DumpEntry, target: DumpEntry, outputs: list[Row], rows: list[Row]) -> None:
    """The rows of a call's outputs (and of the ops' inputs that take them) that differ because the
    call filled each run's finfo constant: shown as warnings saying so, not as errors."""
    constants = ", ".join(f"{suffix} {golden.numbers[suffix]:g} / {value:g}" for suffix, value in target.numbers.items()
                          if golden.numbers.get(suffix, value) != value)
    message = (f"differs where filled with each run's spelling of one constant ({constants}: torch.finfo"
               " constants of each run's dtype, or a finite fill for an infinite one): the same masking; what"
               " uses the values is judged")
    names = {row.target.name for row in outputs if row.target is not None}
    for row in rows:
        if row.verdict == ERROR and row.target is not None and (
                row.target.name in names or row.target.producer in names):
            row.verdict, row.message = WARN, message


def _dtype_constants_differ(golden: DumpEntry, target: DumpEntry) -> bool:
    """True when the numbers the two calls took differ, and each only as the same torch.finfo field
    of the dtype each run computes in (finfo(att.dtype).min: -3.4e38 in fp32, -65504 in fp16)."""
    golden_dtypes = {leaf.dtype for leaf in golden.leaves()}
    target_dtypes = {leaf.dtype for leaf in target.leaves()}
    differ = False
    for suffix, value in target.numbers.items():
        other = golden.numbers.get(suffix)
        if other is None or other == value:
            continue
        if _finite_for_infinite(value, other, target_dtypes) or _finite_for_infinite(other, value, golden_dtypes):
            differ = True  # a mask filled with finfo(dtype).min in one run and -inf in the other
            continue
        if golden_dtypes == target_dtypes or not _finfo_names(value, target_dtypes) & _finfo_names(other, golden_dtypes):
            return False
        differ = True
    return differ


def _finite_for_infinite(finite: float, infinite: float, dtypes: set[str]) -> bool:
    """finfo(dtype).min where the other run fills -inf (or max for +inf): the fix npu-compare and
    npu-migrate's inf-fill finding advise, which masks the same elements."""
    return math.isinf(infinite) and not math.isinf(finite) and (finite < 0) == (infinite < 0) \
        and bool(_finfo_names(finite, dtypes) & {"min", "max"})


def find_divergence(pair_label: str, pairs: list, rows: list[Row], golden: RankDump, target: RankDump,
                    thresholds: Thresholds, search_backward: bool = True,
                    changed_shares: list | None = None) -> Divergence | None:
    """The first op, in the target's execution order, where the two runs start to differ.
    search_backward=False: forward ops only (the gradients of a step GradScaler skipped).
    changed_shares: one rank of several: gets the first parameter gradient the optimizer got changed
    from what this rank's backward computed (judged over all ranks by _changed_before_the_reduce)."""
    rows_by_entry: dict[int, list[Row]] = {}
    rows_by_target_entry: dict[str, list[Row]] = {}
    for row in rows:
        rows_by_entry.setdefault(row.order, []).append(row)
        if row.target_entry is not None:
            rows_by_target_entry.setdefault(row.target_entry, []).append(row)
    leaf_error = {row.target.name: _err(row) for row in rows if row.target is not None and row.error is not None}
    only_target = {t.name for g, t in pairs if g is None and t is not None}
    only_golden = {g.name for g, t in pairs if t is None and g is not None}
    target_lineage, golden_lineage = _Lineage(target), _Lineage(golden)
    cross_tool = golden.by_npukit != target.by_npukit  # two tools' dumps: see _comparable_entries
    hf32 = golden.hf32 ^ target.hf32
    run_class = _run_class(target, hf32)
    last_unmatched = None

    after_backward = False  # user code between backward and the update (clip_grad_norm_) works on gradients
    step, _ = _step_and_rank(pair_label)
    updated = step is not None and step > 0  # the weights have been through an optimizer step
    has_api_entries = any(not entry.name.startswith("Module.") for entry in target.entries)
    consumers: dict[str, list[DumpEntry]] = {}  # output leaf name -> entries that took it as input
    uses: dict[str, list[tuple[DumpEntry, str]]] = {}  # the same, with the argument (`input.1`) it was
    for entry in target.entries:
        if has_api_entries and entry.name.startswith("Module."):
            continue  # a mix-level dump: the api entries inside a module are the ops that use a value
        for leaf in entry.inputs:
            if leaf.producer is not None:
                consumers.setdefault(leaf.producer, []).append(entry)
                uses.setdefault(leaf.producer, []).append((entry, leaf.suffix))
    gradients = _GradientFlow(target, rows_by_target_entry, uses, has_api_entries, thresholds.amplification)
    several_ranks = _one_of_several_ranks(target)
    golden_items, target_items = _single_values(golden), _single_values(target)
    # What the run's precision explains in a result (a loss, the step's gradient): more than one op's
    # rounding, up to `amplification` times its warn limit (5% for fp16 and HF32, 30% for bf16).
    update_limit = thresholds.amplification * thresholds.limits(run_class).warn_rel_l2
    # In mixed precision an amplified error that leaves every result within that has not changed
    # what is computed. (The error limit alone let an HF32 cancellation leave the loss 14% off.)
    absorbed_limit = min(update_limit, thresholds.error_rel_l2) if run_class != "fp32" else None
    # What the training computes from the step: an amplified error that leaves the whole gradient
    # (all weights' gradients as one vector, as clip_grad_norm_ sees it) within what the run's
    # precision explains changed nothing the step updates.
    update_error = _gradient_error(rows)
    # ... and a weight whose own gradient is more than half off is updated elsewhere, however small
    # its share of the whole gradient (an HF32 cancellation: the layers after it got 100%-off
    # gradients beside a residual branch's gradient 100x larger, the loss 2 off). A bf16 group norm's
    # bias gradients are 30% apart in a correct run.
    consequential = update_error > update_limit or any(
        _err(row) > _WRONG_GRADIENT for row in rows
        if row.target_entry is not None and naming.split_entry_name(row.target_entry)[1] == naming.PARAMETERS_GRAD)
    for order, (golden_entry, target_entry) in enumerate(pairs):
        entry = target_entry or golden_entry
        after_backward = after_backward or entry.direction == naming.BACKWARD
        if golden_entry is None or target_entry is None:
            last_unmatched = (golden_entry, target_entry)
            continue
        if after_backward and not search_backward:
            break  # the backward (and what follows it) comes after the whole forward
        entry_rows = rows_by_entry.get(order, [])
        warn = thresholds.limits(_weakest(_entry_class(target_entry, hf32), run_class)).warn_rel_l2
        if target_entry.direction == naming.PARAMETERS_GRAD:
            # (two tools write a parameter's gradient at other moments: msprobe as the backward
            # leaves the module, npukit as the optimizer starts, after clipping; with several ranks,
            # DDP's all_reduce brings the other ranks' gradients: see ranks.py)
            changed = None if cross_tool else _changed_after_backward(
                entry_rows, target_entry, gradients, target_lineage, rows, order, warn, thresholds,
                computed_only=several_ranks)
            if changed is not None and several_ranks:
                if changed_shares is not None and not changed_shares:
                    changed_shares.append(_make_divergence(pair_label, target_entry, golden_entry, changed[0], target,
                                                           changed[1], changed[2]))
            elif changed is not None:
                return _make_divergence(pair_label, target_entry, golden_entry, changed[0], target, changed[1],
                                        changed[2])
            continue
        # The running statistics a batch norm updates in place are measured after the call: its results.
        written = _written_by_call(target_entry)
        outputs = [row for row in entry_rows if row.error is not None and (
            row.role == "output" or row.target is not None and row.target.suffix in written)]
        inputs = [row for row in entry_rows if row.role in ("input", "param") and row.error is not None
                  and row.target is not None and row.target.suffix not in written]
        if not outputs and target_entry.direction != naming.BACKWARD:
            continue
        # An index a selection returns (topk's, argmax's) flips where two values nearly tie, as a
        # relu's mask does: a discrete consequence of its input's rounding, judged where it is used.
        out_err = max((_err(row) for row in outputs if is_floating(row.target.dtype)), default=0.0)
        found = None  # (culprit entry name, side, reason)
        activation_errors = []
        source_errors = []
        if _dtype_constants_differ(golden_entry, target_entry):
            # masked_fill(~mask, torch.finfo(att.dtype).min) in fp32 and fp16: the same program, its
            # constant in each run's dtype. The filled elements differ by design; what uses them is judged.
            _accept_dtype_constants(golden_entry, target_entry, outputs, rows)
            continue
        number_error, number = _number_error(golden_entry, target_entry, golden_items, target_items)
        if number is not None and number_error > warn and out_err > warn:
            suffix, golden_value, target_value = number
            reason = (f"its argument {suffix} is {golden_value:.6g} in the golden run and {target_value:.6g} in the"
                      f" target; output error {_fmt(out_err)}")
            return _make_divergence(pair_label, target_entry, golden_entry, reason, target, 0.0, out_err)
        if number_error:
            activation_errors.append(number_error)  # a tensor's value (.item()) or a rounding-sized difference
        for row in inputs:
            kind, culprit = _input_kind(row, target_entry, target_lineage, golden_lineage, only_target,
                                        only_golden, leaf_error, warn, target.has_producers)
            if kind == "source":
                if updated and row.target is not None and row.target.requires_grad:
                    # A weight after the first step: the runs' updates (from gradients a few percent
                    # apart in mixed precision) moved it. An input error like an activation's.
                    activation_errors.append(_err(row))
                else:
                    source_errors.append(_err(row))
                continue
            activation_errors.append(_err(row))
            if _err(row) <= warn or found:
                continue
            if kind in ("target-only", "golden-only", "between", "parent-code"):
                found = (culprit, kind, row)
            elif kind == "unknown" and last_unmatched and _first_error_here(rows, order, warn):
                golden_only, target_only = last_unmatched
                found = ((target_only or golden_only).name, "target-only" if target_only else "golden-only", row)
            elif kind == "gradient" and cross_tool:
                # A cross-tool pair leaves the api backwards out (see _comparable_entries): the ops that
                # made this gradient are compared in neither dump, so no divergence is drawn from it.
                continue
            elif kind == "gradient":
                judged = gradients.incoming(target_entry, row, warn)
                if judged is not None and judged[0] == "changed":
                    found = (target_entry.name, "gradient-changed", row, judged[1])
                elif not _first_error_here(rows, order, warn):
                    continue
                elif judged is not None and judged[0] == "amplified":
                    # the op using this value amplified the gradient (a saturated softmax): its rows
                    # were below the noise level of its own gradients, so it was not named there
                    return _backward_amplifier(pair_label, judged[1],
                                               rows_by_target_entry.get(judged[1].target_entry, []), target, out_err)
                elif judged is None or judged[0] == "undumped":
                    found = (target_entry.name, "gradient-gap", row)
        if found:
            return _divergence(pair_label, found, golden, target, out_err)
        lost = _lost_in_place_update(pair_label, golden_entry, target_entry, entry_rows, target, target_lineage,
                                     out_err)
        if lost is not None:
            return lost
        in_err = max(activation_errors, default=0.0)
        source_err = max(source_errors, default=0.0)
        limit = warn
        if after_backward and target_entry.direction != naming.BACKWARD:
            # Ops on gradients after the backward (a gradient norm, a clip coefficient): their inputs
            # come from gradients no dumped op produced, and carry the backward's differences.
            in_err, source_err = max(in_err, source_err), 0.0
            if run_class != "fp32":
                limit = thresholds.error_rel_l2
        elif target_entry.direction == naming.BACKWARD:
            forward_rows = rows_by_target_entry.get(_forward_name(target_entry), [])
            forward_errors = [_err(row) for row in forward_rows if row.role in ("input", "param")]
            if run_class != "fp32" or any(error > 0 for error in forward_errors):
                # The backward ran on other forward values (low-precision activations): a relu's or
                # max-pool's mask, a BatchNorm's statistics turn them into gradient differences of a
                # few percent, as every mixed-precision run has (and statistics dumps underestimate
                # the incoming part). Only an error-sized difference is a divergence.
                limit = thresholds.error_rel_l2
            # A backward computes with its forward's values too: their error is one of its inputs'
            # (after a step that moved the weights apart, pow's backward is 2*x*grad of another x).
            in_err = max([in_err, *forward_errors])
        if out_err <= limit:
            continue
        if in_err <= warn and source_err > warn:
            if updated:
                # after an optimizer step: a buffer an earlier step wrote (running statistics) or data
                reason = (f"an input that no dumped op of this step produced differs (error {_fmt(source_err)});"
                          f" output error {_fmt(out_err)}: state an earlier step updated (a batch norm's running"
                          " statistics, a buffer), whose compare shows where it began, or data that differs"
                          " (`--replay DIR`)")
            else:
                reason = (f"a weight or input that no dumped op produced differs (error {_fmt(source_err)});"
                          f" output error {_fmt(out_err)}. If the runs were not seeded alike (scripts that never"
                          " call manual_seed start from other weights each run), run both with `npu-run --seed N`;"
                          " a data difference: `--replay DIR`")
            return _make_divergence(pair_label, target_entry, golden_entry, reason, target, in_err, out_err,
                                    outside=True)
        # A product whose result is far smaller than its operands (a 128->1 value head near 0) grows
        # their relative error by that ratio: the error it is expected to give.
        explained = in_err * _product_condition(target_entry, inputs, outputs)
        amplified = out_err > thresholds.amplification * explained
        if amplified and target_entry.direction != naming.BACKWARD \
                and target.has_producers and not consequential \
                and _absorbed(target_entry, consumers, rows_by_target_entry, absorbed_limit or limit, set()):
            continue  # its relative error is large but what uses it does not carry it (a sum near 0)
        if amplified and target_entry.direction == naming.BACKWARD and run_class != "fp32" and not (
                _own_gradients_wrong(target_entry, target, rows) if updated else consequential):
            # A gradient a cancellation made noisy (a loss term near 0) that the update does not carry.
            # After an update the whole gradient is no evidence either way: AdamW's first
            # steps move every weight by about lr whatever its gradient's size, so a gradient's sign that
            # bf16 flipped moves the weights apart and the next step's gradients differ by a third in a
            # correct run. What counts is whether this backward's own weights get a wrong gradient.
            continue
        if amplified and target_entry.parent == OPTIMIZER:
            # The update squares, divides and normalizes gradients already judged (Adam's v of a
            # noise-level gradient, 30% off, is 60% off; m / sqrt(v) evens it out again): what it
            # does with them shows in the weights it writes (the next step's forward) and in an update
            # it lost (_lost_in_place_update), not in its intermediate values' relative errors.
            continue
        if has_api_entries and target_entry.name.startswith("Module.") and target_entry.direction != naming.BACKWARD:
            continue  # a mix-level dump: the api entries inside the module say where (and see its weights)
        if amplified and has_api_entries and target_entry.name.startswith("Module.") \
                and _api_backwards_inside(target_entry, pairs[order + 1:], target):
            continue  # its backward's entry is placed before the backwards of the ops inside it: they say which
        if amplified:
            for row in inputs:
                # Statistics cannot see some changes (a transpose keeps max/min/mean/norm): a call
                # only the target makes, feeding this op, is then the better suspect.
                if row.role == "input" and target.has_producers:
                    origin = target_lineage.origin(row.target)
                    if origin.suffix.startswith("output") and _entry_of_leaf(origin.name) in only_target:
                        return _divergence(pair_label, (_entry_of_leaf(origin.name), "target-only", row),
                                           golden, target, out_err)
            if target_entry.direction != naming.BACKWARD and target.has_producers:
                revealed = _revealed_by_cancellation(outputs, inputs, target_lineage, limit, thresholds.amplification)
                if revealed is not None:
                    return _cancellation_divergence(pair_label, revealed, target_entry, target, target_lineage, out_err,
                                                    hf32)
                revealed = _revealed_by_normalization(target_entry, outputs, inputs, target_lineage,
                                                      thresholds.amplification)
                if revealed is not None:
                    return _cancellation_divergence(pair_label, revealed, target_entry, target, target_lineage, out_err,
                                                    hf32)
            reason = f"{_amplification_text(out_err, in_err)} ({'warn' if limit == warn else 'error'} limit {limit:g})"
            return _make_divergence(pair_label, target_entry, golden_entry, reason, target, in_err, out_err)
    return None


_PASS_THROUGH = frozenset({"view", "reshape", "transpose", "permute", "t", "flatten", "unflatten", "unsqueeze",
                           "squeeze", "contiguous", "view_as", "reshape_as", "float", "to", "type_as", "clone",
                           "expand", "expand_as", "__getitem__", "select", "narrow", "chunk", "split"})


def _absorbed(entry: DumpEntry, consumers: dict, rows_by_target_entry: dict, limit: float, seen: set,
              depth: int = 0) -> bool:
    """True when an error this op's outputs carry does not reach a result: along every chain of ops
    that use them, an op's output error falls back within `limit` before the chain ends (a sum that
    is ~0 by construction next to a larger loss term; one advantage among an episode's, stacked
    and summed). An output no dumped op uses is a result: not absorbed."""
    users = [user for leaf in entry.outputs for user in consumers.get(leaf.name, [])]
    if not users or depth > 16:
        return False
    for user in users:
        if user.direction != naming.FORWARD or user.name in seen:
            continue
        seen.add(user.name)
        errors = [_err(row) for row in rows_by_target_entry.get(user.name, []) if row.role == "output"]
        if not errors and user.base.rpartition(".")[2] not in _PASS_THROUGH:
            return False
        carries = not errors or max(errors) > limit  # a view or cast passes it on whatever it measured
        if carries and not _absorbed(user, consumers, rows_by_target_entry, limit, seen, depth + 1):
            return False
    return True


# Products and where their two operands are: (first, second) argument suffixes.
_PRODUCTS = {name: ("input.0", "input.1") for name in ("linear", "matmul", "__matmul__", "mm", "bmm", "mv", "dot",
                                                      "inner", "vdot")}
_PRODUCTS.update({name: ("input.1", "input.2") for name in ("addmm", "baddbmm", "addmv", "addbmm")})


def _product_condition(entry: DumpEntry, inputs: list[Row], outputs: list[Row]) -> float:
    """||a||·||b|| / (||a·b||·sqrt(K)) for a product of operands a, b over K terms, at least 1: about 1
    for a result of the size its operands make it, large when the sums cancel."""
    operands = _PRODUCTS.get(entry.base.rpartition(".")[2]) if entry.direction == naming.FORWARD else None
    if operands is None:
        return 1.0
    by_suffix = {row.target.suffix: row for row in inputs if row.target is not None}
    first, second = by_suffix.get(operands[0]), by_suffix.get(operands[1])
    result = max((row.norm for row in outputs), default=0.0)
    if first is None or second is None or not first.target.shape or not result:
        return 1.0
    terms = first.target.shape[-1]
    return max(1.0, first.norm * second.norm / (result * math.sqrt(max(terms, 1))))


def _api_backwards_inside(module_entry: DumpEntry, later_pairs: list, dump: RankDump) -> bool:
    """Whether an api backward of an op the module (or a submodule) ran comes later in the dump."""
    path = naming.module_path_of(module_entry.name) or ""
    for _, later in later_pairs:
        if later is None or later.direction != naming.BACKWARD or later.name.startswith("Module."):
            continue
        inside = entry_module_path(later, dump)
        if inside is not None and (not path or inside == path or inside.startswith(path + ".")):
            return True
    return False


def _own_gradients_wrong(entry: DumpEntry, dump: RankDump, rows: list[Row]) -> bool:
    """True when a parameter gradient of the module that ran this op is wrong (over half off, or not
    finite): the op's amplified error reached its own weights' update."""
    path = entry_module_path(entry, dump)
    if path is None:
        return False
    own = "" if path == "(root)" else path
    return any(
        (row.error is not None and row.error > _WRONG_GRADIENT or row.target is not None and _nonfinite(row.target))
        for row in rows
        if row.target_entry is not None and naming.split_entry_name(row.target_entry)[1] == naming.PARAMETERS_GRAD
        and naming.module_path_of(row.target_entry) == own)


def _gradient_error(rows: list[Row]) -> float:
    """Relative error of the step's whole gradient: every weight's gradient as one vector."""
    error = size = 0.0
    for row in rows:
        if row.error is not None and row.target_entry is not None and row.norm \
                and naming.split_entry_name(row.target_entry)[1] == naming.PARAMETERS_GRAD:
            error += (_err(row) * row.norm) ** 2
            size += row.norm ** 2
    return math.sqrt(error / size) if size else 0.0


def _single_values(dump: RankDump) -> set[float]:
    """The values of the one-element tensors a run's ops produced: what `.item()` can return."""
    return {leaf.stats[0] for entry in dump.entries for leaf in entry.outputs
            if leaf.numel == 1 and leaf.stats is not None and leaf.stats[0] is not None}


def _number_error(golden: DumpEntry, target: DumpEntry, golden_items: set, target_items: set) -> tuple[float, tuple | None]:
    """The largest relative difference of the Python floats both runs passed to this op, and
    (argument, golden value, target value) when that number is a constant of the program. A number
    each run took out of one of its tensors (`R - value.item()`) carries that tensor's difference,
    judged where the tensor was made: an input error, returned with no location."""
    worst, constant_error, where = 0.0, 0.0, None
    for suffix, value in target.numbers.items():
        other = golden.numbers.get(suffix)
        if other is None or other == value:
            continue
        error = 1.0 if math.isinf(value) or math.isinf(other) else abs(value - other) / max(abs(other), abs(value))
        worst = max(worst, error)
        if (other not in golden_items or value not in target_items) and error > constant_error:
            constant_error, where = error, (suffix, other, value)
    return (constant_error, where) if where is not None else (worst, None)


def _revealed_by_cancellation(outputs: list[Row], inputs: list[Row], lineage: _Lineage,
                              limit: float, slack: float) -> tuple[Row, Row, TensorLeaf] | None:
    """(input row, output row, the input's producing leaf) when the op only revealed an error it was given: its output is far
    smaller than its inputs (a difference of nearly equal values) and carries about the absolute
    error they brought (within `slack` times: statistics dumps measure a tensor's error by its max,
    min, mean and norm, which understate an elementwise error), so a small relative error of the
    input became a large one of the output. The signal was lost where that input was rounded: its
    producer."""
    for out in outputs:
        if _err(out) <= limit or not out.norm or out.target is None:
            continue
        carried = []
        for row in inputs:
            if row.role != "input" or row.error is None or row.target is None or not row.target.numel:
                continue
            if out.target.numel < row.target.numel:
                continue  # a reduction (a sum, a dot product, a 128->1 head) is small by nature, not by cancellation
            broadcast = math.sqrt(out.target.numel / row.target.numel)  # a row of a broadcast input
            carried.append((row.error * row.norm * broadcast, row.norm * broadcast, row))
        if not carried:
            return None
        largest_input = max(size for _, size, _ in carried)
        absolute_in = sum(error for error, _, _ in carried)
        if out.norm < 0.1 * largest_input and out.error * out.norm <= slack * absolute_in:
            updated = _updated_operand([row for _, _, row in carried], lineage)
            _, _, culprit = max(carried, key=lambda item: item[0])
            culprit = updated or culprit
            origin = lineage.origin(culprit.target)
            if origin.suffix.startswith("output"):
                return culprit, out, origin
    return None


_MEAN_SUBTRACTING_NORMS = frozenset({"layer_norm", "group_norm", "batch_norm", "instance_norm"})


def _revealed_by_normalization(entry: DumpEntry, outputs: list[Row], inputs: list[Row], lineage: _Lineage,
                               slack: float) -> tuple[Row, Row, TensorLeaf, float] | None:
    """(input row, output row, the input's producing leaf, offset) when a norm that subtracts the mean
    only revealed an error it was given: its input sits on an offset far larger than its spread (x ~ 3000
    +- 1), so the mean subtraction is a cancellation whose output keeps the input's absolute error at the
    spread's size: relative error times rms/std. The signal was lost where the input was rounded."""
    if entry.base.rpartition(".")[2] not in _MEAN_SUBTRACTING_NORMS or not outputs:
        return None
    data = next((row for row in inputs if row.role == "input" and row.target is not None
                 and row.target.suffix == "input.0"), None)
    stats = data.golden.stats if data is not None and data.golden is not None else None
    if data is None or data.error is None or not stats or None in stats or not data.golden.numel:
        return None
    largest, smallest, mean, norm = stats
    rms = norm / math.sqrt(data.golden.numel)
    # rms^2 - mean^2 loses the spread to the statistics' own rounding when the offset is large: the
    # range bounds it from above (a smaller spread only makes the cancellation worse)
    spread = min(math.sqrt(max(rms * rms - mean * mean, 0.0)), (largest - smallest) / 2)
    condition = rms / spread if spread else math.inf
    out = max(outputs, key=_err)
    if condition < 10 or _err(out) > slack * data.error * condition:
        return None
    origin = lineage.origin(data.target)
    return (data, out, origin, condition) if origin.suffix.startswith("output") else None


def _add_or_sub(entry: DumpEntry) -> bool:
    op = entry.base.rpartition(".")[2].strip("_")
    return op in ("add", "sub", "iadd", "isub", "radd", "rsub")


def _updated_operand(inputs: list[Row], lineage: _Lineage) -> Row | None:
    """The input of `a - b` that is `b` plus an update (`a = b + d`, an add consumed `b`): the error `b`
    carries reaches both operands alike and cancels, so what the difference lost was lost where `d` was
    added (rounded to the larger operand's precision): that add is the producer to name, not `b`'s."""
    origins = {lineage.origin(row.target).name for row in inputs}
    for row in inputs:
        origin = lineage.origin(row.target)
        producer = lineage.entries.get(_entry_of_leaf(origin.name)) if origin.suffix.startswith("output") else None
        if producer is None or not _add_or_sub(producer):
            continue
        if any(lineage.origin(leaf).name in origins - {origin.name} for leaf in producer.inputs):
            return row
    return None


def _lost_update_text(producer: DumpEntry, lineage: _Lineage, shared: set[str]) -> str | None:
    """"adds a value 1e-4x the size of ...": the add's operands by their norms, when both are recorded."""
    norms = {}
    for leaf in producer.inputs:
        if leaf.stats is not None and leaf.stats[3] is not None:
            norms["shared" if lineage.origin(leaf).name in shared else "update"] = leaf.stats[3]
    output = producer.outputs[0] if producer.outputs else None
    if len(norms) != 2 or not norms["shared"] or output is None:
        return None
    return f"it adds {_update_size_text(norms['update'] / norms['shared'], output.dtype)}"


def _update_size_text(ratio: float, dtype: str) -> str:
    """"an update 0.00012x the size of the tensor it updates, below bfloat16's rounding unit (0.0078),
    so most of the update is lost": a lost update's size, as both of its checks word it."""
    eps = _FINFO.get(dtype, {}).get("eps")
    unit = f", below {dtype.removeprefix('torch.')}'s rounding unit ({eps:.2g})" if eps and ratio < eps else ""
    return f"an update {ratio:.2g}x the size of the tensor it updates{unit}, so most of the update is lost"


# The share of the golden run's change of a weight the target's change keeps (its projection on it)
# below which an in-place update of the weight lost it: most of the update is gone, not changed (a
# correct mixed-precision run's gradients a few percent apart keep ~100%; AdamW's first update moves
# each weight by about lr either way, so a bf16 sign flip in 5% of them keeps 90%).
_LOST_UPDATE_KEPT = 0.5


def _in_place(entry: DumpEntry) -> bool:
    """`Tensor.add_`, `Tensor.__isub__`: the op writes its first input (read back from its name)."""
    return entry.direction == naming.FORWARD and naming.in_place_api(entry.base)


def _change_figures(golden_in: TensorLeaf, golden_out: TensorLeaf, target_in: TensorLeaf,
                    target_out: TensorLeaf) -> tuple[float, float, float, float] | None:
    """(|golden change|^2, |golden input|^2, target change . golden change, |change difference|^2) of
    an in-place op, in fp64 over chunks of the four tensor files (never read whole); None when a value
    is not finite."""
    arrays = [as_real_elements(read_tensor(leaf.data_path, leaf.dtype, list(leaf.shape)))
              for leaf in (golden_in, golden_out, target_in, target_out)]
    converters = [float64_converter(leaf.dtype) for leaf in (golden_in, golden_out, target_in, target_out)]
    sums = np.zeros(4)
    buffers = [np.empty(CHUNK) for _ in arrays]
    for low in range(0, arrays[0].size, CHUNK):
        high = min(arrays[0].size, low + CHUNK)
        gi, go, ti, to = (buffer[:high - low] for buffer in buffers)
        for convert, array, buffer in zip(converters, arrays, (gi, go, ti, to)):
            convert(array[low:high], buffer)
        golden_change = go - gi
        target_change = to - ti
        sums += (golden_change @ golden_change, gi @ gi, target_change @ golden_change,
                 np.square(target_change - golden_change).sum())
    return tuple(float(value) for value in sums) if np.isfinite(sums).all() else None


def _lost_in_place_update(pair_label, golden_entry: DumpEntry, target_entry: DumpEntry, entry_rows: list[Row],
                          target: RankDump, lineage: _Lineage, out_err: float) -> Divergence | None:
    """An in-place update of a parameter (the optimizer's `param.add_(grad, alpha=-lr)`, an element of a
    foreach optimizer's `torch._foreach_add_`, a script's `p -= lr * p.grad`) that lost most of the golden run's change: a weight kept in bf16 whose update
    is below half its rounding unit writes the weight back unchanged. What it writes is the weight,
    whose relative error (the update's size, 1e-4) is far within tolerance: the change it makes
    (output - input) is compared instead, from tensor dumps. Only where the target keeps the weight
    in a coarser dtype than the golden run (two runs that both keep it in bf16 round its update alike,
    and a weight both keep in fp32 loses nothing to its rounding)."""
    if not _in_place(target_entry):
        return None
    rows = {row.target.suffix: row for row in entry_rows
            if row.target is not None and row.golden is not None and row.target.suffix in ("input.0", "output.0")}
    if len(rows) != 2:
        return None
    leaves = (rows["input.0"].golden, rows["output.0"].golden, rows["input.0"].target, rows["output.0"].target)
    if not rows["input.0"].target.requires_grad or any(
            leaf.data_path is None or leaf.uninitialized or leaf.dtype not in _FINFO or leaf.shape != leaves[0].shape
            for leaf in leaves):
        return None
    dtype = leaves[3].dtype
    if _FINFO[dtype]["eps"] <= _FINFO[leaves[1].dtype]["eps"]:
        return None
    figures = _change_figures(*leaves)
    if figures is None:
        return None
    golden_change, golden_size, along, apart = figures
    if not golden_change or not golden_size or along / golden_change >= _LOST_UPDATE_KEPT:
        return None
    origin = lineage.origin(rows["input.0"].target)
    used_by = lineage.entries.get(_entry_of_leaf(origin.name)) if origin is not rows["input.0"].target else None
    module = entry_module_path(used_by, target) if used_by is not None else None
    weight = "the parameter" if used_by is None else \
        f"the parameter ({origin.suffix} of {used_by.name}{f' in {module}' if module else ''})"
    reason = (f"it makes {_update_size_text(math.sqrt(golden_change / golden_size), dtype)}: {weight} is kept in"
              f" {dtype.removeprefix('torch.')}, and the change this op makes to it keeps"
              f" {max(along / golden_change, 0.0):.0%} of the golden run's (the change's relative error"
              f" {_fmt(math.sqrt(apart / golden_change))}; the weight it writes: relative error {_fmt(out_err)}, all"
              f" the compare of the weight alone sees). Keep these weights in fp32 (an fp32 master copy the optimizer"
              f" updates, cast to {dtype.removeprefix('torch.')} for the forward), or compute the update on fp32 copies")
    divergence = _make_divergence(pair_label, target_entry, golden_entry, reason, target, 0.0, out_err)
    divergence.module_path = module or divergence.module_path  # the weight's module, not the optimizer's "(root)"
    divergence.kind = "lost-update"
    return divergence


def _cancellation_divergence(pair_label, revealed, consumer, dump, lineage: _Lineage, out_err,
                             hf32: frozenset) -> Divergence:
    input_row, output_row, origin, *offset = revealed
    producer = dump.by_name()[_entry_of_leaf(origin.name)]
    shared = {lineage.origin(leaf).name for leaf in consumer.inputs} - {origin.name}
    lost_update = _lost_update_text(producer, lineage, shared) if _add_or_sub(producer) else None
    if lost_update is not None:
        reason = (f"{lost_update}: {consumer.name} reads the update back as a difference and its relative error "
                  f"becomes {_fmt(out_err)}. Keep the tensor and its update in fp32 (an fp32 master copy), or "
                  f"use the update itself instead of the difference")
    else:
        if _entry_class(producer, hf32) == "hf32":
            switch = f"torch.npu.{'conv' if hf32_kind(producer.name) == 'conv' else 'matmul'}.allow_hf32"
            remedy = f"HF32 rounds this op's inputs to 10 mantissa bits: set {switch} = False around it"
        else:
            remedy = "Compute this op and the cancellation in fp32"
        if offset:
            how = (f"{consumer.name} subtracts its mean, and this input sits on an offset {offset[0]:.3g}x "
                   f"its spread")
        else:
            how = (f"{consumer.name} subtracts nearly equal values (its output is "
                   f"{output_row.norm / input_row.norm:.2g}x the size of this input)")
        reason = (f"its output (relative error {_fmt(input_row.error)}) loses the signal it carries: {how} "
                  f"and its relative error becomes {_fmt(out_err)}. {remedy}, or remove the large common offset")
    return Divergence(
        pair=pair_label,
        entry=producer.name,
        golden_entry=None,
        reason=reason,
        module_path=entry_module_path(producer, dump),
        stack=entry_stack(producer, dump),
        input_error=0.0,
        output_error=out_err,
    )


def _input_kind(row, entry, target_lineage, golden_lineage, only_target, only_golden, leaf_error, warn,
                has_producers) -> tuple[str, str | None]:
    """How an input relates to the rest of the dump: ("source" | "explained" | "target-only" |
    "golden-only" | "between" | "parent-code" | "unknown", culprit entry name)."""
    if row.role == "param":
        return "source", None
    if entry.direction == naming.BACKWARD:
        return "gradient", None  # incoming gradients carry no lineage: judged by execution order
    if not has_producers:
        return "unknown", None
    origin = target_lineage.origin(row.target)
    origin_entry = _entry_of_leaf(origin.name)
    if origin.suffix.startswith("output"):
        if origin_entry in only_target:
            return "target-only", origin_entry
        if row.golden is not None:
            golden_origin = golden_lineage.origin(row.golden)
            golden_entry = _entry_of_leaf(golden_origin.name)
            if golden_origin.suffix.startswith("output") and golden_entry in only_golden:
                return "golden-only", golden_entry
        produced = leaf_error.get(origin.name)
        if produced is not None and produced <= warn and _err(row) > 10 * max(produced, 1e-12):
            return "between", entry.name
        return "explained", origin_entry
    # Not produced by a dumped op. A module's input computed by its parent's own code (module-level
    # dumps do not see that code) blames the parent; anything else is data or a weight: a source.
    holder = target_lineage.entries.get(origin_entry)
    if holder is not None and holder.name.startswith("Module.") and holder.parent:
        return "parent-code", holder.parent
    return "source", None


def _run_class(dump: RankDump, hf32: frozenset = frozenset()) -> str:
    """Lowest float precision used anywhere in the run: ops downstream of bf16 inherit its noise."""
    best = "fp32"
    for entry in dump.entries:
        best = _weakest(best, _entry_class(entry, hf32))
    return best


def _weakest(a: str, b: str) -> str:
    return a if _PRECISION[a] <= _PRECISION[b] else b


def _first_error_here(rows: list[Row], order: int, warn: float) -> bool:
    """No earlier matched output was above the warn limit: the error appears first at `order`."""
    return not any(row.order < order and row.role == "output" and _err(row) > warn for row in rows)


def _entry_of_leaf(leaf_name: str) -> str:
    for marker in (".input.", ".output.", ".parameters."):
        index = leaf_name.rfind(marker)
        if index >= 0:
            return leaf_name[:index]
    return leaf_name.rpartition(".")[0] if ".parameters_grad." in leaf_name else leaf_name


def _divergence(pair_label, found, golden, target, out_err) -> Divergence:
    name, side, row = found[:3]
    consumer = row.target_entry
    dump = target
    if side == "target-only":
        reason = f"call present only in the target; its output feeds {consumer} (input error {_fmt(row.error)})"
        if _err(row) == 0:
            reason = f"call present only in the target; it feeds {consumer}, whose output error is {_fmt(out_err)}"
    elif side == "golden-only":
        reason = f"call present only in the golden run (missing in the target); {consumer} input error {_fmt(row.error)}"
        dump = golden
    elif side == "gradient-changed":
        computed, computed_error = found[3]
        reason = (f"the gradient arriving at this backward differs (error {_fmt(row.error)}) from the one"
                  f" {computed} computed for it (error {_fmt(computed_error)}): it was changed between the two,"
                  " outside the dumped ops (a hook on this op's output (Tensor.register_hook), a custom autograd"
                  " Function)")
        if not computed:  # the ops that used the output ran without autograd (a custom Function's forward)
            reason = (f"the gradient arriving at this backward differs (error {_fmt(row.error)}) and no dumped op's"
                      " backward computed it (the ops that used this op's output ran without autograd, as inside a"
                      " custom autograd Function's forward): it was made outside the dumped ops (a custom autograd"
                      " Function's backward, a hook on this op's output (Tensor.register_hook))")
    elif side == "gradient-gap":
        reason = (f"the gradient arriving at this backward differs (error {_fmt(row.error)}) while every"
                  " gradient before it matched: it was changed outside the dumped ops (a custom autograd"
                  " Function, a hook, or a module's own code at module level)")
    elif side == "parent-code":
        reason = (f"the input of {consumer} (error {_fmt(row.error)}) is computed by this module's own forward"
                  " code, outside its dumped sub-modules")
    else:
        reason = (f"input error {_fmt(row.error)} is not explained by the op that produced it:"
                  " the value changed outside the dumped ops")
    entry = dump.by_name().get(name)
    return Divergence(
        pair=pair_label,
        entry=name,
        golden_entry=name if side == "golden-only" else None,
        reason=reason,
        outside=side not in ("target-only", "golden-only", "parent-code"),
        module_path=entry_module_path(entry, dump) if entry else None,
        stack=entry_stack(entry, dump) if entry else [],
        input_error=0.0,
        output_error=out_err,
        side=side if side in ("target-only", "golden-only") else "both",
    )


def _make_divergence(pair_label, target_entry, golden_entry, reason, target, in_err, out_err,
                     outside: bool = False) -> Divergence:
    return Divergence(
        pair=pair_label,
        entry=target_entry.name,
        golden_entry=golden_entry.name,
        reason=reason,
        outside=outside,
        module_path=entry_module_path(target_entry, target),
        stack=entry_stack(target_entry, target),
        input_error=in_err,
        output_error=out_err,
    )


def _forward_name(entry: DumpEntry) -> str:
    return _forward_of(entry.name) if entry.direction == naming.BACKWARD else entry.name


def _forward_of(backward_name: str) -> str:
    return naming.with_direction(backward_name, naming.FORWARD)


def entry_module_path(entry: DumpEntry, dump: RankDump) -> str | None:
    own = naming.module_path_of(entry.name)
    if own is not None:
        return own or "(root)"
    forward = dump.by_name().get(_forward_name(entry), entry)
    parent = forward.parent
    if parent is None:
        return None
    path = naming.module_path_of(parent)
    return path or "(root)"


def entry_stack(entry: DumpEntry, dump: RankDump) -> list[str]:
    if entry.stack:
        return entry.stack
    forward = dump.by_name().get(_forward_name(entry))
    return forward.stack if forward is not None else []


def _fmt(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.3g}"


def _amplification_text(out_err: float, in_err: float) -> str:
    if in_err <= 0:
        return f"output error {_fmt(out_err)} while its inputs match exactly"
    return f"output error {_fmt(out_err)} is {out_err / in_err:.3g}x its input error {_fmt(in_err)}"


# ---------------------------------------------------------------------------- loss scaling
def detect_loss_scale(pairs: list) -> float:
    """The factor by which the target's backward is scaled relative to the golden run's, if that
    is a power of two (a GradScaler's loss scale): read off the incoming gradient of the first
    paired backward op, which is the gradient of the loss. 1.0 when the runs are not scaled
    differently."""
    for golden, target in pairs:
        if golden is None or target is None or target.direction != naming.BACKWARD:
            continue
        for g_leaf, t_leaf in zip(golden.inputs, target.inputs):
            if g_leaf.stats is None or t_leaf.stats is None:
                continue
            g_norm, t_norm = g_leaf.stats[3], t_leaf.stats[3]
            if not (g_norm and t_norm and math.isfinite(g_norm) and math.isfinite(t_norm)):
                continue
            exponent = math.log2(t_norm / g_norm)
            rounded = round(exponent)
            # bf16/fp16 rounding of the seed gradient stays far below 1% of a factor of two.
            if rounded != 0 and abs(exponent - rounded) < 0.01:
                return 2.0 ** rounded
            return 1.0
        return 1.0
    return 1.0


def _is_backward(entry_name: str | None) -> bool:
    return entry_name is not None and naming.split_entry_name(entry_name)[1] == naming.BACKWARD


def _step_and_rank(label: str) -> tuple[int | None, str]:
    """"step3/rank0" -> (3, "rank0"); a dump without step folders has no step number."""
    first, _, rest = label.partition("/")
    if first.startswith("step") and first[4:].isdigit():
        return int(first[4:]), rest
    return None, label


def _skipped_side(golden: RankDump, target: RankDump) -> str | None:
    sides = [side for side, dump in (("golden", golden), ("target", target)) if dump.skipped_at_loss_scale is not None]
    return "both" if len(sides) == 2 else (sides[0] if sides else None)


def _accept_loss_scaling_overflows(rows: list[Row]) -> None:
    """Non-finite gradients of a step GradScaler skipped are what loss scaling expects: no update
    used them. They stay visible, as warnings."""
    for row in rows:
        entry = row.target_entry or row.golden_entry
        if row.verdict == ERROR and row.error == math.inf and naming.split_entry_name(entry)[1] in (
                naming.BACKWARD, naming.PARAMETERS_GRAD):
            row.verdict = WARN
            row.message = f"{row.message}; overflow under loss scaling: GradScaler skipped this step's update"


def _require_compared_data(rows, golden_entries: int, target_entries: int, golden_dir, target_dir) -> None:
    """A verdict needs compared data: no paired tensor with values, statistics or checksums on
    both sides is an error that says why, never "no divergence". `*_entries`: how many entries the
    compared dumps of each side hold."""
    compared = [row for row in rows if row.verdict != UNMATCHED and (
        row.metrics is not None or row.stat_diffs is not None or row.error is not None)]
    if compared:
        return
    if not golden_entries or not target_entries:
        empty = golden_dir if not golden_entries else target_dir
        why = f"{empty} holds no dumped entries (its dump.json \"data\" is empty)"
    elif not any(row.verdict != UNMATCHED for row in rows):
        why = (f"none of the target's {target_entries} entries has a counterpart among the golden run's"
               f" {golden_entries} (different models, levels or scopes?)")
    else:
        why = "the paired entries hold no tensor values, statistics or checksums on both sides"
    raise UserError(f"nothing to compare between {golden_dir} and {target_dir}: {why}")


def _written_argument_rows(rows: list[Row], pairs: list) -> list[Row]:
    """The rows of a cross-tool pair that the two tools measure at different moments: the arguments
    an op writes in place (_written_by_call), which msprobe measures before the call and npukit
    after it (as its results)."""
    paired = {target.name: target for golden, target in pairs if golden is not None and target is not None}
    return [row for row in rows if row.role == "input" and row.target is not None and row.target_entry in paired
            and row.target.suffix in _written_by_call(paired[row.target_entry])]


def pairing_coverage(pairs: list, golden_entries: list, target_entries: list,
                     skipped: str | None = None) -> PairingCoverage:
    """How much of each side paired and, when less than most of a side did, what stopped it: one
    dump ending early (the other's later entries have no counterpart), else the kinds of entry
    only one side has. Where GradScaler skipped one side's step (`skipped`), the other side's
    optimizer update entries have no counterpart by design: no update ran there. They are not
    counted (they made a small model's fp16 overflow read "too little paired", and the fix finder
    then tried nothing)."""
    paired = sum(1 for golden, target in pairs if golden is not None and target is not None)
    totals = [len(golden_entries), len(target_entries)]
    if skipped in ("golden", "target"):
        ran = 0 if skipped == "target" else 1
        totals[ran] -= sum(1 for pair in pairs if pair[1 - ran] is None and pair[ran] is not None
                           and pair[ran].parent == OPTIMIZER)
    coverage = PairingCoverage(paired, totals[0], paired, totals[1])
    if not coverage.too_little():
        return coverage
    # Parameter gradients pair by module after the rest (see align): the stream is the other entries.
    stream = [(g, t) for g, t in pairs if (g or t).direction != naming.PARAMETERS_GRAD]
    last = max((index for index, (g, t) in enumerate(stream) if g is not None and t is not None), default=-1)
    tail = stream[last + 1:]
    for side, other, index in (("target", "golden", 1), ("golden", "target", 0)):
        if tail and all(pair[index] is None for pair in tail):
            after = f" after {stream[last][index].name}" if last >= 0 else ""
            first = tail[0][1 - index].name
            coverage.stopped = (f"the {side}'s dump ends early: nothing of it pairs with the {other}'s {len(tail)}"
                                f" entries from {first} on (its dump recorded nothing{after})")
            return coverage
    kinds = []
    for side, index in (("golden", 0), ("target", 1)):
        counts: dict[tuple[bool, str], int] = {}  # (an optimizer's update op, key) -> count
        for pair in pairs:
            entry = pair[index]
            if pair[1 - index] is None and entry is not None:
                kind = (entry.parent == OPTIMIZER, entry.key)
                counts[kind] = counts.get(kind, 0) + 1
        # the model's entries first: an optimizer's update ops (one per parameter) say less of why
        common = sorted(counts.items(), key=lambda item: (item[0][0], -item[1]))[:4]
        if common:
            more = len(counts) - len(common)
            kinds.append(f"only in the {side}: " + ", ".join(f"{name} x{count}" for (_, name), count in common)
                         + (f" and {more} more kinds" if more > 0 else ""))
    coverage.stopped = "; ".join(kinds) + " (different models, dump levels, scopes or op lists?)"
    return coverage


def _comparable_entries(golden: RankDump, target: RankDump) -> tuple[list, list, str | None]:
    """The entries of a pair that mean the same in both dumps. Dumps of one tool: all of them. An
    msprobe dump against an npukit one: forward api entries of the apis both tools record, module
    entries (both record a module's backward as a full backward hook gives it) and parameter
    gradients. An api's backward is left out: msprobe records the gradients of the op's last
    autograd node, npukit the op's gradient for each of its arguments."""
    if golden.by_npukit == target.by_npukit:
        return golden.entries, target.entries, None
    # apis (Tensor.flatten: npukit only; an optimizer's Tensor.add_: msprobe only) and modules (the
    # root module: npukit only) one tool records and the other never does
    keys = [{entry.key for entry in dump.entries} for dump in (golden, target)]
    shared = keys[0] & keys[1]
    kept, backward, one_tool = [], 0, set()
    for entries in (golden.entries, target.entries):
        keep = []
        for entry in entries:
            if entry.direction == naming.BACKWARD and not entry.name.startswith("Module."):
                backward += 1
            elif entry.key in shared:
                keep.append(entry)
            else:
                one_tool.add(entry.base)
        kept.append(keep)
    writers = ("npukit" if golden.by_npukit else "msprobe", "npukit" if target.by_npukit else "msprobe")
    note = (f"golden dumped by {writers[0]}, target by {writers[1]}: forward, module and parameter-gradient"
            f" entries compared; {backward} api backward entries left out (msprobe records the gradients of"
            " an op's last autograd node, npukit the op's gradient for each argument)")
    if one_tool:
        note += f"; what only one tool records left out: {', '.join(sorted(one_tool))}"
    return kept[0], kept[1], note


def _process_labels(dumps: dict) -> dict[str, str]:
    """Pairing key -> label. A run without torch.distributed is rank 0: msprobe names its folder
    proc<pid> (a new name every run), npukit rank0; when a side has one process per step, both are
    rank0 for pairing."""
    keys = {label: re.sub(r"(^|/)(proc\d+|rank)$", r"\1rank0", label) for label in dumps}
    if len(set(keys.values())) < len(keys):  # several processes per step: their own names
        keys = {label: label for label in dumps}
    return {key: label for label, key in keys.items()}


# ---------------------------------------------------------------------------- entry point
@dataclass(frozen=True)
class _PairTask:
    """One golden step/rank folder and the target's folder it is compared with."""

    golden_root: Path  # the folders the user named: nothing is read from outside them
    golden_label: str
    golden_path: Path
    target_root: Path
    target_label: str
    target_path: Path


def _contained(root: Path) -> ContainedPaths:
    return ContainedPaths(root if root.is_dir() else root.parent)


def compare_pair(task: _PairTask, thresholds: Thresholds, workers: int | None = None,
                 progress=None) -> tuple[PairResult, int, int]:
    """Load, pair, measure, judge and search one step/rank pair: (its result, the golden and the
    target dump's entry counts). Needs nothing from the other pairs, so pairs run in parallel."""
    golden = load_rank_dump(task.golden_path, task.golden_label, _contained(task.golden_root))
    target = load_rank_dump(task.target_path, task.target_label, _contained(task.target_root))
    golden_entries, target_entries, cross_tool = _comparable_entries(golden, target)
    pairs, aligned = align(golden_entries, target_entries)
    label = task.target_label or task.golden_label or "."
    hf32 = golden.hf32 ^ target.hf32  # an op kind both runs computed in HF32 is compared like for like
    rows = build_rows(label, pairs, hf32)
    if cross_tool:
        written = _written_argument_rows(rows, pairs)
        if written:
            left_out = {id(row) for row in written}
            rows = [row for row in rows if id(row) not in left_out]
            cross_tool += (f"; {len(written)} arguments an op writes in place left out (a batch norm's running"
                           " statistics: msprobe measures an op's arguments before the call, npukit these after it)")
    run_class = _run_class(target, hf32)
    loss_scale = detect_loss_scale(pairs)
    for row in rows:
        row.dtype_class = _weakest(row.dtype_class, run_class)
        if loss_scale != 1.0 and _is_backward(row.target_entry):
            row.target_scale = 1.0 / loss_scale
    measure_rows(rows, workers, progress)
    judge_rows(rows, thresholds)
    skipped = _skipped_side(golden, target)
    if skipped:
        _accept_loss_scaling_overflows(rows)
    changed_shares: list[Divergence] = []
    result = PairResult(
        pair=label,
        golden_pair=golden.label or label,
        golden_dir=golden.path,
        target_dir=target.path,
        mode=target.task or golden.task,
        rows=rows,
        divergence=find_divergence(label, pairs, rows, golden, target, thresholds, search_backward=not skipped,
                                   changed_shares=changed_shares),
        unmatched_golden=[g.name for g, t in pairs if t is None],
        unmatched_target=[t.name for g, t in pairs if g is None],
        aligned=aligned,
        loss_scale=loss_scale,
        golden_low_precision=_first_low_precision_matmul(golden),
        skipped_by_grad_scaler=skipped,
        cross_tool=cross_tool,
        noop_casts=sorted(noop_cast_backwards(pairs)),
        coverage=pairing_coverage(pairs, golden_entries, target_entries, skipped),
        golden_incomplete=golden.incomplete,
        target_incomplete=target.incomplete,
    )
    result.changed_share = changed_shares[0] if changed_shares else None
    return result, len(golden.entries), len(target.entries)


def _has_pt_files(tasks: list[_PairTask]) -> bool:
    """Whether a rank folder holds .pt tensor files (msprobe's): torch opens them, so they are
    compared in this process, never in a forked one."""
    for task in tasks:
        for folder in (task.golden_path, task.target_path):
            try:
                with os.scandir(folder / TENSOR_DATA_DIR) as listing:
                    if any(item.name.endswith(".pt") for item in listing):
                        return True
            except OSError:
                continue
    return False


def compare_pair_tasks(tasks: list[_PairTask], thresholds: Thresholds, workers: int | None = None,
                       progress=None, pair_progress=None) -> list[tuple[PairResult, int, int]]:
    """compare_pair for every task, in order. Several pairs (the ranks of a multi-rank run) go to a
    process pool, one pair per process at a time: at most `workers` pairs are loaded at once.
    progress(elements): tensor elements measured (in this process only); pair_progress(done, total)."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if pair_progress:
        pair_progress(0, len(tasks))
    outcomes: list = [None] * len(tasks)
    if len(tasks) < 2 or workers < 2 or _has_pt_files(tasks):
        for index, task in enumerate(tasks):
            outcomes[index] = compare_pair(task, thresholds, workers, progress)
            if pair_progress:
                pair_progress(index + 1, len(tasks))
        return outcomes
    processes = min(workers, len(tasks))
    inner = max(1, workers // len(tasks))  # fewer pairs than workers: the rest measure tensors
    waiting = iter(enumerate(tasks))
    running: dict = {}
    collecting = gc.isenabled()
    # A result is a pair's rows: tens of thousands of objects and no reference cycle. The collector,
    # triggered by their allocations, would scan every pair received before (measured: 40% of the
    # time, 4 ranks x 6000 rows).
    gc.disable()
    try:
        with ProcessPoolExecutor(max_workers=processes, mp_context=_pool_context()) as pool:
            def submit() -> None:
                for index, task in waiting:
                    running[pool.submit(_compare_pair_without_gc, task, thresholds, inner)] = index
                    return

            for _ in range(processes):
                submit()
            done_count = 0
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    outcomes[running.pop(future)] = future.result()
                    done_count += 1
                    if pair_progress:
                        pair_progress(done_count, len(tasks))
                    submit()
    finally:
        if collecting:
            gc.enable()
    return outcomes


def _changed_before_the_reduce(results: list[PairResult]) -> None:
    """A step where no rank diverged and on every rank the same parameter's gradient, as the optimizer
    got it, differs from what that rank's backward computed for it (which matched the golden run's):
    the gradients the ranks reduce (DDP's all_reduce averages them) were changed between some rank's
    backward and the reduction. Named on every rank, as the dumps hold only the reduced gradient."""
    by_step: dict[int | None, list[PairResult]] = {}
    for pair in results:
        by_step.setdefault(_step_and_rank(pair.pair)[0], []).append(pair)
    for pairs in by_step.values():
        shares = [pair.changed_share for pair in pairs]
        if len(pairs) < 2 or any(pair.divergence for pair in pairs) or None in shares \
                or len({share.entry for share in shares}) != 1:
            continue
        # A hook's Python is dumped where it runs: the ranks that alone ran apis the golden run did not,
        # in the backward before the gradient they changed, are where it was changed
        extra = [_target_only_calls_in_backward(pair, share.entry) for pair, share in zip(pairs, shares)]
        if any(extra) and not all(extra):
            for pair, share, calls in zip(pairs, shares, extra):
                if calls:
                    share.reason += (
                        f", on every one of the {len(pairs)} ranks, while each rank's backward computed its share as"
                        f" the golden run did; this rank alone ran {', '.join(calls[:3])} (not in the golden run) in"
                        " its backward before this gradient: its share was changed there (a hook on the parameter"
                        " (register_hook) or code that runs on this rank only), and the reduction carried the change"
                        " to every rank")
                    pair.divergence = share
            continue
        for pair, share in zip(pairs, shares):
            share.reason += (
                f", on every one of the {len(pairs)} ranks, while each rank's backward computed its share as the"
                " golden run did: a rank's share was changed between its backward and the gradient reduction"
                " (a hook on the parameter (register_hook) or code that runs on some ranks only, a DDP"
                " communication hook), or the reduction itself differs. The dumps hold the reduced gradient, the"
                " same on every rank, so they cannot say which rank")
            pair.divergence = share


def _target_only_calls_in_backward(pair: PairResult, before_entry: str) -> list[str]:
    """The apis this pair's target ran and its golden run did not, after its first backward entry and
    before `before_entry`'s first row, in order."""
    started, calls = False, []
    for row in sorted(pair.rows, key=lambda row: row.order):
        entry = row.target_entry or row.golden_entry
        if entry == before_entry:
            break
        direction = naming.split_entry_name(entry)[1]
        started = started or direction == naming.BACKWARD
        if started and row.golden_entry is None and direction == naming.FORWARD and not entry.startswith("Module.") \
                and entry not in calls:
            calls.append(entry)
    return calls


def _compare_pair_without_gc(task: _PairTask, thresholds: Thresholds, workers: int) -> tuple[PairResult, int, int]:
    """compare_pair in a pool process; the objects it makes hold no reference cycle to collect."""
    gc.disable()
    try:
        return compare_pair(task, thresholds, workers)
    finally:
        gc.enable()


def compare_dirs(golden_dir: Path, target_dir: Path, thresholds: Thresholds | None = None,
                 workers: int | None = None, progress=None, pair_progress=None) -> CompareResult:
    """Every step/rank present on both sides, compared; with several ranks, where the divergence
    began across them (CompareResult.across_ranks). progress(elements) and pair_progress(done,
    total) report advancement (see compare_pair_tasks)."""
    from npukit.accuracy.ranks import first_divergence_across_ranks

    thresholds = thresholds or Thresholds()
    golden_dir, target_dir = Path(golden_dir), Path(target_dir)
    golden_dumps = find_rank_dirs(golden_dir)
    target_dumps = find_rank_dirs(target_dir)
    golden_keys, target_keys = _process_labels(golden_dumps), _process_labels(target_dumps)
    labels_pairs = [(golden_keys[key], label) for key, label in target_keys.items() if key in golden_keys]
    if not labels_pairs:
        if len(golden_dumps) == 1 and len(target_dumps) == 1:
            labels_pairs = [(next(iter(golden_dumps)), next(iter(target_dumps)))]
        else:
            raise UserError(
                f"{target_dir}: no step/rank in common with {golden_dir} "
                f"(golden has {', '.join(golden_dumps) or 'none'}; target has {', '.join(target_dumps) or 'none'})"
            )
    tasks = [_PairTask(golden_dir, golden_label, golden_dumps[golden_label], target_dir, target_label,
                       target_dumps[target_label]) for golden_label, target_label in labels_pairs]
    outcomes = compare_pair_tasks(tasks, thresholds, workers, progress, pair_progress)
    results = [result for result, _, _ in outcomes]
    _require_compared_data([row for result in results for row in result.rows],
                           sum(golden for _, golden, _ in outcomes), sum(target for _, _, target in outcomes),
                           golden_dir, target_dir)
    one_sided_skips = {}  # rank -> (step, side) of its first step GradScaler skipped in one run only
    for pair in results:
        step, rank = _step_and_rank(pair.pair)
        side = pair.skipped_by_grad_scaler
        if side in ("golden", "target") and step is not None and rank not in one_sided_skips:
            one_sided_skips[rank] = (step, side)
    for pair in results:
        step, rank = _step_and_rank(pair.pair)
        earlier = one_sided_skips.get(rank)
        if step is not None and earlier and earlier[0] < step:
            # One run updated its weights at that step and the other did not: from then on they
            # train different models, and the first op that shows it is not a divergence.
            pair.divergence = None
            pair.unsearched = (f"not searched for a divergence: GradScaler skipped step {earlier[0]} in the"
                               f" {earlier[1]} only, so the two runs train from different weights after it. Compare"
                               f" the steps up to {earlier[0]}, or start GradScaler at a scale the target does not"
                               " overflow at (init_scale=...) so that both runs update at every step")
    from npukit.accuracy.own_error import split_backward_errors

    for pair in results:  # a backward-first divergence: each suspect op's own error, re-run (in this process)
        split_backward_errors(pair, thresholds, _contained(golden_dir), _contained(target_dir))
    _changed_before_the_reduce(results)
    paired_golden = {g for g, _ in labels_pairs}
    paired_target = {t for _, t in labels_pairs}
    result = CompareResult(golden_dir, target_dir, results, thresholds,
                           [label for label in golden_dumps if label not in paired_golden],
                           [label for label in target_dumps if label not in paired_target])
    result.across_ranks = first_divergence_across_ranks(result)
    return result
