// Row-wise pieces of the online softmax (FlashAttention-2, arXiv:2307.08691, Algorithm 1 lines
// 8-10; backward Algorithm 2 lines 11-14) on a tile of scores held row-major in CPU memory.
//
// The float versions are compiled for several instruction sets (AVX-512, AVX2, baseline) and
// picked at load time, because the exponential dominates the non-GEMM work and must vectorise.
#pragma once

#include <cstdint>

namespace flash_attn_ext::cpu {

// One step of the online softmax over a (rows x cols) tile S with leading dimension ld.
// In:  scale * S = scaled, capped, masked scores (-inf where masked; scale > 0: 1, or the
//      softmax scale of plain scores that no GEMM has scaled: S is scaled in the max's pass,
//      each score rounded as a pass of its own would round it, without that pass's read of S);
//      m/l = running max and sum per row, in scaled units.
// Out: S = exp(scale * S - m_new); m = m_new; l = l * alpha + rowsum(S); alpha = exp(m_old -
// m_new), the factor the caller rescales its output accumulator by.  A row with no visible key
// so far keeps m = -inf, l = 0 and gets alpha = 0 (its accumulator is zero anyway): never NaN.
void online_softmax_rows(float* S, int64_t rows, int64_t cols, int64_t ld, float* m, float* l,
                         float* alpha, float scale = 1.f);
void online_softmax_rows(double* S, int64_t rows, int64_t cols, int64_t ld, double* m, double* l,
                         double* alpha, double scale = 1.0);

// Recomputes probabilities from scores and the saved log-sum-exp, given as two terms per row:
// S = exp((S - lse[row]) - lse_lo[row]) (lse_lo 0, or lse = the row's max and lse_lo its log
// sum where lse alone would not carry it: flash_bwd_cpu.cpp); rows with lse = -inf (nothing
// visible) become 0.
void probs_from_lse_rows(float* S, int64_t rows, int64_t cols, int64_t ld, const float* lse,
                         const float* lse_lo);
void probs_from_lse_rows(double* S, int64_t rows, int64_t cols, int64_t ld, const double* lse,
                         const double* lse_lo);

// dS = P * (dP - delta[row]), written over dP (Algorithm 2 line 14; delta = rowsum(dO * O)).
void softmax_grad_rows(const float* P, float* dP, int64_t rows, int64_t cols, int64_t ld,
                       const float* delta);
void softmax_grad_rows(const double* P, double* dP, int64_t rows, int64_t cols, int64_t ld,
                       const double* delta);

}  // namespace flash_attn_ext::cpu
