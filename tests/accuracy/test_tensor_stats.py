"""host_stats: a tensor's statistics in one C++ call (its fields read there), and where it steps
aside for tensor_stats' general path, which must then give the same values."""

from __future__ import annotations

import math

import pytest
import torch

from npukit.watch._tensor_stats import host_stats, record_host_stats
from npukit.watch.tensor_stats import tensor_stats

pytestmark = pytest.mark.usefixtures("npu")


def _exact(tensor: torch.Tensor) -> list[float]:
    data = tensor.detach().cpu().double()
    return [float(data.max()), float(data.min()), float(data.mean()), float(data.norm()), 0.0, 0.0]


def _views(dtype, device):
    torch.manual_seed(0)
    base = torch.randn(6, 40, 24, dtype=dtype, device=device) * 3
    return {"contiguous": base, "transposed": base.transpose(0, 2), "sliced": base[1:5, ::2, 2:20],
            "one element": base[2, 3, 4], "expanded row": base[0, 0].expand(5, 24), "parameter": torch.nn.Parameter(base)}


@pytest.mark.parametrize("device", ["cpu", "npu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_host_tensors_are_measured_in_place_as_torch_measures_them(dtype, device):
    for what, tensor in _views(dtype, device).items():
        values = host_stats(tensor, True)
        expected = _exact(tensor)
        if values is None:  # a layout the strided walk does not take (overlapping): the general path
            assert what == "expanded row"
            values = tensor_stats(tensor)
        assert values[:2] == expected[:2], what  # max and min: exact
        assert values[2:4] == pytest.approx(expected[2:4], rel=1e-6), what
        assert values[4:] == [0.0, 0.0]
        assert tensor_stats(tensor) == pytest.approx(values, rel=1e-12), what


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_finite_16_bit_value_converts_exactly(dtype):
    """The 16-bit kernels widen two elements from each 32-bit lane (and fp16 with F16C where the CPU
    has it): random bit patterns over the whole finite range, subnormals, zeros and both signs, in
    lengths that end inside a kernel step, measure as their float64 values do."""
    generator = torch.Generator().manual_seed(1)
    for length in (1, 31, 32, 33, 1000, 4099):
        bits = torch.randint(-2**15, 2**15, (length,), dtype=torch.int16, generator=generator)
        values = bits.view(dtype)
        finite = torch.isfinite(values.double())
        values = torch.where(finite, values, torch.zeros((), dtype=dtype))
        if dtype == torch.bfloat16:  # squares past float32's range: torch's path measures those
            values = torch.where(values.double().abs() < 1e18, values, torch.ones((), dtype=dtype))
        for tensor in (values, values.reshape(1, -1)[:, ::1], (values.view(torch.int16) & 0x83ff).view(dtype)):
            expected = _exact(tensor)
            measured = host_stats(tensor, True)
            assert measured[:2] == expected[:2], length  # max and min: exact
            assert measured[2:4] == pytest.approx(expected[2:4], rel=1e-4, abs=1e-30), length


def test_it_steps_aside_for_what_it_does_not_measure():
    class Marked(torch.Tensor):
        pass

    plain = torch.randn(8)
    with_nan = plain.clone()
    with_nan[3] = math.nan
    npu = plain.to("npu")
    cases = {"subclass": plain.as_subclass(Marked), "nan": with_nan, "integer": torch.arange(8),
             "float64": plain.double(), "empty": torch.empty(0), "meta": torch.empty(8, device="meta"),
             "sparse": plain.to_sparse(), "npu of another backend": npu}
    for what, tensor in cases.items():
        flag = what != "npu of another backend"  # the npu device is not npukit's: not host memory
        assert host_stats(tensor, flag) is None, what
    assert host_stats(npu, True) == tensor_stats(plain)
    # the general path still counts the nan
    assert tensor_stats(with_nan)[4] == 1.0


def test_record_host_stats_measures_a_tensor_once_per_version_and_steps_aside_like_host_stats():
    """The monitor's _add in one C++ call: the slot it appends is (kind, name, dtype, host_stats' values);
    the same tensor at the same version takes the values found in `measured` (not measured again), a
    write that bumps its version is measured anew; what host_stats steps aside for changes nothing."""
    measured, slots = {}, []
    tensor = torch.randn(4, 6, device="npu")
    first = host_stats(tensor, True)
    assert record_host_stats(measured, slots, "activation", "fc1", tensor, True) is True
    assert slots == [("activation", "fc1", torch.float32, first)]
    reference, version, values = measured[id(tensor)]
    assert reference() is tensor and version == tensor._version and values == first

    tensor.data.mul_(2)  # through .data: the tensor's version stays, so its recorded values are taken
    assert record_host_stats(measured, slots, "activation_grad", "fc2", tensor, True) is True
    assert slots[-1] == ("activation_grad", "fc2", torch.float32, first) and slots[-1][3] is values

    with torch.no_grad():
        tensor.mul_(2)  # a write the version counter sees: measured again
    assert record_host_stats(measured, slots, "grad", "w", tensor, True) is True
    assert slots[-1][3] == host_stats(tensor, True) and slots[-1][3][0] == pytest.approx(4 * first[0])

    with_nan = torch.tensor([1.0, math.nan], device="npu")
    with torch.inference_mode():
        inference = torch.randn(3, device="npu")  # no version counter
    for what, other in {"nan": with_nan, "integer": torch.arange(3, device="npu"), "inference": inference,
                        "half": tensor.half()}.items():
        before = (dict(measured), list(slots))
        recorded = record_host_stats(measured, slots, "activation", what, other, True)
        if what == "half":  # fp16 is measured too, under its own dtype
            assert recorded is True and slots[-1][2] == torch.float16
            continue
        assert recorded is False and (measured, slots) == before, what
