"""A small CNN trained on generated images, written for CUDA GPUs (npukit's example project).

Usual CUDA idioms on purpose: torch.cuda.is_available(), .cuda(), cudnn.benchmark,
torch.cuda.amp autocast + GradScaler, torch.cuda.synchronize(), max_memory_allocated().
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallCNN(nn.Module):
    def __init__(self, channels=16, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels * 2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels * 2)
        self.head = nn.Linear(channels * 2 * 8 * 8, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(torch.flatten(x, 1))


def make_data(n, generator):
    """Images whose class is encoded in the mean colour, so the net can learn it."""
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = torch.randn(n, 3, 32, 32, generator=generator) * 0.5
    images += (labels.float() / 10.0).view(-1, 1, 1, 1)
    return images, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast with GradScaler")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True
    data_gen = torch.Generator().manual_seed(args.seed)
    images, labels = make_data(args.steps * args.batch_size, data_gen)

    model = SmallCNN()
    if args.device.startswith("cuda"):
        model = model.cuda()
    else:
        model = model.to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start = time.perf_counter()
    for step in range(args.steps):
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        x = images[batch].to(args.device, non_blocking=True)
        y = labels[batch].to(args.device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=args.amp):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.6f}")
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    print(f"done in {time.perf_counter() - start:.2f}s")


if __name__ == "__main__":
    main()
