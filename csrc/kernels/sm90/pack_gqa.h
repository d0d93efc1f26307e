// When the Hopper forward packs the query heads of a GQA group into one tile (PackGQA, see
// Sm90FwdArgs::pack_gqa in flash_fwd_sm90.cuh).  Plain C++ (no CUDA): the CUDA glue applies it,
// the Python module exposes it (flash_attn_ext._C.sm90_pack_gqa) so that dispatch.py's copy of
// the rule, which names the kernel in explain() and last_plan(), is tested against it.
#pragma once

#include <cstdint>

namespace flash_attn_ext::sm90 {

// Query rows per tile: 192 at head dim 64 (three consumer warpgroups), 128 above.
constexpr int64_t fwd_block_m(int64_t padded_head_dim) { return padded_head_dim <= 64 ? 192 : 128; }

// Pack when it needs at most 3/4 of the tiles that one tile per query head needs: the tiles
// are where the K/V reads and the fixed costs go (a packed tile loads its Q rows by cp.async
// and stores O from registers, so a small saving does not pay).  E.g. seqlen_q <= 16 with 4 or
// more query heads per KV head: one tile per group instead of one per head.
constexpr bool pack_gqa_pays(int64_t seqlen_q, int64_t heads_q, int64_t heads_kv,
                             int64_t padded_head_dim) {
  if (heads_kv <= 0 || heads_q % heads_kv != 0 || seqlen_q <= 0) return false;
  const int64_t group = heads_q / heads_kv, block_m = fwd_block_m(padded_head_dim);
  if (group <= 1 || seqlen_q * group > 0x7fffffffLL) return false;
  const int64_t packed = (seqlen_q * group + block_m - 1) / block_m;
  const int64_t per_head = group * ((seqlen_q + block_m - 1) / block_m);
  return 4 * packed <= 3 * per_head;
}

}  // namespace flash_attn_ext::sm90
