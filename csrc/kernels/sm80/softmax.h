// Softmax statistics of the sm_80 kernels, in the exp2 domain: the forward's online softmax
// (FlashAttention-2, arXiv:2307.08691, Algorithm 1: running row max m and sum l, the output
// accumulator rescaled by exp2(m_old - m_new) whenever m grows) and the backward's use of the
// saved LSE.
//
// Rows follow the m16n8 accumulator layout (mma.h): lane t holds, per 16-row m-tile, rows t / 4
// (r = 0) and t / 4 + 8 (r = 1), each over 2 columns of every n8 tile; the 4 lanes of a quad
// share a row, so row reductions are two xor-shuffles.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace flash_attn_ext::sm80 {

// Max / sum of x over the 4 lanes of this lane's quad (the lanes that share an accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// lse in the exp2 domain; an empty row (lse = -inf) gets +inf so that every P of it is 0.
__device__ __forceinline__ float lse_log2(float lse) {
  constexpr float kLog2e = 1.4426950408889634f;
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// The running max (of raw or transformed scores, score.h) and this lane's share of the running
// sum of exp2(s * scale_log2 - m * scale_log2), per m-tile and half of this lane's rows.
template <int kMT>
struct OnlineSoftmax {
  float m[kMT][2], l[kMT][2];

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m[mt][r] = -INFINITY;
        l[mt][r] = 0.f;
      }
  }

  // One tile's row (mt, r) of scores s[j][2 r + e] (this lane's kN8 n8 tiles, masked entries
  // -inf): updates m and l, turns the scores into P = exp2(s * scale_log2 - m_new * scale_log2)
  // in place and returns the factor alpha = exp2((m_old - m_new) * scale_log2) by which
  // everything accumulated so far for the row must be rescaled (rescale_row).
  template <int kN8>
  __device__ __forceinline__ float update(int mt, int r, float (&s)[kN8][4], float scale_log2) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    mx = quad_max(mx);
    const float m_new = fmaxf(m[mt][r], mx);
    // Nothing visible yet: subtract 0 so exp2(-inf) = 0 rather than NaN.
    const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
    const float alpha = exp2f(m[mt][r] * scale_log2 - m_scaled);  // 0 if m_old = -inf
    m[mt][r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * r + e];
        x = exp2f(fmaf(x, scale_log2, -m_scaled));
        sum += x;
      }
    l[mt][r] = l[mt][r] * alpha + sum;
    return alpha;
  }

  // The row's final sum (over the quad) and whether the row saw nothing (m = -inf, l = 0; a NaN
  // score makes l NaN: not empty, NaN comes out).
  struct Row {
    float l;
    bool empty;
  };
  __device__ __forceinline__ Row finish(int mt, int r) const {
    const float sum = quad_sum(l[mt][r]);
    return {sum, m[mt][r] == -INFINITY && sum == 0.f};
  }
  // The natural-log LSE of a finished, non-empty row: m * scale + ln(l).
  __device__ __forceinline__ float lse(int mt, int r, float sum, float scale_log2) const {
    constexpr float kLn2 = 0.6931471805599453f;
    return (m[mt][r] * scale_log2 + log2f(sum)) * kLn2;
  }
};

// acc[j][2 r + {0, 1}] *= alpha: row half r of this lane's accumulator fragments (the rescale
// that goes with OnlineSoftmax::update).
template <int kN8>
__device__ __forceinline__ void rescale_row(float (&acc)[kN8][4], int r, float alpha) {
#pragma unroll
  for (int j = 0; j < kN8; ++j) {
    acc[j][2 * r] *= alpha;
    acc[j][2 * r + 1] *= alpha;
  }
}

}  // namespace flash_attn_ext::sm80
