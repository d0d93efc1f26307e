// When the Hopper forward packs the query heads of a GQA group into one tile (PackGQA, see
// Sm90FwdArgs::group in fwd_traits.h and the flash_fwd_sm90_hdim*_packgqa.cu instantiations).
// Plain C++ (no CUDA): kernel_select.h applies it for the glue and for flash_attn_ext's
// planning alike.
#pragma once

#include <cstdint>

namespace flash_attn_ext::sm90 {

// Query rows per tile: 192 at head dim 64 (three consumer warpgroups), 128 above.
constexpr int64_t fwd_block_m(int64_t padded_head_dim) { return padded_head_dim <= 64 ? 192 : 128; }

// The Hopper forward's row and key arithmetic is 32-bit: a tile's rows, padded up to whole
// tiles, and the keys must stay below 2^31.  Longer sequences (or packed rows) are refused
// (the portable kernel serves them; explain() says so).
constexpr int64_t kMaxRows = 0x7fffffffLL - 256;

// Whether packing can serve the call at all: a group of two or more query heads per KV head,
// and packed rows (seqlen_q * group) within the kernel's 32-bit row arithmetic.
constexpr bool pack_gqa_possible(int64_t seqlen_q, int64_t heads_q, int64_t heads_kv) {
  if (heads_kv <= 0 || heads_q % heads_kv != 0 || seqlen_q <= 0) return false;
  const int64_t group = heads_q / heads_kv;
  return group > 1 && seqlen_q * group <= kMaxRows;
}

// Pack when it needs at most half the tiles that one tile per query head needs: the tiles are
// where the K/V reads and the fixed costs go.  A packed tile costs more (its consumers load Q
// by cp.async instead of finding it loaded by TMA, and copy O out row by row),
// and at head dim 64 an unpacked tile with warpgroups past seqlen_q skips their work, so a
// smaller saving does not pay.  Measured (benchmarks/bench_gqa.py, H200, groups 4 and 8,
// S = 1k and 8k): packed/unpacked 1.5-1.95x at seqlen_q <= 16, 1.03-1.79x at 64 (half the
// tiles or fewer); 0.69-0.98x at 128 (d = 64: 3/4 of the tiles; d = 128: as many) and 512.
constexpr bool pack_gqa_pays(int64_t seqlen_q, int64_t heads_q, int64_t heads_kv,
                             int64_t padded_head_dim) {
  if (!pack_gqa_possible(seqlen_q, heads_q, heads_kv)) return false;
  const int64_t group = heads_q / heads_kv, block_m = fwd_block_m(padded_head_dim);
  const int64_t packed = (seqlen_q * group + block_m - 1) / block_m;
  const int64_t per_head = group * ((seqlen_q + block_m - 1) / block_m);
  return 2 * packed <= per_head;
}

}  // namespace flash_attn_ext::sm90
