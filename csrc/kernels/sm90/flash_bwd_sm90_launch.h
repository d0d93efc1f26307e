// The Hopper backward instantiations: one translation unit each (flash_bwd_sm90_hdim*_*.cu),
// compiled where the Hopper forward is (FLASH_ATTN_EXT_SM90).  Head dims are padded up to 64,
// 128 or 256 (256: plain, packed sequences, a boolean mask alone, dropout alone, softcap alone
// and ALiBi alone; kernel_select.h sends the rest to the portable backward).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm90 {

// Keys per CTA of the instantiation for padded head dim `head_dim` (Sm90BwdTraits::kBlockN: 64
// where the step is split by role): the key-block table of packed sequences is built with it.
constexpr int bwd_sm90_block_n(int64_t head_dim) { return head_dim > 128 ? 64 : 128; }

// Rows per (batch, head) of the statistics scratch: seqlen_q rounded up to whole 128-row blocks
// (the largest query block of a step).
constexpr int64_t bwd_sm90_stats_pitch(int64_t seqlen_q) { return (seqlen_q + 127) / 128 * 128; }
// Floats of the scratch the launcher takes (`stats`): lse * log2(e) and D.
constexpr int64_t bwd_sm90_stats_floats(int64_t batch, int64_t heads_q, int64_t seqlen_q) {
  return 2 * batch * heads_q * bwd_sm90_stats_pitch(seqlen_q);
}

// dq, dk, dv of plain attention (no softcap, bias or dropout) into BwdParams' gradients;
// p.dq_accum: dq_accum_floats(...) of fp32 scratch (laid out as bwd_dq.h says), `stats`:
// bwd_sm90_stats_floats(...).  Defined in flash_bwd_sm90_hdim<kHeadDim>_<dtype>.cu for
// Element = __half / __nv_bfloat16.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for softcap, an additive bias (p.attn_bias, fp32; not its gradient), ALiBi and
// dropout, defined in flash_bwd_sm90_hdim<kHeadDim>_<dtype>_general.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_general(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for dropout alone (p.dropout; no softcap, bias or ALiBi), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_dropout.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_dropout(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for a boolean mask alone (p.bias_is_mask; no softcap, ALiBi or dropout), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_mask.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_mask(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for softcap alone (p.softcap_only()), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_softcap.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_softcap(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for ALiBi alone (p.alibi_only()), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_alibi.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_alibi(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for packed sequences (p.cu_seqlens_q, plain attention, dQ in any order) with the
// key-block table (p.sm90_varlen_tiles) and padded rows (p.sm90_varlen_rows) the glue builds;
// p.dq_accum of heads_q * sm90_varlen_padded_q * kHeadDim floats, `stats` of 2 * heads_q *
// sm90_varlen_padded_q.  Defined in flash_bwd_sm90_hdim<kHeadDim>_<dtype>_varlen.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_varlen(const BwdParams& p, float* stats, cudaStream_t stream);

// The same for packed sequences with softcap alone (p.cu_seqlens_q and p.softcap_only(): the
// varlen table and rows above, the softcap variant's step), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_varlen_softcap.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_varlen_softcap(const BwdParams& p, float* stats,
                                              cudaStream_t stream);

// The same for packed sequences with ALiBi alone (p.cu_seqlens_q and p.alibi_only(): the ALiBi
// variant's step with each sequence's slope row and offset), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_varlen_alibi.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_varlen_alibi(const BwdParams& p, float* stats,
                                            cudaStream_t stream);

// The same for packed sequences with dropout alone (p.cu_seqlens_q and p.dropout, no softcap or
// ALiBi: the dropout variant's step with each sequence's row ids), defined in
// flash_bwd_sm90_hdim<kHeadDim>_<dtype>_varlen_dropout.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd_sm90_varlen_dropout(const BwdParams& p, float* stats,
                                              cudaStream_t stream);

}  // namespace flash_attn_ext::sm90
