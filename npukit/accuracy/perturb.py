"""`npu-run --golden-perturb PRECISION`: a second golden run whose arithmetic is rounded as the NPU
run's precision rounds, so that two golden runs spread over what benign low-precision numerics drift.

    with PerturbSession("bf16", seed=0):
        runpy.run_path("train.py", run_name="__main__")

Each floating output of an arithmetic op (forward and backward; the tensors' own values, on any
device) is rounded to nearest at the precision's mantissa width (fp16 and HF32 10 bits, bf16 7,
fp32 23), on a grid scaled by a seeded factor c in (1, 2): x -> round(x c) / c. That is a rounding
as the NPU's is (deterministic in the value, so its bias carries from step to step as the NPU's
does), yet not the NPU's own: its errors are as large, its signs fall elsewhere. The cube unit's ops
(matmul, convolution, forward and backward) also compute on rounded copies of their floating
inputs, as autocast's casts and HF32 round them; under `hf32` that is all that is rounded (the NPU
rounds nothing else). The exponent's range is not narrowed: the golden runs do not overflow.

Not perturbed, because no rounding happens there or because it is what the band must tell apart:
view and copy ops and exact ones (relu, indexing, concatenation, max/min, fills); random draws
(initial weights, generated data: the NPU run draws the same values); and every op
inside `optimizer.step()`: mixed-precision training keeps master weights and optimizer state in
fp32, so a run whose optimizer step computes in low precision (updates smaller than half an ulp of
bf16 weights lost) leaves the band rather than widening it.

The factor c comes from a generator of its own (seeded with `seed` + the rank), never torch's global
one: the script's dropout masks, shuffles and initial weights stay those of the first golden run.
`npu-compare --trend` (npukit/accuracy/trend.py) reads the two golden monitors and the NPU's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from npukit.errors import UserError
from npukit.watch.process import rank_from_env

# Mantissa bits of each precision an NPU run computes in (the unit roundoff is 2^-(bits + 1))
MANTISSA_BITS = {"fp16": 10, "bf16": 7, "hf32": 10, "fp32": 23}
# The cube unit's ops, the only ones HF32 rounds (their inputs, which shows in their outputs)
_CUBE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "convolution_backward",
                       "_convolution", "conv2d", "conv1d", "conv3d", "addbmm", "dot", "mv", "addmv"})
# Ops that compute nothing a rounding could change: their output is (a copy of) input values
_EXACT_OPS = frozenset({
    "copy_", "clone", "_to_copy", "to", "contiguous", "lift_fresh", "lift_fresh_copy", "alias_copy", "detach_copy",
    "cat", "stack", "index", "index_select", "gather", "scatter", "scatter_", "index_put_", "index_put",
    "embedding", "select_scatter", "slice_scatter", "masked_fill", "masked_fill_", "where", "masked_select",
    "relu", "relu_", "threshold_backward", "neg", "abs", "sign", "max", "min", "amax", "amin", "maximum",
    "minimum", "clamp", "clamp_", "sort", "topk", "max_pool2d_with_indices", "fill_", "zero_", "zeros_like",
    "ones_like", "full_like", "empty_like", "zeros", "ones", "full", "empty", "empty_strided", "new_zeros",
    "new_ones", "new_empty", "new_empty_strided", "new_full", "fill", "constant_pad_nd", "repeat", "flip",
    "roll", "tril", "triu", "floor", "ceil", "round", "trunc", "_unsafe_view", "expand_copy", "permute_copy",
    "unfold_copy", "nonzero", "_local_scalar_dense", "set_", "resize_",
    # GradScaler's: its scale is a power of two, so unscaling is exact, and the scale must stay one
    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
    # random draws: not arithmetic, and the NPU run draws (initial weights, data) the same values
    "bernoulli_", "bernoulli", "randperm", "uniform_", "normal_", "random_", "exponential_", "normal", "rand",
    "randn", "rand_like", "randn_like", "randint", "randint_like", "multinomial",
})


def check_precision(precision: str) -> None:
    if precision not in MANTISSA_BITS:
        raise UserError(f"--golden-perturb {precision!r}: expected one of {', '.join(MANTISSA_BITS)} (the "
                        "precision the NPU run computes in)")


class PerturbSession:
    """While entered, every arithmetic op's floating output is rounded at `precision`'s mantissa width
    on a seeded scaled grid (see the module docstring); ops inside optimizer.step() are left exact."""

    def __init__(self, precision: str, seed: int = 0, rank: int | None = None) -> None:
        check_precision(precision)
        self.precision = precision
        self.drop_bits = 23 - MANTISSA_BITS[precision]  # of fp32's mantissa
        self.cube_only = precision == "hf32"
        generator = torch.Generator().manual_seed(seed + (rank_from_env() if rank is None else rank))
        self.scale = 1.0 + float(torch.rand((), generator=generator, dtype=torch.float64)) * 0.98 + 0.01
        self.perturbed = 0  # op outputs perturbed so far
        self._in_optimizer = 0
        self._mode: _PerturbMode | None = None
        self._handles: list = []

    def __enter__(self) -> PerturbSession:
        from torch.optim import optimizer as optimizer_hooks

        self._handles = [optimizer_hooks.register_optimizer_step_pre_hook(self._optimizer_starts),
                         optimizer_hooks.register_optimizer_step_post_hook(self._optimizer_ends)]
        self._mode = _PerturbMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc_info)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _optimizer_starts(self, optimizer, args, kwargs) -> None:
        self._in_optimizer += 1

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)

    def rounds(self, func) -> bool:
        """Whether `func`'s outputs are rounded at this precision (HF32 rounds only the cube's inputs)."""
        if self._in_optimizer or func.is_view or self.cube_only:
            return False
        name = func.__name__.split(".")[0]  # `addmm.default` -> `addmm`
        return name not in _EXACT_OPS and not name.startswith("_foreach_zero")

    def rounds_inputs(self, func) -> bool:
        """Whether `func` is a cube op, which computes on its floating inputs rounded to this precision."""
        return not self._in_optimizer and func.__name__.split(".")[0] in _CUBE_OPS

    def rounded_copy(self, value):
        """A floating tensor argument as a perturbed copy (the caller's tensor stays as it is)."""
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            value = value.clone()
            self.perturb(value)
        return value

    def perturb(self, output) -> None:
        """Round each floating tensor of `output` in place, on the scaled grid."""
        tensors = output if isinstance(output, list | tuple) else (output,)
        with torch.no_grad():
            for tensor in tensors:
                if isinstance(tensor, list | tuple):
                    self.perturb(tensor)
                elif isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
                    tensor.copy_(self._rounded(tensor))
                    self.perturbed += 1

    def _rounded(self, tensor: torch.Tensor) -> torch.Tensor:
        scaled = tensor.float() * self.scale  # a new fp32 tensor: fp32's own rounding is the fp32 case's
        if self.drop_bits:  # round to nearest even at the precision's mantissa width, on fp32's bits
            bits = scaled.view(torch.int32)
            odd = bits.bitwise_right_shift(self.drop_bits).bitwise_and_(1)
            bits.add_(odd.add_((1 << (self.drop_bits - 1)) - 1)).bitwise_and_(-(1 << self.drop_bits))
        return scaled.div_(self.scale)


class _PerturbMode(TorchDispatchMode):
    def __init__(self, session: PerturbSession) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        session = self.session
        if session.rounds_inputs(func):  # the cube unit computes on its inputs rounded
            args = [session.rounded_copy(a) for a in args]
        output = func(*args, **(kwargs or {}))
        if session.rounds(func):
            session.perturb(output)
        return output
