#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, print the build/kernel table, run the CUDA tests,
# compute-sanitizer (SANITIZE=1), then benchmark (BENCH=0 skips it).  Logs go to $OUT (or
# ./gpu_out).  Usage: dev/gpu/gpu_session.sh [bench args]
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
NVCC_APPEND_FLAGS="-Xptxas -v" FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace \
  > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | head -20
python3 -m flash_attn_ext info | tee "$OUT/info.txt"
# On an sm_90 GPU a build without the Hopper kernels would test and time the wrong kernels.
if nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q "^9\.0" &&
   grep -qiE "hopper kernels +not built" "$OUT/info.txt"; then
  echo "gpu_session: sm_90 GPU but the Hopper kernels were not built (see gpu_env.sh)"; exit 1
fi
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE ${PYTEST_ARGS:-tests/test_cuda.py} 2>&1 \
  > "$OUT/tests.log"
# The summary lines also in a small file: the device call may not return a large tests.log.
{ grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -40; tail -n 5 "$OUT/tests.log"; } \
  > "$OUT/tests_summary.txt"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -20
grep -E "[0-9]+ (passed|failed|error)" "$OUT/tests.log" | tail -1
sed -n '/= FAILURES =/,/short test summary/p' "$OUT/tests.log" | grep -E "^(E |___|tests/)" | head -60
if [ "${SANITIZE:-0}" = 1 ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck synccheck; do
    echo "compute-sanitizer $tool: $(timeout 120 "$SAN" --print-limit 5 --tool $tool \
      python3 dev/gpu/sanitize_cases.py 2>&1 | tee "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_attention.py --out-dir "$OUT" "$@" \
    2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -60
fi
