// The Hopper forward's compile-time shape (Sm90FwdTraits: tiles, warpgroups, register budgets,
// shared-memory layouts, TMA and wgmma types) and its run-time arguments (Sm90FwdArgs), plus the
// few conventions every role shares: the wgmma accumulator layout (s_index, s_col), a tile row's
// sequence position (row_position) and the named barriers.
#pragma once

#ifndef NDEBUG
#define NDEBUG  // CUTLASS's pipelines otherwise add device-side role checks to every wait
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/sm90/fwd_tile_scheduler.h"
#include "params.h"

namespace flash_attn_ext::sm90 {

using namespace cute;

// CUTLASS's 16-bit types for CUDA's.
template <typename T>
struct CuteType;
template <>
struct CuteType<__half> {
  using type = cutlass::half_t;
};
template <>
struct CuteType<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};

// A (seqlen, head_dim, heads, batch) view of q, k, v or out: element strides, head dim unit-stride.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
// That shape for the TMA tensors of the query rows (q, out, dout: keys = false) or the keys
// (k, v) with `dim` columns and `heads` heads: a batch of seqlen rows each, or for packed
// sequences (kVarlen) the packed tensor's rows as one batch entry (a tile reads at its
// sequence's offsets).
template <bool kVarlen>
__host__ __device__ __forceinline__ GmemShape rows_shape(const FwdParams& p, bool keys,
                                                         int64_t dim, int64_t heads) {
  const int64_t rows = keys ? (kVarlen ? p.total_k : p.seqlen_k)
                            : (kVarlen ? p.total_q : p.seqlen_q);
  return GmemShape(static_cast<int32_t>(rows), static_cast<int32_t>(dim),
                   static_cast<int32_t>(heads), static_cast<int32_t>(kVarlen ? 1 : p.batch));
}

template <typename CudaElement, int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_,
          bool kPackGQA_ = false, bool kGeneral_ = false, bool kDropout_ = false,
          bool kMask_ = false, bool kVarlen_ = false, bool kSoftcap_ = false,
          bool kAlibi_ = false, int kFmaExp2Of8_ = -1>
struct Sm90FwdTraits {
  using Element = typename CuteType<CudaElement>::type;
  // Softcap, an additive bias, ALiBi and dropout on the scores (score_mod.h), its own
  // instantiation, so that plain attention carries none of their code.  (Not with GQA
  // packing: a packed tile's rows belong to different query heads, which the bias tells
  // apart.)
  static constexpr bool kGeneral = kGeneral_;
  static_assert(!(kGeneral_ && kPackGQA_), "the general variant does not pack GQA heads");
  // Dropout alone: the plain kernel with the dropout mask on P, its keep bits drawn while the
  // tile's Q K^T runs (the general variant draws them after it, in the softmax's turn), its
  // own instantiation.
  static constexpr bool kDropout = kDropout_;
  static_assert(!(kDropout_ && (kGeneral_ || kPackGQA_)), "dropout alone, unpacked");
  // Whether the kernel may drop probabilities (it reads the dropout parameters).
  static constexpr bool kMayDrop = kGeneral || kDropout;
  // A boolean mask alone (FwdParams::bias_is_mask): the plain kernel's scores and softmax, the
  // mask read as it is (a byte per score) only in key tiles its block summary calls mixed,
  // fully masked tiles skipped, fully visible ones run as plain attention.  Its own
  // instantiation; unpacked (the mask may differ per query head).
  static constexpr bool kMask = kMask_;
  static_assert(!(kMask_ && (kGeneral_ || kDropout_ || kPackGQA_)), "a mask alone, unpacked");
  // Whether key tiles the bias masks for the whole tile are skipped (bias_blocks.h).
  static constexpr bool kSkipMasked = kGeneral || kMask;
  // Packed sequences (FlashAttention-2's varlen; FwdParams::cu_seqlens_q): tiles come from the
  // host's table (FwdParams::sm90_varlen_tiles), each a query block of one sequence, which
  // carries its offsets and lengths to the consumers (TileInfo's seq); q, k and v are read at
  // the sequence's offsets and O is stored from registers (a TMA store of a whole block would
  // write into the next sequence's rows).  Its own instantiations: plain attention, softcap
  // alone (kSoftcap), ALiBi alone (kAlibi: the sequence's slope row and bottom-right offset,
  // ScoreFn over its lengths) and dropout alone (kDropout: the sequence's dropout row ids,
  // dropout.h).  The scores see the sequence only through those: tile rows and keys count
  // from the sequence's first.
  static constexpr bool kVarlen = kVarlen_;
  static_assert(!(kVarlen_ && (kGeneral_ || kMask_ || kPackGQA_)),
                "packed sequences: plain attention, softcap alone, ALiBi alone or dropout alone");
  // Softcap alone (Gemma-2's logit softcapping): the plain kernel with each score x replaced
  // by t = tanh(x * scale / softcap) (one FMUL and one MUFU) before the mask, and the online
  // softmax's exp2 factor softcap * log2(e) in place of scale * log2(e), so that the
  // exponent stays one FFMA, fma(t, softcap * log2 e, -m).  tanh is increasing: the row max
  // and the masks work on t as on x.  The scores are bounded (|s| <= softcap), so the
  // reference max's rounding never matters.  Its own instantiation; unpacked, as the general
  // variant, whose per-score flag tests and spills it avoids.  With kVarlen too: packed
  // sequences with softcap alone (the scores are per score, blind to the sequence).
  static constexpr bool kSoftcap = kSoftcap_;
  // Of every 8 columns of S a consumer thread holds, how many take their exp2 on the FMA pipe
  // (fwd_softmax.h's exp2_fma) instead of the MUFU unit: the softcap variant at head dim 64,
  // whose two MUFU operations per score (tanh, exp2) bound it (ncu: XU pipe 73% busy, FMA
  // 14%, issue slots 33%; docs/perf/sm90_score_mods.md); 2 of 8 takes the MUFU work per score
  // from 2 to 1.75 for ~2.3 more FMA / ALU instructions (ptxas, bf16: 0 bytes spilled with 2,
  // 20 with 3, 16 with 4 or 8, against 0 before).  kFmaExp2Of8_ >= 0 overrides it
  // (KernelOptions::sm90_fma_exp2, the launcher's A/B instantiations).
  static constexpr int kFmaExp2Of8 =
      kFmaExp2Of8_ >= 0 ? kFmaExp2Of8_ : kSoftcap_ && kHeadDim_ <= 64 ? 2 : 0;
  static_assert(kFmaExp2Of8 >= 0 && kFmaExp2Of8 <= 8, "");
  static_assert(!(kSoftcap_ && (kGeneral_ || kDropout_ || kMask_ || kPackGQA_)),
                "softcap alone (packed sequences or not), GQA unpacked");
  // ALiBi alone (alibi_slopes; FlashAttention-2's definition, score.h): the plain kernel with
  // each score x replaced by x * scale * log2 e - slope * log2 e * |i + off - j| (an FADD for
  // the distance, an FMUL and an FFMA; no MUFU operation) before the mask, and the online
  // softmax's exp2 factor 1.  Its own instantiation, unpacked (the slope is per query head).
  static constexpr bool kAlibi = kAlibi_;
  static_assert(!(kAlibi_ && (kGeneral_ || kDropout_ || kMask_ || kPackGQA_ || kSoftcap_)),
                "ALiBi alone (packed sequences or not), GQA unpacked");
  // ALiBi's term in the Q K^T GEMM (the ALiBi variant at head dim 64, where the softmax's FP32
  // work is as long as a tile's GEMMs and the term's FFMA per score shows: 0.73-0.82x of
  // causal; docs/perf/sm90_score_mods.md).  Under a causal mask (window_right = 0) every
  // visible key j of a tile lies at or left of its rows' diagonal, so the term is slope (j -
  // i - off) = slope (j - j0) + slope (j0 - i - off): a column's part, which one more K step
  // of 16 columns adds to S (QFold's rows [v1, v2, v3, 0, ...], v = slope / scale split into
  // three 16-bit parts, against KFold's rows [jj, jj, jj, 0, ...], jj = j - j0 exact in 16
  // bits), and a part per tile and row, which the softmax adds to its max and exponent
  // (OnlineSoftmax::rows' fold_shift), so that its per-score work is the plain kernel's.  Per
  // tile the kernel takes it or the term per score (fold_alibi in fwd_kernel.h).
  static constexpr bool kAlibiFold = kAlibi_ && kHeadDim_ == 64;
  static constexpr int kFoldCols = 16;  // one wgmma K step
  // GQA packing (see Sm90FwdArgs::group): its own instantiation, so that the kernel without it
  // carries none of its code (in one kernel, its tile-boundary code cost 2-5% at L = 1k).
  static constexpr bool kPackGQA = kPackGQA_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim of q/k and v (64, 128 or 256)
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups
  static constexpr int kBlockM = 64 * kConsumers;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;         // keys per K/V tile
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg budgets (per thread) of the producer and of each consumer warpgroup.  They must
  // fit in what the CTA got at launch, 65536 / kThreads per thread rounded down to a multiple
  // of 8 (168 for 384 threads), or the consumers' increase waits forever.  Head dim 128: 40 for
  // the persistent producer's tile loop (24 spilled ~90 bytes there) and 232 for the consumers
  // (no spill); head dim 256's O accumulator needs 240 (232 spills in the main loop).
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : kHeadDim == 128 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kHeadDim == 128 ? 232 : 240;
  static_assert(kConsumers == 2 || kConsumers == 3, "");
  // The softmax's instruction schedule, which ptxas makes differently per head dim, so chosen
  // per head dim from same-call A/Bs (docs/perf/sm90_forward.md): whether a thread's two rows go
  // through the softmax together or one after the other, in how many independent chains each
  // row's max and sum run, and whether the wait for the previous key tile's P V is pinned after
  // the softmax (else ptxas hoists it before the max, so the softmax no longer overlaps that
  // GEMM).  Against rows one after the other with one chain: head dim 64, together, 4 chains,
  // not pinned: +2% at L = 1k, +1..+12% at 4k, +4..+6% at 16k (pinned: -4% at 1k).  128,
  // together, 4 chains, pinned: +3..+6% at 4k-16k, -1..-3% at 1k without a mask.  256 keeps
  // rows one after the other with one chain (the other schedules measured -1..-6% there).
  static constexpr bool kSoftmaxRowsTogether = kHeadDim <= 128;
  static constexpr int kSoftmaxChains = kHeadDim <= 128 ? 4 : 1;
  static constexpr bool kWaitPvAfterSoftmax = kHeadDim == 128;

  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <=
                    kThreads * (65536 / kThreads / 8 * 8), "");
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows need head dims in multiples of 64");

  // S = Q K^T: M = kBlockM (one 64-row atom per consumer warpgroup), N = kBlockN,
  // K = kHeadDim, operands in smem.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));
  // O += P V: M = kBlockM, N = kHeadDim, K = kBlockN; P from registers, V read "MN-major" (the
  // head dim is V's contiguous axis and the GEMM's N axis).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));

  // Shared tiles: rows of kHeadDim 16-bit elements in 128-byte swizzled atoms (what both TMA and
  // wgmma read without bank conflicts).
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  // Q double-buffered at head dim 64 (not packed): the producer then loads the next tile's Q
  // while this tile's last key tiles run, instead of once every consumer is done with this
  // tile's Q, so the next tile need not wait for it.  Measured +0.9..+1.1% at d=64 L=1k
  // (tiles of 192 rows x 1024 keys; an A/A control read within 0.3%), +0..+0.8% at 2k-4k; at
  // d=128 (which has the shared memory for it) -0.5..-1.5% at 1k-16k, within the noise of
  // single runs (docs/perf/sm90_forward.md).
  static constexpr int kQStages = (!kPackGQA && kHeadDim == 64) ? 2 : 1;
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V seen as (head_dim, keys, stage): the B operand of P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutKV{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  // The epilogue: each consumer warpgroup writes its 64 rows of O to shared memory, kOCols
  // columns at a time, and one of its threads stores them with TMA, so the warpgroup goes on
  // to its next tile while the last copy runs.  At head dim 256 the Q tile and the K/V ring
  // leave room for 128 columns only: two chunks, the second written once TMA has read the first.
  static constexpr int kOCols = kHeadDim < 128 ? kHeadDim : 128;
  using SmemLayoutO = decltype(tile_to_shape(
      SmemAtom{}, Shape<_64, Int<kOCols>, Int<kConsumers>>{}));  // (row, col, warpgroup)
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{},
                                      take<0, 2>(SmemLayoutO{}), Shape<_64, Int<kOCols>>{},
                                      _1{}));

  // The ALiBi fold's operands (kAlibiFold): (query row, 16) and (key, 16), K-major in 32-byte
  // swizzled rows, one copy (KFold is the same for every key tile; QFold per warpgroup's rows).
  using SmemAtomFold = GMMA::Layout_K_SW32_Atom<Element>;
  using SmemLayoutQFold =
      decltype(tile_to_shape(SmemAtomFold{}, Shape<Int<kBlockM>, Int<kFoldCols>>{}));
  using SmemLayoutKFold =
      decltype(tile_to_shape(SmemAtomFold{}, Shape<Int<kBlockN>, Int<kFoldCols>>{}));
  struct FoldStorage {
    array_aligned<Element, cosize_v<SmemLayoutQFold>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutKFold>, 1024> k;
  };

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTileBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTileBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutO>, 1024> o;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Per Q buffer: Q landed (TMA transaction bytes) and its tile announced; every consumer
    // thread is done with that Q and its tile.
    alignas(8) uint64_t barrier_q[kQStages];
    alignas(8) uint64_t barrier_q_empty[kQStages];
    TileInfo<kConsumers, kVarlen> info[2];  // tile i's in info[i % 2] (fwd_tile_scheduler.h)
    std::conditional_t<kAlibiFold, FoldStorage, char> fold;  // (kAlibiFold)
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

template <typename T>
struct Sm90FwdArgs {
  typename T::TmaQ tma_q;
  typename T::TmaKV tma_k;
  typename T::TmaKV tma_v;
  FwdParams p;
  // GQA packing (T::kPackGQA; FlashAttention-3's PackGQA): a tile holds the query rows of all
  // `group` query heads of one KV head, tile row rho = position * group + head in group, so K
  // and V are read once per group instead of once per query head.  Q then comes by cp.async
  // (a TMA box cannot gather such rows with a run-time group) and O through shared memory and
  // row stores.  Tiles are then (query block, batch, KV head).  rows_q: the rows a tile counts
  // over, seqlen_q * group packed, else seqlen_q.
  int32_t group;  // heads_q / heads_kv
  int32_t rows_q;
  int32_t num_m_blocks;
  // Query block m holds rows [m * kBlockM - row_shift, (m + 1) * kBlockM - row_shift): the
  // block that seqlen_q fills only in part is the first (its rows below 0 do not exist) rather
  // than the last.  A multiple of 64 below kBlockM, so every warpgroup's 64 rows lie either all
  // below 0 (it idles) or all at or above; 0 with two consumers (no idle warpgroups there).
  // Under a causal mask the partial block then has the fewest key tiles instead of the most
  // (see the launcher).
  int32_t row_shift;
  int32_t heads_per_section;
  // (tile_coord) pairs / heads_per_section, at least 1; pairs: batch * tile heads, or for
  // packed sequences the tile heads alone (the table's entries take the m-blocks' place)
  int32_t num_sections;
  // num_m_blocks * batch * tile heads (heads_kv where GQA is packed, else heads_q); packed
  // sequences: the table's entries * tile heads
  int32_t num_tiles;
  int32_t* tile_counter;  // zeroed before the launch; CTAs take tiles gridDim.x, +1, ... from it
  // Dynamic schedule: the producer takes each next tile from tile_counter and announces it in
  // shared memory.  Static: CTA c computes tiles c, c + gridDim.x, ... (no counter).  In both
  // the producer announces each tile and, after the last, the end (TileInfo::tile = -1).
  bool dynamic;
  typename T::TmaO tma_o;  // set when tma_store_o
  bool tma_store_o;        // out's address and strides suit TMA (else O from registers)
  // Packed GQA with 16-byte aligned out rows: O goes through shared memory as with TMA, then
  // the threads store whole 16-byte chunks of each row (a TMA box cannot scatter the rows).
  bool o_row_stores;
};

// The sequence position of tile row `row` (>= 0).  (args' fields are read where used, from the
// kernel parameters' constant bank, by every role: copies kept in registers across the main
// loop made it spill.)
template <typename T>
__device__ __forceinline__ int32_t row_position(const Sm90FwdArgs<T>& args, int32_t row) {
  if constexpr (T::kPackGQA) return row / args.group;
  return row;
}

// wgmma's m64nNk16 accumulator: per thread, values (2 columns) x (rows r, r + 8) x (N / 8
// column groups), in that order, which is also the order of the m64nNk16 register A operand
// with K = N (16 columns = two groups per K step).  s_index: the index of value pair column c of
// row half `half` (0: row r, 1: row r + 8); s_col: that value's column relative to the thread's
// first column.  (The same for S and for O.)
__device__ __forceinline__ constexpr int s_index(int half, int c) {
  return (c & 1) + 2 * half + 4 * (c >> 1);
}
__device__ __forceinline__ constexpr int s_col(int c) { return (c & 1) + 8 * (c >> 1); }
// The row and column of value i relative to the thread's first (the inverse of s_index), as
// constants: through CuTe's identity-tensor partition the compiler may not fold the
// difference of two values' coordinates, and keeps them in registers (the Hopper backward's
// ALiBi term spilled 168 bytes at head dim 128 that way).
__device__ __forceinline__ constexpr int acc_row(int i) { return 8 * ((i >> 1) & 1); }
__device__ __forceinline__ constexpr int acc_col(int i) { return (i & 1) + 8 * (i >> 2); }

// Named barriers: 0 .. kConsumers - 1 are the consumers' pingpong ring (fwd_mainloop.h),
// kConsumers + me is consumer warpgroup me's own (the packed Q load's and the epilogue's
// shared-memory handoffs within the warpgroup).
template <typename T>
__device__ __forceinline__ void warpgroup_sync(int me) {
  cutlass::arch::NamedBarrier::sync(128, T::kConsumers + me);
}

}  // namespace flash_attn_ext::sm90
