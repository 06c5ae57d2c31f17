"""Reading msprobe dumps (.pt data, rank/proc folders, both stack.json formats) and safe tensor files."""

import json

import numpy as np
import pytest
import torch

from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.dumpfile import load_dump_dir
from npukit.accuracy.tensor_io import read_tensor, write_tensor
from npukit.errors import UserError


def _leaf(tensor, data_name):
    return {
        "type": "torch.Tensor", "dtype": str(tensor.dtype), "shape": list(tensor.shape),
        "Max": tensor.max().item(), "Min": tensor.min().item(), "Mean": tensor.float().mean().item(),
        "Norm": tensor.float().norm().item(), "requires_grad": False, "data_name": data_name,
    }


def write_msprobe_dump(rank_dir, scale_relu_output=1.0):
    """A dump laid out the way msprobe writes it: x -> conv2d -> relu, tensors as .pt files."""
    data_dir = rank_dir / "dump_tensor_data"
    data_dir.mkdir(parents=True)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 5)
    weight = torch.randn(3, 2, 3, 3)
    conv = torch.nn.functional.conv2d(x, weight)
    relu = torch.relu(conv) * scale_relu_output
    tensors = {
        "Functional.conv2d.0.forward.input.0.pt": x,
        "Functional.conv2d.0.forward.input.1.pt": weight,
        "Functional.conv2d.0.forward.output.0.pt": conv,
        "Functional.relu.0.forward.input.0.pt": conv,
        "Functional.relu.0.forward.output.0.pt": relu,
    }
    for name, tensor in tensors.items():
        torch.save(tensor, data_dir / name)
    dump = {
        "task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": str(data_dir),
        "data": {
            "Functional.conv2d.0.forward": {
                "input_args": [_leaf(x, "Functional.conv2d.0.forward.input.0.pt"),
                               _leaf(weight, "Functional.conv2d.0.forward.input.1.pt")],
                "input_kwargs": {"stride": {"type": "int", "value": 1}},
                "output": [_leaf(conv, "Functional.conv2d.0.forward.output.0.pt")],
            },
            "Functional.relu.0.forward": {
                "input_args": [_leaf(conv, "Functional.relu.0.forward.input.0.pt")],
                "input_kwargs": {},
                "output": [_leaf(relu, "Functional.relu.0.forward.output.0.pt")],
            },
        },
    }
    (rank_dir / "dump.json").write_text(json.dumps(dump))
    (rank_dir / "stack.json").write_text(json.dumps({"Functional.relu.0.forward": ["File train.py, line 7, in forward"]}))


def test_msprobe_dump_with_pt_files_is_compared(tmp_path):
    write_msprobe_dump(tmp_path / "golden" / "rank0")
    write_msprobe_dump(tmp_path / "target" / "proc4242", scale_relu_output=1.5)
    result = compare_dirs(tmp_path / "golden", tmp_path / "target", workers=1)
    divergence = result.pairs[0].divergence
    assert divergence.entry == "Functional.relu.0.forward"
    assert divergence.stack == ["File train.py, line 7, in forward"]
    conv_rows = [row for row in result.rows if row.target_entry == "Functional.conv2d.0.forward"]
    assert conv_rows and all(row.metrics.rel_l2 == 0 for row in conv_rows)


def test_step_rank_layout_is_discovered(tmp_path):
    write_msprobe_dump(tmp_path / "dump" / "step0" / "rank0")
    write_msprobe_dump(tmp_path / "dump" / "step2" / "rank1")
    assert list(load_dump_dir(tmp_path / "dump")) == ["step0/rank0", "step2/rank1"]


def test_pt_file_with_pickled_objects_is_refused(tmp_path):
    write_msprobe_dump(tmp_path / "golden" / "rank0")
    write_msprobe_dump(tmp_path / "target" / "rank0")
    evil = tmp_path / "target/rank0/dump_tensor_data/Functional.relu.0.forward.output.0.pt"
    torch.save({"payload": print}, evil)
    with pytest.raises(UserError, match="Functional.relu.0.forward.output.0.pt: holds Python objects other than"
                                        " tensors, which npukit never unpickles"):
        compare_dirs(tmp_path / "golden", tmp_path / "target", workers=1)


def test_npy_with_object_dtype_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match="x.npy: holds pickled Python objects, which npukit never loads"):
        read_tensor(path)


def test_tensor_file_disagreeing_with_dump_json_is_reported(tmp_path):
    write_tensor(tmp_path / "t.npy", torch.zeros(2, 3))
    with pytest.raises(UserError, match=r"t.npy: holds shape \[2, 3\] but dump.json says \[3, 2\]"):
        read_tensor(tmp_path / "t.npy", "torch.float32", [3, 2])
    with pytest.raises(UserError, match="t.npy: holds float32 data but dump.json says torch.bfloat16"):
        read_tensor(tmp_path / "t.npy", "torch.bfloat16")


def test_entry_without_dtype_names_file_and_tensor(tmp_path):
    rank_dir = tmp_path / "d" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "dump.json").write_text(json.dumps(
        {"data": {"Functional.relu.0.forward": {"output": [{"type": "torch.Tensor", "shape": [2]}]}}}
    ))
    with pytest.raises(UserError, match=r"d/rank0/dump.json: tensor Functional.relu.0.forward.output.0 has no dtype"):
        load_dump_dir(tmp_path / "d")


def test_older_npukit_module_backward_nulls_and_integer_statistics_compare_with_the_new_form(tmp_path):
    """npukit before msprobe's layout wrote a null for a module argument without gradient and
    numeric Mean/Norm for integer tensors (and |x| as a 0-d tensor's Norm): such a dump still
    loads, and compares with the new form with no error and no unmatched row."""
    import json

    def tensor(dtype, shape, stats):
        return {"type": "torch.Tensor", "dtype": dtype, "shape": shape, "requires_grad": False,
                **dict(zip(("Max", "Min", "Mean", "Norm"), stats))}

    grad = tensor("torch.float32", [3], [1.0, 1.0, 1.0, 3 ** 0.5])
    labels = tensor("torch.int64", [4], [3.0, 1.0, 2.0, 4.242640687119285])
    scalar = tensor("torch.float32", [], [-1.5, -1.5, -1.5, 1.5])
    old = {"Module.m.Two.backward.0": {"input": [grad], "output": [None, grad]},
           "Module.n.Two.backward.0": {"input": [grad], "output": [None]},
           "Functional.cross_entropy.0.forward": {"input_args": [scalar, labels], "input_kwargs": {},
                                                  "output": [scalar]}}
    new = json.loads(json.dumps(old))
    new["Module.m.Two.backward.0"]["output"] = [grad]
    new["Module.n.Two.backward.0"]["output"] = []
    new_labels = new["Functional.cross_entropy.0.forward"]["input_args"][1]
    new_labels.update(Max=3, Min=1, Mean=None, Norm=None)
    for value in (new["Functional.cross_entropy.0.forward"]["input_args"][0],
                  new["Functional.cross_entropy.0.forward"]["output"][0]):
        value["Norm"] = -1.5  # msprobe 26.2: a 0-d tensor's value as all four
    for side, data in (("old", old), ("new", new)):
        rank = tmp_path / side / "step0" / "rank0"
        rank.mkdir(parents=True)
        (rank / "dump.json").write_text(json.dumps({"task": "statistics", "level": "mix", "framework": "pytorch",
                                                    "dump_data_dir": None, "data": data}))
    [old_rank] = load_dump_dir(tmp_path / "old").values()
    [new_rank] = load_dump_dir(tmp_path / "new").values()
    for dump in (old_rank, new_rank):
        [leaf] = dump.by_name()["Module.m.Two.backward.0"].outputs
        assert leaf.suffix == "output.0"
        assert dump.by_name()["Functional.cross_entropy.0.forward"].inputs[0].stats[3] == 1.5
    for golden, target in (("old", "new"), ("new", "old")):
        [pair] = compare_dirs(tmp_path / golden, tmp_path / target, workers=1).pairs
        assert pair.divergence is None
        assert [(row.name, row.verdict) for row in pair.rows if row.verdict != "pass"] == []
        assert len(pair.rows) == 6
