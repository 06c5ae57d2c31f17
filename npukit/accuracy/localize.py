"""`npu-compare --trend GOLDEN NPU --localize -- npu-run ... train.py`: from "the NPU run left the
golden band at step S in module M" to the op and the fix, in one command.

The trend names the first step S and module M the NPU run departs at (trend.py). Two re-runs of
the user's npu-run command then make step S comparable on its own (a departing weight: step S-1,
whose update wrote the weight recorded at step S's start; made_in_step):

1. the golden re-run (the command with `--golden`) records the state at step S's start (every root
   module's and optimizer's: `--replay DIR --replay-step S`, replay.py) and dumps step S, tensors;
2. the NPU re-run loads that state at step S's start and dumps step S: after S steps its weights had
   drifted, and step S would differ from its first op on; from the golden state, what differs is
   what step S's own ops do.

Both dump M's subtree only (`--dump-scope M`: M's and its sub-modules' calls, the ops they run, the
optimizer's foreach updates of their parameters; the departure's record names M: a parameter's
module, a module output's, trend.module_scope): a large model's whole step is gigabytes of tensors.
Both stop once step S ended (`--stop-after-step S`): the rest of the run is not needed. When the
compare of the two subtree dumps names its first divergence at an op of the subtree, that is the
answer: the fix finder re-runs the NPU command (with the same replay, step and scope) with each
candidate, so the fix it proves is proved on step S from the golden state (a trial's divergence
the compare says came from outside the subtree, the undumped modules' rounding reaching it, is not
the subtree's: fix_finder.judge). The subtree cannot answer, and both re-runs are made again dumping step S whole (said once, with why), when:

- the compare says the difference came into the subtree from outside the dumped ops
  (Divergence.outside: M's forward input already differs, or the gradient arriving at M's backward,
  which the modules after M compute: an fp16 head's rounding);
- it names no divergence of the subtree's own (the step's may lie outside it: an optimizer that
  updates weights one by one runs in no module, so its ops are not in a scope);
- the departure names no module (the loss, the gradient norm, a root module's own parameter), or
  the dump holds no call of M (a root module's output is named by its class).

The subtree's dumps are then kept in `subtree/` beside the whole step's.

The steps before S are fast-forwarded (`--fast-forward`, fast_forward.py: the script's loop runs, its
heavy ops skipped): the NPU re-run to S, where it loads the golden state anyway; the golden re-run to
the golden monitor's latest checkpoint at or before S (`--monitor-checkpoint-every`,
step_checkpoints.py), from which it computes to S; without one it computes from the beginning. A
fast-forwarded re-run that fails (the script failed on the zeros, or ended before the step) is said
once and made again from the beginning, every step computed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from npukit.errors import UserError
from npukit.launch_options import option_spans

# npu-run's options a re-run sets itself, or that would write into the user's own folders
_REPLACED = ("--dump", "--dump-mode", "--dump-level", "--dump-steps", "--dump-scope", "--dump-list", "--dump-config",
             "--dump-tensor-format", "--replay", "--replay-step", "--stop-after-step", "--precision-fix",
             "--monitor", "--monitor-dir", "--monitor-every", "--monitor-modules", "--monitor-config",
             "--monitor-checkpoint-every", "--fast-forward",
             "--golden", "--golden-perturb", "--perturb-seed", "--profile", "--profile-steps", "--detect-overflow", "--overflow-action",
             "--overflow-max", "--overflow-dir", "--overflow-level", "--overflow-underflow")


def rerun_commands(command: list[str], step: int, work: Path, golden_from: Path | None = None,
                   npu_fast_forward: bool = False, scope: str | None = None) -> tuple[list[str], list[str]]:
    """(the golden re-run, the NPU re-run) of the user's npu-run command to `step`, dumping that step
    into work/golden and work/npu. golden_from: a golden monitor's checkpoint the golden re-run
    fast-forwards to and starts computing from; npu_fast_forward: the NPU re-run fast-forwards to
    `step` (where it loads the golden state anyway); scope: dump only that module's subtree
    (`--dump-scope`), else the whole step."""
    from npukit.accuracy.fix_finder import npu_run_launcher

    launcher, arguments = npu_run_launcher(command, "--localize")
    options, script = option_spans(arguments)
    if not script:
        raise UserError(f"--localize: {' '.join(command)!r} names no script to run")
    kept = [token for option in options if option[0].split("=", 1)[0] not in _REPLACED for token in option]
    common = ["--replay", str(work / "replay"), "--replay-step", str(step), "--dump-mode", "tensor",
              "--dump-steps", str(step), "--stop-after-step", str(step),
              *(["--dump-scope", scope] if scope is not None else [])]
    golden_start = ["--fast-forward", str(golden_from)] if golden_from is not None else []
    npu_start = ["--fast-forward", str(work / "replay")] if npu_fast_forward else []
    golden = [*launcher, *kept, "--golden", *golden_start, *common, "--dump", str(work / "golden"), *script]
    npu = [*launcher, *kept, *npu_start, *common, "--dump", str(work / "npu"), *script]
    return golden, npu


def run_rerun(command: list[str], what: str) -> None:
    failure = try_rerun(command)
    if failure is not None:
        raise UserError(f"--localize: the {what} re-run failed {failure}")


def try_rerun(command: list[str]) -> str | None:
    """None when the re-run succeeded, else what failed: its exit code, command and last lines."""
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode == 0:
        return None
    tail = "\n".join(completed.stderr.strip().splitlines()[-6:]) or "(no output)"
    return f"(exit {completed.returncode}):\n  {' '.join(command)}\n{tail}"


def fast_forwarded_rerun(fast: list[str], full: list[str], what: str, console, outputs: list[Path],
                         checkpoint: Path | None = None) -> list[str]:
    """Run `fast` (a fast-forwarding re-run); when it fails (the script failed on the skipped steps'
    zeros, or ended before the step), say so once, remove what it wrote and run `full` instead.
    A failure that names `checkpoint` is the checkpoint's (another script's, unreadable): an error.
    Returns the command that ran."""
    failure = try_rerun(fast)
    if failure is None:
        return fast
    if checkpoint is not None and str(checkpoint) in failure:
        raise UserError(f"--localize: the golden monitor's checkpoint {checkpoint} does not fit this run "
                        f"{failure}")
    exit_code, *lines = failure.splitlines()
    # the script's error (a traceback's last line, npu-run's error), not the notes npukit's readers add after it
    reason = next((line.strip() for line in reversed(lines) if line.strip() and not line.startswith("npukit")), "")
    console.print(f"localize: the fast-forwarded {what} re-run failed {exit_code.rstrip(':')} ({reason}): "
                  "re-running it from the script's beginning, every step computed")
    for output in outputs:
        shutil.rmtree(output, ignore_errors=True)
    run_rerun(full, what)
    return full


def localize(departure, command: list[str], work: Path, console, find_fix_runs: int, top: int,
             workers: int | None, golden_monitor: Path | None = None) -> int:
    """Re-run both sides at the departure's step, dumping its module's subtree (or the whole step:
    see the module docstring), compare, find the fix. The compare's exit code. golden_monitor: the
    golden run's monitor folder, whose checkpoints (--monitor-checkpoint-every) the golden re-run
    starts from."""
    from npukit.accuracy.cli_compare import FindFixOptions, run_compare
    from npukit.accuracy.compare import compare_dirs

    if work.exists() and any(work.iterdir()):
        raise UserError(f"--localize-dir: {work} is not empty (it holds an earlier localization): "
                        "remove it or name another")
    step, scope = made_in_step(departure), departure.scope
    work.mkdir(parents=True, exist_ok=True)
    if step != departure.first_step:
        console.print(f"localize: {departure.record()} at step {departure.first_step} is the weight step {step}'s "
                      f"update wrote: localizing step {step}")
    result = None
    if scope is None:
        console.print(f"localize: the departure ({departure.what()}) names no module: dumping step {step} whole")
    else:
        console.print(f"localize: dumping step {step}'s {scope} subtree (npu-run --dump-scope {scope})")
        npu = _reruns(departure, command, work, console, golden_monitor, scope)
        widen = _why_whole(work, scope, step)
        if widen is None:
            result = compare_dirs(work / "golden", work / "npu", workers=workers)
            widen = _outside(result, scope, step)
        if widen is None:
            console.print(f"localize: the first divergence is inside {scope}'s subtree: compared, and the fix "
                          "found, on its dumps")
        else:
            console.print(f"localize: {widen}: dumping step {step} whole")
            result = None
            kept = work / "subtree"  # (small: kept for a look at what the subtree showed)
            kept.mkdir()
            for side in ("golden", "npu"):
                (work / side).rename(kept / side)
            shutil.rmtree(work / "replay")  # the golden re-run records it again
    if result is None:
        npu = _reruns(departure, command, work, console, golden_monitor, None)
    fix = FindFixOptions(npu, max_runs=find_fix_runs, work=work / "find-fix", json_path=work / "find-fix.json")
    return run_compare(work / "golden", work / "npu", None, work / "compare.json", work / "compare.html", top, [],
                       workers, console, find_fix=fix, result=result)


def _reruns(departure, command: list[str], work: Path, console, golden_monitor: Path | None,
            scope: str | None) -> list[str]:
    """The golden and the NPU re-run to the departure's step, each saying which path it took; the NPU
    command that ran (the fix finder re-runs it)."""
    from npukit.accuracy.step_checkpoints import latest_checkpoint

    step = made_in_step(departure)
    checkpoint = latest_checkpoint(golden_monitor, step) if golden_monitor is not None else None
    golden_full, npu_full = rerun_commands(command, step, work, scope=scope)
    golden_fast, npu_fast = rerun_commands(command, step, work, checkpoint[1] if checkpoint else None, True, scope)
    where = f"step {step} (where {departure.module()} departs)"
    if checkpoint is None:
        console.print(f"localize: re-running the golden run to {where}, steps 0-{step} computed (its monitor "
                      "wrote no checkpoint at or before the step: npu-run --monitor-checkpoint-every); its state "
                      "at the step's start recorded")
        run_rerun(golden_full, "golden")
    else:
        start, folder = checkpoint
        console.print(f"localize: re-running the golden run to {where} from its monitor's checkpoint {folder}: "
                      f"steps {_steps(0, start - 1)} fast-forwarded, steps {start}-{step} computed; its state at "
                      "the step's start recorded")
        fast_forwarded_rerun(golden_fast, golden_full, "golden", console, [work / "golden", work / "replay"], folder)
    console.print(f"localize: re-running the NPU run to {where}: steps {_steps(0, step - 1)} fast-forwarded, "
                  f"step {step} computed from the golden state at its start")
    return fast_forwarded_rerun(npu_fast, npu_full, "NPU", console, [work / "npu"])


def made_in_step(departure) -> int:
    """The step whose ops made the departing record: a weight is recorded as its step's optimizer
    starts, so a weight departing at step S holds what step S-1's update wrote (re-running step S
    from the golden state would load that very weight back and find nothing); every other record
    (activations, gradients, Adam's state and update ratio, the loss) is its own step's."""
    if departure.kind == "weight" and departure.first_step > 0:
        return departure.first_step - 1
    return departure.first_step


def _why_whole(work: Path, scope: str, step: int) -> str | None:
    """Why the subtree dumps cannot be compared for the step: the golden one holds no call of the module
    (a root module's output is named by its class, which no module path is)."""
    from npukit.accuracy import naming
    from npukit.files import load_json

    for found in sorted((work / "golden").glob("*/*/dump.json")):
        for name in load_json(found).get("data") or {}:
            path = naming.module_path_of(name)
            if path is not None and (path == scope or path.startswith(scope + ".")):
                return None
    return f"step {step}'s dump holds no call of a module {scope}"


def _outside(result, scope: str, step: int) -> str | None:
    """Why the subtree's compare does not answer, when it does not: it names no divergence of its own (the
    step's may be outside the subtree: an optimizer updating weights one by one runs in no module), or its
    first divergence came into the subtree from outside it (its forward input, the gradient arriving at
    its backward)."""
    divergences = [pair.divergence for pair in result.pairs if pair.divergence is not None]
    if not divergences:
        return f"{scope}'s subtree shows no divergence of its own at step {step} (its cause may lie outside it)"
    outside = next((divergence for divergence in divergences if divergence.outside), None)
    if outside is None:
        return None
    clause = re.split(r"[;:] |\. ", outside.reason, maxsplit=1)[0]
    return f"the difference reaches {scope} from outside it ({outside.entry}: {clause})"


def _steps(first: int, last: int) -> str:
    return "none" if last < first else f"{first}-{last}"
