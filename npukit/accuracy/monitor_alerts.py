"""The monitor's alerts, judged on each monitored step's statistics as training goes on.

    nan/inf        the first record of the step (forward order: activations, then gradients) with a
                   non-finite value, and its statistic; a non-finite weight first (the forward used it)
    turbulence     a norm beyond (1 + threshold) x its running mean (msprobe's AnomalyTurbulence);
                   Adam's exp_avg_sq, a mean of squared gradients, beyond (1 + threshold)^2 x; a
                   norm of zero carries no scale and is not taken in (a LayerNorm's bias, zero at
                   initialization, doubled each step of its first few and was called turbulent)
    loss spike     the loss beyond (1 + loss_spike) x its running mean and beyond loss_spike_sigmas
                   running standard deviations above it: a small batch's loss varies by itself (a
                   regression over 16 random rows reached 2.7x its running mean, 5.3 deviations)
    grad-norm      the total gradient norm beyond grad_norm_growth x its running mean
    skipped steps  GradScaler skipped every one of the last skipped_steps monitored steps
    forecast       an activation's or gradient's abs-max past the square root of its dtype's largest
                   value (256 in fp16), growing at every recent sample, at a rate that reaches the
                   largest value within forecast_steps steps

Running means are exponential (recent steps weigh most) and start judging after `warmup` monitored
steps. Gradients of a step GradScaler skipped are its own business (the scale was too high): they
raise no alert and leave the running means alone. Each alert is said once per (rule, name), nan/inf
once per run (the first; the nan then spreads everywhere): the state kept is a few numbers per record name, bounded by the model's size, not by the run's length.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

GRADIENT_KINDS = frozenset({"grad", "grad_local", "activation_grad"})
# abs-max forecasts: forward values, and gradients once unscaled (activation gradients and a rank's
# gradients before the all-reduce are taken under the loss scale, which GradScaler raises until they
# overflow on purpose)
FORECAST_KINDS = frozenset({"activation", "grad", "grad_local", "activation_grad"})
_TAKEN_UNDER_THE_LOSS_SCALE = frozenset({"activation_grad", "grad_local"})
_EMA_DECAY = 0.9


@dataclass
class AlertRules:
    turbulence: float = 9.0  # a norm beyond 10x its running mean
    loss_spike: float = 1.0  # a loss twice its running mean ...
    loss_spike_sigmas: float = 8.0  # ... and this many running standard deviations above it
    grad_norm_growth: float = 10.0
    warmup: int = 5
    forecast_steps: int = 50
    forecast_window: int = 6
    forecast_min_growth: float = 0.005  # slower than 0.5% a step is no trend, unless by a steady amount
    skipped_steps: int = 10  # GradScaler skipping this many monitored steps in a row


@dataclass
class Alert:
    step: int
    rule: str
    name: str
    statistic: str
    value: float
    message: str


@dataclass(slots=True)  # hundreds made per monitored step
class Record:
    """One tensor's statistics in one step: kind is weight, grad, activation, activation_grad,
    exp_avg, exp_avg_sq or update_ratio; values as tensor_stats returns them (max, min, mean,
    norm, nan count, inf count)."""
    kind: str
    name: str
    dtype: torch.dtype
    values: list[float]

    @property
    def abs_max(self) -> float:
        return max(abs(self.values[0]), abs(self.values[1]))


_LABELS = {"activation": "output", "activation_grad": "output gradient", "grad": "gradient",
           "grad_local": "gradient before the all-reduce", "weight": "weight",
           "exp_avg": "Adam exp_avg", "exp_avg_sq": "Adam exp_avg_sq", "update_ratio": "update/weight ratio"}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


_LARGEST: dict[torch.dtype, float | None] = {}


def _largest(dtype: torch.dtype) -> float | None:
    """The dtype's largest finite value (None: not a floating-point dtype), looked up once."""
    largest = _LARGEST.get(dtype, False)
    if largest is False:
        largest = _LARGEST[dtype] = torch.finfo(dtype).max if dtype.is_floating_point else None
    return largest


def label(record: Record) -> str:
    return f"{record.name} {_LABELS.get(record.kind, record.kind)}"


def short_number(value: float) -> str:
    """41k, 3.2M, 0.013: what a person reads in an alert (the files keep every digit)."""
    size = abs(value)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if size >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


class Alerts:
    def __init__(self, rules: AlertRules | None = None) -> None:
        self.rules = rules or AlertRules()
        self._said: set[tuple[str, str]] = set()
        # (kind, name) -> (running mean of the norm, samples); ("loss", "") and ("grad_norm", ""): the scalars'
        self._means: dict[tuple[str, str], tuple[float, int]] = {}
        self._history: dict[tuple[str, str], deque] = {}  # (kind, name) -> (step, log abs-max)
        self._skipped_since: tuple[int, float | None, int] | None = None  # first step, its scale, steps
        self._loss_variance = 0.0

    def judge(self, step: int, records: list[Record], loss: float | None, grad_norm: float | None,
              skipped: bool, loss_scale: float | None) -> list[Alert]:
        """The alerts this step raises for the first time."""
        found: list[Alert] = []
        loss_scaled = loss_scale is not None
        skipped_run = self._skipped_run(step, skipped, loss_scale)
        if skipped_run is not None:
            found.append(skipped_run)
        judged = [r for r in records if not (skipped and r.kind in GRADIENT_KINDS)]
        first_bad = next((r for r in judged if r.values[4] or r.values[5]), None)
        if first_bad is not None and first_bad.kind != "weight":
            # a weight is recorded after backward but holds what the forward used: non-finite there, it
            # is where the step's nan starts (an update made it so), not the first output computed from it
            first_bad = next((r for r in judged if r.kind == "weight" and (r.values[4] or r.values[5])), first_bad)
        if first_bad is not None:
            statistic = "nan" if first_bad.values[4] else "inf"
            count = int(first_bad.values[4] or first_bad.values[5])
            where = ("a weight this step's forward used: the update before it (or the initialization) made it "
                     "non-finite") if first_bad.kind == "weight" else "the first module with a non-finite value this step"
            found.append(Alert(step, "nan/inf", first_bad.name, statistic, float(count),
                               f"step {step}: {count} {statistic} value(s) in {label(first_bad)}, {where}"))
        # Adam's exp_avg_sq holds squared gradients: a gradient (1 + threshold)x its usual size
        # shows there squared (a 3x gradient, normal in a small layer's first steps, is 9x)
        factor = 1 + self.rules.turbulence
        squared = factor ** 2
        forecast_kinds = FORECAST_KINDS - _TAKEN_UNDER_THE_LOSS_SCALE if loss_scaled else FORECAST_KINDS
        # per record: one lookup and one update of its running norm (hundreds of records a step,
        # judged in the training thread)
        means, warmup, isfinite = self._means, self.rules.warmup, math.isfinite
        for record in judged:
            kind, values = record.kind, record.values
            norm = values[3]
            if values[4] or values[5] or not isfinite(norm):
                continue
            if norm:
                norm = abs(norm)
                key = (kind, record.name)
                mean, samples = means.get(key, (norm, 0))
                means[key] = (_EMA_DECAY * mean + (1 - _EMA_DECAY) * norm if samples else norm, samples + 1)
                if samples >= warmup and norm > (squared if kind == "exp_avg_sq" else factor) * mean > 0:
                    found.append(Alert(step, "turbulence", f"{record.name}:{kind}", "norm", values[3],
                                       f"step {step}: {label(record)} norm {short_number(values[3])}, "
                                       f"{norm / mean:.1f}x its running mean {short_number(mean)}"))
            if kind in forecast_kinds:
                forecast = self._forecast(step, record)
                if forecast is not None:
                    found.append(forecast)
        if loss is not None and math.isfinite(loss):
            deviation = self._running_deviation(loss)
            mean = self._running(("loss", ""), loss)
            if (mean is not None and mean > 0 and loss > (1 + self.rules.loss_spike) * mean
                    and loss - mean > self.rules.loss_spike_sigmas * deviation):
                found.append(Alert(step, "loss spike", "loss", "value", loss,
                                   f"step {step}: loss {loss:.4g}, {loss / mean:.1f}x its running mean {mean:.4g}"))
        if grad_norm is not None and math.isfinite(grad_norm) and not skipped:
            mean = self._running(("grad_norm", ""), grad_norm)
            if mean is not None and mean > 0 and grad_norm > self.rules.grad_norm_growth * mean:
                found.append(Alert(step, "grad-norm growth", "total gradient norm", "value", grad_norm,
                                   f"step {step}: total gradient norm {short_number(grad_norm)}, "
                                   f"{grad_norm / mean:.1f}x its running mean {short_number(mean)}"))
        fresh = [alert for alert in found if self._said_key(alert) not in self._said]
        self._said.update(self._said_key(alert) for alert in fresh)
        return fresh

    @staticmethod
    def _said_key(alert: Alert) -> tuple[str, str]:
        # nan/inf is said once per run: after the first, the nan spreads to every later module and step
        return (alert.rule, "" if alert.rule == "nan/inf" else alert.name)

    def _skipped_run(self, step: int, skipped: bool, loss_scale: float | None) -> Alert | None:
        """GradScaler skipped every one of the last skipped_steps monitored steps: the model does not
        train (fp16 values overflow at every scale, or in saturation mode a value saturates)."""
        if not skipped:
            self._skipped_since = None
            return None
        if self._skipped_since is None:
            self._skipped_since = (step, loss_scale, 0)
        first, first_scale, count = self._skipped_since
        self._skipped_since = (first, first_scale, count + 1)
        if count + 1 < self.rules.skipped_steps:
            return None
        return Alert(step, "skipped steps", "GradScaler", "steps skipped", float(count + 1),
                     f"step {step}: GradScaler skipped every step since step {first} (loss scale "
                     f"{first_scale:g} -> {loss_scale:g}): the model is not training; npu-run --detect-overflow "
                     "names the op that overflows (or, in saturation mode, saturates)")

    def _running_deviation(self, loss: float) -> float:
        """The loss's running standard deviation before this value (its exponential variance about
        the running mean, as the mean decays); then takes the value in."""
        mean, samples = self._means.get(("loss", ""), (loss, 0))
        variance = self._loss_variance
        if samples:
            self._loss_variance = _EMA_DECAY * (variance + (1 - _EMA_DECAY) * (loss - mean) ** 2)
        return math.sqrt(variance)

    def _running(self, key: tuple[str, str], value: float) -> float | None:
        """The running mean before this value (None during the warmup); then takes the value in."""
        mean, samples = self._means.get(key, (value, 0))
        before = mean if samples >= self.rules.warmup else None
        self._means[key] = (_EMA_DECAY * mean + (1 - _EMA_DECAY) * value if samples else value, samples + 1)
        return before

    def _forecast(self, step: int, record: Record) -> Alert | None:
        """The abs-max grew at every one of the last forecast_window samples: at the slowest of
        those rates (per step), when does it reach the dtype's largest value? A value rising from
        near zero grows fast at first; the slowest recent rate keeps it from being called early."""
        largest = _largest(record.dtype)
        if largest is None:
            return None
        abs_max = record.abs_max
        key = (record.kind, record.name)
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = deque(maxlen=self.rules.forecast_window)
        if not (0 < abs_max < largest) or not math.isfinite(abs_max):
            history.clear()  # an overflow (or all zeros) ends the trend
            return None
        history.append((step, math.log(abs_max)))
        if len(history) < history.maxlen or abs_max < math.sqrt(largest):
            return None  # below half the dtype's range (in orders of magnitude) nothing approaches it
        samples = list(history)
        slopes = [(b_log - a_log) / (b_step - a_step) for (a_step, a_log), (b_step, b_log) in zip(samples, samples[1:])]
        slope = min(slopes)
        if slope <= 0:
            return None  # not growing at every sample: no trend to extrapolate
        # a value that grows by a steady amount (a feature rising with the step) grows ever slower in
        # proportion: its rate falls at every sample, and it reaches the largest value at that amount
        increments = [(math.exp(b_log) - math.exp(a_log)) / (b_step - a_step)
                      for (a_step, a_log), (b_step, b_log) in zip(samples, samples[1:])]
        steady = all(later < earlier for earlier, later in zip(slopes, slopes[1:])) and \
            max(increments) <= 1.5 * min(increments)
        if slope < math.log1p(self.rules.forecast_min_growth) and not steady:
            return None  # a slow creep of changing pace is no trend; a steady amount is, however slow
        steps_left = (math.log(largest) - samples[-1][1]) / slope
        if steady:
            steps_left = (largest - abs_max) / increments[-1]
        if steps_left > self.rules.forecast_steps:
            return None
        dtype = _DTYPE_NAMES.get(record.dtype, str(record.dtype).removeprefix("torch."))
        growth = f"by {short_number(increments[-1])}" if steady else f"{math.expm1(slope) * 100:.2g}%"
        return Alert(step, "overflow forecast", f"{record.name}:{record.kind}", "abs max", abs_max,
                     f"step {step}: {label(record)} max {short_number(abs_max)}, growing {growth} a step: "
                     f"{dtype} overflow in about {max(1, round(steps_left))} steps")
