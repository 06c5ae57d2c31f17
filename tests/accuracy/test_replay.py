"""ReplaySession: the second run starts from the first run's weights and batches."""

import contextlib
import gc
import io
import json
import random
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from npukit.accuracy import replay
from npukit.accuracy.replay import ReplaySession
from npukit.errors import UserError


def script(seed, replay_dir, dtype=torch.float32, model_cls=None):
    """A training script whose weights and data depend on the seed."""
    torch.manual_seed(seed)
    with ReplaySession(replay_dir, batches=2) as session:
        model = (model_cls or (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
        losses, labels = [], []
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(dtype)).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            labels.append(y.tolist())
    return losses, labels, session


def test_second_run_replays_weights_and_batches(tmp_path):
    first, first_labels, recorder = script(1, tmp_path)
    assert not recorder.replaying and (tmp_path / "replay.json").is_file()
    second, second_labels, replayer = script(2, tmp_path)
    assert replayer.replaying and replayer.replayed_modules == 1 and replayer.replayed_batches == 2
    assert second == first and second_labels == first_labels
    unreplayed, _, _ = script(2, tmp_path / "fresh")
    assert unreplayed != first  # without replay the seed changes everything


def test_replay_into_bf16_model_rounds_the_recorded_values(tmp_path):
    first, _, _ = script(1, tmp_path)
    second, _, _ = script(2, tmp_path, dtype=torch.bfloat16)
    assert second == pytest.approx(first, rel=2e-2)


def test_different_model_is_a_clear_error(tmp_path):
    script(1, tmp_path)
    with pytest.raises(UserError, match="root module 0 was a Sequential .* now it is a Linear"):
        script(1, tmp_path, model_cls=lambda: nn.Linear(4, 2))


def loss_module_script(seed, replay_dir, steps=3, batches=2):
    """word_language_model's shape: an nn.Module loss called on the model's output, no DataLoader.
    Its data comes from a generator of its own (the global ones are set back at the first forward)."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed)
    with ReplaySession(replay_dir, batches=batches) as session:
        model = nn.Linear(4, 2)
        criterion = nn.MSELoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        for _ in range(steps):
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grads.append(model.weight.grad is not None)
            optimizer.step()
            losses.append(loss.item())
    return losses, grads, session


def test_loss_module_input_is_kept_and_backward_reaches_the_model(tmp_path):
    first, first_grads, _ = loss_module_script(1, tmp_path)
    second, second_grads, replayer = loss_module_script(2, tmp_path)
    assert first_grads == second_grads == [True, True, True]
    # The first `batches` forwards of each root (model and loss) are replayed: inputs and targets.
    assert second[:2] == first[:2] and second[2] != first[2]
    assert replayer.replayed_modules == 2  # the model, and the (parameterless) loss module
    manifest = json.loads((tmp_path / "replay.json").read_text())
    loss_inputs = [item["args"]["list"] for item in manifest["forward_inputs"] if item["module"] == 1]
    assert [args[0] for args in loss_inputs] == [{"activation": True, "dtype": "torch.float32", "shape": [8, 2]}] * 2
    assert all("tensor" in args[1] for args in loss_inputs)  # the targets are data: recorded


def test_outputs_of_a_root_forward_under_no_grad_are_not_substituted(tmp_path):
    def run(seed, offset):
        torch.manual_seed(seed)
        with ReplaySession(tmp_path, batches=1):
            body, head = nn.Linear(4, 4), nn.Linear(4, 1)
            x = torch.randn(2, 4)
            with torch.no_grad():
                body(x)  # first forward: weights saved / loaded
                body.weight.add_(offset)  # a run that diverges after the load
                features = body(x)
                return head(features), head(features[:, :])  # the output, and a view of it

    recorded = run(1, 0.0)
    replayed = run(2, 1.0)
    assert torch.equal(recorded[0], recorded[1]) and torch.equal(replayed[0], replayed[1])
    # Had head's input been replaced by the recording, the divergence would be hidden.
    assert not torch.allclose(recorded[0], replayed[0])


def test_leaf_input_that_requires_grad_keeps_its_gradient(tmp_path):
    def run(seed):
        torch.manual_seed(seed)
        with ReplaySession(tmp_path, batches=1):
            model = nn.Linear(4, 1)
            x = torch.randn(2, 4, requires_grad=True)
            model(x).sum().backward()
        return x.grad

    run(1)
    assert run(2) is not None


def test_each_rank_records_and_replays_in_its_own_folder(tmp_path, monkeypatch):
    results = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        results[rank], _, recorder = script(int(rank), tmp_path)
        assert not recorder.replaying and recorder.directory == tmp_path / f"rank{rank}"
    assert (tmp_path / "rank0" / "replay.json").is_file() and (tmp_path / "rank1" / "replay.json").is_file()
    assert not (tmp_path / "replay.json").exists() and not (tmp_path / "tensors").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        replayed, _, replayer = script(7, tmp_path)
        assert replayer.replaying and replayed == results[rank]
    monkeypatch.delenv("RANK")
    with pytest.raises(UserError, match="recorded per rank .*rank0, rank1.* --nproc-per-node"):
        script(7, tmp_path)


def test_single_process_recording_is_not_replayed_by_a_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    script(1, tmp_path)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match="recorded by a single process"):
        script(1, tmp_path)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UserError, match="RANK environment variable"):
        script(1, tmp_path / "other")


def training(seed, replay_dir, start_step, steps=5, optimizer_cls=torch.optim.Adam):
    """Adam over a shuffled DataLoader: weights, data order and optimizer state all depend on the seed."""
    torch.manual_seed(seed)
    with (ReplaySession(replay_dir, batches=1, start_step=start_step) if replay_dir else contextlib.nullcontext()) as session:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = optimizer_cls(model.parameters(), lr=0.05)
        loader = DataLoader(TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 2)), batch_size=4,
                            shuffle=True)
        losses, weights = [], []
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            weights.append(model[0].weight.detach().clone())
    return losses, weights, session


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.SGD])
def test_replay_from_a_later_step_starts_that_step_from_the_recorded_state(tmp_path, optimizer_cls):
    """--replay-step 3: the second run computes step 3 from the first run's weights, optimizer state
    (Adam's moments and step count, SGD's) and batch, whatever its own first 3 steps did."""
    if optimizer_cls is torch.optim.SGD:
        optimizer_cls = lambda parameters, lr: torch.optim.SGD(parameters, lr=lr, momentum=0.9)  # noqa: E731
    first, first_weights, recorder = training(1, tmp_path, 3, optimizer_cls=optimizer_cls)
    second, second_weights, replayer = training(2, tmp_path, 3, optimizer_cls=optimizer_cls)
    assert replayer.replayed_modules == 1 and replayer.replayed_optimizers == 1 and replayer.replayed_batches == 1
    assert second[:3] != first[:3]  # its own first steps
    assert second[3] == first[3]  # step 3 from the recorded state and batch
    assert torch.equal(second_weights[3], first_weights[3])  # and its update too (optimizer state replayed)
    unrecorded, _, _ = training(1, None, 0, optimizer_cls=optimizer_cls)
    assert unrecorded == first  # recording changes nothing in the recorded run


def test_replay_step_mismatch_and_a_run_too_short_are_clear_errors(tmp_path):
    training(1, tmp_path, 3)
    with pytest.raises(UserError, match="recorded at the start of step 3; replay it with --replay-step 3"):
        training(2, tmp_path, 2)
    with pytest.raises(UserError, match="--replay-step 9: the run ended after 5 training step"):
        training(1, tmp_path / "short", 9)
    assert not (tmp_path / "short" / "replay.json").exists()


def test_a_run_whose_script_failed_before_the_step_keeps_the_scripts_error(tmp_path):
    """npu-run tells the sessions the script failed (its traceback printed): the replay adds no error of
    its own that the step never started, and records nothing."""
    with ReplaySession(tmp_path, start_step=9) as session:
        session.mark_run_failed()
    assert not (tmp_path / "replay.json").exists()
    with pytest.raises(UserError, match="--replay-step 9: the run ended after 0 training step"):
        with ReplaySession(tmp_path, start_step=9):
            pass


def training_by_hand(seed, replay_dir, start_step, steps=5):
    """No optimizer: SGD written out (p -= lr * p.grad), a BatchNorm (its running statistics are
    buffers), a shuffled DataLoader and an evaluation forward (no gradients) after each update:
    weights, buffers and data order all depend on the seed."""
    gc.collect()  # an optimizer of an earlier test, left in a reference cycle, is one the scan would find
    torch.manual_seed(seed)
    with (ReplaySession(replay_dir, batches=1, start_step=start_step) if replay_dir else contextlib.nullcontext()) as session:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        loader = DataLoader(TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 2)), batch_size=4,
                            shuffle=True)
        losses, states = [], []
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.05 * parameter.grad
                    parameter.grad = None
                model.eval()
                model(x)
                model.train()
            losses.append(loss.item())
            states.append({key: value.clone() for key, value in model.state_dict().items()})
    return losses, states, session


def test_replay_from_a_later_step_without_an_optimizer_counts_its_models_forwards(tmp_path):
    """--replay-step 3 in a script that updates its weights by hand: step 3 starts as the model's
    fourth forward with gradients starts (the monitor's and the dump's step 3); the second run computes
    it from the first run's weights, buffers and batch, taken before that forward (the loop takes the
    batch first), whatever its own first 3 steps did."""
    first, first_states, recorder = training_by_hand(1, tmp_path, 3)
    second, second_states, replayer = training_by_hand(2, tmp_path, 3)
    assert replayer.replayed_modules == 1 and replayer.replayed_batches == 1 and replayer.replayed_optimizers == 0
    assert second[:3] != first[:3]  # its own first steps
    assert second[3] == first[3]  # step 3 from the recorded state and batch
    for key, value in first_states[3].items():  # and its update and running statistics too
        assert torch.equal(second_states[3][key], value), key
    unrecorded, _, _ = training_by_hand(1, None, 0)
    assert unrecorded == first  # recording changes nothing in the recorded run
    with pytest.raises(UserError, match="--replay-step 9: the run ended after 4 training step.*without an optimizer"):
        training_by_hand(1, tmp_path / "short", 9)


class Noise(nn.Module):
    """Randomness a script draws in its step from its device's, Python's and numpy's global generators
    (the emulated device's dropout draws from the CPU generator, torch.rand_like on it from its own)."""

    def forward(self, x):
        noise = np.random.standard_normal(tuple(x.shape)).astype(np.float32)
        return x * random.uniform(0.5, 1.5) + 0.1 * torch.from_numpy(noise).to(x.device) + 0.1 * torch.rand_like(x)


def dropout_training(seed, replay_dir, start_step, device="cpu", by_hand=False, steps=5):
    """Dropout (the device's generator), Noise (Python's and numpy's) and a shuffled DataLoader (the CPU
    generator), with Adam or, by_hand, SGD written out: every step draws random numbers."""
    gc.collect()  # an optimizer of an earlier test, left in a reference cycle, is one the scan would find
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    with ReplaySession(replay_dir, batches=1, start_step=start_step) as session:
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), Noise(), nn.Linear(16, 2)).to(device)
        optimizer = None if by_hand else torch.optim.Adam(model.parameters(), lr=0.05)
        loader = DataLoader(TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 2)), batch_size=4,
                            shuffle=True)
        losses = []
        for x, y in loader:
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            if optimizer is None:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter -= 0.05 * parameter.grad
                        parameter.grad = None
            else:
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses, session


@pytest.mark.parametrize("device,by_hand", [("cpu", False), ("npu", False), ("cpu", True)])
def test_replay_from_a_later_step_draws_the_recorded_runs_random_numbers(tmp_path, request, device, by_hand):
    """Step 3 replayed by a run seeded otherwise draws the same dropout mask (the CPU or npu generator)
    and the same Python and numpy numbers as the recorded run: it computes step 3 exactly as it did."""
    if device == "npu":
        request.getfixturevalue("npu")
    first, _ = dropout_training(1, tmp_path, 3, device, by_hand)
    second, replayer = dropout_training(2, tmp_path, 3, device, by_hand)
    assert replayer.replaying and replayer.replayed_modules == 1 and replayer.replayed_batches == 1
    assert replayer.replayed_generators
    assert second[:3] != first[:3]  # its own first steps
    assert second[3] == first[3]  # step 3 from the recorded state, batch and random number generators


def test_replay_from_the_first_step_draws_the_recorded_runs_random_numbers(tmp_path):
    first, _ = dropout_training(1, tmp_path, 0)
    second, _ = dropout_training(2, tmp_path, 0)
    assert second[0] == first[0] and second[1:] != first[1:]  # later batches are the run's own


def test_a_recording_without_generator_states_replays_the_rest_and_says_so_once(tmp_path, capsys):
    """A replay directory recorded before the generators' states were (an older npukit) still replays
    weights, optimizer state and batches; its random draws are the run's own, and it says so once."""
    first, _ = dropout_training(1, tmp_path, 3)
    manifest = json.loads((tmp_path / "replay.json").read_text())
    del manifest["rng"]
    (tmp_path / "replay.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    second, replayer = dropout_training(2, tmp_path, 3)
    assert replayer.replayed_modules == 1 and replayer.replayed_optimizers == 1 and replayer.replayed_batches == 1
    assert second[3] != first[3] and not replayer.replayed_generators  # other dropout masks and noise
    err = capsys.readouterr().err
    assert err.count("random number generators' states") == 1 and "not restored" in err


def test_a_recording_with_an_earlier_npukits_16_byte_npu_states_still_replays_them(tmp_path, npu, monkeypatch):
    """An earlier npukit recorded each npu generator's 16-byte state (seed, offset), read as
    torch.npu.get_rng_state() reads it (the recorded run then continued from it): set back as such,
    it draws what the recorded run drew."""
    with monkeypatch.context() as patch:
        patch.setattr(replay, "_exact_npu_generators", lambda: None)  # records as the earlier npukit did
        first, _ = dropout_training(1, tmp_path, 3, "npu")
    states = json.loads((tmp_path / "replay.json").read_text())["rng"]
    assert "npu_exact" not in states and states["npu"][0]["shape"] == [16]
    second, replayer = dropout_training(2, tmp_path, 3, "npu")
    assert replayer.replayed_generators and second[3] == first[3]


@pytest.mark.parametrize("field,value,message", [
    ("rng", [], "rng: expected an object"),
    ("python", [3, [1, 2], None], r"rng.python: expected \[version, 625 integers, gauss_next\]"),
    ("numpy", {"keys": [1]}, "rng.numpy: expected"),
    ("npu", {"tensor": "x"}, "rng.npu: must be a list"),
    ("npu_exact", {"tensor": "x"}, "rng.npu_exact: must be a list"),
])
def test_a_broken_generator_state_is_named(tmp_path, field, value, message):
    dropout_training(1, tmp_path, 0)
    manifest = json.loads((tmp_path / "replay.json").read_text())
    if field == "rng":
        manifest["rng"] = value
    else:
        manifest["rng"][field] = value
    (tmp_path / "replay.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=f"replay.json: {message}"):
        dropout_training(2, tmp_path, 0)


def _fsdp2_training(seed, replay_dir, start_step):
    """fully_shard (FSDP2) over a model on npu, Adam, 3 steps on fixed data; the losses and final weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to("npu")
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0)).to("npu")
    losses = []
    with ReplaySession(replay_dir, start_step=start_step):
        for x in data:
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, [parameter.to_local().detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize("start_step", [0, 1])
def test_fsdp2s_sharded_weights_and_optimizer_state_are_recorded_and_replayed(tmp_path, npu, start_step):
    """FSDP2 keeps the parameters and Adam's state as DTensors: loading the recorded values, plain
    tensors, failed ('aten.copy_.default got mixed torch.Tensor and DTensor'), and on 2 ranks the
    recorded shape was the global one while the file holds this rank's shard ('holds shape [64, 64] but
    dump.json says [128, 64]': MindSpeed-LLM's fsdp2 GPT-OSS under npu-run --nproc-per-node 2
    --replay). Each rank's shard is recorded with its shape and loaded back as a DTensor placed as the
    live one."""
    import torch.distributed as dist

    dist.init_process_group("hccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first, first_weights = _fsdp2_training(1, tmp_path, start_step)
        second, second_weights = _fsdp2_training(2, tmp_path, start_step)
    finally:
        dist.destroy_process_group()
    assert second[start_step:] == first[start_step:]  # seeded otherwise: equal only when replayed
    assert second[:start_step] != first[:start_step] or not start_step  # before step N: its own steps
    assert all(torch.equal(a, b) for a, b in zip(first_weights, second_weights))


_FSDP2_TWO_RANKS = """
import json
import sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
dist.init_process_group("hccl")
torch.npu.set_device(dist.get_rank())
torch.manual_seed(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).npu()
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for x in torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(dist.get_rank())).npu():
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
with open(f"losses.rank{dist.get_rank()}.seed{sys.argv[1]}", "w") as file:  # the ranks' stdout interleaves
    json.dump(losses, file)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two launches of two ranks
def test_fsdp2_on_two_ranks_replays_each_ranks_shard(tmp_path):
    """On 2 ranks a shard's shape is not its parameter's: the recording must say the shard's (the
    golden run stopped at 'holds shape [64, 64] but dump.json says [128, 64]')."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "train.py").write_text(_FSDP2_TWO_RANKS)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", "--replay", "replay",
                              "train.py", seed], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "replay" / "rank1" / "replay.json").read_text())
    assert manifest["modules"][0]["state"]["0.weight"]["shape"] == [4, 4]  # rank 1's half of the [8, 4] weight
    for rank in (0, 1):
        recorded, replayed = ((tmp_path / f"losses.rank{rank}.seed{seed}").read_text() for seed in ("1", "2"))
        assert len(json.loads(recorded)) == 2 and replayed == recorded, rank


def test_a_tensor_file_that_disagrees_with_replay_json_names_replay_json(tmp_path):
    """The check is read_tensor's, which the compare shares: it said 'but dump.json says' of a replay."""
    script(1, tmp_path)
    manifest = json.loads((tmp_path / "replay.json").read_text())
    weight = manifest["modules"][0]["state"]["0.weight"]
    np.save(tmp_path / weight["tensor"], np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(UserError, match=r"holds shape \[2, 2\] but replay.json says \[8, 4\]"):
        script(2, tmp_path)


AMP_TRAIN = '''\
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
seed, init_scale = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(seed)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to("npu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("npu", init_scale=init_scale, growth_interval=2)
data = torch.Generator().manual_seed(0)  # the same batches in every run (the targets are not replayed)
for step in range(6):
    scale, tracker = scaler.get_scale(), scaler._get_growth_tracker()
    x, y = torch.randn(4, 4, generator=data).to("npu"), torch.randn(4, 2, generator=data).to("npu")
    with torch.autocast("npu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print("step", step, "scale", scale, "tracker", tracker, "loss", repr(loss.item()),
          "weight", repr(model[0].weight.double().sum().item()), flush=True)
'''


def amp_steps(output: str) -> dict[int, dict[str, str]]:
    """step -> the scale and growth tracker it started with, its loss, the first weight after its update."""
    return {int(step): {"scale": scale, "tracker": tracker, "loss": loss, "weight": weight}
            for step, scale, tracker, loss, weight in
            re.findall(r"^step (\d+) scale (\S+) tracker (\S+) loss (\S+) weight (\S+)$", output, re.M)}


@pytest.mark.slow  # (two npu-run processes: about 20 s)
def test_replay_from_a_later_step_starts_it_with_the_recorded_grad_scalers_state(tmp_path):
    """fp16 autocast under a GradScaler: --replay-step 3 records the scaler's loss scale and growth
    tracker at step 3's start with the weights, and a run with another history of its own (other
    weights, another initial scale) computes step 3 with them: the same loss scale and update, and from
    there the same scale history and overflows (step 5's update skipped in both)."""
    (tmp_path / "train.py").write_text(AMP_TRAIN)

    def npu_run(*args):
        run = subprocess.run([sys.executable, "-m", "npukit.run", "--replay", "state", "--replay-step", "3",
                              "train.py", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return amp_steps(run.stdout)

    recorded = npu_run("0", str(2.0**18))
    assert len({(recorded[step]["scale"], recorded[step]["tracker"]) for step in range(4)}) == 4  # backs off, grows
    assert recorded[3]["tracker"] != "0"
    manifest = json.loads((tmp_path / "state" / "replay.json").read_text())
    assert [scaler["class"] for scaler in manifest["scalers"]] == ["GradScaler"]
    replayed = npu_run("1", str(2.0**10))
    assert replayed[0]["scale"] == str(2.0**10) and replayed[0]["loss"] != recorded[0]["loss"]  # its own steps 0-2
    assert recorded[5]["weight"] == recorded[4]["weight"]  # step 5's fp16 gradients overflowed: no update
    for step in (3, 4, 5):
        assert replayed[step] == recorded[step]  # scale, tracker, loss and update (or its skip)


def run_amp_script(folder, seed, init_scale, monkeypatch):
    """AMP_TRAIN (in tmp_path/train.py) run in this process under a ReplaySession of step 3: (its steps, the session)."""
    monkeypatch.setattr(sys, "argv", ["train.py", str(seed), str(init_scale)])
    printed = io.StringIO()
    with ReplaySession(folder, start_step=3) as session, contextlib.redirect_stdout(printed):
        runpy.run_path(str(folder.parent / "train.py"), run_name="__main__")
    return amp_steps(printed.getvalue()), session


@pytest.fixture
def amp_recording(tmp_path, npu, monkeypatch):
    """The state at step 3's start of AMP_TRAIN, recorded in tmp_path/state, and the recorded run's steps."""
    (tmp_path / "train.py").write_text(AMP_TRAIN)
    recorded, _ = run_amp_script(tmp_path / "state", 0, 2.0**18, monkeypatch)
    return tmp_path / "state", recorded


def test_a_recording_without_grad_scaler_state_replays_the_rest_and_says_so_once(amp_recording, monkeypatch,
                                                                                 capsys):
    """A folder recorded before GradScalers' states were (an older npukit) replays the rest; the loss scale
    is the run's own, said once, and only by a run that uses a GradScaler."""
    folder, recorded = amp_recording
    manifest = json.loads((folder / "replay.json").read_text())
    del manifest["scalers"]
    (folder / "replay.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    replayed, session = run_amp_script(folder, 1, 2.0**10, monkeypatch)
    assert session.replayed_modules == 1 and session.replayed_optimizers == 1 and session.replayed_scalers == 0
    assert replayed[3]["loss"] == recorded[3]["loss"] and replayed[3]["scale"] != recorded[3]["scale"]
    err = capsys.readouterr().err
    assert err.count("holds no GradScaler state") == 1 and "this run's own" in err
    training(1, folder.parent / "plain", 3)  # Adam, no GradScaler
    manifest = json.loads((folder.parent / "plain" / "replay.json").read_text())
    assert manifest["scalers"] == []
    del manifest["scalers"]
    (folder.parent / "plain" / "replay.json").write_text(json.dumps(manifest))
    training(2, folder.parent / "plain", 3)
    assert "GradScaler" not in capsys.readouterr().err


def test_a_grad_scaler_before_its_first_scale_takes_the_recorded_state_there(amp_recording):
    """A scaler whose tensors its first scale() is still to create starts from the recorded scale and
    growth tracker; scalers are matched in order, their count and class checked."""
    folder, recorded = amp_recording
    session = ReplaySession(folder, start_step=3)
    scaler = torch.amp.GradScaler("npu", growth_interval=2)
    session._load_scalers([scaler])
    assert scaler._scale is None
    assert scaler.scale(torch.ones((), device="npu")).item() == float(recorded[3]["scale"])
    assert scaler._scale.device.type == "npu" and scaler._get_growth_tracker() == int(recorded[3]["tracker"])
    with pytest.raises(UserError, match=r"state of 1 GradScaler\(s\) at the start of step 3; this run has stepped 2"):
        session._load_scalers([scaler, torch.amp.GradScaler("npu")])

    class OtherScaler(torch.amp.GradScaler):
        pass

    with pytest.raises(UserError, match="was a GradScaler, now it is a OtherScaler"):
        session._load_scalers([OtherScaler("npu")])
    manifest = json.loads((folder / "replay.json").read_text())
    manifest["scalers"][0]["scale"] = {"other": "float"}
    (folder / "replay.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"replay.json: scalers\[0\].scale: expected a tensor of one number"):
        ReplaySession(folder, start_step=3)
