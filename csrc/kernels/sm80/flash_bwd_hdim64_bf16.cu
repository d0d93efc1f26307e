// Backward instantiation: head dim 64, bf16.
#include "kernels/sm80/flash_bwd_kernel.cuh"
#include "kernels/sm80/flash_bwd_launch.h"

namespace flash_attn_ext::sm80 {

template <>
cudaError_t run_flash_bwd<__nv_bfloat16, 64>(const BwdParams& p, float* delta, cudaStream_t stream) {
  using Traits = BwdTraits<__nv_bfloat16, 64, bwd_block_m<64>(), bwd_split_d<64>(), bwd_block_n_dq<64>()>;
  return launch_flash_bwd<Traits>(p, delta, stream);
}

}  // namespace flash_attn_ext::sm80
