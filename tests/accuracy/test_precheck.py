"""`npu-compare --precheck DUMP`: every op of a small transformer's dump re-run on the emulated NPU and
judged against a reference accelerator's numerics; an op whose NPU kernel is made imprecise is the
one flagged; msprobe's CSV layout."""

import csv
import subprocess
import sys
import warnings

import pytest
import torch

from npukit.accuracy.precheck import (
    COMPARE_DETAIL_COLUMNS,
    COMPARE_RESULT_COLUMNS,
    DETAIL_COLUMNS,
    ERROR,
    FILES,
    PASS,
    RESULT_COLUMNS,
    SKIP,
    run_precheck,
    write_csvs,
)
from tests.accuracy.models import dump_llama


@pytest.fixture(scope="module")
def tensor_dump(tmp_path_factory):
    import npukit.npu_backend  # noqa: F401

    out = tmp_path_factory.mktemp("precheck") / "dump"
    dump_llama(out, "tensor")
    return out


def _degraded_softmax(self, dim, half_to_float):
    """softmax computed in fp16 with its sum truncated to 8 mantissa bits: an imprecise NPU kernel."""
    values = self.cpu().half()
    exps = (values - values.amax(dim, keepdim=True)).exp()
    total = exps.float().sum(dim, keepdim=True)
    truncated = (total.view(torch.int32) & ~((1 << 15) - 1)).view(torch.float32).half()
    return (exps / truncated).to(self.dtype).to(self.device)


@pytest.fixture
def imprecise_npu_softmax():
    """The emulated NPU's softmax kernel replaced by an imprecise one for the test (the CPU's untouched)."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        library.impl("_softmax", _degraded_softmax, "PrivateUse1")
    yield
    library._destroy()  # the emulator's own kernel again


def test_every_op_of_a_transformer_dump_is_judged_and_none_is_flagged(tensor_dump, npu):
    result = run_precheck(tensor_dump)
    names = [op.name for op in result.ops]
    assert {"NPU.npu_rms_norm.0.forward", "NPU.npu_rotary_mul.3.forward", "NPU.npu_swiglu.1.forward",
            "Functional.linear.0.forward", "Torch.matmul.1.forward", "Functional.softmax.0.forward",
            "Functional.layer_norm.1.forward", "Tensor.masked_fill.0.forward", "Functional.cross_entropy.0.forward",
            } <= set(names)
    assert [(op.name, op.reason) for op in result.ops if op.status != PASS] == []
    assert result.exit_code() == 0
    assert "0 failed, 0 skipped" in result.headline()
    # each forward output and, from its backward entry, each input gradient was measured
    linear = next(op for op in result.ops if op.name == "Functional.linear.0.forward")
    assert [t.name for t in linear.tensors] == ["Functional.linear.0.forward.output.0",
                                                "Functional.linear.0.backward.output.0",
                                                "Functional.linear.0.backward.output.1",
                                                "Functional.linear.0.backward.output.2"]
    assert linear.backward_status == PASS


def test_the_op_whose_npu_kernel_is_imprecise_is_flagged_and_no_other(tensor_dump, npu, imprecise_npu_softmax):
    result = run_precheck(tensor_dump, workers=1)  # in this process, where the kernel is replaced
    assert sorted(op.name for op in result.failed()) == ["Functional.softmax.0.forward", "Functional.softmax.1.forward"]
    assert result.skipped() == []
    assert result.exit_code() == 1
    assert "2 failed" in result.headline() and "Functional.softmax.0.forward" in result.headline()
    forward = next(t for t in result.failed()[0].tensors if t.name.endswith("forward.output.0"))
    assert forward.status == ERROR and "the reference's" in forward.message


def test_a_statistics_dump_is_judged_on_inputs_drawn_within_its_statistics(tmp_path, npu):
    dump_llama(tmp_path / "stats", "stats")
    result = run_precheck(tmp_path / "stats")
    assert len(result.ops) >= 30
    assert [(op.name, op.reason) for op in result.ops if op.status != PASS] == []
    assert result.exit_code() == 0


def test_ops_that_cannot_be_rerun_are_skipped_with_the_reason_and_never_passed(tmp_path, npu):
    dump_llama(tmp_path / "dropout", "tensor", dropout=0.1)
    result = run_precheck(tmp_path / "dropout")
    skipped = {op.name: op.reason for op in result.skipped()}
    assert skipped == {"Functional.dropout.0.forward": "a random op: its result cannot be reproduced",
                       "Functional.dropout.1.forward": "a random op: its result cannot be reproduced"}
    assert "2 skipped" in result.headline() and result.exit_code() == 0
    # a dump in which most ops cannot be re-run vouches for nothing
    for op in result.ops[: len(result.ops) // 2 + 1]:
        op.status, op.reason = SKIP, "test"
    assert result.exit_code() == 1 and "too few judged" in result.headline()


def test_csv_files_carry_msprobe_columns_and_verdicts(tensor_dump, tmp_path, npu, imprecise_npu_softmax):
    result = run_precheck(tensor_dump, workers=1)
    write_csvs(result, tmp_path / "out")

    def rows(key):
        with open(tmp_path / "out" / FILES[key], newline="") as handle:
            return list(csv.reader(handle))

    assert rows("npu_details")[0] == DETAIL_COLUMNS and rows("bench_details")[0] == DETAIL_COLUMNS
    assert rows("npu_result")[0] == RESULT_COLUMNS and rows("compare_result")[0] == COMPARE_RESULT_COLUMNS
    assert rows("compare_details")[0] == COMPARE_DETAIL_COLUMNS
    verdicts = {row[0]: row[1] for row in rows("compare_result")[1:]}
    assert {name for name, verdict in verdicts.items() if verdict != PASS} == {"Functional.softmax.0",
                                                                               "Functional.softmax.1"}
    details = {row[0]: row for row in rows("npu_details")[1:]}
    assert details["Functional.softmax.0.forward.output.0"][DETAIL_COLUMNS.index("Status")] == ERROR
    assert details["Functional.linear.0.backward.output.1"][DETAIL_COLUMNS.index("DEVICE Dtype")] == "torch.float32"


def test_column_names_are_msprobes_own():
    compare_utils = pytest.importorskip("msprobe.pytorch.api_accuracy_checker.compare.compare_utils")
    columns = compare_utils.ApiPrecisionCompareColumn
    assert DETAIL_COLUMNS == compare_utils.DETAIL_TEST_ROWS[0]
    assert set(columns.to_required_columns()) <= set(DETAIL_COLUMNS)
    assert COMPARE_DETAIL_COLUMNS == columns.get_detail_csv_title()
    assert COMPARE_RESULT_COLUMNS == columns.get_result_csv_title()
    comparator = pytest.importorskip("msprobe.pytorch.api_accuracy_checker.compare.compare").Comparator
    assert RESULT_COLUMNS == [comparator.COLUMN_API_NAME, comparator.COLUMN_FORWARD_SUCCESS,
                              comparator.COLUMN_BACKWARD_SUCCESS, "Message"]


@pytest.mark.slow
def test_msprobe_api_precision_compare_reads_the_csv_files(tensor_dump, tmp_path, npu, imprecise_npu_softmax):
    msprobe = pytest.importorskip("msprobe")
    result = run_precheck(tensor_dump, workers=1)
    write_csvs(result, tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "msprobe.msprobe", "api_precision_compare",
         "-npu", str(tmp_path / "out" / FILES["npu_details"]), "-gpu", str(tmp_path / "out" / FILES["bench_details"]),
         "-o", str(tmp_path / "msprobe")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    [result_csv] = (tmp_path / "msprobe").glob("api_precision_compare_result_*.csv")
    with open(result_csv, newline="", encoding="utf-8-sig") as handle:
        verdicts = {row["API Name"]: row["Forward Test Success"] for row in csv.DictReader(handle)}
    judged = {op.name.rpartition(".")[0] for op in result.judged()}
    assert set(verdicts) == judged, msprobe.__file__
    assert {name for name, verdict in verdicts.items() if verdict != PASS} == {"Functional.softmax.0",
                                                                               "Functional.softmax.1"}


def test_npu_compare_precheck_prints_the_verdict_writes_the_files_and_exits_by_it(tensor_dump, tmp_path):
    from tests.accuracy.test_journey import npukit

    done = npukit("compare_main", "--precheck", str(tensor_dump), "--precheck-dir", str(tmp_path / "csv"), "--top", "100",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "0 failed, 0 skipped: every judged op is as precise as the reference accelerator" in done.stdout
    assert "NPU.npu_rms_norm.0.forward" in done.stdout
    assert {path.name for path in (tmp_path / "csv").iterdir()} == set(FILES.values())
    both = npukit("compare_main", str(tensor_dump), str(tensor_dump), "--precheck", str(tensor_dump), cwd=tmp_path)
    assert both.returncode == 2 and "--precheck DUMP judges one dump on its own: GOLDEN/TARGET" in both.stderr


def test_fp32_convolutions_and_matmuls_in_hf32_are_judged_against_a_tf32_reference(tmp_path, npu):
    """An fp32 run with HF32 on (the dump records it) is as precise as a GPU in TF32 mode, forward and
    backward; measured against TF32-off numerics alone its conv2d and linear would be flagged."""
    import torch.nn as nn
    import torch.nn.functional as F

    from npukit.accuracy.dump import DumpSession

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).to("npu")
    torch.npu.matmul.allow_hf32 = True
    try:
        with DumpSession(tmp_path / "dump", level="api", mode="tensor"):
            loss = F.cross_entropy(model(torch.randn(4, 3, 8, 8, device="npu")), torch.randint(0, 10, (4,), device="npu"))
            loss.backward()
    finally:
        torch.npu.matmul.allow_hf32 = False
    result = run_precheck(tmp_path / "dump", workers=1)
    assert [(op.name, op.status) for op in result.ops] == [
        ("Functional.conv2d.0.forward", PASS), ("Functional.relu.0.forward", PASS),
        ("Functional.linear.0.forward", PASS), ("Functional.cross_entropy.0.forward", PASS)]
    conv = result.ops[0]
    # the input needs no gradient: the weight's and the bias's are judged
    assert [t.name for t in conv.tensors] == ["Functional.conv2d.0.forward.output.0", "Functional.conv2d.0.backward.output.1",
                                              "Functional.conv2d.0.backward.output.2"]
    assert conv.tensors[0].npu["max_ulp"] is not None  # matmul-class: ULP error reported


def _leaf(shape, high, low, mean, dtype="torch.float32"):
    return {"type": "torch.Tensor", "dtype": dtype, "shape": shape, "Max": high, "Min": low, "Mean": mean, "Norm": 1.0,
            "requires_grad": False}


def test_a_hand_written_statistics_dump_names_what_it_cannot_rerun(tmp_path, npu):
    """msprobe's dump.json layout, statistics only: the op it can rebuild is judged on generated inputs
    (its backward, whose gradient does not fit, is said not to be), an unknown api and an argument the
    dump holds no value of are skipped naming them, and one judged op of three is too few to vouch for
    the run."""
    import json

    entries = {
        "Torch.mul.0.forward": {"input_args": [_leaf([64, 8], 3.0, -2.0, 0.1), {"type": "float", "value": 0.5}],
                                "input_kwargs": {}, "output": [_leaf([64, 8], 1.5, -1.0, 0.05)]},
        # a gradient of another shape than the input it is for: the forward is still judged
        "Torch.mul.0.backward": {"input": [_leaf([64, 8], 1.0, -1.0, 0.0)], "output": [_leaf([8, 8], 1.0, -1.0, 0.0)]},
        "Torch.no_such_op.0.forward": {"input_args": [_leaf([4], 1.0, 0.0, 0.5)], "input_kwargs": {},
                                       "output": [_leaf([4], 1.0, 0.0, 0.5)]},
        "Functional.pad.0.forward": {"input_args": [_leaf([4, 4], 1.0, 0.0, 0.5), {"type": "PadSpec"}],
                                     "input_kwargs": {}, "output": [_leaf([6, 6], 1.0, 0.0, 0.4)]},
    }
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": entries}))
    result = run_precheck(tmp_path, workers=1)
    assert {op.name: (op.status, op.reason) for op in result.ops} == {
        "Torch.mul.0.forward": (PASS, "backward not judged: the gradients of Torch.mul.0.backward do not match its "
                                      "forward's inputs"),
        "Torch.no_such_op.0.forward": (SKIP, "Torch.no_such_op: not a torch api npukit knows"),
        "Functional.pad.0.forward": (SKIP, "Functional.pad.0.forward: an argument of type PadSpec whose value the dump "
                                           "does not hold"),
    }
    assert result.exit_code() == 1 and "1 judged, 0 failed, 2 skipped: too few judged" in result.headline()


@pytest.mark.slow
def test_a_dump_the_real_msprobe_wrote_is_prechecked(tmp_path, npu):
    """msprobe's own tensor dump (bf16 autocast, L1) of a conv/LayerNorm/MLP model: every op judged, none
    flagged; msprobe's linear backward (its autograd node's gradients) is said not to be judged."""
    from pathlib import Path

    pytest.importorskip("msprobe")
    script = Path(__file__).with_name("msprobe_interop_model.py")
    done = subprocess.run([sys.executable, str(script), "msprobe", "tensor", "L1", "bf16", str(tmp_path / "dump")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = run_precheck(tmp_path / "dump", workers=1)
    assert len(result.ops) >= 15 and result.exit_code() == 0
    assert [(op.name, op.status) for op in result.ops if op.status != PASS] == []
    assert {op.name for op in result.ops if op.reason.startswith("backward not judged")} == {
        "Functional.linear.0.forward", "Functional.linear.1.forward", "Functional.linear.2.forward"}


def test_moe_token_routing_and_grouped_matmul_are_judged_not_skipped(tmp_path, npu):
    """GPT-OSS's MoE layer (MindSpeed-LLM): npu_moe_token_permute, npu_grouped_matmul and
    npu_moe_token_unpermute accept the float64 of the reference run on the CPU and are judged."""
    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend.torch_npu_shim import install_torch_npu

    torch_npu = install_torch_npu()

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(2, 32, 32) * 0.2)

        def forward(self, tokens, indices, probs):
            permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, indices)
            counts = torch.bincount(indices.flatten().cpu(), minlength=2).to(tokens.device)
            with torch.no_grad():  # torch_npu registers no backward for npu_grouped_matmul
                torch_npu.npu_grouped_matmul([permuted], [self.weight.half()], group_list=counts, group_type=0,
                                             group_list_type=1, split_item=2)
            return torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)

    torch.manual_seed(0)
    model = Experts().to(npu)
    tokens = torch.randn(6, 32, device=npu, dtype=torch.float16, requires_grad=True)
    indices = torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0], [1, 0], [0, 1]], device=npu)
    probs = torch.softmax(torch.randn(6, 2, device=npu), -1).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DumpSession(tmp_path / "dump", level="api", mode="tensor"):
        model(tokens, indices, probs).float().sum().backward()
        optimizer.step()
    result = run_precheck(tmp_path / "dump", workers=1)
    verdicts = {op.name: (op.status, op.reason) for op in result.ops if op.name.startswith("NPU.")}
    assert verdicts == {"NPU.npu_moe_token_permute.0.forward": (PASS, ""),
                        "NPU.npu_grouped_matmul.0.forward": (PASS, ""),
                        "NPU.npu_moe_token_unpermute.0.forward": (PASS, "")}
    assert result.skipped() == [] and result.exit_code() == 0


def test_an_op_whose_reference_run_raises_is_skipped_saying_it_was_the_reference_run(tmp_path, npu, monkeypatch):
    """A kernel that runs on the NPU but refuses the float64 reference run is skipped, and the reason
    names that run rather than reading as if the op refused its recorded arguments."""
    import json

    from npukit.accuracy import precheck

    entries = {"Torch.mul.0.forward": {"input_args": [_leaf([64, 8], 3.0, -2.0, 0.1), {"type": "float", "value": 0.5}],
                                       "input_kwargs": {}, "output": [_leaf([64, 8], 1.5, -1.0, 0.05)]}}
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": entries}))
    call = precheck._call

    def refusing_float64(op, tensors, device, side):
        if side == "truth":
            raise ValueError("mul: float64 is not supported")
        return call(op, tensors, device, side)

    monkeypatch.setattr(precheck, "_call", refusing_float64)
    result = run_precheck(tmp_path, workers=1)
    assert [(op.name, op.status, op.reason) for op in result.ops] == [
        ("Torch.mul.0.forward", SKIP, "could not re-run it: the float64 reference run on the CPU raised ValueError: "
                                      "mul: float64 is not supported")]
