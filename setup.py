"""Builds npukit's emulated-device extension (C++ against the installed torch)."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "npukit.npu_backend._C",
            ["npukit/npu_backend/csrc/device.cpp"],
            extra_compile_args=["-O3", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
