"""Every HTML report npukit writes, opened in a real headless Chromium.

npu-compare's --html report is the only HTML npukit writes (the profiler writes CSV, JSON and
Chrome-trace JSON; npu-migrate writes Markdown, CSV, JSON and SARIF). The page must load without
a console error, an uncaught exception or a failed load, draw its chart (checked in the DOM and in
the screenshot's pixels), mark the first divergence and show a table that sorts. Its module tree
must open at the first divergence without a click (DOM and screenshot pixels), show a module's ops
when clicked, filter by verdict, sort, show a fix record on its module, say how it grouped dumps
without construct.json, and a 100k-row report must be ready within 2 s of navigation start.

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


def compare_to_html(root):
    """npu-compare ROOT/golden ROOT/target --html --json, in this process: (the page, the JSON report).
    Both dumps hold an injected bug, so it must exit 1."""
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
    return html_path, json.loads(json_path.read_text())


@pytest.fixture(scope="module")
def compare_report(tmp_path_factory):
    """npu-compare --html on a golden/target pair whose target has one injected bug (LayerNorm eps)."""
    root = tmp_path_factory.mktemp("report")
    dump_forward(root / "golden", layer_norm_eps=1e-5)
    dump_forward(root / "target", layer_norm_eps=0.5)
    html_path, report = compare_to_html(root)
    first = report["pairs"][0]["first_divergence"]["entry"]
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
    verdictBox: (document.querySelector('#verdict') || {}).textContent || '',
    // the pair's box naming the first divergence (the page's first box is the verdict)
    divergenceBox: ([...document.querySelectorAll('.box')].find(b => b.textContent.startsWith('First divergence:'))
                    || {}).textContent || '',
    headers: [...document.querySelectorAll('#all-rows table.sortable th')].map(th => th.textContent),
    rows: document.querySelectorAll('#all-rows table.sortable tbody tr').length,
    firstRows: [...document.querySelectorAll('#all-rows table.sortable tbody tr.first')].map(r => r.cells[2].textContent),
  };
})()"""

COLUMN_AFTER_CLICK = """((name) => {
  const headers = [...document.querySelectorAll('#all-rows table.sortable th')];
  const column = headers.findIndex(th => th.textContent === name);
  headers[column].click();
  return [...document.querySelectorAll('#all-rows table.sortable tbody tr')].map(r => r.cells[column].textContent);
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
    assert facts["verdictBox"].startswith("Summary:")  # a divergence: the red verdict box, as the terminal says it
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


# ---------------------------------------------------------------------------- the module tree
class Block(torch.nn.Module):
    def __init__(self, layer_norm_eps: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16, eps=layer_norm_eps)

    def forward(self, x):
        return x + F.gelu(self.norm(self.fc(x)))


class Encoder(torch.nn.Module):
    def __init__(self, layer_norm_eps: float) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(1e-5), Block(layer_norm_eps)])
        self.final = torch.nn.LayerNorm(16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.final(x)


class NestedNet(torch.nn.Module):
    """Modules three deep (encoder.blocks.1.norm); the injected bug is in encoder.blocks.1.norm."""

    def __init__(self, layer_norm_eps: float) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.encoder = Encoder(layer_norm_eps)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def dump_training_step(out, layer_norm_eps: float) -> None:
    torch.manual_seed(0)
    model = NestedNet(layer_norm_eps)
    x = torch.randn(6, 8)
    with DumpSession(out, level="mix", mode="tensor"):
        model(x).square().mean().backward()


DIVERGED_MODULE = "encoder.blocks.1.norm"
# report_page.DIVERGED_BACKGROUND, the background of the first-divergence node
DIVERGED_COLOUR = (0xFF, 0xD8, 0x4D)


@pytest.fixture(scope="module")
def nested_report(tmp_path_factory):
    """npu-compare --html --json of a forward and backward of NestedNet, LayerNorm eps wrong in one block."""
    root = tmp_path_factory.mktemp("nested")
    dump_training_step(root / "golden", layer_norm_eps=1e-5)
    dump_training_step(root / "target", layer_norm_eps=0.5)
    html_path, report = compare_to_html(root)
    report = report["pairs"][0]
    assert report["first_divergence"]["module_path"] == DIVERGED_MODULE, report["first_divergence"]
    return root, html_path, report


def module_rows(root, report: dict, module_path: str) -> set[str]:
    """Names of the rows that belong to a module, read independently of the page: its own entries'
    rows and those of the api entries construct.json places in it."""
    construct = json.loads((root / "target" / "step0" / "rank0" / "construct.json").read_text())

    def module_of(entry: str) -> str | None:
        module = entry if entry.startswith("Module.") else construct.get(entry)
        return ".".join(module.split(".")[1:-3]) if module else None  # Module.<path>.<Class>.<direction>.<n>

    names = set()
    for row in report["rows"]:
        name = row["NPU Name"]
        entry = name.split(".parameters_grad.")[0] + ".parameters_grad.0" if ".parameters_grad." in name else next(
            name[:name.rindex(marker)] for marker in (".input.", ".output.", ".parameters.") if marker in name)
        if module_of(entry) == module_path:
            names.add(name)
    return names


TREE_FACTS = """(() => {
  const tree = document.querySelector('#tree'), treeBox = tree.getBoundingClientRect();
  const nodes = [...tree.querySelectorAll('li.node')];
  const label = li => li.querySelector(':scope > .label');
  const diverged = [...tree.querySelectorAll('.label.diverged')];
  const box = diverged.length ? diverged[0].getBoundingClientRect() : null;
  const style = diverged.length ? getComputedStyle(diverged[0]) : null;
  return {
    note: document.querySelector('#tree-note').textContent,
    shown: nodes.map(li => label(li).title),
    expanded: nodes.filter(li => li.querySelector(':scope > ul')).map(li => label(li).title),
    classes: Object.fromEntries(nodes.map(li => [label(li).title, li.className])),
    diverged: diverged.map(l => l.title),
    divergedBox: box && {x: box.x + scrollX, y: box.y + scrollY, width: box.width, height: box.height},
    divergedInsideTree: !!box && box.top >= treeBox.top && box.bottom <= treeBox.bottom && box.width > 0,
    divergedBackground: style && style.backgroundColor,
    selected: [...tree.querySelectorAll('.label.selected')].map(l => l.title),
    opsTitle: (document.querySelector('#node-title') || {}).textContent || '',
    opsRows: [...document.querySelectorAll('#node-ops tbody tr')].map(r => r.cells[2].textContent),
    opsFirst: [...document.querySelectorAll('#node-ops tbody tr.first')].map(r => r.cells[2].textContent),
    fixBadges: tree.querySelectorAll('.badge.fix').length,
    fixBoxes: [...document.querySelectorAll('.fixbox')].map(b => b.textContent),
    ready: window.npukitReady,
  };
})()"""

COUNT_COLOUR_IN_BOX = """(async () => {
  const image = new Image();
  image.src = 'data:image/png;base64,%s';
  await image.decode();
  const box = %s, [r, g, b] = %s;
  const canvas = document.createElement('canvas');
  canvas.width = image.width; canvas.height = image.height;
  const context = canvas.getContext('2d', {willReadFrequently: true});
  context.drawImage(image, 0, 0);
  const count = (x, y, w, h) => {
    const pixels = context.getImageData(x, y, w, h).data;
    let n = 0;
    for (let i = 0; i < pixels.length; i += 4)
      if (Math.abs(pixels[i] - r) + Math.abs(pixels[i + 1] - g) + Math.abs(pixels[i + 2] - b) < 30) n++;
    return n;
  };
  const inside = count(Math.floor(box.x), Math.floor(box.y), Math.ceil(box.width), Math.ceil(box.height));
  return {inside, area: Math.ceil(box.width) * Math.ceil(box.height), everywhere: count(0, 0, image.width, image.height)};
})()"""


def test_tree_opens_at_the_first_divergence_without_a_click(chromium, nested_report, tmp_path):
    root, html_path, report = nested_report
    screenshot = tmp_path / "tree.png"
    with Chromium(chromium) as browser:
        browser.open(html_path.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        facts = browser.evaluate(TREE_FACTS)
        png = browser.screenshot(screenshot)
        painted = browser.evaluate(COUNT_COLOUR_IN_BOX % (base64.b64encode(png).decode(), json.dumps(facts["divergedBox"]),
                                                          json.dumps(DIVERGED_COLOUR)))
        problems = browser.problems.all()
    assert problems == [], problems
    assert "construct.json" in facts["note"], facts["note"]
    # The path encoder -> encoder.blocks.1 -> its norm is open, nothing else: collapsed by default. (The
    # model itself has no entry, as in msprobe's dumps: its modules are the tree's top.)
    assert facts["expanded"] == ["encoder", "encoder.blocks.1"], facts
    assert facts["shown"] == ["embed", "encoder", "encoder.blocks.0", "encoder.blocks.1",
                              "encoder.blocks.1.fc", DIVERGED_MODULE, "encoder.final", "head",
                              "(outside any module): ops no module ran (the loss, casts, the optimizer's ops)"], facts
    assert facts["diverged"] == [DIVERGED_MODULE] and facts["divergedInsideTree"], facts
    assert facts["divergedBackground"] == "rgb({}, {}, {})".format(*DIVERGED_COLOUR), facts
    # Coloured by the worst verdict of the module and its sub-modules: the bug's module and all above it are errors.
    for path in ("encoder", "encoder.blocks.1", DIVERGED_MODULE):
        assert "v-err" in facts["classes"][path].split(), (path, facts["classes"])
    # Its ops are listed without a click, the divergent op's rows marked.
    assert facts["selected"] == [DIVERGED_MODULE] and facts["opsTitle"].startswith(DIVERGED_MODULE)
    assert set(facts["opsRows"]) == module_rows(root, report, DIVERGED_MODULE), facts["opsRows"]
    assert facts["opsFirst"] and all(name.startswith(report["first_divergence"]["entry"]) for name in facts["opsFirst"])
    assert facts["fixBadges"] == 0 and facts["fixBoxes"] == [], "no fix record given: no fix shown"
    # The highlight reached the screen: the node's box is mostly the highlight colour, and little else is.
    assert painted["inside"] >= 0.5 * painted["area"], (painted, screenshot)
    assert painted["everywhere"] - painted["inside"] < 0.2 * painted["inside"], (painted, screenshot)


def test_clicking_a_module_expands_it_and_shows_its_ops(chromium, nested_report):
    root, html_path, report = nested_report
    with Chromium(chromium) as browser:
        browser.open(html_path.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        browser.click('#tree .label[title="encoder.blocks.0"]')
        after_block = browser.evaluate(TREE_FACTS)
        browser.click('#with-submodules')
        with_subtree = browser.evaluate(TREE_FACTS)
        browser.click('#with-submodules')
        browser.click('#tree .label[title="encoder.blocks.0.fc"]')
        after_leaf = browser.evaluate(TREE_FACTS)
        problems = browser.problems.all()
    assert problems == [], problems
    assert "encoder.blocks.0" in after_block["expanded"], after_block["expanded"]
    assert {"encoder.blocks.0.fc", "encoder.blocks.0.norm"} <= set(after_block["shown"])
    assert after_block["selected"] == ["encoder.blocks.0"] and after_block["opsTitle"].startswith("encoder.blocks.0")
    assert set(after_block["opsRows"]) == module_rows(root, report, "encoder.blocks.0") != set()
    assert after_block["diverged"] == [DIVERGED_MODULE], "the first divergence stays highlighted"
    assert after_leaf["selected"] == ["encoder.blocks.0.fc"]
    fc_rows = module_rows(root, report, "encoder.blocks.0.fc")
    assert set(after_leaf["opsRows"]) == fc_rows and any(name.startswith("Functional.linear.") for name in fc_rows)
    # "include sub-modules' ops": the block's own rows and those of its fc and norm
    block_and_below = set().union(*(module_rows(root, report, path) for path in
                                    ("encoder.blocks.0", "encoder.blocks.0.fc", "encoder.blocks.0.norm")))
    assert set(with_subtree["opsRows"]) == block_and_below and len(with_subtree["opsRows"]) == len(block_and_below)
    assert block_and_below > set(after_block["opsRows"])


VERDICT_FILTER = """((verdict, on) => {
  const box = document.querySelector('input.verdict[data-verdict="' + ['error', 'warn', 'unmatched', 'pass'].indexOf(verdict) + '"]');
  if (box.checked !== on) box.click();
  const results = sel => [...document.querySelectorAll(sel + ' tbody tr')].map(r => r.cells[13].textContent);
  return {all: results('#all-rows'), ops: results('#node-ops'),
          nodes: [...document.querySelectorAll('#tree li.node > .label')].map(l => l.title),
          pager: document.querySelector('#all-rows .pager').textContent};
})(%s, %s)"""


def test_verdict_filter_hides_rows_and_modules(chromium, nested_report):
    _, html_path, report = nested_report
    counts = {}
    for row in report["rows"]:
        counts[row["Result"]] = counts.get(row["Result"], 0) + 1
    with Chromium(chromium) as browser:
        browser.open(html_path.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        everything = browser.evaluate(VERDICT_FILTER % ('"pass"', "true"))
        no_pass = browser.evaluate(VERDICT_FILTER % ('"pass"', "false"))
        only_warn = [browser.evaluate(VERDICT_FILTER % (json.dumps(verdict), "false")) for verdict in ("error", "unmatched")][-1]
        back = [browser.evaluate(VERDICT_FILTER % (json.dumps(verdict), "true")) for verdict in ("error", "unmatched", "pass")][-1]
        problems = browser.problems.all()
    assert problems == [], problems
    assert len(everything["all"]) == len(report["rows"]) and "pass" in everything["all"]
    assert sorted(set(no_pass["all"])) == sorted(set(counts) - {"pass"}) and len(no_pass["all"]) == len(report["rows"]) - counts["pass"]
    assert f"{counts['pass']} hidden by the verdict filter" in no_pass["pager"], no_pass["pager"]
    assert "pass" not in no_pass["ops"] and no_pass["ops"], no_pass
    assert set(only_warn["all"]) == {"warn"} and len(only_warn["all"]) == counts["warn"]
    # Modules with no warn row among theirs and their sub-modules' are gone from the tree.
    assert "embed" in everything["nodes"] and "embed" not in only_warn["nodes"], only_warn["nodes"]
    assert DIVERGED_MODULE not in only_warn["nodes"] and "encoder" in only_warn["nodes"]
    assert back["all"] == everything["all"] and back["nodes"] == everything["nodes"]


SORT_BY = """((table, name) => {
  const headers = [...document.querySelectorAll(table + ' th')];
  const column = headers.findIndex(th => th.textContent === name);
  headers[column].click();
  return [...document.querySelectorAll(table + ' tbody tr')].map(r => r.cells[column].textContent);
})(%s, %s)"""


def test_columns_sort_both_ways_in_both_tables(chromium, nested_report):
    _, html_path, _ = nested_report
    with Chromium(chromium) as browser:
        browser.open(html_path.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        browser.click('#tree .label[title="encoder"]')  # a module with rows of several verdicts and errors
        ops_up = browser.evaluate(SORT_BY % ('"#node-ops"', '"RelativeL2"'))
        ops_down = browser.evaluate(SORT_BY % ('"#node-ops"', '"RelativeL2"'))
        names_up = browser.evaluate(SORT_BY % ('"#all-rows"', '"NPU Name"'))
        names_down = browser.evaluate(SORT_BY % ('"#all-rows"', '"NPU Name"'))
        results_up = browser.evaluate(SORT_BY % ('"#all-rows"', '"Result"'))
        problems = browser.problems.all()
    assert problems == [], problems
    errors = [float(text) for text in ops_up if text]
    assert len(errors) >= 3 and errors == sorted(errors) and errors[0] < errors[-1], ops_up
    assert [float(text) for text in ops_down if text] == errors[::-1]
    assert names_up == sorted(names_up) and names_down == names_up[::-1] and len(set(names_up)) > 10
    severity = ["error", "warn", "unmatched", "pass"]
    assert [severity.index(v) for v in results_up] == sorted(severity.index(v) for v in results_up), "worst first"


def test_a_fix_record_is_shown_on_its_module(chromium, nested_report, tmp_path):
    from npukit.accuracy.compare import compare_dirs
    from npukit.accuracy.report import write_html

    root, _, _ = nested_report
    result = compare_dirs(root / "golden", root / "target", workers=1)
    page = tmp_path / "fix.html"
    code = "with torch.autocast('npu', enabled=False):\n    h = self.norm(h.float())  # </script> stays text"
    write_html(result, page, fix=[{"module": DIVERGED_MODULE, "summary": "keep this LayerNorm in fp32",
                                   "code": code, "details": "relative L2 0.41 -> 2e-07 in 3 runs"},
                                  {"module": "no.such.module", "description": "a module the tree lacks", "code": "x = 1"}])
    with Chromium(chromium) as browser:
        browser.open(page.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        facts = browser.evaluate(TREE_FACTS)
        badge_on = browser.evaluate("[...document.querySelectorAll('#tree .badge.fix')].map(b => b.parentNode.title)")
        shown_code = browser.evaluate("document.querySelector('#node-ops .fixcode').textContent")
        problems = browser.problems.all()
    assert problems == [], problems
    assert badge_on == [DIVERGED_MODULE] and facts["selected"] == [DIVERGED_MODULE]
    assert len(facts["fixBoxes"]) == 2 and "keep this LayerNorm in fp32" in facts["fixBoxes"][0]
    assert "0.41 -> 2e-07" in facts["fixBoxes"][0] and shown_code == code
    assert "no.such.module" in facts["fixBoxes"][1] and "a module the tree lacks" in facts["fixBoxes"][1]


def test_a_fix_made_in_every_block_is_shown_on_each_blocks_module(chromium, nested_report, tmp_path):
    """The fix finder's `"module": "encoder.blocks.*.fc"` (one change for every block) names no single
    node: it is shown on each module it names, each path opened, not below the tree as unplaced."""
    from npukit.accuracy.compare import compare_dirs
    from npukit.accuracy.report import write_html

    root, _, _ = nested_report
    result = compare_dirs(root / "golden", root / "target", workers=1)
    page = tmp_path / "every.html"
    write_html(result, page, fix=[{"module": "encoder.blocks.*.fc", "description": "compute Functional.linear in every "
                                   "encoder.blocks.*.fc in fp32", "code": "change_op(model, ...)"}])
    with Chromium(chromium) as browser:
        browser.open(page.resolve().as_uri())
        browser.wait_for("window.npukitReady")
        badge_on = browser.evaluate("[...document.querySelectorAll('#tree .badge.fix')].map(b => b.parentNode.title)")
        unplaced = browser.evaluate("[...document.querySelectorAll('body > .fixbox')].map(b => b.textContent)")
        browser.evaluate("document.querySelector('#tree li[data-node] > .label[title=\"encoder.blocks.0.fc\"]').click()")
        shown = browser.evaluate("[...document.querySelectorAll('#node-ops .fixbox')].map(b => b.textContent)")
        problems = browser.problems.all()
    assert problems == [], problems
    assert sorted(badge_on) == ["encoder.blocks.0.fc", "encoder.blocks.1.fc"] and unplaced == [], (badge_on, unplaced)
    assert len(shown) == 1 and "every encoder.blocks.*.fc" in shown[0] and "change_op(model, ...)" in shown[0]


def test_dumps_without_construct_json_say_how_the_page_groups_rows(chromium, nested_report, tmp_path):
    import shutil

    from npukit.accuracy.compare import compare_dirs
    from npukit.accuracy.report import write_html

    root, _, report = nested_report
    for side in ("golden", "target"):
        shutil.copytree(root / side, tmp_path / side)
        (tmp_path / side / "step0" / "rank0" / "construct.json").unlink()
    write_html(compare_dirs(tmp_path / "golden", tmp_path / "target", workers=1), tmp_path / "prefix.html")
    for side in ("golden", "target"):  # an api-level dump: no module entries either
        torch.manual_seed(0)
        model = NestedNet(1e-5 if side == "golden" else 0.5)
        with DumpSession(tmp_path / f"api-{side}", level="api", mode="tensor"), torch.no_grad():
            model(torch.randn(6, 8))
        for construct in (tmp_path / f"api-{side}").rglob("construct.json"):
            construct.unlink()
    write_html(compare_dirs(tmp_path / "api-golden", tmp_path / "api-target", workers=1), tmp_path / "flat.html")
    with Chromium(chromium) as browser:
        browser.open((tmp_path / "prefix.html").as_uri())
        browser.wait_for("window.npukitReady")
        prefix = browser.evaluate(TREE_FACTS)
        browser.click('#tree .label[title="encoder"]')
        prefix_opened = browser.evaluate(TREE_FACTS)
        browser.open((tmp_path / "flat.html").as_uri())
        browser.wait_for("window.npukitReady")
        flat = browser.evaluate("({note: document.querySelector('#tree-note').textContent, tree: !!document.querySelector('#tree'),"
                                " rows: document.querySelectorAll('#all-rows tbody tr').length})")
        problems = browser.problems.all()
    assert problems == [], problems
    assert "no construct.json" in prefix["note"] and "module path prefix" in prefix["note"], prefix["note"]
    # Module entries still nest by path (collapsed); the api ops, the divergent one among them, go under
    # one node that says why.
    assert prefix["shown"] == ["embed", "encoder", "head", "(api ops, module unknown): without construct.json"
                               " the page cannot tell which module ran an api op"], prefix["shown"]
    assert prefix["diverged"] == prefix["shown"][3:] and prefix["expanded"] == [], prefix
    assert prefix["opsFirst"] and prefix["opsFirst"][0].startswith(report["first_divergence"]["entry"]), prefix
    assert {"encoder.blocks.0", "encoder.blocks.1"} <= set(prefix_opened["shown"]), prefix_opened["shown"]
    assert "no module tree" in flat["note"] and not flat["tree"] and flat["rows"] > 5, flat


# ---------------------------------------------------------------------------- 100k rows
LOAD_BUDGET_MS = 2000


def test_a_100k_row_report_loads_in_under_two_seconds(chromium, tmp_path):
    from npukit.accuracy.report import write_html

    from .synthetic import synthetic_result

    result = synthetic_result(tmp_path, rows=100_000)
    page = tmp_path / "report.html"
    write_html(result, page)
    assert len(result.rows) >= 100_000
    with Chromium(chromium) as browser:
        browser.open(page.as_uri())
        ready_ms = browser.wait_for("window.npukitReady")  # performance.now(): since navigation start
        facts = browser.evaluate(TREE_FACTS)
        dom = browser.evaluate("({rows: document.querySelectorAll('tr').length, nodes: document.querySelectorAll('li.node').length,"
                               " elements: document.querySelectorAll('*').length,"
                               " loaded: performance.getEntriesByType('navigation')[0].loadEventEnd})")
        problems = browser.problems.all()
    size = page.stat().st_size / 1e6
    print(f"\n100k-row npu-compare page: {len(result.rows)} rows, {size:.1f} MB, ready {ready_ms:.0f} ms after"
          f" navigation start (load event {dom['loaded']:.0f} ms); {dom['elements']} elements in the DOM")
    assert problems == [], problems
    assert ready_ms < LOAD_BUDGET_MS, f"{len(result.rows)}-row page ready after {ready_ms:.0f} ms"
    # Lazy: a page of each table and the open path of the tree are in the DOM, not 100k rows.
    assert dom["rows"] < 500 and dom["elements"] < 20_000, dom
    assert facts["diverged"] and facts["diverged"][0].endswith("mlp.fc2") and facts["divergedInsideTree"], facts
