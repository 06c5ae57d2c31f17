"""Plain records passed between the analysers, the runner and the report writers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Severity of a flagged item: "error" will break on an NPU host, "warning" changes behaviour or
# needs a decision, "info" is kept as is and only worth knowing.
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Edit:
    """Replace source[start:end] with text. Offsets are str indices into the decoded file."""

    start: int
    end: int
    text: str
    rule: str
    line: int
    col: int
    # The rewrite produces code that needs torch_npu loaded (torch.npu, .npu(), "npu" devices...).
    needs_torch_npu: bool = True


@dataclass(frozen=True)
class Change:
    """One applied (or, in dry-run, proposed) rewrite, as shown in change_list.csv."""

    path: str
    line: int
    col: int
    rule: str
    before: str
    after: str


@dataclass(frozen=True)
class Finding:
    """Something not migrated automatically, with where it is, why, and what to do instead."""

    path: str
    line: int
    col: int
    kind: str
    severity: str
    code: str
    reason: str
    suggestion: str
    end_line: int | None = None  # the last line it covers, when it reports a block (a kept if-branch)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class FileResult:
    """What happened to one file. new_bytes is None when the file is left byte-identical."""

    path: str
    kind: str  # python | notebook | shell | config | requirements | cuda-source | other
    new_bytes: bytes | None = None
    changes: list[Change] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None  # why the file could not be processed (left as it was)

    @property
    def changed(self) -> bool:
        return self.new_bytes is not None


@dataclass(frozen=True)
class TreeFacts:
    """What one file's analysis needs to know about the rest of the tree (gathered before the run)."""

    custom_ops: frozenset[str] = frozenset()  # ops the tree's CUDA native code binds for Python
    cuda_method_classes: frozenset[str] = frozenset()  # classes, anywhere in the tree, with their own cuda()
    is_cuda_classes: frozenset[str] = frozenset()  # classes, anywhere in the tree, with their own is_cuda
    local_packages: frozenset[str] = frozenset()  # the tree's own top-level packages and modules
    # module names other files import (--runtime only; None: unknown, then only __main__ guards count)
    imported_modules: frozenset[str] | None = None
    # a file makes a CUDA tensor type the default (set_default_tensor_type(torch.cuda.HalfTensor)):
    # legacy constructors anywhere in the tree made CUDA tensors
    cuda_default_tensor_type: bool = False
    # module name -> path of the tree's files that call set_device (a helper that selects the device)
    set_device_modules: tuple[tuple[str, str], ...] = ()
    # native files the PyTorch path builds (named in the tree's Python, and what they #include);
    # None: unknown (a single file), then every CUDA file counts as the PyTorch path's
    built_native: frozenset[str] | None = None
    # which positional parameters of the tree's functions, methods and classes take a device, by name
    # (codemods.device_values.device_signatures): a "cuda" passed there is a device, as its default is
    device_signatures: dict[str, tuple[bool, ...]] = field(default_factory=dict)
    # npu-migrate --fused: CUDA kernel libraries (flash_attn, apex) are rewritten to torch_npu's fused ops
    # and torch equivalents (codemods.flash_attention, codemods.apex_fused), not only reported
    fused: bool = False
