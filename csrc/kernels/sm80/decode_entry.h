// Where a decode call's keys lie in the KV cache (DecodeParams: contiguous entries,
// cache_batch_idx, cache_leftpad, pages through block_table), shared by the decode kernel
// (flash_decode_kernel.cuh) and the exact pass (cuda/exact_rows.cu).
#pragma once

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm80 {

// Where batch row b's keys are, and whether its values obey the rules (DecodeParams).
struct DecodeEntry {
  int64_t entry;  // cache entry (contiguous caches)
  int64_t start;  // first used cache row (leftpad)
  int64_t len_k;  // used rows
  bool ok;
  __device__ __forceinline__ DecodeEntry(const DecodeParams& p, int64_t b) {
    const int64_t seqlen = p.cache_seqlens[b];
    const int64_t total = seqlen + p.seqlen_new;
    start = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
    entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    len_k = total - start;
    ok = seqlen >= 0 && total <= p.seqlen_cache && start >= 0 && start <= total &&
         (p.block_table != nullptr || (entry >= 0 && entry < p.num_entries)) &&
         (p.seqlen_ro < 0 || seqlen + p.rotary_rows <= p.seqlen_ro);
  }
};

// Element offset of cache row `row` of batch row b (paged: through its block table row `bt`).
__device__ __forceinline__ int64_t cache_row_offset(const DecodeParams& p, const int32_t* bt,
                                                     int64_t entry, int64_t row,
                                                     int64_t batch_stride, int64_t row_stride) {
  if (bt == nullptr) return entry * batch_stride + row * row_stride;
  const uint32_t r = static_cast<uint32_t>(row), ps = static_cast<uint32_t>(p.page_size);
  const uint32_t page = r / ps;
  return static_cast<int64_t>(bt[page]) * batch_stride + static_cast<int64_t>(r - page * ps) *
                                                             row_stride;
}

}  // namespace flash_attn_ext::sm80
