import gc

import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from npukit.npu_backend.fused import layout

ND, NCHW, NHWC, NC1HWC0, FRACTAL_Z, FRACTAL_NZ, NCDHW = 2, 0, 1, 3, 4, 29, 30


def test_untagged_tensors_report_their_natural_format():
    assert torch_npu.get_npu_format(torch.rand(2, 3, 4, 5).npu()) == NCHW  # the docs' example
    assert torch_npu.get_npu_format(torch.rand(2, 3, 4, 5, 6).npu()) == NCDHW
    assert torch_npu.get_npu_format(torch.rand(3, 4).npu()) == ND
    assert torch_npu.get_npu_format(torch.rand(3).npu()) == ND


def test_format_cast_reports_the_new_format_and_keeps_the_data():
    x = torch.rand(2, 3, 4, 5).npu()
    for acl_format in (ND, NHWC, NC1HWC0, FRACTAL_Z, FRACTAL_NZ, NCHW):
        cast = torch_npu.npu_format_cast(x, acl_format)
        assert torch_npu.get_npu_format(cast) == acl_format
        assert torch.equal(cast.cpu(), x.cpu()) and cast.shape == x.shape and cast.dtype == x.dtype
    assert torch_npu.get_npu_format(x) == NCHW  # the input keeps its own


def test_the_format_survives_the_tensor_being_passed_around():
    weight = torch.nn.Linear(16, 8).npu().weight
    weight.data = torch_npu.npu_format_cast(weight.data, FRACTAL_NZ)  # the usual inference idiom
    assert torch_npu.get_npu_format(weight) == FRACTAL_NZ
    holder = {"w": weight.data}
    assert torch_npu.get_npu_format(holder["w"]) == FRACTAL_NZ
    assert torch_npu.get_npu_format(weight.detach()) == FRACTAL_NZ
    assert torch_npu.get_npu_format(weight.data.npu_format_cast(ND)) == ND  # the Tensor method torch_npu adds


def test_the_tag_leaves_with_the_memory():
    cast = torch_npu.npu_format_cast(torch.rand(64, 64).npu(), FRACTAL_NZ)
    tagged = len(layout._STORAGE_FORMATS)
    del cast
    gc.collect()
    assert len(layout._STORAGE_FORMATS) == tagged - 1
    for _ in range(5):  # new allocations (possibly at the same address) start untagged
        assert torch_npu.get_npu_format(torch.rand(64, 64).npu()) == ND


def test_format_cast_in_place_from_a_tensor_or_a_format():
    x = torch.rand(2, 3, 4, 5).npu()
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast_(x, FRACTAL_NZ)) == FRACTAL_NZ  # the docs' example
    assert torch_npu.get_npu_format(x) == FRACTAL_NZ
    y = torch.rand(4, 4).npu()
    out = torch_npu.npu_format_cast_(y, x)
    assert out is y and torch_npu.get_npu_format(y) == FRACTAL_NZ
    torch_npu.npu_format_cast_(y, ND)
    assert torch_npu.get_npu_format(y) == ND


def test_format_cast_passes_the_gradient_through():
    x = torch.randn(4, 4).npu().requires_grad_()
    y = torch_npu.npu_format_cast(x, FRACTAL_NZ)
    (y * 3).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((4, 4), 3.0))


def test_format_cast_refuses_unknown_formats():
    with pytest.raises(ValueError, match="npu_format_cast.*unknown acl_format 7"):
        torch_npu.npu_format_cast(torch.rand(2, 2).npu(), 7)


def test_format_cast_under_compile():
    x = torch.rand(4, 8).npu()
    compiled = torch.compile(lambda t: torch_npu.npu_format_cast(t, FRACTAL_NZ) * 2, backend="npu", fullgraph=True)
    assert torch.equal(compiled(x).cpu(), x.cpu() * 2)

    def in_place(t):
        torch_npu.npu_format_cast_(t, FRACTAL_NZ)
        return t + 1

    # Compiled, the in-place cast traces (functionalized, it runs on a copy: the input's own memory is not
    # tagged, a limitation of the emulator's tags under torch.compile).
    y = torch.rand(4, 8).npu()
    assert torch.equal(torch.compile(in_place, backend="npu", fullgraph=True)(y).cpu(), y.cpu() + 1)


# ---- npu_confusion_transpose, npu_transpose, npu_broadcast ---------------------------------------

@pytest.mark.parametrize("transpose_first", [True, False])
def test_confusion_transpose_forward_and_backward(transpose_first):
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    if transpose_first:  # the docs' examples: transpose then reshape ...
        perm, shape, expected_shape = (0, 2, 1, 3), (2, 4, 18), (2, 4, 18)
        reference = lambda t: t.permute(perm).reshape(shape)  # noqa: E731
    else:  # ... or reshape then transpose
        perm, shape, expected_shape = (0, 2, 1), (2, 12, 6), (2, 6, 12)
        reference = lambda t: t.reshape(shape).permute(perm)  # noqa: E731
    x_npu = x.float().npu().requires_grad_()
    y = torch_npu.npu_confusion_transpose(x_npu, perm, shape, transpose_first)
    assert y.shape == expected_shape and y.is_contiguous()
    assert torch.equal(y.detach().cpu(), reference(x).float())
    dy = torch.randn(expected_shape, dtype=torch.float64)
    y.backward(dy.float().npu())
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(dy)
    assert torch.equal(x_npu.grad.cpu(), x_ref.grad.float())


def test_confusion_transpose_backward_is_an_op_of_its_own():
    grad = torch.randn(2, 4, 18)
    dx = torch.ops.npu.npu_confusion_transpose_backward(grad.npu(), [0, 2, 1, 3], [2, 3, 4, 6], False)
    assert torch.equal(dx.cpu(), grad.reshape(2, 4, 3, 6).permute(0, 2, 1, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.uint8])
def test_transpose_and_broadcast_are_contiguous_copies(dtype):
    x = torch.arange(30).reshape(2, 3, 5).to(dtype)
    y = torch_npu.npu_transpose(x.npu(), (2, 0, 1))
    assert y.shape == (5, 2, 3) and y.is_contiguous() and torch.equal(y.cpu(), x.permute(2, 0, 1))
    assert torch.equal(torch_npu.npu_transpose(x.npu(), (1, 0, 2), False).cpu(), x.permute(1, 0, 2))
    column = torch.tensor([[1], [2], [3]]).to(dtype)
    b = torch_npu.npu_broadcast(column.npu(), [3, 4])  # the docs' example
    assert b.is_contiguous() and torch.equal(b.cpu(), column.expand(3, 4))
    assert torch_npu.npu_broadcast(column.npu(), [2, 3, 4]).shape == (2, 3, 4)  # new leading dims
    out = torch.empty(5, 2, 3, dtype=dtype).npu()
    torch.ops.npu.npu_transpose(x.npu(), [2, 0, 1], out=out)
    assert torch.equal(out.cpu(), x.permute(2, 0, 1))


def test_layout_ops_refuse_bad_arguments_and_have_no_derivative():
    with pytest.raises(ValueError, match="npu_transpose.*perm"):
        torch_npu.npu_transpose(torch.randn(2, 3).npu(), (0, 0))
    with pytest.raises(ValueError, match="npu_broadcast.*cannot broadcast"):
        torch_npu.npu_broadcast(torch.randn(2, 3).npu(), [4, 3])
    with pytest.raises(ValueError, match="npu_confusion_transpose.*elements"):
        torch_npu.npu_confusion_transpose(torch.randn(2, 3).npu(), [1, 0], [4, 2], True)
    x = torch.randn(2, 3).npu().requires_grad_()
    with pytest.raises(NotImplementedError, match="derivative for torch_npu.npu_transpose"):
        torch_npu.npu_transpose(x, (1, 0)).sum().backward()


def test_golden_and_compile():
    x = torch.randn(2, 3, 4).half()
    with numerics.golden():
        golden = torch_npu.npu_confusion_transpose(x.npu(), [1, 0, 2], [3, 8], True).cpu()
    assert torch.equal(golden, torch_npu.npu_confusion_transpose(x, [1, 0, 2], [3, 8], True))

    def f(t):
        return (torch_npu.npu_confusion_transpose(t, [0, 2, 1], [2, 4, 3], True) * 2).sum() + \
            torch_npu.npu_transpose(t, [2, 1, 0]).sum() + torch_npu.npu_broadcast(t, [2, 2, 3, 4]).sum()

    t = torch.randn(2, 3, 4).npu()
    compiled = torch.compile(f, backend="npu", fullgraph=True)
    torch.testing.assert_close(compiled(t).cpu(), f(t).cpu())


def test_every_op_of_these_families_is_on_torch_npu_and_torch_ops_npu():
    from npukit.npu_backend import fused

    families = {"norms", "activations", "rotary", "softmax", "layout"}
    ops = [op for op in fused.load().values() if op.family in families]
    assert {"npu_swiglu", "npu_rotary_mul", "npu_scaled_masked_softmax", "npu_format_cast", "fast_gelu"} <= \
        {op.name for op in ops}
    for op in ops:
        attribute = getattr(torch_npu, op.name)  # grad ops too: the wheel exports all of torch.ops.npu
        assert not getattr(attribute, "npukit_missing", False), op.name
        if op.name == "npu_apply_rotary_pos_emb":  # the in-place update around the functional op
            assert attribute.__module__ == "npukit.npu_backend.fused.rotary"
        else:
            assert attribute is op.packet, op.name
    assert torch_npu.get_npu_format is layout.get_npu_format
