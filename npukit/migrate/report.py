"""Migration reports: a terminal summary, and report.json / report.md / CSVs / SARIF in a folder."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from pathlib import Path

from npukit import __version__
from npukit.migrate import dependencies, rules
from npukit.migrate.files import atomic_write
from npukit.migrate.model import SEVERITIES
from npukit.migrate.runner import MigrationRun

# change_list.csv / unsupported_api.csv: GPU2Ascend's file names and leading columns (file, start
# line, end line, code) so its users can line the two tools up; our extra columns come after.
CHANGE_LIST_COLUMNS = ["File", "Start Line", "End Line", "Original Code", "Modified Code", "Rule", "Column"]
UNSUPPORTED_COLUMNS = ["File", "Start Line", "End Line", "Code", "API/Kind", "Reason", "Suggestion", "Severity", "Column"]
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def summary(run: MigrationRun) -> dict:
    findings = run.findings
    rewrites = Counter(c.rule for r in run.results for c in r.changes)
    return {
        "files_scanned": run.files_scanned,
        "files_changed": len(run.changed),
        "files_unparsable": sum(1 for r in run.results if r.error),
        "rewrites": sum(rewrites.values()),
        "rewrites_by_rule": dict(rewrites.most_common()),
        "findings_by_severity": {s: sum(1 for f in findings if f.severity == s) for s in SEVERITIES},
        "findings_by_kind": dict(Counter(f.kind for f in findings).most_common()),
        "skipped_paths": len(run.skipped),
        "seconds": round(run.elapsed, 3),
    }


def _minutes(kind: str, severity: str) -> int:
    """Rough minutes one finding costs: dependency-file kinds (one-line pin/index edits, one re-lock for a group
    of transitive CUDA wheels), then the longer kinds (kernels, extensions), else per severity."""
    if kind in dependencies.EFFORT_MINUTES:
        return dependencies.EFFORT_MINUTES[kind]
    return rules.EFFORT_OVERRIDES.get(kind, rules.EFFORT_MINUTES[severity])


STANDALONE = "standalone-"  # kinds of CUDA C the PyTorch path does not build: estimated apart


def effort(run: MigrationRun) -> dict:
    """Items that need a human, by kind, with a rough time estimate (an estimate, not a promise).

    A group of transitive CUDA wheels (one per dependency file and root cause) is one item. CUDA C
    that no Python in the tree builds (`standalone-` kinds) is its own group, outside the total: the
    PyTorch path does not need it.
    """
    by_kind: dict[str, dict] = {}
    ported: set[tuple[str, str]] = set()  # (library kind, file): the port is estimated once per file
    for finding in run.findings:
        if finding.severity == "info":
            continue
        entry = by_kind.setdefault(finding.kind, {"items": 0, "severity": finding.severity, "minutes": 0})
        entry["items"] += 1
        if finding.kind in rules.PER_LIBRARY_EFFORT and (finding.kind, finding.path) in ported:
            # another import or call site of a library this file already pays for: adapting it is small
            entry["minutes"] += rules.EFFORT_MINUTES["warning"]
            continue
        ported.add((finding.kind, finding.path))
        entry["minutes"] += _minutes(finding.kind, finding.severity)
    path_kinds = {k: e for k, e in by_kind.items() if not k.startswith(STANDALONE)}
    standalone = {k: e for k, e in by_kind.items() if k.startswith(STANDALONE)}
    total = sum(e["minutes"] for e in path_kinds.values())
    standalone_minutes = sum(e["minutes"] for e in standalone.values())
    return {"items_needing_a_human": sum(e["items"] for e in path_kinds.values()),
            "estimated_minutes": total, "estimated_hours": round(total / 60, 1),
            "by_kind": dict(sorted(path_kinds.items(), key=lambda kv: -kv[1]["minutes"])),
            "standalone_cuda": {"items": sum(e["items"] for e in standalone.values()),
                                "estimated_minutes": standalone_minutes,
                                "estimated_hours": round(standalone_minutes / 60, 1),
                                "by_kind": dict(sorted(standalone.items(), key=lambda kv: -kv[1]["minutes"]))},
            "note": "rough estimate: 15 min per warning, 1 h per error, 4 h per CUDA kernel (__global__), 2-4 h per "
                    "CUDA-only library a file uses (flash-attn, triton ...; 15 min per further use in that file); in dependency files 10 min per pin or index line and 15 min "
                    "per group of transitive CUDA wheels; CUDA C no Python in the tree builds is estimated apart"}


def effort_text(estimate: dict) -> str:
    """'about 15 min' under an hour, else 'about 1.5 h'; then the standalone CUDA C apart, if any."""
    minutes = estimate["estimated_minutes"]
    text = f"about {minutes} min" if minutes < 60 else f"about {estimate['estimated_hours']} h"
    standalone = estimate.get("standalone_cuda", {})
    if standalone.get("items"):
        text += (f" (and about {standalone['estimated_hours']} h for {standalone['items']} items of CUDA C the "
                 "PyTorch path does not build)")
    return text


def to_json(run: MigrationRun) -> dict:
    return {
        "tool": "npu-migrate",
        "version": __version__,
        "target": str(run.options.target),
        "mode": run.options.mode,
        "runtime": run.options.runtime,
        "summary": summary(run),
        "effort": effort(run),
        "files": [
            {"path": r.path, "kind": r.kind, "changed": r.changed, "error": r.error,
             "changes": [vars(c) for c in r.changes], "findings": [f.as_dict() for f in r.findings]}
            for r in run.results if r.changed or r.findings or r.error
        ],
        "skipped": [{"path": p, "reason": why} for p, why in run.skipped],
    }


def change_list_csv(run: MigrationRun) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CHANGE_LIST_COLUMNS)
    for result in run.results:
        for c in result.changes:
            # lines are those of the written file when the run writes (the new code's span), else the input's
            end_line = c.line + (c.after if run.options.writes else c.before).count("\n")
            writer.writerow([c.path, c.line, end_line, c.before, c.after, c.rule, c.col])
    return buffer.getvalue()


def unsupported_csv(run: MigrationRun) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(UNSUPPORTED_COLUMNS)
    for f in run.findings:
        writer.writerow([f.path, f.line, f.end_line or f.line, f.code, f.kind, f.reason, f.suggestion, f.severity, f.col])
    return buffer.getvalue()


def sarif(run: MigrationRun) -> dict:
    kinds = sorted({f.kind for f in run.findings})
    results = []
    for f in run.findings:
        region = {"startLine": f.line, "startColumn": f.col}
        if f.end_line:
            region["endLine"] = f.end_line
        if f.code:
            region["snippet"] = {"text": f.code}
        results.append({
            "ruleId": f.kind,
            "level": _SARIF_LEVEL[f.severity],
            "message": {"text": f"{f.reason}. Suggestion: {f.suggestion}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.path, "uriBaseId": "SRCROOT"},
                                                "region": region}}],
        })
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "npu-migrate", "version": __version__,
                                "rules": [{"id": k, "shortDescription": {"text": k}} for k in kinds]}},
            "originalUriBaseIds": {"SRCROOT": {"uri": run.root.resolve().as_uri() + "/"}},
            "results": results,
        }],
    }


def markdown(run: MigrationRun) -> str:
    s = summary(run)
    e = effort(run)
    lines = [f"# npu-migrate report: `{run.options.target}`", "",
             f"Mode: {run.options.mode}{' (runtime transfer_to_npu)' if run.options.runtime else ''}. "
             f"{_count(s['files_scanned'], 'file')} scanned, {s['files_changed']} changed, "
             f"{_count(s['rewrites'], 'rewrite')}, "
             f"{s['files_unparsable']} left unparsed, in {s['seconds']} s.", "",
             "## Rewrites by rule", "", "| rule | count |", "|---|---:|"]
    lines += [f"| {rule} | {count} |" for rule, count in s["rewrites_by_rule"].items()] or ["| (none) | 0 |"]
    lines += ["", "## Flagged items by severity", "", "| severity | count |", "|---|---:|"]
    lines += [f"| {sev} | {count} |" for sev, count in s["findings_by_severity"].items()]
    lines += ["", f"## Effort estimate (rough): {e['items_needing_a_human']} items, {effort_text(e)}", "",
              f"_{e['note']}_", "", "| kind | severity | items | minutes |", "|---|---|---:|---:|"]
    lines += [f"| {kind} | {v['severity']} | {v['items']} | {v['minutes']} |" for kind, v in e["by_kind"].items()]
    standalone = e["standalone_cuda"]
    if standalone["items"]:
        lines += ["", f"### CUDA C the PyTorch path does not build: {standalone['items']} items, about "
                      f"{standalone['estimated_hours']} h (not in the total)", "",
                  "No Python in the tree builds these files (no setup.py / cpp_extension source names them or "
                  "includes them): a CUDA C program beside the PyTorch code, kernel experiments. Port them only "
                  "if you run them.", "", "| kind | severity | items | minutes |", "|---|---|---:|---:|"]
        lines += [f"| {kind} | {v['severity']} | {v['items']} | {v['minutes']} |"
                  for kind, v in standalone["by_kind"].items()]
    needing = [f for f in sorted(run.findings, key=lambda f: (SEVERITIES.index(f.severity), f.path, f.line))
               if f.severity != "info"]
    lines += ["", "## Items needing a human", ""]
    if needing:
        lines += ["| where | severity | kind | code | reason | suggestion |", "|---|---|---|---|---|---|"]
        lines += [f"| {f.path}:{f.line}:{f.col} | {f.severity} | {f.kind} | `{_md(f.code)}` | {_md(f.reason)} | {_md(f.suggestion)} |"
                  for f in needing]
    else:
        lines.append("None.")
    info = [f for f in run.findings if f.severity == "info"]
    if info:
        lines += ["", f"## For information ({len(info)})", ""]
        lines += [f"- {f.path}:{f.line}:{f.col} {f.kind}: {_md(f.reason)}" for f in info]
    return "\n".join(lines) + "\n"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("`", "'")


def write_reports(run: MigrationRun, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    outputs = {
        "report.json": json.dumps(to_json(run), indent=2, ensure_ascii=False) + "\n",
        "report.md": markdown(run),
        "change_list.csv": change_list_csv(run),
        "unsupported_api.csv": unsupported_csv(run),
        "report.sarif": json.dumps(sarif(run), indent=2, ensure_ascii=False) + "\n",
    }
    written = []
    for name, content in outputs.items():
        path = directory / name
        # A file name with undecodable bytes (kept as surrogates) is written as \xNN: reports stay UTF-8.
        atomic_write(path, content.encode("utf-8", "backslashreplace"))
        written.append(path)
    return written


def print_summary(run: MigrationRun, console) -> None:
    """The rich terminal summary: files changed, rewrites by rule, flagged items by severity."""
    from rich.table import Table

    s = summary(run)
    verb = {"in-place": "changed", "copy": "changed in the copy"}.get(run.options.mode, "would change")
    console.print(f"[bold]npu-migrate[/bold] {run.options.target}: {_count(s['files_scanned'], 'file')} scanned, "
                  f"[bold]{s['files_changed']}[/bold] {verb}, {_count(s['rewrites'], 'rewrite')}, "
                  f"{s['files_unparsable']} not parsed ({s['seconds']:.2f} s)")
    if s["rewrites_by_rule"]:
        table = Table(title="Rewrites by rule", title_justify="left")
        table.add_column("rule")
        table.add_column("count", justify="right")
        for rule, count in s["rewrites_by_rule"].items():
            table.add_row(rule, str(count))
        console.print(table)
    if run.findings:
        table = Table(title="Flagged items (need a human unless info)", title_justify="left")
        table.add_column("severity")
        table.add_column("kind")
        table.add_column("count", justify="right")
        table.add_column("first at")
        firsts: dict[tuple[str, str], str] = {}
        counts: Counter = Counter()
        for f in sorted(run.findings, key=lambda f: (SEVERITIES.index(f.severity), f.kind, f.path, f.line)):
            counts[(f.severity, f.kind)] += 1
            firsts.setdefault((f.severity, f.kind), f"{f.path}:{f.line}:{f.col}")
        for (severity, kind), count in counts.items():
            style = {"error": "red", "warning": "yellow"}.get(severity, "dim")
            table.add_row(f"[{style}]{severity}[/{style}]", kind, str(count), firsts[(severity, kind)])
        console.print(table)
        e = effort(run)
        console.print(f"Effort estimate: {_count(e['items_needing_a_human'], 'item')} needing a human, "
                      f"{effort_text(e)} (rough). Details: --report DIR.")
        fusable = sum(rules.FUSED_WOULD_REWRITE in f.reason for f in run.findings)
        if fusable and not run.options.fused:
            console.print(f"npu-migrate --fused would rewrite {_count(fusable, 'call')} of flash_attn / xformers / apex "
                          "to torch_npu's fused ops and torch modules (docs/migrate.md).")
