"""Run a migration over a file or a tree: discover, analyse in a process pool, write, report."""

from __future__ import annotations

import ast
import difflib
import fnmatch
import os
import posixpath
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from npukit.errors import UserError
from npukit.migrate import files as fs
from npukit.migrate import rules
from npukit.migrate.codemods.device_values import device_signatures, merge_signatures
from npukit.migrate.codemods.leftovers import unparsed_cuda_uses
from npukit.migrate.dependencies import scan_dependency_file, scan_setup_py, worth_scanning
from npukit.migrate.model import FileResult, Finding, TreeFacts
from npukit.migrate.pysource import MigrationSyntaxError, migrate_python, remap_changes, remap_findings
from npukit.migrate.pysource_model import defines_is_cuda
from npukit.migrate.textfiles import (
    is_cuda_native,
    migrate_build,
    migrate_dockerfile,
    migrate_json,
    migrate_notebook,
    migrate_shell,
    migrate_yaml,
    native_op_names,
    scan_native_source,
)
from npukit.migrate.user_codemods import specs_from_options

# below this many candidate files a process pool costs more than it saves
_POOL_THRESHOLD = 24


@dataclass
class MigrateOptions:
    target: Path
    out: Path | None = None
    dry_run: bool = False
    diff: bool = False
    check: bool = False
    runtime: bool = False
    force: bool = False
    jobs: int | None = None
    report_dir: Path | None = None
    quiet: bool = False
    codemods: tuple[str, ...] = ()  # users' libcst codemods (pkg.module.Class), run after the built-ins
    fused: bool = False  # rewrite flash_attn / apex calls to torch_npu fused ops and torch equivalents

    @property
    def writes(self) -> bool:
        return not (self.dry_run or self.diff or self.check)

    @property
    def mode(self) -> str:
        if self.check:
            return "check"
        if self.diff:
            return "diff"
        if self.dry_run:
            return "dry-run"
        return "copy" if self.out is not None else "in-place"


@dataclass
class MigrationRun:
    options: MigrateOptions
    root: Path
    results: list[FileResult]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    files_scanned: int = 0
    elapsed: float = 0.0

    @property
    def changed(self) -> list[FileResult]:
        return [r for r in self.results if r.changed]

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]


@dataclass(frozen=True)
class FileSettings:
    """What every file's analysis needs to know about the run (sent to the worker processes)."""

    runtime: bool = False
    lines_after: bool = False  # report changes and findings at their line in the rewritten file (it is written)
    facts: TreeFacts = TreeFacts()
    codemods: tuple = ()  # user_codemods.CodemodSpec: they see every Python file, CUDA or not


def process_file(root: str, relative: str, kind: str, settings: FileSettings) -> FileResult:
    """Analyse (and compute the rewrite of) one file. Never raises for a bad file: it reports it."""
    runtime = settings.runtime
    result = FileResult(path=relative, kind=kind)
    full = os.path.join(root, relative)
    try:
        with open(full, "rb") as stream:
            data = stream.read()
    except OSError as exc:
        result.error = f"cannot be read ({exc.strerror})"
        return result
    if kind in ("yaml", "json") and len(data) > fs.MAX_CONFIG_BYTES:
        if b"cuda" in data.lower():  # data, not configuration; but it mentions CUDA: say so
            result.findings.append(Finding(relative, 1, 1, "too-large", "info", "", f"larger than "
                                           f"{fs.MAX_CONFIG_BYTES >> 20} MB, read as data: not scanned, and it "
                                           "mentions cuda", "check it by hand if it is configuration"))
        return result
    if len(data) > fs.MAX_SOURCE_BYTES:
        result.error = f"is larger than {fs.MAX_SOURCE_BYTES >> 20} MB (generated code?): not analysed"
        return result
    try:
        decoded = fs.decode(data, kind)
    except fs.UndecodableError as exc:
        result.error = str(exc)  # every kind: reported as unparsable, never skipped in silence
        return result
    text = decoded.text
    try:
        new_text = text
        if kind == "python":
            # setup.py: a literal install_requires is checked like a requirements file (flagged, never edited)
            requirements = scan_setup_py(text, relative) if relative.rsplit("/", 1)[-1] == "setup.py" else []
            builtin_rules = bool(rules.worth_parsing(text) or any(op in text for op in settings.facts.custom_ops) or (
                settings.facts.cuda_default_tensor_type and rules.LEGACY_CONSTRUCTOR_CALL_TEXT.search(text)))
            if not builtin_rules and not settings.codemods:
                result.findings = requirements
                return result
            outcome = migrate_python(text, relative, runtime=runtime, facts=settings.facts, codemods=settings.codemods,
                                     builtin_rules=builtin_rules)
            new_text, result.changes = outcome.text, outcome.changes
            result.findings = outcome.findings + requirements
            if settings.lines_after:
                result.findings = remap_findings(result.findings, text, outcome.edits)
                result.changes = remap_changes(outcome.changes, outcome.edits, outcome.text)
        elif kind == "notebook":
            if not settings.codemods and not rules.worth_parsing(text):
                return result
            new_text, result.changes, result.findings = migrate_notebook(text, relative, runtime=runtime,
                                                                         lines_after=settings.lines_after,
                                                                         codemods=settings.codemods)
        elif kind == "shell":
            new_text, result.changes, result.findings = migrate_shell(text, relative)
        elif kind == "dockerfile":
            new_text, result.changes, result.findings = migrate_dockerfile(text, relative)
        elif kind == "build":  # Makefile, CMake: reported only
            new_text, result.changes, result.findings = migrate_build(text, relative)
        elif kind == "yaml":
            if not _mentions_cuda(text) and not _conda_environment_with_torch(text):
                return result
            new_text, result.changes, result.findings = migrate_yaml(text, relative)
        elif kind == "json":
            if not _mentions_cuda(text):
                return result
            new_text, result.changes, result.findings = migrate_json(text, relative)
        elif kind == "requirements":  # requirements files, pyproject.toml, lock files, setup.cfg, Pipfile
            if not worth_scanning(text):
                return result
            result.findings = scan_dependency_file(text, relative)
        elif kind == "native":
            built = settings.facts.built_native
            result.findings = scan_native_source(text, relative, built=built is None or relative in built)
    except MigrationSyntaxError as exc:
        result.error = str(exc)
        # nothing of it is rewritten: its CUDA uses are listed, each at its line
        result.changes, result.findings = [], unparsed_cuda_uses(text, relative) if kind == "python" else []
        return result
    except (RecursionError, MemoryError) as exc:
        result.error = f"is too deeply nested or too large to analyse ({type(exc).__name__})"
        result.changes, result.findings = [], []
        return result
    except Exception as exc:  # a bug in a rule must cost one file, not the whole run
        result.error = f"could not be analysed (npu-migrate bug, please report: {type(exc).__name__}: {exc})"
        result.changes, result.findings = [], []
        return result
    if runtime and kind not in ("python", "notebook"):
        # --runtime only inserts the import into entry points; transfer_to_npu does not see these files
        result.findings += [
            Finding(relative, c.line, c.col, "not-covered-by-transfer_to_npu", "warning", c.before,
                    f"transfer_to_npu does not handle {kind} files ({c.rule})", f"change it by hand: {c.before!r} -> {c.after!r}")
            for c in result.changes
        ]
        new_text, result.changes = text, []
    if new_text != text:
        result.new_bytes = fs.encode(new_text, decoded.encoding)
    return result


_CONFIG_TRIGGERS = ("cuda", "nccl", "nvidia", "cudnn", "cublas", "flash", "xformers", "bitsandbytes", "apex", "triton", "cupy", "tensorrt")


def _mentions_cuda(text: str) -> bool:
    """Cheap test for configs: nothing to do unless one of these words appears."""
    lowered = text.lower()
    return any(word in lowered for word in _CONFIG_TRIGGERS)


def _conda_environment_with_torch(text: str) -> bool:
    """A conda environment file that installs torch (checked for torch_npu even without CUDA words)."""
    return "torch" in text and re.search(r"^dependencies\s*:", text, re.M) is not None


def _usable_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _gather_tree_facts(root: Path, candidates: list[str], runtime: bool, fused: bool = False) -> TreeFacts:
    kinds = {c: fs.file_kind(root, c) for c in candidates}
    native = [c for c in candidates if kinds[c] == "native"]
    python = [c for c in candidates if kinds[c] == "python"]
    classes, is_cuda_classes, cuda_default_type, set_device_modules = _python_tree_facts(root, python)
    return TreeFacts(custom_ops=_custom_cuda_ops(root, native), cuda_method_classes=classes,
                     is_cuda_classes=is_cuda_classes, local_packages=_local_packages(python),
                     imported_modules=_imported_modules(root, python) if runtime else None,
                     cuda_default_tensor_type=cuda_default_type, set_device_modules=set_device_modules,
                     built_native=_native_built_by_python(root, python, native), fused=fused,
                     device_signatures=merge_signatures([device_signatures(data.decode("utf-8", "replace"))
                                                         for data in _read_all(root, python) if b"def " in data]))


_NATIVE_NAME = re.compile(rb"""["']([^"'\n]*\.(?:cu|cuh|cpp|cc|cxx|c|h|hpp|hh))["']""")
_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def _native_built_by_python(root: Path, python_files: list[str], native_files: list[str]) -> frozenset[str]:
    """The native files the PyTorch path builds: those a string in the tree's Python names (a
    CUDAExtension's or cpp_extension.load's sources, `os.path.join(here, "csrc", "k.cu")`'s last part,
    a glob such as "*.cu"), looked for under that Python file's folder, the other native files of a named
    file's folder, and what they #include. The rest (a CUDA C trainer beside the PyTorch code, kernel
    experiments) is standalone CUDA C."""
    if not native_files:
        return frozenset()
    built: set[str] = set()
    for relative in python_files:
        try:
            data = (root / relative).read_bytes()
        except OSError:
            continue
        folder = posixpath.dirname(relative)
        under = [n for n in native_files if not folder or n.startswith(folder + "/")]
        for match in _NATIVE_NAME.finditer(data):
            named = match.group(1).decode("utf-8", "replace").replace("\\", "/").lstrip("./")
            if "*" in named or "?" in named:
                built |= {n for n in under if fnmatch.fnmatchcase(n, f"*{named}")}
            else:
                built |= {n for n in under if n == named or n.endswith("/" + named)}
    # an extension's sources live together: the rest of a named source's folder is built with it
    # (sources listed through os.listdir or a variable name no file)
    folders = {posixpath.dirname(name) for name in built}
    built |= {n for n in native_files if posixpath.dirname(n) in folders}
    pending = list(built)
    while pending:  # the headers and sources the built files include
        relative = pending.pop()
        try:
            data = (root / relative).read_bytes()
        except OSError:
            continue
        for match in _QUOTED_INCLUDE.finditer(data):
            included = match.group(1).decode("utf-8", "replace")
            near = posixpath.normpath(posixpath.join(posixpath.dirname(relative), included))
            found = [near] if near in native_files else [n for n in native_files if n.endswith("/" + included)]
            for name in found:
                if name not in built:
                    built.add(name)
                    pending.append(name)
    return frozenset(built)


def _local_packages(python_files: list[str]) -> frozenset[str]:
    """The names the tree's own code is imported by: each top-level package (a folder with an
    __init__.py whose parent has none, at any depth: `src/pkg/`) and each module outside packages."""
    packaged = {str(Path(f).parent) for f in python_files if Path(f).name == "__init__.py"}
    names: set[str] = set()
    for relative in python_files:
        path = Path(relative)
        if str(path.parent) not in packaged:
            names.add(path.stem)
        elif str(path.parent.parent) not in packaged or path.parent == path.parent.parent:
            names.add(path.parent.name)
    return frozenset(names - {"__init__", "setup", ""})


def _read_all(root: Path, files: list[str]):
    """The bytes of each readable file; unreadable ones are skipped here."""
    for relative in files:
        try:
            yield (root / relative).read_bytes()
        except OSError:
            continue


_IMPORT_LINE = re.compile(rb"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import[ \t]+([\w, \t()]+)|import[ \t]+([\w., \t]+))", re.M)


def _imported_modules(root: Path, python_files: list[str]) -> frozenset[str]:
    """Every module-name component the tree's files import (`from a.b import c` gives a, b, c)."""
    names: set[str] = set()
    for data in _read_all(root, python_files):
        for match in _IMPORT_LINE.finditer(data):
            for group in match.groups():
                if group:
                    names |= {part.decode("ascii", "replace") for part in re.split(rb"[\s.,()]+", group) if part}
    return frozenset(names - {b"as".decode()})


_CUDA_DEFAULT_TENSOR_TYPE = re.compile(rb"set_default_tensor_type\(\s*['\"]?(?:torch\.)?cuda\.")
_OWN_IS_CUDA = re.compile(rb"def is_cuda\b|\bis_cuda\s*(:[^=\n]*)?=(?!=)")  # defined or assigned


def _python_tree_facts(root: Path, python_files: list[str]) -> tuple[frozenset[str], frozenset[str], bool,
                                                                   tuple[tuple[str, str], ...]]:
    """One read of the tree's Python files: classes that define their own `cuda` method (GA renamed
    calls to them), classes with their own `is_cuda` (an attribute or property of the user's),
    whether a file makes a CUDA tensor type the default, and the modules that call set_device."""
    names: set[str] = set()
    is_cuda_names: set[str] = set()
    cuda_default_type = False
    set_device_modules: list[tuple[str, str]] = []
    for relative in python_files:
        try:
            data = (root / relative).read_bytes()
        except OSError:
            continue
        cuda_default_type = cuda_default_type or bool(_CUDA_DEFAULT_TENSOR_TYPE.search(data))
        if b"set_device(" in data:
            set_device_modules.append((Path(relative).stem, relative.replace(os.sep, "/")))
        own_cuda = b"def cuda(" in data
        own_is_cuda = b"is_cuda" in data and _OWN_IS_CUDA.search(data) is not None
        if not (own_cuda or own_is_cuda):
            continue
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError, RecursionError):
            continue  # reported when the file itself is processed
        classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        names |= {node.name for node in classes if any(
            isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "cuda" for item in node.body)}
        if own_is_cuda:
            is_cuda_names |= {node.name for node in classes if defines_is_cuda(node)}
    return frozenset(names), frozenset(is_cuda_names), cuda_default_type, tuple(set_device_modules)


def _custom_cuda_ops(root: Path, native_files: list[str]) -> frozenset[str]:
    """Op names bound for Python by C++/CUDA sources, when the tree has CUDA native code at all."""
    names: set[str] = set()
    has_cuda = False
    for relative in native_files:
        if relative.endswith((".h", ".hpp", ".hh", ".cuh")) and has_cuda:
            continue  # headers rarely bind ops; skip reading them once CUDA code is known to exist
        try:
            text = (root / relative).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        has_cuda = has_cuda or is_cuda_native(text, relative)
        names |= native_op_names(text)
    return frozenset(names) if has_cuda else frozenset()


def _process_batch(batch: list[tuple]) -> list[FileResult]:
    return [process_file(*item) for item in batch]


def _analyse(root: Path, candidates: list[str], options: MigrateOptions,
             progress: Callable[[int], None] | None) -> list[FileResult]:
    settings = FileSettings(runtime=options.runtime, lines_after=options.writes,
                            facts=_gather_tree_facts(root, candidates, options.runtime, options.fused),
                            codemods=specs_from_options(options.codemods))
    items = [(str(root), rel, fs.file_kind(root, rel), settings) for rel in candidates]
    jobs = options.jobs or _usable_cores()
    if jobs <= 1 or len(items) < _POOL_THRESHOLD:
        results = []
        for item in items:
            results.append(process_file(*item))
            if progress:
                progress(1)
        return results
    # interleave big and small files across batches so workers finish together
    batch_count = max(jobs * 4, len(items) // 16)  # ~16 files a batch keeps the progress bar moving
    batches = [items[i::batch_count] for i in range(batch_count)]
    results: list[FileResult] = []
    context = None
    if sys.platform.startswith("linux"):
        import multiprocessing

        context = multiprocessing.get_context("fork")  # workers inherit the parsed rule tables
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for batch_results in pool.map(_process_batch, [b for b in batches if b]):
            results.extend(batch_results)
            if progress:
                progress(len(batch_results))
    order = {rel: index for index, rel in enumerate(candidates)}
    results.sort(key=lambda r: order[r.path])
    return results


def _validate(options: MigrateOptions) -> None:
    target = options.target
    if not target.exists():
        raise UserError(f"{target}: no such file or directory")
    if options.out is not None:
        if options.dry_run or options.diff or options.check:
            raise UserError("--out writes a migrated copy; it cannot be combined with --dry-run, --diff or --check")
        out = options.out
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out}: exists and is not an empty folder (choose a new folder)")
        source_dir = target if target.is_dir() else target.parent
        if fs.inside(out, source_dir) and target.is_dir():
            raise UserError(f"--out {out}: must not be inside the folder being migrated ({target})")
    if options.report_dir is not None and options.report_dir.exists() and not options.report_dir.is_dir():
        raise UserError(f"--report {options.report_dir}: exists and is not a folder")
    if options.jobs is not None and options.jobs < 1:
        raise UserError(f"--jobs {options.jobs}: must be at least 1")
    if options.codemods and options.runtime:
        raise UserError("--codemod rewrites code and --runtime does not: use one of them")
    specs_from_options(options.codemods)  # each one imports and is a libcst codemod, before any file is read
    if options.writes and options.out is None and not options.force:
        dirty = fs.dirty_files(target)
        if dirty:
            listed = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
            raise UserError(
                f"{target}: the git tree has uncommitted changes ({listed}); commit or stash them so the "
                "migration can be reviewed as one diff, or pass --force (or use --out DIR / --dry-run)"
            )


class MigrationInterrupted(Exception):
    """Ctrl-C while an in-place run was writing: which files were written (each whole) and which not."""

    def __init__(self, written: list[str], remaining: list[str]) -> None:
        self.written, self.remaining = written, remaining
        shown = ", ".join(remaining[:5]) + (f" and {len(remaining) - 5} more" if len(remaining) > 5 else "")
        super().__init__(
            f"interrupted while writing: {len(written)} of {len(written) + len(remaining)} changed files were "
            f"written (each whole), not yet: {shown}. Run the same command again to finish (add --force in a git "
            "tree: it now has uncommitted changes); files already migrated are left as they are")


def run_migration(options: MigrateOptions, progress_factory=None) -> MigrationRun:
    """Run one migration. progress_factory(total) -> callable(advance) draws a progress bar."""
    _validate(options)
    started = time.perf_counter()
    discovery = fs.discover(options.target, for_copy=options.out is not None)
    root = discovery.root
    if options.report_dir is not None and fs.inside(options.report_dir, root):
        # our own reports quote CUDA code; a later run must not "migrate" them
        reports = Path(os.path.realpath(options.report_dir))
        discovery.files = [f for f in discovery.files if not fs.inside(root / f, reports)]
    progress = progress_factory(len(discovery.files)) if progress_factory else None
    results = _analyse(root, discovery.files, options, progress)
    for result in results:
        if result.error:
            result.findings.append(Finding(result.path, 1, 1, "unparsable", "warning", "",
                                           f"{result.error}; left unchanged", "migrate this file by hand"))
    if options.writes:
        _write(options, root, discovery, results)
    run = MigrationRun(options, root, results, discovery.skipped, len(discovery.files), time.perf_counter() - started)
    return run


def _write(options: MigrateOptions, root: Path, discovery: fs.Discovery, results: list[FileResult]) -> None:
    changed = {r.path: r for r in results if r.changed}
    if options.out is None:
        written: list[str] = []
        try:
            for relative, result in changed.items():
                path = root / relative
                if not fs.inside(path, root):  # a path that escapes through a symlinked parent
                    result.findings.append(Finding(relative, 1, 1, "outside-target", "warning", "",
                                                   "resolves outside the target; not written", "migrate it where it lives"))
                    result.new_bytes = None
                    continue
                # Read-only by its mode (even for root, whom os.access lets write): respected, not replaced.
                read_only = not os.stat(path).st_mode & 0o222 or not os.access(path, os.W_OK)
                problem = "the file is read-only" if read_only else None
                if problem is None:
                    try:
                        fs.atomic_write(path, result.new_bytes, mode_from=path)
                    except (OSError, UserError) as exc:
                        problem = getattr(exc, "strerror", None) or str(exc)
                if problem is not None:  # this file stays as it was; the others are still migrated
                    result.new_bytes = None
                    result.error = f"could not be written ({problem})"
                    result.findings.append(Finding(relative, 1, 1, "unwritable", "error", "", f"{result.error}; left "
                                                   "unchanged", "fix its permissions and run again"))
                    continue
                written.append(relative)
        except KeyboardInterrupt:
            raise MigrationInterrupted(written, [r for r in changed if r not in written]) from None
        return
    out = options.out
    try:
        out.mkdir(parents=True, exist_ok=True)
        for relative in discovery.all_files:
            destination = out / relative
            if not fs.inside(destination, out):
                continue
            if relative in changed:
                fs.atomic_write(destination, changed[relative].new_bytes, mode_from=root / relative)
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / relative, destination)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write {exc.filename or out} ({exc.strerror or exc})") from None


def unified_diff(run: MigrationRun) -> str:
    chunks = []
    for result in run.changed:
        path = run.root / result.path
        old = path.read_bytes()
        encoding = fs.decode(old, result.kind).encoding
        before = old.decode(encoding).splitlines(keepends=True)
        after = result.new_bytes.decode(encoding).splitlines(keepends=True)
        diff = difflib.unified_diff(before, after, f"a/{result.path}", f"b/{result.path}")
        chunks.append("".join(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"
                              for line in diff))
    return "".join(chunks)
