"""Every HTML report npukit writes, opened in a real headless Chromium.

npu-compare's --html report is the only HTML npukit writes (the profiler writes CSV, JSON and
Chrome-trace JSON; npu-migrate writes Markdown, CSV, JSON and SARIF). The page must load without
a console error, an uncaught exception or a failed load, draw its chart (checked in the DOM and in
the screenshot's pixels), mark the first divergence and show a table that sorts.

Skipped only when Chromium is absent outside CI; in CI (CI=true) a missing Chromium fails.
"""

from __future__ import annotations

import base64
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from npukit.accuracy.dump import DumpSession
from npukit.cli import compare_main

from .browser import Chromium, find_chromium

# Colours of the chart's series in npukit/accuracy/report.py: relative L2, cosine, divergence marker.
CHART_COLOURS = {"relative L2": (0x2E, 0x86, 0xC1), "cosine": (0x28, 0xB4, 0x63), "first divergence": (0xE7, 0x4C, 0x3C)}


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        if running_in_ci():
            pytest.fail("CI is set but Chromium was not found: install the Debian packages chromium and "
                        "chromium-driver (or set CHROMIUM=/path/to/chromium)")
        pytest.skip("Chromium is not installed (apt-get install chromium chromium-driver); CI runs this test")
    return path


class TinyNet(torch.nn.Module):
    def __init__(self, layer_norm_eps: float) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16, eps=layer_norm_eps)
        self.hidden = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(self.embed(x))
        h = F.gelu(self.hidden(h))
        return self.head(h * 0.5)


def dump_forward(out, layer_norm_eps: float) -> None:
    torch.manual_seed(0)
    model = TinyNet(layer_norm_eps)
    x = torch.randn(6, 8)
    with DumpSession(out, level="mix", mode="tensor"), torch.no_grad():
        model(x)


@pytest.fixture(scope="module")
def compare_report(tmp_path_factory):
    """npu-compare --html on a golden/target pair whose target has one injected bug (LayerNorm eps)."""
    root = tmp_path_factory.mktemp("report")
    dump_forward(root / "golden", layer_norm_eps=1e-5)
    dump_forward(root / "target", layer_norm_eps=0.5)
    html_path, json_path = root / "report.html", root / "report.json"
    argv = sys.argv
    sys.argv = ["npu-compare", str(root / "golden"), str(root / "target"), "--html", str(html_path),
                "--json", str(json_path), "--workers", "1"]
    try:
        with pytest.raises(SystemExit) as exit_info:
            compare_main()
    finally:
        sys.argv = argv
    assert exit_info.value.code == 1, "npu-compare should report the injected divergence"
    first = json.loads(json_path.read_text())["pairs"][0]["first_divergence"]["entry"]
    assert "layer_norm" in first, f"the injected LayerNorm bug should be the first divergence, got {first}"
    return html_path, first


PAGE_FACTS = """(() => {
  const svg = document.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : null;
  const polylines = svg ? [...svg.querySelectorAll('polyline')] : [];
  const markers = svg ? [...svg.querySelectorAll('text')].filter(t => t.textContent.startsWith('first divergence:')) : [];
  return {
    title: document.title,
    charts: document.querySelectorAll('svg').length,
    chartBox: box && {x: box.x + scrollX, y: box.y + scrollY, width: box.width, height: box.height},
    seriesPoints: polylines.map(p => p.points.numberOfItems),
    dots: svg ? svg.querySelectorAll('circle').length : 0,
    marker: markers.map(t => t.textContent),
    markerLine: svg ? svg.querySelectorAll('line[stroke="#e74c3c"]').length : 0,
    divergenceBox: (document.querySelector('.box') || {}).textContent || '',
    headers: [...document.querySelectorAll('table.sortable th')].map(th => th.textContent),
    rows: document.querySelectorAll('table.sortable tbody tr').length,
    firstRows: [...document.querySelectorAll('table.sortable tbody tr.first')].map(r => r.cells[2].textContent),
  };
})()"""

COLUMN_AFTER_CLICK = """((name) => {
  const headers = [...document.querySelectorAll('table.sortable th')];
  const column = headers.findIndex(th => th.textContent === name);
  headers[column].click();
  return [...document.querySelectorAll('table.sortable tbody tr')].map(r => r.cells[column].textContent);
})(%s)"""

# Decode the screenshot in the page itself (no image library needed) and count, inside the
# chart's box, the pixels close to each series colour.
COUNT_COLOURS = """(async () => {
  const image = new Image();
  image.src = 'data:image/png;base64,%s';
  await image.decode();
  const box = %s, colours = %s;
  const canvas = document.createElement('canvas');
  canvas.width = image.width; canvas.height = image.height;
  const context = canvas.getContext('2d');
  context.drawImage(image, 0, 0);
  const pixels = context.getImageData(Math.floor(box.x), Math.floor(box.y), Math.ceil(box.width), Math.ceil(box.height)).data;
  const counts = {};
  for (const [name, [r, g, b]] of Object.entries(colours)) {
    let n = 0;
    for (let i = 0; i < pixels.length; i += 4)
      if (Math.abs(pixels[i] - r) + Math.abs(pixels[i + 1] - g) + Math.abs(pixels[i + 2] - b) < 60) n++;
    counts[name] = n;
  }
  return {counts, width: image.width, height: image.height};
})()"""


def test_compare_report_renders_chart_marker_and_table(chromium, compare_report, tmp_path):
    html_path, first_divergence = compare_report
    screenshot = tmp_path / "npu-compare-report.png"
    with Chromium(chromium) as browser:
        browser.open(html_path.resolve().as_uri())
        facts = browser.evaluate(PAGE_FACTS)
        assert facts["charts"] == 1, f"{html_path}: expected one chart, the page has {facts['charts']}"
        png = browser.screenshot(screenshot)  # as the page first appears, before the table is sorted
        painted = browser.evaluate(COUNT_COLOURS % (base64.b64encode(png).decode(), json.dumps(facts["chartBox"]),
                                                    json.dumps(CHART_COLOURS)))
        cosine_sorted = browser.evaluate(COLUMN_AFTER_CLICK % json.dumps("Cosine"))
        problems = browser.problems.all()

    assert problems == [], f"{html_path} reported errors in the browser: {problems}"
    assert facts["title"] == "npu-compare report"
    assert facts["chartBox"]["width"] > 500 and facts["chartBox"]["height"] > 200, facts
    # Both series (relative L2 and cosine) drawn through every measured op output, one dot per op.
    assert len(facts["seriesPoints"]) == 2 and min(facts["seriesPoints"]) >= 5, facts
    assert facts["dots"] == facts["seriesPoints"][0], facts
    assert facts["marker"] == [f"first divergence: {first_divergence}"] and facts["markerLine"] == 1, facts
    assert first_divergence in facts["divergenceBox"]
    assert {"NPU Name", "Cosine", "RelativeL2", "Result"} <= set(facts["headers"])
    assert facts["rows"] >= 10 and facts["firstRows"] and all(first_divergence in name for name in facts["firstRows"])
    cosines = [float(text) for text in cosine_sorted if text]
    assert cosines == sorted(cosines) and cosines[0] < cosines[-1], "clicking Cosine should sort the table ascending"
    # The chart really reached the screen: each series colour is painted inside the chart's box.
    assert png.startswith(b"\x89PNG") and painted["height"] >= facts["chartBox"]["y"] + facts["chartBox"]["height"]
    for series, count in painted["counts"].items():
        assert count >= 20, f"{series} is not visible in the screenshot {screenshot}: {painted['counts']}"


def test_browser_check_sees_every_kind_of_page_error(chromium, tmp_path):
    # The checks above are only as good as the error collection: a page with one of each problem.
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><head><title>broken</title></head><body><img src='missing.png'>"
                    "<script>console.error('drawn nothing');</script><script>undefinedChart();</script></body></html>")
    with Chromium(chromium) as browser:
        browser.open(page.as_uri())
        problems = browser.problems
        assert browser.evaluate("document.querySelectorAll('svg').length") == 0
    assert problems.console_errors == ["console.error: drawn nothing"]
    assert len(problems.exceptions) == 1 and "undefinedChart is not defined" in problems.exceptions[0]
    assert any("missing.png" in entry for entry in problems.log_errors), problems.log_errors
