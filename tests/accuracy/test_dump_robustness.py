"""Runs the watching tools used to break (#31): inference mode, complex buffers, torch.compile
(fullgraph=True) regions, and a hook's internal error. The dump and the overflow detector record
the run completely, or say in what they write what they could not record; the run never fails."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from npukit.accuracy import dump as dump_module
from npukit.accuracy.compare import compare_dirs
from npukit.accuracy.dump import DumpSession
from npukit.accuracy.overflow import OverflowSession
from npukit.watch import hook_guard
from tests.accuracy.test_journey import npukit

WIDTH, HEADS, LAYERS, VOCAB, SEQ = 16, 2, 3, 32, 6


def rotary_table(head_dim: int, length: int) -> torch.Tensor:
    """Meta Llama's freqs_cis: complex64, made with torch.polar."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(length, head_dim // 2), torch.outer(torch.arange(length).float(), freqs))


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.qk = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q, k = self.qk(self.norm(x)).view(b, s, 2, HEADS, -1).unbind(2)
        q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, s, HEADS, -1, 2)) * freqs_cis).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, s, HEADS, -1, 2)) * freqs_cis).flatten(3)
        attention = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), -1)
        return x + self.out((attention @ x.view(b, s, HEADS, -1).transpose(1, 2)).transpose(1, 2).reshape(b, s, -1))


class RotaryLM(nn.Module):
    """Llama's reference layout: the complex rotary table is a buffer moved with the model, so on
    the device it is a normal tensor while the generation runs under torch.inference_mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(RotaryBlock() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("freqs_cis", rotary_table(WIDTH // HEADS, 32), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        freqs_cis = self.freqs_cis.to(x.device)[: tokens.shape[1]].view(1, tokens.shape[1], 1, -1)
        for layer in self.layers:
            x = layer(x, freqs_cis)
        return self.head(x)


def load(root: Path, step: int = 0) -> dict:
    return json.loads((root / f"step{step}" / "rank0" / "dump.json").read_text())


INFERENCE = """
import torch
from tests.accuracy.test_dump_robustness import RotaryLM, VOCAB, SEQ

torch.manual_seed(0)
model = RotaryLM().to("npu")
with torch.inference_mode():
    logits = model(torch.randint(0, VOCAB, (2, SEQ), device="npu"))
print("TABLE_NORM", float(model.freqs_cis[:SEQ].abs().norm()), "LOGITS_MAX", float(logits.max()))
"""


def test_an_inference_mode_run_with_a_complex_rotary_buffer_is_dumped_completely(tmp_path, npu):
    # In its own process: the emulated device's per-thread CPU aliases made under inference mode
    # are reused outside it (an optimizer step later raises "Inplace update to inference tensor")
    (tmp_path / "generate.py").write_text(INFERENCE)
    run = npukit("run_main", "--dump", "dump", "generate.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "internal error" not in run.stderr
    values = run.stdout.split()
    table_norm, logits_max = float(values[values.index("TABLE_NORM") + 1]), float(values[values.index("LOGITS_MAX") + 1])
    dump = load(tmp_path / "dump")
    assert "npukit_incomplete" not in dump
    names = list(dump["data"])
    for layer in range(LAYERS):  # every layer, not only the first
        assert f"Module.layers.{layer}.RotaryBlock.forward.0" in names
    assert "Module.head.Linear.forward.0" in names
    # the complex table is measured as its real view: its norm is the complex tensor's norm
    table = dump["data"]["Module.layers.0.RotaryBlock.forward.0"]["input_args"][1]
    assert table["dtype"] == "torch.complex64"
    assert math.isclose(table["Norm"], table_norm, rel_tol=1e-5)
    assert math.isclose(dump["data"]["Module.head.Linear.forward.0"]["output"][0]["Max"], logits_max, rel_tol=1e-6)


class KvCache(nn.Module):
    def forward(self, cache, x):
        cache.add_(x)  # written in place under inference mode: the cache has no version counter
        return cache * 2.0


# On the CPU: see the first test (the stale values are no matter of the device)
def test_an_inference_tensor_written_in_place_is_recorded_with_its_new_values(tmp_path):
    with DumpSession(tmp_path, level="mix", mode="stats"), torch.inference_mode():
        cache = torch.zeros(4)
        KvCache()(cache, torch.ones(4))
    data = load(tmp_path)["data"]
    assert data["Tensor.add_.0.forward"]["input_args"][0]["Max"] == 0.0  # before the write
    assert data["Tensor.add_.0.forward"]["output"][0]["Max"] == 1.0  # after it
    assert data["Tensor.__mul__.0.forward"]["input_args"][0]["Max"] == 1.0
    assert data["Tensor.__mul__.0.forward"]["output"][0]["Max"] == 2.0


def test_overflow_detection_names_an_in_place_overflow_under_inference_mode(tmp_path):
    class Scale(nn.Module):
        def forward(self, cache, x):
            cache.mul_(x)  # 300 * 300 overflows fp16
            return cache + 1

    with OverflowSession(tmp_path, console=False) as session, torch.inference_mode():
        cache = torch.full((4,), 300.0, dtype=torch.float16)
        Scale()(cache, torch.full((4,), 300.0, dtype=torch.float16))
    assert session.first_event["name"] == "Tensor.mul_.0.forward"


def test_overflow_detection_watches_complex_values_and_survives_the_rotary_model(tmp_path, capsys):
    torch.manual_seed(0)
    model = RotaryLM()
    with OverflowSession(tmp_path, console=False) as session, torch.inference_mode():
        model(torch.randint(0, VOCAB, (2, SEQ)))
        nn.Identity()(torch.exp(model.freqs_cis * 100.0))  # |exp(100 cos t)| up to e^100: inf in complex64
    assert "internal error" not in capsys.readouterr().err
    assert [event["name"] for event in session.events] == ["Torch.exp.0.forward"]
    assert session.not_watched == []


def test_an_internal_error_of_a_hook_is_written_into_the_dump_and_fails_the_compare(tmp_path, npu, monkeypatch, capsys):
    def run(out):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(npu)
        with DumpSession(out, level="mix", mode="stats") as session:
            for _ in range(2):
                model(torch.randn(3, 4, device=npu)).sum().backward()
                session.step()

    run(tmp_path / "golden")
    original = dump_module.DumpSession._describe_output

    def broken(self, output, name):
        if name == "Functional.gelu.0.forward":
            raise ValueError("a bug of npukit's")
        return original(self, output, name)

    monkeypatch.setattr(dump_module.DumpSession, "_describe_output", broken)
    run(tmp_path / "npu")
    assert "internal error in DumpSession._record_api (at Functional.gelu)" in capsys.readouterr().err
    for step in (0, 1):  # the step it happened in and every later one lack the apis
        [gap] = load(tmp_path / "npu", step)["npukit_incomplete"]
        assert gap["kind"] == "internal_error" and gap["where"] == "Functional.gelu"
        assert "ValueError: a bug of npukit's" in gap["detail"]
    assert "npukit_incomplete" not in load(tmp_path / "golden")
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu")
    assert result.failed()


def test_a_new_session_has_its_hooks_on_again_after_an_internal_error(tmp_path, npu, monkeypatch):
    monkeypatch.setattr(hook_guard, "broken_hooks", {"DumpSession._record_api"})  # an earlier session's error
    with DumpSession(tmp_path, level="api", mode="stats"):
        nn.Identity()(torch.ones(2, device=npu))
        torch.relu(torch.ones(2, device=npu))
    assert "Torch.relu.0.forward" in load(tmp_path)["data"]


COMPILED = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.compile(fullgraph=True)
def sgd_update(params, grads, lr):
    for param, grad in zip(params, grads):
        param.add_(grad, alpha=-lr)


class FusedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            sgd_update(params, [p.grad for p in params], group["lr"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    @torch.compile(fullgraph=True)
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


torch.manual_seed(0)
model = Net().to("npu")
optimizer = FusedSGD(model.parameters(), lr=0.1)
x, y = torch.randn(6, 8, device="npu"), torch.randint(0, 4, (6,), device="npu")
for step in range(2):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("GRAPHS", torch._dynamo.utils.counters["stats"]["unique_graphs"])
'''


def test_fullgraph_regions_run_compiled_under_the_dump_and_the_overflow_detector_and_are_named(tmp_path, npu):
    (tmp_path / "train.py").write_text(COMPILED)
    run = npukit("run_main", "--dump", "dump", "--dump-mode", "tensor", "--detect-overflow", "--overflow-dir",
                 "overflow", "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "GRAPHS 2" in run.stdout  # the model's forward and the optimizer's update, compiled
    assert "Net.forward is compiled with fullgraph=True" in run.stderr
    for step in (0, 1):
        dump = load(tmp_path / "dump", step)
        # the model's forward is missing from the dump; the optimizer's compiled update is not
        # (an optimizer step's ops are never dumped)
        [gap] = dump["npukit_incomplete"]
        assert (gap["kind"], gap["where"]) == ("compiled_region", "Net.forward")
        names = list(dump["data"])
        assert "Module.Net.forward.0" in names and "Functional.cross_entropy.0.forward" in names
        assert not any("GraphModule" in name for name in names)  # the compiled backward is no layer
    report = json.loads((tmp_path / "overflow" / "overflow.json").read_text())
    assert [(item["kind"], item["where"]) for item in report["not_watched"]] == [("compiled_region", "Net.forward")]
    assert "not watched: Net.forward" in run.stdout + run.stderr

    # msprobe compare reads a dump that names what it lacks
    msprobe = Path(sys.executable).with_name("msprobe")
    step0 = str(tmp_path / "dump" / "step0")
    compared = subprocess.run([str(msprobe), "compare", "-gp", step0, "-tp", step0, "-o", str(tmp_path / "msprobe")],
                              capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
    [table] = (tmp_path / "msprobe").glob("compare_result_*.csv")
    assert "Functional.cross_entropy.0.forward" in table.read_text()


def test_a_model_compiled_whole_with_fullgraph_keeps_its_parameter_gradients_in_the_dump(tmp_path, npu):
    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(npu)
        compiled = torch.compile(model, fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = compiled(torch.randn(3, 4, device=npu)).square().mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    expected = train()
    with DumpSession(tmp_path, level="mix", mode="stats"):
        assert train() == expected
    dump = load(tmp_path)
    assert [(gap["kind"], gap["where"]) for gap in dump["npukit_incomplete"]] == [("compiled_region",
                                                                                  "Sequential.forward")]
    assert {"Module.0.Linear.parameters_grad.0", "Module.2.Linear.parameters_grad.0"} <= set(dump["data"])
