"""The precision fix `unfuse`: a fused op's call computed by its decomposition in fp32. The decomposition
equals the golden kernel; npu-run --precision-fix applies it at the one call site it names; the fix
finder proposes it for an imprecise npu_fusion_attention call, and the code it prints, written into
the user's file, passes the compare."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch

from npukit.accuracy import unfuse
from npukit.accuracy.compare import Thresholds
from npukit.accuracy.dumpfile import TensorLeaf
from npukit.accuracy.fixes import FixChange, PrecisionFix, PrecisionFixSession
from npukit.errors import UserError
from tests.accuracy.test_fix_finder import HEADER, _find_fix, _line_of, _npukit, _printed_code

ATTENTION = "NPU.npu_fusion_attention"


def _fused():
    import npukit.npu_backend.fused as fused

    fused.load()
    return torch.ops.npu.npu_fusion_attention


def _inputs(layout: str, dtype, b=2, n=4, nkv=2, sq=5, skv=7, d=8):
    def tensor(heads, s):
        x = torch.randn(b, heads, s, d)
        return {"BNSD": x, "BSND": x.transpose(1, 2), "BSH": x.transpose(1, 2).flatten(2),
                "SBH": x.permute(2, 0, 1, 3).flatten(2)}[layout].contiguous().to(dtype).requires_grad_()
    return tensor(n, sq), tensor(nkv, skv), tensor(nkv, skv)


MASKS = {  # sparse_mode, mask, options
    "none": (0, None, {}),
    "band": (0, "random", {"pre_tockens": 3, "next_tockens": 1}),
    "all": (1, "random", {}),
    "causal": (2, "compressed", {}),
    "right-down": (3, "compressed", {}),
    "bottom-right band": (4, "compressed", {"pre_tockens": 2, "next_tockens": 0}),
}


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_the_decomposition_equals_the_golden_kernel_forward_and_backward(layout, mask):
    """GQA (4 query heads over 2 key/value heads), pse, every sparse mode it covers; fp32 and fp16
    (the golden kernel: the emulator's op on CPU tensors, its reference numerics)."""
    op = _fused()
    torch.manual_seed(0)
    sparse_mode, kind, options = MASKS[mask]
    atten_mask = {"random": torch.rand(2, 1, 5, 7) > 0.7, "compressed": torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                  None: None}[kind]
    if kind == "random":
        atten_mask[0, 0, 1] = True  # a row with every key masked: zeros
    pse = torch.randn(2, 4, 5, 7) if mask == "all" else None
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        inputs = _inputs(layout, dtype)
        results = []
        for function in (op, unfuse.npu_fusion_attention_unfused):
            out = function(*inputs, 4, layout, pse=pse, atten_mask=atten_mask, scale=0.3, sparse_mode=sparse_mode,
                           **options)
            grads = torch.autograd.grad(out[0], inputs, torch.ones_like(out[0]))
            results.append((out, grads))
        (fused, fused_grads), (unfused, unfused_grads) = results
        assert [t.shape for t in fused[:4]] == [t.shape for t in unfused[:4]] and fused[4:] == unfused[4:]
        assert fused[0].dtype == unfused[0].dtype == dtype
        for name, a, b in [("out", fused[0], unfused[0]), ("max", fused[1], unfused[1]), ("sum", fused[2], unfused[2]),
                           *[(f"grad {i}", a, b) for i, (a, b) in enumerate(zip(fused_grads, unfused_grads))]]:
            error = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1.0)
            assert error <= tolerance, (name, dtype, error)


def test_the_printed_source_runs_with_torch_alone_and_refuses_what_it_does_not_compute():
    namespace = {"__builtins__": __builtins__}
    exec(unfuse.source(ATTENTION), namespace)
    printed = [*unfuse.HELPERS[ATTENTION], unfuse.npu_fusion_attention_unfused]
    assert sorted(name for name in namespace if not name.startswith("__")) == \
        sorted(["torch", *(function.__name__ for function in printed)])
    function = namespace["npu_fusion_attention_unfused"]
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    assert torch.equal(function(q, k, v, 2, "BNSD", scale=0.5)[0], unfuse.npu_fusion_attention_unfused(
        q, k, v, 2, "BNSD", scale=0.5)[0])
    with pytest.raises(ValueError, match=r"keep_prob 0.9 \(dropout\), sparse_mode 6"):
        function(q, k, v, 2, "BNSD", keep_prob=0.9, sparse_mode=6)
    # no blank line inside a function: the source pastes into an interactive interpreter too
    assert unfuse.source(ATTENTION).count("\n\n\n") == len(printed) and \
        not any("\n\n" in inspect.getsource(function).strip() for function in printed)


def test_the_call_at_the_users_line_is_replaced_by_the_decomposition():
    replaced = unfuse.call_replaced
    assert replaced('out = torch_npu.npu_fusion_attention(q, k, v, 2, "BSH")[0]', ATTENTION) == \
        'out = npu_fusion_attention_unfused(q, k, v, 2, "BSH")[0]'
    assert replaced("out = torch.ops.npu.npu_fusion_attention.default(q, k, v, 2, 'BSH')", ATTENTION) == \
        "out = npu_fusion_attention_unfused(q, k, v, 2, 'BSH')"
    assert replaced("out = npu_fusion_attention_v2(q, k, v, 2, 'BSH')", ATTENTION) is None  # another op


def test_a_recorded_call_is_accepted_when_the_decomposition_computes_its_options():
    name = "NPU.npu_fusion_attention.0.forward"

    def accepted(**kwargs) -> bool:
        tensor = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": [2, 8, 16]}
        body = {"input_args": [tensor, tensor, tensor, {"type": "int", "value": 2}, {"type": "str", "value": "BSH"}],
                "input_kwargs": {key: {"type": type(value).__name__, "value": value} for key, value in kwargs.items()}}
        leaves = [TensorLeaf(f"{name}.input.{i}", "torch.float16", (2, 8, 16), None, None, None, True, None, None, None,
                             f"input.{i}") for i in range(3)]
        return unfuse.accepts(name, body, leaves)

    assert accepted(scale=0.25)
    assert not accepted(keep_prob=0.9)  # dropout: its mask cannot be the kernel's
    assert not accepted(sparse_mode=7)
    assert not accepted(head_num_is_not_an_argument=1)
    assert not unfuse.accepts("NPU.npu_rms_norm.0.forward", {"input_args": []}, [])  # no decomposition


class TwoAttentions(torch.nn.Module):
    def forward(self, q, k, v):
        first = torch.ops.npu.npu_fusion_attention(q, k, v, 2, "BNSD")[0]
        second = torch.ops.npu.npu_fusion_attention(q, k, v, 2, "BNSD")[0]
        return first, second


def test_precision_fix_unfuses_the_call_at_the_line_it_names_and_no_other(npu):
    _fused()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, device=npu).half() for _ in range(3))
    model = TwoAttentions()
    fused = model(q, k, v)
    line = f"test_unfuse_fix.py:{TwoAttentions.forward.__code__.co_firstlineno + 2}"  # the second call
    with PrecisionFixSession(PrecisionFix([FixChange("unfuse", ATTENTION, "", line)])):
        fixed = model(q, k, v)
    assert torch.equal(fixed[0], fused[0])
    assert torch.equal(fixed[1], unfuse.npu_fusion_attention_unfused(q, k, v, 2, "BNSD")[0])
    # an option the decomposition does not compute: the run stops saying which, where
    with PrecisionFixSession(PrecisionFix([FixChange("unfuse", ATTENTION)])), \
            pytest.raises(UserError, match=r"unfuse NPU.npu_fusion_attention in the model .*: .*keep_prob 0.5"):
        torch.ops.npu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)


# A self-attention over 8 tokens (fine on the NPU), then each token reads a memory of 2**17 slots in
# fp16: the first slot (a sink whose value is zero) takes almost all the weight, and what the read
# brings is the small share of the 131071 others, ~2e-8 each. The fused kernel keeps its probabilities
# in fp16 for the P @ V matmul, and each is below fp16's smallest subnormal (2**-25): all are lost.
LONG_ROWS = HEADER + '''
SLOTS = 1 << 17


class SelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        h = torch_npu.npu_fusion_attention(q, k, v, self.heads, "BSH", scale=(x.shape[-1] // self.heads) ** -0.5)[0]
        return x + self.out(h)


class Memory(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        keys, values = torch.zeros(1, SLOTS, dim), torch.zeros(1, SLOTS, dim)
        keys[0, 0, 0] = 1.0  # the sink: a score of ~17.6 above every other slot's 0
        values[0, 1:] = torch.linspace(-1, 1, dim)
        self.register_buffer("keys", keys)
        self.register_buffer("values", values)
        with torch.no_grad():
            self.query.weight.mul_(0.05)
            self.query.bias.zero_()
            self.query.bias[0] = 17.6

    def forward(self, x):
        q, b = self.query(x), x.shape[0]
        read = torch_npu.npu_fusion_attention(q, self.keys.expand(b, -1, -1), self.values.expand(b, -1, -1), 1, "BSH")[0]
        return x + 30 * read


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.memory, self.head = SelfAttention(), Memory(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.memory(self.attn(x)))


torch.manual_seed(0)
model = Model().to("npu").half()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(2, 8, 16, device="npu").half(), torch.randint(0, 4, (2,), device="npu")
loss = F.cross_entropy(model(x).float().mean(1), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()
'''


def _patched(script: str, code: str) -> str:
    """The script as the printed code says to change it: the line shown written at the call's line (its
    indentation kept), the function defined after the imports."""
    line = int(re.search(r"at train\.py:(\d+) call", code)[1])
    replacement = re.search(r"^#   (.*)$", code, re.M)[1]
    definitions = "\n".join(text for text in code.splitlines() if not text.startswith("#"))
    lines = script.splitlines()
    indent = re.match(r"\s*", lines[line - 1])[0]
    lines[line - 1] = indent + replacement
    imports = max(index for index, text in enumerate(lines) if text.startswith("import "))
    return "\n".join([*lines[:imports + 1], "", definitions, "", *lines[imports + 1:]]) + "\n"


@pytest.mark.slow  # (a whole-run e2e: kept out of the 20-minute main suite, run in CI's slow stage)
def test_an_imprecise_fused_attention_call_is_unfused_and_the_printed_code_passes_the_compare(tmp_path):
    result, found = _find_fix(tmp_path, LONG_ROWS)
    assert "First divergence: NPU.npu_fusion_attention.1.forward  (module memory)" in found.stdout, found.stdout
    memory_line, attn_line = _line_of(LONG_ROWS, "read = torch_npu."), _line_of(LONG_ROWS, "h = torch_npu.")
    assert [(c["kind"], c["api"], c["module"], c["line"]) for c in result["fix"]] == \
        [("unfuse", ATTENTION, "memory", memory_line)], found.stdout
    # the self-attention's call was a candidate too, and is not unfused: it is fine
    assert ("unfuse", "attn", attn_line) in {(c["kind"], c["module"], c["line"]) for c in result["candidates"]}
    before, after = result["before"], result["after"]
    assert not before["fixed"] and before["divergence_error"] > 0.5
    assert after["fixed"] and after["divergence_error"] < Thresholds().fp16.pass_rel_l2
    assert after["loss_error"] < Thresholds().fp16.pass_rel_l2 < before["loss_error"]
    # applied by npu-run --precision-fix (the finder's last run, this file): the compare passes
    last = max(tmp_path.glob("npu.find-fix/trial*"), key=lambda path: int(path.name[5:]))
    assert json.loads((last / "fix.json").read_text())["changes"] == \
        [{"kind": "unfuse", "api": ATTENTION, "module": "memory", "line": memory_line,
          "source": "read = torch_npu.npu_fusion_attention(q, self.keys.expand(b, -1, -1), "
                    "self.values.expand(b, -1, -1), 1, \"BSH\")[0]"}]
    assert result["trials"][-1] == after and after["note"] == "no divergence, 0 error rows"
    # the printed code, written into the user's file: the call replaced, the same step, the compare passes
    code = _printed_code(found.stdout)
    assert code == result["code"]
    assert "read = npu_fusion_attention_unfused(q, self.keys.expand(b, -1, -1)" in code
    (tmp_path / "train.py").write_text(_patched(LONG_ROWS, code))
    run = _npukit("run_main", "--seed", "0", "--replay", "replay", "--dump", "patched", "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    patched = _npukit("compare_main", "golden", "patched", cwd=tmp_path)
    assert patched.returncode == 0 and "No divergence found" in patched.stdout, patched.stdout


def test_a_fix_file_unfusing_an_op_without_a_decomposition_is_refused_naming_the_change(tmp_path):
    fix_file = tmp_path / "fix.json"
    fix_file.write_text(json.dumps({"changes": [{"kind": "unfuse", "api": ATTENTION, "module": "attn"},
                                                {"kind": "unfuse", "api": "NPU.npu_rms_norm", "module": "norm"}]}))
    with pytest.raises(UserError, match=r"fix.json: change 1: unfuse NPU.npu_rms_norm: no decomposition of that op "
                                        r"\(unfuse takes NPU.npu_fusion_attention, NPU.npu_fusion_attention_v2, "
                                        r"NPU.npu_prompt_flash_attention, .*\)"):
        PrecisionFix.load(fix_file)


def test_blocks_sharing_a_line_get_one_edit_and_the_function_once():
    line, source = "model.py:30", 'o = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]'
    code = unfuse.code([FixChange("unfuse", ATTENTION, f"h.{index}.attn", line, source) for index in (6, 7)])
    assert code.count("#   o = npu_fusion_attention_unfused(q, k, v, 4, \"BNSD\")[0]") == 1
    assert "in h.6.attn (its decomposition in fp32); unfuse NPU.npu_fusion_attention in h.7.attn" in code
    assert code.count("def npu_fusion_attention_unfused(") == 1
