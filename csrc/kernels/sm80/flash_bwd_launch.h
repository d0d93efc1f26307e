// The backward instantiations: one translation unit each (flash_bwd_hdim*_*.cu).  Head dims are
// padded up to 64, 128 or 256 as in the forward.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flash_attn_ext::sm80 {

// Tile shapes per padded head dim, chosen so that the accumulators stay in registers (see
// BwdTraits): query rows per dK/dV step, head-dim split of dK/dV, key rows per dQ step.
template <int kHeadDim>
constexpr int bwd_block_m() {
  return kHeadDim <= 128 ? 64 : 32;
}
template <int kHeadDim>
constexpr int bwd_split_d() {
  return kHeadDim <= 128 ? 1 : 2;
}
template <int kHeadDim>
constexpr int bwd_block_n_dq() {
  return kHeadDim <= 64 ? 64 : (kHeadDim <= 128 ? 32 : 16);
}

// Shared memory per block that the 8-warp plain-attention backward (flash_bwd_lean.cuh) needs
// at a padded head dim (64, 128 or 256) in its smallest variant (64-row steps): the larger of
// its dK/dV kernel (K, V of 128 keys, 64 at head dim 256; Q, dO double-buffered; P^T, dS^T;
// lse, D) and its dQ kernel.  GPUs that allow less run the 4-warp kernels, which ignore
// BwdParams::dq_accum, so the glue allocates that only where this fits.  launch_flash_bwd
// checks the formula against LeanBwdTraits.
constexpr int lean_bwd_smem_bytes(int head_dim) {
  const int keys = head_dim <= 128 ? 128 : 64, rows = 64, stages = 2, elem = 2;
  const int dkdv = (2 * keys + 2 * stages * rows) * head_dim * elem + 2 * keys * rows * elem +
                   2 * stages * rows * 4;
  const int dq = (2 * keys + 2 * stages * 64) * head_dim * elem + keys * 64 * elem;
  return dkdv > dq ? dkdv : dq;
}

// Defined in flash_bwd_hdim<kHeadDim>_<dtype>.cu for Element = __half / __nv_bfloat16.
// `delta` is fp32 scratch of batch * heads_q * seqlen_q elements.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const BwdParams& p, float* delta, cudaStream_t stream);

}  // namespace flash_attn_ext::sm80
