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

  // Turns x into the exponent's units (see above) for query row i and key j, which must be in
  // range when there is a bias; returns ds/dx.
  __device__ __forceinline__ float apply(float& x, int64_t i, int64_t j) const {
    float dscore = scale;
    if (capped) {
      const float t = tanhf(x * cap_inv_scale);
      x = cap * t;
      dscore = scale * (1.f - t * t);
    } else if (bias != nullptr) {
      x *= scale;
    }
    if (bias != nullptr) x += bias[i * bias_row_stride + j * bias_col_stride];
    return dscore;
  }
};

}  // namespace flash_attn_ext::sm80
