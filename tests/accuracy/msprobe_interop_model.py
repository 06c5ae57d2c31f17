"""One model (a conv net, a transformer-style block, an MLP head) trained for one step and dumped
by the real msprobe or by npukit: `python msprobe_interop_model.py TOOL TASK LEVEL DTYPE OUT`.

TOOL msprobe | npukit; TASK statistics | tensor; LEVEL L1 | mix (npukit: api | mix); DTYPE fp32 | bf16
(CPU autocast). Used by test_msprobe_interop.py."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from msprobe_parity_model import dump_step  # this script's folder is on sys.path

tool, task, level, dtype, out = sys.argv[1:6]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.norm(F.relu(self.conv(x)).flatten(2).mean(1))
        return h + self.fc2(F.gelu(self.fc1(h))) * 0.5


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(x))


torch.manual_seed(0)
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 4, (4,))


def train_step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


formats = {"tensor_format": sys.argv[6]} if len(sys.argv) > 6 else {}  # else npukit's default
dump_step(tool, task, level, out, model, train_step, **formats)
