"""Advisor: each rule fires on a model built to trigger it, with evidence; a clean model stays quiet."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import npukit.profiler
from npukit.profiler.advisor import RULE_IDS, advise
from npukit.profiler.table import (
    KIND_ANNOTATION,
    KIND_OP,
    PHASE_DATALOADER,
    PHASE_FORWARD,
    EventTable,
    TableBuilder,
)


def record(tmp_path, step_fn, steps: int = 2) -> EventTable:
    with npukit.profiler.profile(tmp_path, trace=False, auto_steps=False) as prof:
        for index in range(steps):
            step_fn(index)
            prof.step()
    return EventTable.load(tmp_path / "rank0")


def rules_fired(table: EventTable) -> dict:
    return {finding.rule: finding for finding in advise(table)}


def train_step_fn(model, make_input, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)

    def step(index: int) -> None:
        loss = model(make_input(index)).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def test_at_least_ten_rules_exist():
    assert len(RULE_IDS) >= 10
    assert len(set(RULE_IDS)) == len(RULE_IDS)


def test_clean_model_gets_no_advice(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).bfloat16()
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    table = record(tmp_path, train_step_fn(model, lambda i: x), steps=3)
    assert advise(table) == []


def test_float64_ops(tmp_path):
    model = torch.nn.Linear(64, 64).double()
    x = torch.randn(32, 64, dtype=torch.float64)
    fired = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x)))
    finding = fired["float64-ops"]
    assert any("aten::linear" in e or "aten::addmm" in e for e in finding.evidence)
    assert any("test_advisor.py" in e for e in finding.evidence)  # the user line
    assert "float32" in finding.change


def test_fp32_matmul(tmp_path):
    model = torch.nn.Linear(512, 512)
    x = torch.randn(256, 512)
    fired = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x)))
    assert "fp32-matmul" in fired
    assert "bfloat16" in fired["fp32-matmul"].change or "hf32" in fired["fp32-matmul"].change.lower()


def test_tiny_ops(tmp_path):
    values = torch.randn(16)

    def step(index: int) -> None:
        total = values
        for _ in range(400):
            total = total * 1.0001 + 0.5
    fired = rules_fired(record(tmp_path, step))
    assert "tiny-ops" in fired
    assert any("aten::mul" in e or "aten::add" in e for e in fired["tiny-ops"].evidence)


def test_dynamic_shapes(tmp_path):
    model = torch.nn.Linear(64, 64).bfloat16()
    batches = [8, 12, 16, 20]
    step = train_step_fn(model, lambda i: torch.randn(batches[i], 64, dtype=torch.bfloat16))
    finding = rules_fired(record(tmp_path, step, steps=4))["dynamic-shapes"]
    # the first step is warm-up: the shapes of the three after it
    assert any("aten::linear" in e and "3 shapes" in e for e in finding.evidence)


def test_shapes_seen_only_in_the_first_step_are_warm_up(tmp_path):
    """First-call work (tensor parallelism's first forward detaches each parameter, in its own
    shape, at the model's line) is not a shape that changes from step to step."""
    class FirstCallWork(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = torch.nn.Linear(64, 64), 0

        def forward(self, x):
            self.calls += 1
            rows = 3 if self.calls == 1 else 8  # one call site, another shape in the first step only
            return self.linear(x) + torch.ones(rows, 64).mean(0)

    step = train_step_fn(FirstCallWork(), lambda i: torch.randn(8, 64))
    assert "dynamic-shapes" not in rules_fired(record(tmp_path, step, steps=3))


def test_matmul_alignment(tmp_path):
    model = torch.nn.Linear(100, 60).bfloat16()
    x = torch.randn(32, 100, dtype=torch.bfloat16)
    finding = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x)))["matmul-alignment"]
    assert any("K=100" in e and "N=60" in e for e in finding.evidence)


def test_conv_channels(tmp_path):
    model = torch.nn.Conv2d(20, 24, 3).bfloat16()
    x = torch.randn(2, 20, 8, 8, dtype=torch.bfloat16)
    finding = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x)))["conv-channels"]
    assert any("20 -> 24" in e for e in finding.evidence)


class Patterns(torch.nn.Module):
    """Hand-written versions of what torch_npu offers as fused APIs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))

    def forward(self, x):
        mask = torch.zeros(64, 64, dtype=torch.bool)
        scores = (x @ x.transpose(-1, -2)) / 8.0
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)  # masked softmax + attention
        x = probs @ x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight  # RMSNorm
        x = F.silu(x) * x  # SwiGLU
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotary embedding
        return x * 0.5 + rotated * 0.5


@pytest.fixture(scope="module")
def pattern_findings(tmp_path_factory):
    model = Patterns()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    table = record(tmp_path_factory.mktemp("patterns"), train_step_fn(model, lambda i: x))
    return rules_fired(table)


@pytest.mark.parametrize(
    "rule, api",
    [
        ("fused-masked-softmax", "npu_scaled_masked_softmax"),
        ("fused-rms-norm", "npu_rms_norm"),
        ("fused-swiglu", "npu_swiglu"),
        ("fused-attention", "npu_fusion_attention"),
        ("fused-rotary", "npu_rotary_mul"),
    ],
)
def test_fused_api_candidates(pattern_findings, rule, api):
    finding = pattern_findings[rule]
    assert api in finding.change
    assert any("test_advisor.py" in e for e in finding.evidence)


def test_fused_optimizer(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).bfloat16()
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    finding = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x, optimizer)))["fused-optimizer"]
    assert "Adam" in finding.summary
    assert "NpuFused" in finding.change


def test_dataloader_wait(tmp_path):
    import time

    class SlowDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            time.sleep(0.002)
            return torch.randn(8)

    loader = iter(torch.utils.data.DataLoader(SlowDataset(), batch_size=4))

    def step(index: int) -> None:
        batch = next(loader)
        batch.sum()

    finding = rules_fired(record(tmp_path, step))["dataloader-wait"]
    assert "num_workers" in finding.change


def test_gc_pauses(tmp_path):
    def step(index: int) -> None:
        garbage = []
        for _ in range(20000):
            node = {}
            node["self"] = node
            garbage.append(node)
        del garbage
        torch.randn(4).sum()
        gc.collect()

    finding = rules_fired(record(tmp_path, step))["gc-pauses"]
    assert "gc.freeze()" in finding.change


def _device_table(ops: list[tuple[str, str, str, str]], steps: int = 2) -> EventTable:
    """A synthetic profile of a device run: (op, shapes, dtypes, devices) per call, repeated per step."""
    builder = TableBuilder()
    t = 0
    for step in range(steps):
        step_row = builder.add(f"ProfilerStep#{step}", start_ns=t, dur_ns=1_000_000, kind=KIND_ANNOTATION, step=step)
        for name, shapes, dtypes, devices in ops:
            t += 100
            builder.add(
                name, start_ns=t, dur_ns=50, step=step, parent=step_row, shapes=shapes, dtypes=dtypes,
                devices=devices, stack="train.py:42 in train", phase=PHASE_FORWARD, top_level=True, nbytes=400.0,
            )
        t += 1_000_000
    return builder.build()


def test_host_sync_on_device_tensors():
    table = _device_table([("aten::_local_scalar_dense", "[]", "float32", "npu:0"),
                           ("aten::nonzero", "[128]", "bool", "npu:0")])
    finding = rules_fired(table)["host-sync"]
    assert any("aten::_local_scalar_dense" in e and "1/step" in e for e in finding.evidence)
    assert any("train.py:42" in e for e in finding.evidence)


def test_host_sync_quiet_for_host_tensors():
    table = _device_table([("aten::_local_scalar_dense", "[]", "float32", "cpu")])
    assert "host-sync" not in rules_fired(table)


def test_host_device_copies_and_host_ops():
    table = _device_table([
        ("aten::copy_", "[64, 64], [64, 64]", "float32, float32", "npu:0, cpu"),  # H2D
        ("aten::copy_", "[64, 64], [64, 64]", "float32, float32", "cpu, npu:0"),  # D2H
        ("aten::mul", "[64, 64], [64, 64]", "float32, float32", "cpu, cpu"),  # left on the host
        ("aten::add", "[64, 64], [64, 64]", "float32, float32", "npu:0, npu:0"),
    ])
    fired = rules_fired(table)
    assert "1/step host-to-device and 1/step device-to-host" in fired["host-device-copies"].summary
    assert any("aten::mul" in e for e in fired["host-ops"].evidence)


def test_device_advice_on_npu(tmp_path, npu_device):
    x = torch.randn(64, 64, device=npu_device)

    def step(index: int) -> None:
        y = (x * 2).sum()
        y.item()
        x.cpu()

    fired = rules_fired(record(tmp_path, step))
    assert {"host-sync", "host-device-copies"} <= set(fired)


def test_each_transfer_counts_once_in_its_direction(tmp_path, npu_device):
    """The emulator's copy_ runs a transfer as _copy_from(src, dst) inside it (as out-of-tree
    backends do): one transfer, and its direction is read from copy_'s (dst, src)."""
    weight = torch.randn(64, 64)

    def step(index: int) -> None:
        batch = torch.randn(64, 64).to(npu_device)
        (batch @ weight.to(npu_device)).cpu()

    copies = rules_fired(record(tmp_path, step, steps=3))["host-device-copies"]
    assert "2/step host-to-device and 1/step device-to-host" in copies.summary, copies.summary


def test_fp32_matmul_is_not_advised_where_autocast_already_runs_it_in_low_precision(tmp_path):
    """autocast's outer aten::linear takes the fp32 weight and runs its matmul in fp16 inside it."""
    model = torch.nn.Linear(512, 512)
    x = torch.randn(256, 512)

    def step(index: int) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()

    assert "fp32-matmul" not in rules_fired(record(tmp_path, step))


def test_fp32_convolutions_are_not_told_to_allow_hf32_which_is_their_default(tmp_path):
    model = torch.nn.Conv2d(32, 64, 3, padding=1)
    x = torch.randn(8, 32, 32, 32)
    finding = rules_fired(record(tmp_path, train_step_fn(model, lambda i: x)))["fp32-matmul"]
    assert "allow_hf32 = True" not in finding.change and "autocast" in finding.change
    assert "already" in finding.summary


def test_findings_are_ranked_by_time_at_stake_and_a_tiny_one_is_not_high():
    """A 0.02 ms/step host sync under a float32 matmul costing most of the step: the matmul first, and
    the sync, 'high' by its rule, is low for what it costs here."""
    builder = TableBuilder()
    t = 0
    for step in range(2):
        step_row = builder.add(f"ProfilerStep#{step}", start_ns=t, dur_ns=400_000_000, kind=KIND_ANNOTATION, step=step)
        for name, shapes, dtypes, dur_ns, flops in (
                ("aten::mm", "[4096, 4096], [4096, 4096]", "float32, float32", 300_000_000, 2 * 4096 ** 3),
                ("aten::_local_scalar_dense", "[]", "float32", 20_000, 0)):
            t += 100
            builder.add(name, start_ns=t, dur_ns=dur_ns, step=step, parent=step_row, shapes=shapes, dtypes=dtypes,
                        devices="npu:0, npu:0" if flops else "npu:0", stack="train.py:42 in train",
                        phase=PHASE_FORWARD, top_level=True, nbytes=400.0, flops=float(flops))
            t += dur_ns
    findings = advise(builder.build())
    assert [f.rule for f in findings][:2] == ["fp32-matmul", "host-sync"]
    sync = findings[1]
    assert sync.severity == "low" and sync.est_us_per_step == pytest.approx(20.0)


def test_a_datasets_module_transform_is_data_pipeline_work_not_host_ops_in_the_model(tmp_path, npu_device):
    """A CPU transform that is an nn.Module, called by a Dataset inside DataLoader.__next__: its module
    call made its ops 'forward', and host-ops called them host ops inside the model (high)."""

    class Normalize(torch.nn.Module):
        def forward(self, x):
            return (x - x.mean()) / (x.std() + 1e-6) * 2.0 + 0.5

    class Data(torch.utils.data.Dataset):
        transform, samples = Normalize(), torch.randn(64, 32)

        def __len__(self):
            return 64

        def __getitem__(self, i):
            return self.transform(self.samples[i])

    model = torch.nn.Linear(32, 32).to(npu_device)
    batches = iter(torch.utils.data.DataLoader(Data(), batch_size=16))

    def step(index: int) -> None:
        model(next(batches).to(npu_device)).sum().backward()

    table = record(tmp_path, step, steps=3)
    assert "host-ops" not in rules_fired(table)
    names = table.string_array()[table.name_id]
    assert set(table.phase[(names == "aten::std") & (table.kind == KIND_OP)].tolist()) == {PHASE_DATALOADER}
