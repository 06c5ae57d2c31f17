"""Every OpInfo op of PyTorch's op_db, beyond forward parity: npu against CPU, NPU numerics off.

Run as a script (`python op_db_variants.py OUT.json`), in its own process, so that a crash is a
failure that names its op (the case about to run is written to stderr first) rather than an
aborted test session. For each op, with its first float32 sample:
- inplace:        the in-place variant (x.add_(y)): result and mutated input;
- out:            the out= variant into a fresh npu tensor;
- out_resized:    out= npu tensors of the wrong size (resized, with torch's warning);
- out_dtype:      out= npu tensors of another dtype (refused, or cast where torch casts);
- out_device:     out= a 0-dim CPU tensor with npu inputs: must raise, as on CUDA;
- out_alias:      an input passed as out= (torch.add(x, y, out=x)): what the CPU does (result, or error);
- noncontiguous:  the sample made non-contiguous;
- backward:       gradients of the sum of the outputs for every input that requires grad.
A case passes when npu does what the CPU does: the same values (1e-5), or both raise.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

import npukit.npu_backend  # noqa: F401  (installs the emulated device)
from npukit.accuracy import naming
from npukit.npu_backend import numerics

SKIP = "skip"
UNINITIALIZED = {name.rpartition(".")[2] for name in naming.UNINITIALIZED_OUTPUT} | {"empty_permuted"}
CATEGORIES = ("inplace", "out", "out_resized", "out_dtype", "out_device", "out_alias", "noncontiguous", "backward")


def with_layout(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """The tensor on `device` with the same strides and storage offset (`.to()` makes a
    non-contiguous tensor contiguous, and then a layout check would compare unlike inputs)."""
    tensor = tensor.detach()
    if device == "cpu" or tensor.is_conj() or tensor.is_neg() or tensor.layout != torch.strided:
        return tensor.to(device)
    count = tensor.untyped_storage().nbytes() // tensor.element_size()
    flat = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, (count,), (1,))
    return flat.to(device).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def moved(value, device):
    def move(v):
        if isinstance(v, torch.Tensor):
            result = with_layout(v, device)
            return result.requires_grad_() if v.requires_grad else result
        if isinstance(v, torch.device) and v.type == "cpu" or v == "cpu":
            return torch.device(device)
        return v

    return tree_map(move, value)


def attempt(function):
    try:
        return True, function()
    except Exception as exc:  # an op refusing its input is an outcome to compare, not a failure here
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def same(expected, actual, shapes_only: bool, device: str = "npu") -> str | None:
    """None when equal (and `actual` is on `device`), else what differs."""
    flat_expected, _ = tree_flatten(expected)
    flat_actual, _ = tree_flatten(actual)
    if len(flat_expected) != len(flat_actual):
        return f"{len(flat_actual)} results, CPU {len(flat_expected)}"
    for e, a in zip(flat_expected, flat_actual):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{type(a).__name__} instead of a tensor"
            if a.device.type != device:
                return f"a result on {a.device}"
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"{a.dtype}{list(a.shape)}, CPU {e.dtype}{list(e.shape)}"
            if shapes_only:
                continue
            actual_cpu, expected_cpu = a.detach().cpu(), e.detach()
            if e.dtype == torch.complex32:  # assert_close has no complex32 kernels on the CPU
                actual_cpu, expected_cpu = torch.view_as_real(actual_cpu).float(), torch.view_as_real(expected_cpu).float()
            try:
                torch.testing.assert_close(actual_cpu, expected_cpu, equal_nan=True, atol=1e-5, rtol=1e-5)
            except AssertionError as exc:
                return str(exc).strip().splitlines()[0][:160]
        elif e != a and not (e != e and a != a):
            return f"{a!r}, CPU {e!r}"
    return None


def compare(case, shapes_only: bool) -> str | None:
    """Run case(device) on cpu and npu: None when npu does what the CPU does (both raise, or the
    same results), SKIP when the case does not apply to npu, else what differs."""
    torch.manual_seed(0)
    cpu_ok, cpu_result = attempt(lambda: case("cpu"))
    torch.manual_seed(0)
    again_ok, again = attempt(lambda: case("cpu"))
    if cpu_ok and again_ok and same(cpu_result, again, False, "cpu") is not None:
        shapes_only = True  # not reproducible on the CPU: uninitialized memory (new_empty_strided), or
        # an out= that aliases an input the kernel still reads (linalg.ldl_solve)
    npu_ok, npu_result = attempt(lambda: case("npu"))
    if not cpu_ok:
        return None if not npu_ok else f"CPU raises ({cpu_result}) but npu does not"
    if not npu_ok:
        if "to be on cpu" in npu_result:
            return SKIP  # the op takes CPU index tensors (tensor_split's sections), as on CUDA
        return f"npu raises {npu_result}"
    return same(cpu_result, npu_result, shapes_only)


def is_random(op, sample) -> bool:
    """Ops whose CPU result changes between two calls are random: compared by shape and dtype."""
    def run():
        return op(sample.input, *sample.args, **sample.kwargs)

    torch.manual_seed(0)
    first_ok, first = attempt(run)
    second_ok, second = attempt(run)
    if not (first_ok and second_ok):
        return False
    for x, y in zip(tree_flatten(first)[0], tree_flatten(second)[0]):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided:
            try:
                if not torch.equal(x, y) and not (x.isnan().all() and y.isnan().all()):
                    return True
            except RuntimeError:  # no equal for this dtype on the CPU (complex32): compare the real view
                if not torch.equal(torch.view_as_real(x).float(), torch.view_as_real(y).float()):
                    return True
    return False


def cases(op, sample):
    """(category, case(device) -> result) for what this op supports."""

    def args_on(device, source=sample):
        return moved(source.input, device), moved(source.args, device), moved(source.kwargs, device)

    if op.inplace_variant is not None and isinstance(sample.input, torch.Tensor):
        def inplace(device):
            x, args, kwargs = args_on(device)
            x = x.clone()
            result = op.inplace_variant(x, *args, **kwargs)
            return result, x
        yield "inplace", inplace

    if op.supports_out:
        reference_ok, reference = attempt(lambda: op(sample.input, *sample.args, **sample.kwargs))
        tensors = reference_ok and all(isinstance(t, torch.Tensor) for t in tree_flatten(reference)[0])
        if tensors:
            def out(device):
                x, args, kwargs = args_on(device)
                target = tree_map(lambda t: torch.empty_like(t, device=device), reference)
                result = op(x, *args, **kwargs, out=target)
                return result, target
            yield "out", out

            def out_resized(device):  # out= tensors of the wrong size: resized (with a warning), as on CPU
                x, args, kwargs = args_on(device)
                target = tree_map(lambda t: torch.empty(t.numel() + 1, dtype=t.dtype, device=device), reference)
                result = op(x, *args, **kwargs, out=target)
                return result, target
            yield "out_resized", out_resized

            def out_dtype(device):  # out= tensors of another dtype: refused or cast, as on CPU
                x, args, kwargs = args_on(device)
                other = {torch.float32: torch.int64, torch.int64: torch.float32, torch.bool: torch.float32}
                target = tree_map(lambda t: torch.empty_like(t, dtype=other.get(t.dtype, torch.float64), device=device),
                                  reference)
                result = op(x, *args, **kwargs, out=target)
                return result, target
            yield "out_dtype", out_dtype

            def out_device(device):
                x, args, kwargs = args_on(device)
                target = tree_map(lambda t: torch.empty((), dtype=t.dtype), reference)
                op(x, *args, **kwargs, out=target)
                return target
            yield "out_device", out_device

            single = isinstance(reference, torch.Tensor) and isinstance(sample.input, torch.Tensor)
            if single and reference.shape == sample.input.shape and reference.dtype == sample.input.dtype:
                def out_alias(device):
                    x, args, kwargs = args_on(device)
                    x = x.clone()
                    result = op(x, *args, **kwargs, out=x)
                    return result, x

                # Only where the CPU defines the result: it raises, or gives what it gives without
                # the alias. Otherwise the kernel reads an input it already overwrote (linalg.ldl_solve)
                # and the values depend on its internals (threads), on any device.
                aliased_ok, aliased = attempt(lambda: out_alias("cpu"))
                if not aliased_ok or same(reference, aliased[0], False, "cpu") is None:
                    yield "out_alias", out_alias

    noncontiguous = sample.noncontiguous()

    def noncontiguous_case(device):
        x, args, kwargs = args_on(device, noncontiguous)
        return op(x, *args, **kwargs)
    yield "noncontiguous", noncontiguous_case

    if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu"):
        grad_sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=True)), None)
        if grad_sample is not None:
            def backward(device):
                x, args, kwargs = args_on(device, grad_sample)
                leaves = [t for t in tree_flatten((x, args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.requires_grad]
                outputs = [t for t in tree_flatten(op(x, *args, **kwargs))[0]
                           if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                if not outputs or not leaves:
                    return []
                total = sum(o.float().sum() if not o.is_complex() else o.abs().sum() for o in outputs)
                grads = torch.autograd.grad(total, leaves, allow_unused=True)
                return [g if g is not None else "none" for g in grads]
            yield "backward", backward


def main(out_path: str) -> None:
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")
    results = {category: {"pass": [], "fail": {}} for category in CATEGORIES}
    with numerics.golden():
        for op in op_db:
            if torch.float32 not in op.supported_dtypes("cpu"):
                continue
            name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
            sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)), None)
            if sample is None or any(isinstance(t, torch.Tensor) and t.layout != torch.strided
                                     for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]):
                continue  # sparse samples: the emulated NPU holds dense tensors only (as docs/emulator.md says)
            # Uninitialized results (empty, new_empty_strided ...): garbage on both devices, which
            # may even repeat between two CPU calls.
            shapes_only = op.name.rpartition(".")[2].lstrip("_") in UNINITIALIZED or is_random(op, sample)
            for category, case in cases(op, sample):
                print(f"RUNNING {name} {category}", file=sys.stderr, flush=True)
                if category == "out_device":
                    npu_ok, npu_result = attempt(lambda case=case: case("npu"))
                    problem = None if not npu_ok else "an out= CPU tensor with npu inputs is accepted"
                else:
                    problem = compare(case, shapes_only)
                if problem == SKIP:
                    continue
                if problem is None:
                    results[category]["pass"].append(name)
                else:
                    results[category]["fail"][name] = problem
    with open(out_path, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
