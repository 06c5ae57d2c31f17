"""What `npu-compare --trend` shows and writes (npukit/accuracy/trend.py computes it): the terminal
headline and table, a JSON and a CSV of the departures, and one self-contained HTML page with the
plot of the statistic on the three runs and the band, the plot also written beside it as an SVG.
"""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path

import numpy as np

from npukit.accuracy import report_page
from npukit.accuracy.trend import (
    DRIFT_QUANTILE,
    LOOKAHEAD,
    MARGIN,
    PERSIST,
    SCALARS,
    Series,
    TrendResult,
    short_value,
)
from npukit.files import write_text_atomic

_DEPARTURE_COLUMNS = ("rank", "module", "kind", "name", "statistic", "first_step", "last_step", "golden",
                      "perturbed", "npu", "half_width", "peak")
_PLOT_POINTS = 800  # at most this many steps drawn per line (evenly spaced, the last step kept)


def band_text() -> str:
    return (f"band: the golden run +- {MARGIN:g}x the largest spread of the perturbed golden run(s) from it up to twice the step "
            f"(at least {LOOKAHEAD} monitored steps ahead; for weights and optimizer state, at least their movement x the "
            f"{DRIFT_QUANTILE:.0%} quantile of the golden pair's drift per movement over all of them); a departure is "
            f"{PERSIST} monitored steps in a row outside it")


def print_trend(result: TrendResult, console, top: int = 20) -> None:
    from rich.markup import escape
    from rich.table import Table

    console.print(f"golden: {result.golden}   perturbed golden: {', '.join(map(str, result.perturbed))}   "
                  f"NPU: {result.npu}")
    for note in result.notes:
        console.print(f"note: {note}")
    if result.departures:
        table = Table(title=f"Statistics that left the band ({len(result.departures)}; the earliest first)")
        for column in ("rank", "module", "record", "statistic", "steps out", "golden", "NPU", "band +-", "x band",
                       "at most"):
            table.add_column(column, justify="left" if column in ("module", "record", "statistic", "steps out")
                             else "right")
        for departure in result.departures[:top]:
            table.add_row(str(departure.rank), departure.module(), departure.record(), departure.statistic,
                          f"{departure.first_step}-{departure.last_step}",
                          short_value(departure.golden, departure.half_width),
                          short_value(departure.npu, departure.half_width), short_value(departure.half_width),
                          _times(departure.times_out()),
                          _times(departure.peak))
        console.print(table)
        if len(result.departures) > top:
            console.print(f"... {len(result.departures) - top} more (--top, --csv)")
    console.print(band_text())
    style = "bold red" if result.departures else "bold green"
    console.print(f"[{style}]{escape(result.headline())}[/]")


def _times(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "inf"


def write_trend_json(result: TrendResult, path: Path) -> None:
    write_text_atomic(path, json.dumps(result.as_json(), indent=1))


def write_trend_csv(result: TrendResult, path: Path) -> None:
    """A row per statistic that left the band, the earliest first."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(_DEPARTURE_COLUMNS)
        for departure in result.departures:
            record = departure.as_json()
            writer.writerow([record[column] for column in _DEPARTURE_COLUMNS])


def plot_path(html_path: Path) -> Path:
    """Where write_trend_html writes the plot: beside the page, same name, .svg."""
    return html_path.with_suffix(".svg")


def write_trend_html(result: TrendResult, path: Path) -> Path:
    """The page and its plot (an SVG file beside it, also inlined in the page). Returns the SVG's path."""
    svg = trend_svg(result)
    svg_path = plot_path(path)
    write_text_atomic(svg_path, svg)
    first = result.first()
    verdict = "box" if first is not None else "ok"
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>npu-compare --trend report</title>",
           f"<style>{report_page.CSS}</style></head><body>", "<h1>npu-compare --trend report</h1>",
           f"<p>golden: <code>{html.escape(str(result.golden))}</code><br>perturbed golden: "
           f"<code>{html.escape(', '.join(map(str, result.perturbed)))}</code><br>NPU: <code>{html.escape(str(result.npu))}</code></p>",
           f"<div class='{verdict}' id='verdict'><b>{html.escape(result.headline())}</b></div>"]
    out += [f"<p class='note'>{html.escape(note)}</p>" for note in result.notes]
    out.append(f"<p class='note'>{html.escape(band_text())}.</p>")
    out.append(f"<h2>The statistic and the band</h2><p class='note'>Also in <code>{html.escape(svg_path.name)}</code>."
               "</p>" + svg)
    if result.departures:
        out.append(f"<h2>Statistics that left the band ({len(result.departures)})</h2><table><tr>"
                   + "".join(f"<th>{c}</th>" for c in ("rank", "module", "record", "statistic", "steps out", "golden",
                                                       "perturbed golden", "NPU", "band +-", "x band", "at most")) + "</tr>")
        for index, d in enumerate(result.departures[:500]):
            cells = (d.rank, d.module(), d.record(), d.statistic, f"{d.first_step}-{d.last_step}",
                     *(short_value(value, d.half_width) for value in (d.golden, d.perturbed, d.npu)),
                     short_value(d.half_width), _times(d.times_out()), _times(d.peak))
            css = " class='first'" if index == 0 else ""
            out.append(f"<tr{css}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        out.append("</table>")
        if len(result.departures) > 500:
            out.append(f"<p class='note'>... {len(result.departures) - 500} more (--csv lists them all)</p>")
    out.append("</body></html>")
    write_text_atomic(path, "".join(out))
    return svg_path


def trend_svg(result: TrendResult) -> str:
    """A panel per plotted statistic: the golden run, the perturbed golden run, the NPU run and the
    band; the departure's steps shaded."""
    width, panel, gap = 960, 230, 40
    first = result.first()
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{(len(result.plots) + 1) * (panel + gap) + 10}"'
             ' font-size="11" font-family="sans-serif">']
    panels = [(series, False) for series in result.plots]
    if panels:  # the first series also as its distance from the golden run, where the band shows its width
        panels.insert(1, (result.plots[0], True))
    for index, (series, relative) in enumerate(panels):
        departure = first if first is not None and (first.rank, first.kind, first.name) == (
            series.rank, series.kind, series.name) and index < 2 else None
        parts.append(_panel(series, departure, top=index * (panel + gap) + 10, width=width, height=panel,
                            relative=relative))
    parts.append("</svg>")
    return "".join(parts)


def _panel(series: Series, departure, top: float, width: int, height: int, relative: bool = False) -> str:
    left, right, bottom_pad = 70, 20, 22
    steps = np.asarray(series.steps, dtype=float)
    keep = np.unique(np.append(np.linspace(0, len(steps) - 1, min(len(steps), _PLOT_POINTS)).astype(int), len(steps) - 1))
    steps = steps[keep]
    golden, perturbed, npu, half = (np.asarray(a, dtype=float)[keep] for a in
                                    (series.golden, series.perturbed, series.npu, series.half_width))
    if relative:  # each run minus the golden run: the band is 0 +- its half-width
        perturbed, npu, golden = perturbed - golden, npu - golden, np.zeros_like(golden)
    upper, lower = golden + half, golden - half
    shown = np.concatenate([v[np.isfinite(v)] for v in (golden, perturbed, npu, upper, lower)])
    low, high = (float(shown.min()), float(shown.max())) if shown.size else (0.0, 1.0)
    if high - low <= 1e-300 * max(1.0, abs(high)):
        low, high = low - 1.0, high + 1.0
    pad = (high - low) * 0.05
    low, high = low - pad, high + pad
    plot_top, plot_bottom = top + 18, top + height - bottom_pad
    span = max(steps[-1] - steps[0], 1.0)

    def x(step: float) -> float:
        return left + (width - left - right) * (step - steps[0]) / span

    def y(value: float) -> float:
        value = min(max(value, low), high) if math.isfinite(value) else high
        return plot_bottom - (plot_bottom - plot_top) * (value - low) / (high - low)

    title = series.kind if series.kind in SCALARS else f"{series.kind} {series.name} {series.statistic}"
    title += ", minus the golden run" if relative else ""
    rank = f" (rank {series.rank})"
    parts = [f'<text x="{left}" y="{top + 10}" font-weight="bold">{html.escape(title + rank)}</text>',
             f'<text x="{width - 470}" y="{top + 10}"><tspan fill="#2e86c1">golden</tspan>, <tspan fill="#8e44ad">'
             'perturbed golden</tspan>, <tspan fill="#e74c3c">NPU</tspan>, <tspan fill="#27ae60">band</tspan></text>']
    for fraction in (0.0, 0.5, 1.0):
        value = low + (high - low) * fraction
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#eee"/>'
                     f'<text x="4" y="{y(value) + 4:.1f}">{value:.4g}</text>')
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        step = round(steps[0] + span * fraction)
        parts.append(f'<text x="{x(step) - 10:.1f}" y="{plot_bottom + 14:.1f}">{step}</text>')
    if departure is not None:
        x0, x1 = x(departure.first_step), x(departure.last_step)
        parts.append(f'<rect x="{x0:.1f}" y="{plot_top}" width="{max(x1 - x0, 1.0):.1f}" height="{plot_bottom - plot_top}"'
                     f' fill="#fdecea"/><line x1="{x0:.1f}" x2="{x0:.1f}" y1="{plot_top}" y2="{plot_bottom}" '
                     f'stroke="#e74c3c" stroke-dasharray="4 3"/><text x="{x0 + 4:.1f}" y="{plot_top + 12}" '
                     f'fill="#e74c3c">leaves the band: steps {departure.first_step}-{departure.last_step}</text>')
    finite = np.isfinite(upper) & np.isfinite(lower)
    if finite.any():
        outline = [f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps[finite], upper[finite])]
        outline += [f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps[finite][::-1], lower[finite][::-1])]
        parts.append(f'<polygon points="{" ".join(outline)}" fill="#27ae60" fill-opacity="0.18" stroke="none"/>')
    for values, colour, dash in ((golden, "#2e86c1", ""), (perturbed, "#8e44ad", ' stroke-dasharray="3 2"'),
                                 (npu, "#e74c3c", "")):
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, values) if not math.isnan(v))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2"{dash} points="{points}"/>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{plot_top}" y2="{plot_bottom}" stroke="#999"/>'
                 f'<line x1="{left}" x2="{width - right}" y1="{plot_bottom}" y2="{plot_bottom}" stroke="#999"/>')
    return "".join(parts)
