"""Correct mixed-precision training of seven small models, each dumped in tensor and statistics mode.
Run it under `npu-run` (the NPU run) and `npu-run --golden`: npu-compare must find no divergence,
except in `offset`, where fp16/bf16 loses a real signal (tests/accuracy/test_false_alarms.py)."""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy.dump import DumpSession

out, dtype_name = Path(sys.argv[1]), sys.argv[2]
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(w), nn.MultiheadAttention(w, 4, batch_first=True)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(64, 32), nn.Parameter(torch.randn(16, 32) * 0.02)
        self.blocks, self.head = nn.ModuleList([Block(32) for _ in range(2)]), nn.Linear(32, 64)

    def forward(self, t):
        x = self.emb(t) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CNN(nn.Module):
    """Conv biases before BatchNorm: their gradient is ~0 by cancellation; relu masks flip."""
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2, self.fc = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        return self.fc(F.relu(self.b2(self.c2(x))).mean((2, 3)))


class LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(64, 32), nn.LSTM(32, 48, num_layers=2, batch_first=True), nn.Linear(48, 64)

    def forward(self, t):
        return self.out(self.rnn(self.emb(t))[0])


class Policy(nn.Module):
    """An actor-critic whose two heads are called on their own."""
    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.critic = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
        self.log_std = nn.Parameter(torch.zeros(4))

    def forward(self, obs):
        dist = torch.distributions.Normal(self.actor(obs), self.log_std.exp())
        return dist.log_prob(dist.mean + 0.5).sum(-1), self.critic(obs).squeeze(-1)


class RMSNorm(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(w))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Gain(nn.Module):
    """A scalar gain the following RMSNorm removes: its gradient is ~1e-10 from terms of ~0.1."""
    def __init__(self):
        super().__init__()
        self.fc1, self.gain = nn.Linear(64, 64), nn.Parameter(torch.tensor(1.0))
        self.norm, self.head = RMSNorm(64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(self.norm(self.fc1(x) * self.gain))


class Offset(nn.Module):
    """A small signal on a large offset (bias 3000), centred by the next line: fp16/bf16 rounding
    of fc1's output loses the signal, and the subtraction reveals it."""
    def __init__(self):
        super().__init__()
        self.fc1, self.head = nn.Linear(64, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.fc1.bias.fill_(3000.0)

    def forward(self, x):
        h = self.fc1(x)
        return self.head(h - h.mean(-1, keepdim=True))


class Episode(nn.Module):
    """pytorch/examples' actor-critic: one state at a time, a 128->1 value head, and advantages taken
    from `value.item()` (Python floats carrying the head's rounding) by a critic that predicts the
    returns well, so `R - value.item()` cancels."""
    def __init__(self):
        super().__init__()
        self.affine, self.action_head, self.value_head = nn.Linear(4, 128), nn.Linear(128, 2), nn.Linear(128, 1)

    def forward(self, state):
        x = F.relu(self.affine(state))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def episode_loss(model, states, actions):
    with torch.no_grad(), torch.autocast("npu", enabled=False):
        returns = model(states)[1].squeeze(-1) + 0.1 * torch.randn(len(states), device="npu")
    policy_losses, value_losses = [], []
    for state, action, R in zip(states, actions, returns):
        probs, value = model(state)
        advantage = R - value.item()
        policy_losses.append(-torch.distributions.Categorical(probs).log_prob(action) * advantage)
        value_losses.append(F.smooth_l1_loss(value, R.reshape(1)))
    return torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()


def batch(kind):
    if kind == "episode":
        return torch.randn(24, 4, device="npu"), torch.randint(0, 2, (24,), device="npu")
    if kind in ("transformer", "lstm"):
        t = torch.randint(0, 64, (4, 16), device="npu")
        return t, t.flatten()
    if kind == "cnn":
        return torch.randn(8, 3, 16, 16, device="npu"), torch.randint(0, 10, (8,), device="npu")
    if kind == "policy":
        return torch.randn(32, 8, device="npu"), torch.randn(32, device="npu")
    return torch.randn(32, 64, device="npu"), torch.randint(0, 16, (32,), device="npu")


def loss_of(kind, model, x, y):
    if kind == "episode":
        return episode_loss(model, x, y)
    if kind == "policy":
        logp, value = model(x)
        return -(logp * (y - value.detach())).mean() + F.mse_loss(value.float(), y)
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2).float() if logits.dim() > 2 else logits.float(), y)


MODELS = {"transformer": Transformer, "cnn": CNN, "lstm": LSTM, "policy": Policy, "gain": Gain, "offset": Offset,
          "episode": Episode}
for kind, cls in MODELS.items():
    for mode in ("tensor", "stats"):
        torch.manual_seed(0)
        model = cls().npu()
        # The CNN trains as pytorch/examples' mnist does (Adadelta, lr 1.0): large first updates, so
        # step 1 starts from weights the two runs' different fp16/bf16 gradients moved apart.
        opt = torch.optim.Adadelta(model.parameters(), lr=1.0) if kind == "cnn" else \
            torch.optim.AdamW(model.parameters(), lr=1e-3)
        # fp16 with loss scaling, at a scale no step skips (skipped steps have their own test)
        scaler = torch.amp.GradScaler("npu", init_scale=256.0, enabled=dtype == torch.float16)
        with DumpSession(out / kind / mode, level="mix", mode=mode):
            for _step in range(2):
                x, y = batch(kind)
                with torch.autocast("npu", dtype=dtype):
                    loss = loss_of(kind, model, x, y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # user code on the gradients
                scaler.step(opt)
                scaler.update()
