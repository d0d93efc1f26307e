// The scores every sm_80 kernel computes from a raw dot product x = q.k (forward and backward
// alike, so that the backward recomputes the forward's P):
//   s = x * scale                                   (plain)
//   s = softcap * tanh(x * scale / softcap)         (softcap > 0)
//   s += bias[b, h, i, j]                           (attn_bias, fp32, any broadcast strides)
//   s -= slope[b, h] * |i + off - j|                (ALiBi; off as the mask's, params.h)
// and their exp2-domain form: P = exp2(s' * scale_log2 - lse * log2(e)), where s' is x itself
// for plain scores (scale_log2 = scale * log2 e, saving a multiply) and s * log2(e) otherwise
// (scale_log2 = 1).  Softcapped or biased scores go to log2 units before the softmax, not in
// it: a mask of huge finite values (-1e9, finfo(float32).min) then gives a running max m whose
// own exponent is exactly 0 (s' - m, two values rounded alike, is exact where they are close),
// where s * log2 e - m * log2 e rounded apart (2^18 at -1e9: inf in fp16 P) or overflowed
// (m * log2 e = -inf below -2.36e38: NaN).  A score below -2.36e38 becomes -inf: a row of
// nothing else counts as masked (zeros, LSE -inf), as with -inf.
#pragma once

#include <cfloat>
#include <cmath>
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
  bool alibi;         // ALiBi: s -= alibi_slope * |i + alibi_offset - j|
  float alibi_slope;  // this (b, h)'s slope, 0 without ALiBi
  int64_t alibi_offset;
  const float* bias;  // at (b, h, 0, 0); nullptr without a bias
  int64_t bias_row_stride, bias_col_stride;

  __device__ ScoreFn(const FwdParams& p, int64_t b, int64_t h)
      : ScoreFn(p, b, h, p.seqlen_q, p.seqlen_k) {}
  // For a sequence of its own lengths (packed sequences: ALiBi's bottom-right offset is each
  // sequence's).
  __device__ ScoreFn(const FwdParams& p, int64_t b, int64_t h, int64_t seqlen_q, int64_t seqlen_k)
      : scale(static_cast<float>(p.softmax_scale)),
        cap(static_cast<float>(p.softcap)),
        capped(p.softcap > 0.0),
        alibi(p.alibi_slopes != nullptr),
        alibi_slope(p.alibi_slopes == nullptr
                        ? 0.f
                        : static_cast<const float*>(p.alibi_slopes)[b * p.alibi_batch_stride + h]),
        alibi_offset(p.align_bottom_right ? seqlen_k - seqlen_q : 0),
        bias(p.attn_bias == nullptr ? nullptr
                                    : static_cast<const float*>(p.attn_bias) +
                                          b * p.bias_batch_stride + h * p.bias_head_stride),
        bias_row_stride(p.bias_row_stride),
        bias_col_stride(p.bias_col_stride) {
    scale_log2 = scale_log2_of(p);
    cap_inv_scale = capped ? scale / cap : 0.f;
  }
  static constexpr float kLog2e = 1.4426950408889634f;

  // modified() and scale_log2 for a call's scores where no (b, h) is at hand (the decode
  // combine): the same answers from the call's parameters.
  __host__ __device__ static bool modified_of(const FwdParams& p) {
    return p.softcap > 0.0 || p.alibi_slopes != nullptr || p.attn_bias != nullptr;
  }
  __host__ __device__ static float scale_log2_of(const FwdParams& p) {
    return modified_of(p) ? 1.f : static_cast<float>(p.softmax_scale) * kLog2e;
  }

  // Whether scores are more than x * scale (softcap, a bias or ALiBi): they then go through
  // transform and to_log2 (or apply) before the softmax.
  __device__ __forceinline__ bool modified() const { return capped || alibi || bias != nullptr; }

  // ALiBi's term for a (query row - key) distance `dist` = i + alibi_offset - j, given as a
  // float (exact up to 2^24; beyond, rounded to float32 like the product that uses it), added
  // to x: one FMA with the |.| as its operand modifier.  The caller checks `alibi`.
  __device__ __forceinline__ void add_alibi(float& x, float dist) const {
    x = fmaf(-alibi_slope, fabsf(dist), x);
  }

  // The first half of apply: x becomes the score s in natural units, but for the bias, which
  // the caller then adds (as apply does, or from its own reads: the Hopper kernels) before
  // to_log2; returns ds/dx.
  __device__ __forceinline__ float transform(float& x) const {
    float dscore = scale;
    if (capped) {
      const float t = tanh_approx(x * cap_inv_scale);
      x = cap * t;
      dscore = scale * (1.f - t * t);
    } else if (alibi || bias != nullptr) {
      x *= scale;
    }
    return dscore;
  }
  // The second half: a modified score to log2 units (plain ones stay x).
  __device__ __forceinline__ void to_log2(float& x) const {
    if (modified()) x *= kLog2e;
  }
  // Turns x into the exponent's units (see above) for query row i and key j, which must be in
  // range when there is a bias; returns ds/dx.
  __device__ __forceinline__ float apply(float& x, int64_t i, int64_t j) const {
    const float dscore = transform(x);
    if (bias != nullptr) x += bias[i * bias_row_stride + j * bias_col_stride];
    if (alibi) add_alibi(x, static_cast<float>(i + alibi_offset - j));
    to_log2(x);
    return dscore;
  }
  // The backward's P = exp2(s' * scale_log2 - lse_log2), its exponent capped at 0: exact
  // arithmetic gives at most 0 (P <= 1); a row whose LSE is huge (a mask of finite values
  // like -1e9 over all of it) rounds lse_log2 and s' apart, which could exceed it.  NaN stays
  // NaN (a comparison, not fminf, which would drop it).
  __device__ __forceinline__ float prob(float x, float lse_log2) const {
    const float e = fmaf(x, scale_log2, -lse_log2);
    return exp2f(e > 0.f ? 0.f : e);
  }
};

// A row's LSE (natural log) from its maximum m in the exponent's units (x for plain scores,
// log2 units for modified ones) and its sum l = sum_j exp2((x_j - m) * scale_log2), computed in
// float64 and rounded once: m * scale_log2 rounded to float32 first would move a huge LSE by
// half its ulp (2^-11 in the exponent at 2^13, 64 at 2^30; cuda/exact_rows.h), and the float
// scale_log2's own rounding would too.  NaN where l is NaN, -inf where it is 0 (no key seen).
__device__ __forceinline__ float lse_of(const FwdParams& p, bool modified, float m, float l) {
  constexpr double kLn2 = 0.6931471805599453, kLog2e = 1.4426950408889634;
  const double c = modified ? 1.0 : p.softmax_scale * kLog2e;
  return l > 0.f    ? static_cast<float>((static_cast<double>(m) * c +
                                          log2(static_cast<double>(l))) * kLn2)
         : isnan(l) ? l
                    : -INFINITY;
}

// The exp2 domain's factor of tanh values, softcap * log2(e) (the Hopper kernels' softcap
// variants, forward and backward), kept a normal float: a softcap below ~1e-38 would make it
// 0 and a masked score's -inf * 0 NaN, one above ~2.4e38 inf (ops.cpp takes any finite
// softcap).
__device__ __forceinline__ float softcap_log2(double softcap) {
  return fminf(fmaxf(static_cast<float>(softcap) * ScoreFn::kLog2e, FLT_MIN), FLT_MAX);
}

}  // namespace flash_attn_ext::sm80
