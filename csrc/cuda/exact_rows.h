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
// With a floating attn_bias (the only way a finite huge LSE arises outside absurd
// softmax_scales; a boolean mask is -inf where it hides), the glue runs:
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
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::cuda {

// |lse * log2(e)| from which a row takes the exact pass: below it the LSE's rounding (at most
// 2^-11 in the exponent) scales P by at most 1 +- 3.4e-4, under a 16-bit output's rounding.
constexpr float kExactRowsLse2 = 8192.f;

// Step 1 for the (batch, heads_q, seqlen_q) rows of p.softmax_lse: lse_hidden (same layout)
// gets -inf at flagged rows and lse elsewhere, flags 1 / 0 per row, and *any 1 if some row is
// flagged (the caller zeroes it first).
cudaError_t exact_rows_flag(const BwdParams& p, float* lse_hidden, uint8_t* flags, int32_t* any,
                            cudaStream_t stream);

// Step 3, after the main backward wrote dq, dk, dv (and p.dbias_full): p.softmax_lse the
// forward's LSE again; row_stats: 3 floats per row of scratch.  Element: __half or
// __nv_bfloat16, the dtype of q, k, v and the gradients.
template <typename Element>
cudaError_t exact_rows_backward(const BwdParams& p, const uint8_t* flags, const int32_t* any,
                                float* row_stats, cudaStream_t stream);

}  // namespace flash_attn_ext::cuda
