"""npu-compare against the real MindStudio Probe (mindstudio-probe 26.2.0, a dev dependency): dumps
of one model written by msprobe and by npukit, compared across tools in both directions.

What the two tools record differently is left out of a cross-tool pair and said in the report: an
api's backward (msprobe: the gradients of the op's last autograd node; npukit: the op's gradient
for each argument), apis and modules only one tool records (with --dump-ops all Tensor.flatten and
other apis msprobe leaves out by default). Everything else pairs, by the same names: forward api
entries (x + y is Tensor.__add__, F.layer_norm's weight input.2), the optimizer's update ops, module
entries below the model (neither tool records the model itself), and parameter gradients
(Module.X.parameters_grad.0 with {"weight": [leaf]}), in npu-compare and in msprobe compare."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npukit.accuracy.compare import ERROR, PASS, UNMATCHED, compare_dirs
from npukit.accuracy.report import write_csv

# A real-code suite (the real msprobe (mindstudio-probe) on npukit's dumps and its own): `make test` runs it after the main suite.
pytestmark = pytest.mark.slow

MODEL = Path(__file__).with_name("msprobe_interop_model.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    made = {}

    def dump(tool, task, level, dtype, tensor_format=None):
        """tensor_format None: npukit's default."""
        key = (tool, task, level, dtype, tensor_format or "default")
        if key not in made:
            out = root / "_".join(key)
            formats = [tensor_format] if tensor_format else []
            run = subprocess.run([sys.executable, str(MODEL), tool, task, level, dtype, str(out), *formats],
                                 capture_output=True, text=True, timeout=300,
                                 env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=root)
            assert run.returncode == 0, run.stderr[-3000:]
            made[key] = out
        return made[key]
    return dump


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
@pytest.mark.parametrize("golden_tool", ["msprobe", "npukit"])
def test_the_same_model_dumped_by_both_tools_pairs_every_comparable_entry(dumps, task, level, golden_tool):
    target_tool = "npukit" if golden_tool == "msprobe" else "msprobe"
    result = compare_dirs(dumps(golden_tool, task, level, "fp32"), dumps(target_tool, task, level, "fp32"),
                          workers=1)
    [pair] = result.pairs  # msprobe's step0/proc<pid> is npukit's step0/rank0
    assert pair.divergence is None
    assert [row.name for row in pair.rows if row.verdict in (ERROR, UNMATCHED)] == []
    assert f"golden dumped by {golden_tool}, target by {target_tool}" in pair.cross_tool
    assert "api backward entries left out" in pair.cross_tool
    names = {row.name for row in pair.rows}
    assert "Functional.conv2d.0.forward.output.0" in names
    # F.layer_norm's weight: input.2 in both, as nn.LayerNorm passes it (torch hands it to
    # __torch_function__ by name)
    weight = {(row.golden.name, row.target.name) for row in pair.rows if "layer_norm.0.forward.input.weight" in row.name
              or "layer_norm.0.forward.input.2" in row.name}
    assert weight == {("Functional.layer_norm.0.forward.input.2",) * 2}
    assert {(row.golden.name, row.target.name) for row in pair.rows if "__add__.0.forward.input.1" in row.name} \
        == {("Tensor.__add__.0.forward.input.1",) * 2}
    if level == "mix":
        grads = [row for row in pair.rows if ".parameters_grad" in row.name]
        assert len(grads) == 10 and all(row.verdict == PASS for row in grads)  # 5 layers x weight, bias
    # the same modules (not the model itself) and apis, the optimizer's update included, in both
    assert "only one tool records" not in pair.cross_tool
    values = [row for row in pair.rows if row.metrics is not None or row.stat_diffs is not None]
    assert len(values) == len(pair.rows)


@pytest.mark.parametrize("task, level, tensor_format", [("statistics", "mix", None), ("tensor", "mix", None),
                                                     ("tensor", "mix", "npy"), ("statistics", "L1", None),
                                                     ("tensor", "L1", None)])
def test_a_correct_bf16_run_against_an_msprobe_fp32_golden_has_no_divergence(dumps, task, level, tensor_format):
    result = compare_dirs(dumps("msprobe", task, level, "fp32"), dumps("npukit", task, level, "bf16", tensor_format),
                          workers=1)
    [pair] = result.pairs
    assert pair.divergence is None
    assert [row.name for row in pair.rows if row.verdict in (ERROR, UNMATCHED)] == []
    assert any(row.target.dtype == "torch.bfloat16" for row in pair.rows)


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_a_correct_msprobe_bf16_run_against_an_npukit_fp32_golden_has_no_divergence(dumps, task, level):
    """The other direction: npukit's golden on a CPU, msprobe's dump of the low-precision run."""
    result = compare_dirs(dumps("npukit", task, level, "fp32"), dumps("msprobe", task, level, "bf16"), workers=1)
    [pair] = result.pairs
    assert pair.divergence is None
    assert [row.name for row in pair.rows if row.verdict in (ERROR, UNMATCHED)] == []
    assert any(row.target.dtype == "torch.bfloat16" for row in pair.rows)


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_msprobe_dumps_compare_with_each_other_with_their_parameter_gradients(dumps, task, level):
    result = compare_dirs(dumps("msprobe", task, level, "fp32"), dumps("msprobe", task, level, "bf16"), workers=1)
    [pair] = result.pairs
    assert pair.cross_tool is None and pair.divergence is None
    assert [row.name for row in pair.rows if row.verdict in (ERROR, UNMATCHED)] == []
    assert all(row.metrics is not None or row.stat_diffs is not None for row in pair.rows)
    grads = [row for row in pair.rows if ".parameters_grad.0." in row.name]
    assert len(grads) == (10 if level == "mix" else 0)  # module-level entries: not recorded at L1


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_msprobe_compare_reads_npukit_dumps_as_written(dumps, tmp_path, task, level):
    """npukit's default tensor files: a bare tensor per leaf, a file per leaf (msprobe compare
    pairs rows by data file: files shared by several leaves gave duplicated, mislabelled rows)."""
    golden = dumps("npukit", task, level, "fp32")
    target = dumps("npukit", task, level, "bf16")
    msprobe = Path(sys.executable).with_name("msprobe")
    run = subprocess.run([str(msprobe), "compare", "-gp", str(golden / "step0"), "-tp", str(target / "step0"),
                          "-o", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [table] = tmp_path.glob("compare_result_*.csv")
    rows = list(csv.DictReader(table.open()))
    names = [row["NPU Name"] for row in rows]
    assert len(names) == len(set(names))
    # stack.json: msprobe compare shows each forward entry's call stack, the user's line in it, on
    # the entry's first row (as for its own dumps; backward entries have none in either tool)
    forward = {name.split(".forward.")[0] for name in names if ".forward." in name}
    stacks = {row["NPU Name"].split(".forward.")[0] for row in rows if ".forward." in row["NPU Name"]
              and "msprobe_interop_model.py, line" in row["NPU_Stack_Info"]}
    assert forward - stacks == set()
    metric = "Cosine" if task == "tensor" else "NormRelativeErr"
    # every paired tensor of one dimension or more (msprobe itself lists numbers and 0-d tensors
    # unsupported; Tensor.float's backward exists in the bf16 run only)
    tensors = [row for row in rows if row["NPU Dtype"].startswith("torch.") and row["NPU Tensor Shape"] != "[]"
               and row["Bench Name"] != "N/A"]
    assert len(tensors) > (100 if level == "mix" else 50)
    assert [row["NPU Name"] for row in tensors if row[metric] in ("", "N/A", "unsupported")] == []
    result = compare_dirs(golden, target, workers=1)
    ours = result.pairs[0]
    assert ours.divergence is None
    write_csv(result, tmp_path / "ours.csv")
    with (tmp_path / "ours.csv").open() as handle:
        our_table = list(csv.DictReader(handle))
    assert set(rows[0]) - set(our_table[0]) == set()  # every msprobe column, in both modes
    if task == "statistics":
        ours_by_name = {row["NPU Name"]: row for row in our_table}
        for row in tensors:
            for column in ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr",
                           "NPU Requires_grad", "Bench Requires_grad", "Requires_grad Consistent"):
                mine, theirs = ours_by_name[row["NPU Name"]][column], row[column]
                if theirs.endswith("%"):
                    assert float(mine.rstrip("%")) == pytest.approx(float(theirs.rstrip("%")), rel=1e-6), column
                else:
                    assert mine == theirs, (row["NPU Name"], column)
    if task == "tensor":
        assert all(path.suffix == ".pt" for path in (golden / "step0" / "rank0" / "dump_tensor_data").iterdir())
        scalars = [row for row in rows if row["NPU Tensor Shape"] == "[]" and row["NPU Dtype"].startswith("torch.")
                   and row["Bench Name"] != "N/A"]
        ours_by_name = {row["NPU Name"]: row for row in our_table}
        assert scalars  # the loss: msprobe gives 0-d tensors no cosine, distance or ratios; npukit's CSV neither
        for row in scalars:
            for column in ("Cosine", "EucDist", "One Thousandth Err Ratio", "Five Thousandths Err Ratio"):
                assert ours_by_name[row["NPU Name"]][column] == row[column] == "unsupported"
        assert _metrics_agree(ours, rows) > (100 if level == "mix" else 50)


# msprobe's tensor-mode metric columns and npukit's fields for them
METRIC_COLUMNS = {"Cosine": "cosine", "EucDist": "euc_dist", "MaxAbsErr": "max_abs", "MaxRelativeErr": "max_rel",
                  "One Thousandth Err Ratio": "within_1e3", "Five Thousandths Err Ratio": "within_5e3"}


def _metrics_agree(ours, msprobe_rows: list[dict]) -> int:
    """Every tensor both tools paired and measured: the metrics agree to 1e-6 (msprobe prints
    cosine to 6 digits). Returns how many rows were checked; a row msprobe measured that npu-compare
    did not pair or measure fails, unless npu-compare says why it left that entry out."""
    theirs = {row["NPU Name"]: row for row in msprobe_rows if row["NPU Dtype"].startswith("torch.")
              and row["NPU Tensor Shape"] != "[]" and row["Bench Name"] != "N/A"
              and row["Cosine"] not in ("", "N/A", "unsupported")}
    measured = {row.name: row for row in ours.rows if row.metrics is not None}
    left_out = [name for name in theirs if name not in measured]
    # a cross-tool pair leaves api backward entries out (different meanings) and says so
    assert all(".backward." in name and not name.startswith("Module.") for name in left_out), left_out[:5]
    if left_out:
        assert "api backward entries left out" in (ours.cross_tool or "")
    checked = 0
    for name, row in theirs.items():
        if name in left_out:
            continue
        for column, field in METRIC_COLUMNS.items():
            assert getattr(measured[name].metrics, field) == pytest.approx(float(row[column]), rel=1e-6, abs=1e-6), \
                (name, column)
        checked += 1
    return checked


STATISTICS_COLUMNS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")


def _statistics_agree(result, msprobe_rows: list[dict], csv_path: Path) -> int:
    """Statistics mode: npu-compare's CSV gives every row msprobe measured the same relative
    errors (msprobe's percentages, to 1e-6); rows left out as in _metrics_agree."""
    write_csv(result, csv_path)
    with csv_path.open() as handle:
        ours = {row["NPU Name"]: row for row in csv.DictReader(handle)}
    [pair] = result.pairs
    checked = 0
    for row in msprobe_rows:
        if row["Bench Name"] == "N/A" or not row["NormRelativeErr"].endswith("%"):
            continue
        if row["NPU Name"] not in ours:
            assert ".backward." in row["NPU Name"] and "api backward entries left out" in (pair.cross_tool or "")
            continue
        for column in STATISTICS_COLUMNS:
            mine, theirs = ours[row["NPU Name"]][column], row[column]
            if theirs.endswith("%"):
                assert float(mine.rstrip("%")) == pytest.approx(float(theirs.rstrip("%")), rel=1e-6, abs=1e-6), \
                    (row["NPU Name"], column)
        checked += 1
    return checked


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
@pytest.mark.parametrize("golden_tool, target_tool", [("msprobe", "npukit"), ("npukit", "msprobe"),
                                                       ("msprobe", "msprobe")])
def test_metrics_equal_msprobes_on_every_row_both_tools_pair(dumps, tmp_path, task, level, golden_tool, target_tool):
    """The issue's matrix beyond npukit's own pairs: an fp32 golden against a bf16 target, dumped by
    either tool, compared by npu-compare and by msprobe compare."""
    golden = dumps(golden_tool, task, level, "fp32")
    target = dumps(target_tool, task, level, "bf16")
    golden = _as_rank0(golden, tmp_path / "golden") if golden_tool == "msprobe" else golden
    target = _as_rank0(target, tmp_path / "target") if target_tool == "msprobe" else target
    rows = _msprobe_compare(golden, target, tmp_path / "out")
    result = compare_dirs(golden, target, workers=1)
    assert result.pairs[0].divergence is None
    if task == "tensor":
        assert _metrics_agree(result.pairs[0], rows) > 30
    else:
        assert _statistics_agree(result, rows, tmp_path / "ours.csv") > 30


def _msprobe_compare(golden: Path, target: Path, out: Path) -> list[dict]:
    msprobe = Path(sys.executable).with_name("msprobe")
    run = subprocess.run([str(msprobe), "compare", "-gp", str(golden / "step0"), "-tp", str(target / "step0"),
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [table] = out.glob("compare_result_*.csv")
    with table.open() as handle:
        return list(csv.DictReader(handle))


def _as_rank0(msprobe_dump: Path, copy: Path) -> Path:
    """msprobe compare pairs rank folders with rank folders: its own non-distributed run's
    step0/proc<pid> renamed step0/rank0, as the docs say (npukit's single process is rank 0)."""
    import shutil

    shutil.copytree(msprobe_dump, copy)
    [proc] = (copy / "step0").glob("proc*")
    proc.rename(proc.with_name("rank0"))
    return copy


@pytest.mark.parametrize("task", ["statistics", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
@pytest.mark.parametrize("golden_tool", ["msprobe", "npukit"])
def test_msprobe_compare_pairs_a_cross_tool_pair_by_name(dumps, tmp_path, task, level, golden_tool):
    """The same model dumped by msprobe and npukit: msprobe compare lines the two up by name,
    forward entries, parameter gradients and argument positions included (x + y is
    Tensor.__add__ in both, F.layer_norm's weight input.2, a parameter gradient
    Module.X.parameters_grad.0.weight), the optimizer's update (Tensor.add_) too."""
    msprobe_dump = _as_rank0(dumps("msprobe", task, level, "fp32"), tmp_path / "msprobe")
    npukit_dump = dumps("npukit", task, level, "fp32")
    golden, target = (msprobe_dump, npukit_dump) if golden_tool == "msprobe" else (npukit_dump, msprobe_dump)
    rows = _msprobe_compare(golden, target, tmp_path / "out")
    names = [row["NPU Name"] for row in rows]
    assert len(names) == len(set(names))
    forward = [row for row in rows if ".forward." in row["NPU Name"] or ".parameters_grad." in row["NPU Name"]]
    assert [row["NPU Name"] for row in forward if row["Bench Name"] == "N/A"] == []
    grads = [row for row in forward if ".parameters_grad.0." in row["NPU Name"]]
    assert len(grads) == (10 if level == "mix" else 0) and all(row["Bench Name"] == row["NPU Name"] for row in grads)
    assert any(row["NPU Name"] == "Functional.layer_norm.0.forward.input.2" and row["Bench Name"] != "N/A"
               for row in forward)
    assert any(row["NPU Name"].startswith("Tensor.__add__.0.forward.input.") for row in forward)
    metric = "Cosine" if task == "tensor" else "NormRelativeErr"
    tensors = [row for row in forward if row["Bench Name"] != "N/A" and row["NPU Dtype"].startswith("torch.")
               and row["NPU Tensor Shape"] != "[]"]
    assert len(tensors) > (40 if level == "mix" else 25)
    assert [row["NPU Name"] for row in tensors if row[metric] in ("", "N/A", "unsupported")] == []
    if task == "tensor":  # fp32 against fp32, the same weights and batch
        assert all(float(row["Cosine"]) > 0.99999 for row in tensors)


def _dump_json(dump: Path) -> dict:
    import json

    [path] = (dump / "step0").glob("*/dump.json")
    return json.loads(path.read_text())["data"]


def test_both_tools_write_the_same_module_backward_lists_and_integer_statistics(dumps, tmp_path):
    """A module whose inputs need no gradient (the conv, the block): "output": [] in both (npukit
    wrote [null], an N/A row in msprobe compare); the int64 labels: Max/Min integers, Mean/Norm
    null in both (npukit wrote numbers)."""
    theirs = _dump_json(dumps("msprobe", "statistics", "mix", "fp32"))
    ours = _dump_json(dumps("npukit", "statistics", "mix", "fp32"))
    modules = [name for name in theirs if name.startswith("Module.") and ".backward." in name]
    assert "Module.block.conv.Conv2d.backward.0" in modules and "Module.block.Block.backward.0" in modules
    for name in modules:
        assert len(ours[name]["output"]) == len(theirs[name]["output"]), name
        assert None not in ours[name]["output"], name
    labels = [dump["Functional.cross_entropy.0.forward"]["input_args"][1] for dump in (theirs, ours)]
    stats = [[(leaf[key], type(leaf[key])) for key in ("Max", "Min", "Mean", "Norm")] for leaf in labels]
    assert labels[0]["dtype"] == "torch.int64" and stats[0] == stats[1]
    # msprobe compare on npukit's own pair: no N/A row from a module backward entry
    rows = _msprobe_compare(dumps("npukit", "statistics", "mix", "fp32"), dumps("npukit", "statistics", "mix", "bf16"),
                            tmp_path)
    assert [row["NPU Name"] for row in rows if row["NPU Name"].startswith("Module.") and ".backward." in row["NPU Name"]
            and "N/A" in (row["Bench Name"], row["NPU Dtype"], row["Bench Dtype"])] == []


def _msprobe_graph(dump: Path) -> dict[str, str | None]:
    """msprobe's own model-graph builder (its visualization, which reads construct.json, dump.json
    and stack.json) on a dump: node -> parent node."""
    from msprobe.visualization.builder.graph_builder import GraphBuilder

    [rank] = (dump / "step0").iterdir()
    graph = GraphBuilder.build(str(rank / "construct.json"), str(rank / "dump.json"), str(rank / "stack.json"))
    return {name: node.upnode.id if node.upnode else None for name, node in graph.node_map.items()}


def test_msprobes_graph_builder_reads_npukits_model_structure_as_its_own(dumps):
    """construct.json: msprobe builds the same module tree from npukit's dump as from its own, the
    optimizer's update under its "optimizer" node in both."""
    theirs = _msprobe_graph(dumps("msprobe", "statistics", "mix", "fp32"))
    ours = _msprobe_graph(dumps("npukit", "statistics", "mix", "fp32"))
    assert len(theirs) > 40
    shared = [name for name in theirs if name in ours]
    assert [name for name in shared if theirs[name] != ours[name]] == []
    # msprobe's construct.json also lists the apis its risk level leaves out of dump.json (nodes
    # without data: Tensor.flatten, Tensor.float, forward and backward); npukit's lists what it dumps
    data = _dump_json(dumps("msprobe", "statistics", "mix", "fp32"))
    structure_only = {name for name in theirs if name not in data and name.endswith(("forward", "backward"))
                      and not name.startswith("Module.")}
    assert {name.split(".")[1] for name in structure_only} == {"flatten", "float"}
    assert len(shared) == len(theirs) - len(structure_only)
    assert {name for name, parent in ours.items() if parent == "optimizer"} == \
        {name for name, parent in theirs.items() if parent == "optimizer"} != set()
    assert {"Module.block.Block.forward.0", "Module.block.fc1.Linear.backward.0"} <= set(shared)
    assert ours["Functional.linear.0.forward"] == "Module.block.fc1.Linear.forward.0"
