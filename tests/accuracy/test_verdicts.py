"""npu-compare's verdict (#31): "No divergence found" only when the compare saw the runs. A dump an
internal error switched off says so and exits 1; a compare that paired less than most of either
side says so, naming what stopped pairing, and exits 1; compiled regions not dumped are named; a
cross-tool pair draws no divergence from entries one tool lacks. The exit code, the terminal's
headline, the JSON report and the HTML page say the same thing."""

from __future__ import annotations

import csv
import html
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console

from npukit.accuracy.cli_compare import run_compare
from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.dump import DumpSession
from npukit.errors import UserError


class Layer(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 32), nn.Linear(32, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Inference of a decoder-like stack: an embedding, four layers, a head."""

    def __init__(self):
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(40, 16), nn.ModuleList(Layer() for _ in range(4)), nn.Linear(16, 40)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x).to(torch.float32)
        return self.head(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def _dump_json(folder: Path) -> Path:
    [path] = folder.rglob("dump.json")
    return path


def _edit(folder: Path, change) -> None:
    path = _dump_json(folder)
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


@pytest.fixture(scope="module")
def inference_dump(tmp_path_factory) -> Path:
    """A statistics dump of TinyLM's inference (mix level, as npu-run --dump writes by default)."""
    torch.manual_seed(0)
    model, ids = TinyLM().eval(), torch.randint(0, 40, (2, 6))
    folder = tmp_path_factory.mktemp("verdicts") / "golden"
    session = DumpSession(folder, level="mix", mode="stats")
    session.start()
    with torch.inference_mode():
        model(ids)
    session.stop()
    return folder


@pytest.fixture(scope="module")
def cnn_dump(tmp_path_factory) -> Path:
    """A statistics dump of one training step of SmallCNN in fp32 (mix level)."""
    torch.manual_seed(0)
    model, x, y = SmallCNN(), torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    folder = tmp_path_factory.mktemp("verdicts") / "cnn_golden"
    session = DumpSession(folder, level="mix", mode="stats")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session.start()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # the parameter gradients are dumped as it starts
    session.stop()
    return folder


def _copy(source: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _stopped_after_first_layer(payload: dict, record_incomplete: bool = True) -> None:
    """What a dump whose hooks switched themselves off during layers.1 holds: the entries before it."""
    names = list(payload["data"])
    first_lost = next(index for index, name in enumerate(names) if "layers.1." in name)
    payload["data"] = {name: payload["data"][name] for name in names[:first_lost]}
    if record_incomplete:
        payload["npukit_incomplete"] = [{
            "kind": "internal_error", "where": "Tensor.to",
            "detail": "DumpSession._record_api: RuntimeError: Cannot set version_counter for inference tensor"}]


def _compare(golden: Path, target: Path, tmp_path: Path) -> tuple[int, str, dict, str]:
    """npu-compare GOLDEN TARGET --json --html: (exit code, terminal text, JSON report, HTML page)."""
    out = io.StringIO()
    console = Console(file=out, width=250, color_system=None)
    report_json, report_html = tmp_path / "report.json", tmp_path / "report.html"
    code = run_compare(golden, target, tmp_path / "report.csv", report_json, report_html, top=5, overrides=[],
                       workers=1, console=console)
    return code, out.getvalue(), json.loads(report_json.read_text()), report_html.read_text()


def _assert_paths_agree(code: int, terminal: str, report: dict, page: str) -> None:
    """The exit code, the terminal, the JSON report and the HTML page give one verdict."""
    assert report["failed"] == (code == 1)
    said = " ".join(terminal.split())  # rich wraps long lines
    for line in report["verdict"]:
        assert " ".join(line.split()) in said
    assert report["verdict"][0] == report["headline"]
    assert ("<div class='box' id='verdict'>" in page) == (code == 1)
    verdict_box = page.split("id='verdict'>", 1)[1].split("</div>", 1)[0]
    shown = " ".join(html.unescape(re.sub(r"<[^>]+>", "", verdict_box.replace("<br>", " "))).split())
    for line in report["verdict"]:
        assert " ".join(line.split()) in shown
    assert ("No divergence found" in report["headline"]) == (code == 0)


def test_a_dump_an_internal_error_switched_off_is_incomplete_and_exits_1(inference_dump, tmp_path):
    target = _copy(inference_dump, tmp_path, "target")
    _edit(target, _stopped_after_first_layer)
    code, terminal, report, page = _compare(inference_dump, target, tmp_path)
    assert code == 1
    assert "No divergence found" not in terminal
    assert "the target's dump is incomplete" in report["headline"] or any(
        "the target's dump is incomplete" in line for line in report["verdict"])
    said = " ".join(report["verdict"])
    assert "recording stopped at Tensor.to after an internal error" in said
    assert "Cannot set version_counter for inference tensor" in said
    assert report["pairs"][0]["incomplete"]["target"][0]["where"] == "Tensor.to"
    _assert_paths_agree(code, terminal, report, page)


def test_a_dump_that_ends_early_without_saying_so_paired_too_little_and_exits_1(inference_dump, tmp_path):
    """A dump written before "npukit_incomplete" existed (or by msprobe): the pairing shows it."""
    target = _copy(inference_dump, tmp_path, "target")
    _edit(target, lambda payload: _stopped_after_first_layer(payload, record_incomplete=False))
    code, terminal, report, page = _compare(inference_dump, target, tmp_path)
    assert code == 1
    coverage = report["pairs"][0]["coverage"]
    assert coverage["golden_paired"] * 2 < coverage["golden_entries"]
    assert coverage["target_paired"] == coverage["target_entries"]
    said = " ".join(report["verdict"])
    assert "too little paired" in said and "the target's dump ends early" in said
    first_lost = next(name for name in json.loads(_dump_json(inference_dump).read_text())["data"] if "layers.1." in name)
    assert f"from {first_lost} on" in said  # where pairing stopped
    _assert_paths_agree(code, terminal, report, page)


def test_dumps_of_different_models_name_the_entries_only_one_side_has(inference_dump, cnn_dump, tmp_path):
    code, terminal, report, page = _compare(inference_dump, cnn_dump, tmp_path)
    said = " ".join(report["verdict"])
    assert code == 1 and "too little paired" in said
    assert "only in the target: Functional.conv2d.forward x2" in said
    assert "only in the golden: Functional.linear.forward x8" in said  # the ninth pairs with the CNN's fc
    _assert_paths_agree(code, terminal, report, page)


def test_compiled_regions_not_dumped_alike_in_both_runs_are_named_and_pass(inference_dump, tmp_path):
    region = [{"kind": "compiled_region", "where": "Module.layers.3.Layer.forward",
               "detail": "torch.compile(fullgraph=True)"}]
    golden, target = _copy(inference_dump, tmp_path, "golden"), _copy(inference_dump, tmp_path, "target")
    for folder in (golden, target):
        _edit(folder, lambda payload: payload.update(npukit_incomplete=region))
    code, terminal, report, page = _compare(golden, target, tmp_path)
    assert code == 0 and report["headline"].startswith("No divergence found")
    note = "ran compiled (torch.compile(fullgraph=True)) and were not dumped"
    terminal = " ".join(terminal.split())
    assert note in terminal and "in both runs: Module.layers.3.Layer.forward" in terminal
    assert note in html.unescape(page)
    _assert_paths_agree(code, terminal, report, page)


def test_a_passing_compare_agrees_on_every_path(inference_dump, tmp_path):
    code, terminal, report, page = _compare(inference_dump, inference_dump, tmp_path)
    assert code == 0 and report["problems"] == []
    _assert_paths_agree(code, terminal, report, page)


def test_a_malformed_incomplete_record_names_the_file(inference_dump, tmp_path):
    target = _copy(inference_dump, tmp_path, "target")
    _edit(target, lambda payload: payload.update(npukit_incomplete=[{"kind": "crashed", "where": "x"}]))
    with pytest.raises(UserError, match=r"dump\.json: \"npukit_incomplete\" item 0"):
        compare_dirs(inference_dump, target, workers=1)


def _as_msprobe(payload: dict) -> None:
    """The same dump as msprobe writes it: no writer key, no producer links."""
    payload.pop("dumped_by", None)

    def strip(value):
        if isinstance(value, dict):
            value.pop("producer", None)
            for item in value.values():
                strip(item)
        elif isinstance(value, list):
            for item in value:
                strip(item)
    strip(payload["data"])


def _as_correct_bf16_run(payload: dict) -> None:
    """The run in bf16: every tensor bfloat16, every gradient after the loss's 4% apart (bf16's usual
    spread, under its 0.3 error limit for a backward) and the forward exact."""
    first_backward = True
    for name, body in payload["data"].items():
        backward = name.endswith(".backward") or ".backward." in name or ".parameters_grad" in name
        for key, value in body.items():
            leaves = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else []
            for leaf in leaves:
                for item in leaf if isinstance(leaf, list) else [leaf]:
                    if not isinstance(item, dict) or "dtype" not in item:
                        continue
                    item["dtype"] = "torch.bfloat16"
                    if backward and not (first_backward and key == "input"):
                        for stat in ("Max", "Min", "Mean", "Norm"):
                            item[stat] *= 1.04
        first_backward = first_backward and not backward


def test_a_cross_tool_compare_draws_no_divergence_from_entries_one_tool_lacks(cnn_dump, tmp_path):
    """An msprobe fp32 golden against a correct bf16 run gives the verdict npukit's own golden gives.
    The api backward entries are left out of a cross-tool pair, so the gradient reaching the first
    module backward compared was made by ops that pair compares in neither dump: not a divergence."""
    target = _copy(cnn_dump, tmp_path, "target")
    _edit(target, _as_correct_bf16_run)
    msprobe_golden = _copy(cnn_dump, tmp_path, "msprobe_golden")
    _edit(msprobe_golden, _as_msprobe)
    same_tool = compare_dirs(cnn_dump, target, workers=1)
    assert [pair.divergence for pair in same_tool.pairs] == [None] and not same_tool.failed()
    code, terminal, report, page = _compare(msprobe_golden, target, tmp_path)
    assert "golden dumped by msprobe, target by npukit" in terminal
    assert report["pairs"][0]["first_divergence"] is None
    assert code == 0
    _assert_paths_agree(code, terminal, report, page)


def test_a_rank_whose_dump_stopped_fails_the_multi_rank_compare_and_is_named_per_rank(inference_dump, tmp_path):
    golden, target = tmp_path / "golden", tmp_path / "target"
    for root in (golden, target):
        for rank in (0, 1):
            shutil.copytree(_dump_json(inference_dump).parent, root / "step0" / f"rank{rank}")
    _edit(target / "step0" / "rank1", _stopped_after_first_layer)
    code, terminal, report, page = _compare(golden, target, tmp_path)
    assert code == 1
    assert report["verdict"][1].strip().startswith("step0/rank1: the target's dump is incomplete")
    ranks = {record["Step/Rank"]: record for record in report["ranks"]}
    assert ranks["step0/rank0"]["Problems"] is None
    assert "recording stopped at Tensor.to" in ranks["step0/rank1"]["Problems"]
    with open(tmp_path / "report.ranks.csv", newline="") as handle:
        problems = {row["Step/Rank"]: row["Problems"] for row in csv.DictReader(handle)}
    assert problems["step0/rank0"] == "" and "recording stopped at Tensor.to" in problems["step0/rank1"]
    said = " ".join(terminal.split())
    assert "no rank diverged" not in said and "no divergence named on any rank" in said
    _assert_paths_agree(code, terminal, report, page)


def test_find_fix_makes_no_run_on_a_dump_an_internal_error_switched_off(inference_dump, tmp_path):
    from npukit.accuracy.cli_compare import FindFixOptions

    target = _copy(inference_dump, tmp_path, "target")
    _edit(target, _stopped_after_first_layer)
    out = io.StringIO()
    fix = FindFixOptions(command=["npu-run", "--replay", str(tmp_path / "replay"), str(tmp_path / "never_run.py")],
                         work=tmp_path / "work")
    code = run_compare(inference_dump, target, None, None, None, top=0, overrides=[], workers=1,
                       console=Console(file=out, width=250, color_system=None), find_fix=fix)
    said = " ".join(out.getvalue().split())
    assert code == 1
    assert "find-fix: no run made: the target's dump is incomplete (recording stopped at Tensor.to" in said
    assert not (tmp_path / "work").exists()


def test_parameter_gradients_written_in_another_order_are_no_difference_of_the_op_streams(cnn_dump, tmp_path):
    """msprobe writes a module's parameter gradients as its backward ends, npukit when the optimizer
    starts: they pair by module, and the report says nothing of a difference (it printed an empty
    cast note: ': a cast that changed nothing ...')."""
    def grads_early(payload: dict) -> None:
        data = payload["data"]
        grads = [name for name in data if ".parameters_grad" in name]
        first_backward = next(name for name in data if name.endswith(".backward") or ".backward." in name)
        order = [name for name in data if name not in grads]
        at = order.index(first_backward) + 1
        payload["data"] = {name: data[name] for name in order[:at] + grads + order[at:]}
    golden = _copy(cnn_dump, tmp_path, "golden")
    _edit(golden, grads_early)
    code, terminal, report, page = _compare(golden, cnn_dump, tmp_path)
    assert code == 0 and report["pairs"][0]["aligned"]
    assert "op streams differ" not in terminal and "a cast that changed nothing" not in terminal
    _assert_paths_agree(code, terminal, report, page)


class NormedCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2), 1))


def test_a_cross_tool_compare_leaves_out_the_running_statistics_each_tool_measures_at_another_moment(tmp_path):
    """msprobe measures a training batch norm's running_mean and running_var before the call (the
    values it starts from), npukit after it (the values it wrote): compared, they were an error row
    (cosine 0, relative L2 inf) that no run's precision made."""
    torch.manual_seed(0)
    model, x, y = NormedCNN(), torch.randn(4, 3, 16, 16), torch.randint(0, 3, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    golden = tmp_path / "npukit_golden"
    session = DumpSession(golden, level="mix", mode="stats")
    session.start()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    session.stop()

    def as_msprobe_measures_it(payload: dict) -> None:
        _as_msprobe(payload)
        mean, var = payload["data"]["Functional.batch_norm.0.forward"]["input_args"][1:3]
        mean.update(Max=0.0, Min=0.0, Mean=0.0, Norm=0.0)  # torch's initial running statistics
        var.update(Max=1.0, Min=1.0, Mean=1.0, Norm=2.0)  # 4 channels of 1
    msprobe_golden = _copy(golden, tmp_path, "msprobe_golden")
    _edit(msprobe_golden, as_msprobe_measures_it)
    same_tool = compare_dirs(golden, golden, workers=1)
    code, terminal, report, page = _compare(msprobe_golden, golden, tmp_path)
    assert code == 0 and report["summary"]["error"] == 0
    assert "Functional.batch_norm.0.forward.input.1" not in {row["NPU Name"] for row in report["pairs"][0]["rows"]}
    assert "2 arguments an op writes in place left out (a batch norm's running statistics" in " ".join(terminal.split())
    assert same_tool.counts()["error"] == 0 and not same_tool.failed()
    _assert_paths_agree(code, terminal, report, page)


def test_a_real_dump_an_internal_error_switched_off_makes_the_compare_say_so(inference_dump, tmp_path, monkeypatch):
    """The dump itself records the internal error that switched its api handler off (during
    layers.1: everything after it is missing), and the compare reads it."""
    from npukit.watch import hook_guard

    torch.manual_seed(0)
    model, ids = TinyLM().eval(), torch.randint(0, 40, (2, 6))
    real_leaf = DumpSession._tensor_leaf

    def fails_after_the_first_layer(self, *args, **kwargs):
        if model.layers[0].done:
            raise RuntimeError("Cannot set version_counter for inference tensor")
        return real_leaf(self, *args, **kwargs)
    model.layers[0].done = False
    model.layers[0].register_forward_hook(lambda module, args, output: setattr(module, "done", True))
    monkeypatch.setattr(DumpSession, "_tensor_leaf", fails_after_the_first_layer)
    monkeypatch.setattr(hook_guard, "broken_hooks", set())
    target = tmp_path / "target"
    session = DumpSession(target, level="mix", mode="stats")
    session.start()
    with torch.inference_mode():
        model(ids)
    session.stop()
    code, terminal, report, page = _compare(inference_dump, target, tmp_path)
    said = " ".join(report["verdict"])
    assert code == 1 and "the target's dump is incomplete" in said
    assert "after an internal error" in said and "Cannot set version_counter for inference tensor" in said
    _assert_paths_agree(code, terminal, report, page)
