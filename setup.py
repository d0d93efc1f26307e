"""Build script for flash_attn_ext.

Builds one extension module, ``flash_attn_ext._C``, that registers the ``flash_attn_ext`` ops with
``TORCH_LIBRARY``.  The CPU implementation is always built.  CUDA sources (``csrc/cuda`` and
``csrc/kernels``) are added when the CUDA build is switched on:

* ``FLASH_ATTN_EXT_CUDA=auto`` (default): on when torch is a CUDA build and nvcc is found.
* ``FLASH_ATTN_EXT_CUDA=1``: on; fails with a clear error if either is missing.
* ``FLASH_ATTN_EXT_CUDA=0``: off (CPU only), even where CUDA is available.

``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures (default ``8.0;9.0a``).  No GPU is needed to
build.  The Hopper kernels (``csrc/kernels/sm90``, for ``9.0a``) are written with CuTe and need the
CUTLASS headers of the pinned ``nvidia-cutlass`` wheel (``pip install nvidia-cutlass==4.2.0.0``;
or ``CUTLASS_INCLUDE_DIR``); without them the build warns and leaves them out (the portable sm80
kernels then serve Hopper GPUs, and ``explain()`` says so).  Install with
``pip install --no-build-isolation .`` (torch must already be installed).
"""

import glob
import importlib.util
import os
import re
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def read_version() -> str:
    with open(os.path.join(HERE, "flash_attn_ext", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def cuda_requested() -> bool:
    import torch
    from torch.utils import cpp_extension

    mode = os.environ.get("FLASH_ATTN_EXT_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"FLASH_ATTN_EXT_CUDA={mode!r}: expected one of auto, 0, 1")
    have_cuda_torch = torch.version.cuda is not None
    have_nvcc = cpp_extension.CUDA_HOME is not None
    if mode == "0":
        return False
    if mode == "1":
        if not have_cuda_torch:
            raise RuntimeError("FLASH_ATTN_EXT_CUDA=1 but the installed torch is a CPU-only build")
        if not have_nvcc:
            raise RuntimeError("FLASH_ATTN_EXT_CUDA=1 but nvcc / CUDA_HOME was not found")
        return True
    return have_cuda_torch and have_nvcc


def cutlass_include():
    """The CUTLASS/CuTe include directory: $CUTLASS_INCLUDE_DIR, else the nvidia-cutlass wheel's
    (found without importing it), else None."""
    candidates = []
    if os.environ.get("CUTLASS_INCLUDE_DIR"):
        candidates.append(os.environ["CUTLASS_INCLUDE_DIR"])
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, "source", "include")
                       for p in spec.submodule_search_locations]
    for path in candidates:
        if os.path.exists(os.path.join(path, "cute", "tensor.hpp")):
            return path
    return None


def rel(paths):
    return sorted(os.path.relpath(p, HERE) for p in paths)


def make_extension():
    from torch.utils import cpp_extension

    cpp_sources = rel(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    cpp_sources += rel(glob.glob(os.path.join(HERE, "csrc", "cpu", "*.cpp")))
    cuda_sources = rel(
        glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu"))
        + glob.glob(os.path.join(HERE, "csrc", "kernels", "sm80", "*.cu"))
    )
    with_cuda = cuda_requested() and bool(cuda_sources)
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs

    defines = [f'-DFLASH_ATTN_EXT_VERSION="{read_version()}"']
    include_dirs = [os.path.join(HERE, "csrc")]
    if with_cuda:
        defines += ["-DFLASH_ATTN_EXT_WITH_CUDA", f'-DFLASH_ATTN_EXT_CUDA_ARCHS="{archs}"']
        tokens = [a.strip().split("+")[0] for a in re.split(r"[;\s]+", archs) if a.strip()]
        if "9.0" in tokens and "9.0a" not in tokens:
            print("flash_attn_ext: WARNING: TORCH_CUDA_ARCH_LIST has 9.0 but not 9.0a: the Hopper "
                  "kernels (wgmma/TMA need sm_90a) are left out", file=sys.stderr)
        if "9.0a" in tokens:
            cutlass = cutlass_include()
            if cutlass is None:
                print("flash_attn_ext: WARNING: the CUTLASS headers were not found (pip install "
                      "nvidia-cutlass==4.2.0.0, or set CUTLASS_INCLUDE_DIR): building without "
                      "the Hopper (sm90) kernels", file=sys.stderr)
            else:
                include_dirs.append(cutlass)
                defines.append("-DFLASH_ATTN_EXT_SM90")
                cuda_sources += rel(glob.glob(os.path.join(HERE, "csrc", "kernels", "sm90",
                                                           "*.cu")))
    cxx_flags = ["-O3", "-fopenmp-simd", *defines]
    link_flags = []
    if sys.platform.startswith("linux") and os.environ.get("FLASH_ATTN_EXT_OPENMP", "1") != "0":
        # at::parallel_for is a header template that is parallel only where the including file is
        # compiled with OpenMP; torch ships libgomp.so.1 and the loader reuses that copy.
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    if with_cuda:
        return cpp_extension.CUDAExtension(
            "flash_attn_ext._C",
            cpp_sources + cuda_sources,
            include_dirs=include_dirs,
            extra_link_args=link_flags,
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "--use_fast_math", "--expt-relaxed-constexpr", *defines],
            },
        )
    return cpp_extension.CppExtension(
        "flash_attn_ext._C", cpp_sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags,
    )


def require_torch() -> None:
    """Stops with one line that says what to do when torch is not importable (instead of a
    ModuleNotFoundError traceback in pip's error box)."""
    if importlib.util.find_spec("torch") is None:
        sys.exit("flash_attn_ext: building needs PyTorch: install torch first "
                 "(https://pytorch.org/get-started), then `pip install --no-build-isolation .` "
                 "(the extension compiles against the torch that is installed)")


def main():
    require_torch()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="flash_attn_ext",
        version=read_version(),
        packages=["flash_attn_ext", "flash_attn_ext.integrations"],
        ext_modules=[make_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
