"""npu-migrate --dry-run vs torch.utils.hipify over the same .py files, measured in one run.

Corpus: a fresh copy of the installed torch/distributed package (362 files, ~139k lines on
torch 2.13). Both tools run over the same copy, each in a fresh subprocess so neither benefits
from the other's warm caches. Two figures per tool, medians of REPEATS runs:
  work: the tool's own call (run_migration / hipify()), timed inside the subprocess after its
        imports - the fair comparison, and the one the target applies to;
  end to end: the whole subprocess (interpreter start, imports; hipify's import loads torch).
Target: npu-migrate work <= 1.5x hipify work. Also printed: the CPU time against Ascend's own
GPU2Ascend's published figure (669 s of CPU for ~139k lines; the tool is not installable from PyPI).

    python benchmarks/migrate_speed.py [--repeats N] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GPU2ASCEND_CPU_SECONDS, GPU2ASCEND_LINES = 669.0, 139_000  # Ascend's migration tool on ~139k lines (issue #17)

# CPU seconds of this process and its reaped children (the migrate workers)
CPU = "import resource\ndef cpu():\n    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime " \
      "for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))\n"

HIPIFY = CPU + """
import sys, time
from torch.utils.hipify import hipify_python
started, cpu0 = time.perf_counter(), cpu()
hipify_python.hipify(project_directory=sys.argv[1], output_directory=sys.argv[2], includes=["*"],
                     extensions=(".py",), show_detailed=False, is_pytorch_extension=True, show_progress=False)
print("WORK", time.perf_counter() - started, cpu() - cpu0)
"""

MIGRATE = CPU + """
import sys, time
from pathlib import Path
from npukit.migrate import MigrateOptions, run_migration
jobs = int(sys.argv[2]) if len(sys.argv) > 2 else None
started, cpu0 = time.perf_counter(), cpu()
run = run_migration(MigrateOptions(target=Path(sys.argv[1]), dry_run=True, quiet=True, jobs=jobs))
print("WORK", time.perf_counter() - started, cpu() - cpu0, len(run.changed), sum(len(r.changes) for r in run.results))
"""


def _timed(command: list[str], env: dict) -> tuple[float, float, float, list[str]]:
    """(work seconds, work CPU seconds, end-to-end seconds, the rest of the tool's WORK line)."""
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if completed.returncode != 0:
        sys.exit(f"command failed ({completed.returncode}): {' '.join(command)}\n{completed.stderr[-2000:]}")
    work_line = next(line for line in completed.stdout.splitlines() if line.startswith("WORK "))
    fields = work_line.split()
    return float(fields[1]), float(fields[2]), elapsed, fields[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=None, help="npu-migrate --jobs (default: all cores)")
    args = parser.parse_args()

    source = Path(torch.__file__).parent / "distributed"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="npukit-bench-") as scratch:
        corpus = Path(scratch) / "distributed"
        shutil.copytree(source, corpus, ignore=shutil.ignore_patterns("__pycache__"))
        py_files = sorted(corpus.rglob("*.py"))
        lines = sum(p.read_bytes().count(b"\n") for p in py_files)
        print(f"corpus: copy of {source} ({len(py_files)} .py files, {lines} lines), {os.cpu_count()} cores")

        migrate_cmd = [sys.executable, "-c", MIGRATE, str(corpus)] + ([str(args.jobs)] if args.jobs else [])
        times: dict[str, list[tuple[float, float, float]]] = {"migrate": [], "hipify": []}
        migrate_counts: list[str] = []
        for repeat in range(args.repeats):
            hip_out = Path(scratch) / f"hipified{repeat}"
            hip_in = Path(scratch) / f"hip_in{repeat}"
            shutil.copytree(corpus, hip_in)  # hipify rewrites in place around its output dir; keep runs independent
            # alternate the order so neither tool always runs with a warmer page cache
            runs = [("migrate", migrate_cmd), ("hipify", [sys.executable, "-c", HIPIFY, str(hip_in), str(hip_out)])]
            for name, command in runs if repeat % 2 == 0 else reversed(runs):
                work, cpu, total, extra = _timed(command, env)
                times[name].append((work, cpu, total))
                if name == "migrate":
                    migrate_counts = extra
            shutil.rmtree(hip_in)
            shutil.rmtree(hip_out, ignore_errors=True)
        unchanged = all(p.read_bytes() == (source / p.relative_to(corpus)).read_bytes() for p in py_files)

    medians = {name: tuple(statistics.median(run[i] for run in runs) for i in range(3)) for name, runs in times.items()}
    for name, label in (("migrate", "npu-migrate --dry-run"), ("hipify", "hipify")):
        work, cpu, total = medians[name]
        listed = ", ".join(f"{run[0]:.2f}" for run in times[name])
        print(f"{label:22s}: work {work:.3f} s (runs {listed}), CPU {cpu:.3f} s; end to end {total:.3f} s")
    print(f"npu-migrate would change {migrate_counts[0]} files with {migrate_counts[1]} rewrites")
    ratio = [medians["migrate"][i] / medians["hipify"][i] for i in range(3)]
    print(f"ratio npu-migrate / hipify: work {ratio[0]:.2f}x (target <= 1.5x), CPU {ratio[1]:.2f}x, end to end {ratio[2]:.2f}x")
    # Ascend's GPU2Ascend (libcst-based, not installable here): its published figure, scaled per line
    gpu2ascend_cpu = GPU2ASCEND_CPU_SECONDS * lines / GPU2ASCEND_LINES
    print(f"GPU2Ascend's published CPU time, {GPU2ASCEND_CPU_SECONDS:.0f} s for {GPU2ASCEND_LINES // 1000}k lines, is "
          f"{gpu2ascend_cpu:.0f} s for these {lines} lines: npu-migrate's CPU {medians['migrate'][1]:.2f} s is "
          f"{gpu2ascend_cpu / medians['migrate'][1]:.0f}x less")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work skews wall times)")
    print(f"dry-run left the corpus byte-identical: {unchanged}")


if __name__ == "__main__":
    main()
