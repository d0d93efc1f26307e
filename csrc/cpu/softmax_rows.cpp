#include "cpu/softmax_rows.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Function multi-versioning: GCC emits one copy per target and an ifunc resolver that picks the
// best at load time, so a binary built on any x86-64 machine vectorises on the machine it runs on.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
// GCC if-converts exp_nonpositive's float selects (and so vectorises the loops that call it)
// only when it may assume that comparisons do not trap; without this the AVX2 clone's exp loops
// stayed scalar (perf: 48% of an fp32 forward there, 23% in sgemm).  Results are unchanged:
// nothing here relies on floating-point exceptions, and NaN and infinities keep their meaning.
// fp-contract=fast lets it fuse a * b + c into an FMA where the clone has one (the ISO C++ mode
// of the build turns contraction off): the exp polynomial's Horner steps, each then rounded
// once instead of twice (no less accurate; the range reduction is exact without FMA too, see
// exp_nonpositive).  The second clone is
// x86-64-v3 (AVX2 with FMA; every AVX2 CPU but a few early VIA ones), chosen by ISA level, not
// "avx2", which has no FMA.
#pragma GCC optimize("no-trapping-math", "fp-contract=fast")
#define FAE_MULTIVERSION \
  __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#define FAE_INLINE __attribute__((always_inline)) inline
#else
#define FAE_MULTIVERSION
#define FAE_INLINE inline
#endif

namespace flash_attn_ext::cpu {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 in float32 with a branch-free body that vectorises, in 15 vector
// operations (the softmax's cost per score on the CPU).  x = n ln2 + r with n = round(x log2e)
// and |r| <= ln2/2, Cody-Waite: ln2 split so that n * kLn2Hi is exact, which keeps r accurate
// with or without FMA (one rounded product with ln2 in one constant, as in a clone without
// FMA, cost up to 68 ulp near -87), then exp(r) = 1 + r q(r) with q of degree 4 fitted for
// least relative error on [-ln2/2, ln2/2] (Lawson-weighted least squares on 400 Chebyshev
// nodes, in 40-digit arithmetic): 9e-8 relative before float32 rounding.  Measured against
// float64 over 4M points in [-87.3, 0] (g++, this function): at most 2.0 ulp with FMA, 2.3
// without (mean 0.66), exp(0) = 1 exactly; PyTorch's vectorised exp (exp_u20) allows 20.
// 2^n comes from the bits of x log2e + 1.5 * 2^23 (which hold n in its low mantissa bits) by
// an integer add and a shift.  Below -87.3 (where exp underflows to denormals) the result is 0; NaN stays NaN (it
// reaches r and the polynomial, and NaN times 2^n is NaN whatever the garbage exponent).
FAE_INLINE float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln2 split so n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kUnderflow = -87.3f;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr uint32_t kMagicBits = 0x4B400000u;  // kRoundMagic's bits, n = 0
  const float xc = x < kUnderflow ? kUnderflow : x;
  const float t = xc * kLog2e + kRoundMagic;  // kRoundMagic + n, exactly
  const float n = t - kRoundMagic;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float q = 0.0082903066650033f;
  q = q * r + 0.041897933930158615f;
  q = q * r + 0.1666763573884964f;
  q = q * r + 0.4999915063381195f;
  q = q * r + 0.9999997019767761f;
  const float p = q * r + 1.f;
  uint32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof(t_bits));
  const uint32_t bits = (t_bits - kMagicBits + 127u) << 23;  // n + 127 >= 1 for x >= -87.3
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float y = p * two_n;
  return x < kUnderflow ? 0.f : y;
}

FAE_INLINE double exp_nonpositive(double x) { return std::exp(x); }

template <typename T>
FAE_INLINE void online_softmax_rows_impl(T* S, int64_t rows, int64_t cols, int64_t ld, T* m,
                                         T* l, T* alpha, T scale) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* s = S + r * ld;
    T mx = -inf;
    if (scale != T(1)) {
      // Scaled in the max's pass and stored: each score rounded once, as a separate pass over
      // S would round it (not x = fma(S, scale, -m): its product's rounding would differ from
      // the max's, by up to 2^8 in the exponent at huge scores, test_attention.py's extreme
      // scales), one read of S fewer.
#pragma omp simd reduction(max : mx)
      for (int64_t c = 0; c < cols; ++c) {
        const T x = s[c] * scale;
        s[c] = x;
        mx = x > mx ? x : mx;
      }
    } else {
#pragma omp simd reduction(max : mx)
      for (int64_t c = 0; c < cols; ++c) mx = s[c] > mx ? s[c] : mx;
    }
    const T m_old = m[r];
    const T m_new = m_old > mx ? m_old : mx;
    // With nothing visible yet (m_new = -inf) subtract 0 so that exp(-inf - 0) = 0, not NaN.
    const T m_use = m_new == -inf ? T(0) : m_new;
    alpha[r] = m_old == -inf ? T(0) : exp_nonpositive(m_old - m_use);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
      const T p = exp_nonpositive(s[c] - m_use);
      s[c] = p;
      sum += p;
    }
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
}

template <typename T>
FAE_INLINE void probs_from_lse_rows_impl(T* S, int64_t rows, int64_t cols, int64_t ld,
                                         const T* lse, const T* lse_lo) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* s = S + r * ld;
    if (lse[r] == -inf) {
      for (int64_t c = 0; c < cols; ++c) s[c] = T(0);
      continue;
    }
    const T lr = lse[r], lo = lse_lo[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) s[c] = exp_nonpositive((s[c] - lr) - lo);
  }
}

template <typename T>
FAE_INLINE void softmax_grad_rows_impl(const T* P, T* dP, int64_t rows, int64_t cols, int64_t ld,
                                       const T* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = P + r * ld;
    T* dp = dP + r * ld;
    const T d = delta[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) dp[c] = p[c] * (dp[c] - d);
  }
}

}  // namespace

FAE_MULTIVERSION void online_softmax_rows(float* S, int64_t rows, int64_t cols, int64_t ld,
                                          float* m, float* l, float* alpha, float scale) {
  online_softmax_rows_impl(S, rows, cols, ld, m, l, alpha, scale);
}
void online_softmax_rows(double* S, int64_t rows, int64_t cols, int64_t ld, double* m, double* l,
                         double* alpha, double scale) {
  online_softmax_rows_impl(S, rows, cols, ld, m, l, alpha, scale);
}

FAE_MULTIVERSION void probs_from_lse_rows(float* S, int64_t rows, int64_t cols, int64_t ld,
                                          const float* lse, const float* lse_lo) {
  probs_from_lse_rows_impl(S, rows, cols, ld, lse, lse_lo);
}
void probs_from_lse_rows(double* S, int64_t rows, int64_t cols, int64_t ld, const double* lse,
                         const double* lse_lo) {
  probs_from_lse_rows_impl(S, rows, cols, ld, lse, lse_lo);
}

FAE_MULTIVERSION void softmax_grad_rows(const float* P, float* dP, int64_t rows, int64_t cols,
                                        int64_t ld, const float* delta) {
  softmax_grad_rows_impl(P, dP, rows, cols, ld, delta);
}
void softmax_grad_rows(const double* P, double* dP, int64_t rows, int64_t cols, int64_t ld,
                       const double* delta) {
  softmax_grad_rows_impl(P, dP, rows, cols, ld, delta);
}

}  // namespace flash_attn_ext::cpu
