"""Writing output files whole or not at all.

Every file npukit writes (dumps, reports, profiles, migrated sources) goes through a temporary
file in the same folder that is renamed over the target once complete: a crash, a full disk or
Ctrl-C never leaves a half-written file for the next command to choke on.
"""

from __future__ import annotations

import os
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
