// The Hopper forward's loads: the producer warpgroup's TMA loads of Q, K and V (one thread), and,
// with GQA packing, the consumers' own cp.async loads of their Q rows.
//
// The producer issues, per tile, the Q tile once and the K and V tiles into a kStages-deep
// shared-memory ring, each stage guarded by a pair of mbarriers (CUTLASS's PipelineTmaAsync:
// "full" when the TMA bytes have landed, "empty" when every consumer is done with the stage).
// The K/V ring runs on across tiles (the producer issues the next tile's first K before it
// needs the Q buffer back), so the consumers find the next tile's data waiting when they finish
// a tile, instead of a new CTA's start-up and first loads.
#pragma once

#include <cstdint>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/fwd_mask.h"
#include "kernels/sm90/fwd_tile_scheduler.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_attn_ext::sm90 {

// The producer thread's loop over this CTA's tiles (fwd_tile_scheduler.h), until it announced
// the end (TileInfo::tile = -1).
template <typename T, typename SmemQ, typename SmemKV>
__device__ __forceinline__ void run_producer(const Sm90FwdArgs<T>& args,
                                             typename T::SharedStorage& smem,
                                             typename T::Pipeline& pipe_k,
                                             typename T::Pipeline& pipe_v, const VisibleKeys& vis,
                                             int num_m_blocks, int group, SmemQ& sQ, SmemKV& sK,
                                             SmemKV& sV) {
  using Pipeline = typename T::Pipeline;
  using Info = TileInfo<T::kConsumers, T::kVarlen>;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim, kQStages = T::kQStages;
  const FwdParams& p = args.p;
  // (packed sequences: the whole packed tensors, one batch; a tile reads at its offsets)
  Tensor mQ = args.tma_q.get_tma_tensor(rows_shape<T::kVarlen>(p, false, p.head_dim, p.heads_q));
  Tensor mK = args.tma_k.get_tma_tensor(rows_shape<T::kVarlen>(p, true, p.head_dim, p.heads_kv));
  Tensor mV =
      args.tma_v.get_tma_tensor(rows_shape<T::kVarlen>(p, true, p.head_dim_v, p.heads_kv));
  auto state = cutlass::make_producer_start_state<Pipeline>();
  int32_t tile = blockIdx.x;
  for (int iter = 0;; ++iter) {
    if (tile >= args.num_tiles) {  // tell the consumers to stop, once they released Q
      wait_q_free<kQStages>(smem.barrier_q_empty, iter);
      Info stop{};
      stop.tile = -1;
      publish_tile(smem.info[iter & 1], stop);
      cutlass::arch::ClusterTransactionBarrier::arrive(&smem.barrier_q[q_stage<kQStages>(iter)]);
      return;
    }
    // A tile's head: the KV head when packed, else the query head.
    const int32_t tile_heads = static_cast<int32_t>(T::kPackGQA ? p.heads_kv : p.heads_q);
    TileCoord tc;
    // Packed sequences: the tile's sequence, and the masks over its own lengths.
    TileSeq seq{0, 0, args.rows_q, static_cast<int32_t>(p.seqlen_k)};
    VisibleKeys tile_vis = vis;
    if constexpr (T::kVarlen) {
      // (sections of heads over the table's entries, in the table's order: tile_coord's
      // blocks count down)
      const int32_t entries = p.sm90_varlen_entries;
      const TileCoord sc = tile_coord(tile, entries, args.heads_per_section, args.num_sections,
                                      tile_heads, tile_heads);
      const VarlenTile e = p.sm90_varlen_tiles[entries - 1 - sc.m_block];
      tc = {e.block, e.b, sc.h};
      seq = {e.q0, e.k0, e.len_q, e.len_k};
      tile_vis = VisibleKeys(e.len_q, e.len_k, p.window_left, p.window_right,
                             p.align_bottom_right);
    } else {
      tc = tile_coord(tile, num_m_blocks, args.heads_per_section, args.num_sections,
                      static_cast<int32_t>(p.batch) * tile_heads, tile_heads);
    }
    const int b = tc.b, h = tc.h;
    const int hk = T::kPackGQA ? h : h / group;
    // The tile's rows and query positions (a packed sequence's own).
    const int32_t tile_rows = seq.len_q;
    const int64_t positions = T::kVarlen ? seq.len_q : p.seqlen_q;
    // This tile's first row (negative in a partial first block: see Sm90FwdArgs::row_shift)
    // and the key tiles its existing rows' positions see.
    const int32_t m0 = tc.m_block * kM - args.row_shift;
    const VisibleKeys::Block keys = visible_key_tiles(args, tile_vis, m0, kM, tile_rows,
                                                      positions);
    int n_begin = static_cast<int>(keys.n_begin), n_end = static_cast<int>(keys.n_end);
    // The general and mask variants: key tiles that the bias masks for all of the tile's rows
    // are skipped (skip_tile; the consumers ask the same), the range narrowed to the others:
    // first to the summary's span for these rows (a (B, 1, L, S) causal mask, which the kernel
    // does not know as causal, leaves the upper key tiles out in two reads, where testing tile
    // by tile took a dependent global load per tile before the first TMA copy), then to tiles
    // that skip_tile keeps at both ends (the consumers compute the first and the last tile).
    auto skip_tile = [&](int n_block) {
      if constexpr (T::kSkipMasked) return bias_masks_tile<kM, kN>(p, b, h, m0, n_block * kN);
      return false;
    };
    if constexpr (T::kSkipMasked) {
      const Span span = bias_key_span<kM>(p, b, h, m0);
      n_begin = max(n_begin, static_cast<int>(span.begin / kN));
      n_end = min(n_end, static_cast<int>((span.end + kN - 1) / kN));
      if (n_end < n_begin) n_end = n_begin;
      while (n_begin < n_end && skip_tile(n_begin)) ++n_begin;
      while (n_end > n_begin && skip_tile(n_end - 1)) --n_end;
    }
    // Each warpgroup's key tiles that the bias hides nothing of (bias_visible_tiles), read
    // here, before the waits below, so that their latency runs under them.
    int32_t visible_begin[T::kConsumers], visible_end[T::kConsumers];
#pragma unroll
    for (int w = 0; w < T::kConsumers; ++w) {
      visible_begin[w] = visible_end[w] = 0;
      if constexpr (T::kSkipMasked) {
        const int64_t row0 = m0 + 64 * w;
        if (row0 >= 0 && row0 < p.seqlen_q) {
          const Span run = bias_visible_tiles<kN>(p, b, h, row0);
          visible_begin[w] = static_cast<int32_t>(run.begin < n_end ? run.begin : n_end);
          visible_end[w] = static_cast<int32_t>(run.end < n_end ? run.end : n_end);
        }
      }
    }
    // Rows below 0 (a partial first block) are out of the tensor: TMA fills them with zeros.
    // (Unused when packed: the consumers load Q.)  A packed sequence's tiles start at its
    // offsets; rows and keys past its end belong to the next sequence (or lie past the tensor,
    // zeros): the mask hides those keys, the epilogue does not store those rows.
    const int qb = T::kVarlen ? 0 : b;
    Tensor gQ = local_tile(domain_offset(make_coord(T::kVarlen ? seq.q0 : -args.row_shift, 0),
                                         mQ(_, _, h, qb)),
                           Shape<Int<kM>, Int<kD>>{}, make_coord(tc.m_block, 0));
    auto key_tiles = [&](auto& mKV) {  // (kN, kD, n)
      if constexpr (T::kVarlen) {
        return local_tile(domain_offset(make_coord(seq.k0, 0), mKV(_, _, hk, 0)),
                          Shape<Int<kN>, Int<kD>>{}, make_coord(_, 0));
      } else {
        return local_tile(mKV(_, _, hk, b), Shape<Int<kN>, Int<kD>>{}, make_coord(_, 0));
      }
    };
    Tensor gK = key_tiles(mK);
    Tensor gV = key_tiles(mV);
    auto [tQg, tQs] = tma_partition(args.tma_q, _0{}, Layout<_1>{},
                                    group_modes<0, 2>(sQ(_, _, q_stage<kQStages>(iter))),
                                    group_modes<0, 2>(gQ));
    auto [tKg, tKs] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
    // The first K tile goes into the ring before the Q buffer is waited for: it may be freed
    // by the previous tile's consumers sooner.
    if (n_begin < n_end) {
      pipe_k.producer_acquire(state);
      copy(args.tma_k.with(*pipe_k.producer_get_barrier(state)), tKg(_, n_begin),
           tKs(_, state.index()));
    }
    wait_q_free<kQStages>(smem.barrier_q_empty, iter);
    Info info;
    info.tile = tile;
    info.m_block = tc.m_block;
    info.b = b;
    info.h = h;
    info.n_begin = n_begin;
    info.n_end = n_end;
#pragma unroll
    for (int w = 0; w < T::kConsumers; ++w) {
      // warpgroup w's own 64 rows: a key tile straddling another warpgroup's diagonal needs
      // no mask there (under a causal mask 1-2 masked key tiles per warpgroup, not 2-3)
      // (no rows: an idle warpgroup, which reads neither)
      const VisibleKeys::Block wg_keys =
          visible_key_tiles(args, tile_vis, m0 + 64 * w, 64, tile_rows, positions);
      info.interior_begin[w] = static_cast<int32_t>(wg_keys.interior_begin);
      info.interior_end[w] = static_cast<int32_t>(wg_keys.interior_end);
      info.visible_begin[w] = visible_begin[w];
      info.visible_end[w] = visible_end[w];
    }
    if constexpr (T::kVarlen) info.seq = seq;
    publish_tile(smem.info[iter & 1], info);  // released by the barrier arrive below
    if constexpr (T::kPackGQA) {  // the consumers load their rows of Q themselves
      cutlass::arch::ClusterTransactionBarrier::arrive(&smem.barrier_q[0]);
    } else {
      uint64_t* full = &smem.barrier_q[q_stage<kQStages>(iter)];
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, T::kTileBytesQ);
      copy(args.tma_q.with(*full), tQg, tQs);
    }
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
      if (T::kSkipMasked && skip_tile(n_block)) continue;
      if (n_block > n_begin) {
        pipe_k.producer_acquire(state);
        copy(args.tma_k.with(*pipe_k.producer_get_barrier(state)), tKg(_, n_block),
             tKs(_, state.index()));
      }
      pipe_v.producer_acquire(state);
      copy(args.tma_v.with(*pipe_v.producer_get_barrier(state)), tVg(_, n_block),
           tVs(_, state.index()));
      ++state;
    }
    tile = next_tile(args, tile);  // claimed only now, with this tile's loads issued
  }
}

// GQA packing: consumer warpgroup me's 64 rows of a tile (rows m0 + 64 me ..) into its slice of
// sQ, 16 bytes per cp.async; rows past rows_q and columns past head_dim (padding) as zeros, as
// TMA would fill them.  Issued for the next tile as soon as this warpgroup's last P V of the
// current one is done and the producer announced it (the epilogue then overlaps the load), else
// at the tile's start.  Only this warpgroup reads its slice, and it finished its Q K^T GEMMs of
// the previous tile before, so no other barrier is needed; finish_q_packed makes the writes
// visible to wgmma (the async proxy): wait, fence, warpgroup barrier.
template <typename T, typename SmemQ>
__device__ __forceinline__ void issue_q_packed(const Sm90FwdArgs<T>& args, SmemQ& sQ, int ctid,
                                               int me, int32_t m0, int b, int hk) {
  using Element = typename T::Element;
  const FwdParams& p = args.p;
  constexpr int kChunks = T::kHeadDim / 8;  // 16-byte chunks per row
  const auto* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                  static_cast<int64_t>(hk) * args.group * p.q_head_stride;
#pragma unroll 1  // unrolled, the compiler kept every address live across the main loop
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int c = ctid % 128 + 128 * i, r = c / kChunks, col = (c % kChunks) * 8;
    const int32_t row = m0 + 64 * me + r;
    const uint32_t dst = cast_smem_ptr_to_uint(&sQ(64 * me + r, col, 0));  // (kQStages 1)
    if (row < args.rows_q && col < p.head_dim) {
      const int32_t pos = row / args.group, g = row - pos * args.group;
      const Element* src = q + pos * p.q_row_stride + g * p.q_head_stride + col;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    } else {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0));
    }
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <typename T>
__device__ __forceinline__ void finish_q_packed(int me) {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  cutlass::arch::fence_view_async_shared();
  warpgroup_sync<T>(me);
}

}  // namespace flash_attn_ext::sm90
