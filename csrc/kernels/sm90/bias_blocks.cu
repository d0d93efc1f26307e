// The bias summary of bias_blocks.h: one CTA per block, every thread testing its values, the
// class by two CTA-wide votes.  An additive fp32 bias: 0 visible, -inf masked; a boolean mask
// (FwdParams::bias_is_mask): nonzero visible, zero masked.
#include "kernels/sm90/bias_blocks.h"

#include <cmath>
#include <type_traits>

namespace flash_attn_ext::sm90 {

namespace {

// The bias's own extent along a dimension: 1 where it broadcasts (stride 0).
__host__ __device__ int64_t own(int64_t size, int64_t stride) { return stride == 0 ? 1 : size; }
int64_t blocks_of(int64_t n) { return (n + kBiasBlock - 1) / kBiasBlock; }

template <typename Value>
__device__ __forceinline__ void classify(Value x, bool& zero, bool& masked) {
  if constexpr (std::is_same_v<Value, uint8_t>) {
    zero &= x != 0;
    masked &= x == 0;
  } else {
    zero &= x == 0.f;
    masked &= x == -INFINITY;
  }
}

template <typename Value>
__global__ void __launch_bounds__(256) summarize_bias_kernel(const FwdParams p, uint8_t* blocks,
                                                             uint32_t* ranges, int64_t row_blocks,
                                                             int64_t key_blocks) {
  // blockIdx: x the key block, y the row block, z (batch, head) of the bias's own extent.
  const int64_t heads = own(p.heads_q, p.bias_head_stride);
  const int64_t bh = blockIdx.z, b = bh / heads, h = bh % heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBiasBlock;
  const int64_t key0 = static_cast<int64_t>(blockIdx.x) * kBiasBlock;
  // Rows and keys of the block that exist (one where the bias broadcasts along them: all its
  // rows or keys are that one).
  const int64_t rows = p.bias_row_stride == 0                  ? 1
                       : p.seqlen_q - row0 < kBiasBlock ? p.seqlen_q - row0
                                                          : kBiasBlock;
  const int64_t keys = p.bias_col_stride == 0                  ? 1
                       : p.seqlen_k - key0 < kBiasBlock ? p.seqlen_k - key0
                                                          : kBiasBlock;
  const Value* bias = static_cast<const Value*>(p.attn_bias) + b * p.bias_batch_stride +
                      h * p.bias_head_stride + row0 * p.bias_row_stride +
                      key0 * p.bias_col_stride;
  bool zero = true, masked = true;
  for (int64_t e = threadIdx.x; e < rows * keys; e += blockDim.x) {
    classify(bias[(e / keys) * p.bias_row_stride + (e % keys) * p.bias_col_stride], zero, masked);
  }
  zero = __syncthreads_and(zero);
  masked = __syncthreads_and(masked);
  if (threadIdx.x == 0) {
    blocks[(bh * row_blocks + blockIdx.y) * key_blocks + blockIdx.x] =
        masked ? kBlockMasked : zero ? kBlockVisible : kBlockMixed;
    if (!masked) {  // the spans (bias_key_span, bias_row_span): begin and ~end by atomicMin
      uint32_t* row_pair = ranges + bh * 2 * (row_blocks + key_blocks) + 2 * blockIdx.y;
      uint32_t* key_pair = ranges + bh * 2 * (row_blocks + key_blocks) + 2 * row_blocks +
                           2 * blockIdx.x;
      atomicMin(row_pair, blockIdx.x);
      atomicMin(row_pair + 1, ~(blockIdx.x + 1));
      atomicMin(key_pair, blockIdx.y);
      atomicMin(key_pair + 1, ~(blockIdx.y + 1));
    }
  }
}

// The class bytes, rounded up to whole 32-bit words (the spans follow).
int64_t class_bytes(const FwdParams& p) {
  return (own(p.batch, p.bias_batch_stride) * own(p.heads_q, p.bias_head_stride) *
              blocks_of(own(p.seqlen_q, p.bias_row_stride)) *
              blocks_of(own(p.seqlen_k, p.bias_col_stride)) + 3) / 4 * 4;
}
int64_t span_words(const FwdParams& p) {
  return own(p.batch, p.bias_batch_stride) * own(p.heads_q, p.bias_head_stride) * 2 *
         (blocks_of(own(p.seqlen_q, p.bias_row_stride)) +
          blocks_of(own(p.seqlen_k, p.bias_col_stride)));
}

}  // namespace

int64_t bias_summary_bytes(const FwdParams& p) { return class_bytes(p) + 4 * span_words(p); }

cudaError_t summarize_bias(FwdParams& p, uint8_t* summary, cudaStream_t stream) {
  const int64_t batch = own(p.batch, p.bias_batch_stride);
  const int64_t heads = own(p.heads_q, p.bias_head_stride);
  const int64_t row_blocks = blocks_of(own(p.seqlen_q, p.bias_row_stride));
  const int64_t key_blocks = blocks_of(own(p.seqlen_k, p.bias_col_stride));
  if (batch * heads * row_blocks * key_blocks == 0) return cudaSuccess;
  // Past the grid's limits: no summary (p.bias_blocks stays nullptr: every block is read).
  if (key_blocks > 0x7fffffff || row_blocks > 65535 || batch * heads > 65535) return cudaSuccess;
  uint8_t* blocks = summary;
  uint32_t* ranges = reinterpret_cast<uint32_t*>(summary + class_bytes(p));
  // (all bits set: begin past every block, end 0, until a block that is not all masked)
  cudaError_t err = cudaMemsetAsync(ranges, 0xff, 4 * span_words(p), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(key_blocks), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(batch * heads));
  if (p.bias_is_mask)
    summarize_bias_kernel<uint8_t>
        <<<grid, 256, 0, stream>>>(p, blocks, ranges, row_blocks, key_blocks);
  else
    summarize_bias_kernel<float>
        <<<grid, 256, 0, stream>>>(p, blocks, ranges, row_blocks, key_blocks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  p.bias_blocks = blocks;
  p.bias_ranges = ranges;
  p.ranges_key_offset = 2 * row_blocks;
  p.ranges_head_stride = p.bias_head_stride == 0 ? 0 : 2 * (row_blocks + key_blocks);
  p.ranges_batch_stride = p.bias_batch_stride == 0 ? 0 : heads * 2 * (row_blocks + key_blocks);
  p.blocks_col_stride = p.bias_col_stride == 0 ? 0 : 1;
  p.blocks_row_stride = p.bias_row_stride == 0 ? 0 : key_blocks;
  p.blocks_head_stride = p.bias_head_stride == 0 ? 0 : row_blocks * key_blocks;
  p.blocks_batch_stride = p.bias_batch_stride == 0 ? 0 : heads * row_blocks * key_blocks;
  return cudaSuccess;
}

}  // namespace flash_attn_ext::sm90
