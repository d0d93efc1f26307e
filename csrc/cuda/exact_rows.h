// The backward's exact pass over rows whose saved LSE cannot give their probabilities (CUDA).
//
// Every CUDA backward recomputes P = exp2(s' - lse * log2 e) from the forward's one-float LSE.
// Where |lse * log2 e| is large the float's rounding (half an ulp: 2^-11 in the exponent at
// 2^13, 64 at 2^30) scales the whole row's P by up to 2^(ulp / 2), and unlike P's own 16-bit
// rounding it does not average out over the row.  The case that needs it is not exotic: a row
// whose every key an additive mask of large finite values hides (`masked_fill(-1e9)`, -1e4 in
// BERT-era code, finfo(float16).min) has an LSE of about the mask value; its forward is the
// uniform average of v, but P = exp2(s' - lse2) came out up to S_k times too large in dq, dk, dv
// and the mask's gradient (the CPU backward had the same defect, fixed by the same rule:
// docs/reference.md).
//
// A finite huge LSE arises from a floating attn_bias of huge values (a boolean mask is -inf
// where it hides) and, without one, from huge scores (|q.k| * scale * log2 e >= 2^13: large
// softmax_scales or unnormalised activations, issue 29).  On every backward (KernelOptions::
// exact_rows_always; off: only with a floating bias) the glue runs:
//   1. exact_rows_flag: rows whose LSE is finite with |lse * log2 e| >= kExactRowsLse2 are
//      flagged and get LSE -inf in a copy the main backward reads, so that their P there is 0:
//      the main kernels give them no dq and add nothing to dk, dv or the bias's gradient;
//   2. the main backward, unchanged;
//   3. exact_rows_backward: for flagged rows only, m and l recomputed from the scores as the
//      forward forms them (score.h's ScoreFn: scale, softcap, bias, ALiBi; the causal / window
//      mask; dropout's Philox mask), P = exp2(s' - m) / l, and their whole dq row, their
//      entries of the bias's gradient, and their dk / dv contributions (added to the main
//      backward's dk / dv: one more rounding of those values to the 16-bit dtype, only in the
//      key tiles of a (batch, KV head) that has a flagged row).  Fixed order throughout, so a
//      deterministic call stays bitwise reproducible.
// Without a flagged row both kernels read one flag and return.  The pass is scalar fp32 code,
// far slower per row than the main kernels: a call with many such rows (a left-padded causal
// batch masked by -1e9) pays for correctness.
//
// The forward has the same limit where its scores are plain (no softcap, float bias or ALiBi:
// those go to log2 units before the softmax, score.h, and their reference max is exact): each
// exponent is one FMA, s * c - m_c, with m_c = m * c rounded to float32, so a row's P carries
// the common factor 2^(m * c - m_c), up to 2^(ulp(M) / 2) at scores of magnitude M in the exp2
// domain.  The Hopper forward's O, l and LSE share m_c, so the factor cancels until P
// overflows (16-bit P: M >~ 2^27 with fp16, 2^31 with bf16; issue 29's fp16 inputs of
// magnitude 900 with scale 100 are at ~2^31); the portable forward's rescale and LSE use the
// exact product, so its O and l disagree by that factor from M ~ 2^13.  After every forward
// of plain scores, dense or packed (exact_rows_always), exact_rows_forward reads the LSE the
// main forward wrote and, for rows whose |lse * log2 e| >= kExactRowsLse2, whose LSE is +inf or
// NaN, or -inf although they see keys (every P underflowed), recomputes out and the LSE with
// exponents (s - m) * c (exact where s is close to m).  Without such a row it reads the LSE and
// returns: one launch.  The backward's pass runs in the packed sequences' backward too.
//
// Decoding against a KV cache takes no pass: the decode kernels are memory-bound, so they form
// each exponent as (x - m) * c (an FADD more per score than the FMA, hidden behind the loads
// there), merge the splits of a row from each split's (m, l) rather than its rounded LSE, and
// compute the LSE in float64 (sm80::lse_of), as the pass does: no row needs it, and a decode
// call has one launch fewer (flash_decode_kernel.cuh; docs/perf/decode.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::cuda {

// |lse * log2(e)| from which a row takes the exact pass: below it the LSE's rounding (at most
// 2^-11 in the exponent) scales P by at most 1 +- 3.4e-4, under a 16-bit output's rounding.
constexpr float kExactRowsLse2 = 8192.f;

// Step 1 for the rows of p.softmax_lse ((batch, heads_q, seqlen_q); packed sequences
// (heads_q, total_q)): lse_hidden (same layout)
// gets -inf at flagged rows and lse elsewhere, flags 1 / 0 per row, and *any 1 if some row is
// flagged (the caller zeroes it first).
cudaError_t exact_rows_flag(const BwdParams& p, float* lse_hidden, uint8_t* flags, int32_t* any,
                            cudaStream_t stream);

// Step 3, after the main backward wrote dq, dk, dv (and p.dbias_full); row_stats: 3 floats
// per row of scratch.  Element: __half or
// __nv_bfloat16, the dtype of q, k, v and the gradients.
template <typename Element>
cudaError_t exact_rows_backward(const BwdParams& p, const uint8_t* flags, const int32_t* any,
                                float* row_stats, cudaStream_t stream);

// Whether a forward's scores are plain (no softcap, floating bias or ALiBi; a boolean mask kept
// as bytes, bias_is_mask, is plain too; dropout does not change the scores): the calls whose
// main forward forms each exponent with the one FMA above, so the glue runs exact_rows_forward
// after them.  sm80::ScoreFn::modified() (kernels/sm80/score.h) is its kernel-side twin, the
// same question per (batch, head) on the device, which picks the exponent's units there, and
// ScoreFn::modified_of(p) the same per call (the decode combine).  This one stays apart because
// ScoreFn sees a byte mask as a bias (RowScore takes it off; here it is plain).
inline bool plain_scores(const FwdParams& p) {
  return p.softcap <= 0.0 && p.alibi_slopes == nullptr &&
         (p.attn_bias == nullptr || p.bias_is_mask);
}

// The forward's pass, after the main forward wrote p.out and p.softmax_lse, for plain scores
// (plain_scores).  Element: __half or __nv_bfloat16.
template <typename Element>
cudaError_t exact_rows_forward(const FwdParams& p, cudaStream_t stream);

}  // namespace flash_attn_ext::cuda
