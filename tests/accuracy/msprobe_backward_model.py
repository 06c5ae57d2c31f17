"""A model whose backward runs Python: a custom autograd Function whose backward calls torch apis
(as MindSpeed's grouped matmul does), a tensor hook, and optionally a block under
torch.utils.checkpoint (its recompute runs inside the backward). One SGD step dumped by the real
msprobe or by npukit: `python msprobe_backward_model.py TOOL TASK LEVEL OUT CHECKPOINT`, CHECKPOINT
none | recompute (torch's early stop off: the whole block recomputed) | early-stop (torch's default).
Used by test_msprobe_parity.py."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from msprobe_parity_model import dump_step  # this script's folder is on sys.path


class ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight) * 0.5

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad * 0.5
        return torch.matmul(grad, weight.t()), torch.matmul(x.t(), grad)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = ScaledMatmul.apply(x, self.weight)
        if h.requires_grad:
            h.register_hook(lambda grad: torch.tanh(grad))
        return self.fc(torch.relu(h))


class Model(nn.Module):
    def __init__(self, checkpoint: str):
        super().__init__()
        self.checkpoint = checkpoint
        self.a, self.b = Layer(), Layer()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.a(x)
        if self.checkpoint == "none":
            x = self.b(x)
        else:
            with torch.utils.checkpoint.set_checkpoint_early_stop(self.checkpoint == "early-stop"):
                x = torch.utils.checkpoint.checkpoint(self.b, x, use_reentrant=False)
        return self.head(x)


def main(tool: str, task: str, level: str, out: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = Model(checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def step():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    dump_step(tool, task, level, out, model, step)


if __name__ == "__main__":
    main(*sys.argv[1:])
