"""npukit's own accuracy, measured on generated faults: does npu-compare name the op a fault was
injected at, stay quiet on clean runs, and does --find-fix find the smallest fix?

    python benchmarks/localization.py [--cases N] [--seed S] [--jobs J] [--json out.json]
    python benchmarks/localization.py --case 31-17          # one case again, with its compare's output

`--cases N` faulty cases (the seven kinds in turn) and as many clean ones, each a small model drawn
from the seed (benchmarks/localization_cases/: the models, the faults, the case runner; its module
docstrings define each kind and what "named at the injected op" means). Prints, per fault kind and
overall: the share named at the injected op (precision), named at or downstream of it, missed; the
false alarm rate on clean runs; the fix finder on the fixable faults (fp16 overflow, cancellation,
lost update, HF32 loss, where the fault's op in fp32 / with HF32 off makes the run pass): found,
runs per fix, within 2*log2(K)+4 runs for K candidates, minimal (tried: no proper subset of its
changes fixes it); then every miss, false alarm and failed fix with its case id.
The unit tests never use these seeds (the default seed is drawn here only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localization_cases.cases import FAULT_KINDS, Case, make_case  # noqa: E402

DEFAULT_SEED = 31
WORKER_CASES = 40


def cases_for(count: int, seed: int) -> list[Case]:
    """`count` faulty cases (kinds in turn) and `count` clean ones, interleaved."""
    cases = []
    for index in range(count):
        cases.append(make_case(seed, 2 * index, FAULT_KINDS[index % len(FAULT_KINDS)]))
        cases.append(make_case(seed, 2 * index + 1, None))
    return cases


def find_case(case_id: str) -> Case:
    seed, _, index = case_id.partition("-")
    index = int(index)
    fault = FAULT_KINDS[(index // 2) % len(FAULT_KINDS)] if index % 2 == 0 else None
    return make_case(int(seed), index, fault)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    import npukit.npu_backend  # noqa: F401  (before the first backward of the process)


def _run(payload: tuple[dict, str, str, bool]) -> dict:
    from localization_cases.runner import run_case

    case_json, root, mode, find_fix = payload
    case = Case.from_json(case_json)
    work = Path(root) / case.case_id
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run_case(case, work, mode, find_fix)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100.0 * part / whole:.1f}%)" if whole else "-"


def summarize(records: list[dict]) -> dict:
    faulty = [r for r in records if r["case"]["fault"]]
    clean = [r for r in records if not r["case"]["fault"]]
    outcomes = Counter(r["outcome"] for r in faulty)
    fixable = [r for r in faulty if r.get("fix") and r["fix"]["fixable"]]
    found = [r for r in fixable if r["fix"]["found"]]
    found_in_bound = [r for r in found if r["fix"]["within_bound"]]
    minimal = [r for r in found if r["fix"]["minimal"]]
    per_kind = {}
    for kind in FAULT_KINDS:
        mine = [r for r in faulty if r["case"]["fault"] == kind]
        per_kind[kind] = {"cases": len(mine), **Counter(r["outcome"] for r in mine)}
    return {
        "faulty": len(faulty), "clean": len(clean),
        "at_op": outcomes["at_op"], "downstream": outcomes["at_op"] + outcomes["downstream"],
        # named at the op's module (`Module.site.fc.Linear.forward.0`) rather than the op's own entry
        "at_module": sum(r["outcome"] == "at_op" and r["named"]["entry"].startswith("Module.") for r in faulty),
        "outcomes": dict(outcomes), "false_alarms": sum(r["outcome"] == "false_alarm" for r in clean),
        "clean_errors": sum(r["outcome"] == "error" for r in clean),
        "fix": {"fixable": len(fixable), "found": len(found), "found_within_bound": len(found_in_bound),
                "minimal": len(minimal), "on_injected_op": sum(bool(r["fix"]["on_injected_op"]) for r in found),
                "runs_per_fix": (sum(r["fix"]["runs"] for r in found) / len(found)) if found else None,
                "not_fixable": sum(1 for r in faulty if r.get("fix") and not r["fix"]["fixable"])},
        "per_kind": per_kind,
        "per_family_clean": dict(Counter(r["case"]["family"] for r in clean if r["outcome"] == "false_alarm")),
    }


def print_report(summary: dict, records: list[dict], seconds: float, jobs: int) -> None:
    s = summary
    print(f"localization: {s['faulty']} faulty + {s['clean']} clean cases, {seconds:.0f} s with {jobs} job(s)")
    print(f"  named at the injected op (precision): {_share(s['at_op'], s['faulty'])}   (goal >= 95%; "
          f"{s['at_module']} of them at its module's entry)")
    print(f"  named at or downstream of it:         {_share(s['downstream'], s['faulty'])}")
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items())))
    print(f"  false alarms on clean runs:           {_share(s['false_alarms'], s['clean'])}   (goal 0)")
    f = s["fix"]
    print(f"  fix finder on fixable faults:         found {_share(f['found'], f['fixable'])}, within the run bound "
          f"{_share(f['found_within_bound'], f['fixable'])} (goal >= 90%), minimal {_share(f['minimal'], f['found'])}"
          f" (goal >= 90%), on the injected op {_share(f['on_injected_op'], f['found'])}, runs per fix "
          f"{f['runs_per_fix']:.1f}" if f["runs_per_fix"] is not None else "  fix finder: no fix found")
    print(f"  (precision faults the oracle fix does not cure, left out of the fix figures: {f['not_fixable']})")
    print()
    kinds = list(FAULT_KINDS)
    columns = ["at_op", "downstream", "upstream", "unnamed", "missed", "error"]
    print(f"  {'fault kind':<15}{'cases':>6}" + "".join(f"{c:>12}" for c in columns))
    for kind in kinds:
        row = s["per_kind"][kind]
        print(f"  {kind:<15}{row['cases']:>6}" + "".join(f"{row.get(c, 0):>12}" for c in columns))
    print()
    misses = [r for r in records if r["case"]["fault"] and r["outcome"] != "at_op"]
    alarms = [r for r in records if not r["case"]["fault"] and r["outcome"] != "quiet"]
    fixes = [r for r in records if r.get("fix") and r["fix"]["fixable"] and
             (not r["fix"]["found"] or not r["fix"]["within_bound"] or r["fix"]["minimal"] is False)]
    if misses:
        print("misses (python benchmarks/localization.py --case ID):")
        for r in sorted(misses, key=lambda r: (r["case"]["fault"], r["case"]["variant"], r["outcome"])):
            print(f"  {_describe(r)}: {r['outcome']}; {_said(r)}")
    if alarms:
        print("false alarms and errors on clean runs:")
        for r in alarms:
            print(f"  {_describe(r)}: {r['outcome']}; {_said(r)}")
    if fixes:
        print("fix finder short of the goal:")
        for r in fixes:
            f = r["fix"]
            what = "no fix" if not f["found"] else ("not minimal" if f["minimal"] is False else "over the run bound")
            print(f"  {_describe(r)}: {what}; {f['runs']} runs for {f['candidates']} candidates; fix "
                  f"{f.get('fix')}; {f.get('note', '')}")


def _describe(record: dict) -> str:
    c = record["case"]
    where = ",".join(f"{op['api']}@{op['module'] or '(root)'}" for op in c["location"])
    return (f"{c['case_id']} {c['fault'] or 'clean'}/{c['variant'] or '-'} {c['family']} {c['precision']}"
            f"{' x' + str(c['ranks']) + ' ranks' if c['ranks'] > 1 else ''}{' at ' + where if where else ''}"
            f"{' on rank ' + str(c['bad_rank']) if c['bad_rank'] >= 0 else ''}")


def _said(record: dict) -> str:
    if record["outcome"] == "error":
        return "case error: " + record["error"].strip().splitlines()[-1]
    named = record.get("named")
    head = f"exit {record.get('exit_code')}"
    if named:
        reason = " ".join(str(named.get("reason", "")).split())[:220]
        return f"{head}, named {named['entry']} ({named['pair']}): {reason}"
    return f"{head}: {record.get('headline', '')[:200]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=150, help="faulty cases (as many clean ones run too: 300 cases in all by default)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--json", type=Path, help="write every case's record and the summary")
    parser.add_argument("--summarize", type=Path, help="print the report of the records in a .jsonl file "
                        "(--json OUT streams them to OUT with the suffix .jsonl)")
    parser.add_argument("--resume", type=Path, help="a .jsonl of a stopped run (same --cases and --seed): "
                        "keep its records, run the rest and its case errors")
    parser.add_argument("--case", help="run one case (its id, e.g. 31-17) and show its compare's output")
    parser.add_argument("--dump-mode", default="tensor", choices=("tensor", "stats"))
    parser.add_argument("--no-find-fix", action="store_true", help="skip the fix finder (localization only)")
    args = parser.parse_args()
    if args.summarize:
        records = [json.loads(line) for line in args.summarize.read_text().splitlines() if line.strip()]
        print_report(summarize(records), records, 0.0, 0)
        return 0
    if args.case:
        return _one(find_case(args.case), args.dump_mode, not args.no_find_fix)
    cases = cases_for(args.cases, args.seed)
    kept: list[dict] = []
    if args.resume:  # the records of a stopped run with the same seed, but for its case errors
        kept = [json.loads(line) for line in args.resume.read_text().splitlines() if line.strip()]
        kept = [record for record in kept if record["outcome"] != "error"]
        done_ids = {record["case"]["case_id"] for record in kept}
        cases = [case for case in cases if case.case_id not in done_ids]
    root = Path(tempfile.mkdtemp(prefix="npukit-localization-"))
    started = time.perf_counter()
    records: list[dict] = list(kept)
    stream = None
    try:
        stream = args.json.with_suffix(".jsonl").open("w") if args.json else None
        if stream:
            stream.writelines(json.dumps(record) + "\n" for record in kept)
        done = 0
        # Fresh worker processes every WORKER_CASES cases a worker: each case's runs leave memory behind.
        # (Not max_tasks_per_child: Python 3.11's pool deadlocks replacing its workers, gh-115634; the run
        # stopped at case 80 with its workers gone.)
        chunk = args.jobs * WORKER_CASES
        for first in range(0, len(cases), chunk):
            with ProcessPoolExecutor(args.jobs, initializer=_worker_init) as pool:
                futures = [pool.submit(_run, (case.as_json(), str(root), args.dump_mode, not args.no_find_fix))
                           for case in cases[first:first + chunk]]
                for future in as_completed(futures):
                    records.append(future.result())
                    done += 1
                    if stream:  # each record as it comes: a long run stopped early still has its figures
                        stream.write(json.dumps(records[-1]) + "\n")
                        stream.flush()
                    if done % 20 == 0:
                        print(f"  {done}/{len(cases)} cases, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    finally:
        if stream:
            stream.close()
        shutil.rmtree(root, ignore_errors=True)
    records.sort(key=lambda r: int(r["case"]["case_id"].rpartition("-")[2]))
    summary = summarize(records)
    print_report(summary, records, time.perf_counter() - started, args.jobs)
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "summary": summary, "records": records}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _one(case: Case, mode: str, find_fix: bool) -> int:
    from localization_cases.runner import compare, run_case

    _worker_init()
    work = Path(tempfile.mkdtemp(prefix=f"npukit-case-{case.case_id}-"))
    print(json.dumps(case.as_json(), indent=1))
    record = run_case(case, work, mode, find_fix)
    if (work / "golden").exists() and (work / "npu").exists():  # the compare's terminal report, as npu-compare prints it
        (work / "again").mkdir()
        print(compare(work / "golden", work / "npu", work / "again")[2])
    print(json.dumps({k: v for k, v in record.items() if k != "case"}, indent=1))
    print(f"dumps kept in {work} (npu-compare {work / 'golden'} {work / 'npu'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
