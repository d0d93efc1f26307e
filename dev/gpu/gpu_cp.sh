#!/usr/bin/env bash
# One device call on the two-GPU machine (nvidia-h200-x2): build with CUDA (skipped when the
# warm machine kept this tree's build), then benchmarks/bench_context_parallel.py with what is
# left of a 540 s budget (nothing starts that would not fit; the ranks are stopped at 585 s),
# so that the call ends before its 600 s limit with the JSON written so far.  The script's own
# docstring says what it checks; its CUDA path has not yet run.  Carry .whl (the CUTLASS wheel,
# see gpu_env.sh).  Logs and the JSON go to $OUT: build.log, info.txt, cp.log,
# context_parallel_<date>_<commit>.json.
# Usage on the GPU machine: OUT=... [BUDGET=540] [COMMIT=sha] bash dev/gpu/gpu_cp.sh [args]
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASH_ATTN_EXT_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUDGET=${BUDGET:-540}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
build_once gpu_cp 32
python3 -m flash_attn_ext info > "$OUT/info.txt" 2>&1
# (A build without the Hopper kernels still checks context parallelism, on the portable
# kernels, but its timings are not the ones wanted: said, not stopped for.)
if grep -qiE "hopper kernels +not built" "$OUT/info.txt"; then
  echo "gpu_cp: the Hopper kernels were not built (see gpu_env.sh): ours is the portable kernel"
fi
python3 benchmarks/bench_context_parallel.py --out-dir "$OUT" --budget-s $((BUDGET - SECONDS)) \
  --deadline-s $((BUDGET + 45 - SECONDS)) "$@" 2>&1 | tee "$OUT/cp.log"
