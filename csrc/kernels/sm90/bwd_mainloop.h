// The Hopper backward's consumer step (bwd_traits.h has the algorithm): per (query head, query
// block) of the CTA's key block, S^T and dP^T, the softmax gradient in registers, dV and dK
// accumulated in registers, dS^T to shared memory and dQ = dS K added to the fp32 dQ buffer
// (bwd_dq.h).
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/sm80/dropout.h"
#include "kernels/sm80/score.h"
#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/bwd_dq.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/fwd_mainloop.h"  // (GMMA helpers of the forward's headers)
#include "mask.h"

namespace flash_attn_ext::sm90 {

// P^T = exp2(S^T scale log2(e) - lse log2(e)) of the plain, softcap (T::kSoftcap) and ALiBi
// (T::kAlibi) variants, one S^T accumulator element at a time (both mainloops).  Built once
// per step at the thread's first (key, query) of S^T, key0 and q0 of the step's keys n0 ..
// and query rows m0 ..: the softcap's t = tanh(x scale / softcap) takes fn.cap_inv_scale, and
// ALiBi's term its slope in log2 units and the distance i + off - j, which at element i is
// dist00 + (acc_col(i) - acc_row(i)) (S^T: keys are the rows), a compile-time offset.
template <typename T>
struct BwdProbs {
  float cap_inv_scale = 0.f, slope_log2 = 0.f, dist00 = 0.f;

  __device__ __forceinline__ BwdProbs(const sm80::ScoreFn& fn, int64_t m0, int64_t n0, int key0,
                                      int q0) {
    if constexpr (T::kSoftcap) cap_inv_scale = fn.cap_inv_scale;
    if constexpr (T::kAlibi) {
      slope_log2 = fn.alibi_slope * sm80::ScoreFn::kLog2e;
      dist00 = static_cast<float>(m0 + q0 + fn.alibi_offset - n0 - key0);
    }
  }
  // P^T of S^T's value x at element i (col_minus_row: acc_col(i) - acc_row(i)) of a row whose
  // lse log2(e) is lse_log2; t: the score the exponent took (tanh's value with softcap).
  // scale_log2: scale log2(e), or softcap log2(e) with softcap.
  __device__ __forceinline__ float operator()(float x, float scale_log2, float lse_log2,
                                              int col_minus_row, float& t) const {
    t = T::kSoftcap ? sm80::tanh_approx(x * cap_inv_scale) : x;
    float e = fmaf(t, scale_log2, -lse_log2);
    if constexpr (T::kAlibi)
      e = fmaf(-slope_log2, fabsf(dist00 + static_cast<float>(col_minus_row)), e);
    return exp2f(e);
  }
};

// What hides S^T's accumulator elements from a thread's P^T (both mainloops): the causal /
// window mask (rel, where the step is `masked`) and, with kBool (the mask variant's mixed
// steps), the boolean mask's bytes (mask_bh at query row 0, key 0 of (b, h); its strides from
// fn: keys unit-stride or broadcast, prepare_bias).  Built once per step at the thread's first
// (key, query) key0, q0 of keys n0 .. and query rows m0 ..; with kBool the causal / window
// mask hides nothing where the step has none (one copy of the loop for both); rows and keys
// past the ends (rows_left, keys_left) read no byte, their P^T being 0 by the statistics and
// the mask.
template <bool kBool>
struct BwdHide {
  static constexpr int kNever = 1 << 30;
  VisibleKeys::Relative::Thread hide;
  const uint8_t* mask_at = nullptr;
  int64_t row_stride = 0;
  bool per_key = false;

  __device__ __forceinline__ BwdHide(const VisibleKeys::Relative& rel, bool masked, int key0,
                                     int q0, const sm80::ScoreFn& fn, const uint8_t* mask_bh,
                                     int64_t m0, int64_t n0)
      : hide(!kBool || masked ? rel.thread(key0, q0)
                              : VisibleKeys::Relative::Thread{-kNever, kNever, kNever}) {
    if constexpr (kBool) {
      row_stride = fn.bias_row_stride;
      per_key = fn.bias_col_stride != 0;
      mask_at = mask_bh + (m0 + q0) * row_stride + (per_key ? n0 + key0 : 0);
    }
  }
  // Whether the causal / window mask hides the element at (acc_row, acc_col) of the thread's
  // first; and the boolean mask's byte there (1 where the element's row or key does not
  // exist: `exists`).
  __device__ __forceinline__ bool by_rel(int row, int col) const { return hide.hidden(row, col); }
  __device__ __forceinline__ uint8_t visible(int row, int col, bool exists) const {
    return exists ? mask_at[col * row_stride + (per_key ? row : 0)] : uint8_t{1};
  }
};

// A key block's dK or dV accumulator (acc, its (key, column) coordinates coord) to `out`, the
// thread's first element's place in dk / dv (row stride row_stride), rows_left of its rows
// and cols of its columns existing, one 32-bit word per pair of columns.  Every element's
// (key, column) is a compile-time offset from the thread's first, so the bounds are
// immediates compared with per-thread limits and the addresses immediates off two row
// pointers (a thread's rows are key0 and key0 + 8 in wgmma's accumulator layout; the general
// form folds to one of them).  (Computed per element from 64-bit coordinates, the stores took
// ~12 instructions each: ~1,500 per thread, a few per cent of a causal CTA's time.)
template <typename Element, typename Acc, typename Coord>
__device__ __forceinline__ void store_kv_accumulator(const Acc& acc, const Coord& coord,
                                                     Element* out, int64_t row_stride,
                                                     int rows_left, int cols) {
  const int key0 = get<0>(coord(0)), c0 = get<1>(coord(0));
  Element* out8 = out + 8 * row_stride;
  constexpr int kVals = decltype(size(acc))::value;
  CUTE_UNROLL
  for (int i = 0; i < kVals; i += 2) {
    const int dr = get<0>(coord(i)) - key0, dc = get<1>(coord(i)) - c0;
    if (dr >= rows_left || dc >= cols) continue;
    Element pair[2] = {static_cast<Element>(acc(i)), static_cast<Element>(acc(i + 1))};
    *reinterpret_cast<uint32_t*>((dr == 0 ? out : dr == 8 ? out8 : out + dr * row_stride) + dc) =
        *reinterpret_cast<uint32_t*>(pair);
  }
}

// The layout stage_kv_rows relies on: accumulator values 8k .. 8k + 7 of a warpgroup's 64 x kD
// tile are the pairs of the 8 x 8 matrices (rows + 0, chunk 2k), (rows + 8, chunk 2k), (+0,
// 2k + 1), (+8, 2k + 1) of the thread's warp (fwd_traits.h's acc_row / acc_col), in
// stmatrix's order of four matrices.
template <int kD>
constexpr bool stmatrix_order() {
  for (int i = 0; i < kD / 2; ++i) {
    const int m = (i % 8) / 2;
    if (acc_row(i) != 8 * (m & 1) || acc_col(i) != (i & 1) + 8 * (2 * (i / 8) + (m >> 1)))
      return false;
  }
  return true;
}

// dK / dV through shared memory, where store_kv_accumulator stores 4 bytes per thread from
// registers (a warp's store filled half of each of its 32-byte sectors; ncu: all of the
// kernel's excess sectors): a warpgroup's 64 x kD accumulator (thread tid of 128) to `rows`,
// 64 rows of kD elements in shared memory, by stmatrix, 16-byte chunks swizzled (chunk c of
// row r at chunk c ^ (r & 7) of its row: the 8 rows of each 8 x 8 matrix, and 8 consecutive
// chunks of a row, fall on distinct banks).  Then, after a barrier of the warpgroup,
// copy_kv_rows reads one 16-byte chunk per thread and stores whole rows (full sectors).
// (FlashAttention-3 also stages dK and dV in shared memory, then stores them by TMA; 16-byte
// stores keep the packed sequences' row bounds without a descriptor per call.)
template <int kD, typename Element, typename Acc>
__device__ __forceinline__ void stage_kv_rows(const Acc& acc, Element* rows, int tid) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static_assert(kChunks % 8 == 0, "the swizzle permutes chunks in groups of 8");
  static_assert(decltype(size(acc))::value == kD / 2 && stmatrix_order<kD>(),
                "unexpected wgmma accumulator layout");
  const int lane = tid % 32;
  // stmatrix: lane l gives the address of row l % 8 of matrix l / 8
  const int row_l = 16 * (tid / 32) + 8 * ((lane >> 3) & 1) + (lane & 7);
  CUTE_UNROLL
  for (int k = 0; k < kChunks / 2; ++k) {
    uint32_t r[4];
    CUTE_UNROLL
    for (int m = 0; m < 4; ++m) {
      Element pair[2] = {static_cast<Element>(acc(8 * k + 2 * m)),
                         static_cast<Element>(acc(8 * k + 2 * m + 1))};
      r[m] = *reinterpret_cast<uint32_t*>(pair);
    }
    const int chunk = (2 * k + (lane >> 4)) ^ (row_l & 7);
    SM90_U32x4_STSM_N::copy(r[0], r[1], r[2], r[3],
                            *reinterpret_cast<uint128_t*>(rows + row_l * kD + chunk * 8));
  }
}

// stage_kv_rows' 64 rows to out (row stride row_stride, 16-byte aligned), its first n_rows
// rows and the chunks of its first cols columns (a multiple of 8).
template <int kD, typename Element>
__device__ __forceinline__ void copy_kv_rows(const Element* rows, Element* out,
                                             int64_t row_stride, int n_rows, int cols,
                                             int tid) {
  constexpr int kChunks = kD / 8;
  CUTE_UNROLL
  for (int it = 0; it < 64 * kChunks / 128; ++it) {
    const int idx = tid + 128 * it, r = idx / kChunks, c = idx % kChunks;
    if (r < n_rows && 8 * c < cols)
      *reinterpret_cast<uint4*>(out + r * row_stride + 8 * c) =
          *reinterpret_cast<const uint4*>(rows + r * kD + (c ^ (r & 7)) * 8);
  }
}

template <typename T>
struct BwdMainloop {
  using Element = typename T::Element;
  using TiledMmaSdP = typename T::TiledMmaSdP;
  using TiledMmadKV = typename T::TiledMmadKV;
  using TiledMmadQ = typename T::TiledMmadQ;
  static constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim;

  using SmemQ = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                     typename T::SmemLayoutQ{}));
  using SmemK = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                     typename T::SmemLayoutK{}));
  using SmemQt = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                      typename T::SmemLayoutQt{}));
  using SmemKt = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                      typename T::SmemLayoutKt{}));
  using SmemdS = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                      typename T::SmemLayoutdS{}));
  using ThrSdP = decltype(std::declval<TiledMmaSdP&>().get_thread_slice(0));
  using ThrdKV = decltype(std::declval<TiledMmadKV&>().get_thread_slice(0));
  using ThrdQ = decltype(std::declval<TiledMmadQ&>().get_thread_slice(0));
  using FragK = decltype(std::declval<ThrSdP&>().partition_fragment_A(std::declval<SmemK&>()));
  using FragQ = decltype(std::declval<ThrSdP&>().partition_fragment_B(std::declval<SmemQ&>()));
  using FragQt = decltype(std::declval<ThrdKV&>().partition_fragment_B(std::declval<SmemQt&>()));
  using FragdS = decltype(std::declval<ThrdQ&>().partition_fragment_A(std::declval<SmemdS&>()));
  using FragKt = decltype(std::declval<ThrdQ&>().partition_fragment_B(std::declval<SmemKt&>()));
  using AccS = decltype(partition_fragment_C(std::declval<TiledMmaSdP&>(),
                                             Shape<Int<kN>, Int<kM>>{}));
  using AccKV = decltype(partition_fragment_C(std::declval<TiledMmadKV&>(),
                                              Shape<Int<kN>, Int<kD>>{}));
  using AccdQ = decltype(partition_fragment_C(std::declval<TiledMmadQ&>(),
                                              Shape<Int<kM>, Int<kD>>{}));
  // P^T and dS^T in 16 bits: the A operands of dV and dK (see the forward's FragP).
  using FragP =
      decltype(make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kM / 16>>>{}));
  using CoordS = decltype(std::declval<ThrSdP&>().partition_C(
      make_identity_tensor(Shape<Int<kN>, Int<kM>>{})));
  using CoordKV = decltype(std::declval<ThrdKV&>().partition_C(
      make_identity_tensor(Shape<Int<kN>, Int<kD>>{})));
  using CoorddQ = decltype(std::declval<ThrdQ&>().partition_C(
      make_identity_tensor(Shape<Int<kM>, Int<kD>>{})));

  static constexpr int kSVals = decltype(size(std::declval<AccS&>()))::value;
  static_assert(kSVals == kM / 2, "unexpected wgmma accumulator layout");
  static_assert(decltype(size(std::declval<FragP&>()))::value == kSVals, "");
  // A thread's S^T values lie in kSVals / 2 query columns (fwd_traits.h's acc_col): value i in
  // slot col_slot(i), slot c at column offset slot_col(c).
  __device__ __forceinline__ static constexpr int col_slot(int i) { return (i & 1) + 2 * (i >> 2); }
  __device__ __forceinline__ static constexpr int slot_col(int c) { return (c & 1) + 8 * (c >> 1); }
  static constexpr bool slots_match() {
    for (int i = 0; i < kSVals; ++i)
      if (slot_col(col_slot(i)) != acc_col(i) || col_slot(i) >= kSVals / 2) return false;
    return true;
  }
  static_assert(slots_match(), "col_slot must invert slot_col over acc_col's columns");

  TiledMmaSdP mma_sdp;
  TiledMmadKV mma_dkv;
  TiledMmadQ mma_dq;
  FragK tSrK, tSrV;    // shared-memory descriptors
  FragQ tSrQ, tSrdO;   // (MMA, MMA_N, MMA_K, stage)
  FragQt tdKrQ, tdVrdO;
  FragdS tdQrdS;       // (MMA, MMA_M, MMA_K, buffer)
  FragKt tdQrK;
  AccKV acc_dk, acc_dv;
  CoordS tScS;    // (key, query) of every S^T accumulator element of this thread
  CoordKV tdKcdK;  // (key, column) of dK / dV's
  CoorddQ tdQcdQ;  // (query, column) of dQ's
  SmemdS sdS;

  // ctid: 0 .. 255 over the two consumer warpgroups.
  __device__ __forceinline__ BwdMainloop(int ctid, SmemQ& sQ, SmemQ& sdO, SmemK& sK, SmemK& sV,
                                         SmemQt& sQt, SmemQt& sdOt, SmemKt& sKt, SmemdS& sdS_)
      : tSrK(mma_sdp.get_thread_slice(ctid).partition_fragment_A(sK)),
        tSrV(mma_sdp.get_thread_slice(ctid).partition_fragment_A(sV)),
        tSrQ(mma_sdp.get_thread_slice(ctid).partition_fragment_B(sQ)),
        tSrdO(mma_sdp.get_thread_slice(ctid).partition_fragment_B(sdO)),
        tdKrQ(mma_dkv.get_thread_slice(ctid).partition_fragment_B(sQt)),
        tdVrdO(mma_dkv.get_thread_slice(ctid).partition_fragment_B(sdOt)),
        tdQrdS(mma_dq.get_thread_slice(ctid).partition_fragment_A(sdS_)),
        tdQrK(mma_dq.get_thread_slice(ctid).partition_fragment_B(sKt)),
        acc_dk(partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kD>>{})),
        acc_dv(partition_fragment_C(mma_dkv, Shape<Int<kN>, Int<kD>>{})),
        tScS(mma_sdp.get_thread_slice(ctid).partition_C(
            make_identity_tensor(Shape<Int<kN>, Int<kM>>{}))),
        tdKcdK(mma_dkv.get_thread_slice(ctid).partition_C(
            make_identity_tensor(Shape<Int<kN>, Int<kD>>{}))),
        tdQcdQ(mma_dq.get_thread_slice(ctid).partition_C(
            make_identity_tensor(Shape<Int<kM>, Int<kD>>{}))),
        sdS(sdS_) {
    clear(acc_dk);
    clear(acc_dv);
  }

  template <typename MmaT, typename A, typename B, typename C>
  __device__ __forceinline__ static void gemm_zero(MmaT& mma, const A& a, const B& b, C& c) {
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(a); ++kb) {
      cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }

  // dV += P^T dO (P^T from registers), one commit group.
  __device__ __forceinline__ void issue_dv(FragP& p16, int stage) {
    warpgroup_fence_operand(p16);
    warpgroup_fence_operand(acc_dv);
    warpgroup_arrive();
    mma_dkv.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(p16); ++kb)
      cute::gemm(mma_dkv, p16(_, _, kb), tdVrdO(_, _, kb, stage), acc_dv);
    warpgroup_commit_batch();
  }

  // dK += dS^T Q (dS^T from registers), one commit group.
  __device__ __forceinline__ void issue_dk(FragP& ds16, int stage) {
    warpgroup_fence_operand(ds16);
    warpgroup_fence_operand(acc_dk);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(ds16); ++kb)
      cute::gemm(mma_dkv, ds16(_, _, kb), tdKrQ(_, _, kb, stage), acc_dk);
    warpgroup_commit_batch();
  }

  // S^T = K Q^T of the step whose Q is in ring stage `stage`, into acc, one commit group.
  __device__ __forceinline__ void issue_s(AccS& acc, int stage) {
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm_zero(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc);
    warpgroup_commit_batch();
  }

  // One step: query rows m0 .. m0 + kM of query head h, Q / dO / statistics in ring stage `stage`,
  // dS through buffer `buf`.  `masked`: some (key, query) pair of the step is not visible (rel: the
  // visible keys of each of the step's rows, relative to the key block). dq_staging: this
  // warpgroup's (me) part of the staging tile, tid its thread, handed to the dQ writer; `first` on
  // the CTA's first step (bwd_dq.h).  The general variant (T::kGeneral) recomputes the forward's
  // scores with fn (sm80::ScoreFn: softcap, bias, ALiBi) at query rows m0 .. and keys n0 ..;
  // rows_left / keys_left: how many of them exist (those past the end read no bias and get P = 0
  // from their statistics or the mask); cls: the bias's class on the step's rows and this
  // warpgroup's keys (bias_blocks.h: all 0 reads nothing, all -inf gives P = 0); drop: the
  // forward's dropout mask (dropout.h; drop_row_base the row id of query row 0 of (b, h)): dV takes
  // P Z / P(kept) and dS = P (dP Z / P(kept) - D), D = rowsum(dO O) of the dropped O. The mask
  // variant (T::kMask): mask_bh, the boolean mask at query row 0, key 0 of (b, h) (bias strides
  // from fn), hides scores where it is false (P^T = 0), read a byte per score in steps whose class
  // (cls) is mixed; all masked gives P^T = 0, all visible reads nothing.  col_rows (the mask
  // variant, nullptr without them): the mask's keys as row intervals (bias_blocks.h:
  // mask_col_rows) of (b, h) at key 0; in mixed steps a thread whose two keys both have one
  // compares its columns with them instead of reading the bytes.  (Issuing S^T a step ahead,
  // under the previous step's dQ tail, measured no gain: the other warpgroup's GEMMs already fill
  // that gap; docs/perf/sm90_backward.md.)
  __device__ __forceinline__ void step(const typename T::SharedStorage& smem, int stage,
                                       int buf, bool masked, const VisibleKeys::Relative& rel,
                                       float scale, float scale_log2, float* dq_staging,
                                       int me, int tid,
                                       const sm80::ScoreFn& fn, int64_t m0, int64_t n0,
                                       int32_t rows_left, int32_t keys_left, int cls,
                                       const sm80::DropoutFn& drop, int64_t drop_row_base,
                                       const uint8_t* mask_bh, const int32_t* col_rows,
                                       bool first) {
    AccS acc_s = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
    issue_s(acc_s, stage);
    AccS acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kN>, Int<kM>>{});
    warpgroup_fence_operand(acc_dp);
    warpgroup_arrive();
    gemm_zero(mma_sdp, tSrV, tSrdO(_, _, _, stage), acc_dp);
    warpgroup_commit_batch();

    const float* lse_s = smem.lse_log2[stage];
    const float* d_s = smem.delta[stage];
    FragP p16, ds16;
    // This thread's first (key, query) of S^T; every other element's lies a compile-time offset
    // from it, so the mask (rel.thread) compares immediates, without a branch per element.
    const int key0 = get<0>(tScS(0)), q0 = get<1>(tScS(0));
    if constexpr (T::kGeneral) {
      // Both GEMMs first: the score's derivative (softcap) is needed with dP^T, and keeping it
      // per value until then would cost kSVals registers.  dS^T = P^T (dP^T - D) ds/dx, with
      // softmax_scale inside ds/dx (ScoreFn::apply), rounded to 16 bits as below.
      // The bias from global memory, this thread's first (key, query) at `bias`; its keys
      // unit-stride or broadcast (prepare_bias), so a value's offset is (query offset) x row
      // stride + key offset.
      // ALiBi's distance i + off - j at this thread's first (key, query); at value i it is
      // dist00 + (acc_col(i) - acc_row(i)), a compile-time offset: one FADD with an immediate
      // (converting q - key per value would take an I2F, a quarter-rate op like the exp2).
      const float dist00 = static_cast<float>(m0 + q0 + fn.alibi_offset - n0 - key0);
      const float* bias = fn.bias == nullptr || cls != kBlockMixed
                              ? nullptr
                              : fn.bias + (m0 + q0) * fn.bias_row_stride +
                                    (fn.bias_col_stride != 0 ? n0 + key0 : 0);
      // Dropout's keep bits (bit i: accumulator element i), while the GEMMs run.
      const uint64_t kept =
          drop.enabled ? drop.template keep_bits<kM / 8, false>(drop_row_base, n0 + key0, m0 + q0)
                       : 0;
      // The mask: hides nothing in steps without one (one copy of the loop for both).
      constexpr int kNever = 1 << 30;
      const VisibleKeys::Relative::Thread hide =
          masked ? rel.thread(key0, q0) : VisibleKeys::Relative::Thread{-kNever, kNever, kNever};
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      // Copies of the loop with and without ALiBi and dropout, so that calls without them issue
      // none of their instructions (a per-value test leaves them predicated in the loop).
      auto scores = [&](auto with_alibi, auto with_dropout) {
        CUTE_UNROLL
        for (int i = 0; i < kSVals; ++i) {
          const int key = key0 + acc_row(i), q = q0 + acc_col(i);  // (fwd_traits.h)
          float x = acc_s(i);
          const float dscore = fn.transform(x);
          if (bias != nullptr && q < rows_left && key < keys_left)
            x += bias[acc_col(i) * fn.bias_row_stride +
                      (fn.bias_col_stride != 0 ? acc_row(i) : 0)];
          if constexpr (decltype(with_alibi)::value)
            fn.add_alibi(x, dist00 + static_cast<float>(acc_col(i) - acc_row(i)));
          fn.to_log2(x);
          float pr = fn.prob(x, lse_s[q]);
          if (hide.hidden(acc_row(i), acc_col(i))) pr = 0.f;
          if (cls == kBlockMasked) pr = 0.f;
          float pz = pr, dp = acc_dp(i);
          if constexpr (decltype(with_dropout)::value) {
            const bool keep = (kept >> i) & 1u;
            pz = keep ? pr * drop.scale : 0.f;
            dp = keep ? dp * drop.scale : 0.f;
          }
          p16(i) = static_cast<Element>(pz);
          ds16(i) = static_cast<Element>(pr * (dp - d_s[q]) * dscore);
        }
      };
      auto with_alibi = [&](auto with_dropout) {
        if (fn.alibi)
          scores(cute::true_type{}, with_dropout);
        else
          scores(cute::false_type{}, with_dropout);
      };
      if (drop.enabled)
        with_alibi(cute::true_type{});
      else
        with_alibi(cute::false_type{});
    } else {
      // kDropout: the keep bits while the GEMMs run (bit i: accumulator element i).
      uint64_t kept = 0;
      if constexpr (T::kDropout)
        kept = drop.template keep_bits<kM / 8, false>(drop_row_base, n0 + key0, m0 + q0);
      // The step's lse log2(e) of this thread's query columns, read while the GEMMs run rather
      // than after the wait for S^T, where the first exponents waited on them.  (ncu at head
      // dim 128: the stall at the first exponent stayed, so it is mostly the wait for S^T's
      // accumulators; the kernel 1.5% shorter, docs/perf/sm90_backward.md.)  Only with 64-row
      // steps (16 values): at head dim 64 (128 rows, 32 values) ptxas spilled 52 bytes more
      // (plain) and 168 (mask variant).  Not in the mask variant: at head dim 128 it spilled 44
      // bytes more (104 -> 148) and its backward measured 4-6% slower (1b244b6 against
      // 36429dd).
      constexpr bool kLseAhead = kM == 64 && !T::kMask;
      float lse_q[kLseAhead ? kSVals / 2 : 1];
      if constexpr (kLseAhead) {
        CUTE_UNROLL
        for (int c = 0; c < kSVals / 2; ++c) lse_q[c] = lse_s[q0 + slot_col(c)];
      }
      auto lse_of = [&](int i) {
        if constexpr (kLseAhead)
          return lse_q[col_slot(i)];
        else
          return lse_s[q0 + acc_col(i)];
      };
      // The mask variant's visible query columns of the thread's two keys (below).
      int32_t col_lo[2] = {0, 0}, col_hi[2] = {0, 0};
      warpgroup_wait<1>();  // S^T
      warpgroup_fence_operand(acc_s);
      // P^T = exp2(S^T scale log2(e) - lse log2(e)), 0 where the key is not visible to the row.
      // Two copies, for steps with and without a mask: a per-element test of `masked` made
      // each element its own basic block (a branch around its mask code), so ptxas could not
      // overlap one element's exp2 with the next ones' (ncu: those waits were the largest
      // block of stalls outside the GEMMs).
      // The mask variant's mixed steps take a third copy, with the boolean mask (and the
      // causal/window mask, hiding nothing where the step has none); its other masked steps
      // one with each key's visible query columns (col_lo, col_hi) instead of rel's test.
      auto probs = [&](auto with_mask, auto with_bool, auto with_cols) {
        const BwdHide<decltype(with_bool)::value> hide(rel, masked, key0, q0, fn, mask_bh, m0,
                                                       n0);
        // (the softcap and ALiBi variants' terms: Sm90BwdTraits::kSoftcap, kAlibi)
        const BwdProbs<T> prob(fn, m0, n0, key0, q0);
        CUTE_UNROLL
        for (int i = 0; i < kSVals; ++i) {
          const int key = key0 + acc_row(i), q = q0 + acc_col(i);  // (fwd_traits.h)
          float t;
          float pr = prob(acc_s(i), scale_log2, lse_of(i), acc_col(i) - acc_row(i), t);
          // (the softcap variant's t too: a hidden key's score may be NaN, which P^T (1 - t^2)
          // below would keep)
          if constexpr (decltype(with_mask)::value)
            if (hide.by_rel(acc_row(i), acc_col(i))) pr = t = 0.f;
          if constexpr (decltype(with_bool)::value)
            pr = hide.visible(acc_row(i), acc_col(i), q < rows_left && key < keys_left) != 0
                     ? pr
                     : 0.f;
          if constexpr (decltype(with_cols)::value)
            if (acc_col(i) < col_lo[acc_row(i) / 8] || acc_col(i) >= col_hi[acc_row(i) / 8])
              pr = t = 0.f;
          if constexpr (T::kSoftcap) {
            // P^T for dV now; S^T's register keeps P^T ds/dx / scale = P^T (1 - t^2) for dS^T.
            // (A select of 0 where P^T is 0 instead of t = 0 for hidden keys above spilled 516
            // bytes at head dim 64, ptxas; this form 108.)
            p16(i) = static_cast<Element>(pr);
            acc_s(i) = pr * fmaf(-t, t, 1.f);
          } else {
            acc_s(i) = pr;
          }
        }
      };
      if constexpr (T::kMask) {
        // The mask variant: each of the thread's two keys sees the query columns [col_lo[r],
        // col_hi[r]) (relative to its first, q0): in mixed steps the mask's row interval of
        // the key (mask_col_rows, where both keys have one), intersected with the causal /
        // window mask's (rel, in masked steps; keys past the end see none).  One copy of the
        // loop then serves the causal mask and the boolean mask, two compares per score; a
        // mixed step whose keys are not both intervals reads the mask's bytes.  (The records
        // are read after the wait: the CTA's keys are the same every step, so they are in L1
        // after its first.  A fourth copy of the loop for the mixed steps spilled 132 bytes
        // more at head dim 64, with the records read before the wait or after it.)
        bool bytes = false;
        const int32_t base = static_cast<int32_t>(m0) + q0;
        const VisibleKeys::Relative::Thread band =
            masked ? rel.thread(key0, q0)
                   : VisibleKeys::Relative::Thread{-(1 << 30), 1 << 30, 1 << 30};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // (rel's test hides (8 r, dr) iff 8 r - dr < band.lo or >= band.hi, or 8 r >= k_limit)
          col_lo[r] = 8 * r >= band.k_limit ? 0 : 8 * r - band.hi + 1;
          col_hi[r] = 8 * r >= band.k_limit ? 0 : 8 * r - band.lo + 1;
          if (cls == kBlockMixed) {
            const int2 rows =
                col_rows == nullptr ? make_int2(1, 0)
                : key0 + 8 * r < keys_left
                    ? *reinterpret_cast<const int2*>(col_rows + 4 * (n0 + key0 + 8 * r))
                    : make_int2(0, 0);
            bytes |= rows.x > rows.y;
            col_lo[r] = max(col_lo[r], rows.x - base);
            col_hi[r] = min(col_hi[r], rows.y - base);
          }
        }
        if (bytes)
          probs(cute::true_type{}, cute::true_type{}, cute::false_type{});
        else if (masked || cls == kBlockMixed)
          probs(cute::false_type{}, cute::false_type{}, cute::true_type{});
        else
          probs(cute::false_type{}, cute::false_type{}, cute::false_type{});
      } else if (masked) {
        probs(cute::true_type{}, cute::false_type{}, cute::false_type{});
      } else {
        probs(cute::false_type{}, cute::false_type{}, cute::false_type{});
      }
      if (T::kMask && cls == kBlockMasked) {
        CUTE_UNROLL
        for (int i = 0; i < kSVals; ++i) acc_s(i) = 0.f;
      }
      // dV += P^T dO issued before dS^T is computed, so that the tensor cores work while this
      // warpgroup computes dS^T (issued after it, dV left them idle for that time).  With
      // dropout dV takes P^T Z / P(kept) (Z: the keep mask).
      if constexpr (!T::kSoftcap) {  // (the softcap variant's probs wrote p16)
        CUTE_UNROLL
        for (int i = 0; i < kSVals; ++i) {
          float pz = acc_s(i);
          if constexpr (T::kDropout) pz = (kept >> i) & 1u ? pz * drop.scale : 0.f;
          p16(i) = static_cast<Element>(pz);
        }
      }
      issue_dv(p16, stage);
      warpgroup_wait<1>();  // dP^T (dV may still run)
      warpgroup_fence_operand(acc_dp);
      // dS^T scale = P^T (dP^T scale - D scale): scaled before it is rounded to 16 bits (as the
      // portable kernels: unscaled, fp16 dS would overflow 1 / scale times sooner), so dK and
      // dQ need no scale afterwards.  With dropout dP^T Z / P(kept) in place of dP^T (D is
      // rowsum(dO O) of the dropped O).
      const float dp_scale = T::kDropout ? scale * drop.scale : scale;
      CUTE_UNROLL
      for (int i = 0; i < kSVals; ++i) {
        const int q = q0 + acc_col(i);
        float dp = acc_dp(i) * dp_scale;
        if constexpr (T::kDropout) dp = (kept >> i) & 1u ? dp : 0.f;
        ds16(i) = static_cast<Element>(acc_s(i) * (dp - d_s[q] * scale));
      }
    }
    if constexpr (T::kGeneral) issue_dv(p16, stage);

    // dS^T to shared memory as dS (query, key), queries contiguous: the accumulator's 8 x 8
    // blocks (keys by queries) are stmatrix's layout, four per instruction.  (One 32-bit store
    // per pair of queries compiled to generic stores, each with its own 64-bit address and
    // swizzle arithmetic: ~6 instructions per word.)
    {
      auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
      auto thr = r2s.get_thread_slice(me * 128 + tid);
      Tensor src = thr.retile_S(make_tensor(ds16.data(), typename AccS::layout_type{}));
      // The same buffers as (key, query, buffer).
      Tensor dst = thr.partition_D(make_tensor(sdS.data(), typename T::SmemLayoutdSt{}));
      cute::copy(r2s, src, dst(_, _, _, buf));
    }
    cutlass::arch::fence_view_async_shared();  // visible to wgmma (the async proxy)

    // Both warpgroups' dS written: dQ = dS K (this warpgroup's rows or head-dim half), issued
    // before dK += dS^T Q, so that dQ's staging and reduction run under the dK GEMM.
    cutlass::arch::NamedBarrier::sync(256, 0);
    AccdQ acc_dq = partition_fragment_C(mma_dq, Shape<Int<kM>, Int<kD>>{});
    warpgroup_fence_operand(acc_dq);
    warpgroup_arrive();
    gemm_zero(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
    warpgroup_commit_batch();
    issue_dk(ds16, stage);
    warpgroup_wait<1>();  // dV and dQ (dK may run on)
    warpgroup_fence_operand(acc_dq);
    // (Whole tiles: the dQ buffer has rows for every query block, zeros added past seqlen_q.)
    BwdDq<T>::add(acc_dq, dq_staging, me, tid, first);
    warpgroup_wait<0>();  // dK
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(p16);
    warpgroup_fence_operand(ds16);
  }

  // Rows [first, kRows) of a (kRows, kD) tile of the swizzled layout become zeros, written by
  // this warpgroup's 128 threads, then made visible to its wgmma (packed sequences: rows past
  // the sequence's end, bwd_kernel.h).  16-byte chunks are contiguous under the swizzle.
  template <typename Tile>
  __device__ __forceinline__ static void zero_rows(Tile&& tile, int first, int last, int tid) {
    constexpr int kChunks = kD / 8;
#pragma unroll 1
    for (int i = tid; i < (last - first) * kChunks; i += 128) {
      const int r = first + i / kChunks, col = (i % kChunks) * 8;
      *reinterpret_cast<uint4*>(&tile(r, col)) = make_uint4(0, 0, 0, 0);
    }
  }
  // Keys from `first` of the block (relative to n0) of this warpgroup's 64: zeros in K and V.
  __device__ __forceinline__ void zero_kv_rows(typename T::SharedStorage& smem, int64_t first,
                                               int me, int tid) {
    const int lo = 64 * me, hi = 64 * me + 64;
    const int from = first < lo ? lo : first > hi ? hi : static_cast<int>(first);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutK{});
    zero_rows(sK, from, hi, tid);
    zero_rows(sV, from, hi, tid);
    cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before wgmma reads
    cutlass::arch::NamedBarrier::sync(128, 1 + me);
  }
  // Query rows from `first` of ring stage `stage`: zeros in Q and dO.  Both warpgroups read
  // all rows of the stage; each writes the same zeros before its own GEMMs (the stage is
  // refilled only after both released it).
  __device__ __forceinline__ void zero_qdo_rows(typename T::SharedStorage& smem, int stage,
                                                int first, int me, int tid) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutQ{});
    zero_rows(sQ(_, _, stage), first < 0 ? 0 : first, kM, tid);
    zero_rows(sdO(_, _, stage), first < 0 ? 0 : first, kM, tid);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 1 + me);
  }

  // dK and dV rows row_base .. of k / v (the block's keys, keys_left of them exist; columns
  // cut at head_dim / head_dim_v) from the accumulators (store_kv_accumulator).
  __device__ __forceinline__ void store_dkdv(const BwdParams& p, int64_t row_base,
                                             int64_t keys_left, int32_t b, int32_t hk) const {
    const int key0 = get<0>(tdKcdK(0)), c0 = get<1>(tdKcdK(0));
    const int64_t row0 = row_base + key0;
    const int rows_left = static_cast<int>(keys_left - key0 < kN ? keys_left - key0 : kN);
    store_kv_accumulator(acc_dk, tdKcdK,
                         static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                             hk * p.dk_head_stride + row0 * p.dk_row_stride + c0,
                         p.dk_row_stride, rows_left, static_cast<int>(p.head_dim) - c0);
    store_kv_accumulator(acc_dv, tdKcdK,
                         static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                             hk * p.dv_head_stride + row0 * p.dv_row_stride + c0,
                         p.dv_row_stride, rows_left, static_cast<int>(p.head_dim_v) - c0);
  }

  // Whether store_dkdv_staged may store this call's dK and dV: 16-byte aligned rows and head
  // dims of whole 16-byte chunks (the glue's buffers always are: kernel_ready pads the head
  // dim to 8 and new_output_like keeps those strides) and not turned off
  // (KernelOptions::sm90_direct_epilogue, experimental: both compared in one build).
  __device__ __forceinline__ static bool staged_store_fits(const BwdParams& p) {
    const int64_t strides = p.dk_row_stride | p.dk_head_stride | p.dk_batch_stride |
                            p.dv_row_stride | p.dv_head_stride | p.dv_batch_stride |
                            p.head_dim | p.head_dim_v;
    const uintptr_t bases = reinterpret_cast<uintptr_t>(p.dk) | reinterpret_cast<uintptr_t>(p.dv);
    return !p.sm90_direct_epilogue && strides % 8 == 0 && bases % 16 == 0;
  }

  // dK and dV rows row_base .. (keys_left of the block's keys exist) through shared memory
  // (stage_kv_rows, copy_kv_rows): each warpgroup's 64 keys into its own rows of the K and V
  // tiles (sk, sv: free once both warpgroups' last GEMMs have read them, the caller's
  // barrier).
  __device__ __forceinline__ void store_dkdv_staged(const BwdParams& p, Element* sk, Element* sv,
                                                    int64_t row_base, int64_t keys_left,
                                                    int32_t b, int32_t hk, int me,
                                                    int tid) const {
    static_assert(kN == 128, "two warpgroups of 64 keys");
    stage_kv_rows<kD>(acc_dk, sk + 64 * me * kD, tid);
    stage_kv_rows<kD>(acc_dv, sv + 64 * me * kD, tid);
    cutlass::arch::NamedBarrier::sync(128, 1 + me);  // (this warpgroup's rows only)
    const int64_t left = keys_left - 64 * me;
    const int rows = static_cast<int>(left < 64 ? left : 64);
    const int64_t row0 = row_base + 64 * me;
    copy_kv_rows<kD>(sk + 64 * me * kD,
                     static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                         hk * p.dk_head_stride + row0 * p.dk_row_stride,
                     p.dk_row_stride, rows, static_cast<int>(p.head_dim), tid);
    copy_kv_rows<kD>(sv + 64 * me * kD,
                     static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                         hk * p.dv_head_stride + row0 * p.dv_row_stride,
                     p.dv_row_stride, rows, static_cast<int>(p.head_dim_v), tid);
  }
};

}  // namespace flash_attn_ext::sm90
