#!/usr/bin/env bash
# One device call: build (9.0a), the GPU tests, compute-sanitizer, then the backward's per-kernel
# time split against SDPA FLASH (benchmarks/bench_bwd_kernels.py) and an ncu profile of both
# backwards at one shape.  BASE=<dir> (a source tree, e.g. `git archive` of main unpacked there):
# built too, and bench_bwd_kernels runs alternately in it and here, ROUNDS times (same-call A/B).
# Usage on the GPU machine: OUT=... bash dev/gpu/gpu_profile_bwd.sh
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
build() {
  (cd "$1" && NVCC_APPEND_FLAGS="-Xptxas -v" TORCH_CUDA_ARCH_LIST=${ARCH:-9.0a} \
    FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace \
    > "$OUT/build_$2.log" 2>&1) || { tail -40 "$OUT/build_$2.log"; exit 1; }
}
build . new &
if [ -n "${BASE:-}" ]; then build "$BASE" base & fi
wait
[ -f flash_attn_ext/_C*.so ] 2>/dev/null || ls flash_attn_ext/_C*.so >/dev/null || exit 1
echo "build: $(( $(date +%s) - start )) s"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rfE ${PYTEST_ARGS:-tests/test_sm90.py \
    tests/test_cuda.py tests/test_numerics_nan.py} > "$OUT/tests.log" 2>&1
  echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head
fi
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in ${SANITIZERS:-}; do
  echo "$tool: $(timeout 90 "$SAN" --print-limit 5 --tool $tool python3 dev/gpu/sanitize_cases.py \
    2>&1 | tee "$OUT/sanitize_$tool.log" | tail -1)"
done
if [ -n "${BASE:-}" ]; then
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in "$BASE" .; do
      tag=$([ "$tree" = . ] && echo new || echo base)
      (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout ${BENCH_TIMEOUT:-150} python3 \
        benchmarks/bench_bwd_kernels.py ${BENCH_ARGS:-} 2>&1) | grep -v -i warn \
        | sed "s/^/$tag r$round /" | tee -a "$OUT/bwd_kernels.txt"
    done
  done
else
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_bwd_kernels.py ${BENCH_ARGS:-} 2>&1 \
    | grep -v -i warn | tee "$OUT/bwd_kernels.txt"
fi
# SCORE_ARGS (with BASE): benchmarks/bench_score_mods.py with those arguments in both trees, in
# turn (stdout only, to score_mods_ab.txt).
if [ -n "${SCORE_ARGS:-}" ] && [ -n "${BASE:-}" ]; then
  for tree in "$BASE" .; do
    tag=$([ "$tree" = . ] && echo new || echo base)
    (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout ${BENCH_TIMEOUT:-150} python3 \
      benchmarks/bench_score_mods.py $SCORE_ARGS --out-dir /tmp/score_$tag 2>&1) \
      | grep -v -i warn | sed "s/^/$tag /" | tee -a "$OUT/score_mods_ab.txt"
  done
fi
if [ "${NCU:-1}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout ${NCU_TIMEOUT:-180} "$NCU_BIN" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 benchmarks/bench_bwd_kernels.py --ncu ${NCU_ARGS:---dims 64 128 --seqlens 4096 --causal no} \
    > "$OUT/ncu_bwd.txt" 2>&1
  echo "ncu: rc $? $(grep -c '^  [a-zA-Z_].*(' "$OUT/ncu_bwd.txt") kernel reports"
fi
