"""Make a golden run and an NPU run start from the same weights and the same first batches.

    with ReplaySession(Path("replay")):       # first run: records; second run: replays
        runpy.run_path("train.py", run_name="__main__")

First run (DIR has no replay.json): at the first forward of each root module (a module called
while no other module runs) its state_dict is saved -- at that moment the weights are still the
initial ones, whatever the script did to create or move them. The tensor arguments of the first
`batches` forwards of each root module and the first `batches` batches yielded by any DataLoader
(so labels too) are saved as well. Everything is stored pickle-free (.npy + replay.json).

Second run (DIR holds replay.json): the same points load the saved weights into the module
(in place, so an optimizer already holding the parameters keeps working) and substitute the saved
batches and forward arguments, on the device and with the structure the script uses.

Only true inputs are substituted. A root-forward argument that requires grad (an activation
computed under autograd, or a leaf the script wants a gradient for) or that is the output of an
earlier root forward (or a view of one, e.g. under no_grad) is an activation: it is recorded as
such, without its values, and always kept as it is. So `criterion(model(x), y)` with an
`nn.Module` loss keeps the autograd graph from the loss to the model, and only `y` (data) is
replaced. Not recognised: a new tensor made from a root output by a function under no_grad
(`head(body(x).float())`) or by `.detach()` (an RNN's carried hidden state) is still substituted.

Under torchrun (RANK set) every rank records and replays in its own DIR/rank{RANK}/, as dumps
do; a single process uses DIR itself.

From a later step (`start_step=N`, npu-run's `--replay-step N`): the same, at the start of step N
instead of the run's (when step N-1 ends, as watch.steps.RunSteps ends steps, the monitor's count):
every root module's state, every optimizer's state (Adam's moments, its step count, SGD's
momentum) and every GradScaler's (below) are saved, or loaded in place, and the batches and forward
arguments counted from there.
Without an optimizer (weights updated by hand) step N starts as the first root module starts its
forward for step N (with gradients): the state is taken there, after step N-1's update, and the
DataLoader batches taken after step N-1's forward began (the loop takes step N's before its forward)
are step N's. So an NPU run whose weights drifted over N steps computes step N from the golden run's
state: its dump of step N shows what step N's own ops do, not what N steps accumulated (npu-compare
--trend --localize relies on it).

GradScalers (torch.amp.GradScaler and its subclasses, enabled): those the script stepped before step N,
as watch.scaler_steps sees their GradScaler.step, in the order of their first step; each one's loss
scale and growth tracker (tensors on its device, stored as .npy files; its growth and backoff factors
and interval are the script's and stay live). A replaying run loads them in place into its own
scalers, matched in that order (a scaler whose first scale() is still to come takes them as its
initial values). The replaying run takes the recorded run's scale, not its own, for the reason it takes
the optimizer's state: step N computes from it. The scale multiplies every gradient of step N's
backward and decides whether step N's update is skipped (an fp16 overflow), and its value is what the
steps before did (each overflow halved it): an NPU run computing step N from the golden state with its
own scale would scale, overflow and skip as its own N steps left it, not as step N's ops do. With the
golden scale both runs start step N alike, and a step only the NPU run skips is one whose fp16
gradients overflow at the scale the golden run had. (Under --localize the NPU re-run is fast-forwarded:
its own scale would not even be its real run's, but what the skipped steps' zero gradients grew.) At
step 0 nothing is recorded: a scaler starts from the script's own init_scale in both runs. A directory
recorded before scalers were (no "scalers" in replay.json) loads the rest and, when the run uses a
GradScaler, says so once.

Random number generators: at the same point (the first root forward of the run, or step N's start)
the states of the global generators are recorded and set back -- torch's CPU generator, each npu
device's default generator, Python's `random` and numpy's `np.random` -- so a step that draws (dropout,
noise, a random crop, a DataLoader iterator started from there: its shuffle and its workers' seeds) draws
what the recorded run drew, whatever the run's own seed did before. All four are restored, not only
torch's: they are the script's state at that point as much as its weights are (same script, same
point of it, every other input of the step restored), and npukit itself draws from none of them.
Generators the script makes itself (torch.Generator, random.Random, np.random.default_rng) and those of
DataLoader workers already running are not reached. Recording changes nothing in the recorded run: an
emulated npu generator is read with npukit's own full state (its seed, offset and the CPU generator it
draws from: rng.npu_exact), not with torch.npu.get_rng_state(), which makes it continue from (seed,
offset), and set back with it exactly: a replay draws what the recorded run drew from that point on,
and that run draws what it draws unrecorded. rng.npu keeps the 16-byte states (seed, offset), which a
real torch_npu, or an npukit without the full states, sets; a directory of such an npukit (no
npu_exact) is set back from them, as it recorded them (its recording run continued from them). A
directory recorded before the states were (no "rng" in replay.json) restores none, and says so once.
"""

from __future__ import annotations

import json
import os
import random
import sys
import weakref
from pathlib import Path

import torch

from npukit.accuracy.tensor_io import read_tensor, write_tensor
from npukit.errors import UserError
from npukit.files import (
    ContainedPaths,
    check_output_location,
    load_json,
    output_folder,
    refuse_links_inside,
    write_text_atomic,
)
from npukit.watch.process import rank_from_env
from npukit.watch.tensors import local_shard

MANIFEST = "replay.json"
_FORMAT_VERSION = 2  # 2: forward calls are counted per root module, activations are not stored


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"replay: unknown dtype {name!r} in {MANIFEST}")
    return dtype


def _rank() -> int | None:
    """This process's rank under torchrun (RANK set), else None."""
    if "RANK" not in os.environ:
        return None
    return rank_from_env()


class ReplaySession:
    """Record (first run) or replay (second run) initial weights and first batches in `directory`."""

    def __init__(self, directory: Path, batches: int = 4, start_step: int | None = 0) -> None:
        """start_step None: replay `directory` at the step it was recorded at (a monitor's checkpoint)."""
        if batches < 0:
            raise UserError("--replay: the number of batches must be >= 0")
        if start_step is not None and start_step < 0:
            raise UserError(f"--replay-step: a step number is >= 0, not {start_step}")
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise UserError(f"--replay: {root} exists and is not a directory")
        self.root_directory = root
        self.rank = _rank()
        # One folder per rank under torchrun, so that ranks never write into each other's files.
        self.directory = root if self.rank is None else root / f"rank{self.rank}"
        self.batches = batches
        self.replaying = (self.directory / MANIFEST).is_file()
        if not self.replaying:
            check_output_location(root, "--replay")
            self._check_layout(root)
        if start_step is None and not self.replaying:
            raise UserError(f"{self.directory / MANIFEST}: no such file (a recorded replay folder or monitor "
                            "checkpoint holds one)")
        self._manifest = self._load_manifest() if self.replaying else _new_manifest(start_step)
        if start_step is None:
            start_step = self._manifest.get("start_step", 0)
        self.replayed_generators = False
        self._roots: dict[int, int] = {}  # id(module) -> index in manifest["modules"]
        self._root_refs: list = []  # keep ids stable while the session runs
        self._forward_calls: dict[int, int] = {}  # root index -> forwards seen
        self._produced: dict[int, weakref.ref] = {}  # id(tensor) -> tensor, outputs of root forwards
        self._batch_calls = 0
        self._depth = 0
        self._handles: list = []
        self._patched_next = None
        self._file_count = 0
        self.replayed_modules = 0
        self.replayed_batches = 0
        self.replayed_optimizers = 0
        self.replayed_scalers = 0
        self.start_step = start_step
        self._steps_ended = 0
        self._active = start_step == 0  # recording or replaying (from the first forward, or step N's start)
        self._optimizers: list = []  # weak references, in the order they first stepped
        self._step_watch = None
        self._optimizer_hook = None
        self._run_failed = False
        if self.replaying:
            recorded = self._manifest.get("start_step", 0)
            if recorded != start_step:
                raise UserError(f"--replay: {self.directory} was recorded at the start of step {recorded}; "
                                f"replay it with --replay-step {recorded}, or record another directory")

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> ReplaySession:
        from torch.nn.modules import module as module_hooks

        if not self.replaying:
            self._prepare_output()
        if self.start_step:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            from npukit.watch.steps import RunSteps

            self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
            # before the module hooks below: a step that starts at a forward (no optimizer) has begun,
            # and its state been loaded, when _on_pre_forward takes that forward's inputs
            self._step_watch = RunSteps(self._on_step_end)
            self._step_watch.install()
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._on_pre_forward),
            module_hooks.register_module_forward_hook(self._on_forward, always_call=True),
        ]
        self._patch_dataloader()
        return self

    def _prepare_output(self) -> None:
        refuse_links_inside(self.root_directory, "--replay", depth=2)
        rank = () if self.rank is None else (f"rank{self.rank}",)
        output_folder(self.root_directory, *rank, "tensors")

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unpatch_dataloader()
        self._produced.clear()
        if self._step_watch is not None:
            self._step_watch.remove()
            self._optimizer_hook.remove()
            self._step_watch = self._optimizer_hook = None

    def mark_run_failed(self) -> None:
        """The script failed (npu-run calls it before the sessions exit): its own error says why, not
        that step N never started, and a recording that never started is not written."""
        self._run_failed = True

    def __exit__(self, exc_type, *exc_info) -> None:
        self.remove_hooks()
        if not self._active and self._run_failed:
            return
        if not self._active and exc_type is None:
            raise UserError(f"--replay-step {self.start_step}: the run ended after {self._steps_ended} training "
                            f"step(s), before step {self.start_step} started: nothing was "
                            f"{'replayed' if self.replaying else 'recorded'} in {self.directory} (a step ends at "
                            "each optimizer step or, in a script without an optimizer, as its first model starts "
                            "a new forward with gradients enabled: forwards under torch.no_grad() make none)")
        if not self.replaying:
            write_text_atomic(self.directory / MANIFEST, json.dumps(self._manifest, indent=1))

    # ---------------------------------------------------------------- step N's start
    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    def _on_step_end(self, optimizer, skipped: bool, loss_scale) -> None:
        self._steps_ended += 1
        if self._active or self._steps_ended != self.start_step:
            return
        self._active = True
        self._step_state()

    def _step_state(self) -> None:
        """Record (into the manifest) or load the state a step starts from: every root module's,
        every optimizer's, every GradScaler's and the global generators'."""
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for index, module in enumerate(self._root_refs):  # (in the order _roots numbered them)
                if self.replaying:
                    self._load_state(module, index)
                else:
                    self._save_state(module)
            optimizers = [ref() for ref in self._optimizers if ref() is not None]
            if self.replaying:
                self._load_optimizers(optimizers)
            else:
                self._manifest["optimizers"] = [self._encode_optimizer(optimizer) for optimizer in optimizers]
            scalers = self._step_watch.scalers()
            if self.replaying:
                self._load_scalers(scalers)
            else:
                self._manifest["scalers"] = [self._encode_scaler(scaler) for scaler in scalers]
            self._generators()

    def _encode_optimizer(self, optimizer) -> dict:
        """Its per-parameter state in param_groups order: tensors as files, numbers as they are (its
        hyper-parameters are the script's, the same in both runs, and stay live)."""
        states = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                state = {}
                for key, value in optimizer.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[key] = self._encode(value)
                    elif isinstance(value, bool | int | float) or value is None:
                        state[key] = {"value": value}
                    else:
                        state[key] = {"other": type(value).__name__}
                states.append(state)
        return {"class": type(optimizer).__name__, "state": states}

    def _load_optimizers(self, optimizers: list) -> None:
        saved = self._manifest.get("optimizers", [])
        if len(saved) != len(optimizers):
            raise UserError(f"replay: {self.directory} holds the state of {len(saved)} optimizer(s) at the start of "
                            f"step {self.start_step}; this run has stepped {len(optimizers)}: was it recorded with "
                            "the same script?")
        for optimizer, recorded in zip(optimizers, saved):
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            if recorded.get("class") != type(optimizer).__name__ or len(recorded["state"]) != len(parameters):
                raise UserError(f"replay: the optimizer recorded in {self.directory} was a {recorded.get('class')} of "
                                f"{len(recorded['state'])} parameters, now it is a {type(optimizer).__name__} of "
                                f"{len(parameters)}")
            for parameter, state in zip(parameters, recorded["state"]):
                live = optimizer.state[parameter]
                for key, encoded in state.items():
                    if "value" in encoded:
                        live[key] = encoded["value"]
                    elif "tensor" in encoded:
                        reference = live.get(key)
                        if not isinstance(reference, torch.Tensor):
                            reference = parameter if encoded["shape"] == _stored_shape(parameter) else \
                                torch.empty(0, dtype=_torch_dtype(encoded["dtype"]))
                        value = self._decode(encoded, reference).requires_grad_(False)
                        if isinstance(live.get(key), torch.Tensor) and live[key].shape == value.shape:
                            live[key].copy_(value)  # in place: a fused/foreach step may hold it
                        else:
                            live[key] = value
            self.replayed_optimizers += 1

    # ---------------------------------------------------------------- GradScalers
    def _encode_scaler(self, scaler) -> dict:
        """Its loss scale and growth tracker, tensors on its device (a scaler that stepped has them: its
        step() requires them); its growth and backoff factors and interval are the script's and stay live."""
        return {"class": type(scaler).__name__, "scale": self._encode(scaler._scale),
                "growth_tracker": self._encode(scaler._growth_tracker)}

    def _load_scalers(self, scalers: list) -> None:
        """In place, on each scaler's device; one whose first scale() is still to come (no tensors yet)
        takes the recorded values as its initial ones, as GradScaler.load_state_dict does, and its
        first scale() creates its tensors from them."""
        saved = self._manifest.get("scalers")
        if saved is None:
            if scalers:
                print(f"npukit replay: {self.directory / MANIFEST} holds no GradScaler state (recorded by an earlier "
                      f"npukit): the loss scale and growth tracker from step {self.start_step} on are this run's "
                      "own; record the directory again to have them replayed", file=sys.stderr)
            return
        if len(saved) != len(scalers):
            raise UserError(f"replay: {self.directory} holds the state of {len(saved)} GradScaler(s) at the start of "
                            f"step {self.start_step}; this run has stepped {len(scalers)}: was it recorded with the "
                            "same script?")
        for scaler, recorded in zip(scalers, saved):
            if recorded["class"] != type(scaler).__name__:
                raise UserError(f"replay: the GradScaler recorded in {self.directory} was a {recorded['class']}, "
                                f"now it is a {type(scaler).__name__}")
            live = {"scale": scaler._scale, "growth_tracker": scaler._growth_tracker}
            values = {key: self._decode(recorded[key], tensor if tensor is not None else torch.empty(0))
                      for key, tensor in live.items()}
            if any(tensor is None for tensor in live.values()):
                scaler._init_scale = float(values["scale"])
                scaler._init_growth_tracker = int(values["growth_tracker"])
            else:
                for key, tensor in live.items():
                    tensor.copy_(values[key].reshape(tensor.shape))
            self.replayed_scalers += 1

    # ---------------------------------------------------------------- random number generators
    def _generators(self) -> None:
        """Record, or set back, the global generators' states (the module docstring says which, and why)."""
        if not self.replaying:
            self._manifest["rng"] = self._encode_generators()
            return
        states = self._manifest.get("rng")
        if states is None:
            print(f"npukit replay: {self.directory / MANIFEST} holds no random number generators' states (recorded "
                  "by an earlier npukit): they are not restored, so random draws (dropout) from the replayed point "
                  "on are this run's own; record the directory again to have them replayed", file=sys.stderr)
            return
        self._restore_generators(states)
        self.replayed_generators = True

    def _encode_generators(self) -> dict:
        import numpy

        version, words, gauss_next = random.getstate()
        algorithm, keys, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        npu, exact = _npu_generators(), _exact_npu_generators()
        states = {}
        if exact is not None:
            # read without changing what the run draws next; "npu" keeps the 16-byte states (seed, offset)
            # that an npukit without the full states, or a real torch_npu, sets
            full = [exact._generator_full_state(index) for index in range(npu.device_count())]
            states["npu_exact"] = [self._encode(state) for state in full]
            npu_states = [state[8:24].clone() for state in full]
        else:
            npu_states = [npu.get_rng_state(index) for index in range(npu.device_count())] if npu else []
        return {
            "torch": self._encode(torch.get_rng_state()),
            "npu": [self._encode(state) for state in npu_states],
            **states,
            "python": [version, list(words), gauss_next],
            "numpy": {"algorithm": algorithm, "keys": keys.tolist(), "pos": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        }

    def _restore_generators(self, states: dict) -> None:
        import numpy

        byte = torch.empty(0, dtype=torch.uint8)
        where = self.directory / MANIFEST
        try:
            torch.set_rng_state(self._decode(states["torch"], byte))
        except RuntimeError as exc:
            raise UserError(f"{where}: rng.torch: not a CPU generator's state ({exc})") from None
        npu, exact = _npu_generators(), _exact_npu_generators()
        recorded = states["npu"]
        count = npu.device_count() if npu else 0
        # the full states continue exactly the recorded run's streams; a folder without them (an earlier
        # npukit, a real torch_npu) has the 16-byte ones, which continue from (seed, offset)
        full = states.get("npu_exact") if exact is not None else None
        for index, encoded in enumerate(recorded[:count]):
            exactly = full is not None and index < len(full)
            try:
                if exactly:
                    exact._set_generator_full_state(index, self._decode(full[index], byte))
                else:
                    npu.set_rng_state(self._decode(encoded, byte), index)
            except RuntimeError as exc:
                field = "npu_exact" if exactly else "npu"
                raise UserError(f"{where}: rng.{field}[{index}]: not an npu generator's state ({exc})") from None
        if len(recorded) > count:
            print(f"npukit replay: {where} holds the generator states of {len(recorded)} npu devices; this run has "
                  f"{count}: those of npu:{count} on are not restored", file=sys.stderr)
        version, words, gauss_next = states["python"]
        try:
            random.setstate((version, tuple(words), gauss_next))
        except (TypeError, ValueError, OverflowError) as exc:
            raise UserError(f"{where}: rng.python: not a state of Python's random ({exc})") from None
        state = states["numpy"]
        try:
            numpy.random.set_state((state["algorithm"], numpy.array(state["keys"], dtype=numpy.uint32), state["pos"],
                                    state["has_gauss"], state["cached_gaussian"]))
        except (TypeError, ValueError, OverflowError) as exc:
            raise UserError(f"{where}: rng.numpy: not a state of numpy's global generator ({exc})") from None

    def _check_layout(self, root: Path) -> None:
        """Refuse to record a second, differently laid out recording next to an existing one."""
        if self.rank is None:
            recorded = sorted(path.parent.name for path in root.glob(f"rank*/{MANIFEST}"))
            if recorded:
                raise UserError(
                    f"--replay: {root} was recorded per rank ({', '.join(recorded)}) under torchrun; "
                    f"replay it with the same --nproc-per-node, or use another directory"
                )
        elif (root / MANIFEST).is_file():
            raise UserError(
                f"--replay: {root} was recorded by a single process; this is rank {self.rank} of a "
                f"torchrun job: replay it without --nproc-per-node, or use another directory"
            )

    def _load_manifest(self) -> dict:
        self._contained = ContainedPaths(self.root_directory)
        return load_manifest(self._contained, self.directory / MANIFEST)

    # ---------------------------------------------------------------- module hooks
    def _on_pre_forward(self, module, args):
        self._depth += 1
        if self._depth != 1:
            return None
        index = self._roots.get(id(module))
        if index is None:
            index = len(self._roots)
            self._roots[id(module)] = index
            self._root_refs.append(module)
            if self._active:  # else its state is taken at step N's start
                with torch._C.DisableTorchFunction(), torch.no_grad():
                    if self.replaying:
                        self._load_state(module, index)
                    else:
                        self._save_state(module)
                    if index == 0:  # the run's start: its first root forward
                        self._generators()
        if not self._active:
            return None
        call = self._forward_calls.get(index, 0)
        if call >= self.batches:
            return None
        self._forward_calls[index] = call + 1
        with torch._C.DisableTorchFunction():
            if self.replaying:
                what = f"forward input {call} of {type(module).__name__}"
                return self._replace(args, self._find_forward_input(index, call), what, inputs=True)
            self._manifest["forward_inputs"].append(
                {"module": index, "call": call, "args": self._encode(args, inputs=True)}
            )
        return None

    def _on_forward(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and output is not None:
            with torch._C.DisableTorchFunction():
                self._remember_outputs(output)

    # ---------------------------------------------------------------- activations
    def _remember_outputs(self, value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            key = id(value)
            produced = self._produced

            def forget(ref, key=key):
                if produced.get(key) is ref:
                    del produced[key]

            produced[key] = weakref.ref(value, forget)
        elif depth < 4 and isinstance(value, list | tuple):
            for item in value:
                self._remember_outputs(item, depth + 1)
        elif depth < 4 and isinstance(value, dict):
            for item in value.values():
                self._remember_outputs(item, depth + 1)

    def _is_output(self, tensor: torch.Tensor) -> bool:
        ref = self._produced.get(id(tensor))
        return ref is not None and ref() is tensor

    def _is_activation(self, tensor: torch.Tensor) -> bool:
        """True for a root-forward argument computed by the script rather than loaded: never substituted."""
        if tensor.requires_grad:
            return True
        base = tensor._base
        return self._is_output(tensor) or (base is not None and self._is_output(base))

    def _save_state(self, module) -> None:
        tensors = {key: self._encode(value) for key, value in module.state_dict().items()}
        self._manifest["modules"].append({"class": type(module).__name__, "state": tensors})

    def _load_state(self, module, index: int) -> None:
        modules = self._manifest.get("modules", [])
        if index >= len(modules):
            raise UserError(
                f"replay: {self.directory} holds {len(modules)} root module(s); this run uses more "
                f"({type(module).__name__} is number {index + 1}): was it recorded with the same script?"
            )
        saved = modules[index]
        if saved.get("class") != type(module).__name__:
            raise UserError(
                f"replay: root module {index} was a {saved.get('class')} when recorded in {self.directory}, "
                f"now it is a {type(module).__name__}"
            )
        live = module.state_dict()
        state = {}
        for key, encoded in saved["state"].items():
            if key not in live:
                raise UserError(f"replay: {type(module).__name__} has no {key!r} (recorded in {self.directory})")
            state[key] = self._decode(encoded, live[key])
        missing = sorted(set(live) - set(state))
        if missing:
            raise UserError(f"replay: {self.directory} has no saved value for {type(module).__name__}.{missing[0]}")
        module.load_state_dict(state, strict=True)
        self.replayed_modules += 1

    def _find_forward_input(self, index: int, call: int):
        for item in self._manifest.get("forward_inputs", []):
            if item.get("module") == index and item.get("call") == call:
                return item["args"]
        return None

    # ---------------------------------------------------------------- DataLoader
    def _patch_dataloader(self) -> None:
        # The only place a DataLoader's batches (labels included) pass through the main process.
        from torch.utils.data import dataloader

        original = dataloader._BaseDataLoaderIter.__next__
        session = self

        def __next__(iterator):
            batch = original(iterator)
            return session._on_batch(batch)

        self._patched_next = (dataloader._BaseDataLoaderIter, original)
        dataloader._BaseDataLoaderIter.__next__ = __next__

    def _unpatch_dataloader(self) -> None:
        if self._patched_next is not None:
            owner, original = self._patched_next
            owner.__next__ = original
            self._patched_next = None

    def _next_steps_batch(self) -> bool:
        """Under forward steps (no optimizer), a batch taken after step N-1's forward began is step N's:
        the loop takes it before the forward that starts step N."""
        watch = self._step_watch
        return (watch is not None and self._steps_ended == self.start_step - 1 and watch.forward_begun
                and watch.by_forwards())

    def _on_batch(self, batch):
        call = self._batch_calls
        if not (self._active or self._next_steps_batch()) or call >= self.batches:
            return batch
        self._batch_calls += 1
        if self.replaying:
            saved = self._manifest.get("batches", [])
            if call >= len(saved):
                return batch
            self.replayed_batches += 1
            return self._replace(batch, saved[call], f"DataLoader batch {call}")
        self._manifest["batches"].append(self._encode(batch))
        return batch

    # ---------------------------------------------------------------- structure codec
    def _encode(self, value, inputs: bool = False):
        if isinstance(value, torch.Tensor):
            if inputs and self._is_activation(value):
                return {"activation": True, "dtype": str(value.dtype), "shape": list(value.shape)}
            self._file_count += 1
            name = f"tensors/{self._file_count:06d}.npy"
            with torch._C.DisableTorchFunction():
                write_tensor(self.directory / name, value)
            # the file holds this rank's shard of a DTensor (FSDP2's state): its shape, not the global one
            return {"tensor": name, "dtype": str(value.dtype), "shape": _stored_shape(value)}
        if isinstance(value, list | tuple):
            return {"list": [self._encode(item, inputs) for item in value]}
        if isinstance(value, dict):
            return {"dict": {str(key): self._encode(item, inputs) for key, item in value.items()}}
        return {"other": type(value).__name__}

    def _decode(self, encoded: dict, live: torch.Tensor) -> torch.Tensor:
        name = encoded.get("tensor")
        if not isinstance(name, str):
            raise UserError(f"{self.directory / MANIFEST}: a tensor entry has no file name ({name!r})")
        path = self._contained.child(self.directory, name, self.directory / MANIFEST)
        array = read_tensor(path, encoded["dtype"], encoded["shape"], recorded_in=MANIFEST)
        dtype = _torch_dtype(encoded["dtype"])
        with torch._C.DisableTorchFunction():
            tensor = torch.from_numpy(array.copy())
            if tensor.dtype != dtype:
                tensor = tensor.view(dtype)  # bf16 / float8 stored as raw bits
            # Same device and (for floats) dtype as the live tensor: a bf16 run gets the recorded values rounded.
            target_dtype = live.dtype if live.is_floating_point() and tensor.is_floating_point() else tensor.dtype
            tensor = tensor.to(device=live.device, dtype=target_dtype)
            distributed = _distributed_tensor(live)
            if distributed is not None:  # FSDP2's parameters and optimizer state: this rank's shard, placed as live
                tensor = distributed.from_local(tensor, live.device_mesh, live.placements, run_check=False,
                                                shape=live.shape, stride=live.stride())
            if live.requires_grad and tensor.is_floating_point():
                tensor.requires_grad_(True)
        return tensor

    def _replace(self, live, encoded, what: str, inputs: bool = False):
        """The live structure with every tensor swapped for its saved counterpart.

        With `inputs`, activations (recorded as such, or activations in this run) are kept."""
        if encoded is None:
            return live
        if isinstance(live, torch.Tensor):
            if inputs and (encoded.get("activation") or self._is_activation(live)):
                return live
            if "tensor" not in encoded:
                raise UserError(f"replay: {what} differs from the recording in {self.directory} (a tensor was not)")
            if _stored_shape(live) != encoded["shape"]:
                raise UserError(
                    f"replay: {what} has shape {_stored_shape(live)} but {encoded['shape']} was recorded in {self.directory}"
                )
            return self._decode(encoded, live)
        if isinstance(live, list | tuple):
            items = encoded.get("list")
            if items is None or len(items) != len(live):
                raise UserError(f"replay: {what} has a different structure than recorded in {self.directory}")
            replaced = [self._replace(item, saved, what, inputs) for item, saved in zip(live, items)]
            if isinstance(live, tuple) and hasattr(live, "_fields"):
                return type(live)(*replaced)
            return type(live)(replaced)
        if isinstance(live, dict):
            items = encoded.get("dict")
            if items is None or set(map(str, live)) != set(items):
                raise UserError(f"replay: {what} has different keys than recorded in {self.directory}")
            return type(live)((key, self._replace(item, items[str(key)], what, inputs)) for key, item in live.items())
        return live


def load_manifest(contained: ContainedPaths, path: Path) -> dict:
    """A recorded replay.json, checked field by field (a UserError names the file). Every file the
    manifest names must lie inside the replay folder (no .., absolute names or symlinks leading
    out): weights are never loaded from elsewhere."""
    path = contained.resolve(path, path)
    manifest = load_json(path)
    if not isinstance(manifest, dict) or manifest.get("version") != _FORMAT_VERSION:
        raise UserError(f"{path}: not a replay manifest of format version {_FORMAT_VERSION}")
    _check_manifest(manifest, path)
    return manifest


def _new_manifest(start_step: int) -> dict:
    return {"version": _FORMAT_VERSION, "modules": [], "forward_inputs": [], "batches": [], "start_step": start_step,
            "optimizers": []}


def _distributed_tensor(tensor):
    """torch.distributed.tensor's DTensor class when `tensor` is one, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None and isinstance(tensor, module.DTensor) else None


def _stored_shape(tensor: torch.Tensor) -> list[int]:
    """The shape of what a tensor file holds of `tensor`: a DTensor's local shard, as written."""
    return list(local_shard(tensor).shape) if _distributed_tensor(tensor) is not None else list(tensor.shape)


def _npu_generators():
    """torch.npu (npukit's emulated device, or a real torch_npu's) when it has device generators, else None."""
    npu = getattr(torch, "npu", None)
    if npu is None or not all(hasattr(npu, name) for name in ("get_rng_state", "set_rng_state", "device_count")):
        return None
    return npu


def _exact_npu_generators():
    """npukit's _C when torch.npu is npukit's emulated device and its generators' full states can be read
    without changing them (replay.py's "Random number generators"), else None."""
    npu = sys.modules.get("npukit.npu_backend.npu")
    if npu is None or getattr(torch, "npu", None) is not npu or not hasattr(npu._C, "_generator_full_state"):
        return None
    return npu._C


def _check_manifest(manifest: dict, path: Path) -> None:
    """Every field the replay reads has the type it expects, so that a broken or hand-edited
    replay.json is named here (field by field) instead of failing inside the user's script."""

    def fail(where: str, what: str):
        raise UserError(f"{path}: {where}: {what}")

    def encoded(value, where: str, depth: int = 0) -> None:
        if depth > 64 or not isinstance(value, dict):
            fail(where, "expected an encoded value (an object with tensor, list, dict or other)")
        if "tensor" in value or value.get("activation") is True:  # an activation is described, not stored
            shape = value.get("shape")
            if "tensor" in value and not isinstance(value["tensor"], str) or not isinstance(value.get("dtype"), str):
                fail(where, "a tensor needs a file name and a dtype (strings)")
            if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                       for n in shape):
                fail(where, f"shape {shape!r} is not a list of sizes >= 0")
        elif "list" in value:
            if not isinstance(value["list"], list):
                fail(where, "\"list\" must be a list")
            for index, item in enumerate(value["list"]):
                encoded(item, f"{where}[{index}]", depth + 1)
        elif "dict" in value:
            if not isinstance(value["dict"], dict):
                fail(where, "\"dict\" must be an object")
            for key, item in value["dict"].items():
                encoded(item, f"{where}[{key!r}]", depth + 1)
        elif not isinstance(value.get("other"), str):
            fail(where, "expected one of tensor, list, dict or other")

    for field in ("modules", "forward_inputs", "batches", "optimizers", "scalers"):
        if not isinstance(manifest.get(field, []), list):
            fail(field, "must be a list")
    start = manifest.get("start_step", 0)
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        fail("start_step", f"{start!r} is not a step number")
    for index, optimizer in enumerate(manifest.get("optimizers", [])):
        where = f"optimizers[{index}]"
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("class"), str) \
                or not isinstance(optimizer.get("state"), list):
            fail(where, "expected an object with a class name and a state list")
        for number, state in enumerate(optimizer["state"]):
            if not isinstance(state, dict):
                fail(f"{where}.state[{number}]", "expected an object")
            for key, value in state.items():
                if isinstance(value, dict) and "value" in value:
                    if not (isinstance(value["value"], bool | int | float) or value["value"] is None):
                        fail(f"{where}.state[{number}][{key!r}]", "a value is a number, a boolean or null")
                else:
                    encoded(value, f"{where}.state[{number}][{key!r}]")
    for index, scaler in enumerate(manifest.get("scalers", [])):
        where = f"scalers[{index}]"
        if not isinstance(scaler, dict) or not isinstance(scaler.get("class"), str):
            fail(where, "expected an object with a class name, scale and growth_tracker")
        for key in ("scale", "growth_tracker"):
            encoded(scaler.get(key), f"{where}.{key}")
            if "tensor" not in scaler[key] or scaler[key]["shape"] not in ([], [1]):
                fail(f"{where}.{key}", "expected a tensor of one number")
    for index, module in enumerate(manifest.get("modules", [])):
        where = f"modules[{index}]"
        if not isinstance(module, dict) or not isinstance(module.get("class"), str) \
                or not isinstance(module.get("state"), dict):
            fail(where, "expected an object with a class name and a state object")
        for key, value in module["state"].items():
            encoded(value, f"{where}.state[{key!r}]")
    for index, item in enumerate(manifest.get("forward_inputs", [])):
        where = f"forward_inputs[{index}]"
        if not isinstance(item, dict) or not all(isinstance(item.get(key), int) and not isinstance(item.get(key), bool)
                                                 for key in ("module", "call")):
            fail(where, "expected an object with integer module and call")
        encoded(item.get("args"), f"{where}.args")
    for index, batch in enumerate(manifest.get("batches", [])):
        encoded(batch, f"batches[{index}]")
    if "rng" in manifest:
        _check_generators(manifest["rng"], fail, encoded)


def _check_generators(states, fail, encoded) -> None:
    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(states, dict):
        fail("rng", "expected an object with torch, npu, python and numpy")
    for field in ("torch", "npu", "python", "numpy"):
        if field not in states:
            fail("rng", f"has no {field!r}")
    for field in ("npu", "npu_exact"):
        if not isinstance(states.get(field, []), list):
            fail(f"rng.{field}", "must be a list")
    for where, state in [("rng.torch", states["torch"]),
                         *((f"rng.{field}[{index}]", state) for field in ("npu", "npu_exact")
                           for index, state in enumerate(states.get(field, [])))]:
        encoded(state, where)
        if "tensor" not in state:
            fail(where, "expected a tensor")
    python = states["python"]
    if not (isinstance(python, list) and len(python) == 3 and integer(python[0]) and isinstance(python[1], list)
            and len(python[1]) == 625 and all(integer(word) for word in python[1])
            and (python[2] is None or isinstance(python[2], float))):
        fail("rng.python", "expected [version, 625 integers, gauss_next]")
    numpy_state = states["numpy"]
    if not (isinstance(numpy_state, dict) and isinstance(numpy_state.get("algorithm"), str)
            and isinstance(numpy_state.get("keys"), list) and all(integer(word) for word in numpy_state["keys"])
            and all(integer(numpy_state.get(key)) for key in ("pos", "has_gauss"))
            and isinstance(numpy_state.get("cached_gaussian"), int | float)
            and not isinstance(numpy_state.get("cached_gaussian"), bool)):
        fail("rng.numpy", "expected an object with algorithm, keys, pos, has_gauss and cached_gaussian")
