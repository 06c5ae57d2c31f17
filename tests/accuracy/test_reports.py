"""Reports and the npu-compare command."""

import csv
import json
import sys

import pytest

from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.report import CSV_COLUMNS, write_csv, write_html, write_json
from npukit.cli import compare_main

from .models import train


@pytest.fixture(scope="module")
def eps_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("eps")
    train(root / "golden", None, level="mix", mode="tensor", steps=1)
    train(root / "target", "eps", level="mix", mode="tensor", steps=1)
    return root


def run_cli(args, capsys):
    argv = sys.argv
    sys.argv = ["npu-compare", *map(str, args)]
    try:
        with pytest.raises(SystemExit) as exit_info:
            compare_main()
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_names_first_divergence_and_writes_reports(eps_dumps, tmp_path, capsys):
    code, out, _ = run_cli([eps_dumps / "golden", eps_dumps / "target", "--csv", tmp_path / "r.csv",
                            "--json", tmp_path / "r.json", "--html", tmp_path / "r.html"], capsys)
    assert code == 1
    assert "First divergence" in out and "Functional.layer_norm.1.forward" in out and "blocks.1.norm" in out
    with open(tmp_path / "r.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[: len(CSV_COLUMNS)] == CSV_COLUMNS
    assert CSV_COLUMNS[:6] == ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape",
                               "Bench Tensor Shape"]
    flagged = {row["NPU Name"] for row in rows if row["First Divergence"] == "True"}
    assert "Functional.layer_norm.1.forward.output.0" in flagged
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["pairs"][0]["first_divergence"]["entry"] == "Functional.layer_norm.1.forward"
    page = (tmp_path / "r.html").read_text()
    assert "<svg" in page and "first divergence" in page and "Functional.layer_norm.1.forward" in page
    assert "src=" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")


def test_cli_is_quiet_and_exits_zero_when_runs_agree(eps_dumps, capsys):
    code, out, _ = run_cli([eps_dumps / "golden", eps_dumps / "golden"], capsys)
    assert code == 0
    assert "No divergence found" in out


def test_cli_user_errors_exit_2_with_a_message(eps_dumps, tmp_path, capsys):
    code, _, err = run_cli([eps_dumps / "golden", tmp_path / "missing"], capsys)
    assert code == 2 and "missing: no such dump directory" in err and "Traceback" not in err
    code, _, err = run_cli([eps_dumps / "golden", eps_dumps / "target", "--set", "bogus=1"], capsys)
    assert code == 2 and "--set: unknown threshold 'bogus'" in err
    code, _, err = run_cli([eps_dumps / "golden", eps_dumps / "target", "--csv", tmp_path / "no/dir/r.csv"], capsys)
    assert code == 2 and "--csv" in err


def test_reports_are_written_atomically(eps_dumps, tmp_path):
    result = compare_dirs(eps_dumps / "golden", eps_dumps / "target", workers=1)
    for writer, name in ((write_csv, "a.csv"), (write_json, "a.json"), (write_html, "a.html")):
        writer(result, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "a.html", "a.json"]


def test_steps_present_on_one_side_only_are_reported(tmp_path, capsys):
    train(tmp_path / "golden", None, level="module", mode="stats", steps=2)
    train(tmp_path / "target", None, level="module", mode="stats", steps=2, dump_steps="0")
    code, out, _ = run_cli([tmp_path / "golden", tmp_path / "target"], capsys)
    assert code == 0 and "not compared, only in golden: step1/rank0" in out
