// Tile sizes and the per-tile score transforms shared by the CPU forward and backward.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "mask.h"

namespace flash_attn_ext::cpu {

// Query rows per task and key rows per tile.  A (kBlockQ x kBlockK) float32 score tile is 128 KiB:
// it stays in L2 while the key tile is large enough for BLAS to run near peak.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 512;

// S = softcap * tanh(S / softcap) (Gemma-2 style logit soft-capping).
template <typename T>
inline void apply_softcap(T* S, int64_t rows, int64_t cols, int64_t ld, T softcap) {
  const T inv = T(1) / softcap;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) S[r * ld + c] = softcap * std::tanh(S[r * ld + c] * inv);
}

// S += bias for a (rows x cols) tile; bias element (r, c) at bias[r * row_stride + c * col_stride]
// (strides 0 where the bias broadcasts).
template <typename T>
inline void add_bias(T* S, int64_t rows, int64_t cols, int64_t ld, const T* bias,
                     int64_t row_stride, int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) S[r * ld + c] += bias[r * row_stride + c * col_stride];
}

// Sets S to -inf where key j0 + c is not visible to query i0 + r (see mask.h).
template <typename T>
inline void apply_mask(T* S, int64_t rows, int64_t cols, int64_t ld, const VisibleKeys& vis,
                       int64_t i0, int64_t j0) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lo = vis.begin(i0 + r) - j0, hi = vis.end(i0 + r) - j0;  // visible [lo, hi)
    T* s = S + r * ld;
    for (int64_t c = 0; c < std::min(lo, cols); ++c) s[c] = neg_inf;
    for (int64_t c = std::max<int64_t>(hi, 0); c < cols; ++c) s[c] = neg_inf;
  }
}

}  // namespace flash_attn_ext::cpu
