// The dropout mask of every kernel (CPU and CUDA), as a pure function of (seed, offset) and the
// element's coordinates, so that the backward regenerates the forward's mask instead of storing
// it, and the CPU and CUDA kernels drop the same elements for the same (seed, offset).
//
// One Philox4x32-10 call gives 16 bytes; byte e of the call decides element e of a *cell*: the
// 4 x 4 elements (query rows x0 + {0, 1, 8, 9}) x (keys y0 + {0, 1, 8, 9}) of one (batch, head),
// x0 and y0 even with x0 % 16 < 8 and y0 % 16 < 8.  Those are exactly the 8 values a thread of
// an m16n8 MMA accumulator (mma.sync, and each warp of a wgmma) holds in a 16 x 16 tile (rows
// r, r + 8; columns 2c, 2c + 1, 2c + 8, 2c + 9), whether the tile is S (query rows: the
// forward) or S^T (key rows: the backward), so one call serves two lanes' 16 values and no call
// is wasted.  For query row i and key j:
//
//   cell_row  = i & ~9           (the cell's first row: bits 0 and 3 cleared)
//   cell_col  = 4 * (j / 16) + (j % 8) / 2
//   row id    = (b * heads_q + h) * seqlen_q + cell_row   (64-bit; packed sequences: start(b)
//               * heads_q + h * len_q(b) + cell_row, the dense rule for equal lengths)
//   words     = Philox4x32-10(counter = (offset + cell_col, row id), key = seed)
//               (counter words, low first: lo(offset + cell_col), hi(..), lo(row id), hi(row id);
//                key words: lo(seed), hi(seed))
//   byte      = byte dj of word di, little-endian,  di = (i & 1) | ((i >> 2) & 2),
//                                                   dj = (j & 1) | ((j >> 2) & 2)
//   keep      = byte < threshold,  threshold = (1 - dropout_p) * 256 to the nearest integer
//               (ties to even), in [0, 256]
//
// An 8-bit threshold, as FlashAttention-2's, costs one call per 16 elements (a 32-bit word per
// element would cost a call per 4, on Hopper as much as the GEMMs).  Kept elements have probability
// threshold / 256 (dropout_p rounded to a multiple of 1/256) and are scaled by its inverse,
// dropout_scale = 256 / threshold, so the expectation of every output is exact; a dropout_p
// that rounds to 0 drops nothing and draws nothing (dropout_active), one that rounds to 1
// drops everything (scale 0).  The counters of one call span offset .. offset + 4 *
// ceil(seqlen_k / 16) per row id; the CUDA generator's offset advances by that much per call,
// so successive calls never reuse a counter.  Philox4x32-10 is curand's (curand_Philox4x32_10)
// on the device and ATen's philox_engine, which computes the same function, on the host.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define FLASH_DROPOUT_HD __host__ __device__ __forceinline__
#else
#define FLASH_DROPOUT_HD inline
#endif

namespace flash_attn_ext {

// Kept elements: those whose byte is below this, in [0, 256].
inline uint32_t dropout_threshold(double dropout_p) {
  const double t = std::nearbyint((1.0 - dropout_p) * 256.0);
  return t <= 0.0 ? 0u : (t >= 256.0 ? 256u : static_cast<uint32_t>(t));
}

// Whether a call with this dropout_p drops anything (draws random numbers at all).
inline bool dropout_active(double dropout_p) {
  return dropout_p > 0.0 && dropout_threshold(dropout_p) < 256u;
}

// The scale of kept elements: 1 / P(kept), 0 when nothing is kept.
inline double dropout_scale(double dropout_p) {
  const uint32_t t = dropout_threshold(dropout_p);
  return t == 0u ? 0.0 : 256.0 / static_cast<double>(t);
}

// Philox counter blocks one call uses per row id: the generator's offset increment.
inline uint64_t dropout_counters_per_row(int64_t seqlen_k) {
  return static_cast<uint64_t>(4 * ((seqlen_k + 15) / 16));
}

// The row id of query row 0 of head h of a sequence whose query rows start at packed row q0
// and number len_q (above); a dense batch's entry b is the sequence q0 = b * seqlen_q, len_q =
// seqlen_q, which gives (b * heads_q + h) * seqlen_q.  Every kernel's rows number from it.
FLASH_DROPOUT_HD int64_t dropout_row_base(int64_t q0, int64_t h, int64_t heads_q, int64_t len_q) {
  return q0 * heads_q + h * len_q;
}

// The cell of query row i / key j, and the element's byte within the call (see above).
FLASH_DROPOUT_HD int64_t dropout_cell_row(int64_t i) { return i & ~int64_t{9}; }
FLASH_DROPOUT_HD int64_t dropout_cell_col(int64_t j) { return 4 * (j >> 4) + ((j >> 1) & 3); }
FLASH_DROPOUT_HD int dropout_cell_index(int64_t x) {
  return static_cast<int>((x & 1) | ((x >> 2) & 2));
}

}  // namespace flash_attn_ext
