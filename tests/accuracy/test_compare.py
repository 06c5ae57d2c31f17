"""npu-compare: the first divergence names the injected bug; a correct bf16 run reports no error."""

import json

import numpy as np
import pytest
import torch

from npukit.accuracy import metrics
from npukit.accuracy.compare import ERROR, Thresholds, align, compare_dirs
from npukit.accuracy.dumpfile import DumpEntry
from npukit.accuracy.metrics import PairJob, compare_pairs
from npukit.accuracy.tensor_io import write_tensor
from npukit.errors import UserError

from .models import train

# bug -> (expected first divergence at api/mix level, expected at module level)
INJECTED = {
    "eps": ("Functional.layer_norm.1.forward", "Module.blocks.1.norm.LayerNorm.forward.0"),
    "transpose": ("Tensor.t.0.forward", "Module.blocks.1.fc2.TransposedLinear.forward.0"),
    "relu": ("Functional.relu.0.forward", "Module.blocks.1.Block.forward.0"),
    "insert": ("Torch.tanh.0.forward", "Module.blocks.1.Block.forward.0"),
    "overflow": ("Torch.square.1.forward", "Module.blocks.1.Block.forward.0"),
}


def run_pair(tmp_path, bug, level, mode, steps=1, **target_options):
    golden, target = tmp_path / "golden", tmp_path / "target"
    # The fp16 overflow is not a code change: the same model overflows only when run in float16.
    train(golden, bug if bug == "overflow" else None, level=level, mode=mode, steps=steps)
    if bug == "overflow":
        target_options.setdefault("dtype", torch.float16)
    train(target, bug, level=level, mode=mode, steps=steps, **target_options)
    return compare_dirs(golden, target, workers=1)


@pytest.mark.parametrize("mode", ["tensor", "stats"])
@pytest.mark.parametrize("level", ["mix", "api", "module"])
@pytest.mark.parametrize("bug", sorted(INJECTED))
def test_first_divergence_names_the_injected_op(tmp_path, bug, level, mode):
    result = run_pair(tmp_path, bug, level, mode)
    divergence = result.pairs[0].divergence
    assert divergence is not None
    assert divergence.entry == INJECTED[bug][level == "module"], divergence.reason
    assert divergence.stack, "the report must show where the op was called"
    if level != "api":
        assert divergence.module_path and divergence.module_path.startswith("blocks.1")


@pytest.mark.parametrize("mode", ["tensor", "stats"])
@pytest.mark.parametrize("level", ["mix", "api", "module"])
def test_correct_bf16_run_against_fp32_reports_no_error(tmp_path, level, mode):
    result = run_pair(tmp_path, None, level, mode, steps=2, autocast_bf16=True)
    assert [pair.divergence for pair in result.pairs] == [None, None]
    assert result.counts()[ERROR] == 0
    rows = [row for row in result.rows if row.target and row.target.dtype == "torch.bfloat16" and row.metrics]
    if mode == "tensor":
        assert rows and all(row.dtype_class == "bf16" for row in rows)


def test_identical_runs_pass_everything(tmp_path):
    result = run_pair(tmp_path, None, "mix", "tensor")
    counts = result.counts()
    assert counts["pass"] > 0 and counts["warn"] == counts[ERROR] == counts["unmatched"] == 0


def test_inserted_call_realigns_the_rest_of_the_stream(tmp_path):
    result = run_pair(tmp_path, "insert", "api", "tensor")
    pair = result.pairs[0]
    assert pair.aligned
    assert [name for name in pair.unmatched_target if name.endswith("forward")] == ["Torch.tanh.0.forward"]
    # After the inserted call the same ops still pair with their counterparts, not by shifted index.
    rows = {row.target_entry: row for row in pair.rows if row.target_entry}
    assert rows["Torch.square.1.forward"].golden_entry == "Torch.square.1.forward"


def entry(name):
    base, _, direction = name.rpartition(".")
    return DumpEntry(name=name, base=base.rpartition(".")[0], direction=direction)


def test_alignment_pairs_ops_across_an_insertion_and_a_deletion():
    golden = [entry(n) for n in ["A.a.0.forward", "A.b.0.forward", "A.c.0.forward", "A.b.1.forward"]]
    target = [entry(n) for n in ["A.a.0.forward", "A.x.0.forward", "A.b.0.forward", "A.b.1.forward"]]
    pairs, aligned = align(golden, target)
    as_names = [(g.name if g else None, t.name if t else None) for g, t in pairs]
    assert aligned
    assert ("A.b.1.forward", "A.b.1.forward") in as_names
    assert (None, "A.x.0.forward") in as_names and ("A.c.0.forward", None) in as_names


def test_metrics_match_a_numpy_reference(tmp_path):
    rng = np.random.default_rng(0)
    golden = rng.standard_normal(300_000).astype(np.float32)
    target = (golden + rng.standard_normal(golden.size).astype(np.float32) * 1e-3).astype(np.float32)
    write_tensor(tmp_path / "g.npy", torch.from_numpy(golden))
    write_tensor(tmp_path / "t.npy", torch.from_numpy(target))
    rms = float(np.sqrt(np.mean(golden.astype(np.float64) ** 2)))
    job = PairJob(str(tmp_path / "g.npy"), "torch.float32", str(tmp_path / "t.npy"), "torch.float32",
                  golden.size, "torch.float32", ulp_floor=rms)
    (m,) = compare_pairs([job], workers=1)
    g, t = golden.astype(np.float64), target.astype(np.float64)
    d = t - g
    assert m.cosine == pytest.approx(g @ t / np.linalg.norm(g) / np.linalg.norm(t), rel=1e-12)
    assert m.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(g), rel=1e-12)
    assert m.sqnr_db == pytest.approx(10 * np.log10((g @ g) / (d @ d)), rel=1e-12)
    assert m.max_abs == pytest.approx(np.abs(d).max())
    rel = np.abs(d) / np.maximum(np.abs(g), 1e-10)
    assert m.max_rel == pytest.approx(rel.max())
    assert m.within_1e3 == pytest.approx(np.mean(rel <= 1e-3))
    assert m.within_5e3 == pytest.approx(np.mean(rel <= 5e-3))
    magnitude = np.maximum(np.abs(golden), np.float32(rms))  # ULPs at the tensor's scale near zero
    assert m.max_ulp == pytest.approx((np.abs(d) / np.spacing(magnitude).astype(np.float64)).max())


def test_multiprocess_metrics_equal_single_process(tmp_path):
    rng = np.random.default_rng(1)
    jobs = []
    for i, size in enumerate([5_000_000, 3_000_000, 10]):
        golden = rng.standard_normal(size).astype(np.float32)
        target = golden + np.float32(1e-4)
        write_tensor(tmp_path / f"g{i}.npy", torch.from_numpy(golden))
        write_tensor(tmp_path / f"t{i}.npy", torch.from_numpy(target))
        jobs.append(PairJob(str(tmp_path / f"g{i}.npy"), "torch.float32", str(tmp_path / f"t{i}.npy"),
                            "torch.float32", size))
    single = compare_pairs(jobs, workers=1)
    multi = compare_pairs(jobs, workers=2)
    for a, b in zip(single, multi):
        assert a.rel_l2 == pytest.approx(b.rel_l2, rel=1e-12) and a.max_abs == b.max_abs


@pytest.mark.parametrize("golden_dtype, target_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float64, torch.float16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float64)])
def test_one_pass_metrics_equal_numpys_chunked_metrics(tmp_path, golden_dtype, target_dtype):
    """Float pairs are measured by one C pass (pair_partial); its figures are the numpy chunks':
    non-finite values, zeros in the golden (relative error over eps), a loss scale, ULPs near zero."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal(10_003) * 50
    values[rng.integers(0, values.size, 40)] = 0.0
    golden = torch.from_numpy(values).to(golden_dtype)
    target = (torch.from_numpy(values * (1 + 1e-3 * rng.standard_normal(values.size))) * 4).to(target_dtype)
    golden[[7, 5000]] = float("nan")
    target[[7, 9000]] = float("nan")
    golden[[100, 6000]] = float("inf")
    target[[100, 6001]] = float("-inf")
    write_tensor(tmp_path / "g.pt", golden)
    write_tensor(tmp_path / "t.pt", target)
    names = [str(dtype) for dtype in (golden_dtype, target_dtype)]
    job = PairJob(str(tmp_path / "g.pt"), names[0], str(tmp_path / "t.pt"), names[1], golden.numel(), names[1],
                  target_scale=0.25, ulp_floor=0.5, zero_eps=metrics.FLOAT32_EPS)
    (measured,) = compare_pairs([job], workers=1)
    reference = metrics.empty_partial()
    for low in range(0, golden.numel(), 4096):  # numpy's path, chunk by chunk as it reads files
        chunk = metrics.chunk_partial(golden[low:low + 4096].double().numpy().copy(),
                                      target[low:low + 4096].double().numpy() * 0.25, names[1], None, 0.5)
        metrics.merge(reference, chunk)
    expected = metrics.finish(reference, True)
    for field in ("cosine", "rel_l2", "sqnr_db", "euc_dist", "max_abs", "max_rel", "within_1e3", "within_5e3",
                  "max_ulp", "nan_inf_mismatch", "golden_nonfinite", "target_nonfinite"):
        assert getattr(measured, field) == pytest.approx(getattr(expected, field), rel=1e-12), field
    assert measured.golden_stats == pytest.approx(expected.golden_stats, rel=1e-12)
    assert measured.target_stats == pytest.approx(expected.target_stats, rel=1e-12)
    assert 0 < measured.within_1e3 < 1 and measured.nan_inf_mismatch == 5


def test_nan_inf_mismatch_is_an_error(tmp_path):
    golden = torch.tensor([1.0, 2.0, 3.0, float("inf")])
    target = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    write_tensor(tmp_path / "g.npy", golden)
    write_tensor(tmp_path / "t.npy", target)
    (m,) = compare_pairs([PairJob(str(tmp_path / "g.npy"), "torch.float32", str(tmp_path / "t.npy"),
                                  "torch.float32", 4)], workers=1)
    assert m.nan_inf_mismatch == 1 and m.rel_l2 == 0.0  # the finite rest agrees


def test_bf16_data_is_compared_exactly(tmp_path):
    golden = torch.randn(1000)
    target = golden.to(torch.bfloat16)
    write_tensor(tmp_path / "g.npy", golden)
    write_tensor(tmp_path / "t.npy", target)
    (m,) = compare_pairs([PairJob(str(tmp_path / "g.npy"), "torch.float32", str(tmp_path / "t.npy"),
                                  "torch.bfloat16", 1000, "torch.bfloat16")], workers=1)
    expected = float((target.double() - golden.double()).norm() / golden.double().norm())
    assert m.rel_l2 == pytest.approx(expected, rel=1e-12)
    assert m.max_ulp <= 0.5 + 1e-9  # round-to-nearest: at most half a bf16 ULP


def test_thresholds_are_configurable_and_validated():
    thresholds = Thresholds().with_overrides(["bf16.warn_rel_l2=0.05", "amplification=4"])
    assert thresholds.bf16.warn_rel_l2 == 0.05 and thresholds.amplification == 4
    assert Thresholds().bf16.warn_rel_l2 == 3e-2
    with pytest.raises(UserError, match="--set: unknown threshold 'bf16.nope'"):
        Thresholds().with_overrides(["bf16.nope=1"])
    with pytest.raises(UserError, match="NAME=NUMBER"):
        Thresholds().with_overrides(["fp32.pass_rel_l2=abc"])


def test_corrupt_dump_json_names_the_file(tmp_path):
    train(tmp_path / "g", level="api", mode="stats", steps=1)
    train(tmp_path / "t", level="api", mode="stats", steps=1)
    broken = tmp_path / "t/step0/rank0/dump.json"
    broken.write_text(broken.read_text()[:-100])
    with pytest.raises(UserError, match=r"t/step0/rank0/dump.json: invalid JSON at line 1"):
        compare_dirs(tmp_path / "g", tmp_path / "t")


def test_truncated_tensor_file_names_the_file(tmp_path):
    train(tmp_path / "g", level="api", mode="tensor", steps=1)
    train(tmp_path / "t", level="api", mode="tensor", steps=1)
    data = json.loads((tmp_path / "t/step0/rank0/dump.json").read_text())["data"]
    name = data["Functional.linear.0.forward"]["output"][0]["data_name"]
    path = tmp_path / "t/step0/rank0/dump_tensor_data" / name
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(UserError, match=name.replace(".", r"\.") + ": corrupt or truncated"):
        compare_dirs(tmp_path / "g", tmp_path / "t")


def test_missing_tensor_file_names_the_file(tmp_path):
    train(tmp_path / "g", level="api", mode="tensor", steps=1)
    train(tmp_path / "t", level="api", mode="tensor", steps=1)
    victim = next((tmp_path / "t/step0/rank0/dump_tensor_data").iterdir())
    victim.unlink()
    with pytest.raises(UserError, match=f"{victim.name}: tensor data file is missing"):
        compare_dirs(tmp_path / "g", tmp_path / "t")


def test_no_common_step_is_a_clear_error(tmp_path):
    train(tmp_path / "g", level="module", mode="stats", steps=2)
    train(tmp_path / "t", level="module", mode="stats", steps=2, dump_steps="1")
    (tmp_path / "g/step1").rename(tmp_path / "g/step5")
    with pytest.raises(UserError, match="no step/rank in common"):
        compare_dirs(tmp_path / "g", tmp_path / "t")


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such dump directory"):
        compare_dirs(tmp_path / "nope", tmp_path / "nope2")


def test_md5_dumps_name_the_first_op_whose_checksum_changes(tmp_path):
    result = run_pair(tmp_path, "eps", "mix", "md5")
    assert result.pairs[0].divergence.entry == "Functional.layer_norm.1.forward"
    quiet = run_pair(tmp_path / "same", None, "mix", "md5")
    assert quiet.pairs[0].divergence is None and quiet.counts()[ERROR] == 0


def test_a_bad_file_is_named_even_from_a_worker_process(tmp_path):
    jobs = []
    for i in range(2):
        data = torch.zeros(5_000_000)
        write_tensor(tmp_path / f"g{i}.npy", data)
        write_tensor(tmp_path / f"t{i}.npy", data)
        jobs.append(PairJob(str(tmp_path / f"g{i}.npy"), "torch.float32", str(tmp_path / f"t{i}.npy"),
                            "torch.float32", data.numel(), shape=(data.numel(),)))
    victim = tmp_path / "t1.npy"
    victim.write_bytes(victim.read_bytes()[: 1_000_000])
    with pytest.raises(UserError, match="t1.npy: corrupt or truncated"):
        compare_pairs(jobs, workers=2)


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_loss_scaled_backward_is_compared_unscaled(tmp_path, mode):
    result = run_pair(tmp_path, None, "mix", mode, steps=2, loss_scale=1024.0, autocast_bf16=True)
    assert [pair.loss_scale for pair in result.pairs] == [1024.0, 1024.0]
    assert [pair.divergence for pair in result.pairs] == [None, None]
    assert result.counts()[ERROR] == 0


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; its backward multiplies the gradient (the bug: by 1.5 instead of 1)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _BackwardBugNet(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.a, self.b, self.factor = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), factor

    def forward(self, x):
        return self.b(_ScaledGradient.apply(torch.nn.functional.gelu(self.a(x)), self.factor))


@pytest.mark.parametrize(("level", "expected", "why"), [
    # the multiply in the Function's backward is dumped (as msprobe dumps it): named, with the argument
    ("mix", "Tensor.__mul__.0.forward", "its argument input.1 is 1 in the golden run and 1.5 in the target"),
    # module level: no api dumped; the first module backward receiving the changed gradient
    ("module", "Module.a.Linear.backward.0", "gradient arriving")])
def test_backward_only_bug_is_named_at_the_op_that_made_it_or_where_its_gradient_arrives(tmp_path, level, expected,
                                                                                         why):
    from npukit.accuracy.dump import DumpSession

    for side, factor in (("golden", 1.0), ("target", 1.5)):
        torch.manual_seed(0)
        model = _BackwardBugNet(factor)
        with DumpSession(tmp_path / side, level=level, mode="tensor"):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 4, (4,)))
            loss.backward()
    divergence = compare_dirs(tmp_path / "golden", tmp_path / "target", workers=1).pairs[0].divergence
    assert divergence.entry == expected and why in divergence.reason


def test_a_step_grad_scaler_skipped_in_the_target_is_no_incomplete_compare(tmp_path, npu):
    """fp16 overflows a linear in the target, whose GradScaler then skips the optimizer step; the
    golden run's update ops have no counterpart by design. On a small model they were most of its
    entries: the compare read "too little paired" and the fix finder tried nothing
    (benchmarks/localization.py: 6 of 75 fixable faults)."""
    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend import numerics

    for side in ("golden", "target"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(npu)
        with torch.no_grad():
            model[1].weight.mul_(1e5)  # its fp16 output passes 65504
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("npu")
        policies = numerics.golden() if side == "golden" else numerics.policies()
        with policies, DumpSession(tmp_path / side, mode="tensor"):
            with torch.autocast("npu", dtype=torch.float32 if side == "golden" else torch.float16):
                loss = model(torch.randn(4, 8, device=npu) * 10).float().square().mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    pair = compare_dirs(tmp_path / "golden", tmp_path / "target", workers=1).pairs[0]
    assert pair.skipped_by_grad_scaler == "target"
    assert any(name.startswith("Torch._foreach") for name in pair.unmatched_golden)
    assert not pair.coverage.too_little(), pair.coverage.text()
    assert pair.divergence is not None and pair.divergence.entry == "Functional.linear.1.forward"
