// The decode instantiations (flash_decode_hdim*_*.cu, one translation unit each): attention of
// a few query rows against a KV cache (flash_decode_kernel.cuh).  Head dims are padded up to 64,
// 128 or 256.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm80 {

// The most splits of the keys the combine kernel merges per row (flash_decode_kernel.cuh: its
// shared memory and LSE loads are sized by it); the glue clamps num_splits to it.  256, not
// FlashAttention-2's 128: where one wave of every split cannot fill the GPU (MQA at batch 1: one
// CTA per split), decode bandwidth grew in proportion to the splits up to 128
// (docs/perf/decode.md, "The split count"), and 256 such CTAs still fit in one wave of an
// H100 / H200 (two per SM).
constexpr int kMaxDecodeSplits = 256;

// Split-KV decode (and its combine kernel when p.num_splits > 1), on `stream`.
template <typename Element, int kHeadDim>
cudaError_t run_flash_decode(const DecodeParams& p, cudaStream_t stream);

// CTAs of the decode kernel run_flash_decode launches for p (its rows per CTA, load form and
// lanes) that one SM holds at once, from the CUDA occupancy calculator (registers and shared
// memory), cached per device and kernel; 0 if the query fails.  The split heuristic's slots.
template <typename Element, int kHeadDim>
int run_flash_decode_ctas_per_sm(const DecodeParams& p);

// The append of k_new / v_new (rotated) into the cache; defined in the head-dim-64 files.
template <typename Element>
cudaError_t run_kvcache_append(const DecodeParams& p, cudaStream_t stream);

// Query rows one decode CTA takes (DecodeTraits::kRows) for `rows` = seqlen_q * heads_q /
// heads_kv packed rows: 32 where there are more than 16 and the head dim is at most 128 (so a
// 32-query-head MQA group reads its keys once), else 16 (a 16-row m-tile wastes less of the
// MMAs on GQA groups of a few heads; at head dim 256 two m-tiles would not fit in registers).
// But where the 32-row CTAs of the call (kv_heads_total = batch * heads_kv of them per 32
// rows) are fewer than 32, 16: two lighter CTAs per split (167 registers against 255) read the
// same keys, the second mostly from L2, and hide twice the latency (MQA on the H100: B = 1,
// S = 128k 49.9 -> 37.8 us, B = 8 216.6 -> 197.1; at B = 64 16 rows lost 7%;
// docs/perf/decode.md, "Rows per CTA").  `forced` (KernelOptions::decode_block_rows, 0: the
// rule) picks 16 or 32 where the head dim allows both.
constexpr int decode_block_rows(int head_dim, int64_t rows, int64_t kv_heads_total,
                                int forced = 0) {
  return head_dim > 128                              ? 16
         : forced > 0                                ? forced
         : rows > 16 && kv_heads_total * ((rows + 31) / 32) >= 32 ? 32
                                                     : 16;
}

}  // namespace flash_attn_ext::sm80
