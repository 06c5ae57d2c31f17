import copy
import importlib
import math

import pytest
import torch
import torch._functorch.config as functorch_config
import torch_npu

STEPS = 5


def small_model(dtype=torch.float32, device="npu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.to(device=device, dtype=dtype)


def batches(device="npu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=generator).to(device, dtype), torch.randn(6, 4, generator=generator).to(device, dtype))
            for _ in range(STEPS)]


def train(model, optimizer, data, before_step=None):
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        if before_step is not None:
            before_step(optimizer)
        optimizer.step()
    return [p.detach().cpu().double() for p in model.parameters()]


def assert_params_close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


PAIRS = [
    ("NpuFusedAdam", dict(lr=1e-2, weight_decay=0.1), torch.optim.Adam),
    ("NpuFusedAdam", dict(lr=1e-2, amsgrad=True), torch.optim.Adam),
    ("NpuFusedAdamW", dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
    ("NpuFusedAdamW", dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True), torch.optim.AdamW),
    ("NpuFusedSGD", dict(lr=0.1), torch.optim.SGD),
    ("NpuFusedSGD", dict(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True), torch.optim.SGD),
    ("NpuFusedSGD", dict(lr=0.1, momentum=0.9, dampening=0.3), torch.optim.SGD),
    ("NpuFusedAdadelta", dict(lr=1.0, weight_decay=1e-2), torch.optim.Adadelta),
    ("NpuFusedRMSprop", dict(lr=1e-2, weight_decay=1e-2), torch.optim.RMSprop),
    ("NpuFusedRMSprop", dict(lr=1e-2, momentum=0.9, centered=True), torch.optim.RMSprop),
]


@pytest.mark.parametrize(("name", "kwargs", "reference"), PAIRS, ids=[f"{p[0]}-{i}" for i, p in enumerate(PAIRS)])
def test_fused_optimizer_steps_equal_torch_optim(name, kwargs, reference):
    model = small_model()
    twin = copy.deepcopy(model)
    data = batches()
    fused = train(model, getattr(torch_npu.optim, name)(model.parameters(), **kwargs), data)
    expected = train(twin, reference(twin.parameters(), **kwargs), data)
    assert_params_close(fused, expected, what=name)
    assert not all(torch.equal(a, b.cpu().double()) for a, b in zip(fused, small_model().parameters(), strict=True))


@pytest.mark.parametrize("module", ["npu_fused_optim_base", "npu_fused_sgd", "npu_fused_adadelta", "npu_fused_lamb",
                                    "npu_fused_adam", "npu_fused_adamw", "npu_fused_adamp", "npu_fused_bert_adam",
                                    "npu_fused_rmsprop", "npu_fused_rmsprop_tf"])
def test_each_optimizer_imports_from_its_module_as_in_the_wheel(module):
    """`from torch_npu.optim.npu_fused_adamw import NpuFusedAdamW`: the wheel's torch_npu.optim is a
    package with one module per optimizer, and code written for Ascend imports from them."""
    imported = importlib.import_module(f"torch_npu.optim.{module}")
    assert getattr(torch_npu.optim, module) is imported
    (name,) = [name for name in torch_npu.optim.__all__ if name in vars(imported)]
    assert getattr(imported, name) is getattr(torch_npu.optim, name)


def test_fused_adam_fp16_parameters_follow_torch_optim():
    model = small_model(torch.float16)
    twin = copy.deepcopy(model)
    data = batches(dtype=torch.float16)
    fused = train(model, torch_npu.optim.NpuFusedAdam(model.parameters(), lr=1e-2, eps=1e-4), data)
    expected = train(twin, torch.optim.Adam(twin.parameters(), lr=1e-2, eps=1e-4), data)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert_params_close(fused, expected, rtol=2e-3, atol=2e-3, what="fp16 Adam")


def test_fused_adamw_under_autocast_equals_torch_optim():
    model = small_model()
    twin = copy.deepcopy(model)
    data = batches()

    def run(net, optimizer):
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("npu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            optimizer.step()
        return [p.detach().cpu().double() for p in net.parameters()]

    fused = run(model, torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2))
    expected = run(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2))
    assert_params_close(fused, expected, what="autocast AdamW")


# ---- optimizers without a torch.optim twin: fp64 references from their documented formulas --------

def reference_run(model, data, update):
    """Train an fp64 CPU copy, `update(index, param, grad, state, step)` per parameter per step."""
    model = copy.deepcopy(model).cpu().double()
    states = [dict() for _ in model.parameters()]
    for step, (x, y) in enumerate(data, start=1):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x.cpu().double()), y.cpu().double()).backward()
        with torch.no_grad():
            update(list(model.parameters()), states, step)
    return [p.detach().clone() for p in model.parameters()]


def lamb_fp64(lr, betas, eps, weight_decay, use_global_grad_norm):
    def update(params, states, step):
        grads = [p.grad for p in params]
        if use_global_grad_norm:
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
            if norm > 1:
                grads = [g / norm for g in grads]
        for p, g, state in zip(params, grads, states, strict=True):
            m = state["m"] = betas[0] * state.get("m", 0) + (1 - betas[0]) * g
            v = state["v"] = betas[1] * state.get("v", 0) + (1 - betas[1]) * g * g
            adam_step = m / (v.sqrt() + eps) + weight_decay * p
            w_norm, a_norm = min(float(p.norm()), 10.0), float(adam_step.norm())
            ratio = w_norm / a_norm if w_norm > 0 and a_norm > 0 else 1.0
            p -= lr * ratio * adam_step
    return update


@pytest.mark.parametrize("use_global_grad_norm", [False, True])
def test_fused_lamb_against_its_fp64_formula(use_global_grad_norm):
    model = small_model()
    data = batches()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    expected = reference_run(model, data, lamb_fp64(**kwargs, use_global_grad_norm=use_global_grad_norm))
    optimizer = torch_npu.optim.NpuFusedLamb(model.parameters(), use_global_grad_norm=use_global_grad_norm, **kwargs)
    assert_params_close(train(model, optimizer, data), expected, rtol=1e-4, atol=1e-5, what="Lamb")


def bert_adam_fp64(lr, t_total, warmup, b1, b2, e, weight_decay, max_grad_norm):
    def update(params, states, step):
        grads = [p.grad for p in params]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        if max_grad_norm > 0 and max_grad_norm / (norm + 1e-6) < 1:
            grads = [g * (max_grad_norm / (norm + 1e-6)) for g in grads]
        progress = (step - 1) / t_total
        rate = lr * (progress / warmup if progress < warmup else max((progress - 1) / (warmup - 1), 0))
        for p, g, state in zip(params, grads, states, strict=True):
            m = state["m"] = b1 * state.get("m", 0) + (1 - b1) * g
            v = state["v"] = b2 * state.get("v", 0) + (1 - b2) * g * g
            p -= rate * (m / (v.sqrt() + e) + weight_decay * p)
    return update


def test_fused_bert_adam_with_warmup_linear_and_clipping():
    model = small_model()
    data = batches()
    kwargs = dict(lr=5e-2, t_total=10, warmup=0.3, b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=0.05)
    expected = reference_run(model, data, bert_adam_fp64(**kwargs))
    optimizer = torch_npu.optim.NpuFusedBertAdam(model.parameters(), **kwargs)
    assert_params_close(train(model, optimizer, data), expected, rtol=1e-4, atol=1e-5, what="BertAdam")


def rmsprop_tf_fp64(lr, alpha, eps, momentum, weight_decay, lr_in_momentum, decoupled_decay):
    def update(params, states, step):
        for p, state in zip(params, states, strict=True):
            g = p.grad
            if decoupled_decay:
                p *= 1 - weight_decay
            else:
                g = g + weight_decay * p
            sq = state.setdefault("sq", torch.ones_like(p))
            sq += (1 - alpha) * (g * g - sq)
            avg = (sq + eps).sqrt()
            buf = state.setdefault("buf", torch.zeros_like(p))
            if lr_in_momentum:
                buf.mul_(momentum).add_(lr * g / avg)
                p -= buf
            else:
                buf.mul_(momentum).add_(g / avg)
                p -= lr * buf
    return update


@pytest.mark.parametrize(("lr_in_momentum", "decoupled_decay"), [(True, False), (False, True)])
def test_fused_rmsprop_tf_against_its_fp64_formula(lr_in_momentum, decoupled_decay):
    model = small_model()
    data = batches()
    kwargs = dict(lr=1e-2, alpha=0.9, eps=1e-3, momentum=0.9, weight_decay=1e-2)
    expected = reference_run(model, data, rmsprop_tf_fp64(**kwargs, lr_in_momentum=lr_in_momentum,
                                                          decoupled_decay=decoupled_decay))
    optimizer = torch_npu.optim.NpuFusedRMSpropTF(model.parameters(), lr_in_momentum=lr_in_momentum,
                                                  decoupled_decay=decoupled_decay, **kwargs)
    assert_params_close(train(model, optimizer, data), expected, rtol=1e-4, atol=1e-5, what="RMSpropTF")


def adamp_fp64(lr, betas, eps, weight_decay, delta, wd_ratio):
    def update(params, states, step):
        for p, state in zip(params, states, strict=True):
            g = p.grad
            m = state["m"] = betas[0] * state.get("m", 0) + (1 - betas[0]) * g
            v = state["v"] = betas[1] * state.get("v", 0) + (1 - betas[1]) * g * g
            perturb = m / ((v / (1 - betas[1] ** step)).sqrt() + eps)
            ratio = 1.0
            if p.dim() > 1:
                for rows in (p.shape[0], 1):  # per output channel, then the whole layer
                    pv, gv = p.reshape(rows, -1), g.reshape(rows, -1)
                    cosine = (pv * gv).sum(1).abs() / (gv.norm(dim=1) + eps) / (pv.norm(dim=1) + eps)
                    if float(cosine.max()) < delta / math.sqrt(pv.shape[1]):
                        unit = pv / (pv.norm(dim=1, keepdim=True) + eps)
                        perturb = (perturb.reshape(rows, -1) - unit * (unit * perturb.reshape(rows, -1)).sum(1, keepdim=True)).reshape(p.shape)
                        ratio = wd_ratio
                        break
            p *= 1 - lr * weight_decay * ratio
            p -= lr / (1 - betas[0] ** step) * perturb
    return update


def test_fused_adamp_against_its_fp64_formula():
    model = small_model()
    data = batches()
    # delta=1 makes the projection fire for some weights of this small model
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, delta=1.0, wd_ratio=0.1)
    expected = reference_run(model, data, adamp_fp64(**kwargs))
    optimizer = torch_npu.optim.NpuFusedAdamP(model.parameters(), **kwargs)
    assert_params_close(train(model, optimizer, data), expected, rtol=1e-4, atol=1e-5, what="AdamP")


# ---- state_dict, clipping, refusals ------------------------------------------------------------

@pytest.mark.parametrize("name", ["NpuFusedAdamW", "NpuFusedSGD", "NpuFusedLamb", "NpuFusedRMSpropTF"])
def test_state_dict_round_trip_resumes_identically(name):
    kwargs = dict(lr=1e-2, momentum=0.9) if name in ("NpuFusedSGD", "NpuFusedRMSpropTF") else dict(lr=1e-2)
    cls = getattr(torch_npu.optim, name)
    data = batches()
    straight_model = small_model()
    straight = train(straight_model, cls(straight_model.parameters(), **kwargs), data)

    model = small_model()
    optimizer = cls(model.parameters(), **kwargs)
    train(model, optimizer, data[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = cls(model.parameters(), **kwargs)
    resumed.load_state_dict(saved)
    result = train(model, resumed, data[2:])
    for a, b in zip(result, straight, strict=True):
        assert torch.equal(a, b)


def test_clip_grad_norm_fused_equals_torch_clip_grad_norm():
    for norm_type in (2.0, 1.0, math.inf):
        model = small_model()
        twin = copy.deepcopy(model)
        x, y = batches()[0]
        for net in (model, twin):
            torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer = torch_npu.optim.NpuFusedAdamW(model.parameters())
        total = optimizer.clip_grad_norm_fused_(0.1, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1, norm_type)
        torch.testing.assert_close(total.cpu(), expected.cpu(), rtol=1e-6, atol=0)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-6, atol=1e-9)


def test_fused_optimizers_refuse_what_the_wheel_refuses():
    model = small_model()
    optimizer = torch_npu.optim.NpuFusedAdam(model.parameters())
    with pytest.raises(ValueError, match="set_to_none=True is not supported"):
        optimizer.zero_grad(set_to_none=True)
    bf16 = small_model(torch.bfloat16)
    torch.nn.functional.mse_loss(bf16(batches(dtype=torch.bfloat16)[0][0]).float(), torch.zeros(6, 4).npu()).backward()
    with pytest.raises(TypeError, match="must be float32 or float16"):
        torch_npu.optim.NpuFusedAdam(bf16.parameters()).step()
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        torch_npu.optim.NpuFusedAdamW(model.parameters(), betas=(1.0, 0.9))
    with pytest.raises(NotImplementedError, match="get_combined_grads"):
        optimizer.get_combined_grads()
    assert set(torch_npu.optim.__all__) >= {"NpuFusedAdamW", "NpuFusedAdam", "NpuFusedSGD", "NpuFusedLamb",
                                            "NpuFusedRMSprop", "NpuFusedRMSpropTF", "NpuFusedBertAdam",
                                            "NpuFusedAdadelta", "NpuFusedAdamP", "NpuFusedOptimizerBase"}


# ---- the ops ----------------------------------------------------------------------------------

def adam_w_fp64(var, m, v, grad, step, lr, wd, b1, b2, eps, max_v=None, maximize=False):
    g = -grad.double() if maximize else grad.double()
    m = b1 * m.double() + (1 - b1) * g
    v = b2 * v.double() + (1 - b2) * g * g
    # amsgrad: the update divides by max(max_grad_norm, v); v itself stays the moving average
    second = v if max_v is None else torch.maximum(max_v.double(), v)
    m_hat, v_hat = m / (1 - b1 ** step), second / (1 - b2 ** step)
    var = var.double()
    return var - lr / (v_hat.sqrt() + eps) * m_hat - lr * wd * var, m, v


@pytest.mark.parametrize(("dtype", "amsgrad", "maximize"), [(torch.float32, False, False), (torch.float32, True, True),
                                                             (torch.float16, False, False), (torch.bfloat16, True, False)])
def test_apply_adam_w_updates_var_m_v_in_place_against_fp64(dtype, amsgrad, maximize):
    torch.manual_seed(2)
    var, m, grad = torch.randn(3, 17), torch.randn(3, 17) * 0.1, torch.randn(3, 17)
    v, max_v = torch.rand(3, 17) * 0.01, torch.rand(3, 17) * 0.02
    step, b1, b2 = 3, 0.9, 0.999
    expected = adam_w_fp64(var.to(dtype), m.to(dtype), v.to(dtype), grad.to(dtype), step, 1e-2, 0.1, b1, b2, 1e-8,
                           max_v.to(dtype) if amsgrad else None, maximize)
    out = [t.to(dtype).npu() for t in (var, m, v)]
    result = torch_npu.npu_apply_adam_w(b1 ** (step - 1), b2 ** (step - 1), 1e-2, 0.1, b1, b2, 1e-8, grad.to(dtype).npu(),
                                        max_v.to(dtype).npu() if amsgrad else None, amsgrad, maximize, out=out)
    assert all(r is o for r, o in zip(result, out, strict=True))
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for actual, reference, what in zip(out, expected, ("var", "m", "v"), strict=True):
        torch.testing.assert_close(actual.cpu().double(), reference, rtol=tolerance, atol=tolerance, msg=what)


def test_apply_adam_w_first_step_is_torch_adamw():
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.randn(10))
    param.grad = torch.randn(10)
    var, m, v = param.detach().clone().npu(), torch.zeros(10).npu(), torch.zeros(10).npu()
    torch_npu.npu_apply_adam_w_out(1.0, 1.0, 1e-2, 0.05, 0.9, 0.999, 1e-8, param.grad.npu(), None, False, False, var, m, v)
    torch.optim.AdamW([param], lr=1e-2, weight_decay=0.05).step()
    torch.testing.assert_close(var.cpu(), param.detach(), rtol=1e-6, atol=1e-7)


def test_apply_adam_w_needs_out_and_max_grad_norm():
    grad = torch.randn(4).npu()
    with pytest.raises(RuntimeError, match="npu_apply_adam_w updates var, m and v in place"):
        torch_npu.npu_apply_adam_w(1.0, 1.0, 1e-3, 0.0, 0.9, 0.999, 1e-8, grad, None, False, False)
    with pytest.raises(ValueError, match="npu_apply_adam_w: amsgrad=True needs max_grad_norm"):
        torch_npu.npu_apply_adam_w(1.0, 1.0, 1e-3, 0.0, 0.9, 0.999, 1e-8, grad, None, True, False,
                                   out=(grad.clone(), grad.clone(), grad.clone()))


@pytest.mark.parametrize("nesterov", [False, True])
def test_apply_adam_is_tensorflow_apply_adam(nesterov):
    torch.manual_seed(4)
    var, m, v, grad = torch.randn(5), torch.randn(5) * 0.1, torch.rand(5) * 0.01, torch.randn(5)
    b1, b2, lr, eps, step = 0.9, 0.999, 1e-2, 1e-7, 4
    m_ref = m.double() + (grad.double() - m.double()) * (1 - b1)
    v_ref = v.double() + (grad.double() ** 2 - v.double()) * (1 - b2)
    lr_t = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    numerator = m_ref * b1 + (1 - b1) * grad.double() if nesterov else m_ref
    var_ref = var.double() - lr_t * numerator / (v_ref.sqrt() + eps)
    out = [t.npu() for t in (var, m, v)]
    torch_npu.npu_apply_adam(b1 ** step, b2 ** step, lr, b1, b2, eps, grad.npu(), False, nesterov, out=out)
    for actual, reference in zip(out, (var_ref, m_ref, v_ref), strict=True):
        torch.testing.assert_close(actual.cpu().double(), reference, rtol=1e-6, atol=1e-7)


# The wheel's schema returns var, m, v without alias annotations, so torch warns that the outputs
# alias inputs when it traces the op; the compiled update is still the eager one.
@pytest.mark.filterwarnings("ignore:.*must not also be an input to this custom operator")
def test_apply_adam_w_under_compile_equals_eager():
    torch.manual_seed(5)
    grad = torch.randn(8).npu()
    eager = [torch.randn(8).npu(), torch.zeros(8).npu(), torch.zeros(8).npu()]
    compiled_state = [t.clone() for t in eager]

    def adam_w_step(var, m, v, g):
        torch_npu.npu_apply_adam_w(0.9, 0.999, 1e-2, 0.01, 0.9, 0.999, 1e-8, g, None, False, False, out=(var, m, v))
        return var * 2

    expected = adam_w_step(*eager, grad)
    # torch_npu's schema returns var, m, v unannotated (`*, Tensor[] out) -> (Tensor, Tensor, Tensor)`),
    # and the kernel returns the very tensors it updated, as the real one does: torch.compile warns that
    # the outputs alias inputs (an error where the CI variable is set), for the real op as for this one.
    with functorch_config.patch(error_on_custom_op_aliasing=False), \
            pytest.warns(UserWarning, match="alias"):
        result = torch.compile(adam_w_step, backend="npu", fullgraph=True)(*compiled_state, grad)
    assert torch.equal(result.cpu(), expected.cpu())
    for a, b in zip(compiled_state, eager, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
