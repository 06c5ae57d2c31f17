"""Fused-op cost on the emulated NPU: each torch_npu fused op (forward + backward) on npu against its
unfused decomposition (the PyTorch ops a user would write instead) on the CPU, measured in one run.

Interleaved blocks (unfused on CPU, fused on npu, repeated), medians, 1 thread, each block at least
20 ms. Target (issue #30): each fused op costs at most 1.2x its unfused decomposition: no Python loop
per head, batch item or expert inside a kernel. Ops not emulated in this checkout are listed as such.

Each op is measured in fp32, fp16 and bf16 (`--dtypes`): in low precision the unfused side is the
same ops in that dtype on the CPU (each rounding to it), the fused side computes in fp32 inside and
rounds once, as the kernel does.

    python benchmarks/fused_ops.py [--repeats 7] [--only NAME] [--dtypes float32,float16,bfloat16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import npukit.npu_backend  # noqa: F401  (installs the device)
from npukit.npu_backend.torch_npu_shim import install_torch_npu

torch_npu = install_torch_npu()
TARGET = 1.2
MIN_BLOCK_SECONDS = 0.02


def rms_norm_case(device, dtype=torch.float32):
    x = torch.randn(8, 128, 512, device=device, dtype=dtype, requires_grad=True)
    gamma = torch.randn(512, device=device, dtype=dtype, requires_grad=True)

    def fused():
        return torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6)[0]

    def unfused():
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    return fused, unfused


def swiglu_case(device, dtype=torch.float32):
    x = torch.randn(8, 128, 2048, device=device, dtype=dtype, requires_grad=True)

    def fused():
        return torch_npu.npu_swiglu(x, dim=-1)

    def unfused():
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
    return fused, unfused


def rotary_case(device, dtype=torch.float32):
    x = torch.randn(4, 16, 128, 64, device=device, dtype=dtype, requires_grad=True)
    cos = torch.randn(1, 1, 128, 64, device=device, dtype=dtype)
    sin = torch.randn(1, 1, 128, 64, device=device, dtype=dtype)

    def fused():
        return torch_npu.npu_rotary_mul(x, cos, sin)

    def unfused():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return fused, unfused


def attention_case(device, dtype=torch.float32):
    b, n, s, d = 2, 8, 256, 64
    q, k, v = (torch.randn(b, n, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)  # True = masked
    scale = d ** -0.5

    def fused():
        return torch_npu.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=mask, scale=scale)[0]

    def unfused():
        scores = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
    return fused, unfused


def scaled_masked_softmax_case(device, dtype=torch.float32):
    x = torch.randn(4, 8, 128, 128, device=device, dtype=dtype, requires_grad=True)
    mask = torch.rand(4, 1, 128, 128, device=device) > 0.8

    def fused():
        return torch_npu.npu_scaled_masked_softmax(x, mask, 0.5)

    def unfused():
        return torch.softmax((x * 0.5).masked_fill(mask, -10000.0), dim=-1)
    return fused, unfused


def grouped_matmul_case(device, dtype=torch.float32):
    """Forward only: torch_npu 2.13 gives npu_grouped_matmul no backward (training code wraps it in
    an autograd.Function of its own, calling it again for the gradients)."""
    experts, m_per, k, n = 8, 64, 256, 256
    x = torch.randn(experts * m_per, k, device=device, dtype=dtype)
    w = torch.randn(experts, k, n, device=device, dtype=dtype)
    group_list = torch.arange(1, experts + 1, device=device) * m_per  # cumsum form

    def fused():
        return torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2, group_type=0,
                                            group_list_type=0)[0]

    def unfused():
        return torch.cat([x[i * m_per:(i + 1) * m_per] @ w[i] for i in range(experts)])
    return fused, unfused


CASES = {"npu_rms_norm": (rms_norm_case, "npu_rms_norm"), "npu_swiglu": (swiglu_case, "npu_swiglu"),
         "npu_rotary_mul": (rotary_case, "npu_rotary_mul"),
         "npu_fusion_attention": (attention_case, "npu_fusion_attention"),
         "npu_scaled_masked_softmax": (scaled_masked_softmax_case, "npu_scaled_masked_softmax"),
         "npu_grouped_matmul": (grouped_matmul_case, "npu_grouped_matmul")}


def _time_block(fn) -> float:
    """Seconds per forward+backward call (forward only where nothing requires grad), over a block of
    at least MIN_BLOCK_SECONDS."""
    calls, start = 0, time.perf_counter()
    while True:
        out = fn()
        if out.requires_grad:
            out.sum().backward()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_BLOCK_SECONDS and calls >= 3:
            return elapsed / calls


def ratio(make_case, repeats: int, dtype: torch.dtype) -> tuple[float, float, float]:
    fused, _ = make_case("npu", dtype)
    _, unfused = make_case("cpu", dtype)
    for fn in (fused, unfused):  # warm-up: allocator, first-call caches
        _time_block(fn)
    fused_times, unfused_times = [], []
    for _ in range(repeats):
        unfused_times.append(_time_block(unfused))
        fused_times.append(_time_block(fused))
    f, u = statistics.median(fused_times), statistics.median(unfused_times)
    return f / u, f, u


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default=None, help="one case, by op name")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16", help="comma-separated torch dtypes")
    args = parser.parse_args()
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",")]
    torch.set_num_threads(1)
    failed = 0
    print(f"{'fused op (fwd+bwd)':<28} {'dtype':<9} {'npu fused ms':>12} {'cpu unfused ms':>14} {'ratio':>7}  "
          f"target <= {TARGET}")
    for name, (make_case, op) in CASES.items():
        if args.only and args.only != name:
            continue
        if not hasattr(torch.ops.npu, op):
            print(f"{name:<28} not emulated in this checkout")
            continue
        for dtype in dtypes:
            r, f, u = ratio(make_case, args.repeats, dtype)
            ok = r <= TARGET and math.isfinite(r)
            failed += not ok
            print(f"{name:<28} {str(dtype).replace('torch.', ''):<9} {f * 1e3:>12.3f} {u * 1e3:>14.3f} {r:>7.3f}  "
                  f"{'ok' if ok else 'OVER TARGET'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
