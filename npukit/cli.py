"""Console entry points: npu-migrate, npu-run, npu-compare, npu-profile (typer apps).

Heavy modules (torch, libcst) are imported inside the commands so `--help` stays instant.
Each section below belongs to one subpackage; its command only parses options and calls
that subpackage's API.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from npukit.errors import UserError


def _hide_flag_types() -> None:
    """typer shows `<bool>` after every flag in --help, as if it took a value, and `<list[str]>` after
    arguments whose name already says what they take: show nothing there."""
    core = getattr(typer, "core", None)
    for class_name, hidden in (("TyperOption", lambda p: getattr(p, "is_flag", False)),
                               ("TyperArgument", lambda p: getattr(p, "metavar", None) is not None)):
        param_class = getattr(core, class_name, None)
        original = getattr(param_class, "display_type_rich", None)
        if original is None or getattr(original, "_npukit", False):
            continue

        def display_type_rich(self, ctx, _original=original, _hidden=hidden):
            return None if _hidden(self) else _original(self, ctx)

        display_type_rich._npukit = True
        param_class.display_type_rich = display_type_rich


_hide_flag_types()


def _run_app(app: typer.Typer) -> None:
    """Run a typer app, turning UserError into a one-line message and exit code 2."""
    try:
        app()
    except UserError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)


# ----------------------------------------------------------------------------- npu-run
run_app = typer.Typer(add_completion=False, help="Run a script on the emulated Ascend NPU.")


@run_app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run(
    script: str = typer.Argument(..., metavar="SCRIPT", help="Python script to run (or -m MODULE via --module)."),
    args: list[str] = typer.Argument(None, metavar="ARGS", help="Arguments passed to the script."),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module, like python -m."),
    devices: int = typer.Option(8, "--devices", help="Number of emulated NPUs (NPUKIT_DEVICE_COUNT)."),
    emulate: bool = typer.Option(False, "--emulate", help="Use the emulator even if a real torch_npu is installed."),
    transfer_to_npu: bool = typer.Option(False, "--transfer-to-npu", help="Run unmigrated CUDA code: apply torch_npu.contrib.transfer_to_npu first."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Launch N processes via torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", help="With --nproc-per-node: nodes in the run (torchrun's c10d rendezvous)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="With --nnodes > 1: HOST:PORT of the rendezvous."),
    rdzv_conf: Optional[str] = typer.Option(None, "--rdzv-conf", help="torchrun's --rdzv-conf, e.g. is_host=1 on the node hosting the rendezvous."),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", help="torchrun's --local-addr: this node's address for the other nodes."),
    golden: bool = typer.Option(False, "--golden", help="Golden run: NPU numerics off, autocast regions computed in fp32."),
    golden_perturb: Optional[str] = typer.Option(None, "--golden-perturb", metavar="PRECISION", help="A second golden run (implies --golden) with each op's output rounded at the NPU run's precision on a grid of its own: fp16 | bf16 | hf32 | fp32 (the band of npu-compare --trend)."),
    perturb_seed: int = typer.Option(0, "--perturb-seed", help="With --golden-perturb: the seed of its rounding grid; a second perturbed run with another seed (monitor it into GOLDEN.perturbed.1) widens npu-compare --trend's band by a second draw."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch, numpy and random before the script runs."),
    dump: Optional[Path] = typer.Option(None, "--dump", help="Dump per-layer tensors into DIR."),
    dump_level: str = typer.Option("mix", "--dump-level", help="module | api | mix"),
    dump_mode: str = typer.Option("stats", "--dump-mode", help="stats | tensor | md5"),
    dump_tensor_format: str = typer.Option("pt", "--dump-tensor-format", help="pt (msprobe's: a file per leaf) | npy (smaller, faster; npu-compare only) tensor files"),
    dump_steps: Optional[str] = typer.Option(None, "--dump-steps", help="Steps to dump, e.g. 0,2-4."),
    dump_scope: Optional[str] = typer.Option(None, "--dump-scope", help="Only names under these scopes (comma list)."),
    dump_list: Optional[str] = typer.Option(None, "--dump-list", help="Only these module/op names (comma list)."),
    dump_ops: Optional[str] = typer.Option(None, "--dump-ops", help="Which apis: focus (default: what msprobe records by default) | core | msprobe-all | all (also views, slicing, copies msprobe never hooks)."),
    dump_config: Optional[Path] = typer.Option(None, "--dump-config", help="msprobe's config.json (task, level, step, rank, scope, list, risk_level): one config for both tools."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Save (first run) or load (second run) initial weights, first batches and random number generator states in DIR."),
    replay_step: int = typer.Option(0, "--replay-step", metavar="N", help="With --replay: at the start of training step N instead: weights, buffers, optimizer and GradScaler state, and the batches from there. Steps are counted as --monitor counts them: at each optimizer step or, without an optimizer (weights updated by hand), at each new forward with gradients of the first model."),
    stop_after_step: Optional[int] = typer.Option(None, "--stop-after-step", metavar="N", help="End the run (exit 0) once training step N (0-based, counted as --monitor counts steps) has ended; without an optimizer, as the first model starts its forward with gradients for step N+1."),
    precision_fix: Optional[Path] = typer.Option(None, "--precision-fix", help="Apply a precision fix (JSON, as npu-compare --find-fix writes it) without editing the code."),
    detect_overflow: bool = typer.Option(False, "--detect-overflow", help="Name the first op that overflows."),
    overflow_action: str = typer.Option("report", "--overflow-action", help="report | dump | stop"),
    overflow_max: int = typer.Option(20, "--overflow-max", help="Stop recording after N overflow events."),
    overflow_dir: Path = typer.Option(Path("overflow"), "--overflow-dir", help="Where overflow.json (and dumps) go."),
    overflow_level: str = typer.Option("api", "--overflow-level", help="api (every op) | module (module outputs and gradients only, cheapest)"),
    overflow_underflow: bool = typer.Option(False, "--overflow-underflow", help="Also list fp16/bf16 ops that flush values to zero."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Record a profile into DIR."),
    profile_steps: Optional[str] = typer.Option(None, "--profile-steps", help="wait,warmup,active steps"),
    monitor: Optional[Path] = typer.Option(None, "--monitor", "--monitor-dir", help="Record per-step statistics of every module into DIR (CSV, TensorBoard) and alert while training."),
    monitor_every: int = typer.Option(1, "--monitor-every", help="With --monitor: every N steps (msprobe's step_interval)."),
    monitor_modules: Optional[str] = typer.Option(None, "--monitor-modules", metavar="PATTERN", help="With --monitor: only modules whose dotted path matches this regular expression."),
    monitor_config: Optional[Path] = typer.Option(None, "--monitor-config", help="With --monitor: msprobe monitor's config.json (step_interval, start_step, targets, format, AnomalyTurbulence)."),
    monitor_checkpoint_every: Optional[int] = typer.Option(None, "--monitor-checkpoint-every", metavar="K", help="With --monitor: every K steps record the state at the step's start (weights, optimizer and GradScaler state, random generators; as --replay-step records it) into DIR/checkpoints/step-N, where npu-compare --trend --localize starts its golden re-run. Every checkpoint is kept."),
    fast_forward: Optional[Path] = typer.Option(None, "--fast-forward", metavar="DIR", help="DIR is a recorded --replay folder or a monitor checkpoint of step N's start: steps 0 to N-1 run the script's loop with the model's matrix products, convolutions, attention and optimizer updates skipped (zero-filled), and step N's start loads DIR's state, so the run is exact from step N on."),
) -> None:
    from npukit.run import RunOptions, main

    options = RunOptions(
        script=script, args=list(args or []), module=module, devices=devices, emulate=emulate, transfer_to_npu=transfer_to_npu, golden_perturb=golden_perturb, perturb_seed=perturb_seed,
        nproc_per_node=nproc_per_node, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, local_addr=local_addr, golden=golden, seed=seed,
        dump=dump, dump_level=dump_level, dump_mode=dump_mode, dump_tensor_format=dump_tensor_format, dump_steps=dump_steps,
        dump_scope=dump_scope, dump_list=dump_list, dump_ops=dump_ops, dump_config=dump_config, replay=replay, replay_step=replay_step, stop_after_step=stop_after_step,
        precision_fix=precision_fix,
        detect_overflow=detect_overflow, overflow_action=overflow_action,
        overflow_max=overflow_max, overflow_dir=overflow_dir, overflow_level=overflow_level,
        overflow_underflow=overflow_underflow,
        profile=profile, profile_steps=profile_steps,
        monitor=monitor, monitor_every=monitor_every, monitor_modules=monitor_modules, monitor_config=monitor_config,
        monitor_checkpoint_every=monitor_checkpoint_every, fast_forward=fast_forward,
    )
    raise typer.Exit(main(options))


def run_main() -> None:
    _run_app(run_app)


# ------------------------------------------------------------------------- npu-migrate
migrate_app = typer.Typer(add_completion=False, help="Rewrite CUDA PyTorch code into torch_npu code.")

# (section owned by npukit.migrate)
@migrate_app.command()
def migrate(
    path: Path = typer.Argument(..., metavar="PATH", help="Repository folder or single file to migrate."),
    out: Path | None = typer.Option(None, "--out", help="Write a migrated copy of PATH into DIR (PATH is not touched)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Analyse and report only; write nothing."),
    diff: bool = typer.Option(False, "--diff", help="Print the rewrite as a unified diff; write nothing."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if anything would change (for CI); write nothing."),
    runtime: bool = typer.Option(False, "--runtime", help="Do not rewrite; insert torch_npu's transfer_to_npu import at entry points."),
    force: bool = typer.Option(False, "--force", help="Rewrite in place even if the git tree has uncommitted changes."),
    report: Path | None = typer.Option(None, "--report", help="Write report.json, report.md, change_list.csv, unsupported_api.csv, report.sarif into DIR."),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="Worker processes (default: all cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary; errors only."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (the summary goes to stderr)."),
    codemod: list[str] = typer.Option(None, "--codemod", metavar="PKG.MODULE.CLASS",
                                      help="Also run this libcst codemod of yours after the built-in rules (repeatable; see docs/migrate.md)."),
    fused: bool = typer.Option(False, "--fused", help="Also rewrite flash_attn and apex calls to torch_npu fused ops and torch equivalents (see docs/migrate.md)."),
) -> None:
    from npukit.migrate.cli_support import main

    options_kwargs = dict(target=path, out=out, dry_run=dry_run, diff=diff, check=check, runtime=runtime,
                          force=force, jobs=jobs, report_dir=report, quiet=quiet, codemods=tuple(codemod or ()), fused=fused)
    raise typer.Exit(main(json_output=json_output, **options_kwargs))



def migrate_main() -> None:
    _run_app(migrate_app)


# ------------------------------------------------------------------------- npu-compare
compare_app = typer.Typer(add_completion=False, help="Compare a golden dump with an NPU dump, layer by layer.")

# (section owned by npukit.accuracy)


@compare_app.command()
def compare(
    golden: Optional[Path] = typer.Argument(None, metavar="GOLDEN", help="Golden dump directory (npu-run --golden --dump DIR, or msprobe)."),
    target: Optional[Path] = typer.Argument(None, metavar="TARGET", help="Target (NPU) dump directory."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write every row to this CSV (msprobe columns first)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the result as JSON."),
    html_path: Optional[Path] = typer.Option(None, "--html", help="Write one self-contained HTML report."),
    top: int = typer.Option(20, "--top", help="Rows shown in the terminal (worst first)."),
    thresholds: list[str] = typer.Option(
        None, "--set", metavar="KEY=VALUE", help="Override a limit, e.g. --set bf16.warn_rel_l2=0.05 (repeatable)."
    ),
    workers: Optional[int] = typer.Option(None, "--workers", help="Processes for the step/rank pairs and tensor metrics (default: CPU count)."),
    find_fix: bool = typer.Option(False, "--find-fix", help="Find the smallest precision fix: re-run the step with "
                                  "candidate changes (the npu-run command that wrote TARGET follows `--`)."),
    find_fix_runs: int = typer.Option(20, "--find-fix-runs", help="At most this many runs of the step."),
    find_fix_dir: Optional[Path] = typer.Option(None, "--find-fix-dir", help="Where the trial runs go (default: TARGET.find-fix)."),
    find_fix_json: Optional[Path] = typer.Option(None, "--find-fix-json", help="Write the fix finder's result as JSON."),
    command: list[str] = typer.Argument(None, metavar="[-- NPU-RUN COMMAND]", help="With --find-fix: the command that wrote TARGET."),
    precheck: Optional[Path] = typer.Option(None, "--precheck", metavar="DUMP", help="Instead: re-run every op of one dump "
                                            "on the NPU, the CPU (fp32) and in fp64, and judge each on its own (no GOLDEN)."),
    precheck_dir: Optional[Path] = typer.Option(None, "--precheck-dir", help="Where --precheck writes msprobe's CSV files (default: DUMP.precheck)."),
    trend: bool = typer.Option(False, "--trend", help="Instead: GOLDEN and TARGET are monitors (npu-run --monitor); name the first step "
                               "and module where TARGET leaves the band of GOLDEN and the perturbed golden run."),
    perturbed: Optional[list[Path]] = typer.Option(None, "--perturbed", metavar="DIR", help="With --trend: a perturbed golden "
                                                   "run's monitor (npu-run --golden-perturb); repeat it for each perturbed run "
                                                   "(default: GOLDEN.perturbed and GOLDEN.perturbed.*)."),
    localize: bool = typer.Option(False, "--localize", help="With --trend: re-run the golden and NPU runs to the step the "
                                  "NPU run departs at (the npu-run command of the NPU run follows `--`), the NPU one from the "
                                  "golden state at that step's start; compare that step and find the fix."),
    localize_dir: Optional[Path] = typer.Option(None, "--localize-dir", help="Where --localize's re-runs, dumps and "
                                                "reports go (default: TARGET.localize)."),
) -> None:
    """Compare GOLDEN and TARGET dumps; name the first op whose error is amplified. Exit 1 if one is found."""
    from npukit.accuracy.cli_compare import FindFixOptions, run_compare, run_precheck_command
    from npukit.console import make_console

    if precheck is not None:
        given = [name for name, value in (("GOLDEN/TARGET", golden or target), ("--csv", csv_path), ("--json", json_path),
                                          ("--html", html_path), ("--find-fix", find_fix or command)) if value]
        if given:
            raise UserError(f"--precheck DUMP judges one dump on its own: {', '.join(given)} not with it")
        sys.exit(run_precheck_command(precheck, precheck_dir, top, make_console(), workers))
    if golden is None or target is None:
        raise UserError("expected two dump directories, GOLDEN and TARGET (or --precheck DUMP)")
    if trend:
        from npukit.accuracy.cli_compare import run_trend_command

        given = [name for name, value in (("--find-fix", find_fix or (command and not localize)), ("--set", thresholds),
                                          ("--workers", workers and not localize)) if value]
        if given:
            raise UserError(f"--trend compares monitors, not dumps: {', '.join(given)} not with it")
        if localize and not command:
            raise UserError("--localize re-runs the NPU run: its npu-run command follows `--`, e.g. npu-compare --trend "
                            "mon/golden mon/npu --localize -- npu-run --monitor mon/npu train.py")
        localizing = FindFixOptions(list(command), find_fix_runs, localize_dir or target.with_name(target.name + ".localize")) \
            if localize else None
        sys.exit(run_trend_command(golden, target, perturbed, csv_path, json_path, html_path, top, make_console(),
                                   localize=localizing, workers=workers))
    if perturbed or localize or localize_dir is not None:
        raise UserError("--perturbed, --localize and --localize-dir go with --trend (they read monitors)")

    fix_options = FindFixOptions(list(command or []), find_fix_runs, find_fix_dir, find_fix_json) if find_fix else None
    if command and not find_fix:
        raise UserError(f"unexpected arguments {' '.join(command)!r}: a command after GOLDEN TARGET is for --find-fix")
    code = run_compare(golden, target, csv_path, json_path, html_path, top, thresholds or [], workers, make_console(),
                       find_fix=fix_options)
    sys.exit(code)


def compare_main() -> None:
    _run_app(compare_app)


# ------------------------------------------------------------------------- npu-profile
profile_app = typer.Typer(add_completion=False, help="Op hotspots, estimated NPU time, diff and advice.")

# (section owned by npukit.profiler)
@profile_app.command(
    help="Summarize a profile: `npu-profile DIR`. Compare two profiles: `npu-profile diff A B`.",
)
def profile(
    paths: list[str] = typer.Argument(..., metavar="DIR | diff A B", help="Profile directory, or `diff A B`."),
    group_by: str = typer.Option("op", "--group-by", "-g", help="op | shape | module | stack"),
    top: int = typer.Option(20, "--top", "-n", min=1, help="Rows to show."),
    chip: str | None = typer.Option(None, "--chip", help="Estimate NPU time per op: 910B2 | 910B3 | 910B4 | 910A."),
    bandwidth: float | None = typer.Option(None, "--bandwidth", help="Chip memory bandwidth in GB/s (overrides the chip's)."),
    advise: bool = typer.Option(False, "--advise", help="Run the advisor rules and print findings."),
    rank: int | None = typer.Option(None, "--rank", help="Show this rank alone (default with several ranks: all)."),
    ranks: str | None = typer.Option(None, "--ranks", help="Cluster view of these ranks: all | 0,2-3 "
                                     "(the default when DIR holds several ranks)."),
    csv_path: Path | None = typer.Option(None, "--csv", help="Write all rows as CSV to this file."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the full result as JSON to this file."),
    trace_path: Path | None = typer.Option(None, "--trace", help="Cluster view: write one Chrome/Perfetto trace, "
                                           "a process per rank."),
) -> None:
    from npukit.profiler.commands import run_cluster, run_diff, run_summary, wants_cluster

    if paths[0] == "diff":
        if len(paths) != 3:
            raise UserError("usage: npu-profile diff A B  (two profile directories)")
        run_diff(Path(paths[1]), Path(paths[2]), top=top, rank=rank, csv_path=csv_path, json_path=json_path)
        return
    if len(paths) != 1:
        raise UserError(f"expected one profile directory, got {len(paths)}: {' '.join(paths)}")
    if wants_cluster(Path(paths[0]), rank, ranks):
        if chip is not None or bandwidth is not None or group_by != "op":
            raise UserError("--chip, --bandwidth and --group-by summarize one rank: add --rank N")
        run_cluster(Path(paths[0]), ranks=ranks, top=top, advise=advise, csv_path=csv_path, json_path=json_path,
                    trace_path=trace_path)
        return
    if trace_path is not None:
        raise UserError("--trace writes the view of several ranks (--ranks); one rank's trace is already in DIR "
                        "as rank<N>.<time>.pt.trace.json")
    run_summary(
        Path(paths[0]), group_by=group_by, top=top, chip=chip, bandwidth=bandwidth, advise=advise,
        rank=rank, csv_path=csv_path, json_path=json_path,
    )


def profile_main() -> None:
    _run_app(profile_app)
