"""Dependency files: what a CUDA project installs, checked for what will not install or run on an NPU host.

Scanned, never edited (the right pins are the user's decision, and lock files belong to their tools):
requirements/constraints files (also pip-compile / `uv export` output with `# via` annotations),
`pyproject.toml` (PEP 621 dependencies and optional-dependencies, `[dependency-groups]`, Poetry, uv,
PDM, build requires, and any package index it names), `uv.lock`, `poetry.lock`, `pdm.lock`,
`pylock*.toml`, `Pipfile`, `setup.cfg`, a literal `install_requires` in `setup.py`, and conda
environment files (conda and `pip:` entries).

One cause, one finding: lock and exported files list every transitive wheel of the CUDA torch build
(`nvidia-cublas-cu12`, `nvidia-cudnn-cu12`, ..., triton). Those are grouped per file and root cause
into one `transitive-cuda-wheels` finding at the root's line, counted once in the effort estimate.
Direct (non-transitive) CUDA-only requirements stay individual findings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass

from npukit.migrate import rules
from npukit.migrate.model import Finding
from npukit.migrate.pysource import MigrationSyntaxError
from npukit.migrate.rules import Flag

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # Python 3.10: tomli is the same parser, if installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

# ------------------------------------------------------------------------------ torch_npu releases
# torch -> newest torch_npu release for it (release candidates left out). torch_npu X.Y.Z[.postN]
# needs torch X.Y.Z exactly (its wheel metadata says `torch==X.Y.Z.*`).
# Sources, read 2026-11-23: PyPI's torch-npu release list (https://pypi.org/pypi/torch-npu/json;
# newest release 2.14.0, requires_dist `torch==2.14.0.*`), cross-checked against the "TorchNPU version
# mapping table" of Ascend/pytorch COMPATIBILITY.en.md (master snapshot of 2026-08-21), which also states
# the naming rule. torch_npu for torch 1.x / 2.0.1 was never on PyPI (Ascend's own downloads, end of life).
# Update this table when new torch_npu versions are released.
TORCH_NPU_RELEASES: dict[str, str] = {
    "2.1.0": "2.1.0.post17",
    "2.2.0": "2.2.0.post2",
    "2.3.1": "2.3.1.post6",
    "2.4.0": "2.4.0.post4",
    "2.5.1": "2.5.1.post1",
    "2.6.0": "2.6.0.post5",
    "2.7.1": "2.7.1.post11",
    "2.8.0": "2.8.0.post5",
    "2.9.0": "2.9.0.post9",
    "2.9.1": "2.9.1",
    "2.10.0": "2.10.0.post7",
    "2.11.0": "2.11.0.post3",
    "2.12.0": "2.12.0.post3",
    "2.13.0": "2.13.0",
    "2.14.0": "2.14.0",
}
TORCH_NPU_TABLE_DATE = "2026-11-23"

# Effort (minutes) of the dependency-file kinds, used by the report's estimate instead of the
# per-severity default: a pin or an index line is a one-line edit; a group of transitive CUDA
# wheels is one re-lock / re-export against the CPU torch plus torch_npu.
EFFORT_MINUTES = {
    "cuda-wheel": 10,
    "transitive-cuda-wheels": 15,
    "torch-npu-version": 10,
}

# ------------------------------------------------------------------------------ flags
_CUDA_INDEX = Flag("cuda-wheel", "error", "the CUDA wheel index of PyTorch",
                   "use the default (CPU/aarch64) torch index plus torch_npu")
_CUDA_TORCH = Flag("cuda-wheel", "error", "a CUDA build (+cuXXX version, CUDA wheel URL or conda cuda build string)",
                   "pin the plain (CPU/aarch64) build and add the matching torch_npu")
_RUNTIME_WHEEL = Flag("cuda-wheel", "error", "NVIDIA CUDA runtime wheel",
                      "remove it; the CANN toolkit provides the NPU runtime")
_CONDA_TOOLKIT = Flag("cuda-wheel", "error", "a CUDA toolkit package",
                      "remove it; install the CANN toolkit and torch_npu for the NPU")
_TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "torchtext", "pytorch"})
# wheels a CUDA build brings along (torch's nvidia-* dependencies, CUDA Python bindings)
_RUNTIME_WHEEL_NAME = re.compile(
    r"^(nvidia-[a-z0-9-]+-cu\d+"
    r"|nvidia-(cublas|cuda-[a-z0-9-]+|cudnn|cufft|cufile|curand|cusolver|cusparse|cusparselt|nccl|nvjitlink|nvtx"
    r"|nvshmem|npp|nvjpeg|nvcomp)(-cu\d+)?"
    r"|cuda-(bindings|python|pathfinder|toolkit))$")
# triton (and its nightly name) come with CUDA torch on Linux
_TORCH_COMPANIONS = re.compile(r"^(triton|pytorch-triton)$")
_CONDA_CUDA = re.compile(r"^(cudatoolkit|pytorch-cuda|pytorch-gpu|cuda-toolkit|cuda-nvcc|cuda-runtime|cuda-cudart"
                         r"|cudnn|nccl|cuda)$")
_CUDA_BUILD_TAG = re.compile(r"\+cu\d+|%2[bB]cu\d+")

_LOCK_NAMES = frozenset({"uv.lock", "poetry.lock", "pdm.lock"})
_PYLOCK = re.compile(r"^pylock\.([^.]+\.)?toml$")


def is_dependency_file(name: str) -> bool:
    """Files (by base name) scanned by scan_dependency_file, besides requirements*.txt."""
    lowered = name.lower()
    return (lowered in _LOCK_NAMES or lowered in ("pyproject.toml", "setup.cfg", "pipfile")
            or _PYLOCK.match(lowered) is not None)


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------ versions
Clause = tuple[str, str]  # (operator, version text); operators as in PEP 440


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"\s*[vV]?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _pad(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def _satisfies(version: tuple[int, ...], clause: Clause) -> bool:
    op, text = clause
    wildcard = text.endswith(".*")
    target = _release(text[:-2] if wildcard else text)
    if target is None:
        return True  # unreadable: do not exclude anything
    if wildcard:
        equal = version[:len(target)] == target
        return not equal if op == "!=" else equal
    a, b = _pad(version, target)
    if op == "~=":
        return a >= b and version[:len(target) - 1] == target[:-1]
    return {"==": a == b, "===": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}.get(op, True)


_PEP440_CLAUSE = re.compile(r"^\s*(===|==|!=|~=|>=|<=|>|<)\s*([\w.*+!-]+)\s*$")


def pep440_clauses(spec: str) -> list[Clause] | None:
    """`>=2.1,<2.2` -> [(">=", "2.1"), ("<", "2.2")]; "" -> [] (no constraint); None if unreadable."""
    spec = spec.strip().strip("()").strip()
    if not spec:
        return []
    clauses = []
    for part in spec.split(","):
        match = _PEP440_CLAUSE.match(part)
        if match is None:
            if _release(part) is not None and re.fullmatch(r"\s*[\w.*+!-]+\s*", part):
                clauses.append(("==", part.strip()))  # a bare version (lock files)
                continue
            return None
        clauses.append((match.group(1), match.group(2)))
    return clauses


def poetry_clauses(spec: str) -> list[list[Clause]] | None:
    """Poetry constraints (`^2.1`, `~2.1.0`, `2.1.*`, `>=2.1,<2.2`, `2.1.0 || 2.2.0`) as alternatives."""
    alternatives = []
    for alternative in spec.split("||"):
        clauses: list[Clause] = []
        for part in re.split(r"\s*,\s*|\s+(?=[<>=!~^\d])", alternative.strip()):
            part = part.strip()
            if not part or part == "*":
                continue
            release = _release(part.lstrip("^~"))
            if part.startswith("^") and release:
                first = next((i for i, n in enumerate(release) if n), len(release) - 1)
                upper = release[:first] + (release[first] + 1,)
                clauses += [(">=", part[1:]), ("<", ".".join(map(str, upper)))]
            elif part.startswith("~") and not part.startswith("~=") and release:
                upper = (release[0] + 1,) if len(release) == 1 else (release[0], release[1] + 1)
                clauses += [(">=", part[1:]), ("<", ".".join(map(str, upper)))]
            else:
                parsed = pep440_clauses(part)
                if parsed is None:
                    return None
                clauses += parsed
        alternatives.append(clauses)
    return alternatives


def _matching_torch(alternatives: list[list[Clause]]) -> list[str]:
    return [v for v in TORCH_NPU_RELEASES
            if any(all(_satisfies(_release(v), c) for c in clauses) for clauses in alternatives)]


def _distance(candidate: str, version: tuple[int, ...]) -> tuple[int, int, bool]:
    """How far a torch with a torch_npu release is from a version: minor lines first, then patch, lower first."""
    a, b = _pad(version[:3], _release(candidate))
    return abs((a[0] * 100 + a[1]) - (b[0] * 100 + b[1])), abs(a[2] - b[2]), b > a


def _nearest_torch(*versions: tuple[int, ...]) -> str:
    return min(TORCH_NPU_RELEASES, key=lambda candidate: min(_distance(candidate, v) for v in versions))


def _bounds(alternatives: list[list[Clause]]) -> list[tuple[int, ...]]:
    return [r for clauses in alternatives for _op, text in clauses if (r := _release(text.rstrip(".*")))]


def torch_npu_advice(alternatives: list[list[Clause]] | None) -> tuple[str, str]:
    """(what is wrong, what to do) for a torch requirement without torch_npu."""
    newest = max(TORCH_NPU_RELEASES, key=_release)
    rule = "torch_npu X.Y.Z[.postN] needs torch X.Y.Z"
    if not alternatives or all(not clauses for clauses in alternatives):
        return ("", f"pin torch to a version torch_npu is released for and add that torch_npu (newest: torch=={newest} "
                    f"with torch_npu=={TORCH_NPU_RELEASES[newest]}; {rule})")
    exact = [text for clauses in alternatives for op, text in clauses if op in ("==", "===") and not text.endswith(".*")]
    if len(alternatives) == 1 and len(alternatives[0]) == 1 and exact:
        base = ".".join(map(str, (_release(exact[0]) + (0, 0))[:3]))
        if base in TORCH_NPU_RELEASES:
            return "", f"add torch_npu=={TORCH_NPU_RELEASES[base]} (the newest torch_npu for torch {base})"
        near = _nearest_torch(_release(base))
        return (f"; torch_npu has no release for torch {base}",
                f"pin torch=={near} (the nearest torch with a torch_npu release, as of {TORCH_NPU_TABLE_DATE}) "
                f"and add torch_npu=={TORCH_NPU_RELEASES[near]}; {rule}")
    matching = _matching_torch(alternatives)
    if matching:
        best = max(matching, key=_release)
        return "", (f"pin torch=={best} (the newest torch in this range with a torch_npu release) and add "
                    f"torch_npu=={TORCH_NPU_RELEASES[best]}; {rule}")
    bounds = _bounds(alternatives)
    near = _nearest_torch(*bounds) if bounds else newest
    return ("; torch_npu has no release for any torch in this range",
            f"pin torch=={near} (the nearest torch with a torch_npu release, as of {TORCH_NPU_TABLE_DATE}) "
            f"and add torch_npu=={TORCH_NPU_RELEASES[near]}; {rule}")


# ------------------------------------------------------------------------------ requirements as records
@dataclass
class Dep:
    """One requirement as a dependency file states it."""

    name: str  # normalized
    line: int
    code: str  # the text shown in the report
    alternatives: list[list[Clause]] | None = None  # version constraint; None: unreadable, [] / [[]]: any
    cuda_build: bool = False  # +cuXXX local version, CUDA wheel URL, conda build string with cuda
    parents: frozenset[str] | None = None  # packages that pull it in (exported/lock files); None: direct
    conda: bool = False


def _direct_marker(parent: str) -> bool:
    """pip-compile / uv export `# via` entries that mean "the user asked for it" (-r file, pyproject.toml ...)."""
    return parent.startswith("-") or "(" in parent or "/" in parent or parent.endswith((".txt", ".in", ".toml", ".py", ".cfg"))


_PEP508 = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def parse_pep508(text: str, line: int, code: str | None = None) -> Dep | None:
    """`torch[extra]>=2.1,<2.2 ; marker`, `torch @ https://...whl`, a wheel URL; None for other lines."""
    text = text.strip()
    url_name = re.match(r"^(?:\S+/)?([A-Za-z0-9_.]+)-(\d[^-]*)-[^/]*\.whl(?:#\S*)?$", text)
    if url_name and ("://" in text or text.startswith((".", "/"))):  # a wheel file or URL
        version = url_name.group(2).replace("%2B", "+").replace("%2b", "+")
        return Dep(normalize(url_name.group(1)), line, code or text, [[("==", version)]], bool(_CUDA_BUILD_TAG.search(version)))
    egg = re.search(r"#egg=([A-Za-z0-9._-]+)", text)
    if egg and "://" in text:
        return Dep(normalize(egg.group(1)), line, code or text, [[]])
    match = _PEP508.match(text)
    if match is None or "://" in match.group(1):
        return None
    rest = match.group(3)
    if rest.startswith("@"):
        url = rest[1:].split(";", 1)[0].strip()
        return Dep(normalize(match.group(1)), line, code or text, [[]],
                   bool(_CUDA_BUILD_TAG.search(url) or rules.CUDA_INDEX_URL.search(url)))
    spec = rest.split(";", 1)[0].strip()
    clauses = pep440_clauses(spec)
    return Dep(normalize(match.group(1)), line, code or text, None if clauses is None else [clauses],
               bool(_CUDA_BUILD_TAG.search(spec)))


# ------------------------------------------------------------------------------ checks
def _finding(path: str, line: int, code: str, flag: Flag, reason: str | None = None) -> Finding:
    return Finding(path, line, 1, flag.kind, flag.severity, code.strip(), reason or flag.reason, flag.suggestion)


def _flag_of(dep: Dep) -> Flag | None:
    if dep.name in _TORCH_FAMILY and dep.cuda_build:
        return _CUDA_TORCH
    if dep.conda and _CONDA_CUDA.match(dep.name):
        return _CONDA_TOOLKIT
    if _RUNTIME_WHEEL_NAME.match(dep.name):
        return _RUNTIME_WHEEL
    for pattern, flag in rules.REQUIREMENT_FLAGS:
        if pattern.match(dep.name):
            return flag
    return None


def _descendants(roots: Iterable[str], parents: dict[str, frozenset[str] | None]) -> set[str]:
    """Every package that one of roots pulls in, directly or not (one pass over the graph)."""
    children: dict[str, list[str]] = {}
    for child, pulled_by in parents.items():
        for parent in pulled_by or ():
            children.setdefault(parent, []).append(child)
    found: set[str] = set()
    queue = [r for r in roots]
    while queue:
        for child in children.get(queue.pop(), ()):
            if child not in found:
                found.add(child)
                queue.append(child)
    return found


def _root_of(name: str, parents: dict[str, frozenset[str] | None]) -> str:
    """The nearest direct ancestor of a transitive package (torch's descendants are handled by the caller)."""
    seen, order, queue = {name}, [], [name]
    while queue:
        current = queue.pop(0)
        for parent in sorted(parents.get(current) or ()):
            if parent not in seen:
                seen.add(parent)
                order.append(parent)
                if parent in parents:  # a package of this file: follow it up
                    queue.append(parent)
    direct = [p for p in order if p in parents and not parents[p]]
    return (direct or order or [name])[0]


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_dependencies(deps: list[Dep], path: str, *, lock: str | None = None, graph_known: bool = True) -> list[Finding]:
    """Findings for one file's requirements: CUDA builds and CUDA-only packages (transitive ones grouped
    per root cause), and the torch_npu that goes with torch.

    lock: the command that writes this lock file (the advice is to re-lock); graph_known=False: a lock that records no
    dependency graph, whose nvidia runtime wheels are taken to come with torch.
    """
    findings: list[Finding] = []
    known = {d.name for d in deps}
    graph: dict[str, frozenset[str] | None] = {}
    for dep in deps:
        # transitive: pulled in by packages only (no `-r requirements.in` / pyproject entry), and all of them in
        # this file - or, for CUDA runtime wheels, named by `# via` even when the file leaves them out
        parents = dep.parents
        if parents and not any(_direct_marker(p) for p in parents) and (
                _RUNTIME_WHEEL_NAME.match(dep.name) or all(normalize(p) in known for p in parents)):
            graph[dep.name] = frozenset(normalize(p) for p in parents)
        else:
            graph[dep.name] = None
    torch_dep = next((d for d in deps if d.name == "torch" or (d.conda and d.name == "pytorch")), None)
    groups: dict[str, list[tuple[Dep, Flag]]] = {}
    from_torch = {name: root for root in ("pytorch", "torch") for name in _descendants([root], graph)}
    for dep in deps:
        flag = _flag_of(dep)
        if flag is None:
            continue
        transitive = graph.get(dep.name) is not None
        runtime = _RUNTIME_WHEEL_NAME.match(dep.name) is not None
        if dep.name in _TORCH_FAMILY:
            transitive = False  # a CUDA torch build is the root cause itself: always its own finding
        elif lock and not graph_known and runtime and torch_dep is not None:
            transitive = True  # a lock without a dependency graph: nvidia runtime wheels come with torch
        if transitive:
            if not graph.get(dep.name):
                root = torch_dep.name
            else:  # the CUDA torch build is the root cause of everything it pulls in
                root = from_torch.get(dep.name) or _root_of(dep.name, graph)
            groups.setdefault(root, []).append((dep, flag))
        else:
            findings.append(_finding(path, dep.line, dep.code, flag, f"{dep.name}: {flag.reason}"))
    lines: dict[str, Dep] = {}
    for dep in deps:  # a root's first entry, or its CUDA build when a lock holds several builds
        if dep.name not in lines or (dep.cuda_build and not lines[dep.name].cuda_build):
            lines[dep.name] = dep
    for root, members in groups.items():
        names = [dep.name for dep, _ in members]
        at = lines.get(root) or members[0][0]
        from_torch = root in ("torch", "pytorch")
        wheels_only = all(_RUNTIME_WHEEL_NAME.match(n) or (from_torch and _TORCH_COMPANIONS.match(n)) for n in names)
        again = (f"re-lock (`{lock}`) after pointing torch at the CPU/aarch64 index and adding torch_npu; do not "
                 "edit the lock by hand" if lock else
                 "regenerate this file (pip-compile / uv export) after pointing torch at the CPU/aarch64 index and "
                 "adding torch_npu")
        if wheels_only:
            count = f"{len(names)} CUDA wheel{'s' if len(names) != 1 else ''}"
            reason = (f"{count} ({_listing(names)}) come in with the CUDA build of {root}: one cause, one fix"
                      if from_torch else f"{count} ({_listing(names)}) come in with {root}")
            suggestion = f"{again}; these wheels then drop out" if from_torch else \
                f"use a build of {root} without CUDA (or drop it), then {again}"
            findings.append(Finding(path, at.line, 1, "transitive-cuda-wheels", "error", at.code.strip(), reason, suggestion))
        else:
            reason = f"{root} pulls in CUDA-only package{'s' if len(names) != 1 else ''}: {_listing(names)}"
            findings.append(Finding(path, at.line, 1, "transitive-cuda-packages", "error", at.code.strip(), reason,
                                    f"find an Ascend build of {root} or an alternative, then {again}"))
    findings += _torch_npu_findings(deps, torch_dep, path)
    return findings


def _torch_npu_findings(deps: list[Dep], torch_dep: Dep | None, path: str) -> list[Finding]:
    npu = next((d for d in deps if d.name == "torch-npu"), None)
    if torch_dep is None:
        return []
    constraint = _describe(torch_dep.alternatives)
    if npu is None:
        problem, advice = torch_npu_advice(torch_dep.alternatives)
        if torch_dep.conda or any(d.conda for d in deps):
            advice += " (torch_npu comes from pip: list it under `pip:`)"
        return [Finding(path, torch_dep.line, 1, "torch-npu-missing", "info", torch_dep.code.strip(),
                        f"torch{constraint} is required but torch_npu is not{problem}", advice)]
    torch_exact = _exact(torch_dep.alternatives)
    npu_exact = _exact(npu.alternatives)
    if torch_exact and npu_exact and _release(npu_exact)[:3] != (_release(torch_exact) + (0, 0))[:3]:
        needs = ".".join(map(str, _release(npu_exact)[:3]))
        base = ".".join(map(str, (_release(torch_exact) + (0, 0))[:3]))
        _problem, advice = torch_npu_advice([[("==", base)]])
        return [Finding(path, npu.line, 1, "torch-npu-version", "warning", npu.code.strip(),
                        f"torch_npu {npu_exact} needs torch {needs}, but torch {torch_exact} is pinned",
                        f"pin torch=={needs}, or {advice}")]
    return []


def _exact(alternatives: list[list[Clause]] | None) -> str | None:
    if alternatives and len(alternatives) == 1 and len(alternatives[0]) == 1:
        op, text = alternatives[0][0]
        if op in ("==", "===") and not text.endswith(".*"):
            return text.split("+", 1)[0]
    return None


def _describe(alternatives: list[list[Clause]] | None) -> str:
    if not alternatives or not any(alternatives):
        return ""
    return " (" + " || ".join(",".join(f"{op}{text}" for op, text in clauses) for clauses in alternatives) + ")"


def _index_findings(text: str, path: str, *, once: bool = False) -> list[Finding]:
    """Lines naming PyTorch's CUDA wheel index (extra-index-url, uv/poetry/pdm sources, lock registries)."""
    findings = []
    if "download.pytorch.org" not in text:
        return findings
    for number, line in enumerate(text.splitlines(), 1):
        if "download.pytorch.org" in line and rules.CUDA_INDEX_URL.search(line[:comment_start(line)]):
            findings.append(_finding(path, number, line, _CUDA_INDEX))
            if once:
                break
    return findings


# ------------------------------------------------------------------------------ requirements files
_VIA_INLINE = re.compile(r"#\s*via\s+(.+)$")


def scan_requirements(text: str, path: str) -> list[Finding]:
    """requirements / constraints files, pip-compile and `uv export` output included."""
    deps: list[Dep] = []
    findings: list[Finding] = []
    physical = text.splitlines()
    current: Dep | None = None
    via_block = False
    number = 0
    while number < len(physical):
        start = number
        raw = physical[number]
        number += 1
        stripped = raw.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if current is not None and re.fullmatch(r"via", body):
                via_block = True
                continue
            if current is not None and body.startswith("via "):
                current.parents = (current.parents or frozenset()) | _via_names(body[4:])
                via_block = False
                continue
            if via_block and current is not None and body and stripped.startswith("#  "):
                current.parents = (current.parents or frozenset()) | {body.split()[0] if not body.startswith("-") else body}
                continue
            via_block = False
            continue
        via_block = False
        if not stripped:
            current = None
            continue
        logical = raw
        while logical.rstrip().endswith("\\") and number < len(physical):  # continuation (--hash lines)
            logical = logical.rstrip()[:-1] + " " + physical[number]
            number += 1
        inline = _VIA_INLINE.search(logical)
        content = logical.split(" #", 1)[0].split("\t#", 1)[0].strip()
        if rules.CUDA_INDEX_URL.search(content) and not _names_a_package(content):
            findings.append(_finding(path, start + 1, raw, _CUDA_INDEX))
            current = None
            continue
        if content.startswith("-"):
            egg = re.match(r"^-e\s+(\S+)", content)
            dep = parse_pep508(egg.group(1), start + 1, raw) if egg else None
        else:
            dep = parse_pep508(re.split(r"\s+--", content, maxsplit=1)[0], start + 1, raw.strip().rstrip("\\").strip())
        current = dep
        if dep is None:
            continue
        if inline:
            dep.parents = _via_names(inline.group(1))
        deps.append(dep)
    return findings + check_dependencies(deps, path)


def _names_a_package(content: str) -> bool:
    """`torch @ https://download.pytorch.org/whl/cu121/...whl` names a package; `--index-url ...` does not."""
    return not content.startswith("-") and ("@" in content.split("://", 1)[0] or content.split("#", 1)[0].endswith(".whl"))


def _via_names(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


# ------------------------------------------------------------------------------ TOML files
class TomlUnavailable(Exception):
    """No TOML parser (Python 3.10 without tomli)."""


def _load_toml(text: str, what: str) -> dict:
    if tomllib is None:
        raise TomlUnavailable
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MigrationSyntaxError(f"does not parse as TOML ({exc}); {what} not checked") from None


class _Lines:
    """Find the line of a value in a TOML/INI file (tomllib keeps no positions)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()

    def of_string(self, value: str, default: int = 1) -> int:
        for quote in ('"', "'"):
            needle = f"{quote}{value}{quote}"
            for index, line in enumerate(self.lines):
                if needle in line:
                    return index + 1
        return default

    def of_key(self, header: str, key: str, default: int = 1) -> int:
        """The line of `key = ...` under the [header] table (or `header.key` spelled inline)."""
        start = 0
        for index, line in enumerate(self.lines):
            if re.match(r"^\s*\[+\s*" + re.escape(header) + r"\s*\]+\s*(#.*)?$", line):
                start = index + 1
                break
        pattern = re.compile(r"^\s*[\"']?" + re.escape(key) + r"[\"']?\s*=", re.I)
        for index in range(start, len(self.lines)):
            if pattern.match(self.lines[index]):
                return index + 1
        return default

    def text(self, line: int) -> str:
        return self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""


def _pep508_deps(values: Iterable, where: _Lines) -> list[Dep]:
    deps = []
    for value in values:
        if isinstance(value, str):
            line = where.of_string(value)
            dep = parse_pep508(value, line, where.text(line) or value)
            if dep is not None:
                deps.append(dep)
    return deps


def _poetry_deps(table: dict, header: str, where: _Lines) -> list[Dep]:
    deps = []
    for name, value in table.items():
        if name.lower() == "python":
            continue
        line = where.of_key(header, name)
        specs = value if isinstance(value, list) else [value]
        alternatives: list[list[Clause]] | None = []
        cuda = False
        for spec in specs:
            version = spec if isinstance(spec, str) else spec.get("version", "*") if isinstance(spec, dict) else "*"
            if isinstance(spec, dict):
                cuda = cuda or any(isinstance(v, str) and (_CUDA_BUILD_TAG.search(v) or rules.CUDA_INDEX_URL.search(v))
                                   for v in (spec.get("url"), spec.get("path"), version))
            parsed = poetry_clauses(version) if version.strip() != "*" else [[]]
            if parsed is None or alternatives is None:
                alternatives = None
            else:
                alternatives += parsed
            cuda = cuda or bool(_CUDA_BUILD_TAG.search(version))
        deps.append(Dep(normalize(name), line, where.text(line), alternatives, cuda))
    return deps


def scan_pyproject(text: str, path: str) -> list[Finding]:
    data = _load_toml(text, "dependencies")
    where = _Lines(text)
    deps: list[Dep] = []
    project = data.get("project") or {}
    deps += _pep508_deps(project.get("dependencies") or [], where)
    for values in (project.get("optional-dependencies") or {}).values():
        deps += _pep508_deps(values or [], where)
    for values in (data.get("dependency-groups") or {}).values():
        deps += _pep508_deps(values or [], where)  # {include-group = ...} entries are tables: skipped
    deps += _pep508_deps((data.get("build-system") or {}).get("requires") or [], where)
    tool = data.get("tool") or {}
    uv = tool.get("uv") or {}
    for key in ("dev-dependencies", "constraint-dependencies", "override-dependencies"):
        deps += _pep508_deps(uv.get(key) or [], where)
    for values in ((tool.get("pdm") or {}).get("dev-dependencies") or {}).values():
        deps += _pep508_deps(values or [], where)
    poetry = tool.get("poetry") or {}
    deps += _poetry_deps(poetry.get("dependencies") or {}, "tool.poetry.dependencies", where)
    deps += _poetry_deps(poetry.get("dev-dependencies") or {}, "tool.poetry.dev-dependencies", where)
    for group, table in (poetry.get("group") or {}).items():
        deps += _poetry_deps((table or {}).get("dependencies") or {}, f"tool.poetry.group.{group}.dependencies", where)
    return _index_findings(text, path) + check_dependencies(_dedupe(deps), path)


def scan_pipfile(text: str, path: str) -> list[Finding]:
    data = _load_toml(text, "dependencies")
    where = _Lines(text)
    deps: list[Dep] = []
    for section in ("packages", "dev-packages"):
        for name, value in (data.get(section) or {}).items():
            line = where.of_key(section, name)
            version = value if isinstance(value, str) else (value.get("version", "*") if isinstance(value, dict) else "*")
            clauses = [] if version.strip() == "*" else pep440_clauses(version)
            deps.append(Dep(normalize(name), line, where.text(line), None if clauses is None else [clauses],
                            bool(_CUDA_BUILD_TAG.search(version))))
    return _index_findings(text, path) + check_dependencies(_dedupe(deps), path)


def _dedupe(deps: list[Dep]) -> list[Dep]:
    """One record per (name, line): the same requirement can be reached through two tables."""
    seen, result = set(), []
    for dep in deps:
        if (dep.name, dep.line) not in seen:
            seen.add((dep.name, dep.line))
            result.append(dep)
    return result


def scan_lock(text: str, path: str) -> list[Finding]:
    """uv.lock, poetry.lock, pdm.lock, pylock.toml: every package with its version and (where recorded)
    what depends on it. Transitive CUDA wheels are grouped per root cause."""
    data = _load_toml(text, "locked packages")
    packages = data.get("package") or data.get("packages") or []
    # the line of each [[package]] table's `name = ...`, in file order (a name can have several entries)
    name_lines: dict[str, list[int]] = {}
    line, position = 1, 0
    for match in re.finditer(r"""^\[\[packages?\]\]\s*\n(?:(?!\[)[^\n]*\n)*?name\s*=\s*["']([^"']+)["']""", text, re.M):
        line += text.count("\n", position, match.start(1))
        position = match.start(1)
        name_lines.setdefault(normalize(match.group(1)), []).append(line)
    seen_names: dict[str, int] = {}
    projects: set[str] = set()
    parents: dict[str, set[str]] = {}
    for package in packages:
        if not isinstance(package, dict) or "name" not in package:
            continue
        name = normalize(package["name"])
        source = package.get("source")
        if isinstance(source, dict) and ({"editable", "virtual"} & set(source) or source.get("directory") == "."):
            projects.add(name)  # uv: the project itself
        for child in _lock_children(package):
            parents.setdefault(child, set()).add(name)
    deps = []
    for package in packages:
        if not isinstance(package, dict) or "name" not in package:
            continue
        name = normalize(package["name"])
        if name in projects:
            continue
        version = str(package.get("version", ""))
        occurrence = seen_names[name] = seen_names.get(name, -1) + 1
        lines_of_name = name_lines.get(name) or [1]
        line = lines_of_name[min(occurrence, len(lines_of_name) - 1)]
        pulled_by = parents.get(name, set())
        direct = not pulled_by or bool(pulled_by & projects)
        cuda = bool(_CUDA_BUILD_TAG.search(version)) or any(
            isinstance(w, dict) and _CUDA_BUILD_TAG.search(str(w.get("url") or w.get("name") or ""))
            for w in (package.get("wheels") or []))
        code = f"{package['name']} {version}".strip()
        deps.append(Dep(name, line, code, [[("==", version)]] if version else [[]], cuda,
                        None if direct else frozenset(pulled_by)))
    tool = {"uv.lock": "uv lock", "poetry.lock": "poetry lock", "pdm.lock": "pdm lock"}.get(
        path.rsplit("/", 1)[-1].lower(), "your locker")
    findings = check_dependencies(deps, path, lock=tool, graph_known=bool(parents))
    if not any(f.kind == "cuda-wheel" and "CUDA build" in f.reason for f in findings):
        findings = _index_findings(text, path, once=True) + findings  # the index is the cause only if no build says so
    return findings


def _lock_children(package: dict) -> set[str]:
    """Names this locked package depends on (uv: [{name}], poetry: {name: spec}, pdm: ["name>=1"])."""
    children: set[str] = set()
    groups = [package.get("dependencies")]
    for key in ("optional-dependencies", "dev-dependencies"):
        extra = package.get(key)
        if isinstance(extra, dict):
            groups += list(extra.values())
    for group in groups:
        if isinstance(group, dict):
            children |= {normalize(n) for n in group}
        elif isinstance(group, list):
            for item in group:
                if isinstance(item, dict) and "name" in item:
                    children.add(normalize(item["name"]))
                elif isinstance(item, str):
                    match = _PEP508.match(item)
                    if match:
                        children.add(normalize(match.group(1)))
    return children


# ------------------------------------------------------------------------------ setup.cfg, setup.py
_CFG_KEYS = ("install_requires", "setup_requires", "tests_require")


def scan_setup_cfg(text: str, path: str) -> list[Finding]:
    deps: list[Dep] = []
    section = ""
    collecting = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].rstrip()
        if not line.strip() or line.lstrip().startswith(("#", ";")):
            continue
        header = re.match(r"^\[([^\]]+)\]", line)
        if header:
            section, collecting = header.group(1).strip().lower(), False
            continue
        if not line[0].isspace():  # key = value
            key, _, value = line.partition("=")
            key = key.strip().lower()
            collecting = (section == "options" and key in _CFG_KEYS) or section == "options.extras_require"
            value = value.strip()
        elif collecting:
            value = line.strip()
        else:
            continue
        if collecting and value:
            for part in value.split(";") if section == "options" and not line[0].isspace() else [value]:
                dep = parse_pep508(part, number, raw.strip())
                if dep is not None:
                    deps.append(dep)
    return _index_findings(text, path) + check_dependencies(deps, path)


_SETUP_KEYWORDS = ("install_requires", "setup_requires", "tests_require", "extras_require")


def scan_setup_py(text: str, path: str) -> list[Finding]:
    """A literal `install_requires=[...]` (or a module-level name bound to one) and `extras_require={...}`."""
    if not any(key in text for key in _SETUP_KEYWORDS):
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []  # reported by the Python migration
    literals: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            literals[node.targets[0].id] = node.value
    lines = text.splitlines()
    strings: list[ast.Constant] = []

    def collect(value: ast.AST | None, mapping: bool) -> None:
        if isinstance(value, ast.Name):
            value = literals.get(value.id)
        if mapping and isinstance(value, ast.Dict):
            for item in value.values:
                collect(item, False)
        elif isinstance(value, (ast.List, ast.Tuple)):
            strings.extend(e for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "setup" or getattr(node.func, "attr", None) == "setup"):
            for keyword in node.keywords:
                if keyword.arg in _SETUP_KEYWORDS:
                    collect(keyword.value, keyword.arg == "extras_require")
    deps = [dep for s in strings if (dep := parse_pep508(s.value, s.lineno, lines[s.lineno - 1].strip())) is not None]
    return check_dependencies(deps, path)


# ------------------------------------------------------------------------------ conda environments
_CONDA_SPEC = re.compile(r"^(?:[\w.-]+::)?([A-Za-z0-9_.-]+)\s*(.*)$")


def comment_start(line: str) -> int:
    """Index where a shell/YAML/requirements comment starts (a # outside quotes, at line start or
    after a space); the line's length when it has none."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1] in " \t"):
            return index
    return len(line)


def _conda_dep(item: str, line: int, code: str) -> Dep | None:
    match = _CONDA_SPEC.match(item)
    if match is None:
        return None
    name, spec = normalize(match.group(1)), match.group(2).strip()
    build = ""
    if spec.startswith("=") and not spec.startswith("=="):  # name=1.2[=build]: 1.2.*
        version, _, build = spec[1:].partition("=")
        alternatives = [[("==", version.rstrip("*").rstrip(".") + ".*")]] if version else [[]]
    elif re.match(r"^[\d.*]", spec):  # name 1.2 [build]
        version, _, build = spec.partition(" ")
        alternatives = [[("==", version.rstrip("*").rstrip(".") + ".*")]]
    else:  # name==1.2, name>=1.2,<2 [build]
        spec, _, build = spec.partition(" ")
        clauses = pep440_clauses(spec)
        alternatives = None if clauses is None else [clauses]
    cuda = "cuda" in build.lower() or bool(_CUDA_BUILD_TAG.search(spec))
    return Dep(name, line, code, alternatives, cuda, conda=True)


def scan_conda_environment(text: str, path: str) -> list[Finding]:
    """conda environment files: conda packages and `pip:` entries under `dependencies:` (reported only)."""
    if not re.search(r"^dependencies\s*:", text, re.M):
        return []
    deps: list[Dep] = []
    pip_lines: list[tuple[int, str]] = []
    in_dependencies = False
    pip_indent: int | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw[:comment_start(raw)].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace() and not line.startswith("-"):  # a top-level key
            in_dependencies = bool(re.match(r"^dependencies\s*:", line))
            pip_indent = None
            continue
        if not in_dependencies:
            continue
        item = re.match(r"^(\s*)-\s+(.*)$", line)
        if item is None:
            continue
        indent, value = len(item.group(1)), item.group(2).strip().strip("\"'")
        if pip_indent is not None and indent <= pip_indent:
            pip_indent = None
        if pip_indent is None and re.match(r"^pip\s*:", value):
            pip_indent = indent
            continue
        if pip_indent is not None:
            pip_lines.append((number, value))
            continue
        dep = _conda_dep(value, number, raw.strip())
        if dep is not None:
            deps.append(dep)
    findings = []
    for number, value in pip_lines:
        if rules.CUDA_INDEX_URL.search(value) and not _names_a_package(value):
            findings.append(_finding(path, number, value, _CUDA_INDEX))
        elif not value.startswith("-"):
            dep = parse_pep508(value, number, value)
            if dep is not None:
                deps.append(dep)
    return findings + check_dependencies(deps, path)


# ------------------------------------------------------------------------------ dispatch
def scan_dependency_file(text: str, path: str) -> list[Finding]:
    """Any dependency file by its name (requirements files are the default)."""
    name = path.rsplit("/", 1)[-1].lower()
    if name == "setup.cfg":
        return scan_setup_cfg(text, path)
    try:
        if name == "pyproject.toml":
            return scan_pyproject(text, path)
        if name in _LOCK_NAMES or _PYLOCK.match(name):
            return scan_lock(text, path)
        if name == "pipfile":
            return scan_pipfile(text, path)
    except TomlUnavailable:
        return [Finding(path, 1, 1, "dependencies-not-checked", "info", "",
                        "no TOML parser in this Python (3.10 without tomli): its dependencies were not checked",
                        "run npu-migrate with Python 3.11+ or `pip install tomli`")]
    return scan_requirements(text, path)


_TRIGGERS = ("torch", "cuda", "nvidia", "flash", "xformers", "bitsandbytes", "apex", "triton", "cupy", "tensorrt",
             "nvml", "gpustat", "gputil", "cudf", "cuml", "mamba", "causal-conv1d", "causal_conv1d", "liger",
             "flashinfer", "deepspeed")


def worth_scanning(text: str) -> bool:
    """Cheap test: a dependency file with none of these words has nothing to report."""
    lowered = text.lower()
    return any(word in lowered for word in _TRIGGERS)


__all__ = [
    "EFFORT_MINUTES", "TORCH_NPU_RELEASES", "check_dependencies", "is_dependency_file", "scan_conda_environment",
    "scan_dependency_file", "scan_lock", "scan_pipfile", "scan_pyproject", "scan_requirements", "scan_setup_cfg",
    "scan_setup_py", "torch_npu_advice", "worth_scanning",
]
