"""Writing output files whole or not at all.

Every file npukit writes (dumps, reports, profiles, migrated sources) goes through a temporary
file in the same folder that is renamed over the target once complete: a crash, a full disk or
Ctrl-C never leaves a half-written file for the next command to choke on.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from npukit.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would have given; mkstemp's 0600 would hide outputs


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path to write `path`'s content to; renamed over `path` when the block ends
    without error, removed otherwise. An OS error names `path` in a UserError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, cannot write a file there")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        os.chmod(temporary, _FILE_MODE)
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        yield Path(temporary)
        os.replace(temporary, path)
    except BaseException as exc:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise UserError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise


@contextmanager
def atomic_open(path: Path | str, mode: str = "w", newline: str | None = None):
    """open() for writing, with atomic_path's guarantees."""
    with atomic_path(path) as temporary, open(temporary, mode, newline=newline) as handle:
        yield handle


def write_text_atomic(path: Path | str, text: str) -> None:
    with atomic_open(path, "w", newline="") as handle:
        handle.write(text)


def write_json(path: Path | str, payload) -> None:
    """Write JSON atomically and compactly: readers never see a half-written dump.json."""
    # json.dumps, not json.dump: only the one-shot encoder runs in C (5x faster on big dumps).
    write_text_atomic(path, json.dumps(payload, separators=(",", ":")))


class ContainedPaths:
    """Paths named inside an input folder (a dump's data_name, a replay's tensor file), resolved so
    that they stay inside it: `..`, absolute names and symlinks leading out are refused with a
    UserError naming the file that named them. A dump, replay or profile from someone else never
    makes npukit read (or base a verdict on) a file outside the folder the user gave.

    Plain names in a folder already checked cost one lstat each (thousands of tensor files)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        try:
            self._root = self.root.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise UserError(f"{self.root}: cannot open ({getattr(exc, 'strerror', None) or exc})") from None
        self._checked_folders: dict[Path, Path] = {}

    def resolve(self, path: Path | str, named_by: Path | str) -> Path:
        """`path` (absolute, or relative to the current folder as given) checked to lie inside root."""
        path = Path(path)
        if path.name in ("", ".", ".."):
            return self._inside(path, named_by)
        folder = self._checked_folders.get(path.parent)
        if folder is None:
            folder = self._inside(path.parent, named_by)
            self._checked_folders[path.parent] = folder
        return self._file_in(folder, path.name, named_by)

    def child(self, folder: Path | str, name: str, named_by: Path | str) -> Path:
        """`folder / name` for a name read from a file: a plain file name, or refused."""
        plain = "/" not in name and os.sep not in name
        if not name or name == ".." or not plain and (os.path.isabs(name) or ".." in Path(name).parts):
            raise UserError(f"{named_by}: {name!r} names a file outside {self.root}; refusing to read it")
        if plain and name != ".":  # the common case (thousands of tensor files), without Path objects
            checked = self._checked_folders.get(folder)
            if checked is None:
                checked = self._checked_folders[folder] = self._inside(Path(folder), named_by)
            return self._file_in(checked, name, named_by)
        return self.resolve(Path(folder) / name, named_by)

    def _file_in(self, checked_folder: Path, name: str, named_by: Path | str) -> Path:
        """A file of a folder already found inside root: one lstat, and a symlink is followed and checked."""
        resolved = os.path.join(checked_folder, name)
        try:
            if stat.S_ISLNK(os.lstat(resolved).st_mode):
                return self._inside(Path(resolved), named_by)
        except OSError:
            pass  # missing: the reader names it
        return Path(resolved)

    def _inside(self, path: Path, named_by: Path | str) -> Path:
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:
            raise UserError(f"{named_by}: cannot resolve {path} ({getattr(exc, 'strerror', None) or exc})") from None
        if resolved != self._root and not resolved.is_relative_to(self._root):
            raise UserError(f"{named_by}: {path} leads outside {self.root} (to {resolved}); refusing to read it")
        return resolved


def output_folder(root: Path | str, *parts: str) -> Path:
    """root/parts... as a folder, created as needed. An existing component under root that is a
    symbolic link (or not a folder) is refused: outputs land inside root, never through a link a
    previous run or someone else left there (`D/step0 -> /elsewhere`). root itself is the user's
    choice and may be a link."""
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path}: exists and is not a folder") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot create the output folder ({exc.strerror or exc})") from None
    for part in parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            try:
                path.mkdir()
            except FileExistsError:  # made meanwhile by another rank or thread
                mode = os.lstat(path).st_mode
            except OSError as exc:
                raise UserError(f"{path}: cannot create the output folder ({exc.strerror or exc})") from None
            else:
                continue
        if stat.S_ISLNK(mode):
            raise UserError(f"{path}: is a symbolic link; npukit writes only inside {root} "
                            "(remove the link or choose another output folder)")
        if not stat.S_ISDIR(mode):
            raise UserError(f"{path}: exists and is not a folder")
    return path


def refuse_links_inside(root: Path | str, option: str, depth: int = 3) -> None:
    """Before a run writes into root: a symbolic link among its existing sub-folders (to `depth`
    levels) is refused now, not after a training step ran (output_folder refuses it again at write
    time, for links made meanwhile)."""
    pending = [(Path(root), 0)]
    while pending:
        folder, level = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            raise UserError(f"{option}: cannot read {folder} ({exc.strerror or exc})") from None
        for entry in entries:
            if entry.is_symlink():
                raise UserError(f"{option}: {entry.path} is a symbolic link; npukit writes only inside {root} "
                                "(remove the link or choose another output folder)")
            if level + 1 < depth and entry.is_dir(follow_symlinks=False):
                pending.append((Path(entry.path), level + 1))


def load_json(path: Path | str):
    """A JSON file from elsewhere, or a UserError naming it (invalid, not text, too deep, unreadable)."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to be a dump, replay or profile file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file ({exc.reason})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None


def check_output_location(path: Path | str, option: str) -> None:
    """Before a run: the folder `path` can be created (or is a folder) and written, so that a
    training step never runs to fail on its output (a file in the way, a read-only file system)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option}: {path} exists and is not a directory")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option}: {path} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {path} cannot be written ({existing} is read-only or not writable)")
