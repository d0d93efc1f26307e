// The dropout mask of dropout.h on the device, with curand's Philox4x32-10.
#pragma once

#include <curand_philox4x32_x.h>

#include <cstdint>

#include "../../dropout.h"  // csrc/dropout.h (a plain "dropout.h" names this file)
#include "params.h"

namespace flash_attn_ext::sm80 {

struct DropoutFn {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float scale = 1.f;
  bool enabled = false;

  DropoutFn() = default;  // no dropout
  __device__ explicit DropoutFn(const FwdParams& p) : enabled(p.dropout) {
    if (!enabled) return;
    threshold = p.dropout_threshold;
    scale = p.dropout_scale;
    seed = p.philox_seed_ptr != nullptr ? static_cast<uint64_t>(*p.philox_seed_ptr)
                                        : p.philox_seed;
    offset = p.philox_offset_ptr != nullptr
                 ? static_cast<uint64_t>(*p.philox_offset_ptr) + p.philox_offset_intragraph
                 : p.philox_offset;
  }
  // The 16 bytes of the dropout cell with row id `row_id` and column `cell_col` (dropout.h).
  __device__ __forceinline__ uint4 cell(uint64_t row_id, int64_t cell_col) const {
    const uint64_t block = offset + static_cast<uint64_t>(cell_col);
    const uint4 counter = make_uint4(static_cast<uint32_t>(block),
                                     static_cast<uint32_t>(block >> 32),
                                     static_cast<uint32_t>(row_id),
                                     static_cast<uint32_t>(row_id >> 32));
    return curand_Philox4x32_10(counter, make_uint2(static_cast<uint32_t>(seed),
                                                    static_cast<uint32_t>(seed >> 32)));
  }
  __device__ __forceinline__ static uint32_t word(const uint4& w, int di) {
    return di == 0 ? w.x : (di == 1 ? w.y : (di == 2 ? w.z : w.w));
  }
  // Whether byte dj of a cell word is kept.
  __device__ __forceinline__ bool kept(uint32_t word, int dj) const {
    return ((word >> (8 * dj)) & 0xffu) < threshold;
  }
  // The 8 bytes of a cell's 16 (its Philox words w) that the lane with row parity d holds
  // (d = dropout_cell_index of its first row: lanes l and l ^ 4 hold the two halves): byte c of
  // .x / .y decides the element at (row r = 0 / 1: its rows row0, row0 + 8; column c: its
  // columns col0 + {0, 1, 8, 9}).  kQueryRows: rows are query rows (word d + 2 r, byte c),
  // else key rows (word c, byte d + 2 r).
  template <bool kQueryRows>
  __device__ __forceinline__ static uint2 lane_bytes(const uint4& w, int d) {
    if constexpr (kQueryRows) {
      return d == 0 ? make_uint2(w.x, w.z) : make_uint2(w.y, w.w);
    } else {
      // Bytes d and d + 2 of each word, gathered by byte permutes.
      const uint32_t sel = static_cast<uint32_t>(d | (4 + d) << 4 | (d + 2) << 8 | (6 + d) << 12);
      const uint32_t t0 = __byte_perm(w.x, w.y, sel), t1 = __byte_perm(w.z, w.w, sel);
      return make_uint2(__byte_perm(t0, t1, 0x5410), __byte_perm(t0, t1, 0x7632));
    }
  }
  // The keep bits of one lane's part of an m16n8 accumulator tile of 16 rows x 8 kNTiles
  // columns (mma.sync's, and each warp's of wgmma): bit 4 j + i for element [j][i], which lies
  // at row row0 + 8 (i / 2), column col0 + 8 j + i % 2 (row0: the lane's first row, at lane / 4
  // of a 16-aligned block; col0: the tile's first column + 2 (lane % 4), the tile 16-aligned).
  // That is also the index of the value in wgmma's accumulator (sm90 s_index).  kQueryRows:
  // rows are query rows and columns keys (S), else rows are keys and columns query rows (S^T).
  // row_base: the row id of the (batch, head)'s query row 0.  Each 16 x 16 block is one
  // dropout cell (dropout.h), whose 16 bytes lanes l and l ^ 4 share: of two cells side by side
  // each computes one and they swap halves (one Philox call per lane per 32 columns).  The
  // whole warp must call this (it shuffles).
  template <int kNTiles, bool kQueryRows>
  __device__ __forceinline__ uint64_t keep_bits(int64_t row_base, int64_t row0,
                                                int64_t col0) const {
    static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "a dropout cell spans 16 columns");
    const int d = dropout_cell_index(row0);  // 0 or 1: row0 is 16-aligned + lane / 4
    // Cell jc's 16 bytes (query and key coordinates of its first element).
    auto cell_words = [&](int jc) {
      const int64_t q0 = kQueryRows ? row0 : col0 + 16 * jc;
      const int64_t k0 = kQueryRows ? col0 + 16 * jc : row0;
      return cell(static_cast<uint64_t>(row_base + dropout_cell_row(q0)), dropout_cell_col(k0));
    };
    uint64_t bits = 0;
    auto set_bits = [&](int jc, const uint2& bytes) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          bits |= static_cast<uint64_t>(kept(r == 0 ? bytes.x : bytes.y, c))
                  << (4 * (2 * jc + c / 2) + 2 * r + c % 2);
    };
#pragma unroll
    for (int jc = 0; jc + 1 < kNTiles / 2; jc += 2) {
      const uint4 w = cell_words(jc + d);  // parity 0 computes cell jc, parity 1 cell jc + 1
      const uint2 own = lane_bytes<kQueryRows>(w, d), give = lane_bytes<kQueryRows>(w, d ^ 1);
      const uint2 got = make_uint2(__shfl_xor_sync(0xffffffffu, give.x, 4),
                                   __shfl_xor_sync(0xffffffffu, give.y, 4));
      set_bits(jc, d == 0 ? own : got);
      set_bits(jc + 1, d == 0 ? got : own);
    }
    if constexpr (kNTiles / 2 % 2 == 1)
      set_bits(kNTiles / 2 - 1, lane_bytes<kQueryRows>(cell_words(kNTiles / 2 - 1), d));
    return bits;
  }
  __device__ __forceinline__ static bool bit(uint64_t bits, int j, int i) {
    return (bits >> (4 * j + i)) & 1u;
  }
};

}  // namespace flash_attn_ext::sm80
