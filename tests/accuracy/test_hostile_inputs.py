"""Dumps and replays from someone else: reads stay inside the folder given, and a verdict needs data.

Each case starts from a correct tensor-mode dump pair (or a recorded replay), breaks it the way a
crafted or careless input would, and expects exit 2 with a message naming the file -- never a
read outside the folder, never "no divergence" without compared data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.dump import DumpSession
from npukit.accuracy.replay import ReplaySession
from npukit.errors import UserError

RANK = Path("step0/rank0")


def _dump(out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with DumpSession(out, level="mix", mode="tensor") as session:
        model(torch.randn(3, 4)).sum().backward()
        session.step()


@pytest.fixture
def pair(tmp_path):
    for side in ("golden", "target"):
        _dump(tmp_path / side)
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / "x.npy", np.full((3, 4), 1e6, dtype=np.float32))  # would decide the verdict if read
    return tmp_path


def _rank_dir(root: Path) -> Path:
    return root / "target" / RANK


def _first_data_name(dump: dict) -> tuple[str, dict]:
    for name, entry in dump["data"].items():
        for leaf in entry.get("input_args", []):
            if isinstance(leaf, dict) and leaf.get("data_name"):
                return name, leaf
    raise AssertionError("no tensor file in the dump")


def _set_data_name(root: Path, value) -> None:
    path = _rank_dir(root) / "dump.json"
    dump = json.loads(path.read_text())
    _, leaf = _first_data_name(dump)
    leaf["data_name"] = value(root) if callable(value) else value
    path.write_text(json.dumps(dump))


def _symlink_data_file(root: Path) -> None:
    dump = json.loads((_rank_dir(root) / "dump.json").read_text())
    _, leaf = _first_data_name(dump)
    data_file = _rank_dir(root) / "dump_tensor_data" / leaf["data_name"]
    data_file.unlink()
    data_file.symlink_to(root / "outside" / "x.npy")


def _symlink_folder(relative: str):
    def breaker(root: Path) -> None:
        original = root / "target" / relative
        moved = root / "outside" / original.name
        shutil.move(original, moved)
        original.symlink_to(moved, target_is_directory=moved.is_dir())
    return breaker


def _empty_data(root: Path) -> None:
    path = _rank_dir(root) / "dump.json"
    dump = json.loads(path.read_text())
    dump["data"] = {}
    path.write_text(json.dumps(dump))


def _rename_entries(root: Path) -> None:
    path = _rank_dir(root) / "dump.json"
    dump = json.loads(path.read_text())
    dump["data"] = {f"Other.{name}": entry for name, entry in dump["data"].items()}
    path.write_text(json.dumps(dump))


OUTSIDE = r"leads outside|names a file outside"
DUMP_CASES = {
    "data_name with ..": (lambda root: _set_data_name(root, "../../../../outside/x.npy"), OUTSIDE),
    "absolute data_name": (lambda root: _set_data_name(root, lambda r: str(r / "outside" / "x.npy")), OUTSIDE),
    "symlinked data file": (_symlink_data_file, OUTSIDE),
    "symlinked dump_tensor_data": (_symlink_folder(f"{RANK}/dump_tensor_data"), OUTSIDE),
    "symlinked dump.json": (_symlink_folder(f"{RANK}/dump.json"), OUTSIDE),
    "symlinked rank folder": (_symlink_folder(str(RANK)), OUTSIDE),
    "empty data": (_empty_data, r"nothing to compare .* holds no dumped entries"),
    "no entry in common": (_rename_entries, r"nothing to compare .* none of the target's \d+ entries has a counterpart"),
}


def _assert_refused(pair: Path, breaker, message: str) -> None:
    breaker(pair)
    with pytest.raises(UserError, match=message):
        compare_dirs(pair / "golden", pair / "target", workers=1)


@pytest.mark.parametrize("case", sorted(DUMP_CASES))
def test_a_broken_or_crafted_dump_is_refused_by_name(pair, case):
    _assert_refused(pair, *DUMP_CASES[case])


def test_the_unbroken_pair_compares_clean(pair):
    result = compare_dirs(pair / "golden", pair / "target", workers=1)
    assert [p.divergence for p in result.pairs] == [None] and result.counts()["pass"] > 10


@pytest.mark.parametrize("case", ["absolute data_name", "no entry in common"])
def test_npu_compare_exits_2_with_one_line_and_no_traceback(pair, case):
    DUMP_CASES[case][0](pair)
    run = subprocess.run([str(Path(sys.executable).with_name("npu-compare")), "golden", "target"],
                         capture_output=True, text=True, cwd=pair)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr + run.stdout and "No divergence" not in run.stdout


# ---------------------------------------------------------------------------- replay
def _record_replay(directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with ReplaySession(directory):
        model(torch.randn(4, 3))
    return model


def _point_first_tensor(to):
    def breaker(directory: Path) -> None:
        manifest = json.loads((directory / "replay.json").read_text())
        manifest["modules"][0]["state"]["weight"]["tensor"] = to(directory)
        (directory / "replay.json").write_text(json.dumps(manifest))
    return breaker


def _symlink_first_tensor(directory: Path) -> None:
    outside = directory.parent / "outside.npy"
    np.save(outside, np.full((2, 3), 1e6, dtype=np.float32))
    target = directory / "tensors" / "000001.npy"
    target.unlink()
    target.symlink_to(outside)


REPLAY_CASES = {
    "tensor path with ..": _point_first_tensor(lambda d: "../outside.npy"),
    "absolute tensor path": _point_first_tensor(lambda d: str(d.parent / "outside.npy")),
    "symlink in tensors/": _symlink_first_tensor,
    "tensor path not a string": _point_first_tensor(lambda d: 7),
}


@pytest.mark.parametrize("case", sorted(REPLAY_CASES))
def test_a_replay_never_loads_weights_from_outside_its_folder(tmp_path, case):
    directory = tmp_path / "replay"
    _record_replay(directory)
    np.save(tmp_path / "outside.npy", np.full((2, 3), 1e6, dtype=np.float32))
    REPLAY_CASES[case](directory)
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(UserError, match=r"replay\.json") as error:
        with ReplaySession(directory):
            model(torch.randn(4, 3))
    assert "outside" in str(error.value) or "a tensor needs a file name" in str(error.value)
    assert torch.equal(model.weight.detach(), before)  # nothing was loaded


def test_a_symlink_that_stays_inside_the_folder_is_followed(pair):
    data_dir = _rank_dir(pair) / "dump_tensor_data"
    first = sorted(data_dir.iterdir())[0]
    copy = data_dir / f"copy{first.suffix}"
    shutil.copy(first, copy)
    first.unlink()
    os.symlink(copy.name, first)  # relative link inside the folder
    assert compare_dirs(pair / "golden", pair / "target", workers=1).pairs[0].divergence is None


class _Payload:
    def __reduce__(self):  # would run on unpickling
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_a_pickled_tensor_file_is_refused_without_recommending_unsafe_loading(tmp_path, suffix):
    from npukit.accuracy.tensor_io import read_tensor

    path = tmp_path / f"evil{suffix}"
    if suffix == ".npy":
        np.save(path, np.array([_Payload()], dtype=object), allow_pickle=True)
    else:
        torch.save({"x": _Payload()}, path)
    with pytest.raises(UserError, match=r"npukit never (loads|unpickles)") as error:
        read_tensor(path, "torch.float32", [1])
    assert "allow_pickle" not in str(error.value) and "weights_only" not in str(error.value)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


# ---------------------------------------------------------------------------- outputs
LINK_LEFT_IN_OUTPUT = {"--dump": "step0", "--replay": "tensors", "--profile": "rank0"}


@pytest.mark.parametrize("option", sorted(LINK_LEFT_IN_OUTPUT))
def test_outputs_never_go_through_a_link_left_in_the_output_folder_and_the_script_does_not_run(tmp_path, option):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / LINK_LEFT_IN_OUTPUT[option]).symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "train.py").write_text("import torch\nprint('RAN')\nm = torch.nn.Linear(2, 2)\nm(torch.ones(1, 2))\n")
    run = subprocess.run([str(Path(sys.executable).with_name("npu-run")), option, "out", "train.py"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "is a symbolic link" in run.stderr and "Traceback" not in run.stderr
    assert "RAN" not in run.stdout  # refused before the run, not after it
    assert list(elsewhere.iterdir()) == []


def test_a_link_made_during_the_run_is_refused_when_writing(tmp_path):
    from npukit.files import output_folder

    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "step3").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UserError, match=r"out/step3: is a symbolic link"):
        output_folder(tmp_path / "out", "step3", "rank0")
    assert output_folder(tmp_path / "out", "step4", "rank0") == tmp_path / "out" / "step4" / "rank0"


def _first_leaf_field(field, value):
    def breaker(root: Path) -> None:
        path = _rank_dir(root) / "dump.json"
        dump = json.loads(path.read_text())
        _, leaf = _first_data_name(dump)
        leaf[field] = value
        path.write_text(json.dumps(dump))
    return breaker


def _entry_field(field, value):
    def breaker(root: Path) -> None:
        path = _rank_dir(root) / "dump.json"
        dump = json.loads(path.read_text())
        name, _ = _first_data_name(dump)
        dump["data"][name][field] = value
        path.write_text(json.dumps(dump))
    return breaker


def _deep_json(root: Path) -> None:
    (_rank_dir(root) / "dump.json").write_text('{"data": ' + "[" * 100_000 + "]" * 100_000 + "}")


MALFORMED_CASES = {
    "unknown dtype": (_first_leaf_field("dtype", "torch.evil"), r"unknown dtype 'torch.evil'"),
    "data_name not a string": (_first_leaf_field("data_name", 123), r"data_name that is not a file name \(123\)"),
    "negative size": (_first_leaf_field("shape", [3, -4]), r"malformed one: dtype 'torch.float32', shape \[3, -4\]"),
    "output not a list": (_entry_field("output", 5), r'"output" must be a list or an object, found int 5'),
    "JSON nested 100k deep": (_deep_json, r"nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CASES))
def test_a_malformed_dump_field_is_named_not_skipped(pair, case):
    _assert_refused(pair, *MALFORMED_CASES[case])


@pytest.mark.parametrize("setting", ["amplification=nan", "bf16.warn_rel_l2=inf", "negligible=-1"])
def test_a_threshold_must_be_a_finite_non_negative_number(setting):
    from npukit.accuracy.compare import Thresholds

    with pytest.raises(UserError, match=r"--set: .* a threshold is a finite number >= 0"):
        Thresholds().with_overrides([setting])


@pytest.mark.parametrize("spec", ["99999999999999999999", "0-99999999999"])
def test_dump_steps_out_of_reach_are_refused_at_once(spec):
    from npukit.accuracy.dump import parse_steps

    with pytest.raises(UserError, match=r"--dump-steps: .*(not steps or ranks a run reaches|select fewer)"):
        parse_steps(spec)


def test_a_dump_that_wrote_nothing_says_so(tmp_path, capsys):
    with DumpSession(tmp_path / "d", level="mix", mode="stats", steps="5") as session:
        torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
        session.step()
    err = capsys.readouterr().err
    assert "nothing dumped into" in err and "selected step(s) 5" in err and "ended in step 1" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


REPLAY_FIELD_CASES = {
    "modules not a list": (lambda m: m.update(modules={"a": 1}), r"modules: must be a list"),
    "state not an object": (lambda m: m["modules"][0].update(state=[1]), r"modules\[0\]: expected an object"),
    "shape of text": (lambda m: m["modules"][0]["state"]["weight"].update(shape="2x3"), r"shape '2x3' is not a list"),
    "call not an integer": (lambda m: m["forward_inputs"][0].update(call="0"), r"forward_inputs\[0\]: expected .*"
                            r"integer module and call"),
    "args an unknown kind": (lambda m: m["forward_inputs"][0].update(args={"weird": 1}), r"forward_inputs\[0\]\.args: "
                             r"expected one of tensor, list, dict or other"),
}


@pytest.mark.parametrize("case", sorted(REPLAY_FIELD_CASES))
def test_a_wrongly_typed_replay_field_is_named_before_the_script_runs(tmp_path, case):
    directory = tmp_path / "replay"
    _record_replay(directory)
    manifest = json.loads((directory / "replay.json").read_text())
    change, message = REPLAY_FIELD_CASES[case]
    change(manifest)
    (directory / "replay.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=message):
        ReplaySession(directory)  # at construction: before any module of the script runs


def test_an_unreadable_step_folder_is_named(pair, monkeypatch):
    original = Path.iterdir

    def iterdir(self):
        if self.name == "step0" and "target" in self.parts:
            raise PermissionError(13, "Permission denied")
        return original(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(UserError, match=r"target/step0: cannot read this folder \(Permission denied\)"):
        compare_dirs(pair / "golden", pair / "target", workers=1)


def test_a_dump_too_large_for_this_machine_is_refused_by_name(pair, monkeypatch):
    from npukit.accuracy import dumpfile

    size = (_rank_dir(pair) / "dump.json").stat().st_size
    monkeypatch.setattr(dumpfile, "_available_memory", lambda: size * 3)  # less than the ~6x it needs
    with pytest.raises(UserError, match=r"golden/step0/rank0/dump.json: .* need about .* GB to compare .* are free; "
                                        r"dump fewer entries"):
        compare_dirs(pair / "golden", pair / "target", workers=1)


def test_dump_json_is_read_entry_by_entry_with_its_fields_in_any_order(tmp_path):
    from npukit.accuracy.dumpfile import load_rank_dump

    leaf = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1, "Min": 0, "Mean": 0.5,
            "Norm": 1.0}
    entry = json.dumps({"input_args": [leaf], "output": [leaf]})
    text = ('{"data": {"Functional.relu.0.forward": ' + entry + '},\n'
            ' "task": "statistics", "step_skipped_by_grad_scaler": {"loss_scale": 1024}}')
    (tmp_path / "dump.json").write_text(text)
    dump = load_rank_dump(tmp_path)
    assert [e.name for e in dump.entries] == ["Functional.relu.0.forward"]
    assert dump.task == "statistics" and dump.skipped_at_loss_scale == 1024.0
    (tmp_path / "dump.json").write_text(text[:-40])
    with pytest.raises(UserError, match=r"dump.json: invalid JSON"):
        load_rank_dump(tmp_path)
