"""The compact event table: one row per recorded op or annotation, stored as columns.

Saved as `events.npz` (numpy arrays only, loaded with allow_pickle=False) so a 100k-event
profile loads in milliseconds and every summary is a vectorized pass over these columns.
Strings (op names, shapes, dtypes, devices, stack lines, module paths) live once in a shared
string pool; the *_id columns index into it, -1 meaning "none".
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from npukit.errors import UserError
from npukit.files import atomic_open, load_json

SCHEMA_VERSION = 1
EVENTS_FILE = "events.npz"
META_FILE = "meta.json"

# kind: what a row is.
KIND_OP = 0  # an operator (aten::mm, c10d::allreduce_ ...)
KIND_ANNOTATION = 1  # record_function range: ProfilerStep#3, Optimizer.step#..., DataLoader, user labels
KIND_AUTOGRAD = 2  # autograd engine node (evaluate_function: MmBackward0, MmBackward0)
KIND_GC = 3  # Python garbage-collection pause
KIND_COMM = 4  # a collective as its process group runs it, on that group's own thread (gloo:all_reduce)

# phase: which part of a training step an op belongs to.
PHASE_OTHER, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_DATALOADER = range(5)
PHASE_NAMES = ("other", "forward", "backward", "optimizer", "dataloader")

_INT_COLUMNS = {
    "name_id": np.int32,
    "kind": np.int8,
    "phase": np.int8,
    "parent": np.int32,
    "thread": np.int32,
    "step": np.int32,
    "shapes_id": np.int32,
    "dtypes_id": np.int32,
    "devices_id": np.int32,
    "stack_id": np.int32,
    "module_id": np.int32,
    "seq": np.int64,
}
_TIME_COLUMNS = {"start_ns": np.int64, "dur_ns": np.int64}
_COST_COLUMNS = {"flops": np.float64, "bytes": np.float64, "top_level": np.bool_}
# Columns that tables recorded by an earlier npukit lack: read as all False, or (ids) all -1, "none".
_ADDED_COLUMNS = {"framework": np.bool_, "sources_id": np.int32}
COLUMN_DTYPES = {**_INT_COLUMNS, **_TIME_COLUMNS, **_COST_COLUMNS, **_ADDED_COLUMNS}


@dataclass
class EventTable:
    """Columns of equal length N plus the string pool; see COLUMN_DTYPES for the columns.

    parent: row index of the enclosing recorded event (-1 for roots); rows are in start order
    per thread. top_level: an op whose parent is not an op (what a user's code called; the unit
    for NPU time estimates). flops/bytes: this op's own cost estimate (0 when unknown).
    framework: an op that torch.distributed's own Python (FSDP sharding and gathering parameters,
    DDP's helpers) or the emulated hccl group called: real work, but not the user's code to change.
    sources_id: of a top-level op, where each tensor input came from, as "d1,d2,...": d rows back to
    the top-level op that wrote its storage (allocated it, or changed it in place), empty when not
    known (data flow, from the allocations a profile records; meta "data_flow").
    """

    strings: list[str]
    name_id: np.ndarray
    kind: np.ndarray
    phase: np.ndarray
    parent: np.ndarray
    thread: np.ndarray
    step: np.ndarray
    shapes_id: np.ndarray
    dtypes_id: np.ndarray
    devices_id: np.ndarray
    stack_id: np.ndarray
    module_id: np.ndarray
    seq: np.ndarray
    start_ns: np.ndarray
    dur_ns: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    top_level: np.ndarray
    framework: np.ndarray
    sources_id: np.ndarray
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.name_id)

    @classmethod
    def column_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("strings", "meta")]

    def string_array(self) -> np.ndarray:
        """The pool as a numpy array with a trailing "" so that id -1 maps to an empty string."""
        return np.array([*self.strings, ""], dtype=object)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.string_array()[ids]

    def op_steps(self) -> list[int]:
        """Recorded steps that ran at least one op (a trailing empty ProfilerStep range is not a step)."""
        steps = self.step[(self.kind == KIND_OP) & (self.step >= 0)]
        return np.unique(steps).tolist()

    def in_steps(self) -> np.ndarray:
        """Rows inside the recorded steps, or every row when there are none. Per-step figures count
        these: not the setup before the first step (the model loaded and moved to the device) nor
        what runs after the last one (saving, a final print)."""
        inside = self.step >= 0
        return inside if inside.any() else np.ones(len(self), dtype=bool)

    def self_ns(self) -> np.ndarray:
        """Self time = duration minus the durations of direct children (one bincount)."""
        has_parent = self.parent >= 0
        child_sum = np.bincount(
            self.parent[has_parent], weights=self.dur_ns[has_parent], minlength=len(self)
        )
        return np.maximum(self.dur_ns - child_sum.astype(np.int64), 0)

    def save(self, directory: Path) -> Path:
        """Write events.npz atomically (a temp file renamed into place)."""
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {name: np.asarray(getattr(self, name), dtype=COLUMN_DTYPES[name]) for name in self.column_names()}
        arrays["strings"] = np.array(self.strings, dtype=np.str_) if self.strings else np.zeros(0, dtype="<U1")
        arrays["schema_version"] = np.array(SCHEMA_VERSION)
        target = directory / EVENTS_FILE
        with atomic_open(target, "wb") as handle:
            np.savez(handle, **arrays)
        return target

    @classmethod
    def load(cls, directory: Path) -> EventTable:
        path = directory / EVENTS_FILE
        if not path.is_file():
            raise UserError(f"{directory}: no {EVENTS_FILE} here; record one with `npu-run --profile {directory} script.py`")
        try:
            with np.load(path, allow_pickle=False) as data:
                version = int(data["schema_version"]) if "schema_version" in data else -1
                if version != SCHEMA_VERSION:
                    raise UserError(f"{path}: event table schema {version}, this npukit reads schema {SCHEMA_VERSION}; re-record the profile")
                columns = {name: data[name] for name in cls.column_names() if name not in _ADDED_COLUMNS or name in data}
                rows = len(columns["name_id"])
                columns.update({name: np.full(rows, -1 if name.endswith("_id") else 0, dtype)
                                for name, dtype in _ADDED_COLUMNS.items() if name not in columns})
                strings = data["strings"].tolist()
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            reason = str(exc) or type(exc).__name__
            if "pickle" in reason:  # numpy's message would advise loading it unsafely
                reason = "it holds pickled Python objects, which npukit never loads"
            raise UserError(f"{path}: not a readable npukit event table ({reason})") from None
        _check_columns(path, columns, strings)
        meta = read_meta(directory)
        return cls(strings=strings, meta=meta, **columns)

    @classmethod
    def concat(cls, tables: list[EventTable]) -> EventTable:
        """Join tables (e.g. several schedule cycles) into one, remapping string ids and parents."""
        strings: list[str] = []
        index: dict[str, int] = {}
        parts: dict[str, list[np.ndarray]] = {name: [] for name in cls.column_names()}
        offset = 0
        origin = tables[0].meta.get("origin_ns") if tables else None
        for table in tables:
            # each cycle's times count from its own first event: count them from the first cycle's
            shift = table.meta.get("origin_ns", origin) - origin if isinstance(origin, int) else 0
            remap = np.array([index.setdefault(s, len(index)) for s in table.strings] + [-1], dtype=np.int32)
            for name in cls.column_names():
                column = np.asarray(getattr(table, name))
                if name.endswith("_id"):
                    column = remap[column]
                elif name == "parent":
                    column = np.where(column >= 0, column + offset, -1)
                elif name == "start_ns" and shift:
                    column = column + shift
                parts[name].append(column)
            offset += len(table)
        strings = list(index)
        columns = {
            name: np.concatenate(chunks).astype(COLUMN_DTYPES[name]) if chunks else np.zeros(0, COLUMN_DTYPES[name])
            for name, chunks in parts.items()
        }
        meta = dict(tables[0].meta) if tables else {}
        return cls(strings=strings, meta=meta, **columns)


def _check_columns(path: Path, columns: dict[str, np.ndarray], strings: list) -> None:
    """A table from elsewhere: every column of the right kind and length, every id inside the
    string pool and every parent a row (a crafted table must not show another op's name)."""
    rows = None
    for name, column in columns.items():
        expected = np.dtype(COLUMN_DTYPES[name])
        if column.ndim != 1 or column.dtype.kind != expected.kind:
            raise UserError(f"{path}: column {name} holds {column.dtype}{list(column.shape)}, expected a 1-d {expected}")
        rows = len(column) if rows is None else rows
        if len(column) != rows:
            raise UserError(f"{path}: column {name} has {len(column)} rows, other columns {rows}")
    if not all(isinstance(text, str) for text in strings):
        raise UserError(f"{path}: the string pool holds non-text values")
    for name, column in columns.items():
        if not len(column):
            continue
        if name.endswith("_id"):
            low = 0 if name == "name_id" else -1
            if column.min() < low or column.max() >= len(strings):
                raise UserError(f"{path}: column {name} refers to strings outside the pool of {len(strings)}"
                                f" (values {column.min()} to {column.max()})")
        elif name == "parent" and (column.min() < -1 or column.max() >= rows):
            raise UserError(f"{path}: column parent refers to rows outside the table of {rows}")


def write_meta(directory: Path, meta: dict) -> None:
    with atomic_open(directory / META_FILE) as handle:
        json.dump(meta, handle, indent=2)


def read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    if not path.is_file():
        return {}
    meta = load_json(path)
    if not isinstance(meta, dict):
        raise UserError(f"{path}: expected an object, found {type(meta).__name__}")
    return meta


class TableBuilder:
    """Append rows one at a time (used while walking the profiler tree and by tests)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._rows: dict[str, list] = {name: [] for name in EventTable.column_names()}

    def intern(self, text: str | None) -> int:
        if text is None:
            return -1
        found = self._index.get(text)
        if found is None:
            found = self._index[text] = len(self._index)
        return found

    def __len__(self) -> int:
        return len(self._rows["name_id"])

    def add(
        self,
        name: str,
        *,
        start_ns: int,
        dur_ns: int,
        kind: int = KIND_OP,
        phase: int = PHASE_OTHER,
        parent: int = -1,
        thread: int = 0,
        step: int = -1,
        shapes: str | None = None,
        dtypes: str | None = None,
        devices: str | None = None,
        stack: str | None = None,
        module: str | None = None,
        seq: int = -1,
        flops: float = 0.0,
        nbytes: float = 0.0,
        top_level: bool = False,
        framework: bool = False,
        sources: str | None = None,
    ) -> int:
        rows = self._rows
        row = len(rows["name_id"])
        rows["name_id"].append(self.intern(name))
        rows["kind"].append(kind)
        rows["phase"].append(phase)
        rows["parent"].append(parent)
        rows["thread"].append(thread)
        rows["step"].append(step)
        rows["shapes_id"].append(self.intern(shapes))
        rows["dtypes_id"].append(self.intern(dtypes))
        rows["devices_id"].append(self.intern(devices))
        rows["stack_id"].append(self.intern(stack))
        rows["module_id"].append(self.intern(module))
        rows["seq"].append(seq)
        rows["start_ns"].append(start_ns)
        rows["dur_ns"].append(dur_ns)
        rows["flops"].append(flops)
        rows["bytes"].append(nbytes)
        rows["top_level"].append(top_level)
        rows["framework"].append(framework)
        rows["sources_id"].append(self.intern(sources))
        return row

    def set(self, row: int, column: str, value) -> None:
        self._rows[column][row] = value

    def get(self, row: int, column: str):
        return self._rows[column][row]

    def build(self, meta: dict | None = None) -> EventTable:
        columns = {name: np.asarray(values, dtype=COLUMN_DTYPES[name]) for name, values in self._rows.items()}
        return EventTable(strings=list(self._index), meta=dict(meta or {}), **columns)
