# Sourced by the device scripts (dev/gpu/gpu_*.sh): strict mode, the
# repository root as working directory, $OUT (default ./gpu_out) created, unbuffered Python, and
# the system C++ compiler where the image has one.  The device image's default C++ compiler
# (/opt/gcc) links a private copy of libstdc++ into the extension, whose iostreams then crash on
# the process's (system) locale objects the first time a TORCH_CHECK message formats a number;
# the system g++ links libstdc++ dynamically.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
# The CUTLASS headers for the Hopper kernels: the device machine has no network, so the pinned
# nvidia-cutlass wheel travels with the working tree in .whl/ (`pip download --no-deps
# nvidia-cutlass==4.2.0.0 -d .whl` here, then carry .whl).  Installed into a private target
# (headers only) when the interpreter does not already find cutlass_library.
if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)" 2>/dev/null; then
  whl=$(ls .whl/nvidia_cutlass-4.2.0.0-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/cutlass_site "$whl" && export PYTHONPATH=/tmp/cutlass_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_env: no CUTLASS headers (carry .whl/nvidia_cutlass-4.2.0.0-*.whl): the Hopper kernels will not be built"
  fi
fi
if [ -d /usr/local/cuda/bin ]; then export PATH=$PATH:/usr/local/cuda/bin; fi
# The lent GPU is an H200: build for it only (both kernel families run there; 8.0 would double
# the build time for nothing).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
# build_once NAME [JOBS]: the CUDA build in place, unless this machine already built this tree's
# sources (a warm machine keeps flash_attn_ext/_C*.so and build/ between calls; the stamp, a
# hash of csrc/ and setup.py, tells a changed tree from the same one, so that a warm call never
# tests the previous call's binary; the rebuild is incremental); its log in $OUT/build.log; on
# failure the log's tail and "NAME: build failed", exit 1.
build_once() {
  local stamp
  stamp=$(find csrc setup.py -type f | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-16)
  if ! ls flash_attn_ext/_C*.so > /dev/null 2>&1 || [ "$(cat build/cuda_build.stamp 2>/dev/null)" != "$stamp" ]; then
    (FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-${2:-16}} python3 setup.py -q build_ext \
      --inplace > "$OUT/build.log" 2>&1) || { tail -30 "$OUT/build.log"; echo "$1: build failed"; exit 1; }
    mkdir -p build && echo "$stamp" > build/cuda_build.stamp
  fi
  echo "$1: build done at ${SECONDS} s"
}
