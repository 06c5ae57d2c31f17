"""npu-compare over the ranks of a multi-rank run: a summary per step/rank, and where a divergence began.

Ranks run the same program on their own data and meet in collectives (DDP's gradient all_reduce,
FSDP's all_gather/reduce_scatter, a broadcast), so a change on one rank reaches the others there.
Each rank's first divergence is found on its own (compare.find_divergence); across the ranks of a
step, the one that diverged earliest in the step is where it began: positions are compared by
phase (forward, then backward, then the parameter gradients and what runs on them after the
backward), then by the op's place in the rank's execution order (ranks run the same ops in the same
order). npukit's dumps record neither time nor collectives per entry: the collective that carried
the change is named from what the other ranks show (their first difference in the parameter
gradients, after DDP's or FSDP's gradient collective) or from a `Distributed.*` entry when the dump
holds one (msprobe dumps its collectives so).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from npukit.accuracy import naming
from npukit.accuracy.compare import (
    ERROR,
    PASS,
    UNMATCHED,
    WARN,
    CompareResult,
    Divergence,
    PairResult,
    _err,
    _step_and_rank,
)
from npukit.console import number_ranges

FORWARD, BACKWARD, AFTER_BACKWARD = 0, 1, 2  # phases of a step, in the order they run
_PHASE_TEXT = {FORWARD: "forward", BACKWARD: "backward", AFTER_BACKWARD: "parameter gradients"}
_RANK = re.compile(r"^rank(\d+)$")
_FSDP = re.compile(r"^Module\.(?:.+\.)?(FullyShardedDataParallel|FSDP\w*)\.(?:forward|backward)\.\d+$")


@dataclass
class RankSummary:
    """One step/rank pair: its row counts by verdict, first divergence, and first difference."""

    pair: str  # "step0/rank3"
    step: int | None
    rank: int | None
    counts: dict[str, int]
    divergence: Divergence | None
    divergence_position: tuple[int, int] | None  # (phase, order) of the divergent op
    first_difference: str | None = None  # the first entry with a tensor above its warn limit
    difference_error: float | None = None
    difference_position: tuple[int, int] | None = None
    role: str = ""  # "source" | "reached" (across ranks), else ""


@dataclass
class AcrossRanks:
    """Where a divergence began over the ranks of one step, and which ranks it reached."""

    step: int | None
    ranks: list[int]  # the source rank(s): the earliest divergence of the step
    entry: str
    pair: str  # step/rank label of the first source rank
    phase: str  # forward | backward | parameter gradients
    module_path: str | None
    output_error: float
    reached: list[int] = field(default_factory=list)  # ranks that differ later in the step
    through: str = ""  # the collective that carried it there
    first_seen: dict[int, str] = field(default_factory=dict)  # reached rank -> its first differing entry
    clean: list[int] = field(default_factory=list)  # ranks of the step with no difference

    def line(self) -> str:
        where = f" (module {self.module_path})" if self.module_path else ""
        step = f", step {self.step}" if self.step is not None else ""
        ranks = "rank" if len(self.ranks) == 1 else "ranks"
        text = f"it began on {ranks} {number_ranges(self.ranks)}{step} at {self.entry}{where}, in the {self.phase}"
        if len(self.ranks) > 1 and self.phase == _PHASE_TEXT[AFTER_BACKWARD]:
            text += (": the same gradient on each, as the gradient reduction gives every rank the same one (a rank's"
                     " share changed before it is in the reduced gradient of all)")
        elif len(self.ranks) > 1:
            text += (": at the same op on each, so a cause they share (their data, or a weight or buffer one rank"
                     " broadcast to them)")
        if self.reached:
            seen = sorted(set(self.first_seen.values()))
            text += (f"; it reached rank{'s' if len(self.reached) > 1 else ''} {number_ranges(self.reached)} through"
                     f" {self.through} (first seen there at {', '.join(seen[:2])}{', ...' if len(seen) > 2 else ''})")
        if self.clean:
            text += f"; rank{'s' if len(self.clean) > 1 else ''} {number_ranges(self.clean)} show no difference"
        return text


def several_ranks(result: CompareResult) -> bool:
    """Whether the result compares more than one rank (a multi-rank run's dumps)."""
    return len({_step_rank(pair.pair)[1] for pair in result.pairs} - {None}) > 1


def _step_rank(label: str) -> tuple[int | None, int | None]:
    """"step0/rank3" -> (0, 3); msprobe's proc<pid> folder has no rank number."""
    step, rank = _step_and_rank(label)
    match = _RANK.search(rank)
    return step, int(match.group(1)) if match else None


def _positions(pair: PairResult) -> dict[int, int]:
    """Phase of each order (position in the pair's execution order)."""
    first_backward = math.inf
    names = {}
    for row in pair.rows:
        names[row.order] = row.target_entry or row.golden_entry
    directions = {order: naming.split_entry_name(name)[1] for order, name in names.items()}
    for order, direction in directions.items():
        if direction == naming.BACKWARD:
            first_backward = min(first_backward, order)
    phases = {}
    for order, direction in directions.items():
        if direction == naming.PARAMETERS_GRAD or (direction != naming.BACKWARD and order > first_backward):
            phases[order] = AFTER_BACKWARD
        else:
            phases[order] = BACKWARD if direction == naming.BACKWARD else FORWARD
    return phases


def rank_summaries(result: CompareResult) -> list[RankSummary]:
    """One summary per compared step/rank, in the result's order; the roles of the step where the
    divergence began across ranks are filled in."""
    summaries = []
    for pair in result.pairs:
        step, rank = _step_rank(pair.pair)
        counts = {PASS: 0, WARN: 0, ERROR: 0, UNMATCHED: 0}
        phases = _positions(pair)
        first = None
        divergence_order = None
        for row in pair.rows:
            counts[row.verdict] = counts.get(row.verdict, 0) + 1
            if pair.divergence and divergence_order is None and pair.divergence.entry in (row.target_entry,
                                                                                           row.golden_entry):
                divergence_order = row.order
            if row.verdict in (WARN, ERROR) and _err(row) > result.thresholds.limits(row.dtype_class).warn_rel_l2:
                if first is None or row.order < first.order:
                    first = row
        summary = RankSummary(pair.pair, step, rank, counts, pair.divergence,
                              None if divergence_order is None else (phases[divergence_order], divergence_order))
        if first is not None:
            summary.first_difference = first.target_entry or first.golden_entry
            summary.difference_error = first.error
            summary.difference_position = (phases[first.order], first.order)
        summaries.append(summary)
    began = result.across_ranks
    if isinstance(began, AcrossRanks):
        for summary in summaries:
            if summary.step == began.step and summary.rank is not None:
                summary.role = ("source" if summary.rank in began.ranks
                                else "reached" if summary.rank in began.reached else "")
    return summaries


def first_divergence_across_ranks(result: CompareResult) -> AcrossRanks | None:
    """The earliest divergence over the ranks of the first step where one diverged; None with a
    single rank per step or no divergence."""
    summaries = [summary for summary in rank_summaries(result) if summary.rank is not None]
    steps = sorted({summary.step for summary in summaries}, key=lambda step: (step is None, step))
    for step in steps:
        group = [summary for summary in summaries if summary.step == step]
        if len({summary.rank for summary in group}) < 2:
            continue
        diverged = [summary for summary in group if summary.divergence_position is not None]
        if not diverged:
            continue
        earliest = min(summary.divergence_position for summary in diverged)
        sources = [summary for summary in diverged if summary.divergence_position == earliest]
        reached = [summary for summary in group if summary not in sources
                   and (summary.difference_position is not None or summary.divergence is not None)]
        first = sources[0]
        return AcrossRanks(
            step=step,
            ranks=sorted(summary.rank for summary in sources),
            entry=first.divergence.entry,
            pair=first.pair,
            phase=_PHASE_TEXT[earliest[0]],
            module_path=first.divergence.module_path,
            output_error=first.divergence.output_error,
            reached=sorted(summary.rank for summary in reached),
            through=_collective(reached, result) if reached else "",
            first_seen={summary.rank: _first_seen(summary) for summary in reached},
            clean=sorted(summary.rank for summary in group if summary not in sources and summary not in reached),
        )
    return None


def _first_seen(summary: RankSummary) -> str:
    if summary.divergence_position is not None and (summary.difference_position is None
                                                    or summary.divergence_position < summary.difference_position):
        return summary.divergence.entry
    return summary.first_difference or summary.divergence.entry


def _collective(reached: list[RankSummary], result: CompareResult) -> str:
    """What carried the change to the other ranks: a collective the dump recorded before their first
    difference, else the data-parallel wrapper's gradient collective when the difference appears
    in the parameter gradients, else a collective the dump does not show."""
    pairs = {pair.pair: pair for pair in result.pairs}
    positions = [summary.difference_position or summary.divergence_position for summary in reached]
    first = min(zip(positions, [summary.pair for summary in reached]), key=lambda item: item[0] or (9, 0))
    position, label = first
    pair = pairs[label]
    names = {row.order: row.target_entry or row.golden_entry for row in pair.rows}
    if position is not None:
        recorded = [names[order] for order in sorted(names) if order <= position[1]
                    and names[order].startswith("Distributed.")]
        if recorded:
            return recorded[-1]
    if position is not None and position[0] == AFTER_BACKWARD:
        entries = set(names.values())
        if any(_FSDP.match(name) for name in entries):
            return "FSDP's gradient reduce_scatter"
        # DDP wraps the model as its `module` (the wrapper itself, the model's root, has no entry)
        if any(".DistributedDataParallel." in name or name.startswith("Module.module.") for name in entries):
            return "DDP's gradient all_reduce"
        return "a gradient collective (all_reduce of the gradients)"
    return "a collective the dump does not record"
