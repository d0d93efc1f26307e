// bf16 tile GEMMs for the CPU kernels on CPUs with AVX512-BF16 (vdpbf16ps: each fp32 lane adds
// a0 * b0 + a1 * b1 of two bf16 pairs; products of bf16 values are exact in fp32, accumulation is
// fp32).  Twice sgemm's multiply-adds per instruction, and no conversion of bf16 tiles to fp32.
//
// Operands are "words": uint32 holding two bf16 that are adjacent along the GEMM's reduction
// dimension k (the even one in the low half).  A(i, p) is read at a[i * a_m + p * a_p], so one
// packed buffer serves as A or as A's transpose; B(p, j) at b[p * ldb + j], its row p of words
// read 16 at a time.  An odd k is padded with a zero bf16.
//
// Which operands are bf16 (the error rule of DEVELOPERS.md, measured in docs/perf/cpu.md): the
// score GEMMs S = Q K^T and dP = dO V^T multiply the inputs themselves (exact products, the same
// result as fp32 tiles up to summation order); P V, P^T dO, dS^T Q and dS K round P and dS to
// bf16 first, as the CUDA kernels and PyTorch's CPU flash kernel do.  vdpbf16ps ignores MXCSR:
// denormal inputs count as zero, denormal results are flushed, and each instruction rounds
// twice (after each product of the pair); the packers flush denormals when they round fp32 to
// bf16, as vcvtneps2bf16 does.  Below 1.2e-38 none of this changes an attention result.
#pragma once

#include <cstdint>

namespace flash_attn_ext::cpu::bf16dot {

// Whether the bf16 path runs: the CPU has AVX512-BF16 (with AVX512-BW/VL) and the environment
// variable FLASH_ATTN_EXT_CPU_BF16_DOT does not switch it off (read once, env_switch.h: 0,
// false, no or off keep bf16 inputs on fp32 tiles and sgemm, e.g. to compare; 1, true, yes,
// on or unset leave it to the CPU; any other value raises ValueError).
bool enabled();

// dst[r * ldd + p] = (src[r][2p], src[r][2p + 1]) for r < rows, p < (cols + 1) / 2; element
// (r, c) of src at src[r * ld + c].  bf16 bits, or fp32 rounded to nearest even (NaN stays NaN).
void pack_rows(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t rows,
               int64_t cols);
void pack_rows(uint32_t* dst, int64_t ldd, const float* src, int64_t ld, int64_t rows,
               int64_t cols);

// dst[p * ldd + j] = (src[j][2p], src[j][2p + 1]) for j < n, p < (k + 1) / 2: B = X^T from an
// (n x k) matrix X whose rows run along k (K or V tiles for S = Q K^T, dP = dO V^T).
void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t n,
                     int64_t k);

// dst[p * ldd + j] = (src[2p][j], src[2p + 1][j]) for p < (k + 1) / 2, j < n: B = X from a
// (k x n) matrix X (two rows interleaved per word row); also A = X^T with a_m = 1, a_p = ldd.
void pack_interleaved(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t ld, int64_t k,
                      int64_t n);
void pack_interleaved(uint32_t* dst, int64_t ldd, const float* src, int64_t ld, int64_t k,
                      int64_t n);

// online_softmax_rows (softmax_rows.h) with P written as the words of the P V product instead
// of over S: for each row r < rows, x = S[r, c] * scale (scale > 0), m_new = max(m[r], max_c
// x), P = exp(x - m_new) (the same exponential, rounded to bf16 as pack_rows rounds it; the
// row sum l takes P in fp32), dst[r * ldd + c / 2] = (P[r, c], P[r, c + 1]) for c < cols (an
// odd cols pads with zero), alpha[r] = exp(m_old - m_new), m and l updated.  S is read, not
// written.  Only call when enabled().
void softmax_to_words(const float* S, int64_t rows, int64_t cols, int64_t ld, float scale,
                      float* m, float* l, float* alpha, uint32_t* dst, int64_t ldd);

// dst[j * ldd + i] = src[i * lds + j] for i < m, j < n (fp32; S from the S^T of the forward's
// decode route).  Only call when enabled().
void transpose(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t m, int64_t n);

// C (m x n, leading dimension ldc) = alpha * A B, plus C's previous contents if `accumulate`;
// A (m x pairs words), B (pairs x n words) as above.  Only call when enabled().
void gemm(float* c, int64_t ldc, const uint32_t* a, int64_t a_m, int64_t a_p, const uint32_t* b,
          int64_t ldb, int64_t m, int64_t n, int64_t pairs, float alpha, bool accumulate);

// Held by each parallel chunk that may call gemm (`on`: it does): its end releases the
// thread's AMX state where gemm took the AMX path (bf16_amx.h).
struct ChunkGuard {
  bool on;
  ~ChunkGuard();
};

}  // namespace flash_attn_ext::cpu::bf16dot
