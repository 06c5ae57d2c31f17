"""`npu-compare --trend GOLDEN NPU`: the first step and module where the NPU run's monitored statistics
leave the band two golden runs spread over.

Three monitors (`npu-run --monitor`) of the same script: GOLDEN (`--golden`), the perturbed golden
run (`--golden-perturb PRECISION`, by default in GOLDEN.perturbed beside it: each arithmetic op's
output rounded at random at the NPU run's precision, npukit/accuracy/perturb.py) and the NPU run.
The two golden runs differ only as benign low-precision rounding does, so how far apart they drift,
step by step, is how far the NPU run may drift for no reason of its own: there is no fixed threshold.

Per rank, record (`weight fc2.weight`, `activation blocks.1.mlp`, the loss ...) and statistic
(max, min, mean, norm, nan, inf):

    spread(t)    = |perturbed(t) - golden(t)|, the widest over the perturbed runs (GOLDEN.perturbed and
                   any GOLDEN.perturbed.*, recorded with other --perturb-seed: other draws of the rounding)
    envelope(t)  = the largest spread over the monitored steps up to twice t (at least LOOKAHEAD
                   steps past t): it grows as the spread grows, and judges each step on many samples
                   of the spread, not on the one at t (a weight's drift is one slow sample per run:
                   the two runs' rounding pushed it one way or the other for hundreds of steps)
    drift(t)     = for a value carried from step to step (a weight, Adam's m and v): its movement up
                   to t (the path its extreme elements travelled on the golden run) x the upper
                   quartile, over the rank's records of its kind (every weight; every m), of
                   envelope / movement
    band(t)      = golden(t) +- MARGIN x max(envelope(t), drift(t))
    the NPU run leaves the band at t when |npu(t) - golden(t)| is beyond it at t and at each of the
    next PERSIST - 1 monitored steps (one noisy step is not a departure); a non-finite NPU value
    where the golden one is finite is beyond any band

Why the drift: each update of a carried value adds a rounding error that stays nearly the same for
many steps (the same inputs round the same way), so one golden pair gives each of its statistics
about one sample of how far benign rounding moves it, and one sample can fall far below its scale:
on an fp16 regressor, the perturbed run's seeds 0-3 moved one bias's minimum 3 to 180 fp32 ulps in
40 steps, the clean NPU run 130, and a band of 5x seed 0's sample named a departure at step 2. Pooled
over the records of a kind (a weight's drift and Adam's v's differ in kind, not in luck), the rate
is many samples; a lost update still leaves it (it moves the weight by all of the update, where
rounding moves it by a part in a thousand). On benchmarks/trend_verdicts.py's 16 clean runs the
band without the drift named 6 false departures, with it none.

MARGIN (5) is what benign numerics showed: an NPU run under bf16 autocast drifted up to 3.9x the
envelope (its weights' deterministic rounding biases accumulate a little more than the perturbed
run's), where updates lost in a pure-bf16 optimizer step left it by 57x (tests/accuracy/test_trend.py);
benchmarks/trend_verdicts.py measures the verdicts on other models, optimizers and dtypes.

The trend divergence is the earliest departure over all ranks; at the same step the record a
cause comes before its effects in (a weight before what is computed from it, then the forward in
execution order: the first layer, then the loss, the backward (a rank's own gradient before the
reduced one), the optimizer's state). Its range
runs to the last step of the stretch the NPU run stayed out. `write_html` draws that statistic on
the three runs and the band (an SVG, also written as a file).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npukit.errors import UserError

MARGIN = 5.0  # the band's half-width in envelopes of the golden runs' spread
LOOKAHEAD = 10  # monitored steps past t the envelope at t covers at least
PERSIST = 5  # monitored steps in a row outside the band that make a departure
DRIFT_QUANTILE = 0.75  # the pooled drift rate of carried records: the upper quartile over them
STATS = ("max", "min", "mean", "norm", "nan", "inf")  # monitor.csv's statistics
SCALARS = ("loss", "grad_norm")  # scalars.csv's per-step series, judged as records of the model
# The order causes come before their effects in within a step (see the module docstring)
_KIND_ORDER = {"weight": 0, "activation": 1, "loss": 2, "activation_grad": 3, "grad_local": 4, "grad": 5,
               "grad_norm": 6, "exp_avg": 7, "exp_avg_sq": 8, "update_ratio": 9}
_PARAMETER_KINDS = frozenset({"weight", "grad_local", "grad", "exp_avg", "exp_avg_sq", "update_ratio"})
# records whose value carries from step to step (each step adds to it): their drift is one slow sample
# per run, so their band is pooled over the records of their kind (pooled_drift)
_CARRIED_KINDS = frozenset({"weight", "exp_avg", "exp_avg_sq"})
# what a step GradScaler skipped leaves non-finite by design (its scaled gradients overflowed), not judged there
_SKIPPED_STEP_RECORDS = frozenset({"activation_grad", "grad_local", "grad", "grad_norm"})
SHARED_RECORDS = 0.9  # of each monitor's records, at least, for a trend over the shared ones


class MonitorsDoNotPair(UserError):
    """The three monitors are not of the same run (other ranks, records or steps): exit code 3."""


PAIRING_EXIT_CODE = 3


@dataclass
class Monitor:
    """One rank's monitor: values[record, step, statistic] (NaN where not recorded)."""
    folder: Path
    steps: list[int]
    records: list[tuple[str, str]]  # (kind, name) in the order first recorded
    values: np.ndarray
    skipped: frozenset[int] = frozenset()  # the steps GradScaler skipped (scalars.csv)


@dataclass
class Departure:
    rank: int
    kind: str
    name: str
    statistic: str
    first_step: int
    last_step: int  # the last step of the stretch outside the band
    golden: float
    perturbed: float
    npu: float
    half_width: float  # the band's at first_step
    peak: float = math.nan  # the most it was outside, in half-widths, over first_step .. last_step
    # the module path `npu-run --dump-scope` takes for the record's module (module_scope); None: no module
    # (the loss, the gradient norm, a root module's own parameter), so --localize dumps the whole step
    scope: str | None = None

    def record(self) -> str:
        return f"{self.kind} {self.name}" if self.name else self.kind

    def what(self) -> str:
        """The record and its statistic (a scalar such as the loss has only its value)."""
        return self.kind if self.kind in SCALARS else f"{self.record()} {self.statistic}"

    def module(self) -> str:
        """The module the record belongs to (a parameter's owner, an output's module; the model's loss)."""
        if not self.name:
            return "(the model)"
        if self.kind in _PARAMETER_KINDS and "." in self.name:
            return self.name.rsplit(".", 1)[0]
        return self.name

    def times_out(self) -> float:
        deviation = abs(self.npu - self.golden)
        if not math.isfinite(deviation):
            return math.inf
        return deviation / self.half_width if self.half_width > 0 else math.inf

    def as_json(self) -> dict:
        record = {key: getattr(self, key) for key in ("rank", "kind", "name", "statistic", "first_step", "last_step")}
        for key in ("golden", "perturbed", "npu", "half_width", "peak"):
            value = getattr(self, key)
            record[key] = value if math.isfinite(value) else str(value)
        record["module"] = self.module()
        return record


_CALL = re.compile(r"(?P<path>.+)\.call\d+(?:\.\d+)?")  # a module's later call, and an output of several
_OUTPUT = re.compile(r"(?P<path>.+)\.\d+")


def module_scope(kind: str, name: str, records: list[tuple[str, str]]) -> str | None:
    """The module path of a record's module, as `npu-run --dump-scope` and the dump name it, or None
    when the record names no module (the loss, the gradient norm; a parameter of the model's root
    module, whose subtree is the whole step). A parameter's record is `path.weight`; a module output's
    `path`, `path.callN` (its N+1-th call in the step) with `.I` after it when the module returns
    several tensors: `blocks.0` is module blocks.0, or blocks' first output when no record names
    `blocks` itself (a module with one output would have it) and none names something under
    `blocks.0.` (a child has its own parameters or children). A root module's output is named by its
    class (its path is empty): that scope matches no module path, and --localize says so."""
    if kind in SCALARS or not name:
        return None
    if kind in _PARAMETER_KINDS:
        path = name.rpartition(".")[0]
        # (a parameter of no module that ran: the monitor's `param_group{G}.{I}`)
        return path if path and not re.fullmatch(r"param_group\d+", path) else None
    called = _CALL.fullmatch(name)
    if called:
        return called["path"]
    output = _OUTPUT.fullmatch(name)
    if output and not any(other == output["path"] or other.startswith(name + ".") for _, other in records):
        return output["path"]
    return name


@dataclass
class Series:
    """One statistic of one record on the three runs, with its band, for the plot."""
    rank: int
    kind: str
    name: str
    statistic: str
    steps: list[int]
    golden: np.ndarray
    perturbed: np.ndarray
    npu: np.ndarray
    half_width: np.ndarray


@dataclass
class TrendResult:
    golden: Path
    perturbed: list[Path]  # the perturbed golden runs the band rests on (the first is plotted)
    npu: Path
    ranks: list[int]
    steps: list[int]  # the monitored steps compared (the same on every rank)
    records: int  # records per rank judged
    series: int  # statistics judged, over all ranks
    departures: list[Departure]  # every series that left the band, earliest (and most causal) first
    plots: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def first(self) -> Departure | None:
        return self.departures[0] if self.departures else None

    def exit_code(self) -> int:
        return 1 if self.departures else 0

    def headline(self) -> str:
        first = self.first()
        span = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no steps"
        if first is None:
            return (f"No trend divergence: over {span} ({len(self.steps)} monitored, rank(s) "
                    f"{_ranks_text(self.ranks)}), all {self.series} statistics of {self.records} records stay "
                    "inside the band the golden runs spread over")
        rank = f" on rank {first.rank}" if len(self.ranks) > 1 else ""
        where = f"in the model's {first.kind}" if first.kind in SCALARS else f"in {first.module()} ({first.what()})"
        return (f"Trend divergence: the NPU run leaves the golden band at step {first.first_step}{rank}, "
                f"{where}, and stays out through step "
                f"{first.last_step}: NPU {short_value(first.npu, first.half_width)}, golden "
                f"{short_value(first.golden, first.half_width)}, band +-{short_value(first.half_width)} ({_times(first.times_out())} its half-width; at most "
                f"{_times(first.peak)} over those steps)")

    def as_json(self) -> dict:
        return {"golden": str(self.golden), "perturbed_golden": [str(path) for path in self.perturbed],
                "npu": str(self.npu),
                "ranks": self.ranks, "steps": [self.steps[0], self.steps[-1]] if self.steps else [],
                "monitored_steps": len(self.steps), "records": self.records, "statistics": self.series,
                "diverged": bool(self.departures), "headline": self.headline(), "notes": self.notes,
                "band": {"margin": MARGIN, "lookahead_steps": LOOKAHEAD, "persist_steps": PERSIST,
                         "carried_drift_quantile": DRIFT_QUANTILE},
                "first_departure": self.first().as_json() if self.departures else None,
                "departures": [d.as_json() for d in self.departures]}


def short_value(value: float, resolve: float | None = None) -> str:
    """`value` to 4 significant digits, or to as many as show a tenth of `resolve` (the band's half-width):
    an NPU value a band outside the golden one is not printed as the same number (wpe's norm: 31.64 both)."""
    if not math.isfinite(value):
        return str(value)
    digits = 4
    if resolve is not None and math.isfinite(resolve) and resolve > 0 and value != 0:
        digits = min(12, max(4, math.floor(math.log10(abs(value))) - math.floor(math.log10(resolve / 10)) + 1))
    return f"{value:.{digits}g}"


def _times(value: float) -> str:
    return "beyond any multiple of" if not math.isfinite(value) else f"{value:.3g}x"


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


# ----------------------------------------------------------------------------- reading
def rank_folders(directory: Path, role: str) -> dict[int, Path]:
    """{rank: folder holding monitor.csv} of a monitor directory (DIR/rank{R}/, or one rank's folder)."""
    if not directory.is_dir():
        raise UserError(f"--trend: {role} monitor {directory} is not a directory")
    if (directory / "monitor.csv").is_file():
        name = directory.name
        return {int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else 0: directory}
    folders = {}
    for child in directory.iterdir():
        if child.name.startswith("rank") and child.name[4:].isdigit() and (child / "monitor.csv").is_file():
            folders[int(child.name[4:])] = child
    if not folders:
        raise UserError(f"--trend: {role} monitor {directory} holds no rank*/monitor.csv (npu-run --monitor DIR "
                        "writes it; a --monitor-config with format tensorboard writes none)")
    return dict(sorted(folders.items()))


def read_monitor(folder: Path) -> Monitor:
    """monitor.csv and scalars.csv of one rank's folder, as a Monitor."""
    rows: list[tuple[int, int, list[float]]] = []
    index: dict[tuple[str, str], int] = {}
    path = folder / "monitor.csv"
    with open(path, newline="") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if header is None or header[:2] != ["step", "kind"] or header[4:10] != list(STATS):
            raise UserError(f"--trend: {path}: not a monitor.csv of npu-run --monitor (header {header})")
        for line, row in enumerate(reader, start=2):
            try:
                key = (row[1], row[2])
                rows.append((int(row[0]), index.setdefault(key, len(index)), [float(v) for v in row[4:10]]))
            except (ValueError, IndexError):
                raise UserError(f"--trend: {path}, line {line}: not a record of npu-run --monitor: {row}") from None
    scalars = folder / "scalars.csv"
    skipped: set[int] = set()
    if scalars.is_file():
        with open(scalars, newline="") as file:
            for line, row in enumerate(csv.DictReader(file), start=2):
                if row.get("skipped_by_grad_scaler") == "1" and (row.get("step") or "").isdigit():
                    skipped.add(int(row["step"]))
                for name in SCALARS:
                    text = row.get(name, "")
                    if text:
                        try:
                            value = float(text)
                            rows.append((int(row["step"]), index.setdefault((name, ""), len(index)), _scalar(value)))
                        except (ValueError, KeyError, TypeError):
                            raise UserError(f"--trend: {scalars}, line {line}: not a step of npu-run --monitor") from None
    steps = sorted({step for step, _, _ in rows})
    column = {step: i for i, step in enumerate(steps)}
    values = np.full((len(index), len(steps), len(STATS)), np.nan)
    for step, record, stats in rows:
        values[record, column[step]] = stats
    return Monitor(folder, steps, list(index), values, frozenset(skipped))


# ----------------------------------------------------------------------------- pairing
def _pair(golden: Monitor, perturbed: list[Monitor], npu: Monitor,
          notes: list[str]) -> tuple[list[int], list[tuple[str, str]]]:
    """The steps and records the monitors share; MonitorsDoNotPair when they are not of one run.

    A record one run lacks is left out, said in a note, while the shared records are at least
    SHARED_RECORDS of each monitor's: a low-precision run can lack a gradient the golden run has (the
    Trainer's fp16 logits are a copy the loss does not use: no gradient reaches them)."""
    monitors = (("golden", golden), *(("perturbed golden", monitor) for monitor in perturbed), ("NPU", npu))
    sets = [set(monitor.records) for _, monitor in monitors]
    shared = [r for r in golden.records if all(r in records for records in sets)]
    for (role, monitor), records in zip(monitors[1:], sets[1:]):
        missing = [r for r in golden.records if r not in records]
        extra = [r for r in monitor.records if r not in sets[0]]
        if not (missing or extra):
            continue
        said = "; ".join(text for text in (
            f"{len(missing)} golden record(s) it lacks ({_records_text(missing)})" if missing else "",
            f"{len(extra)} record(s) the golden run lacks ({_records_text(extra)})" if extra else "") if text)
        if len(shared) < SHARED_RECORDS * max(len(golden.records), len(monitor.records)):
            raise MonitorsDoNotPair(f"the monitors do not pair: the {role} run's {monitor.folder} has {said}: "
                                    "monitor the same script with the same --monitor-modules")
        notes.append(f"the {role} run's {monitor.folder} has {said}: not compared")
    length = min(len(monitor.steps) for _, monitor in monitors)
    for role, monitor in monitors[1:]:
        if monitor.steps[:length] != golden.steps[:length]:
            at = next(i for i in range(length) if monitor.steps[i] != golden.steps[i])
            raise MonitorsDoNotPair(f"the monitors do not pair: the {role} run's {monitor.folder} monitored step "
                                    f"{monitor.steps[at]} where the golden run's monitored step {golden.steps[at]}: "
                                    "monitor them with the same --monitor-every")
    if length < 2:
        raise MonitorsDoNotPair(f"the monitors do not pair: {length} monitored step(s) in common; a trend needs "
                                "at least 2")
    for role, monitor in monitors:
        if len(monitor.steps) > length:
            notes.append(f"the {role} run monitored {len(monitor.steps)} steps, the shortest {length}: steps "
                         f"{golden.steps[0]}-{golden.steps[length - 1]} compared")
    return golden.steps[:length], shared


def _scalar(value: float) -> list[float]:
    """A per-step scalar (the loss) as a record: its value is its one statistic, kept as the mean."""
    return [math.nan, math.nan, value, math.nan, math.nan, math.nan]


def _records_text(records: list[tuple[str, str]], shown: int = 3) -> str:
    text = ", ".join(f"{kind} {name}".strip() for kind, name in records[:shown])
    return text + (f" and {len(records) - shown} more" if len(records) > shown else "")


def _aligned(monitor: Monitor, records: list[tuple[str, str]], length: int) -> np.ndarray:
    order = {record: i for i, record in enumerate(monitor.records)}
    return monitor.values[[order[record] for record in records], :length]


# ----------------------------------------------------------------------------- the band
def widest_spread(golden: np.ndarray, perturbed: list[np.ndarray]) -> np.ndarray:
    """|perturbed - golden|, the widest over the perturbed runs ([record, step, statistic]); NaN where the
    golden run or a perturbed run is not finite (not judged there)."""
    spread = np.abs(perturbed[0] - golden)
    for other in perturbed[1:]:
        spread = np.maximum(spread, np.abs(other - golden))  # (NaN wins: not judged)
    return np.where(np.isfinite(spread), spread, np.nan)


def band_half_width(golden: np.ndarray, spread: np.ndarray, kinds: list[str] | None = None) -> np.ndarray:
    """MARGIN x the envelope of the spread (`widest_spread`) along axis 1 (steps): at step index t, the
    largest spread over indices 0 .. max(2t, t + LOOKAHEAD). Non-finite spreads count as none. For records
    whose kind (`kinds`, one per record) carries from step to step, the envelope is at least the
    pooled drift (`pooled_drift`), and a weight's max and min at least its norm's; a module output that
    is a weight as it is (`weight_copies`) takes that weight's envelope."""
    spread = np.where(np.isfinite(spread), spread, 0.0)
    steps = spread.shape[1]
    running = np.maximum.accumulate(spread, axis=1)
    reach = np.minimum(np.maximum(np.arange(steps) * 2, np.arange(steps) + LOOKAHEAD), steps - 1)
    envelope = running[:, reach]
    if kinds is not None:
        envelope = np.maximum(envelope, pooled_drift(golden, envelope, kinds))
        # a weight's largest and smallest elements can change hands: an element the loss leaves free (an
        # attention key's bias: softmax ignores a shift) has rounding noise for a gradient in a low-precision
        # run, which Adam turns into steps of its learning rate, and it may walk past the extreme on one run
        # and not on another. An extreme moves no more than the elements do, and the norm's spread measures
        # how far they moved (randomly signed changes move the norm by about their rms)
        weights = np.array([kind == "weight" for kind in kinds], dtype=bool)
        norm = envelope[weights, :, STATS.index("norm")]
        for extreme in (STATS.index("max"), STATS.index("min")):
            envelope[weights, :, extreme] = np.maximum(envelope[weights, :, extreme], norm)
        for output, weight in weight_copies(golden, kinds):
            envelope[output] = np.maximum(envelope[output], envelope[weight])
    # never narrower than what an fp32 statistic resolves: two golden runs may agree to the last bit
    # (an Adam update is nearly the sign of its gradient), where one fp32 ulp more is no departure
    resolution = np.spacing(np.abs(np.where(np.isfinite(golden), golden, 0.0)).astype(np.float32)).astype(np.float64)
    return MARGIN * np.maximum(envelope, resolution)


def weight_copies(golden: np.ndarray, kinds: list[str]) -> list[tuple[int, int]]:
    """(activation, weight) record indices whose golden statistics are the same at every monitored step:
    a module whose output is its weight as it is (a learned position embedding looked up at all its
    positions: GPT-2's and makemore's wpe with the sequence at block_size). That output carries the
    weight's drift from step to step as the weight does, so it is judged on the weight's band: on its
    own spread (one golden pair's sample, not pooled), makemore's clean bf16 run put wpe's output
    1.56x outside its band where the weight stayed at 0.13x of its own."""
    values = slice(0, STATS.index("nan"))
    weights: dict[bytes, int] = {}
    for index, kind in enumerate(kinds):
        if kind == "weight" and np.isfinite(golden[index, :, values]).all():
            weights.setdefault(golden[index, :, values].tobytes(), index)
    return [(index, weights[key]) for index, kind in enumerate(kinds)
            if kind == "activation" and (key := golden[index, :, values].tobytes()) in weights]


def pooled_drift(golden: np.ndarray, envelope: np.ndarray, kinds: list[str]) -> np.ndarray:
    """The drift the golden pair shows per unit of movement, pooled over the records of one carried
    kind, times each such record's own movement ([record, step, statistic]; 0 for other records).

    A record's movement up to t is the path its extreme elements travelled: the sum over steps of the
    larger of |max(s) - max(s-1)| and |min(s) - min(s-1)| on the golden run (each element's update
    carries a rounding error, whichever statistic it shows in; the mean of a weight may not move at
    all while its elements do). Per statistic and step, the pooled rate is the upper quartile over the
    kind's records of envelope / movement."""
    extremes = [STATS.index("max"), STATS.index("min")]
    moves = np.abs(np.diff(golden[:, :, extremes], axis=1, prepend=golden[:, :1, extremes])).max(axis=2)
    movement = np.cumsum(np.where(np.isfinite(moves), moves, 0.0), axis=1)[:, :, None]  # [record, step, 1]
    drift = np.zeros_like(envelope)
    values = slice(0, STATS.index("nan"))  # (not the counts of non-finite elements)
    for carried in sorted(set(kinds) & _CARRIED_KINDS):
        members = np.array([kind == carried for kind in kinds])
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(movement[members] > 0, envelope[members, :, values] / movement[members], np.nan)
        rate = np.where(np.isnan(rate).all(axis=0, keepdims=True), 0.0, rate)  # (nothing moved yet: no rate)
        pooled = np.nanquantile(rate, DRIFT_QUANTILE, axis=0)  # [step, statistic]
        drift[members, :, values] = pooled[None] * movement[members]
    return drift


def outside_band(golden: np.ndarray, spread: np.ndarray, npu: np.ndarray, half_width: np.ndarray) -> np.ndarray:
    """Where the NPU run is outside the band: beyond it, or non-finite where every golden run is finite
    (`spread` finite)."""
    judged = np.isfinite(golden) & np.isfinite(spread)
    deviation = np.abs(npu - golden)
    beyond = np.where(np.isfinite(deviation), deviation > half_width, True)
    return judged & beyond


def first_stretch(outside: np.ndarray, persist: int) -> tuple[np.ndarray, np.ndarray]:
    """Per series (outside[..., step]): the first step index starting `persist` steps in a row outside
    (-1: none) and the last index of the stretch it starts."""
    steps = outside.shape[-1]
    persist = min(persist, steps)
    run = np.zeros(outside.shape, dtype=np.int64)  # steps in a row outside, ending at each index
    count = np.zeros(outside.shape[:-1], dtype=np.int64)
    for index in range(steps):
        count = np.where(outside[..., index], count + 1, 0)
        run[..., index] = count
    ends = run >= persist
    has = ends.any(axis=-1)
    start = np.where(has, ends.argmax(axis=-1) - persist + 1, -1)
    last = np.full(start.shape, -1)
    for position in zip(*np.nonzero(has)):
        begin = start[position]
        inside = np.nonzero(~outside[position][begin:])[0]
        last[position] = begin + inside[0] - 1 if inside.size else steps - 1
    return start, last


def _causal_order(records: list[tuple[str, str]]) -> list[int]:
    """Record indices sorted as causes come before effects within a step (first recorded first)."""
    return sorted(range(len(records)), key=lambda i: (_KIND_ORDER.get(records[i][0], len(_KIND_ORDER)), i))


# ----------------------------------------------------------------------------- the trend
def perturbed_monitors(golden: Path) -> list[Path]:
    """The perturbed golden runs recorded beside GOLDEN: GOLDEN.perturbed, then GOLDEN.perturbed.* (a second
    one, `npu-run --golden-perturb P --perturb-seed 1 --monitor GOLDEN.perturbed.1`), in name order."""
    first = golden.with_name(golden.name + ".perturbed")
    more = sorted(path for path in golden.parent.glob(f"{golden.name}.perturbed.*") if path.is_dir()) \
        if golden.parent.is_dir() else []
    return ([first] if first.exists() else []) + more


def compare_trend(golden: Path, npu: Path, perturbed: Path | list[Path] | None = None) -> TrendResult:
    """The band, the departures and the plots of the monitor directories (see the module docstring).
    `perturbed`: the perturbed golden run(s); by default those beside GOLDEN (`perturbed_monitors`)."""
    if perturbed is None:
        perturbed = perturbed_monitors(golden)
        if not perturbed:
            missing = golden.with_name(golden.name + ".perturbed")
            raise UserError(f"--trend: no perturbed golden monitor at {missing}: record the golden run a second time "
                            f"with `npu-run --golden-perturb bf16 --monitor {missing} ...` (the precision the NPU run "
                            "computes in: fp16, bf16 or hf32), or name its directory with --perturbed DIR")
    perturbed = [perturbed] if isinstance(perturbed, Path) else list(perturbed)
    several = len(perturbed) > 1
    roles = [("golden", golden), *((f"perturbed golden ({path})" if several else "perturbed golden", path)
                                   for path in perturbed), ("NPU", npu)]
    folders = [rank_folders(path, role) for role, path in roles]
    ranks = list(folders[0])
    for (role, _), found in zip(roles[1:], folders[1:]):
        if list(found) != ranks:
            raise MonitorsDoNotPair(f"the monitors do not pair: the golden run has rank(s) {_ranks_text(ranks)}, the "
                                    f"{role} run rank(s) {_ranks_text(list(found))}")
    notes: list[str] = []
    departures: list[tuple[int, int, int, Departure]] = []  # (step index, causal position, rank, departure)
    plots_of_rank: dict[int, list[Series]] = {}  # the rank's first departure (or closest) and its loss
    records_count = series_count = 0
    identical = [True] * len(perturbed)  # each perturbed run recorded exactly what the golden run did
    alike = len(perturbed) > 1  # the perturbed runs recorded the same values (one seed twice)
    closest_ratio, closest_rank = -1.0, ranks[0]
    loaded = {rank: [read_monitor(found[rank]) for found in folders] for rank in ranks}
    paired = {rank: _pair(monitors[0], monitors[1:-1], monitors[-1], notes) for rank, monitors in loaded.items()}
    # the steps every rank monitored (one may have stopped first)
    steps = min((rank_steps for rank_steps, _ in paired.values()), key=len)
    for rank, (rank_steps, _) in paired.items():
        if rank_steps[:len(steps)] != steps:
            raise MonitorsDoNotPair(f"the monitors do not pair: rank {rank} monitored steps {rank_steps[0]}, "
                                    f"{rank_steps[1]} ..., rank {ranks[0]} steps {steps[0]}, {steps[1]} ...")
        if len(rank_steps) > len(steps):
            notes.append(f"rank {rank} monitored {len(rank_steps)} steps, another rank {len(steps)}: steps "
                         f"{steps[0]}-{steps[-1]} compared")
    for rank in ranks:
        monitors, records = loaded.pop(rank), paired[rank][1]
        g, *each, n = (_aligned(monitor, records, len(steps)) for monitor in monitors)
        identical = [same and bool(np.array_equal(g, q, equal_nan=True)) for same, q in zip(identical, each)]
        alike = alike and all(np.array_equal(each[0], q, equal_nan=True) for q in each[1:])
        skipped = [column for column, step in enumerate(steps) if any(step in m.skipped for m in monitors)]
        if skipped:  # (a skipped step's optimizer did not step: the weights say what that cost)
            gradients = [row for row, (kind, _) in enumerate(records) if kind in _SKIPPED_STEP_RECORDS]
            g[np.ix_(gradients, skipped)] = np.nan
            notes.append(f"rank {rank}: {len(skipped)} step(s) GradScaler skipped (from step {steps[skipped[0]]}): "
                         "their gradients are not judged")
        # (after the skipped steps are blanked: their scaled gradients neither are judged nor widen the band)
        p, spread = each[0], widest_spread(g, each)
        half = band_half_width(g, spread, [kind for kind, _ in records])
        start, last = first_stretch(np.moveaxis(outside_band(g, spread, n, half), 1, 2), PERSIST)  # [record, stat]
        records_count = len(records)
        series_count += int(np.isfinite(g).any(axis=1).sum())
        found = []
        for position, record in enumerate(_causal_order(records)):
            kind, name = records[record]
            for stat_index, statistic in enumerate(STATS):
                begin = int(start[record, stat_index])
                if begin >= 0:
                    values = (float(a[record, begin, stat_index]) for a in (g, p, n))
                    end = int(last[record, stat_index]) + 1
                    found.append((begin, position, rank, Departure(
                        rank, kind, name, "value" if kind in SCALARS else statistic, steps[begin], steps[end - 1],
                        *values, float(half[record, begin, stat_index]),
                        _peak(g[record, begin:end, stat_index], n[record, begin:end, stat_index],
                              half[record, begin:end, stat_index]), module_scope(kind, name, records)),
                        record, stat_index))
        if found:
            first = min(found, key=lambda d: d[:3])
            shown = (first[4], first[5])
        else:  # the statistic that came closest to leaving the band
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(half > 0, np.abs(n - g) / half, 0.0)
            ratio = np.where(np.isfinite(ratio), ratio, 0.0)
            record, _, stat_index = np.unravel_index(int(ratio.argmax()), ratio.shape)
            shown = (int(record), int(stat_index))
            if float(ratio.max()) > closest_ratio:
                closest_ratio, closest_rank = float(ratio.max()), rank
        departures += [d[:4] for d in found]
        plots_of_rank[rank] = [_series(rank, records, *shown, steps, g, p, n, half)]
        if ("loss", "") in records and records[shown[0]] != ("loss", ""):
            plots_of_rank[rank].append(_series(rank, records, records.index(("loss", "")), STATS.index("mean"), steps,
                                               g, p, n, half))
    if any(identical):
        same = perturbed[identical.index(True)]
        raise MonitorsDoNotPair(f"the monitors do not pair as a band: the perturbed golden run {same} recorded "
                                f"exactly what the golden run {golden} did, so the band has no width: record it with "
                                "npu-run --golden-perturb PRECISION")
    if alike:
        raise MonitorsDoNotPair(f"the monitors do not pair as a band: the perturbed golden runs "
                                f"{', '.join(map(str, perturbed))} recorded the same values (the same --perturb-seed): "
                                "a second perturbed run is a second draw of the rounding only with another "
                                "--perturb-seed")
    departures.sort(key=lambda d: d[:3])
    ordered = [d[3] for d in departures]
    if ordered and len(perturbed) == 1 and math.isfinite(ordered[0].npu):  # (a nan/inf is out of any band)
        second = golden.with_name(golden.name + ".perturbed.1")
        notes.append(f"the band rests on one perturbed golden run, one draw of benign rounding (an Adam update "
                     f"of the other sign on a gradient element within rounding of zero stays in a weight): record "
                     f"a second draw, `npu-run --golden-perturb PRECISION --perturb-seed 1 --monitor {second} ...`, "
                     "and npu-compare --trend reads both")
    plots = plots_of_rank[ordered[0].rank if ordered else closest_rank]
    return TrendResult(golden, perturbed, npu, ranks, steps, records_count, series_count, ordered, plots,
                       list(dict.fromkeys(notes)))  # each rank says the same


def _peak(golden: np.ndarray, npu: np.ndarray, half_width: np.ndarray) -> float:
    """The largest |npu - golden| / half-width over a stretch (inf: a non-finite value or no width)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.abs(npu - golden) / half_width
    return float(np.nan_to_num(ratio, nan=math.inf).max())


def _series(rank: int, records: list[tuple[str, str]], record: int, statistic: int, steps: list[int],
            golden: np.ndarray, perturbed: np.ndarray, npu: np.ndarray, half_width: np.ndarray) -> Series:
    kind, name = records[record]
    return Series(rank, kind, name, STATS[statistic], steps, *(a[record, :, statistic].copy()
                                                              for a in (golden, perturbed, npu, half_width)))
