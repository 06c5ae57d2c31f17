"""npu-compare reports: rich terminal table, CSV (msprobe columns first), JSON and one HTML file."""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path

from npukit.accuracy.compare import ERROR, PASS, UNMATCHED, WARN, CompareResult, Divergence, Row
from npukit.files import atomic_open, write_text_atomic

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
        "only_golden": result.only_golden,
        "only_target": result.only_target,
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
        if pair.loss_scale != 1.0:
            console.print(f"target gradients are loss-scaled by {pair.loss_scale:g}{where} (GradScaler): "
                          "backward tensors compared after unscaling")
        if pair.golden_pair != pair.pair:
            same_step = pair.golden_pair.partition("/")[0] == pair.pair.partition("/")[0] and "/" in pair.pair
            why = ("one process per step on each side, rank 0 (msprobe names it proc<pid>)" if same_step
                   else "each folder holds one dump, of different steps or ranks")
            console.print(f"[yellow]compared the golden run's {escape(pair.golden_pair)} with the target's "
                          f"{escape(pair.pair)}[/]: {why}")
        if pair.cross_tool:
            console.print(f"[yellow]{escape(pair.cross_tool)}[/]{where}")
        if pair.unsearched:
            console.print(f"[yellow]{escape(pair.pair)}[/]: {escape(pair.unsearched)}")
        if pair.skipped_by_grad_scaler:
            side = {"both": "both runs", "golden": "the golden run", "target": "the target"}[pair.skipped_by_grad_scaler]
            console.print(f"[yellow]GradScaler skipped this step in {side}{where}[/]: its gradients overflowed under"
                          " loss scaling and no update used them; the backward is shown but not searched for a divergence")
        if pair.golden_low_precision:
            console.print(f"[yellow]the golden run was not fp32{where}[/]: {escape(pair.golden_low_precision)} "
                          "(the code casts to a compute dtype itself; --golden only runs autocast regions in fp32): "
                          "errors below are measured against a low-precision reference")
        casts_only = set(pair.unmatched_golden + pair.unmatched_target) <= set(pair.noop_casts)
        if pair.aligned and casts_only:
            console.print(f"[dim]{escape(', '.join(pair.noop_casts))}{where}: a cast that changed nothing in the other"
                          " run (its tensor had that dtype already) has no backward there; the op streams are the same[/]")
        elif pair.aligned:
            console.print(
                f"[yellow]op streams differ{where}[/]: aligned by sequence "
                f"({len(pair.unmatched_target)} calls only in target, {len(pair.unmatched_golden)} only in golden)"
            )
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
    summary = ", ".join(f"{counts[key]} {key}" for key in (PASS, WARN, ERROR, UNMATCHED) if counts.get(key))
    if not result.failed():
        console.print(f"[green]No divergence found[/]: {summary}.")
        if counts.get(ERROR):
            console.print(f"[dim]The {counts[ERROR]} error row{'s' if counts[ERROR] > 1 else ''} carry their inputs'"
                          " error and no op amplified it (a relu's or max-pool's mask where a value near 0 changed"
                          " sign in low precision moves a whole element of a gradient): the search names an op"
                          " only where its error is its own.[/]")
    else:
        console.print(f"Summary: {summary}.  (* = first divergent op)")
        if not any(pair.divergence for pair in result.pairs):
            console.print(f"{len(result.unexplained_errors())} error rows in steps or backwards not searched for a"
                          " divergence (said above): exit 1")


def _short(value: float) -> str:
    if isinstance(value, float) and 0.9 < value < 1.0:
        return f"{value:.6f}"  # cosines: the digits that matter are the nines
    return _number(value) if not isinstance(value, float) or not math.isfinite(value) else f"{value:.3g}"


def _user_frames(stack: list[str], limit: int = 3) -> list[str]:
    return [line.replace("\n", " ").strip() for line in stack[:limit]]


# ---------------------------------------------------------------------------- HTML
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} .err{color:#c0392b} .warn{color:#b9770e} .pass{color:#1e8449} .unmatched{color:#8e44ad}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f4f4f4;cursor:pointer;position:sticky;top:0} tr.first{background:#fdecea}
.box{border:1px solid #e74c3c;background:#fdf2f0;padding:8px 12px;margin:12px 0}
.ok{border:1px solid #27ae60;background:#eefaf1;padding:8px 12px;margin:12px 0}
pre{white-space:pre-wrap;font-size:12px;margin:4px 0}
"""

_SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th, col){
  th.addEventListener('click', function(){
    var table = th.closest('table'), body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
    rows.sort(function(a, b){
      var x = a.cells[col].dataset.v || a.cells[col].textContent, y = b.cells[col].dataset.v || b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? c : -c;
    });
    rows.forEach(function(r){ body.appendChild(r); });
  });
});
"""

_HTML_ROW_LIMIT = 20000


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


def write_html(result: CompareResult, path: Path) -> None:
    divergent = _divergent_entries(result)
    stacks = _stack_texts(result)
    counts = result.counts()
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>npu-compare report</title>",
           f"<style>{_CSS}</style></head><body>",
           "<h1>npu-compare report</h1>",
           f"<p>golden: <code>{html.escape(str(result.golden))}</code><br>target: <code>{html.escape(str(result.target))}</code></p>",
           "<p>" + ", ".join(f"<span class='{_css(key)}'>{counts.get(key, 0)} {key}</span>" for key in (PASS, WARN, ERROR, UNMATCHED)) + "</p>"]
    for index, pair in enumerate(result.pairs):
        out.append(f"<h2>{html.escape(pair.pair)} ({html.escape(pair.mode)})</h2>")
        if pair.divergence:
            d = pair.divergence
            out.append("<div class='box'><b>First divergence:</b> "
                       f"<code>{html.escape(d.entry)}</code>"
                       + (f" in module <code>{html.escape(d.module_path)}</code>" if d.module_path else "")
                       + f"<br>{html.escape(d.reason)}{_stack_html(d.stack)}</div>")
        elif pair.unsearched:
            out.append(f"<div class='box'>{html.escape(pair.unsearched)}</div>")
        else:
            out.append("<div class='ok'>No divergence found.</div>")
        out.append(_chart_svg(result, index))
    columns = ["Step/Rank", "Order", "NPU Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Cosine",
               "RelativeL2", "SQNR(dB)", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "MaxULP",
               "Result", "Err_message"]
    rows = ordered_rows(result)
    if len(rows) > _HTML_ROW_LIMIT:
        out.append(f"<p>Showing the {_HTML_ROW_LIMIT} most relevant of {len(rows)} rows; the CSV has all.</p>")
        rows = rows[:_HTML_ROW_LIMIT]
    out.append("<table class='sortable'><thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns)
               + "</tr></thead><tbody>")
    for row in rows:
        record = row_record(row, divergent, stacks)
        name = record["NPU Name"] or record["Bench Name"]
        cells = []
        for column in columns:
            value = name if column == "NPU Name" else record[column]
            text = value if isinstance(value, str) else _number(value) if not isinstance(value, list) else str(value)
            css = f" class='{_css(row.verdict)}'" if column == "Result" else ""
            cells.append(f"<td{css}>{html.escape(text)}</td>")
        first = " class='first'" if record["First Divergence"] else ""
        out.append(f"<tr{first}>" + "".join(cells) + "</tr>")
    out.append(f"</tbody></table><script>{_SORT_JS}</script></body></html>")
    write_text_atomic(path, "".join(out))


def _stack_html(stack: list[str], shown: int = 6) -> str:
    """The innermost frames, the rest folded away."""
    head = f"<pre>{html.escape(chr(10).join(stack[:shown]))}</pre>"
    if len(stack) <= shown:
        return head
    rest = html.escape(chr(10).join(stack[shown:]))
    return f"{head}<details><summary>{len(stack) - shown} more frames</summary><pre>{rest}</pre></details>"


def _css(verdict: str) -> str:
    return {ERROR: "err"}.get(verdict, verdict)
