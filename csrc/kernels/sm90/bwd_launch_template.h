// The Hopper backward's host side: the statistics pass (D, lse * log2(e), the dQ buffer zeroed:
// the portable backward's delta kernel with padded rows), TMA descriptors, one CTA per (key
// block, batch, KV head) of flash_bwd_sm90_kernel (bwd_kernel.h), then the dQ buffer converted
// to dq (bwd_dq.h).  With p.dq_semaphore (zeroed by the caller) dQ is added in a fixed order.
// Packed sequences (T::kVarlen): one CTA per (entry of the key-block table, KV head), the
// scratch in the sequences' padded rows (BwdParams::sm90_varlen_rows).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/sm80/flash_bwd_kernel.cuh"
#include "kernels/sm80/launch.h"
#include "kernels/sm90/bwd_dq.h"
#include "kernels/sm90/bwd_kernel.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/flash_bwd_sm90_launch.h"
#include "kernels/sm90/pack_gqa.h"  // kMaxRows
#include "params.h"

namespace flash_attn_ext::sm90 {

template <typename T>
cudaError_t launch_flash_bwd_sm90(const BwdParams& p, float* stats, cudaStream_t stream) {
  using Element = typename T::Element;
  using CudaElement =
      std::conditional_t<std::is_same_v<Element, cutlass::half_t>, __half, __nv_bfloat16>;
  constexpr int kD = T::kHeadDim;
  constexpr bool varlen = T::kVarlen;
  static_assert(bwd_sm90_block_n(kD) == T::kBlockN,
                "bwd_sm90_block_n (the key-block table's block) must be the traits' kBlockN");
  // The dropout variant at head dim 64, dense calls: 64-row steps in place of 128 (an
  // instantiation of its own, in the same translation unit), unless BwdParams::
  // sm90_bwd_short_steps is cleared (KernelOptions, experimental: the 128-row form for A/Bs).
  // Measured on an H100 at L = 4k / 8k, causal, dropout 0.1: the backward kernel 7-9% shorter;
  // the same form lost 7-16% in the plain, mask, softcap and ALiBi variants, which keep 128
  // rows (docs/perf/sm90_score_mods.md).
  if constexpr (T::kDropout && kD == 64 && !varlen && !T::kShortSteps) {
    if (p.sm90_bwd_short_steps)
      return launch_flash_bwd_sm90<
          Sm90BwdTraits<CudaElement, kD, /*kGeneral=*/false, /*kDropout=*/true, /*kMask=*/false,
                        /*kVarlen=*/false, /*kSoftcap=*/false, /*kAlibi=*/false,
                        /*kShortSteps=*/true>>(p, stats, stream);
  }
  // Rows of the tensors (packed sequences: one batch entry of all rows) and of the per-row
  // scratch per (batch, query head).
  const int64_t rows_q = varlen ? p.total_q : p.seqlen_q;
  const int64_t rows_k = varlen ? p.total_k : p.seqlen_k;
  const int64_t batch = varlen ? 1 : p.batch;
  const int64_t pitch = varlen ? p.sm90_varlen_padded_q : bwd_sm90_stats_pitch(p.seqlen_q);
  if (p.dq_accum == nullptr || rows_q > kMaxRows || rows_k > kMaxRows || pitch > kMaxRows)
    return cudaErrorInvalidValue;
  // The bias's gradient is not in these kernels; softcap, a bias and ALiBi only in the general
  // variant (softcap alone and ALiBi alone also in their variants), dropout there or in the
  // dropout variant (which needs it).  Packed sequences only in the varlen instantiations
  // (plain, softcap alone, ALiBi alone, dropout alone), with their tables (for dQ in a fixed
  // order, each sequence's key blocks the highest first: sm90_bwd_varlen_tables).
  if (p.dbias_full != nullptr || (p.cu_seqlens_q != nullptr) != varlen ||
      !p.sm90_variant_is(T::kGeneral, T::kDropout, T::kMask, T::kSoftcap, T::kAlibi))
    return cudaErrorInvalidValue;
  if (varlen && ((p.sm90_varlen_entries > 0 && p.sm90_varlen_tiles == nullptr) ||
                 p.sm90_varlen_block_m != T::kBlockN ||
                 (pitch > 0 && p.sm90_varlen_rows == nullptr) || pitch % 128 != 0))
    return cudaErrorInvalidValue;
  float* lse_log2 = stats;
  float* delta = stats + batch * p.heads_q * pitch;
  cudaError_t err = sm80::launch_bwd_delta<CudaElement, kD>(
      p, delta, p.dq_accum, batch * p.heads_q * pitch * kD, stream, pitch, lse_log2,
      varlen ? p.sm90_varlen_rows : nullptr);
  if (err != cudaSuccess) return err;

  auto stride_of = [](int64_t size, int64_t stride) {
    return size <= 1 ? int64_t{8} : stride;
  };
  auto gmem = [&](const void* ptr, int64_t rows, int64_t dim, int64_t heads, int64_t batches,
                  int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       GmemShape(static_cast<int32_t>(rows), static_cast<int32_t>(dim),
                                 static_cast<int32_t>(heads), static_cast<int32_t>(batches)),
                       GmemStride(stride_of(rows, row_stride), _1{},
                                  stride_of(heads, head_stride), stride_of(batches, batch_stride)));
  };
  using TileQ = Shape<Int<T::kBlockM>, Int<kD>>;
  using TileK = Shape<Int<T::kBlockN>, Int<kD>>;
  const int64_t num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  // dQ in a fixed order (deterministic=True): rotated where every key block reaches every query
  // block and a (batch, KV head)'s CTAs can all be resident at once (one CTA per SM: a CTA may
  // wait for any other of its group; this assumes the GPU's SMs free for this kernel, not
  // taken by a concurrent one or an SM-limited context), else descending (a CTA waits only for
  // CTAs launched before it).  Descending where every key block starts at query block 0 (no
  // mask beyond 16.9k keys, a window open to the right) puts each key block a writer step
  // behind the next higher one at the start: not measured.  Packed sequences: descending
  // within each sequence (the table puts each sequence's higher key blocks first).
  // (packed sequences: the padded rows, whole blocks)
  const int64_t num_m_blocks = (varlen ? pitch : p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  int32_t dq_order = kDqAnyOrder;
  if (p.dq_semaphore != nullptr)
    dq_order = !varlen && p.window_left < 0 && p.window_right < 0 &&
                       num_n_blocks <= sm80::multiprocessor_count() &&
                       num_m_blocks * (num_n_blocks + 1) < 0x7fffffffLL
                   ? kDqRotated
                   : kDqDescending;
  // Unequal CTAs (a causal mask or a window) with dQ in any order: sections of (batch, KV head)
  // pairs whose Q, dO (the group's query heads) and fp32 dQ buffer take about 40 MiB of L2
  // (FlashAttention-3's figure for its sections), the key block slowest within each
  // (bwd_kernel.h).  p.heads_per_section > 0 (KernelOptions::sm90_section_pairs, experimental)
  // overrides the size; 1 is the key block fastest over the whole launch.
  int32_t section_pairs = 0;
  if (!varlen && dq_order == kDqAnyOrder && (p.window_left >= 0 || p.window_right >= 0)) {
    const int64_t pairs = p.batch * p.heads_kv;
    const int64_t pair_bytes =
        (p.heads_q / p.heads_kv) *
        (p.seqlen_q * (p.head_dim + p.head_dim_v) * static_cast<int64_t>(sizeof(Element)) +
         pitch * kD * static_cast<int64_t>(sizeof(float)));
    const int64_t fit = (int64_t{40} << 20) / (pair_bytes > 0 ? pair_bytes : 1);
    const int64_t want = p.heads_per_section > 0 ? p.heads_per_section : fit;
    section_pairs = static_cast<int32_t>(std::clamp<int64_t>(want, 1, pairs));
  }
  Sm90BwdArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.q, rows_q, p.head_dim, p.heads_q, batch, p.q_row_stride,
                         p.q_head_stride, p.q_batch_stride),
                    take<0, 2>(typename T::SmemLayoutQ{}), TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.dout, rows_q, p.head_dim_v, p.heads_q, batch, p.dout_row_stride,
                         p.dout_head_stride, p.dout_batch_stride),
                    take<0, 2>(typename T::SmemLayoutQ{}), TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.k, rows_k, p.head_dim, p.heads_kv, batch, p.k_row_stride,
                         p.k_head_stride, p.k_batch_stride),
                    typename T::SmemLayoutK{}, TileK{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.v, rows_k, p.head_dim_v, p.heads_kv, batch, p.v_row_stride,
                         p.v_head_stride, p.v_batch_stride),
                    typename T::SmemLayoutK{}, TileK{}, _1{}),
      p,
      lse_log2,
      delta,
      static_cast<int32_t>(pitch),
      static_cast<int32_t>(num_n_blocks),
      static_cast<int32_t>(p.heads_q / p.heads_kv),
      dq_order,
      section_pairs};
  const int64_t ctas = varlen ? int64_t{p.sm90_varlen_entries} * p.heads_kv
                              : num_n_blocks * p.batch * p.heads_kv;
  if (ctas > 0x7fffffffLL) return cudaErrorInvalidValue;
  if (ctas > 0) {
    err = sm80::launch(flash_bwd_sm90_kernel<T>, ctas, T::kThreads, T::kSmemBytes, stream, args);
    if (err != cudaSuccess) return err;
  }
  return sm80::launch(flash_bwd_sm90_convert_dq_kernel<T>, num_m_blocks * batch * p.heads_q,
                      128 * T::kConsumers, 0, stream, p, static_cast<int32_t>(num_m_blocks));
}

}  // namespace flash_attn_ext::sm90
