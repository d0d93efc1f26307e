// The Hopper forward instantiations: one translation unit each (flash_fwd_sm90_hdim*_*.cu),
// compiled only where the build targets sm_90a and finds the CUTLASS headers
// (FLASH_ATTN_EXT_SM90 is defined then).  Head dims are padded up to 64, 128 or 256.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flash_attn_ext::sm90 {

// Keys per K/V tile and pipeline stages, chosen so that S (64 x kBlockN per consumer warpgroup)
// and O (64 x head dim) stay in registers and the Q tile plus the K/V ring fit in shared memory.
// kNarrow: 96-key tiles at head dim 64, for the per-score variants' A/B shapes (three consumer
// warpgroups: ptxas spills nothing with 96 keys; with 128 the softcap variant 444 bytes, ALiBi
// 84).  The softcap and ALiBi variants take 128 all the same: on the H100 (causal ALiBi and
// softcap 30, L = 8k) their forward kernels took 8% and 9-10% less time with 128 keys than with
// 96 (1,156-1,162 against 1,259-1,261 us; 2,593-2,636 against 2,887-2,914; the per-tile work,
// a third more tiles with 96, costs more than the spills; docs/perf/sm90_score_mods.md).
template <int kHeadDim, bool kNarrow = false>
constexpr int fwd_block_n() {
  return kHeadDim <= 64 && kNarrow ? 96 : kHeadDim <= 128 ? 128 : 64;
}
template <int kHeadDim>
constexpr int fwd_stages() {
  return 2;
}

// Consumer warpgroups of 64 query rows: three at head dim 64 (FlashAttention-3's 192-row tiles;
// there the exp2s of a tile take about as long as its two GEMMs), two above (the O accumulator
// needs the registers), and two for the general and dropout variants (kPerScoreWork) at 64 too:
// with three (160 registers per consumer thread) the general variant's score code spilled 1,616
// bytes, and the dropout variant measured 3.6% faster with two (H200, bf16, causal, L = 4k:
// 244.6 against 236.0 TFLOP/s; H100, with 96-key tiles: 6-8% faster with two).  The softcap
// and ALiBi variants take three at 64: with two softcap waited on its MUFU
// work (tanh and exp2 per score) at 58-65% of that unit's floor, the issue slots half idle, and
// ALiBi, whose extra work is FP32 issue, measured 10-21% slower forward (H100, causal, L = 4k
// and 8k, both with 96-key tiles then; docs/perf/sm90_score_mods.md).
template <int kHeadDim, bool kPerScoreWork = false>
constexpr int fwd_consumers() {
  return kHeadDim <= 64 && !kPerScoreWork ? 3 : 2;
}

// Query rows per tile (64 per consumer warpgroup): the packed-sequence tile table's block size
// (FwdParams::sm90_varlen_block_m), per_score_work for the dropout variant's (kPerScoreWork).
template <int kHeadDim, bool kPerScoreWork = false>
constexpr int fwd_block_m() {
  return 64 * fwd_consumers<kHeadDim, kPerScoreWork>();
}
inline int fwd_block_m_of(int64_t head_dim, bool per_score_work) {
  if (per_score_work)
    return head_dim <= 64 ? fwd_block_m<64, true>() : head_dim <= 128 ? fwd_block_m<128, true>()
                                                                      : fwd_block_m<256, true>();
  return head_dim <= 64 ? fwd_block_m<64>() : head_dim <= 128 ? fwd_block_m<128>()
                                                              : fwd_block_m<256>();
}

// Defined in flash_fwd_sm90_hdim<kHeadDim>_<dtype>.cu for Element = __half / __nv_bfloat16.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FwdParams& p, cudaStream_t stream);

// The same with the query heads of each GQA group packed into shared tiles (pack_gqa.h says
// when; heads_q > heads_kv and seqlen_q * group < 2^31 or cudaErrorInvalidValue), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_packgqa.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_packgqa(const FwdParams& p, cudaStream_t stream);

// The general variant: softcap, an additive bias (p.attn_bias, fp32), ALiBi and dropout, no GQA
// packing (cudaErrorInvalidValue); defined in flash_fwd_sm90_hdim<kHeadDim>_<dtype>_general.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_general(const FwdParams& p, cudaStream_t stream);

// Dropout alone (p.dropout; no softcap, bias or ALiBi; no GQA packing), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_dropout.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_dropout(const FwdParams& p, cudaStream_t stream);

// A boolean mask alone (p.bias_is_mask; no softcap, ALiBi or dropout; no GQA packing), defined
// in flash_fwd_sm90_hdim<kHeadDim>_<dtype>_mask.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_mask(const FwdParams& p, cudaStream_t stream);

// Softcap alone (p.softcap_only(); no GQA packing), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_softcap.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_softcap(const FwdParams& p, cudaStream_t stream);

// ALiBi alone (p.alibi_only(); no GQA packing), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_alibi.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_alibi(const FwdParams& p, cudaStream_t stream);

// Packed sequences (p.cu_seqlens_q, p.sm90_varlen_tiles of fwd_block_m<kHeadDim>() rows;
// plain attention: causal and windows per sequence, GQA unpacked), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_varlen.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_varlen(const FwdParams& p, cudaStream_t stream);

// Packed sequences with softcap alone (p.cu_seqlens_q and p.softcap_only(): the varlen tiles
// above, the softcap variant's scores), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_varlen_softcap.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_varlen_softcap(const FwdParams& p, cudaStream_t stream);

// Packed sequences with ALiBi alone (p.cu_seqlens_q and p.alibi_only(): the varlen tiles above,
// the ALiBi variant's scores with each sequence's slope row and offset), defined in
// flash_fwd_sm90_hdim<kHeadDim>_<dtype>_varlen_alibi.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_varlen_alibi(const FwdParams& p, cudaStream_t stream);

// Packed sequences with dropout alone (p.cu_seqlens_q and p.dropout, no softcap or ALiBi: the
// varlen tiles above, of fwd_block_m<kHeadDim, true>() rows, the dropout variant's mask with
// each sequence's row ids), defined in flash_fwd_sm90_hdim<kHeadDim>_<dtype>_varlen_dropout.cu.
template <typename Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90_varlen_dropout(const FwdParams& p, cudaStream_t stream);

}  // namespace flash_attn_ext::sm90
