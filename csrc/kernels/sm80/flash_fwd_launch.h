// The forward instantiations: one translation unit each (flash_fwd_hdim*_*.cu), so the CUDA
// build compiles them in parallel.  Head dims are padded up to 64, 128 or 256.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flash_attn_ext::sm80 {

// Key/value rows per tile and 16-row m-tiles per warp, chosen so that the O and S accumulators
// stay in registers: (64, 2) up to head dim 128, (32, 1) at 256.
template <int kHeadDim>
constexpr int fwd_block_n() {
  return kHeadDim <= 128 ? 64 : 32;
}
template <int kHeadDim>
constexpr int fwd_m_tiles() {
  return kHeadDim <= 128 ? 2 : 1;
}

// Defined in flash_fwd_hdim<kHeadDim>_<dtype>.cu for Element = __half / __nv_bfloat16.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd(const FwdParams& p, cudaStream_t stream);

}  // namespace flash_attn_ext::sm80
