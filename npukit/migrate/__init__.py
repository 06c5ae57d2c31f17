"""npu-migrate: rewrite CUDA PyTorch code into torch_npu code and report what needs a human.

Public API:
    run_migration(MigrateOptions(target=Path("repo"))) -> MigrationRun
    migrate_python(source_text, path) -> PythonOutcome      (one Python source, no I/O)
    write_reports(run, Path("report_dir"))                  (report.json/md, CSVs, SARIF)
"""

from npukit.migrate.pysource import MigrationSyntaxError, PythonOutcome, migrate_python
from npukit.migrate.report import write_reports
from npukit.migrate.runner import MigrateOptions, MigrationRun, run_migration

__all__ = [
    "MigrateOptions", "MigrationRun", "MigrationSyntaxError", "PythonOutcome", "migrate_python", "run_migration",
    "write_reports",
]
