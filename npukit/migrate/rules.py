"""The migration rules as data (target: torch_npu 2.14 on torch 2.13/2.14).

The analysers in pysource.py / textfiles.py read these tables; adding a same-name API, an env var
or a third-party library is a one-line change here. Qualified names are in "expression space":
`torch.npu.X` is what rewritten code spells (it exists once torch_npu is imported). Import
statements use the real module path `torch_npu.npu...` instead (see IMPORT_SPACE), because
`from torch.npu.amp import x` would load a second copy of torch_npu's submodule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS

# --------------------------------------------------------------------------- torch.cuda namespace
# torch_npu.npu.__all__ (2.14.0) plus the submodules that exist under the same name.
NPU_SAME_NAME = frozenset(
    """
    is_initialized init is_available device_count set_device current_device get_device_name
    get_device_properties can_device_access_peer device device_of utilization mem_get_info
    ipc_collect synchronize Stream Event StreamContext stream set_stream current_stream default_stream
    ExternalStream set_sync_debug_mode get_sync_debug_mode manual_seed manual_seed_all seed seed_all
    initial_seed get_rng_state set_rng_state get_rng_state_all set_rng_state_all caching_allocator_alloc
    caching_allocator_delete get_per_process_memory_fraction set_per_process_memory_fraction empty_cache
    memory_stats memory_stats_as_nested_dict reset_accumulated_memory_stats reset_peak_memory_stats
    reset_max_memory_allocated reset_max_memory_cached memory_allocated max_memory_allocated
    memory_reserved max_memory_reserved memory_cached max_memory_cached memory_snapshot memory_summary
    MemPool use_mem_pool get_allocator_backend change_current_allocator host_memory_stats
    host_memory_stats_as_nested_dict reset_accumulated_host_memory_stats reset_peak_host_memory_stats
    is_bf16_supported graph graph_pool_handle is_current_stream_capturing make_graphed_callables
    current_blas_handle BoolStorage ByteStorage ShortStorage LongStorage IntStorage HalfStorage
    CharStorage DoubleStorage FloatStorage BoolTensor ByteTensor CharTensor DoubleTensor FloatTensor
    HalfTensor IntTensor LongTensor ShortTensor BFloat16Tensor BFloat16Storage
    random memory streams graphs
    """.split()
)

# Members of torch.cuda submodules that torch_npu.npu's submodules also have.
NPU_SUBMODULE_MEMBERS = {
    "memory": NPU_SAME_NAME | {"_record_memory_history", "_snapshot", "_dump_snapshot"},
    "random": NPU_SAME_NAME,
    "streams": NPU_SAME_NAME,
    "graphs": NPU_SAME_NAME,
}


@dataclass(frozen=True)
class Flag:
    """A use that is reported instead of rewritten."""

    kind: str
    severity: str
    reason: str
    suggestion: str


# torch.cuda members with a different name on NPU (value: full replacement, expression space).
CUDA_RENAMED = {
    "torch.cuda.CUDAGraph": "torch.npu.NPUGraph",
    "torch.cuda.graphs.CUDAGraph": "torch.npu.graphs.NPUGraph",
    "torch.cuda.default_generators": "torch_npu.npu.default_generators",
    "torch.cuda.OutOfMemoryError": "torch.OutOfMemoryError",
    "torch.cuda.nvtx": "torch.npu.mstx",
    "torch.cuda.nvtx.range": "torch.npu.mstx.mstx_range",
    "torch.cuda.nvtx.range_push": "torch.npu.mstx.range_push",
    "torch.cuda.nvtx.range_pop": "torch.npu.mstx.range_pop",
    "torch.cuda.nvtx.range_start": "torch.npu.mstx.range_start",
    "torch.cuda.nvtx.range_end": "torch.npu.mstx.range_end",
    "torch.cuda.nvtx.mark": "torch.npu.mstx.mark",
    "torch.backends.cuda.matmul.allow_tf32": "torch.npu.matmul.allow_hf32",
    "torch.backends.cudnn.allow_tf32": "torch.npu.conv.allow_hf32",
    "torch.distributed.is_nccl_available": "torch.distributed.is_hccl_available",
    "torch.distributed.Backend.NCCL": "torch.distributed.Backend.HCCL",
    "torch.profiler.ProfilerActivity.CUDA": "torch.profiler.ProfilerActivity.NPU",
    "torch.autograd.profiler.ProfilerActivity.CUDA": "torch.autograd.profiler.ProfilerActivity.NPU",
}

# Rule name for each renamed entry (the report groups rewrites by rule).
CUDA_RENAMED_RULE = {
    "torch.cuda.CUDAGraph": "cuda-graph",
    "torch.cuda.graphs.CUDAGraph": "cuda-graph",
    "torch.cuda.default_generators": "cuda-renamed",
    "torch.cuda.OutOfMemoryError": "cuda-renamed",
    "torch.backends.cuda.matmul.allow_tf32": "tf32-to-hf32",
    "torch.backends.cudnn.allow_tf32": "tf32-to-hf32",
    "torch.distributed.is_nccl_available": "nccl-to-hccl",
    "torch.distributed.Backend.NCCL": "nccl-to-hccl",
    "torch.profiler.ProfilerActivity.CUDA": "profiler-activity",
    "torch.autograd.profiler.ProfilerActivity.CUDA": "profiler-activity",
}

# A rewrite that still deserves a note in the report (kind, severity, reason, suggestion).
RENAME_NOTES = {
    "torch.backends.cuda.matmul.allow_tf32": Flag(
        "precision", "warning",
        "rewritten to allow_hf32: HF32 is not TF32 (different mantissa and rounding), results differ",
        "compare against a golden fp32 run (npu-compare) before trusting accuracy",
    ),
    "torch.backends.cudnn.allow_tf32": Flag(
        "precision", "warning",
        "rewritten to torch.npu.conv.allow_hf32: HF32 is not TF32, and on NPU conv HF32 defaults to True",
        "set torch.npu.conv.allow_hf32 = False explicitly if the model needs fp32 convolutions",
    ),
    "torch.cuda.DoubleTensor": Flag(
        "fp64", "warning",
        "fp64 is limited on NPU (many ops raise 'Unsupport data type: at::ScalarType::Double')",
        "use float32 unless the computation really needs float64",
    ),
}

_NO_NPU = "no torch_npu equivalent"
CUDA_FLAGGED = {
    "torch.cuda.nccl": Flag("no-equivalent", "error", f"torch.cuda.nccl: {_NO_NPU}", "use torch.distributed with the hccl backend"),
    "torch.cuda.comm": Flag("no-equivalent", "error", f"torch.cuda.comm: {_NO_NPU}", "use torch.distributed collectives (hccl)"),
    "torch.cuda.memory_usage": Flag("no-equivalent", "error", f"torch.cuda.memory_usage: {_NO_NPU}", "torch.npu.utilization() or torch.npu.mem_get_info()"),
    "torch.cuda.temperature": Flag("no-equivalent", "error", f"torch.cuda.temperature: {_NO_NPU}", "read it with `npu-smi info`"),
    "torch.cuda.power_draw": Flag("no-equivalent", "error", f"torch.cuda.power_draw: {_NO_NPU}", "read it with `npu-smi info`"),
    "torch.cuda.clock_rate": Flag("no-equivalent", "error", f"torch.cuda.clock_rate: {_NO_NPU}", "read it with `npu-smi info`"),
    "torch.cuda.jiterator": Flag("no-equivalent", "error", f"torch.cuda.jiterator (runtime CUDA kernels): {_NO_NPU}", "write the op with torch ops or an Ascend C kernel"),
    "torch.cuda.tunable": Flag("no-equivalent", "error", f"torch.cuda.tunable (TunableOp): {_NO_NPU}", "remove it; CANN selects kernels itself"),
    "torch.cuda._sleep": Flag("no-equivalent", "warning", "torch.cuda._sleep is a private CUDA helper", "torch.npu._sleep exists but is private too; prefer time.sleep in tests"),
    "torch.cuda.get_arch_list": Flag("no-equivalent", "error", f"torch.cuda.get_arch_list: {_NO_NPU}", "gate on torch.npu.is_available() / torch.npu.get_device_name()"),
    "torch.cuda.get_gencode_flags": Flag("no-equivalent", "error", f"torch.cuda.get_gencode_flags: {_NO_NPU}", "remove it; NPU kernels are not built with nvcc"),
    "torch.cuda.profiler": Flag("no-equivalent", "error", f"torch.cuda.profiler (cudaProfilerStart): {_NO_NPU}", "use torch_npu.profiler or `npu-run --profile`"),
    "torch.cuda.cudart": Flag("no-equivalent", "error", f"torch.cuda.cudart: {_NO_NPU}", "remove the CUDA runtime call"),
    "torch.cuda.list_gpu_processes": Flag("no-equivalent", "warning", f"torch.cuda.list_gpu_processes: {_NO_NPU}", "use `npu-smi info`"),
    "torch.cuda.is_tf32_supported": Flag("no-equivalent", "warning", "TF32 does not exist on NPU (HF32 is the analogue)", "use torch.npu.matmul.allow_hf32"),
    "torch.cuda.get_device_capability": Flag(
        "device-capability", "error",
        "torch.npu.get_device_capability() returns None (unless TORCH_NPU_DEVICE_CAPABILITY is set), so "
        "comparisons such as `[0] >= 8` crash",
        "replace the intent: bf16 -> torch.npu.is_bf16_supported(); flash attention -> NPU fused "
        "attention is always available",
    ),
    "torch.version.cuda": Flag(
        "version-gate", "warning",
        "torch.version.cuda is None on an NPU host, so this branch flips silently",
        "gate on torch.npu.is_available() or a feature check instead",
    ),
    "torch.backends.cudnn.version": Flag(
        "version-gate", "warning",
        "cuDNN is absent on NPU hosts: the version is None and the gate flips",
        "gate on torch.npu.is_available() or a feature check instead",
    ),
    "torch.backends.cudnn.benchmark": Flag("no-op", "info", "cuDNN flags are harmless no-ops on NPU", "remove it or keep it; for determinism see torch.use_deterministic_algorithms"),
    "torch.backends.cudnn.deterministic": Flag(
        "no-op", "info", "cuDNN flags are harmless no-ops on NPU",
        "for determinism use torch.use_deterministic_algorithms(True) / torch_npu.npu.set_deterministic_level",
    ),
    "torch.backends.cudnn.enabled": Flag("no-op", "info", "cuDNN flags are harmless no-ops on NPU", "remove it or keep it"),
    "torch.backends.cudnn.is_available": Flag("no-op", "info", "cuDNN is never available on NPU hosts", "gate on torch.npu.is_available() instead"),
    "torch.backends.cuda": Flag(
        "cuda-backend-flag", "warning",
        "torch.backends.cuda settings (SDPA kernel choice, linalg library...) do not apply on NPU",
        "remove the setting; F.scaled_dot_product_attention dispatches to NPU fused attention by itself",
    ),
    "torch.set_float32_matmul_precision": Flag(
        "precision", "warning",
        "float32 matmul precision on NPU is controlled by HF32, not by this setting",
        "set torch.npu.matmul.allow_hf32 to choose HF32 (faster) or fp32 (exact)",
    ),
    "torch.distributed.ProcessGroupNCCL": Flag(
        "nccl", "error", "ProcessGroupNCCL does not exist with torch_npu",
        "torch_npu._C._distributed_c10d.ProcessGroupHCCL, or create groups with backend='hccl'",
    ),
    "torch.distributed.distributed_c10d.ProcessGroupNCCL": Flag(
        "nccl", "error", "ProcessGroupNCCL does not exist with torch_npu",
        "torch_npu._C._distributed_c10d.ProcessGroupHCCL, or create groups with backend='hccl'",
    ),
    "torch.nn.DataParallel": Flag(
        "data-parallel", "error", "nn.DataParallel is not supported on NPU",
        "use torch.nn.parallel.DistributedDataParallel under torchrun / npu-run --nproc-per-node",
    ),
    "torch.nn.parallel.DataParallel": Flag(
        "data-parallel", "error", "nn.DataParallel is not supported on NPU",
        "use torch.nn.parallel.DistributedDataParallel under torchrun / npu-run --nproc-per-node",
    ),
    "torch.channels_last": Flag(
        "channels-last", "warning", "channels_last memory format is not supported by NPU auto-migration",
        "keep the default contiguous format on NPU",
    ),
    "torch.jit.script": Flag(
        "torchscript", "info", "TorchScript support on NPU is limited (transfer_to_npu turns it into a no-op)",
        "run eagerly, or use torch.compile(backend='npu')",
    ),
    "torch.compile": Flag(
        "compile", "info", "torch.compile on NPU uses the dynamo backends 'npu'/'npugraph_ex' (torchair); "
        "inductor needs triton-ascend",
        "try torch.compile(model, backend='npu'); check accuracy with npu-compare",
    ),
    "torch.utils.cpp_extension.CUDAExtension": Flag(
        "cuda-extension", "error", "CUDA C++ extensions cannot be migrated automatically",
        "rewrite the kernels in Ascend C / op-plugin and build with torch_npu.utils.cpp_extension.NpuExtension",
    ),
    "torch.utils.cpp_extension.CUDA_HOME": Flag(
        "cuda-extension", "error", "CUDA_HOME is None on NPU hosts",
        "use the CANN toolkit path (ASCEND_TOOLKIT_HOME) for NPU builds",
    ),
    "torch.utils.cpp_extension.load_inline": Flag(
        "cuda-extension", "error", "JIT-compiled extension: CUDA sources cannot run on NPU",
        "rewrite the kernels in Ascend C / op-plugin (torch_npu.utils.cpp_extension)",
    ),
    "torch.utils.cpp_extension.load": Flag(
        "cuda-extension", "error", "JIT-compiled extension (unsupported on NPU; .cu sources cannot run)",
        "rewrite the kernels in Ascend C / op-plugin (torch_npu.utils.cpp_extension)",
    ),
    "torch.autograd.profiler.emit_nvtx": Flag(
        "nvtx", "error", "emit_nvtx is not supported by torch_npu",
        "use torch_npu.profiler, or mark ranges with torch.npu.mstx",
    ),
}

DEVICE_PROPERTY_FIELDS_MISSING = frozenset({"major", "minor", "multi_processor_count"})

# ------------------------------------------------------------------------------ rule catalogue
# How a finding of a CUDA kernel library's call says `--fused` would rewrite it (codemods.fused; the summary counts them)
FUSED_WOULD_REWRITE = "`npu-migrate --fused` rewrites this call"
# Every rewrite names one of these rules (change_list.csv, report.json, the summary table).
REWRITE_RULES = {
    "import-torch-npu": "`import torch_npu` once, after the docstring and __future__ imports",
    "fused-attention": "--fused: flash_attn's attention functions -> torch_npu.npu_fusion_attention(...)[0]",
    "fused-rotary": "--fused: flash_attn's apply_rotary_emb -> torch_npu.npu_rotary_mul",
    "fused-norm": "--fused: apex FusedLayerNorm / FusedRMSNorm -> torch.nn.LayerNorm / torch.nn.RMSNorm; flash_attn "
                  "rms_norm / rms_norm_fn / layer_norm_fn -> torch_npu.npu_rms_norm / F.layer_norm",
    "fused-layer": "--fused: flash_attn RMSNorm / CrossEntropyLoss / FusedDense -> torch.nn.RMSNorm / "
                   "CrossEntropyLoss / Linear",
    "fused-optimizer": "--fused: apex FusedAdam -> torch.optim.AdamW / torch.optim.Adam, FusedSGD -> torch.optim.SGD",
    "fused-multi-tensor": "--fused: apex multi_tensor_applier(amp_C.multi_tensor_l2norm / _scale / _axpby) -> "
                          "torch.nn.utils.get_total_norm / torch._foreach_*",
    "fused-import": "--fused: an import of flash_attn / xformers / apex / amp_C whose every use was rewritten, removed",
    "cuda-namespace": "torch.cuda.X -> torch.npu.X for the names torch_npu has",
    "cuda-import": "imports of torch.cuda / its members -> torch_npu.npu",
    "cuda-renamed": "torch.cuda names that have another name (default_generators, OutOfMemoryError)",
    "cuda-graph": "torch.cuda.CUDAGraph -> torch.npu.NPUGraph",
    "nvtx-to-mstx": "torch.cuda.nvtx.* -> torch.npu.mstx.*",
    "tf32-to-hf32": "allow_tf32 -> allow_hf32 (with a precision note)",
    "nccl-to-hccl": "is_nccl_available / Backend.NCCL -> hccl",
    "profiler-activity": "ProfilerActivity.CUDA -> ProfilerActivity.NPU",
    "amp-upgrade": "torch.cuda.amp.* -> torch.amp.* with device 'npu'; get_autocast_gpu_dtype",
    "device-string": "'cuda' literals in device positions, templates and f-strings",
    "device-compare": "'cuda' compared with a device expression",
    "device-variable": "'cuda' assigned to a device variable, parameter default or config key",
    "argparse-default": "argparse default/choices 'cuda' / 'nccl'",
    "int-ordinal": "int device ordinals made explicit: .to(rank) -> .to(f'npu:{rank}')",
    "backend-string": "'nccl' process-group backend strings",
    "backend-compare": "'nccl' compared with a backend expression",
    "cuda-method": ".cuda() -> .npu() on tensors and modules",
    "is-cuda": ".is_cuda -> .is_npu",
    "torch-load-map-location": "torch.load without map_location: 'cpu' into load_state_dict, 'npu' otherwise",
    "default-tensor-type": "set_default_tensor_type(torch.cuda.XTensor) -> set_default_device + set_default_dtype",
    "fork-rng-device-type": "torch.random.fork_rng gets device_type='npu'",
    "cuda-default-device": "torch APIs whose device defaults to CUDA (GradScaler(), ShardedGradScaler() ...) get 'npu'",
    "env-var": "CUDA_VISIBLE_DEVICES and friends -> their Ascend names",
    "runtime-transfer-to-npu": "--runtime: transfer_to_npu import at entry points",
}

# ------------------------------------------------------------------------------ amp upgrade
# torch.cuda.amp.* is deprecated upstream; rewrite to the device-generic torch.amp.* with "npu".
AMP_CALLS = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})
# positional parameters of torch.cuda.amp.autocast, which torch.amp.autocast orders differently
CUDA_AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")

# ------------------------------------------------------------------------------ device strings
# keyword arguments that take a device: device=, device_type=, use_device=, target_device=, device_map=...
DEVICE_KEYWORD = re.compile(r"(?:\w+_)?device(?:_type|_id|_map)?\Z|map_location\Z")
# functions whose first positional argument is a device (expression-space qualified names)
DEVICE_FIRST_ARG = frozenset(
    {
        "torch.device", "torch.set_default_device", "torch.autocast", "torch.amp.autocast",
        "torch.amp.autocast_mode.autocast", "torch.amp.GradScaler", "torch.is_autocast_enabled",
        "torch.get_autocast_dtype", "torch.set_autocast_dtype", "torch.get_device_module",
        "torch.Generator", "torch.distributed.device_mesh.init_device_mesh",
        "torch.distributed.init_device_mesh", "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed.DeviceMesh", "torch.Stream", "torch.Event",
        # torch.cuda's functions whose first parameter is the device (get_device_name("cuda") ...)
        *(f"torch.cuda.{name}" for name in (
            "Stream", "can_device_access_peer", "clock_rate", "current_stream", "default_stream", "device",
            "device_memory_used", "get_device_capability", "get_device_name", "get_device_properties",
            "get_per_process_memory_fraction", "get_rng_state", "list_gpu_processes", "max_memory_allocated",
            "max_memory_cached", "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached",
            "memory_reserved", "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "memory_usage",
            "power_draw", "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
            "reset_peak_memory_stats", "set_device", "synchronize", "temperature", "utilization")),
    }
)
# methods whose first positional argument is a device, whatever the receiver
DEVICE_FIRST_ARG_METHODS = frozenset({"to", "to_empty"})
# map_location may also be passed positionally as torch.load's second argument
TORCH_LOAD = "torch.load"

DEVICE_VALUE = re.compile(r"cuda(:\d+)?\Z")
# template strings whose text is "cuda:" + a placeholder ("cuda:%d", "cuda:{}", "cuda:{rank}")
DEVICE_TEMPLATE = re.compile(r"cuda(:(\d+|%[ds]|\{[^{}]*\})?)?\Z")
# backend strings: "nccl" or "cuda:nccl,cpu:gloo"-style device:backend pairs
BACKEND_VALUE = re.compile(r"(nccl|(cuda|cpu):(nccl|gloo|mpi|ucc)(,(cuda|cpu):(nccl|gloo|mpi|ucc))*)\Z")
# names of int ordinals (local_rank, args.gpu ...) that .to(x)/device=x turn into "npu:x"
INT_ORDINAL_NAMES = frozenset(
    {"rank", "local_rank", "gpu", "gpu_id", "gpu_idx", "gpu_index", "local_gpu", "rank_id", "gpu_rank"}
)
# call names whose string arguments are log/print text and never device uses
LOG_CALLS = frozenset(
    {"print", "debug", "info", "warning", "warn", "error", "exception", "critical", "log", "write", "echo",
     "secho", "format_exc"}
)

# ------------------------------------------------------------------------------ env vars
ENV_RENAMES = {
    "CUDA_VISIBLE_DEVICES": "ASCEND_RT_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF": "PYTORCH_NPU_ALLOC_CONF",
    # torch's device-generic name: torch_npu's allocator reads only PYTORCH_NPU_ALLOC_CONF
    "PYTORCH_ALLOC_CONF": "PYTORCH_NPU_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING": "ASCEND_LAUNCH_BLOCKING",
    "NCCL_SOCKET_IFNAME": "HCCL_SOCKET_IFNAME",
}
ENV_RENAME_NOTES = {
    "CUDA_VISIBLE_DEVICES": Flag(
        "visible-devices", "warning",
        "ASCEND_RT_VISIBLE_DEVICES ids must be strictly ascending (device_count() is 0 otherwise) and "
        "set before the NPU is initialised",
        "keep the list sorted, e.g. 0,1,2,3, and set it before importing torch_npu",
    ),
}
ENV_FLAGGED = {
    "CUBLAS_WORKSPACE_CONFIG": Flag(
        "env-var", "info", "CUBLAS_WORKSPACE_CONFIG has no effect on NPU",
        "remove it; for determinism use torch.use_deterministic_algorithms(True)",
    ),
}
NCCL_ENV_FLAG = Flag(
    "env-var", "warning", "NCCL_* variables have no effect on NPU; HCCL_* variables have different knobs",
    "find the HCCL equivalent in the CANN HCCL environment-variable list (e.g. HCCL_CONNECT_TIMEOUT)",
)
ENV_NAME = re.compile(r"\b(CUDA_VISIBLE_DEVICES|PYTORCH_CUDA_ALLOC_CONF|PYTORCH_ALLOC_CONF|CUDA_LAUNCH_BLOCKING|CUBLAS_WORKSPACE_CONFIG|"
                      r"(TORCH_)?NCCL_[A-Z0-9_]+)\b")

# A variable named like CUDA's that none of the tables above knows (basaran's CUDA_MEMORY_FRACTION):
# the project's own setting, read by its own code, so nothing can rename it; reported where it is
# set or read. NCCL_* are all reported above already. Names CUDA's toolkit, driver, libraries or
# container runtime do read, and CUDA's status constants, are not the project's own: left to the
# rules that know them (torch.utils.cpp_extension.CUDA_HOME, the audit of Python strings).
PROJECT_CUDA_VARIABLE = re.compile(r"\b(?:CUDA|NVIDIA|CUDNN|CUBLAS)_[A-Z0-9_]*[A-Z0-9]\b")
CUDA_READ_VARIABLES = re.compile(
    r"(?:CUDA_(?:HOME|PATH|ROOT|TOOLKIT_ROOT_DIR|BIN_PATH|VERSION|DEVICE_ORDER|MODULE_LOADING|DEVICE_MAX_CONNECTIONS|"
    r"AUTO_BOOST|FORCE_PTX_JIT|DISABLE_PTX_JIT|ENABLE_COREDUMP_ON_EXCEPTION|COREDUMP_FILE|SUCCESS|"
    r"(?:CACHE|MPS|ERROR|NVCC)_\w+)"
    r"|NVIDIA_(?:VISIBLE_DEVICES|DRIVER_CAPABILITIES|REQUIRE_\w+|DISABLE_REQUIRE|TF32_OVERRIDE|MIG_CONFIG_DEVICES|"
    r"PRODUCT_NAME|CUDA_\w+|DRIVER_VERSION)"
    r"|CUDNN_(?:LOG\w+|STATUS_\w+|VERSION|HOME|PATH|INCLUDE_DIR|LIB_DIR|LIBRARY)"
    r"|CUBLAS_(?:LOG\w+|STATUS_\w+))\Z")


def project_cuda_variable(name: str) -> bool:
    """A whole name like CUDA's (CUDA_*, NVIDIA_*, CUDNN_*, CUBLAS_*) that neither the tables here
    (renamed, flagged) nor CUDA itself know: the project's own variable."""
    return (PROJECT_CUDA_VARIABLE.fullmatch(name) is not None and name not in ENV_RENAMES
            and name not in ENV_FLAGGED and CUDA_READ_VARIABLES.match(name) is None)


def project_cuda_variable_flag(name: str) -> Flag:
    return Flag("project-cuda-variable", "warning",
                f"{name} is this project's own variable named like CUDA's (not one CUDA reads): "
                "check what it controls on the NPU",
                "read its uses: a GPU-only setting (a memory fraction, a device list) needs its NPU "
                "counterpart (torch.npu.set_per_process_memory_fraction, ASCEND_RT_VISIBLE_DEVICES) or none; "
                "rename it if the name now misleads")

# Allocator options torch_npu's PYTORCH_NPU_ALLOC_CONF parser knows (torch_npu 2.x NPUCachingAllocator):
# max_split_size_mb, garbage_collection_threshold, expandable_segments, roundup_power2_divisions,
# base_addr_aligned_kb, page_size, segment_size_mb. CUDA-only ones are reported.
CUDA_ONLY_ALLOC_OPTIONS = re.compile(r"\b(backend\s*:\s*cudaMallocAsync|pinned_use_cuda_host_register|"
                                     r"pinned_num_register_threads|release_lock_on_cudamalloc|"
                                     r"pinned_use_background_threads)\b")
ALLOC_OPTION_FLAG = Flag(
    "env-var", "warning", "this allocator setting is CUDA-only: torch_npu's PYTORCH_NPU_ALLOC_CONF does not know it",
    "keep the options torch_npu supports (expandable_segments, max_split_size_mb, garbage_collection_threshold, "
    "roundup_power2_divisions) and drop the rest",
)

# ------------------------------------------------------------------------------ legacy constructors
# torch.set_default_tensor_type(torch.cuda.HalfTensor) made legacy constructors (torch.Tensor(4, 4),
# as model-parallel layer libraries write them) create CUDA fp16 tensors. torch_npu refuses
# torch.npu.HalfTensor there ("only floating-point types are supported as the default type"), and the
# rewrite's set_default_device("npu") does not reach legacy constructors: they make CPU tensors.
LEGACY_CONSTRUCTORS = frozenset(
    f"torch.{name}" for name in ("Tensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor")
)
# a legacy constructor call in a file's text (files the pre-filter would skip, in such a tree)
LEGACY_CONSTRUCTOR_CALL_TEXT = re.compile(r"\b(?:Tensor|FloatTensor|HalfTensor|BFloat16Tensor|DoubleTensor)\(")
LEGACY_CONSTRUCTOR_DEFAULT = Flag(
    "legacy-constructor", "warning",
    "rewritten to set_default_device('npu') + set_default_dtype: factories (torch.empty, torch.zeros ...) follow "
    "it, but legacy constructors (torch.Tensor(4, 4), torch.FloatTensor(n)) do not and create CPU tensors, where "
    "the CUDA default tensor type made them CUDA tensors; torch_npu has no NPU default tensor type",
    "replace legacy constructors with torch.empty(...) / torch.tensor(...); each one in this tree is reported",
)
LEGACY_CONSTRUCTOR_CALL = Flag(
    "legacy-constructor", "warning",
    "a legacy constructor in a tree that made a CUDA tensor type the default: on the GPU it created a CUDA tensor, "
    "after the migration it creates a CPU tensor (set_default_device does not reach it)",
    "use torch.empty(sizes) for an uninitialised tensor (or torch.tensor(data) for data): they follow the default "
    "device and dtype",
)

# ------------------------------------------------------------------------------ CUDA-defaulting APIs
# torch APIs whose device argument defaults to "cuda" (torch 2.13): called without it they stay CUDA
# objects (a GradScaler() disables itself on an NPU host: fp16 training silently loses loss scaling).
# value: (parameter name, positional arguments that mean it was given)
CUDA_DEFAULT_DEVICE_APIS = {
    "torch.amp.GradScaler": ("device", 1),
    "torch.amp.grad_scaler.GradScaler": ("device", 1),
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler": ("device", 1),
    "torch.utils.checkpoint.DefaultDeviceType.set_device_type": ("device", 1),
    "torch.is_autocast_enabled": ("device_type", 1),
    "torch.set_autocast_enabled": ("device_type", 2),  # set_autocast_enabled(True) means CUDA
}



def lacks_device_argument(qualified: str, positional: int, starred: bool, keywords: set[str | None], *,
                          starred_may_give_it: bool = True) -> bool:
    """A call of a torch API whose device defaults to CUDA (CUDA_DEFAULT_DEVICE_APIS) made without it:
    `positional` arguments, `*args` among them or not, the keyword names (None for `**kwargs`).

    starred_may_give_it: `f(*args)` may pass the device (the rewrite leaves it alone); the audit,
    which must not miss one, passes False."""
    parameter, given_at = CUDA_DEFAULT_DEVICE_APIS[qualified]
    if starred_may_give_it and starred:
        return False
    return positional < given_at and not keywords & {parameter, None}


def torch_load_lacks_map_location(positional: int, keywords: set[str | None]) -> bool:
    """torch.load called with neither map_location (its second parameter) nor **kwargs."""
    return positional < 2 and not keywords & {"map_location", None}


# ------------------------------------------------------------------------------ third party
THIRD_PARTY = {
    "flash_attn": Flag(
        "flash-attn", "error", "flash_attn is a CUDA-only library",
        "torch_npu.npu_fusion_attention (different signature: head_num, input_layout, scale, keep_prob, "
        "atten_mask; returns a tuple) or F.scaled_dot_product_attention",
    ),
    "xformers": Flag(
        "xformers", "error", "xformers kernels are CUDA-only",
        "F.scaled_dot_product_attention (check the mask/bias semantics)",
    ),
    # an MLP, not attention: xformers' SwiGLU is w3(silu(x @ w1) * (x @ w2)), w12 packing [w1; w2] by default
    "xformers.ops.SwiGLU": Flag(
        "xformers", "error", "xformers' SwiGLU is a fused CUDA MLP kernel",
        "an nn.Module computing w3(F.silu(w1(x)) * w2(x)) with nn.Linear w1/w2/w3 (the same state dict as "
        "_pack_weights=False; packed, w12 is [w1; w2]), or w3(torch_npu.npu_swiglu(w12(x), dim=-1)) on the NPU",
    ),
    "triton": Flag(
        "triton", "error", "triton kernels target CUDA",
        "triton-ascend (triton-lang/triton-ascend) runs triton on NPU, but kernels need review; or use torch ops",
    ),
    "bitsandbytes": Flag(
        "bitsandbytes", "error", "bitsandbytes has only partial Ascend support (NF4)",
        "check the bitsandbytes Ascend backend for the ops used, or use torch.optim / unquantised weights",
    ),
    "apex": Flag(
        "apex", "error", "NVIDIA apex is CUDA-only",
        "torch.amp (autocast + GradScaler('npu')), torch.optim.AdamW, nn.LayerNorm, torch DDP; or "
        "Ascend's apex fork (NpuFusedAdam[W]); with apex amp, wrap DDP after amp.initialize",
    ),
    "amp_C": Flag("apex", "error", "amp_C is apex's CUDA extension", "use torch.optim's foreach/fused implementations"),
    "cupy": Flag("cupy", "error", "cupy runs on CUDA only", "use numpy on the host or torch ops on the NPU"),
    "pycuda": Flag("pycuda", "error", "pycuda runs on CUDA only", "use torch ops on the NPU"),
    "numba.cuda": Flag("numba-cuda", "error", "numba.cuda kernels run on CUDA only", "use torch ops or an Ascend C kernel"),
    "cudf": Flag("cudf", "error", "cudf runs on CUDA only", "use pandas"),
    "tensorrt": Flag("tensorrt", "error", "TensorRT is NVIDIA-only", "use torch_npu / torchair (torch.compile backend 'npu') or ATC/ACL for inference"),
    "torch2trt": Flag("tensorrt", "error", "torch2trt is NVIDIA-only", "use torchair (torch.compile backend 'npu')"),
    "nvidia.dali": Flag("dali", "error", "NVIDIA DALI runs on CUDA only", "use torch DataLoader (pin_memory) or Ascend DVPP"),
    "pynvml": Flag(
        "nvml", "error", "NVML does not exist on NPU hosts",
        "torch.npu.utilization(), torch.npu.mem_get_info(), or `npu-smi info`",
    ),
    "py3nvml": Flag("nvml", "error", "NVML does not exist on NPU hosts", "torch.npu.utilization(), torch.npu.mem_get_info(), or `npu-smi info`"),
    "nvidia_smi": Flag("nvml", "error", "NVML does not exist on NPU hosts", "torch.npu.utilization(), torch.npu.mem_get_info(), or `npu-smi info`"),
    "GPUtil": Flag("nvml", "error", "GPUtil reads nvidia-smi", "torch.npu.utilization(), torch.npu.mem_get_info(), or `npu-smi info`"),
    "isaacgym": Flag("cuda-only-library", "error", "Isaac Gym's GPU pipeline (PhysX on CUDA) does not exist on NPU hosts",
                     "run the simulator on the CPU (sim_device='cpu', use_gpu_pipeline=False) and move observations "
                     "to the NPU, or keep simulation on a CUDA host"),
    "isaacgymenvs": Flag("cuda-only-library", "error", "isaacgymenvs runs on Isaac Gym's CUDA pipeline",
                         "run the simulator on the CPU (sim_device='cpu') and the policy on the NPU"),
    "warp": Flag("cuda-only-library", "error", "NVIDIA Warp kernels run on CUDA or the CPU, never on an NPU",
                 "run Warp on the CPU (device='cpu') or port the kernels to torch ops"),
    "cuda": Flag("cuda-only-library", "error", "cuda-python (cuda.cudart, cuda.cuda) binds the CUDA driver/runtime",
                 "remove it; use torch.npu APIs"),
    "mamba_ssm": Flag("cuda-only-library", "error", "mamba_ssm's selective-scan kernels are CUDA/triton only",
                      "use its reference (pure torch) selective_scan_ref path or an Ascend port"),
    "causal_conv1d": Flag("cuda-only-library", "error", "causal_conv1d is a CUDA kernel package",
                          "use F.conv1d with left padding (the reference implementation)"),
    # the compiled extension modules those packages build, imported directly by mamba-style code
    "causal_conv1d_cuda": Flag("cuda-only-library", "error", "causal_conv1d_cuda is causal_conv1d's compiled CUDA "
                               "extension", "use F.conv1d with left padding (the reference implementation)"),
    "selective_scan_cuda": Flag("cuda-only-library", "error", "selective_scan_cuda is mamba_ssm's compiled CUDA "
                                "extension", "use mamba_ssm's reference (pure torch) selective_scan_ref path or an "
                                "Ascend port"),
    **{name: Flag("cuda-only-library", "error", f"{name} is {origin}'s compiled CUDA extension", suggestion)
       for name, origin, suggestion in (
           ("flash_attn_2_cuda", "flash-attn", "torch_npu.npu_fusion_attention or F.scaled_dot_product_attention"),
           ("flash_attn_cuda", "flash-attn", "torch_npu.npu_fusion_attention or F.scaled_dot_product_attention"),
           ("rotary_emb", "flash-attn (csrc/rotary)", "torch_npu.npu_rotary_mul(x, cos, sin) (cos/sin repeated to "
            "the full head dim), or x * cos + rotate_half(x) * sin in torch"),
           ("dropout_layer_norm", "flash-attn (csrc/layer_norm)", "torch_npu.npu_rms_norm(x, weight, eps)[0] or "
            "F.layer_norm (add the residual and apply dropout before it)"),
           ("xentropy_cuda_lib", "flash-attn (csrc/xentropy)", "F.cross_entropy (label_smoothing=, "
            "ignore_index=) in fp32"),
           ("fused_dense_lib", "flash-attn (csrc/fused_dense_lib)", "nn.Linear / F.linear"),
           ("fused_softmax_lib", "flash-attn (csrc/fused_softmax)", "torch_npu.npu_scaled_masked_softmax or "
            "torch.softmax"),
           ("ft_attention", "flash-attn (csrc/ft_attention)", "torch_npu.npu_incre_flash_attention or "
            "F.scaled_dot_product_attention"),
           ("apex_C", "apex", "torch._utils._flatten_dense_tensors / _unflatten_dense_tensors"),
           ("fused_layer_norm_cuda", "apex", "F.layer_norm or torch_npu.npu_rms_norm(x, weight, eps)[0]"),
           ("fast_layer_norm", "apex (contrib)", "F.layer_norm"),
           ("fused_adam_cuda", "apex", "torch.optim.AdamW(fused=True) or Ascend's apex fork (NpuFusedAdamW)"),
           ("fused_lamb_cuda", "apex", "a torch LAMB optimizer or Ascend's apex fork (NpuFusedLamb)"),
           ("syncbn", "apex", "torch.nn.SyncBatchNorm"),
           ("mlp_cuda", "apex", "nn.Sequential of nn.Linear and the activation"),
           ("fused_dense_cuda", "apex", "nn.Linear / F.linear"),
           ("xentropy_cuda", "apex (contrib)", "F.cross_entropy (label_smoothing=) in fp32"),
           ("scaled_masked_softmax_cuda", "apex/Megatron", "torch_npu.npu_scaled_masked_softmax"),
           ("scaled_upper_triang_masked_softmax_cuda", "apex/Megatron", "torch_npu.npu_scaled_masked_softmax with "
            "an upper-triangular mask"),
           ("scaled_softmax_cuda", "apex/Megatron", "torch.softmax(x * scale, dim=-1)"),
           ("fused_weight_gradient_mlp_cuda", "apex/Megatron", "the weight gradient of F.linear (no gradient "
            "accumulation fusion)"),
       )},
    "torch_tensorrt": Flag("tensorrt", "error", "Torch-TensorRT is NVIDIA-only", "use torchair (torch.compile backend 'npu')"),
    "cuml": Flag("cudf", "error", "cuML runs on CUDA only", "use scikit-learn"),
    "cugraph": Flag("cudf", "error", "cuGraph runs on CUDA only", "use networkx or torch ops"),
}
# CUDA-only libraries that take device strings: a "cuda" meant for them is theirs, never rewritten.
# value: keyword/variable names that carry their device (besides calls into the library itself)
CUDA_ONLY_DEVICE_LIBRARIES = {
    "isaacgym": frozenset({"sim_device", "graphics_device", "compute_device", "physics_device"}),
    "isaacgymenvs": frozenset({"sim_device", "graphics_device", "compute_device", "physics_device"}),
    "warp": frozenset({"wp_device", "warp_device"}),
    "cupy": frozenset(),
    "numba": frozenset(),
}
# for these, every call site is reported too (for the others the import is enough)
THIRD_PARTY_CALLS_REPORTED = frozenset({"flash_attn", "xformers", "bitsandbytes", "apex", "cupy", "pycuda", "pynvml"})
THIRD_PARTY_DECORATORS = frozenset({"triton.jit", "triton.autotune", "triton.heuristics", "numba.cuda.jit"})


def dotted_prefixes(qualified: str) -> list[str]:
    """`a.b.c` -> [a.b.c, a.b, a]: the most specific first."""
    parts = qualified.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def third_party_flag(qualified: str, local_packages: frozenset[str] = frozenset()) -> Flag | None:
    """The finding for a name in a CUDA-only library (THIRD_PARTY), by its most specific entry; none
    for a name in one of the migrated tree's own packages (mamba_ssm's own repository imports
    mamba_ssm.models.config_mamba, a dataclass: its kernels are reported where they are)."""
    top = qualified.split(".")[0]
    if top in local_packages:
        return None
    for prefix in dotted_prefixes(qualified):
        if prefix in THIRD_PARTY:
            return THIRD_PARTY[prefix]
    if CUDA_EXTENSION_NAME.search(top):
        return Flag("cuda-only-library", "error",
                    f"{top} is named as a compiled CUDA extension and is not a module of this tree: its kernels "
                    "have no NPU build", "replace its calls with torch / torch_npu ops (the package's pure-torch "
                    "reference, if it ships one)")
    return None


# a top-level module named like a built CUDA extension: `xentropy_cuda_lib`, `fused_adam_cuda`, `cuda_kernels_v2`
CUDA_EXTENSION_NAME = re.compile(r"(?:^|_)cuda(?:_|\d|$)", re.I)

NVIDIA_SMI = Flag(
    "nvidia-smi", "error", "nvidia-smi does not exist on NPU hosts",
    "`npu-smi info`, torch.npu.utilization(), torch.npu.mem_get_info()",
)
_NSIGHT = Flag("nvidia-profiler", "warning", "NVIDIA's profilers (Nsight Systems, nvprof) profile CUDA GPUs only",
               "on an NPU host: torch_npu.profiler or CANN's msprof; on the emulator: `npu-run --profile`")
_SANITIZER = Flag("nvidia-profiler", "warning", "compute-sanitizer / cuda-memcheck check CUDA kernels only",
                  "CANN's mssanitizer checks Ascend C kernels")
# a batch scheduler's GPU request: Slurm `#SBATCH --gres=gpu:8` / `--gpus-per-node`, PBS `ngpus=`, LSF `-gpu`
# (in a job script, or in a Python string that is one's template)
JOB_GPU_REQUEST = re.compile(r"^\s*#(?:SBATCH|PBS|BSUB)\b.*?(--gres[= ]\S*gpu\S*|--gpus(?:-per-\w+)?[= ]\S+|"
                             r"\bngpus=\S+|-gpu\b\s*\S*)", re.M)
JOB_GPU_FLAG = Flag("job-gpu-request", "warning", "this job asks its scheduler for NVIDIA GPUs",
                    "ask for the cluster's NPUs instead: the resource name is the site's (Slurm often "
                    "`--gres=npu:8`; check `scontrol show node` / the site docs)")
# NVIDIA's command-line tools, as the first word of a command (shell lines, subprocess strings and lists)
NVIDIA_TOOLS = {
    "nvidia-smi": NVIDIA_SMI,
    "nvcc": Flag("nvcc", "error", "nvcc compiles CUDA C++, which does not run on an NPU",
                 "NPU kernels are Ascend C, built with CANN's toolchain; or replace the kernel with a torch_npu "
                 "fused op or PyTorch ops"),
    "nsys": _NSIGHT,
    "nvprof": _NSIGHT,
    "ncu": Flag("nvidia-profiler", "warning", "Nsight Compute (ncu) profiles CUDA kernels only",
                "on an NPU host: CANN's `msprof op` profiles one kernel; on the emulator: `npu-run --profile`"),
    "compute-sanitizer": _SANITIZER,
    "cuda-memcheck": _SANITIZER,
}
# a tool's name where a command starts: line start, after ; & | ( ` $( or a quote, optionally behind sudo/env
NVIDIA_COMMAND = re.compile(r"(?:^|[;&|(`'\"]|\bsudo\s+|\bexec\s+|\btime\s+)\s*(?:\S*/)?"
                            r"(nvidia-smi|nvcc|nsys|nvprof|ncu|compute-sanitizer|cuda-memcheck)(?=$|[\s;&|)`'\"])")


# the same names as words anywhere in a shell line (`watch -n1 nvidia-smi`, `srun nsys profile`, `$(which nvcc)`,
# a notebook's `!nvidia-smi`, a Makefile recipe's `@nvcc`)
NVIDIA_TOOL_WORD = re.compile(r"(?:^|(?<=[\s;&|(`'\"/=!@]))(nvidia-smi|nvcc|nsys|nvprof|ncu|compute-sanitizer|cuda-memcheck)"
                              r"(?=$|[\s;&|)`'\"])")


def nvidia_tool(command: str) -> tuple[str, Flag] | None:
    """The NVIDIA tool a command line starts with (`nvcc -O3 ...`, `/usr/local/cuda/bin/nsys profile`)."""
    match = NVIDIA_COMMAND.match(command.lstrip())
    return (match.group(1), NVIDIA_TOOLS[match.group(1)]) if match else None

# ------------------------------------------------------------------------------ requirements
REQUIREMENT_FLAGS = [
    (re.compile(r"^(flash[-_]attn)", re.I), THIRD_PARTY["flash_attn"]),
    (re.compile(r"^xformers", re.I), THIRD_PARTY["xformers"]),
    (re.compile(r"^bitsandbytes", re.I), THIRD_PARTY["bitsandbytes"]),
    (re.compile(r"^(apex)\b", re.I), THIRD_PARTY["apex"]),
    (re.compile(r"^cupy", re.I), THIRD_PARTY["cupy"]),
    (re.compile(r"^pycuda", re.I), THIRD_PARTY["pycuda"]),
    (re.compile(r"^(triton)\b", re.I), THIRD_PARTY["triton"]),
    (re.compile(r"^(tensorrt|torch2trt|torch[-_]tensorrt)", re.I), THIRD_PARTY["tensorrt"]),
    (re.compile(r"^(pynvml|nvidia-ml-py3?|py3nvml|gpustat|GPUtil)", re.I), THIRD_PARTY["pynvml"]),
    (re.compile(r"^(cudf|dask-cudf|cuml|cugraph)", re.I), THIRD_PARTY["cudf"]),
    (re.compile(r"^nvidia-dali", re.I), THIRD_PARTY["nvidia.dali"]),
    (re.compile(r"^(mamba[-_]ssm|causal[-_]conv1d|deepspeed-kernels|liger[-_]kernel|flashinfer|vllm-flash-attn)", re.I),
     Flag("cuda-only-package", "error", "this package ships CUDA kernels", "look for an Ascend port or a torch-op fallback")),
    (re.compile(r"^nvidia-", re.I), Flag("cuda-wheel", "error", "NVIDIA CUDA runtime wheel", "remove it; the CANN toolkit provides the NPU runtime")),
]
TORCH_CUDA_WHEEL = re.compile(r"^(torch|torchvision|torchaudio)\s*[=~<>!]=?[^;#\s]*\+cu\d+", re.I)
CUDA_INDEX_URL = re.compile(r"download\.pytorch\.org/whl/(cu\d+|nightly/cu\d+)")

# ------------------------------------------------------------------------------ unsupported APIs
# Tensor methods from the unsupported list that are distinctive enough to flag by method name alone
# (a receiver's type is unknown without type inference; `mode`, `is_shared`... are too common).
UNSUPPORTED_TENSOR_METHODS = frozenset(
    name.rsplit(".", 1)[1]
    for name in UNSUPPORTED_TORCH_APIS
    if name.startswith("torch.Tensor.")
) - {"mode", "is_shared", "share_memory_"}

UNSUPPORTED_GENERIC = Flag(
    "unsupported-api", "warning",
    "on Ascend's published list of torch 2.8 APIs that torch_npu does not support (the list names APIs, not "
    "arguments; npu-run's emulator runs them with the CPU kernel, so a clean emulated run does not prove they "
    "run on the device)",
    "check it on an Ascend host, or find an alternative / keep this part on the CPU",
)
UNSUPPORTED_SUGGESTIONS = {
    "torch.nn.DataParallel": "use DistributedDataParallel",
    "torch.nn.parallel.data_parallel": "use DistributedDataParallel",
    "torch.backends.cuda.sdp_kernel": "remove the context manager: NPU SDPA picks its fused kernel itself",
    "torch.backends.cuda.enable_flash_sdp": "remove it: NPU SDPA picks its fused kernel itself",
    "torch.backends.cuda.enable_mem_efficient_sdp": "remove it: NPU SDPA picks its fused kernel itself",
    "torch.backends.cuda.enable_math_sdp": "remove it: NPU SDPA picks its fused kernel itself",
    "torch.autograd.profiler.emit_nvtx": "use torch_npu.profiler or torch.npu.mstx ranges",
    "torch.utils.cpp_extension.load": "rewrite CUDA kernels in Ascend C; build with torch_npu.utils.cpp_extension",
}

# Effort classes for the estimate (per item needing a human; labelled as an estimate in reports).
EFFORT_MINUTES = {
    "error": 60,
    "warning": 15,
    "info": 0,
}
# CUDA-only libraries whose port is estimated once per file: their further imports and call sites in
# that file cost a warning's time (one xformers import and three calls were "about 8 h"). Not triton
# or numba.cuda: each of their kernels (@triton.jit) is a port of its own.
PER_LIBRARY_EFFORT = frozenset({"flash-attn", "xformers", "apex", "cupy", "bitsandbytes", "pycuda",
                                "cuda-only-library"})
EFFORT_OVERRIDES = {  # kinds that take much longer than the default for their severity
    "cuda-extension": 60,  # the build switch; its kernels are counted one by one (cuda-kernel)
    # CUDA C: per kernel (__global__), host code and headers apart; `standalone-` kinds are code the
    # PyTorch path does not build, estimated apart from the total (report.effort)
    "cuda-kernel": 4 * 60,
    "standalone-cuda-kernel": 4 * 60,
    "cuda-source": 60,
    "standalone-cuda-source": 60,
    "cuda-header": 15,
    "standalone-cuda-header": 15,
    "triton": 4 * 60,
    "flash-attn": 2 * 60,
    "xformers": 2 * 60,
    "apex": 2 * 60,
    "numba-cuda": 4 * 60,
    "cupy": 4 * 60,
    "pycuda": 4 * 60,
}

# ------------------------------------------------------------------------------ pre-filter
# A file that matches none of these has nothing to migrate: it is not parsed at all. Every rule is
# triggered by a name that must appear in the text, whatever the import style; members of classes
# (torch.fx.Node.args ...) are left out because they are never written as qualified names.
_GENERIC_TOKENS = frozenset(
    """disable enable is_enabled load save export Linear LSTM scatter gather enabled strategy mark narrow
    compile reset is_available range_push range_pop step module code graph nodes args kwargs next prev type
    value name get_state set_state add check get set wait dtype events key_averages masked_select script range
    version comm profiler deterministic benchmark""".split()
)


def _is_class_member(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 3 and parts[-2][:1].isupper() and parts[-2] != "Tensor"


_STRONG_TOKENS = ("cuda", "nccl", "nvidia", "nvml", "cublas", "tf32", "nvtx", "cudf", "cudnn")
# (and what the environment rule reports in Python strings: NVIDIA's tools run, a job script's template)
_SUBSTRING_TOKENS = ("torch.load", "torch.compile", "nvcc", "nsys", "nvprof", "ncu", "compute-sanitizer",
                     "#SBATCH", "#PBS", "#BSUB")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# int device ordinals (.to(0), .to(local_rank), device=args.gpu, torch.device(rank)) mean the GPU too
_ORDINAL_USES = tuple(re.compile(prefix + r"\s*(?:\d|[\w.]*(?:rank|gpu)\b)") for prefix in (r"\.to\(", r"device\(", r"device\s*="))


def _prefilter_words() -> tuple[frozenset[str], tuple[tuple[str, str], ...]]:
    words: set[str] = set(UNSUPPORTED_TENSOR_METHODS)
    pairs: set[tuple[str, str]] = set()  # (parent, generic last name): both must appear
    for name in UNSUPPORTED_TORCH_APIS | set(CUDA_FLAGGED) | set(CUDA_RENAMED):
        if "." not in name or _is_class_member(name) or name.startswith("torch.Tensor."):
            continue
        if any(token in name.lower() for token in _STRONG_TOKENS):
            continue  # the text must spell the strong token to reach this name: already a trigger
        parent, last = name.rsplit(".", 2)[-2:]
        if last in _GENERIC_TOKENS:
            pairs.add((parent, last))
        else:
            words.add(last)
    words |= {m.split(".")[0] for m in THIRD_PARTY}
    words |= {"fork_rng", "channels_last", "autocast", "set_default_tensor_type", "set_float32_matmul_precision",
              "GradScaler", "ShardedGradScaler", "set_device_type", "set_autocast_enabled",
              "get_autocast_gpu_dtype", "set_autocast_gpu_dtype", "is_autocast_enabled",
              "load_in_8bit", "load_in_4bit", "BitsAndBytesConfig"}  # bitsandbytes through transformers
    return frozenset(words), tuple(sorted(pairs))


_PREFILTER_WORDS, _PREFILTER_PAIRS = _prefilter_words()


# Calls that write a value into a tensor: with float("-inf") they break fp16 training on a
# saturation-mode NPU (Ascend 910A), where every such fill sets the overflow flag.
INFINITE_FILL_CALLS = frozenset({"masked_fill", "masked_fill_", "fill", "fill_", "index_fill", "index_fill_",
                                 "new_full", "full", "full_like"})
INFINITE_FILL = Flag(
    "inf-fill", "info",
    "fills with +-inf: in fp16 on a saturation-mode NPU (Ascend 910A) inf saturates to +-65504 and sets the "
    "overflow flag every step, so GradScaler skips every step (fine in INF_NAN mode, 910B)",
    "fill with torch.finfo(x.dtype).min (or .max) instead",
)

# A fill call and an inf on one line: the usual spelling, and cheap enough for the pre-filter.
_INFINITE_FILL_LINE = re.compile(r"\b(?:" + "|".join(sorted(INFINITE_FILL_CALLS)) + r")\s*\([^\n]*\binf", re.IGNORECASE)


def worth_parsing(text: str) -> bool:
    """False when no rule can fire on this text (cheap: substring tests, then one word scan)."""
    lowered = text.lower()
    if any(token in lowered for token in _STRONG_TOKENS) or any(token in text for token in _SUBSTRING_TOKENS):
        return True
    if any(pattern.search(text) for pattern in _ORDINAL_USES):
        return True
    words = set(_WORD.findall(text))
    if not words.isdisjoint(_PREFILTER_WORDS):
        return True
    if "inf" in lowered and _INFINITE_FILL_LINE.search(text):
        return True
    return any(parent in words and last in words for parent, last in _PREFILTER_PAIRS)
