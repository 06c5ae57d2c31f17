"""Fused torch_npu ops by their unfused decompositions in plain torch: the precision fix `unfuse`.

A fused kernel rounds where its reference does not: npu_fusion_attention keeps its softmax
probabilities in the input dtype for the P @ V matmul, so over a long fp16 row the many small
probabilities below fp16's smallest subnormal (2**-25) are lost together. The fix computes that
call by the same math written with torch's own ops, in fp32, rounded once to the output dtype:
what the golden run computes (the emulator's fused kernels with the device's numerics off,
npukit/npu_backend/fused). `npu-run --precision-fix` runs the function below in place of the call,
and the fix finder prints that same function's source for the user to paste: the functions in
DECOMPOSITIONS use nothing but torch (a test runs their source in a namespace holding only torch).

The decomposition calls torch's functions (`torch.matmul`, `torch.mul`), not Tensor operators: a dump
of the patched code records them in place of the fused op, and the compare, aligning the two op
streams by name, then does not pair them with the user's own `*` or `+` after the call.

`accepts()` says whether a call the dump recorded is one the decomposition computes, by running it
on fake tensors of the recorded shapes: the function's own checks are the only list of what it
covers.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import torch


def npu_fusion_attention_unfused(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                                 atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                                 next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                                 actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                                 softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    """torch_npu.npu_fusion_attention unfused: per head softmax(scale * (q @ k^T + pse), masked) @ v in
    fp32 (a key/value head serves head_num / its count query heads), the output rounded once to the
    input dtype. Returns what the fused op returns: (attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels). Layouts BSH, SBH, BSND, BNSD; sparse_mode 0-4; no dropout."""
    layout = input_layout.upper()
    refused = [what for what, given in (
        (f"input_layout {input_layout}", layout not in ("BSH", "SBH", "BSND", "BNSD")),
        (f"keep_prob {keep_prob} (dropout)", keep_prob != 1), (f"sparse_mode {sparse_mode}", sparse_mode not in range(5)),
        ("padding_mask", padding_mask is not None), ("prefix", prefix is not None),
        ("actual_seq_qlen", actual_seq_qlen is not None), ("actual_seq_kvlen", actual_seq_kvlen is not None),
        ("sink", sink is not None), ("dropout_mask", dropout_mask is not None)) if given]
    if refused:
        raise ValueError(f"npu_fusion_attention_unfused does not compute {', '.join(refused)}: keep the fused call")
    def to_bnsd(x, heads):  # [B, N, S, D]
        if layout == "BNSD":
            return x
        if layout == "BSND":
            return x.transpose(1, 2)
        x = x.unflatten(2, (heads, -1))
        return x.transpose(1, 2) if layout == "BSH" else x.permute(1, 2, 0, 3)
    if layout in ("BSH", "SBH"):
        kv_heads = key.shape[2] // (query.shape[2] // head_num)
    else:
        kv_heads = key.shape[1 if layout == "BNSD" else 2]
    with torch.autocast(query.device.type, enabled=False):
        q = to_bnsd(query, head_num).float()
        k = to_bnsd(key, kv_heads).float().repeat_interleave(head_num // kv_heads, 1)
        v = to_bnsd(value, kv_heads).float().repeat_interleave(head_num // kv_heads, 1)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if pse is not None:
            scores = torch.add(scores, pse.float())
        scores = torch.mul(scores, scale)
        masked = None
        if atten_mask is not None:  # True = masked out; without a mask every mode computes everything
            sq, skv = scores.shape[-2], scores.shape[-1]
            diff = torch.arange(skv, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None]
            if sparse_mode in (0, 1):
                masked = atten_mask.bool()
                if sparse_mode == 0:  # the band -pre_tockens <= j - i <= next_tockens, top-left origin
                    masked = masked | (diff < -pre_tockens) | (diff > next_tockens)
            elif sparse_mode == 2:
                masked = diff > 0
            elif sparse_mode == 3:
                masked = diff > skv - sq
            else:  # 4: the band around the bottom-right diagonal
                masked = (diff - (skv - sq) < -pre_tockens) | (diff - (skv - sq) > next_tockens)
            scores = torch.masked_fill(scores, masked, -1e30)
        probs = torch.softmax(scores, -1)
        out = torch.matmul(probs, v)
        if masked is not None:  # a row whose every key is masked gives zeros
            out = torch.masked_fill(out, masked.all(-1, keepdim=True), 0.0)
        # the softmax's row max and its sum of exp(score - max): the largest probability is 1 / that sum
        row_max = torch.amax(scores, -1, keepdim=True)
        row_sum = torch.reciprocal(torch.amax(probs, -1, keepdim=True))
    out = out.to(query.dtype)
    if layout == "BSND":
        out = out.transpose(1, 2)
    elif layout == "BSH":
        out = out.transpose(1, 2).flatten(2)
    elif layout == "SBH":
        out = out.permute(2, 0, 1, 3).flatten(2)
    b, n, sq, skv = scores.shape
    return (out.contiguous(), row_max.expand(b, n, sq, 8).contiguous(), row_sum.expand(b, n, sq, 8).contiguous(),
            query.new_empty(0), 0, 0, b * n * sq * skv)


# The fused ops (as dumps name them) that the unfuse fix computes by their decomposition.
DECOMPOSITIONS = {"NPU.npu_fusion_attention": npu_fusion_attention_unfused}


def decomposition(api: str):
    return DECOMPOSITIONS.get(api)


def source(api: str) -> str:
    """The decomposition's source as printed for the user: `import torch` and the function."""
    return "import torch\n\n\n" + inspect.getsource(DECOMPOSITIONS[api])


def call_replaced(line: str, api: str) -> str | None:
    """The user's line with the fused call (`torch_npu.npu_fusion_attention(`, `torch.ops.npu.X.default(`,
    a bare imported name) calling the decomposition instead; None when the line does not name it."""
    name = api.removeprefix("NPU.")
    call = re.compile(rf"(?<![\w.])(?:[A-Za-z_][\w.]*\.)?{re.escape(name)}(?:\.default)?(?=\s*\()")
    replaced, count = call.subn(DECOMPOSITIONS[api].__name__, line)
    return replaced if count == 1 else None


def check_api(api: str, where: str) -> None:
    """A UserError unless `api` is a fused op with a decomposition."""
    if api not in DECOMPOSITIONS:
        from npukit.errors import UserError

        raise UserError(f"{where}: unfuse {api or '(no api)'}: no decomposition of that op (unfuse takes "
                        f"{', '.join(DECOMPOSITIONS)})")


def run(change, args, kwargs):
    """The call `change` (a FixChange of kind unfuse) names, computed by its op's decomposition."""
    from npukit.errors import UserError

    check_api(change.api, "--precision-fix")
    try:
        return DECOMPOSITIONS[change.api](*args, **kwargs)
    except ValueError as exc:  # an option the decomposition does not cover
        raise UserError(f"--precision-fix: {change.describe()}: {exc}") from None


def code(changes) -> str:
    """The unfuse changes as code to paste: for each call site the line to write there (the call
    replaced), then each op's decomposition in full, once. Changes at one line in several modules
    (blocks 6 and 7 of a model whose blocks share that line) are one edit: the line then computes
    unfused in every module that runs it, more than the fix needs and no less precise."""
    sites: dict[tuple, list] = {}
    for change in changes:
        sites.setdefault((change.api, change.line, change.source), []).append(change)
    notes, apis = [], []
    for (api, line, line_source), group in sites.items():
        function = DECOMPOSITIONS[api].__name__
        replaced = call_replaced(line_source, api) if line_source else None
        what = "; ".join(change.describe(False) for change in group)
        notes.append(f"# {what}: at {line or 'its line'} call {function} (defined below:\n"
                     f"# put it in that file) in place of the fused op, as\n"
                     f"#   {replaced or f'{function}(<the arguments of the fused call>)'}")
        if api not in apis:
            apis.append(api)
    return "\n".join([*notes, *(source(api) for api in apis)]).rstrip("\n")


def accepts(name: str, body: dict, leaves) -> bool:
    """Does the decomposition compute this call, as dump.json recorded it? `name`: its forward entry
    (`NPU.npu_fusion_attention.1.forward`), `body`: its dump.json record, `leaves`: its input tensors
    (the DumpEntry's). The decomposition runs on fake tensors of the recorded shapes and dtypes, the
    arguments decoded as the pre-check decodes them: its own checks decide."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npukit.accuracy import naming
    from npukit.accuracy.precheck import CannotRun, _arguments, _fill, _torch_dtype

    function = DECOMPOSITIONS.get(naming.split_entry_name(name)[0])
    if function is None or not isinstance(body, dict):
        return False
    try:
        args, kwargs, slots = _arguments(name, body, {leaf.name: leaf for leaf in leaves})
        with FakeTensorMode():
            tensors = [torch.empty(leaf.shape, dtype=_torch_dtype(leaf.dtype)) for leaf in slots]
            function(*_fill(args, tensors, "cpu"), **_fill(kwargs, tensors, "cpu"))
    except (CannotRun, ValueError, TypeError, RuntimeError, IndexError):
        return False  # an option it refuses, shapes it cannot take, an argument the dump did not keep
    return True


def recorded_calls(rank_dir: Path, names: list[str]) -> dict[str, dict]:
    """The bodies dump.json recorded for these forward entries (their arguments), read from the file's
    text at each name: the dump is not parsed whole again for the few fused calls the fix finder asks about."""
    if not names:
        return {}
    try:
        text = (Path(rank_dir) / "dump.json").read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    decoder, bodies = json.JSONDecoder(), {}
    for name in names:
        found = re.search(rf'"{re.escape(name)}"\s*:\s*', text)
        if found is None:
            continue
        try:
            body = decoder.raw_decode(text, found.end())[0]
        except ValueError:
            continue
        if isinstance(body, dict):
            bodies[name] = body
    return bodies
