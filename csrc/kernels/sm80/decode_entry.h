// Where a decode call's keys lie in the KV cache (DecodeParams: contiguous entries,
// cache_batch_idx, cache_leftpad, pages through block_table) and whether its values obey the
// rules, shared by the decode and append kernels (flash_decode_kernel.cuh), so that both refuse
// the same rows.
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
    ok = seqlen >= 0 && total <= p.seqlen_cache && start >= 0 && start <= seqlen &&
         (p.block_table != nullptr || (entry >= 0 && entry < p.num_entries)) &&
         (p.seqlen_ro < 0 || seqlen + p.rotary_rows <= p.seqlen_ro);
  }
};

// Whether another batch row appends into batch row b's cache entry `entry` (cache_batch_idx
// naming one entry twice while seqlen_new > 0): the two appends would race, so every kernel
// refuses both rows.  Looks at batch rows o = first, first + step, ... only, so that a CTA's
// threads can share the rows (first = threadIdx.x, step = blockDim.x) and combine their
// answers; first = 0, step = 1 looks at all of them.
__device__ __forceinline__ bool entry_shared(const DecodeParams& p, int64_t b, int64_t entry,
                                             int64_t first, int64_t step) {
  bool shared = false;
  if (p.cache_batch_idx != nullptr && p.seqlen_new > 0)
    for (int64_t o = first; o < p.batch; o += step)
      if (o != b && p.cache_batch_idx[o] == entry) shared = true;
  return shared;
}

// Whether a block table entry names a page of the cache.
__device__ __forceinline__ bool page_exists(const DecodeParams& p, int32_t page) {
  return page >= 0 && page < p.num_entries;
}

// Whether the block table row bt maps every page that holds cache rows [row_begin, row_end)
// (not empty) to a page of the cache; as entry_shared, over the pages first, first + step, ...
// of that range only.
__device__ __forceinline__ bool pages_exist(const DecodeParams& p, const int32_t* bt,
                                            int64_t row_begin, int64_t row_end, int64_t first,
                                            int64_t step) {
  bool ok = true;
  for (int64_t pg = row_begin / p.page_size + first; pg <= (row_end - 1) / p.page_size;
       pg += step)
    if (!page_exists(p, bt[pg])) ok = false;
  return ok;
}

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
