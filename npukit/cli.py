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


def _run_app(app: typer.Typer) -> None:
    """Run a typer app, turning UserError into a one-line message and exit code 2."""
    try:
        app(standalone_mode=False)
    except UserError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except Exception as exc:  # click usage errors and aborts
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise


# ----------------------------------------------------------------------------- npu-run
run_app = typer.Typer(add_completion=False, help="Run a script on the emulated Ascend NPU.")


@run_app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def run(
    script: str = typer.Argument(..., help="Python script to run (or -m MODULE via --module)."),
    args: list[str] = typer.Argument(None, help="Arguments passed to the script."),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module, like python -m."),
    devices: int = typer.Option(8, "--devices", help="Number of emulated NPUs (NPUKIT_DEVICE_COUNT)."),
    emulate: bool = typer.Option(False, "--emulate", help="Use the emulator even if a real torch_npu is installed."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Launch N processes via torchrun."),
    golden: bool = typer.Option(False, "--golden", help="Golden run: NPU numerics off, autocast disabled (fp32)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch, numpy and random before the script runs."),
    dump: Optional[Path] = typer.Option(None, "--dump", help="Dump per-layer tensors into DIR."),
    dump_level: str = typer.Option("mix", "--dump-level", help="module | api | mix"),
    dump_mode: str = typer.Option("stats", "--dump-mode", help="stats | tensor | md5"),
    dump_steps: Optional[str] = typer.Option(None, "--dump-steps", help="Steps to dump, e.g. 0,2-4."),
    dump_scope: Optional[str] = typer.Option(None, "--dump-scope", help="Only names under these scopes (comma list)."),
    dump_list: Optional[str] = typer.Option(None, "--dump-list", help="Only these module/op names (comma list)."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Save (first run) or load (second run) initial weights and first batches in DIR."),
    detect_overflow: bool = typer.Option(False, "--detect-overflow", help="Name the first op that overflows."),
    overflow_action: str = typer.Option("report", "--overflow-action", help="report | dump | stop"),
    overflow_max: int = typer.Option(20, "--overflow-max", help="Stop recording after N overflow events."),
    overflow_dir: Path = typer.Option(Path("overflow"), "--overflow-dir", help="Where overflow.json (and dumps) go."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Record a profile into DIR."),
    profile_steps: Optional[str] = typer.Option(None, "--profile-steps", help="wait,warmup,active steps"),
) -> None:
    from npukit.run import RunOptions, main

    options = RunOptions(
        script=script, args=list(args or []), module=module, devices=devices, emulate=emulate,
        nproc_per_node=nproc_per_node, golden=golden, seed=seed,
        dump=dump, dump_level=dump_level, dump_mode=dump_mode, dump_steps=dump_steps,
        dump_scope=dump_scope, dump_list=dump_list, replay=replay,
        detect_overflow=detect_overflow, overflow_action=overflow_action,
        overflow_max=overflow_max, overflow_dir=overflow_dir,
        profile=profile, profile_steps=profile_steps,
    )
    raise typer.Exit(main(options))


def run_main() -> None:
    _run_app(run_app)


# ------------------------------------------------------------------------- npu-migrate
migrate_app = typer.Typer(add_completion=False, help="Rewrite CUDA PyTorch code into torch_npu code.")

# (section owned by npukit.migrate)
@migrate_app.command()
def migrate(
    path: Path = typer.Argument(..., help="Repository folder or single file to migrate."),
    out: Path | None = typer.Option(None, "--out", help="Write a migrated copy of PATH into DIR (PATH is not touched)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Analyse and report only; write nothing."),
    diff: bool = typer.Option(False, "--diff", help="Print the rewrite as a unified diff; write nothing."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if anything would change (for CI); write nothing."),
    runtime: bool = typer.Option(False, "--runtime", help="Do not rewrite; insert torch_npu's transfer_to_npu import at entry points."),
    force: bool = typer.Option(False, "--force", help="Rewrite in place even if the git tree has uncommitted changes."),
    report: Path | None = typer.Option(None, "--report", help="Write report.json, report.md, change_list.csv, unsupported_api.csv, report.sarif into DIR."),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="Worker processes (default: all cores)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary; errors only."),
) -> None:
    from npukit.migrate.cli_support import main

    options_kwargs = dict(target=path, out=out, dry_run=dry_run, diff=diff, check=check, runtime=runtime,
                          force=force, jobs=jobs, report_dir=report, quiet=quiet)
    raise typer.Exit(main(**options_kwargs))



def migrate_main() -> None:
    _run_app(migrate_app)


# ------------------------------------------------------------------------- npu-compare
compare_app = typer.Typer(add_completion=False, help="Compare a golden dump with an NPU dump, layer by layer.")

# (section owned by npukit.accuracy)


def compare_main() -> None:
    _run_app(compare_app)


# ------------------------------------------------------------------------- npu-profile
profile_app = typer.Typer(add_completion=False, help="Op hotspots, estimated NPU time, diff and advice.")

# (section owned by npukit.profiler)


def profile_main() -> None:
    _run_app(profile_app)
