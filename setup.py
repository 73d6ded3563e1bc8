"""Builds the extension fastattn._C: the C++ CPU sources always, the CUDA sources only where both a
CUDA toolkit and a CUDA build of PyTorch are present. Metadata lives in pyproject.toml."""

import glob
import os
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# No floating-point traps are used: without them GCC vectorises loops with conversions. -g0
# drops the debug information Python's CFLAGS ask for (-g): it halved the build on 2 cores (147
# and 192 s against 354 and 362 s) and the library is 2 MB instead of 25.
cxx_flags = ["-O3", "-std=c++17", "-fno-trapping-math", "-g0"]
# at::parallel_for is inline OpenMP in ATen's headers: without -fopenmp every loop of the extension
# runs on one thread. Linking libgomp.so.1 reuses the one torch has loaded (same soname).
link_flags = []
if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
    cxx_flags.append("-fopenmp")
    link_flags.append("-fopenmp")
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
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension("fastattn._C", sources, extra_compile_args={"cxx": cxx_flags},
                       extra_link_args=link_flags)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
