"""Builds the extension fastattn._C: the C++ CPU sources always, the CUDA sources only where both a
CUDA toolkit and a CUDA build of PyTorch are present. Metadata lives in pyproject.toml."""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# No floating-point traps are used: without them GCC vectorises loops with conversions.
cxx_flags = ["-O3", "-std=c++17", "-fno-trapping-math"]
sources = sorted(glob.glob("csrc/*.cpp"))
with_cuda = (
    torch.version.cuda is not None
    and CUDA_HOME is not None
    and os.environ.get("FASTATTN_NO_CUDA", "0") != "1"
)
if with_cuda:
    ext = CUDAExtension(
        "fastattn._C",
        sources + sorted(glob.glob("csrc/*.cu")),
        define_macros=[("FASTATTN_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
    )
else:
    ext = CppExtension("fastattn._C", sources, extra_compile_args={"cxx": cxx_flags})

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
