"""torch.compile on npu tensors: backend "npu" and the default backend give the eager results."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.npu_backend import compile as npu_compile
from npukit.npu_backend import numerics

from .conftest import run_python


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def loss_and_grads(model, tokens, targets):
    model.zero_grad()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["npu", None], ids=["backend=npu", "default backend"])
def test_compiled_transformer_forward_and_gradients_equal_eager(backend):
    torch.manual_seed(0)
    model = TinyGPT().npu()
    tokens = torch.randint(0, 50, (2, 12), device="npu")
    targets = torch.randint(0, 50, (2, 12), device="npu")
    eager_logits, eager_grads = loss_and_grads(model, tokens, targets)
    compiled = torch.compile(model) if backend is None else torch.compile(model, backend=backend)
    logits, grads = loss_and_grads(compiled, tokens, targets)
    assert logits.device.type == "npu" and all(g.device.type == "npu" for g in grads)
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=0)
    for grad, eager_grad in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["npu", "inductor"])
def test_compiled_autocast_region_equals_eager(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1)).npu()
    x = torch.randn(4, 8, device="npu")

    def run(module):
        model.zero_grad()
        with torch.autocast("npu", dtype=torch.float16):
            out = module(x)
        out.float().sum().backward()
        return out, [p.grad.clone() for p in model.parameters()]

    eager_out, eager_grads = run(model)
    out, grads = run(torch.compile(model, backend=backend))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    for grad, eager_grad in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


def test_compiled_graphs_run_under_the_device_numerics():
    numerics.configure(fp16_mode="saturation")

    def scale(x):
        return (x.half() * 1000.0).float() + 1.0

    x = torch.tensor([1.0, 100.0], device="npu")
    numerics.clear_overflow_flag()
    result = torch.compile(scale, backend="npu")(x)
    assert result.tolist() == [1001.0, 65505.0]  # clamped to the fp16 maximum, as on the device
    assert numerics.overflow_flag()


def test_only_graphs_on_npu_are_taken_from_inductor():
    def fn(x):
        return torch.sin(x) + 1

    cpu_graph = torch.fx.symbolic_trace(fn)
    assert not npu_compile.graph_uses_npu(cpu_graph, [torch.ones(2)])
    assert npu_compile.graph_uses_npu(cpu_graph, [torch.ones(2, device="npu")])


def test_inductor_from_the_dynamo_registry_also_routes_npu_graphs():
    import torch._dynamo

    torch.compile(nn.Identity())  # registration happens on first use of torch.compile
    inductor = torch._dynamo.lookup_backend("inductor")
    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend=inductor)
    assert compiled(torch.tensor([-1.0, 2.0], device="npu")).tolist() == [0.0, 6.0]


def test_backend_names():
    import torch._dynamo

    torch.compile(nn.Identity())  # registration happens on first use of torch.compile
    backends = torch._dynamo.list_backends()
    assert "npu" in backends
    assert "npugraphs" not in backends and "npugraph_ex" not in backends  # no graph capture on the emulator


def test_importing_the_backend_does_not_import_dynamo_and_compile_registers_npu():
    result = run_python("""
        import sys, torch
        import npukit.npu_backend
        assert "torch._dynamo" not in sys.modules, "import npukit.npu_backend must stay cheap"
        f = torch.compile(lambda x: x * 2 + 1, backend="npu")
        print(f(torch.ones(2, device="npu")).tolist())
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[3.0, 3.0]"


def test_backend_is_registered_at_install_when_dynamo_was_imported_first():
    result = run_python("""
        import torch._dynamo
        import npukit.npu_backend
        print("npu" in torch._dynamo.list_backends())
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
