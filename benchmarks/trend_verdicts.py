"""How often `npu-compare --trend` is right: clean NPU runs (no departure) and runs with a late
NPU-only fault (departure named at the fault's module, at a step within a few of its onset).

    python benchmarks/trend_verdicts.py [--steps 240] [--models mlp,norm,residual,deep] [--seed 0] [--seeds 1]
                                        [--jobs 2] [--json out.json]
    python benchmarks/trend_verdicts.py --models norm --keep /tmp/runs   # the monitors kept, to look at a verdict

Each scenario is a small model of its own (below) trained `--steps` steps on fixed random data, with
SGD (momentum 0.9) or AdamW, on the emulated NPU under fp16 autocast (with GradScaler) or bf16
autocast; the learning rate drops 20x at half the run, so late updates are small. Per scenario:
the golden run (`--golden` numerics, fp32), the golden run rounded at the NPU run's precision twice
(the perturbed golden runs of `npu-run --golden-perturb`, `--perturb-seed` 0 and 1), and four NPU
runs, each judged on the band of the first perturbed run alone and on that of both:

- clean: nothing injected; the verdict is right when --trend names no departure;
- lost: from the onset (3/4 of the run) the target module's weight takes a pure-bf16 optimizer step
  (kept in bf16, the update rounded to bf16 and added in bf16: updates under half an ulp are lost);
- accumulate: from the onset the target module's weight gradient is summed over the batch in the
  run's low precision (fp16/bf16) instead of fp32 (a missing fp32 accumulator, 16 terms);
- state: from the onset the target module's optimizer state (SGD's momentum, AdamW's m and v) is
  kept in bf16 (AdamW's v decays by 0.1% a step, under half a bf16 ulp: it stops decaying).

A fault's verdict is right when the first departure is at the target module and its first step is
within `--within` monitored steps after the onset; a departure before the onset is a false alarm.
Prints the false-alarm rate on clean runs; per fault kind the right-verdict rate, how many were
named at the target module at any step after the onset (and how many steps after), how many
departed before it or not at all; then every wrong verdict with its scenario. The accumulate and
the SGD state faults are about as large as benign rounding (16 terms summed in the compute dtype;
a momentum rounded to bf16 is a relative error of 2^-9, like the perturbed run's): they measure
what the band does not catch rather than what it should.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path

MODELS = ("mlp", "norm", "residual", "deep")
OPTIMIZERS = ("sgd", "adamw")
DTYPES = ("fp16", "bf16")
FAULTS = ("lost", "accumulate", "state")
BANDS = (1, 2)  # perturbed golden runs the band rests on: GOLDEN.perturbed, then also GOLDEN.perturbed.1
TARGET = {"mlp": "fc2", "norm": "embed", "residual": "blocks.1.up", "deep": "layers.2"}  # the faulty module


def build(model: str):
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.fc3(self.fc2(self.fc1(x).tanh()).tanh())

    class Norm(nn.Module):  # readings and an unnormalized elapsed-time feature, through a LayerNorm
        def __init__(self):
            super().__init__()
            self.embed, self.norm, self.head = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.norm(self.embed(x)).tanh())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.blocks, self.out = nn.Linear(16, 32), nn.ModuleList([Block(), Block()]), nn.Linear(32, 4)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            widths = (16, 48, 48, 48, 4)
            self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

        def forward(self, x):
            for layer in self.layers[:-1]:
                x = nn.functional.silu(layer(x))
            return self.layers[-1](x)

    return {"mlp": MLP, "norm": Norm, "residual": Residual, "deep": Deep}[model]()


class AccumulateInLowPrecision:
    """The target Linear's weight gradient recomputed as a running sum over the batch in `dtype`."""

    def __init__(self, module, dtype) -> None:
        self.module, self.dtype, self.saved = module, dtype, None
        module.register_forward_hook(self._forward)

    def _forward(self, module, inputs, output) -> None:
        if output.requires_grad:
            x = inputs[0].detach()
            output.register_hook(lambda grad: setattr(self, "saved", (x, grad.detach())))

    def apply(self) -> None:
        import torch

        x, grad = self.saved
        x, grad = x.reshape(-1, x.shape[-1]).to(self.dtype), grad.reshape(-1, grad.shape[-1]).to(self.dtype)
        total = torch.zeros_like(self.module.weight, dtype=self.dtype)
        for row in range(x.shape[0]):
            total = total + torch.outer(grad[row], x[row])
        self.module.weight.grad.copy_(total.float())


def train(out: Path, scenario: dict, run: str, perturb_seed: int = 0) -> None:
    """`run`: golden, perturbed (with `perturb_seed`), clean, lost or accumulate (see the module docstring)."""
    import torch

    import npukit.npu_backend  # noqa: F401
    from npukit.accuracy.monitor import MonitorSession
    from npukit.accuracy.perturb import PerturbSession
    from npukit.npu_backend import numerics

    steps, dtype_name = scenario["steps"], scenario["dtype"]
    dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
    onset = steps * 3 // 4
    torch.manual_seed(scenario["seed"])
    model = build(scenario["model"]).to("npu")
    target = model.get_submodule(TARGET[scenario["model"]])
    data = torch.Generator().manual_seed(scenario["seed"] + 1)
    inputs, targets = torch.randn(128, 16, generator=data), torch.randn(128, 4, generator=data)
    if scenario["model"] == "norm":
        inputs[:, -1] = torch.arange(128) * 0.5  # the elapsed time, unnormalized
    inputs, targets = inputs.to("npu"), targets.to("npu")
    if scenario["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [steps // 2], gamma=0.05)
    golden = run in ("golden", "perturbed")
    scaler = torch.amp.GradScaler("npu", init_scale=1024.0, enabled=dtype_name == "fp16")
    accumulate = AccumulateInLowPrecision(target, dtype) if run == "accumulate" else None
    with contextlib.ExitStack() as stack:
        if golden:
            stack.enter_context(numerics.golden())
        stack.enter_context(MonitorSession(out, rank=0, tensorboard=False))
        if run == "perturbed":
            stack.enter_context(PerturbSession(dtype_name, seed=perturb_seed, rank=0))
        for step in range(steps):
            start = (step * 16) % 128
            x, y = inputs[start:start + 16], targets[start:start + 16]
            with torch.autocast("npu", dtype=dtype, enabled=not golden):
                loss = (model(x).float() - y).square().mean()
            scaler.scale(loss).backward()
            faulty = step >= onset
            if accumulate is not None and faulty:
                accumulate.apply()
            before = target.weight.detach().clone() if run == "lost" and faulty else None
            scaler.step(optimizer)
            scaler.update()
            if run == "state" and faulty:
                with torch.no_grad():
                    for value in optimizer.state[target.weight].values():
                        if value.is_floating_point() and value.dim():
                            value.copy_(value.to(torch.bfloat16).float())
            if before is not None:  # a pure-bf16 step: the weight held in bf16, the update added in bf16
                with torch.no_grad():
                    update = (target.weight - before).to(torch.bfloat16)
                    target.weight.copy_((before.to(torch.bfloat16) + update).float())
            optimizer.zero_grad()
            schedule.step()


def judge(scenario: dict) -> list[dict]:
    """The NPU runs' verdicts of one scenario, on the band of one perturbed run and on that of two."""
    import torch

    from npukit.accuracy.trend import compare_trend

    torch.set_num_threads(1)
    name = f"{scenario['model']}-{scenario['optimizer']}-{scenario['dtype']}-{scenario['seed']}"
    with contextlib.ExitStack() as stack:
        if scenario["keep"]:
            work = Path(scenario["keep"]) / name
            shutil.rmtree(work, ignore_errors=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trend_verdicts_")))
        train(work / "golden", scenario, "golden")
        perturbed = [work / "golden.perturbed", work / "golden.perturbed.1"]
        for seed, folder in enumerate(perturbed):
            train(folder, scenario, "perturbed", perturb_seed=seed)
        onset = scenario["steps"] * 3 // 4
        verdicts = []
        for run, bands in product(("clean", *FAULTS), BANDS):
            if not (work / run).exists():
                train(work / run, scenario, run)
            result = compare_trend(work / "golden", work / run, perturbed[:bands])
            first = result.first()
            verdict = {**scenario, "run": run, "bands": bands, "departure": None}
            if first is not None:
                verdict["departure"] = {"step": first.first_step, "module": first.module(), "what": first.what()}
            if run == "clean":
                verdict["right"] = first is None
            else:
                verdict["right"] = (first is not None and first.module() == TARGET[scenario["model"]]
                                    and onset <= first.first_step <= onset + scenario["within"])
                verdict["early"] = first is not None and first.first_step < onset
            verdicts.append(verdict)
        return verdicts


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--within", type=int, default=10, help="monitored steps after the onset a fault may be named")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", type=int, default=1, help="scenarios per model, optimizer and dtype")
    parser.add_argument("--seed", type=int, default=0, help="the first scenario seed (initial weights and data)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep each scenario's monitors in DIR/<model>-<optimizer>-<dtype>-<seed>")
    options = parser.parse_args()
    models = options.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    scenarios = [{"model": m, "optimizer": o, "dtype": d, "seed": s, "steps": options.steps, "within": options.within,
                  "keep": str(options.keep) if options.keep else None}
                 for s, m, o, d in product(range(options.seed, options.seed + options.seeds), models, OPTIMIZERS, DTYPES)]
    began = time.perf_counter()
    with ProcessPoolExecutor(options.jobs) as pool:
        verdicts = [v for batch in pool.map(judge, scenarios) for v in batch]
    seconds = time.perf_counter() - began
    onset = options.steps * 3 // 4
    print(f"{len(scenarios)} scenarios ({', '.join(models)} x SGD/AdamW x fp16/bf16, {options.steps} steps, "
          f"fault onset at step {options.steps * 3 // 4}), {seconds:.0f} s")
    for bands in BANDS:
        print(f"-- the band of {bands} perturbed golden run(s):")
        clean = [v for v in verdicts if v["run"] == "clean" and v["bands"] == bands]
        print(f"clean runs without a departure: {_rate(sum(v['right'] for v in clean), len(clean))}")
        for fault in FAULTS:
            runs = [v for v in verdicts if v["run"] == fault and v["bands"] == bands]
            at_module = [v["departure"]["step"] - onset for v in runs if v["departure"] and not v["early"]
                         and v["departure"]["module"] == TARGET[v["model"]]]
            delays = f" (steps after the onset: median {statistics.median(at_module):g}, most {max(at_module)})" \
                if at_module else ""
            print(f"{fault}: named at the module within {options.within} steps of the onset "
                  f"{_rate(sum(v['right'] for v in runs), len(runs))}, at any later step "
                  f"{_rate(len(at_module), len(runs))}{delays}; departure before the onset "
                  f"{_rate(sum(v['early'] for v in runs), len(runs))}; "
                  f"none {_rate(sum(v['departure'] is None for v in runs), len(runs))}")
    wrong = [v for v in verdicts if not v["right"]]
    for v in wrong:
        said = v["departure"]
        print(f"  wrong ({v['bands']} perturbed): {v['model']} {v['optimizer']} {v['dtype']} seed {v['seed']} {v['run']}: "
              + (f"step {said['step']} in {said['module']} ({said['what']})" if said else "no departure")
              + (f" (target {TARGET[v['model']]})" if v["run"] != "clean" else ""))
    if options.json:
        options.json.write_text(json.dumps(verdicts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
