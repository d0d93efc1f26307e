#!/usr/bin/env bash
# One device call: build, CUDA tests, compute-sanitizer, and only if every test passed the full
# benchmark table (bench_attention.py defaults), then with FWD_ROUNDS=<n> also fwd_rounds.py's
# forward-only comparison in n interleaved rounds (~20 s per round).  Timing on the H200
# (2026-11-30): build ~90 s, tests ~30 s, compute-sanitizer ~60 s, bench_attention ~340 s (its
# forwards in 3 rounds; ~10% more since its backward takes its own forward reading): ~560 s of
# a call's 600 (bench_attention rewrites its JSON after every point, so a timeout keeps what
# it measured).  Usage on the GPU machine:
#   OUT=... [FWD_ROUNDS=5] [BENCH_ARGS="..."] [HOST_OVERHEAD=1] [BASE_BUILD_LOG=path]
#     bash dev/gpu/gpu_final.sh [extra pytest files]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
SANITIZE=1 BENCH=0 PYTEST_ARGS="--maxfail=15 --tb=short tests/test_sm90.py tests/test_cuda.py $*" \
  bash dev/gpu/gpu_session.sh
if [ -n "${BASE_BUILD_LOG:-}" ]; then  # ptxas -v of every kernel against an earlier build's
  python3 dev/gpu/ptxas_compare.py "$BASE_BUILD_LOG" "$OUT/build.log" | tee "$OUT/ptxas_compare.txt"
fi
if grep -qE "[0-9]+ failed|[0-9]+ error" "$OUT/tests.log" || ! grep -qE "[0-9]+ passed" "$OUT/tests.log"; then
  echo "tests did not all pass: no benchmark"; exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${HOST_OVERHEAD:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/host_overhead.py 2>&1 | grep -v Warning | tee "$OUT/host_overhead.txt"
fi
# BENCH_ARGS: bench_attention.py options, e.g. a smaller grid ("--seqlens 1024 4096 --no-flex").
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_attention.py --out-dir "$OUT" \
  ${BENCH_ARGS:---flex-dims 128} \
  2>&1 | grep -v Warning > "$OUT/bench.log"
sed -n '/^fwd_tflops/,$p' "$OUT/bench.log"
grep -iE "memory|GiB" "$OUT/bench.log" | head -8
if [ "${FWD_ROUNDS:-0}" -gt 0 ]; then
  timeout ${ROUNDS_TIMEOUT:-200} python3 benchmarks/fwd_rounds.py --rounds "$FWD_ROUNDS" \
    --out "$OUT/fwd_rounds.json" 2>&1 | grep -v Warning | tee "$OUT/fwd_rounds.txt"
fi
