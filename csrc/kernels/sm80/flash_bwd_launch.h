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

// Defined in flash_bwd_hdim<kHeadDim>_<dtype>.cu for Element = __half / __nv_bfloat16.
// `delta` is fp32 scratch of batch * heads_q * seqlen_q elements.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const BwdParams& p, float* delta, cudaStream_t stream);

}  // namespace flash_attn_ext::sm80
