"""Small models with switchable injected bugs, and a helper that trains them under a DumpSession."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy.dump import DumpSession


class TransposedLinear(nn.Linear):
    """The transposed-weight bug: a square Linear that multiplies by W instead of W^T."""

    def forward(self, x):
        return F.linear(x, self.weight.t(), self.bias)


class Block(nn.Module):
    def __init__(self, width: int, bug: str | None) -> None:
        super().__init__()
        self.bug = bug
        self.fc1 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width, eps=0.5 if bug == "eps" else 1e-5)
        self.fc2 = TransposedLinear(width, width) if bug == "transpose" else nn.Linear(width, width)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        h = F.relu(h) if self.bug == "relu" else F.gelu(h)
        if self.bug == "insert":
            h = torch.tanh(h)  # a call present only in the buggy run
        if self.bug == "overflow":
            h = torch.square(h * 300.0)  # overflows float16 (max 65504), fine in float32
        else:
            h = torch.square(h * 0.5)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, width: int = 16, classes: int = 4, bug: str | None = None, bug_block: int = 1) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width, bug if i == bug_block else None) for i in range(3)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def train(out: Path | None, bug: str | None = None, *, level: str = "mix", mode: str = "tensor", steps: int = 2,
          dtype: torch.dtype = torch.float32, autocast_bf16: bool = False, device: str = "cpu",
          seed: int = 0, dump_steps: str | None = None, loss_scale: float | None = None,
          **session_options) -> list[float]:
    """Train Net for a few steps (optionally under a DumpSession); returns the losses."""
    torch.manual_seed(seed)
    model = Net(bug=bug)
    data = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(steps)]
    model = model.to(device=device, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    session = DumpSession(out, level=level, mode=mode, steps=dump_steps, **session_options) if out is not None else None
    if session:
        session.start()
    try:
        for x, y in data:
            x, y = x.to(device=device, dtype=dtype), y.to(device)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad()
            if loss_scale:  # what a GradScaler does: scaled backward, unscaled grads before the step
                (loss * loss_scale).backward()
                with torch.no_grad():
                    for param in model.parameters():
                        param.grad.div_(loss_scale)
            else:
                loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        if session:
            session.stop()
    return losses


class UnusualLayouts(nn.Module):
    """A sparse matmul, a dequantized copy and a nested tensor inside an ordinary forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.sparse.mm(torch.eye(4).to_sparse(), self.fc(x).t()).t()
        dequantized = torch.quantize_per_tensor(y.detach(), 0.1, 0, torch.quint8).dequantize()
        nested = torch.nested.nested_tensor([y[0], y[1, :2]]) * 2
        return y.sum() + dequantized.sum() + nested.unbind()[0].sum()


class LlamaBlock(nn.Module):
    """A Llama-style block as Ascend code writes it: torch_npu's fused RMSNorm, rotary embedding and
    SwiGLU, attention written out with a causal mask (optionally dropout), a LayerNorm and a GELU."""

    def __init__(self, torch_npu, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.torch_npu, self.heads, self.dropout = torch_npu, heads, dropout
        self.norm = nn.Parameter(torch.ones(width))
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(2 * width, width)

    def forward(self, x, cos, sin, mask):
        b, s, width = x.shape
        h = self.torch_npu.npu_rms_norm(x, self.norm, epsilon=1e-6)[0]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        q, k = self.torch_npu.npu_rotary_mul(q, cos, sin), self.torch_npu.npu_rotary_mul(k, cos, sin)
        scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        weights = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        if self.dropout:
            weights = F.dropout(weights, self.dropout)
        x = x + self.out(torch.matmul(weights, v).transpose(1, 2).reshape(b, s, width))
        return x + self.down(self.torch_npu.npu_swiglu(self.up(F.gelu(self.ln(x))), dim=-1))


def dump_llama(out: Path, mode: str, *, width: int = 16, heads: int = 2, seq: int = 8, batch: int = 4,
               blocks: int = 2, steps: int = 1, dropout: float = 0.0) -> None:
    """Train LlamaBlocks in fp16 autocast on the emulated NPU for `steps` steps, dumped api by api
    (DumpSession, mode "tensor" or "stats") into `out`."""
    from npukit.npu_backend.torch_npu_shim import install_torch_npu

    torch_npu = install_torch_npu()
    torch.manual_seed(0)
    layers = nn.ModuleList([LlamaBlock(torch_npu, width, heads, dropout) for _ in range(blocks)]).to("npu")
    head = nn.Linear(width, 4).to("npu")
    optimizer = torch.optim.SGD([*layers.parameters(), *head.parameters()], lr=0.01)
    angles = torch.arange(seq, device="npu")[:, None] * torch.arange(1, width // heads // 2 + 1, device="npu")
    cos, sin = (torch.cat([f(angles * 0.1)] * 2, -1)[None, None] for f in (torch.cos, torch.sin))
    mask = torch.ones(seq, seq, dtype=torch.bool, device="npu").triu(1)
    with DumpSession(out, level="api", mode=mode):
        for _ in range(steps):
            h = torch.randn(batch, seq, width, device="npu")
            y = torch.randint(0, 4, (batch,), device="npu")
            with torch.autocast("npu", dtype=torch.float16):
                for layer in layers:
                    h = layer(h, cos, sin, mask)
                loss = F.cross_entropy(head(h.mean(1)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
