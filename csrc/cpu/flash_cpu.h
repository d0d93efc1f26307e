// Tile sizes and the per-tile score transforms shared by the CPU forward and backward.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#include "cpu/tile_gemm.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::cpu {

// Work buffers on 64-byte boundaries (a cache line; AMX tile rows and AVX-512 vectors): with
// malloc's 16-byte alignment a tile row straddled two lines wherever the buffer happened to
// start, so the same call's time depended on the process (docs/perf/cpu.md).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    void* ptr = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
    if (ptr == nullptr) throw std::bad_alloc();
    return static_cast<T*>(ptr);
  }
  void deallocate(T* ptr, std::size_t) { std::free(ptr); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;
struct FreeDeleter {  // for CacheLineAllocator's memory held by a unique_ptr (not zeroed)
  void operator()(void* ptr) const { std::free(ptr); }
};

// Where sequence b's rows lie.  Dense (cu_q == nullptr): batch b of (B, L, H, D) tensors, every
// sequence p.seqlen_q / p.seqlen_k long, placed by the batch strides.  Packed (varlen,
// FlashAttention-2's cu_seqlens): sequence b is rows cu_q[b] .. cu_q[b + 1] (keys: cu_k) of
// (total, H, D) tensors whose batch strides are 0; p.seqlen_q / p.seqlen_k are then the
// longest sequences' lengths and p.batch the number of sequences.  The LSE is (B, H, L) dense,
// (H, total_q) packed (FlashAttention-2's); a dropout row id is start(b) * H + h * len_q(b) + x,
// x the first row of row i's dropout cell (dropout.h), start(b) = b * L dense, which is the
// dense rule (b * H + h) * L + x, so equal-length packed sequences drop what the dense batch
// drops.
struct Seqs {
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* used_k = nullptr;  // packed, optional: keys used per sequence (seqused_k)
  int64_t total_q = 0;  // rows of the packed q: the packed LSE's row length

  int64_t first_q(int64_t b) const { return cu_q == nullptr ? 0 : cu_q[b]; }
  int64_t first_k(int64_t b) const { return cu_k == nullptr ? 0 : cu_k[b]; }
  int64_t len_q(const FwdParams& p, int64_t b) const {
    return cu_q == nullptr ? p.seqlen_q : cu_q[b + 1] - cu_q[b];
  }
  int64_t len_k(const FwdParams& p, int64_t b) const {
    if (used_k != nullptr) return used_k[b];
    return cu_k == nullptr ? p.seqlen_k : cu_k[b + 1] - cu_k[b];
  }
  // Index of (sequence b, head h, row i)'s LSE; rows i .. of one (b, h) are consecutive.
  int64_t lse_index(const FwdParams& p, int64_t b, int64_t h, int64_t i) const {
    return cu_q == nullptr ? (b * p.heads_q + h) * p.seqlen_q + i : h * total_q + cu_q[b] + i;
  }
  // The row id of row i's dropout cell (dropout.h).
  uint64_t dropout_row(const FwdParams& p, int64_t b, int64_t h, int64_t i) const {
    const int64_t start = cu_q == nullptr ? b * p.seqlen_q : cu_q[b];
    return static_cast<uint64_t>(dropout_row_base(start, h, p.heads_q, len_q(p, b)) +
                                 dropout_cell_row(i));
  }
  VisibleKeys visible(const FwdParams& p, int64_t b) const {
    return VisibleKeys(len_q(p, b), len_k(p, b), p.window_left, p.window_right,
                       p.align_bottom_right);
  }
};

// Query rows per task and key rows per tile.  A (kBlockQ x kBlockK) float32 score tile is 128 KiB:
// it stays in L2 while the key tile is large enough for BLAS to run near peak.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 512;
static_assert(kBlockQ % 2 == 0 && kBlockK % 2 == 0, "bf16_dot.h packs rows and keys in pairs");

// S = softcap * tanh(S / softcap) (Gemma-2 style logit soft-capping); with `dtanh` (same layout
// as S) also stores the derivative 1 - tanh^2 for the backward.
template <typename T>
inline void apply_softcap(T* S, int64_t rows, int64_t cols, int64_t ld, T softcap,
                          T* dtanh = nullptr) {
  const T inv = T(1) / softcap;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T t = std::tanh(S[r * ld + c] * inv);
      S[r * ld + c] = softcap * t;
      if (dtanh != nullptr) dtanh[r * ld + c] = T(1) - t * t;
    }
}

// S += bias for a (rows x cols) tile; bias element (r, c) at bias[r * row_stride + c * col_stride]
// (strides 0 where the bias broadcasts).
template <typename T>
inline void add_bias(T* S, int64_t rows, int64_t cols, int64_t ld, const T* bias,
                     int64_t row_stride, int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) S[r * ld + c] += bias[r * row_stride + c * col_stride];
}

// S = -inf where a boolean mask (FwdParams::bias_is_mask: a byte per element, 0 = hidden) hides
// the key, for a (rows x cols) tile; strides as add_bias's.  The same scores as adding its
// 0 / -inf form, without that fp32 copy of the mask.
template <typename T>
inline void apply_bool_mask(T* S, int64_t rows, int64_t cols, int64_t ld, const uint8_t* mask,
                            int64_t row_stride, int64_t col_stride) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (mask[r * row_stride + c * col_stride] == 0) S[r * ld + c] = neg_inf;
}

// ALiBi: S -= slope * |dist0 + r - c| for a (rows x cols) tile, dist0 = i0 + offset - j0 (the
// distance i + offset - j at the tile's first element; params.h).
template <typename T>
inline void add_alibi(T* S, int64_t rows, int64_t cols, int64_t ld, T slope, int64_t dist0) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      S[r * ld + c] -= slope * static_cast<T>(std::abs(dist0 + r - c));
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

// The scores of the tile (query rows [i0, i0 + mq) of head h, keys [j0, j0 + nk)) into S with
// leading dimension kBlockK, computed one way for the forward and the backward's recomputation:
// S = softcap(scale * Q K^T) + bias + ALiBi, -inf where masked.  `dtanh`: see apply_softcap.
// finish_scores is everything after the GEMM (S = scale * Q K^T in, however it was computed).
template <typename T>
inline void finish_scores(T* S, int64_t mq, int64_t nk, const FwdParams& p,
                          const VisibleKeys& vis, int64_t b, int64_t h, int64_t i0, int64_t j0,
                          T* dtanh = nullptr) {
  if (p.softcap > 0.0) apply_softcap(S, mq, nk, kBlockK, static_cast<T>(p.softcap), dtanh);
  if (p.attn_bias != nullptr) {
    const int64_t at = b * p.bias_batch_stride + h * p.bias_head_stride + i0 * p.bias_row_stride +
                       j0 * p.bias_col_stride;
    if (p.bias_is_mask)
      apply_bool_mask(S, mq, nk, kBlockK, static_cast<const uint8_t*>(p.attn_bias) + at,
                      p.bias_row_stride, p.bias_col_stride);
    else
      add_bias(S, mq, nk, kBlockK, static_cast<const T*>(p.attn_bias) + at, p.bias_row_stride,
               p.bias_col_stride);
  }
  if (p.alibi_slopes != nullptr) {
    const T slope = static_cast<const T*>(p.alibi_slopes)[b * p.alibi_batch_stride + h];
    add_alibi(S, mq, nk, kBlockK, slope, i0 + vis.offset - j0);  // (the mask's alignment)
  }
  apply_mask(S, mq, nk, kBlockK, vis, i0, j0);
}

template <typename T>
inline void score_tile(T* S, const Mat<T>& qm, const Mat<T>& km, int64_t mq, int64_t nk,
                       const FwdParams& p, const VisibleKeys& vis, int64_t b, int64_t h,
                       int64_t i0, int64_t j0, T* dtanh = nullptr) {
  gemm(S, kBlockK, qm, km.t(), mq, nk, p.head_dim, p.softmax_scale, 0.0);
  finish_scores(S, mq, nk, p, vis, b, h, i0, j0, dtanh);
}

}  // namespace flash_attn_ext::cpu
