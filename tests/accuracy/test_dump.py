"""DumpSession: names, schema, levels, modes, steps, filters, and option errors."""

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy import naming
from npukit.accuracy.dump import DumpSession, parse_steps
from npukit.accuracy.tensor_io import read_tensor
from npukit.errors import UserError
from npukit.watch.tensor_stats import tensor_stats

from .models import train


def load(root, step=0, rank=0):
    return json.loads((root / f"step{step}" / f"rank{rank}" / "dump.json").read_text())


def test_mix_level_names_and_schema(tmp_path):
    train(tmp_path, level="mix", mode="stats", steps=1)
    dump = load(tmp_path)
    assert dump["task"] == "statistics" and dump["level"] == "mix" and dump["framework"] == "pytorch"
    data = dump["data"]
    for name in ("Functional.linear.0.forward", "Functional.layer_norm.0.forward", "Functional.gelu.0.forward",
                 "Torch.square.0.forward", "Tensor.__add__.0.forward", "Functional.cross_entropy.0.forward",
                 "Module.blocks.0.fc1.Linear.forward.0", "Module.blocks.0.Block.forward.0",
                 "Functional.linear.0.backward", "Module.blocks.0.norm.LayerNorm.backward.0",
                 "Module.blocks.0.fc1.Linear.parameters_grad.0"):
        assert name in data, name
    leaf = data["Functional.linear.0.forward"]["output"][0]
    assert leaf["type"] == "torch.Tensor" and leaf["dtype"] == "torch.float32" and leaf["shape"] == [6, 16]
    assert set(leaf) >= {"Max", "Min", "Mean", "Norm", "requires_grad"}
    # the model itself is no entry: msprobe records the modules below the model it is given
    assert not any(name.startswith("Module.Net.") for name in data)
    module = data["Module.blocks.0.fc1.Linear.forward.0"]
    assert set(module["parameters"]) == {"weight", "bias"}
    assert data["Module.blocks.0.fc1.Linear.parameters_grad.0"]["weight"][0]["shape"] == [16, 16]
    # Inner ops complete before the module that runs them: execution (completion) order.
    names = list(data)
    assert names.index("Functional.linear.0.forward") < names.index("Module.embed.Linear.forward.0")
    construct = json.loads((tmp_path / "step0/rank0/construct.json").read_text())
    assert construct["Functional.layer_norm.0.forward"] == "Module.blocks.0.norm.LayerNorm.forward.0"
    stack = json.loads((tmp_path / "step0/rank0/stack.json").read_text())
    assert any("models.py" in line for _, (names, lines) in stack.items() for line in lines)


def test_stats_values_match_the_tensor(tmp_path):
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        nn.Identity()(x)  # the first module forward starts api recording
        torch.relu(x)
        session.step()
    leaf = load(tmp_path)["data"]["Torch.relu.0.forward"]["output"][0]
    assert (leaf["Max"], leaf["Min"], leaf["Mean"]) == (4.0, 0.0, 2.0)
    assert leaf["Norm"] == pytest.approx(float(torch.relu(x).norm()))


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "chunk of the last dim": lambda t: t.chunk(3, -1)[1],  # rows of a slice, as q/k/v of a fused qkv
    "every other row": lambda t: t[::2],
    "expanded (overlapping)": lambda t: t[:1].expand(40, -1),
    "narrow rows": lambda t: t[:, :3],
    "scalar": lambda t: t[7, 9],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_statistics_agree_with_float64_for_every_dtype_and_layout(dtype, layout):
    generator = torch.Generator().manual_seed(0)
    data = (torch.randn(301, 157, generator=generator) * 3 + 0.5).to(dtype)  # odd sizes: a partial tail
    data = LAYOUTS[layout](data)
    exact = data.double()
    high, low, mean, norm, nans, infs = tensor_stats(data)
    assert (high, low) == (float(exact.max()), float(exact.min()))
    assert mean == pytest.approx(float(exact.mean()), rel=1e-6, abs=1e-6)
    assert norm == pytest.approx(float(exact.norm()), rel=1e-6)
    assert (nans, infs) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_inf_and_float_overflowing_squares_give_torch_figures(dtype):
    data = torch.ones(1000, dtype=dtype)
    data[3], data[500], data[999] = float("nan"), float("inf"), float("-inf")
    high, low, _, _, nans, infs = tensor_stats(data)
    assert high != high and low != low and (nans, infs) == (1, 2)  # nan propagates, as in torch.amax
    if dtype != torch.float16:  # 1e20 is beyond fp16's range
        big = torch.full((64,), 1e20, dtype=dtype)  # finite, but its squares overflow float32
        assert tensor_stats(big)[3] == pytest.approx(float(big.double().norm()), rel=1e-2)


def test_activations_are_freed_by_backward_not_kept_for_a_gc_pass(tmp_path):
    """Backward hooks must not hold the tensors they hook: a leak here made dumps 20% slower."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    gc.disable()
    try:
        with DumpSession(tmp_path, level="mix", mode="stats") as session:
            out = model(torch.randn(4, 8, requires_grad=True))
            alive = weakref.ref(out)
            out.sum().backward()
            del out
            assert alive() is None
            session.step()
    finally:
        gc.enable()


def test_a_dump_file_that_cannot_be_written_is_an_error_naming_it_at_stop(tmp_path):
    (tmp_path / "step0" / "rank0" / "dump.json").mkdir(parents=True)  # in the way of the file
    session = DumpSession(tmp_path, level="api", mode="stats")
    session.start()
    nn.Identity()(torch.ones(2))
    torch.relu(torch.ones(2))
    with pytest.raises(UserError, match=r"step0/rank0/dump.json: is a directory"):
        session.stop()  # the files are written by a background thread; its error is not lost


def test_an_api_backward_holds_the_gradient_of_each_argument_whatever_kernel_ran(tmp_path):
    """A golden and an NPU run may run one api through different kernels (the math attention:
    a dozen autograd nodes; the fused one: one node). Their backward entries must still match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention_backward(out, backend):
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 3, 8, 4, generator=generator, requires_grad=True) for _ in range(3))
        with sdpa_kernel(backend), DumpSession(out, level="api", mode="stats") as session:
            nn.Identity()(q)  # the first module forward starts api recording
            (F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2).sum().backward()
            session.step()
        return load(out)["data"]["Functional.scaled_dot_product_attention.0.backward"], (q.grad, k.grad, v.grad)

    math, grads = attention_backward(tmp_path / "math", SDPBackend.MATH)
    fused, _ = attention_backward(tmp_path / "fused", SDPBackend.FLASH_ATTENTION)
    for entry in (math, fused):
        assert [leaf["shape"] for leaf in entry["input"]] == [[2, 3, 8, 4]]
        assert [leaf["shape"] for leaf in entry["output"]] == [[2, 3, 8, 4]] * 3
        for leaf, grad in zip(entry["output"], grads, strict=True):
            assert leaf["Norm"] == pytest.approx(float(grad.norm()), rel=1e-5)



def test_the_ops_a_custom_functions_backward_calls_are_dumped_once_and_fused_ops_backward_internals_not(tmp_path):
    """msprobe on an NPU records the apis Python code calls in a custom autograd Function's backward
    (MindSpeed's grouped matmul); autograd ran that code with the dump off the stack. A torch_npu fused
    op's backward is one kernel there: its emulation's ops stay unseen, its backward entry is dumped."""
    from npukit.npu_backend.torch_npu_shim import install_torch_npu
    from tests.accuracy.test_overflow import CustomBackwardOverflow

    torch_npu = install_torch_npu()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gmm = CustomBackwardOverflow()

        def forward(self, x):
            return torch_npu.npu_swiglu(self.gmm(x))

    model = Model().npu()
    with DumpSession(tmp_path, level="api", mode="stats"):
        model(torch.randn(8, 16, device="npu")).sum().backward()
    entries = list(json.loads(next(tmp_path.rglob("dump.json")).read_text())["data"])
    assert entries == ["Torch.matmul.0.forward", "NPU.npu_swiglu.0.forward", "Tensor.sum.0.forward",
                       "Tensor.sum.0.backward", "NPU.npu_swiglu.0.backward",
                       "Tensor.t.0.forward", "Torch.matmul.1.forward", "Tensor.t.1.forward", "Torch.matmul.2.forward"]


def test_each_call_of_a_layer_autocast_casts_once_gets_its_own_weight_gradient(tmp_path):
    """Autocast casts a weight once per region and every call reuses the cast, whose autograd
    node sums all the calls' gradients. Each call's backward holds its own gradient, in the
    weight's dtype, as a golden run without autocast records it (pytorch/examples' actor-critic
    calls its value head once per state: the first call showed the sum of all of them)."""
    class OneStatePerCall(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, states):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return [self.head(state) for state in states]

    torch.manual_seed(0)
    model = OneStatePerCall()
    xs = [torch.randn(2, 4) for _ in range(3)]
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        sum(out.float().sum() * (i + 1) for i, out in enumerate(model(xs))).backward()
        session.step()
    data = load(tmp_path)["data"]
    for i, x in enumerate(xs):
        weight, bias = data[f"Functional.linear.{i}.backward"]["output"][1:]
        assert weight["dtype"] == bias["dtype"] == "torch.float32"
        expected_weight = (i + 1) * torch.ones(2, 3).T @ x.to(torch.bfloat16).float()
        assert weight["Norm"] == pytest.approx(float(expected_weight.norm()), rel=1e-2)
        assert bias["Norm"] == pytest.approx(float(torch.full((3,), 2.0 * (i + 1)).norm()), rel=1e-6)


def test_a_layer_that_works_in_place_gets_its_backward_and_its_input_before_the_write(tmp_path):
    """nn.LeakyReLU(inplace=True) (pytorch/examples' DCGAN) calls F.leaky_relu(x, 0.2, True): its
    input is measured before it is overwritten, and its api and module backward entries hold the
    gradient for that input (they were missing: a bf16 compare then named the BatchNorm before it,
    'the gradient arriving at this backward differs ... changed outside the dumped ops')."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.LeakyReLU(0.2, inplace=True), nn.Linear(6, 1))
    x = torch.randn(5, 4)
    with DumpSession(tmp_path, level="mix", mode="stats") as session:
        net(x).sum().backward()
        session.step()
    data = load(tmp_path)["data"]
    hidden = net[0](x).detach().requires_grad_()
    net[2](F.leaky_relu(hidden, 0.2)).sum().backward()
    lowest = float(hidden.detach().min())
    assert lowest < 0
    for name in ("Functional.leaky_relu.0.forward", "Module.1.LeakyReLU.forward.0"):
        assert data[name]["input_args"][0]["Min"] == pytest.approx(lowest, rel=1e-6)
    for name in ("Functional.leaky_relu.0.backward", "Module.1.LeakyReLU.backward.0"):
        assert data[name]["output"][0]["Norm"] == pytest.approx(float(hidden.grad.norm()), rel=1e-6)


def test_an_api_backward_sums_every_edge_of_a_composite_op_over_many_time_steps(tmp_path, npu):
    """torch.lstm on a device without a fused kernel makes several autograd nodes per time step
    and layer (hundreds here): each weight's gradient is the sum over all of them, as .grad is."""
    torch.manual_seed(0)
    rnn = nn.LSTM(6, 8, num_layers=2).to(npu)
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        out, _ = rnn(torch.randn(30, 2, 6, device=npu))
        out.square().sum().backward()
        session.step()
    outputs = load(tmp_path)["data"]["Torch.lstm.0.backward"]["output"]
    weights = outputs[3:]  # after the input and the two initial states (zeros: no gradient)
    assert outputs[:3] == [None, None, None]
    assert [leaf["Norm"] for leaf in weights] == pytest.approx([float(w.grad.norm()) for w in rnn._flat_weights],
                                                               rel=1e-5)

def test_a_module_backward_holds_its_own_share_of_a_residual_inputs_gradient(tmp_path):
    """x feeds the layer and a residual add: the layer's backward output is the gradient through
    the layer only (msprobe's full backward hook), not x's whole gradient."""
    layer = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(3) * 2)
    x = torch.tensor([[1.0, -2.0, 3.0]], requires_grad=True)
    with DumpSession(tmp_path, level="module", mode="stats") as session:
        h = x * 1  # a non-leaf input, as activations are
        (h + layer(h)).sum().backward()
        session.step()
    entry = load(tmp_path)["data"]["Module.Linear.backward.0"]
    assert [leaf["Max"] for leaf in entry["input"]] == [1.0]  # d(sum)/d(layer output)
    assert [leaf["Max"] for leaf in entry["output"]] == [2.0]  # W^T 1 = 2; x's whole gradient is 3
    assert x.grad.tolist() == [[3.0, 3.0, 3.0]]


class _Model(nn.Module):
    """A model around one layer: the model itself is no entry (msprobe records the modules below it)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return self.layer(*args)


def test_a_module_backward_is_recorded_when_no_input_gradient_leaves_it(tmp_path):
    class UsesOnlyData(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, unused, data):
            return self.fc(data)

    unused = torch.ones(2, requires_grad=True)  # needs a gradient, gets none from this module
    with DumpSession(tmp_path, level="module", mode="stats") as session:
        _Model(UsesOnlyData())(unused, torch.ones(1, 2)).sum().backward()
        session.step()
    entry = load(tmp_path)["data"]["Module.layer.UsesOnlyData.backward.0"]
    # `output`: the arguments that need a gradient (`unused`), none arrived (msprobe 26.2 writes no
    # entry at all here: its hook never fires)
    assert [leaf["shape"] for leaf in entry["input"]] == [[1, 2]] and entry["output"] == [None]


def test_api_gradients_are_numbered_as_msprobe_numbers_them_and_read_by_argument(tmp_path):
    """msprobe numbers an api's backward gradients by its autograd node's edges: batch_norm's node
    has none for the running statistics (weight gradient output.1), embedding's none for the
    indices (weight gradient output.0). The dump writes them so (msprobe compare pairs them) and
    says whose each is; npu-compare reads them by argument (batch_norm's weight is input.3)."""
    from npukit.accuracy.dumpfile import load_rank_dump

    norm, embed = nn.BatchNorm1d(3), nn.Embedding(5, 3)
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        norm(embed(torch.tensor([[1, 4], [2, 2]])).transpose(1, 2)).sum().backward()
        session.step()
    dump = load(tmp_path)
    norm_grads = dump["data"]["Functional.batch_norm.0.backward"]["output"]
    assert [leaf["shape"] for leaf in norm_grads] == [[2, 3, 2], [3], [3]]
    assert norm_grads[1]["Norm"] == pytest.approx(float(norm.weight.grad.norm()))
    [embed_grad] = dump["data"]["Functional.embedding.0.backward"]["output"]
    assert embed_grad["Norm"] == pytest.approx(float(embed.weight.grad.norm()))
    assert dump["npukit_arguments"] == {"Functional.batch_norm.0.backward": [0, 3, 4],
                                        "Functional.embedding.0.backward": [1]}
    entries = load_rank_dump(tmp_path / "step0" / "rank0").by_name()
    assert [leaf.suffix for leaf in entries["Functional.batch_norm.0.backward"].outputs] == \
        ["output.0", "output.3", "output.4"]
    assert [leaf.suffix for leaf in entries["Functional.embedding.0.backward"].outputs] == ["output.1"]


def test_an_argument_passed_twice_gets_one_gradient_per_position(tmp_path):
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        nn.Identity()(x)
        torch.mul(x, x).sum().backward()
        session.step()
    outputs = load(tmp_path)["data"]["Torch.mul.0.backward"]["output"]
    assert [leaf["Max"] for leaf in outputs] == [3.0, 3.0]  # d(x*y)/dx = y and d/dy = x, with y = x


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and nested tensors warn they are old/new
@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_sparse_quantized_and_nested_tensors_are_dumped_without_failing_the_run(tmp_path, mode):
    from .models import UnusualLayouts

    with DumpSession(tmp_path, level="mix", mode=mode, ops="all") as session:  # to_sparse, quantize: msprobe records neither
        UnusualLayouts()(torch.randn(3, 4)).backward()
        session.step()
    data = load(tmp_path)["data"]
    sparse = data["Tensor.to_sparse.0.forward"]["output"][0]
    assert sparse["Max"] == 1.0 and sparse["Min"] == 0.0 and sparse["Mean"] == 0.25  # its zeros count
    quantized = data["Torch.quantize_per_tensor.0.forward"]["output"][0]
    assert quantized["dtype"] == "torch.quint8" and quantized["Max"] > 0  # measured dequantized
    assert data["Tensor.__mul__.0.forward"]["output"][0] == {"type": "torch.Tensor", "layout": "nested",
                                                         "dtype": "torch.float32"}


def test_nan_and_inf_are_counted(tmp_path):
    x = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    with DumpSession(tmp_path, level="api", mode="stats"):
        nn.Identity()(x)
        torch.neg(x)
    leaf = load(tmp_path)["data"]["Torch.neg.0.forward"]["output"][0]
    assert leaf["nan_count"] == 1 and leaf["inf_count"] == 1
    # non-finite statistics are bare JSON numbers (NaN, Infinity), as msprobe writes them
    text = next(tmp_path.rglob("dump.json")).read_text()
    assert '"Max":NaN' in text and '"nan"' not in text


def test_module_level_has_no_api_entries_and_api_level_no_modules(tmp_path):
    train(tmp_path / "m", level="module", mode="stats", steps=1)
    train(tmp_path / "a", level="api", mode="stats", steps=1)
    modules = load(tmp_path / "m")["data"]
    apis = load(tmp_path / "a")["data"]
    assert modules and all(name.startswith("Module.") for name in modules)
    assert apis and not any(name.startswith("Module.") for name in apis)


@pytest.mark.parametrize("tensor_format", ["pt", "npy"])
def test_tensor_mode_writes_exact_data(tmp_path, tensor_format):
    """The default .pt: a file per leaf, as msprobe writes them (msprobe compare pairs rows by
    file). .npy: a file per tensor, the leaves that show it again point at it."""
    train(tmp_path, level="mix", mode="tensor", steps=1, dtype=torch.bfloat16, tensor_format=tensor_format)
    rank_dir = tmp_path / "step0/rank0"
    data = load(tmp_path)["data"]
    out = data["Functional.linear.0.forward"]["output"][0]
    assert out["dtype"] == "torch.bfloat16" and out["data_name"].endswith(f".{tensor_format}")
    stored = read_tensor(rank_dir / "dump_tensor_data" / out["data_name"], "torch.bfloat16", out["shape"])
    assert stored.dtype == np.uint16  # raw bf16 bits: exact
    module_out = data["Module.embed.Linear.forward.0"]["output"][0]
    module_stored = read_tensor(rank_dir / "dump_tensor_data" / module_out["data_name"], "torch.bfloat16",
                                module_out["shape"])
    assert np.array_equal(module_stored, stored)  # the module output is the op output
    if tensor_format == "pt":
        saved = torch.load(rank_dir / "dump_tensor_data" / out["data_name"], weights_only=True)
        assert isinstance(saved, torch.Tensor) and saved.dtype == torch.bfloat16  # as msprobe reads it
    # The consumer's input records where it came from.
    consumer = data["Module.blocks.0.fc1.Linear.forward.0"]["input_args"][0]
    assert consumer["producer"].endswith(".output.0")
    referenced = {leaf["data_name"] for leaf in _tensor_leaves(data) if "data_name" in leaf}
    files = {f.name for f in (rank_dir / "dump_tensor_data").iterdir()}
    assert files == referenced  # every referenced file exists; no orphan or half-written (.tmp) file
    leaves_with_data = sum(1 for leaf in _tensor_leaves(data) if "data_name" in leaf)
    if tensor_format == "npy":
        assert module_out["data_name"] == out["data_name"]
        assert len(files) < leaves_with_data / 2  # shared tensors are written once
    else:
        assert len(files) == leaves_with_data


def _tensor_leaves(value):
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            yield value
        else:
            for item in value.values():
                yield from _tensor_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _tensor_leaves(item)


def test_bf16_tensor_roundtrip_is_bit_exact(tmp_path):
    x = torch.randn(33, dtype=torch.float32).to(torch.bfloat16)
    with DumpSession(tmp_path, level="api", mode="tensor"):
        nn.Identity()(x)
        y = torch.neg(x)
    leaf = load(tmp_path)["data"]["Torch.neg.0.forward"]["output"][0]
    raw = read_tensor(tmp_path / "step0/rank0/dump_tensor_data" / leaf["data_name"], leaf["dtype"])
    assert torch.equal(torch.from_numpy(np.array(raw)).view(torch.bfloat16), y)


def test_md5_mode_records_checksums(tmp_path):
    train(tmp_path, level="api", mode="md5", steps=1)
    leaf = load(tmp_path)["data"]["Functional.linear.0.forward"]["output"][0]
    assert len(leaf["md5"]) == 8


def test_in_place_op_inputs_are_measured_before_the_op(tmp_path):
    x = torch.ones(4)
    with DumpSession(tmp_path, level="api", mode="stats"):
        nn.Identity()(x)
        x.mul_(3.0)
    entry = load(tmp_path)["data"]["Tensor.mul_.0.forward"]
    assert entry["input_args"][0]["Max"] == 1.0
    assert entry["output"][0]["Max"] == 3.0


@pytest.mark.parametrize(("api", "in_place"), [
    ("Tensor.mul_", True), ("Tensor.__imul__", True), ("Torch._foreach_add_", True), ("Functional.relu_", True),
    ("Tensor.__add__", False), ("Tensor.__invert__", False), ("Tensor.__getitem__", False), ("Torch._foreach_add", False),
])
def test_which_apis_write_their_first_argument(api, in_place):
    """What the dump measures before the op runs, the overflow detector copies before it runs, and the
    compare judges by the change it made: `a += b` writes a, `a + b` and `~a` do not."""
    assert naming.writes_its_input(api, (), {}) is in_place
    assert naming.writes_its_input(api, (), {"out": None})  # an out= tensor is written whatever the api


def test_optimizer_steps_split_dumps_and_step_filter(tmp_path):
    train(tmp_path, level="module", mode="stats", steps=4, dump_steps="1,3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1", "step3"]


def test_inference_loop_without_optimizer_splits_steps_at_root_forward(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad(), DumpSession(tmp_path, level="module", mode="stats"):
        for _ in range(3):
            model(torch.randn(2, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0", "step1", "step2"]
    assert "Module.0.Linear.forward.0" in load(tmp_path, 2)["data"]


@pytest.mark.parametrize("training_steps", [False, True])
def test_an_evaluation_before_training_is_a_step_unless_steps_are_training_steps(tmp_path, training_steps):
    """Under --monitor or --replay (so in --localize's re-runs) step S is the monitor's training step S:
    the forwards of an evaluation before the first optimizer step start no step there (they did, so
    the re-run dumped an evaluation forward instead of the step the monitor named)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with DumpSession(tmp_path, level="mix", mode="stats", steps="0", training_steps=training_steps):
        with torch.no_grad():
            for _ in range(3):
                model(x)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(x).sum().backward()
            optimizer.step()
    entries = load(tmp_path, 0)["data"]
    assert any(name.endswith(".backward") for name in entries) == training_steps


def test_scope_and_list_filters(tmp_path):
    train(tmp_path / "scope", level="mix", mode="stats", steps=1, scope="blocks.1")
    names = list(load(tmp_path / "scope")["data"])
    assert names and all("blocks.1" in name or not name.startswith("Module.") for name in names)
    assert "Functional.layer_norm.1.forward" in names  # inside blocks.1: kept, same index as unfiltered
    assert "Functional.layer_norm.0.forward" not in names
    train(tmp_path / "list", level="mix", mode="stats", steps=1, names="layer_norm,fc2")
    names = list(load(tmp_path / "list")["data"])
    assert names and all("layer_norm" in name or "fc2" in name for name in names)


def test_rank_comes_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    train(tmp_path, level="module", mode="stats", steps=1)
    assert (tmp_path / "step0" / "rank3" / "dump.json").is_file()
    train(tmp_path / "other", level="module", mode="stats", steps=1, ranks="0-2")
    assert not (tmp_path / "other").exists()  # rank 3 is not in 0-2: nothing dumped
    with pytest.raises(UserError, match="--dump-ranks"):
        DumpSession(tmp_path, ranks="a")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UserError, match="RANK"):
        DumpSession(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"level": "layer"}, "--dump-level"),
        ({"mode": "full"}, "--dump-mode"),
        ({"steps": "1,x"}, "--dump-steps"),
        ({"steps": "4-2"}, "--dump-steps"),
        ({"scope": "a,,b"}, "--dump-scope"),
        ({"names": ","}, None),
    ],
)
def test_invalid_options_name_the_option(tmp_path, kwargs, option):
    if option is None:  # an empty list means "no filter", not an error
        DumpSession(tmp_path, **kwargs)
        return
    with pytest.raises(UserError, match=option):
        DumpSession(tmp_path, **kwargs)


def test_parse_steps():
    assert parse_steps("0,2-4") == {0, 2, 3, 4}
    assert parse_steps(None) is None


def test_optimizer_update_ops_are_dumped_as_msprobe_dumps_them(tmp_path):
    """msprobe records the apis optimizer.step runs, each with construct.json parent "optimizer":
    an SGD step is a Tensor.add_ per parameter, weight and gradient in (before the update), the
    updated weight out. No module entry and no backward comes from the update."""
    train(tmp_path, level="mix", mode="stats", steps=1)
    data = load(tmp_path)["data"]
    construct = json.loads((tmp_path / "step0/rank0/construct.json").read_text())
    updates = [name for name, parent in construct.items() if parent == "optimizer"]
    assert construct["optimizer"] is None
    assert updates == [name for name in data if name.startswith("Tensor.add_.")]
    assert list(data)[-len(updates):] == updates  # after the parameter gradients the update reads
    grads = [grad for name, entry in data.items() if ".parameters_grad." in name for grad in entry.values()]
    assert len(updates) == len(grads) > 3  # one per parameter
    update = data[updates[0]]
    weight, grad = update["input_args"]
    assert update["input_kwargs"] == {"alpha": {"type": "float", "value": -0.05}}
    assert weight["shape"] == grad["shape"] == update["output"][0]["shape"]
    assert weight["Norm"] != update["output"][0]["Norm"]


def test_functional_calls_inside_user_code_are_dumped_without_patching_torch(tmp_path):
    before = F.gelu
    with DumpSession(tmp_path, level="api", mode="stats"):
        nn.Identity()(torch.ones(1))
        F.gelu(torch.ones(3))
    assert F.gelu is before
    assert "Functional.gelu.0.forward" in load(tmp_path)["data"]


def test_dump_on_the_emulated_npu(tmp_path, npu):
    train(tmp_path, level="mix", mode="tensor", steps=1, device=npu)
    data = load(tmp_path)["data"]
    leaf = data["Functional.linear.0.forward"]["output"][0]
    assert leaf["Norm"] > 0 and (tmp_path / "step0/rank0/dump_tensor_data" / leaf["data_name"]).is_file()


def test_a_forward_that_raises_leaves_module_tracking_intact(tmp_path):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 1:
                raise ValueError("first call fails")
            return self.inner(x)

    model = nn.Sequential(Flaky())  # a module below the model: the model itself is no entry
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="stats") as session:
        with pytest.raises(ValueError):
            model(torch.ones(1, 2))
        model(torch.ones(1, 2))
        session.step()
    # No optimizer: each root forward starts a step, the failed one included.
    construct = json.loads((tmp_path / "step1/rank0/construct.json").read_text())
    assert construct["Functional.linear.0.forward"] == "Module.0.inner.Linear.forward.0"
    assert construct["Module.0.inner.Linear.forward.0"] == "Module.0.Flaky.forward.0"
    assert construct["Module.0.Flaky.forward.0"] is None


def test_keyword_arguments_are_recorded_as_the_caller_can_have_written_them(tmp_path):
    """F.softmax(x, dim=-1) reaches __torch_function__ with torch's own `_stacklevel` and its unset
    `dtype=None`; msprobe records `{"dim": -1}` alone, and so does the dump."""
    with DumpSession(tmp_path, level="api", mode="stats"):
        nn.Identity()(torch.zeros(1))  # the first module forward starts api recording
        F.softmax(torch.randn(3), dim=-1)
        F.softmax(torch.randn(3), dim=-1, dtype=torch.float64)
    data = load(tmp_path)["data"]
    assert data["Functional.softmax.0.forward"]["input_kwargs"] == {"dim": {"type": "int", "value": -1}}
    assert set(data["Functional.softmax.1.forward"]["input_kwargs"]) == {"dim", "dtype"}


def test_statistics_of_integer_bool_and_0d_tensors_are_written_as_msprobe_writes_them(tmp_path):
    """msprobe 26.2 (checked against its own dump): integer and bool tensors get Max/Min only (ints;
    any/all as true/false), Mean and Norm null; a 0-d tensor gives its value as all four."""
    with DumpSession(tmp_path, level="api", mode="stats") as session:
        nn.Identity()(torch.ones(1))
        torch.add(torch.tensor([3, -1, 2]), 1)
        torch.logical_not(torch.tensor([True, False]))
        torch.add(torch.tensor(-5), 1)
        torch.add(torch.tensor(-1.5), 1)
        torch.logical_not(torch.tensor(True))
        session.step()
    data = load(tmp_path)["data"]

    def stats(name):
        leaf = data[name]["input_args"][0]
        return [leaf[key] for key in ("Max", "Min", "Mean", "Norm")]

    for name, expected in [("Torch.add.0.forward", [3, -1, None, None]),
                           ("Torch.logical_not.0.forward", [True, False, None, None]),
                           ("Torch.add.1.forward", [-5, -5, -5, -5]),
                           ("Torch.add.2.forward", [-1.5, -1.5, -1.5, -1.5]),
                           ("Torch.logical_not.1.forward", [True, True, None, None])]:
        got = stats(name)
        assert got == expected and [type(v) for v in got] == [type(v) for v in expected], (name, got)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, a, b):
        return a * self.w + b


def test_module_backward_output_lists_only_the_arguments_that_need_a_gradient(tmp_path):
    """msprobe 26.2 writes "output": [] for a module none of whose inputs needs a gradient, and the
    gradients of those that do, in order (no null), as it did for this model."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.third = _TwoInputs(), _TwoInputs(), _TwoInputs()

        def forward(self, x, y):
            h = self.first(x, y)  # neither input needs a gradient
            h = self.second(y, h)  # the second does
            return self.third(h, x)  # the first does

    model = Model()
    with DumpSession(tmp_path, level="module", mode="stats") as session:
        model(torch.randn(3), torch.randn(3)).sum().backward()
        session.step()
    data = load(tmp_path)["data"]
    assert data["Module.first._TwoInputs.backward.0"]["output"] == []
    for name in ("Module.second._TwoInputs.backward.0", "Module.third._TwoInputs.backward.0"):
        [grad] = data[name]["output"]
        assert grad["shape"] == [3] and grad["Max"] == grad["Min"] == 1.0, name


def test_a_dtensor_is_dumped_as_this_ranks_shard(tmp_path, npu):
    """DTensor ops return DTensors (FSDP2's parameters cast under its mixed-precision policy,
    `Tensor.to`), tensor parallelism's functional collectives AsyncCollectiveTensors: wrappers with
    no data of their own. Their statistics failed ("stats: shape and strides differ in length, or
    no data": the hook switched off, nothing more dumped, on pytorch/examples' FSDP2 and tensor
    parallel examples); a DTensor is dumped as its local shard, as FSDP2's gradients are, and a
    collective's result once it has arrived."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("hccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.arange(12.0, device=npu).view(4, 3), init_device_mesh("npu", (1,)), [Shard(0)])
        with DumpSession(tmp_path, level="api", mode="tensor", ops="all"):  # Tensor.to: left out by default
            nn.Identity()(weight)
            weight.to(torch.bfloat16)
            # tensor parallelism's outputs: a functional collective's result, still in flight
            in_flight = funcol.all_reduce(torch.full((2,), 3.0, device=npu), "sum", dist.group.WORLD)
            assert isinstance(in_flight, funcol.AsyncCollectiveTensor)
            in_flight.sum()
    finally:
        dist.destroy_process_group()
    summed = load(tmp_path)["data"]["Tensor.sum.0.forward"]["input_args"][0]
    assert summed["shape"] == [2] and (summed["Max"], summed["Min"]) == (3.0, 3.0)
    leaf = load(tmp_path)["data"]["Tensor.to.0.forward"]["output"][0]
    assert leaf["shape"] == [4, 3] and leaf["dtype"] == "torch.bfloat16" and (leaf["Max"], leaf["Min"]) == (11.0, 0.0)
    raw = read_tensor(tmp_path / "step0/rank0/dump_tensor_data" / leaf["data_name"], leaf["dtype"])
    assert torch.equal(torch.from_numpy(np.array(raw)).view(torch.bfloat16).float(), torch.arange(12.0).view(4, 3))
