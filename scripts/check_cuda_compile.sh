#!/usr/bin/env bash
# Compiles every CUDA source file without a GPU and without a CUDA build of torch, so a compile
# error is caught in CI before anyone reaches a GPU.  Kernels (csrc/kernels, torch-free) for each
# default arch; the glue (csrc/cuda, includes torch) for sm_80 against the installed torch's
# headers (a CPU wheel lacks one generated c10/cuda header; a stub stands in for this check).
# Objects are thrown away.  Incremental: a compilation that passed is not run again until its
# inputs change (scripts/cuda_check_run.py; stamps in .cuda-check-cache, or $CUDA_CHECK_CACHE),
# so a fresh clone (CI) compiles everything and a second `make test` only what changed.
# CUDA_CHECK=0 skips the check.  Skips (exit 0) when nvcc is missing; without the CUTLASS headers
# (and no way to install them) the Hopper kernels are skipped with a warning.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ "${CUDA_CHECK:-1}" = 0 ]; then echo "check_cuda_compile: skipped (CUDA_CHECK=0)"; exit 0; fi
if ! command -v nvcc >/dev/null; then echo "check_cuda_compile: no nvcc, skipped"; exit 0; fi
TORCH_DIR=$($PY -c "import os, torch; print(os.path.dirname(torch.__file__))")
# curand's headers (dropout's Philox): nvcc's own, else those of the pinned nvidia-curand wheel.
curand_include() {
  $PY - <<'PYEOF'
import os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
for d in nvidia.__path__:
    inc = os.path.join(d, "cu13", "include")
    if os.path.exists(os.path.join(inc, "curand_philox4x32_x.h")):
        print(inc)
        break
PYEOF
}
# CUTLASS/CuTe headers (the Hopper kernels): the pinned nvidia-cutlass wheel's, found without
# importing it (its Python dependencies are not needed for the headers).
cutlass_include() {
  $PY - <<'PYEOF'
import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
for d in (spec.submodule_search_locations or []) if spec else []:
    inc = os.path.join(d, "source", "include")
    if os.path.exists(os.path.join(inc, "cute", "tensor.hpp")):
        print(inc)
        break
PYEOF
}
CUTLASS_INC=$(cutlass_include)
if [ -z "$CUTLASS_INC" ]; then
  $PY -m pip install -q --no-deps -r requirements-cuda-check.txt || true
  CUTLASS_INC=$(cutlass_include)
fi
SM90_FLAGS=""
if [ -n "$CUTLASS_INC" ]; then
  SM90_FLAGS="-DFLASH_ATTN_EXT_SM90 -I $CUTLASS_INC"
else  # e.g. offline: the rest is still checked, the Hopper kernels are not
  echo "check_cuda_compile: WARNING: no CUTLASS headers (pip install --no-deps" \
       "nvidia-cutlass==4.2.0.0): the Hopper kernels are not compile-checked"
fi
EXTRA_INC=()
if ! echo '#include <curand_philox4x32_x.h>' | nvcc -x cu -E - -o /dev/null 2>/dev/null; then
  inc=$(curand_include)
  if [ -z "$inc" ]; then
    $PY -m pip install -q --no-deps -r requirements-cuda-check.txt
    inc=$(curand_include)
  fi
  [ -n "$inc" ] && EXTRA_INC=(-I "$inc")
fi
STUB=$(mktemp -d)
trap 'rm -rf "$STUB"' EXIT
mkdir -p "$STUB/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STUB/c10/cuda/impl/cuda_cmake_macros.h"
# The flags torch's CUDAExtension adds: no implicit half/bfloat16 conversions or operators.
FLAGS=(-std=c++17 -O2 --use_fast_math -I csrc -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr ${EXTRA_INC[@]+"${EXTRA_INC[@]}"})
jobs=()
for f in $(find csrc/kernels/sm80 -name '*.cu' | sort); do
  for arch in 80 90a; do
    jobs+=("nvcc ${FLAGS[*]} -gencode arch=compute_${arch},code=sm_${arch} -c $f -o /dev/null")
  done
done
# The Hopper kernels: sm_90a only (their bodies are empty for other archs).
for f in $( [ -n "$SM90_FLAGS" ] && find csrc/kernels/sm90 -name '*.cu' | sort); do
  jobs+=("nvcc ${FLAGS[*]} $SM90_FLAGS -gencode arch=compute_90a,code=sm_90a -c $f -o /dev/null")
done
for f in $(find csrc/cuda -name '*.cu' | sort); do
  jobs+=("nvcc ${FLAGS[*]} $SM90_FLAGS -I $STUB -I $TORCH_DIR/include -I $TORCH_DIR/include/torch/csrc/api/include -gencode arch=compute_80,code=sm_80 -c $f -o /dev/null")
done
printf '%s\n' "${jobs[@]}" | PY=$PY $PY scripts/cuda_check_run.py \
  --cache "${CUDA_CHECK_CACHE:-.cuda-check-cache}" --jobs "$(nproc)" --stub "$STUB" \
  || { echo "check_cuda_compile: FAILED"; exit 1; }
echo "check_cuda_compile: ${#jobs[@]} compilations of $(find csrc -name '*.cu' | wc -l) CUDA files OK"
