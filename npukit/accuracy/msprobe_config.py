"""msprobe 26.2's dump configuration, for npukit's dump: which apis it records by default, and its
config.json read into DumpSession's options, so one config drives both tools.

Which apis: msprobe hooks the apis of its support list (support_wrap_ops.yaml: `functional`,
`tensor`, `torch`, torch_npu's and torch.distributed's ops) and, at levels L1 and mix with no
`scope` or `list`, records those of its `risk_level` (config.json; default FOCUS: all but its
low-risk apis: views, reshapes, splits, casts, creations). npukit's `--dump-ops`:

    focus        what msprobe records by default (npukit's default)
    core         msprobe's risk_level CORE: matmuls, convolutions, norms, embeddings, attention, fused ops
    msprobe-all  msprobe's whole support list (risk_level ALL; what msprobe records of a scope or list)
    all          every torch / functional / Tensor api npukit sees (also those msprobe never hooks:
                 Tensor.view, Tensor.__getitem__, Tensor.contiguous ...)

The lists below are msprobe 26.2's (tests/accuracy/test_msprobe_parity.py checks them against the
installed msprobe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from npukit.accuracy.naming import foreach_op
from npukit.errors import UserError

OP_SETS = ("focus", "core", "msprobe-all", "all")

# support_wrap_ops.yaml, by section
_SUPPORT_FUNCTIONAL = """
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc avg_pool1d
avg_pool2d avg_pool3d fractional_max_pool2d_with_indices fractional_max_pool2d
fractional_max_pool3d_with_indices fractional_max_pool3d max_pool1d_with_indices max_pool1d
max_pool2d_with_indices max_pool2d max_pool3d_with_indices max_pool3d max_unpool1d max_unpool2d
max_unpool3d lp_pool2d lp_pool1d adaptive_max_pool1d_with_indices adaptive_max_pool1d
adaptive_max_pool2d_with_indices adaptive_max_pool2d adaptive_max_pool3d_with_indices
adaptive_max_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d dropout
alpha_dropout dropout2d dropout3d feature_alpha_dropout threshold threshold_ relu relu_ glu hardtanh
hardtanh_ relu6 elu elu_ selu selu_ celu celu_ leaky_relu leaky_relu_ prelu rrelu rrelu_ logsigmoid
gelu hardshrink tanhshrink softsign softplus softmin softmax gumbel_softmax log_softmax softshrink
tanh sigmoid hardsigmoid linear bilinear silu hardswish embedding embedding_bag batch_norm
instance_norm layer_norm group_norm local_response_norm ctc_loss nll_loss poisson_nll_loss
gaussian_nll_loss kl_div cross_entropy binary_cross_entropy binary_cross_entropy_with_logits
smooth_l1_loss l1_loss mse_loss margin_ranking_loss hinge_embedding_loss multilabel_margin_loss
soft_margin_loss multilabel_soft_margin_loss cosine_embedding_loss multi_margin_loss pixel_shuffle
pixel_unshuffle channel_shuffle upsample interpolate upsample_nearest upsample_bilinear grid_sample
affine_grid pad pairwise_distance pdist cosine_similarity one_hot triplet_margin_loss
triplet_margin_with_distance_loss normalize unfold fold multi_head_attention_forward
scaled_dot_product_attention lp_pool3d dropout1d mish huber_loss
""".split()
_SUPPORT_TENSOR = """
__add__ __and__ __bool__ __div__ __eq__ __floordiv__ __ge__ __gt__ __iadd__ __iand__ __idiv__
__ifloordiv__ __ilshift__ __imod__ __imul__ __ior__ __ipow__ __irshift__ __isub__ __ixor__ __le__
__lshift__ __lt__ __matmul__ __mod__ __mul__ __ne__ __nonzero__ __or__ __pow__ __radd__ __rdiv__
__rmod__ __rmul__ __ror__ __rpow__ __rshift__ __rsub__ __rxor__ __setitem__ __sub__ __truediv__
__xor__ abs abs_ absolute absolute_ acos acos_ acosh acosh_ add add_ addbmm addbmm_ addcdiv addcdiv_
addcmul addcmul_ addmm addmm_ addmv addmv_ addr addr_ adjoint align_as align_to all allclose amax
amin aminmax angle any arccos arccos_ arccosh arccosh_ arcsin arcsin_ arcsinh arcsinh_ arctan
arctan2 arctan2_ arctan_ arctanh arctanh_ argmax argmin argsort argwhere asin asin_ asinh asinh_
atan atan2 atan2_ atan_ atanh atanh_ baddbmm baddbmm_ bernoulli bernoulli_ bfloat16 bincount
bitwise_and bitwise_and_ bitwise_left_shift bitwise_left_shift_ bitwise_not bitwise_not_ bitwise_or
bitwise_or_ bitwise_right_shift bitwise_right_shift_ bitwise_xor bitwise_xor_ bmm bool broadcast_to
byte cauchy_ ceil ceil_ cfloat char cholesky cholesky_inverse cholesky_solve chunk clamp clamp_
clamp_max clamp_max_ clamp_min clamp_min_ clip clip_ conj_physical copysign copysign_ corrcoef cos
cos_ cosh cosh_ count_nonzero cov cummax cummin cumprod cumprod_ cumsum cumsum_ deg2rad deg2rad_ det
diag diag_embed diagflat diagonal diagonal_scatter diff digamma digamma_ dist div div_ divide
divide_ dot double dsplit eig eq eq_ equal erf erf_ erfc erfc_ erfinv erfinv_ exp exp2 exp2_ exp_
expand expand_as expm1 expm1_ exponential_ fill_ fill_diagonal_ fix fix_ flatten flip fliplr flipud
float float_power float_power_ floor floor_ floor_divide floor_divide_ fmax fmin fmod fmod_ frac
frac_ frexp gather gcd gcd_ ge ge_ geometric_ geqrf ger greater greater_ greater_equal
greater_equal_ gt gt_ half hardshrink heaviside heaviside_ histc histogram hsplit hypot hypot_ i0
i0_ igamma igamma_ igammac igammac_ index_add index_add_ index_copy index_copy_ index_fill
index_fill_ index_put index_put_ index_select inner int inverse isclose isfinite isinf isnan
isneginf isposinf isreal kron kthvalue lcm lcm_ ldexp ldexp_ le le_ lerp lerp_ less less_ less_equal
less_equal_ lgamma lgamma_ log log10 log10_ log1p log1p_ log2 log2_ log_ log_normal_ log_softmax
logaddexp logaddexp2 logcumsumexp logdet logical_and logical_and_ logical_not logical_not_
logical_or logical_or_ logical_xor logical_xor_ logit logit_ logsumexp long lstsq lt lt_ lu lu_solve
map2_ map_ masked_fill masked_fill_ masked_scatter masked_scatter_ masked_select matmul matrix_exp
matrix_power max maximum mean median min minimum mm mode moveaxis movedim msort mul mul_ multinomial
multiply multiply_ mv mvlgamma mvlgamma_ nan_to_num nan_to_num_ nanmean nanmedian nanquantile nansum
narrow narrow_copy ne ne_ neg neg_ negative negative_ nextafter nextafter_ nonzero norm normal_
not_equal not_equal_ numpy orgqr ormqr outer permute pinverse polygamma polygamma_ pow pow_ prelu
prod put_ q_zero_point qr quantile rad2deg rad2deg_ ravel reciprocal reciprocal_ relu relu_
remainder remainder_ renorm renorm_ repeat repeat_interleave reshape reshape_as resize_ resize_as_
resolve_neg roll rot90 round round_ rsqrt rsqrt_ scatter scatter_ scatter_add scatter_add_ select
sgn sgn_ short sigmoid sigmoid_ sign sign_ signbit sin sin_ sinc sinc_ sinh sinh_ slice_scatter
slogdet smm softmax solve sort split split_with_sizes sqrt sqrt_ square square_ squeeze squeeze_
sspaddmm std stft stride sub sub_ subtract sum sum_to_size svd swapaxes swapdims swapdims_ symeig t
t_ take take_along_dim tan tan_ tanh tanh_ tensor_split tile to topk transpose transpose_
triangular_solve tril tril_ triu triu_ true_divide true_divide_ trunc trunc_ type_as unbind
unflatten unfold unique unique_consecutive unsafe_chunk unsafe_split unsafe_split_with_sizes
unsqueeze unsqueeze_ var vdot view_as vsplit where xlogy xlogy_
""".split()
_SUPPORT_TORCH = """
linalg.norm linalg.vector_norm linalg.matrix_norm linalg.diagonal linalg.det linalg.slogdet
linalg.cond linalg.matrix_rank linalg.qr linalg.lu linalg.lu_factor linalg.svd linalg.svdvals
linalg.solve linalg.lstsq linalg.inv linalg.pinv linalg.matrix_exp linalg.matrix_power linalg.cross
linalg.matmul linalg.vecdot linalg.multi_dot linalg.householder_product linalg.tensorsolve
linalg.vander linalg.cholesky_ex linalg.inv_ex linalg.solve_ex linalg.lu_factor_ex linalg.ldl_factor
linalg.ldl_factor_ex _adaptive_avg_pool2d _add_relu _add_relu_ _aminmax _batch_norm_impl_index
_convolution _foreach_norm _fused_adamw_ _softmax_backward_data abs abs_ absolute acos acos_ acosh
acosh_ adaptive_avg_pool1d adaptive_max_pool1d add addbmm addcdiv addcmul addmm addmv addmv_ addr
affine_grid_generator align_tensors all alpha_dropout alpha_dropout_ amax amin aminmax angle any
arange arccos arccos_ arccosh arccosh_ arcsin arcsin_ arcsinh arcsinh_ arctan arctan2 arctan_
arctanh arctanh_ argmax argmin argsort argwhere asin asin_ asinh asinh_ atan atan2 atan_ atanh
atanh_ atleast_1d atleast_2d atleast_3d avg_pool1d baddbmm bartlett_window batch_norm_backward_elemt
batch_norm_backward_reduce batch_norm_elemt batch_norm_gather_stats
batch_norm_gather_stats_with_counts batch_norm_stats batch_norm_update_stats bernoulli bilinear
binary_cross_entropy_with_logits bincount binomial bitwise_and bitwise_not bitwise_or bitwise_xor
blackman_window block_diag bmm broadcast_tensors broadcast_to bucketize cartesian_prod cat cdist
ceil ceil_ celu celu_ chain_matmul channel_shuffle cholesky cholesky_inverse cholesky_solve
choose_qparams_optimized chunk clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip clip_
clone column_stack combinations concat concatenate constant_pad_nd conv1d conv2d conv3d conv_tbc
conv_transpose1d conv_transpose2d conv_transpose3d convolution copysign cos cos_ cosh cosh_
cosine_embedding_loss cosine_similarity count_nonzero cov cross ctc_loss cummax cummin cumprod
cumsum cumulative_trapezoid deg2rad deg2rad_ det diag diag_embed diagflat diagonal diagonal_scatter
diff digamma dist div divide dot dropout dropout_ dsmm dsplit dstack eig einsum embedding
embedding_bag embedding_renorm_ eq equal erf erf_ erfc erfc_ erfinv exp exp2 exp2_ exp_ expm1 expm1_
eye feature_alpha_dropout feature_alpha_dropout_ feature_dropout feature_dropout_ fill_ fix fix_
flatten flip fliplr flipud float_power floor floor_ floor_divide fmax fmin fmod frac frac_ frexp
frobenius_norm full full_like gather gcd gcd_ ge geqrf ger greater greater_equal grid_sampler
grid_sampler_2d grid_sampler_3d group_norm gru gru_cell gt hamming_window hann_window hardshrink
heaviside hinge_embedding_loss histc histogram histogramdd hsmm hsplit hspmm hstack hypot i0 i0_
igamma igammac index_add index_copy index_fill index_put index_put_ index_select inner instance_norm
inverse isclose isfinite isin isinf isnan isneginf isposinf istft kaiser_window kl_div kron kthvalue
layer_norm lcm lcm_ ldexp ldexp_ le lerp less less_equal lgamma linspace log log10 log10_ log1p
log1p_ log2 log2_ log_ log_softmax logaddexp logaddexp2 logcumsumexp logdet logical_and logical_not
logical_or logical_xor logit logit_ logspace logsumexp lstm lstm_cell lstsq lt lu_solve lu_unpack
margin_ranking_loss masked_fill masked_scatter masked_select matmul matrix_exp matrix_power
matrix_rank max max_pool1d max_pool1d_with_indices max_pool2d max_pool3d maximum mean median min
minimum mm mode moveaxis movedim msort mul multinomial multiply mv mvlgamma nan_to_num nan_to_num_
nanmean nanmedian nanquantile nansum narrow narrow_copy native_batch_norm native_group_norm
native_layer_norm native_norm ne neg neg_ negative negative_ nextafter nonzero norm norm_except_dim
normal not_equal nuclear_norm outer pairwise_distance pdist permute pinverse pixel_shuffle
pixel_unshuffle poisson poisson_nll_loss polar polygamma pow prelu prod qr quantile rad2deg rad2deg_
range ravel real reciprocal reciprocal_ relu relu_ remainder renorm repeat_interleave reshape
resize_as_ resolve_neg roll rot90 round round_ row_stack rrelu rrelu_ rsqrt rsqrt_ rsub saddmm
scalar_tensor scatter scatter_add searchsorted select selu selu_ sgn sigmoid sigmoid_ sign signbit
sin sin_ sinc sinc_ sinh sinh_ slogdet smm softmax solve sort sparse_coo_tensor split
split_with_sizes spmm sqrt sqrt_ square square_ squeeze sspaddmm stack std std_mean stft sub
subtract sum svd swapaxes swapdims symeig t take take_along_dim tan tan_ tanh tanh_ tensor_split
tensordot threshold threshold_ tile topk transpose trapz triangular_solve tril tril_indices
triplet_margin_loss triu triu_indices true_divide trunc trunc_ unbind unflatten unique_consecutive
unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze vander var var_mean vdot vsplit vstack
where xlogy xlogy_
""".split()
# api_risk_level.py: LOW_RISK_API_SET, left out at risk level FOCUS
_LOW_RISK = """
__bool__ align_as align_to arange atleast_1d atleast_2d atleast_3d bfloat16 bool byte cat cfloat
char chunk clamp clone column_stack concat concatenate diag diag_embed diagflat double dsplit dstack
empty empty_like expand expand_as eye flatten float full full_like half hsplit hstack identity int
linspace logspace long moveaxis movedim numpy ones ones_like permute ravel repeat repeat_interleave
reshape reshape_as row_stack split split_with_sizes squeeze stack stride swapaxes swapdims
tensor_split tile to transpose tril tril_indices triu triu_indices type_as unbind unflatten unfold
unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze view view_as vsplit vstack zeros
zeros_like
""".split()
# api_risk_level.py: CORE_API_SET, less the names it adds from the yaml's torch_npu and distributed
# sections (_WHOLE_SECTIONS). As msprobe 26.2 has it: a missing comma joins chain_matmul and linear
# into one name, so F.linear is not a core api there.
_CORE = """
__matmul__ _batch_norm_impl_index _convolution _fused_adam_ _fused_adamw_ addbmm addbmm_ addmm
addmm_ addmv addmv_ addr addr_ baddbmm baddbmm_ batch_norm batch_norm_backward_elemt
batch_norm_backward_reduce batch_norm_elemt batch_norm_gather_stats
batch_norm_gather_stats_with_counts batch_norm_stats batch_norm_update_stats bilinear bmm
chain_matmullinear conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
convolution embedding embedding_bag group_norm instance_norm layer_norm linalg.matmul
linalg.multi_dot linalg.vecdot local_response_norm matmul mm multi_head_attention_forward mv
scaled_dot_product_attention
""".split()


# Prefixes of ops msprobe lists in sections npukit checks as a whole: torch_npu's fused ops (NPU.*)
# and torch.distributed's (Distributed.*): in its support list and all of risk level CORE.
_WHOLE_SECTIONS = ("NPU", "Distributed")
_SUPPORT = {"Functional": frozenset(_SUPPORT_FUNCTIONAL), "Tensor": frozenset(_SUPPORT_TENSOR),
            "Torch": frozenset(_SUPPORT_TORCH)}


def check_op_set(ops: str, option: str = "--dump-ops") -> str:
    if ops not in OP_SETS:
        raise UserError(f"{option}: {ops!r} is not one of {', '.join(OP_SETS)}")
    return ops


@cache
def api_recorded(ops: str, api: str) -> bool:
    """Whether the op set `ops` records `api` ("Tensor.view", "Functional.conv2d", "NPU.npu_rms_norm"),
    as msprobe decides it: in its support list, then by the bare name's risk level."""
    if ops == "all":
        return True
    prefix, _, bare = api.partition(".")
    if prefix in _WHOLE_SECTIONS:
        return True
    listed = _SUPPORT.get(prefix)
    if listed is None or bare not in listed:
        per_tensor = foreach_op(api)
        # A foreach op msprobe does not hook (it hooks torch._foreach_norm only) is recorded where the
        # op it applies to each tensor is: an optimizer's torch._foreach_add_ as the per-tensor
        # optimizer's Tensor.add_ (npukit's addition: the update the default, foreach, optimizer makes)
        return per_tensor is not None and api_recorded(ops, f"Tensor.{per_tensor}")
    if ops == "core":
        return bare in _CORE
    if ops == "focus":
        return bare not in _LOW_RISK
    return True


# ---------------------------------------------------------------------------- config.json
_TASK_MODES = {"statistics": "stats", "tensor": "tensor"}
_LEVELS = {"L0": "module", "L1": "api", "mix": "mix"}
_RISK_LEVELS = {"FOCUS": "focus", "CORE": "core", "ALL": "msprobe-all"}


@dataclass(frozen=True)
class DumpConfig:
    """DumpSession's options from an msprobe config.json."""

    dump_path: Path | None
    level: str
    mode: str
    steps: str | None
    ranks: str | None
    scope: str | None
    names: str | None
    ops: str
    stack: bool

    def session_options(self) -> dict:
        return {"level": self.level, "mode": self.mode, "steps": self.steps, "ranks": self.ranks,
                "scope": self.scope, "names": self.names, "ops": self.ops, "stack": self.stack}


def read_config_object(path: Path, option: str) -> dict:
    """The JSON object an msprobe config.json holds (the dump's, the monitor's); a file that cannot
    be read, is not JSON or holds no object raises a UserError naming the option, file and line."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{option}: {path}, line {exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise UserError(f"{option}: {path}: an msprobe config.json is a JSON object, not {type(config).__name__}")
    return config


def load_dump_config(path: Path) -> DumpConfig:
    """Read msprobe's config.json (task, level, step, rank, the task's scope and list, risk_level,
    extra_info ...). What npukit cannot do as msprobe would raises a UserError naming the key and value."""
    reader = _ConfigReader(Path(path), read_config_object(path, "--dump-config"))
    return reader.read()


class _ConfigReader:
    def __init__(self, path: Path, config: dict) -> None:
        self.path = path
        self.config = config

    def fail(self, key: str, value, why: str):
        raise UserError(f"--dump-config {self.path}: \"{key}\": {json.dumps(value)}: {why}")

    def read(self) -> DumpConfig:
        config = self.config
        task = config.get("task") or "statistics"
        if task not in _TASK_MODES:
            self.fail("task", task, "npukit dumps tasks statistics and tensor (for overflow checks: npu-run "
                      "--detect-overflow)")
        level = config.get("level") or "L1"
        if level not in _LEVELS:
            self.fail("level", level, "npukit dumps levels L0 (modules), L1 (apis) and mix (both), not kernels")
        risk_level = config.get("risk_level") or "FOCUS"
        if risk_level not in _RISK_LEVELS:
            self.fail("risk_level", risk_level, f"not one of {', '.join(_RISK_LEVELS)}")
        for key, honoured in (("dump_enable", None), ("load", None)):
            if config.get(key) is not honoured:
                self.fail(key, config[key], "not supported by npukit's dump (it dumps from start to end of the run)")
        namespaces = config.get("custom_op_namespaces")
        if namespaces not in (None, [], ["_C_ascend"]):
            self.fail("custom_op_namespaces", namespaces, "npukit records torch_npu's ops (torch.ops.npu) only")
        for key in ("extra_info", "async_dump"):
            if not isinstance(config.get(key, True), bool):
                self.fail(key, config[key], "should be true or false")
        if config.get("precision", "low") not in ("low", "high"):
            # npukit sums statistics in double: what "high" asks for, and more than "low" needs
            self.fail("precision", config["precision"], "not one of low, high")
        section = config.get(task) or {}
        if not isinstance(section, dict):
            self.fail(task, section, "should be an object with scope, list ...")
        mode = _TASK_MODES[task]
        summary = section.get("summary_mode") or "statistics"
        if task == "statistics" and summary not in ("statistics", "md5"):
            self.fail(f"{task}.summary_mode", summary, "npukit writes statistics or md5 (a CRC32, as msprobe's)")
        if summary == "md5":
            mode = "md5"
        if section.get("data_mode") not in (None, [], ["all"]):
            self.fail(f"{task}.data_mode", section["data_mode"], "npukit dumps every input and output, forward "
                      "and backward (data_mode [\"all\"])")
        for key in ("slice", "request_id", "tensor_list", "bench_path"):
            if section.get(key):
                self.fail(f"{task}.{key}", section[key], "not supported by npukit's dump")
        names = self._names(task, section.get("list"))
        scope = self._scope(task, section.get("scope"))
        dump_path = config.get("dump_path")
        if dump_path is not None and not isinstance(dump_path, str):
            self.fail("dump_path", dump_path, "should be a string")
        return DumpConfig(
            dump_path=Path(dump_path) if dump_path else None, level=_LEVELS[level], mode=mode,
            steps=self._numbers("step"), ranks=self._numbers("rank"), scope=scope, names=names,
            # msprobe: a scope or a list decides what is recorded, its risk level only otherwise
            ops="msprobe-all" if scope or names else _RISK_LEVELS[risk_level],
            stack=config.get("extra_info", True))

    def _numbers(self, key: str) -> str | None:
        """msprobe's step/rank list ([0, 2, "4-6"]) as npukit's spec ("0,2,4-6"); [] means all."""
        values = self.config.get(key)
        if values in (None, []):
            return None
        if not isinstance(values, list):
            self.fail(key, values, "should be a list of integers or \"a-b\" ranges")
        parts = []
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int | str) \
                    or (isinstance(value, int) and value < 0):
                self.fail(key, value, "an element should be an integer >= 0 or an \"a-b\" range")
            parts.append(str(value).strip())
        return ",".join(parts)

    def _names(self, task: str, names) -> str | None:
        if names in (None, []):
            return None
        if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
            self.fail(f"{task}.list", names, "should be a list of names")
        for name in names:
            if name.startswith("name-regex("):
                self.fail(f"{task}.list", name, "regular expressions are not supported by npukit's dump: "
                          "list the names (whole dotted components: \"Functional.conv2d\", \"layer1.0\")")
            if "," in name:
                self.fail(f"{task}.list", name, "a name with a comma")
        return ",".join(names)

    def _scope(self, task: str, scope) -> str | None:
        """msprobe's scope is a range [first, last] of full entry names. npukit dumps a module's
        subtree: a range that starts and ends at one module call (its forward entry twice)."""
        if scope in (None, []):
            return None
        key = f"{task}.scope"
        if not isinstance(scope, list) or len(scope) != 2 or not all(isinstance(name, str) for name in scope):
            self.fail(key, scope, "should be two full entry names, [first, last]")
        from npukit.accuracy import naming

        paths = [naming.module_path_of(name) for name in scope]
        if paths[0] is None or paths[0] != paths[1] or not all(".forward." in name for name in scope):
            self.fail(key, scope, "npukit dumps whole modules: give one module call's forward entry as both "
                      "ends ([\"Module.blocks.0.Block.forward.0\", \"Module.blocks.0.Block.forward.0\"]), or "
                      "--dump-scope with module paths; a range between two entries is not supported")
        if not paths[0]:
            return None  # the root module: everything
        return paths[0]
