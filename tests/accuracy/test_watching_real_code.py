"""The user's run never fails because npukit watches it, and its summary never claims a clean run
after a failure: reproductions of what broke on real training code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# A real-code suite (reproductions of real repositories' runs under the dump and overflow tools):
# `make test` runs it after the main suite.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

COMPILED = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    model = M().npu()
    run = torch.compile(model) if sys.argv[1] == "compiled" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss = run(torch.randn(4, 8, device="npu")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("step", step, "loss", round(loss.item(), 6))
""")


EMBEDDING_DROPOUT = '''import sys
import torch
from torch import nn
torch.manual_seed(0)

class EmbeddingDropout(nn.Module):
    """awd-lstm style: a mask over embedding rows from an uninitialized buffer."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 2)
    def forward(self, ids):
        mask = self.emb.weight.new().resize_((10, 1)).bernoulli_(0.9) / 0.9
        w = mask.expand_as(self.emb.weight) * self.emb.weight
        noise = torch.empty_like(w).uniform_(-0.01, 0.01)
        return self.out(nn.functional.embedding(ids, w + noise))

model = EmbeddingDropout().npu()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    if sys.argv[1] == "nan":  # leave NaNs in freed memory, as a previous step's buffers may
        junk = [torch.full((10, 1), float("nan"), device="npu") for _ in range(8)]
        junk += [torch.full((10, 8), float("nan"), device="npu") for _ in range(8)]
        del junk
    loss = model(torch.arange(4, device="npu")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(round(loss.item(), 6))
'''


ROTARY = '''import sys
import torch
from torch import nn
torch.manual_seed(0)

class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        angles = torch.outer(torch.arange(6).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))
    def forward(self, x):
        q = self.q(x)
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        if sys.argv[1] == "bug":
            qc = qc * self.freqs_cis.conj()
        else:
            qc = qc * self.freqs_cis
        return torch.view_as_real(qc).flatten(-2)

model = Rotary().npu()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1):
    loss = model(torch.randn(6, 8, device="npu")).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
'''


def npu_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "npukit.run", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_dump_of_a_compiled_model_runs_eagerly_and_names_layers_as_without_compile(tmp_path):
    (tmp_path / "train.py").write_text(COMPILED)
    eager = npu_run("--dump", "eager", "train.py", "eager", cwd=tmp_path)
    compiled = npu_run("--dump", "compiled", "train.py", "compiled", cwd=tmp_path)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert compiled.stderr.count("torch.compile regions run eagerly while the dump is active") == 1
    assert "global hooks" not in compiled.stderr
    assert compiled.stdout == eager.stdout  # the same losses: the run was not changed
    names = {kind: list(json.loads((tmp_path / kind / "step0" / "rank0" / "dump.json").read_text())["data"])
             for kind in ("eager", "compiled")}
    assert names["compiled"] == names["eager"]
    assert "Module.fc1.Linear.forward.0" in names["compiled"]
    compare = subprocess.run([str(Path(sys.executable).with_name("npu-compare")), "eager", "compiled"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert "No divergence found" in compare.stdout and "unmatched" not in compare.stdout, compare.stdout[-2000:]


def test_overflow_detection_of_a_compiled_model_checks_every_step(tmp_path):
    (tmp_path / "train.py").write_text(COMPILED)
    result = npu_run("--detect-overflow", "train.py", "compiled", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "overflow check: no overflow in 2 step(s)" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_compile_works_again_after_the_session(tmp_path):
    import torch

    from npukit.accuracy.dump import DumpSession

    compiled_calls = []

    def backend(graph_module, example_inputs):
        compiled_calls.append(1)
        return graph_module.forward

    def f(x):
        return torch.sin(x) + 1

    with DumpSession(tmp_path / "d"):
        torch.compile(f, backend=backend)(torch.ones(3))
    assert not compiled_calls  # eager while the dump watched
    torch.compile(f, backend=backend)(torch.ones(3))
    assert compiled_calls  # compiled again afterwards


@pytest.mark.parametrize("option", ["--detect-overflow"])
def test_a_failed_run_is_not_summarised_as_clean(tmp_path, option):
    (tmp_path / "fails.py").write_text(
        "import torch\nx = torch.ones(3, device='npu')\ny = (x * 2).sum()\nraise RuntimeError('user bug')\n")
    result = npu_run(option, "fails.py", cwd=tmp_path)
    assert result.returncode == 1
    assert "RuntimeError: user bug" in result.stderr
    output = result.stderr + result.stdout
    assert "no overflow in" not in output
    assert "the run stopped with an error" in output


def test_profile_of_a_compiled_model_is_kept(tmp_path):
    (tmp_path / "train.py").write_text(COMPILED)
    result = npu_run("--profile", "prof", "train.py", "compiled", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "UnicodeDecodeError" not in result.stderr
    shown = subprocess.run([str(Path(sys.executable).with_name("npu-profile")), "prof", "--top", "500", "--json",
                            "p.json"], capture_output=True, text=True, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    ops = json.dumps(json.loads((tmp_path / "p.json").read_text()))
    assert "aten::relu" in ops or "aten::addmm" in ops


def test_one_unreadable_event_costs_only_itself():
    from types import SimpleNamespace

    from torch._C._profiler import _EventType

    from npukit.profiler.extract import table_from_profiler

    class Broken:
        tag = _EventType.TorchOp
        children = []

        @property
        def extra_fields(self):
            raise UnicodeDecodeError("utf-8", b"\xf1", 0, 1, "invalid continuation byte")

    import torch
    from torch.profiler import profile

    with profile() as prof:
        torch.ones(3).add(1)
    results = prof.profiler.kineto_results
    good = results.experimental_event_tree()
    fake = SimpleNamespace(kineto_results=SimpleNamespace(
        experimental_event_tree=lambda: [Broken(), *good], events=results.events))
    table = table_from_profiler(SimpleNamespace(profiler=fake))
    assert table.meta["unreadable_events"] == 1 and "UnicodeDecodeError" in table.meta["unreadable_error"]
    assert "aten::add" in {table.strings[i] for i in table.name_id.tolist()}


def test_uninitialized_memory_is_marked_and_never_a_divergence(tmp_path):
    """`w.new().resize_(n, 1).bernoulli_(p)` (awd-lstm's embedding dropout), `empty_like(x).uniform_()`:
    the buffers hold whatever was in memory -- here zeros in one run, NaNs in the other."""
    (tmp_path / "train.py").write_text(EMBEDDING_DROPOUT)
    for run, garbage in (("golden", "zero"), ("npu", "nan")):
        # every api: Tensor.uniform_ and torch.empty_like are left out by default (msprobe leaves them out)
        result = npu_run("--seed", "1", "--dump", run, "--dump-ops", "all", "train.py", garbage, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "npu" / "step0" / "rank0" / "dump.json").read_text())["data"]
    assert data["Tensor.resize_.0.forward"]["output"][0]["uninitialized"] is True
    assert data["Tensor.bernoulli_.0.forward"]["input_args"][0]["uninitialized"] is True
    assert data["Tensor.uniform_.0.forward"]["input_args"][0]["uninitialized"] is True
    assert "uninitialized" not in data["Tensor.bernoulli_.0.forward"]["output"][0]
    compare = subprocess.run([str(Path(sys.executable).with_name("npu-compare")), "golden", "npu"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert compare.returncode == 0, compare.stderr
    assert "No divergence found" in compare.stdout, compare.stdout[-3000:]
    overflow = npu_run("--detect-overflow", "train.py", "nan", cwd=tmp_path)
    assert "overflow check: no overflow in 2 step(s)" in overflow.stdout + overflow.stderr


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_complex_tensors_are_measured_and_a_rotary_bug_is_named_where_it_is(tmp_path, mode):
    """Rotary embeddings (torch.polar, view_as_complex): complex tensors get statistics and metrics;
    the divergence is not pinned on the next real-valued op (view_as_real)."""
    (tmp_path / "rope.py").write_text(ROTARY)
    for run in ("ok", "again", "bug"):
        # every api: view_as_complex and conj are left out by default (msprobe leaves them out)
        result = npu_run("--seed", "1", "--dump", run, "--dump-mode", mode, "--dump-ops", "all", "rope.py",
                         "bug" if run == "bug" else "ok", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    leaf = json.loads((tmp_path / "ok" / "step0" / "rank0" / "dump.json").read_text())["data"][
        "Torch.view_as_complex.0.forward"]["output"][0]
    assert leaf["dtype"] == "torch.complex64" and leaf["Norm"] > 0 and leaf["Max"] is not None
    compare_cmd = str(Path(sys.executable).with_name("npu-compare"))
    same = subprocess.run([compare_cmd, "ok", "again", "--csv", "same.csv"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert "No divergence found" in same.stdout
    rows = (tmp_path / "same.csv").read_text()
    assert "no data to compare" not in rows
    bug = subprocess.run([compare_cmd, "ok", "bug"], capture_output=True, text=True, cwd=tmp_path)
    first = [line for line in bug.stdout.splitlines() if line.startswith("First divergence")]
    assert first and "Tensor.conj.0.forward" in first[0], bug.stdout[-3000:]


def test_an_infinite_fill_by_a_creation_op_is_named_with_its_line_and_hint(tmp_path):
    (tmp_path / "fill.py").write_text(textwrap.dedent("""
        import torch
        x = torch.randn(4, 4, device="npu", dtype=torch.float16)
        bias = torch.full(x.shape, float("-inf"), dtype=torch.float16, device="npu")
        y = (x + bias.triu(1)).softmax(-1)
    """))
    env_run = subprocess.run([sys.executable, "-m", "npukit.run", "--detect-overflow", "fill.py"], capture_output=True,
                             text=True, cwd=tmp_path, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(REPO), NPUKIT_FP16_MODE="saturation"))
    output = env_run.stdout + env_run.stderr
    assert "does not see" not in output
    assert "Torch.full.0.forward" in output and "fill.py, line 4" in output
    assert "torch.finfo(x.dtype).min" in output


def _train_losses(session_factory, steps=3):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with session_factory():
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tool, broken", [
    ("dump", "_tensor_leaf"),          # runs in the api handler and the module hooks
    ("dump", "_enter_module"),         # module hooks only
    ("dump", "_hook_api_backward"),    # registers backward hooks
    ("overflow", "_check_all"),
    ("overflow", "_hook_module_backward"),
])
def test_an_internal_error_in_a_hook_is_reported_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys, tool, broken):
    import contextlib

    from npukit.accuracy.dump import DumpSession
    from npukit.accuracy.overflow import OverflowSession
    from npukit.watch import hook_guard

    session_class = DumpSession if tool == "dump" else OverflowSession
    expected = _train_losses(contextlib.nullcontext)

    def fault(*args, **kwargs):
        raise ZeroDivisionError("injected fault")

    monkeypatch.setattr(session_class, broken, fault)
    monkeypatch.setattr(hook_guard, "broken_hooks", set())
    factory = (lambda: DumpSession(tmp_path / "d")) if tool == "dump" else (
        lambda: OverflowSession(tmp_path / "o", level="module" if "module" in broken else "api"))
    assert _train_losses(factory) == expected  # the run goes on, unchanged
    err = capsys.readouterr().err
    reports = [line for line in err.splitlines() if line.startswith("npukit: internal error")]
    assert reports and all("injected fault" in line for line in reports)
    assert len(reports) == len(set(line.split(" (at")[0].split(":")[1] for line in reports))  # once per hook


def test_the_users_own_errors_still_reach_the_user_under_the_dump(tmp_path):
    import torch

    from npukit.accuracy.dump import DumpSession

    model = torch.nn.Linear(8, 2)
    with DumpSession(tmp_path / "d"), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(torch.randn(4, 7))


def test_module_names_are_attribute_paths_when_a_parent_forward_never_runs(tmp_path):
    """Two heads of a container called directly (`agent.actor(x)`), and a model whose .forward() is
    called directly (generation loops): names keep the attribute path; every head's gradients kept."""
    import torch
    from torch import nn

    from npukit.accuracy.dump import DumpSession

    class Agent(nn.Module):
        def __init__(self):
            super().__init__()
            self.actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            self.critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.fc(x)

    agent, lm = Agent(), LM()
    opt = torch.optim.SGD([*agent.parameters(), *lm.parameters()], lr=0.1)
    with DumpSession(tmp_path / "d"):
        x = torch.randn(3, 4)
        (agent.actor(x).sum() + agent.critic(x).sum() + lm.forward(x).sum()).backward()
        opt.step()
    names = set(json.loads((tmp_path / "d" / "step0" / "rank0" / "dump.json").read_text())["data"])
    for expected in ("Module.actor.0.Linear.forward.0", "Module.critic.0.Linear.forward.0",
                     "Module.actor.Sequential.forward.0", "Module.layers.1.Linear.forward.0",
                     "Module.fc.Linear.forward.0", "Module.actor.2.Linear.parameters_grad.0",
                     "Module.critic.2.Linear.parameters_grad.0", "Module.layers.0.Linear.parameters_grad.0"):
        assert expected in names, sorted(names)
    assert not any(name.startswith(("Module.0.", "Module.Linear.")) for name in names)


def test_the_owner_of_a_head_is_searched_once_per_process_not_per_session(tmp_path, monkeypatch):
    """The heap scan that finds a head's container (~20 ms on a loaded interpreter) is not repeated
    by every session (one per test under pytest --npu, one per repeat in the benchmarks)."""
    import gc

    import torch
    from torch import nn

    from npukit.accuracy.dump import DumpSession

    agent = nn.Module()
    agent.actor = nn.Sequential(nn.Linear(4, 2))
    scans = []
    real_referrers = gc.get_referrers
    monkeypatch.setattr(gc, "get_referrers", lambda *objs: scans.append(objs) or real_referrers(*objs))
    for session in range(3):
        with DumpSession(tmp_path / str(session)):
            agent.actor(torch.randn(1, 4)).sum().backward()
        names = json.loads((tmp_path / str(session) / "step0" / "rank0" / "dump.json").read_text())["data"]
        assert "Module.actor.0.Linear.forward.0" in names
        if session == 0:
            first_scans = len(scans)
    assert first_scans > 0 and len(scans) == first_scans
    spare = nn.Module()  # moved into another container: searched again
    spare.head = agent.actor
    del agent.actor
    with DumpSession(tmp_path / "moved"):
        spare.head(torch.randn(1, 4)).sum().backward()
    names = json.loads((tmp_path / "moved" / "step0" / "rank0" / "dump.json").read_text())["data"]
    assert "Module.head.0.Linear.forward.0" in names and len(scans) > first_scans


def test_a_golden_run_runs_programs_that_rely_on_autocast_to_mix_dtypes(tmp_path):
    (tmp_path / "mixed.py").write_text(textwrap.dedent("""
        import torch
        lin = torch.nn.Linear(8, 8).half().npu()
        x = torch.randn(2, 8, device="npu")
        with torch.autocast("npu", dtype=torch.float16):
            y = lin(x)
        print("dtype", y.dtype)
    """))
    npu = npu_run("mixed.py", cwd=tmp_path)
    golden = npu_run("--golden", "mixed.py", cwd=tmp_path)
    assert npu.returncode == 0 and "dtype torch.float16" in npu.stdout
    assert golden.returncode == 0, golden.stderr[-2000:]
    assert "dtype torch.float32" in golden.stdout  # the region ran, computed in fp32
    assert "not fp32" not in golden.stderr


def test_a_golden_run_that_is_not_fp32_says_so_at_run_time_and_in_the_compare(tmp_path):
    (tmp_path / "cast.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).npu().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8, device="npu", dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
    """))
    golden = npu_run("--golden", "--seed", "0", "--dump", "golden", "cast.py", cwd=tmp_path)
    assert golden.returncode == 0, golden.stderr[-2000:]
    warnings = [line for line in golden.stderr.splitlines() if "the golden run is not fp32" in line]
    assert len(warnings) == 1 and "torch.bfloat16" in warnings[0] and "cast.py:8" in warnings[0]
    npu_run("--seed", "0", "--dump", "npu", "cast.py", cwd=tmp_path)
    compare = subprocess.run([str(Path(sys.executable).with_name("npu-compare")), "golden", "npu", "--json",
                              "c.json"], capture_output=True, text=True, cwd=tmp_path)
    assert "the golden run was not fp32" in compare.stdout
    pair = json.loads((tmp_path / "c.json").read_text())["pairs"][0]
    assert pair["golden_low_precision"].startswith("Functional.linear.0.forward")


SKIPPED_BY_SCALER = textwrap.dedent("""
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).npu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # fp16 autocast with the default loss scale: the first step's gradients overflow and GradScaler
    # skips it (in a golden run they fit in fp32 and the step is taken)
    scaler = torch.amp.GradScaler("npu")
    for step in range(3):
        x, y = torch.randn(64, 8, device="npu"), torch.randn(64, 1, device="npu") * 10
        with torch.autocast("npu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print("step", step, "scale", scaler.get_scale())
""")


def test_a_step_gradscaler_skipped_ends_there_and_its_overflow_is_not_a_divergence(tmp_path):
    (tmp_path / "scaled.py").write_text(SKIPPED_BY_SCALER)
    for side, golden in (("npu", ()), ("golden", ("--golden",))):
        run = npu_run(*golden, "--seed", "0", "--replay", "r", "--dump", side, "--dump-mode", "tensor",
                      "scaled.py", cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
    assert "step 0 scale 32768.0" in npu_run("--seed", "0", "scaled.py", cwd=tmp_path).stdout  # skipped: halved
    npu_step0 = json.loads((tmp_path / "npu/step0/rank0/dump.json").read_text())
    assert npu_step0["step_skipped_by_grad_scaler"] == {"loss_scale": 65536.0}
    golden_step0 = json.loads((tmp_path / "golden/step0/rank0/dump.json").read_text())
    assert "step_skipped_by_grad_scaler" not in golden_step0
    # the skipped step ended at scaler.step: one forward of the model, as in the golden step
    assert [name for name in npu_step0["data"] if name.startswith("Module.0.Linear.forward")] == \
        ["Module.0.Linear.forward.0"]
    assert sorted(p.name for p in (tmp_path / "npu").iterdir()) == ["step0", "step1", "step2"]

    from npukit.accuracy.compare import ERROR, compare_dirs

    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    step0 = result.pairs[0]
    assert step0.pair == "step0/rank0" and step0.skipped_by_grad_scaler == "target"
    assert step0.divergence is None
    overflowed = [row for row in step0.rows if row.metrics and row.metrics.nan_inf_mismatch]
    assert overflowed and all("GradScaler skipped" in row.message for row in overflowed)
    assert not [row for row in step0.rows if row.verdict == ERROR]
    # the next steps start from weights only the golden run updated: no op is to blame for what
    # differs there, and the report says why they were not searched
    for pair in result.pairs[1:]:
        assert pair.divergence is None
        assert pair.unsearched.startswith("not searched for a divergence: GradScaler skipped step 0 in the target only")
    # ... and what differs there is not judged correct either: npu-compare exits 1 on those rows
    assert result.unexplained_errors() == [row for pair in result.pairs[1:] for row in pair.rows if row.verdict == ERROR]
