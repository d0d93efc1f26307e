#!/usr/bin/env bash
# One device call for the Hopper forward's variants: build (9.0a only), tests/test_cuda.py,
# tests/test_sm90.py (its many-tiles test runs every FLASH_ATTN_EXT_SM90_SCHEDULE and
# FLASH_ATTN_EXT_SM90_EPILOGUE), compute-sanitizer racecheck/memcheck/synccheck with the defaults,
# then benchmarks/sm90_variants.py (schedules x epilogues next to cuDNN, CUDA-graph timing).
# Usage on the GPU machine: OUT=... bash scripts/gpu_verify_persistent.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=16 \
  python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
echo "test_cuda (default schedule): $(timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rfE tests/test_cuda.py 2>&1 \
  | tee "$OUT/test_cuda.log" | tail -1)"
grep -E "^(FAILED|ERROR) " "$OUT/test_cuda.log" | head -20
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# test_sm90 runs its many-tiles test under every schedule and epilogue itself.
timeout 150 python3 -m pytest -q -rfE tests/test_sm90.py > "$OUT/test_sm90.log" 2>&1
echo "test_sm90: $(tail -1 "$OUT/test_sm90.log")"
grep -E "^(FAILED|ERROR) " "$OUT/test_sm90.log" | head
for tool in racecheck memcheck synccheck; do
  echo "$tool: $(timeout 90 "$SAN" --print-limit 5 --tool $tool python3 scripts/sanitize_cases.py \
    2>&1 | tee "$OUT/sanitize_$tool.log" | tail -1)"
done
unset FLASH_ATTN_EXT_SM90_SCHEDULE
timeout ${VARIANTS_TIMEOUT:-240} python3 benchmarks/sm90_variants.py "$@" 2>&1 | grep -v Warning \
  | tee "$OUT/variants.txt"
