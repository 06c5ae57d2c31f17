"""A tiny character-level GPT trained on generated text, written for CUDA GPUs.

npukit's example project: the usual CUDA idioms (torch.cuda.is_available(), .cuda(),
"cuda:{rank}" devices, torch.cuda.amp autocast + GradScaler, cudnn.benchmark, an nccl DDP
path under torchrun) so that `npu-migrate` has real work to do and `npu-run` can train it.

    python train_gpt.py --steps 50 --amp
    torchrun --nproc-per-node 2 train_gpt.py --steps 20        # DDP over nccl
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 32


def generated_text(length: int, seed: int) -> torch.Tensor:
    """A learnable stream: repeated 'words' of a small alphabet with some noise."""
    generator = torch.Generator().manual_seed(seed)
    words = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in torch.randint(3, 8, (40,), generator=generator)]
    picks = torch.randint(0, len(words), (length // 4,), generator=generator)
    stream = torch.cat([torch.cat([words[int(i)], torch.zeros(1, dtype=torch.long)]) for i in picks])
    return stream[:length]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim=64, heads=4, layers=2, context=32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast with GradScaler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    device = args.device
    if distributed:
        dist.init_process_group(backend="nccl")
        rank = dist.get_rank()
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    data = generated_text(args.steps * args.batch_size * (args.context + 1) + 1, args.seed)
    model = TinyGPT(context=args.context).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start = time.perf_counter()
    span = args.context + 1
    for step in range(args.steps):
        offset = (step * args.batch_size) * span
        batch = data[offset:offset + args.batch_size * span].view(args.batch_size, span)
        chunk = batch.cuda(non_blocking=True) if device.startswith("cuda") else batch.to(device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.cuda.amp.autocast(enabled=args.amp):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
