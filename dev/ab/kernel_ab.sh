#!/usr/bin/env bash
# Same-call A/B of portable-kernel variants without building the extension on the GPU machine.
#   build: compile dev/ab/kernel_ab.cu with the sm80 bf16 head-dim 64/128/256 forward and
#          backward translation units of a source tree into one binary (no GPU, no PyTorch
#          needed: nvcc and the CUDA runtime).  ARCH (default 90a) picks the target.
#     bash dev/ab/kernel_ab.sh build <tree> <binary>
#          SM90=1 adds the Hopper forward (bf16, same head dims; the CUTLASS headers of the
#          pinned nvidia-cutlass wheel or $CUTLASS_INCLUDE_DIR) for --fwd sm90; SM80_FROM=<binary>
#          reuses that earlier build's sm80 objects (kept in <binary>.objs) when only the
#          Hopper kernel differs between trees.
#   run:   on the GPU machine, run the binaries alternately ROUNDS times (default 2), each
#          line prefixed with the binary's name and the round; extra arguments after `--` go
#          to every binary (see kernel_ab.cu: --dims, --seqlens, --causal, --reps, ...).
#     bash dev/ab/kernel_ab.sh run <binary>... [-- args]
# Example: git archive main | tar -x -C /tmp/base; bash dev/ab/kernel_ab.sh build /tmp/base
#   .ab/base; bash dev/ab/kernel_ab.sh build . .ab/new; then on the GPU machine (carry .ab):
#   bash dev/ab/kernel_ab.sh run .ab/base .ab/new -- --seqlens 2048 16384
set -euo pipefail
HARNESS=$(cd "$(dirname "$0")" && pwd)/kernel_ab.cu
case "${1:-}" in
  build)
    tree=$2 bin=$3 arch=${ARCH:-90a}
    mkdir -p "$(dirname "$bin")"
    CUDA_INC=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "include"))' 2>/dev/null || true)
    flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -I "$tree/csrc"
           -gencode "arch=compute_$arch,code=sm_$arch")
    # NVCC_FLAGS: extra flags for every translation unit (e.g. -D switches of a variant).
    read -r -a extra <<< "${NVCC_FLAGS:-}"
    flags+=("${extra[@]}")
    [ -n "$CUDA_INC" ] && [ -d "$CUDA_INC" ] && flags+=(-I "$CUDA_INC")
    tus=("$tree"/csrc/kernels/sm80/flash_{fwd,bwd}_hdim{64,128,256}_bf16.cu)
    objdir=$bin.objs
    rm -rf "$objdir" && mkdir -p "$objdir"
    if [ -n "${SM80_FROM:-}" ]; then cp "$SM80_FROM".objs/flash_*_hdim*_bf16.o "$objdir"/ && tus=(); fi
    rm -f "$objdir"/flash_fwd_sm90_*.o
    if [ "${SM90:-0}" = 1 ]; then
      CUTLASS=${CUTLASS_INCLUDE_DIR:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
      flags+=(-I "$CUTLASS" -DFLASH_ATTN_EXT_SM90)
      tus+=("$tree"/csrc/kernels/sm90/flash_fwd_sm90_hdim{64,128,256}_bf16.cu)
    fi
    pids=()
    for tu in "${tus[@]}" "$HARNESS"; do
      nvcc "${flags[@]}" -c "$tu" -o "$objdir/$(basename "$tu" .cu).o" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    nvcc -gencode "arch=compute_$arch,code=sm_$arch" "$objdir"/*.o -o "$bin"
    echo "built $bin from $tree"
    ;;
  run)
    shift
    bins=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do bins+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    for round in $(seq "${ROUNDS:-2}"); do
      for bin in "${bins[@]}"; do
        "$bin" --tag "$(basename "$bin") r$round" "$@"
      done
    done
    ;;
  *)
    sed -n 2,14p "$0"; exit 2 ;;
esac
