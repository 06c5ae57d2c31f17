"""What `npu-migrate` does once typer has parsed the options (kept out of cli.py so --help stays instant)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from npukit.errors import UserError
from npukit.migrate.report import print_summary, to_json, write_reports
from npukit.migrate.runner import MigrateOptions, MigrationInterrupted, run_migration, unified_diff

_PROGRESS_MIN_FILES = 100  # smaller trees finish before a bar is worth drawing


def main(json_output: bool = False, **option_values) -> int:
    """Returns the exit code: 0, or 1 for --check when something would change."""
    from npukit.console import make_console

    options = MigrateOptions(**option_values)
    console = make_console(stderr=True)
    progress_bar = None

    def progress_factory(total: int):
        nonlocal progress_bar
        if options.quiet or total < _PROGRESS_MIN_FILES or not console.is_terminal:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # no refresh thread: the analysis forks worker processes, and forking next to a thread is unsafe
        progress_bar = Progress(TextColumn("migrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=console, transient=True, auto_refresh=False)
        progress_bar.start()
        task = progress_bar.add_task("files", total=total)

        def advance(count: int) -> None:
            progress_bar.advance(task, count)
            progress_bar.refresh()

        return advance

    try:
        run = run_migration(options, progress_factory=progress_factory)
    except MigrationInterrupted as interrupted:
        console.print(f"[red]npu-migrate: {interrupted}[/red]")
        return 130
    finally:
        if progress_bar is not None:
            progress_bar.stop()
    if options.diff:
        sys.stdout.write(unified_diff(run))
    if json_output:
        sys.stdout.write(json.dumps(to_json(run), indent=2, ensure_ascii=False) + "\n")
    written = []
    if options.report_dir is not None:
        try:
            written = write_reports(run, options.report_dir)
        except OSError as exc:
            raise UserError(f"--report {options.report_dir}: cannot write ({exc.strerror or exc})") from None
    if not options.quiet:
        print_summary(run, make_console(stderr=options.diff or json_output))
        if options.out is not None:
            console.print(f"migrated copy written to {Path(options.out)}")
        if written:
            console.print(f"reports written to {options.report_dir}: {', '.join(p.name for p in written)}")
    if options.check and run.changed:
        if not options.quiet:
            console.print(f"[red]{len(run.changed)} file(s) would change[/red]")
        return 1
    return 0
