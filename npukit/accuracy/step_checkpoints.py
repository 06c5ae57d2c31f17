"""`npu-run --monitor DIR --monitor-checkpoint-every K`: the state at the start of steps K, 2K, 3K ...
recorded as `--replay DIR --replay-step N` records it (replay.py: every root module's weights and
buffers, every optimizer's state, every GradScaler's loss scale and growth tracker, the global random
number generators', read without changing what the run draws next, so a run writing checkpoints
computes what it computes without them; no batches: a re-run's own data loader yields them), each into
DIR/checkpoints/step-N/ (under torchrun per rank, step-N/rank{R}/, as --replay lays out its folders).
So each is a folder `npu-run --replay DIR/checkpoints/step-N --replay-step N` loads, and
`npu-compare --trend --localize` starts its golden re-run from the latest one at or before the step
it localizes (localize.py).

Every checkpoint is kept: a departure may be localized at any step, and the earliest is the one
that matters. Each holds the weights and the optimizer's state (Adam: three times the parameters'
bytes), so K sets the disk use; the line printed as the run ends gives the count and the size.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from npukit.accuracy.replay import MANIFEST, ReplaySession, _new_manifest, load_manifest
from npukit.errors import UserError
from npukit.files import ContainedPaths, output_folder, refuse_links_inside, write_text_atomic

CHECKPOINTS = "checkpoints"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def checkpoint_folders(monitor: Path) -> dict[int, Path]:
    """A monitor folder's checkpoints: step -> its folder (DIR/checkpoints/step-N), none when it has none."""
    folder = Path(monitor) / CHECKPOINTS
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _STEP_FOLDER.match(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def latest_checkpoint(monitor: Path, step: int) -> tuple[int, Path] | None:
    """(K, its folder): the monitor's latest checkpoint of a step K <= step, its manifests checked
    (a broken one, or one of another step, is a UserError naming the file); None without one."""
    earlier = [known for known in checkpoint_folders(monitor) if known <= step]
    if not earlier:
        return None
    latest = max(earlier)
    folder = checkpoint_folders(monitor)[latest]
    manifests = [folder / MANIFEST] if (folder / MANIFEST).is_file() else sorted(folder.glob(f"rank*/{MANIFEST}"))
    if not manifests:
        raise UserError(f"{folder / MANIFEST}: no such file: {folder} is not a whole checkpoint (written by npu-run "
                        "--monitor-checkpoint-every); remove it or record the golden run again")
    contained = ContainedPaths(folder)
    for path in manifests:
        recorded = load_manifest(contained, path).get("start_step", 0)
        if recorded != latest:
            raise UserError(f"{path}: holds the state at step {recorded}'s start, not step {latest}'s as its folder "
                            "says")
    return latest, folder


class StepCheckpoints(ReplaySession):
    """Record the state at the start of every `every`-th step (not step 0's: a re-run starts there
    anyway) into monitor/checkpoints/step-N/."""

    def __init__(self, monitor: Path, every: int) -> None:
        if every < 1:
            raise UserError(f"--monitor-checkpoint-every must be at least 1, got {every}")
        # start_step=every: ReplaySession counts steps (RunSteps) and records nothing before it
        super().__init__(Path(monitor) / CHECKPOINTS, batches=0, start_step=every)
        self.every = every
        self.written: list[Path] = []
        self.bytes_written = 0

    def _prepare_output(self) -> None:
        """An earlier run's checkpoints would be taken for this run's: removed as the monitor removes its files."""
        refuse_links_inside(self.root_directory, "--monitor-checkpoint-every", depth=2)
        for folder in checkpoint_folders(self.root_directory.parent).values():
            shutil.rmtree(folder)

    def _on_step_end(self, optimizer, skipped: bool, loss_scale) -> None:
        self._steps_ended += 1
        step = self._steps_ended
        if step % self.every:
            return
        rank = () if self.rank is None else (f"rank{self.rank}",)
        self.directory = output_folder(self.root_directory, f"step-{step}", *rank)
        output_folder(self.directory, "tensors")
        self._manifest, self._file_count = _new_manifest(step), 0
        self._step_state()
        write_text_atomic(self.directory / MANIFEST, json.dumps(self._manifest, indent=1))
        self.written.append(self.directory)
        self.bytes_written += sum(path.stat().st_size for path in self.directory.rglob("*") if path.is_file())

    def __exit__(self, exc_type, *exc_info) -> None:
        self.remove_hooks()
        if self.written:
            size = self.bytes_written / len(self.written)
            size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
            print(f"npukit monitor: {len(self.written)} checkpoint(s) of the state at a step's start "
                  f"({size} each) in {self.root_directory}/step-N (every {self.every} steps, the last "
                  f"step-{self._steps_ended - self._steps_ended % self.every}); npu-compare --trend --localize "
                  "starts its golden re-run from them", file=sys.stderr)
