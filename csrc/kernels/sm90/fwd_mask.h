// The Hopper forward's masking: csrc/mask.h's rule (VisibleKeys: causal and sliding windows),
// applied at two levels.  The producer works out, per tile, the key tiles its rows see and, per
// consumer warpgroup, the key tiles that every one of its rows sees in full (TileInfo); the
// consumers then mask only the key tiles that straddle a boundary of their own 64 rows, per
// element, against per-row bounds set once per tile (RowMask).
#pragma once

#include <cstdint>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/fwd_traits.h"
#include "mask.h"

namespace flash_attn_ext::sm90 {

// The positions of tile rows [row, row + rows) cut to [0, rows_q), as VisibleKeys::block's
// arguments (packed GQA: the rows of a group's heads share positions).
template <typename T>
__device__ __forceinline__ void row_positions(const Sm90FwdArgs<T>& args, int32_t row,
                                              int32_t rows, int32_t rows_q, int32_t& first,
                                              int32_t& count) {
  const int32_t lo = max(row, 0), hi = min(row + rows, rows_q);
  first = row_position(args, lo);
  count = hi > lo ? row_position(args, hi - 1) + 1 - first : 0;
}

// The key tiles of kBlockN keys that tile rows [m0, m0 + rows) see (VisibleKeys::Block): the
// producer's, per tile (the loop bounds) and per consumer warpgroup (its interior).  rows_q:
// the rows the tiles count over (Sm90FwdArgs::rows_q), seqlen_q: the query positions
// (FwdParams::seqlen_q); a packed sequence's len_q for both.
template <typename T>
__device__ __forceinline__ VisibleKeys::Block visible_key_tiles(const Sm90FwdArgs<T>& args,
                                                                const VisibleKeys& vis,
                                                                int32_t m0, int32_t rows,
                                                                int32_t rows_q,
                                                                int64_t seqlen_q) {
  int32_t pos0, npos;
  row_positions(args, m0, rows, rows_q, pos0, npos);
  return vis.block(pos0, npos, seqlen_q, T::kBlockN);
}

// One consumer thread's mask: per-tile bounds of its two rows (row halves r and r + 8 of
// wgmma's accumulator, s_index), applied to an S tile in registers.
template <typename T>
struct RowMask {
  static constexpr int kN = T::kBlockN;
  // Keys [key_lo[r], key_hi[r]) are visible to row half r, stored relative to this thread's
  // first column (thread_col: accumulator value c of a row half sits at column
  // thread_col + s_col(c) of the key tile); key tiles inside [interior_begin, interior_end) are
  // visible to every row of this warpgroup.  Rows, columns and key bounds fit in 32 bits
  // (TMA's shapes are int32); keeping them 32-bit frees registers for the accumulators.
  int32_t key_lo[2], key_hi[2], interior_begin, interior_end;
  const int32_t thread_col;
  // The mask variant (T::kMask): bit r set where row half r's row of the boolean mask is a key
  // interval (mask_row_keys), which key_lo[r] / key_hi[r] then also bound, so that the
  // mask's mixed blocks mask that row by comparisons (FwdMainloop::mask_scores).
  uint32_t interval_rows = 0;

  __device__ __forceinline__ explicit RowMask(int32_t thread_col_) : thread_col(thread_col_) {}

  // Row half r's bounds, from its tile row (>= 0 once clamped: rows below 0 see what row 0
  // sees, and belong to idle warpgroups).
  __device__ __forceinline__ void set_row(const Sm90FwdArgs<T>& args, const VisibleKeys& vis,
                                          int r, int32_t row) {
    const int32_t pos = row_position(args, max(row, 0));
    key_lo[r] = static_cast<int32_t>(vis.begin(pos)) - thread_col;
    key_hi[r] = static_cast<int32_t>(vis.end(pos)) - thread_col;
  }

  // The mask variant: intersects the bounds set_row set with the mask's row intervals of this
  // thread's rows (rows: clamped into [0, seqlen_q)), where the rows have one.  The bounds stay
  // exact: the visible keys of such a row are those the mask and the causal mask or window
  // both let through.
  __device__ __forceinline__ void take_mask_rows(const FwdParams& p, int32_t b, int32_t h,
                                                 const int32_t (&rows)[2]) {
    interval_rows = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int2 keys = mask_row_keys(p, b, h, rows[r]);
      if (keys.x <= keys.y) {
        key_lo[r] = max(key_lo[r], keys.x - thread_col);
        key_hi[r] = min(key_hi[r], keys.y - thread_col);
        interval_rows |= 1u << r;
      }
    }
  }

  // Row half r of an S tile whose first key is col0: scores of keys outside [key_lo[r],
  // key_hi[r]) become -inf.  Compared with the columns' compile-time offsets: one ISETP and one
  // FSEL per value for the right bound (causal), one more only where a left bound (window, or a
  // mask row's interval) falls inside the tile.
  template <typename TensorS>
  __device__ __forceinline__ void hide_outside(TensorS& tSrS, int r, int32_t col0) const {
    constexpr int kSVals = kN / 2;  // values of S per thread (FwdMainloop checks it)
    const int32_t lo = key_lo[r] - col0, hi = key_hi[r] - col0;
    if (lo > 0) {
#pragma unroll
      for (int c = 0; c < kSVals / 2; ++c) {
        if (s_col(c) < lo || s_col(c) >= hi) tSrS(s_index(r, c)) = -INFINITY;
      }
    } else {
#pragma unroll
      for (int c = 0; c < kSVals / 2; ++c) {
        if (s_col(c) >= hi) tSrS(s_index(r, c)) = -INFINITY;
      }
    }
  }

  // Rows [r0, r1) of key tile n_block in tSrS: invisible scores become -inf, only on key tiles
  // outside the warpgroup's interior.
  template <int r0, int r1, typename TensorS>
  __device__ __forceinline__ void apply(TensorS& tSrS, int n_block) const {
    const int32_t col0 = n_block * kN;
    if (col0 < interior_begin || col0 + kN > interior_end) {
#pragma unroll
      for (int r = r0; r < r1; ++r) hide_outside(tSrS, r, col0);
    }
  }
};

}  // namespace flash_attn_ext::sm90
