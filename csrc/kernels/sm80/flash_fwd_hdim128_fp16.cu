// Forward instantiation: head dim 128, fp16.
#include "kernels/sm80/flash_fwd_kernel.cuh"
#include "kernels/sm80/flash_fwd_launch.h"

namespace flash_attn_ext::sm80 {

template <>
cudaError_t run_flash_fwd<__half, 128>(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraits<__half, 128, fwd_block_n<128>(), fwd_m_tiles<128>()>;
  return launch_flash_fwd<Traits>(p, stream);
}

}  // namespace flash_attn_ext::sm80
