// AVX512-BF16 tile GEMMs and packing (bf16_dot.h).  Every function that uses the instructions
// carries the target attribute and is reached only after enabled() checked the CPU; the file
// includes no library header with inline functions, so no AVX-512 copy of a shared inline
// function can be picked by the linker for code that runs on other CPUs.
#include "cpu/bf16_dot.h"

#include "cpu/bf16_amx.h"
#include "cpu/env_switch.h"

#include <cstdlib>
#include <cstring>

// GCC only: its target attribute, __builtin_cpu_supports("avx512bf16") and the intrinsics'
// vector casts are what this file was written and tested with (clang has equivalents; untested).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    (__GNUC__ > 11 || (__GNUC__ == 11 && __GNUC_MINOR__ >= 1))
#define FAE_HAVE_BF16_DOT 1
#include <immintrin.h>
#define FAE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// GCC 12 reports the zeroed/masked intrinsics' internal temporaries as maybe uninitialised
// (a false positive inside avx512fintrin.h); off for the intrinsic code only (pop below).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#else
#define FAE_HAVE_BF16_DOT 0
#endif

namespace flash_attn_ext::cpu::bf16dot {

ChunkGuard::~ChunkGuard() {
  if (on && bf16amx::enabled()) bf16amx::release();
}

bool enabled() {
  static const bool on = [] {
    // (read on every build and CPU, so that a bad value is an error wherever it is set; the
    // first read is build_info()'s, when flash_attn_ext is imported)
    if (!env_switch("FLASH_ATTN_EXT_CPU_BF16_DOT", true)) return false;
#if FAE_HAVE_BF16_DOT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
  }();
  return on;
}

namespace {

// fp32 -> bf16 bits, round to nearest even, as vcvtneps2bf16 does (denormals flushed to a
// signed zero, NaN kept quiet).
inline uint32_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  if ((u & 0x7f800000u) == 0) return (u >> 16) & 0x8000u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
inline uint32_t to_bf16(uint16_t x) { return x; }

template <typename S>
inline uint32_t word(const S* lo, const S* hi) {  // hi == nullptr: the zero pad of an odd k
  return to_bf16(*lo) | (hi != nullptr ? to_bf16(*hi) << 16 : 0u);
}

}  // namespace

#if FAE_HAVE_BF16_DOT

// The packers of the tiles that are packed once per GEMM (Q, dO, P, dS; V in the forward) are
// vectorised, 16 or 32 values per instruction, scalar only for the last few of a row; bf16
// inputs are moved as they are, fp32 ones rounded (vcvtneps2bf16) on the way.
namespace {

// 32 consecutive values as 16 words (pairs in order).
FAE_BF16 inline __m512i words_of_32(const uint16_t* s) { return _mm512_loadu_si512(s); }
FAE_BF16 inline __m512i words_of_32(const float* s) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
}

// i * stride for lanes i = 0 .. 15: the element offsets of 16 rows, for the gathers of
// pack_transposed and transpose (callers keep 16 * stride within 32 bits).
FAE_BF16 inline __m512i lane_offsets(int64_t stride) {
  return _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(stride)));
}

// 16 consecutive values as bf16 bits in the low halves of 16 words.
FAE_BF16 inline __m512i low_halves_of_16(const uint16_t* s) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
FAE_BF16 inline __m512i low_halves_of_16(const float* s) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s)));
}

template <typename S>
FAE_BF16 void pack_rows_t(uint32_t* dst, int64_t ldd, const S* src, int64_t ld, int64_t rows,
                            int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * ld;
    uint32_t* d = dst + r * ldd;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) _mm512_storeu_si512(d + c / 2, words_of_32(s + c));
    for (; c < cols; c += 2) d[c / 2] = word(s + c, c + 1 < cols ? s + c + 1 : nullptr);
  }
}

template <typename S>
FAE_BF16 void pack_interleaved_t(uint32_t* dst, int64_t ldd, const S* src, int64_t ld,
                                   int64_t k, int64_t n) {
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const S* lo = src + 2 * p * ld;
    const S* hi = 2 * p + 1 < k ? lo + ld : nullptr;
    uint32_t* d = dst + p * ldd;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      __m512i w = low_halves_of_16(lo + j);
      if (hi != nullptr) w = _mm512_or_si512(w, _mm512_slli_epi32(low_halves_of_16(hi + j), 16));
      _mm512_storeu_si512(d + j, w);
    }
    for (; j < n; ++j) d[j] = word(lo + j, hi ? hi + j : nullptr);
  }
}

}  // namespace

// Sixteen keys at a time: one gather reads word p of 16 rows, one store writes them to row p of
// dst contiguously (a key-by-key loop wrote a word per cache line, on a new page per word once
// ldd reaches 1024).  An odd k: the last word's high half is the zero pad.
FAE_BF16 void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld,
                              int64_t n, int64_t k) {
  const int64_t pairs = (k + 1) / 2;
  const __m512i rows = lane_offsets(ld);
  // An odd k's last pair is read element by element below: a 4-byte gather there would read
  // the element after each row's last, past the tensor's end for its last row (a reviewer's
  // guard-page test: SIGSEGV at head dim 59 with 16 keys).
  const int64_t whole = k / 2;
  int64_t j = 0;
  for (; j + 16 <= n && 16 * ld <= (int64_t{1} << 30); j += 16) {
    const uint16_t* s = src + j * ld;
    for (int64_t p = 0; p < whole; ++p) {
      // (byte offsets: rows[i] elements of 2 bytes; element 2p of each row)
      _mm512_storeu_si512(dst + p * ldd + j, _mm512_i32gather_epi32(rows, s + 2 * p, 2));
    }
    if (whole < pairs)
      for (int64_t i = 0; i < 16; ++i) dst[whole * ldd + j + i] = s[i * ld + 2 * whole];
  }
  for (; j < n; ++j) {
    const uint16_t* s = src + j * ld;
    for (int64_t p = 0; p < pairs; ++p)
      dst[p * ldd + j] = word(s + 2 * p, 2 * p + 1 < k ? s + 2 * p + 1 : nullptr);
  }
}

// Sixteen elements of a destination row per gather (src's column j, rows i .. i + 15).
FAE_BF16 void transpose(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t m,
                        int64_t n) {
  if (16 * lds > (int64_t{1} << 28)) {  // (the gather's 32-bit offsets)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) dst[j * ldd + i] = src[i * lds + j];
    return;
  }
  const __m512i rows = lane_offsets(lds);
  for (int64_t j = 0; j < n; ++j) {
    float* d = dst + j * ldd;
    int64_t i = 0;
    for (; i + 16 <= m; i += 16)
      _mm512_storeu_ps(d + i, _mm512_i32gather_ps(rows, src + i * lds + j, 4));
    if (i < m) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (m - i)) - 1u);
      _mm512_mask_storeu_ps(d + i, tail, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), tail, rows,
                                                                  src + i * lds + j, 4));
    }
  }
}

namespace {

// softmax_rows.cpp's exp_nonpositive, the same operations in the same order as its AVX-512
// clone compiles them (Cody-Waite reduction, degree-4 q(r) by FMA Horner steps, 2^n from
// x log2e + 1.5 * 2^23), on 16 lanes.
FAE_BF16 inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 under = _mm512_set1_ps(-87.3f);
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __mmask16 low = _mm512_cmp_ps_mask(x, under, _CMP_LT_OQ);
  const __m512 xc = _mm512_mask_blend_ps(low, x, under);
  const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 q = _mm512_set1_ps(0.0082903066650033f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.041897933930158615f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.1666763573884964f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.4999915063381195f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.9999997019767761f));
  const __m512 p = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)),
                       _mm512_set1_epi32(127)),
      23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~low), y);  // below -87.3: 0 (NaN: NaN)
}

// P of 16 scores: x * scale rounded, then minus the row's max, as the two passes of
// scale_rows and online_softmax_rows round them.  The product by the rounding-mode form: the
// plain one is a vector multiply that GCC fuses with the subtraction (C++'s default
// fp-contract), whose exact product then differs from the max's rounded one by up to
// ulp(max) / 2 in the exponent (NaN rows at scores ~5e10: test_attention.py's extreme scales).
FAE_BF16 inline __m512 probs16(__m512 x, __m512 scale, __m512 m) {
  const __m512 scaled =
      _mm512_mul_round_ps(x, scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return exp16_nonpositive(_mm512_sub_ps(scaled, m));
}

}  // namespace

FAE_BF16 void softmax_to_words(const float* S, int64_t rows, int64_t cols, int64_t ld,
                               float scale, float* m, float* l, float* alpha, uint32_t* dst,
                               int64_t ldd) {
  const float inf = __builtin_inff();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = S + r * ld;
    uint32_t* d = dst + r * ldd;
    // The raw max, scaled once: rounding is monotonic, so it is the scaled scores' max.
    __m512 vmax = _mm512_set1_ps(-inf);
    int64_t c = 0;
    // (vmaxps returns its second operand unless the first is greater: a NaN score, first, is
    // skipped, as online_softmax_rows' comparison skips it; the row sum below takes it)
    for (; c + 16 <= cols; c += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(s + c), vmax);
    if (c < cols) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (cols - c)) - 1u);
      vmax = _mm512_mask_max_ps(vmax, tail, _mm512_maskz_loadu_ps(tail, s + c), vmax);
    }
    const float mx = _mm512_reduce_max_ps(vmax) * scale;
    const float m_old = m[r];
    const float m_new = m_old > mx ? m_old : mx;
    const float m_use = m_new == -inf ? 0.f : m_new;
    alpha[r] = m_old == -inf ? 0.f : _mm512_cvtss_f32(
        exp16_nonpositive(_mm512_set1_ps(m_old - m_use)));
    const __m512 vm = _mm512_set1_ps(m_use);
    __m512 vsum = _mm512_setzero_ps();
    c = 0;
    for (; c + 32 <= cols; c += 32) {
      const __m512 p0 = probs16(_mm512_loadu_ps(s + c), vscale, vm);
      const __m512 p1 = probs16(_mm512_loadu_ps(s + c + 16), vscale, vm);
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(d + c / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    if (c < cols) {  // the last 1-31 scores: masked loads, zeros past cols (the pad included)
      const int64_t left = cols - c;
      const __mmask16 t0 = static_cast<__mmask16>(left >= 16 ? 0xffffu : (1u << left) - 1u);
      const __mmask16 t1 =
          static_cast<__mmask16>(left <= 16 ? 0u : left >= 32 ? 0xffffu : (1u << (left - 16)) - 1u);
      const __m512 p0 =
          _mm512_maskz_mov_ps(t0, probs16(_mm512_maskz_loadu_ps(t0, s + c), vscale, vm));
      const __m512 p1 =
          _mm512_maskz_mov_ps(t1, probs16(_mm512_maskz_loadu_ps(t1, s + c + 16), vscale, vm));
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
      const int64_t words = (left + 1) / 2;
      _mm512_mask_storeu_epi32(d + c / 2, static_cast<__mmask16>((1u << words) - 1u),
                               (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
    m[r] = m_new;
  }
}

namespace {

// One MR x (16 NV) block of C over all `pairs`: MR * NV accumulators (at most 24 of the 32 zmm
// registers), NV words of B per step shared by MR broadcast words of A.  `tail`: the lanes of
// the last vector that lie inside C (B is read under the same mask).
template <int MR, int NV>
FAE_BF16 void micro(const uint32_t* a, int64_t a_m, int64_t a_p, const uint32_t* b, int64_t ldb,
                    int64_t pairs, float* c, int64_t ldc, __mmask16 tail, float alpha,
                    bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* bp = b + p * ldb;
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = (__m512bh)(j + 1 < NV ? _mm512_loadu_si512(bp + 16 * j)
                                    : _mm512_maskz_loadu_epi32(tail, bp + 16 * j));
    const uint32_t* ap = a + p * a_p;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[i * a_m]));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 mask = j + 1 < NV ? __mmask16(0xffff) : tail;
      float* cp = c + i * ldc + 16 * j;
      const __m512 r = accumulate ? _mm512_fmadd_ps(acc[i][j], va, _mm512_maskz_loadu_ps(mask, cp))
                                  : _mm512_mul_ps(acc[i][j], va);
      _mm512_mask_storeu_ps(cp, mask, r);
    }
}

using Micro = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                       float*, int64_t, __mmask16, float, bool);

constexpr int kMR = 6, kNV = 4;

template <int MR>
constexpr Micro pick_nv(int nv) {
  return nv == 1 ? micro<MR, 1> : nv == 2 ? micro<MR, 2> : nv == 3 ? micro<MR, 3> : micro<MR, 4>;
}

Micro pick(int mr, int nv) {
  switch (mr) {
    case 1: return pick_nv<1>(nv);
    case 2: return pick_nv<2>(nv);
    case 3: return pick_nv<3>(nv);
    case 4: return pick_nv<4>(nv);
    case 5: return pick_nv<5>(nv);
    default: return pick_nv<6>(nv);
  }
}

}  // namespace

void gemm(float* c, int64_t ldc, const uint32_t* a, int64_t a_m, int64_t a_p, const uint32_t* b,
          int64_t ldb, int64_t m, int64_t n, int64_t pairs, float alpha, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  // AMX where the CPU has it (bf16_amx.h): A in rows, or transposed (a_m = 1: the backward's
  // P^T and dS^T).
  if (bf16amx::enabled() && (a_p == 1 || a_m == 1)) {
    if (a_p == 1)
      bf16amx::gemm(c, ldc, a, a_m, b, ldb, m, n, pairs, alpha, accumulate);
    else
      bf16amx::gemm_transposed(c, ldc, a, a_p, b, ldb, m, n, pairs, alpha, accumulate);
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += 16 * kNV) {
    const int64_t w = n - j0 < 16 * kNV ? n - j0 : 16 * kNV;
    const int nv = static_cast<int>((w + 15) / 16);
    const int last = static_cast<int>(w - 16 * (nv - 1));
    const __mmask16 tail = static_cast<__mmask16>(last == 16 ? 0xffff : (1u << last) - 1u);
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      const int mr = static_cast<int>(m - i0 < kMR ? m - i0 : kMR);
      pick(mr, nv)(a + i0 * a_m, a_m, a_p, b + j0, ldb, pairs, c + i0 * ldc + j0, ldc, tail,
                   alpha, accumulate);
    }
  }
}

#else  // no AVX512-BF16 compiler support: enabled() is false and these are never called

void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t n,
                     int64_t k) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t p = 0; p < (k + 1) / 2; ++p)
      dst[p * ldd + j] = word(src + j * ld + 2 * p,
                              2 * p + 1 < k ? src + j * ld + 2 * p + 1 : nullptr);
}

template <typename S>
void pack_rows_t(uint32_t* dst, int64_t ldd, const S* src, int64_t ld, int64_t rows,
                      int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 2)
      dst[r * ldd + c / 2] = word(src + r * ld + c, c + 1 < cols ? src + r * ld + c + 1 : nullptr);
}

template <typename S>
void pack_interleaved_t(uint32_t* dst, int64_t ldd, const S* src, int64_t ld, int64_t k,
                             int64_t n) {
  for (int64_t p = 0; p < (k + 1) / 2; ++p)
    for (int64_t j = 0; j < n; ++j)
      dst[p * ldd + j] = word(src + 2 * p * ld + j, 2 * p + 1 < k ? src + (2 * p + 1) * ld + j
                                                                  : nullptr);
}

void gemm(float*, int64_t, const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
          int64_t, int64_t, float, bool) {
  std::abort();
}

void transpose(float*, int64_t, const float*, int64_t, int64_t, int64_t) { std::abort(); }
void softmax_to_words(const float*, int64_t, int64_t, int64_t, float, float*, float*, float*,
                      uint32_t*, int64_t) {
  std::abort();
}

#endif

// (pack_rows_t / pack_interleaved_t: the vectorised templates above, or the scalar ones)
void pack_rows(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t rows,
               int64_t cols) {
  pack_rows_t(dst, ldd, src, ld, rows, cols);
}
void pack_rows(uint32_t* dst, int64_t ldd, const float* src, int64_t ld, int64_t rows,
               int64_t cols) {
  pack_rows_t(dst, ldd, src, ld, rows, cols);
}
void pack_interleaved(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t k,
                      int64_t n) {
  pack_interleaved_t(dst, ldd, src, ld, k, n);
}
void pack_interleaved(uint32_t* dst, int64_t ldd, const float* src, int64_t ld, int64_t k,
                      int64_t n) {
  pack_interleaved_t(dst, ldd, src, ld, k, n);
}

}  // namespace flash_attn_ext::cpu::bf16dot

#if FAE_HAVE_BF16_DOT
#pragma GCC diagnostic pop
#endif
