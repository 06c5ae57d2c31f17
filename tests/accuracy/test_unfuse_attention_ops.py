"""The precision fix `unfuse` for npu_fusion_attention_v2 and the inference attention ops
(npu_prompt_flash_attention, npu_incre_flash_attention, npu_fused_infer_attention_score and _v2): each
decomposition equals the golden kernel (the emulator's op on CPU tensors, its reference numerics) in
fp32 and fp64 (fp16 within its rounding), and the code the fix prints, the user's line with the call
replaced and the functions it calls, runs as printed and computes the same."""

from __future__ import annotations

import pytest
import torch

from npukit.accuracy import unfuse
from npukit.accuracy.fixes import FixChange

COMPRESSED = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3}


def _ops():
    import npukit.npu_backend.fused as fused

    fused.load()
    return torch.ops.npu


def _tensor(layout, b, n, s, d, dtype, grad=False):
    x = torch.randn(b, n, s, d, dtype=torch.float64)
    x = {"BNSD": x, "BNSD_BSND": x, "BSND": x.transpose(1, 2), "BSH": x.transpose(1, 2).flatten(2),
         "SBH": x.permute(2, 0, 1, 3).flatten(2)}[layout]
    return x.contiguous().to(dtype).requires_grad_(grad)


def _error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1.0)


def _assert_equal(fused, unfused, dtype, what):
    assert fused.shape == unfused.shape and fused.dtype == unfused.dtype, (what, fused.shape, unfused.shape)
    assert _error(fused, unfused) <= TOLERANCE[dtype], (what, dtype, _error(fused, unfused))


V2_CASES = {  # layout, sparse_mode, mask, options
    "pse_type 0, no mask": ("BSND", 0, None, {"pse_type": 0}),
    "pse_type 1, band": ("BSH", 0, "random", {"pse_type": 1, "pre_tokens": 3, "next_tokens": 1}),
    "pse_type 0, all": ("SBH", 1, "random", {"pse_type": 0}),
    "pse_type 0, causal": ("BNSD", 2, "compressed", {"pse_type": 0}),
    "pse_type 1, right-down": ("BSND", 3, "compressed", {"pse_type": 1}),
    "pse_type 0, bottom-right band": ("BNSD", 4, "compressed", {"pse_type": 0, "pre_tokens": 2, "next_tokens": 0}),
}


@pytest.mark.parametrize("case", list(V2_CASES))
def test_fusion_attention_v2_unfused_equals_the_golden_kernel_forward_and_backward(case):
    """GQA (4 query heads over 2), a pse added after the scale (pse_type 0, xformers' bias as the
    codemod passes it) or inside it (1), each sparse mode the decomposition covers."""
    op = _ops().npu_fusion_attention_v2
    layout, sparse_mode, kind, options = V2_CASES[case]
    torch.manual_seed(0)
    atten_mask = {"random": torch.rand(2, 1, 5, 7) > 0.7, "compressed": COMPRESSED, None: None}[kind]
    for dtype in (torch.float64, torch.float32, torch.float16):
        if kind == "random":  # a row with every key masked: zeros, no gradient (in fp64 too: the
            atten_mask[0, 0, 1] = True  # kernel's fp64 backward gave NaN there)
        inputs = [_tensor(layout, 2, heads, s, 8, dtype, grad=True) for heads, s in ((4, 5), (2, 7), (2, 7))]
        pse = torch.randn(2, 4, 5, 7, dtype=dtype)
        results = []
        for function in (op, unfuse.npu_fusion_attention_v2_unfused):
            out = function(*inputs, 4, layout, pse=pse, atten_mask=atten_mask, scale=0.3, sparse_mode=sparse_mode,
                           **options)
            results.append((out, torch.autograd.grad(out[0], inputs, torch.ones_like(out[0]))))
        (fused, fused_grads), (unfused, unfused_grads) = results
        assert fused[4:] == unfused[4:] and fused[3].shape == unfused[3].shape
        for index, what in enumerate(("out", "softmax_max", "softmax_sum")):
            _assert_equal(fused[index], unfused[index], dtype, what)
        for name, a, b in zip(("dq", "dk", "dv"), fused_grads, unfused_grads):
            # (the kernel's backward recomputes the probabilities from its fp32 softmax_max/sum: fp64
            # gradients agree to fp32's precision)
            _assert_equal(a, b, torch.float32 if dtype == torch.float64 else dtype, name)


INFER_CASES = {  # op, dtype-independent keyword arguments (tensors built per dtype), query/key sequences
    "prompt, BSH, no mask": ("npu_prompt_flash_attention", "BSH", 5, 7, {}),
    "prompt, causal band by default, padded mask cut": (
        "npu_prompt_flash_attention", "BNSD", 5, 5, {"atten_mask": "random 2d wide"}),
    "prompt, sparse 3, GQA, pse_shift cut, BNSD_BSND": (
        "npu_prompt_flash_attention", "BNSD_BSND", 5, 7,
        {"atten_mask": "compressed", "sparse_mode": 3, "num_key_value_heads": 2, "pse_shift": "wide"}),
    "prompt, sparse 4 band, per-batch lengths": (
        "npu_prompt_flash_attention", "BSND", 5, 7,
        {"atten_mask": "compressed", "sparse_mode": 4, "pre_tokens": 2, "next_tokens": 1,
         "actual_seq_lengths": [5, 3], "actual_seq_lengths_kv": [7, 4]}),
    "incre, BSH, kv lengths, [B, Skv] mask, pse_shift": (
        "npu_incre_flash_attention", "BSH", 1, 7,
        {"atten_mask": "per batch", "actual_seq_lengths": [7, 5], "pse_shift": "exact"}),
    "incre, BNSD, GQA": ("npu_incre_flash_attention", "BNSD", 1, 6, {"num_key_value_heads": 2}),
    "fused infer, prompt branch, softmax_lse": (
        "npu_fused_infer_attention_score", "BSND", 5, 7,
        {"atten_mask": "random 4d", "sparse_mode": 1, "softmax_lse_flag": True, "actual_seq_lengths_kv": [6]}),
    "fused infer, one token: the incremental branch ignores the sparse mode and band": (
        "npu_fused_infer_attention_score", "BNSD", 1, 7,
        {"atten_mask": "per batch", "sparse_mode": 1, "pre_tokens": 0, "next_tokens": 0, "softmax_lse_flag": True,
         "actual_seq_lengths": [1]}),
    "fused infer, MLA rope parts": (
        "npu_fused_infer_attention_score", "BNSD", 3, 7, {"rope": True, "softmax_lse_flag": True}),
}


def _infer_kwargs(options: dict, dtype, b, n, sq, skv) -> dict:
    kwargs = {name: value for name, value in options.items() if name != "rope"}
    mask = kwargs.get("atten_mask")
    if mask is not None:
        kwargs["atten_mask"] = {
            "compressed": COMPRESSED,
            "random 2d wide": torch.rand(sq + 3, skv + 2) > 0.7,  # longer than the sequences: cut
            "random 4d": torch.rand(b, 1, sq, skv) > 0.7,
            "per batch": torch.rand(b, skv) > 0.7,
        }[mask]
        if mask == "random 4d":
            kwargs["atten_mask"][0, 0, 1] = True  # a row with every key masked: zeros
    if "pse_shift" in kwargs:
        wide = kwargs["pse_shift"] == "wide"
        kwargs["pse_shift"] = torch.randn(1 if wide else b, n, sq + 2 * wide, skv + 3 * wide, dtype=dtype)
    scale = "scale" if options is not None and "softmax_lse_flag" in options or "rope" in options else "scale_value"
    kwargs[scale] = 0.35
    return kwargs


@pytest.mark.parametrize("case", list(INFER_CASES))
def test_inference_attention_unfused_equals_the_golden_kernel(case):
    """Each inference op's decomposition against the emulator's kernel: layouts, masks cut to the
    sequences, sparse modes, per-batch lengths, pse_shift, GQA, the incremental branch, MLA rope."""
    name, layout, sq, skv, options = INFER_CASES[case]
    op, function = getattr(_ops(), name), unfuse.DECOMPOSITIONS[f"NPU.{name}"]
    torch.manual_seed(0)
    b, n = 2, 4
    kv_heads = options.get("num_key_value_heads", n)
    for dtype in (torch.float32, torch.float16):  # (the inference kernels take no fp64)
        q = _tensor(layout, b, n, sq, 8, dtype)
        k, v = (_tensor(layout, b, kv_heads, skv, 8, dtype) for _ in range(2))
        kwargs = _infer_kwargs(options, dtype, b, n, sq, skv)
        kwargs["num_heads"] = n
        kwargs["input_layout"] = layout
        if options.get("rope"):
            kwargs["query_rope"] = _tensor(layout, b, n, sq, 4, dtype)
            kwargs["key_rope"] = _tensor(layout, b, kv_heads, skv, 4, dtype)
        fused, unfused = op(q, k, v, **kwargs), function(q, k, v, **kwargs)
        if name == "npu_fused_infer_attention_score":
            _assert_equal(fused[1], unfused[1], dtype, "softmax_lse")
            fused, unfused = fused[0], unfused[0]
        _assert_equal(fused, unfused, dtype, "attention_out")


# v1's keyword arguments under v2's names
V2_NAMES = {"num_heads": "num_query_heads", "scale": "softmax_scale", "softmax_lse_flag": "return_softmax_lse",
            "actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen"}


@pytest.mark.parametrize("case", [case for case in INFER_CASES if INFER_CASES[case][0] == "npu_fused_infer_attention_score"])
def test_fused_infer_attention_score_v2_unfused_equals_the_golden_kernel(case):
    """v2 is v1 under other names: v1's cases (both branches, masks, lengths, MLA rope) through v2's op
    and v2's decomposition, with GQA (4 query heads over 2)."""
    _, layout, sq, skv, options = INFER_CASES[case]
    torch.manual_seed(0)
    b, n, kv_heads = 2, 4, 2
    for dtype in (torch.float32, torch.float16):
        q = _tensor(layout, b, n, sq, 8, dtype)
        k, v = (_tensor(layout, b, kv_heads, skv, 8, dtype) for _ in range(2))
        kwargs = {V2_NAMES.get(name, name): value for name, value in _infer_kwargs(options, dtype, b, n, sq, skv).items()}
        kwargs.update(num_query_heads=n, num_key_value_heads=kv_heads, input_layout=layout)
        if options.get("rope"):
            kwargs["query_rope"] = _tensor(layout, b, n, sq, 4, dtype)
            kwargs["key_rope"] = _tensor(layout, b, kv_heads, skv, 4, dtype)
        fused = _ops().npu_fused_infer_attention_score_v2(q, k, v, **kwargs)
        unfused = unfuse.DECOMPOSITIONS["NPU.npu_fused_infer_attention_score_v2"](q, k, v, **kwargs)
        _assert_equal(fused[1], unfused[1], dtype, "softmax_lse")
        _assert_equal(fused[0], unfused[0], dtype, "attention_out")


def test_fused_infer_attention_score_without_the_lse_flag_returns_its_placeholder():
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    out, lse = unfuse.npu_fused_infer_attention_score_unfused(q, k, v, num_heads=2, input_layout="BNSD")
    fused_lse = _ops().npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD")[1]
    assert lse.shape == fused_lse.shape == (1,) and lse.dtype == fused_lse.dtype == torch.float32


USER_LINES = {  # the user's line (q, k, v in the namespace), its inputs' layout and sequences
    "NPU.npu_fusion_attention_v2": (
        "out = torch_npu.npu_fusion_attention_v2(q, k, v, 2, 'BNSD', pse=bias, scale=0.5, pse_type=0)[0]", 4, 4),
    "NPU.npu_prompt_flash_attention": (
        "out = torch.ops.npu.npu_prompt_flash_attention.default(q, k, v, num_heads=2, input_layout='BNSD', "
        "scale_value=0.5)", 4, 4),
    "NPU.npu_incre_flash_attention": (
        "out = npu_incre_flash_attention(q, k, v, num_heads=2, input_layout='BNSD', scale_value=0.5)", 1, 6),
    "NPU.npu_fused_infer_attention_score": (
        "out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout='BNSD', "
        "scale=0.5, softmax_lse_flag=True)", 3, 6),
    "NPU.npu_fused_infer_attention_score_v2": (
        "out, lse = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2, input_layout='BNSD', "
        "softmax_scale=0.5, return_softmax_lse=True)", 3, 6),
}


@pytest.mark.parametrize("api", list(USER_LINES))
def test_the_printed_code_replaces_the_call_at_the_users_line_and_runs_as_printed(api):
    """The fix's code for a call: the note shows the user's line calling the decomposition; that line
    and the printed definitions, run in a namespace holding only torch and the user's tensors, compute
    what the fused op computes."""
    line, sq, skv = USER_LINES[api]
    code = unfuse.code([FixChange("unfuse", api, "attn", "model.py:12", line)])
    function = unfuse.DECOMPOSITIONS[api].__name__
    replaced = unfuse.call_replaced(line, api)
    assert replaced is not None and f"= {function}(q, k, v" in replaced
    assert f"#   {replaced}" in code.splitlines() and "at model.py:12 call" in code
    definitions = "\n".join(text for text in code.splitlines() if not text.startswith("#"))
    assert definitions.count(f"def {function}(") == 1 and definitions.startswith("import torch\n")
    torch.manual_seed(0)
    q = torch.randn(1, 2, sq, 8)
    k, v = torch.randn(1, 2, skv, 8), torch.randn(1, 2, skv, 8)
    bias = torch.randn(1, 2, sq, skv)
    namespace = {"__builtins__": __builtins__, "q": q, "k": k, "v": v, "bias": bias}
    exec(definitions + "\n" + replaced, namespace)  # noqa: S102 - the printed code, as the user pastes it
    expected = {"NPU.npu_fusion_attention_v2": lambda: _ops().npu_fusion_attention_v2(
                    q, k, v, 2, "BNSD", pse=bias, scale=0.5, pse_type=0)[0],
                "NPU.npu_prompt_flash_attention": lambda: _ops().npu_prompt_flash_attention(
                    q, k, v, num_heads=2, input_layout="BNSD", scale_value=0.5),
                "NPU.npu_incre_flash_attention": lambda: _ops().npu_incre_flash_attention(
                    q, k, v, num_heads=2, input_layout="BNSD", scale_value=0.5),
                "NPU.npu_fused_infer_attention_score": lambda: _ops().npu_fused_infer_attention_score(
                    q, k, v, num_heads=2, input_layout="BNSD", scale=0.5, softmax_lse_flag=True)[0],
                "NPU.npu_fused_infer_attention_score_v2": lambda: _ops().npu_fused_infer_attention_score_v2(
                    q, k, v, num_query_heads=2, input_layout="BNSD", softmax_scale=0.5,
                    return_softmax_lse=True)[0]}[api]()
    _assert_equal(expected, namespace["out"], torch.float32, api)


def test_one_printed_fix_for_two_ops_defines_each_shared_function_once():
    code = unfuse.code([FixChange("unfuse", "NPU.npu_fusion_attention", "a", "m.py:3", "o = npu_fusion_attention(x)"),
                        FixChange("unfuse", "NPU.npu_prompt_flash_attention", "b", "m.py:9",
                                  "o = torch_npu.npu_prompt_flash_attention(x)")])
    assert code.count("import torch\n") == 1 and code.count("def attention_unfused(") == 1
    namespace = {"__builtins__": __builtins__}
    exec(code, namespace)  # noqa: S102
    assert {"npu_fusion_attention_unfused", "npu_prompt_flash_attention_unfused"} <= set(namespace)


@pytest.mark.parametrize(("api", "call", "refused"), [
    ("NPU.npu_fusion_attention_v2", lambda f, q: f(q, q, q, 2, "BNSD", pse_type=2, keep_prob=0.9),
     r"npu_fusion_attention_v2_unfused does not compute keep_prob 0.9 \(dropout\), pse_type 2"),
    ("NPU.npu_prompt_flash_attention", lambda f, q: f(q, q, q, num_heads=2, input_layout="TND",
                                                      quant_scale1=q), "input_layout TND, quant_scale1"),
    ("NPU.npu_incre_flash_attention", lambda f, q: f(q, q, q, num_heads=2, block_table=q),
     r"block_table \(paged KV cache\)"),
    ("NPU.npu_fused_infer_attention_score", lambda f, q: f(q, q, q, num_heads=2, sparse_mode=9, antiquant_scale=q),
     "sparse_mode 9, antiquant_scale"),
    ("NPU.npu_fused_infer_attention_score_v2",
     lambda f, q: f(q, q, q, num_query_heads=2, input_layout="TND", learnable_sink=q[0, :, 0, 0], key_quant_mode=1),
     "input_layout TND, learnable_sink, key_quant_mode=1"),
])
def test_what_a_decomposition_does_not_compute_is_refused_naming_it(api, call, refused):
    """The fix finder's accepts() and --precision-fix rely on this refusal: such a call keeps its fused op."""
    with pytest.raises(ValueError, match=refused + ": keep the fused call"):
        call(unfuse.DECOMPOSITIONS[api], torch.randn(1, 2, 3, 8))


@pytest.mark.parametrize(("api", "args", "kwargs", "accepted"), [
    ("NPU.npu_fusion_attention_v2", [2, "BSH"], {"scale": 0.25, "pse_type": 0}, True),
    ("NPU.npu_fusion_attention_v2", [2, "BSH"], {"keep_prob": 0.9}, False),  # dropout: not the kernel's mask
    ("NPU.npu_prompt_flash_attention", [], {"num_heads": 2, "input_layout": "BSH", "scale_value": 0.25}, True),
    ("NPU.npu_prompt_flash_attention", [], {"num_heads": 2, "input_layout": "TND"}, False),
    ("NPU.npu_incre_flash_attention", [], {"num_heads": 2, "input_layout": "BSH"}, True),
    ("NPU.npu_fused_infer_attention_score", [], {"num_heads": 2, "input_layout": "BSH", "sparse_mode": 9}, False),
    ("NPU.npu_fused_infer_attention_score_v2", [], {"num_query_heads": 2, "input_layout": "BSH"}, True),
    ("NPU.npu_fused_infer_attention_score_v2", [], {"num_query_heads": 2, "input_layout": "TND"}, False),
])
def test_a_recorded_call_is_accepted_when_the_decomposition_computes_it(api, args, kwargs, accepted):
    """What the fix finder asks before proposing to unfuse a call the dump recorded."""
    from npukit.accuracy.dumpfile import TensorLeaf

    name = f"{api}.0.forward"
    tensor = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": [2, 8, 16]}
    body = {"input_args": [tensor, tensor, tensor, *({"type": type(value).__name__, "value": value} for value in args)],
            "input_kwargs": {key: {"type": type(value).__name__, "value": value} for key, value in kwargs.items()}}
    leaves = [TensorLeaf(f"{name}.input.{i}", "torch.float16", (2, 8, 16), None, None, None, True, None, None, None,
                         f"input.{i}") for i in range(3)]
    assert unfuse.accepts(name, body, leaves) is accepted


PRECISION_FIX_CALLS = {  # the fused call as a model makes it (npu tensors q, k, v, bias)
    "NPU.npu_fusion_attention_v2": lambda ops, q, k, v, bias: ops.npu_fusion_attention_v2(
        q, k, v, 2, "BNSD", pse=bias, scale=0.5, pse_type=0)[0],
    "NPU.npu_prompt_flash_attention": lambda ops, q, k, v, bias: ops.npu_prompt_flash_attention(
        q, k, v, pse_shift=bias, num_heads=2, input_layout="BNSD", scale_value=0.5),
    "NPU.npu_fused_infer_attention_score": lambda ops, q, k, v, bias: ops.npu_fused_infer_attention_score(
        q, k, v, pse_shift=bias, num_heads=2, input_layout="BNSD", scale=0.5)[0],
    "NPU.npu_fused_infer_attention_score_v2": lambda ops, q, k, v, bias: ops.npu_fused_infer_attention_score_v2(
        q, k, v, pse_shift=bias, num_query_heads=2, input_layout="BNSD", softmax_scale=0.5)[0],
}


@pytest.mark.parametrize("api", list(PRECISION_FIX_CALLS))
def test_precision_fix_computes_the_call_by_its_decomposition(npu, api):
    """npu-run --precision-fix with an unfuse change of these ops: the call on the emulated NPU returns
    what the decomposition computes (fp16: the fused kernel's own roundings are gone)."""
    from npukit.accuracy.fixes import PrecisionFix, PrecisionFixSession

    ops, call = _ops(), PRECISION_FIX_CALLS[api]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, device=npu).half() for _ in range(3))
    bias = torch.randn(1, 2, 64, 64, device=npu).half()
    fused = call(ops, q, k, v, bias)
    with PrecisionFixSession(PrecisionFix([FixChange("unfuse", api)])):
        fixed = call(ops, q, k, v, bias)
    expected = call(_Decompositions(), q, k, v, bias)
    assert torch.equal(fixed, expected) and not torch.equal(fixed, fused)


class _Decompositions:
    """The decompositions under the ops' names, for the calls above."""

    def __getattr__(self, name):
        return unfuse.DECOMPOSITIONS[f"NPU.{name}"]
