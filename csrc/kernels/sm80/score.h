// The scores every sm_80 kernel computes from a raw dot product x = q.k (forward and backward
// alike, so that the backward recomputes the forward's P):
//   s = x * scale                                   (plain)
//   s = softcap * tanh(x * scale / softcap)         (softcap > 0)
//   s += bias[b, h, i, j]                           (attn_bias, fp32, any broadcast strides)
// and their exp2-domain factor: P = exp2(s' * scale_log2 - lse * log2(e)), where s' is x itself
// for plain scores (scale_log2 = scale * log2 e, saving a multiply) and s otherwise
// (scale_log2 = log2 e).
#pragma once

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm80 {

// tanh(y) to an absolute error of a few fp32 ulps of 1, which is what the scores need
// (softcap * tanh is added to other scores, so an absolute error is what moves P; the relative
// error near 0 does not matter): (1 - e) / (1 + e) with e = exp(-2 |y|) in (0, 1], signed.  Two
// MUFU operations and a few FMAs, fewer registers than tanhf (whose spills cost the Hopper
// forward), and exact limits (|y| large: e = 0, t = +-1).
__device__ __forceinline__ float tanh_abs_accurate(float y) {
  constexpr float kMinus2Log2e = -2.8853900817779268f;  // -2 log2(e)
  const float e = exp2f(fabsf(y) * kMinus2Log2e);
  return copysignf(__fdividef(1.f - e, 1.f + e), y);
}

struct ScoreFn {
  float scale, scale_log2, cap, cap_inv_scale;
  bool capped;
  const float* bias;  // at (b, h, 0, 0); nullptr without a bias
  int64_t bias_row_stride, bias_col_stride;

  __device__ ScoreFn(const FwdParams& p, int64_t b, int64_t h)
      : scale(static_cast<float>(p.softmax_scale)),
        cap(static_cast<float>(p.softcap)),
        capped(p.softcap > 0.0),
        bias(p.attn_bias == nullptr ? nullptr
                                    : static_cast<const float*>(p.attn_bias) +
                                          b * p.bias_batch_stride + h * p.bias_head_stride),
        bias_row_stride(p.bias_row_stride),
        bias_col_stride(p.bias_col_stride) {
    constexpr float kLog2e = 1.4426950408889634f;
    scale_log2 = (capped || bias != nullptr) ? kLog2e : scale * kLog2e;
    cap_inv_scale = capped ? scale / cap : 0.f;
  }

  // Turns x into the exponent's units (see above) but for the bias, which the caller adds
  // (as apply does, or from its own reads: the Hopper kernels); returns ds/dx.
  __device__ __forceinline__ float transform(float& x) const {
    float dscore = scale;
    if (capped) {
      const float t = tanh_abs_accurate(x * cap_inv_scale);
      x = cap * t;
      dscore = scale * (1.f - t * t);
    } else if (bias != nullptr) {
      x *= scale;
    }
    return dscore;
  }
  // Turns x into the exponent's units (see above) for query row i and key j, which must be in
  // range when there is a bias; returns ds/dx.
  __device__ __forceinline__ float apply(float& x, int64_t i, int64_t j) const {
    const float dscore = transform(x);
    if (bias != nullptr) x += bias[i * bias_row_stride + j * bias_col_stride];
    return dscore;
  }
};

}  // namespace flash_attn_ext::sm80
