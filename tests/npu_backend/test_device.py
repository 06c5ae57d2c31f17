"""The npu device behaves like a real PyTorch device: tensors, views, storage, autograd."""

import copy
import io

import pytest
import torch


def test_device_is_available_and_named_npu():
    assert torch.npu.is_available()
    assert torch.npu.device_count() == 8
    x = torch.randn(2, 3, device="npu")
    assert type(x) is torch.Tensor
    assert x.device == torch.device("npu", 0)
    assert x.is_npu and not x.is_cpu
    assert torch.device("npu", 1).type == "npu"


def test_moving_tensors_and_modules():
    cpu = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(cpu.npu().cpu(), cpu)
    on1 = cpu.to("npu:1")
    assert on1.device.index == 1
    assert torch.equal(on1.to("npu:0").cpu(), cpu)
    model = torch.nn.Linear(3, 2)
    assert model.to("npu").weight.device.type == "npu"
    assert torch.nn.Linear(3, 2).npu().bias.is_npu


def test_tensors_have_real_strides_and_data_pointers():
    x = torch.zeros(4, 6, device="npu")
    t = x.t()
    assert t.stride() == (1, 6)
    assert t.data_ptr() == x.data_ptr()
    assert x[1].data_ptr() == x.data_ptr() + 6 * 4
    assert x.untyped_storage().nbytes() == 4 * 6 * 4


def test_inplace_on_view_mutates_base():
    base = torch.zeros(3, 4, device="npu")
    base[1].add_(5)
    base[:, 2].fill_(-1)
    base.t()[0].mul_(0)
    expected = torch.zeros(3, 4)
    expected[1] += 5
    expected[:, 2] = -1
    expected[:, 0] = 0
    assert torch.equal(base.cpu(), expected)


def test_data_and_parameter():
    p = torch.nn.Parameter(torch.ones(3, device="npu"))
    p.data.mul_(3)
    assert torch.equal(p.detach().cpu(), torch.full((3,), 3.0))
    assert isinstance(p, torch.nn.Parameter) and p.is_npu


def test_deepcopy_keeps_device_and_values():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to("npu:2")
    clone = copy.deepcopy(model)
    assert clone[0].weight.device == torch.device("npu", 2)
    assert torch.equal(clone[0].weight.cpu(), model[0].weight.cpu())
    assert clone[0].weight.data_ptr() != model[0].weight.data_ptr()


def test_save_load_keeps_view_sharing_and_honours_map_location():
    base = torch.arange(8.0, device="npu")
    view = base[2:6]
    buffer = io.BytesIO()
    torch.save({"base": base, "view": view}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["base"].device.type == "npu"
    loaded["view"].fill_(0)
    assert loaded["base"].cpu().tolist() == [0, 1, 0, 0, 0, 0, 6, 7]
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu")["base"].device.type == "cpu"
    buffer.seek(0)
    assert torch.load(buffer, map_location="npu:3")["base"].device == torch.device("npu", 3)
    buffer.seek(0)
    assert torch.load(buffer, map_location={"npu:0": "npu:1"})["view"].device == torch.device("npu", 1)


def test_numpy_refused_like_cuda():
    with pytest.raises(TypeError, match="can't convert npu:0 device type tensor to numpy. Use Tensor.cpu()"):
        torch.ones(2, device="npu").numpy()


def test_mixing_devices_raises_like_cuda():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="npu") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="npu:0") + torch.ones(3, device="npu:1")
    # 0-dim CPU tensors are allowed, as on CUDA.
    assert (torch.ones(3, device="npu") + torch.tensor(2.0)).cpu().tolist() == [3, 3, 3]


def test_a_written_argument_must_be_on_the_npu_even_0_dim_like_cuda():
    x = torch.ones(3, device="npu")
    for run in (lambda: torch.add(x, 1, out=torch.tensor(0.0)), lambda: torch.sum(x, 0, out=torch.tensor(0.0))):
        with pytest.raises(RuntimeError, match=r"Expected out tensor to have device npu:0, but got cpu instead"):
            run()


def test_an_input_passed_again_as_out_is_seen_as_the_same_tensor():
    """One CPU alias per npu tensor per call: the kernel sees the overlap, as on the CPU, and
    refuses to resize an output that is also an input (it resized the user's x to 5x5)."""
    x = torch.ones(5, 1, device="npu")
    with pytest.raises(RuntimeError, match=r"output with shape \[5, 1\] doesn't match the broadcast shape \[5, 5\]"):
        torch.add(x, torch.ones(5, 5, device="npu"), out=x)
    assert x.shape == (5, 1)
    w = torch.ones(4, device="npu")
    with pytest.raises(RuntimeError, match=r"output with shape \[3\] doesn't match the broadcast shape \[4, 3\]"):
        w[:3].ldexp_(torch.ones(4, 3, device="npu"))
    y = torch.tensor([1.0, 2.0], device="npu")
    torch.mul(y, y, out=y)
    assert y.cpu().tolist() == [1.0, 4.0]


def test_zero_tensors_have_no_memory_and_are_read_as_zeros():
    zero = torch._efficientzerotensor(4, device="npu")
    assert zero._is_zerotensor() and zero.device.type == "npu"
    assert zero.sum().item() == 0 and (zero + 1).cpu().tolist() == [1.0] * 4
    # sgn's backward returns a zero tensor for real inputs: this crashed the process.
    x = torch.randn(5, device="npu", requires_grad=True)
    torch.sgn(x).sum().backward()
    assert x.grad.cpu().tolist() == [0.0] * 5


def test_out_variants_that_check_the_device_type_run_on_npu():
    a = torch.tensor([[1.0, 1.0, 2.0], [3.0, 0.0, 0.0]], device="npu")
    values, indices = torch.empty(2, device="npu"), torch.empty(2, dtype=torch.long, device="npu")
    torch.mode(a, out=(values, indices))
    assert values.cpu().tolist() == [1.0, 0.0] and values.device.type == "npu"


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_legacy_storage_classes_are_classes_for_every_dtype():
    assert torch.ones(2, device="npu").storage_type() is torch.npu.FloatStorage
    assert torch.ones(2, device="npu").half().storage_type() is torch.npu.HalfStorage
    assert torch.ones(2, device="npu", dtype=torch.complex64).storage_type() is torch.npu.ComplexFloatStorage
    storage = torch.npu.FloatStorage(3)
    assert storage.device.type == "npu" and storage.dtype == torch.float32 and len(storage) == 3
    assert isinstance(torch.ones(2, device="npu").storage(), torch.npu.FloatStorage)
    assert not isinstance(torch.ones(2).storage(), torch.npu.FloatStorage)


def test_float64_matmul_is_refused_with_the_way_to_run_gradchecks():
    x = torch.ones(3, device="npu", dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"aten::dot: float64 is not supported .* npu-run --golden, pytest --npu-golden"):
        torch.dot(x, x)
    from npukit.npu_backend import numerics

    with numerics.golden():  # gradcheck in float64 runs with the NPU numerics off
        w = torch.randn(3, 3, device="npu", dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda m: (m @ m).sum(), (w,))


def test_conj_and_neg_bits_are_resolved_on_device():
    z = torch.tensor([1 + 2j, 3 - 1j], device="npu")
    assert torch.equal(z.conj().resolve_conj().cpu(), torch.tensor([1 - 2j, 3 + 1j]))
    assert torch.equal((z.conj() * 1).cpu(), torch.tensor([1 - 2j, 3 + 1j]))
    assert torch.equal(z.conj().imag.neg().cpu(), torch.tensor([2.0, -1.0]))


def test_out_argument_resized_on_device():
    out = torch.empty(0, device="npu")
    torch.add(torch.ones(5, device="npu"), 1, out=out)
    assert out.shape == (5,) and out.device.type == "npu"
    assert out.cpu().tolist() == [2.0] * 5


def test_dropout_and_factories_with_device_argument():
    torch.manual_seed(0)
    x = torch.ones(1000, device="npu")
    y = torch.nn.functional.dropout(x, 0.5, training=True)
    kept = (y.cpu() != 0).float().mean().item()
    assert 0.4 < kept < 0.6 and y.device.type == "npu"
    assert torch.tril_indices(3, 3, device="npu").device.type == "npu"
    assert torch.arange(5, device="npu:1").device == torch.device("npu", 1)


def test_autograd_matches_cpu():
    torch.manual_seed(0)
    w = torch.randn(5, 3)
    x = torch.randn(7, 5)
    results = []
    for device in ("cpu", "npu"):
        wd = w.to(device).detach().requires_grad_()
        loss = torch.tanh(x.to(device) @ wd).pow(2).sum()
        loss.backward()
        results.append((loss.detach().cpu(), wd.grad.cpu()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_pin_memory():
    pinned = torch.ones(4).pin_memory()
    assert pinned.is_pinned()
    assert not torch.ones(4).is_pinned()


def test_backward_after_cpu_backward_and_from_other_threads():
    """Autograd ran before the device was installed, and backward runs from a worker thread."""
    from tests.npu_backend.conftest import run_python

    result = run_python("""
        import threading, torch
        w = torch.randn(3, requires_grad=True)
        (w * 2).sum().backward()
        import npukit.npu_backend
        v = torch.ones(3, device="npu", requires_grad=True)
        (v * 2).sum().backward()
        out = {}
        def worker():
            u = torch.ones(3, device="npu", requires_grad=True)
            (u * 3).sum().backward()
            out["grad"] = u.grad.cpu().tolist()
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        print(v.grad.cpu().tolist(), out["grad"])
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2.0, 2.0, 2.0] [3.0, 3.0, 3.0]"


def test_parameter_data_swapped_between_cpu_and_npu():
    """`param.data = param.to("npu")`, as FSDP does with a CPU model and a device id."""
    param = torch.nn.Parameter(torch.arange(3.0))
    param.data = param.to("npu")
    assert isinstance(param, torch.nn.Parameter) and param.device.type == "npu"
    assert param.cpu().tolist() == [0.0, 1.0, 2.0]
    param.data = param.cpu()
    assert param.device.type == "cpu"


def test_storage_resized_to_zero_stays_on_its_npu():
    """FSDP frees a shard with storage._resize_(0) and later set_()s it back."""
    t = torch.ones(4, device="npu:1")
    storage = t.untyped_storage()
    storage.resize_(0)
    assert storage.device == torch.device("npu", 1) and storage.nbytes() == 0
    storage.resize_(16)
    t.set_(storage, 0, (4,), (1,))
    assert t.device == torch.device("npu", 1)


def test_module_to_npu_moves_its_parameters_in_place():
    """As with torch_npu, Module.to("npu") keeps the Parameter objects (an optimizer made earlier
    still holds the model's parameters)."""
    model = torch.nn.Linear(2, 2)
    weight = model.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("npu")
    assert model.weight is weight and weight.device.type == "npu"
    model(torch.ones(1, 2, device="npu")).sum().backward()
    optimizer.step()
    assert optimizer.param_groups[0]["params"][0].device.type == "npu"


def test_a_tensor_changed_in_place_is_read_as_it_is_now():
    """Small ops reuse the CPU alias of an argument they read before (and results become npu tensors
    without a copy): a tensor whose shape, strides, storage or values changed since must be read as
    it is now, and a tensor sharing the old memory must keep reading it."""
    results = {}
    for device in ("cpu", "npu"):
        x = torch.arange(12.0, device=device).reshape(3, 4)
        seen = [x + 1]
        x.t_()
        seen.append(x + 1)
        x.resize_(12)
        seen.append(x * 2)
        x.as_strided_((2, 2), (1, 2), 1)
        seen.append(x.sum())
        x.set_(torch.ones(5, device=device))
        seen.append(x + 1)
        x.fill_(3.0)
        seen.append(x + 1)
        results[device] = seen
    for on_cpu, on_npu in zip(results["cpu"], results["npu"]):
        assert torch.equal(on_npu.cpu(), on_cpu)

    out = torch.zeros(2, device="npu")
    old_view = out[:]
    assert torch.equal((out + 1).cpu(), torch.ones(2))
    with pytest.warns(UserWarning, match="resized"):
        torch.add(torch.ones(3, 3, device="npu"), 1, out=out)  # resized: new memory
    assert torch.equal((out + 1).cpu(), torch.full((3, 3), 3.0))
    assert torch.equal((old_view + 1).cpu(), torch.ones(2))  # the old memory, untouched


def test_results_made_without_a_copy_are_accounted_and_freed():
    before = torch.npu.memory_allocated()
    x = torch.ones(1024, device="npu")
    y = x * 2
    assert torch.npu.memory_allocated() == before + 2 * 4096
    assert y.device == x.device and y.untyped_storage().device == x.device
    assert y.untyped_storage().data_ptr() == y.data_ptr() and y.sum().item() == 2048.0
    del x, y
    assert torch.npu.memory_allocated() == before
    on2 = torch.ones(3, device="npu:2") + 1
    assert on2.device == torch.device("npu", 2) and on2.untyped_storage().device == torch.device("npu", 2)


def test_the_same_tensors_used_from_several_threads_at_once():
    import threading

    weights = torch.randn(64, 64, device="npu")
    inputs = [torch.randn(8, 64, device="npu") for _ in range(4)]
    expected = [(x.cpu() @ weights.cpu()).relu() for x in inputs]
    failures = []

    def work(i):
        for _ in range(300):
            got = (inputs[i] @ weights).relu().cpu()
            if not torch.allclose(got, expected[i]):
                failures.append(i)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_a_copy_between_overlapping_views_is_refused_as_on_the_cpu():
    """a.copy_(a.t()) reads what it writes: the CPU refuses it; npu wrote [[0, 2], [2, 3]] silently
    (the two views got a CPU storage each, so the overlap check could not see it)."""
    for device in ("cpu", "npu"):
        a = torch.arange(4.0, device=device).reshape(2, 2)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            a.copy_(a.view(2, 2).t())
        b = torch.arange(6.0, device=device)
        b[:3].copy_(b[3:])  # the same storage, no overlap: allowed
        assert b.tolist() == [3.0, 4.0, 5.0, 3.0, 4.0, 5.0]
