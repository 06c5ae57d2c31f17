"""Emulated NPU overhead: training-step time on npu vs the same step on CPU, measured in one run.

Interleaved runs (CPU block, npu block, repeated), medians, 1 thread; a block lasts at least
20 ms (the small MLP's 10 steps took 1.7 ms, and its ratio moved between 1.12 and 1.34 from run
to run). Also per-op overhead in microseconds on 8x8 tensors, and the import cost of
npukit.npu_backend.

Both sides run the same optimizer code: torch picks the foreach implementation for a device such
as npu (or cuda) and the for-loop one for the CPU, and on a small model the two differ by more
than the emulator costs (the small MLP: foreach 12 us a step slower than the loop on the CPU
itself). So every case builds its optimizer with foreach=True, the path the npu takes by default;
the small MLP's pair with each device's default is printed as well, for information.

The small MLP's ratio depends on the process more than on anything within one: the same code read
1.116 to 1.148 in six fresh processes, while blocks within a process agreed (the CPU step alone
moved between 240 and 274 us from process to process: where the allocator put the model). So that
case is measured in --processes fresh processes and the median of their ratios is the figure, with
the range printed beside it.

    python benchmarks/backend_overhead.py [--repeats 7] [--steps 10] [--processes 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = {"MLP": 1.30, "small MLP": 1.15, "Adam MLP": 1.15, "CNN": 1.10, "GPT block": 1.10, "GPT AMP": 1.25,
           "tiny Llama": 1.15}
OP_OVERHEAD_TARGET_US = 0.3
MIN_BLOCK_SECONDS = 0.02
PROCESS_MEDIAN_CASES = ("small MLP", "Adam MLP")  # see the module docstring
SAME_OPTIMIZER = {"foreach": True}  # see the module docstring


def mlp_case(device):
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, **SAME_OPTIMIZER)
    x = torch.randn(64, 784, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return model, optimizer, lambda: F.cross_entropy(model(x), y)


def small_mlp_case(device, optimizer_options=SAME_OPTIMIZER):
    """Dispatch-bound: each op is a few hundred nanoseconds of work (reinforcement learning policies,
    unit tests of users' code under pytest --npu), so the per-op overhead is the ratio."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, **optimizer_options)
    x = torch.randn(16, 32, device=device)
    y = torch.randint(0, 4, (16,), device=device)
    return model, optimizer, lambda: F.cross_entropy(model(x), y)


def adam_mlp_case(device):
    """Dispatch-bound too, with the optimizer's share larger: a 3-layer MLP at batch 16 under Adam
    (issue #30 measured 1.19-1.22x on models like it; the small MLP's SGD has few update ops)."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, **SAME_OPTIMIZER)
    x = torch.randn(16, 64, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    return model, optimizer, lambda: F.cross_entropy(model(x), y)


def cnn_case(device):
    layers, channels = [], 3
    for width in (16, 16, 32, 32, 64, 64):
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **SAME_OPTIMIZER)
    x = torch.randn(16, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    return model, optimizer, lambda: F.cross_entropy(model(x), y)


class GPTBlock(nn.Module):
    def __init__(self, d=256, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def gpt_case(device):
    model = GPTBlock().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **SAME_OPTIMIZER)
    x = torch.randn(8, 128, 256, device=device)
    return model, optimizer, lambda: model(x).square().mean()


def gpt_amp_case(device):
    """The GPT block step with fp16 autocast + GradScaler on npu (INF_NAN mode).

    The CPU pair runs the same step in fp32 with the same GradScaler code. The device (and so the
    emulator) computes fp16 matmuls with fp32 accumulation, i.e. on the host's fp32 GEMM, so both
    sides do the same GEMM work and the ratio is the emulator's own cost (casts, numeric policies,
    dispatch). CPU autocast is no fair pair: its fp16 GEMM is a software path (~14x slower here),
    its bf16 GEMM a native one (~2x faster), both different arithmetic.
    """
    model, optimizer, loss_fn = gpt_case(device)
    if device == "npu":
        from npukit.npu_backend import numerics

        numerics.set_fp16_mode("inf_nan")

    def amp_loss():
        with torch.autocast(device, dtype=torch.float16, enabled=device == "npu"):
            return loss_fn()

    return model, optimizer, amp_loss, torch.amp.GradScaler(device)


def tiny_llama_case(device):
    """A Hugging Face LlamaForCausalLM training step as the Trainer runs it (forward with labels,
    backward, AdamW), on the emulator through transformers' own NPU detection (issue #30)."""
    from npukit.npu_backend.torch_npu_shim import install_torch_npu

    install_torch_npu()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **SAME_OPTIMIZER)
    ids = torch.randint(0, config.vocab_size, (4, 64), device=device)
    return model, optimizer, lambda: model(input_ids=ids, labels=ids).loss


CASES = {"MLP": mlp_case, "small MLP": small_mlp_case, "Adam MLP": adam_mlp_case, "CNN": cnn_case,
         "GPT block": gpt_case, "GPT AMP": gpt_amp_case, "tiny Llama": tiny_llama_case}
# For information: each device's default optimizer implementation (CPU for-loop, npu foreach).
DEFAULT_OPTIMIZER_CASE = ("small MLP, default optimizers", lambda device: small_mlp_case(device, {}))


def time_steps(case, steps: int) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) per step. With 1 thread and backward in the
    calling thread, CPU time is the step's whole cost and is not inflated by other processes."""
    model, optimizer, loss_fn, *scaler = case
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if scaler:
            scaler[0].scale(loss_fn()).backward()
            scaler[0].step(optimizer)
            scaler[0].update()
        else:
            loss_fn().backward()
            optimizer.step()
    return (time.perf_counter() - start) / steps, (time.thread_time() - start_cpu) / steps


def step_ratio(name: str, repeats: int, steps: int, make_case=None) -> tuple[float, float, float, float]:
    """Medians of interleaved runs: (cpu wall, npu wall, wall ratio, CPU-time ratio)."""
    torch.manual_seed(0)
    make_case = make_case or CASES[name]
    cases = {device: make_case(device) for device in ("cpu", "npu")}
    for case in cases.values():
        time_steps(case, 2)  # warm-up
    step_seconds = time_steps(cases["cpu"], 2)[0]
    steps = max(steps, math.ceil(MIN_BLOCK_SECONDS / step_seconds))
    cpu_runs, npu_runs = [], []
    for _ in range(repeats):
        cpu_runs.append(time_steps(cases["cpu"], steps))
        npu_runs.append(time_steps(cases["npu"], steps))
    cpu_wall = statistics.median(run[0] for run in cpu_runs)
    npu_wall = statistics.median(run[0] for run in npu_runs)
    cpu_time = statistics.median(run[1] for run in cpu_runs)
    npu_time = statistics.median(run[1] for run in npu_runs)
    return cpu_wall, npu_wall, npu_wall / cpu_wall, npu_time / cpu_time


def step_ratio_over_processes(name: str, repeats: int, steps: int, processes: int) -> tuple[tuple, list[float]]:
    """step_ratio in `processes` fresh interpreters: (the run with the median ratio, every ratio)."""
    runs = []
    for _ in range(processes):
        out = subprocess.check_output([sys.executable, __file__, "--one-case", name, "--repeats", str(repeats),
                                       "--steps", str(steps)], text=True)
        runs.append(tuple(map(float, out.split())))
    runs.sort(key=lambda run: run[2])
    return runs[len(runs) // 2], [run[2] for run in runs]


def op_overhead_us(repeats: int = 2000) -> dict[str, tuple[float, float]]:
    results = {}
    a_cpu, b_cpu = torch.randn(8, 8), torch.randn(8, 8)
    a_npu, b_npu = a_cpu.npu(), b_cpu.npu()
    ops = {
        "add": lambda a, b: a + b,
        "add_": lambda a, b: a.add_(b),
        "view": lambda a, b: a.view(64),
        "mm": lambda a, b: a @ b,
        "sum": lambda a, b: a.sum(),
    }
    for name, fn in ops.items():
        per_device = []
        for a, b in ((a_cpu, b_cpu), (a_npu, b_npu)):
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(repeats):
                    fn(a, b)
                samples.append((time.perf_counter() - start) / repeats * 1e6)
            per_device.append(statistics.median(samples))
        results[name] = (per_device[0], per_device[1])
    return results


def import_cost() -> tuple[float, float]:
    code = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
            "import npukit.npu_backend; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    samples = [tuple(map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split()))
               for _ in range(3)]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--processes", type=int, default=5,
                        help="fresh processes for the small MLP, whose median ratio is the figure")
    parser.add_argument("--one-case", help=argparse.SUPPRESS)  # a child of step_ratio_over_processes
    args = parser.parse_args()
    torch.set_num_threads(1)
    import npukit.npu_backend  # noqa: F401

    if args.one_case:
        print(*step_ratio(args.one_case, args.repeats, args.steps))
        return 0

    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats x {args.steps} steps, medians")
    print(f"{'model':<10} {'cpu ms/step':>12} {'npu ms/step':>12} {'ratio':>7} {'cpu-time ratio':>15} {'target':>7}")
    met = True
    spreads = []
    for name in CASES:
        if name in PROCESS_MEDIAN_CASES and args.processes > 1:
            (cpu, npu, ratio, cpu_time_ratio), ratios = step_ratio_over_processes(name, args.repeats, args.steps,
                                                                                  args.processes)
            spreads.append(f"{name}: the median of {len(ratios)} processes, which read "
                           + ", ".join(f"{r:.3f}" for r in ratios))
        else:
            cpu, npu, ratio, cpu_time_ratio = step_ratio(name, args.repeats, args.steps)
        ok = ratio <= TARGETS[name]
        met &= ok
        print(f"{name:<10} {cpu * 1e3:>12.2f} {npu * 1e3:>12.2f} {ratio:>7.3f} {cpu_time_ratio:>15.3f} "
              f"{'<=' + str(TARGETS[name]):>7} {'ok' if ok else 'MISSED'}")
    for spread in spreads:
        print(f"({spread})")
    info_name, make_case = DEFAULT_OPTIMIZER_CASE
    cpu, npu, ratio, cpu_time_ratio = step_ratio(info_name, args.repeats, args.steps, make_case)
    print(f"{info_name}: cpu {cpu * 1e3:.3f} ms, npu {npu * 1e3:.3f} ms, ratio {ratio:.3f} (information:\n"
          " torch runs the for-loop SGD on the CPU and the foreach one on npu; not a target)")
    print("(ratio: wall time, the target's measure; cpu-time ratio: the same steps in this thread's CPU\n"
          " time, which other processes on the machine cannot inflate)")
    print("(GPT AMP: npu fp16 autocast + GradScaler, INF_NAN mode, vs the same step on CPU in fp32 with\n"
          " GradScaler: the device's fp16 matmuls accumulate in fp32, the same GEMM work as CPU fp32)")
    print("\nper-op cost on 8x8 (us): cpu, npu, overhead")
    overheads = []
    for name, (cpu, npu) in op_overhead_us().items():
        overheads.append(npu - cpu)
        print(f"  {name:<5} {cpu:7.2f} {npu:7.2f} {npu - cpu:+7.2f}")
    overhead = statistics.median(overheads)
    ok = overhead <= OP_OVERHEAD_TARGET_US
    met &= ok
    print(f"  median overhead {overhead:+.2f} us (target <= {OP_OVERHEAD_TARGET_US}) {'ok' if ok else 'MISSED'}")
    torch_s, backend_s = import_cost()
    print(f"\nimport torch {torch_s:.2f} s; import npukit.npu_backend adds {backend_s:.3f} s (target <= 0.3 s)")
    met &= backend_s <= 0.3
    print("all targets met" if met else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
