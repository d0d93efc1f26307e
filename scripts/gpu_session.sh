#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, print the build/kernel table, run the CUDA tests,
# then benchmark.  Logs go to $OUT (or ./gpu_out).  Usage: scripts/gpu_session.sh [bench args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# The device image's default C++ compiler (/opt/gcc) links a private copy of libstdc++ into the
# extension, whose iostreams then crash on the process's (system) locale objects the first time a
# TORCH_CHECK message formats a number.  The system g++ links libstdc++ dynamically.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
NVCC_APPEND_FLAGS="-Xptxas -v" FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace \
  > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | head -20
python3 -m flash_attn_ext info | tee "$OUT/info.txt"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q ${PYTEST_ARGS:-tests/test_cuda.py} 2>&1 \
  | tee "$OUT/tests.log" | tail -25
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_attention.py --out-dir "$OUT" "$@" \
    2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -60
fi
