// The Hopper forward's online softmax, per consumer thread (two rows: wgmma's row halves r and
// r + 8), in the exp2 domain: a running max m and sum l per row (FlashAttention-2,
// arXiv:2307.08691, Algorithm 1), O rescaled by exp2(m_old - m_new) when m moves, with lazy
// rescaling (m moves only by more than kRescaleLog2).  The softcap variant with bf16 inputs
// needs no running max (fixed_max).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/sm90/fwd_mask.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_attn_ext::sm90 {

// A row's kChains partial maxima (max) or sums (!max) combined pairwise.
template <int kChains>
__device__ __forceinline__ float combine_chains(float (&x)[kChains], bool max) {
#pragma unroll
  for (int w = 1; w < kChains; w *= 2)
#pragma unroll
    for (int j = 0; j + w < kChains; j += 2 * w)
      x[j] = max ? fmaxf(x[j], x[j + w]) : x[j] + x[j + w];
  return x[0];
}

// 2^z without the MUFU unit (FMA and ALU pipes only), for the softmax's exponents where the
// MUFU work per score, not the GEMMs or the issue slots, bounds the kernel (the softcap variant
// at head dim 64: tanh and exp2 per score, docs/perf/sm90_score_mods.md).  z = n + f with n the
// nearest integer (z + 1.5 * 2^23 leaves n in the low mantissa bits) and f in [-0.5, 0.5];
// 2^f by a polynomial with constant term 1 (minimax in relative error, fitted in float32:
// degree 3 at most 1.02e-4, degree 4 at most 2.9e-6), times 2^n built in the exponent bits.
// Valid for z < 127.5 (above, 2^n's bits overflow into the sign: garbage).  The callers'
// exponents are at most kFixedMaxLimit with the fixed reference max, and with the running max
// kRescaleLog2 plus half an ulp of the reference max m * scale_log2, at most ~8.5 for
// scale_log2 <= 2^24, which the launcher checks (launch_flash_fwd_sm90_hdim).  z below -127
// (-inf for a masked score) is clamped there, where 2^n's bits are all 0: exactly 0, as exp2
// gives (a row that sees no key keeps l = 0).  NaN
// stays NaN (max.NaN keeps it, p is NaN); +inf gives NaN (f = inf - inf) where exp2 gives inf,
// and either makes the row's l and out NaN or inf / inf.
template <int kDegree>
__device__ __forceinline__ float exp2_fma(float z) {
  static_assert(kDegree == 3 || kDegree == 4, "");
  float zc;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(zc) : "f"(z), "f"(-127.f));
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  const float zr = __fadd_rn(zc, kRound);  // (the _rn forms: never contracted or reassociated)
  const float f = __fadd_rn(zc, -__fadd_rn(zr, -kRound));
  float p = kDegree == 4 ? fmaf(fmaf(fmaf(0.009582818f, f, 0.05590637f), f, 0.24024099f), f,
                                0.69312418f)
                         : fmaf(fmaf(0.05500858f, f, 0.24221037f), f, 0.6932829f);
  p = fmaf(p, f, 1.f);
  // n's low 9 bits (n + 127 in [0, 254]) into the exponent field: 2^n, 0 for n = -127.
  const float two_n = __uint_as_float((__float_as_uint(zr) << 23) + 0x3F800000u);
  return p * two_n;
}

template <typename T>
struct OnlineSoftmax {
  static constexpr int kSVals = T::kBlockN / 2;  // values of S per thread (FwdMainloop checks)
  static constexpr int kChains = T::kSoftmaxChains;
  static_assert(kSVals / 2 % kChains == 0, "");
  // Lazy rescaling's threshold in the exp2 domain (see rows).
  static constexpr float kRescaleLog2 = 8.f;
  // The softcap variant's scores t = tanh(.) lie in [-1, 1], so with bf16 inputs a fixed
  // reference max of 0 keeps every P = exp2(t softcap log2 e) within [2^-s, 2^s], s = softcap
  // log2 e = scale_log2 (bf16 has fp32's exponent range): no max per tile (an FMNMX per score,
  // a row's two shuffles) and no rescale of O; P and l carry fp32's relative precision as with
  // the running max, and O / l and the LSE use the one reference.  What the running max does
  // not have is the range limit on O = sum P v: exact for |v| in [2^(s - 126), 2^(127 - s) /
  // keys] (P a normal float times v; with the running max, [2^-126, 2^119 / keys]), hence only
  // for s <= kFixedMaxLimit (softcap <= 50.25, Gemma-2's 50 included: |v| from 2^-54 to 2^55 /
  // keys).  fp16's range (2^-24 .. 2^16) is too narrow: P would overflow or vanish.
  static constexpr bool kMayFixMax =
      T::kSoftcap && std::is_same_v<typename T::Element, cute::bfloat16_t>;
  static constexpr float kFixedMaxLimit = 72.5f;
  // exp2_fma's columns (Sm90FwdTraits::kFmaExp2Of8) and its polynomial: degree 3 where P is
  // rounded to bf16 for P V (relative 2^-9 against its 1.0e-4), 4 for fp16 (2^-11; 2.9e-6).
  static constexpr int kFmaExp2Of8 = T::kFmaExp2Of8;
  static constexpr int kFmaExp2Degree =
      std::is_same_v<typename T::Element, cute::bfloat16_t> ? 3 : 4;

  // The exp2 domain's factor (softmax_scale * log2(e): fwd_kernel.h); the ALiBi variant sets it
  // per tile (1 for scores its term per score took to log2 units, softmax_scale * log2(e) with
  // the term in the GEMM: rows' kFold).
  float scale_log2;
  // Reference max (unscaled; with kFold in the exp2 domain, shift included) and sum of each
  // row half.
  float m_row[2], l_row[2];
  // The reference max as P used it: m_row * scale_log2 rounded to fp32 (0 while m_row is
  // -inf).  O's rescale factor and the LSE use it too, not the exact product an FMA would
  // form from m_row: with scores of magnitude M (in the exp2 domain) the two differ by up to
  // ulp(M) / 2, so O and l disagreed by that factor at each raise of the max (an fp32
  // emulation, dev/huge_scores_emulation.py: 7e-3 at M = 2^24, 3e-2 at 2^28, against 3-4e-4
  // with one reference; the same instruction count).
  float m_scaled_row[2];
  // The ALiBi variant's constant in row half 1's scores (FwdMainloop::compute_tile's modify),
  // which the LSE takes back; 0 elsewhere.
  float lse_shift1 = 0.f;

  // Whether the call takes the fixed reference max (kMayFixMax, softcap log2 e <=
  // kFixedMaxLimit): the kernel then runs the tile loop's copy whose steps
  // take kFixed (fwd_kernel.h), chosen once per call (a branch per tile costs the loop its
  // overlap of the softmax with P V: ptxas hoists a wgmma wait to the start of a basic block,
  // docs/perf/sm90_forward.md).  m_row stays -inf there, so a row is empty exactly when l = 0.
  const bool fixed_max;

  __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_)
      : scale_log2(scale_log2_), fixed_max(kMayFixMax && scale_log2_ <= kFixedMaxLimit) {}

  __device__ __forceinline__ void reset(int r) {
    m_row[r] = -INFINITY;
    m_scaled_row[r] = 0.f;
    l_row[r] = 0.f;
  }

  // Online softmax of one S tile in place (S becomes exp2(S * scale - m) in fp32), `mask`
  // applied first; alpha gets the rescale factors exp2(m_old - m_new) of O's two rows.  Rows
  // [r0, r1) go through each phase (mask, max, exp2 and sum) together, each row's max and sum
  // as kSoftmaxChains independent partial chains (see Sm90FwdTraits: the schedule ptxas makes
  // of it differs per head dim).  Max is exact in any order; a chained sum rounds differently
  // from a left-to-right one, at the level of fp32 rounding.  kFold (the ALiBi fold,
  // Sm90FwdTraits::kAlibiFold): every score of the tile is s * scale_log2 + fold_shift in the
  // exp2 domain (the GEMM added the term's column part to s, fold_shift is its part per tile
  // and row), so the tile's max is mx * scale_log2 + fold_shift and each exponent is still one
  // FFMA, fma(s, scale_log2, fold_shift - m); m_row is kept in the exp2 domain.
  template <bool kFixed, int r0, int r1, bool kFold, typename TensorS>
  __device__ __forceinline__ void rows(TensorS& tSrS, const RowMask<T>& mask, int n_block,
                                       float (&alpha)[2], float fold_shift) {
    static_assert(!kFixed || kMayFixMax, "a fixed reference max for the softcap variant, bf16");
    mask.template apply<r0, r1>(tSrS, n_block);
    // A chain starts at its first value; a single chain starts from -inf and 0 instead (one
    // FMNMX and one FADD more per row, the schedule measured for it).
    float part[2][kChains], mx[2], m_scaled[2];
    float offset[2];  // the exponent's constant: -m_scaled, with kFold fold_shift - m_scaled
    if constexpr (kFixed) {
#pragma unroll
      for (int r = r0; r < r1; ++r) {
        m_scaled[r] = 0.f;
        m_scaled_row[r] = m_scaled[r];
        alpha[r] = 1.f;
        offset[r] = 0.f;
      }
    } else {
#pragma unroll
      for (int c = 0; c < kSVals / 2; ++c)
#pragma unroll
        for (int r = r0; r < r1; ++r) {
          const float x = tSrS(s_index(r, c));
          const float first = kChains > 1 ? x : fmaxf(-INFINITY, x);
          part[r][c % kChains] = c < kChains ? first : fmaxf(part[r][c % kChains], x);
        }
#pragma unroll
      for (int r = r0; r < r1; ++r) mx[r] = combine_chains<kChains>(part[r], true);
#pragma unroll
      for (int r = r0; r < r1; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
#pragma unroll
      for (int r = r0; r < r1; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
#pragma unroll
      for (int r = r0; r < r1 && kFold; ++r) {
        // (the same rule as below, in the exp2 domain: mx = -inf, no visible key in the tile,
        // stays -inf rather than -inf + shift)
        const float m_tile = mx[r] == -INFINITY ? -INFINITY : fmaf(mx[r], scale_log2, fold_shift);
        const float m_old = m_row[r];
        const bool raise = m_tile - m_old > kRescaleLog2;
        const float m_new = raise ? m_tile : m_old;
        m_scaled[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = raise ? (m_old == -INFINITY ? 0.f : exp2f(m_scaled_row[r] - m_scaled[r])) : 1.f;
        m_row[r] = m_new;
        m_scaled_row[r] = m_scaled[r];
        offset[r] = fold_shift - m_scaled[r];
      }
#pragma unroll
      for (int r = r0; r < r1 && !kFold; ++r) {
        // Lazy rescaling (FlashAttention-4's): the reference max m moves only when this tile's
        // max exceeds it by more than kRescaleLog2 in the exp2 domain, so P <= 2^kRescaleLog2.
        // O and l always share one reference, so O / l and the LSE stay exact, and most key
        // tiles leave O unscaled.  True for m_old = -inf < mx; false (NaN) while both are -inf.
        const float m_old = m_row[r];
        const bool raise = (mx[r] - m_old) * scale_log2 > kRescaleLog2;
        const float m_new = raise ? mx[r] : m_old;
        // Nothing visible yet: subtract 0 so exp2(-inf) = 0 rather than NaN.
        m_scaled[r] = m_new == -INFINITY ? 0.f : m_new * scale_log2;
        // 0 if m_old = -inf
        alpha[r] = raise ? (m_old == -INFINITY ? 0.f : exp2f(m_scaled_row[r] - m_scaled[r])) : 1.f;
        m_row[r] = m_new;
        m_scaled_row[r] = m_scaled[r];
        offset[r] = -m_scaled[r];
      }
    }
#pragma unroll
    for (int c = 0; c < kSVals / 2; ++c)
#pragma unroll
      for (int r = r0; r < r1; ++r) {
        const int i = s_index(r, c);
        const float z = fmaf(tSrS(i), scale_log2, offset[r]);
        tSrS(i) = c % 8 < kFmaExp2Of8 ? exp2_fma<kFmaExp2Degree>(z) : exp2f(z);
        const float first = kChains > 1 ? tSrS(i) : 0.f + tSrS(i);
        part[r][c % kChains] = c < kChains ? first : part[r][c % kChains] + tSrS(i);
      }
#pragma unroll
    for (int r = r0; r < r1; ++r)
      l_row[r] = l_row[r] * alpha[r] + combine_chains<kChains>(part[r], false);
  }

  // One key tile: both rows together or one after the other (Sm90FwdTraits); kFixed: with the
  // fixed reference max (fixed_max).
  template <bool kFixed, bool kFold = false, typename TensorS>
  __device__ __forceinline__ void step(TensorS& tSrS, const RowMask<T>& mask, int n_block,
                                       float (&alpha)[2], float fold_shift = 0.f) {
    static_assert(!(kFixed && kFold), "");
    if constexpr (T::kSoftmaxRowsTogether) {
      rows<kFixed, 0, 2, kFold>(tSrS, mask, n_block, alpha, fold_shift);
    } else {
      rows<kFixed, 0, 1, kFold>(tSrS, mask, n_block, alpha, fold_shift);
      rows<kFixed, 1, 2, kFold>(tSrS, mask, n_block, alpha, fold_shift);
    }
  }

  // O *= alpha per row; with `vote`, skipped by the whole warp when none of its rows moved its
  // reference max (the caller without it has taken that vote).
  template <typename TensorO>
  __device__ __forceinline__ static void rescale_o(TensorO& tOrO, const float (&alpha)[2],
                                                   bool vote) {
    constexpr int kOVals = T::kHeadDim / 2;  // values of O per thread (FwdMainloop checks)
    if (vote && !__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kOVals / 2; ++c) tOrO(s_index(r, c)) *= alpha[r];
  }

  // At the tile's end: l summed over the row's four threads; inv_l = 1 / l, 0 for rows that
  // saw nothing (empty).
  __device__ __forceinline__ void finalize(float (&inv_l)[2], bool (&empty)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_row[r];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      // No visible key (m = -inf, l = 0).  A NaN score makes l NaN: not empty, NaN comes out.
      empty[r] = m_row[r] == -INFINITY && l == 0.f;
      inv_l[r] = empty[r] ? 0.f : 1.f / l;
      l_row[r] = l;
    }
  }

  // Row half r's log-sum-exp (natural log), after finalize.
  __device__ __forceinline__ float lse(int r, bool empty) const {
    constexpr float kLn2 = 0.6931471805599453f;
    const float shift = T::kAlibi && r == 1 ? lse_shift1 : 0.f;
    return empty ? -INFINITY : (m_scaled_row[r] + log2f(l_row[r]) - shift) * kLn2;
  }
};

}  // namespace flash_attn_ext::sm90
