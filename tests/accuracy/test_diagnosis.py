"""npu-compare names where an error arises, and names nothing where both runs compute the same program.

Each case is a small model trained one step under a golden run (fp32, NPU numerics off) and an NPU run
(autocast fp16/bf16 or HF32), both dumped by DumpSession in tensor mode, as `npu-run --golden --dump`
and `npu-run --dump` would. The cases are the ones issue #31 found diagnosed wrongly: a gradient hook
that only the NPU run installs ("no divergence"), a saturated softmax whose backward amplifies (named
at the next op as "changed outside the dumped ops"), a batch norm whose running statistics it updates
itself (named as "a weight that differs: seed your runs"), finfo(dtype).min as a mask fill (a false
alarm), and an HF32 cancellation next to a large residual branch ("no divergence", the loss 2 off).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from npukit.accuracy.compare import ERROR, WARN, compare_dirs


def _dumps(tmp_path, make_model, loss_of, *, dtype=None, hf32=False, npu_only=None, steps=1, seed=0,
           make_optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1)):
    """Golden and NPU dumps of `steps` optimizer steps; npu_only(model) runs before the NPU run only."""
    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend import numerics

    for side in ("golden", "npu"):
        golden_run = side == "golden"
        torch.manual_seed(seed)
        model = make_model().npu()
        if npu_only is not None and not golden_run:
            npu_only(model)
        optimizer = make_optimizer(model.parameters())
        policies = numerics.golden() if golden_run else (
            numerics.policies(matmul_hf32=True) if hf32 else contextlib.nullcontext())
        with policies, DumpSession(tmp_path / side, mode="tensor"):
            for step in range(steps):
                torch.manual_seed(1 + step)
                with torch.autocast("npu", dtype=torch.float32 if golden_run else dtype, enabled=dtype is not None):
                    loss = loss_of(model)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)


class _MLP(nn.Module):
    def __init__(self, hook_hidden: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(24, 48), nn.Linear(48, 48), nn.Linear(48, 6)
        self.hook_hidden = hook_hidden

    def forward(self, x):
        h = self.fc1(x)
        if self.hook_hidden:
            h.register_hook(lambda grad: grad * 5)  # the bad hook: the NPU run's gradient 5x
        return self.fc3(F.relu(self.fc2(F.relu(h))))


def _mlp_loss(model):
    return F.cross_entropy(model(torch.randn(64, 24, device="npu")).float(), torch.randint(0, 6, (64,), device="npu"))


def test_a_hook_that_scales_a_parameter_gradient_in_the_npu_run_only_is_named_at_that_parameter(tmp_path, npu):
    """fc2.weight's gradient 5x off, every other tensor within bf16's limits: "No divergence found:
    the error rows carry their inputs' error" (exit 0) although nothing before it had any error."""

    def hook(model):
        model.fc2.weight.register_hook(lambda grad: grad * 5)

    result = _dumps(tmp_path, _MLP, _mlp_loss, dtype=torch.bfloat16, npu_only=hook)
    [pair] = result.pairs
    divergence = pair.divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Module.fc2.Linear.parameters_grad.0" and divergence.module_path == "fc2"
    assert "the gradient of weight as the optimizer got it differs (error 4" in divergence.reason
    assert "Functional.linear.1.backward: error" in divergence.reason and "register_hook" in divergence.reason
    # the rows say the same: the parameter's gradient is the only error, and the optimizer's update
    # (SGD, foreach on the npu: its element for fc2.weight, the 3rd parameter) took it
    assert [row.name for row in pair.rows if row.verdict == ERROR] == [
        "Module.fc2.Linear.parameters_grad.0.weight", "Torch._foreach_add_.2.forward.input.1"]


def test_a_parameter_hook_is_named_when_both_runs_scale_the_loss_with_grad_scaler(tmp_path, npu):
    """Both runs under GradScaler: the backward's gradients are in loss-scaled units in both (so they
    compare alike), the optimizer's are unscaled, and the computed gradient's absolute error, 65536x
    too large, 'explained' the 5x hook: no divergence."""
    from npukit.accuracy.dump import DumpSession
    from npukit.npu_backend import numerics

    for side in ("golden", "npu"):
        golden_run = side == "golden"
        torch.manual_seed(0)
        model = _MLP().npu()
        if not golden_run:
            model.fc2.weight.register_hook(lambda grad: grad * 5)
        optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("npu")
        with numerics.golden() if golden_run else contextlib.nullcontext(), DumpSession(tmp_path / side, mode="tensor"):
            torch.manual_seed(1)
            with torch.autocast("npu", dtype=torch.float32 if golden_run else torch.float16):
                loss = _mlp_loss(model)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    result = compare_dirs(tmp_path / "golden", tmp_path / "npu", workers=1)
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Module.fc2.Linear.parameters_grad.0"
    assert "the gradient of weight as the optimizer got it differs (error 4" in divergence.reason


def test_a_hook_on_an_activation_gradient_is_named_where_the_gradient_changed(tmp_path, npu):
    """A hook on fc1's output scales the gradient arriving at fc1's backward: the gradient relu's
    backward computed for that value matches, the one fc1's backward gets is 5x. Named there, with
    the op that computed it."""
    result = _dumps(tmp_path, _MLP, _mlp_loss, dtype=torch.bfloat16,
                    npu_only=lambda model: setattr(model, "hook_hidden", True))
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Functional.linear.0.backward" and divergence.module_path == "fc1"
    assert "differs (error 4" in divergence.reason
    assert "from the one Functional.relu.0.backward computed for it" in divergence.reason
    assert "Tensor.register_hook" in divergence.reason


class _Attention(nn.Module):
    """Query and key weights 16x their initial size: attention logits in the hundreds, a softmax
    saturated to 1e-4 of its incoming gradient."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(16)
            self.k.weight.mul_(16)

    def forward(self, x):
        att = (self.q(x) @ self.k(x).transpose(-1, -2)) * 0.25
        return self.out(att.softmax(-1) @ self.v(x))


def test_a_saturated_softmax_whose_backward_amplifies_is_named_as_the_amplifier(tmp_path, npu):
    """fp16: the softmax backward's gradient has error 0.13 from an incoming gradient within 1e-3,
    but is 1e-4 of that gradient's size, below the noise level of its own op. It was named at the
    scaling before it as 'changed outside the dumped ops (a custom autograd Function, a hook ...)'."""
    result = _dumps(tmp_path, _Attention, lambda model: model(torch.randn(2, 8, 16, device="npu")).pow(2).mean(),
                    dtype=torch.float16)
    divergence = result.pairs[0].divergence
    assert divergence is not None
    assert divergence.entry == "Tensor.softmax.0.backward"
    assert "this backward amplifies the error: its gradient for input.0 has error" in divergence.reason
    assert "a softmax over saturated logits" in divergence.reason and "outside the dumped ops" not in divergence.reason
    assert divergence.output_error > 10 * divergence.input_error


class _OffsetNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(F.relu(self.norm(self.fc(x + 1e4))))


def test_running_statistics_a_batch_norm_updates_are_its_results_not_a_weight_that_differs(tmp_path, npu):
    """HF32 linear over x + 1e4, then BatchNorm1d, both runs seeded alike: 'a weight or input that
    no dumped op produced differs ... if the runs were not seeded alike' -- the input was running_var,
    which the dump measures after the batch norm updated it. The variance the HF32 rounding lost is
    what the batch norm's subtraction of the mean reveals: named at the linear."""
    result = _dumps(tmp_path, _OffsetNorm, lambda model: model(torch.randn(16, 16, device="npu")).pow(2).mean(),
                    hf32=True)
    divergence = result.pairs[0].divergence
    assert divergence is not None
    assert (divergence.entry, divergence.module_path) == ("Functional.linear.0.forward", "fc")
    assert "Functional.batch_norm.0.forward subtracts nearly equal values" in divergence.reason
    assert "allow_hf32 = False" in divergence.reason and "seed" not in divergence.reason


def test_an_hf32_cancellation_beside_a_large_residual_branch_is_named(tmp_path, npu):
    """h - h.mean(0) of an HF32 linear over x + 1e4 feeds a head added to a 100x larger skip branch:
    the loss moved by 2 in 3000, the whole gradient by 1% (the skip weight's gradient is 100x the
    others), so the cancellation was 'absorbed' and the compare said no divergence -- while fc's and
    out's weight gradients were 100% off."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out, self.skip = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(16, 4)

        def forward(self, x):
            h = self.fc(x + 1e4)
            return self.skip(x) * 100 + self.out(h - h.mean(0, keepdim=True))

    result = _dumps(tmp_path, Residual, lambda model: model(torch.randn(16, 16, device="npu")).pow(2).mean(), hf32=True)
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert (divergence.entry, divergence.module_path) == ("Functional.linear.0.forward", "fc")
    assert "Tensor.__sub__.0.forward subtracts nearly equal values" in divergence.reason


class _LostUpdate(nn.Module):
    """moved = base + 1e-4 * update, read back as (moved - base) * 1e4, after a trunk whose rounding
    makes `base` carry more error than the add's own rounding adds."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.ModuleList(nn.Linear(10, 10) for _ in range(4))
        self.inp, self.base, self.update, self.out = nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.trunk:
            x = F.gelu(layer(x))
        h = torch.tanh(self.inp(x))
        base = self.base(h)
        moved = base + self.update(h) * 1e-4
        return self.out(h + (moved - base) * 1e4)


def test_a_lost_update_is_named_at_the_add_not_at_the_producer_of_the_tensor_it_updated(tmp_path, npu):
    """In bf16 `base` carried more error than `moved`, so the cancellation rule named base's linear
    ("its output loses the signal it carries"): but base's error reaches both operands of the
    difference alike and cancels; the update was lost where it was added."""

    def loss_of(model):
        return F.cross_entropy(model(torch.randn(16, 10, device="npu")).float(), torch.randint(0, 4, (16,), device="npu"))

    result = _dumps(tmp_path, _LostUpdate, loss_of, dtype=torch.bfloat16)
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert divergence.entry == "Tensor.__add__.0.forward"
    assert "below bfloat16's rounding unit (0.0078), so most of the update is lost" in divergence.reason
    assert "Tensor.__sub__.0.forward reads the update back" in divergence.reason


class _OffsetLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(12, 32), nn.LayerNorm(32), nn.Linear(32, 4)
        with torch.no_grad():
            self.fc.weight.mul_(0.05)  # the features' spread, ~0.1 ...
            self.fc.bias.fill_(2000.0)  # ... is lost to fp16's spacing at 2000, which is 1

    def forward(self, x):
        return self.out(x[:, :1] + self.norm(self.fc(x)))


def test_a_cancellation_a_layer_norm_reveals_is_named_at_the_op_that_rounded_away_the_signal(tmp_path, npu):
    """fc(x) on a bias of 2000 in fp16, then LayerNorm (run in fp32 under autocast): fc's output is
    1e-4 off, the norm's 1.0 off. It was named at the norm ("output error 1 is 4e4x its input error"),
    which computed exactly what it was given; the signal was lost in fc's fp16 output."""
    result = _dumps(tmp_path, _OffsetLayerNorm, lambda model: model(torch.randn(16, 12, device="npu")).float().pow(2).mean(),
                    dtype=torch.float16)
    divergence = result.pairs[0].divergence
    assert divergence is not None and result.failed()
    assert (divergence.entry, divergence.module_path) == ("Functional.linear.0.forward", "fc")
    assert "Functional.layer_norm.0.forward subtracts its mean, and this input sits on an offset" in divergence.reason
    assert "Compute this op and the cancellation in fp32" in divergence.reason


class _PairGroupNorms(nn.Module):
    """Group norms over pairs of channels: in bf16 their backward amplifies what it is given."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(12, 16), nn.Linear(16, 10)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(16, 16), "norm": nn.GroupNorm(8, 16)})
                                    for _ in range(4))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + F.gelu(block["norm"](block["fc"](x)))
        return self.head(x)


def _pair_norms_run(tmp_path, seed):
    def loss_of(model):
        return F.cross_entropy(model(torch.randn(4, 12, device="npu")).float(), torch.randint(0, 10, (4,), device="npu"))

    return _dumps(tmp_path, _PairGroupNorms, loss_of, dtype=torch.bfloat16, steps=2, seed=seed,
                  make_optimizer=lambda parameters: torch.optim.AdamW(parameters, lr=5e-2))


def test_after_an_adamw_step_a_backward_that_amplifies_drift_is_not_a_divergence(tmp_path, npu):
    """Step 0 matched; AdamW's first update (about lr per weight whatever its gradient's size) moved
    the weights apart where bf16 flipped a small gradient's sign, so step 1's gradients differ by a
    third everywhere. A group norm's backward amplifying that was named as the first divergence of a
    correct run (the whole gradient over its limit). Its own weights' gradients are within half."""
    result = _pair_norms_run(tmp_path, seed=2)
    assert not result.failed() and not any(pair.divergence for pair in result.pairs)
    from npukit.accuracy.report import verdict_lines

    notes = " ".join(rest for kind, _, rest in verdict_lines(result) if kind == "note")
    assert "of the steps after an optimizer step started from weights the earlier low-precision updates moved" \
        in notes or "all in steps after an optimizer step, started from weights" in notes


def test_after_an_adamw_step_a_backward_that_makes_its_own_weights_gradient_wrong_is_named(tmp_path, npu):
    """The same model and run where the amplified error does reach the norm's own weight gradient
    (over half off): still named, at step 1."""
    result = _pair_norms_run(tmp_path, seed=7)
    assert result.failed()
    [(pair, entry)] = [(pair.pair, pair.divergence.entry) for pair in result.pairs if pair.divergence]
    assert pair == "step1/rank0" and entry.startswith("Functional.group_norm.") and entry.endswith(".backward")


class _MaskedAttention(nn.Module):
    def __init__(self, fill=None):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)
        self.fill = fill

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = q @ k.transpose(-1, -2) / 4
        mask = torch.tril(torch.ones(8, 8, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min if self.fill is None else self.fill)
        return self.out(att.softmax(-1) @ v)


def _masked_loss(model):
    return model(torch.randn(2, 8, 16, device="npu")).float().pow(2).mean()


def test_finfo_min_as_a_mask_fill_under_fp16_autocast_is_the_same_program(tmp_path, npu):
    """att.masked_fill(~mask, torch.finfo(att.dtype).min): -3.4e38 in the fp32 golden run, -65504 in
    fp16. Was 'its argument input.2 is -3.40282e+38 in the golden run and -65504 in the target', the
    first divergence of a correct model. The filled rows are warnings that say why."""
    result = _dumps(tmp_path, _MaskedAttention, _masked_loss, dtype=torch.float16)
    [pair] = result.pairs
    assert pair.divergence is None, pair.divergence.reason
    assert not result.failed()
    assert [row.name for row in pair.rows if row.verdict == ERROR] == []
    filled = {row.name: row.message for row in pair.rows if "finfo" in row.message}
    assert set(filled) == {"Tensor.masked_fill.0.forward.output.0", "Tensor.softmax.0.forward.input.0"}
    assert all(row.verdict == WARN for row in pair.rows if row.name in filled)
    assert "input.2 -3.40282e+38 / -65504" in filled["Tensor.masked_fill.0.forward.output.0"]


def test_a_finite_mask_fill_where_the_golden_run_fills_minus_inf_is_the_same_masking(tmp_path, npu):
    """The fix finder's finite_fill trial (and npu-migrate's inf-fill advice) fills finfo(fp32).min where
    the golden run filled -inf, both in fp32 (HF32 on): it was the first divergence of every such trial
    ('its argument input.2 is -inf in the golden run and -3.40282e+38 in the target'), so a trial that
    applied all candidates, the HF32 fix among them, never passed and no fix was found."""

    def finite_fill(model):
        model.fill = torch.finfo(torch.float32).min

    result = _dumps(tmp_path, lambda: _MaskedAttention(fill=float("-inf")), _masked_loss, hf32=True,
                    npu_only=finite_fill)
    [pair] = result.pairs
    assert pair.divergence is None, pair.divergence.reason
    assert not result.failed() and [row.name for row in pair.rows if row.verdict == ERROR] == []
    filled = {row.name: row.message for row in pair.rows if "a finite fill for an infinite one" in row.message}
    assert "Tensor.masked_fill.0.forward.output.0" in filled
    assert "input.2 -inf / -3.40282e+38" in filled["Tensor.masked_fill.0.forward.output.0"]


def test_a_mask_fill_constant_that_differs_for_another_reason_is_still_named(tmp_path, npu):
    """The NPU run fills -1e4 where the golden run fills finfo(fp32).min: not a dtype's constant."""
    result = _dumps(tmp_path, _MaskedAttention, _masked_loss, dtype=torch.float16,
                    npu_only=lambda model: setattr(model, "fill", -1e4))
    divergence = result.pairs[0].divergence
    assert divergence is not None and divergence.entry == "Tensor.masked_fill.0.forward"
    assert "its argument input.2 is -3.40282e+38 in the golden run and -10000 in the target" in divergence.reason


class _Router(nn.Module):
    """Top-1 routing over two experts whose router rows nearly tie: bf16 rounding picks the other
    expert for some tokens, as it does in a correct MoE."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(16, 2, bias=False), nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        with torch.no_grad():
            self.router.weight[1] = self.router.weight[0] + 0.003 * torch.randn(16)

    def forward(self, x):
        value, index = self.router(x).float().softmax(-1).topk(1, dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], 1).float()
        chosen = torch.gather(outputs, 1, index.unsqueeze(-1).expand(-1, 1, outputs.shape[-1])).squeeze(1)
        return chosen * value


def test_an_index_a_near_tie_flips_in_bf16_is_judged_where_it_is_used_not_at_the_selection(tmp_path, npu):
    """topk's indices differ where the router's logits nearly tie: an integer output 'integer values
    differ' by 26%, which was taken for an output error 260x the input's, the first divergence of a
    correct bf16 MoE."""
    result = _dumps(tmp_path, _Router, lambda model: model(torch.randn(32, 16, device="npu")).pow(2).mean(),
                    dtype=torch.bfloat16)
    [pair] = result.pairs
    flipped = [row for row in pair.rows if row.name == "Tensor.topk.0.forward.output.1"]
    assert flipped and flipped[0].error > 0.01  # the case: some tokens went to the other expert
    # the tokens routed elsewhere show where the indices are used (gather's output), carried, not amplified
    assert pair.divergence is None, pair.divergence.reason
