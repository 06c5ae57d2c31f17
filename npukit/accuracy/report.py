"""npu-compare reports: rich terminal table, CSV (msprobe columns first), JSON and one HTML file."""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path

from npukit.accuracy import report_page
from npukit.accuracy.compare import ERROR, PASS, UNMATCHED, WARN, CompareResult, Divergence, Row
from npukit.accuracy.dumpfile import COMPILED_REGION
from npukit.accuracy.fixes import module_matches
from npukit.accuracy.naming import split_entry_name
from npukit.accuracy.ranks import rank_summaries, several_ranks
from npukit.errors import UserError
from npukit.files import ContainedPaths, atomic_open, load_json, write_text_atomic

_SEVERITY = {ERROR: 0, WARN: 1, UNMATCHED: 2, PASS: 3}

# msprobe 26.2's compare_result columns of both modes (NPU = target, Bench = golden), then npukit's
# own. MaxRelativeErr is what msprobe puts there: the largest element's relative error for a row
# with tensor data, the relative difference of the maxima (a percentage) for a statistics row.
CSV_COLUMNS = [
    "NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
    "NPU Requires_grad", "Bench Requires_grad",
    "Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
    "Max diff", "Min diff", "Mean diff", "L2norm diff", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr",
    "NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm",
    "Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info", "Data_name",
    "Step/Rank", "Order", "Role", "Dtype Class", "RelativeL2", "SQNR(dB)", "MaxULP", "NanInf Mismatch",
    "Negligible", "First Divergence",
]


def _number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.6g}"
    return str(value)


_UNSUPPORTED = "unsupported"


def _statistic_relative(diff, bench, npu=0.0) -> str | None:
    """msprobe's statistics-mode relative error: |diff / bench| as a percentage; "inf" over a 0;
    "0" where both sides have none (an integer tensor's Mean/Norm), as msprobe calls them equal."""
    if bench is None and npu is None:
        return "0"
    if diff is None or bench is None:
        return None
    if diff == 0:
        return "0"
    return "inf" if bench == 0 else f"{abs(diff / bench * 100)!r}%"


def _requires_grad(leaf) -> str:
    return "N/A" if leaf is None or leaf.requires_grad is None else str(leaf.requires_grad)


def _stats(row: Row, side: str):
    leaf = row.target if side == "target" else row.golden
    if row.metrics is not None:
        return row.metrics.target_stats if side == "target" else row.metrics.golden_stats
    return leaf.stats if leaf is not None and leaf.stats is not None else (None, None, None, None)


def _divergent_entries(result: CompareResult) -> set[tuple[str, str]]:
    return {(pair.pair, pair.divergence.entry) for pair in result.pairs if pair.divergence}


def row_record(row: Row, divergent: set, stacks: dict) -> dict:
    """One row as a flat dict keyed by CSV_COLUMNS."""
    m = row.metrics
    target, golden = row.target, row.golden
    t_stats, g_stats = _stats(row, "target"), _stats(row, "golden")
    diffs = row.stat_diffs or {}
    paired = t_stats if target is not None and golden is not None else (0.0,) * 4  # both sides' leaves
    if m is not None and not diffs:
        diffs = {
            key: (t - g) if t is not None and g is not None else None
            for key, t, g in zip(("Max", "Min", "Mean", "Norm"), t_stats, g_stats)
        }
    data_names = [leaf.data_path.name if leaf and leaf.data_path else "" for leaf in (target, golden)]
    # msprobe gives a 0-d tensor no cosine, distance or ratios ("unsupported"); npukit's own
    # columns (RelativeL2 ...) and the verdict still judge it.
    scalar = m is not None and target is not None and target.shape == ()
    return {
        "NPU Name": target.name if target else "",
        "Bench Name": golden.name if golden else "",
        "NPU Dtype": target.dtype if target else "",
        "Bench Dtype": golden.dtype if golden else "",
        "NPU Tensor Shape": list(target.shape) if target else "",
        "Bench Tensor Shape": list(golden.shape) if golden else "",
        "NPU Requires_grad": _requires_grad(target),
        "Bench Requires_grad": _requires_grad(golden),
        "Cosine": _UNSUPPORTED if scalar else m.cosine if m else None,
        "EucDist": _UNSUPPORTED if scalar else m.euc_dist if m else None,
        "MaxAbsErr": m.max_abs if m else None,
        "MaxRelativeErr": m.max_rel if m else _statistic_relative(diffs.get("Max"), g_stats[0], paired[0]),
        "One Thousandth Err Ratio": _UNSUPPORTED if scalar else m.within_1e3 if m else None,
        "Five Thousandths Err Ratio": _UNSUPPORTED if scalar else m.within_5e3 if m else None,
        "Max diff": diffs.get("Max"),
        "Min diff": diffs.get("Min"),
        "Mean diff": diffs.get("Mean"),
        "L2norm diff": diffs.get("Norm"),
        "MinRelativeErr": None if m else _statistic_relative(diffs.get("Min"), g_stats[1], paired[1]),
        "MeanRelativeErr": None if m else _statistic_relative(diffs.get("Mean"), g_stats[2], paired[2]),
        "NormRelativeErr": None if m else _statistic_relative(diffs.get("Norm"), g_stats[3], paired[3]),
        "NPU max": t_stats[0], "NPU min": t_stats[1], "NPU mean": t_stats[2], "NPU l2norm": t_stats[3],
        "Bench max": g_stats[0], "Bench min": g_stats[1], "Bench mean": g_stats[2], "Bench l2norm": g_stats[3],
        "Requires_grad Consistent": str(_requires_grad(target) == _requires_grad(golden)),
        "Result": row.verdict,
        "Err_message": row.message,
        "NPU_Stack_Info": stacks.get((row.pair, row.target_entry), ""),
        "Data_name": data_names if any(data_names) else "",
        "Step/Rank": row.pair,
        "Order": row.order,
        "Role": row.role,
        "Dtype Class": row.dtype_class,
        "RelativeL2": row.error if m is not None else None,
        "SQNR(dB)": m.sqnr_db if m else None,
        "MaxULP": m.max_ulp if m else None,
        "NanInf Mismatch": m.nan_inf_mismatch if m else None,
        "Negligible": row.negligible,
        "First Divergence": (row.pair, row.target_entry) in divergent,
    }


def _stack_texts(result: CompareResult) -> dict:
    texts = {}
    for pair in result.pairs:
        if pair.divergence:
            texts[(pair.pair, pair.divergence.entry)] = "\n".join(pair.divergence.stack)
    return texts


def write_csv(result: CompareResult, path: Path) -> None:
    divergent = _divergent_entries(result)
    stacks = _stack_texts(result)
    with atomic_open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in result.rows:
            record = row_record(row, divergent, stacks)
            writer.writerow({key: _number(value) if not isinstance(value, str) else value for key, value in record.items()})


RANK_CSV_COLUMNS = ["Step/Rank", "Step", "Rank", "pass", "warn", "error", "unmatched", "First Divergence",
                    "Output Error", "Module", "Across Ranks", "First Difference", "Difference Error", "Problems"]


def rank_records(result: CompareResult) -> list[dict]:
    """The per-rank summary (ranks.rank_summaries) as flat dicts keyed by RANK_CSV_COLUMNS."""
    records = []
    pairs = {pair.pair: pair for pair in result.pairs}
    for summary in rank_summaries(result):
        divergence = summary.divergence
        records.append({
            "Step/Rank": summary.pair, "Step": summary.step, "Rank": summary.rank,
            **{key: summary.counts.get(key, 0) for key in (PASS, WARN, ERROR, UNMATCHED)},
            "First Divergence": divergence.entry if divergence else None,
            "Output Error": divergence.output_error if divergence else None,
            "Module": divergence.module_path if divergence else None,
            "Across Ranks": summary.role or None,
            "First Difference": summary.first_difference,
            "Difference Error": summary.difference_error,
            # why no divergence can be claimed for this pair (CompareResult.pair_problems)
            "Problems": "; ".join(result.pair_problems(pairs[summary.pair])) or None,
        })
    return records


def ranks_csv_path(path: Path) -> Path:
    """Where --csv X.csv puts the per-rank summary of a multi-rank compare: X.ranks.csv."""
    return path.with_name(f"{path.stem}.ranks{path.suffix or '.csv'}")


def write_ranks_csv(result: CompareResult, path: Path) -> None:
    with atomic_open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=RANK_CSV_COLUMNS)
        writer.writeheader()
        for record in rank_records(result):
            writer.writerow({key: _number(value) if not isinstance(value, str) else value
                             for key, value in record.items()})


def across_ranks_record(result: CompareResult) -> dict | None:
    began = result.across_ranks
    if began is None:
        return None
    return {"step": began.step, "ranks": began.ranks, "entry": began.entry, "pair": began.pair,
            "phase": began.phase, "module_path": began.module_path, "output_error": _json_value(began.output_error),
            "reached": began.reached, "through": began.through,
            "first_seen": {str(rank): entry for rank, entry in began.first_seen.items()},
            "clean": began.clean, "text": began.line()}


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return _number(value)
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    return value


def divergence_record(divergence: Divergence | None) -> dict | None:
    if divergence is None:
        return None
    return {
        "entry": divergence.entry,
        "golden_entry": divergence.golden_entry,
        "side": divergence.side,
        "kind": divergence.kind,  # "lost-update", or "" (a fix depends on it: fix_finder)
        "reason": divergence.reason,
        "module_path": divergence.module_path,
        "input_error": _json_value(divergence.input_error),
        "output_error": _json_value(divergence.output_error),
        "stack": divergence.stack,
    }


def result_json(result: CompareResult) -> dict:
    divergent = _divergent_entries(result)
    stacks = _stack_texts(result)
    return {
        "golden": str(result.golden),
        "target": str(result.target),
        "summary": result.counts(),
        "failed": result.failed(),  # npu-compare's exit 1
        "headline": headline(result),  # the terminal's verdict line
        "verdict": [head + rest for _, head, rest in verdict_lines(result)],
        "problems": result.problems(),  # why no "no divergence" besides a divergence
        "only_golden": result.only_golden,
        "only_target": result.only_target,
        # several ranks: a summary per step/rank and where the divergence began across them
        "ranks": [{key: _json_value(value) for key, value in record.items()} for record in rank_records(result)]
        if several_ranks(result) else None,
        "across_ranks": across_ranks_record(result),
        "pairs": [
            {
                "pair": pair.pair,
                "golden_pair": pair.golden_pair,
                "mode": pair.mode,
                "aligned": pair.aligned,
                "noop_casts": pair.noop_casts,
                "golden_low_precision": pair.golden_low_precision,
                "loss_scale": pair.loss_scale,
                "skipped_by_grad_scaler": pair.skipped_by_grad_scaler,
                "cross_tool": pair.cross_tool,
                "not_searched": pair.unsearched,
                "problems": result.pair_problems(pair),
                "coverage": None if pair.coverage is None else {
                    "golden_paired": pair.coverage.golden_paired, "golden_entries": pair.coverage.golden_total,
                    "target_paired": pair.coverage.target_paired, "target_entries": pair.coverage.target_total,
                    "stopped": pair.coverage.stopped or None},
                "incomplete": {side: [{"kind": item.kind, "where": item.where, "detail": item.detail} for item in items]
                               for side, items in (("golden", pair.golden_incomplete),
                                                   ("target", pair.target_incomplete))},
                "first_divergence": divergence_record(pair.divergence),
                "unmatched_golden": pair.unmatched_golden,
                "unmatched_target": pair.unmatched_target,
                "rows": [
                    {key: _json_value(value) for key, value in row_record(row, divergent, stacks).items()}
                    for row in pair.rows
                ],
            }
            for pair in result.pairs
        ],
    }


def write_json(result: CompareResult, path: Path) -> None:
    with atomic_open(path) as handle:
        json.dump(result_json(result), handle, indent=1)


# ---------------------------------------------------------------------------- terminal
def ordered_rows(result: CompareResult) -> list[Row]:
    """First-divergent op rows first (outputs, then inputs), then the worst rows by verdict and error."""
    divergent = _divergent_entries(result)
    pair_index = {pair.pair: index for index, pair in enumerate(result.pairs)}
    role_rank = {"output": 0, "input": 1, "param": 2}

    def key(row: Row):
        if (row.pair, row.target_entry) in divergent:
            return (0, pair_index[row.pair], role_rank.get(row.role, 3), 0.0, row.order)
        error = row.error if row.error is not None else -1.0
        return (1, _SEVERITY.get(row.verdict, 3), 0, -error, row.order)

    return sorted(result.rows, key=key)


def print_terminal(result: CompareResult, console, top: int = 20) -> None:
    from rich.markup import escape
    from rich.table import Table

    counts = result.counts()
    total = sum(counts.values())
    for side, labels in (("golden", result.only_golden), ("target", result.only_target)):
        if labels:
            console.print(f"[dim]not compared, only in {side}: {escape(', '.join(labels))}[/]")
    for pair in result.pairs:
        where = escape(f" [{pair.pair}]") if len(result.pairs) > 1 else ""
        for style, head, rest in pair_notes(result, pair):
            console.print(f"[{style}]{escape(head)}[/]{escape(rest)}" if style else escape(head + rest))
        if pair.divergence:
            d = pair.divergence
            console.print(f"[bold red]First divergence{where}:[/] [bold]{escape(d.entry)}[/]"
                          + (f"  (module {escape(d.module_path)})" if d.module_path else ""))
            console.print(f"  {escape(d.reason)}")
            for line in _user_frames(d.stack):
                console.print(f"  [dim]{escape(line)}[/]")
    table = Table(title=f"npu-compare: {total} tensors", show_lines=False)
    multi = len(result.pairs) > 1
    if multi:
        table.add_column("Step/Rank")
    table.add_column("Name", overflow="fold", ratio=3)
    for column in ("Dtype", "Cosine", "RelL2", "MaxAbs", "Result"):
        table.add_column(column, no_wrap=True)
    table.add_column("Message", overflow="fold", ratio=2)
    divergent = _divergent_entries(result)
    shown = [row for row in ordered_rows(result) if row.verdict != PASS or (row.pair, row.target_entry) in divergent]
    for row in shown[:top]:
        m = row.metrics
        colour = {ERROR: "red", WARN: "yellow", UNMATCHED: "magenta"}.get(row.verdict, "green")
        dtype = (row.target or row.golden).dtype.replace("torch.", "")
        if row.golden and row.target and row.golden.dtype != row.target.dtype:
            dtype = f"{row.target.dtype.replace('torch.', '')}/{row.golden.dtype.replace('torch.', '')}"
        cells = [
            escape(row.name) + (" *" if (row.pair, row.target_entry) in divergent else ""),
            dtype,
            _short(m.cosine) if m else "",
            _short(row.error) if row.error is not None else "",
            _short(m.max_abs) if m else "",
            f"[{colour}]{row.verdict}[/]",
            escape(row.message),
        ]
        table.add_row(*([row.pair] if multi else []) + cells)
    if shown:
        console.print(table)
        if len(shown) > top:
            console.print(f"[dim]... {len(shown) - top} more rows not passing (use --top or the CSV/HTML report)[/]")
    if several_ranks(result):
        _print_ranks(result, console)
    styles = {"pass": "green", "fail": "bold red", "note": "dim"}
    for kind, head, rest in verdict_lines(result):
        console.print(f"[{styles[kind]}]{escape(head)}[/]{escape(rest)}" if head else f"[{styles[kind]}]{escape(rest)}[/]")


def _where(result: CompareResult, pair) -> str:
    return f" [{pair.pair}]" if len(result.pairs) > 1 else ""


def pair_notes(result: CompareResult, pair) -> list[tuple[str, str, str]]:
    """What the terminal and the HTML page say about one step/rank pair before its divergence:
    (rich style of the head, head, rest) -- style "" for plain text. What makes the pair fail is
    said in the verdict (verdict_lines)."""
    where = _where(result, pair)
    notes = []
    if pair.loss_scale != 1.0:
        notes.append(("", f"target gradients are loss-scaled by {pair.loss_scale:g}{where} (GradScaler): ",
                      "backward tensors compared after unscaling"))
    if pair.golden_pair != pair.pair:
        same_step = pair.golden_pair.partition("/")[0] == pair.pair.partition("/")[0] and "/" in pair.pair
        why = ("one process per step on each side, rank 0 (msprobe names it proc<pid>)" if same_step
               else "each folder holds one dump, of different steps or ranks")
        notes.append(("yellow", f"compared the golden run's {pair.golden_pair} with the target's {pair.pair}", f": {why}"))
    not_dumped = _not_dumped_regions(pair)
    if not_dumped:
        notes.append(("yellow", f"not dumped{where}", f": {not_dumped}"))
    if pair.cross_tool:
        notes.append(("yellow", pair.cross_tool, where))
    if pair.unsearched:
        notes.append(("yellow", pair.pair, f": {pair.unsearched}"))
    if pair.skipped_by_grad_scaler:
        side = {"both": "both runs", "golden": "the golden run", "target": "the target"}[pair.skipped_by_grad_scaler]
        notes.append(("yellow", f"GradScaler skipped this step in {side}{where}", ": its gradients overflowed under"
                      " loss scaling and no update used them; the backward is shown but not searched for a divergence"))
    if pair.golden_low_precision:
        notes.append(("yellow", f"the golden run was not fp32{where}", f": {pair.golden_low_precision} (the code casts"
                      " to a compute dtype itself; --golden only runs autocast regions in fp32): errors below are"
                      " measured against a low-precision reference"))
    unmatched = set(pair.unmatched_golden + pair.unmatched_target)  # aligned with none: only the order differed
    if pair.aligned and unmatched and unmatched <= set(pair.noop_casts):
        notes.append(("dim", f"{', '.join(pair.noop_casts)}{where}: a cast that changed nothing in the other run (its"
                      " tensor had that dtype already) has no backward there; the op streams are the same", ""))
    elif pair.aligned and unmatched:
        notes.append(("yellow", f"op streams differ{where}", f": aligned by sequence ({len(pair.unmatched_target)} calls"
                      f" only in target, {len(pair.unmatched_golden)} only in golden)"))
    return notes


def _not_dumped_regions(pair) -> str | None:
    """The compiled regions (torch.compile fullgraph) a pair's dumps say they did not record, by side.
    The same regions on both sides compare like for like: only their ops are missing."""
    golden = {item.where for item in pair.golden_incomplete if item.kind == COMPILED_REGION}
    target = {item.where for item in pair.target_incomplete if item.kind == COMPILED_REGION}
    if not golden and not target:
        return None
    parts = [f"{label}: {', '.join(sorted(regions))}" for label, regions in
             (("in both runs", golden & target), ("in the golden run only", golden - target),
              ("in the target only", target - golden)) if regions]
    return ("ran compiled (torch.compile(fullgraph=True)) and were not dumped, so their ops are not compared, "
            + "; ".join(parts))


def verdict_lines(result: CompareResult) -> list[tuple[str, str, str]]:
    """The verdict, as the terminal, the JSON report and the HTML page all say it: (kind, head,
    rest) lines, kind "pass" | "fail" | "note". The first line is the headline; "fail" exactly when
    npu-compare exits 1 (result.failed())."""
    counts = result.counts()
    summary = ", ".join(f"{counts[key]} {key}" for key in (PASS, WARN, ERROR, UNMATCHED) if counts.get(key))
    problems = result.problems()
    if any(pair.divergence for pair in result.pairs):
        return ([("fail", "", f"Summary: {summary}.  (* = first divergent op)")]
                + [("fail", "and ", problem) for problem in problems])
    if problems:
        return ([("fail", "Cannot say there is no divergence", f": {summary} (exit 1):")]
                + [("fail", "  ", problem) for problem in problems])
    lines = [("pass", "No divergence found", f": {summary}.")]
    if counts.get(ERROR):
        first_step = sum(row.verdict == ERROR for pair in result.pairs if not _after_an_update(pair.pair)
                         for row in pair.rows)
        later = counts[ERROR] - first_step
        if first_step:
            lines.append(("note", "", f"{_error_rows(first_step, later)} carry their inputs' error and no op"
                          " amplified it (a relu's or max-pool's mask where a value near 0 changed sign in low"
                          " precision moves a whole element of a gradient; an MoE router's top-k where a near tie"
                          " flipped sends a token to another expert): the search names an op only where its"
                          " error is its own."))
        if later:
            lines.append(("note", "", f"{_error_rows(later, first_step, later=True)} started from weights the"
                          " earlier low-precision updates moved apart (AdamW moves a weight by about lr whatever its"
                          " gradient's size, so a gradient sign rounding flipped moves it the other way): where an op"
                          " there amplified the difference, no weight it computes a gradient for got one over half"
                          " off. Drift, not a divergence: the first step shows the program's own numerics."))
    return lines


def _error_rows(count: int, others: int, later: bool = False) -> str:
    rows = f"{count} error row{'s' if count > 1 else ''}"
    if later:
        return f"The {rows} of the steps after an optimizer step" if others else f"The {rows}, all in steps after an optimizer step,"
    return f"The {rows} of the first step" if others else f"The {rows}"


def _after_an_update(pair_label: str) -> bool:
    """`step1/rank0` and later steps: a dump whose weights went through the run's own updates."""
    step = pair_label.partition("/")[0]
    return step.startswith("step") and step[4:].isdigit() and int(step[4:]) > 0


def headline(result: CompareResult) -> str:
    _, head, rest = verdict_lines(result)[0]
    return head + rest


_RANK_ROWS = 16  # more step/rank pairs than this: the terminal shows one step's


def _print_ranks(result: CompareResult, console) -> None:
    """The per-rank table and, when one rank diverged first, where it began and what it reached."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="per rank", show_lines=False)
    for column in ("Step/Rank", "pass", "warn", "error", "unmatched"):
        table.add_column(column, no_wrap=True, justify="left" if column == "Step/Rank" else "right")
    table.add_column("First divergence", overflow="fold", ratio=3)
    table.add_column("Error", no_wrap=True)
    table.add_column("Across ranks", overflow="fold", ratio=2)
    records = rank_records(result)
    shown = records
    if len(records) > _RANK_ROWS:  # many steps: the step where it began (else the first), the rest in the files
        step = result.across_ranks.step if result.across_ranks is not None else records[0]["Step"]
        shown = [record for record in records if record["Step"] == step][:_RANK_ROWS * 4]
    for record in shown:
        role = record["Across Ranks"] or ""
        table.add_row(escape(record["Step/Rank"]), *(str(record[key]) for key in (PASS, WARN, ERROR, UNMATCHED)),
                      escape(record["First Divergence"] or ("cannot say: see below" if record["Problems"] else "none")),
                      _short(record["Output Error"]) if record["Output Error"] is not None else "",
                      f"[bold red]{role}[/]" if role == "source" else escape(role))
    console.print(table)
    if len(shown) < len(records):
        console.print(f"[dim]... {len(records) - len(shown)} more step/rank pairs (--json, or --csv X.csv: X.ranks.csv)[/]")
    if result.across_ranks is not None:
        console.print(f"[bold red]First divergence across ranks:[/] {escape(result.across_ranks.line())}")
    else:
        diverged = sum(1 for pair in result.pairs if pair.divergence)
        if not diverged and result.problems():
            console.print(f"[yellow]no divergence named on any rank[/] ({len(result.pairs)} step/rank pairs): the"
                          " verdict below says why none can be claimed")
        elif not diverged:
            console.print(f"[green]no rank diverged[/] ({len(result.pairs)} step/rank pairs)")
        else:
            console.print(f"{diverged} step/rank pair(s) diverged, each on its own (one rank per step)")


def _short(value: float) -> str:
    if isinstance(value, float) and 0.9 < value < 1.0:
        return f"{value:.6f}"  # cosines: the digits that matter are the nines
    return _number(value) if not isinstance(value, float) or not math.isfinite(value) else f"{value:.3g}"


def _user_frames(stack: list[str], limit: int = 3) -> list[str]:
    return [line.replace("\n", " ").strip() for line in stack[:limit]]


def _chart_svg(result: CompareResult, pair_index: int) -> str:
    """Relative L2 (log scale) and cosine of each op's outputs along execution order."""
    pair = result.pairs[pair_index]
    points: dict[int, list] = {}
    for row in pair.rows:
        if row.role != "output" or row.error is None or row.verdict == UNMATCHED:
            continue
        cosine = row.metrics.cosine if row.metrics else None
        current = points.get(row.order)
        if current is None or row.error > current[0]:
            points[row.order] = [row.error, cosine, row.target_entry]
    if not points:
        return "<p>No measured outputs to chart.</p>"
    orders = sorted(points)
    width, height, left, top_pad = 960, 170, 60, 12
    plot_w = width - left - 20
    x_of = {order: left + plot_w * (i / max(len(orders) - 1, 1)) for i, order in enumerate(orders)}

    def y_log(value):
        value = min(max(value, 1e-12), 10.0) if math.isfinite(value) else 10.0
        return top_pad + (height - 2 * top_pad) * (1 - (math.log10(value) + 12) / 13)

    def y_cos(value):
        value = min(max(value, 0.0), 1.0)
        return height + 30 + top_pad + (height - 2 * top_pad) * (1 - value)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height + 60}" font-size="11">']
    for exponent in range(-12, 2, 2):
        y = y_log(10.0 ** exponent)
        parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="4" y="{y + 4:.1f}">1e{exponent}</text>')
    for value in (0.0, 0.5, 0.9, 1.0):
        y = y_cos(value)
        parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="4" y="{y + 4:.1f}">{value:g}</text>')
    parts.append(f'<text x="{left}" y="10" font-weight="bold">relative L2 error (log)</text>')
    classes = [row.dtype_class for row in pair.rows if row.role == "output" and row.verdict != UNMATCHED]
    if classes:
        dtype_class = max(set(classes), key=classes.count)
        warn = result.thresholds.limits(dtype_class).warn_rel_l2
        y = y_log(warn)
        parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#f39c12" '
                     f'stroke-dasharray="6 4"/><text x="{width - 200}" y="{y - 3:.1f}" fill="#b9770e">'
                     f'{dtype_class} warn limit {warn:g}</text>')
    parts.append(f'<text x="{left}" y="{height + 38}" font-weight="bold">cosine</text>')
    if pair.divergence:
        for order, point in points.items():
            if point[2] == pair.divergence.entry:
                x = x_of[order]
                parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{2 * height + 40}" stroke="#e74c3c" '
                             f'stroke-dasharray="4 3"/><text x="{x + 4:.1f}" y="{height + 22}" fill="#e74c3c">'
                             f'first divergence: {html.escape(point[2])}</text>')
    if len(orders) > _CHART_DOTS:  # one point per pixel column: its worst error and lowest cosine
        columns: dict[int, int] = {}
        for order in orders:
            column = int(x_of[order])
            kept = columns.get(column)
            if kept is None or _worse(points[order], points[kept]):
                columns[column] = order
        lowest = {}
        for order in orders:
            column = int(x_of[order])
            if points[order][1] is not None and (column not in lowest or points[order][1] < lowest[column]):
                lowest[column] = points[order][1]
        parts.append(f'<text x="{width - 420}" y="10" fill="#555">{len(orders)} op outputs: the worst of each'
                     ' pixel column drawn</text>')
        orders = sorted(columns.values())
        points = {order: [points[order][0], lowest.get(int(x_of[order])), points[order][2]] for order in orders}
    rel_path = " ".join(f"{x_of[o]:.1f},{y_log(points[o][0]):.1f}" for o in orders)
    parts.append(f'<polyline fill="none" stroke="#2e86c1" points="{rel_path}"/>')
    cos_points = [o for o in orders if points[o][1] is not None]
    if cos_points:
        cos_path = " ".join(f"{x_of[o]:.1f},{y_cos(points[o][1]):.1f}" for o in cos_points)
        parts.append(f'<polyline fill="none" stroke="#28b463" points="{cos_path}"/>')
    for order in orders:
        error, cosine, name = points[order]
        tip = html.escape(f"{name}: relL2 {_number(error)}" + (f", cosine {_number(cosine)}" if cosine is not None else ""))
        parts.append(f'<circle cx="{x_of[order]:.1f}" cy="{y_log(error):.1f}" r="2.5" fill="#2e86c1"><title>{tip}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)




def _worse(point, other) -> bool:
    """The larger relative error; nan counts as the worst."""
    return not (point[0] <= other[0])

# ---------------------------------------------------------------------------- HTML
_HTML_ROW_LIMIT = 300_000  # rows embedded in the page (the most relevant first); the CSV has all
_CHART_DOTS = 2000  # above this many measured op outputs the chart draws the worst op per pixel column

# The tables' columns; "kind" tells the page how to show and sort a cell.
_HTML_COLUMNS = [("Step/Rank", "text"), ("Order", "num"), ("NPU Name", "name"), ("NPU Dtype", "text"),
                 ("Bench Dtype", "text"), ("NPU Tensor Shape", "text"), ("Cosine", "num"), ("RelativeL2", "num"),
                 ("SQNR(dB)", "num"), ("MaxAbsErr", "num"), ("MaxRelativeErr", "num"),
                 ("One Thousandth Err Ratio", "num"), ("MaxULP", "num"), ("Result", "verdict"),
                 ("Err_message", "text")]
_VERDICT_ORDER = (ERROR, WARN, UNMATCHED, PASS)  # worst first: a verdict's index is its severity
_OUTSIDE = "(outside any module)"
_UNPLACED = "(api ops, module unknown)"
_TREE_NOTES = {
    "construct": "Module tree from the dumps' construct.json (each entry's parent module).",
    "prefix": "These dumps have no construct.json (older dumps, msprobe L1 dumps): modules are grouped by their"
              " module path prefix (blocks.1.norm under blocks.1), and the api ops, which only construct.json"
              " places in a module, are listed under \"" + _UNPLACED + "\".",
    "flat": "These dumps have no construct.json and no module entries (an api-level or msprobe L1 dump): there is"
            " no module tree; every row is in the table of all rows below.",
}


class _ModuleNode:
    __slots__ = ("id", "key", "path", "cls", "parent", "counts", "max_error")

    def __init__(self, node_id: int, key: str, path: str, cls: str | None) -> None:
        self.id, self.key, self.path, self.cls = node_id, key, path, cls
        self.parent: _ModuleNode | None = None
        self.counts = [0, 0, 0, 0]  # rows per verdict, in _VERDICT_ORDER, this node and its descendants
        self.max_error: float | None = None


def _load_construct(folder: Path) -> dict:
    """`{entry: parent module entry}` of one rank folder, {} when absent or unreadable (the compare
    itself read the same file and would have refused a malformed one)."""
    try:
        path = ContainedPaths(folder).resolve(Path(folder) / "construct.json", Path(folder) / "construct.json")
        construct = load_json(path) if path.is_file() else {}
    except (UserError, OSError):
        return {}
    return construct if isinstance(construct, dict) else {}


def _module_base(entry: str) -> str:
    """`Module.blocks.1.norm.LayerNorm.backward.0` -> `Module.blocks.1.norm.LayerNorm`: one tree node
    for a module's forward and backward calls and its parameter gradients."""
    return split_entry_name(entry)[0]


class _ModuleTree:
    """The module tree of one step/rank: nodes are modules (a module's forward and backward calls
    are one node, keyed by `Module.<path>.<Class>`); a row belongs to the module its entry ran in
    (construct.json's parent) or, for a module entry's own inputs/outputs, to that module."""

    def __init__(self, nodes: list[_ModuleNode], construct: dict, pair_index: int) -> None:
        self.all_nodes = nodes  # shared by every pair: node ids index the page's one list
        self.construct = construct
        self.pair_index = pair_index
        self.by_key: dict[str, _ModuleNode] = {}
        self.mine: list[_ModuleNode] = []

    def _new(self, key: str, path: str, cls: str | None) -> _ModuleNode:
        node = _ModuleNode(len(self.all_nodes), key, path, cls)
        self.all_nodes.append(node)
        self.mine.append(node)
        self.by_key[key] = node
        return node

    def node_of(self, entry: str | None) -> _ModuleNode:
        if entry and entry.startswith("Module."):
            return self._module(entry)
        parent = self.construct.get(entry) if entry else None
        if isinstance(parent, str) and parent.startswith("Module."):
            return self._module(parent)
        return self.by_key.get(_OUTSIDE) or self._new(_OUTSIDE, _OUTSIDE if self.construct else _UNPLACED, None)

    def _module(self, entry: str) -> _ModuleNode:
        chain, seen = [], set()
        while entry is not None and entry not in seen:
            seen.add(entry)
            key = _module_base(entry)
            node = self.by_key.get(key)
            if node is None:
                parts = key.split(".")[1:]
                node = self._new(key, ".".join(parts[:-1]), parts[-1] if parts else None)
            elif node.parent is not None:
                chain.append(node)
                break
            chain.append(node)
            parent = self.construct.get(entry)
            entry = parent if isinstance(parent, str) and parent.startswith("Module.") else None
        for child, parent in zip(chain, chain[1:]):
            if child.parent is None and not _descends(parent, child):
                child.parent = parent
        return chain[0]

    def link_by_path(self) -> None:
        """Modules construct.json did not place (no construct.json, or a parameter gradient of a module
        outside the dumped scope): under the module whose path is the longest prefix of theirs."""
        by_path: dict[str, _ModuleNode] = {}
        for node in self.mine:
            if node.key != _OUTSIDE:
                by_path.setdefault(node.path, node)
        roots = [node for node in self.mine if node.key != _OUTSIDE and node.path == ""]
        for node in self.mine:
            if node.parent is not None or node.key == _OUTSIDE or node.path == "":
                continue
            parts = node.path.split(".")
            for cut in range(len(parts) - 1, -1, -1):
                parent = by_path.get(".".join(parts[:cut])) if cut else (roots[0] if len(roots) == 1 else None)
                if parent is not None and parent is not node and not _descends(parent, node):
                    node.parent = parent
                    break


def _descends(node: _ModuleNode, ancestor: _ModuleNode) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


class _Strings:
    """The page's string table: each distinct text once, cells refer to it by index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.items: list[str] = []

    def __call__(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.items)
            self.items.append(text)
        return found


def _cell_number(value):
    """A numeric cell for the page: a number rounded as the CSV writes it, or the CSV's text."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else _number(value)
    return str(value)


def _resolve_fix(fix: dict, result: CompareResult, trees: list[_ModuleTree], row_nodes: dict) -> tuple[int, int]:
    """(pair index, node id) a fix record names, (-1, -1) when no node matches."""
    wanted = [fix.get(key) for key in ("node", "module", "entry") if isinstance(fix.get(key), str) and fix.get(key)]
    if not wanted and "" in (fix.get("node"), fix.get("module")):
        wanted = ["(root)"]  # the fix finder's module "" is the model itself
    pair_label = fix.get("pair")
    order = list(range(len(trees)))
    if pair_label is not None:
        order = [i for i in order if result.pairs[i].pair == pair_label]
    else:  # the pair whose divergence the fix finder started from, first
        order.sort(key=lambda i: result.pairs[i].divergence is None)
    for index in order:
        tree = trees[index]
        for name in wanted:
            if name.startswith("Module."):
                node = tree.by_key.get(_module_base(name)) or tree.by_key.get(name)
                if node is not None:
                    return index, node.id
            node = next((n for n in tree.mine if n.key != _OUTSIDE and (n.path or "(root)") == name), None)
            if node is None:
                node = next((n for n in tree.mine if n.key != _OUTSIDE and n.path == "" and n.cls == name), None)
            if node is None and (index, name) in row_nodes:
                node = tree.all_nodes[row_nodes[(index, name)]]
            if node is not None:
                return index, node.id
    return -1, -1


def _fix_places(record: dict, result: CompareResult, trees: list[_ModuleTree], row_nodes: dict) -> list[tuple[int, int]]:
    """[(pair index, node id)] a fix record is shown on: a change made in every block (`blocks.*.fc`)
    on each module it names (in the first pair, by _resolve_fix's order, that has them); else the one
    node _resolve_fix() finds ((-1, -1): none)."""
    pattern = record.get("node") or record.get("module")
    if isinstance(pattern, str) and "*" in pattern:
        order = [i for i in range(len(trees)) if record.get("pair") in (None, result.pairs[i].pair)]
        order.sort(key=lambda i: result.pairs[i].divergence is None)
        for index in order:
            nodes = [node.id for node in trees[index].mine if node.key != _OUTSIDE and module_matches(pattern, node.path)]
            if nodes:
                return [(index, node) for node in nodes]
    return [_resolve_fix(record, result, trees, row_nodes)]


def _fix_records(fix) -> list[dict]:
    if fix is None:
        return []
    records = [fix] if isinstance(fix, dict) else list(fix)
    return [record for record in records if isinstance(record, dict)]


def _page_data(result: CompareResult, fix=None) -> tuple[dict, list[str]]:
    """The JSON blob the page renders from, and the notes to print above its tables."""
    divergent = _divergent_entries(result)
    stacks = _stack_texts(result)
    strings = _Strings()
    nodes: list[_ModuleNode] = []
    trees, pairs_info, row_node = [], [], {}
    for index, pair in enumerate(result.pairs):
        construct = _load_construct(pair.golden_dir)
        construct.update(_load_construct(pair.target_dir))  # the target's word where both have one
        entries = {row.target_entry for row in pair.rows} | {row.golden_entry for row in pair.rows}
        has_modules = any(entry and entry.startswith("Module.") for entry in entries)
        mode = ("construct" if any(entry in construct for entry in entries if entry) else
                "prefix" if has_modules else "flat")
        tree = _ModuleTree(nodes, construct if mode == "construct" else {}, index)
        trees.append(tree)
        if mode == "flat":
            pairs_info.append({"label": pair.pair, "mode": mode, "note": _TREE_NOTES[mode], "roots": [],
                               "divergence_node": -1, "fix_node": -1})
            continue
        for row in pair.rows:
            node = tree.node_of(row.target_entry or row.golden_entry)
            row_node[id(row)] = node.id
            node.counts[_SEVERITY.get(row.verdict, 3)] += 1
            if row.error is not None and (node.max_error is None or row.error > node.max_error):
                node.max_error = row.error
            for entry in {row.target_entry, row.golden_entry} - {None}:
                row_node.setdefault((index, entry), node.id)
        tree.link_by_path()
        depth = {}
        for node in tree.mine:
            chain, up = 0, node.parent
            while up is not None:
                chain, up = chain + 1, up.parent
            depth[node.id] = chain
        for node in sorted(tree.mine, key=lambda n: -depth[n.id]):  # children before their parents
            if node.parent is not None:
                node.parent.counts = [a + b for a, b in zip(node.parent.counts, node.counts)]
                if node.max_error is not None and (node.parent.max_error is None or node.max_error > node.parent.max_error):
                    node.parent.max_error = node.max_error
        divergence_node = -1
        if pair.divergence is not None:
            divergence_node = row_node.get((index, pair.divergence.entry), -1)
            if divergence_node < 0:
                divergence_node = tree.node_of(pair.divergence.entry).id
        pairs_info.append({"label": pair.pair, "mode": mode, "note": _TREE_NOTES[mode],
                           "roots": [node.id for node in sorted(tree.mine, key=lambda n: n.key == _OUTSIDE)
                                     if node.parent is None],
                           "divergence_node": divergence_node, "fix_node": -1})
    fixes = []
    for record in _fix_records(fix):
        shown = {key: str(record[key]) for key in ("summary", "code", "details") if record.get(key) is not None}
        if "summary" not in shown and record.get("description") is not None:
            shown["summary"] = str(record["description"])
        for pair_index, node_id in _fix_places(record, result, trees, row_node):
            if pair_index >= 0 and pairs_info[pair_index]["fix_node"] < 0:
                pairs_info[pair_index]["fix_node"] = node_id
            fixes.append({**shown, "node": node_id, "pair": pair_index,
                          "names": str(record.get("node") or record.get("module") or record.get("entry") or "")})
    rows = ordered_rows(result)
    notes = []
    if len(rows) > _HTML_ROW_LIMIT:
        notes.append(f"The tables hold the {_HTML_ROW_LIMIT} most relevant of {len(rows)} rows (the tree's counts"
                     " are of all rows); the CSV has all.")
        rows = rows[:_HTML_ROW_LIMIT]
    text_columns = [i for i, (_, kind) in enumerate(_HTML_COLUMNS) if kind == "text"]
    packed = []
    for row in rows:
        record = row_record(row, divergent, stacks)
        record["NPU Name"] = record["NPU Name"] or record["Bench Name"]
        cells = []
        for i, (column, kind) in enumerate(_HTML_COLUMNS):
            value = record[column]
            if kind == "verdict":
                cells.append(_SEVERITY.get(row.verdict, 3))
            elif kind == "name":  # [entry, leaf suffix]: an entry's few rows share its name in the string table
                entry = row.target_entry if row.target is not None else row.golden_entry
                split = entry is not None and value.startswith(entry + ".")
                cells.append([strings(entry), strings(value[len(entry) + 1:])] if split else strings(value))
            elif i in text_columns:
                text = value if isinstance(value, str) else str(value) if isinstance(value, list) else _number(value)
                cells.append(strings(text) if text else None)
            else:
                cells.append(_cell_number(value))
        packed.append(cells + [row_node.get(id(row), -1), 1 if record["First Divergence"] else 0])
    # The tree opens at the first step/rank with a divergence, else where a fix is, else the first.
    start = next((i for i, pair in enumerate(result.pairs) if pair.divergence is not None), None)
    if start is None:
        start = next((record["pair"] for record in fixes if record["pair"] >= 0), 0)
    data = {
        "columns": [{"name": name, "kind": kind} for name, kind in _HTML_COLUMNS],
        "strings": strings.items,
        "rows": packed,
        "nodes": [{"pair": trees_index, "parent": node.parent.id if node.parent else -1,
                   "label": strings(_node_label(node)), "cls": strings(node.cls) if node.cls and node.path else -1,
                   "path": strings(_node_path(node)), "counts": node.counts,
                   "worst": next((i for i, count in enumerate(node.counts) if count), -1),
                   "max_error": _cell_number(node.max_error)}
                  for trees_index, tree in enumerate(trees) for node in tree.mine],
        "pairs": pairs_info,
        "fixes": fixes,
        "start_pair": start,
    }
    return data, notes


def _node_label(node: _ModuleNode) -> str:
    if node.key == _OUTSIDE:
        return node.path
    if not node.path:
        return node.cls or "(root)"
    parent = node.parent.path if node.parent is not None and node.parent.key != _OUTSIDE else ""
    return node.path[len(parent) + 1:] if parent and node.path.startswith(parent + ".") else node.path


def _node_path(node: _ModuleNode) -> str:
    if node.key == _OUTSIDE and node.path == _UNPLACED:
        return _UNPLACED + ": without construct.json the page cannot tell which module ran an api op"
    if node.key == _OUTSIDE:
        return _OUTSIDE + ": ops no module ran (the loss, casts, the optimizer's ops)"
    return node.path or f"{node.cls} (root module)"


def _json_for_script(data) -> str:
    """JSON safe inside a <script> element: every `<` escaped, so no `</script>` can end it early."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def write_html(result: CompareResult, path: Path, fix=None) -> None:
    """One self-contained page (no network): counts, the first divergence and a chart per step/rank,
    the model's module tree with each module's ops, and a table of all rows; sortable, filterable
    by verdict, paged, rendered lazily from one JSON blob (fast for 100k rows).

    `fix` (default: `result.fix` if the CompareResult carries one) is the fix finder's result, shown
    on the tree node it names; absent or None shows nothing. A dict, or a list of dicts, each with:
      - "node" or "module": where the fix applies, as a module path (`blocks.1.norm`; the root module
        by its class name or "(root)"), a module entry (`Module.blocks.1.norm.LayerNorm.forward.0`)
        or an op entry (`Functional.layer_norm.1.forward`: the module that op ran in); "" is the model
        itself (the root module); a path with `*` for an index (`blocks.*.fc`: the fix finder's change
        made in every block) is shown on each module it names;
      - "summary" (or "description", as the fix finder's FixResult.as_json()["fix"] items have it): one
        line, e.g. "keep blocks.1.norm's layer_norm in fp32: relative L2 0.41 -> 2e-6";
      - "code": the code to paste (shown verbatim, preformatted);
      - optional "entry" (an op entry, tried when "node"/"module" match no node), "pair"
        ("step0/rank0"; default: the pair with a divergence, then the first where the name matches)
        and "details" (more text: errors before/after, the runs it took).
    A fix whose node is not in the tree is still listed, below the tree, with the name it gave.
    """
    fix = getattr(result, "fix", None) if fix is None else fix
    counts = result.counts()
    data, notes = _page_data(result, fix)
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>npu-compare report</title>",
           f"<style>{report_page.CSS}</style></head><body>",
           "<h1>npu-compare report</h1>",
           f"<p>golden: <code>{html.escape(str(result.golden))}</code><br>target: <code>{html.escape(str(result.target))}</code></p>",
           "<p>" + ", ".join(f"<span class='{_css(key)}'>{counts.get(key, 0)} {key}</span>" for key in (PASS, WARN, ERROR, UNMATCHED)) + "</p>",
           _verdict_html(result)]
    if result.across_ranks is not None:  # as the terminal says it: the rank it began on, the ranks it reached
        out.append(f"<div class='box'><b>First divergence across ranks:</b> {html.escape(result.across_ranks.line())}</div>")
    for pair in result.pairs:
        out.append(f"<h2>{html.escape(pair.pair)} ({html.escape(pair.mode)})</h2>")
        out += [f"<p class='note'>{html.escape(head + rest)}</p>" for _, head, rest in pair_notes(result, pair)]
        problems = result.pair_problems(pair)
        if pair.divergence:
            d = pair.divergence
            out.append("<div class='box'><b>First divergence:</b> "
                       f"<code>{html.escape(d.entry)}</code>"
                       + (f" in module <code>{html.escape(d.module_path)}</code>" if d.module_path else "")
                       + f" (<a href='#model'>in the model tree below</a>)<br>{html.escape(d.reason)}{_stack_html(d.stack)}</div>")
        elif problems:
            out.append("<div class='box'>" + "<br>".join(html.escape(problem) for problem in problems) + "</div>")
        elif not pair.unsearched:  # an unsearched pair's note says why
            out.append("<div class='ok'>No divergence found.</div>")
    verdict_boxes = "".join(
        f"<label class='{_css(verdict)}'><input type='checkbox' class='verdict' data-verdict='{index}' checked> "
        f"{verdict} ({counts.get(verdict, 0)})</label>" for index, verdict in enumerate(_VERDICT_ORDER))
    out.append(f"<div class='toolbar' id='filters'><b>Show verdicts:</b> {verdict_boxes}</div>")
    out.append("<h2 id='model'>Model</h2>")
    if any(info["mode"] != "flat" for info in data["pairs"]):
        pair_select = ""
        if len(result.pairs) > 1:
            options = "".join(f"<option value='{index}'{' selected' if index == data['start_pair'] else ''}>"
                              f"{html.escape(info['label'])}</option>" for index, info in enumerate(data["pairs"]))
            pair_select = f"<label>step/rank <select id='pair-select'>{options}</select></label>"
        out.append("<p class='note' id='tree-note'></p>"
                   "<p class='note'>Each module is coloured by the worst verdict among its ops and its sub-modules'"
                   " (red error, amber warn, purple unmatched, green pass); the path to the first divergence is"
                   " open and that module highlighted. Click a module for its ops.</p>"
                   f"<div class='toolbar'>{pair_select}<label><input type='checkbox' id='with-submodules'>"
                   " include sub-modules' ops</label></div>"
                   "<div class='model'><div id='tree'></div><div id='node-ops'></div></div>")
    else:
        out.append(f"<p class='note' id='tree-note'>{html.escape(_TREE_NOTES['flat'])}</p>")
    unplaced = [record for record in data["fixes"] if record["node"] < 0]
    for record in unplaced:
        out.append(f"<div class='fixbox'><b>Proposed fix</b> (for <code>{html.escape(record['names'])}</code>, not"
                   f" a module of the tree): {html.escape(record.get('summary', ''))}"
                   + (f"<pre>{html.escape(record['code'])}</pre>" if record.get("code") else "") + "</div>")
    out.append("<h2>Error along execution order</h2>")
    for index, pair in enumerate(result.pairs):
        if len(result.pairs) > 1:
            out.append(f"<h3>{html.escape(pair.pair)}</h3>")
        out.append(_chart_svg(result, index))
    out.append("<h2>All rows</h2><p class='note'>The first divergent op's rows first, then the worst rows."
               " Click a column to sort.</p>")
    out += [f"<p>{html.escape(note)}</p>" for note in notes]
    out.append("<div id='all-rows'></div>")
    out.append(f"<script type='application/json' id='npukit-data'>{_json_for_script(data)}</script>")
    out.append(f"<script>{report_page.JS}</script></body></html>")
    write_text_atomic(path, "".join(out))


def _verdict_html(result: CompareResult) -> str:
    """verdict_lines as the page's first box: green when npu-compare exits 0, red when it exits 1."""
    lines = verdict_lines(result)
    css = "box" if lines[0][0] == "fail" else "ok"
    body = "<br>".join(f"<b>{html.escape(head)}</b>{html.escape(rest)}" if kind != "note" else
                       f"<span class='note'>{html.escape(head + rest)}</span>" for kind, head, rest in lines)
    return f"<div class='{css}' id='verdict'>{body}</div>"


def _stack_html(stack: list[str], shown: int = 6) -> str:
    """The innermost frames, the rest folded away."""
    head = f"<pre>{html.escape(chr(10).join(stack[:shown]))}</pre>"
    if len(stack) <= shown:
        return head
    rest = html.escape(chr(10).join(stack[shown:]))
    return f"{head}<details><summary>{len(stack) - shown} more frames</summary><pre>{rest}</pre></details>"


def _css(verdict: str) -> str:
    return {ERROR: "err"}.get(verdict, verdict)
