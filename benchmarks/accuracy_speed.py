"""Accuracy tooling speed, measured side by side in one run.

1. Dump overhead: time per training step of a small transformer with a DumpSession (module / api /
   mix statistics, mix tensor in .pt, the default, and in .npy) divided by the time per step without
   one. Targets: mix stats <= 1.3x, mix tensor (.pt) <= 2.5x. Then the files and bytes a tensor
   dump writes per step.
   Baseline and dump steps are interleaved, as many of each (24), and the fastest step of each is kept:
   load from other processes only ever adds time, so the minimum is the steadiest estimate of
   both. Wall time and process CPU time are both shown.
2. Compare throughput: npu-compare (metrics in fp64, all cores) on a generated dump pair of
   >= 500 MB (both sides together), in MB/s of dump data read, with the tensors in .pt files (the
   dump's default, msprobe's format) and in .npy. Targets on 2 cores: >= 1000 MB/s (.pt), >= 500 MB/s
   (.npy). Then a pair of 4,000 small tensors a side, in files/s (real dumps are mostly small tensors).
   If msprobe is installed, `msprobe compare` runs on the same .pt pair for the ratio.

    python benchmarks/accuracy_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npukit.accuracy.compare import compare_dirs  # noqa: E402
from npukit.accuracy.dump import DumpSession  # noqa: E402
from npukit.accuracy.tensor_io import write_tensor  # noqa: E402
from npukit.files import write_json  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def training_steps(model, optimizer, count: int) -> list[tuple[float, float]]:
    """(wall seconds, process CPU seconds) of each of `count` training steps."""
    times = []
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = torch.randint(0, 512, (8, 128))
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def dump_overhead(rounds: int, steps: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters())
    training_steps(model, optimizer, 2)  # warm-up
    configs = [("module", "stats", "pt"), ("api", "stats", "pt"), ("mix", "stats", "pt"), ("mix", "tensor", "pt"),
               ("mix", "tensor", "npy")]
    samples: dict = {config: [] for config in configs}
    # Each configuration is divided by the steps run just before it, as many as its own: the
    # fastest of a larger sample is lower, which would bias every ratio upwards.
    baselines: dict = {config: [] for config in configs}
    written: dict = {}
    for _ in range(rounds):
        for config in configs:
            baselines[config] += training_steps(model, optimizer, steps)
            with tempfile.TemporaryDirectory() as out:
                with DumpSession(Path(out), level=config[0], mode=config[1], tensor_format=config[2]):
                    training_steps(model, optimizer, 1)  # first step: module paths, warm caches
                    samples[config] += training_steps(model, optimizer, steps)
                if config[1] == "tensor":
                    written[config] = files_written(Path(out) / "step1")
    every_baseline = [t for values in baselines.values() for t in values]
    print(f"dump overhead per training step, dump / no dump (TinyGPT 4x256, batch 8x128, AdamW; fastest of "
          f"{len(samples[configs[0]])} steps each, the fastest step without a dump: "
          f"{min(t[0] for t in every_baseline) * 1e3:.0f} ms wall, {min(t[1] for t in every_baseline) * 1e3:.0f} ms CPU)")
    print("  level  mode         wall   CPU")
    targets = {("mix", "stats", "pt"): "  (target <= 1.3x)", ("mix", "tensor", "pt"): "  (target <= 2.5x)"}
    for config, values in samples.items():
        wall = min(t[0] for t in values) / min(t[0] for t in baselines[config])
        cpu = min(t[1] for t in values) / min(t[1] for t in baselines[config])
        mode = f"{config[1]} .{config[2]}" if config[1] == "tensor" else config[1]
        print(f"  {config[0]:6s} {mode:11s} {wall:5.2f}x {cpu:5.2f}x{targets.get(config, '')}")
    for config, (files, distinct, size) in written.items():
        links = f", {files - distinct} hard links to them" if files > distinct else ""
        print(f"  tensor .{config[2]} per step: {files} files, {distinct} written ({size / 1e6:.0f} MB){links}")


def files_written(step_dir: Path) -> tuple[int, int, int]:
    """(files, distinct files, their bytes) of one step's tensor data: a .pt dump has a file per
    leaf, and a tensor's later leaves are hard links to its first file."""
    sizes = {}
    files = 0
    for path in step_dir.glob("rank*/dump_tensor_data/*"):
        stat = path.stat()
        sizes[stat.st_ino] = stat.st_size
        files += 1
    return files, len(sizes), sum(sizes.values())


def generate_pair(root: Path, megabytes_per_side: int, elements: int = 2_000_000, suffix: str = ".pt") -> int:
    """A golden/target dump pair of fp32 tensors (8 MB each by default), msprobe layout, tensor files
    written as a dump writes them (`suffix`: .pt or .npy); returns total bytes."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, megabytes_per_side * 1_000_000 // (elements * 4))
    total = 0
    for side in ("golden", "target"):
        rank_dir = root / side / "step0" / "rank0"
        data_dir = rank_dir / "dump_tensor_data"
        data_dir.mkdir(parents=True)
        entries = {}
        torch.manual_seed(0)
        for index in range(count):
            name = f"Functional.linear.{index}.forward"
            tensor = torch.randn(elements, generator=torch.Generator().manual_seed(index))
            if side == "target":
                tensor = tensor + torch.randn(elements, generator=generator) * 1e-6
            file_name = f"{name}.output.0{suffix}"
            write_tensor(data_dir / file_name, tensor)
            total += tensor.numel() * tensor.element_size()
            entries[name] = {"input_args": [], "input_kwargs": {}, "output": [{
                "type": "torch.Tensor", "dtype": "torch.float32", "shape": [elements],
                "Max": None, "Min": None, "Mean": None, "Norm": None, "requires_grad": False,
                "data_name": file_name,
            }]}
        write_json(rank_dir / "dump.json", {"task": "tensor", "level": "L1", "framework": "pytorch",
                                            "dump_data_dir": str(data_dir), "data": entries})
    return total


def compare_throughput(megabytes_per_side: int, repeats: int) -> None:
    """Both formats' pairs on disk at once, compared alternately `repeats` times: the fastest of each."""
    roots = {suffix: Path(tempfile.mkdtemp(prefix="npukit-bench-")) for suffix in (".pt", ".npy")}
    try:
        totals = {suffix: generate_pair(root, megabytes_per_side, suffix=suffix) for suffix, root in roots.items()}
        workers = os.cpu_count() or 1
        fastest = dict.fromkeys(roots, float("inf"))
        for _ in range(repeats):
            for suffix, root in roots.items():
                start = time.perf_counter()
                result = compare_dirs(root / "golden", root / "target", workers=workers)
                fastest[suffix] = min(fastest[suffix], time.perf_counter() - start)
                assert result.pairs[0].divergence is None
        for suffix, target in ((".pt", 1000), (".npy", 500)):
            rate = totals[suffix] / fastest[suffix] / 1e6
            print(f"compare throughput ({suffix}): {totals[suffix] / 1e6:.0f} MB pair in {fastest[suffix]:.2f} s = "
                  f"{rate:.0f} MB/s on {workers} cores, fastest of {repeats}  (target >= {target} MB/s)")
        msprobe_ratio(roots[".pt"], fastest[".pt"])
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


def compare_small_files(files_per_side: int) -> None:
    """Real dumps hold thousands of small tensors (biases, norms, scalars): files/s matters there."""
    for suffix in (".pt", ".npy"):
        root = Path(tempfile.mkdtemp(prefix="npukit-bench-"))
        try:
            elements = 256
            generate_pair(root, megabytes_per_side=files_per_side * elements * 4 // 1_000_000 or 1, elements=elements,
                          suffix=suffix)
            files = 2 * len(list((root / "golden" / "step0" / "rank0" / "dump_tensor_data").iterdir()))
            start = time.perf_counter()
            compare_dirs(root / "golden", root / "target", workers=os.cpu_count() or 1)
            seconds = time.perf_counter() - start
            print(f"compare of small tensors ({suffix}): {files} files of {elements} elements in {seconds:.2f} s = "
                  f"{files / seconds:.0f} files/s ({seconds / files * 1e3:.2f} ms per file)")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def msprobe_ratio(root: Path, npukit_seconds: float) -> None:
    beside = Path(sys.executable).with_name("msprobe")  # the venv's, when its python runs this
    msprobe = str(beside) if beside.exists() else shutil.which("msprobe")
    if msprobe is None:
        print("msprobe compare: not installed (pip install mindstudio-probe), ratio skipped")
        return
    start = time.perf_counter()
    done = subprocess.run([msprobe, "compare", "-gp", str(root / "golden/step0"), "-tp", str(root / "target/step0"),
                           "-o", str(root / "out")], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(f"msprobe compare failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return
    print(f"msprobe compare: {seconds:.2f} s; npukit is {seconds / npukit_seconds:.1f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller dump pair")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cores")
    dump_overhead(rounds=2 if args.quick else 8, steps=2 if args.quick else 3)
    compare_throughput(megabytes_per_side=64 if args.quick else 256, repeats=2 if args.quick else 3)
    compare_small_files(files_per_side=1000 if args.quick else 4000)


if __name__ == "__main__":
    main()
