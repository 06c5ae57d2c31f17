"""Make a golden run and an NPU run start from the same weights and the same first batches.

    with ReplaySession(Path("replay")):       # first run: records; second run: replays
        runpy.run_path("train.py", run_name="__main__")

First run (DIR has no replay.json): at the first forward of each root module (a module called
while no other module runs) its state_dict is saved -- at that moment the weights are still the
initial ones, whatever the script did to create or move them. The tensor arguments of the first
`batches` root forwards and the first `batches` batches yielded by any DataLoader (so labels too)
are saved as well. Everything is stored pickle-free (.npy + replay.json).

Second run (DIR holds replay.json): the same points load the saved weights into the module
(in place, so an optimizer already holding the parameters keeps working) and substitute the saved
batches and forward arguments, on the device and with the structure the script uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from npukit.accuracy.tensor_io import read_tensor, write_tensor
from npukit.errors import UserError

MANIFEST = "replay.json"
_FORMAT_VERSION = 1


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"replay: unknown dtype {name!r} in {MANIFEST}")
    return dtype


class ReplaySession:
    """Record (first run) or replay (second run) initial weights and first batches in `directory`."""

    def __init__(self, directory: Path, batches: int = 4) -> None:
        if batches < 0:
            raise UserError("--replay: the number of batches must be >= 0")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"--replay: {self.directory} exists and is not a directory")
        self.batches = batches
        self.replaying = (self.directory / MANIFEST).is_file()
        self._manifest = self._load_manifest() if self.replaying else {
            "version": _FORMAT_VERSION, "modules": [], "forward_inputs": [], "batches": [],
        }
        self._roots: dict[int, int] = {}  # id(module) -> index in manifest["modules"]
        self._root_refs: list = []  # keep ids stable while the session runs
        self._forward_calls = 0
        self._batch_calls = 0
        self._depth = 0
        self._handles: list = []
        self._patched_next = None
        self._file_count = 0
        self.replayed_modules = 0
        self.replayed_batches = 0

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> ReplaySession:
        from torch.nn.modules import module as module_hooks

        if not self.replaying:
            (self.directory / "tensors").mkdir(parents=True, exist_ok=True)
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._on_pre_forward),
            module_hooks.register_module_forward_hook(self._on_forward, always_call=True),
        ]
        self._patch_dataloader()
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unpatch_dataloader()
        if not self.replaying:
            tmp = self.directory / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(self._manifest, indent=1))
            os.replace(tmp, self.directory / MANIFEST)

    def _load_manifest(self) -> dict:
        path = self.directory / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: not a valid replay manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("version") != _FORMAT_VERSION:
            raise UserError(f"{path}: not a replay manifest of format version {_FORMAT_VERSION}")
        return manifest

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
            with torch._C.DisableTorchFunction(), torch.no_grad():
                if self.replaying:
                    self._load_state(module, index)
                else:
                    self._save_state(module)
        call = self._forward_calls
        if call >= self.batches:
            return None
        self._forward_calls += 1
        if self.replaying:
            return self._replace(args, self._find_forward_input(index, call), f"forward input {call} of {type(module).__name__}")
        self._manifest["forward_inputs"].append({"module": index, "call": call, "args": self._encode(args)})
        return None

    def _on_forward(self, module, args, output):
        self._depth = max(0, self._depth - 1)

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

    def _on_batch(self, batch):
        call = self._batch_calls
        if call >= self.batches:
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
    def _encode(self, value):
        if isinstance(value, torch.Tensor):
            self._file_count += 1
            name = f"tensors/{self._file_count:06d}.npy"
            with torch._C.DisableTorchFunction():
                write_tensor(self.directory / name, value)
            return {"tensor": name, "dtype": str(value.dtype), "shape": list(value.shape)}
        if isinstance(value, list | tuple):
            return {"list": [self._encode(item) for item in value]}
        if isinstance(value, dict):
            return {"dict": {str(key): self._encode(item) for key, item in value.items()}}
        return {"other": type(value).__name__}

    def _decode(self, encoded: dict, live: torch.Tensor) -> torch.Tensor:
        path = self.directory / encoded["tensor"]
        array = read_tensor(path, encoded["dtype"], encoded["shape"])
        dtype = _torch_dtype(encoded["dtype"])
        with torch._C.DisableTorchFunction():
            tensor = torch.from_numpy(array.copy())
            if tensor.dtype != dtype:
                tensor = tensor.view(dtype)  # bf16 / float8 stored as raw bits
            # Same device and (for floats) dtype as the live tensor: a bf16 run gets the recorded values rounded.
            target_dtype = live.dtype if live.is_floating_point() and tensor.is_floating_point() else tensor.dtype
            tensor = tensor.to(device=live.device, dtype=target_dtype)
            if live.requires_grad and tensor.is_floating_point():
                tensor.requires_grad_(True)
        return tensor

    def _replace(self, live, encoded, what: str):
        """The live structure with every tensor swapped for its saved counterpart."""
        if encoded is None:
            return live
        if isinstance(live, torch.Tensor):
            if "tensor" not in encoded:
                raise UserError(f"replay: {what} differs from the recording in {self.directory} (a tensor was not)")
            if list(live.shape) != encoded["shape"]:
                raise UserError(
                    f"replay: {what} has shape {list(live.shape)} but {encoded['shape']} was recorded in {self.directory}"
                )
            return self._decode(encoded, live)
        if isinstance(live, list | tuple):
            items = encoded.get("list")
            if items is None or len(items) != len(live):
                raise UserError(f"replay: {what} has a different structure than recorded in {self.directory}")
            replaced = [self._replace(item, saved, what) for item, saved in zip(live, items)]
            if isinstance(live, tuple) and hasattr(live, "_fields"):
                return type(live)(*replaced)
            return type(live)(replaced)
        if isinstance(live, dict):
            items = encoded.get("dict")
            if items is None or set(map(str, live)) != set(items):
                raise UserError(f"replay: {what} has different keys than recorded in {self.directory}")
            return type(live)((key, self._replace(item, items[str(key)], what)) for key, item in live.items())
        return live

