"""Recording: what a user gets on disk from ProfileSession / npukit.profiler.profile."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import npukit.profiler
from npukit.errors import UserError
from npukit.profiler.record import ProfileSession, parse_steps
from npukit.profiler.summary import summarize
from npukit.profiler.table import KIND_OP, PHASE_BACKWARD, PHASE_NAMES, EventTable

from .conftest import PROFILED_BATCH, MatmulNet, train_steps


def _names(table: EventTable) -> np.ndarray:
    return table.lookup(table.name_id)


def test_schedule_follows_optimizer_steps_without_prof_step(matmul_profile):
    root, table = matmul_profile
    # wait=1, warmup=1, active=2 over 4 optimizer.step() calls: steps 2 and 3 are recorded.
    assert table.meta["steps"] == [2, 3]
    assert table.meta["step_source"] == "optimizer.step"
    ops = table.kind == KIND_OP
    assert set(np.unique(table.step[ops]).tolist()) <= {2, 3}
    names = _names(table)
    # Each recorded step ran the explicit torch.mm once forward.
    forward_mm = (names == "aten::mm") & (table.phase != PHASE_BACKWARD) & table.top_level
    assert forward_mm.sum() == 2


def test_dominant_matmul_is_named_first(matmul_profile):
    _, table = matmul_profile
    summary = summarize(table, "op")
    first = summary.rows[0]
    assert first["group"] == "aten::mm"
    # Per step: forward [B,384]x[384,384], its weight-gradient matmul of the same size, and the
    # head's two backward matmuls (grad input and grad weight, Bx8x384 each).
    batch = PROFILED_BATCH
    assert first["calls"] == 2 * 4
    assert first["flops"] == 2 * (2 * (2 * batch * 384 * 384) + 2 * (2 * batch * 8 * 384))
    assert first["self_pct"] > 30
    by_shape = {(row["group"], row["shapes"]): row for row in summarize(table, "shape").rows}
    forward = by_shape[("aten::mm", f"[{batch}, 384], [384, 384]")]
    assert forward["calls"] == 2 and forward["flops"] == 2 * (2 * batch * 384 * 384)


def test_files_written_per_rank_and_trace_is_chrome_json(matmul_profile):
    """The table and meta.json per rank; the trace as torch.profiler.tensorboard_trace_handler
    names and places it (worker rank0), naming itself inside (traceName), no partial file left."""
    root, table = matmul_profile
    rank_dir = root / "rank0"
    assert sorted(p.name for p in rank_dir.iterdir()) == ["events.npz", "meta.json"]
    [trace_path] = root.glob("*.pt.trace.json")
    assert re.fullmatch(r"rank0\.\d+\.pt\.trace\.json", trace_path.name)
    assert sorted(p.name for p in root.iterdir() if p.is_file()) == [trace_path.name]
    trace = json.loads(trace_path.read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names
    assert trace["traceName"] == str(trace_path)
    meta = json.loads((rank_dir / "meta.json").read_text())
    assert meta["events"] == len(table) and meta["traces"] == [trace_path.name]
    # The table is plain numpy: it loads with pickling disabled.
    with np.load(rank_dir / "events.npz", allow_pickle=False) as data:
        assert len(data["name_id"]) == len(table)


def test_module_paths_and_user_lines_cover_forward_and_backward(matmul_profile):
    _, table = matmul_profile
    names, modules, stacks = _names(table), table.lookup(table.module_id), table.lookup(table.stack_id)
    addmm = names == "aten::addmm"
    assert set(modules[addmm]) == {"MatmulNet.head"}
    # The backward matmuls are attributed to the forward op's module: the head's to the head,
    # the explicit torch.mm's to MatmulNet itself.
    backward_mm = (names == "aten::mm") & (table.phase == PHASE_BACKWARD)
    assert set(modules[backward_mm]) == {"MatmulNet.head", "MatmulNet"}
    explicit_mm = (names == "aten::mm") & (table.phase != PHASE_BACKWARD) & table.top_level
    lines = set(stacks[explicit_mm])
    assert len(lines) == 1
    (line,) = lines
    assert line.startswith("tests/profiler/conftest.py:") or "conftest.py:" in line
    assert line.endswith("in forward")
    source = (__import__("pathlib").Path(__file__).parent / "conftest.py").read_text().splitlines()
    assert "torch.mm(x, self.weight)" in source[int(line.split(":")[1].split()[0]) - 1]


def test_self_time_is_duration_minus_children(matmul_profile):
    _, table = matmul_profile
    self_ns = table.self_ns()
    assert (self_ns <= table.dur_ns).all()
    linear = np.flatnonzero(_names(table) == "aten::linear")[0]
    children = np.flatnonzero(table.parent == linear)
    assert len(children) >= 1
    assert self_ns[linear] == max(table.dur_ns[linear] - table.dur_ns[children].sum(), 0)


def test_explicit_step_and_rank_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    x = torch.randn(64, 64)
    with npukit.profiler.profile(tmp_path, steps="0,0,2", trace=False) as prof:
        for _ in range(3):
            torch.mm(x, x)
            prof.step()
    table = EventTable.load(tmp_path / "rank3")
    assert table.meta["step_source"] == "explicit"
    assert table.meta["steps"] == [0, 1]
    assert (_names(table) == "aten::mm").sum() == 2
    assert not list(tmp_path.glob("*.json"))


def test_under_grad_scaler_a_step_ends_after_its_update_and_a_skipped_step_is_one(tmp_path):
    """GradScaler skips optimizer.step where the gradients hold inf/nan (common while the loss scale
    settles): that step still ends, not with the next step's optimizer.step. A step ends when
    GradScaler.update returns: the update's ops are the step's, the last one is no step of its own."""
    weight = torch.nn.Parameter(torch.randn(64, 64))
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256)
    x = torch.randn(64, 64)
    with npukit.profiler.profile(tmp_path, steps="0,0,5", trace=False):  # one more than the loop runs
        for step in range(4):
            loss = torch.mm(x, weight).sum() * (float("inf") if step == 1 else 1.0)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    table = EventTable.load(tmp_path / "rank0")
    assert table.meta["steps"] == [0, 1, 2, 3]
    forward_mm = (_names(table) == "aten::mm") & (table.phase != PHASE_BACKWARD) & table.top_level
    assert sorted(table.step[forward_mm].tolist()) == [0, 1, 2, 3]
    assert sorted(table.step[_names(table) == "aten::_amp_update_scale_"].tolist()) == [0, 1, 2, 3]


def test_schedule_never_active_writes_nothing_and_says_why(tmp_path, capsys):
    with ProfileSession(tmp_path, steps="0,0,1"):
        train_steps(MatmulNet(), 1, batch=4)
    assert (tmp_path / "rank0" / "events.npz").exists()
    # A second run into the same directory that records nothing must not leave the old profile.
    with ProfileSession(tmp_path, steps="5,1,1"):
        train_steps(MatmulNet(), 2, batch=4)
    assert not (tmp_path / "rank0" / "events.npz").exists()
    err = capsys.readouterr().err
    assert "never reached an active step" in err and "2 step(s)" in err


def test_gc_pauses_are_recorded(tmp_path):
    import gc

    with npukit.profiler.profile(tmp_path, trace=False):
        torch.randn(8).sum()
        gc.collect()
    table = EventTable.load(tmp_path / "rank0")
    assert any(name.startswith("Python GC gen2") for name in _names(table))


@pytest.mark.parametrize("text", ["1,1", "a,b,c", "1,1,0", "-1,0,2", "1,2,3,4,5"])
def test_bad_step_schedule_is_a_user_error(text):
    with pytest.raises(UserError, match="--profile-steps"):
        parse_steps(text)


def test_step_schedule_parses_repeat():
    schedule = parse_steps("2, 1, 3, 2")
    assert (schedule.wait, schedule.warmup, schedule.active, schedule.repeat) == (2, 1, 3, 2)
    assert parse_steps(None) is None


def test_phase_names_cover_all_phases(matmul_profile):
    _, table = matmul_profile
    assert set(np.unique(table.phase).tolist()) <= set(range(len(PHASE_NAMES)))
    assert {"forward", "backward", "optimizer"} <= {PHASE_NAMES[p] for p in np.unique(table.phase)}


def test_profile_on_npu_device(tmp_path, npu_device):
    model = MatmulNet().to(npu_device)
    with npukit.profiler.profile(tmp_path, trace=False):
        train_steps_on(model, npu_device)
    table = EventTable.load(tmp_path / "rank0")
    devices = set(table.lookup(table.devices_id))
    assert any("npu" in d for d in devices)


def train_steps_on(model, device) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 384, device=device)
    for _ in range(2):
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_tensor_swap_while_recording_goes_ahead_and_recording_resumes_at_the_next_step(tmp_path):
    """torch.profiler's references to recorded tensors made torch.utils.swap_tensors refuse them
    (pytorch/pytorch#170137): FSDP2's to_empty after a meta-device init, under `npu-run --profile`,
    failed with "_apply(): Couldn't swap Embedding.weight". The swap ends the recording cycle; the
    step it interrupted is no step; recording starts again at the next one."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight
    with _swapping_conversions():
        with npukit.profiler.profile(tmp_path) as prof:
            for step in range(4):
                model(torch.randn(2, 4)).sum().backward()
                optimizer.step()
                # (without it, to_empty also swaps each .grad for uninitialized memory: the next step
                # accumulated into it, and a nan from that memory failed the check below now and then)
                optimizer.zero_grad()
                if step == 1:
                    model.to_empty(device="cpu")  # swaps each parameter
                    model.reset_parameters()
    assert model.weight is before and torch.isfinite(model.weight).all()  # swapped in place
    table = EventTable.load(tmp_path / "rank0")
    # step 0 is the setup before the first optimizer step; step 2 (the swap's) is not a step; 3 recorded again
    assert table.meta["steps"] == [1, 3]
    assert len(prof.traces) == 2 and all((tmp_path / name).is_file() for name in prof.traces)


class _swapping_conversions:
    """nn.Module._apply swaps parameters (as it does for tensor subclasses such as FSDP2's DTensors)."""

    def __enter__(self):
        self.before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)

    def __exit__(self, *exc):
        torch.__future__.set_swap_module_params_on_conversion(self.before)


def test_backward_ops_keep_their_forward_line_when_an_item_call_sits_between_steps(tmp_path):
    """`loss.item()` in a print records the autograd counter's next value, the one the next step's first
    node takes: backward ops (a tied embedding's gradient, its add) were blamed on that print."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(300, 32)
    head = torch.nn.Linear(32, 300, bias=False)
    head.weight = emb.weight  # tied: the weight's gradient is added from two paths
    idx = torch.randint(0, 300, (4, 16))
    with npukit.profiler.profile(tmp_path, trace=False, auto_steps=False) as prof:
        for _ in range(3):
            x = emb(idx)  # EMBEDDING LINE
            loss = head(x).pow(2).mean()
            loss.backward()
            print(f"loss {loss.item():.3f}")  # PRINT LINE
            prof.step()
    table = EventTable.load(tmp_path / "rank0")
    source = open(__file__).read().splitlines()
    line_of = {tag: next(i for i, text in enumerate(source, 1) if text.rstrip().endswith(f"# {tag}"))
               for tag in ("EMBEDDING LINE", "PRINT LINE")}
    names, stacks = _names(table), table.string_array()[table.stack_id]
    backward = (table.phase == PHASE_BACKWARD) & (table.kind == KIND_OP)
    assert not any(f":{line_of['PRINT LINE']} " in stack for stack in stacks[backward])
    embedding_backward = backward & (names == "aten::embedding_dense_backward")
    assert embedding_backward.sum() == 3
    assert all(f":{line_of['EMBEDDING LINE']} " in stack for stack in stacks[embedding_backward])


def test_only_python_files_are_user_lines():
    """A tracer frame whose file name is a string of the program is no location to print."""
    from npukit.profiler.extract import is_user_file

    assert is_user_file(__file__)
    assert is_user_file("train.py")  # unresolvable but a Python file: the user's
    assert not is_user_file("'class_to_index' must have at least one entry")
    assert not is_user_file("torch/nn/modules/module.py")
    assert not is_user_file("<frozen runpy>")


def test_a_warn_once_warning_of_the_users_shows_once_while_profiled(tmp_path):
    """The session silences torch's per-cycle note once for the run: a catch_warnings() per step reset
    Python's warn-once memory, and a script's own warning repeated at every step."""
    import warnings

    x = torch.randn(16, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's default action: once per place
        with npukit.profiler.profile(tmp_path, trace=False) as prof:
            for _ in range(4):
                torch.mm(x, x)
                warnings.warn("the user's warning", UserWarning, stacklevel=1)
                prof.step()
    assert [str(w.message) for w in seen].count("the user's warning") == 1
    assert not any("Profiler clears events" in str(w.message) for w in seen)
