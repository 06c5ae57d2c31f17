import pytest
import torch
import torch_npu

from npukit.npu_backend import numerics
from tests.npu_backend.fused.reference import assert_close_to_reference, relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COUNTS = [3, 0, 5, 2]  # an empty group too


def grouped_fp64(x, weights, counts, biases=None):
    """The documented semantics, unfused: rows of group e times weight e (+ bias e), in fp64."""
    outs, start = [], 0
    for e, count in enumerate(counts):
        y = x[start:start + count].double() @ weights[e].double()
        if biases is not None:
            y = y + biases[e].double()
        outs.append(y)
        start += count
    return torch.cat(outs)


def leaves(*tensors, dtype, device="npu"):
    return [t.to(dtype).to(device).requires_grad_() for t in tensors]


def reference_leaves(*tensors, dtype):
    # the fp64 reference sees the values the op reads (rounded to dtype)
    return [t.to(dtype).double().requires_grad_() for t in tensors]


def test_the_ops_are_one_op_under_both_names():
    for name in ("npu_grouped_matmul", "npu_bmmV2", "npu_linear"):
        assert getattr(torch_npu, name) is getattr(torch.ops.npu, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("stacked_weight", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_matmul_group_list_against_fp64(dtype, group_list_type, stacked_weight, with_bias):
    torch.manual_seed(0)
    m, k, n, experts = sum(COUNTS), 12, 10, len(COUNTS)
    x, w, b = torch.randn(m, k).to(dtype), torch.randn(experts, k, n).to(dtype), torch.randn(experts, n).to(dtype)
    y_ref = grouped_fp64(x, w, COUNTS, b if with_bias else None)
    counts = torch.tensor(COUNTS)
    group_list = (counts.cumsum(0) if group_list_type == 0 else counts).npu()
    weight = [w.npu()] if stacked_weight else list(w.npu().unbind(0))
    bias = None if not with_bias else [b.npu()] if stacked_weight else list(b.npu().unbind(0))
    (y,) = torch_npu.npu_grouped_matmul([x.npu()], weight, bias=bias, group_list=group_list, split_item=3,
                                        group_type=0, group_list_type=group_list_type)
    assert y.dtype == dtype and y.shape == (m, n) and y.device.type == "npu"
    assert_close_to_reference(y, y_ref, dtype, "y")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_list_forms_against_fp64(dtype):
    """group_type -1: each x (here 3-D) times its own weight; split_item 3 with several x: one
    output of the stacked products; the int-list group_list overload: one x split into groups."""
    torch.manual_seed(1)
    shapes = [((2, 3, 8), (8, 6)), ((4, 5, 4), (4, 7))]
    xs = [torch.randn(s) for s, _ in shapes]
    ws = [torch.randn(s) for _, s in shapes]
    bs = [torch.randn(s[1]) for _, s in shapes]
    tensors = [t.to(dtype) for t in (*xs, *ws, *bs)]
    outs = torch_npu.npu_grouped_matmul([t.npu() for t in tensors[:2]], [t.npu() for t in tensors[2:4]],
                                        bias=[t.npu() for t in tensors[4:]], split_item=0, group_type=-1)
    refs = [tensors[i].double() @ tensors[2 + i].double() + tensors[4 + i].double() for i in range(2)]
    for out, ref in zip(outs, refs):
        assert out.dtype == dtype and out.shape == ref.shape
        assert_close_to_reference(out, ref, dtype, "y_i")

    # 多多单: several 2-D x, one output
    x2 = [torch.randn(3, 8), torch.randn(5, 8)]
    w2 = [torch.randn(8, 6), torch.randn(8, 6)]
    (y,) = torch_npu.npu_grouped_matmul([t.to(dtype).npu() for t in x2], [t.to(dtype).npu() for t in w2],
                                        split_item=3, group_type=0)
    ref = torch.cat([x2[0].to(dtype).double() @ w2[0].to(dtype).double(),
                     x2[1].to(dtype).double() @ w2[1].to(dtype).double()])
    assert_close_to_reference(y, ref, dtype, "y")

    # the int-list overload: cumulative row ends, group_type None, one output per group or one
    x3, w3 = torch.randn(9, 8), [torch.randn(8, 6) for _ in range(3)]
    ends = [2, 2, 9]
    per_group = torch_npu.npu_grouped_matmul([x3.to(dtype).npu()], [t.to(dtype).npu() for t in w3],
                                             group_list=ends, split_item=1)
    assert [tuple(t.shape) for t in per_group] == [(2, 6), (0, 6), (7, 6)]
    ref = grouped_fp64(x3.to(dtype), [t.to(dtype) for t in w3], [2, 0, 7])
    assert_close_to_reference(torch.cat(per_group), ref, dtype, "y")
    (single,) = torch_npu.npu_grouped_matmul([x3.to(dtype).npu()], [t.to(dtype).npu() for t in w3],
                                             group_list=ends, split_item=2)
    assert torch.equal(single.cpu(), torch.cat(per_group).cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_split_k_is_the_weight_gradient(dtype):
    """group_type=2: x [M, K] and weight [K, N] split along K by group_list, one [M, N] per group
    (what MindSpeed-style gmm backward calls with x.t() for the weight gradient)."""
    torch.manual_seed(2)
    m, n, counts = 6, 5, [4, 0, 7]
    x, w = torch.randn(sum(counts), m).to(dtype), torch.randn(sum(counts), n).to(dtype)
    bounds = torch.tensor([0] + counts).cumsum(0).tolist()
    y_ref = torch.stack([x[a:b].double().t() @ w[a:b].double() for a, b in zip(bounds, bounds[1:])])
    (y,) = torch_npu.npu_grouped_matmul([x.npu().t()], [w.npu()], group_list=torch.tensor(counts).npu(),
                                        split_item=3, group_type=2, group_list_type=1)
    assert y.shape == (len(counts), m, n) and y.dtype == dtype
    assert torch.count_nonzero(y[1]) == 0  # an empty group sums nothing
    assert_close_to_reference(y, y_ref, dtype, "y")
    per_group = torch_npu.npu_grouped_matmul([x.npu().t()], [w.npu()], group_list=torch.tensor(counts).npu(),
                                             split_item=0, group_type=2, group_list_type=1)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(per_group, y.unbind(0)))


class GmmFunction(torch.autograd.Function):
    """How training code on Ascend differentiates npu_grouped_matmul (torch_npu has no autograd
    for it): a backward of two more grouped matmuls, M-split for dx and K-split for dweight."""

    @staticmethod
    def forward(ctx, x, weight, group_list):
        ctx.save_for_backward(x, weight, group_list)
        return torch_npu.npu_grouped_matmul([x], [weight], group_list=group_list, split_item=2, group_type=0,
                                            group_list_type=1)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight, group_list = ctx.saved_tensors
        dx = torch_npu.npu_grouped_matmul([grad], [weight.transpose(1, 2)], group_list=group_list, split_item=2,
                                          group_type=0, group_list_type=1)[0]
        dweight = torch_npu.npu_grouped_matmul([x.t()], [grad], group_list=group_list, split_item=3, group_type=2,
                                               group_list_type=1)[0]
        return dx, dweight, None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_user_gmm_autograd_function_matches_fp64(dtype):
    """Training through npu_grouped_matmul the way Ascend code does: forward and backward against
    the per-expert loop in fp64."""
    torch.manual_seed(3)
    x, w, dy = torch.randn(10, 8), torch.randn(4, 8, 6), torch.randn(10, 6)
    counts = [1, 4, 0, 5]
    x_npu, w_npu = leaves(x, w, dtype=dtype)
    y = GmmFunction.apply(x_npu, w_npu, torch.tensor(counts).npu())
    dx, dw = torch.autograd.grad(y, [x_npu, w_npu], dy.to(dtype).npu())
    x_ref, w_ref = reference_leaves(x, w, dtype=dtype)
    y_ref = grouped_fp64(x_ref, w_ref, counts)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, [x_ref, w_ref], dy.to(dtype).double())
    assert dx.dtype == dw.dtype == dtype
    assert_close_to_reference(y, y_ref, dtype, "y")
    assert_close_to_reference(dx, dx_ref, dtype, "dx", factor=2)
    assert_close_to_reference(dw, dw_ref, dtype, "dweight", factor=2)


def test_grouped_matmul_backward_raises_as_torch_npu_does():
    """torch_npu 2.13 has no autograd for npu_grouped_matmul: code that differentiates it directly
    fails on the device, so it fails here too (instead of training here only)."""
    x = torch.randn(4, 8, device="npu", requires_grad=True)
    w = torch.randn(2, 8, 4, device="npu")
    (y,) = torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]).npu(), split_item=3,
                                        group_type=0, group_list_type=1)
    with pytest.raises(NotImplementedError, match="the derivative for torch_npu.npu_grouped_matmul is not implemented"):
        y.sum().backward()
    (y,) = torch_npu.npu_grouped_matmul([x], [w[0], w[1]], group_list=[1, 4], split_item=2)  # the .List overload
    with pytest.raises(NotImplementedError, match="is not implemented"):
        y.sum().backward()
    with torch.no_grad():
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]).npu(), split_item=3, group_type=0,
                                     group_list_type=1)


def test_grouped_matmul_is_seen_by_dispatch_modes():
    """Its autograd kernel calls the npu kernel directly only when nothing sits between autograd and
    the device: a TorchDispatchMode (msprobe-style dumps) still sees the op and its result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, device="npu")
    w = torch.randn(2, 8, 4, device="npu", requires_grad=True)
    group_list = torch.tensor([1, 3]).npu()
    recorder = Recorder()
    with recorder:
        (seen,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                               group_list_type=1)
    assert "npu.npu_grouped_matmul.default" in recorder.ops
    (direct,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                             group_list_type=1)
    assert torch.equal(seen.cpu(), direct.cpu())
    assert seen.requires_grad and direct.requires_grad  # both tied to the raising backward


def test_grouped_matmul_fp16_rounds_once_like_the_kernel():
    torch.manual_seed(4)
    x, w = (torch.randn(64, 256) * 4).half(), (torch.randn(2, 256, 32) * 4).half()
    counts = [24, 40]
    (y,) = torch_npu.npu_grouped_matmul([x.npu()], [w.npu()], group_list=torch.tensor(counts).npu(), split_item=3,
                                        group_type=0, group_list_type=1)
    exact = grouped_fp64(x, w, counts)
    assert relative_error(y.cpu(), exact) <= relative_error(exact.half(), exact) * 1.01
    # an fp16 accumulation per group would be further off
    unfused = torch.cat([(x[:24].float() @ w[0].float()).half(), (x[24:].float() @ w[1].float()).half()])
    assert torch.equal(y.cpu(), unfused)


def test_grouped_matmul_golden_run_is_the_cpu_kernel():
    torch.manual_seed(5)
    x, w = torch.randn(9, 8).half(), torch.randn(3, 8, 4).half()
    group_list = torch.tensor([2, 3, 4])
    kwargs = dict(split_item=3, group_type=0, group_list_type=1)
    with numerics.golden():
        golden = torch_npu.npu_grouped_matmul([x.npu()], [w.npu()], group_list=group_list.npu(), **kwargs)[0].cpu()
    cpu = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, **kwargs)[0]
    assert torch.equal(golden, cpu)


def test_matmul_ops_under_compile_equal_eager():
    torch.manual_seed(6)
    x, w, group_list = torch.randn(9, 8).npu(), torch.randn(3, 8, 4).npu(), torch.tensor([2, 3, 4]).npu()
    a, b = torch.randn(2, 3, 8).npu(), torch.randn(2, 8, 5).npu()

    def fn(x, w, group_list, a, b):
        y = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                         group_list_type=1)[0]
        z = torch_npu.npu_bmmV2(a, b, [])
        return y * 2, torch_npu.npu_linear(z[0], b[0]) + 1

    compiled = torch.compile(fn, backend="npu", fullgraph=True)
    for got, expected in zip(compiled(x, w, group_list, a, b), fn(x, w, group_list, a, b)):
        torch.testing.assert_close(got.cpu(), expected.cpu())


def test_grouped_matmul_trains_under_compile():
    """A gmm autograd.Function compiles with its backward (the grouped matmuls stay the op); one
    output per group (sizes from the group_list's values) traces with unbacked sizes."""
    torch.manual_seed(10)
    leaves_ = [torch.randn(9, 8).npu().requires_grad_(), torch.randn(3, 8, 4).npu().requires_grad_()]
    group_list = torch.tensor([2, 3, 4]).npu()

    def loss(x, w):
        return GmmFunction.apply(x, w, group_list).relu().square().sum()

    compiled_grads = torch.autograd.grad(torch.compile(loss, backend="npu", fullgraph=True)(*leaves_), leaves_)
    for got, expected in zip(compiled_grads, torch.autograd.grad(loss(*leaves_), leaves_)):
        torch.testing.assert_close(got.cpu(), expected.cpu())

    per_group = torch.compile(lambda x, w: torch_npu.npu_grouped_matmul(
        [x], [w], group_list=group_list, split_item=0, group_type=0, group_list_type=1), backend="npu",
        fullgraph=True)(leaves_[0].detach(), leaves_[1].detach())
    assert [tuple(t.shape) for t in per_group] == [(2, 4), (3, 4), (4, 4)]


def test_matmul_ops_under_autocast_take_mixed_dtypes():
    torch.manual_seed(7)
    x = torch.randn(6, 16).npu()
    w = torch.randn(2, 16, 8).npu()
    linear_weight = torch.randn(16, 16).npu()
    with torch.autocast("npu", dtype=torch.float16):
        h = torch.nn.functional.linear(x, linear_weight)  # fp16 activation, fp32 weights below
        (y,) = torch_npu.npu_grouped_matmul([h], [w], group_list=torch.tensor([4, 2]).npu(), split_item=3,
                                            group_type=0, group_list_type=1)
        z = torch_npu.npu_linear(h, linear_weight)
        bmm = torch_npu.npu_bmmV2(h.unsqueeze(0), w[:1], [])
    assert y.dtype == z.dtype == bmm.dtype == torch.float16
    assert_close_to_reference(y, grouped_fp64(h.cpu(), w.cpu(), [4, 2]), torch.float16, "y")
    assert_close_to_reference(z, h.cpu().double() @ linear_weight.cpu().double().t(), torch.float16, "linear")
    assert_close_to_reference(bmm[0], h.cpu().double() @ w[0].cpu().double(), torch.float16, "bmm")


@pytest.mark.parametrize("kwargs, error", [
    (dict(split_item=4, group_type=0), "split_item must be 0, 1, 2 or 3"),
    (dict(split_item=3), "group_type must be -1, 0 or 2"),
    (dict(split_item=3, group_type=1), "group_type must be -1 .no grouping., 0 .split M. or 2"),
    (dict(split_item=3, group_type=0, group_list_type=2), "group_list_type must be 0 .cumsum. or 1"),
    (dict(split_item=3, group_type=0, act_type=5), "act_type 5 needs per-token quantization"),
])
def test_grouped_matmul_refuses_what_torch_npu_refuses(kwargs, error):
    x, w = torch.randn(4, 8).npu(), torch.randn(2, 8, 4).npu()
    with pytest.raises(ValueError, match=f"npu_grouped_matmul: {error}"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]).npu(), **kwargs)
    with pytest.raises(ValueError, match=r"npu_grouped_matmul: group_list must give non-negative group sizes"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 5]).npu(), split_item=3, group_type=0,
                                     group_list_type=1)
    with pytest.raises(NotImplementedError, match="npu_grouped_matmul: antiquant_scale"):
        torch_npu.npu_grouped_matmul([x], [w], antiquant_scale=[torch.ones(2, 4).npu()],
                                     group_list=torch.tensor([1, 3]).npu(), split_item=3, group_type=0)


def test_grouped_matmul_computes_cpu_float64_in_float64_and_refuses_npu_float64():
    """The pre-check's reference run calls the op on float64 CPU tensors: it must compute in float64
    (values 1 + 2**-40 are not fp32's), while npu float64 is refused as the device refuses it."""
    x, w = torch.full((10, 4), 1 + 2**-40, dtype=torch.float64), torch.randn(4, 4, 3, dtype=torch.float64)
    b = torch.randn(4, 3, dtype=torch.float64)
    group_list = torch.tensor(COUNTS)
    (y,) = torch_npu.npu_grouped_matmul([x], [w], bias=[b], group_list=group_list, split_item=3, group_type=0,
                                        group_list_type=1)
    assert y.dtype == torch.float64 and torch.equal(y, grouped_fp64(x, w, COUNTS, b))
    # group_type 2 (split K): group e sums k over its rows, as the weight gradient does
    dy = torch.randn(10, 3, dtype=torch.float64)
    (dw,) = torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=group_list, split_item=3, group_type=2,
                                         group_list_type=1)
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    assert dw.dtype == torch.float64
    assert torch.equal(dw, torch.stack([x[a:e].t() @ dy[a:e] for a, e in zip(bounds, bounds[1:])]))
    with pytest.raises(ValueError, match="npu_grouped_matmul: x must be float16, bfloat16 or float32"):
        torch_npu.npu_grouped_matmul([x.npu()], [w.float().npu()], group_list=group_list.npu(), split_item=3,
                                     group_type=0, group_list_type=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_v2_broadcasts_and_differentiates_against_fp64(dtype):
    torch.manual_seed(8)
    a, b, dy = torch.randn(2, 1, 3, 4), torch.randn(5, 4, 6), torch.randn(2, 5, 3, 6)
    a_ref, b_ref = reference_leaves(a, b, dtype=dtype)
    y_ref = a_ref @ b_ref
    da_ref, db_ref = torch.autograd.grad(y_ref, [a_ref, b_ref], dy.to(dtype).double())
    a_npu, b_npu = leaves(a, b, dtype=dtype)
    y = torch_npu.npu_bmmV2(a_npu, b_npu, [])
    assert y.shape == (2, 5, 3, 6) and y.dtype == dtype
    da, db = torch.autograd.grad(y, [a_npu, b_npu], dy.to(dtype).npu())
    assert da.shape == a.shape and db.shape == b.shape
    assert_close_to_reference(y, y_ref, dtype, "y")
    assert_close_to_reference(da, da_ref, dtype, "dmat1", factor=2)
    assert_close_to_reference(db, db_ref, dtype, "dmat2", factor=2)
    # output_sizes: the product in that shape (the same elements), its gradient reshaped back
    flat = torch_npu.npu_bmmV2(a_npu, b_npu, [10, 18])
    assert flat.shape == (10, 18) and torch.equal(flat.reshape(y.shape).cpu(), y.detach().cpu())
    da_flat, _ = torch.autograd.grad(flat, [a_npu, b_npu], dy.to(dtype).npu().reshape(10, 18))
    assert torch.equal(da_flat.cpu(), da.cpu())
    with pytest.raises(ValueError, match="npu_bmmV2: output_sizes"):
        torch_npu.npu_bmmV2(a_npu, b_npu, [7])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_against_fp64(dtype):
    torch.manual_seed(9)
    x, w, b, dy = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8), torch.randn(5, 8)
    x_ref, w_ref, b_ref = reference_leaves(x, w, b, dtype=dtype)
    y_ref = torch.nn.functional.linear(x_ref, w_ref, b_ref)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, w_ref, b_ref], dy.to(dtype).double())
    x_npu, w_npu, b_npu = leaves(x, w, b, dtype=dtype)
    y = torch_npu.npu_linear(x_npu, w_npu, b_npu)
    assert y.dtype == dtype and y.shape == (5, 8)
    grads = torch.autograd.grad(y, [x_npu, w_npu, b_npu], dy.to(dtype).npu())
    assert_close_to_reference(y, y_ref, dtype, "y")
    for grad, ref, name in zip(grads, grads_ref, ("dx", "dweight", "dbias")):
        assert_close_to_reference(grad, ref, dtype, name, factor=2)
    with pytest.raises(ValueError, match="npu_linear: input and weight must be 2-D"):
        torch_npu.npu_linear(x_npu.unsqueeze(0), w_npu)
