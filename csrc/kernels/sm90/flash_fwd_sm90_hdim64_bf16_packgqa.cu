// Hopper forward instantiation: head dim 64, bf16, GQA query heads packed into shared tiles.
#include "kernels/sm90/flash_fwd_sm90.cuh"

namespace flash_attn_ext::sm90 {

template <>
cudaError_t run_flash_fwd_sm90_packgqa<__nv_bfloat16, 64>(const FwdParams& p, cudaStream_t stream) {
  return launch_flash_fwd_sm90_hdim<__nv_bfloat16, 64, /*kPackGQA=*/true>(p, stream);
}

}  // namespace flash_attn_ext::sm90
