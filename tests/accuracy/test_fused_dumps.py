"""torch_npu's fused ops in dumps, compares and overflow checks: named as msprobe names them
(`NPU.npu_rms_norm.0.forward`), golden (fp32 reference decomposition) vs NPU with no false
divergence, and a wrong fused call named where it is."""

import json

from npukit.accuracy.compare import compare_dirs
from tests.accuracy.test_journey import npukit

SCRIPT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(width))
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        h = torch_npu.npu_rms_norm(x, self.gamma, epsilon=EPS)[0]
        return x + self.down(torch_npu.npu_swiglu(self.up(h)) if SWIGLU else F.silu(self.up(h)[..., ::2]))

model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4)).to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1):
    x = torch.randn(4, 8, device="npu")
    y = torch.randint(0, 4, (4,), device="npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def write_script(path, eps="1e-6"):
    import torch_npu  # noqa: F401  (installed by the fused tests' conftest or npu-run)

    swiglu = "True" if hasattr(__import__("torch").ops.npu, "npu_swiglu") else "False"
    path.write_text(SCRIPT.replace("EPS", eps).replace("SWIGLU", swiglu))


def test_fused_ops_dump_as_msprobe_names_them_and_compare_quietly(tmp_path, npu):
    from npukit.npu_backend.torch_npu_shim import install_torch_npu

    install_torch_npu()
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
    assert {"NPU.npu_rms_norm.0.forward", "NPU.npu_rms_norm.1.forward", "NPU.npu_rms_norm.0.backward"} <= names

    quiet = compare_dirs(tmp_path / "golden", tmp_path / "npu")
    assert [pair.divergence for pair in quiet.pairs] == [None] and quiet.counts()["error"] == 0

    found = compare_dirs(tmp_path / "golden", tmp_path / "bug").pairs[0].divergence
    assert found.entry == "NPU.npu_rms_norm.0.forward" and found.module_path == "1"
    assert any("train_bug.py" in line for line in found.stack)


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
