"""The Hugging Face stack as Ascend users run it, on the emulated NPU (#30).

transformers' Trainer, accelerate, peft's LoRA and DeepSpeed detect the NPU through `torch_npu`
(`importlib.util.find_spec`, `torch.npu`) and run on it unchanged, under `npu-run` as a user runs a
script: tiny Llama, Mixtral and Qwen2-MoE models built from configs (nothing is downloaded), eager,
sdpa and flash_attention_2 attention (the last through torch_npu.npu_fusion_attention), fp32, fp16
and bf16, train + evaluate + predict, on one rank and on two (`npu-run --nproc-per-node 2`);
DeepSpeed's ZeRO stages; Python processes started under npu-run or `pytest --npu` (`accelerate
launch`) on the emulated NPU too. docs/huggingface.md describes what runs.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import npukit.npu_backend

# A real-code suite (transformers, accelerate, peft, DeepSpeed): `make test` runs it after the main suite.
pytestmark = pytest.mark.slow

NPU_RUN = Path(sys.executable).with_name("npu-run")

# Trains tiny models with the Trainer (`--models`, `--attn`, `--precision` are comma lists: every
# combination runs in the one process). Prints a DETECT line (what transformers and accelerate see)
# and one RESULT line of JSON per run and rank: the logged losses, the eval loss before and after,
# the predictions' shape; with --lora, what was trained and whether a saved adapter reloads equal.
HF_TRAIN = r'''
import argparse
import json
import math
import os

import torch
import transformers
from accelerate import PartialState
from transformers import Trainer, TrainingArguments
from transformers.utils import is_torch_npu_available

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="llama")
parser.add_argument("--attn", default="sdpa")
parser.add_argument("--precision", default="fp32")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=2e-2)
parser.add_argument("--lora", action="store_true")
parser.add_argument("--cpu", action="store_true")
parser.add_argument("--deepspeed", help="a DeepSpeed config file for the Trainer")
parser.add_argument("--out", required=True)
args = parser.parse_args()

state = PartialState(cpu=args.cpu)
print("DETECT " + json.dumps({"rank": state.process_index, "npu_available": is_torch_npu_available(),
                              "accelerate_device": str(state.device),
                              "placed_on": str(torch.zeros(1, device=state.device).device),
                              "ascend_home": os.environ.get("ASCEND_HOME_PATH"),
                              "backend": state.backend}), flush=True)

VOCAB, LENGTH, SAMPLES = 64, 16, 32
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH)
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)),
}


class Sequences(torch.utils.data.Dataset):
    """Token sequences a model learns in a few steps: every odd token is the one before plus one."""

    def __init__(self):
        tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1))
        tokens[:, 1::2] = (tokens[:, 0::2] + 1) % VOCAB
        self.tokens = tokens

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def base_model(kind, attn):
    config_class, model_class, extra = MODELS[kind]
    torch.manual_seed(0)
    return model_class(config_class(**TINY, **extra, attn_implementation=attn))


def build(kind, attn):
    model = base_model(kind, attn)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    return model


for kind in args.models.split(","):
    for attn in args.attn.split(","):
        for precision in args.precision.split(","):
            model = build(kind, attn)
            frozen_before = {name: p.detach().cpu().clone() for name, p in model.named_parameters()
                             if not p.requires_grad}
            training = TrainingArguments(
                output_dir=args.out, per_device_train_batch_size=8, per_device_eval_batch_size=4,
                max_steps=args.steps, learning_rate=args.lr, warmup_steps=0, logging_steps=1, report_to=[],
                save_strategy="no", fp16=precision == "fp16", bf16=precision == "bf16", use_cpu=args.cpu,
                seed=0, data_seed=0, deepspeed=args.deepspeed, dataloader_num_workers=0, disable_tqdm=True)
            trainer = Trainer(model=model, args=training, train_dataset=Sequences(), eval_dataset=Sequences())
            # (the Trainer evaluates with DeepSpeed only once it has trained, or under ZeRO-3)
            eval_loss_before = None if args.deepspeed else trainer.evaluate()["eval_loss"]
            trainer.train()
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            evaluation = trainer.evaluate()
            prediction = trainer.predict(Sequences())
            result = {
                "tag": f"{kind}/{attn}/{precision}" + ("/lora" if args.lora else ""),
                "rank": training.process_index, "world": training.world_size,
                "device": str(training.device), "parameters": str(next(model.parameters()).device),
                "losses": losses, "eval_loss_before": eval_loss_before,
                "eval_loss": evaluation["eval_loss"],
                "predictions": list(prediction.predictions.shape),
                "finite_predictions": bool(torch.isfinite(torch.as_tensor(prediction.predictions)).all()),
            }
            if args.lora:
                trainable = [name for name, p in model.named_parameters() if p.requires_grad]
                result["trainable"] = sorted({part for name in trainable for part in name.split(".")
                                              if part.startswith("lora_")})
                result["frozen_unchanged"] = all(
                    torch.equal(p.detach().cpu(), frozen_before[name])
                    for name, p in model.named_parameters() if name in frozen_before)
                # the adapter a user saves and loads again computes the same logits
                model.save_pretrained(f"{args.out}/adapter")
                from peft import PeftModel

                reloaded = PeftModel.from_pretrained(base_model(kind, attn), f"{args.out}/adapter")
                reloaded.to(training.device)
                batch = Sequences().tokens[:2].to(training.device)
                model.eval()
                reloaded.eval()
                # the Trainer left the trained model's forward under autocast in fp16/bf16
                low_precision = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
                with torch.no_grad():
                    trained_logits = model(input_ids=batch).logits.float()
                    with torch.autocast(training.device.type, dtype=low_precision,
                                        enabled=low_precision is not None):
                        reloaded_logits = reloaded(input_ids=batch).logits.float()
                result["reloaded_equal"] = bool(torch.allclose(trained_logits, reloaded_logits, atol=1e-5))
            assert all(math.isfinite(loss) for loss in losses), losses
            print("RESULT " + json.dumps(result), flush=True)
'''

# Two ranks of accelerate as a metrics loop uses it: gather and gather_for_metrics of 2-D tensors
# (the last batch of an uneven dataset padded by the sampler and its duplicates dropped again),
# pad_across_processes of ragged tensors, reduce. Prints one GATHER line of JSON per rank.
ACCELERATE_GATHER = r'''
import json

import torch
from accelerate import Accelerator

accelerator = Accelerator()
rank = accelerator.process_index
rows = torch.arange(6, dtype=torch.float32, device=accelerator.device).reshape(2, 3) + 100 * rank
gathered = accelerator.gather(rows)

dataset = torch.utils.data.TensorDataset(torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3))
loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=4))
for_metrics = torch.cat([accelerator.gather_for_metrics(batch) for (batch,) in loader])

ragged = torch.full((rank + 1, 2), float(rank + 1), device=accelerator.device)
padded = accelerator.gather(accelerator.pad_across_processes(ragged, dim=0))
summed = accelerator.reduce(torch.ones(2, 2, device=accelerator.device) * (rank + 1), reduction="sum")
print("GATHER " + json.dumps({
    "rank": rank, "device": str(accelerator.device), "distributed": str(accelerator.distributed_type),
    "backend": accelerator.state.backend, "gathered": gathered.cpu().tolist(), "gathered_on": str(gathered.device),
    "for_metrics": for_metrics.cpu().tolist(), "padded": padded.cpu().tolist(), "summed": summed.cpu().tolist(),
}), flush=True)
# No destroy_process_group: the group is left to the interpreter's exit, as most scripts leave it.
'''


MARKERS = ("DETECT", "RESULT", "GATHER", "DEEPSPEED")


# DeepSpeed on two ranks: ZeRO stage x precision (comma lists) in one process, 5 AdamW steps of a
# small MLP each; one DEEPSPEED line per stage, precision and rank (losses, replicas equal after).
DEEPSPEED_TRAIN = r'''
import json
import sys
import traceback

import deepspeed
import torch

deepspeed.init_distributed(dist_backend="hccl")
for stage in map(int, sys.argv[1].split(",")):
    for precision in sys.argv[2].split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  "zero_optimization": {"stage": stage},
                  "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
                  "bf16": {"enabled": precision == "bf16"}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        generator = torch.Generator().manual_seed(engine.global_rank)
        inputs = torch.randn(4, 16, generator=generator).to(engine.device)
        targets = torch.randn(4, 4, generator=generator).to(engine.device)
        losses = []
        try:
            for _ in range(5):
                loss = torch.nn.functional.mse_loss(engine(inputs.to(engine.module[0].weight.dtype)).float(),
                                                    targets)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        except RuntimeError as error:  # reported, and the next configuration runs
            print("DEEPSPEED " + json.dumps({"rank": engine.global_rank, "stage": stage, "precision": precision,
                                             "error": str(error).splitlines()[0],
                                             "where": traceback.extract_tb(error.__traceback__)[-1].name,
                                             "frames": [f.name for f in traceback.extract_tb(error.__traceback__)]}),
                  flush=True)
            continue
        weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(2)]
        torch.distributed.all_gather(everyone, weights)
        print("DEEPSPEED " + json.dumps({
            "rank": engine.global_rank, "stage": stage, "precision": precision, "device": str(engine.device),
            "weights_on": str(weights.device), "losses": losses, "replicas_equal": torch.equal(*everyone)}),
            flush=True)
'''


def _records(stdout: str) -> dict[str, list[dict]]:
    """The JSON records the scripts print after a marker (two ranks' lines may share one line)."""
    records = {marker: [] for marker in MARKERS}
    decoder = json.JSONDecoder()
    for match in re.finditer(rf"({'|'.join(MARKERS)}) (?=\{{)", stdout):
        records[match.group(1)].append(decoder.raw_decode(stdout, match.end())[0])
    return records


def _run(command: list[str], tmp_path: Path, timeout: int = 300):
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                       TOKENIZERS_PARALLELISM="false")
    environment.pop("NPUKIT_EMULATE", None)  # the CPU reference stays on the CPU; npu-run sets it itself
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=environment,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    records = _records(result.stdout)
    return records["DETECT"], records["RESULT"] + records["GATHER"] + records["DEEPSPEED"]


def train(tmp_path: Path, *options: str, ranks: int = 1, cpu: bool = False):
    script = tmp_path / "hf_train.py"
    script.write_text(HF_TRAIN)
    arguments = [str(script), "--out", str(tmp_path / "out"), *options]
    if cpu:  # the reference: plain python, no torch_npu anywhere
        return _run([sys.executable, *arguments, "--cpu"], tmp_path)
    launcher = [str(NPU_RUN)] + (["--nproc-per-node", str(ranks)] if ranks > 1 else [])
    return _run(launcher + arguments, tmp_path)


def assert_learned(run: dict) -> None:
    losses = run["losses"]
    assert losses and all(torch.isfinite(torch.tensor(losses))), run
    if run["eval_loss_before"] is not None:
        assert run["eval_loss"] < run["eval_loss_before"] - 0.05, run
    assert losses[-1] < losses[0], run
    assert run["finite_predictions"], run
    assert run["predictions"] == [32, 16, 64], run  # every sample once, (batch, sequence, vocabulary)


def fusion_attention_emulated() -> bool:
    from npukit.npu_backend import fused

    return any(op.name == "npu_fusion_attention" for op in fused.public_ops())


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    # fp32 on the CPU, the same seeds: the first loss an NPU run must reproduce
    _, runs = train(tmp_path_factory.mktemp("cpu"), "--models", "llama,mixtral,qwen2_moe", "--attn",
                    "eager,sdpa", "--precision", "fp32", "--steps", "1", cpu=True)
    return {run["tag"]: run for run in runs}


def test_llama_trains_evaluates_predicts_on_one_npu_in_every_precision(tmp_path, cpu_reference):
    detected, runs = train(tmp_path, "--models", "llama", "--attn", "eager,sdpa", "--precision", "fp32,fp16,bf16")
    assert detected == [{"rank": 0, "npu_available": True, "accelerate_device": "npu", "placed_on": "npu:0",
                         "ascend_home": str(Path(npukit.npu_backend.__file__).parent), "backend": None}]
    assert len(runs) == 6
    for run in runs:
        assert run["device"] == run["parameters"] == "npu:0", run
        assert_learned(run)
        if run["tag"].endswith("fp32"):
            reference = cpu_reference[run["tag"]]
            assert reference["device"] == "cpu"
            assert run["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5, abs=1e-6), run["tag"]


def test_moe_models_train_on_one_npu(tmp_path, cpu_reference):
    # MoE experts count tokens per expert with torch.histc of int ids on every device but cpu/mps
    detected, runs = train(tmp_path, "--models", "mixtral,qwen2_moe", "--attn", "sdpa",
                           "--precision", "fp32,fp16,bf16")
    _, eager = train(tmp_path, "--models", "mixtral", "--attn", "eager", "--precision", "fp32")
    assert detected[0]["npu_available"]
    assert len(runs) == 6 and len(eager) == 1
    for run in runs + eager:
        assert run["device"] == run["parameters"] == "npu:0", run
        assert_learned(run)
        if run["tag"].endswith("fp32"):
            assert run["losses"][0] == pytest.approx(cpu_reference[run["tag"]]["losses"][0], rel=1e-5, abs=1e-6)


def test_peft_lora_trains_only_the_adapter_and_reloads(tmp_path):
    _, runs = train(tmp_path, "--models", "llama", "--attn", "sdpa", "--precision", "fp32,bf16", "--lora",
                    "--lr", "3e-2")
    assert len(runs) == 2
    for run in runs:
        assert run["device"] == "npu:0", run
        assert_learned(run)
        assert run["trainable"] == ["lora_A", "lora_B"], run
        assert run["frozen_unchanged"] and run["reloaded_equal"], run


def test_flash_attention_2_runs_through_npu_fusion_attention(tmp_path, cpu_reference):
    if not fusion_attention_emulated():
        pytest.skip("torch_npu.npu_fusion_attention is not emulated yet: transformers' flash_attention_2 on "
                    "an NPU calls it")
    _, runs = train(tmp_path, "--models", "llama,mixtral", "--attn", "flash_attention_2",
                    "--precision", "fp32,fp16,bf16")
    assert len(runs) == 6
    for run in runs:
        assert run["device"] == "npu:0", run
        assert_learned(run)
        if run["tag"].endswith("fp32"):  # the fused attention computes what the CPU's sdpa does
            reference = cpu_reference[run["tag"].replace("flash_attention_2", "sdpa")]
            assert run["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5, abs=1e-6), run["tag"]


def test_trainer_on_two_ranks(tmp_path):
    detected, runs = train(tmp_path, "--models", "llama,mixtral", "--attn", "sdpa", "--precision", "fp32,fp16",
                           ranks=2)
    assert sorted((d["rank"], d["accelerate_device"], d["backend"]) for d in detected) == [
        (0, "npu:0", "hccl"), (1, "npu:1", "hccl")]
    assert len(runs) == 8
    for run in runs:
        assert run["world"] == 2 and run["device"] == run["parameters"] == f"npu:{run['rank']}", run
        assert_learned(run)
    for tag in {run["tag"] for run in runs}:  # DDP: both ranks log the same (averaged) loss
        pair = [run for run in runs if run["tag"] == tag]
        assert pair[0]["eval_loss"] == pytest.approx(pair[1]["eval_loss"]), tag


def test_accelerate_gather_and_gather_for_metrics_of_2d_tensors_on_two_ranks(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(ACCELERATE_GATHER)
    _, runs = _run([str(NPU_RUN), "--nproc-per-node", "2", str(script)], tmp_path)
    assert sorted(run["rank"] for run in runs) == [0, 1]
    rows = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    dataset = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    for run in runs:
        assert run["device"] == run["gathered_on"] == f"npu:{run['rank']}", run
        assert (run["distributed"], run["backend"]) == ("DistributedType.MULTI_NPU", "hccl")
        assert run["gathered"] == rows + [[v + 100 for v in row] for row in rows]
        # every sample once: the sampler's padding of the last batch is dropped again
        assert sorted(map(tuple, run["for_metrics"])) == sorted(map(tuple, dataset.tolist()))
        assert run["padded"] == [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]
        assert run["summed"] == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float32])
def test_histc_counts_integer_tensors_on_the_npu(dtype):
    # The CPU kernel refuses integer input ("histogram_cpu" not implemented for 'Int'); the
    # device counts it in the input's dtype, as transformers' MoE experts need.
    ids = torch.tensor([0, 1, 1, 3, 3, 3, 7], dtype=dtype)
    counts = torch.histc(ids.npu(), bins=4, min=0, max=3)
    assert counts.device.type == "npu" and counts.dtype == dtype
    assert counts.cpu().tolist() == [1, 2, 0, 3]
    out = torch.empty(0, dtype=dtype, device="npu")
    torch.histc(ids.npu(), bins=4, min=0, max=3, out=out)
    assert out.cpu().tolist() == [1, 2, 0, 3]
    compiled = torch.compile(lambda t: torch.histc(t, bins=4, min=0, max=3), backend="npu", fullgraph=True)
    assert compiled(ids.npu()).cpu().tolist() == [1, 2, 0, 3]


def test_deepspeed_zero_1_and_2_train_on_two_ranks_and_zero_3_meets_hccl_float64_refusal(tmp_path):
    # deepspeed.init_distributed builds its NPU op builders, which read ASCEND_HOME_PATH (set by
    # CANN wherever torch_npu imports) with no default: a KeyError before the emulator set it.
    script = tmp_path / "deepspeed_train.py"
    script.write_text(DEEPSPEED_TRAIN)
    _, runs = _run([str(NPU_RUN), "--nproc-per-node", "2", str(script), "1,2,3", "fp32,fp16,bf16"], tmp_path)
    assert len(runs) == 18
    for run in runs:
        if run["stage"] == 3:
            # DeepSpeed 0.19.8's ZeRO-3 step all-reduces its gradient norm in float64
            # (get_norm_dtype(): every accelerator that has fp64), and HCCL reduces no float64 on
            # the chips emulated (Ascend910B; Atlas A5 adds it): ZeRO-3 stops at its first step.
            assert run["error"] == "HCCL allreduce: Unsupported data type at::kDouble", run
            assert "get_grad_norm_direct" in run["frames"], run
            continue
        assert run["device"] == run["weights_on"] == f"npu:{run['rank']}", run
        assert all(torch.isfinite(torch.tensor(run["losses"]))) and run["losses"][-1] < 0.6 * run["losses"][0], run
        assert run["replicas_equal"], run


def test_trainer_with_deepspeed_zero_2_on_two_ranks(tmp_path):
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
                                  "fp16": {"enabled": "auto"}}))
    _, runs = train(tmp_path, "--models", "llama", "--attn", "sdpa", "--precision", "bf16", "--deepspeed",
                    str(config), ranks=2)
    assert sorted(run["rank"] for run in runs) == [0, 1]
    for run in runs:
        assert run["device"] == run["parameters"] == f"npu:{run['rank']}", run
        assert_learned(run)
        assert run["eval_loss"] < run["losses"][0] - 0.3, run
    assert runs[0]["losses"] == runs[1]["losses"]


# A script's own child process: plain `python`, as accelerate launch, deepspeed and
# subprocess.run start them; it prints where torch_npu came from and where a tensor lands.
CHILD_PROCESS = r'''
import subprocess
import sys

child = subprocess.run([sys.executable, "-c", "import torch, torch_npu; "
                        "print('CHILD', torch_npu.__npukit__, torch.npu.device_count(), torch.ones(1, device='npu').device)"],
                       capture_output=True, text=True)
print(child.stdout.strip() or child.stderr[-2000:], flush=True)
'''


def test_python_processes_started_under_npu_run_have_the_emulated_npu(tmp_path):
    # On an Ascend host every process has torch_npu (torch loads it as a device backend):
    # accelerate's tests start `accelerate launch`, which failed in the child without it.
    script = tmp_path / "parent.py"
    script.write_text(CHILD_PROCESS)
    result = subprocess.run([str(NPU_RUN), "--devices", "3", str(script)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CHILD True 3 npu:0" in result.stdout, result.stdout + result.stderr


def test_accelerate_launch_from_a_test_under_pytest_npu_runs_on_the_emulated_npu(tmp_path):
    # accelerate's own test suite starts `accelerate launch` from its tests: under `pytest --npu`
    # the launcher and both ranks have the emulated NPU (torch_npu, hccl, npu:0 and npu:1).
    (tmp_path / "gather.py").write_text(ACCELERATE_GATHER)
    accelerate = Path(sys.executable).with_name("accelerate")
    (tmp_path / "test_launch.py").write_text(
        "import subprocess\n"
        "def test_launch():\n"
        f"    out = subprocess.run([{str(accelerate)!r}, 'launch', '--num_processes', '2', '--num_machines', '1',\n"
        "                          '--mixed_precision', 'no', '--dynamo_backend', 'no', 'gather.py'],\n"
        "                         capture_output=True, text=True)\n"
        "    print(out.stdout, out.stderr[-3000:])\n"
        "    assert out.returncode == 0\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--npu",
                             "--npu-devices", "2", "test_launch.py"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-6000:] + result.stderr[-3000:]
    runs = _records(result.stdout)["GATHER"]
    assert sorted((run["rank"], run["device"], run["backend"]) for run in runs) == [
        (0, "npu:0", "hccl"), (1, "npu:1", "hccl")]


def test_torch_alone_loads_no_emulator_without_the_switch(tmp_path):
    # The entry point is imported by every `import torch` where npukit is installed: without
    # NPUKIT_EMULATE it must leave the process as it was.
    environment = {k: v for k, v in os.environ.items() if k != "NPUKIT_EMULATE"}
    probe = ("import sys, torch; print('PROBE', hasattr(torch, 'npu'), 'torch_npu' in sys.modules, "
             "'npukit.npu_backend' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env=environment)
    assert "PROBE False False False" in result.stdout, result.stdout + result.stderr
