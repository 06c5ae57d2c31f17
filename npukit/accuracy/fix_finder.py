"""`npu-compare GOLDEN NPU --find-fix -- <the npu-run command that wrote NPU>`: the smallest
precision fix that brings the NPU run back within tolerance.

From the divergence a compare names (its op, and the ops after it that are off too), candidates
are drawn: each op computed in fp32 instead of fp16/bf16, a fused op (npu_fusion_attention) computed
by its unfused decomposition in fp32 (before its fp32 candidate: the call keeps its output dtype),
HF32 off for a matmul/conv the run computed in HF32, a fill with +-inf made finite; for an update
optimizer.step() lost in a bf16 weight, first an fp32 master copy of the weight's module. The step is run
again (the user's command under `--replay`, with `--precision-fix` and a dump of its own) with sets
of candidates applied, and each run is compared with the golden dump: a set fixes the run when
that compare finds no divergence.
The search bisects prefixes of the candidate list (nearest the problem first): all candidates
first (if they do not fix it, nothing smaller will), then the shortest prefix that still fixes it,
whose last candidate is then needed; that one is kept, and the search goes on in the candidates
before it, first trying those kept alone, until what is kept fixes the run. A change repeated in
every block (`blocks.*.fc`, one candidate for all of them) that is part of the fix is then narrowed
the same way over its blocks, those whose ops are off last and each round first trying the blocks
without the last one: the fewest blocks that still fix it (`blocks.6.fc`, `blocks.7.fc`). Every set
kept fixes the run, and no change (or block) of the fix can be dropped.

Runs, for K candidates and a fix of d changes: at most 1 + d*(ceil(log2 K) + 1) (ceil(log2 K) + 2 for
one change, 2*ceil(log2 K) + 3 for two). Narrowing a change over B blocks to b of them: at most
b*(ceil(log2 B) + 2) + 2 more (4 for the two off blocks of the 8-block stream), B when every block
needs it. `--find-fix-runs` caps the total; at the cap the smallest set known to fix the run is
proposed.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from npukit.accuracy import naming
from npukit.accuracy.compare import (
    ERROR,
    NONFINITE_IN_GOLDEN_ONLY,
    WARN,
    CompareResult,
    Thresholds,
    compare_dirs,
    entry_module_path,
    entry_stack,
    hf32_kind,
)
from npukit.accuracy.dumpfile import load_rank_dump
from npukit.accuracy.fixes import FILL_APIS, FixChange, PrecisionFix, fix_code, module_pattern
from npukit.accuracy.unfuse import accepts, decomposition, recorded_calls
from npukit.errors import UserError
from npukit.files import write_text_atomic

MAX_CANDIDATES = 24
_STACK_LINE = re.compile(r"File (?P<file>.+?), line (?P<line>\d+)")
# ops that do no arithmetic (they move, view or cast values): nothing to gain computing them in fp32
_NO_ARITHMETIC = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "split", "split_with_sizes", "chunk",
    "unbind", "flatten", "unflatten", "contiguous", "expand", "expand_as", "squeeze", "unsqueeze", "narrow", "select",
    "__getitem__", "getitem", "repeat", "cat", "stack", "to", "type", "float", "half", "bfloat16", "dropout",
    "clone", "detach", "movedim", "swapaxes", "index_select", "gather", "roll", "pad",
    # exact in any dtype
    "relu", "relu_", "abs", "neg", "maximum", "minimum", "max", "min", "where", "clamp", "clamp_", "sign"})
_LOW_PRECISION = ("torch.float16", "torch.bfloat16")


@dataclass
class Trial:
    changes: list[FixChange]
    fixed: bool
    divergence_error: float | None  # at the original first divergence's output
    loss_error: float | None  # at the step's last forward output (the loss)
    note: str = ""  # what the compare said, or why the run failed


@dataclass
class FixResult:
    candidates: list[FixChange]
    before: Trial
    fix: list[FixChange] | None
    after: Trial | None
    trials: list[Trial] = field(default_factory=list)
    divergence: str = ""

    def as_json(self) -> dict:
        def trial(t: Trial | None):
            return None if t is None else {**asdict(t), "changes": [asdict(c) for c in t.changes]}

        return {
            "divergence": self.divergence,
            "candidates": [asdict(c) for c in self.candidates],
            "fix": None if self.fix is None else [{**asdict(c), "description": c.describe(), "code": c.code()}
                                                  for c in self.fix],
            "before": trial(self.before), "after": trial(self.after),
            "runs": len(self.trials), "trials": [trial(t) for t in self.trials],
            "precision_fix_file": None if self.fix is None else json.loads(PrecisionFix(self.fix).to_json()),
            "code": None if self.fix is None else fix_code(self.fix),
        }


# ---------------------------------------------------------------------------- candidates
def grad_scaler_only(result: CompareResult) -> str | None:
    """What to say when the run's only problem is a step GradScaler skipped in the target alone,
    before any forward op was off: its gradients overflowed at the loss scale it started with,
    which GradScaler handles by lowering the scale. No precision change is the fix for that."""
    for pair in result.pairs:
        forward_errors = [row for row in pair.rows if row.verdict == ERROR and row.target_entry
                          and row.target_entry.endswith(".forward")]
        if pair.divergence is not None or forward_errors:
            return None
        if pair.skipped_by_grad_scaler == "target":
            return (f"{pair.pair}: GradScaler skipped this step in the target only (its gradients overflowed at "
                    "the starting loss scale) and no forward op is off: that is no precision problem to fix. "
                    "Start GradScaler lower (init_scale=...) in both runs, record the golden run again, then "
                    "compare (and --find-fix) once more")
    return None


def anchor_entry(result: CompareResult) -> tuple[object, str] | None:
    """(the pair, the target entry) where the problem shows first: the compare's first divergence,
    else the first forward op whose output is an error row (a problem the search did not name:
    the error is carried, or a step GradScaler skipped in the target only)."""
    for pair in result.pairs:
        if pair.divergence is not None:
            return pair, pair.divergence.entry
    for pair in result.pairs:
        errors = [row for row in pair.rows if row.verdict == ERROR and row.target_entry
                  and row.target_entry.endswith(".forward") and not row.target_entry.startswith("Module.")]
        if errors:
            return pair, min(errors, key=lambda row: row.order).target_entry
    return None


def candidates_from(result: CompareResult, limit: int = MAX_CANDIDATES) -> list[FixChange]:
    """The changes worth trying, nearest the anchor first: the anchor and the forward ops before it
    (backwards), then the later ones whose outputs are off (error or warn rows); for each op, what
    its dtype and kind allow (most ops allow nothing: an fp32 add has no precision to gain)."""
    return candidates_with_blocks(result, limit)[0]


def candidates_with_blocks(result: CompareResult, limit: int = MAX_CANDIDATES
                           ) -> tuple[list[FixChange], dict[FixChange, list[FixChange]]]:
    """candidates_from(), and for each candidate grouped over the blocks of a model (`h.*.attn`) its
    blocks' own changes, those whose ops are off (error or warn rows) last: find_fix() narrows it
    down to the blocks that need it trying the last ones first."""
    anchor = anchor_entry(result)
    if anchor is None:
        return [], {}
    pair, anchor_name = anchor
    dump = load_rank_dump(pair.target_dir, pair.pair)
    off = {row.target_entry for row in pair.rows if row.verdict in (ERROR, WARN) and row.target_entry}
    ops = [entry for entry in dump.entries if entry.direction == naming.FORWARD and not entry.name.startswith("Module.")]
    at = next((index for index, entry in enumerate(ops) if entry.name == anchor_name), len(ops) - 1)
    # every op up to the anchor may have fed it (an op whose own output passes can lose what a later
    # subtraction reveals); after it, only those that are off themselves
    ordered = [*reversed(ops[:at + 1]), *(entry for entry in ops[at + 1:] if entry.name in off)]
    # the arguments of the fused calls that have a decomposition: does it compute them (their options)?
    fused_calls = recorded_calls(dump.path, [entry.name for entry in ordered if decomposition(_api(entry))])
    found: list[FixChange] = []
    off_changes: set[FixChange] = set()
    for entry in ordered:
        for change in _changes_for(entry, dump, fused_calls.get(entry.name)):
            if change not in found:
                found.append(change)
            if entry.name in off:
                off_changes.add(change)
    grouped, members = _groups(found)
    grouped = [*_master_copies(pair, dump, anchor_name), *grouped][:limit]
    blocks = {change: sorted(members[change], key=lambda member: member in off_changes)
              for change in grouped if change in members}
    if _saturated(pair):  # last: a code fix is preferred, and a 910A has no INF_NAN mode
        grouped.append(FixChange("inf_nan_mode"))
    return grouped, blocks


def _master_copies(pair, dump, anchor_name: str) -> list[FixChange]:
    """For an update optimizer.step() lost (a weight kept in fp16/bf16, its update below half a rounding
    unit: the compare's "lost-update"): an fp32 master copy of the weight's module's parameters, then of
    the model's (the op may update weights of several modules: a foreach update). First: computing the
    update op in fp32 cannot help, its result is written into the bf16 weight. None for an update made
    by hand (`p -= lr * p.grad`, outside an optimizer): no optimizer step updates a master there."""
    divergence = pair.divergence
    if divergence is None or divergence.kind != "lost-update" or divergence.entry != anchor_name:
        return []
    entry = dump.by_name().get(anchor_name)
    if entry is None or entry.parent != "optimizer":
        return []
    module = "" if divergence.module_path in (None, "(root)") else divergence.module_path
    return [FixChange("fp32_master", module=path) for path in dict.fromkeys([module, ""])]


def _saturated(pair) -> bool:
    """The target ran fp16 in saturation mode: an fp16 value the golden run had as inf or nan is
    finite in the target (saturation clamps to +-65504, nan to 0)."""
    return any(row.message == NONFINITE_IN_GOLDEN_ONLY and row.target is not None and row.target.dtype == "torch.float16"
               for row in pair.rows)


def _grouped(changes: list[FixChange]) -> list[FixChange]:
    """The same change at the same line in modules that differ only by their indices (every block
    of a GPT: `h.0.attn`, `h.1.attn`) as one candidate for all of them (`h.*.attn`), placed where
    the first of them was: a problem a model repeats in every layer needs the fix in every layer
    (or, find_fix() then finds out, in a few of them)."""
    return _groups(changes)[0]


def _groups(changes: list[FixChange]) -> tuple[list[FixChange], dict[FixChange, list[FixChange]]]:
    """_grouped(), and each grouped candidate -> the changes it stands for, in their order."""
    pattern_of = {change: module_pattern(change.module) for change in changes}
    groups: dict[tuple, list[FixChange]] = {}
    for change in changes:
        groups.setdefault((change.kind, change.api, change.line, pattern_of[change]), []).append(change)
    grouped, members = [], {}
    for change in changes:
        key = (change.kind, change.api, change.line, pattern_of[change])
        if len(groups[key]) == 1:
            grouped.append(change)
        elif change is groups[key][0]:
            wildcard = FixChange(change.kind, change.api, key[3], change.line, change.source)
            grouped.append(wildcard)
            members[wildcard] = groups[key]
    return grouped, members


def _api(entry) -> str:
    return naming.operator_op(naming.split_entry_name(entry.name)[0])


def _changes_for(entry, dump, recorded_call: dict | None = None) -> list[FixChange]:
    """`recorded_call`: the entry's arguments as dump.json has them (for a fused op with a decomposition)."""
    api = _api(entry)
    module = entry_module_path(entry, dump) or ""
    module = "" if module == "(root)" else module
    line, source = _user_line(entry_stack(entry, dump))
    out_dtypes = {leaf.dtype for leaf in entry.outputs}
    in_dtypes = {leaf.dtype for leaf in entry.inputs}
    changes = []
    if api in FILL_APIS:  # first: the fix a saturating 910A needs (fp32 would move more ops out of fp16)
        changes.append(FixChange("finite_fill", api, module, line, source))
    if out_dtypes & set(_LOW_PRECISION) and recorded_call is not None and accepts(entry.name, recorded_call,
                                                                                 entry.inputs):
        # before fp32: the fused kernel's own roundings are what the decomposition leaves out, and the
        # call keeps its output dtype (fp32 would hand fp32 to every op after it)
        changes.append(FixChange("unfuse", api, module, line, source))
    if out_dtypes & set(_LOW_PRECISION) and api.rsplit(".", 1)[-1] not in _NO_ARITHMETIC:
        changes.append(FixChange("fp32", api, module, line, source))
    kind = hf32_kind(entry.name)
    if kind is not None and kind in dump.hf32 and "torch.float32" in in_dtypes:
        changes.append(FixChange("hf32_off", api, module, line, source))
    return changes


def _user_line(stack: list[str]) -> tuple[str, str]:
    """(`train.py:16`, its code) of the first frame of a dump's stack (the user's call site)."""
    for frame in stack:
        match = _STACK_LINE.search(frame)
        if match:
            code = frame.split("\n", 1)[1].strip() if "\n" in frame else ""
            return f"{Path(match['file']).name}:{match['line']}", code
    return "", ""


# ---------------------------------------------------------------------------- trials
class TrialRunner:
    """Runs the user's npu-run command with a fix and its own dump, and judges it against golden."""

    def __init__(self, golden: Path, command: list[str], work: Path, divergence_entry: str,
                 thresholds: Thresholds, on_trial=None) -> None:
        self.golden = golden
        self.launcher, arguments = npu_run_launcher(command)
        self.arguments = _without_dump(arguments)
        self.scoped = dumps_a_scope(arguments)
        self.work = work
        self.anchor = divergence_entry
        self.thresholds = thresholds
        self.trials: list[Trial] = []
        self.on_trial = on_trial

    def run(self, changes: list[FixChange]) -> Trial:
        index = len(self.trials)
        folder = self.work / f"trial{index}"
        folder.mkdir(parents=True, exist_ok=True)
        fix_file = folder / "fix.json"
        write_text_atomic(fix_file, PrecisionFix(changes).to_json())
        dump = folder / "dump"
        command = [*self.launcher, "--precision-fix", str(fix_file), "--dump", str(dump), *self.arguments]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            tail = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
            trial = Trial(changes, False, None, None, f"the run failed (exit {completed.returncode}): {tail}")
        else:
            trial = judge(compare_dirs(self.golden, dump, self.thresholds), changes, self.anchor, self.scoped)
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial


def judge(result: CompareResult, changes: list[FixChange], anchor: str, scoped: bool = False) -> Trial:
    """Fixed: the compare names no divergence and leaves no error row unjudged, and the loss (the
    last step's last forward output) is within the warn limit of the run's loosest dtype class (an
    fp16 run's loss carries its logits' rounding). Error rows the search judged as carried, not
    amplified, do not count: a fill made finite differs from golden's -inf where it is masked, and
    nothing downstream sees it. Errors shown: the anchor op's output and the loss.
    scoped: the dumps hold one module's subtree (`--dump-scope`, as --localize dumps it): a divergence
    the compare says came from outside the dumped ops (the gradient the undumped modules after it
    send into it, carrying their fp16 rounding) is not the subtree's own and does not count."""
    rows = result.rows
    at_anchor = max((row.error or 0.0 for row in rows if row.target_entry == anchor and row.role == "output"),
                    default=None)
    loss = None
    for pair in result.pairs:  # the last step's
        # the last forward output before the backward: not clip_grad_norm_'s or the optimizer's ops after it
        backward = min((row.order for row in pair.rows if row.target_entry and row.target_entry.endswith(".backward")),
                       default=math.inf)
        forward_outputs = [row for row in pair.rows if row.role == "output" and row.target_entry
                           and row.target_entry.endswith(".forward") and not row.target_entry.startswith("Module.")
                           and row.order < backward and not row.in_optimizer]
        if forward_outputs:
            loss = max(forward_outputs, key=lambda row: row.order)
    loss_error = None if loss is None else (loss.error or 0.0)
    limit = max(result.thresholds.limits(row.dtype_class).warn_rel_l2 for row in rows) if rows else 0.0
    divergences = [pair.divergence for pair in result.pairs if pair.divergence]
    own = [divergence for divergence in divergences if not (scoped and divergence.outside)]
    errors = result.counts()[ERROR]
    note = f"first divergence {divergences[0].entry}" if divergences else f"no divergence, {errors} error rows"
    if divergences and not own:
        note += " (from outside the dumped subtree)"
    failed = bool(own) or bool(result.problems())
    fixed = not failed and (loss_error is None or loss_error <= limit)
    if not failed and not fixed:
        note += f", loss error above {limit:g}"
    return Trial(changes, fixed, at_anchor, loss_error, note)


def _without_dump(arguments: list[str]) -> list[str]:
    """npu-run's arguments without its own --dump / --precision-fix (each trial sets them); the
    script's own arguments, after its name, are kept as they are."""
    from npukit.launch_options import option_spans, strip_option

    for name in ("--dump", "--precision-fix"):
        arguments = strip_option(arguments, name)
    if not any(option[0].split("=", 1)[0] == "--replay" for option in option_spans(arguments)[0]):
        raise UserError("--find-fix: the command must replay the recorded step (npu-run --replay DIR ...), "
                        "so every trial runs on the same weights and batches as the NPU dump")
    return arguments


def dumps_a_scope(arguments: list[str]) -> bool:
    """npu-run's arguments dump a module subtree (--dump-scope)."""
    from npukit.launch_options import option_spans

    return any(option[0].split("=", 1)[0] == "--dump-scope" for option in option_spans(arguments)[0])


def npu_run_launcher(command: list[str], option: str = "--find-fix") -> tuple[list[str], list[str]]:
    """(how to start npu-run, its arguments): `npu-run` (or `python -m npukit.run`) runs as this
    interpreter's `-m npukit.run`, so the trials use the npukit and torch of this compare. option:
    the npu-compare option the command follows, named in errors."""
    if not command:
        raise UserError("--find-fix needs the npu-run command that wrote the NPU dump after `--`, e.g. "
                        "npu-compare golden npu --find-fix -- npu-run --replay rep --dump npu train.py")
    if Path(command[0]).name == "npu-run":
        return [sys.executable, "-m", "npukit.run"], command[1:]
    for index in range(len(command) - 1):
        if command[index] == "-m" and command[index + 1] == "npukit.run":
            return command[:index + 2], command[index + 2:]
    raise UserError(f"{option}: {' '.join(command)!r} is not an npu-run command (npu-run ... or python -m npukit.run "
                    "...): its re-runs pass it --precision-fix and --dump")


# ---------------------------------------------------------------------------- the search
def find_fix(candidates: list[FixChange], runner: TrialRunner, max_runs: int,
             members: dict[FixChange, list[FixChange]] | None = None) -> list[FixChange] | None:
    """The fewest candidates that fix the run (each one needed), or None when all of them together
    do not. `members`: a grouped candidate (`blocks.*.fc`) -> its blocks' own changes, most likely
    needed last; a grouped candidate in the fix is narrowed to the fewest of them that still fix it."""
    def fixes(changes: list[FixChange]) -> bool | None:
        if len(runner.trials) >= max_runs:
            return None
        return runner.run(changes).fixed

    if not candidates or not fixes(candidates):
        return None
    fix = _needed(list(candidates), [], fixes)
    for change in list(fix):
        blocks = (members or {}).get(change, [])
        if len(blocks) < 2 or len(runner.trials) >= max_runs:
            continue
        at = fix.index(change)
        rest = fix[:at] + fix[at + 1:]
        narrowed = _needed(list(blocks), rest, fixes, last_first=True)
        if len(narrowed) < len(blocks):  # (all of them: the grouped change stays, as it was run)
            fix = fix[:at] + sorted(narrowed, key=_block_indices) + fix[at + 1:]
    return fix


def _block_indices(change: FixChange) -> tuple[int, ...]:
    return tuple(int(part) for part in change.module.split(".") if part.isdigit())


def _needed(pool: list[FixChange], kept: list[FixChange], fixes, last_first: bool = False) -> list[FixChange]:
    """The fewest of `pool` that, with `kept`, fix the run, known: `pool + kept` fixes it and `kept`
    alone does not. The shortest prefix of the pool that fixes it ends with a change that is needed
    (ceil(log2 len(pool)) runs of bisection); that one is kept, and the search goes on in the changes
    before it, first trying those kept alone (one run). `last_first` (the pool's likeliest changes
    last: a grouped change's blocks whose ops are off): each round first tries the pool without its
    last change, so a needed one costs one run, and B blocks that are all needed B runs.
    At the run cap (fixes() gives None): the smallest set known to fix the run."""
    needed: list[FixChange] = []
    alone_fails = True  # needed + kept does not fix it (known for the first round)
    while pool:
        # the shortest prefix of pool that fixes it, with needed + kept: in (failing, fixing]
        fixing, failing = len(pool), 0 if alone_fails else -1
        probes = ([len(pool) - 1] if last_first else []) + ([] if alone_fails else [0])
        while fixing - failing > 1:
            middle = probes.pop(0) if probes else (fixing + failing) // 2
            if not failing < middle < fixing:
                continue
            verdict = fixes(pool[:middle] + needed + kept)
            if verdict is None:
                return pool[:fixing] + needed
            fixing, failing = (middle, failing) if verdict else (fixing, middle)
        if fixing == 0:
            break  # those kept fix it alone
        needed.insert(0, pool[fixing - 1])
        pool = pool[:fixing - 1]
        alone_fails = False  # not known: tried first in the next round
    return needed


def run_find_fix(golden: Path, target: Path, result: CompareResult, command: list[str], *, work: Path,
                 max_runs: int, console, thresholds: Thresholds) -> FixResult | None:
    """The fix finder's search, or None when the compare leaves nothing to fix (no divergence,
    no unjudged error row, the loss within tolerance)."""
    anchor = anchor_entry(result)
    before = judge(result, [], anchor[1], dumps_a_scope(npu_run_launcher(command)[1])) if anchor is not None else None
    if before is None or before.fixed:
        return None  # nothing to fix
    anchor_name = anchor[1]
    candidates, blocks = candidates_with_blocks(result)
    if not candidates:
        return FixResult([], before, None, None, [], anchor_name)
    steps = math.ceil(math.log2(max(len(candidates), 2)))
    console.print(f"find-fix: {len(candidates)} candidate change(s) around {anchor_name}; a fix of d changes takes at "
                  f"most 1 + {steps + 1}*d runs of the step, and narrowing a change made in every block to b of its B "
                  f"blocks b*(ceil(log2 B) + 2) + 2 more, B if all (at most {max_runs} runs: --find-fix-runs)")
    for index, change in enumerate(candidates):
        console.print(f"  [{index}] {change.describe()}")
    started = time.perf_counter()
    group_of = {member: group for group, members in blocks.items() for member in members}

    def label(change: FixChange) -> str:
        if change in group_of:  # one block of a grouped candidate: [2] blocks.6.fc
            return f"[{candidates.index(group_of[change])}] {change.module}"
        return f"[{candidates.index(change)}]"

    def show(trial: Trial) -> None:
        what = ", ".join(label(c) for c in trial.changes)
        console.print(f"  run {len(runner.trials)}: {what or 'nothing'} -> {'FIXED' if trial.fixed else 'not fixed'}; "
                      f"error at {runner.anchor} {_fmt(trial.divergence_error)}, at the loss {_fmt(trial.loss_error)}"
                      f" ({trial.note}; {time.perf_counter() - started:.1f} s)")

    runner = TrialRunner(golden, command, work, anchor_name, thresholds, on_trial=show)
    if console.is_terminal:  # a bar while each run of the step goes (seconds to minutes)
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("find-fix: run {task.completed:.0f} (at most {task.total:.0f})"), BarColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("runs", total=max_runs)
            runner.on_trial = lambda trial: (progress.advance(task), show(trial))
            fix = find_fix(candidates, runner, max_runs, blocks)
    else:
        fix = find_fix(candidates, runner, max_runs, blocks)
    after = next((t for t in reversed(runner.trials) if t.fixed and set(t.changes) == set(fix)), None) if fix else None
    return FixResult(candidates, before, fix, after, runner.trials, anchor_name)


def print_fix(fix_result: FixResult, console) -> None:
    if fix_result.fix is None:
        reason = "no candidate change applies to the divergent ops" if not fix_result.candidates else \
            "even all candidate changes together do not bring the run within tolerance"
        console.print(f"find-fix: no fix found ({reason}; {len(fix_result.trials)} runs).")
        return
    before, after = fix_result.before, fix_result.after
    console.print(f"find-fix: fixed by {len(fix_result.fix)} change(s) in {len(fix_result.trials)} runs:")
    for change in fix_result.fix:
        console.print(f"  {change.describe()}")
    kinds = {change.kind for change in fix_result.fix}
    built = "the model and its optimizer are" if "fp32_master" in kinds else "the model is"
    how = [f"pasted once {built} built"] if kinds - {"unfuse"} else []
    if "unfuse" in kinds:  # a call replaced at its line
        how.append("an unfused op's function put in its file and called at the line shown")
    console.print(f"  as code (it runs as printed, {'; '.join(how)}):")
    for line in fix_code(fix_result.fix).splitlines():
        console.print(f"      {line}" if line else "", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  error at {fix_result.divergence}: {_fmt(before.divergence_error)} -> "
                  f"{_fmt(after.divergence_error if after else None)}; at the loss: {_fmt(before.loss_error)} -> "
                  f"{_fmt(after.loss_error if after else None)}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
