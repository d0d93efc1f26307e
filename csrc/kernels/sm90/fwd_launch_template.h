// The Hopper forward's host side: TMA descriptors, the epilogue's path, the tile order and
// schedule, then the persistent launch of flash_fwd_sm90_kernel (fwd_kernel.h).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/sm80/launch.h"
#include "kernels/sm90/flash_fwd_sm90_launch.h"
#include "kernels/sm90/fwd_kernel.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/pack_gqa.h"
#include "params.h"

namespace flash_attn_ext::sm90 {

// Host side: TMA descriptors for q, k, v (the caller guarantees 16-byte aligned rows and strides),
// the tile counter zeroed, then min(tiles, SMs) persistent CTAs on `stream`.
template <typename T>
cudaError_t launch_flash_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using Element = typename T::Element;
  // A dimension of size 1 may carry any stride (0 included); TMA wants multiples of 16 bytes.
  auto stride_of = [](int64_t size, int64_t stride) {
    return size <= 1 ? int64_t{8} : stride;
  };
  auto gmem = [&](auto* ptr, int64_t rows, int64_t dim, int64_t heads, int64_t batch,
                  int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    using Ptr = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(ptr)>>,
                                   const Element*, Element*>;
    return make_tensor(make_gmem_ptr(static_cast<Ptr>(ptr)),
                       GmemShape(static_cast<int32_t>(rows), static_cast<int32_t>(dim),
                                 static_cast<int32_t>(heads), static_cast<int32_t>(batch)),
                       GmemStride(stride_of(rows, row_stride), _1{},
                                  stride_of(heads, head_stride), stride_of(batch, batch_stride)));
  };
  // Packed sequences: the packed tensors as one batch of total_q / total_k rows (a tile reads
  // at its sequence's offsets).
  constexpr bool varlen = T::kVarlen;
  const int64_t rows_q_all = varlen ? p.total_q : p.seqlen_q;
  const int64_t rows_k_all = varlen ? p.total_k : p.seqlen_k;
  const int64_t batch = varlen ? 1 : p.batch;
  Sm90FwdArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.q, rows_q_all, p.head_dim, p.heads_q, batch, p.q_row_stride,
                         p.q_head_stride, p.q_batch_stride),
                    take<0, 2>(typename T::SmemLayoutQ{}),
                    Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.k, rows_k_all, p.head_dim, p.heads_kv, batch, p.k_row_stride,
                         p.k_head_stride, p.k_batch_stride),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.v, rows_k_all, p.head_dim_v, p.heads_kv, batch, p.v_row_stride,
                         p.v_head_stride, p.v_batch_stride),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      p, 1, 0, 0, 0, 1, 1, 0, p.tile_counter, p.tile_counter != nullptr, typename T::TmaO{},
      false, false};
  // The rows a tile counts over (Sm90FwdArgs::rows_q), in 32 bits as the keys (kMaxRows,
  // pack_gqa.h; the glue keeps longer calls, and packing without a group, off this kernel).
  // Softcap, an additive bias and ALiBi only in the general variant (softcap alone and ALiBi
  // alone also in their variants), dropout there or in the dropout variant (which needs it), a
  // boolean mask alone only in the mask variant (FwdParams::sm90_variant_is); packed sequences
  // only in the varlen instantiations (plain, softcap alone, ALiBi alone, dropout alone), with
  // a tile table of their query blocks.
  if ((p.cu_seqlens_q != nullptr) != varlen ||
      !p.sm90_variant_is(T::kGeneral, T::kDropout, T::kMask, T::kSoftcap, T::kAlibi))
    return cudaErrorInvalidValue;
  // (no table where no sequence has a query row: nothing to launch, below)
  if (varlen && ((p.sm90_varlen_entries > 0 && p.sm90_varlen_tiles == nullptr) ||
                 p.sm90_varlen_block_m != T::kBlockM || rows_q_all > kMaxRows ||
                 rows_k_all > kMaxRows))
    return cudaErrorInvalidValue;
  const int64_t group = p.heads_q / p.heads_kv;
  args.group = static_cast<int32_t>(group);
  constexpr bool pack = T::kPackGQA;
  // (packed sequences: max_seqlen_q / max_seqlen_k may exceed the tensors; the kernel's row
  // arithmetic is bounded by the totals, checked above)
  const int64_t rows_q = pack ? p.seqlen_q * group
                         : varlen ? std::min(p.seqlen_q, rows_q_all)
                                  : p.seqlen_q;
  if ((pack && group <= 1) || rows_q > kMaxRows || (!varlen && p.seqlen_k > kMaxRows))
    return cudaErrorInvalidValue;
  const int64_t tile_heads = pack ? p.heads_kv : p.heads_q;
  args.rows_q = static_cast<int32_t>(rows_q);
  args.num_m_blocks = static_cast<int32_t>((rows_q + T::kBlockM - 1) / T::kBlockM);
  // TMA needs a 16-byte aligned address and strides (the glue's out always has them).
  auto aligned = [](int64_t size, int64_t stride) {
    return size <= 1 || (stride * static_cast<int64_t>(sizeof(Element))) % 16 == 0;
  };
  // p.sm90_direct_epilogue (KernelOptions, experimental: to compare the two in one build): the
  // threads store O from registers (packed GQA rows too).
  const bool direct = p.sm90_direct_epilogue;
  const bool o_aligned = reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                        aligned(p.seqlen_q, p.out_row_stride) &&
                        aligned(p.heads_q, p.out_head_stride) &&
                        aligned(p.batch, p.out_batch_stride);
  args.tma_store_o = !direct && !pack && !varlen && o_aligned;
  args.o_row_stores = !direct && pack && o_aligned;
  if (args.tma_store_o) {
    args.tma_o = make_tma_copy(SM90_TMA_STORE{},
                               gmem(p.out, p.seqlen_q, p.head_dim_v, p.heads_q, p.batch,
                                    p.out_row_stride, p.out_head_stride, p.out_batch_stride),
                               take<0, 2>(typename T::SmemLayoutO{}),
                               Shape<_64, Int<T::kOCols>>{}, _1{});
  }
  // Under a causal mask (a right window bound and no left one: later rows see more keys) the
  // partial query block goes first (Sm90FwdArgs::row_shift), in whole warpgroups.  With 192-row
  // tiles (head dim 64) and seqlen_q = 1024 the first block then holds rows [-128, 64), one
  // working warpgroup on one key tile, where the last block held rows [960, 1152) on all 8:
  // 27 tile passes per head instead of 32.  Measured (kernel_ab, same call) at d = 64 causal:
  // +9.6% at L = 1k, +3.3% at 2k, +-1% from 4k.  Without a mask both orders do the same work,
  // yet the shift measured -4% at L = 2k (the static schedule's waves), so it stays off there.
  // Only with three consumers: the idle path (for warpgroups without rows) exists only there.
  // p.sm90_row_shift = false (KernelOptions::sm90_row_shift, experimental: to compare the
  // two in one build) keeps the partial block last.
  if (T::kConsumers == 3 && !varlen && p.sm90_row_shift && p.window_left < 0 &&
      p.window_right >= 0) {
    args.row_shift = static_cast<int32_t>(
        (static_cast<int64_t>(args.num_m_blocks) * T::kBlockM - rows_q) / 64 * 64);
  }
  // (packed sequences: the table's query blocks, each for every query head)
  const int64_t num_tiles =
      varlen ? static_cast<int64_t>(p.sm90_varlen_entries) * tile_heads
             : static_cast<int64_t>(args.num_m_blocks) * p.batch * tile_heads;
  if (num_tiles == 0) return cudaSuccess;
  if (num_tiles > 0x7fffffffLL) return cudaErrorInvalidValue;
  args.num_tiles = static_cast<int32_t>(num_tiles);
  const int sms = sm80::multiprocessor_count();
  if (sms <= 0) return cudaErrorInvalidDevice;
  cudaError_t err = cudaSuccess;
  // Tile order (see tile_coord).  Two consumer warpgroups (head dims 128, 256) without a mask:
  // one (batch, head) pair per section, i.e. all query blocks of a head back to back, so the
  // CTAs running at once share few heads' K and V and L2 serves them: measured at d=128 L=2k,
  // DRAM reads 430 -> 201 MB (Q, K, V are 192 MB), L2 hit rate 69 -> 83%, +2-7% at d = 128
  // and 256.  Three (head dim 64, short tiles): sections of pairs whose K and V take ~24 MiB
  // of L2, the concurrent CTAs spread over many heads; one head per section measured 5% slower
  // there at L = 1k-2k (many SMs reading the same K/V lines at once).  Two under a causal mask
  // or window (tiles of unequal length): with one head per section the longest-first order
  // holds only inside each head, and the last heads' longest tiles run on with the other SMs
  // idle.  There sections of the L2 rule's size, at most 8 pairs (the best measured: against
  // one pair, d = 256 causal +4% at L = 1k, +15% at 2k-4k; d = 128 +1% at 1k, +2..+9% at 2k-4k;
  // 24 pairs measured 2-7% below 8; sm90_variants.py, docs/perf/sm90_forward.md; measured under
  // a causal mask only: a window bounded on both sides, whose tiles are nearly equal, follows
  // the rule).
  // p.heads_per_section > 0 (KernelOptions::sm90_section_pairs, experimental: orders compared
  // in one build) overrides it.
  // Packed sequences: sections of heads, the table's entries (each sequence's query blocks
  // together, the heaviest first: the glue's sm90_varlen_tiles) slowest within a section, so
  // that the CTAs running at once take the same few (sequence, head) pairs' K and V, as the
  // dense order's (batch, head) pairs; the same rule for the section's size, over the longest
  // sequence's keys.  (p.sm90_varlen_sections = false, KernelOptions, experimental: one
  // section, the heads fastest over a table ordered by weight alone, the form before.)
  const bool unequal_tiles = p.window_left >= 0 || p.window_right >= 0;
  const int64_t kv_bytes = p.seqlen_k * (p.head_dim + p.head_dim_v) * sizeof(Element);
  const int64_t l2_heads = (int64_t{24} << 20) / std::max<int64_t>(kv_bytes, 1);
  int64_t heads = T::kConsumers == 3 ? l2_heads
                  : unequal_tiles    ? std::min<int64_t>(l2_heads, 8)
                                     : 1;
  if (varlen && !p.sm90_varlen_sections) heads = tile_heads;
  if (p.heads_per_section > 0) heads = p.heads_per_section;
  const int64_t batch_heads = varlen ? tile_heads : p.batch * tile_heads;
  args.heads_per_section = static_cast<int32_t>(std::clamp<int64_t>(heads, 1, batch_heads));
  args.num_sections = static_cast<int32_t>(batch_heads / args.heads_per_section);
  if (args.dynamic) {
    err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t ctas = std::min<int64_t>(num_tiles, p.max_ctas > 0 ? p.max_ctas : sms);
  return sm80::launch(flash_fwd_sm90_kernel<T>, ctas, T::kThreads, T::kSmemBytes, stream, args);
}

// What each instantiation (flash_fwd_sm90_hdim<d>_<dtype>[_packgqa|_general|_dropout|_mask|
// _varlen|_softcap|_alibi|_varlen_softcap|_varlen_alibi|_varlen_dropout].cu) launches: the
// traits of head dim kHeadDim (flash_fwd_sm90_launch.h), with or without GQA packing, plain,
// general (softcap, bias, ALiBi, dropout), dropout alone, a boolean mask alone, packed
// sequences, softcap alone, ALiBi alone, or packed sequences with softcap, ALiBi or dropout
// alone.
template <typename CudaElement, int kHeadDim, bool kPackGQA, bool kGeneral = false,
          bool kDropout = false, bool kMask = false, bool kVarlen = false, bool kSoftcap = false,
          bool kAlibi = false>
cudaError_t launch_flash_fwd_sm90_hdim(const FwdParams& p, cudaStream_t stream) {
  using T = Sm90FwdTraits<CudaElement, kHeadDim, fwd_block_n<kHeadDim>(),
                          fwd_stages<kHeadDim>(), fwd_consumers<kHeadDim, kGeneral || kDropout>(),
                          kPackGQA, kGeneral, kDropout, kMask, kVarlen, kSoftcap, kAlibi>;
  static_assert(!kVarlen || T::kBlockM == fwd_block_m<kHeadDim, kGeneral || kDropout>(),
                "the glue's tile table");
  // (The A/B instantiations below change the tiles of dense calls only: packed sequences keep
  // the table's query blocks and compile one kernel, but for the softcap exp2 split's guard.)
  if constexpr ((kSoftcap || kAlibi) && kHeadDim <= 64 && !kVarlen) {
    // The A/B instantiation of the softcap and ALiBi variants at head dim 64 with 96-key
    // tiles and the same warpgroups (KernelOptions::sm90_narrow_tiles, experimental): their
    // default before 128 measured faster despite its spills (flash_fwd_sm90_launch.h).
    if (p.sm90_narrow_tiles) {
      using U = Sm90FwdTraits<CudaElement, kHeadDim, fwd_block_n<kHeadDim, true>(), T::kStages,
                              T::kConsumers, kPackGQA, kGeneral, kDropout, kMask, kVarlen,
                              kSoftcap, kAlibi>;
      return launch_flash_fwd_sm90<U>(p, stream);
    }
  }
  if constexpr (kSoftcap && kHeadDim <= 64) {
    // The A/B instantiations of the softcap variant's exp2 split (KernelOptions::sm90_fma_exp2,
    // experimental; -1 is T's default).
    auto with = [&](auto of8) {
      using U = Sm90FwdTraits<CudaElement, kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                              kPackGQA, kGeneral, kDropout, kMask, kVarlen, kSoftcap, kAlibi,
                              decltype(of8)::value>;
      return launch_flash_fwd_sm90<U>(p, stream);
    };
    // exp2_fma takes exponents below 127.5: with the running max they stay below ~8.5 while
    // softcap * log2 e <= 2^24 (fwd_softmax.h); a larger softcap takes the MUFU's exp2 only.
    if (p.sm90_fma_exp2 == 0 || p.softcap * sm80::ScoreFn::kLog2e > 16777216.0)
      return with(std::integral_constant<int, 0>{});
    if (p.sm90_fma_exp2 == 4) return with(std::integral_constant<int, 4>{});
  }
  if constexpr ((kAlibi || kDropout) && kHeadDim <= 64 && !kVarlen) {
    // The A/B instantiation of the ALiBi and dropout variants at head dim 64 with the other
    // warpgroup count (KernelOptions::sm90_per_score_consumers, experimental; 0: T's), 128-key
    // tiles either way: two consumer warpgroups (ALiBi's other shape; dropout's default) or
    // three (dropout's other shape, ptxas: 164 bytes spilled, against 12 with 96-key tiles,
    // which measured 6-8% slower than two on the H100; ALiBi's default).
    constexpr int other = T::kConsumers == 3 ? 2 : 3;
    if (p.sm90_per_score_consumers == other) {
      using U = Sm90FwdTraits<CudaElement, kHeadDim, T::kBlockN, T::kStages, other, kPackGQA,
                              kGeneral, kDropout, kMask, kVarlen, kSoftcap, kAlibi>;
      return launch_flash_fwd_sm90<U>(p, stream);
    }
  }
  return launch_flash_fwd_sm90<T>(p, stream);
}

}  // namespace flash_attn_ext::sm90
