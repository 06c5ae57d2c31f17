"""torch_npu's fused ops in dumps, compares and overflow checks: named as msprobe names them
(`NPU.npu_rms_norm.0.forward`), golden (fp32 reference decomposition) vs NPU with no false
divergence, and a wrong fused call named where it is."""

import csv
import json
import subprocess
import sys
from pathlib import Path

from npukit.accuracy.compare import compare_dirs
from tests.accuracy.test_journey import npukit

SCRIPT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu

HEADS, WIDTH, SEQ = 2, 16, 8


class Block(nn.Module):
    """A Llama-style block written with torch_npu's fused ops, as Ascend training code writes it."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.Parameter(torch.ones(WIDTH))
        self.norm2 = nn.Parameter(torch.ones(WIDTH))
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        h = torch_npu.npu_rms_norm(x, self.norm1, epsilon=EPS)[0]
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        q, k = torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
        attn = torch_npu.npu_fusion_attention(q, k, v, HEADS, "BNSD", atten_mask=mask,
                                              scale=q.shape[-1] ** -0.5)[0]
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, WIDTH))
        h = torch_npu.npu_rms_norm(x, self.norm2, epsilon=EPS)[0]
        return x + self.down(torch_npu.npu_swiglu(self.up(h), dim=-1))


blocks = nn.ModuleList([Block(), Block()]).to("npu")
head = nn.Linear(WIDTH, 4).to("npu")
optimizer = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=0.1)
angles = torch.arange(SEQ, device="npu")[:, None] * torch.arange(1, WIDTH // HEADS // 2 + 1, device="npu")
cos = torch.cat([angles.cos()] * 2, -1)[None, None]
sin = torch.cat([angles.sin()] * 2, -1)[None, None]
mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device="npu").triu(1)  # True = masked
for step in range(1):
    x = torch.randn(4, SEQ, WIDTH, device="npu")
    y = torch.randint(0, 4, (4,), device="npu")
    with torch.autocast("npu", dtype=torch.float16):
        for block in blocks:
            x = block(x, cos, sin, mask)
        loss = F.cross_entropy(head(x.mean(1)), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def write_script(path, eps="1e-6"):
    path.write_text(SCRIPT.replace("EPS", eps))


def test_fused_ops_dump_as_msprobe_names_them_and_compare_quietly(tmp_path, npu):
    write_script(tmp_path / "train.py")
    write_script(tmp_path / "train_bug.py", eps="10.0")
    common = ["--seed", "0", "--replay", "replay", "--dump-mode", "tensor"]
    golden = npukit("run_main", "--golden", *common, "--dump", "golden", "train.py", cwd=tmp_path)
    assert golden.returncode == 0, golden.stderr
    target = npukit("run_main", *common, "--dump", "npu", "train.py", cwd=tmp_path)
    assert target.returncode == 0, target.stderr
    buggy = npukit("run_main", *common, "--dump", "bug", "train_bug.py", cwd=tmp_path)
    assert buggy.returncode == 0, buggy.stderr

    dump_json = next((tmp_path / "npu").rglob("dump.json"))
    names = set(json.loads(dump_json.read_text())["data"])
    for op, calls in (("npu_rms_norm", 4), ("npu_rotary_mul", 4), ("npu_fusion_attention", 2), ("npu_swiglu", 2)):
        assert {f"NPU.{op}.{i}.{direction}" for i in range(calls) for direction in ("forward", "backward")} <= names, op

    quiet = compare_dirs(tmp_path / "golden", tmp_path / "npu")
    assert [pair.divergence for pair in quiet.pairs] == [None] and quiet.counts()["error"] == 0

    found = compare_dirs(tmp_path / "golden", tmp_path / "bug").pairs[0].divergence
    assert found.entry == "NPU.npu_rms_norm.0.forward" and found.module_path == "0"
    assert any("train_bug.py" in line for line in found.stack)

    # the peer tool: msprobe compare pairs every fused-op tensor of the two dumps, as for its own
    msprobe = Path(sys.executable).with_name("msprobe")
    run = subprocess.run([str(msprobe), "compare", "-gp", str(tmp_path / "golden" / "step0"),
                          "-tp", str(tmp_path / "npu" / "step0"), "-o", str(tmp_path / "msprobe")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [table] = (tmp_path / "msprobe").glob("compare_result_*.csv")
    fused_rows = [row for row in csv.DictReader(table.open()) if row["NPU Name"].startswith("NPU.")]
    assert {row["NPU Name"] for row in fused_rows} == {row["Bench Name"] for row in fused_rows}
    assert {name for name in names if name.startswith("NPU.")} == \
        {row["NPU Name"].split(".input.")[0].split(".output.")[0] for row in fused_rows}
    cosines = [float(row["Cosine"]) for row in fused_rows if row["Cosine"] not in ("", "N/A", "unsupported")]
    assert cosines and min(cosines) > 0.999


OVERFLOW = '''
import torch
import torch_npu

# A lone spike normalises to sqrt(64) = 8: times a gamma of 60000 it is past fp16's 65504, inside the op.
x = torch.zeros(2, 64, device="npu", dtype=torch.float16)
x[:, 0] = 100.0
gamma = torch.full((64,), 60000.0, device="npu", dtype=torch.float16)
y = torch_npu.npu_rms_norm(x, gamma)[0]
print(float(y.float().abs().max()))
'''


def test_overflow_inside_a_fused_op_is_named_at_the_op(tmp_path, npu):
    (tmp_path / "over.py").write_text(OVERFLOW)
    result = npukit("run_main", "--detect-overflow", "over.py", cwd=tmp_path)
    assert "NPU.npu_rms_norm" in result.stdout + result.stderr, result.stdout + result.stderr


FIX_SCRIPT = '''
import torch
import torch_npu

x = torch.randn(4, 64, device="npu").half()
gamma = torch.randn(64, device="npu").half()
y = torch_npu.npu_rms_norm(x, gamma)[0]
print(y.dtype)
'''


def test_precision_fix_keeps_a_fused_op_in_fp32(tmp_path, npu):
    """`npu-run --precision-fix` applies an fp32 change to a fused op by its msprobe name, as the
    fix finder proposes it for a fused op named as the first divergence."""
    (tmp_path / "fix.py").write_text(FIX_SCRIPT)
    (tmp_path / "fix.json").write_text(json.dumps({"changes": [{"kind": "fp32", "api": "NPU.npu_rms_norm"}]}))
    fixed = npukit("run_main", "--precision-fix", "fix.json", "fix.py", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "torch.float32"
    plain = npukit("run_main", "fix.py", cwd=tmp_path)
    assert plain.stdout.strip() == "torch.float16"
