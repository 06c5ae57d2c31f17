"""Which files a migration touches, how they are read, and how they are written back safely."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

from npukit.files import atomic_path
from npukit.migrate.dependencies import is_dependency_file

# never walked, never copied: version control, virtualenvs (also any folder with pyvenv.cfg), caches
EXCLUDED_DIRS = frozenset(
    {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".tox", ".nox", ".mypy_cache", ".pytest_cache",
     ".ruff_cache", ".ipynb_checkpoints"}
)
# other people's code or build output: copied by --out, never migrated
VENDORED_DIRS = frozenset(
    {"site-packages", "dist-packages", "node_modules", ".eggs", "build", "dist", "third_party", "thirdparty",
     "third-party", "3rdparty", "vendor", "vendored", "_vendor"}
)
PYTHON_SUFFIXES = (".py", ".pyw")
SHELL_SUFFIXES = (".sh", ".bash", ".zsh")
# batch-scheduler job scripts are shell scripts under their scheduler's name (Slurm, PBS/Torque, LSF)
JOB_SCRIPT_SUFFIXES = (".sbatch", ".slurm", ".pbs", ".qsub", ".lsf", ".bsub", ".job")
# a file without a suffix npu-migrate knows is read by its `#!` line (`launch`, `run_train`)
_SHELLS = frozenset({"sh", "bash", "zsh", "ksh", "dash"})
NATIVE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh")
# requirements files, also pip-compile/uv export output and rye's requirements*.lock
_REQUIREMENTS = re.compile(r"(requirements|constraints)[\w.-]*\.(txt|in|lock)\Z|.*\.requirements\.txt\Z", re.I)
MAX_CONFIG_BYTES = 2 * 1024 * 1024  # larger JSON/YAML files are data, not configuration
# Larger sources are generated code: analysing one costs ~200x its size in memory (a 50 MB file took
# 10 GB and 135 s); it is reported, not analysed.
MAX_SOURCE_BYTES = 8 * 1024 * 1024


def kind_of(relative: str) -> str | None:
    name = relative.rsplit("/", 1)[-1]
    lowered = name.lower()
    if lowered.endswith(PYTHON_SUFFIXES):
        return "python"
    if lowered.endswith(".ipynb"):
        return "notebook"
    if lowered.endswith(SHELL_SUFFIXES + JOB_SCRIPT_SUFFIXES):
        return "shell"
    if lowered in ("makefile", "gnumakefile", "cmakelists.txt") or lowered.endswith((".mk", ".cmake")):
        return "build"
    if lowered == "dockerfile" or lowered.startswith("dockerfile.") or lowered.endswith(".dockerfile"):
        return "dockerfile"
    if lowered.endswith((".yaml", ".yml")):
        return "yaml"
    if lowered.endswith(".json"):
        return "json"
    if _REQUIREMENTS.match(name) or "/requirements/" in f"/{relative.lower()}" and lowered.endswith(".txt"):
        return "requirements"
    if is_dependency_file(name):  # pyproject.toml, uv.lock, poetry.lock, pdm.lock, pylock*.toml, Pipfile, setup.cfg
        return "requirements"
    if lowered.endswith(NATIVE_SUFFIXES):
        return "native"
    return None


def kind_by_shebang(path: str) -> str | None:
    """"shell" or "python" for a script whose `#!` line names that interpreter, else None."""
    try:
        with open(path, "rb") as stream:
            first = stream.read(256).split(b"\n", 1)[0]
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("ascii", "replace").split()
    if words and words[0].rsplit("/", 1)[-1] == "env":  # `#!/usr/bin/env -S bash -e`
        words = [word for word in words[1:] if not word.startswith("-")]
    if not words:
        return None
    interpreter = words[0].rsplit("/", 1)[-1]
    if interpreter in _SHELLS:
        return "shell"
    if re.fullmatch(r"python[\d.]*", interpreter):
        return "python"
    return None


def _unknown_suffix(name: str) -> bool:
    """No suffix, or one no tool claims (`run.job1`): worth reading the `#!` line of."""
    stem, dot, suffix = name.rpartition(".")
    return not dot or not stem or not suffix.isalpha()


def file_kind(root: str | Path, relative: str) -> str | None:
    """kind_of, and for a name it does not know, the `#!` line (a job script named `launch`)."""
    kind = kind_of(relative)
    if kind is None and _unknown_suffix(relative.rsplit("/", 1)[-1]):
        kind = kind_by_shebang(os.path.join(root, relative))
    return kind


@dataclass
class Discovery:
    root: Path  # a directory (the target, or the parent of a single target file)
    files: list[str]  # relative posix paths of candidate files
    all_files: list[str]  # every regular file, for --out copies
    skipped: list[tuple[str, str]]  # (relative path, why)


def _git_root(path: Path) -> Path | None:
    try:
        result = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return Path(result.stdout.strip())


def _git_ignores(path: Path) -> bool:
    try:
        result = subprocess.run(["git", "-C", str(path), "check-ignore", "-q", "."], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def _git_visible(root: Path) -> set[str] | None:
    """Files git does not ignore under root (tracked + untracked), relative to root."""
    try:
        result = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "."],
            capture_output=True, timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return {p.decode("utf-8", "surrogateescape") for p in result.stdout.split(b"\0") if p}


class _GitIgnore:
    """A small .gitignore matcher for trees that are not git work trees."""

    def __init__(self) -> None:
        self.rules: list[tuple[str, str, bool, bool]] = []  # (base dir, pattern, negated, dir only)

    def add_file(self, base: str, path: Path) -> None:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return
        for raw in lines:
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            line = line[1:] if negated else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            self.rules.append((base, line, negated, dir_only))

    def ignored(self, relative: str, is_dir: bool) -> bool:
        result = False
        for base, pattern, negated, dir_only in self.rules:
            if dir_only and not is_dir:
                continue
            if base and not relative.startswith(base + "/"):
                continue
            local = relative[len(base) + 1:] if base else relative
            if "/" in pattern.strip("/"):
                matched = fnmatch.fnmatch(local, pattern.lstrip("/"))
            else:
                matched = fnmatch.fnmatch(local.rsplit("/", 1)[-1], pattern.lstrip("/"))
            if matched:
                result = not negated
        return result


def discover(target: Path, *, for_copy: bool = False) -> Discovery:
    """Walk target without following symlinks, honouring .gitignore and skipping vendored folders.

    for_copy: also walk ignored and vendored folders (their files go to all_files, not to files).
    """
    if target.is_file():
        root = target.parent
        relative = target.name
        kind = file_kind(root, relative)
        return Discovery(root, [relative] if kind else [], [relative], [] if kind else [(relative, "not a file type npu-migrate handles")])
    root = target
    git_root = _git_root(root)
    # a target the enclosing repository ignores (a venv, a scratch copy) is walked on its own terms
    visible = _git_visible(root) if git_root is not None and not _git_ignores(root) else None
    ignore = _GitIgnore()
    files: list[str] = []
    all_files: list[str] = []
    skipped: list[tuple[str, str]] = []
    root_real = os.path.realpath(root)
    ignored_dirs: set[str] = set()  # git-ignored folders: walked (so --out copies them) but not migrated
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(directory, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        in_ignored_dir = rel_dir in ignored_dirs
        if visible is None and not in_ignored_dir and ".gitignore" in filenames:
            ignore.add_file(rel_dir, Path(directory) / ".gitignore")
        kept = []
        for name in sorted(dirnames):
            relative = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(directory, name)
            if os.path.islink(full):
                skipped.append((relative, "symlinked folder (not followed)"))
            elif name in EXCLUDED_DIRS or os.path.exists(os.path.join(full, "pyvenv.cfg")):
                if name != ".git":
                    skipped.append((relative, "virtualenv or cache folder"))
            else:
                why = None
                if name in VENDORED_DIRS:
                    why = "vendored or build folder"
                elif visible is None and ignore.ignored(relative, True):
                    why = "ignored by .gitignore"
                if why and not in_ignored_dir:
                    skipped.append((relative, why))
                if why or in_ignored_dir:
                    ignored_dirs.add(relative)
                    if not for_copy:
                        continue
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            relative = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(directory, name)
            if os.path.islink(full):
                real = os.path.realpath(full)
                if not (real == root_real or real.startswith(root_real + os.sep)):
                    skipped.append((relative, "symlink pointing outside the target (not followed)"))
                else:
                    skipped.append((relative, "symlink (its target is migrated in place instead)"))
                continue
            if not os.path.isfile(full):
                continue
            all_files.append(relative)
            if in_ignored_dir or (visible is not None and relative not in visible):
                continue
            if visible is None and ignore.ignored(relative, False):
                continue
            if file_kind(root, relative) is not None:
                files.append(relative)
    return Discovery(root, files, all_files, skipped)


def dirty_files(target: Path) -> list[str] | None:
    """Uncommitted changes under target, or None if target is not in a git work tree."""
    directory = target if target.is_dir() else target.parent
    if _git_root(directory) is None:
        return None
    pathspec = "." if target.is_dir() else target.name  # relative to `git -C directory`
    result = subprocess.run(["git", "-C", str(directory), "status", "--porcelain", "--", pathspec],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        return None
    return [line[3:] for line in result.stdout.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ reading and writing
@dataclass
class Decoded:
    text: str
    encoding: str  # codec that turns text back into the original bytes (utf-8-sig keeps a BOM)


class UndecodableError(Exception):
    pass


def decode(data: bytes, kind: str) -> Decoded:
    if b"\0" in data[:8192]:
        raise UndecodableError("is a binary file")
    encoding = "utf-8"
    if kind == "python":
        try:
            encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        except SyntaxError as exc:
            raise UndecodableError(f"has an invalid encoding declaration ({exc})") from None
    elif data.startswith(b"\xef\xbb\xbf"):
        encoding = "utf-8-sig"
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        raise UndecodableError(f"cannot be decoded as {encoding} ({exc.__class__.__name__})") from None
    return Decoded(text, encoding)


def encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding)


def atomic_write(path: Path, data: bytes, *, mode_from: Path | None = None) -> None:
    """Write via a temporary file in the same folder and rename over: never a half-written file."""
    with atomic_path(path) as temporary:
        with open(temporary, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())  # sources are rewritten in place: they must survive a crash
        source = mode_from if mode_from is not None and mode_from.exists() else (path if path.exists() else None)
        if source is not None:
            shutil.copymode(source, temporary)


def inside(path: Path, root: Path) -> bool:
    """True if path (resolved) lies in root (resolved): nothing is ever written elsewhere."""
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
    except ValueError:
        return False
    return True
