"""torch.npu.HalfTensor & co. and the default tensor type, as with torch_npu on an Ascend host.

torch_npu makes torch.npu.<Scalar>Tensor as real legacy tensor types (TensorType.cpp), but torch's
set_default_tensor_type accepts only torch's own CPU/CUDA type objects, so
`torch.set_default_tensor_type(torch.npu.HalfTensor)` raises TypeError there. LLaMA/fairscale-style
code that relied on `torch.set_default_tensor_type(torch.cuda.HalfTensor)` is migrated to
`torch.set_default_dtype(torch.float16)` + `torch.set_default_device("npu")`, and every legacy
constructor `torch.Tensor(*sizes)` of such a tree (which ignores the default device) is reported
with `torch.empty(*sizes)` as the replacement.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.npu_backend.conftest import run_python

INVALID_TYPE = "invalid type object: only floating-point types are supported as the default type"


@pytest.fixture(autouse=True)
def restore_defaults():
    yield
    torch.set_default_device(None)
    torch.set_default_tensor_type(torch.FloatTensor)
    torch.set_default_dtype(torch.float32)


def assert_cpu_float32_defaults():
    for tensor in (torch.Tensor(4, 4), torch.Tensor([1, 2]), torch.empty(3), torch.zeros(2),
                   nn.Linear(4, 4).weight):
        assert tensor.device == torch.device("cpu") and tensor.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("tensor_type", [
    "HalfTensor", "FloatTensor", "BFloat16Tensor", "DoubleTensor", "LongTensor",
    "torch.npu.HalfTensor", "torch.npu.FloatTensor",
])
def test_set_default_tensor_type_rejects_npu_types_like_torch_npu(tensor_type):
    arg = tensor_type if "." in tensor_type else getattr(torch.npu, tensor_type)
    with pytest.raises(TypeError, match=INVALID_TYPE):
        torch.set_default_tensor_type(arg)
    assert_cpu_float32_defaults()  # nothing changed


def test_npu_legacy_types_are_tensortype_objects_like_torch_npu():
    half = torch.npu.HalfTensor
    assert type(half).__name__ == "tensortype" and type(half) is not type(torch.HalfTensor)
    assert half in torch._tensor_classes
    assert repr(half) == "<class 'torch.npu.HalfTensor'>" and half.__module__ == "torch.npu"
    assert not half.__flags__ & (1 << 9)  # a static type, like torch_npu's
    assert half.dtype == torch.float16 and half.layout == torch.strided
    assert half.is_npu and not half.is_sparse
    assert half.add is torch.Tensor.add
    with pytest.raises(TypeError, match="not an acceptable base type"):
        type("Sub", (half,), {})
    expected = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
                "BFloat16Tensor": torch.bfloat16, "ByteTensor": torch.uint8, "CharTensor": torch.int8,
                "ShortTensor": torch.int16, "IntTensor": torch.int32, "LongTensor": torch.int64,
                "BoolTensor": torch.bool}
    assert {name: getattr(torch.npu, name).dtype for name in expected} == expected


def test_npu_legacy_constructors():
    w = torch.npu.HalfTensor(4, 4)
    assert w.shape == (4, 4) and w.device == torch.device("npu", 0) and w.dtype == torch.float16
    v = torch.npu.HalfTensor([1, 2])
    assert v.dtype == torch.float16 and v.tolist() == [1.0, 2.0]
    assert torch.npu.FloatTensor(torch.Size([2, 3])).shape == (2, 3)
    assert torch.npu.FloatTensor().shape == (0,)
    assert torch.npu.LongTensor([1, 2]).type() == "torch.npu.LongTensor"
    assert torch.npu.FloatTensor(2, device="npu:1").device == torch.device("npu", 1)
    with torch.npu.device(1):
        assert torch.npu.FloatTensor(2).device == torch.device("npu", 1)
    with pytest.raises(RuntimeError, match="legacy constructor expects device type: npu"):
        torch.npu.FloatTensor(2, device="cpu")
    with pytest.raises(TypeError, match="expected TensorOptions"):
        torch.npu.HalfTensor(torch.ones(2))  # a CPU tensor is not adopted, as with torch's legacy types
    alias = torch.npu.HalfTensor(w)
    assert alias.data_ptr() == w.data_ptr()


def test_npu_legacy_constructor_warns_once_and_needs_a_device():
    result = run_python("""
        import warnings
        import torch
        import npukit.npu_backend
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.npu.FloatTensor(2)
            torch.npu.HalfTensor(2)
        print(sum("torch.npu.*DtypeTensor constructors are no longer recommended" in str(w.message)
                  for w in caught))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    result = run_python("""
        import torch
        import npukit.npu_backend
        try:
            torch.npu.HalfTensor(2)
        except TypeError as exc:
            print(exc)
    """, env={"NPUKIT_DEVICE_COUNT": "0"})
    assert result.returncode == 0, result.stderr
    assert "type torch.npu.HalfTensor not available. Torch not compiled with npu enabled." in result.stdout


def test_isinstance_and_type_conversions():
    t = torch.ones(2, dtype=torch.float16, device="npu")
    assert t.type() == "torch.npu.HalfTensor"
    assert isinstance(t, torch.npu.HalfTensor) and not isinstance(t, torch.npu.FloatTensor)
    assert not isinstance(t.cpu(), torch.npu.HalfTensor) and not isinstance(t, torch.HalfTensor)
    assert isinstance(nn.Parameter(t), torch.npu.HalfTensor)
    assert t.type(torch.npu.FloatTensor).type() == "torch.npu.FloatTensor"
    assert t.type("torch.npu.FloatTensor").type() == "torch.npu.FloatTensor"
    moved = torch.ones(2).type(torch.npu.HalfTensor)
    assert moved.device.type == "npu" and moved.dtype == torch.float16
    back = t.type(torch.FloatTensor)
    assert back.device == torch.device("cpu") and back.dtype == torch.float32
    assert t.type(torch.npu.HalfTensor) is t


def test_unmigrated_cuda_default_type_raises_as_on_an_ascend_host():
    # The torch of an Ascend host is a CPU build: the CUDA type objects exist but are unavailable.
    with pytest.raises(TypeError, match="type torch.cuda.HalfTensor not available. Torch not compiled with CUDA"):
        torch.set_default_tensor_type(torch.cuda.HalfTensor)
    assert_cpu_float32_defaults()


def test_transfer_to_npu_maps_cuda_half_type_to_npu_and_still_raises():
    result = run_python("""
        import torch
        from npukit.npu_backend.torch_npu_shim import install_torch_npu
        install_torch_npu()
        import torch_npu.contrib.transfer_to_npu
        assert torch.cuda.HalfTensor is torch.npu.HalfTensor
        try:
            torch.set_default_tensor_type(torch.cuda.HalfTensor)
        except TypeError as exc:
            print(exc)
        print(torch.Tensor(2).device, torch.get_default_dtype())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [INVALID_TYPE, "cpu torch.float32"]


def test_restore_to_cpu_float32():
    torch.set_default_tensor_type(torch.HalfTensor)
    assert torch.Tensor(2).dtype == torch.float16 and torch.empty(2).dtype == torch.float16
    with pytest.raises(TypeError, match=INVALID_TYPE):
        torch.set_default_tensor_type(torch.npu.HalfTensor)
    assert torch.Tensor(2).dtype == torch.float16  # the failed call changed nothing
    torch.set_default_tensor_type(torch.FloatTensor)
    assert_cpu_float32_defaults()


def test_default_device_and_dtype_recipe():
    """The migration of set_default_tensor_type(torch.cuda.HalfTensor), and where it stops."""
    torch.set_default_dtype(torch.float16)
    torch.set_default_device("npu")
    for tensor in (torch.empty(3), torch.zeros(2), torch.tensor([1.0, 2.0]), nn.Linear(4, 4).weight,
                   nn.Linear(4, 4).bias):
        assert tensor.device == torch.device("npu", 0) and tensor.dtype == torch.float16
    # The legacy constructor follows the default tensor type only, never the default device.
    for tensor in (torch.Tensor(4, 4), torch.Tensor([1, 2])):
        assert tensor.device == torch.device("cpu") and tensor.dtype == torch.float16
    # Undoing it: set_default_tensor_type(torch.FloatTensor) resets the dtype, not the device.
    torch.set_default_tensor_type(torch.FloatTensor)
    assert torch.empty(2).device.type == "npu" and torch.empty(2).dtype == torch.float32
    torch.set_default_device(None)
    assert_cpu_float32_defaults()


class ColumnParallelLinear(nn.Module):
    """fairscale-style: the weight comes from the legacy constructor, then xavier init."""

    def __init__(self, in_features: int, out_features: int, legacy: bool):
        super().__init__()
        make = torch.Tensor if legacy else torch.empty
        self.weight = nn.Parameter(make(out_features, in_features))
        nn.init.xavier_normal_(self.weight)

    def forward(self, x):
        return F.linear(x, self.weight)


def run_step(layer):
    x = torch.randn(3, 8, dtype=torch.float16, device="npu")
    out = layer(x)
    assert out.device.type == "npu" and out.dtype == torch.float16
    out.float().pow(2).sum().backward()
    grad = layer.weight.grad
    assert grad.device.type == "npu" and grad.dtype == torch.float16 and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0


def test_model_parallel_layer_fp16_on_npu_under_the_migrated_defaults():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float16)
    torch.set_default_device("npu")

    migrated = ColumnParallelLinear(8, 16, legacy=False)  # torch.Tensor(out, in) -> torch.empty(out, in)
    assert migrated.weight.device.type == "npu" and migrated.weight.dtype == torch.float16
    assert 0.05 < migrated.weight.float().std().item() < 0.6  # xavier_normal_: std = sqrt(2 / 24)
    run_step(migrated)

    as_written = ColumnParallelLinear(8, 16, legacy=True)  # e.g. inside an unmigrated library
    assert as_written.weight.device.type == "cpu" and as_written.weight.dtype == torch.float16
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        as_written(torch.randn(3, 8, device="npu"))
    run_step(as_written.npu())
