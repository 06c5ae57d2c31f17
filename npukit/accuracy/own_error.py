"""A backward-first divergence split into each backward op's own error and the error it inherited.

When a tensor-dump compare finds the forward equal and its first divergence in the backward ("forward
loss within 1% of the GPU's, the first layer's gradients 50% off"), the error of a gradient is what
its op made plus what the gradients and forward values it was given already carried. The search
judges that from the dumped errors alone (an op's error against its inputs'), which cannot tell the
two apart: the op it names may only pass on an error an op before it made, or a small, saturated
result (a softmax's over large logits) hides an op's error below its neighbours'.

So each suspect backward op -- the api backward entries from the loss to the first gradient over
its limits, the nearest MAX_SUSPECTS of them -- is re-run on the NPU in the target run's dtypes and
HF32 setting, on the GOLDEN run's inputs and incoming gradients (precheck.npu_gradients_from): its
result against fp64 on the same values is its own error -- the incoming gradients taken as the
target held them, rounded to its dtype by the op before (whose own error that rounding is: an fp16
gradient that underflows is its maker's), the forward values as the golden run had them (an op whose
gradient the rounding of its forward values throws off, a saturated softmax, makes that error
itself); the error of what it received in the target run is the error it inherited. The op with the
largest own error above its dtype's warn limit is named, with both figures (the search's divergence
moves to it, or gets the figures when it is that op; where the search named none, only an
error-sized own error is). When no op's own error is above its limit, the error was made between the dumped ops
(a custom autograd Function, a hook): the divergence the search named stays, and says so with the
figures. Error rows the search named nothing for are left alone: a correct mixed-precision run has
them, and an op's own error there is its dtype's (a bf16 group norm's backward: 9%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from npukit.accuracy import naming
from npukit.accuracy.compare import (
    ERROR,
    Divergence,
    PairResult,
    Row,
    Thresholds,
    entry_module_path,
    entry_stack,
    judge_carried_gradient,
)
from npukit.accuracy.dumpfile import RankDump, load_rank_dump
from npukit.accuracy.metrics import chunk_partial, finish
from npukit.files import ContainedPaths, load_json

# The backward ops re-run per step/rank pair: the nearest ones before the first diverging gradient.
MAX_SUSPECTS = 24
_GRADIENT_DIRECTIONS = (naming.BACKWARD, naming.PARAMETERS_GRAD)


@dataclass
class OwnError:
    entry: str  # the backward entry (Tensor.softmax.0.backward)
    argument: str  # its gradient with the largest own error ("input.0": the gradient for that argument)
    own: float  # relative L2 of that gradient re-run on the golden inputs, against its fp64 reference
    inherited: float  # the largest error of what it received in the target run (gradients, forward values)
    total: float  # that gradient's error in the target run
    limit: float  # the warn limit of the gradient's dtype


def _direction(entry_name: str | None) -> str | None:
    return naming.split_entry_name(entry_name)[1] if entry_name else None


def backward_first(pair: PairResult) -> tuple[int, str] | None:
    """(order, target entry) of the first gradient over its limits, when the forward is equal and the
    divergence the search named, if any, is in the backward: a tensor dump of one tool, searched."""
    divergence = pair.divergence
    if pair.mode != "tensor" or pair.cross_tool or pair.unsearched or pair.skipped_by_grad_scaler:
        return None
    if divergence is not None and _direction(divergence.entry) not in _GRADIENT_DIRECTIONS:
        return None
    rows = [row for row in pair.rows if row.target_entry is not None]
    start = min((row.order for row in rows if _direction(row.target_entry) in _GRADIENT_DIRECTIONS), default=None)
    if start is None or any(row.verdict == ERROR for row in rows if row.order < start):
        return None
    first = min(((row.order, row.target_entry) for row in rows if row.order >= start and row.verdict == ERROR
                 and _direction(row.target_entry) in _GRADIENT_DIRECTIONS), default=None)
    named = min((row.order for row in rows if divergence is not None and row.target_entry == divergence.entry),
                default=None)
    if named is not None and (first is None or named < first[0]):
        first = (named, divergence.entry)
    return first


def _rel_l2(measured, golden) -> float | None:
    golden_array = golden.double().numpy().reshape(-1)
    measured_array = measured.double().numpy().reshape(-1)
    if golden_array.size != measured_array.size or not np.isfinite(golden_array).all() or not golden_array.any():
        return None  # a reference of zeros (or inf) gives a relative error no meaning
    return finish(chunk_partial(golden_array.copy(), measured_array.copy(), None), False).rel_l2


def _errors(rows: list[Row]) -> float:
    return max((0.0 if row.negligible else row.error for row in rows if row.error is not None), default=0.0)


def measure_own_errors(pair: PairResult, golden: RankDump, target: RankDump, golden_data: dict, last: int,
                       thresholds: Thresholds) -> tuple[list[OwnError], int, int]:
    """(the own error of each suspect backward op that could be re-run, how many could not, how many
    backward ops there are from the loss to `last`: more than MAX_SUSPECTS when the nearest were kept)."""
    from npukit.accuracy.precheck import npu_gradients_from

    rows_of: dict[str, list[Row]] = {}
    for row in pair.rows:
        if row.target_entry is not None:
            rows_of.setdefault(row.target_entry, []).append(row)
    golden_names = {row.target_entry: row.golden_entry for row in pair.rows if row.golden_entry is not None}
    golden_entries, target_entries = golden.by_name(), target.by_name()
    order_of = {row.target_entry: row.order for row in pair.rows if row.target_entry is not None}
    candidates = [entry for entry in target.entries if entry.direction == naming.BACKWARD
                  and not entry.name.startswith("Module.") and entry.name in golden_names
                  and order_of.get(entry.name, math.inf) <= last]
    suspects = candidates[-MAX_SUSPECTS:]
    hf32 = target.hf32 if target.by_npukit else None
    measured, failed = [], 0
    for backward in suspects:
        forward_name = naming.with_direction(backward.name, naming.FORWARD)
        golden_backward = golden_entries.get(golden_names[backward.name])
        golden_forward = golden_entries.get(naming.with_direction(golden_names[backward.name], naming.FORWARD))
        forward = target_entries.get(forward_name)
        if golden_backward is None or golden_forward is None or forward is None:
            failed += 1
            continue
        try:
            grads, references = npu_gradients_from(pair.pair, golden_forward, golden_data.get(golden_forward.name, {}),
                                                   golden_backward, forward, backward, hf32, pair.loss_scale)
        except Exception:  # noqa: BLE001  (an op that cannot be re-run is counted, never judged)
            failed += 1
            continue
        outputs = {row.target.suffix: row for row in rows_of.get(backward.name, [])
                   if row.role == "output" and row.target is not None}
        best = None
        for index, (grad, truth) in enumerate(zip(grads, references)):
            row = outputs.get(f"output.{index}")
            if grad is None or truth is None or row is None:
                continue
            if row.negligible and not (index < len(forward.inputs) and forward.inputs[index].producer):
                # noise beside the op's other gradients, and no dumped op's backward takes it further
                # (a bias a batch norm cancels); a small gradient another op receives (a saturated
                # softmax's) carries its error on
                continue
            own = _rel_l2(grad, truth)
            if own is not None and (best is None or own > best[0]):
                best = (own, f"input.{index}", thresholds.limits(row.dtype_class).warn_rel_l2, row.error or 0.0)
        if best is None:
            continue  # re-run, but no gradient of it to judge
        received = [row for row in rows_of.get(backward.name, []) if row.role == "input"]
        received += [row for row in rows_of.get(forward_name, []) if row.role in ("input", "param")]
        measured.append(OwnError(backward.name, best[1], best[0], _errors(received), best[3], best[2]))
    return measured, failed, len(candidates)


def _figures(own: OwnError) -> str:
    return f"own error {own.own:.3g}, inherited {own.inherited:.3g}"


def split_backward_errors(pair: PairResult, thresholds: Thresholds, golden_paths: ContainedPaths,
                          target_paths: ContainedPaths) -> None:
    """Re-run the suspects of a backward-first divergence and name the op with the largest own error
    (pair.divergence replaced or completed); nothing when the pair is not one."""
    first = backward_first(pair)
    if first is None:
        return
    order, first_entry = first
    golden = load_rank_dump(pair.golden_dir, pair.golden_pair, golden_paths)
    target = load_rank_dump(pair.target_dir, pair.pair, target_paths)
    golden_data = load_json(pair.golden_dir / "dump.json").get("data") or {}
    measured, failed, candidates = measure_own_errors(pair, golden, target, golden_data, order, thresholds)
    if not measured:
        return
    ranked = sorted(measured, key=lambda each: each.own, reverse=True)
    worst = ranked[0]
    how = "re-run on the golden run's inputs and incoming gradients in the target's numerics"
    span = "from the loss to the first diverging gradient" if candidates <= MAX_SUSPECTS else (
        f"nearest before the first diverging gradient, of the {candidates} from the loss")
    suspects = f"{len(measured)} backward ops re-run {span}" + (f" ({failed} could not be re-run)" if failed else "")
    first_rows = [row for row in pair.rows if row.target_entry == first_entry and row.error is not None]
    first_error = max((row.error for row in first_rows), default=0.0)
    # Where the search named nothing, error rows are what a correct mixed-precision run can show (a
    # relu's mask flipped, a bf16 group norm's backward 9% off on its own): an op is named for them
    # only when its own error is error-sized (an fp16 gradient that underflows in its scaling).
    limit = worst.limit if pair.divergence is not None else max(worst.limit, thresholds.error_rel_l2)
    if worst.own > limit:
        others = "; ".join(f"{each.entry} {each.own:.3g}" for each in ranked[1:3])
        own_text = (f"{how}, its gradient for {worst.argument} has an own error of {worst.own:.3g} ("
                    f"{'warn' if limit == worst.limit else 'error'} limit {limit:g}) while what it received carried {worst.inherited:.3g} (inherited); in the run that"
                    f" gradient's error is {worst.total:.3g}. The largest own error of the {suspects}"
                    + (f" (next: {others})" if others else ""))
        # its gradient, noise beside the one it received (a saturated softmax's, an underflowed one),
        # is what the next backward receives: the table judges it on its error, as the headline does
        for row in pair.rows:
            if row.target_entry == worst.entry and row.target is not None \
                    and row.target.suffix == worst.argument.replace("input", "output"):
                judge_carried_gradient(row, thresholds)
        if first_entry != worst.entry:
            own_text += f"; the first gradient over its limits is at {first_entry} (error {first_error:.3g})"
        if pair.divergence is not None and pair.divergence.entry == worst.entry:
            pair.divergence.reason = f"{pair.divergence.reason}. {own_text[0].upper()}{own_text[1:]}"
            pair.divergence.input_error, pair.divergence.output_error = worst.inherited, worst.total
            return
        reason = f"this backward makes the error: {own_text}"
        entry = target.by_name()[worst.entry]
        pair.divergence = Divergence(pair=pair.pair, entry=worst.entry,
                                     golden_entry=next((row.golden_entry for row in pair.rows
                                                        if row.target_entry == worst.entry), None),
                                     reason=reason, module_path=entry_module_path(entry, target),
                                     stack=entry_stack(entry, target), input_error=worst.inherited,
                                     output_error=worst.total)
        return
    if pair.divergence is None:
        return  # the error rows carry what the ops inherited
    here = next((each for each in measured if each.entry == pair.divergence.entry), None)
    this = f"; this op: {_figures(here)}" if here is not None else ""
    pair.divergence.reason += (
        f". No dumped op makes it: {how}, the {suspects} each have an own error within their warn limit (largest:"
        f" {worst.entry}, {worst.own:.3g}){this}; the error was made between the dumped ops")
