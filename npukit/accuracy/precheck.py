"""`npu-compare --precheck DUMP`: every op of a dump re-run and judged on its own, without a GPU.

For each api entry of a dump (`Functional.linear.0.forward`, `Tensor.__add__.1.forward`,
`NPU.npu_rms_norm.0.forward` ...) the op is called again on the inputs the dump recorded (a tensor
dump) or on inputs drawn within the recorded Max/Min/Mean, shape and dtype (a statistics dump):

- on the NPU (the emulated device, or the real one on an Ascend host), with the dump's HF32 settings;
- as a reference accelerator computes it: on the CPU in fp32 (fp16/bf16 inputs widened, the result
  rounded once to the op's dtype: fp32 accumulation), TF32 off, and for an fp32 matmul or convolution
  a second time with its inputs rounded to TF32 (a GPU's default for convolutions);
- in fp64, the truth each of them is measured against;
- in fp64 on inputs moved by one ulp of their dtype (and the result rounded to the op's dtype): what an
  implementation that is exact but for rounding its inputs and output may be off by, the op's
  sensitivity.

Floating inputs are first cast to the dtype of the op's first floating output, so an op recorded
under autocast (fp32 inputs, fp16 output) is computed as autocast computed it. Its backward entry, when
the dump holds one, is judged the same way in the same run: the recorded output gradients are fed back
and the gradient of every input compared.

Each output (and input gradient) gets msprobe acc_check's benchmark metrics against the truth
(small-value error proportion, RMSE, max and mean relative error, error balance, cosine, max absolute
error, max ULP error for matmul-class ops). The NPU's error is judged as msprobe's
api_precision_compare judges an NPU's error against a GPU's, ratio = NPU error / reference error,
except that the reference error is floored by the op's measured sensitivity rather than a fixed
minimum per dtype: an op whose output moves a lot when its inputs move by an ulp is allowed to,
one that barely moves is not. The ratio limits are msprobe 26.2's (StandardConfig). An NPU result
with inf/nan where neither the truth nor the reference has one fails too.

Ops that cannot be re-run are listed as skipped with the reason (an api not known here, a random op,
an argument the dump did not record, inputs missing); they never count as passed.
"""

from __future__ import annotations

import csv
import math
import os
import re
import zlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from npukit.accuracy import naming
from npukit.accuracy.compare import hf32_kind
from npukit.accuracy.dumpfile import DumpEntry, TensorLeaf, find_rank_dirs, load_rank_dump
from npukit.accuracy.metrics import chunk_partial, finish
from npukit.accuracy.tensor_io import FLOAT_PRECISION_BITS, read_tensor
from npukit.errors import UserError
from npukit.files import ContainedPaths, atomic_open, load_json

PASS, ERROR, SKIP = "pass", "error", "SKIP"  # msprobe's CompareConst values
# msprobe 26.2 StandardConfig: the error limits of api_precision_compare's benchmark ratios (level L0).
RATIO_LIMITS = {"small_value": 2.0, "rmse": 2.0, "max_rel_err": 10.0, "mean_rel_err": 2.0}
# msprobe 26.2 StandardConfig: |truth| at or below this is a small value (judged by absolute error),
# and the absolute error a small value may have in the benchmark method.
_SMALL_VALUE = {"torch.float16": 2**-10, "torch.bfloat16": 2**-10}
_SMALL_VALUE_ATOL = {"torch.float16": 1e-16, "torch.bfloat16": 1e-16}
_RANDOM_APIS = frozenset({
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "poisson", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "randperm", "uniform_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "rrelu", "rrelu_", "gumbel_softmax",
})
_DEVICE_STRING = re.compile(r"^(npu|cuda|cpu)(:\d+)?$")
# The fewest judged ops, as a share of the ops a dump holds, for a pre-check to say anything.
MIN_JUDGED_SHARE = 0.5


class CannotRun(Exception):
    """Why an op cannot be re-run (the skip reason shown to the user)."""


@dataclass
class TensorCheck:
    """One floating output (or input gradient) of an op: metrics against the fp64 truth."""

    name: str  # msprobe's detail row name: Functional.linear.0.forward.output.0
    dtype: str
    shape: tuple
    npu: dict  # metric -> value, the NPU's error
    bench: dict  # metric -> value, the reference accelerator's error floored by the sensitivity
    ratios: dict = field(default_factory=dict)  # judged metric -> npu / bench
    status: str = PASS
    message: str = ""


@dataclass
class OpCheck:
    label: str  # "step0/rank0"
    name: str  # the dump entry: Functional.linear.0.forward (a backward is judged with its forward)
    status: str  # PASS | ERROR | SKIP
    reason: str = ""
    tensors: list[TensorCheck] = field(default_factory=list)
    backward_status: str = " "  # msprobe: a space when there is no backward


@dataclass
class PrecheckResult:
    dump: Path
    ops: list[OpCheck]
    not_ops: int  # module and parameter-gradient entries: their ops are entries of their own

    def judged(self) -> list[OpCheck]:
        return [op for op in self.ops if op.status != SKIP]

    def failed(self) -> list[OpCheck]:
        return [op for op in self.ops if op.status == ERROR]

    def skipped(self) -> list[OpCheck]:
        return [op for op in self.ops if op.status == SKIP]

    def too_few_judged(self) -> bool:
        return not self.ops or len(self.judged()) < MIN_JUDGED_SHARE * len(self.ops)

    def exit_code(self) -> int:
        return 1 if self.failed() or self.too_few_judged() else 0

    def headline(self) -> str:
        judged, failed, skipped = len(self.judged()), len(self.failed()), len(self.skipped())
        text = (f"npu-compare --precheck {self.dump}: {len(self.ops)} ops, {judged} judged, {failed} failed, "
                f"{skipped} skipped")
        if failed:
            return text + f"; first failure: {self.failed()[0].name}"
        if not self.ops:
            return text + ": the dump holds no api entry (dump with --dump-level api or mix)"
        if self.too_few_judged():
            return text + f": too few judged to vouch for the run (less than {MIN_JUDGED_SHARE:.0%})"
        return text + ": every judged op is as precise as the reference accelerator"


# ----------------------------------------------------------------------------- running ops
@dataclass
class _Slot:
    """A tensor argument of the op, by its place among the op's tensor arguments."""

    index: int


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CannotRun(f"unknown dtype {name}")
    return dtype


def resolve_api(api: str):
    """The callable a dump's api name stands for: `Functional.linear` -> F.linear,
    `Tensor.__add__` -> Tensor.__add__, `NPU.npu_rms_norm` -> torch.ops.npu.npu_rms_norm."""
    prefix, _, name = api.partition(".")
    if prefix == "NPU":
        try:
            packet = getattr(torch.ops.npu, name)
        except (AttributeError, RuntimeError):
            packet = None
        if packet is None:
            raise CannotRun(f"{api}: no such torch_npu op here")
        return packet
    if prefix == "Tensor":
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise CannotRun(f"{api}: no such Tensor method")
        return method
    function = _api_functions().get(api)
    if function is None:
        raise CannotRun(f"{api}: not a torch api npukit knows")
    return function


_API_FUNCTIONS: dict | None = None


def _api_functions() -> dict:
    global _API_FUNCTIONS
    if _API_FUNCTIONS is None:
        table = {**naming.creation_table(), **naming.api_name_table()}
        _API_FUNCTIONS = {}
        for function, api in table.items():
            _API_FUNCTIONS.setdefault(api, function)
    return _API_FUNCTIONS


def _decode(value, where: str):
    """A non-tensor argument as dump.json describes it ({"type", "value"}), as the Python value."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CannotRun(f"{where}: argument {value!r} is not a dump description")
    kind = value.get("type")
    if kind in ("int", "float", "bool", "str"):
        item = value.get("value")
        if kind == "str" and isinstance(item, str) and _DEVICE_STRING.match(item):
            return _DEVICE
        return item
    if kind == "torch.dtype":
        return _torch_dtype(str(value.get("value")))
    if kind == "torch.device":
        return _DEVICE
    if kind == "torch.Size":
        return torch.Size(value.get("value") or [])
    if kind == "slice":
        return slice(*value.get("value", [None, None, None]))
    if kind == "ellipsis":
        return Ellipsis
    raise CannotRun(f"{where}: an argument of type {kind} whose value the dump does not hold")


_DEVICE = object()  # a device argument: the device of the run it is replayed in


def _arguments(entry_name: str, body: dict, leaves: dict) -> tuple[list, dict, list[TensorLeaf]]:
    """(args, kwargs, tensor leaves in order) of a forward entry, tensors as _Slot placeholders."""
    slots: list[TensorLeaf] = []

    def walk(value, leaf_name):
        if isinstance(value, dict) and value.get("type") in ("torch.Tensor", "numpy.ndarray"):
            leaf = leaves.get(leaf_name)
            if leaf is None or value.get("layout") == "nested":
                raise CannotRun(f"{leaf_name}: a tensor the dump describes without values or statistics")
            slots.append(leaf)
            return _Slot(len(slots) - 1)
        if isinstance(value, list):
            return [walk(item, f"{leaf_name}.{i}") for i, item in enumerate(value)]
        if isinstance(value, dict) and "type" not in value:
            return {key: walk(item, f"{leaf_name}.{key}") for key, item in value.items()}
        return _decode(value, entry_name)

    args = walk(body.get("input_args", body.get("input", [])), f"{entry_name}.input")
    kwargs = {key: walk(item, f"{entry_name}.input.{key}") for key, item in (body.get("input_kwargs") or {}).items()}
    if not isinstance(args, list):
        raise CannotRun(f"{entry_name}: input_args is not a list")
    if entry_name.startswith("Tensor.__getitem__") and len(args) > 1 and isinstance(args[1], list):
        args[1] = tuple(args[1])  # x[a, b]: Python passes the index as a tuple, the dump writes a list
    return args, kwargs, slots


def _fill(value, tensors: list, device):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if value is _DEVICE:
        return device
    if isinstance(value, list):
        return [_fill(item, tensors, device) for item in value]
    if isinstance(value, tuple):
        return tuple(_fill(item, tensors, device) for item in value)
    if isinstance(value, dict):
        return {key: _fill(item, tensors, device) for key, item in value.items()}
    return value


def _generated(leaf: TensorLeaf, seed: int) -> torch.Tensor:
    """A tensor of the leaf's shape and dtype within its recorded Max and Min, with its Mean on average
    (values Min + (Max - Min) * u**p, u uniform, p chosen for the mean), its inf and nan counts placed."""
    dtype = _torch_dtype(leaf.dtype)
    generator = torch.Generator().manual_seed(seed)
    numel = leaf.numel
    if leaf.stats is None:
        raise CannotRun(f"{leaf.name}: neither values nor statistics recorded")
    high, low, mean, _ = leaf.stats
    if dtype == torch.bool:
        share = 0.5 if mean is None or not math.isfinite(mean) else min(max(mean, 0.0), 1.0)
        return (torch.rand(numel, generator=generator) < share).reshape(leaf.shape)
    if high is None or low is None:
        raise CannotRun(f"{leaf.name}: no Max/Min recorded")
    finite_high = high if math.isfinite(high) else (abs(low) if math.isfinite(low) else 1.0)
    finite_low = low if math.isfinite(low) else -abs(finite_high)
    if not dtype.is_floating_point and not dtype.is_complex:
        values = torch.randint(int(finite_low), int(finite_high) + 1, (numel,), generator=generator)
        return values.to(dtype).reshape(leaf.shape)
    if dtype.is_complex:
        raise CannotRun(f"{leaf.name}: complex inputs are not generated")
    span = finite_high - finite_low
    share = (mean - finite_low) / span if mean is not None and span > 0 and math.isfinite(mean) else 0.5
    share = min(max(share, 0.02), 0.98)
    u = torch.rand(numel, generator=generator, dtype=torch.float64)
    values = finite_low + span * u ** (1.0 / share - 1.0)
    if numel >= 2:
        values[0], values[1] = finite_high, finite_low
    specials: list[float] = []
    if leaf.inf_count:  # of the signs the extremes show (-inf when Min is -inf, and so on)
        signs = [math.inf] * (high == math.inf) + [-math.inf] * (low == -math.inf) or [math.inf]
        specials += [signs[i % len(signs)] for i in range(leaf.inf_count)]
    specials = (specials + [math.nan] * (leaf.nan_count or 0))[:max(numel - 2, 0)]
    if specials:
        values[2:2 + len(specials)] = torch.tensor(specials, dtype=torch.float64)
    permutation = torch.randperm(numel, generator=generator)
    return values[permutation].to(dtype).reshape(leaf.shape)


def _load(leaf: TensorLeaf, generate: bool, seed: int) -> torch.Tensor:
    if leaf.data_path is None:
        if not generate:
            raise CannotRun(f"{leaf.name}: its values are not in the dump")
        return _generated(leaf, seed)
    array = read_tensor(leaf.data_path, leaf.dtype, list(leaf.shape))
    dtype = _torch_dtype(leaf.dtype)
    tensor = torch.from_numpy(np.array(array))
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


def round_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32's 10 mantissa bits (nearest, ties to even), as a GPU's TF32 mode does."""
    bits = tensor.contiguous().view(torch.int32)
    dropped = 13
    lsb = (bits >> dropped) & 1
    rounded = (bits + ((1 << (dropped - 1)) - 1) + lsb) & ~((1 << dropped) - 1)
    finite = torch.isfinite(tensor)
    return torch.where(finite, rounded.view(torch.float32), tensor)


class _Tf32(torch.autograd.Function):
    """An fp32 matmul/conv input rounded to TF32, and the gradient coming back to it too: a GPU in TF32
    mode computes the backward's matmuls/convolutions in TF32 as well."""

    @staticmethod
    def forward(ctx, tensor):
        return round_to_tf32(tensor)

    @staticmethod
    def backward(ctx, grad):
        return round_to_tf32(grad)


@dataclass
class _Op:
    label: str
    entry: DumpEntry
    backward: DumpEntry | None
    function: object
    args: list
    kwargs: dict
    inputs: list[torch.Tensor]  # the recorded (or generated) tensor arguments, on the CPU
    compute: torch.dtype | None  # the dtype floating inputs are cast to (the first floating output's)
    grad_outputs: list  # per forward output: its recorded gradient, or None
    grad_inputs: list[TensorLeaf | None]  # per tensor argument: its recorded gradient's leaf, or None
    tf32: bool  # an fp32 matmul/conv: a TF32 reference too
    hf32: bool | None  # the NPU run computed it in HF32 (None: unknown, the device's defaults)
    in_place: bool  # it writes into an argument (`add_`, `x += y`, `out=`)
    note: str = ""  # said with the verdict (a backward that could not be judged)


def _call(op: _Op, tensors: list, device, side: str):
    """Run the op once. side: npu | ref | tf32 | truth | sens. Returns (outputs, input grads or None)."""
    wants_grad = op.backward is not None
    leaves = []
    prepared = []
    for index, tensor in enumerate(tensors):
        floating = tensor.is_floating_point()
        leaf = tensor.to(device)
        if leaf is tensor:  # its own tensor: neither requires_grad_ nor an in-place op may touch the recorded one
            leaf = tensor.clone() if op.in_place else tensor.detach()
        value = leaf
        if wants_grad and floating and op.grad_inputs[index] is not None:
            leaf.requires_grad_(True)
            if op.in_place:
                value = leaf.clone()  # a leaf that needs a gradient cannot be changed in place
        leaves.append(leaf)
        if floating and op.compute is not None and side in ("npu", "ref", "tf32"):
            value = value.to(op.compute)
            if side != "npu":
                value = value.float()
                if side == "tf32":
                    value = _Tf32.apply(value)
        prepared.append(value)
    args = _fill(op.args, prepared, device)
    kwargs = _fill(op.kwargs, prepared, device)
    with torch.set_grad_enabled(wants_grad):
        result = op.function(*args, **kwargs)
        outputs = list(result) if isinstance(result, list | tuple) else [result]
        if side in ("ref", "tf32") and op.compute is not None:
            outputs = [out.to(op.compute) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
                       for out in outputs]
    grads = None
    if wants_grad:
        pairs = [(out, grad) for out, grad in zip(outputs, op.grad_outputs)
                 if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = [None] * len(leaves)
        if pairs and wanted:
            found = iter(torch.autograd.grad([out for out, _ in pairs], wanted,
                                             [grad.to(device=device, dtype=out.dtype) for out, grad in pairs],
                                             allow_unused=True))
            grads = [next(found) if leaf.requires_grad else None for leaf in leaves]
            grads = [grad.detach().cpu() if grad is not None else None for grad in grads]
    return [out.detach().cpu() if isinstance(out, torch.Tensor) else out for out in outputs], grads


# dtype -> (its bits as integers, the exponent field: all ones is inf or nan)
_BITS = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
         torch.float32: (torch.int32, 0x7F800000)}


def _perturbed(tensors: list, seed: int) -> list:
    """Each floating tensor moved by one ulp of its dtype (to the next or the previous representable
    value: its bits +-1), in a random direction per element, held in fp64. inf, nan and a step that
    would leave the finite range stay as they are."""
    random = np.random.default_rng(seed)
    moved = []
    for tensor in tensors:
        view, exponent = _BITS.get(tensor.dtype, (None, 0))
        if view is None:
            moved.append(tensor.double() if tensor.is_floating_point() else tensor)
            continue
        bits = tensor.contiguous().view(view).numpy()
        neighbour = bits + (random.integers(0, 2, bits.shape, dtype=bits.dtype) * 2 - 1)
        stays = ((bits & exponent) == exponent) | ((neighbour & exponent) == exponent)
        moved.append(torch.from_numpy(np.where(stays, bits, neighbour)).view(tensor.dtype).double())
    return moved


def _truth_inputs(op: _Op) -> list:
    """The input values the op computed on: floating inputs cast to its compute dtype (and still in it;
    the fp64 runs widen them, exactly)."""
    return [tensor.to(op.compute) if tensor.is_floating_point() and op.compute is not None else tensor
            for tensor in op.inputs]


# ----------------------------------------------------------------------------- metrics
class _Truth:
    """The fp64 truth of one output, with what every candidate's metrics share."""

    def __init__(self, truth: np.ndarray, dtype: str) -> None:
        self.values = truth.reshape(-1)
        self.dtype = dtype
        self.finite = np.isfinite(self.values)
        self.magnitude = np.abs(self.values)
        self.small = (self.magnitude <= _SMALL_VALUE.get(dtype, 2**-20)) & self.finite
        self.nan = np.isnan(self.values)


def benchmark_metrics(truth: _Truth, value: np.ndarray, ulp: bool, full: bool = True) -> dict:
    """msprobe acc_check's benchmark metrics of `value` (an op's result widened to fp64) against the
    fp64 truth (msprobe 26.2 compare/algorithm.py); `full`: also cosine, max abs error and (`ulp`) max
    ULP error, from npukit's metrics."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # inf - inf: masked out below
        return _benchmark_metrics(truth, value.reshape(-1), ulp, full)


def _benchmark_metrics(truth: _Truth, value: np.ndarray, ulp: bool, full: bool) -> dict:
    dtype, size = truth.dtype, value.size
    both_finite = truth.finite & np.isfinite(value)
    inf_nan = ~both_finite
    diff = value - truth.values
    abs_err = np.abs(diff)
    abs_err[inf_nan] = 0.0
    small = truth.small & both_finite
    small_count = np.count_nonzero(small)
    small_err = (np.count_nonzero(small & (abs_err > _SMALL_VALUE_ATOL.get(dtype, 2**-30))) / small_count
                 if small_count else 0.0)
    normal = both_finite & ~small
    eps = 2**-8 if dtype == "torch.bfloat16" else float(np.finfo(np.float64).eps)
    rel = abs_err[normal] / (truth.magnitude[normal] + eps)
    abs_err[small] = 0.0
    excluded = np.count_nonzero(inf_nan)
    mse = float(np.dot(abs_err, abs_err)) / size if size else 0.0
    rmse = math.sqrt(mse * (size / (size - excluded + 0.0001) + 0.0001)) if size else 0.0
    diff[inf_nan] = 0.0
    eb = abs(int(np.count_nonzero(diff > 0)) - int(np.count_nonzero(diff < 0))) / size if size else 0.0
    # nan/inf the truth does not have (or other ones), as a share of all elements
    mismatch = np.count_nonzero(inf_nan & ~((truth.values == value) | (truth.nan & np.isnan(value))))
    metrics = {
        "small_value": small_err,
        "rmse": rmse,
        "max_rel_err": float(rel.max()) if rel.size else 0.0,
        "mean_rel_err": float(rel.mean()) if rel.size else 0.0,
        "eb": eb,
        "inf_nan": mismatch / size if size else 0.0,
    }
    if full:
        ulp_dtype = dtype if ulp and dtype in FLOAT_PRECISION_BITS else None
        common = finish(chunk_partial(truth.values.copy(), value.copy(), ulp_dtype), ulp_dtype is not None)
        metrics.update(cosine=common.cosine, max_abs=common.max_abs, max_ulp=common.max_ulp)
    return metrics


def _judge_tensor(name: str, truth: torch.Tensor, npu: torch.Tensor, references: list[torch.Tensor],
                  sensitivity: torch.Tensor, ulp: bool) -> TensorCheck:
    dtype = str(npu.dtype)
    true = _Truth(truth.detach().double().numpy(), dtype)
    npu_metrics = benchmark_metrics(true, npu.double().numpy(), ulp)
    bands = [benchmark_metrics(true, other.double().numpy(), ulp, full=False) for other in [*references, sensitivity]]
    bench = {key: max(band[key] for band in bands) for key in bands[0]}
    check = TensorCheck(name, dtype, tuple(npu.shape), npu_metrics, bench)
    messages = []
    for metric, limit in RATIO_LIMITS.items():
        band = bench[metric]
        error = npu_metrics[metric]
        ratio = error / band if band > 0 else (0.0 if error == 0 else math.inf)
        check.ratios[metric] = ratio
        if ratio > limit:
            messages.append(f"{metric} {error:.3g} is {ratio:.3g}x the reference's {band:.3g} (limit {limit:g}x)")
    if npu_metrics["inf_nan"] > bench["inf_nan"]:
        messages.append(f"inf/nan in {npu_metrics['inf_nan']:.3g} of the elements where the truth is finite"
                        f" (the reference: {bench['inf_nan']:.3g})")
    if messages:
        check.status = ERROR
        check.message = "; ".join(messages)
    return check


def _exact_tensor(name: str, npu: torch.Tensor, reference: torch.Tensor) -> TensorCheck:
    """An integer or bool result: it must equal the reference's (msprobe's binary consistency)."""
    differ = float((npu != reference).double().mean()) if npu.numel() else 0.0
    check = TensorCheck(name, str(npu.dtype), tuple(npu.shape), {"error_rate": differ}, {"error_rate": 0.0})
    if differ:
        check.status = ERROR
        check.message = f"{differ:.3g} of the elements differ from the reference's"
    return check


# ----------------------------------------------------------------------------- the pre-check
def _is_random(api: str) -> bool:
    name = api.rpartition(".")[2]
    return "dropout" in name or name in _RANDOM_APIS


def _prepare(label: str, entry: DumpEntry, body: dict, backward: DumpEntry | None, generate: bool,
             hf32: frozenset | None) -> _Op:
    api = entry.base
    if _is_random(api):
        raise CannotRun("a random op: its result cannot be reproduced")
    if api in naming.UNINITIALIZED_OUTPUT:
        raise CannotRun("its output is uninitialized memory")
    if api.startswith("Distributed."):
        raise CannotRun("a collective: it needs the other ranks")
    function = resolve_api(api)
    args, kwargs, slots = _arguments(entry.name, body, {leaf.name: leaf for leaf in entry.inputs})
    if naming.foreach_op(api) and not any(isinstance(arg, list) for arg in args):
        function = _one_element(function)
    seed = zlib.crc32(f"{label}/{entry.name}".encode())
    inputs = [_load(leaf, generate, seed + i) for i, leaf in enumerate(slots)]
    floating_outputs = [leaf for leaf in entry.outputs if _is_float(leaf.dtype)]
    if any(leaf.dtype.startswith("torch.complex") for leaf in entry.leaves()):
        raise CannotRun("complex tensors are not pre-checked")
    compute = _torch_dtype(floating_outputs[0].dtype) if floating_outputs else None
    if compute == torch.float64:
        raise CannotRun("a float64 op: the NPU does not compute in float64")
    grad_outputs: list = []
    grad_inputs: list = [None] * len(inputs)
    note = ""
    if backward is not None:
        try:
            grad_outputs, grad_inputs = _backward_leaves(entry, backward, inputs, generate, seed)
        except CannotRun as exc:  # the forward is still judged; the note says the backward was not
            grad_outputs, grad_inputs, note = [], [None] * len(inputs), f"backward not judged: {exc}"
        if not any(grad is not None for grad in grad_outputs) or not any(grad_inputs):
            backward = None
    kind = hf32_kind(entry.name)
    return _Op(label, entry, backward, function, args, kwargs, inputs, compute, grad_outputs, grad_inputs,
               tf32=kind is not None and compute == torch.float32,
               hf32=None if kind is None or hf32 is None else kind in hf32,
               in_place=naming.writes_its_input(api, tuple(args), kwargs), note=note)


def _one_element(foreach):
    """A foreach op's call on one element, as the dump records each parameter's element of it
    (dump._ParameterTensors): its tensors as one-item lists; its result, that item's."""
    def call(*args, **kwargs):
        lists = [[arg] if isinstance(arg, torch.Tensor) else arg for arg in args]
        result = foreach(*lists, **kwargs)
        return lists[0][0] if result is None else result[0]  # an in-place op writes its first list
    return call


def _backward_leaves(entry: DumpEntry, backward: DumpEntry, inputs: list, generate: bool, seed: int):
    """(gradient per forward output, recorded gradient leaf per tensor argument) of a backward entry."""
    outputs = {leaf.suffix: leaf for leaf in backward.outputs}  # output.i: gradient of tensor argument i
    incoming = {leaf.suffix: leaf for leaf in backward.inputs}  # input.i: gradient of forward output i
    grad_inputs = [outputs.get(f"output.{i}") for i in range(len(inputs))]
    if any(leaf is not None and tuple(leaf.shape) != tuple(tensor.shape) for leaf, tensor in zip(grad_inputs, inputs)):
        raise CannotRun(f"the gradients of {backward.name} do not match its forward's inputs")
    grad_outputs = []
    for i, out in enumerate(entry.outputs):
        leaf = incoming.get(f"input.{i}")
        if leaf is not None and tuple(leaf.shape) != tuple(out.shape):
            raise CannotRun(f"the gradients {backward.name} received do not match its forward's outputs")
        grad_outputs.append(_load(leaf, generate, seed + 1000 + i) if leaf is not None else None)
    return grad_outputs, grad_inputs


def _is_float(dtype: str) -> bool:
    return dtype in ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def check_op(op: _Op, device) -> OpCheck:
    """Run one op every way and judge the NPU's outputs (and input gradients)."""
    kind = hf32_kind(op.entry.name)
    npu = _call_on_npu(op, op.inputs, device)
    references = [_call_on_cpu(op, op.inputs, "ref")]
    if op.tf32:
        references.append(_call_on_cpu(op, op.inputs, "tf32"))
    truth_inputs = _truth_inputs(op)
    truth_op = _as_fp64(op)
    truth = _call_on_cpu(truth_op, [t.double() if t.is_floating_point() else t for t in truth_inputs], "truth")
    seed = zlib.crc32(op.entry.name.encode())
    sens_op = _as_fp64(op, perturb_grads=seed)
    sens = _call_on_cpu(sens_op, _perturbed(truth_inputs, seed), "sens")
    check = OpCheck(op.label, op.entry.name, PASS)
    ulp = kind is not None  # matmul-class: max ULP error reported
    prefix = op.entry.name.rpartition(".")[0]  # Functional.linear.0
    for leaves, pick, direction in ((op.entry.outputs, 0, "forward"), (op.grad_inputs, 1, "backward")):
        if pick == 1 and op.backward is None:
            continue
        for index, leaf in enumerate(leaves):
            if leaf is None:
                continue
            values = [side[pick][index] if side[pick] is not None and index < len(side[pick]) else None
                      for side in (npu, truth, sens, *references)]
            npu_value, truth_value, sens_value, *ref_values = values
            if not all(isinstance(v, torch.Tensor) for v in values):
                continue
            name = f"{prefix}.{direction}.output.{index}"
            if npu_value.is_floating_point():
                if str(npu_value.dtype) not in FLOAT_PRECISION_BITS:
                    continue
                sens_value = sens_value.to(npu_value.dtype)  # an exact implementation rounds its result
                check.tensors.append(_judge_tensor(name, truth_value, npu_value, ref_values, sens_value, ulp))
            else:
                check.tensors.append(_exact_tensor(name, npu_value, ref_values[0]))
    if not check.tensors:
        check.status, check.reason = SKIP, "no tensor output to judge"
    forward = [t for t in check.tensors if ".forward." in t.name]
    backward = [t for t in check.tensors if ".backward." in t.name]
    if any(t.status == ERROR for t in check.tensors):
        check.status = ERROR
    if backward:
        check.backward_status = ERROR if any(t.status == ERROR for t in backward) else PASS
    if check.status != SKIP:
        check.reason = op.note or ("" if forward else "only its backward had a result to judge")
    return check


_REFERENCE_RUNS = {"ref": "the fp32 reference run on the CPU", "tf32": "the TF32 reference run on the CPU",
                   "truth": "the float64 reference run on the CPU",
                   "sens": "the float64 run on perturbed inputs on the CPU"}


def _call_on_cpu(op: _Op, tensors: list, side: str):
    """_call on the CPU; an op that raises there is skipped saying it was a reference run that raised
    (not the NPU's), e.g. a kernel that refuses the float64 of the truth."""
    try:
        return _call(op, tensors, torch.device("cpu"), side)
    except (CannotRun, UserError):
        raise
    except Exception as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CannotRun(f"could not re-run it: {_REFERENCE_RUNS[side]} raised {type(exc).__name__}: "
                        f"{first_line}"[:300]) from exc


def _call_on_npu(op: _Op, tensors: list, device):
    """_call on the NPU with the dump's HF32 setting for the op (a real device: torch_npu's own)."""
    kind = hf32_kind(op.entry.name)
    previous = None
    if op.hf32 is not None and not _npu_device()[1]:
        from npukit.npu_backend import numerics

        previous = numerics.configure(matmul_hf32=op.hf32 if kind == "matmul" else None,
                                      conv_hf32=op.hf32 if kind == "conv" else None)
    try:
        return _call(op, tensors, device, "npu")
    finally:
        if previous is not None:
            from npukit.npu_backend import numerics

            numerics.restore(previous)


def npu_gradients_from(label: str, source: DumpEntry, source_body: dict, source_backward: DumpEntry,
                       target: DumpEntry, target_backward: DumpEntry, hf32: frozenset | None,
                       grad_scale: float = 1.0) -> tuple[list, list]:
    """(gradient per tensor argument as the NPU computes it, its fp64 reference), or None where there is
    none: `target`'s op re-run on the NPU in the target run's dtypes and HF32 setting (`hf32`: the target
    dump's), on the inputs and incoming gradients another dump recorded for the same op (`source`: the
    golden run's). The reference computes in fp64 on the same values, the incoming gradients as the
    target held them (rounded to its dtype, by the op that computed them): what the op gets wrong
    itself, its sensitivity to its forward values' rounding included, without the error its inputs
    carried. grad_scale: the target's loss scale (its incoming gradients were that much larger; the
    results are returned unscaled). Raises CannotRun when the op cannot be re-run."""
    if source.base != target.base:
        raise CannotRun(f"{target.name} is {target.base} in the target and {source.base} in the other dump")
    op = _prepare(label, source, source_body, source_backward, False, hf32)
    if op.backward is None:
        raise CannotRun(f"{source_backward.name}: no gradient to re-run")
    by_suffix = {leaf.suffix: leaf for leaf in target.inputs}
    slots = _arguments(source.name, source_body, {leaf.name: leaf for leaf in source.inputs})[2]
    inputs = []
    for leaf, tensor in zip(slots, op.inputs):
        own = by_suffix.get(leaf.suffix)
        # each input in the dtype the target run held it in (its rounding there is its producer's error)
        inputs.append(tensor.to(_torch_dtype(own.dtype)) if own is not None and tensor.is_floating_point()
                      and _is_float(own.dtype) else tensor)
    received = {leaf.suffix: leaf for leaf in target_backward.inputs}
    grad_outputs = []
    for index, grad in enumerate(op.grad_outputs):
        own = received.get(f"input.{index}")
        if grad is not None and grad.is_floating_point():
            grad = grad.double() * grad_scale
            grad = grad.to(_torch_dtype(own.dtype) if own is not None and _is_float(own.dtype) else grad.dtype)
        grad_outputs.append(grad)
    floating_outputs = [leaf for leaf in target.outputs if _is_float(leaf.dtype)]
    compute = _torch_dtype(floating_outputs[0].dtype) if floating_outputs else op.compute
    kind = hf32_kind(target.name)
    golden = op.inputs
    op = replace(op, inputs=inputs, grad_outputs=grad_outputs, compute=compute,
                 hf32=None if kind is None or hf32 is None else kind in hf32)
    _, grads = _call_on_npu(op, op.inputs, _npu_device()[0])
    _, truth = _call(_as_fp64(op), [t.double() if t.is_floating_point() else t for t in golden], torch.device("cpu"),
                     "truth")
    unscaled = [[grad.double() / grad_scale if grad is not None and grad.is_floating_point() else grad
                 for grad in (side or [None] * len(op.inputs))] for side in (grads, truth)]
    return unscaled[0], unscaled[1]


def _as_fp64(op: _Op, perturb_grads: int | None = None) -> _Op:
    """The op for the fp64 runs: no cast to the compute dtype; gradients held in fp64 (moved by one
    ulp of their dtype for the sensitivity run)."""
    grads = []
    for grad in op.grad_outputs:
        if grad is None or not grad.is_floating_point():
            grads.append(grad)
        elif perturb_grads is not None:
            grads.append(_perturbed([grad], perturb_grads + 7)[0])
        else:
            grads.append(grad.double())
    return replace(op, args=_retyped(op.args), kwargs=_retyped(op.kwargs), compute=None, grad_outputs=grads)


def _retyped(value):
    """fp16/bf16/fp32 dtype arguments (`softmax(x, dtype=torch.float32)`) made float64 for the truth."""
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, list):
        return [_retyped(item) for item in value]
    if isinstance(value, dict):
        return {key: _retyped(item) for key, item in value.items()}
    return value


@lru_cache(maxsize=1)
def _npu_device() -> tuple[torch.device, bool]:
    """(the NPU the ops run on, whether it is a real one): the real device when torch_npu is installed
    (an Ascend host), else the emulator."""
    from npukit.run import real_torch_npu_installed

    real = real_torch_npu_installed()
    if real:
        import torch_npu  # noqa: F401  (registers the device)
    else:
        import npukit.npu_backend  # noqa: F401
        from npukit.npu_backend.torch_npu_shim import install_torch_npu

        install_torch_npu()
    return torch.device("npu"), real


# Ops per task of a worker process, and the fewest ops worth starting workers for (each imports torch).
_CHUNK = 16
_POOL_MIN_OPS = 4 * _CHUNK


def run_precheck(dump: Path, progress=None, workers: int | None = None) -> PrecheckResult:
    """Pre-check every api entry of every step/rank dump under `dump`. workers: processes (default:
    the CPU count, for dumps of at least _POOL_MIN_OPS ops); each computes on one thread, since
    torch's intra-op threads spin against each other on a busy machine (3x the CPU time per op)."""
    dump = Path(dump)
    rank_dirs = find_rank_dirs(dump)
    ops: list[OpCheck | None] = []
    tasks: list[tuple[str, list[tuple[int, str]]]] = []  # (label, [(place in ops, forward entry name)])
    not_ops = 0
    for label, rank_dir in rank_dirs.items():
        rank, _ = _rank(dump, label, rank_dir)
        by_name = rank.by_name()
        pending: list[tuple[int, str]] = []
        for entry in rank.entries:
            if entry.name.startswith("Module.") or entry.direction not in (naming.FORWARD, naming.BACKWARD):
                not_ops += 1
            elif entry.direction == naming.FORWARD:
                pending.append((len(ops), entry.name))
                ops.append(None)
            elif naming.with_direction(entry.name, naming.FORWARD) not in by_name:  # else judged with its forward
                ops.append(OpCheck(label, entry.name, SKIP, "its forward entry is not in the dump"))
        tasks += [(label, pending[i:i + _CHUNK]) for i in range(0, len(pending), _CHUNK)]
    workers = workers if workers is not None else (os.cpu_count() or 1)
    count = sum(len(names) for _, names in tasks)
    done = 0

    def collect(places, checks):
        nonlocal done
        for (place, _), check in zip(places, checks):
            ops[place] = check
        done += len(checks)
        if progress is not None:
            progress(done)

    if workers > 1 and count >= _POOL_MIN_OPS:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # a fresh device per worker; forking one is unsafe
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_one_thread) as pool:
            futures = [(pool.submit(check_entries, dump, label, rank_dirs[label], [name for _, name in places]), places)
                       for label, places in tasks]
            for future, places in futures:
                collect(places, future.result())
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for label, places in tasks:
                collect(places, check_entries(dump, label, rank_dirs[label], [name for _, name in places]))
        finally:
            torch.set_num_threads(threads)
    return PrecheckResult(dump, [op for op in ops if op is not None], not_ops)


def _one_thread() -> None:
    torch.set_num_threads(1)


_RANKS: dict = {}  # (dump, label) -> (RankDump, raw "data" of its dump.json): read once per process


def _rank(dump: Path, label: str, rank_dir: Path):
    key = (str(dump), label)
    if key not in _RANKS:
        contained = ContainedPaths(dump if dump.is_dir() else dump.parent)
        rank = load_rank_dump(rank_dir, label, contained)
        raw = load_json(rank_dir / "dump.json").get("data") or {}
        _RANKS.clear()  # one rank's entries held at a time
        _RANKS[key] = (rank, raw)
    return _RANKS[key]


def check_entries(dump: Path, label: str, rank_dir: Path, names: list[str]) -> list[OpCheck]:
    """Pre-check the named forward entries of one step/rank dump (each with its backward entry)."""
    device, _ = _npu_device()
    rank, raw = _rank(dump, label, rank_dir)
    by_name = rank.by_name()
    generate = rank.task == "statistics" or not any(
        leaf.data_path is not None for entry in rank.entries for leaf in entry.leaves())
    checks = []
    for name in names:
        entry = by_name[name]
        backward = by_name.get(naming.with_direction(name, naming.BACKWARD))
        try:
            op = _prepare(label, entry, raw.get(name, {}), backward, generate, rank.hf32 if rank.by_npukit else None)
            checks.append(check_op(op, device))
        except CannotRun as exc:
            checks.append(OpCheck(label, name, SKIP, str(exc)))
        except UserError:
            raise
        except Exception as exc:  # the op refused its recorded arguments: said, never passed
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            checks.append(OpCheck(label, name, SKIP, f"could not re-run it: {type(exc).__name__}: {first_line}"[:300]))
    return checks


# ----------------------------------------------------------------------------- reports
# msprobe 26.2's acc_check detail CSV (compare_utils.DETAIL_TEST_ROWS) and result CSV columns.
DETAIL_COLUMNS = [
    "API Name", "Bench Dtype", "DEVICE Dtype", "Shape", "余弦相似度", "最大绝对误差", "双百指标", "双千指标",
    "双万指标", "二进制一致错误率", "误差均衡性", "均方根误差", "小值域错误占比", "相对误差最大值",
    "相对误差平均值", "inf/nan错误率", "相对误差错误率", "绝对误差错误率", "ULP误差最大值", "ULP误差平均值",
    "ULP误差大于阈值占比", "Status", "Message",
]
RESULT_COLUMNS = ["API name", "Forward Test Success", "Backward Test Success", "Message"]
# msprobe 26.2's api_precision_compare output (ApiPrecisionCompareColumn.get_detail_csv_title /
# get_result_csv_title): npukit's verdicts, in the file msprobe's own compare would write.
COMPARE_DETAIL_COLUMNS = [
    "API Name", "小值域错误比值", "小值域判定结果", "均方根误差比值", "均方根误差判定结果", "相对误差最大值比值",
    "相对误差最大值判定结果", "相对误差平均值比值", "相对误差平均值判定结果", "误差均衡性比值", "误差均衡性判定结果",
    "inf/nan错误率", "inf/nan判定结果", "相对误差错误率", "相对误差判定结果", "绝对误差错误率", "绝对误差判定结果",
    "二进制一致错误率", "二进制一致错误率判定结果", "ULP误差平均值", "ULP误差大于阈值占比", "ULP误差大于阈值占比比值",
    "ULP误差判定结果", "双千指标", "双千指标判定结果", "比对结果", "比对算法", "Message",
]
COMPARE_RESULT_COLUMNS = ["API Name", "Forward Test Success", "Backward Test Success", "Message"]
ALGORITHM = "标杆比对法 (npukit: reference error floored by the op's one-ulp sensitivity)"
FILES = {
    "npu_details": "accuracy_checking_details_npu.csv",
    "npu_result": "accuracy_checking_result_npu.csv",
    "bench_details": "accuracy_checking_details_bench.csv",
    "bench_result": "accuracy_checking_result_bench.csv",
    "compare_details": "api_precision_compare_details.csv",
    "compare_result": "api_precision_compare_result.csv",
}
_SPACE = " "


def _number(value) -> object:
    if value is None:
        return _SPACE
    return f"{float(value):.14f}" if math.isfinite(float(value)) else str(float(value))


def _detail_row(tensor: TensorCheck, metrics: dict, bench_dtype: str) -> list:
    shape = str(tuple(tensor.shape)) if tensor.shape else "()"
    if "error_rate" in metrics:  # integer/bool outputs: binary consistency
        cells = {"二进制一致错误率": _number(metrics["error_rate"])}
    else:
        cells = {"余弦相似度": _number(metrics.get("cosine")), "最大绝对误差": _number(metrics.get("max_abs")),
                 "误差均衡性": _number(metrics["eb"]), "均方根误差": _number(metrics["rmse"]),
                 "小值域错误占比": _number(metrics["small_value"]), "相对误差最大值": _number(metrics["max_rel_err"]),
                 "相对误差平均值": _number(metrics["mean_rel_err"]), "inf/nan错误率": _number(metrics["inf_nan"]),
                 "ULP误差最大值": _number(metrics.get("max_ulp"))}
    row = {"API Name": tensor.name, "Bench Dtype": bench_dtype, "DEVICE Dtype": tensor.dtype, "Shape": shape,
           "Status": tensor.status, "Message": tensor.message or _SPACE, **cells}
    return [row.get(column, _SPACE) for column in DETAIL_COLUMNS]


def _compare_detail_row(tensor: TensorCheck) -> list:
    row = {"API Name": tensor.name, "比对结果": tensor.status, "比对算法": ALGORITHM, "Message": tensor.message or _SPACE}
    for metric, ratio_column, status_column in (("small_value", "小值域错误比值", "小值域判定结果"),
                                                ("rmse", "均方根误差比值", "均方根误差判定结果"),
                                                ("max_rel_err", "相对误差最大值比值", "相对误差最大值判定结果"),
                                                ("mean_rel_err", "相对误差平均值比值", "相对误差平均值判定结果")):
        if metric in tensor.ratios:
            ratio = tensor.ratios[metric]
            row[ratio_column] = _number(ratio)
            row[status_column] = ERROR if ratio > RATIO_LIMITS[metric] else PASS
    if "error_rate" in tensor.npu:
        row["二进制一致错误率"] = _number(tensor.npu["error_rate"])
        row["二进制一致错误率判定结果"] = tensor.status
    return [row.get(column, _SPACE) for column in COMPARE_DETAIL_COLUMNS]


def write_csvs(result: PrecheckResult, out: Path) -> list[Path]:
    """msprobe's files, one set per step/rank (out/step0/rank0/ when the dump has several):
    acc_check's details and result CSVs of the NPU and of the reference accelerator (each against the
    fp64 truth; `msprobe api_precision_compare -npu ... -gpu ...` reads them), and npukit's verdicts in
    the layout of api_precision_compare's own output."""
    labels = sorted({op.label for op in result.ops}) or [""]
    written = []
    for label in labels:
        folder = out / label if len(labels) > 1 else out
        folder.mkdir(parents=True, exist_ok=True)
        ops = [op for op in result.ops if op.label == label]
        tables = {key: [] for key in FILES}
        for op in ops:
            base = op.name.rpartition(".")[0]  # Functional.linear.0
            if op.status == SKIP:
                for key in ("npu_result", "bench_result", "compare_result"):
                    tables[key].append([base, SKIP, SKIP, op.reason])
                continue
            forward = PASS if all(t.status == PASS for t in op.tensors if ".forward." in t.name) else ERROR
            message = "; ".join(f"{t.name}: {t.message}" for t in op.tensors if t.message) or _SPACE
            tables["npu_result"].append([base, forward, op.backward_status, message])
            tables["bench_result"].append([base, PASS, PASS if op.backward_status != _SPACE else _SPACE, _SPACE])
            tables["compare_result"].append([base, forward, op.backward_status, message])
            for tensor in op.tensors:
                tables["npu_details"].append(_detail_row(tensor, tensor.npu, "torch.float64"))
                bench = TensorCheck(tensor.name, tensor.dtype, tensor.shape, tensor.bench, tensor.bench)
                tables["bench_details"].append(_detail_row(bench, tensor.bench, "torch.float64"))
                tables["compare_details"].append(_compare_detail_row(tensor))
        headers = {"npu_details": DETAIL_COLUMNS, "bench_details": DETAIL_COLUMNS, "npu_result": RESULT_COLUMNS,
                   "bench_result": RESULT_COLUMNS, "compare_details": COMPARE_DETAIL_COLUMNS,
                   "compare_result": COMPARE_RESULT_COLUMNS}
        for key, file_name in FILES.items():
            path = folder / file_name
            with atomic_open(path, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(headers[key])
                writer.writerows(tables[key])
            written.append(path)
    return written


def print_precheck(result: PrecheckResult, console, top: int = 20) -> None:
    from rich.markup import escape
    from rich.table import Table

    failed, skipped = result.failed(), result.skipped()
    table = Table(title=f"npu-compare --precheck: {len(result.ops)} ops", show_lines=False)
    multi = len({op.label for op in result.ops}) > 1
    if multi:
        table.add_column("Step/Rank")
    table.add_column("Op", overflow="fold", ratio=3)
    # "Ref RMSE": the reference accelerator's, floored by the op's sensitivity (the ratio's denominator)
    for column in ("Dtype", "NPU RMSE", "Ref RMSE", "RMSE ratio", "MaxRel ratio", "Result"):
        table.add_column(column, no_wrap=True)
    table.add_column("Message", overflow="fold", ratio=3)

    def closeness(op: OpCheck) -> float:  # how near its limits the op's worst output came
        return max((ratio / RATIO_LIMITS[metric] for t in op.tensors for metric, ratio in t.ratios.items()),
                   default=0.0)

    passed = sorted((op for op in result.ops if op.status == PASS), key=closeness, reverse=True)
    for op in [*failed, *skipped, *passed][:top]:
        worst = max(op.tensors, key=lambda t: max((r / RATIO_LIMITS[m] for m, r in t.ratios.items()), default=0.0),
                    default=None)
        colour = {ERROR: "red", SKIP: "magenta"}.get(op.status, "green")
        npu = worst.npu if worst else {}
        ratios = worst.ratios if worst else {}
        cells = [escape(op.name), worst.dtype.replace("torch.", "") if worst else "", _short(npu.get("rmse")),
                 _short(worst.bench.get("rmse")) if worst else "", _short(ratios.get("rmse")),
                 _short(ratios.get("max_rel_err")), f"[{colour}]{op.status}[/]",
                 escape(op.reason or next((t.message for t in op.tensors if t.message), ""))]
        table.add_row(*([escape(op.label)] if multi else []), *cells)
    console.print(table)
    if skipped:  # the reasons, most frequent first (the table shows each skipped op's own)
        from collections import Counter

        reasons = Counter(op.reason for op in skipped).most_common()
        shown = "; ".join(f"{reason} ({count})" for reason, count in reasons[:5])
        more = f"; {len(reasons) - 5} other reasons" if len(reasons) > 5 else ""
        console.print("[magenta]skipped:[/] " + escape(shown + more))
    style = "bold red" if result.exit_code() else "bold green"
    console.print(f"[{style}]{escape(result.headline())}[/]", soft_wrap=True)  # one line, for grep


def _short(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.3g}"
