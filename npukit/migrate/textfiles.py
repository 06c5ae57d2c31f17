"""CUDA -> NPU migration of the files around the Python code.

Notebooks (code cells, with shell escapes and magics), shell scripts, YAML/JSON configs,
requirements files (scanned in dependencies.py) and CUDA/C++ sources. Text rewrites here are line based and skip comments,
echo/printf lines and anything that is not a command or a config value.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re

from npukit.migrate import rules
from npukit.migrate.dependencies import comment_start, scan_conda_environment, scan_requirements
from npukit.migrate.model import Change, Finding
from npukit.migrate.pysource import (
    MigrationSyntaxError,
    apply_edits,
    migrate_python,
    remap_changes,
    remap_findings,
)
from npukit.migrate.rules import Flag

_ENV_RENAME = re.compile(r"\b(" + "|".join(rules.ENV_RENAMES) + r")\b")
# in configs an env var name is a use when it is a whole scalar (key or value), an assignment or a
# $reference - not when a sentence mentions it
_ENV_ALT = "(" + "|".join(rules.ENV_RENAMES) + ")"
_CONFIG_ENV_USE = re.compile(
    r"\$\{?" + _ENV_ALT + r"\}?"                    # $X, ${X}
    + r"|\b" + _ENV_ALT + r"(?==)"                   # X=1
    + r"|(?<=[\"'])" + _ENV_ALT + r"(?=[\"'])"        # "X"
    + r"|^\s*(?:-\s+)?" + _ENV_ALT + r"(?=\s*:)"      # X: value, - X: value
    + r"|:\s+" + _ENV_ALT + r"\s*$"                  # key: X
    + r"|^\s*-\s+" + _ENV_ALT + r"\s*$"              # - X
)
_NCCL_ENV = re.compile(r"\b(TORCH_)?NCCL_[A-Z0-9_]+\b")
# a project's own variable named like CUDA's (rules.project_cuda_variable): any such word of a shell
# line (export X=, X=1 cmd, ENV X 1, ARG X, $X, ${X}); in configs only where _CONFIG_ENV_USE would see a use
_LIKE_CUDA = r"((?:CUDA|NVIDIA|CUDNN|CUBLAS)_[A-Z0-9_]*[A-Z0-9])"
_SHELL_PROJECT_ENV = re.compile(r"(?<![\w-])" + _LIKE_CUDA + r"(?![\w-])")
_CONFIG_PROJECT_ENV = re.compile(_CONFIG_ENV_USE.pattern.replace(_ENV_ALT, _LIKE_CUDA))
_DEVICE_OPTION = re.compile(r"(--[\w-]*device[\w-]*(?:=|\s+)[\"']?)cuda(?=(?::\d+)?[\"']?(?:\s|$|\\))")
_BACKEND_OPTION = re.compile(r"(--[\w-]*backend[\w-]*(?:=|\s+)[\"']?)nccl\b")
_LOG_COMMAND = re.compile(r"\s*(echo|printf)\b")
_YAML_ITEM = re.compile(r"""^(?P<lead>\s*(?:-\s+)?)(?P<kq>["']?)(?P<key>[\w.-]+)(?P=kq)(?P<sep>\s*:\s*)(?P<vq>["']?)(?P<value>[^"'#\s][^"'#]*?)(?P=vq)\s*$""")
_JSON_DEVICE = re.compile(r'("[\w.-]*[dD]evice[\w.-]*"\s*:\s*")cuda((?::\d+)?")')
_JSON_BACKEND = re.compile(r'("[\w.-]*[bB]ackend[\w.-]*"\s*:\s*")nccl(")')
_CUDA_INCLUDE = re.compile(r'#\s*include\s*[<"](cuda|cublas|cudnn|cufft|curand|cusparse|nccl|thrust/|cub/|c10/cuda|ATen/cuda)')
_CUDA_KERNEL = re.compile(r"__global__|<<<")


class TextEdit:
    """A (line, start, end, text, rule) replacement inside one line of a text file."""

    __slots__ = ("line", "start", "end", "text", "rule")

    def __init__(self, line: int, start: int, end: int, text: str, rule: str) -> None:
        self.line, self.start, self.end, self.text, self.rule = line, start, end, text, rule


def _finding(path: str, line_no: int, col: int, line: str, flag: Flag, reason: str | None = None) -> Finding:
    return Finding(path, line_no, col, flag.kind, flag.severity, line.strip(), reason or flag.reason, flag.suggestion)


def _command_line_edits(line: str, line_no: int, path: str, findings: list[Finding],
                        env_pattern: re.Pattern[str] = _ENV_RENAME,
                        project_env_pattern: re.Pattern[str] | None = _SHELL_PROJECT_ENV) -> list[TextEdit]:
    """Env var names, --device cuda, --backend nccl, and NVIDIA's tools (nvidia-smi, nvcc, nsys ...)
    where a command starts, in one shell-like line; a project's own variable named like CUDA's reported."""
    code = line[:comment_start(line)]
    if not code.strip() or _LOG_COMMAND.match(code):
        return []
    edits: list[TextEdit] = []
    for match in env_pattern.finditer(code):
        name = match.group(match.lastindex)
        edits.append(TextEdit(line_no, match.start(match.lastindex), match.end(match.lastindex),
                              rules.ENV_RENAMES[name], "env-var"))
        if name in rules.ENV_RENAME_NOTES:
            findings.append(_finding(path, line_no, match.start() + 1, line, rules.ENV_RENAME_NOTES[name]))
    for match in _DEVICE_OPTION.finditer(code):
        edits.append(TextEdit(line_no, match.end(1), match.end(1) + 4, "npu", "device-string"))
    for match in _BACKEND_OPTION.finditer(code):
        edits.append(TextEdit(line_no, match.end(1), match.end(1) + 4, "hccl", "backend-string"))
    for match in _NCCL_ENV.finditer(code):
        if match.group(0) not in rules.ENV_RENAMES:
            findings.append(_finding(path, line_no, match.start() + 1, line, rules.NCCL_ENV_FLAG,
                                     f"{match.group(0)}: {rules.NCCL_ENV_FLAG.reason}"))
    for match in project_env_pattern.finditer(code) if project_env_pattern else ():
        name = match.group(match.lastindex)
        if rules.project_cuda_variable(name):
            findings.append(_finding(path, line_no, match.start(match.lastindex) + 1, line,
                                     rules.project_cuda_variable_flag(name)))
    if "CUBLAS_WORKSPACE_CONFIG" in code:
        findings.append(_finding(path, line_no, code.index("CUBLAS_WORKSPACE_CONFIG") + 1, line,
                                 rules.ENV_FLAGGED["CUBLAS_WORKSPACE_CONFIG"]))
    for match in rules.NVIDIA_TOOL_WORD.finditer(code):
        findings.append(_finding(path, line_no, match.start(1) + 1, line, rules.NVIDIA_TOOLS[match.group(1)]))
    for match in _CUDA_LINK.finditer(code):
        findings.append(_finding(path, line_no, match.start() + 1, line, _CUDA_LINK_FLAG,
                                 f"{match.group(0)}: {_CUDA_LINK_FLAG.reason}"))
    return edits


# NVIDIA's libraries on a compiler or linker line
_CUDA_LINK = re.compile(r"(?<![\w-])-l(?:cublas(?:Lt)?|cudart(?:_static)?|cudnn|nccl|cufft|curand|cusparse|cusolver|nvrtc|"
                        r"nvToolsExt|cuda)\b")
_CUDA_LINK_FLAG = Flag("cuda-link", "error", "links one of NVIDIA's CUDA libraries, which NPU hosts lack",
                       "link CANN's counterparts (ascendcl, hccl, the op libraries) or build the native part "
                       "without CUDA")


def _apply_line_edits(lines: list[str], edits: list[TextEdit], path: str) -> tuple[list[str], list[Change]]:
    by_line: dict[int, list[TextEdit]] = {}
    for edit in edits:
        by_line.setdefault(edit.line, []).append(edit)
    changes = []
    new_lines = list(lines)
    for line_no, line_edits in by_line.items():
        line = lines[line_no - 1]
        pieces, position = [], 0
        for edit in sorted(line_edits, key=lambda e: e.start):
            if edit.start < position:
                continue
            pieces += [line[position:edit.start], edit.text]
            position = edit.end
            changes.append(Change(path, line_no, edit.start + 1, edit.rule, line[edit.start:edit.end], edit.text))
        pieces.append(line[position:])
        new_lines[line_no - 1] = "".join(pieces)
    return new_lines, changes


def migrate_shell(text: str, path: str) -> tuple[str, list[Change], list[Finding]]:
    lines = text.splitlines(keepends=True)
    findings: list[Finding] = []
    edits: list[TextEdit] = []
    for number, line in enumerate(lines, 1):
        request = rules.JOB_GPU_REQUEST.match(line)
        if request:  # a scheduler directive is a comment to the shell
            findings.append(_finding(path, number, request.start(1) + 1, line, rules.JOB_GPU_FLAG))
        edits += _command_line_edits(line, number, path, findings)
    new_lines, changes = _apply_line_edits(lines, edits, path)
    return "".join(new_lines), changes, findings


# Kubernetes / Helm: NVIDIA's device plugin resource, and a container image built on CUDA
_K8S_GPU_RESOURCE = re.compile(r"""["']?nvidia\.com/gpu["']?\s*:""")
_K8S_GPU_FLAG = Flag("k8s-gpu-resource", "error", "the pod requests NVIDIA GPUs (nvidia.com/gpu), which an Ascend "
                     "node does not offer", "request the Ascend device plugin's resource (e.g. huawei.com/Ascend910: "
                     "N; the name is your cluster's) and use an Ascend CANN image")
# docker compose: a device reservation for NVIDIA's driver, or the old `runtime: nvidia`
_CONTAINER_GPU = re.compile(r"""^\s*(?:-\s+)?["']?((?:driver|runtime)["']?\s*:\s*["']?nvidia)\b""")
_CONTAINER_GPU_FLAG = Flag("container-gpu-request", "error", "the container asks for NVIDIA GPUs (NVIDIA's container "
                           "runtime), which an Ascend host does not have",
                           "map the NPUs into the container instead (devices /dev/davinciN, /dev/davinci_manager, "
                           "/dev/devmm_svm, /dev/hisi_hdc and the driver's mounts, as Ascend's container docs show)")
# ... or only the GPU capability (compose needs no driver to hand a container NVIDIA's GPUs):
# `capabilities: [gpu]`, or `capabilities:` with a `- gpu` item on the next line
_CONTAINER_GPU_CAPABILITY = re.compile(r"""^\s*(?:-\s+)?["']?(capabilities)["']?\s*:\s*(?:\[([^\]]*)\])?\s*$""")
_DEVICE_ITEM_LINES = 4  # a compose device item: driver, count or device_ids, capabilities, options
_GPU_ITEM = re.compile(r"""^\s*-\s*["']?gpu["']?\s*$""")
_CUDA_IMAGE = re.compile(r"""^\s*(?:-\s+)?["']?image["']?\s*:\s*["']?(\S*(?:nvidia/|nvcr\.io/|cuda)\S*?)["']?\s*$""", re.I)
_CUDA_IMAGE_FLAG = Flag("cuda-base-image", "error", "a CUDA container image",
                        "use an Ascend CANN image (e.g. ascendai/cann) with torch + torch_npu installed")
_CUDA_BASE_IMAGE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S*(?:nvidia/|nvcr\.io/|cuda)\S*)", re.I)


def migrate_dockerfile(text: str, path: str) -> tuple[str, list[Change], list[Finding]]:
    """ENV/RUN lines get the shell rules; a CUDA base image is reported."""
    new_text, changes, findings = migrate_shell(text, path)
    for number, line in enumerate(text.splitlines(), 1):
        match = _CUDA_BASE_IMAGE.match(line)
        if match:
            findings.append(_finding(path, number, 1, line, Flag(
                "cuda-base-image", "error", f"{match.group(1)}: a CUDA base image",
                "start from an Ascend CANN image (e.g. ascendai/cann) and install torch + torch_npu")))
    return new_text, changes, findings


_CMAKE_CUDA = re.compile(r"\benable_language\s*\(\s*CUDA\b|\bproject\s*\([^)]*\bCUDA\b|\bfind_package\s*\(\s*(?:CUDA|CUDAToolkit|"
                         r"NCCL|CUDNN)\b|\bcuda_add_\w+\s*\(|\bCUDA::\w+|\bLANGUAGE\s+CUDA\b|\bCMAKE_CUDA_\w+|"
                         r"\bCUDA_ARCHITECTURES\b|[\w/.-]+\.cu\b", re.I)
_CUDA_BUILD_FLAG = Flag("cuda-build", "error", "this build compiles or links CUDA code, which does not build on an NPU host",
                        "build the native part without CUDA: port its kernels to Ascend C (CANN's toolchain) or "
                        "replace them with torch_npu fused ops / PyTorch ops, and link CANN's libraries")


def migrate_build(text: str, path: str) -> tuple[str, list[Change], list[Finding]]:
    """Makefiles get the shell rules (their recipes are shell: env var names and --device cuda are
    rewritten; nvcc, nsys, -lcublas ... reported); CMake files are reported, never rewritten: CUDA's
    language, packages, targets and .cu sources, one finding per line. Porting a build is a human's job."""
    if not path.lower().endswith((".cmake", "cmakelists.txt")):
        return migrate_shell(text, path)
    findings: list[Finding] = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line[:comment_start(line)]
        match = _CMAKE_CUDA.search(code)
        if match:
            findings.append(_finding(path, number, match.start() + 1, line, _CUDA_BUILD_FLAG,
                                     f"`{match.group(0).strip()}`: {_CUDA_BUILD_FLAG.reason}"))
        else:
            # execute_process(nvcc ...), -lcudart in flags; not CMake's variables (FindCUDA sets CUDA_LIBRARIES ...)
            _command_line_edits(code, number, path, findings, project_env_pattern=None)
    return text, [], findings


def migrate_yaml(text: str, path: str) -> tuple[str, list[Change], list[Finding]]:
    """`device: cuda`, `backend: nccl`, env var names and command strings in YAML configs."""
    parsed_before = _yaml_parses(text)
    if parsed_before is False:
        raise MigrationSyntaxError("does not parse as YAML")
    lines = text.splitlines(keepends=True)
    findings: list[Finding] = []
    edits: list[TextEdit] = []
    reserved_at: list[int] = []  # lines of `driver: nvidia` device reservations
    gpu_capabilities: list[Finding] = []
    for number, line in enumerate(lines, 1):
        body = line.rstrip("\r\n")
        code = body[:comment_start(body)]
        match = _YAML_ITEM.match(code.rstrip())
        if match:
            key, value = match.group("key").lower(), match.group("value")
            at = match.start("value")
            if "device" in key and rules.DEVICE_VALUE.match(value):
                edits.append(TextEdit(number, at, at + 4, "npu", "device-string"))
                continue
            if "backend" in key and rules.BACKEND_VALUE.match(value) and "nccl" in value:
                new = re.sub(r"\bnccl\b", "hccl", re.sub(r"\bcuda\b", "npu", value))
                edits.append(TextEdit(number, at, at + len(value), new, "backend-string"))
                continue
        gpu = _K8S_GPU_RESOURCE.search(code)
        if gpu:
            findings.append(_finding(path, number, gpu.start() + 1, body, _K8S_GPU_FLAG))
        reservation = _CONTAINER_GPU.match(code)
        if reservation:
            findings.append(_finding(path, number, reservation.start(1) + 1, body, _CONTAINER_GPU_FLAG))
            reserved_at.append(number)
        capability = _CONTAINER_GPU_CAPABILITY.match(code)
        if capability and (re.search(r"""(?:^|[\s,'"])gpu(?:$|[\s,'"])""", capability.group(2) or "")
                           or capability.group(2) is None and number < len(lines)
                           and _GPU_ITEM.match(lines[number][:comment_start(lines[number])])):
            gpu_capabilities.append(_finding(path, number, capability.start(1) + 1, body, _CONTAINER_GPU_FLAG))
        image = _CUDA_IMAGE.match(code)
        if image:
            findings.append(_finding(path, number, image.start(1) + 1, body, _CUDA_IMAGE_FLAG,
                                     f"{image.group(1)}: {_CUDA_IMAGE_FLAG.reason}"))
        edits += _command_line_edits(body, number, path, findings, _CONFIG_ENV_USE, _CONFIG_PROJECT_ENV)
    # a device reservation with its driver named is reported at the driver: once per device
    findings += [finding for finding in gpu_capabilities
                 if not any(abs(finding.line - line) <= _DEVICE_ITEM_LINES for line in reserved_at)]
    findings.sort(key=lambda finding: finding.line)  # (stable: a line's findings keep their order)
    findings += scan_conda_environment(text, path)
    new_lines, changes = _apply_line_edits(lines, edits, path)
    new_text = "".join(new_lines)
    if changes and parsed_before and _yaml_parses(new_text) is False:
        raise MigrationSyntaxError("the rewrite would not parse as YAML; left unchanged")
    return new_text, changes, findings


def _yaml_parses(text: str) -> bool | None:
    """True/False, or None when PyYAML is not installed (then no validation is possible)."""
    try:
        import yaml
    except ImportError:
        return None
    try:
        for _ in yaml.safe_load_all(text):
            pass
    except yaml.YAMLError:
        return False
    return True


def migrate_json(text: str, path: str) -> tuple[str, list[Change], list[Finding]]:
    try:
        json.loads(text)
    except ValueError as exc:
        raise MigrationSyntaxError(f"does not parse as JSON ({exc})") from None
    lines = text.splitlines(keepends=True)
    findings: list[Finding] = []
    edits: list[TextEdit] = []
    for number, line in enumerate(lines, 1):
        for match in _JSON_DEVICE.finditer(line):
            edits.append(TextEdit(number, match.end(1), match.end(1) + 4, "npu", "device-string"))
        for match in _JSON_BACKEND.finditer(line):
            edits.append(TextEdit(number, match.end(1), match.end(1) + 4, "hccl", "backend-string"))
        for match in _CONFIG_ENV_USE.finditer(line.rstrip("\r\n")):
            index = match.lastindex
            edits.append(TextEdit(number, match.start(index), match.end(index), rules.ENV_RENAMES[match.group(index)], "env-var"))
        for match in _NCCL_ENV.finditer(line):
            if match.group(0) not in rules.ENV_RENAMES:
                findings.append(_finding(path, number, match.start() + 1, line, rules.NCCL_ENV_FLAG,
                                         f"{match.group(0)}: {rules.NCCL_ENV_FLAG.reason}"))
    new_lines, changes = _apply_line_edits(lines, edits, path)
    new_text = "".join(new_lines)
    json.loads(new_text)  # the replacements are inside string values; this guards the claim
    return new_text, changes, findings


_BOUND_OP = re.compile(r"""\.def\(\s*"([A-Za-z_]\w*)""")


def native_op_names(text: str) -> set[str]:
    """Names a C++/CUDA file binds for Python (pybind11 `m.def("name", ...)`, TORCH_LIBRARY `m.def("name(...)")`)."""
    if "PYBIND11_MODULE" not in text and "TORCH_LIBRARY" not in text:
        return set()
    return set(_BOUND_OP.findall(text)) - {"__init__", "__call__", "__repr__"}


def is_cuda_native(text: str, path: str) -> bool:
    return path.endswith((".cu", ".cuh")) or _CUDA_INCLUDE.search(text) is not None or _CUDA_KERNEL.search(text) is not None


_KERNEL = re.compile(r"\b__global__\b[^;{()]*?\b(\w+)\s*(?:<[^;{()]*>\s*)?\(")
_HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".cuh")
_PORT = ("rewrite as an Ascend C / op-plugin kernel and build with torch_npu.utils.cpp_extension.NpuExtension, "
         "or replace with torch_npu fused ops / torch ops")
_STANDALONE = ("no Python in the tree builds it (no setup.py / cpp_extension source names it, nor includes it): "
               "the PyTorch path does not need it; port it only if you run it")


def scan_native_source(text: str, path: str, *, built: bool = True) -> list[Finding]:
    """CUDA C/C++ cannot be migrated automatically. One finding per kernel (`__global__` function),
    where it is defined; a file with CUDA but no kernel (host code, a header of device functions) is
    one finding, a header a small one. built: the PyTorch path builds the file (runner's
    _native_built_by_python); if not, its findings are the `standalone-` kinds, estimated apart."""
    is_cuda_file = path.endswith((".cu", ".cuh"))
    match = _CUDA_INCLUDE.search(text) or _CUDA_KERNEL.search(text)
    if not is_cuda_file and match is None:
        return []
    prefix, severity, note = ("", "error", "") if built else ("standalone-", "warning", f"; {_STANDALONE}")
    lines = text.splitlines()
    kernels = [m for m in _KERNEL.finditer(text) if not lines[text.count("\n", 0, m.start())].lstrip().startswith("//")]
    if kernels:
        findings = []
        for kernel in kernels:
            line = text.count("\n", 0, kernel.start()) + 1
            findings.append(Finding(path, line, 1, f"{prefix}cuda-kernel", severity, lines[line - 1].strip(),
                                    f"CUDA kernel `{kernel.group(1)}`: kernels must be rewritten for the NPU "
                                    f"(no automatic path){note}", _PORT))
        return findings
    line = text.count("\n", 0, match.start()) + 1 if match else 1
    code = lines[line - 1].strip() if lines else ""
    if path.endswith(_HEADER_SUFFIXES):
        return [Finding(path, line, 1, f"{prefix}cuda-header", "warning", code,
                        f"a header of CUDA declarations or device functions (no kernel){note}",
                        "port it with the kernels that include it")]
    return [Finding(path, line, 1, f"{prefix}cuda-source", severity, code,
                    f"host code using CUDA (no kernel here): its CUDA runtime/library calls need an NPU port{note}",
                    "use ACL / torch_npu calls for memory, streams and the libraries, or torch ops")]


# ------------------------------------------------------------------------------ notebooks
_CELL_SHELL_MAGICS = ("%%bash", "%%sh", "%%script", "%%system")
_CELL_PYTHON_MAGICS = ("%%time", "%%timeit", "%%capture", "%%prun")
_HELP_SYNTAX = re.compile(r"[\w.]+\?{1,2}\s*\Z")


def _neutral(length: int) -> str:
    """Python text of exactly `length` characters that is a valid statement (keeps offsets)."""
    return ("pass" + "#" * (length - 4)) if length >= 4 else "0".ljust(length)


def migrate_notebook(text: str, path: str, *, runtime: bool = False, lines_after: bool = False,
                     codemods: tuple = ()) -> tuple[str, list[Change], list[Finding]]:
    """Code cells are migrated as one module (imports in cell 1 serve cell 5); magics as shell lines.

    lines_after: give the Python changes and findings the (cell) lines of the rewritten notebook.
    """
    try:
        notebook = json.loads(text)
        cells = notebook["cells"]
    except (ValueError, KeyError, TypeError):
        raise MigrationSyntaxError("is not a Jupyter notebook (invalid JSON or no cells)") from None
    code_cells = [(i, c) for i, c in enumerate(cells) if isinstance(c, dict) and c.get("cell_type") == "code"]
    sources = ["".join(c.get("source", "")) if isinstance(c.get("source"), list) else c.get("source", "") for _, c in code_cells]
    python_parts: list[str] = []
    shell_lines: list[tuple[int, int, str]] = []  # (cell position, line index, text)
    written_files: list[tuple[int, str]] = []  # (cell position, name) of `%%writefile name.py` cells
    for position, source in enumerate(sources):
        lines = source.split("\n")
        first = lines[0].strip() if lines else ""
        whole_cell_shell = first.startswith(_CELL_SHELL_MAGICS)
        out_lines = []
        continued = False  # the line before was a shell line ending in a backslash: this one is part of it
        for index, line in enumerate(lines):
            stripped = line.lstrip()
            indent = line[:len(line) - len(stripped)]
            if whole_cell_shell or continued or stripped.startswith(("!", "%")) or (index == 0 and first.startswith("%%")):
                if index or not first.startswith("%%") or whole_cell_shell:
                    shell_lines.append((position, index, line))
                if continued or first.startswith("%%"):
                    # a comment: its indentation does not matter to Python, and `import torch_npu`
                    # goes below it (above a cell magic, the cell would fail: "%%time not found")
                    out_lines.append("#" * len(line))
                else:
                    out_lines.append(indent + _neutral(len(stripped)) if stripped else line)
                continued = line.rstrip().endswith("\\")
            elif _HELP_SYNTAX.match(stripped):  # IPython's `obj?` / `obj??`
                out_lines.append(indent + _neutral(len(stripped)))
            else:
                out_lines.append(line)
        if first.startswith("%%") and not whole_cell_shell and not first.startswith(_CELL_PYTHON_MAGICS):
            out_lines = ["#" * len(line) for line in out_lines]  # not Python of this notebook
            target = first.split(maxsplit=1)[1].strip() if first.startswith("%%writefile") and " " in first else ""
            if target.split()[-1:] and target.split()[-1].endswith(".py"):
                written_files.append((position, target.split()[-1]))
        python_parts.append("\n".join(out_lines))
    combined = "\n".join(python_parts)
    outcome = migrate_python(combined, path, runtime=runtime, entry_point=True,  # a notebook is run directly
                             codemods=codemods)
    spanning = _edits_across_cells(outcome.edits, python_parts)
    if spanning:  # a user codemod rewrote lines of two cells as one: not applied here, said instead
        outcome = migrate_python(combined, path, runtime=runtime, entry_point=True)
        outcome.findings.extend(
            Finding(path, edit.line, edit.col, edit.rule, "error", combined[edit.start:edit.end].strip()[:80],
                    "this codemod's change spans two code cells of the notebook; not applied to this notebook",
                    "change it by hand, or make the codemod keep each statement's lines")
            for edit in spanning)
    new_sources = list(sources)
    changes: list[Change] = []
    findings = [_cell_finding(f, python_parts) for f in outcome.findings]
    if outcome.text != combined:
        new_sources = _split_back(outcome.edits, sources, python_parts)
        changes = [_cell_change(c, python_parts) for c in outcome.changes]
        if lines_after:  # e.g. `import torch_npu` inserted into the first code cell moves that cell's lines
            new_parts = _split_back(outcome.edits, python_parts, python_parts)
            changes = [_cell_change(c, new_parts) for c in remap_changes(outcome.changes, outcome.edits, outcome.text)]
            findings = [_cell_finding(f, new_parts) for f in remap_findings(outcome.findings, combined, outcome.edits)]
    # shell escapes and magics (!nvidia-smi, %env CUDA_VISIBLE_DEVICES=0, %%bash cells)
    per_cell: dict[int, list[tuple[int, str]]] = {}
    for position, index, line in shell_lines:
        per_cell.setdefault(position, []).append((index, line))
    for position, entries in per_cell.items():
        cell_lines = new_sources[position].split("\n")
        cell_findings: list[Finding] = []
        edits = []
        search_from = 0
        for index, line in entries:
            # Python edits may have added lines above; magic lines themselves are never edited by them
            found = next((j for j in range(max(index, search_from), len(cell_lines)) if cell_lines[j] == line), None)
            if found is not None:
                edits += _command_line_edits(line, found + 1, path, cell_findings)
                search_from = found + 1
        new_lines, cell_changes = _apply_line_edits(cell_lines, edits, path)
        new_sources[position] = "\n".join(new_lines)
        cell_number = code_cells[position][0] + 1
        changes += [_relabel_change(c, cell_number) for c in cell_changes]
        findings += [_relabel_finding(f, cell_number) for f in cell_findings]
    for position, name in written_files:  # a script the notebook writes: migrated as the module it is
        changes_of, findings_of = _migrate_written_file(new_sources, position, name, path, runtime, lines_after, codemods)
        cell_number = code_cells[position][0] + 1
        changes += [_relabel_change(c, cell_number) for c in changes_of]
        findings += [_relabel_finding(f, cell_number) for f in findings_of]
    if new_sources == sources:
        return text, [], findings
    for (_, cell), old, new in zip(code_cells, sources, new_sources):
        if old != new:
            cell["source"] = new.splitlines(keepends=True) if isinstance(cell.get("source"), list) else new
    return _dump_notebook(notebook, text), changes, findings


def _migrate_written_file(sources: list[str], position: int, name: str, path: str, runtime: bool, lines_after: bool,
                          codemods: tuple) -> tuple[list[Change], list[Finding]]:
    """`%%writefile name.py` + a script: the script is migrated on its own (its lines count from the
    cell's second line); sources[position] is replaced by the result."""
    magic, _, script = sources[position].partition("\n")
    try:
        outcome = migrate_python(script, path, runtime=runtime, entry_point=True, codemods=codemods)
    except MigrationSyntaxError as exc:
        return [], [Finding(path, 2, 1, "unparsable", "error", magic, f"the script {name} it writes {exc}",
                            "fix its syntax, then migrate again")]
    changes, findings = outcome.changes, outcome.findings
    if lines_after:
        changes = remap_changes(changes, outcome.edits, outcome.text)
        findings = remap_findings(findings, script, outcome.edits)
    sources[position] = f"{magic}\n{outcome.text}"
    shift = [dataclasses.replace(item, line=item.line + 1) for item in (*changes, *findings)]
    return shift[:len(changes)], shift[len(changes):]


def _edits_across_cells(edits, parts: list[str]) -> list:
    """Edits of the combined module that reach past the end of the cell they start in."""
    ends, offset = [], 0
    for part in parts:
        offset += len(part)
        ends.append(offset)
        offset += 1
    return [edit for edit in edits if edit.end > ends[bisect.bisect_left(ends, edit.start)]]


def _split_back(edits, sources: list[str], parts: list[str]) -> list[str]:
    """Apply edits of the combined module to the cells (each part has its cell's exact length)."""
    starts, offset = [], 0
    for part in parts:
        starts.append(offset)
        offset += len(part) + 1
    per_cell: dict[int, list] = {}
    for edit in edits:
        cell = max(i for i, start in enumerate(starts) if start <= edit.start)
        per_cell.setdefault(cell, []).append(edit)
    result = list(sources)
    for cell, cell_edits in per_cell.items():
        base = starts[cell]
        shifted = [type(e)(e.start - base, e.end - base, e.text, e.rule, e.line, e.col) for e in cell_edits]
        result[cell] = apply_edits(sources[cell], shifted)
    return result


def _cell_of_line(line: int, parts: list[str]) -> tuple[int, int]:
    for position, part in enumerate(parts):
        count = part.count("\n") + 1
        if line <= count:
            return position, line
        line -= count
    return len(parts) - 1, line


def _cell_finding(finding: Finding, parts: list[str]) -> Finding:
    position, line = _cell_of_line(finding.line, parts)
    return Finding(finding.path, line, finding.col, finding.kind, finding.severity, finding.code,
                   f"[code cell {position + 1}] {finding.reason}", finding.suggestion)


def _cell_change(change: Change, parts: list[str]) -> Change:
    position, line = _cell_of_line(change.line, parts)
    return Change(change.path, line, change.col, change.rule, change.before, change.after + f"  [code cell {position + 1}]")


def _relabel_change(change: Change, cell_number: int) -> Change:
    return Change(change.path, change.line, change.col, change.rule, change.before, change.after + f"  [cell {cell_number}]")


def _relabel_finding(finding: Finding, cell_number: int) -> Finding:
    return Finding(finding.path, finding.line, finding.col, finding.kind, finding.severity, finding.code,
                   f"[cell {cell_number}] {finding.reason}", finding.suggestion)


def _dump_notebook(notebook: dict, original: str) -> str:
    """Serialise like nbformat does (indent 1, no ASCII escaping), keeping the file's own indent."""
    second = original.split("\n", 2)[1] if original.count("\n") >= 2 else ""
    indent = len(second) - len(second.lstrip(" ")) or 1
    dumped = json.dumps(notebook, indent=indent, ensure_ascii=False)
    return dumped + ("\n" if original.endswith("\n") else "")


__all__ = [
    "migrate_dockerfile", "migrate_json", "migrate_notebook", "migrate_shell", "migrate_yaml", "scan_conda_environment",
    "is_cuda_native", "native_op_names", "scan_native_source", "scan_requirements",
]
