"""`npu-compare --trend GOLDEN NPU --localize -- npu-run ... train.py`: from "the NPU run left the
golden band at step S in module M" to the op and the fix, in one command.

The trend names the first step S and module M the NPU run departs at (trend.py). Two re-runs of
the user's npu-run command then make step S comparable on its own:

1. the golden re-run (the command with `--golden`) records the state at step S's start (every root
   module's and optimizer's: `--replay DIR --replay-step S`, replay.py) and dumps step S, tensors;
2. the NPU re-run loads that state at step S's start and dumps step S: after S steps its weights had
   drifted, and step S would differ from its first op on; from the golden state, what differs is
   what step S's own ops do.

Both dump step S whole, not M's subtree alone: the gradient arriving at M's backward comes from the
modules after it, and a dump without them reads a difference there (an fp16 head's rounding) as
changed outside the dumped ops. Both stop once step S ended (`--stop-after-step S`): the rest of
the run is not needed. The compare of the two dumps names the op; the fix finder re-runs the NPU
command (with the same replay and step) with each candidate, so the fix it proves is proved on
step S from the golden state.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from npukit.errors import UserError
from npukit.launch_options import option_spans

# npu-run's options a re-run sets itself, or that would write into the user's own folders
_REPLACED = ("--dump", "--dump-mode", "--dump-level", "--dump-steps", "--dump-scope", "--dump-list", "--dump-config",
             "--dump-tensor-format", "--replay", "--replay-step", "--stop-after-step", "--precision-fix",
             "--monitor", "--monitor-dir", "--monitor-every", "--monitor-modules", "--monitor-config",
             "--golden", "--golden-perturb", "--perturb-seed", "--profile", "--profile-steps", "--detect-overflow", "--overflow-action",
             "--overflow-max", "--overflow-dir", "--overflow-level", "--overflow-underflow")


def rerun_commands(command: list[str], step: int, work: Path) -> tuple[list[str], list[str]]:
    """(the golden re-run, the NPU re-run) of the user's npu-run command to `step`, dumping that step
    into work/golden and work/npu."""
    from npukit.accuracy.fix_finder import npu_run_launcher

    launcher, arguments = npu_run_launcher(command, "--localize")
    options, script = option_spans(arguments)
    if not script:
        raise UserError(f"--localize: {' '.join(command)!r} names no script to run")
    kept = [token for option in options if option[0].split("=", 1)[0] not in _REPLACED for token in option]
    common = ["--replay", str(work / "replay"), "--replay-step", str(step), "--dump-mode", "tensor",
              "--dump-steps", str(step), "--stop-after-step", str(step)]
    golden = [*launcher, *kept, "--golden", *common, "--dump", str(work / "golden"), *script]
    npu = [*launcher, *kept, *common, "--dump", str(work / "npu"), *script]
    return golden, npu


def run_rerun(command: list[str], what: str) -> None:
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-6:]) or "(no output)"
        raise UserError(f"--localize: the {what} re-run failed (exit {completed.returncode}):\n  "
                        f"{' '.join(command)}\n{tail}")


def localize(departure, command: list[str], work: Path, console, find_fix_runs: int, top: int,
             workers: int | None) -> int:
    """Re-run both sides at the departure's step, compare, find the fix. The compare's exit code."""
    from npukit.accuracy.cli_compare import FindFixOptions, run_compare

    if work.exists() and any(work.iterdir()):
        raise UserError(f"--localize-dir: {work} is not empty (it holds an earlier localization): "
                        "remove it or name another")
    work.mkdir(parents=True, exist_ok=True)
    step = departure.first_step
    golden, npu = rerun_commands(command, step, work)
    where = f"step {step} (where {departure.module()} departs)"
    console.print(f"localize: re-running the golden run to {where} (its state at the step's start recorded)")
    run_rerun(golden, "golden")
    console.print(f"localize: re-running the NPU run to {where}, from the golden state at the step's start")
    run_rerun(npu, "NPU")
    fix = FindFixOptions(npu, max_runs=find_fix_runs, work=work / "find-fix", json_path=work / "find-fix.json")
    return run_compare(work / "golden", work / "npu", None, work / "compare.json", work / "compare.html", top, [],
                       workers, console, find_fix=fix)
