// The Hopper forward's epilogue, per consumer warpgroup and tile: out = O / l (0 for rows that
// saw nothing), lse = m * scale + ln(l).  O goes one of three ways (the launcher's choice,
// Sm90FwdArgs): through shared memory and a TMA store (tma_store_o), through shared memory and
// 16-byte row stores (packed GQA, o_row_stores), or straight from registers (otherwise).
#pragma once

#include <cstdint>

#include "kernels/sm90/fwd_softmax.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_attn_ext::sm90 {

template <typename T>
struct FwdEpilogue {
  using Element = typename T::Element;
  static constexpr int kD = T::kHeadDim;
  static constexpr int kOVals = T::kHeadDim / 2;  // values of O per thread (FwdMainloop checks)

  const Sm90FwdArgs<T>& args;
  typename T::SharedStorage& smem;
  const int ctid;        // 0 .. 128 * kConsumers - 1 over the consumer warpgroups
  const int me;          // this consumer warpgroup
  const bool o_leader;   // issues this warpgroup's TMA stores of O

  __device__ __forceinline__ FwdEpilogue(const Sm90FwdArgs<T>& args_,
                                         typename T::SharedStorage& smem_, int ctid_, int me_)
      : args(args_), smem(smem_), ctid(ctid_), me(me_), o_leader(ctid_ % 128 == 0) {}

  // The value pairs (two adjacent columns) of row half r, scaled and rounded to 16 bits.
  template <typename TensorO>
  __device__ __forceinline__ static uint32_t o_pair(const TensorO& tOrO,
                                                    const float (&inv_l)[2], int r, int c) {
    const int i = s_index(r, c);
    Element pair[2] = {static_cast<Element>(tOrO(i) * inv_l[r]),
                       static_cast<Element>(tOrO(i + 1) * inv_l[r])};
    return *reinterpret_cast<const uint32_t*>(pair);
  }

  // Tile row `row`'s sequence position and query head (packed: from its tile row) in tile head
  // h, or false for a row past the tile's rows_q (rows below 0 belong to idle warpgroups,
  // which do not get here).
  __device__ __forceinline__ bool row_head(int32_t row, int h, int32_t rows_q, int32_t& pos,
                                           int32_t& head) const {
    pos = row_position(args, row);
    head = T::kPackGQA ? h * args.group + (row - pos * args.group) : h;
    return row < rows_q;
  }

  // The tile's O (tOrO, coordinates tOcO) and LSE of this thread's rows (row_of: its two row
  // halves' tile rows; thread_col: its first column, 0 for the thread that writes the LSE),
  // tile rows from m0, batch b, tile head h, rows_q rows (Sm90FwdArgs::rows_q; a packed
  // sequence's len_q, its rows from row q0 of out).  l is reduced over the row's threads first
  // (softmax.finalize).
  template <typename TensorO, typename CoordO>
  __device__ __forceinline__ void store(const TensorO& tOrO, const CoordO& tOcO,
                                        OnlineSoftmax<T>& softmax, const int32_t (&row_of)[2],
                                        int32_t thread_col, int32_t m0, int b, int h,
                                        int32_t q0, int32_t rows_q) {
    const FwdParams& p = args.p;
    float inv_l[2];
    bool empty[2];
    softmax.finalize(inv_l, empty);
    if constexpr (T::kMayDrop) {
      if (p.dropout) {  // kept elements scaled by 1 / P(kept) (dropout.h)
        inv_l[0] *= p.dropout_scale;
        inv_l[1] *= p.dropout_scale;
      }
    }
    // (Each instantiation has one of the two shared-memory paths.)
    const bool tma_store_o = !T::kPackGQA && !T::kVarlen && args.tma_store_o;
    const bool o_row_stores = T::kPackGQA && args.o_row_stores;
    if (tma_store_o || o_row_stores) {
      constexpr int kOCols = T::kOCols;
#pragma unroll
      for (int chunk = 0; chunk < kD / kOCols; ++chunk) {
        if (o_leader) tma_store_wait<0>();  // the previous store has read the slice
        warpgroup_sync<T>(me);
        write_o_smem(tOrO, inv_l, chunk);
        tma_store_fence();  // the generic-proxy smem writes before the TMA (async proxy) read
        warpgroup_sync<T>(me);
        if (o_row_stores) {
          store_o_rows(chunk, m0, b, h);
        } else if (o_leader) {
          store_o_tma(chunk, m0, b, h);
        }
      }
    }
    if (!tma_store_o && !o_row_stores) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int32_t pos, head;
        if (!row_head(row_of[r], h, rows_q, pos, head)) continue;
        Element* o_row = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                         head * p.out_head_stride +
                         static_cast<int64_t>(T::kVarlen ? q0 + pos : pos) * p.out_row_stride;
#pragma unroll
        for (int c = 0; c < kOVals / 2; c += 2) {
          const int col = get<1>(tOcO(s_index(r, c)));
          // head_dim_v is even (the glue pads it to a multiple of 8)
          if (col < p.head_dim_v) {
            *reinterpret_cast<uint32_t*>(o_row + col) = o_pair(tOrO, inv_l, r, c);
          }
        }
      }
    }
    if (thread_col == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int32_t pos, head;
        if (row_head(row_of[r], h, rows_q, pos, head)) {
          // (packed sequences: (heads_q, total_q))
          const int64_t at = T::kVarlen ? head * p.total_q + q0 + pos
                                        : (b * p.heads_q + head) * p.seqlen_q + pos;
          static_cast<float*>(p.softmax_lse)[at] = softmax.lse(r, empty[r]);
        }
      }
    }
  }

  // This warpgroup's rows, columns [chunk * kOCols, (chunk + 1) * kOCols), go to its own
  // (64, kOCols) slice of smem.o, laid out as SmemLayoutO (128-byte swizzle: row r's 16-byte
  // chunk k sits at chunk k ^ (r % 8) of its 128-byte row; atoms of 8 rows x 64 columns, row
  // atoms first), then one thread stores the slice with TMA, which leaves rows past seqlen_q
  // and columns past head_dim_v alone (packed GQA rows: the threads copy the rows out, see
  // store_o_rows).  Thread (warp w, lane) holds rows 16 w + lane / 4 + 8 half and columns
  // 8 g + 2 (lane % 4) + {0, 1} (wgmma's accumulator layout): each 4-byte store of a warp
  // lands in 8 different chunks, no bank conflict.  The byte offsets are written out by hand
  // (checked against CuTe's layout on the host) so that no per-value address stays live across
  // the main loop.
  template <typename TensorO>
  __device__ __forceinline__ void write_o_smem(const TensorO& tOrO, const float (&inv_l)[2],
                                               int chunk) {
    constexpr int kOCols = T::kOCols, kGroups = kOCols / 8;  // 8-column groups per chunk
    const int lane = ctid % 32, warp = (ctid % 128) / 32, row8 = lane / 4;
    unsigned char* slice = reinterpret_cast<unsigned char*>(smem.o.data()) +
                           me * (64 * kOCols * sizeof(Element)) + warp * 2048 + row8 * 128 +
                           (lane % 4) * 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        *reinterpret_cast<uint32_t*>(slice + r * 1024 + (g / 8) * 8192 +
                                     (((g % 8) ^ row8) * 16)) =
            o_pair(tOrO, inv_l, r, 2 * (chunk * kGroups + g));
      }
    }
  }

  // Packed rows: each thread copies 16-byte chunks (row R's chunk k at byte
  // R * 128 + (k / 8) * 8192 + ((k % 8) ^ (R % 8)) * 16 of the slice, as write_o_smem wrote
  // them) to the row's (position, head) in out, whole rows per 8 or 16 neighbouring threads.
  __device__ __forceinline__ void store_o_rows(int chunk, int32_t m0, int b, int h) const {
    const FwdParams& p = args.p;
    constexpr int kOCols = T::kOCols, kRowChunks = kOCols / 8;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(smem.o.data()) +
                                me * (64 * kOCols * sizeof(Element));
#pragma unroll 1
    for (int i = 0; i < 64 * kRowChunks / 128; ++i) {
      const int c = ctid % 128 + 128 * i, rr = c / kRowChunks, k = c % kRowChunks;
      const int col = chunk * kOCols + k * 8;
      int32_t pos, head;
      if (!row_head(m0 + 64 * me + rr, h, args.rows_q, pos, head) || col >= p.head_dim_v)
        continue;
      const uint4 v = *reinterpret_cast<const uint4*>(
          base + rr * 128 + (k / 8) * 8192 + (((k % 8) ^ (rr % 8)) * 16));
      *reinterpret_cast<uint4*>(static_cast<Element*>(p.out) + b * p.out_batch_stride +
                                head * p.out_head_stride + pos * p.out_row_stride + col) = v;
    }
  }

  // The slice by TMA (one thread, o_leader), which the next tile's epilogue waits for before it
  // writes the slice again (and drain at the end).
  __device__ __forceinline__ void store_o_tma(int chunk, int32_t m0, int b, int h) const {
    const FwdParams& p = args.p;
    constexpr int kOCols = T::kOCols;
    Tensor sO = make_tensor(make_smem_ptr(smem.o.data()), typename T::SmemLayoutO{})(_, _, me);
    Tensor mO = args.tma_o.get_tma_tensor(
        GmemShape(static_cast<int32_t>(p.seqlen_q), static_cast<int32_t>(p.head_dim_v),
                  static_cast<int32_t>(p.heads_q), static_cast<int32_t>(p.batch)));
    Tensor gO = local_tile(mO(_, _, h, b), Shape<_64, Int<kOCols>>{},
                           make_coord((m0 + 64 * me) / 64, chunk));  // m0 + 64 me >= 0
    auto [tOg, tOs] = tma_partition(args.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                    group_modes<0, 2>(gO));
    copy(args.tma_o, tOs, tOg);
    tma_store_arrive();
  }

  // After the last tile: smem.o must outlive the last store's read.
  __device__ __forceinline__ void drain() const {
    if (o_leader) tma_store_wait<0>();
  }
};

}  // namespace flash_attn_ext::sm90
