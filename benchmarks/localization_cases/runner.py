"""Run one case: a golden and an NPU run dumped with npukit's DumpSession (in this process, or one
process per rank for a multi-rank case), `npu-compare`'s body (run_compare, with --json) on them, the
verdict judged against the fault's known location, and for a fixable fault the fix finder
(`--find-fix`, its trials run in this process) and a check of its fix's minimality.

What "named at the injected op" means (the `at_op` outcome): the compare's first divergence --
across ranks when it names one, else that of the first step/rank pair that has one -- is an entry
of one of the fault's ops (`cases.Op`) in that pair's dumps: the op's forward or backward entry
(`Functional.linear.3.forward` / `.backward`, in the target dump, or in the golden dump for an op
the fault replaced), or an entry of the module whose forward calls the op (`Module.site.fc.Linear.
forward.0`, `.backward.0`, `.parameters_grad.0`); for a rank-only fault, on the rank at fault.
`downstream`: named at an entry recorded after the injected op's first entry in the target's
execution order (a forward fault: its forward entry; a gradient hook: its backward entry), in a
later step, or on a rank the fault reached through a collective. `upstream`: named before it.
`unnamed`: the compare exits non-zero with no divergence named; `missed`: it exits 0.
A clean case raises a false alarm when the compare exits non-zero.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEARNING_RATE = {"sgd": 0.05, "adamw": 1e-3}


# ---------------------------------------------------------------------------- the runs
def _torch():
    import torch

    import npukit.npu_backend  # noqa: F401  (the emulated device, before the first backward)

    return torch


def build_model(case):
    """The case's model on the npu, the same in both runs: seeded, hazards calibrated in fp32."""
    torch = _torch()
    from .models import Net

    torch.manual_seed(case.seed)
    model = Net(case.family, case.features, case.width, case.depth, 10, case.acts, case.norm, case.attention,
                case.site, case.site_after).to("npu")
    if case.site in ("overflow_linear", "overflow_square", "overflow_scores"):
        _calibrate_overflow(case, model)
    elif case.site in ("cancel_sub", "cancel_norm"):
        with torch.no_grad():
            model.site.fc.bias.fill_(3000.0)
    return model


def _calibrate_overflow(case, model) -> None:
    """Scale the site so its hazard op's largest output (fp32, first batch) lands where fp16
    overflows and nothing before it does: linear outputs to 3e5; for a square, h to 2e3 (h*h 4e6);
    attention scores to 3e5 with q and k under 2e3."""
    torch = _torch()
    from npukit.npu_backend import numerics

    seen = {}
    handle = model.site.register_forward_pre_hook(lambda module, args: seen.__setitem__("x", args[0].detach()))
    with torch.no_grad(), numerics.golden():
        model(batch(case, 0, 0)[0])
    handle.remove()
    x, site = seen["x"], model.site
    with torch.no_grad():
        if case.site == "overflow_linear":
            factor = 3e5 / site.fc(x).abs().max().item()
            site.fc.weight.mul_(factor), site.fc.bias.mul_(factor)
        elif case.site == "overflow_square":
            factor = 2e3 / site.fc(x).abs().max().item()
            site.fc.weight.mul_(factor), site.fc.bias.mul_(factor)
        else:
            scores = site.fc(x) @ site.k(x).transpose(-2, -1)
            factor = math.sqrt(3e5 / scores.abs().max().item())
            for layer in (site.fc, site.k):
                layer.weight.mul_(factor), layer.bias.mul_(factor)


def batch(case, rank: int, step: int):
    torch = _torch()
    generator = torch.Generator().manual_seed(case.seed * 7 + rank * 1000 + step)
    if case.family == "cnn":
        shape = (case.batch, 3, 8, 8)
    elif case.tokens:
        shape = (case.batch, case.tokens, case.features)
    else:
        shape = (case.batch, case.features)
    x = torch.randn(*shape, generator=generator)
    y = torch.randint(0, 10, shape[:2] if case.tokens else shape[:1], generator=generator)
    return x.to("npu"), y.to("npu")


def _inject(case, model, rank: int) -> None:
    """The NPU run's own fault (wrong_op, grad_hook, rank_only on its rank)."""
    torch = _torch()
    from .cases import OTHER_ACTIVATION
    from .models import TransposedLinear

    if case.fault not in ("wrong_op", "grad_hook", "rank_only") or (case.fault == "rank_only" and rank != case.bad_rank):
        return
    module = model.get_submodule(case.target)
    variant = case.variant
    if variant == "activation":
        module.act = OTHER_ACTIVATION[module.act]
    elif variant == "transposed":
        module.__class__ = TransposedLinear
    elif variant == "norm_eps":
        module.eps = 0.5
    elif variant == "attention_scale":
        module.scale = 1.0
    elif variant == "softmax_dim":
        module.softmax_dim = -2
    elif variant == "top_k":
        module.top_k = 1
    elif variant == "weight":
        with torch.no_grad():
            module.weight.mul_(case.factor)
    elif variant.endswith("output"):
        factor = case.factor

        def scale_output_gradient(mod, args, out) -> None:  # returns None: the output stays as it is
            out.register_hook(lambda grad: grad * factor)

        module.register_forward_hook(scale_output_gradient)
    elif variant.endswith("weight"):
        factor = case.factor
        module.weight.register_hook(lambda grad: grad * factor)
    else:
        raise ValueError(variant)


@contextlib.contextmanager
def golden_numerics():
    """What `npu-run --golden` does to a run, undone after: NPU numerics off, autocast in fp32."""
    torch = _torch()
    from npukit.npu_backend import numerics
    from npukit.run import golden_autocast

    autocast_cls = torch.amp.autocast_mode.autocast
    original = autocast_cls.__init__
    golden_autocast()
    try:
        with numerics.golden():
            yield
    finally:
        autocast_cls.__init__ = original


def run_side(case, out: Path, golden: bool, fix=None, rank: int = 0, mode: str = "tensor", ddp: bool = False):
    """One run of the case's training steps under a DumpSession writing to `out`."""
    torch = _torch()
    import torch.nn.functional as F

    from npukit.accuracy.dump import DumpSession
    from npukit.accuracy.fixes import PrecisionFixSession

    model = build_model(case)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if not golden:
        _inject(case, model.module if ddp else model, rank)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "hf32": torch.float32}[case.precision]
    optimizer = (torch.optim.SGD if case.optimizer == "sgd" else torch.optim.AdamW)(
        model.parameters(), lr=LEARNING_RATE[case.optimizer])
    scaler = torch.amp.GradScaler("npu", init_scale=1024.0, enabled=case.grad_scaler)
    hf32 = case.precision == "hf32" and not golden
    with contextlib.ExitStack() as stack:
        if golden:
            stack.enter_context(golden_numerics())
        if hf32:  # what the user's script does (torch_npu's default leaves matmuls in fp32)
            torch.npu.matmul.allow_hf32 = True
            stack.callback(setattr, torch.npu.matmul, "allow_hf32", False)
        if fix is not None:  # before the dump, as npu-run enters them
            stack.enter_context(PrecisionFixSession(fix))
        stack.enter_context(DumpSession(out, level="mix", mode=mode, tensor_format="npy"))
        for step in range(case.steps):
            x, y = batch(case, rank, step)
            with torch.autocast("npu", dtype=dtype, enabled=case.precision != "hf32"):
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def run_ranks(case, work: Path, mode: str) -> None:
    """A multi-rank case: one process per rank (hccl over gloo), each runs golden then NPU."""
    env = dict(os.environ, WORLD_SIZE=str(case.ranks), MASTER_ADDR="127.0.0.1", NPUKIT_DEVICE_COUNT=str(case.ranks),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    (work / "case.json").write_text(json.dumps(case.as_json()))
    port = 20000 + (abs(hash((case.case_id, os.getpid(), time.time()))) % 20000)
    processes = [subprocess.Popen([sys.executable, "-m", "localization_cases.runner", str(work), mode],
                                  env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(case.ranks)]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    failed = [(rank, out) for rank, (process, out) in enumerate(zip(processes, outputs)) if process.returncode]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][1][-2000:]}")


def rank_process(work: Path, mode: str) -> None:
    torch = _torch()
    import torch.distributed as dist

    from .cases import Case

    case = Case.from_json(json.loads((work / "case.json").read_text()))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=case.ranks)
    try:
        run_side(case, work / "golden", golden=True, rank=rank, mode=mode, ddp=True)
        run_side(case, work / "npu", golden=False, rank=rank, mode=mode, ddp=True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- locating the fault
def _strip(path: str | None, ddp: bool) -> str | None:
    if path is None:
        return None
    path = "" if path == "(root)" else path
    return path[len("module."):] if ddp and path.startswith("module.") else ("" if ddp and path == "module" else path)


def op_entries(case, dump, golden_side: bool, ddp: bool) -> tuple[set[str], int | None]:
    """(names of the fault's ops and their modules' entries in this dump, the position of the first
    injected entry in its execution order)."""
    from npukit.accuracy import naming
    from npukit.accuracy.compare import entry_module_path

    names, first = set(), None
    backward_fault = case.fault == "grad_hook" or case.variant.startswith("grad_hook")
    order = {entry.name: position for position, entry in enumerate(dump.entries)}
    for op in case.location:
        api = naming.operator_op(op.golden_api if golden_side and op.golden_api else op.api)
        calls = [entry for entry in dump.entries if entry.direction == naming.FORWARD
                 and not entry.name.startswith("Module.") and naming.operator_op(entry.base) == api
                 and _strip(entry_module_path(entry, dump), ddp) == op.module]
        for entry in dump.entries:
            if entry.name.startswith("Module.") and _strip(naming.module_path_of(entry.name), ddp) == op.module:
                names.add(entry.name)
                if backward_fault and op.module and entry.direction == naming.PARAMETERS_GRAD and "weight" in case.variant:
                    first = order[entry.name] if first is None else min(first, order[entry.name])
        if len(calls) > op.occurrence:
            forward = calls[op.occurrence].name
            backward = naming.with_direction(forward, naming.BACKWARD)
            names.update((forward, backward))
            anchor = backward if backward_fault and backward in order else forward
            if anchor in order:
                first = order[anchor] if first is None else min(first, order[anchor])
    return names, first


def judge_localization(case, report: dict, golden_dumps: dict, npu_dumps: dict, exit_code: int) -> dict:
    """The outcome of a faulty case (see the module docstring), with what the compare named."""
    named = None
    began = report.get("across_ranks")
    if began:
        named = {"pair": began["pair"], "entry": began["entry"], "golden_entry": None, "ranks": began["ranks"],
                 "reason": began.get("text", "")}
    else:
        for pair in report["pairs"]:
            divergence = pair["first_divergence"]
            if divergence:
                named = {"pair": pair["pair"], "entry": divergence["entry"], "golden_entry": divergence["golden_entry"],
                         "ranks": [_rank_of(pair["pair"])], "reason": divergence["reason"]}
                break
    if named is None:
        return {"outcome": "missed" if exit_code == 0 else "unnamed", "named": None}
    ddp = case.ranks > 1
    pair = named["pair"]
    step0 = f"step0/rank{case.bad_rank if case.fault == 'rank_only' else named['ranks'][0]}"
    target, golden = npu_dumps.get(pair), golden_dumps.get(pair)
    names, first = op_entries(case, target, False, ddp) if target else (set(), None)
    if golden is not None:
        names |= op_entries(case, golden, True, ddp)[0]
    entries = {named["entry"], named["golden_entry"]} - {None}
    right_rank = case.fault != "rank_only" or case.bad_rank in named["ranks"]
    if entries & names and right_rank:
        outcome = "at_op"
    elif not right_rank:
        outcome = "downstream"  # the fault reached that rank through a collective
    elif pair != step0 and pair.startswith("step") and not pair.startswith("step0/"):
        outcome = "downstream"  # a later step
    else:
        order = {entry.name: position for position, entry in enumerate(target.entries)} if target else {}
        position = order.get(named["entry"])
        outcome = "downstream" if position is not None and first is not None and position >= first else "upstream"
    return {"outcome": outcome, "named": named}


def _rank_of(label: str) -> int:
    return int(label.rpartition("rank")[2] or 0)


# ---------------------------------------------------------------------------- compare and fix
def compare(golden: Path, npu: Path, work: Path, find_fix_command: list[str] | None = None):
    """npu-compare's body with --json (and --find-fix): (exit code, the JSON report, the terminal text)."""
    from rich.console import Console

    from npukit.accuracy.cli_compare import FindFixOptions, run_compare

    text = io.StringIO()
    console = Console(file=text, width=200, force_terminal=False, color_system=None)
    json_path = work / "compare.json"
    options = None
    if find_fix_command is not None:
        options = FindFixOptions(find_fix_command, work=work / "find-fix", json_path=work / "find-fix.json")
    code = run_compare(golden, npu, None, json_path, None, 0, [], 1, console, find_fix=options)
    return code, json.loads(json_path.read_text()), text.getvalue()


def headline(text: str) -> str:
    """The compare's verdict line as the terminal shows it."""
    for line in text.splitlines():
        if line.startswith(("First divergence", "No divergence", "nothing to compare", "Nothing to compare")):
            return line.strip()
    return ""


@contextlib.contextmanager
def trials_in_process(case, mode: str):
    """While active, the fix finder's TrialRunner makes its runs in this process (run_side with the
    fix, as `npu-run --precision-fix FIX --dump DIR` would) and judges them with its own `judge`."""
    from npukit.accuracy import fix_finder

    original = fix_finder.TrialRunner

    class InProcessTrialRunner(original):
        def run(self, changes):
            return run_trial(self, case, mode, changes)

    fix_finder.TrialRunner = InProcessTrialRunner
    try:
        yield
    finally:
        fix_finder.TrialRunner = original


def run_trial(runner, case, mode: str, changes):
    from npukit.accuracy.compare import compare_dirs
    from npukit.accuracy.fix_finder import Trial, judge
    from npukit.accuracy.fixes import PrecisionFix

    folder = runner.work / f"trial{len(runner.trials)}"
    folder.mkdir(parents=True, exist_ok=True)
    fix_file = folder / "fix.json"
    fix_file.write_text(PrecisionFix(list(changes)).to_json())
    dump = folder / "dump"
    try:
        run_side(case, dump, golden=False, fix=PrecisionFix.load(fix_file), mode=mode)
    except Exception as exc:  # what a failed npu-run trial is: not fixed
        trial = Trial(list(changes), False, None, None, f"the run failed: {exc}")
    else:
        trial = judge(compare_dirs(runner.golden, dump, runner.thresholds, workers=1), list(changes), runner.anchor)
    shutil.rmtree(folder, ignore_errors=True)
    runner.trials.append(trial)
    if runner.on_trial is not None:
        runner.on_trial(trial)
    return trial


class _Judge:
    """Runs of the NPU side with a fix, judged as the fix finder judges its trials."""

    def __init__(self, case, golden: Path, work: Path, mode: str, anchor: str) -> None:
        from npukit.accuracy.compare import Thresholds

        self.case, self.golden, self.work, self.mode, self.anchor = case, golden, work, mode, anchor
        self.thresholds, self.trials, self.on_trial = Thresholds(), [], None

    def fixed(self, changes) -> bool:
        return run_trial(self, self.case, self.mode, changes).fixed


def oracle_fix(case):
    """The change a developer who knows the fault would make: its first op in fp32 (fp16/bf16) or
    with HF32 off."""
    from npukit.accuracy import naming
    from npukit.accuracy.fixes import FixChange

    op = case.location[0]
    kind = "hf32_off" if case.precision == "hf32" else "fp32"
    return [FixChange(kind, naming.operator_op(op.api), op.module)]


def concrete(changes, model) -> list:
    """Each change on every module its pattern names (`layers.*.fc` -> layers.0.fc, layers.1.fc ...)."""
    from dataclasses import replace

    from npukit.accuracy.fixes import module_matches

    out = []
    for change in changes:
        if "*" in change.module:
            out += [replace(change, module=name) for name, _ in model.named_modules() if module_matches(change.module, name)]
        else:
            out.append(change)
    return out


def fix_outcome(case, work: Path, golden: Path, npu: Path, mode: str, anchor: str) -> dict:
    """Fixable? (the oracle fix makes the run pass), then --find-fix: found, runs, within the bound,
    minimal (no fix with one of its concrete changes left out also passes: tried), on the injected op."""
    from npukit.accuracy import naming
    from npukit.accuracy.fixes import FixChange, module_matches

    judge = _Judge(case, golden, work / "checks", mode, anchor)
    fixable = judge.fixed(oracle_fix(case))
    command = ["npu-run", "--seed", "0", "--replay", str(work / "replay"), "--dump", str(npu), "case.py"]
    with trials_in_process(case, mode):
        code, _, text = compare(golden, npu, work, command)
    fix_json = work / "find-fix.json"
    if not fix_json.exists():
        return {"fixable": fixable, "found": False, "runs": 0, "candidates": 0, "within_bound": True,
                "minimal": None, "on_injected_op": False, "note": headline(text) or "no fix-finder result"}
    result = json.loads(fix_json.read_text())
    candidates, runs = len(result["candidates"]), result["runs"]
    bound = 2 * math.log2(max(candidates, 2)) + 4
    fix = result["fix"]
    outcome = {"fixable": fixable, "found": fix is not None, "runs": runs, "candidates": candidates,
               "within_bound": runs <= bound, "minimal": None, "on_injected_op": False, "fix": None}
    if fix is None:
        return outcome
    changes = [FixChange(c["kind"], c["api"], c["module"], c["line"], c["source"]) for c in fix]
    outcome["fix"] = [change.describe() for change in changes]
    outcome["on_injected_op"] = any(module_matches(change.module, op.module)
                                    and change.api == naming.operator_op(op.api)
                                    for change in changes for op in case.location)
    parts = concrete(changes, build_model(case))
    minimal = True
    if len(parts) > 1:
        for index in range(len(parts)):
            if judge.fixed(parts[:index] + parts[index + 1:]):
                minimal = False
                break
    outcome["minimal"] = minimal
    outcome["concrete_changes"] = len(parts)
    return outcome


def run_case(case, work: Path, mode: str = "tensor", find_fix: bool = True) -> dict:
    """Everything measured on one case, as a JSON-able record."""
    from npukit.accuracy.dumpfile import load_dump_dir

    started = time.perf_counter()
    record = {"case": case.as_json()}
    try:
        golden, npu = work / "golden", work / "npu"
        if case.ranks > 1:
            run_ranks(case, work, mode)
        else:
            run_side(case, golden, golden=True, mode=mode)
            run_side(case, npu, golden=False, mode=mode)
        code, report, text = compare(golden, npu, work)
        record.update(exit_code=code, headline=headline(text), summary=report["summary"])
        if case.fault is None:
            record["outcome"] = "quiet" if code == 0 else "false_alarm"
            divergences = [(pair["pair"], pair["first_divergence"]) for pair in report["pairs"] if pair["first_divergence"]]
            if divergences:
                record["named"] = {"pair": divergences[0][0], "entry": divergences[0][1]["entry"],
                                   "reason": divergences[0][1]["reason"]}
        else:
            verdict = judge_localization(case, report, load_dump_dir(golden), load_dump_dir(npu), code)
            record.update(verdict)
            if find_fix and case.fixable_kind and case.ranks == 1:
                anchor = verdict["named"]["entry"] if verdict["named"] else ""
                record["fix"] = fix_outcome(case, work, golden, npu, mode, anchor)
    except Exception:
        record.update(outcome="error", error=traceback.format_exc()[-3000:])
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


if __name__ == "__main__":  # a rank of a multi-rank case (run_ranks starts it)
    rank_process(Path(sys.argv[1]), sys.argv[2])
