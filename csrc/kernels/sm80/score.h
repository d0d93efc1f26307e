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

// tanh(y) by the hardware's tanh.approx.f32 (one MUFU operation; PTX ISA: maximum relative
// error 2^-10.99, so an absolute error below 2^-10 on softcap * tanh / softcap).  Measured on
// the H200 (benchmarks/bench_score_mods.py, d = 128, L = 4k, softcap 30): the exact form
// (1 - e) / (1 + e), e = exp(-2|y|), costs two MUFU operations beside the softmax's exp2 and
// ran the Hopper forward at 0.40x of plain attention, MUFU-bound.  The error it adds to a
// score, softcap * 2^-10.99, is below what rounding q.k / softcap and tanh to bf16 or fp16
// (PyTorch's computation in the same low precision) adds, and the error-rule tests
// (tests/test_sm90.py: softcap 7.5 and 50, bf16 and fp16) hold with it.
__device__ __forceinline__ float tanh_approx(float y) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(y));
  return t;
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
      const float t = tanh_approx(x * cap_inv_scale);
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
