// Backward instantiation: head dim 256, fp16.
#include "kernels/sm80/flash_bwd_kernel.cuh"
#include "kernels/sm80/flash_bwd_launch.h"

namespace flash_attn_ext::sm80 {

template <>
cudaError_t run_flash_bwd<__half, 256>(const BwdParams& p, float* delta, cudaStream_t stream) {
  using Traits = BwdTraits<__half, 256, bwd_block_m<256>(), bwd_split_d<256>(), bwd_block_n_dq<256>()>;
  return launch_flash_bwd<Traits>(p, delta, stream);
}

}  // namespace flash_attn_ext::sm80
