"""Builds npukit's extensions: the emulated device (C++ against the installed torch), the
dump session's one-pass statistics kernels (C++ on the CPython API, no torch) and their entry that
takes a tensor (against torch).

The fused ops' kernels (csrc/fused_kernels_<capability>.cpp) are compiled once per CPU capability
ATen dispatches to, with the flags ATen builds that capability's kernels with, so that each
computes exactly as ATen's own kernels do on the machine (the one ATen uses runs)."""

import platform
from pathlib import Path

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = "npukit/npu_backend/csrc"
X86 = platform.machine().lower() in ("x86_64", "amd64")
# ATen's flags per capability (its cmake: CPU_CAPABILITY_FLAGS); like ATen's kernels, these are compiled
# with GNU-mode contraction of a * b + c into FMA (-std=c++17 alone turns it off) and with OpenMP, so
# that at::parallel_for splits a loop as ATen's own kernels do (torch's libgomp serves it at run time)
KERNEL_FLAGS = ["-ffp-contract=fast", "-fopenmp"]
CAPABILITY_FLAGS = {
    "default": KERNEL_FLAGS,
    "avx2": ["-mavx2", "-mfma", "-mbmi", "-mbmi2", "-mf16c"] + KERNEL_FLAGS,
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mbmi", "-mbmi2", "-mf16c"]
    + KERNEL_FLAGS,
}
CAPABILITIES = list(CAPABILITY_FLAGS) if X86 else ["default"]
# Kernels for one CPU feature beyond ATen's capabilities, called only where the CPU has it (checked at run
# time): fused_kernels_avx512bf16.cpp, the bf16 -> fp32 matmul on vdpbf16ps (AVX512-BF16)
FEATURE_FLAGS = {"avx512bf16": CAPABILITY_FLAGS["avx512"] + ["-mavx512bf16"]}
FEATURES = list(FEATURE_FLAGS) if X86 else []


class BuildWithCapabilities(BuildExtension):
    """BuildExtension, with each fused_kernels_<capability or feature>.cpp compiled with its flags."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile

        def compile_with_flags(obj, src, ext_name, cc_args, extra_postargs, pp_opts):
            stem = Path(src).stem
            kind = stem.removeprefix("fused_kernels_")
            flags = CAPABILITY_FLAGS.get(kind, FEATURE_FLAGS.get(kind, [])) if stem.startswith("fused_kernels_") else []
            if isinstance(extra_postargs, dict):
                extra_postargs = {**extra_postargs, "cxx": list(extra_postargs.get("cxx", [])) + flags}
            else:
                extra_postargs = list(extra_postargs) + flags
            return compile_one(obj, src, ext_name, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = compile_with_flags
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = compile_one


setup(
    ext_modules=[
        CppExtension(
            "npukit.npu_backend._C",
            [f"{CSRC}/device.cpp", f"{CSRC}/tensor_types.cpp", f"{CSRC}/fused_kernels.cpp"]
            + [f"{CSRC}/fused_kernels_{capability}.cpp" for capability in CAPABILITIES]
            + [f"{CSRC}/fused_kernels_{feature}.cpp" for feature in FEATURES],
            extra_compile_args=["-O3", "-std=c++17"],
            extra_link_args=["-fopenmp"],
        ),
        Extension("npukit.watch._stats", ["npukit/watch/csrc/stats.cpp"], extra_compile_args=["-O3"],
                  depends=["npukit/watch/csrc/stats_kernels.h"]),
        # the same kernels, given a tensor: its fields read in C++ (see tensor_stats.cpp)
        CppExtension("npukit.watch._tensor_stats", ["npukit/watch/csrc/tensor_stats.cpp"],
                     extra_compile_args=["-O3", "-std=c++17"], depends=["npukit/watch/csrc/stats_kernels.h"]),
    ],
    cmdclass={"build_ext": BuildWithCapabilities.with_options(use_ninja=False)},
)
