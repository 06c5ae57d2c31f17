"""Builds npukit's extensions: the emulated device (C++ against the installed torch) and the
dump session's one-pass statistics kernel (C++ on the CPython API, no torch)."""

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "npukit.npu_backend._C",
            ["npukit/npu_backend/csrc/device.cpp", "npukit/npu_backend/csrc/tensor_types.cpp"],
            extra_compile_args=["-O3", "-std=c++17"],
        ),
        Extension("npukit.accuracy._stats", ["npukit/accuracy/csrc/stats.cpp"], extra_compile_args=["-O3"]),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
