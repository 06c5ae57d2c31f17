"""Element-wise comparison of golden and target tensors: fp64, chunked, memory-mapped, multi-process.

Each tensor pair is cut into chunks; a chunk gives a vector of partial sums and extrema
(`_PARTIAL` layout), partials are merged, and `finish` turns them into the reported metrics.
float64/32/16 and bfloat16 pairs are read once by a C kernel (_stats.pair_partial) that computes
chunk_partial's figures; other dtypes (integers, float8) and strided views go through numpy chunks.
Workers import only numpy (and this module), so a process pool starts quickly.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npukit.accuracy.tensor_io import (
    FLOAT_MIN_EXPONENT,
    FLOAT_PRECISION_BITS,
    TorchNeeded,
    float64_converter,
    forbid_torch,
    read_tensor,
)
from npukit.watch._stats import pair_partial

CHUNK = 1 << 16  # elements: the fp64 work buffers stay in L2 cache
TASK_ELEMENTS = 1 << 22  # elements per pool task: large enough to hide dispatch cost
# Relative errors as msprobe 26.2 defines them (MaxRelativeErr and the 0.1%/0.5% ratios):
# |target - golden| / |golden|, and where the golden is 0 |target| / eps, eps the machine epsilon of
# numpy's result type of the pair with float32 (float64's if either side is float64).
FLOAT32_EPS = float(np.finfo(np.float32).eps)
FLOAT64_EPS = float(np.finfo(np.float64).eps)

# Partial result layout.
(N, S_GT, S_GG, S_TT, S_DD, MAX_ABS, MAX_REL, N_REL_1E3, N_REL_5E3, NAN_MISMATCH, INF_MISMATCH,
 MAX_ULP, G_NONFINITE, T_NONFINITE, G_MAX, G_MIN, G_SUM, T_MAX, T_MIN, T_SUM) = range(20)
_SIZE = 20
_SUMMED = [N, S_GT, S_GG, S_TT, S_DD, N_REL_1E3, N_REL_5E3, NAN_MISMATCH, INF_MISMATCH, G_NONFINITE,
           T_NONFINITE, G_SUM, T_SUM]
_MAXED = [MAX_ABS, MAX_REL, MAX_ULP, G_MAX, T_MAX]
_MINNED = [G_MIN, T_MIN]


@dataclass(frozen=True)
class PairJob:
    """One tensor pair to compare. ulp_dtype: the target dtype when ULPs are wanted (matmul-class ops)."""

    golden_path: str
    golden_dtype: str
    target_path: str
    target_dtype: str
    numel: int
    ulp_dtype: str | None = None
    shape: tuple[int, ...] | None = None  # as recorded in dump.json; checked against both files
    target_scale: float = 1.0  # multiplies the target (1/loss scale): a power of two, so exact
    ulp_floor: float = 0.0  # ULPs are counted at max(|golden|, ulp_floor): the golden RMS
    zero_eps: float = FLOAT32_EPS  # a relative error's denominator where the golden is 0 (msprobe's)


@dataclass
class PairMetrics:
    numel: int
    cosine: float
    rel_l2: float
    sqnr_db: float
    euc_dist: float
    max_abs: float
    max_rel: float
    within_1e3: float  # fraction of elements with relative error < 0.1% (msprobe's strict test)
    within_5e3: float
    max_ulp: float | None
    nan_inf_mismatch: int
    golden_nonfinite: int
    target_nonfinite: int
    golden_stats: tuple  # max, min, mean, norm over finite elements
    target_stats: tuple


def empty_partial() -> np.ndarray:
    partial = np.zeros(_SIZE)
    partial[_MAXED] = -np.inf
    partial[[G_MIN, T_MIN]] = np.inf
    return partial


def merge(into: np.ndarray, other: np.ndarray) -> None:
    into[_SUMMED] += other[_SUMMED]
    into[_MAXED] = np.maximum(into[_MAXED], other[_MAXED])
    into[_MINNED] = np.minimum(into[_MINNED], other[_MINNED])


class Workspace:
    """Reusable float64 buffers for one chunk: no allocation (and no page faults) per chunk."""

    def __init__(self, size: int = CHUNK) -> None:
        self.golden = np.empty(size)
        self.target = np.empty(size)
        self.scratch = np.empty(size)
        self.mask = np.empty(size, dtype=bool)


def _dot(a: np.ndarray, b: np.ndarray, scratch: np.ndarray) -> float:
    # Not np.dot: BLAS threads spin against the worker processes and run 100x slower when the
    # cores are busy. einsum's own loop is one pass with no temporary (fp64 over <= CHUNK terms).
    return float(np.einsum("i,i->", a, b))


def chunk_partial(golden: np.ndarray, target: np.ndarray, ulp_dtype: str | None,
                  work: Workspace | None = None, ulp_floor: float = 0.0, zero_eps: float = FLOAT32_EPS) -> np.ndarray:
    """Partial sums of one chunk. golden and target are float64 1-D arrays; both are overwritten."""
    partial = empty_partial()
    partial[N] = golden.size
    if golden.size == 0:
        return partial
    size = golden.size
    scratch = work.scratch[:size] if work is not None else np.empty(size)
    s_gg = _dot(golden, golden, scratch)
    s_tt = _dot(target, target, scratch)
    if not (math.isfinite(s_gg) and math.isfinite(s_tt)):
        # Slow path, only for chunks holding nan/inf: count mismatches, compare the finite rest.
        golden_nan, target_nan = np.isnan(golden), np.isnan(target)
        golden_fin, target_fin = np.isfinite(golden), np.isfinite(target)
        partial[NAN_MISMATCH] = np.count_nonzero(golden_nan != target_nan)
        partial[INF_MISMATCH] = np.count_nonzero(
            ~golden_nan & ~target_nan & (~golden_fin | ~target_fin) & (golden != target)
        )
        partial[G_NONFINITE] = golden.size - np.count_nonzero(golden_fin)
        partial[T_NONFINITE] = target.size - np.count_nonzero(target_fin)
        both = golden_fin & target_fin
        # Equal non-finite values (inf == inf, nan and nan) count as agreeing elements.
        agreeing_nonfinite = np.count_nonzero(~both & ((golden == target) | (golden_nan & target_nan)))
        golden, target = golden[both], target[both]
        partial[N_REL_1E3] += agreeing_nonfinite
        partial[N_REL_5E3] += agreeing_nonfinite
        size = golden.size
        if size == 0:
            return partial
        scratch = scratch[:size]
        s_gg = _dot(golden, golden, scratch)
        s_tt = _dot(target, target, scratch)
    mask = work.mask[:size] if work is not None else np.empty(size, dtype=bool)
    partial[S_GG] = s_gg
    partial[S_TT] = s_tt
    partial[S_GT] = _dot(golden, target, scratch)
    partial[G_MAX], partial[G_MIN], partial[G_SUM] = golden.max(), golden.min(), golden.sum()
    partial[T_MAX], partial[T_MIN], partial[T_SUM] = target.max(), target.min(), target.sum()
    diff = np.subtract(target, golden, out=target)
    partial[S_DD] = _dot(diff, diff, scratch)
    abs_diff = np.abs(diff, out=diff)
    partial[MAX_ABS] = abs_diff.max()
    if ulp_dtype is not None:
        partial[MAX_ULP] = _max_ulp(golden, abs_diff, ulp_dtype, scratch, ulp_floor)
    rel = np.abs(golden, out=scratch)
    np.putmask(rel, np.equal(rel, 0, out=mask), zero_eps)
    np.divide(abs_diff, rel, out=rel)
    partial[MAX_REL] = rel.max()
    partial[N_REL_1E3] += np.count_nonzero(np.less(rel, 1e-3, out=mask))
    partial[N_REL_5E3] += np.count_nonzero(np.less(rel, 5e-3, out=mask))
    return partial


def _max_ulp(golden: np.ndarray, abs_diff: np.ndarray, dtype: str, scratch: np.ndarray, floor: float) -> float:
    """Largest error in units of the target dtype's spacing at max(|golden|, floor).

    The floor (the golden tensor's RMS) keeps outputs that a reduction cancelled to almost zero
    from reporting millions of ULPs: their error is an absolute one, at the tensor's scale.
    """
    bits = FLOAT_PRECISION_BITS[dtype]
    magnitude = np.maximum(np.abs(golden), floor)
    exponent = np.frexp(magnitude, out=(scratch, np.empty(golden.size, dtype=np.int32)))[1]
    np.subtract(exponent, bits, out=exponent)
    np.maximum(exponent, FLOAT_MIN_EXPONENT[dtype], out=exponent)
    spacing = np.ldexp(1.0, exponent, out=scratch)
    return float(np.divide(abs_diff, spacing, out=scratch).max())


_COMPLEX_PARTS = {"torch.complex64": "torch.float32", "torch.complex128": "torch.float64"}


def real_dtype_name(dtype_name: str) -> str:
    """The dtype of a complex dtype's parts (complex data is compared as its real view)."""
    return _COMPLEX_PARTS.get(dtype_name, dtype_name)


def as_real_elements(array: np.ndarray) -> np.ndarray:
    """Flat elements; a complex array as its real and imaginary parts interleaved (a view, no copy)."""
    flat = array.reshape(-1)
    if np.iscomplexobj(flat):
        flat = flat.view(flat.real.dtype)
    return flat


def pair_range_partial(job: PairJob, start: int, stop: int, work: Workspace | None = None) -> np.ndarray:
    """Partial over elements [start, stop) of one pair (opened memory-mapped, never read whole)."""
    work = work or Workspace()
    shape = list(job.shape) if job.shape is not None else None
    golden = as_real_elements(read_tensor(Path(job.golden_path), job.golden_dtype, shape))
    target = as_real_elements(read_tensor(Path(job.target_path), job.target_dtype, shape))
    to_golden = float64_converter(real_dtype_name(job.golden_dtype))
    to_target = float64_converter(real_dtype_name(job.target_dtype))
    ulp = job.ulp_dtype if job.ulp_dtype in FLOAT_PRECISION_BITS else None
    total = empty_partial()
    golden_kind = _ONE_PASS_KINDS.get(real_dtype_name(job.golden_dtype))
    target_kind = _ONE_PASS_KINDS.get(real_dtype_name(job.target_dtype))
    if golden_kind and target_kind and golden.flags.c_contiguous and target.flags.c_contiguous:
        # one read of both files in C: numpy's path below is a dozen passes over fp64 copies
        pair_partial(total, golden[start:stop], golden_kind, target[start:stop], target_kind, job.target_scale,
                     job.zero_eps, FLOAT_PRECISION_BITS[ulp] if ulp else 0, FLOAT_MIN_EXPONENT[ulp] if ulp else 0,
                     job.ulp_floor)
        return total
    for low in range(start, stop, CHUNK):
        high = min(stop, low + CHUNK)
        size = high - low
        golden_chunk, target_chunk = work.golden[:size], work.target[:size]
        to_golden(golden[low:high], golden_chunk)
        to_target(target[low:high], target_chunk)
        if job.target_scale != 1.0:
            np.multiply(target_chunk, job.target_scale, out=target_chunk)
        merge(total, chunk_partial(golden_chunk, target_chunk, ulp, work, job.ulp_floor, job.zero_eps))
    return total


# dtype name -> pair_partial's element kind (stored arrays: bfloat16 as its uint16 bits)
_ONE_PASS_KINDS = {"torch.float64": "f64", "torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


def _run_task(task: list[tuple[int, PairJob, int, int]]) -> list[tuple[int, np.ndarray]]:
    work = Workspace()
    return [(index, pair_range_partial(job, start, stop, work)) for index, job, start, stop in task]


def finish(partial: np.ndarray, ulp_wanted: bool) -> PairMetrics:
    n = int(partial[N])
    finite = n - int(max(partial[G_NONFINITE], partial[T_NONFINITE]))
    s_gg, s_tt, s_gt, s_dd = partial[S_GG], partial[S_TT], partial[S_GT], partial[S_DD]
    if s_gg == 0 and s_tt == 0:
        cosine = 1.0
    elif s_gg == 0 or s_tt == 0:
        cosine = 0.0
    else:
        cosine = float(np.clip(s_gt / math.sqrt(s_gg * s_tt), -1.0, 1.0))
    golden_norm = math.sqrt(s_gg)
    if s_dd == 0:
        rel_l2, sqnr = 0.0, math.inf
    else:
        rel_l2 = math.sqrt(s_dd) / golden_norm if golden_norm > 0 else math.inf
        sqnr = 10 * math.log10(s_gg / s_dd) if s_gg > 0 else -math.inf
    finite_count = max(finite, 1)

    def stats(max_i, min_i, sum_i, sq_i):
        if finite == 0:
            return (math.nan, math.nan, math.nan, math.nan)
        return (float(partial[max_i]), float(partial[min_i]), float(partial[sum_i]) / finite_count,
                math.sqrt(partial[sq_i]))

    return PairMetrics(
        numel=n,
        cosine=cosine,
        rel_l2=rel_l2,
        sqnr_db=sqnr,
        euc_dist=math.sqrt(s_dd),
        max_abs=float(partial[MAX_ABS]) if finite else 0.0,
        max_rel=float(partial[MAX_REL]) if finite else 0.0,
        within_1e3=float(partial[N_REL_1E3]) / n if n else 1.0,
        within_5e3=float(partial[N_REL_5E3]) / n if n else 1.0,
        max_ulp=float(partial[MAX_ULP]) if ulp_wanted and finite else None,
        nan_inf_mismatch=int(partial[NAN_MISMATCH] + partial[INF_MISMATCH]),
        golden_nonfinite=int(partial[G_NONFINITE]),
        target_nonfinite=int(partial[T_NONFINITE]),
        golden_stats=stats(G_MAX, G_MIN, G_SUM, S_GG),
        target_stats=stats(T_MAX, T_MIN, T_SUM, S_TT),
    )


def compare_pairs(jobs: list[PairJob], workers: int | None = None, progress=None) -> list[PairMetrics]:
    """Metrics for every job, in order. Large workloads (.npy or .pt pairs) are spread over processes."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    partials = [empty_partial() for _ in jobs]
    local_tasks: list = []
    pool_tasks = _plan_tasks(list(enumerate(jobs)))
    if workers <= 1 or sum(job.numel for job in jobs) < 2 * TASK_ELEMENTS or len(pool_tasks) < 2:
        local_tasks, pool_tasks = pool_tasks, []

    def collect(results, task):
        for index, partial in results:
            merge(partials[index], partial)
        if progress:
            progress(sum(stop - start for _, _, start, stop in task))

    if pool_tasks:
        with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=forbid_torch) as pool:
            futures = [(pool.submit(_run_task, task), task) for task in pool_tasks]
            for task in local_tasks:
                collect(_run_task(task), task)
            for future, task in futures:
                try:
                    results = future.result()
                except TorchNeeded:  # a .pt file of a layout only torch reads: here, not in a fork
                    results = _run_task(task)
                collect(results, task)
    else:
        for task in local_tasks:
            collect(_run_task(task), task)
    return [finish(partial, job.ulp_dtype is not None) for partial, job in zip(partials, jobs)]


def _pool_context():
    """fork where available: workers start in milliseconds and need no importable __main__.

    Safe here because workers only run numpy ufuncs on memory-mapped .npy and .pt files (no BLAS,
    no OpenMP, no torch: forbid_torch), so no lock or thread pool inherited from the parent is ever used.
    """
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _plan_tasks(jobs: list[tuple[int, PairJob]]) -> list[list[tuple[int, PairJob, int, int]]]:
    """Cut big pairs into ranges and pack small pairs together: ~TASK_ELEMENTS per task."""
    tasks: list[list] = []
    current: list = []
    current_size = 0
    for index, job in jobs:
        start = 0
        while True:
            stop = min(job.numel, start + TASK_ELEMENTS - current_size)
            current.append((index, job, start, stop))
            current_size += stop - start
            if current_size >= TASK_ELEMENTS:
                tasks.append(current)
                current, current_size = [], 0
            start = stop
            if start >= job.numel:
                break
    if current:
        tasks.append(current)
    return tasks
