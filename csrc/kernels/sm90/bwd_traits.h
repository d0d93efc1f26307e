// The Hopper backward's compile-time shape (Sm90BwdTraits: tiles, warpgroups, register budgets,
// shared-memory layouts, TMA and wgmma types) and its run-time arguments (Sm90BwdArgs).
//
// One CTA per (block of kBlockN = 128 keys, batch, KV head; 64 at head dim 256, below): K and V of
// the block stay in shared memory, Q and dO tiles of kBlockM = 64 query rows (with their
// log-sum-exps and D = rowsum(dO * O)) stream through a ring, one step per (query head of the GQA
// group, query block).  Two consumer warpgroups own 64 keys each and compute, per step, the
// transposed products (FlashAttention-3's "swapped" S and dP, arXiv:2407.08608 section 3.3):
//   S^T = K Q^T and dP^T = V dO^T          SS wgmma, M = 64 keys, N = 64 queries, K = head dim
//   P^T = exp2(S^T scale log2e - lse log2e),  dS^T = P^T (dP^T - D) scale   (registers)
//   dV += P^T dO and dK += dS^T Q          RS wgmma: P^T and dS^T stay in registers as the A
//                                          operand (the accumulator layout of S^T is the A
//                                          layout with K = queries); dO and Q read MN-major
//   dQ = dS K                              SS wgmma over both warpgroups' dS^T (through shared
//                                          memory), split over rows or head-dim halves between
//                                          them, added to an fp32 buffer by bulk reductions
//                                          (bwd_dq.h)
// dK and dV stay in registers across all steps and are stored once.
#pragma once

#include <type_traits>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_attn_ext::sm90 {

template <typename CudaElement, int kHeadDim_, bool kGeneral_ = false, bool kDropout_ = false,
          bool kMask_ = false, bool kVarlen_ = false, bool kSoftcap_ = false,
          bool kAlibi_ = false, bool kShortSteps_ = false>
struct Sm90BwdTraits {
  using Element = typename CuteType<CudaElement>::type;
  // Softcap, an additive bias, ALiBi and dropout on the scores (the forward's general variant;
  // its own instantiation, so that plain attention carries none of its code).
  static constexpr bool kGeneral = kGeneral_;
  // Dropout alone: the plain kernel's step (P^T from S^T alone, dV issued before dS^T is
  // computed) with the forward's dropout mask, its own instantiation.  (The general variant
  // waits for both score GEMMs before computing P^T, which the score's derivative needs.)
  static constexpr bool kDropout = kDropout_;
  static_assert(!(kGeneral && kDropout), "the general variant takes dropout itself");
  // Whether the kernel may drop probabilities (it reads the dropout parameters).
  static constexpr bool kMayDrop = kGeneral || kDropout;
  // A boolean mask alone (BwdParams::bias_is_mask): the plain kernel's step, P^T = 0 where the
  // mask hides a key, the mask read (a byte per score) only in steps whose block summary is
  // mixed; steps it masks for the whole key block skipped.  Its own instantiation.
  static constexpr bool kMask = kMask_;
  static_assert(!(kMask && (kGeneral || kDropout)), "a mask alone");
  // Whether steps the bias masks for the whole key block are skipped (bias_blocks.h).
  static constexpr bool kSkipMasked = kGeneral || kMask;
  // Packed sequences (FlashAttention-2's varlen; BwdParams::cu_seqlens_q), plain attention:
  // each CTA takes one entry of the host's key-block table (FwdParams::sm90_varlen_tiles) and
  // one KV head, loads over the packed tensors at its sequence's offsets, and keeps its
  // statistics and dQ in the sequence's padded rows (BwdParams::sm90_varlen_rows).  dQ in any
  // order, or in a fixed one (deterministic: each sequence's key blocks the highest first, the
  // table ordered so).  Its own instantiations: plain attention, softcap alone (kSoftcap,
  // whose step is blind to the sequence), ALiBi alone (kAlibi: the sequence's slope row and
  // bottom-right offset) and dropout alone (kDropout: the sequence's dropout row ids); steps
  // count rows and keys from the sequence's first, as the forward's tiles.
  static constexpr bool kVarlen = kVarlen_;
  static_assert(!(kVarlen && (kGeneral || kMask)),
                "packed sequences: plain attention, softcap alone, ALiBi alone or dropout alone");
  // Softcap alone (the forward's softcap variant): the plain kernel's step (P^T from S^T
  // alone, dV issued before dS^T is computed) on t = tanh(x * scale / softcap), P^T =
  // exp2(t * softcap * log2 e - lse log2 e), with the score's derivative folded into P^T
  // before dP^T arrives: S^T's registers keep P^T (1 - t^2), from which dS^T = P^T (1 - t^2)
  // (dP^T - D) scale, and dV takes P^T in 16 bits as in the plain step.  (The general variant
  // waits for both GEMMs to have t next to dP^T, and issues dV after dS^T.)  Its own
  // instantiation.
  static constexpr bool kSoftcap = kSoftcap_;
  static_assert(!(kSoftcap && (kGeneral || kDropout || kMask)),
                "softcap alone (packed sequences or not)");
  // ALiBi alone: the plain step, ALiBi's term in P^T's exponent (an FADD for the distance and
  // an FFMA: exp2(S^T scale log2 e - slope log2 e |i + off - j| - lse log2 e)); its derivative
  // with respect to S^T is the plain one.  Its own instantiation.
  static constexpr bool kAlibi = kAlibi_;
  static_assert(!(kAlibi && (kGeneral || kDropout || kMask || kSoftcap)),
                "ALiBi alone (packed sequences or not)");
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim of q/k and v (64, 128, 256)
  // Head dim 256 splits the step by role, not by keys: 64 keys per CTA, both warpgroups on
  // the same keys; warpgroup 0 computes S^T and P^T and accumulates dV, warpgroup 1 computes
  // dP^T and dS^T (P^T handed over through shared memory, fp32) and accumulates dK, and both
  // compute dQ over head-dim halves.  Splitting by keys would need dK and dV of 64 keys over
  // the whole head dim in each warpgroup: 2 x 64 x 256 / 128 = 256 accumulator registers per
  // thread; by role each holds one of them (128).  dQ is added by the consumers themselves
  // (red.global.add.v4.f32): the writer's staging tile (64 KiB) does not fit beside K, V and
  // the Q / dO ring (bwd_mainloop_split.h).
  // Plain attention (packed sequences too), a boolean mask alone, dropout alone, softcap alone
  // and ALiBi alone (their factors in warpgroup 0's P^T).
  static constexpr bool kRoleSplit = kHeadDim == 256;
  static_assert(!(kRoleSplit && kGeneral),
                "head dim 256: plain attention, packed sequences, a boolean mask alone, dropout "
                "alone, softcap alone or ALiBi alone");
  static constexpr int kBlockN = kRoleSplit ? 64 : 128;  // keys per CTA (64 per warpgroup)
  // Query rows per step: 128 at head dim 64 (twice the GEMM work per barrier and statistics
  // load; the S^T / dP^T accumulators, 2 x 64 floats, fit beside dK / dV's 2 x 32), 64 at 128
  // (FlashAttention-3's tiles) and 256.
  // kShortSteps: 64-row steps at head dim 64 too (the dropout variant's, dense calls; the
  // 128-row form stays for A/Bs: KernelOptions::sm90_bwd_short_steps): half the S^T / dP^T
  // accumulators and keep bits live while the Philox rounds run (ptxas: 44 bytes spilled
  // against 300 with 128 rows), against twice the barriers and statistics loads per row.
  // Measured: 7-9% shorter with dropout; the plain, mask, softcap and ALiBi steps, whose
  // spills are smaller (44 against 64-260 bytes), 7-16% longer with it.
  static constexpr bool kShortSteps = kShortSteps_;
  static_assert(!kShortSteps || kHeadDim == 64, "64-row steps are the default above 64");
  static constexpr int kBlockM = kHeadDim == 64 && !kShortSteps ? 128 : 64;
  static constexpr int kStages = 2;           // depth of the Q / dO / statistics ring
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg: producer + 2 consumers within 65536 / 384 = 168 per thread (see the forward's
  // traits).  A consumer holds dK and dV (2 x kHeadDim / 2 floats), S^T and dP^T (2 x 32) and
  // the dQ tile (kHeadDim / 4); with the role split one of dK / dV (128), S^T or dP^T (32) and
  // the dQ tile (64).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <=
                    kThreads * (65536 / kThreads / 8 * 8), "");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "the Hopper backward has head dims 64, 128 and 256");
  static_assert(kBlockM == 64 || kBlockM == 128, "");
  // The warpgroups over which one S^T / dP^T and one dK / dV GEMM is tiled: both (64 keys
  // each), or one (the role split: each warpgroup's GEMM its own).
  static constexpr int kKeyWarpgroups = kRoleSplit ? 1 : kConsumers;
  static_assert(kBlockN == 64 * kKeyWarpgroups, "");

  // S^T = K Q^T, dP^T = V dO^T: M = kBlockN keys (64 per warpgroup; the role split's two GEMMs
  // each in one warpgroup), N = kBlockM, K = head dim.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kKeyWarpgroups>, _1, _1>>{}));
  // dV += P^T dO, dK += dS^T Q: M = kBlockN keys, N = head dim, K = kBlockM; A from registers,
  // B read MN-major (the head dim is dO's and Q's contiguous axis).
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kKeyWarpgroups>, _1, _1>>{}));
  // dQ = dS K: M = kBlockM, N = head dim, K = kBlockN, split over the warpgroups by query rows
  // where there are 128 of them, else by head-dim halves; dS read MN-major (the queries are its
  // contiguous axis: see SmemLayoutdS), K MN-major.
  static constexpr bool kDqSplitRows = kBlockM == 64 * kConsumers;
  using DqAtomShape = std::conditional_t<kDqSplitRows, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                                         Shape<_64, Int<kHeadDim / kConsumers>, Int<kBlockN>>>;
  using DqWarpgroups = std::conditional_t<kDqSplitRows, Layout<Shape<Int<kConsumers>, _1, _1>>,
                                          Layout<Shape<_1, Int<kConsumers>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, DqAtomShape, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      DqWarpgroups{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // also dO
  // K (also V): the dQ GEMM reads K MN-major in slices of kHeadDim / kConsumers columns where
  // dQ is split over head-dim halves; a 128-byte swizzle atom spans 64 columns, so 32-column
  // halves (head dim 64 with 64-row steps) take the 64-byte atom, whose 32 columns they are.
  static constexpr int kDqCols = kDqSplitRows ? kHeadDim : kHeadDim / kConsumers;
  using SmemAtomK = std::conditional_t<kDqCols % 64 == 0, SmemAtom,
                                       GMMA::Layout_K_SW64_Atom<Element>>;
  static_assert(kDqCols % 32 == 0, "");
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // also V
  // Q and dO as (head dim, query, stage), K as (head dim, key): the B operands read MN-major.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS (query, key, buffer), queries contiguous: the rows of a thread's dS^T accumulator
  // blocks are runs of queries, stored by stmatrix (SmemLayoutdSt).  Two buffers: a
  // warpgroup writes step t + 1's dS while the other may still read step t's in its dQ GEMM
  // (the barrier between the dS writes and the dQ GEMM of step t + 1 comes after both
  // finished step t's dQ).
  using SmemLayoutdS = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));

  // (The role split would do with one buffer: warpgroup 1 writes step t + 1's dS only after
  // warpgroup 0 finished step t; bwd_mainloop_split.h.)
  // The same buffers as (key, query, buffer): the consumers store dS^T into them (stmatrix).
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{},
                                          Step<_2, _1, _3>{})));

  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTileBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTileBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kStatBytes = kBlockM * sizeof(float);
  // One stage: Q, dO, lse * log2(e) and D.
  static constexpr uint32_t kStageBytes = 2 * kTileBytesQ + 2 * kStatBytes;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    // The step's dQ tile (bwd_dq.h's writer), or with the role split P^T from warpgroup 0 to
    // warpgroup 1 (fp32, each thread's accumulator values in fragment order).
    array_aligned<float, kRoleSplit ? kBlockN * kBlockM : kBlockM * kHeadDim, 128> dq;
    alignas(16) float lse_log2[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    typename Pipeline::SharedStorage pipe;
    alignas(8) uint64_t barrier_kv;  // K and V landed
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

template <typename T>
struct Sm90BwdArgs {
  typename T::TmaQ tma_q;
  typename T::TmaQ tma_do;
  typename T::TmaK tma_k;
  typename T::TmaK tma_v;
  BwdParams p;
  // lse * log2(e) (+inf for rows that see no key and for the padding) and D = rowsum(dO * O) -
  // dsoftmax_lse, fp32, (batch, heads_q, stats_pitch): rows padded to 128-row blocks, so
  // that every step's 64 values are one aligned bulk copy (packed sequences: (heads_q,
  // sm90_varlen_padded_q), each sequence's rows padded so; bwd_scratch_row).
  const float* lse_log2;
  const float* delta;
  int32_t stats_pitch;
  int32_t num_n_blocks;
  int32_t group;  // heads_q / heads_kv
  // The order in which the key blocks add their dQ tiles to a query block (bwd_dq.h): kDqAnyOrder
  // (as the CTAs get there), or with p.dq_semaphore kDqDescending / kDqRotated.
  int32_t dq_order;
  // Dense calls with dQ in any order and unequal CTAs (a causal mask or a window): (batch, KV
  // head) pairs per section of the launch order (bwd_kernel.h); 0: the key block fastest.
  int32_t section_pairs;
};

// Sm90BwdArgs::dq_order.  kDqDescending: the CTA of key block n is blockIdx n_blocks - 1 - n of its
// (batch, KV head), and at every query block the highest key block adds first: under a causal mask
// (or a window closed to the right) a higher key block reaches a query block at an earlier step of
// its own (it starts further down), so in steady state nobody waits. (Where all start at query
// block 0, each waits a writer step for the next higher one at the start.)  The shortest key blocks
// of a causal mask then launch first, not the longest. kDqRotated (no mask, all of a (batch, KV
// head)'s CTAs resident at once): key block n starts at query block floor(n M / N) (M query blocks,
// N key blocks) and wraps around, and at every query block the key blocks add in the order they
// reach it; without the rotation every key block would reach query block 0 at its first step and
// wait for all others in turn.
constexpr int32_t kDqAnyOrder = 0, kDqDescending = 1, kDqRotated = 2;

// The CTA's sequence: its rows of q / dO start at q0 and its keys at k0 (0 but for packed
// sequences), len_q rows and len_k keys; row_base: its first row in the per-row scratch
// (statistics, dQ buffer) of each (batch, query head).
struct BwdSeq {
  int32_t q0, k0, len_q, len_k, row_base;
};
// Row of query block m_block of (b, h) in the per-row scratch: (batch, heads_q, stats_pitch)
// rows, a sequence's from its row_base (packed sequences: one batch entry, each sequence's
// rows padded to a multiple of 128).  The statistics' offset; times the head dim, dQ's.
template <typename T>
__host__ __device__ __forceinline__ int64_t bwd_scratch_row(const Sm90BwdArgs<T>& args,
                                                            int32_t b, int32_t h,
                                                            const BwdSeq& seq, int32_t m_block) {
  const int64_t bh = T::kVarlen ? h : static_cast<int64_t>(b) * args.p.heads_q + h;
  return bh * args.stats_pitch + seq.row_base + static_cast<int64_t>(m_block) * T::kBlockM;
}

// The query blocks a key block's steps visit, and its steps: (query head of the group, block)
// pairs, the head outermost.  With a bias summary (the general and mask variants) the rows are
// narrowed to the span the bias lets see the key block, over the group's query heads (a
// (B, 1, L, S) causal mask: without it every key block walked all query blocks, the masked ones
// one skipped step each).
struct BwdSteps {
  int32_t m_begin, m_blocks, steps;
  int32_t rot;  // kDqRotated: the first step's block is m_begin + rot (else 0)
};
// The walk over a key block's steps, shared by the producer, the consumers and the dQ writer:
// (query head h, block index i before the rotation).
struct BwdStepWalk {
  int32_t h, i = 0;
  __device__ __forceinline__ int32_t m_block(const BwdSteps& st) const {
    const int32_t r = i + st.rot;
    return st.m_begin + (r >= st.m_blocks ? r - st.m_blocks : r);
  }
  __device__ __forceinline__ void next(const BwdSteps& st) {
    if (++i == st.m_blocks) {
      i = 0;
      ++h;
    }
  }
};
// Whether step (query head h, query block m_block) of key block n_block adds nothing because
// the bias masks the whole block for its rows (the general and mask variants).  The producer
// and the consumers skip it and the dQ writer counts it in without adding: one rule, since a
// disagreement would hang the pipeline or miscount a query block's turns.
template <typename T>
__device__ __forceinline__ bool bwd_step_skipped(const BwdParams& p, int32_t b, int32_t h,
                                                 int32_t m_block, int32_t n_block) {
  return T::kSkipMasked &&
         bias_masks_tile<T::kBlockM, T::kBlockN>(p, b, h,
                                                 static_cast<int64_t>(m_block) * T::kBlockM,
                                                 static_cast<int64_t>(n_block) * T::kBlockN);
}
// The consumers' view of the same rule: the classes of a step's 64 x 64 blocks (rows m0 +
// 64 r, keys n0 + 64 j; bias_block_class), each loaded on its own, so that their loads issue
// together and the step waits one load's latency, not a chain of them (bias_masks_tile stops
// at the first block that is not masked, so each load waited on the one before); skipped()
// is bwd_step_skipped's answer, keys(j) the class of key block j on all the step's rows.
template <typename T>
struct BwdStepClasses {
  static constexpr int kRows = T::kBlockM / kBiasBlock, kKeys = T::kBlockN / kBiasBlock;
  int c[kRows][kKeys];
  __device__ __forceinline__ BwdStepClasses(const BwdParams& p, int32_t b, int32_t h,
                                            int64_t m0, int64_t n0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kKeys; ++j)
        c[r][j] = bias_block_class(p, b, h, m0 + r * kBiasBlock, n0 + j * kBiasBlock);
  }
  __device__ __forceinline__ bool skipped() const {
    bool all = true;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kKeys; ++j) all &= c[r][j] == kBlockMasked;
    return all;
  }
  // (j selected among compile-time indices: an index at run time put c in local memory, each
  // load's value stored there at once, which waited for it)
  __device__ __forceinline__ int keys(int j) const {
    int out = kBlockMixed;
#pragma unroll
    for (int jj = 0; jj < kKeys; ++jj) {
      int cls = c[0][jj];
#pragma unroll
      for (int r = 1; r < kRows; ++r) cls = c[r][jj] == cls ? cls : kBlockMixed;
      out = jj == j ? cls : out;
    }
    return out;
  }
};
template <typename T>
__device__ __forceinline__ BwdSteps bwd_steps(const Sm90BwdArgs<T>& args, const VisibleKeys& vis,
                                              int32_t n_block, int32_t b, int32_t hk,
                                              const BwdSeq& seq) {
  const BwdParams& p = args.p;
  const int64_t n0 = static_cast<int64_t>(n_block) * T::kBlockN;
  const int64_t n1 = n0 + T::kBlockN < seq.len_k ? n0 + T::kBlockN : seq.len_k;
  int64_t row_lo = vis.first_row(n0), row_hi = vis.row_limit(n1);
  row_lo = row_lo < 0 ? 0 : row_lo;
  row_hi = row_hi > seq.len_q ? seq.len_q : row_hi;
  // (Not with an ordered dQ: the writer's turn at a query block counts the key blocks whose
  // steps reach it by the mask's rows alone, bwd_dq.h.)
  if (T::kSkipMasked && args.dq_order == kDqAnyOrder) {
    int64_t lo = p.seqlen_q, hi = 0;
    const int heads = p.ranges_head_stride == 0 ? 1 : args.group;
    for (int g = 0; g < heads; ++g) {
      const Span s = bias_row_span<T::kBlockN>(p, b, hk * args.group + g, n0);
      if (s.end > s.begin) {
        lo = s.begin < lo ? s.begin : lo;
        hi = s.end > hi ? s.end : hi;
      }
    }
    row_lo = lo > row_lo ? lo : row_lo;
    row_hi = hi < row_hi ? hi : row_hi;
  }
  BwdSteps s;
  s.m_begin = static_cast<int32_t>(row_lo / T::kBlockM);
  s.m_blocks = row_hi > row_lo
                   ? static_cast<int32_t>((row_hi + T::kBlockM - 1) / T::kBlockM - s.m_begin)
                   : 0;
  s.steps = s.m_blocks * args.group;
  s.rot = args.dq_order == kDqRotated
              ? static_cast<int32_t>(static_cast<int64_t>(n_block) * s.m_blocks /
                                     args.num_n_blocks)
              : 0;
  return s;
}

}  // namespace flash_attn_ext::sm90
