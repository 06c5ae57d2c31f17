"""Read dump directories written by npukit's DumpSession or by msprobe.

Accepted layouts (DIR is what the user passes to npu-compare):

    DIR/dump.json                       one rank
    DIR/rank{N}/dump.json               msprobe, one step (also `rank/` and `proc{pid}/`)
    DIR/step{S}/rank{N}/dump.json       npukit and msprobe, several steps

Every problem (bad JSON, a leaf without dtype, a missing data file) is a UserError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from npukit.accuracy import naming
from npukit.errors import UserError
from npukit.files import ContainedPaths, load_json

_RANK_DIR = re.compile(r"^(rank\d*|proc\d+)$")
_STEP_DIR = re.compile(r"^step(\d+)$")
TENSOR_DATA_DIR = "dump_tensor_data"
# torch dtype names (msprobe writes them with or without "torch."): float*, bfloat16, int*, uint*,
# complex*, bool, the quantized and bit types.
_DTYPE_NAME = re.compile(r"(torch\.)?(float|bfloat|int|uint|complex|bool|qint|quint|bits|half|double|long|short)\w*")


@dataclass(slots=True)
class TensorLeaf:
    """One tensor of one entry: `Functional.conv2d.0.forward.input.0`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stats: tuple | None  # (Max, Min, Mean, Norm) as floats, None when not recorded
    nan_count: int | None
    inf_count: int | None
    requires_grad: bool | None
    data_path: Path | None
    md5: str | None
    producer: str | None
    suffix: str  # `input.0` / `output.1` / `parameters.weight`: what pairs leaves of matched entries
    uninitialized: bool = False  # uninitialized memory, or an input an in-place op overwrites: not compared

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(slots=True)
class DumpEntry:
    name: str
    base: str  # name without call index: the alignment key
    direction: str
    inputs: list[TensorLeaf] = field(default_factory=list)
    outputs: list[TensorLeaf] = field(default_factory=list)
    params: list[TensorLeaf] = field(default_factory=list)
    parent: str | None = None
    stack: list[str] = field(default_factory=list)
    # Python floats among the inputs, by suffix (`input.1`): a value taken out of a tensor with
    # .item() and passed back (`R - value.item()`) carries that tensor's difference with it.
    numbers: dict[str, float] = field(default_factory=dict)
    # Python bools among a forward entry's inputs, by suffix (`input.5`: batch_norm's `training`).
    flags: dict[str, bool] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Alignment key: the name without call index; modules by path alone, so a module whose
        class differs between the runs (a fused NPU replacement, a patched layer) still pairs."""
        if self.name.startswith("Module.") and self.base.count(".") >= 2:
            return f"{self.base.rpartition('.')[0]}.{self.direction}"
        return f"{naming.operator_op(self.base)}.{self.direction}"

    def leaves(self):
        yield from self.inputs
        yield from self.params
        yield from self.outputs


INCOMPLETE = "npukit_incomplete"  # dump.json key: what the dump could not record
INTERNAL_ERROR = "internal_error"  # a hook switched itself off: everything after `where` is missing
COMPILED_REGION = "compiled_region"  # a torch.compile(fullgraph=True) region ran compiled, undumped
OPTIMIZER = "optimizer"  # construct.json: the parent of the apis an optimizer.step runs (msprobe's)
# dump.json key: {api backward entry: the tensor argument each gradient of its `output` is for}, for
# those numbered by their autograd node's edges, as msprobe numbers them, not by argument
ARGUMENTS = "npukit_arguments"


@dataclass(frozen=True, slots=True)
class Incomplete:
    """One gap of a dump, as the dump wrote it in "npukit_incomplete"."""

    kind: str  # INTERNAL_ERROR | COMPILED_REGION
    where: str  # the api or module it happened at
    detail: str  # the error message, or what the region is

    def text(self) -> str:
        if self.kind == INTERNAL_ERROR:
            detail = self.detail.removeprefix("internal error in ")  # the dump's message may start so
            return f"recording stopped at {self.where} after an internal error ({detail}): everything after it is missing"
        return f"{self.where} ran compiled (torch.compile fullgraph) and was not dumped" + (
            f" ({self.detail})" if self.detail else "")


@dataclass(slots=True)
class RankDump:
    path: Path  # the directory holding dump.json
    label: str  # "step0/rank0"
    task: str
    entries: list[DumpEntry]
    has_producers: bool
    skipped_at_loss_scale: float | None = None  # GradScaler skipped this step's optimizer update
    by_npukit: bool = True  # False: another tool wrote it (msprobe): its api backward entries mean other things
    hf32: frozenset = frozenset()  # op kinds ("conv", "matmul") the run computed in HF32 when fp32
    incomplete: list[Incomplete] = field(default_factory=list)  # what the dump left out (dump.json "npukit_incomplete")

    def by_name(self) -> dict[str, DumpEntry]:
        return {entry.name: entry for entry in self.entries}


def find_rank_dirs(root: Path) -> dict[str, Path]:
    """Map "step0/rank0"-style labels to directories holding a dump.json."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"{root}: no such dump directory")
    if root.is_file():
        if root.name == "dump.json":
            return {"": root.parent}
        raise UserError(f"{root}: expected a dump directory or a dump.json file")
    if (root / "dump.json").is_file():
        return {"": root}
    found: dict[str, Path] = {}
    for child in _listing(root):
        if not child.is_dir():
            continue
        if _RANK_DIR.match(child.name) and (child / "dump.json").is_file():
            found[child.name] = child
        elif _STEP_DIR.match(child.name):
            for rank_dir in _listing(child):
                if rank_dir.is_dir() and _RANK_DIR.match(rank_dir.name) and (rank_dir / "dump.json").is_file():
                    found[f"{child.name}/{rank_dir.name}"] = rank_dir
    if not found:
        raise UserError(f"{root}: no dump.json found (expected DIR/step*/rank*/dump.json)")
    return dict(sorted(found.items(), key=lambda item: _label_sort_key(item[0])))


def _listing(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError as exc:
        raise UserError(f"{folder}: cannot read this folder ({exc.strerror or exc})") from None


def _label_sort_key(label: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


def load_rank_dump(rank_dir: Path, label: str = "", contained: ContainedPaths | None = None) -> RankDump:
    """One rank's dump. Every file it reads (its JSON files, each data_name) must lie inside
    `contained`'s folder (by default the rank folder) once symlinks are resolved."""
    contained = contained or ContainedPaths(rank_dir)
    dump_path = contained.resolve(rank_dir / "dump.json", rank_dir / "dump.json")
    _check_memory_for(dump_path)
    data_dir = rank_dir / TENSOR_DATA_DIR
    stacks = _load_stacks(contained.resolve(rank_dir / "stack.json", rank_dir / "stack.json"))
    construct_path = contained.resolve(rank_dir / "construct.json", rank_dir / "construct.json")
    construct = load_json(construct_path) if construct_path.is_file() else {}
    if not isinstance(construct, dict):
        raise UserError(f"{construct_path}: expected an object mapping entry names to parents")
    parser = _LeafParser(dump_path, data_dir, contained)
    entries = []
    header: dict = {}
    saw_data = False
    for kind, name, body in _stream_dump(dump_path):
        if kind == "header":
            header[name] = body
            continue
        saw_data = True
        if name is None:
            continue  # an empty "data" object
        if not isinstance(body, dict):
            raise UserError(f"{dump_path}: entry {name!r} is not an object")
        try:
            entries.append(parser.entry(name, body, construct.get(name), stacks.get(name, [])))
        except RecursionError:
            raise UserError(f"{dump_path}: entry {name!r} is nested too deeply to be a dump entry") from None
    if not saw_data:
        raise UserError(f"{dump_path}: not a dump.json (no \"data\" object)")
    _to_argument_positions(entries, header.get(ARGUMENTS), dump_path)
    # Dumps from before the DUMPED_BY key are npukit's when they hold producer links (msprobe writes none).
    by_npukit = header.get(DUMPED_BY) == "npukit" or parser.saw_producer
    return RankDump(rank_dir, label, str(header.get("task", "")), entries, parser.saw_producer,
                    _skipped_at_loss_scale(header, dump_path), by_npukit, _hf32_ops(header, dump_path),
                    _incomplete(header, dump_path))


def _to_argument_positions(entries: list[DumpEntry], arguments, dump_path: Path) -> None:
    """The api backward entries numbered by their autograd node's edges, as msprobe numbers them
    (ARGUMENTS: the argument each edge's gradient is for): their gradients renamed
    `output.<argument>`, as npukit numbers the others, so that every npukit backward pairs by argument."""
    if arguments is None:
        return
    if not isinstance(arguments, dict):
        raise UserError(f"{dump_path}: \"{ARGUMENTS}\" must be an object of entry names, found {arguments!r:.60}")
    for entry in entries:
        positions = arguments.get(entry.name)
        if entry.direction != naming.BACKWARD or not isinstance(positions, list):
            continue
        for leaf in entry.outputs:
            place, _, rest = leaf.suffix.removeprefix("output.").partition(".")
            if place.isdigit() and int(place) < len(positions) and isinstance(positions[int(place)], int):
                leaf.suffix = f"output.{positions[int(place)]}" + (f".{rest}" if rest else "")


DUMPED_BY = "dumped_by"  # dump.json key naming the writer
HF32_OPS = "hf32"  # dump.json key: the op kinds computed in HF32 (["conv"] at torch_npu's defaults)


def _hf32_ops(header: dict, dump_path: Path) -> frozenset:
    kinds = header.get(HF32_OPS, [])
    if not isinstance(kinds, list) or not set(kinds) <= {"conv", "matmul"}:
        raise UserError(f"{dump_path}: \"{HF32_OPS}\" is {kinds!r}; expected a list of \"conv\", \"matmul\"")
    return frozenset(kinds)


def _incomplete(header: dict, dump_path: Path) -> list[Incomplete]:
    items = header.get(INCOMPLETE, [])
    if not isinstance(items, list):
        raise UserError(f"{dump_path}: \"{INCOMPLETE}\" is {items!r}; expected a list of objects")
    found = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or item.get("kind") not in (INTERNAL_ERROR, COMPILED_REGION) \
                or not all(isinstance(item.get(key, ""), str) for key in ("where", "detail")):
            raise UserError(f"{dump_path}: \"{INCOMPLETE}\" item {index} is {item!r}; expected"
                            f" {{\"kind\": \"{INTERNAL_ERROR}\" or \"{COMPILED_REGION}\", \"where\": str, \"detail\": str}}")
        found.append(Incomplete(item["kind"], item.get("where", ""), item.get("detail", "")))
    return found


_SPACE = re.compile(r"[ \t\n\r]*")
# Parsed entries take about this many times the size of their dump.json (measured: 746 MB for a
# 135 MB file of 200,000 entries).
_MEMORY_PER_BYTE = 6


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory_for(dump_path: Path) -> None:
    """Refuse, naming the file, a dump.json this machine cannot hold parsed, rather than exhaust it."""
    try:
        size = dump_path.stat().st_size
    except OSError:
        return  # missing or unreadable: the reader names it
    available = _available_memory()
    need = size * _MEMORY_PER_BYTE
    if available is not None and need > 0.8 * available:
        raise UserError(f"{dump_path}: {size / 2**20:.0f} MB of entries need about {need / 2**30:.1f} GB to compare"
                        f" and {available / 2**30:.1f} GB are free; dump fewer entries (--dump-scope, --dump-list,"
                        " --dump-steps) or compare on a machine with more memory")


def _stream_dump(path: Path):
    """dump.json's top-level fields, ("header", key, value), and its "data" entries one at a time,
    ("entry", name, body) -- ("entry", None, None) for an empty "data" -- so that a dump of a million
    entries is never held as one dict next to the parsed entries (3.5 GB for a 300 MB file)."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file ({exc.reason})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    decoder = json.JSONDecoder()

    def value_at(position: int):
        try:
            return decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deeply to be a dump, replay or profile file") from None

    def expect(position: int, characters: str) -> tuple[str, int]:
        position = _SPACE.match(text, position).end()
        if position >= len(text) or text[position] not in characters:
            found = text[position:position + 1] or "the end of the file"
            line = text.count("\n", 0, position) + 1
            raise UserError(f"{path}: invalid JSON at line {line}: expected {' or '.join(characters)}, found {found!r}")
        return text[position], position + 1

    def key_at(position: int) -> tuple[str, int]:
        """`"key" :` from position: the key and the position of its value."""
        _, position = expect(position, '"')
        key, position = value_at(position - 1)
        _, position = expect(position, ":")
        return key, _SPACE.match(text, position).end()

    character, position = expect(0, "{")
    character, position = expect(position, '}"')
    while character != "}":
        key, position = key_at(position - 1)
        if key == "data" and text.startswith("{", position):
            character, position = expect(position + 1, '}"')
            if character == "}":
                yield "entry", None, None
            while character != "}":
                name, position = key_at(position - 1)
                body, position = value_at(position)
                yield "entry", name, body
                character, position = expect(position, ",}")
                if character == ",":
                    character, position = expect(position, '"')
        else:
            value, position = value_at(position)
            yield "header", key, value
        character, position = expect(position, ",}")
        if character == ",":
            character, position = expect(position, '"')
    if text[position:].strip():
        raise UserError(f"{path}: invalid JSON: more text after the top-level object")


def _skipped_at_loss_scale(payload: dict, dump_path: Path) -> float | None:
    skipped = payload.get("step_skipped_by_grad_scaler")
    if skipped is None:
        return None
    scale = skipped.get("loss_scale") if isinstance(skipped, dict) else None
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise UserError(f"{dump_path}: \"step_skipped_by_grad_scaler\" must be an object with a numeric \"loss_scale\"")
    return float(scale)


def _load_stacks(path: Path) -> dict[str, list[str]]:
    """stack.json in either msprobe format: {name: lines} or {"0": [[names], lines]}."""
    if not path.is_file():
        return {}
    payload = load_json(path)
    if not isinstance(payload, dict):
        raise UserError(f"{path}: expected an object")
    stacks: dict[str, list[str]] = {}
    for key, value in payload.items():
        if (
            isinstance(value, list) and len(value) == 2
            and isinstance(value[0], list) and isinstance(value[1], list)
        ):
            for name in value[0]:
                stacks[str(name)] = [str(line) for line in value[1]]
        elif isinstance(value, list):
            stacks[key] = [str(line) for line in value]
    return stacks


class _LeafParser:
    def __init__(self, dump_path: Path, data_dir: Path, contained: ContainedPaths) -> None:
        self.dump_path = dump_path
        self.data_dir = data_dir
        self.contained = contained
        self.saw_producer = False
        self.entry_name = ""
        self.flags: dict[str, bool] = {}  # the current entry's

    def entry(self, name: str, body: dict, parent, stack) -> DumpEntry:
        base, direction, _ = naming.split_entry_name(name)
        self.entry_name = name
        entry = DumpEntry(name, base, direction, parent=parent if isinstance(parent, str) else None, stack=stack)
        self.flags = entry.flags
        if direction == naming.PARAMETERS_GRAD:
            for key, value in body.items():
                if isinstance(value, list) and len(value) == 1:
                    value = value[0]  # msprobe's {"weight": [leaf]}: the same leaf as npukit's {"weight": leaf}
                self._collect(value, f"{name}.{key}", entry.params)
            return entry
        # forward: input_args / input_kwargs / output / parameters;
        # backward: input (grads of outputs) / output (grads of inputs); older dumps say grad_*.
        for key in ("input_args", "input", "grad_output", "output", "grad_input", "input_kwargs", "parameters"):
            if body.get(key) is not None and not isinstance(body[key], list | dict):
                raise UserError(f"{self.dump_path}: entry {name}: \"{key}\" must be a list or an object, "
                                f"found {type(body[key]).__name__} {body[key]!r:.40}")
        numbers = entry.numbers if direction == naming.FORWARD else None
        for key in ("input_args", "input", "grad_output"):
            if key in body:
                self._collect(body[key], f"{name}.input", entry.inputs, numbers)
        kwargs = body.get("input_kwargs")
        if isinstance(kwargs, dict):
            for key, value in kwargs.items():
                first = len(entry.inputs)
                self._collect(value, f"{name}.input.{key}", entry.inputs, numbers)
                position = naming.argument_position(base, key) if base.startswith("Functional.") else None
                if position is not None:  # pairs with the same argument given by position
                    for leaf in entry.inputs[first:]:
                        leaf.suffix = f"input.{position}" + leaf.suffix[len(f"input.{key}"):]
                    if f"input.{key}" in entry.numbers:
                        entry.numbers[f"input.{position}"] = entry.numbers.pop(f"input.{key}")
        for key in ("output", "grad_input"):
            if key in body:
                grads = body[key]
                if direction == naming.BACKWARD and base.startswith("Module.") and isinstance(grads, list):
                    # an argument that needs no gradient has no place (msprobe, npukit since):
                    # older npukit dumps hold a null there
                    grads = [grad for grad in grads if grad is not None]
                self._collect(grads, f"{name}.output", entry.outputs)
        parameters = body.get("parameters")
        if isinstance(parameters, dict):
            for key, value in parameters.items():
                self._collect(value, f"{name}.parameters.{key}", entry.params)
        return entry

    def _collect(self, value, leaf_name: str, into: list, numbers: dict | None = None) -> None:
        if isinstance(value, list):
            for index, item in enumerate(value):
                self._collect(item, f"{leaf_name}.{index}", into, numbers)
        elif isinstance(value, dict):
            kind = value.get("type")
            if kind in ("torch.Tensor", "mindspore.Tensor", "numpy.ndarray"):
                into.append(self._tensor(value, leaf_name))
            elif kind == "bool" and numbers is not None and isinstance(value.get("value"), bool):
                self.flags[leaf_name[len(self.entry_name) + 1:]] = value["value"]
            elif kind == "float" and numbers is not None:
                number = value.get("value")
                if isinstance(number, int | float) and not isinstance(number, bool) and not math.isnan(number):
                    numbers[leaf_name[len(self.entry_name) + 1:]] = float(number)
            elif "type" not in value:
                for key, item in value.items():
                    self._collect(item, f"{leaf_name}.{key}", into, numbers)

    def _tensor(self, value: dict, leaf_name: str) -> TensorLeaf:
        dtype = value.get("dtype")
        shape = value.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape
        ):
            raise UserError(f"{self.dump_path}: tensor {leaf_name} has no dtype/shape (or a malformed one: "
                            f"dtype {dtype!r}, shape {shape!r})")
        if not _DTYPE_NAME.fullmatch(dtype):
            raise UserError(f"{self.dump_path}: tensor {leaf_name} has an unknown dtype {dtype!r}")
        data_name = value.get("data_name")
        if data_name is not None and not isinstance(data_name, str):
            raise UserError(f"{self.dump_path}: tensor {leaf_name} has a data_name that is not a file name "
                            f"({data_name!r})")
        stats = None
        if "Max" in value:
            stats = tuple(_number(value.get(key), self.dump_path, leaf_name) for key in ("Max", "Min", "Mean", "Norm"))
            if stats[3] is not None:  # a 0-d tensor's Norm is its value, sign kept (msprobe 26.2)
                stats = (*stats[:3], abs(stats[3]))
            if all(item is None for item in stats):
                stats = None
        data_path = None
        if isinstance(data_name, str) and data_name not in ("", "-1"):
            data_path = self.contained.child(self.data_dir, data_name, f"{self.dump_path} ({leaf_name})")
        producer = value.get("producer")
        if producer is not None:
            self.saw_producer = True
        leaf = TensorLeaf(
            name=leaf_name,
            dtype=dtype if dtype.startswith("torch.") else f"torch.{dtype}",
            shape=tuple(shape),
            stats=stats,
            nan_count=value.get("nan_count"),
            inf_count=value.get("inf_count"),
            requires_grad=value.get("requires_grad"),
            data_path=data_path,
            md5=value.get("md5"),
            producer=producer,
            suffix=leaf_name[len(self.entry_name) + 1 :],
            uninitialized=value.get("uninitialized") is True,
        )
        return leaf


def _number(value, path: Path, leaf_name: str):
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise UserError(f"{path}: tensor {leaf_name} has a non-numeric statistic {value!r}")


def load_dump_dir(root: Path) -> dict[str, RankDump]:
    """Every step/rank dump under root; nothing read from outside root (a symlinked step or rank
    folder, data file or data_name that leads out is refused)."""
    rank_dirs = find_rank_dirs(root)
    contained = ContainedPaths(root if Path(root).is_dir() else Path(root).parent)
    return {label: load_rank_dump(path, label, contained) for label, path in rank_dirs.items()}
