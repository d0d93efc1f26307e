// bf16 tile GEMMs on AMX through PyTorch's own brgemm (at::native::cpublas, oneDNN's ukernel),
// for the CPUs that have AMX-BF16 (Sapphire Rapids and later): bf16_amx.h.  In a file of its
// own, without bf16_dot.cpp's target attributes: ATen's headers carry inline functions.
#include "cpu/bf16_amx.h"

#include "cpu/env_switch.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

// The passes brgemm leaves to us (it has no alpha), vectorised for the CPU they run on (every
// AMX CPU has AVX-512: the first clone; GCC's function multi-versioning, as softmax_rows.cpp).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FAE_AMX_VECTOR __attribute__((target_clones("avx512f", "default")))
#else
#define FAE_AMX_VECTOR
#endif

namespace flash_attn_ext::cpu::bf16amx {

namespace {

// c[i, :n] *= alpha (the micro-kernel's alpha * A B, one rounding more: after the sum).
FAE_AMX_VECTOR void scale_rows(float* c, int64_t ldc, int64_t m, int64_t n, float alpha) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] *= alpha;
  }
}

// c[i, :n] = fma(alpha, product[i, :n], c[i, :n]) (one rounding, as the micro-kernel's).
FAE_AMX_VECTOR void add_scaled_rows(float* c, int64_t ldc, const float* product, int64_t m,
                                    int64_t n, float alpha) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    const float* src = product + i * n;
    for (int64_t j = 0; j < n; ++j) row[j] = std::fma(alpha, src[j], row[j]);
  }
}

}  // namespace

// The brgemm overloads this file calls (bf16 x bf16 -> fp32, VNNI B by default) are those of
// PyTorch releases that define this macro; on older ones the AMX path is off.
#ifdef CPUBLAS_BRGEMM_BF16BF16F32

bool enabled() {
  static const bool on = [] {
    // (env_switch.h: 0/false/no/off keep the AVX512-BF16 tiles; a value it does not take
    // raises ValueError)
    if (!env_switch("FLASH_ATTN_EXT_CPU_BF16_AMX", true)) return false;
    return at::native::cpublas::could_pack(at::kBFloat16);
  }();
  return on;
}

void gemm(float* c, int64_t ldc, const uint32_t* a, int64_t lda_words, const uint32_t* b,
          int64_t ldb, int64_t m, int64_t n, int64_t pairs, float alpha, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  // Words are VNNI pairs: A's rows are bf16 rows of 2 * pairs elements, B is VNNI-2 (pairs rows
  // of n words); brgemm takes both as they are.  brgemm has no alpha: a scaled product goes to
  // C scaled afterwards, a scaled sum through a buffer of this thread's (C += alpha * A B).
  const auto* a16 = reinterpret_cast<const c10::BFloat16*>(a);
  const auto* b16 = reinterpret_cast<const c10::BFloat16*>(b);
  if (accumulate && alpha != 1.f) {
    thread_local std::vector<float> product;
    product.resize(static_cast<size_t>(m * n));
    at::native::cpublas::brgemm(m, n, 2 * pairs, 2 * lda_words, ldb, n, false, a16, b16,
                                product.data());
    add_scaled_rows(c, ldc, product.data(), m, n, alpha);
    return;
  }
  at::native::cpublas::brgemm(m, n, 2 * pairs, 2 * lda_words, ldb, ldc, accumulate, a16, b16, c);
  if (alpha != 1.f) scale_rows(c, ldc, m, n, alpha);
}

void gemm_transposed(float* c, int64_t ldc, const uint32_t* a, int64_t lda_words,
                    const uint32_t* b, int64_t ldb, int64_t m, int64_t n, int64_t pairs,
                    float alpha, bool accumulate) {
  // A's rows, copied in 8 x 8 blocks of words (both sides stay within a few cache lines).
  thread_local std::vector<uint32_t> rows;
  rows.resize(static_cast<size_t>(m * pairs));
  for (int64_t p0 = 0; p0 < pairs; p0 += 8)
    for (int64_t i0 = 0; i0 < m; i0 += 8)
      for (int64_t p = p0; p < p0 + 8 && p < pairs; ++p)
        for (int64_t i = i0; i < i0 + 8 && i < m; ++i)
          rows[i * pairs + p] = a[p * lda_words + i];
  gemm(c, ldc, rows.data(), pairs, b, ldb, m, n, pairs, alpha, accumulate);
}

void release() { at::native::cpublas::brgemm_release(); }

#else

bool enabled() { return false; }
void gemm(float*, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, int64_t,
          int64_t, float, bool) {
  std::abort();
}
void gemm_transposed(float*, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t,
                     int64_t, int64_t, float, bool) {
  std::abort();
}
void release() {}

#endif

}  // namespace flash_attn_ext::cpu::bf16amx
