// Hopper forward instantiation: head dim 128, fp16, GQA query heads packed into shared tiles.
#include "kernels/sm90/flash_fwd_sm90.cuh"
#include "kernels/sm90/flash_fwd_sm90_launch.h"

namespace flash_attn_ext::sm90 {

template <>
cudaError_t run_flash_fwd_sm90_packgqa<__half, 128>(const FwdParams& p, cudaStream_t stream) {
  using Traits = Sm90FwdTraits<__half, 128, fwd_block_n<128>(), fwd_stages<128>(),
                               fwd_consumers<128>(), /*kPackGQA=*/true>;
  return launch_flash_fwd_sm90<Traits>(p, stream);
}

}  // namespace flash_attn_ext::sm90
