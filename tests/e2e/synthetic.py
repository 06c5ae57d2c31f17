"""A large npu-compare result made up without running a model: the load-time check of the HTML page.

`synthetic_result(rows=100_000)` builds a CompareResult the way compare_dirs would for a deep
transformer-like model (blocks of attention and MLP linears and norms; forward, backward and
parameter-gradient rows; one block's mlp.fc2 diverges) and writes the construct.json its tree is
read from, so that the page goes through the real write_html, tree and all.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from npukit.accuracy.compare import ERROR, PASS, WARN, CompareResult, Divergence, PairResult, Row, Thresholds
from npukit.accuracy.dumpfile import TensorLeaf
from npukit.accuracy.metrics import PairMetrics

LEAVES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc1", "mlp.fc2", "norm1", "norm2")
PAIR = "step0/rank0"


def _leaf(name: str, suffix: str, shape=(4, 512, 1024)) -> TensorLeaf:
    return TensorLeaf(f"{name}.{suffix}", "torch.bfloat16", shape, (3.0, -3.0, 0.01, 40.0), None, None, True,
                      None, None, None, suffix)


def synthetic_result(folder: Path, rows: int = 100_000, diverging_block: int | None = None,
                     seed: int = 0) -> CompareResult:
    """About `rows` rows (a whole number of blocks more); folder gets golden/ and target/ with construct.json."""
    rng = random.Random(seed)
    golden_dir, target_dir = Path(folder) / "golden", Path(folder) / "target"
    for side in (golden_dir, target_dir):
        side.mkdir(parents=True, exist_ok=True)
    construct: dict[str, str | None] = {"Module.Model.forward.0": None}
    made: list[Row] = []
    order = 0
    calls = {"linear": 0, "layer_norm": 0}
    blocks = max(1, -(-rows // (len(LEAVES) * 14 + 5)))  # rows per block: 14 per leaf module, 5 of its own
    diverging_block = blocks * 2 // 3 if diverging_block is None else diverging_block
    divergence = None

    def add(entry: str, suffixes: list[str], parent: str | None, error_scale: float) -> None:
        nonlocal order
        if parent is not None or entry not in construct:
            construct[entry] = parent
        for suffix in suffixes:
            role = "param" if suffix.startswith("parameters") else suffix.split(".")[0]
            error = error_scale * rng.uniform(0.2, 1.5)
            verdict = ERROR if error > 0.3 else WARN if error > 8e-3 else PASS
            metrics = PairMetrics(1 << 20, 1 - error * error / 2, error, -20.0, error * 40, error * 9, error * 30,
                                  max(0.0, 1 - error * 50), max(0.0, 1 - error * 10), None, 0, 0, 0,
                                  (3.0, -3.0, 0.01, 40.0), (3.0, -3.0, 0.01, 40.0 * (1 + error)))
            made.append(Row(PAIR, order, entry, entry, _leaf(entry, suffix), _leaf(entry, suffix), role, "bf16",
                            metrics, error, verdict, "" if verdict == PASS else "relative L2 above the bf16 limit"))
        order += 1

    for block in range(blocks):
        block_entry = f"Module.layers.{block}.Block.forward.0"
        for leaf in LEAVES:
            kind = "layer_norm" if leaf.startswith("norm") else "linear"
            cls = "LayerNorm" if kind == "layer_norm" else "Linear"
            module = f"Module.layers.{block}.{leaf}.{cls}"
            parent = f"Module.layers.{block}.{leaf.split('.')[0]}.{'Attention' if leaf.startswith('attn') else 'MLP'}.forward.0"
            if leaf.startswith("norm"):
                parent = block_entry
            else:
                construct.setdefault(parent, block_entry)
            scale = 3e-3
            if block == diverging_block and leaf == "mlp.fc2":
                scale = 0.5
            elif block > diverging_block:
                scale = 0.05
            api = f"Functional.{kind}.{calls[kind]}.forward"
            calls[kind] += 1
            add(api, ["input.0", "input.1", "input.2", "output.0"], f"{module}.forward.0", scale)
            if scale == 0.5 and divergence is None:
                divergence = Divergence(PAIR, api, api, "output error 0.5 is 160x its input error 0.003",
                                        f"layers.{block}.{leaf}", ["File model.py, line 42, in forward"], 0.003, 0.5)
            add(f"{module}.forward.0", ["input.0", "output.0", "parameters.weight", "parameters.bias"], parent, scale)
            add(api.replace(".forward", ".backward"), ["input.0", "output.0", "output.1", "output.2"],
                f"{module}.backward.0", scale)
            add(f"{module}.parameters_grad.0", ["weight", "bias"], None, scale)
        add(f"Tensor.__add__.{block}.forward", ["input.0", "input.1", "output.0"], block_entry, 3e-3)
        add(block_entry, ["input.0", "output.0"], "Module.Model.forward.0", 3e-3)
    add("Module.Model.forward.0", ["input.0", "output.0"], None, 3e-3)
    add("Functional.cross_entropy.0.forward", ["input.0", "input.1", "output.0"], None, 3e-3)
    (target_dir / "construct.json").write_text(json.dumps(construct))
    pair = PairResult(PAIR, PAIR, golden_dir, target_dir, "tensor", made, divergence, [], [], False)
    return CompareResult(golden_dir, target_dir, [pair], Thresholds())


if __name__ == "__main__":
    import sys
    import time

    from npukit.accuracy.report import write_html

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "synthetic-report")
    start = time.perf_counter()
    result = synthetic_result(out)
    write_html(result, out / "report.html")
    print(f"{len(result.rows)} rows -> {out / 'report.html'} ({(out / 'report.html').stat().st_size / 1e6:.1f} MB)"
          f" in {time.perf_counter() - start:.1f} s")
