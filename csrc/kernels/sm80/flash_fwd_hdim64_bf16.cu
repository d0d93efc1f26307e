// Forward instantiation: head dim 64, bf16.
#include "kernels/sm80/flash_fwd_kernel.cuh"
#include "kernels/sm80/flash_fwd_launch.h"

namespace flash_attn_ext::sm80 {

template <>
cudaError_t run_flash_fwd<__nv_bfloat16, 64>(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraits<__nv_bfloat16, 64, fwd_block_n<64>(), fwd_m_tiles<64>()>;
  return launch_flash_fwd<Traits>(p, stream);
}

}  // namespace flash_attn_ext::sm80
