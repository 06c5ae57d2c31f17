"""torch.npu has the surface of torch_npu.npu and each call does what it says."""

import time

import pytest
import torch


def test_current_device_and_device_context():
    assert torch.npu.current_device() == 0
    torch.npu.set_device(2)
    assert torch.npu.current_device() == 2
    assert torch.empty(1, device="npu").device == torch.device("npu", 2)
    with torch.npu.device(5):
        assert torch.npu.current_device() == 5
        assert torch.zeros(1, device="npu").device.index == 5
    assert torch.npu.current_device() == 2
    with pytest.raises(RuntimeError, match="Invalid device id"):
        torch.npu.set_device(8)


def test_device_count_is_configurable(tmp_path):
    from tests.npu_backend.conftest import run_python

    result = run_python("import npukit.npu_backend, torch; print(torch.npu.device_count())",
                        env={"NPUKIT_DEVICE_COUNT": "3"})
    assert result.stdout.strip() == "3", result.stderr
    result = run_python("import npukit.npu_backend, torch; print(torch.npu.device_count())",
                        env={"ASCEND_RT_VISIBLE_DEVICES": "2,5"})
    assert result.stdout.strip() == "2", result.stderr


def test_stream_and_event_are_synchronous_and_time_work():
    stream = torch.npu.Stream()
    assert stream.query()
    with torch.npu.stream(stream):
        assert torch.npu.current_stream() == stream
    assert torch.npu.current_stream() == torch.npu.default_stream()
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    torch.npu.synchronize()
    assert 15 <= start.elapsed_time(end) < 2000


def test_rng_is_per_device_and_reproducible():
    torch.npu.manual_seed(123)
    a = torch.randn(5, device="npu")
    torch.randn(100)  # the CPU generator is independent
    torch.npu.manual_seed(123)
    b = torch.randn(5, device="npu")
    assert torch.equal(a.cpu(), b.cpu())
    state = torch.npu.get_rng_state()
    c = torch.rand(3, device="npu")
    torch.npu.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="npu").cpu(), c.cpu())
    torch.manual_seed(7)  # seeds every npu generator too, as on CUDA
    d = torch.rand(3, device="npu:1")
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3, device="npu:1").cpu(), d.cpu())
    generator = torch.Generator(device="npu").manual_seed(1)
    e = torch.randn(4, device="npu", generator=generator)
    generator.manual_seed(1)
    assert torch.equal(torch.randn(4, device="npu", generator=generator).cpu(), e.cpu())


def _drawn_with(cpu_seed: int, npu_seed: int, draw):
    torch.manual_seed(cpu_seed)  # seeds the npu generators too: the npu seed is set after it
    torch.npu.manual_seed(npu_seed)
    return draw().cpu()


@pytest.mark.parametrize("what", ["dropout", "attention dropout", "alpha dropout"])
def test_dropout_masks_follow_the_npu_generator_not_the_cpus(what):
    """nn.Dropout's native_dropout has no generator argument: run on the CPU aliases, its mask came
    from the CPU generator, so torch.npu.manual_seed did not change it (torch_npu's follows it)."""
    import torch.nn.functional as F

    x = torch.randn(2, 3, 8, 16, device="npu")
    draw = {"dropout": lambda: F.dropout(x, 0.5, training=True),
            "attention dropout": lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.5),
            "alpha dropout": lambda: F.alpha_dropout(x, 0.5, training=True)}[what]
    first = _drawn_with(0, 1, draw)
    assert torch.equal(_drawn_with(5, 1, draw), first)  # another CPU seed: the same masks
    assert not torch.equal(_drawn_with(0, 2, draw), first)  # another npu seed: other masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_dropout_on_npu_computes_as_the_cpu_kernel(dtype):
    torch.npu.manual_seed(3)
    x = torch.randn(6, 40, device="npu", dtype=dtype).t()  # strided: the output keeps the layout
    out, mask = torch.native_dropout(x, 0.3, True)
    assert mask.dtype == torch.bool and mask.stride() == x.stride() == out.stride()
    kept = mask.float().mean().item()
    assert 0.55 < kept < 0.85
    # the CPU kernel's arithmetic: the scale a double, applied in the op's fp32 opmath
    assert torch.equal(out.cpu(), x.cpu().mul(mask.cpu().to(dtype)).mul_(1 / 0.7))
    for p, train in [(0.3, False), (0.0, True), (1.0, True)]:
        cpu_out, cpu_mask = torch.native_dropout(x.cpu(), p, train)  # no randomness in these cases
        npu_out, npu_mask = torch.native_dropout(x, p, train)
        assert torch.equal(npu_out.cpu(), cpu_out) and torch.equal(npu_mask.cpu(), cpu_mask), (p, train)
        assert npu_out.data_ptr() != x.data_ptr()
    empty = torch.empty(0, 3, device="npu", dtype=dtype)
    out, mask = torch.native_dropout(empty, 0.5, True)
    assert out is empty and mask.dtype == dtype and mask.shape == empty.shape
    # the gradient goes through the kept elements, scaled
    leaf = torch.randn(50, device="npu", requires_grad=True)
    out, mask = torch.native_dropout(leaf, 0.4, True)
    out.sum().backward()
    assert torch.allclose(leaf.grad.cpu(), mask.cpu().float() / 0.6)


def test_rng_state_is_seed_and_philox_offset_as_torch_npus():
    """DTensor's random ops (FSDP2's meta-device init, then reset_parameters) read the state as
    (seed, offset) and write offsets into it; the state was the CPU generator's 5056 bytes, and
    pytorch/examples' FSDP2 example failed in reset_parameters."""
    torch.npu.manual_seed(11)
    state = torch.npu.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    assert state[:8].view(torch.int64).item() == 11 and state[8:].view(torch.int64).item() == 0
    first = torch.rand(10, device="npu")
    after = torch.npu.get_rng_state()
    assert after[8:].view(torch.int64).item() == 12  # 10 elements, rounded up to a multiple of 4
    # a state made by hand (another offset, as DTensor does per shard) draws the same on every
    # generator set to it, and something else than its neighbour
    shard = state.clone()
    shard[8:] = torch.tensor([1000], dtype=torch.int64).view(torch.uint8)
    generator = torch.Generator(device="npu")
    generator.set_state(shard)
    torch.npu.set_rng_state(shard)
    drawn = torch.rand(10, device="npu")
    assert torch.equal(torch.rand(10, device="npu", generator=generator), drawn)
    assert not torch.equal(drawn, first)
    torch.npu.set_rng_state(state)
    assert torch.equal(torch.rand(10, device="npu"), first)
    with pytest.raises(RuntimeError, match="16 bytes of uint8"):
        torch.npu.set_rng_state(torch.get_rng_state())


def test_npukits_full_generator_state_is_read_without_changing_the_draws_and_set_back_exactly():
    """npukit's replay and the monitor's checkpoints record the npu generators with it: reading the
    16-byte state makes the generator continue from (seed, offset), so a run that wrote checkpoints drew
    other dropout masks than the same run without."""
    from npukit.npu_backend import _C

    def draws(read):
        torch.npu.manual_seed_all(0)
        first = torch.rand(4, device="npu:1")
        full = _C._generator_full_state(1) if read else None
        return torch.cat([first, torch.rand(8, device="npu:1")]).cpu(), full

    plain, _ = draws(False)
    read, full = draws(True)
    assert torch.equal(read, plain)
    torch.npu.manual_seed_all(5)
    torch.rand(3, device="npu")  # npu:0's generator is not touched by npu:1's state
    state0 = _C._generator_full_state(0)
    _C._set_generator_full_state(1, full)
    assert torch.equal(torch.rand(8, device="npu:1").cpu(), plain[4:])  # what the unread generator drew
    assert torch.equal(_C._generator_full_state(0), state0)
    # (seed, offset) as the public 16-byte state has them
    assert torch.equal(full[8:24], torch.tensor([0, 4], dtype=torch.int64).view(torch.uint8))
    assert torch.equal(torch.npu.get_rng_state(1), torch.tensor([0, 12], dtype=torch.int64).view(torch.uint8))
    with pytest.raises(RuntimeError, match="more than 24 bytes"):
        _C._set_generator_full_state(1, torch.npu.get_rng_state(1))
    other_version = full.clone()
    other_version[:8] = torch.tensor([2], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(RuntimeError, match="of version 2; this npukit reads version 1"):
        _C._set_generator_full_state(1, other_version)


def test_memory_accounting_follows_allocations():
    torch.npu.empty_cache()
    before = torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    x = torch.empty(1024, 1024, device="npu")
    assert torch.npu.memory_allocated() - before == 4 << 20
    y = x * 2  # result adopted from the CPU kernel is counted too
    assert torch.npu.memory_allocated() - before == 8 << 20
    del x, y
    assert torch.npu.memory_allocated() == before
    assert torch.npu.max_memory_allocated() - before == 8 << 20
    assert torch.npu.memory_stats()["allocated_bytes.all.peak"] == torch.npu.max_memory_allocated()
    assert torch.npu.memory_reserved() == torch.npu.memory_allocated()
    free, total = torch.npu.mem_get_info()
    assert total == 64 << 30 and free == total - torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == torch.npu.memory_allocated()


def test_out_of_memory_is_worded_like_the_device():
    torch.npu.set_per_process_memory_fraction(1 / 1024, device=3)  # 64 MiB
    try:
        keep = torch.empty(10 << 20, dtype=torch.uint8, device="npu:3")
        with pytest.raises(torch.OutOfMemoryError, match=r"NPU out of memory. Tried to allocate 100.00 MiB \(NPU 3;"):
            torch.empty(100 << 20, dtype=torch.uint8, device="npu:3")
        with pytest.raises(RuntimeError, match="NPU out of memory"):
            keep.repeat(10)  # results of CPU kernels are counted against the capacity too
        assert torch.npu.memory_stats(3)["num_ooms"] == 2
    finally:
        torch.npu.set_per_process_memory_fraction(1.0, device=3)


def test_device_properties_and_names():
    assert torch.npu.get_device_name() == "Ascend910B2 (emulated)"
    props = torch.npu.get_device_properties(0)
    assert props.total_memory == 64 << 30 and props.name.startswith("Ascend910B2")
    assert not hasattr(props, "major")  # as torch_npu: no CUDA compute capability
    assert torch.npu.is_bf16_supported()
    with pytest.warns(UserWarning):
        assert torch.npu.get_device_capability() is None


def test_hf32_switches_and_config():
    assert torch.npu.matmul.allow_hf32 is False
    assert torch.npu.conv.allow_hf32 is True
    torch.npu.matmul.allow_hf32 = True
    assert torch.npu.matmul.allow_hf32 is True
    torch.npu.config.allow_internal_format = False
    torch.npu.set_compile_mode(jit_compile=False)
    assert torch.npu.is_jit_compile_false()
    with pytest.raises(ValueError, match="invalid npu option name"):
        torch.npu.set_option({"NOT_AN_OPTION": 1})


def test_names_that_cannot_be_emulated_say_so():
    for name in ("NPUGraph", "graph", "stop_device", "MemPool", "set_dump"):
        api = getattr(torch.npu, name)
        with pytest.raises(NotImplementedError, match=f"torch.npu.{name} is not available on the npukit emulated NPU"):
            api()


def test_surface_covers_torch_npu_all():
    """Every name of torch_npu.npu.__all__ (2.14) exists on torch.npu."""
    import pathlib
    import re

    reference = pathlib.Path(__file__).resolve().parents[3] / "shared" / "reference" / "torch_npu_api.md"
    if not reference.exists():
        pytest.skip("shared/reference is not beside the checkout")
    section = reference.read_text().split("## 2. Public API surface")[1].split("Notes:")[0]
    names = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section))
    missing = sorted(name for name in names if not hasattr(torch.npu, name))
    assert len(names) > 130
    assert missing == []


def test_legacy_tensor_types():
    x = torch.npu.FloatTensor([1.0, 2.0])
    assert x.device.type == "npu" and x.dtype == torch.float32
    assert isinstance(x, torch.npu.FloatTensor)
    assert not isinstance(x, torch.npu.HalfTensor)
    assert torch.npu.LongTensor(3).shape == (3,)


def test_overflow_flag_utils():
    from torch.npu import utils

    assert utils.is_support_inf_nan()
    assert not utils.get_npu_overflow_flag()
    assert utils.npu_check_overflow(torch.tensor([float("inf")], device="npu"))
    assert not utils.npu_check_overflow(torch.ones(2, device="npu"))


def test_soc_version_is_torch_npus_number_of_the_emulated_chip():
    """torch_npu.npu.utils.get_soc_version(): torchair and AscendC build helpers select by it (>= 220 is 910B)."""
    from torch.npu import utils

    from tests.npu_backend.conftest import run_python

    assert utils.get_soc_version() == 221  # Ascend910B2, the default chip (SocVersion in NpuVariables.h)
    script = "import npukit.npu_backend, torch; print(torch.npu.utils.get_soc_version())"
    for chip, number in (("Ascend910B4", "224"), ("Ascend910_9391", "250")):
        result = run_python(script, env={"NPUKIT_CHIP": chip})
        assert result.stdout.strip() == number, result.stderr


def test_memory_capacity_from_environment_and_torch_npu_submodules_import():
    from tests.npu_backend.conftest import run_python

    result = run_python("""
        import torch
        from npukit.npu_backend.torch_npu_shim import install_torch_npu
        install_torch_npu()
        import torch_npu.npu.utils
        from torch_npu.npu.utils import npu_check_overflow, get_npu_overflow_flag, clear_npu_overflow_flag
        print(torch.npu.mem_get_info(0)[1], torch_npu.npu.utils is torch.npu.utils)
        try:
            torch.empty(3 << 20, dtype=torch.uint8, device="npu")
        except torch.OutOfMemoryError as exc:
            print(str(exc).split(" (")[0])
    """, env={"NPUKIT_MEMORY_CAPACITY": "2MiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [f"{2 << 20} True", "NPU out of memory. Tried to allocate 3.00 MiB"]
    bad = run_python("import npukit.npu_backend", env={"NPUKIT_MEMORY_CAPACITY": "lots"})
    assert bad.returncode != 0 and "NPUKIT_MEMORY_CAPACITY='lots'" in bad.stderr


@pytest.mark.parametrize("tensor_type", ["HalfTensor", "FloatTensor", "BFloat16Tensor"])
def test_an_npu_default_tensor_type_is_refused_as_torch_npu_refuses_it(tensor_type):
    """torch_npu's torch.npu.<X>Tensor classes have their own metaclass (torch_npu/csrc/utils/
    TensorType.cpp), which torch's set_default_tensor_type does not accept: npu-migrate therefore
    rewrites set_default_tensor_type(torch.cuda.HalfTensor) to set_default_device + set_default_dtype
    and reports the legacy constructors, instead of naming a type the device refuses."""
    before = torch.tensor([]).type()
    with pytest.raises(TypeError, match="only floating-point types are supported as the default type"):
        torch.set_default_tensor_type(getattr(torch.npu, tensor_type))
    assert torch.tensor([]).type() == before  # nothing half-set


def _cpu_has_fp16_matrix_unit() -> bool:
    """AMX-FP16, which the CPU's fp16 flash attention kernel needs to be fast (oneDNN's brgemm)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "amx_fp16" in cpuinfo.read().split()
    except OSError:
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_dot_product_attention_takes_the_kernel_the_cpu_takes(dtype):
    """F.scaled_dot_product_attention on npu runs the CPU's flash kernel where the CPU would (exp(S - max)
    read in the input dtype, the fp32 sums divided by the row sum at the end, as Ascend's flash kernel),
    not the math decomposition: the same outputs and gradients as on the CPU, bit for bit. fp16 on a
    CPU without AMX-FP16 takes npu's math path instead (the flash kernel's scalar fp16 GEMMs cost twice
    its time; the next test). With dropout it keeps the math path, whose mask follows the npu
    generator (test above)."""
    import torch.nn.functional as F

    if dtype is torch.float16 and not _cpu_has_fp16_matrix_unit():
        pytest.skip("fp16 takes npu's math path on a CPU without AMX-FP16 (the next test)")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 48, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.rand(48, 48) > 0.2
    on_npu = [t.detach().npu().requires_grad_() for t in (q, k, v)]
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        npu_kwargs = {name: value.npu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
        got = F.scaled_dot_product_attention(*on_npu, **npu_kwargs)
        assert type(got.grad_fn).__name__ == type(expected.grad_fn).__name__ == \
            "ScaledDotProductFlashAttentionForCpuBackward0"
        assert torch.equal(got.cpu(), expected)
        expected.sum().backward()
        got.sum().backward()
        for cpu_tensor, npu_tensor in zip((q, k, v), on_npu, strict=True):
            assert torch.equal(npu_tensor.grad.cpu(), cpu_tensor.grad)
            cpu_tensor.grad = npu_tensor.grad = None


def _math_path_rounding_p(q, k, v, mask=None, is_causal=False, gqa_repeats=1):
    """The documented fp16 math path, on CPU tensors: the CPU math path's fp32 steps (the scale's square
    root on each of q and k, the safe softmax), P rounded to fp16 straight-through, fp32 P @ V, one
    rounding at the end."""
    import math

    factor = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    key, value = (t.float().repeat_interleave(gqa_repeats, -3) for t in (k, v))
    scores = (q.float() * factor) @ (key.transpose(-2, -1) * factor)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if mask is not None:
        scores = scores + torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    probs = torch._safe_softmax(scores, -1)
    rounded = probs + (probs.detach().half().float() - probs.detach())
    return (rounded @ value).half()


@pytest.mark.skipif(_cpu_has_fp16_matrix_unit(), reason="the CPU has AMX-FP16: fp16 takes its flash kernel")
def test_fp16_scaled_dot_product_attention_on_the_math_path_rounds_p_as_the_flash_kernels():
    """On a CPU without AMX-FP16, fp16 attention on npu takes the math path (the CPU's fp16 flash kernel
    multiplies with scalar code there), with P rounded to fp16 before P @ V as Ascend's flash kernel
    rounds it: bit for bit the documented steps, gradients included (dP stays fp32: the rounding is
    straight-through), and not the CPU's math path, which leaves P in fp32."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 32, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, 2, 48, 32, dtype=torch.float16, requires_grad=True) for _ in range(2))
    mask = torch.rand(48, 48) > 0.2
    mask[3] = False  # a row with nothing to attend to: the safe softmax's zeros
    on_npu = [t.detach().npu().requires_grad_() for t in (q, k, v)]
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        npu_kwargs = {name: value.npu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
        expected = _math_path_rounding_p(q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False), 2)
        got = F.scaled_dot_product_attention(*on_npu, **npu_kwargs, enable_gqa=True)
        assert torch.equal(got.cpu(), expected)
        with sdpa_kernel(SDPBackend.MATH):
            cpu_math = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), **kwargs, enable_gqa=True)
        assert not torch.equal(got.cpu(), cpu_math)  # P's rounding shows in the output
        torch.testing.assert_close(got.cpu(), cpu_math, rtol=2e-3, atol=2e-3)
        grad_out = torch.randn_like(expected)
        expected.backward(grad_out)
        got.backward(grad_out.npu())
        for cpu_tensor, npu_tensor in zip((q, k, v), on_npu, strict=True):
            assert torch.equal(npu_tensor.grad.cpu(), cpu_tensor.grad)
            cpu_tensor.grad = npu_tensor.grad = None
