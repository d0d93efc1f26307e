// Hopper forward instantiation: head dim 128, fp16.
#include "kernels/sm90/flash_fwd_sm90.cuh"

namespace flash_attn_ext::sm90 {

template <>
cudaError_t run_flash_fwd_sm90<__half, 128>(const FwdParams& p, cudaStream_t stream) {
  return launch_flash_fwd_sm90_hdim<__half, 128, /*kPackGQA=*/false>(p, stream);
}

}  // namespace flash_attn_ext::sm90
