// The Hopper backward's consumer step at head dim 256 (Sm90BwdTraits::kRoleSplit): one key
// block of 64 keys per CTA, both consumer warpgroups on the same keys, the step split by role:
//   warpgroup 0:  S^T = K Q^T (SS wgmma, 64 keys x 64 queries x 256), P^T = exp2(S^T scale
//                 log2 e - lse log2 e) in registers, P^T (fp32) to shared memory for warpgroup
//                 1, dV += P^T dO (RS: P^T in 16 bits as the A operand);
//   warpgroup 1:  dP^T = V dO^T, then with warpgroup 0's P^T: dS^T = P^T (dP^T - D) scale,
//                 dS^T (16 bits) to shared memory as dS, dK += dS^T Q;
//   both:         dQ = dS K over head-dim halves (SS wgmma, 64 queries x 128 x 64 keys), added
//                 to the fp32 dQ buffer with red.global.add.v4.f32 in bwd_dq.h's fragment-order
//                 layout (its conversion kernel writes dq).
// Each warpgroup issues 2.5 of the step's 5 GEMM units of 64 x 64 x 256, and each holds one
// accumulator of 64 keys x 256 (128 registers per thread: dV in warpgroup 0, dK in 1).  Two
// named barriers per step: P^T written (warpgroup 1 waits), dS written (both wait).
// Buffers: P^T single (warpgroup 0 writes step t + 1's only after the dS barrier of step t,
// which warpgroup 1 reaches after reading step t's); dS in the traits' two buffers (one would
// do: warpgroup 1 writes step t + 1's after the P barrier of t + 1, which warpgroup 0 reaches
// after its dQ GEMM of step t).
// Plain attention with the causal / window mask (packed sequences too: T::kVarlen), a boolean
// mask alone (T::kMask: warpgroup 0 reads its bytes in steps whose 64 x 64 block is mixed;
// wholly masked blocks are skipped, bwd_step_skipped), dropout alone (T::kDropout: warpgroup 0
// draws the keep bits while its S^T GEMM runs, takes P^T Z / P(kept) for dV and hands over P^T
// with the bit in its sign, -P^T where dropped, so that warpgroup 1 needs no bits of its own),
// softcap alone (T::kSoftcap: warpgroup 0 hands over P^T (1 - t^2), t = tanh(x scale /
// softcap), the score's derivative folded in as in bwd_mainloop.h's softcap variant) and ALiBi
// alone (T::kAlibi: its term in P^T's exponent); dQ in any order or in a fixed one
// (deterministic: run_split_dq_order keeps the order); the general variant stays on the
// portable backward at this head dim (kernel_select.h).
// The split by role is the budget worked out in docs/perf/sm90_backward.md ("Next");
// FlashAttention-3 (arXiv:2407.08608) takes 64 x 80 tiles there instead, with the dK / dV and
// dQ products transposed over both warpgroups.
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/sm80/score.h"
#include "kernels/sm90/bwd_dq.h"
#include "kernels/sm90/bwd_mainloop.h"  // (its types, gemm_zero, BwdProbs, store_kv_accumulator)
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/fwd_mainloop.h"  // (GMMA helpers of the forward's headers)
#include "mask.h"

namespace flash_attn_ext::sm90 {

// Named barriers of the split step (CUTLASS's user ids; bwd_dq.h's writer barriers are unused
// at this head dim): dS written by warpgroup 1 (both wait), P^T written by warpgroup 0; with
// dQ in a fixed order, between consumer warpgroup me and the order warp (run_split_dq_order):
// kSplitTurnBarrier + me its turn come, kSplitDoneBarrier + me its adds performed; with packed
// sequences, kSplitZeroBarrier + me: warpgroup me's zeros written (zero_kv_rows, zero_qdo_rows).
constexpr int kSplitDsBarrier = 0, kSplitPBarrier = 1, kSplitTurnBarrier = 2,
              kSplitDoneBarrier = 4, kSplitZeroBarrier = 6;
static_assert(kSplitZeroBarrier + 2 +
                      static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) <=
                  16,
              "the split's named barriers exceed the hardware's 16");
constexpr int kSplitOrderThreads = 128 + 32;  // a consumer warpgroup and the order warp

__device__ __forceinline__ void red_add_v4(float* ptr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

template <typename T>
struct BwdMainloopSplit {
  static_assert(T::kRoleSplit, "");
  // The types of the one-warpgroup-per-64-keys mainloop, whose tiled MMAs this one runs.
  using Base = BwdMainloop<T>;
  using Element = typename Base::Element;
  using TiledMmaSdP = typename Base::TiledMmaSdP;
  using TiledMmadKV = typename Base::TiledMmadKV;
  using TiledMmadQ = typename Base::TiledMmadQ;
  static constexpr int kM = Base::kM, kN = Base::kN, kD = Base::kD;
  using SmemQ = typename Base::SmemQ;
  using SmemK = typename Base::SmemK;
  using SmemQt = typename Base::SmemQt;
  using SmemKt = typename Base::SmemKt;
  using SmemdS = typename Base::SmemdS;
  using FragK = typename Base::FragK;
  using FragQ = typename Base::FragQ;
  using FragQt = typename Base::FragQt;
  using FragdS = typename Base::FragdS;
  using FragKt = typename Base::FragKt;
  using AccS = typename Base::AccS;
  using AccKV = typename Base::AccKV;
  using AccdQ = typename Base::AccdQ;
  using FragP = typename Base::FragP;
  using CoordS = typename Base::CoordS;
  using CoordKV = typename Base::CoordKV;

  static constexpr int kSVals = decltype(size(std::declval<AccS&>()))::value;
  static_assert(kSVals == kM / 2, "unexpected wgmma accumulator layout");
  static_assert(decltype(size(std::declval<FragP&>()))::value == kSVals, "");
  static constexpr int kDqVals = decltype(size(std::declval<AccdQ&>()))::value;
  static_assert(kDqVals * 128 == BwdDq<T>::kPartFloats && kDqVals % 4 == 0, "");

  TiledMmaSdP mma_sdp;
  TiledMmadKV mma_dkv;
  TiledMmadQ mma_dq;
  // Warpgroup 0 reads K, Q and dO^T; warpgroup 1 V, dO and Q^T: each its own (the same
  // partitions: both warpgroups' threads run the one-warpgroup tiled MMAs with tid 0 .. 127).
  FragK tSrKV;     // K (warpgroup 0) or V (1)
  FragQ tSrQdO;    // Q (0) or dO (1): (MMA, MMA_N, MMA_K, stage)
  FragQt tdKVrB;   // dO^T (0) or Q^T (1)
  FragdS tdQrdS;   // (MMA, MMA_M, MMA_K, buffer)
  FragKt tdQrK;
  AccKV acc_kv;    // dV (warpgroup 0) or dK (1)
  CoordS tScS;     // (key, query) of every S^T accumulator element of this thread
  CoordKV tdKcdK;  // (key, column) of dK / dV's
  SmemdS sdS;
  int me, tid;
  bool dq_pending = false;  // adds of dQ in a fixed order not yet counted in (finish_dq_ordered)

  // ctid: 0 .. 255 over the two consumer warpgroups.
  __device__ __forceinline__ BwdMainloopSplit(int ctid, SmemQ& sQ, SmemQ& sdO, SmemK& sK,
                                              SmemK& sV, SmemQt& sQt, SmemQt& sdOt, SmemKt& sKt,
                                              SmemdS& sdS_)
      : tSrKV(mma_sdp.get_thread_slice(ctid % 128).partition_fragment_A(ctid < 128 ? sK : sV)),
        tSrQdO(mma_sdp.get_thread_slice(ctid % 128).partition_fragment_B(ctid < 128 ? sQ : sdO)),
        tdKVrB(mma_dkv.get_thread_slice(ctid % 128).partition_fragment_B(ctid < 128 ? sdOt : sQt)),
        tdQrdS(mma_dq.get_thread_slice(ctid).partition_fragment_A(sdS_)),
        tdQrK(mma_dq.get_thread_slice(ctid).partition_fragment_B(sKt)),
        acc_kv(partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kD>>{})),
        tScS(mma_sdp.get_thread_slice(ctid % 128).partition_C(
            make_identity_tensor(Shape<Int<kN>, Int<kM>>{}))),
        tdKcdK(mma_dkv.get_thread_slice(ctid % 128).partition_C(
            make_identity_tensor(Shape<Int<kN>, Int<kD>>{}))),
        sdS(sdS_),
        me(ctid / 128),
        tid(ctid % 128) {
    clear(acc_kv);
  }

  // acc_kv += a16 B (a16: P^T or dS^T in registers, B: dO or Q of ring stage `stage`).
  __device__ __forceinline__ void issue_kv(FragP& a16, int stage) {
    warpgroup_fence_operand(a16);
    warpgroup_fence_operand(acc_kv);
    warpgroup_arrive();
    mma_dkv.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(a16); ++kb)
      cute::gemm(mma_dkv, a16(_, _, kb), tdKVrB(_, _, kb, stage), acc_kv);
    warpgroup_commit_batch();
  }

  // dQ = dS K over this warpgroup's head-dim half, one commit group.
  __device__ __forceinline__ void issue_dq(AccdQ& acc_dq, int buf) {
    warpgroup_fence_operand(acc_dq);
    warpgroup_arrive();
    Base::gemm_zero(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
    warpgroup_commit_batch();
  }

  // This warpgroup's part of the step's dQ tile added to the buffer (`tile`: the query block's
  // first float), float4 chunk j of thread tid at 4 (j 128 + tid) of the part (bwd_dq.h's
  // layout: a warp's adds cover 512 contiguous bytes).
  __device__ __forceinline__ void add_dq(const AccdQ& acc_dq, float* tile) const {
    float* part = tile + me * BwdDq<T>::kPartFloats + 4 * tid;
    CUTE_UNROLL
    for (int j = 0; j < kDqVals / 4; ++j)
      red_add_v4(part + 4 * 128 * j, acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2),
                 acc_dq(4 * j + 3));
  }
  // The same in a fixed order (run_split_dq_order keeps it): after the order warp says that
  // both warpgroups of the key blocks before this one have added theirs (each warpgroup adds
  // its own head-dim half, so the order of every element's sums is fixed).  The order warp
  // counts this warpgroup's adds in once finish_dq_ordered has fenced them: in the next step,
  // before its dS barrier, or after the last step.  (A fence right after the adds waited for
  // them to reach L2, ~1 us per step on the consumers' path: deterministic=True ran at
  // 0.73-0.78x the default, bench_bwd_kernels; a step later the adds have long completed.
  // The consumers polling the counter themselves spilled 1.5 KB of their registers, ptxas:
  // the wait loop with its time limit.)
  __device__ __forceinline__ void add_dq_ordered(const AccdQ& acc_dq, float* tile) {
    cutlass::arch::NamedBarrier::sync(kSplitOrderThreads, kSplitTurnBarrier + me);
    add_dq(acc_dq, tile);
    dq_pending = true;
  }
  __device__ __forceinline__ void finish_dq_ordered() {
    if (!dq_pending) return;
    __threadfence();  // this thread's adds performed before the count
    cutlass::arch::NamedBarrier::arrive(kSplitOrderThreads, kSplitDoneBarrier + me);
    dq_pending = false;
  }

  // One step: query rows m0 .. m0 + kM of the key block's keys n0 .., Q / dO / statistics in
  // ring stage `stage`, dS through buffer `buf`, dQ added at dq_tile.  `masked`: some (key,
  // query) pair of the step is not visible (rel: the visible keys of each row, relative to the
  // key block).  scale_log2: the exp2 domain's factor of S^T (scale log2 e), or of the softcap
  // variant's tanh values (softcap log2 e); fn: the softcap's 1 / (softcap / scale) and the
  // ALiBi slope and offset of the step's query head; ordered: dQ in a fixed order
  // (add_dq_ordered).  The mask variant (T::kMask): cls, the boolean mask's class on the step's
  // block (bias_blocks.h; a wholly masked block never comes here, bwd_step_skipped), mask_bh
  // its bytes at query row 0, key 0 of (b, h) (strides from fn), read where the block is mixed;
  // rows_left / keys_left: the step's rows and keys that exist (the others read nothing).
  // The dropout variant (T::kDropout): drop, the forward's dropout mask (dropout.h;
  // drop_row_base the row id of query row 0 of (b, h)): dV takes P^T Z / P(kept) and dS^T =
  // P^T (dP^T Z / P(kept) - D), D = rowsum(dO O) of the dropped O, as bwd_mainloop.h's.
  __device__ __forceinline__ void step(typename T::SharedStorage& smem, int stage, int buf,
                                       bool masked, const VisibleKeys::Relative& rel,
                                       float scale, float scale_log2, float* dq_tile,
                                       const sm80::ScoreFn& fn, int64_t m0, int64_t n0,
                                       bool ordered, int cls, const uint8_t* mask_bh,
                                       int32_t rows_left, int32_t keys_left,
                                       const sm80::DropoutFn& drop, int64_t drop_row_base) {
    const int key0 = get<0>(tScS(0)), q0 = get<1>(tScS(0));
    float* p_shared = smem.dq.data() + 4 * tid;  // this thread's P^T values (fragment order)
    AccS acc = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
    FragP a16;
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    Base::gemm_zero(mma_sdp, tSrKV, tSrQdO(_, _, _, stage), acc);  // S^T (0) or dP^T (1)
    warpgroup_commit_batch();
    // The dropout variant: warpgroup 0's keep bits while the GEMM runs (bit i: accumulator
    // element i, the same (key, query) coordinates as the one-warpgroup-per-64-keys step's).
    uint64_t kept = 0;
    if constexpr (T::kDropout)
      if (me == 0)
        kept = drop.template keep_bits<kM / 8, false>(drop_row_base, n0 + key0, m0 + q0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (me == 0) {
      // P^T = exp2(S^T scale log2(e) - lse log2(e)), 0 where the key is not visible to the
      // row (a copy of the loop for steps with a mask, one without: see bwd_mainloop.h), in
      // 16 bits for dV; acc keeps what warpgroup 1 needs for dS^T: P^T, or with softcap
      // P^T (1 - t^2).
      // The mask variant's mixed blocks take a third copy, with the boolean mask's bytes
      // (BwdHide).
      const float* lse_s = smem.lse_log2[stage];
      auto probs = [&](auto with_mask, auto with_bool) {
        const BwdHide<decltype(with_bool)::value> hide(rel, masked, key0, q0, fn, mask_bh, m0,
                                                       n0);
        const BwdProbs<T> prob(fn, m0, n0, key0, q0);
        CUTE_UNROLL
        for (int i = 0; i < kSVals; ++i) {
          float t;
          float pr = prob(acc(i), scale_log2, lse_s[q0 + acc_col(i)], acc_col(i) - acc_row(i), t);
          // (t too: a hidden key's score may be NaN, which P^T (1 - t^2) would keep)
          if constexpr (decltype(with_mask)::value)
            if (hide.by_rel(acc_row(i), acc_col(i))) pr = t = 0.f;
          if constexpr (decltype(with_bool)::value)
            pr = hide.visible(acc_row(i), acc_col(i),
                              q0 + acc_col(i) < rows_left && key0 + acc_row(i) < keys_left) != 0
                     ? pr
                     : 0.f;
          if constexpr (T::kDropout) {
            // (P^T Z / P(kept) for dV; -P^T where dropped for warpgroup 1: P^T >= 0, and a
            // dropped 0 is -0, its sign bit set all the same)
            const bool keep = (kept >> i) & 1u;
            a16(i) = static_cast<Element>(keep ? pr * drop.scale : 0.f);
            acc(i) = keep ? pr : -pr;
          } else {
            a16(i) = static_cast<Element>(pr);
            acc(i) = T::kSoftcap ? pr * fmaf(-t, t, 1.f) : pr;
          }
        }
      };
      if (T::kMask && cls != kBlockVisible)
        probs(cute::true_type{}, cute::true_type{});
      else if (masked)
        probs(cute::true_type{}, cute::false_type{});
      else
        probs(cute::false_type{}, cute::false_type{});
      CUTE_UNROLL
      for (int j = 0; j < kSVals / 4; ++j)
        *reinterpret_cast<float4*>(p_shared + 4 * 128 * j) =
            make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
      cutlass::arch::NamedBarrier::arrive(256, kSplitPBarrier);
      issue_kv(a16, stage);  // dV += P^T dO
    } else {
      // dS^T scale = P^T (dP^T scale - D scale), scaled before it is rounded to 16 bits
      // (bwd_mainloop.h says why); with softcap P^T (1 - t^2) in place of P^T; with dropout
      // dP^T Z / P(kept) in place of dP^T, Z from the sign of what warpgroup 0 handed over.
      const float* d_s = smem.delta[stage];
      const float dp_scale = T::kDropout ? scale * drop.scale : scale;
      cutlass::arch::NamedBarrier::sync(256, kSplitPBarrier);
      CUTE_UNROLL
      for (int j = 0; j < kSVals / 4; ++j) {
        const float4 pr = *reinterpret_cast<const float4*>(p_shared + 4 * 128 * j);
        const float pv[4] = {pr.x, pr.y, pr.z, pr.w};
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;
          float pr = pv[e], dp = acc(i) * dp_scale;
          if constexpr (T::kDropout) {
            dp = signbit(pr) ? 0.f : dp;
            pr = fabsf(pr);
          }
          a16(i) = static_cast<Element>(pr * (dp - d_s[q0 + acc_col(i)] * scale));
        }
      }
      // dS^T to shared memory as dS (query, key), queries contiguous (stmatrix; see
      // bwd_mainloop.h).
      auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
      auto thr = r2s.get_thread_slice(tid);
      Tensor src = thr.retile_S(make_tensor(a16.data(), typename AccS::layout_type{}));
      Tensor dst = thr.partition_D(make_tensor(sdS.data(), typename T::SmemLayoutdSt{}));
      cute::copy(r2s, src, dst(_, _, _, buf));
      cutlass::arch::fence_view_async_shared();  // visible to wgmma (the async proxy)
    }
    finish_dq_ordered();  // (the previous step's adds, with dQ in a fixed order)
    // dS written: dQ over this warpgroup's head-dim half, then (warpgroup 1) dK += dS^T Q.
    cutlass::arch::NamedBarrier::sync(256, kSplitDsBarrier);
    AccdQ acc_dq = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
    issue_dq(acc_dq, buf);
    if (me == 1) {
      issue_kv(a16, stage);  // dK += dS^T Q
      warpgroup_wait<1>();   // dQ (dK may run on)
    } else {
      warpgroup_wait<0>();   // dV (issued first) and dQ
    }
    warpgroup_fence_operand(acc_dq);
    if (ordered)
      add_dq_ordered(acc_dq, dq_tile);
    else
      add_dq(acc_dq, dq_tile);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_kv);
    warpgroup_fence_operand(a16);
  }

  // Packed sequences (T::kVarlen; bwd_kernel.h says why): keys from `first` of the block
  // (relative to n0) become zeros, K by warpgroup 0 (its S^T reads it first; warpgroup 1's dQ
  // reads it only after the dS barrier, which warpgroup 0 reaches after these writes), V by
  // warpgroup 1 (only its dP^T reads it); rows from `first` of ring stage `stage`, zeros in Q
  // by warpgroup 0 (its S^T reads Q first; warpgroup 1's dK reads it only after the dS
  // barrier, which warpgroup 0 reaches after these writes) and in dO by both (warpgroup 1's
  // dP^T reads it before any barrier between them, warpgroup 0's dV without waiting for
  // warpgroup 1): each writes the same dO zeros before its own GEMMs.
  __device__ __forceinline__ void zero_kv_rows(typename T::SharedStorage& smem, int64_t first,
                                               int me, int tid) {
    const int from = first < 0 ? 0 : first > kN ? kN : static_cast<int>(first);
    Tensor sKV = make_tensor(make_smem_ptr(me == 0 ? smem.k.data() : smem.v.data()),
                             typename T::SmemLayoutK{});
    Base::zero_rows(sKV, from, kN, tid);
    cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before wgmma reads
    cutlass::arch::NamedBarrier::sync(128, kSplitZeroBarrier + me);
  }
  __device__ __forceinline__ void zero_qdo_rows(typename T::SharedStorage& smem, int stage,
                                                int first, int me, int tid) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutQ{});
    if (me == 0) Base::zero_rows(sQ(_, _, stage), first < 0 ? 0 : first, kM, tid);
    Base::zero_rows(sdO(_, _, stage), first < 0 ? 0 : first, kM, tid);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, kSplitZeroBarrier + me);
  }

  // This warpgroup's accumulator (dV in warpgroup 0, dK in 1) to rows row_base .. of dv / dk
  // (keys_left of the block's keys exist; columns cut at the head dim; store_kv_accumulator).
  __device__ __forceinline__ void store_dkdv(const BwdParams& p, int64_t row_base,
                                             int64_t keys_left, int32_t b, int32_t hk) const {
    const int key0 = get<0>(tdKcdK(0)), c0 = get<1>(tdKcdK(0));
    const int64_t row0 = row_base + key0;
    const bool is_v = me == 0;
    const int64_t row_stride = is_v ? p.dv_row_stride : p.dk_row_stride;
    auto* out = static_cast<Element*>(is_v ? p.dv : p.dk) +
                b * (is_v ? p.dv_batch_stride : p.dk_batch_stride) +
                hk * (is_v ? p.dv_head_stride : p.dk_head_stride) + row0 * row_stride + c0;
    const int rows_left = static_cast<int>(keys_left - key0 < kN ? keys_left - key0 : kN);
    store_kv_accumulator(acc_kv, tdKcdK, out, row_stride, rows_left,
                         static_cast<int>(is_v ? p.head_dim_v : p.head_dim) - c0);
  }

  // The same through shared memory (bwd_mainloop.h's stage_kv_rows and copy_kv_rows; where
  // Base::staged_store_fits): dV by warpgroup 0 in the V tile's space, dK by 1 in K's (both
  // free once both warpgroups' last GEMMs have read them, the caller's barrier).
  __device__ __forceinline__ void store_dkdv_staged(const BwdParams& p, Element* sk, Element* sv,
                                                    int64_t row_base, int64_t keys_left,
                                                    int32_t b, int32_t hk, int, int) const {
    static_assert(kN == 64, "both warpgroups on the same 64 keys");
    const bool is_v = me == 0;
    Element* rows = is_v ? sv : sk;
    stage_kv_rows<kD>(acc_kv, rows, tid);
    cutlass::arch::NamedBarrier::sync(128, kSplitZeroBarrier + me);  // (this warpgroup's)
    const int64_t row_stride = is_v ? p.dv_row_stride : p.dk_row_stride;
    copy_kv_rows<kD>(rows,
                     static_cast<Element*>(is_v ? p.dv : p.dk) +
                         b * (is_v ? p.dv_batch_stride : p.dk_batch_stride) +
                         hk * (is_v ? p.dv_head_stride : p.dk_head_stride) +
                         row_base * row_stride,
                     row_stride, static_cast<int>(keys_left < kN ? keys_left : kN),
                     static_cast<int>(is_v ? p.head_dim_v : p.head_dim), tid);
  }
};

// dQ in a fixed order at head dim 256 (deterministic: args.dq_order, p.dq_semaphore): a warp
// of the producer warpgroup (bwd_kernel.h) walks the CTA's steps as the consumers do; per
// step it waits for its turn at the query block's counter (bwd_dq.h's dq_turn: both
// warpgroups of each key block before this one counted in), lets both consumer warpgroups
// add (kSplitTurnBarrier), waits until both have fenced their adds (kSplitDoneBarrier: in
// their next step, finish_dq_ordered) and counts the two in.  A step the consumers skip (the
// mask variant: a wholly masked block, bwd_step_skipped) is counted in at its turn without
// them.  While the consumers compute, the warp reads the next step's counter once: where that
// turn has already come, the next step releases the consumers at once, without a global
// load's round trip on their path between the count and their next adds.
template <typename T>
__device__ __forceinline__ void run_split_dq_order(const Sm90BwdArgs<T>& args,
                                                   const BwdSteps& st, const BwdSeq& seq,
                                                   int32_t n_block, int32_t b, int32_t hk) {
  const BwdParams& p = args.p;
  const bool leader = threadIdx.x % 32 == 0;
  const int64_t counters_per_head = dq_semaphores_per_head(p.seqlen_q);
  // (packed sequences: a counter per block of the padded scratch rows, as bwd_dq.h's writer)
  auto counter_of = [&](const BwdStepWalk& at) {
    return p.dq_semaphore +
           (T::kVarlen ? bwd_scratch_row(args, b, at.h, seq, at.m_block(st)) / T::kBlockM
                       : (static_cast<int64_t>(b) * p.heads_q + at.h) * counters_per_head +
                             at.m_block(st));
  };
  bool peeked = false;  // (the leader's) this step's turn seen come while the last one ran
  BwdStepWalk w{hk * args.group};
  for (int32_t t = 0; t < st.steps; ++t, w.next(st)) {
    const int32_t h = w.h, m_block = w.m_block(st);
    int32_t* counter = counter_of(w);
    if (leader && !peeked)
      wait_at_least(counter, T::kConsumers * dq_turn(args, st, seq, n_block, m_block));
    peeked = false;
    __syncwarp();
    if (!bwd_step_skipped<T>(p, b, h, m_block, n_block)) {
      CUTE_UNROLL
      for (int me = 0; me < T::kConsumers; ++me)
        cutlass::arch::NamedBarrier::arrive(kSplitOrderThreads, kSplitTurnBarrier + me);
      if (leader && t + 1 < st.steps) {
        BwdStepWalk nx = w;
        nx.next(st);
        peeked = load_acquire(counter_of(nx)) >=
                 T::kConsumers * dq_turn(args, st, seq, n_block, nx.m_block(st));
      }
      __syncwarp();  // (the leader's read done before the warp's bar.sync, as everywhere else)
      CUTE_UNROLL
      for (int me = 0; me < T::kConsumers; ++me)
        cutlass::arch::NamedBarrier::sync(kSplitOrderThreads, kSplitDoneBarrier + me);
    }
    if (leader) add_release(counter, T::kConsumers);
    __syncwarp();
  }
}

}  // namespace flash_attn_ext::sm90
