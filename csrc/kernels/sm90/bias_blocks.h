// A summary of an attention bias by blocks of 64 rows x 64 keys (FwdParams::bias_blocks), so
// that the Hopper kernels' general and mask variants skip what a mask's structure makes
// unnecessary: key tiles that a bias masks for every row of a tile are neither loaded nor
// computed, and tiles where the bias is 0 (a boolean mask true) throughout run without reading
// it (FlexAttention's block mask does the same for its mask functions).  One pass over the bias
// per call (bias_blocks.cu), before the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm90 {

// A block's class: every value 0, every value -inf, or anything else (NaN included); for a
// boolean mask every value true (visible), every value false (masked), or both.
enum BiasBlock : uint8_t { kBlockVisible = 0, kBlockMasked = 1, kBlockMixed = 2 };
constexpr int kBiasBlock = 64;  // rows and keys per block

// Which intervals the summary of a boolean mask also keeps: none, each row's visible keys (the
// forward's mask variant: FwdParams::bias_row_keys, mask_row_keys) or each key's visible rows
// (the backward's: bias_col_rows, mask_col_rows).
enum class MaskIntervals { kNone, kRows, kCols };

// Bytes of the summary of p's bias (prepare_bias's expanded view: stride 0 where it
// broadcasts): a class byte per (batch, head, row block, key block) of the bias's own extent (1
// where it broadcasts), then the spans (FwdParams::bias_ranges): two 32-bit words per row block
// and per key block of each (batch, head); then with kRows, for a boolean mask with a value per
// key, a record of four 32-bit words per row; with kCols, for a boolean mask with a value per
// row and key, one per key.
int64_t bias_summary_bytes(const FwdParams& p, MaskIntervals what);
// Summarises p's bias into `summary` (bias_summary_bytes(p, what) bytes, 8-byte aligned) and
// points p.bias_blocks, p.bias_ranges (and p.bias_row_keys or p.bias_col_rows where `what`
// asks and the mask has them) and their strides at it; the kernels run on `stream`.  A bias
// past the grid's limits (over 4M rows or 65535 (batch, head) pairs of its own) gets no
// summary: the pointers stay nullptr.
cudaError_t summarize_bias(FwdParams& p, uint8_t* summary, cudaStream_t stream,
                           MaskIntervals what);

#if defined(__CUDACC__)
// The summary's class of the 64 x 64 block of rows [row0, row0 + 64) of head h in batch b
// and keys [k0, k0 + 64) (row0 and k0 multiples of 64, row0 possibly negative): kBlockMixed
// without a summary; kBlockMasked where no row or no key of it exists (they are never stored,
// and no key past seqlen_k is visible).
__device__ __forceinline__ int bias_block_class(const FwdParams& p, int32_t b, int32_t h,
                                                int64_t row0, int64_t k0) {
  if (p.bias_blocks == nullptr) return kBlockMixed;
  if (row0 < 0 || row0 >= p.seqlen_q || k0 >= p.seqlen_k) return kBlockMasked;
  return p.bias_blocks[b * p.blocks_batch_stride + h * p.blocks_head_stride +
                       row0 / kBiasBlock * p.blocks_row_stride +
                       k0 / kBiasBlock * p.blocks_col_stride];
}

// Whether the bias masks key tile [n0, n0 + kKeys) for every row of [m0, m0 + kRows) (m0 a
// multiple of 64): such a tile adds nothing (P = 0) and is skipped by producer and consumers
// alike (both ask it, so they walk the same tiles).  One thread's question (the producers',
// the backward's consumers', the forward's consumers' walk over a run of such tiles and
// idle_tile); the forward's consumer warps ask the same of each next tile through
// WarpTileBlocks, which must keep bias_block_class's rule: if the two ever disagreed, producer
// and consumers would walk different tiles and the K/V pipeline would hang.
template <int kRows, int kKeys>
__device__ __forceinline__ bool bias_masks_tile(const FwdParams& p, int32_t b, int32_t h,
                                                int64_t m0, int64_t n0) {
  static_assert(kRows % kBiasBlock == 0 && kKeys % kBiasBlock == 0, "");
  if (p.bias_blocks == nullptr) return false;
#pragma unroll
  for (int r = 0; r < kRows / kBiasBlock; ++r)
#pragma unroll
    for (int j = 0; j < kKeys / kBiasBlock; ++j)
      if (bias_block_class(p, b, h, m0 + r * kBiasBlock, n0 + j * kBiasBlock) != kBlockMasked)
        return false;
  return true;
}

// The classes of the kRowBlocks x kKeyBlocks blocks of a query tile's key tiles (rows from m0,
// key tile n: keys from n * 64 * kKeyBlocks; the rule of bias_block_class, which it repeats
// with the address split into a per-lane base and a per-tile step), held by a warp: lane
// r * kKeyBlocks + j loads block (r, j) of a key tile (load), and the questions are answered
// by two votes (all_masked, row_class).  Every lane of the warp loads and asks.  Why: a class
// is the same for the whole warp, so one thread's load goes to a uniform register at once
// (R2UR), which waits for it; four such loads before each key tile's first wait stood in
// series on the forward's critical path (the mask variant with a mask that hides nothing ran
// 28% slower than the plain kernel).  Spread over lanes the loads stay in vector registers
// until the vote, so a kernel can issue them a tile ahead and ask after the GEMMs.  The
// lane's address is set once per query tile (the constructor): per key tile a load costs an
// IMAD and a compare (computed from scratch it was ~80 instructions in the forward's loop).
template <int kRowBlocks, int kKeyBlocks>
struct WarpTileBlocks {
  static constexpr int kBlocks = kRowBlocks * kKeyBlocks;
  static_assert(kBlocks <= 32, "one block per lane");
  static constexpr uint32_t kAll = kBlocks == 32 ? 0xffffffffu : (1u << kBlocks) - 1;
  // This lane's block row at key tile 0 (nullptr: its class is always `fixed`: kBlockMixed
  // without a summary, kBlockMasked past the blocks or for rows that do not exist), its
  // block's first key in a key tile, and class bytes per key tile.
  const uint8_t* lane_blocks = nullptr;
  int fixed = kBlockMixed;
  int32_t lane_key0 = 0, step = 0;
  // Key tiles in which the bias hides nothing from the asking warp's rows
  // (bias_visible_tiles): those need no load or vote.
  int32_t visible_begin = 0, visible_end = 0;

  __device__ __forceinline__ WarpTileBlocks(const FwdParams& p, int32_t b, int32_t h,
                                            int64_t m0, int32_t visible_begin_ = 0,
                                            int32_t visible_end_ = 0)
      : visible_begin(visible_begin_), visible_end(visible_end_) {
    const int lane = threadIdx.x % 32, r = lane / kKeyBlocks, j = lane % kKeyBlocks;
    const int64_t row0 = m0 + r * kBiasBlock;
    lane_key0 = j * kBiasBlock;
    step = static_cast<int32_t>(kKeyBlocks * p.blocks_col_stride);
    if (p.bias_blocks == nullptr) return;
    fixed = kBlockMasked;
    if (lane >= kBlocks || row0 < 0 || row0 >= p.seqlen_q) return;
    lane_blocks = p.bias_blocks + b * p.blocks_batch_stride + h * p.blocks_head_stride +
                  row0 / kBiasBlock * p.blocks_row_stride + j * p.blocks_col_stride;
  }
  __device__ __forceinline__ bool visible(int n_block) const {
    return n_block >= visible_begin && n_block < visible_end;
  }
  // This lane's class in key tile n_block.
  __device__ __forceinline__ int load(const FwdParams& p, int n_block) const {
    if (lane_blocks == nullptr) return fixed;
    const int64_t k0 = static_cast<int64_t>(n_block) * (kKeyBlocks * kBiasBlock) + lane_key0;
    return k0 < p.seqlen_k ? lane_blocks[n_block * step] : kBlockMasked;
  }
  static __device__ __forceinline__ uint32_t lanes_with(int cls, int c) {
    return __ballot_sync(0xffffffffu, cls == c) & kAll;
  }
  // From the lanes' classes of a key tile (load): whether every block is masked
  // (bias_masks_tile).
  static __device__ __forceinline__ bool all_masked(int cls) {
    return lanes_with(cls, kBlockMasked) == kAll;
  }
  // From the lanes' classes of a key tile: the class of row block `row` against all the
  // tile's keys (a forward warpgroup's 64 rows).
  static __device__ __forceinline__ int row_class(int cls, int row) {
    const uint32_t lanes = ((1u << kKeyBlocks) - 1) << (row * kKeyBlocks);
    if ((lanes_with(cls, kBlockVisible) & lanes) == lanes) return kBlockVisible;
    if ((lanes_with(cls, kBlockMasked) & lanes) == lanes) return kBlockMasked;
    return kBlockMixed;
  }
};

// Keys [begin, end) or rows [begin, end) (end <= begin: none).
struct Span {
  int64_t begin, end;
};

// The span that kBlocks consecutive 64-blocks along one dimension, from x0 (a multiple of 64;
// blocks below 0 or at or past x_limit count for nothing), may see along the other, from their
// (begin, ~end) pairs (summarize_bias); `broadcast`: the bias has one block along the first
// dimension, `other_broadcast` along the other (a block seen then means all of it).
template <int kBlocks>
__device__ __forceinline__ Span bias_span(const uint32_t* pairs, bool broadcast, int64_t x0,
                                          int64_t x_limit, bool other_broadcast,
                                          int64_t other_limit) {
  uint32_t lo = 0xffffffffu, not_hi = 0xffffffffu;
#pragma unroll
  for (int r = 0; r < kBlocks; ++r) {
    const int64_t x = x0 + r * kBiasBlock;
    if (x < 0 || x >= x_limit) continue;
    const uint32_t* pair = pairs + 2 * (broadcast ? 0 : x / kBiasBlock);
    lo = min(lo, pair[0]);
    not_hi = min(not_hi, pair[1]);
  }
  const uint32_t hi = ~not_hi;
  if (hi <= lo) return {0, 0};
  if (other_broadcast) return {0, other_limit};
  const int64_t end = static_cast<int64_t>(hi) * kBiasBlock;
  return {static_cast<int64_t>(lo) * kBiasBlock, end < other_limit ? end : other_limit};
}

// The keys that rows [m0, m0 + kRows) of head h in batch b (m0 a multiple of 64) may see through
// the bias: outside the span every 64 x 64 block of those rows is all masked (the summary's
// spans; every key without a summary).  Rows below 0 or past seqlen_q count for nothing.
template <int kRows>
__device__ __forceinline__ Span bias_key_span(const FwdParams& p, int32_t b, int32_t h,
                                              int64_t m0) {
  if (p.bias_ranges == nullptr) return {0, p.seqlen_k};
  return bias_span<kRows / kBiasBlock>(
      p.bias_ranges + b * p.ranges_batch_stride + h * p.ranges_head_stride,
      p.bias_row_stride == 0, m0, p.seqlen_q, p.bias_col_stride == 0, p.seqlen_k);
}

// The rows of head h in batch b that keys [n0, n0 + kKeys) (n0 a multiple of 64) may be seen by
// through the bias, as bias_key_span.
template <int kKeys>
__device__ __forceinline__ Span bias_row_span(const FwdParams& p, int32_t b, int32_t h,
                                              int64_t n0) {
  if (p.bias_ranges == nullptr) return {0, p.seqlen_q};
  return bias_span<kKeys / kBiasBlock>(
      p.bias_ranges + b * p.ranges_batch_stride + h * p.ranges_head_stride + p.ranges_key_offset,
      p.bias_col_stride == 0, n0, p.seqlen_k, p.bias_row_stride == 0, p.seqlen_q);
}

// The key tiles of kKeys keys (tile n: keys [n kKeys, (n + 1) kKeys)) in which row block
// [row0, row0 + 64) of head h in batch b (row0 a multiple of 64, in [0, seqlen_q)) sees every
// key through the bias: tiles inside the longest run of all-visible 64 x 64 blocks of its row
// (visible_runs_kernel).  A kernel runs them as plain attention without asking the summary
// tile by tile.  No bias: every tile; a bias without a summary: none.
template <int kKeys>
__device__ __forceinline__ Span bias_visible_tiles(const FwdParams& p, int32_t b, int32_t h,
                                                   int64_t row0) {
  static_assert(kKeys % kBiasBlock == 0, "");
  constexpr int64_t kAll = int64_t{1} << 40;
  if (p.attn_bias == nullptr) return {0, kAll};
  if (p.bias_ranges == nullptr) return {0, 0};
  const uint32_t* pair = p.bias_ranges + b * p.ranges_batch_stride + h * p.ranges_head_stride +
                         p.ranges_visible_offset +
                         2 * (p.bias_row_stride == 0 ? 0 : row0 / kBiasBlock);
  const int64_t begin = pair[0], end = pair[1];
  if (end <= begin) return {0, 0};
  if (p.bias_col_stride == 0) return {0, kAll};  // one block for all keys, visible
  // Whole tiles only, except that a run reaching the last key block covers the last tile
  // (keys past seqlen_k are never visible: the kernels mask them on their own).
  const int64_t key_blocks = (p.seqlen_k + kBiasBlock - 1) / kBiasBlock;
  return {(begin * kBiasBlock + kKeys - 1) / kKeys,
          end >= key_blocks ? kAll : end * kBiasBlock / kKeys};
}

// The keys that row `row` (in [0, seqlen_q)) of head h in batch b of a boolean mask sees, as an
// interval (x, y): exactly keys [x, y) where x <= y (an empty row: x == y), else (x > y) its
// visible keys are not one interval and only the mask's bytes tell them.  From the summary's
// row records (summarize_bias with row_keys); (1, 0) without them.  A causal, padding or
// window mask, or any intersection of them, gives every row an interval.
__device__ __forceinline__ int2 mask_row_keys(const FwdParams& p, int32_t b, int32_t h,
                                              int64_t row) {
  if (p.bias_row_keys == nullptr) return make_int2(1, 0);
  return *reinterpret_cast<const int2*>(
      p.bias_row_keys + 4 * (b * p.row_keys_batch_stride + h * p.row_keys_head_stride +
                             row * p.row_keys_row_stride));
}

// The records of head h in batch b of a boolean mask's keys as row intervals, at key 0 (record
// `key` at 4 * key: (x, y) with mask_row_keys's meaning, the query rows [x, y) that see the key
// where x <= y, else not one interval), or nullptr where the summary has none (summarize_bias
// with kCols).  Every key of a causal, padding or window mask, or of any intersection of them,
// has an interval.
__device__ __forceinline__ const int32_t* mask_col_rows(const FwdParams& p, int32_t b,
                                                        int32_t h) {
  if (p.bias_col_rows == nullptr) return nullptr;
  return p.bias_col_rows + 4 * (b * p.col_rows_batch_stride + h * p.col_rows_head_stride);
}

// A boolean mask's bytes (FwdParams::bias_is_mask) at key 0 of query row `row` of head h in
// batch b (the caller keeps row in range).
__device__ __forceinline__ const uint8_t* mask_row(const FwdParams& p, int32_t b, int32_t h,
                                                   int64_t row) {
  return static_cast<const uint8_t*>(p.attn_bias) + b * p.bias_batch_stride +
         h * p.bias_head_stride + row * p.bias_row_stride;
}
#endif

}  // namespace flash_attn_ext::sm90
