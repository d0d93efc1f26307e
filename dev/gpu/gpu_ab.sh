#!/usr/bin/env bash
# One device call: A/B of the Hopper forward against a baseline source tree in the same call
# (the speed of one H200 differs from call to call by several percent, so only same-call numbers
# compare).  Builds this tree (9.0a only) and $BASE (default ab_base/, e.g. `git archive main`
# unpacked there), runs tests/test_sm90.py, tests/test_cuda.py and compute-sanitizer here, then
# dev/ab/sm90_variants.py alternately in each tree, $ROUNDS times ($BASE_ARGS / $NEW_ARGS: its
# variant arguments per tree; a tree whose kernel reads no variant variable runs its one kernel).
# $ALT (optional): a third tree, built and timed like this one ("alt"), e.g. a variant of it.
# Usage on the GPU machine: OUT=... BASE=ab_base bash dev/gpu/gpu_ab.sh [sm90_variants args]
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-ab_base}; ROUNDS=${ROUNDS:-2}
BASE_ARGS=${BASE_ARGS:---schedules tile --epilogues direct}
NEW_ARGS=${NEW_ARGS:---schedules auto --epilogues tma}
build() {
  (cd "$1" && TORCH_CUDA_ARCH_LIST=9.0a FLASH_ATTN_EXT_CUDA=1 MAX_JOBS=${MAX_JOBS:-8} \
    python3 setup.py -q build_ext --inplace > "$OUT/build_$2.log" 2>&1) || { tail -30 "$OUT/build_$2.log"; exit 1; }
}
start=$(date +%s)
build . new & build "$BASE" base &
if [ -n "${ALT:-}" ]; then build "$ALT" alt & fi
wait
echo "builds: $(( $(date +%s) - start )) s"
export PYTHONPATH_NEW=$PWD PYTHONPATH_BASE=$(cd "$BASE" && pwd)
TREES="base new"
if [ -n "${ALT:-}" ]; then PYTHONPATH_ALT=$(cd "$ALT" && pwd); TREES="base new alt"; fi
PYTHONPATH=$PYTHONPATH_NEW:${PYTHONPATH:-} timeout 150 python3 -m pytest -q -rfE tests/test_sm90.py \
  tests/test_cuda.py > "$OUT/tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in ${SANITIZERS:-racecheck memcheck}; do
  echo "$tool: $(PYTHONPATH=$PYTHONPATH_NEW:${PYTHONPATH:-} timeout 90 "$SAN" --print-limit 5 \
    --tool $tool python3 dev/gpu/sanitize_cases.py 2>&1 | tee "$OUT/sanitize_$tool.log" | tail -1)"
done
for round in $(seq "$ROUNDS"); do
  for tree in $TREES; do
    case $tree in
      base) pp=$PYTHONPATH_BASE; args=$BASE_ARGS ;;
      new) pp=$PYTHONPATH_NEW; args=$NEW_ARGS ;;
      *) pp=$PYTHONPATH_ALT; args=$NEW_ARGS ;;
    esac
    # shellcheck disable=SC2086
    PYTHONPATH=$pp:${PYTHONPATH:-} timeout 150 python3 dev/ab/sm90_variants.py --rounds 1 $args "$@" \
      2>&1 | grep -v Warning | sed "s/^/$tree r$round /" | tee -a "$OUT/ab.txt"
  done
done
