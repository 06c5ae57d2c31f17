"""Case generation: from (seed, index) a model spec, a precision, ranks, and one fault (or none).

A fault's *location* is a list of `Op`s: the op(s) the fault changed or made hazardous, each named by
the module whose forward calls it (its path in the model, without DDP's `module.` prefix), the api
as the dump names it (`Functional.linear`), and which of that module's calls of the api it is.

Kinds (the precision each needs):
  wrong_op       (any)        the NPU run computes another op at one place: an activation swapped,
                              a norm's eps, a transposed weight, attention's scale or softmax dim,
                              the MoE's top-k
  fp16_overflow  (fp16)       a site whose output passes 65504 (a linear, a square, attention scores)
  cancellation   (fp16/bf16)  a site whose linear output rides on a large offset that a subtraction
                              or a LayerNorm then removes
  lost_update    (fp16/bf16)  a small update added to a larger tensor and read back as a difference
  hf32_loss      (hf32)       an fp32 linear/conv over inputs on a large offset, HF32 on in the NPU run
  grad_hook      (any)        the NPU run's gradient is scaled by a hook on a layer's output or weight
  rank_only      (any, 2-4 ranks) one rank alone: a weight changed after DDP's broadcast, an
                              activation swapped, or a gradient hook
Precision hazards are in the model's code in both runs (as a user's would be): only the NPU run's
numerics make them faults. The other kinds are injected into the NPU run alone.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

FAULT_KINDS = ("wrong_op", "fp16_overflow", "cancellation", "lost_update", "hf32_loss", "grad_hook", "rank_only")
FAMILIES = ("mlp", "residual", "attention", "norms", "moe", "cnn")
PRECISION_KINDS = {"fp16_overflow": ("fp16",), "cancellation": ("fp16", "bf16"), "lost_update": ("fp16", "bf16"),
                   "hf32_loss": ("hf32",)}
# the faults a precision change can cure (the fix finder is measured on these)
FIXABLE_KINDS = frozenset(PRECISION_KINDS)


@dataclass(frozen=True)
class Op:
    module: str  # "layers.1.fc", "" for the model itself
    api: str  # as the dump names it: "Functional.linear", "Tensor.__mul__"
    occurrence: int = 0  # which of the module's calls of this api (forward order)
    golden_api: str = ""  # the golden run's api at that place when the fault replaced it


@dataclass
class Case:
    case_id: str
    seed: int
    family: str
    precision: str  # fp16 | bf16 | hf32
    ranks: int
    steps: int
    width: int
    depth: int
    features: int
    batch: int
    tokens: int
    acts: list[str]
    norm: str
    attention: str
    optimizer: str
    grad_scaler: bool
    site: str | None  # the Site kind (a hazard, or a harmless twin), None for no site
    site_after: int
    fault: str | None  # a FAULT_KINDS member; None: a clean run
    variant: str = ""
    target: str = ""  # the module the fault acts on (for wrong_op, grad_hook, rank_only)
    factor: float = 1.0
    bad_rank: int = -1  # rank_only: the rank at fault
    location: list[Op] = field(default_factory=list)

    @property
    def fixable_kind(self) -> bool:
        return self.fault in FIXABLE_KINDS

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Case:
        return cls(**{**data, "location": [Op(**op) for op in data["location"]]})


def case_seed(seed: int, index: int) -> int:
    return random.Random(f"npukit-localization:{seed}:{index}").getrandbits(31)


def make_case(seed: int, index: int, fault: str | None) -> Case:
    """The case `index` of a run seeded `seed`: everything drawn from one RNG seeded by both."""
    rng = random.Random(case_seed(seed, index))
    family = rng.choice(FAMILIES)
    if fault in PRECISION_KINDS:
        precision = rng.choice(PRECISION_KINDS[fault])
    else:
        precision = rng.choice(("fp16", "bf16", "hf32"))
    if fault == "hf32_loss" and family in ("attention", "moe") and rng.random() < 0.5:
        family = rng.choice(("mlp", "cnn", "norms"))
    if fault == "rank_only":
        ranks = rng.choice((2, 3, 4))
    elif fault in (None, "wrong_op", "grad_hook") and rng.random() < 0.15:
        ranks = rng.choice((2, 3, 4))
    else:
        ranks = 1
    depth = rng.randint(2, 4)
    sequence = family in ("residual", "attention", "moe")
    norm = rng.choice(("layer", "rms") if sequence else ("layer", "batch", "group")) if family != "cnn" \
        else rng.choice(("batch", "group"))
    if family == "mlp":
        norm = "layer"
    case = Case(
        case_id=f"{seed}-{index}", seed=case_seed(seed, index), family=family, precision=precision, ranks=ranks,
        steps=rng.choice((1, 2)), width=rng.choice((16, 32)), depth=depth, features=rng.choice((8, 12)),
        batch=rng.choice((8, 16)), tokens=rng.choice((4, 6)) if sequence else 0,
        acts=[rng.choice(("gelu", "relu", "silu", "tanh")) for _ in range(depth)], norm=norm,
        attention=rng.choice(("sdpa", "manual_inf", "manual_min")), optimizer=rng.choice(("sgd", "adamw")),
        grad_scaler=precision == "fp16" and rng.random() < 0.5, site=None, site_after=depth - 1, fault=fault)
    _place_fault(case, rng)
    return case


def _place_fault(case: Case, rng: random.Random) -> None:
    fault, family, sequence = case.fault, case.family, case.family in ("residual", "attention", "moe")
    if fault is None:  # a clean run: a harmless site or none
        twins = ["plain", "plain_sub", "plain_square"] + (["plain_scores"] if sequence else [])
        case.site = rng.choice([None, *twins])
        if family == "cnn" and rng.random() < 0.3:
            case.site, case.site_after = "plain_conv", rng.randrange(case.depth)
        return
    if fault == "fp16_overflow":
        case.site = rng.choice(("overflow_linear", "overflow_square") + (("overflow_scores",) if sequence else ()))
        case.variant = case.site
        case.location = {"overflow_linear": [Op("site.fc", "Functional.linear")],
                         "overflow_square": [Op("site", "Tensor.__mul__")],
                         "overflow_scores": [Op("site", "Tensor.__matmul__")]}[case.site]
        return
    if fault == "cancellation":
        case.site = case.variant = rng.choice(("cancel_sub", "cancel_norm"))
        case.location = [Op("site.fc", "Functional.linear")]
        if case.site == "cancel_sub":
            case.location.append(Op("site", "Tensor.__sub__"))
        return
    if fault == "lost_update":
        case.site = case.variant = "lost_update"
        case.location = [Op("site", "Tensor.__add__"), Op("site", "Tensor.__sub__")]
        return
    if fault == "hf32_loss":
        if family == "cnn" and rng.random() < 0.5:
            case.site, case.site_after = "hf32_conv", rng.randrange(case.depth)
            case.location = [Op("site.conv", "Functional.conv2d")]
        else:
            case.site = rng.choice(("hf32_sub",) + (() if sequence else ("hf32_bn",)))
            case.location = [Op("site.fc", "Functional.linear")]
        case.variant = case.site
        return
    if fault == "rank_only":
        case.bad_rank = rng.randrange(case.ranks)
        case.variant = rng.choice(("weight", "activation", "grad_hook"))
        if case.variant == "weight":
            case.target, api = _linear_in_trunk(case, rng)
            case.factor = rng.choice((1.5, 0.5, -1.0))
            case.location = [Op(case.target, api)]
        elif case.variant == "activation":
            _wrong_activation(case, rng)
        else:
            _grad_hook(case, rng)
        return
    if fault == "grad_hook":
        _grad_hook(case, rng)
        return
    if fault == "wrong_op":
        choices = ["activation"] + (["transposed"] if family in ("mlp", "norms", "attention") else [])
        if family in ("residual", "attention", "norms", "moe") and case.norm in ("layer", "batch", "group"):
            choices.append("norm_eps")
        if family == "attention" and case.attention != "sdpa":
            choices += ["attention_scale", "softmax_dim"]
        if family == "moe":
            choices.append("top_k")
        case.variant = rng.choice(choices)
        layer = rng.randrange(case.depth)
        if case.variant == "activation":
            _wrong_activation(case, rng)
        elif case.variant == "transposed":
            case.target = {"mlp": f"layers.{layer}.fc", "norms": f"layers.{layer}.fc",
                           "attention": f"layers.{layer}.attn.proj"}[family]
            case.location = [Op(case.target, "Functional.linear"), Op(case.target, "Tensor.t")]
        elif case.variant == "norm_eps":
            path = {"residual": f"layers.{layer}.norm", "attention": f"layers.{layer}.norm1",
                    "norms": f"layers.{layer}.norm", "moe": f"layers.{layer}.norm"}[family]
            case.target = path
            api = {"layer": "Functional.layer_norm", "batch": "Functional.batch_norm",
                   "group": "Functional.group_norm"}[case.norm]
            case.location = [Op(path, api)]
        elif case.variant == "attention_scale":
            case.target = f"layers.{layer}.attn"
            case.location = [Op(case.target, "Tensor.__mul__")]
        elif case.variant == "softmax_dim":
            case.target = f"layers.{layer}.attn"
            case.location = [Op(case.target, "Tensor.softmax")]
        elif case.variant == "top_k":
            case.target = f"layers.{layer}"
            case.location = [Op(case.target, "Tensor.topk")]
        return
    raise ValueError(fault)


_ACT_API = {"gelu": "Functional.gelu", "relu": "Functional.relu", "silu": "Functional.silu",
            "tanh": "Torch.tanh", "sigmoid": "Torch.sigmoid"}
OTHER_ACTIVATION = {  # what a wrong_op fault puts in place of each activation
    "gelu": "relu", "relu": "sigmoid", "silu": "tanh", "tanh": "sigmoid"}


def _activation_module(case: Case, layer: int, rng: random.Random) -> str:
    return {"mlp": f"layers.{layer}", "residual": f"layers.{layer}", "attention": f"layers.{layer}.mlp",
            "norms": f"layers.{layer}", "moe": f"layers.{layer}.experts.{rng.randrange(4)}",
            "cnn": f"layers.{layer}"}[case.family]


def _wrong_activation(case: Case, rng: random.Random) -> None:
    layer = rng.randrange(case.depth)
    case.target = _activation_module(case, layer, rng)
    good = case.acts[layer]
    bad = OTHER_ACTIVATION[good]
    case.location = [Op(case.target, _ACT_API[bad], golden_api=_ACT_API[good])]
    case.variant = case.variant or "activation"


def _linear_in_trunk(case: Case, rng: random.Random) -> tuple[str, str]:
    """A Linear/Conv2d of the trunk: (its path, its api)."""
    layer = rng.randrange(case.depth)
    options = {"mlp": [f"layers.{layer}.fc"],
               "residual": [f"layers.{layer}.fc1", f"layers.{layer}.fc2"],
               "attention": [f"layers.{layer}.attn.proj", f"layers.{layer}.attn.qkv", f"layers.{layer}.mlp.fc1"],
               "norms": [f"layers.{layer}.fc"],
               "moe": [f"layers.{layer}.experts.{rng.randrange(4)}.fc1", f"layers.{layer}.router"],
               "cnn": [f"layers.{layer}.conv", "head"]}[case.family]
    path = rng.choice(options)
    api = "Functional.conv2d" if path.endswith(".conv") else "Functional.linear"
    return path, api


def _grad_hook(case: Case, rng: random.Random) -> None:
    case.target, api = _linear_in_trunk(case, rng)
    case.variant = case.variant if case.fault == "rank_only" else rng.choice(("output", "weight"))
    if case.fault == "rank_only":
        case.variant = "grad_hook_" + rng.choice(("output", "weight"))
    case.factor = rng.choice((5.0, 0.2, -1.0, 0.0))
    case.location = [Op(case.target, api)]
