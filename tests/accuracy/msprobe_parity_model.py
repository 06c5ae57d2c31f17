"""A small vision transformer trained for one step and dumped by the real msprobe or by npukit:
`python msprobe_parity_model.py TOOL TASK LEVEL DTYPE OUT [OPS]`. A conv stem with batch norm and
pooling, an attention block whose heads are made with chunk / view / transpose / reshape, layer and
group norms, an MLP head.

TOOL msprobe | npukit | msprobe-config (msprobe with the config OUT.json as it is) | plain (no dump: for
`npu-run --dump-config`); TASK statistics | tensor; LEVEL L1 | mix; DTYPE fp32 | bf16 (CPU autocast);
OPS: npukit's op set (DumpSession(ops=...), default its default). Used by test_msprobe_parity.py; dump_step
by msprobe_interop_model.py too."""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (dim // self.heads) ** -0.5, dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 3, padding=1), nn.BatchNorm2d(dim), nn.ReLU(), nn.MaxPool2d(2))
        self.group_norm = nn.GroupNorm(4, dim)
        self.block = Block(dim, heads)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        h = self.group_norm(self.stem(x))
        tokens = torch.flatten(h, 2).transpose(1, 2)
        tokens = self.block(tokens)
        return self.head(F.adaptive_avg_pool1d(tokens.transpose(1, 2), 1).squeeze(-1))


def build():
    """The model, its optimizer and one batch, seeded: the same in every process."""
    torch.manual_seed(0)
    model = Model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))


def train_step(model, optimizer, x, y, dtype: str) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def dump_step(tool: str, task: str, level: str, out: str, model, step, **npukit_options) -> None:
    """Run `step()` dumped by msprobe (its config written to OUT.json; msprobe-config: read from
    there as it is), by npukit (DumpSession(**npukit_options)), or not at all (plain)."""
    if tool.startswith("msprobe"):
        from msprobe.pytorch import PrecisionDebugger

        if tool == "msprobe":
            config = {"task": task, "dump_path": out, "rank": [], "step": [0], "level": level,
                      "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
                      "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
            with open(out + ".json", "w") as file:
                json.dump(config, file)
        debugger = PrecisionDebugger(config_path=out + ".json")
        debugger.start(model)
        step()
        debugger.stop()
        debugger.step()
    elif tool == "plain":
        step()
    else:
        from npukit.accuracy.dump import DumpSession

        with DumpSession(out, level={"L1": "api", "mix": "mix"}[level], mode={"statistics": "stats"}.get(task, task),
                         **npukit_options):
            step()


def main(tool: str, task: str, level: str, dtype: str, out: str, ops: str | None = None) -> None:
    model, optimizer, x, y = build()
    dump_step(tool, task, level, out, model, lambda: train_step(model, optimizer, x, y, dtype), ops=ops)


if __name__ == "__main__":
    main(*sys.argv[1:])
