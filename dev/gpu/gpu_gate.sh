#!/usr/bin/env bash
# One device call: the landing gate of a CUDA-path commit (the brief: test_cuda, test_sm90 and
# the compile tests on that exact commit), in the order that matters when the call runs out of
# time: the build (skipped when the warm machine kept this tree's), the compile tests of every
# file, test_sm90 and test_cuda, then the other CUDA test files as long as time is left.  Each
# stage has its own log under $OUT and a summary line; a stage the deadline cut says so
# ("cut"), so a partial gate is never read as a pass.  Timing on the H200 (2026-12-04): build
# 190-250 s, compile tests ~60 s, test_sm90 + test_cuda ~120 s, the other 15 files ~250 s; on
# an H100 (2026-12-06): build 170-222 s, 61-85 s, 88-124 s, 110 s for the other 16 (half of
# them in 160 s on a slower machine; 2026-12-07: 219, 68, 96 s, and 39% of the others in
# 150 s); on the H200 with 142 Hopper units (2026-12-07): build 270 s, 70, 94 s, the others
# 274 s; on an H100 of 2026-12-07, build 331 s, compile 106 s, core 89% done at 148 s: in
# series one call fits on a fast machine only, so either run the two stages side by side
# (PARALLEL=1, below: build 342 s and both stages 226 s on an H100) or plan two calls
# (STAGES="compile core", then STAGES=others on the warm machine).
# Usage on the GPU machine:
#   OUT=... DEADLINE=<seconds from the start, default 580> [COMMIT=sha] [STAGES="compile core
#   others"] [PARALLEL=1] [AFTER="<command>"] bash dev/gpu/gpu_gate.sh
# STAGES picks the stages (a second, warm call: STAGES=others); AFTER runs last with the time
# left (e.g. an A/B benchmark of the same build), its output in $OUT/after.log.  Tried and
# dropped: each stage's files on 4 pytest-xdist workers (one file per worker).  On an H100
# (2026-12-06) the compile stage took 103 s against 71 serially and the core stage ran 24% of
# its tests in 155 s against all of them in 96 s serially: the workers' processes time-slice
# the one GPU (no MPS), and thousands of short tests wait on the context switches.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASH_ATTN_EXT_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEADLINE=${DEADLINE:-580}
build_once gate
# Each translation unit's compile time (ninja's log: start, end in ms, output), longest first,
# to see which units bound the build's wall time on 16 cores.
log=$(ls build/temp*/.ninja_log 2>/dev/null | head -1)
if [ -n "$log" ]; then
  awk -F'\t' 'NR > 1 { t[$4] = ($2 - $1) / 1000 }  # the last build of each output
    END { for (o in t) { n = o; sub(/.*\/csrc\//, "csrc/", n); printf "%7.1f s  %s\n", t[o], n } }' \
    "$log" | sort -rn > "$OUT/build_times.txt"
  echo "gate: longest compiles: $(head -3 "$OUT/build_times.txt" | awk '{printf "%s %s; ", $1, $3}')"
fi
OTHERS="tests/test_ops.py tests/test_varlen.py tests/test_kvcache.py tests/test_mask.py
  tests/test_alibi.py tests/test_dropout.py tests/test_decode.py tests/test_sdpa.py
  tests/test_torch_flash.py tests/test_transformers.py tests/test_numerics_nan.py
  tests/test_validation.py tests/test_planning.py tests/test_patch.py tests/test_autocast.py
  tests/test_attention.py"
stage() {  # name, pytest arguments...
  local name=$1 left=$((DEADLINE - SECONDS))
  shift
  if [ "$left" -le 5 ]; then echo "gate: $name: not run (no time left)"; return 1; fi
  timeout "$left" python3 -m pytest -q -rfE "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local summary
  summary=$(tail -1 "$OUT/$name.log")
  if [ $rc -eq 124 ]; then summary="cut at the deadline after: $summary"; fi
  echo "gate: $name: $summary"
  grep -E "^(FAILED|ERROR) " "$OUT/$name.log" | head -10
  return $rc
}
# (Unset: every stage; STAGES="" or "none": none, for a call that only builds and runs AFTER.)
STAGES=${STAGES-compile core others}
compile_stage() {
  stage compile -k compile tests/test_cuda.py tests/test_ops.py tests/test_sm90.py \
    tests/test_varlen.py tests/test_kvcache.py tests/test_sdpa.py tests/test_dropout.py
}
# PARALLEL=1 (with both stages asked for): the compile stage in a second process beside the
# core stage.  The compile tests spend most of their time tracing and compiling on the CPU
# (16 cores there), the core tests on the GPU, so the two overlap: on an H100 (2026-12-07,
# 956d51c) both were done in 226 s (core 226, compile 114) against ~272 s in series on an H100
# the day before (106 + ~166), so that the build and both stages fit one call of 585 s there.
# (xdist's four GPU-bound workers lost: above.)
compile_pid=
case " $STAGES " in *" compile "*)
  if [ "${PARALLEL:-0}" = 1 ] && [[ " $STAGES " == *" core "* ]]; then
    compile_stage > "$OUT/compile.summary" 2>&1 &
    compile_pid=$!
  else
    compile_stage
  fi;; esac
case " $STAGES " in *" core "*)
  stage core -k "not compile" tests/test_sm90.py tests/test_cuda.py;; esac
if [ -n "$compile_pid" ]; then
  wait "$compile_pid"
  cat "$OUT/compile.summary"
fi
# shellcheck disable=SC2086
case " $STAGES " in *" others "*) stage others -k "not compile" $OTHERS;; esac
if [ -n "${AFTER:-}" ]; then
  left=$((DEADLINE - SECONDS))
  if [ "$left" -gt 5 ]; then
    timeout "$left" bash -c "$AFTER" > "$OUT/after.log" 2>&1
    echo "gate: after (rc $?): $(tail -3 "$OUT/after.log")"
  else
    echo "gate: after: not run (no time left)"
  fi
fi
echo "gate: end at ${SECONDS} s"
