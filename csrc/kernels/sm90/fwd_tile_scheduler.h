// The Hopper forward's tile schedule and the tile handoff from the producer to the consumers.
//
// Persistent: gridDim.x CTAs (at most one per SM) loop over tiles of 64 * kConsumers query rows.
// A CTA's first tile is blockIdx.x; the producer thread takes each next one from an atomic
// counter (dynamic scheduling: whichever CTA is free first takes the next-longest tile) or
// steps by gridDim.x (static), and announces it to the consumers in shared memory (TileInfo)
// together with the tile's Q load.  The launcher chooses the order (sections) and the schedule.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace flash_attn_ext::sm90 {

struct TileCoord {
  int32_t m_block, b, h;
};

// What the producer tells the consumers about a tile, with its Q load: its coordinates and its
// key tiles (so that the consumers' tile start and epilogue, which nothing overlaps, do no
// integer divisions or 64-bit bound arithmetic: measured ~1,400 cycles per tile and warpgroup).
template <int kConsumers, bool kVarlen = false>
struct TileInfo {
  int32_t tile;  // -1: no more tiles
  int32_t m_block, b, h;
  int32_t n_begin, n_end;  // key tiles [n_begin, n_end) hold every key a row of it sees
  // Keys [interior_begin, interior_end) are visible to every row of warpgroup w's 64 rows.
  int32_t interior_begin[kConsumers], interior_end[kConsumers];
  // The general and mask variants: key tiles [visible_begin, visible_end) are visible through
  // the bias to every row of warpgroup w's 64 rows (bias_visible_tiles).
  int32_t visible_begin[kConsumers], visible_end[kConsumers];
};

// A packed sequence's rows in q / out and keys in k / v, and how many (a VarlenTile's).
struct TileSeq {
  int32_t q0, k0, len_q, len_k;
};
// Packed sequences (Sm90FwdTraits::kVarlen): the tile's sequence too.
template <int kConsumers>
struct TileInfo<kConsumers, true> : TileInfo<kConsumers, false> {
  TileSeq seq;
};

// Tile t -> (query block, batch * heads_q + head), heads_q being the tile heads (the KV heads
// when GQA is packed).  The (batch, head) pairs go in num_sections
// sections of heads_per_section (the launcher's choice: 1 at head dims 128 and 256 without a
// mask), the last one also taking the remainder; inside a section the query blocks go
// last-first, which under causal masking starts the longest rows first
// (longest-processing-time-first, as FlashAttention-3's scheduler).  (A short last section
// would end the grid with few heads' longest tiles running while the other SMs idle: at
// d = 256 L = 2k causal, 64 pairs in sections of 6 or 12, remainder last, measured 550, in
// sections of 8 or 16, 620 TFLOP/s.)  All in 32 bits (the launcher checks that the tile count
// fits): 64-bit divisions would cost the 24-register producer spills.  The producer computes it
// and hands it on (TileInfo).
__device__ __forceinline__ TileCoord tile_coord(int32_t tile, int32_t num_m_blocks,
                                                int32_t heads_per_section, int32_t num_sections,
                                                int32_t batch_heads, int32_t heads_q) {
  const int32_t section_size = num_m_blocks * heads_per_section;
  const int32_t section = min(tile / section_size, num_sections - 1);
  const int32_t in_section = tile - section * section_size;
  const int32_t heads_here =
      section == num_sections - 1 ? batch_heads - section * heads_per_section : heads_per_section;
  const int32_t bh = section * heads_per_section + in_section % heads_here;
  return {num_m_blocks - 1 - in_section / heads_here, bh / heads_q, bh % heads_q};
}

// The tile after `tile` for this CTA (Sm90FwdArgs: dynamic or static schedule).  The producer
// claims it only once the current tile's loads are issued: claiming it earlier would hold a
// long (causal) tile for this CTA while another CTA may become free sooner.
template <typename Args>
__device__ __forceinline__ int32_t next_tile(const Args& args, int32_t tile) {
  return args.dynamic ? atomicAdd(args.tile_counter, 1) + static_cast<int32_t>(gridDim.x)
                      : tile + static_cast<int32_t>(gridDim.x);
}

// Whether warpgroup `me`'s 64 rows of the tile starting at row m0 do not exist (below 0 in a
// partial first block, or past rows_q: Sm90FwdArgs::rows_q, a packed sequence's len_q): such a
// warpgroup issues no GEMMs and no softmax (FwdMainloop::idle_tile).  Only with three
// consumers (192-row tiles, which power-of-two lengths never fill): at head dim 256 the extra
// code path made the main loop spill.
template <int kConsumers>
__device__ __forceinline__ bool warpgroup_idle(int32_t rows_q, int32_t m0, int me) {
  return kConsumers == 3 && (m0 + 64 * me < 0 || m0 + 64 * me >= rows_q);
}

// The handoff of tiles and Q buffers through shared memory.  Tile iter's Q buffer and the phase
// of its two barriers (barrier_q: Q landed and the tile announced; barrier_q_empty: every
// consumer thread is done with that Q and its TileInfo) (kQStages = 1: buffer 0, parity
// iter % 2).
template <int kQStages>
__device__ __forceinline__ int q_stage(int iter) {
  return kQStages == 1 ? 0 : iter % kQStages;
}
template <int kQStages>
__device__ __forceinline__ int q_phase(int iter) {
  return (iter / kQStages) & 1;
}

// Producer side: tile iter's Q buffer (and TileInfo slot) is free once every consumer released
// tile iter - kQStages's.
template <int kQStages>
__device__ __forceinline__ void wait_q_free(uint64_t* barrier_q_empty, int iter) {
  if (iter >= kQStages) {
    cutlass::arch::ClusterBarrier::wait(&barrier_q_empty[q_stage<kQStages>(iter)],
                                        q_phase<kQStages>(iter - kQStages));
  }
}

// The producer writes tile iter's info into info[iter % 2] before the mbarrier arrive that
// announces the tile (the consumers read it after their wait on the same barrier, which
// acquires).  It writes only after every consumer released the Q of tile iter - kQStages,
// i.e. (kQStages <= 2) after they read this slot's previous info (tile iter - 2's, read at
// that tile's start).
template <typename Info>
__device__ __forceinline__ void publish_tile(Info& slot, const Info& info) {
  volatile int32_t* dst = reinterpret_cast<volatile int32_t*>(&slot);
  const int32_t* src = reinterpret_cast<const int32_t*>(&info);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Info) / 4); ++i) dst[i] = src[i];
  asm volatile("" ::: "memory");
}

// Consumer side: wait until tile iter is announced (and, unpacked, its Q landed), then read its
// TileInfo.  CUTLASS's wait has no memory clobber: the info is read after it.
template <typename Info>
__device__ __forceinline__ const volatile Info& wait_tile(uint64_t* barrier_q, const Info& slot,
                                                          int phase) {
  cutlass::arch::ClusterTransactionBarrier::wait(barrier_q, phase);
  asm volatile("" ::: "memory");
  return slot;
}

// Every consumer thread tells the producer that it is done with a tile's Q buffer and TileInfo
// (after the warpgroup_wait that covers its last Q K^T GEMM, or at once for a tile without
// visible keys): the producer overwrites both only after all of them arrived.
__device__ __forceinline__ void release_q(uint64_t* barrier_q_empty) {
  cutlass::arch::ClusterBarrier::arrive(barrier_q_empty);
}

}  // namespace flash_attn_ext::sm90
