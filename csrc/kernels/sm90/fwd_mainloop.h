// The Hopper forward's consumer main loop: per K/V tile, S = Q K^T (wgmma, both operands in
// shared memory, fp32 accumulators in registers), mask and online softmax (fwd_softmax.h), then
// O = O * exp2(m_old - m_new) + P V with P converted to 16 bits in registers and fed to wgmma as
// its register A operand (the accumulator layout of S and the A-operand layout of P V hold the
// same rows and columns per thread).  The consumer warpgroups take turns issuing their GEMMs
// (pingpong, PingpongRing), and within a warpgroup tile n's Q K^T is issued together with tile
// n-1's P V (FlashAttention-3, arXiv:2407.08608, sections 3.1-3.2).
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/sm80/dropout.h"
#include "kernels/sm80/score.h"
#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/fwd_mask.h"
#include "kernels/sm90/fwd_softmax.h"
#include "kernels/sm90/fwd_tile_scheduler.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_attn_ext::sm90 {

// Pingpong (FlashAttention-3, section 3.1): the consumer warpgroups take turns issuing their
// GEMMs, in a ring, so one's softmax runs while the others' GEMMs occupy the tensor cores.
// Named barrier `me` lets this warpgroup issue; after issuing, it lets the next one.  A tile's
// first Q K^T is issued outside the ring, by every warpgroup as soon as it is ready (their
// start then lies closer together: measured +0..+5% at L <= 4k; starting the ring earlier
// for the first warpgroup instead, or running it on across tiles, measured 2-9% slower at
// every L); after issuing it the last warpgroup opens the first turn for the first, and it
// skips its own last hand-over, so every barrier sees as many arrivals as waits.  All
// warpgroups have the same number of turns in a tile (one per key tile after the first,
// plus one for the last P V).
template <int kConsumers>
struct PingpongRing {
  static constexpr int kLastWg = kConsumers - 1;
  const int me, next;  // this consumer warpgroup (0 .. kLastWg) and the one after it

  __device__ __forceinline__ explicit PingpongRing(int me_)
      : me(me_), next(me_ == kLastWg ? 0 : me_ + 1) {}

  __device__ __forceinline__ void turn_begin() const {
    cutlass::arch::NamedBarrier::sync(256, me);
  }
  __device__ __forceinline__ void turn_end(bool last) const {
    if (!(last && me == kLastWg)) cutlass::arch::NamedBarrier::arrive(256, next);
  }
  __device__ __forceinline__ void open_ring() const {
    if (me == kLastWg) cutlass::arch::NamedBarrier::arrive(256, next);
  }
};

// Dropout on a tile's P (the general and dropout variants): the row id of the tile's (batch,
// head) row 0, and this thread's first row (dropout.h).
struct TileDropout {
  int64_t row_base;
  int32_t row0;
};

// One consumer thread's GEMM operands and accumulators, and the loop over a tile's key tiles.
template <typename T>
struct FwdMainloop {
  using Element = typename T::Element;
  using TiledMmaQK = typename T::TiledMmaQK;
  using TiledMmaPV = typename T::TiledMmaPV;
  using Pipeline = typename T::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim;

  // The shared tiles (SharedStorage q, k, v; V also as (head_dim, keys, stage)).
  using SmemQ = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                     typename T::SmemLayoutQ{}));
  using SmemKV = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                      typename T::SmemLayoutKV{}));
  using SmemVt = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                      typename T::SmemLayoutVt{}));
  // The ALiBi fold's operands (Sm90FwdTraits::kAlibiFold; every variant has the types).
  using SmemQFold = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                         typename T::SmemLayoutQFold{}));
  using SmemKFold = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                         typename T::SmemLayoutKFold{}));
  using ThrQK = decltype(std::declval<TiledMmaQK&>().get_thread_slice(0));
  using ThrPV = decltype(std::declval<TiledMmaPV&>().get_thread_slice(0));
  using FragQ = decltype(std::declval<ThrQK&>().partition_fragment_A(std::declval<SmemQ&>()));
  using FragK = decltype(std::declval<ThrQK&>().partition_fragment_B(std::declval<SmemKV&>()));
  using FragV = decltype(std::declval<ThrPV&>().partition_fragment_B(std::declval<SmemVt&>()));
  using FragQFold =
      decltype(std::declval<ThrQK&>().partition_fragment_A(std::declval<SmemQFold&>()));
  using FragKFold =
      decltype(std::declval<ThrQK&>().partition_fragment_B(std::declval<SmemKFold&>()));
  using FragS = decltype(partition_fragment_C(std::declval<TiledMmaQK&>(),
                                              Shape<Int<kM>, Int<kN>>{}));
  using FragO = decltype(partition_fragment_C(std::declval<TiledMmaPV&>(),
                                              Shape<Int<kM>, Int<kD>>{}));
  using FragP =
      decltype(make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kN / 16>>>{}));
  using CoordS = decltype(std::declval<ThrQK&>().partition_C(
      make_identity_tensor(Shape<Int<kM>, Int<kN>>{})));
  using CoordO = decltype(std::declval<ThrPV&>().partition_C(
      make_identity_tensor(Shape<Int<kM>, Int<kD>>{})));

  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  FragQ tSrQ;  // shared-memory descriptors
  FragK tSrK;  // (MMA, MMA_N, MMA_K, stage)
  FragV tOrV;
  FragQFold tSrQF;  // the ALiBi fold's K step (kAlibiFold; unused elsewhere)
  FragKFold tSrKF;
  FragS tSrS;  // S, fp32, then P in fp32 (the softmax works in place)
  FragO tOrO;  // O, fp32
  FragP tOrP;  // P in 16 bits: P V's register A operand
  // (row, column) of every accumulator element of this thread, within the tile.
  CoordS tScS;
  CoordO tOcO;

  // wgmma's m64nNk16 accumulator layout (s_index, fwd_traits.h).
  static constexpr int kSVals = decltype(size(std::declval<FragS&>()))::value;
  static constexpr int kOVals = decltype(size(std::declval<FragO&>()))::value;
  static_assert(kSVals == kN / 2 && kOVals == kD / 2, "unexpected wgmma accumulator layout");
  static_assert(decltype(size(std::declval<FragP&>()))::value == kSVals, "");

  // ctid: 0 .. 128 * kConsumers - 1 over the consumer warpgroups.  sQF, sKF: the ALiBi fold's
  // tiles (kAlibiFold; elsewhere any address: nothing reads them).
  __device__ __forceinline__ FwdMainloop(int ctid, SmemQ& sQ, SmemKV& sK, SmemVt& sVt,
                                         SmemQFold sQF, SmemKFold sKF)
      : tSrQ(mma_qk.get_thread_slice(ctid).partition_fragment_A(sQ)),
        tSrK(mma_qk.get_thread_slice(ctid).partition_fragment_B(sK)),
        tOrV(mma_pv.get_thread_slice(ctid).partition_fragment_B(sVt)),
        tSrQF(mma_qk.get_thread_slice(ctid).partition_fragment_A(sQF)),
        tSrKF(mma_qk.get_thread_slice(ctid).partition_fragment_B(sKF)),
        tSrS(partition_fragment_C(mma_qk, Shape<Int<kM>, Int<kN>>{})),
        tOrO(partition_fragment_C(mma_pv, Shape<Int<kM>, Int<kD>>{})),
        tScS(mma_qk.get_thread_slice(ctid).partition_C(
            make_identity_tensor(Shape<Int<kM>, Int<kN>>{}))),
        tOcO(mma_pv.get_thread_slice(ctid).partition_C(
            make_identity_tensor(Shape<Int<kM>, Int<kD>>{}))) {}

  __device__ __forceinline__ void convert_p() {
#pragma unroll
    for (int i = 0; i < kSVals; ++i) tOrP(i) = static_cast<Element>(tSrS(i));
  }
  // wgmma issue without waiting: S = Q K^T into tSrS, O += P V into tOrO (one commit group
  // each).  kFold: plus the ALiBi fold's K step, slope / scale * (j - j0) (kAlibiFold).
  template <bool kFold = false>
  __device__ __forceinline__ void issue_qk(int stage, int qs) {
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_qk, tSrQ(_, _, kb, qs), tSrK(_, _, kb, stage), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    if constexpr (kFold) cute::gemm(mma_qk, tSrQF(_, _, 0), tSrKF(_, _, 0), tSrS);
    warpgroup_commit_batch();
  }

  // The ALiBi fold's key operand, once per CTA (kAlibiFold): row jj of KFold is [jj, jj, jj,
  // 0, ...] (jj < kBlockN, exact in 16 bits), so that S gains sum_k QFold[i][k] * jj = v * jj.
  // By all threads, before the CTA's first barrier; the caller fences it for wgmma.
  __device__ __forceinline__ static void write_fold_keys(Element* k_fold) {
    Tensor sKF = make_tensor(make_smem_ptr(k_fold), typename T::SmemLayoutKFold{});
    constexpr int kCols = T::kFoldCols;
    for (int i = threadIdx.x; i < kN * kCols; i += T::kThreads) {
      const int jj = i / kCols, col = i % kCols;
      sKF(jj, col) = Element(col < 3 ? static_cast<float>(jj) : 0.f);
    }
  }
  // This warpgroup's 64 rows of QFold: [v1, v2, v3, 0, ...], v = v1 + v2 + v3 (fwd_kernel.h's
  // fold_alibi); written before the tile's first Q K^T, then made visible to wgmma.  Only this
  // warpgroup's GEMMs read its rows, and the previous tile's last one is done: every thread
  // waited for it before that tile's last ring.turn_begin(), a barrier of all 128 threads.
  __device__ __forceinline__ static void write_fold_slope(Element* q_fold, const float (&v)[3],
                                                          int me) {
    Tensor sQF = make_tensor(make_smem_ptr(q_fold), typename T::SmemLayoutQFold{});
    constexpr int kCols = T::kFoldCols;  // 64 x 16 values over 128 threads: 8 each
    const int t = threadIdx.x % 128, row = 64 * me + t / 2, c0 = (t % 2) * 8;
#pragma unroll
    for (int c = 0; c < kCols / 2; ++c)  // (constant indices into v: it stays in registers)
      sQF(row, c0 + c) = Element(c0 == 0 && c < 3 ? v[c] : 0.f);
    cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before wgmma reads
    warpgroup_sync<T>(me);
  }
  __device__ __forceinline__ void issue_pv(int stage) {
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    mma_pv.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tOrP); ++kb) {
      cute::gemm(mma_pv, tOrP(_, _, kb), tOrV(_, _, kb, stage), tOrO);
    }
    warpgroup_commit_batch();
  }

  // The general variant (T::kGeneral): softcap, bias and ALiBi on S of the key tile whose
  // first column of this thread is col0, by the rule every CUDA kernel applies
  // (sm80::ScoreFn).
  // rows: this thread's two rows clamped into [0, seqlen_q) (the values of rows past the end
  // are never stored).  The bias comes straight from global memory (L2: the heads and query
  // blocks of a broadcast mask share its lines), its keys unit-stride (a row pointer, so each
  // value's offset is an immediate) or broadcast (one value per row; prepare_bias ensures one
  // of the two); columns past seqlen_k read nothing (the mask hides them: such a tile is never
  // interior).
  // `cls`: the bias's class on this warpgroup's rows and the key tile (bias_blocks.h): all 0
  // reads nothing, all -inf sets -inf without reading.
  __device__ __forceinline__ void modify_scores(const sm80::ScoreFn& fn, const int32_t (&rows)[2],
                                                int32_t col0, int32_t seqlen_k, int cls) {
    const int32_t limit = seqlen_k - col0;  // this thread's columns s_col(c) < limit exist
    if (cls == kBlockMasked) {
#pragma unroll
      for (int i = 0; i < kSVals; ++i) tSrS(i) = -INFINITY;
      return;
    }
    // Two copies, with and without ALiBi, so that calls without it issue none of its
    // instructions (a per-value test leaves them predicated in the loops).
    auto modify = [&](auto with_alibi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // ALiBi's distance i + off - j at this row's column col0 (column c's: dist0 - s_col(c)).
        const float dist0 = static_cast<float>(rows[r] + fn.alibi_offset - col0);
        if (fn.bias == nullptr || cls == kBlockVisible) {
#pragma unroll
          for (int c = 0; c < kSVals / 2; ++c) {
            float& x = tSrS(s_index(r, c));
            fn.transform(x);
            if constexpr (decltype(with_alibi)::value) fn.add_alibi(x, dist0 - s_col(c));
            fn.to_log2(x);
          }
        } else if (fn.bias_col_stride != 0) {
          const float* row_bias = fn.bias + rows[r] * fn.bias_row_stride + col0;
#pragma unroll
          for (int c = 0; c < kSVals / 2; ++c) {
            float& x = tSrS(s_index(r, c));
            fn.transform(x);
            x += s_col(c) < limit ? row_bias[s_col(c)] : 0.f;
            if constexpr (decltype(with_alibi)::value) fn.add_alibi(x, dist0 - s_col(c));
            fn.to_log2(x);
          }
        } else {
          const float b = fn.bias[rows[r] * fn.bias_row_stride];
#pragma unroll
          for (int c = 0; c < kSVals / 2; ++c) {
            float& x = tSrS(s_index(r, c));
            fn.transform(x);
            x += b;
            if constexpr (decltype(with_alibi)::value) fn.add_alibi(x, dist0 - s_col(c));
            fn.to_log2(x);
          }
        }
      }
    };
    if (fn.alibi)
      modify(cute::true_type{});
    else
      modify(cute::false_type{});
  }

  // The mask variant (T::kMask): a boolean mask on S of key tile n_block, whose first column of
  // this thread is col0.  mask_bh: the mask at the (batch, head)'s row 0, key 0 (bias strides:
  // keys unit-stride, or broadcast when per_key is false); rows: as modify_scores's.  `cls`,
  // the mask's class on this warpgroup's rows and the tile (bias_blocks.h): all visible changes
  // nothing, all masked gives -inf, mixed reads a byte per score (columns past seqlen_k read
  // nothing: the mask hides them), or for a row whose mask row is a key interval
  // (RowMask::interval_rows) compares the columns with its bounds (a causal + padding mask's
  // diagonal blocks: the bytes' loads came after the wait for S, their latency exposed).
  // Hidden scores become -inf, which the softmax turns into 0.
  __device__ __forceinline__ void mask_scores(const uint8_t* mask_bh, int64_t row_stride,
                                              bool per_key, const int32_t (&rows)[2],
                                              int32_t col0, int32_t seqlen_k, int cls,
                                              const RowMask<T>& bounds, int n_block) {
    if (cls == kBlockVisible) return;
    if (cls == kBlockMasked) {
#pragma unroll
      for (int i = 0; i < kSVals; ++i) tSrS(i) = -INFINITY;
      return;
    }
    const int32_t limit = seqlen_k - col0;  // this thread's columns s_col(c) < limit exist
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if ((bounds.interval_rows >> r) & 1u) {
        bounds.hide_outside(tSrS, r, n_block * kN);
        continue;
      }
      const uint8_t* row = mask_bh + rows[r] * row_stride;
      if (per_key) {
        row += col0;
#pragma unroll
        for (int c = 0; c < kSVals / 2; ++c) {
          const bool hidden = s_col(c) < limit && row[s_col(c)] == 0;
          float& x = tSrS(s_index(r, c));
          x = hidden ? -INFINITY : x;
        }
      } else {
        const bool hidden = row[0] == 0;
#pragma unroll
        for (int c = 0; c < kSVals / 2; ++c) {
          float& x = tSrS(s_index(r, c));
          x = hidden ? -INFINITY : x;
        }
      }
    }
  }

  // Packed sequences: rows [first_row, kN) of V stage `stage` (keys past the sequence's end:
  // the next sequence's values, or TMA's zeros past the tensor) become zeros before the last
  // key tile's P V, which weighs them 0 but would carry a NaN or inf there through (0 * inf).
  // Each consumer warpgroup zeroes them before its own P V: they all write the same zeros, and
  // the producer refills the stage only after every warpgroup released it.
  __device__ __forceinline__ static void zero_v_rows(Element* v_smem, int stage, int first_row,
                                                     int me) {
    Tensor sV = make_tensor(make_smem_ptr(v_smem), typename T::SmemLayoutKV{});
    constexpr int kChunks = kD / 8;  // 16-byte chunks per row (contiguous under the swizzle)
#pragma unroll 1
    for (int i = threadIdx.x % 128; i < (kN - first_row) * kChunks; i += 128) {
      const int r = first_row + i / kChunks, col = (i % kChunks) * 8;
      *reinterpret_cast<uint4*>(&sV(r, col, stage)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before wgmma reads
    warpgroup_sync<T>(me);
  }

  // A warpgroup whose 64 rows do not exist (warpgroup_idle) issues no GEMMs and no softmax; it
  // still waits for and releases every K/V stage and takes its pingpong turns, so the other
  // warpgroups' barriers count as usual.  (At head dim 64, seqlen 1024 = 5 1/3 tiles of 192
  // rows: without this, the partial tile's two empty warpgroups cost the tensor cores a full
  // tile.)  The same waits, releases and turns as compute_tile, without the math.  Returns
  // the K/V pipeline state after the tile's stages.
  // (next: the key tile after n_block that the tile computes, see compute_tile.)
  template <typename Next>
  __device__ __forceinline__ static PipelineState idle_tile(
      Pipeline& pipe_k, Pipeline& pipe_v, PipelineState state,
      const PingpongRing<T::kConsumers>& ring, int n_begin, int n_end, uint64_t* q_empty,
      const Next& next) {
    auto prev = state;
    for (int n_block = n_begin; n_block < n_end; n_block = next(n_block)) {
      pipe_k.consumer_wait(state);
      if (n_block > n_begin) {
        pipe_v.consumer_wait(prev);
        ring.turn_begin();
        ring.turn_end(false);
      } else {
        ring.open_ring();  // as the first Q K^T in compute_tile: outside the ring
      }
      pipe_k.consumer_release(state);
      if (n_block + 1 == n_end) release_q(q_empty);
      if (n_block > n_begin) pipe_v.consumer_release(prev);
      prev = state;
      ++state;
    }
    pipe_v.consumer_wait(prev);
    ring.turn_begin();
    ring.turn_end(true);
    pipe_v.consumer_release(prev);
    return state;
  }

  // Key tiles [n_begin, n_end) of a tile (n_begin < n_end) into O, m and l; Q in buffer qs.
  // Releases the Q buffer (q_empty) after the wait that covers the last Q K^T.  Returns the
  // K/V pipeline state after the tile's stages.  next(n_block): the key tile after n_block
  // that the tile computes (n_block + 1, or in the general and mask variants the next one the
  // bias does not mask for the whole tile; n_end - 1 is computed).  blocks: the bias's
  // WarpTileBlocks of the tile (bias_blocks.h), whose row class `me` (this warpgroup's rows)
  // per key tile modify_scores and mask_scores take; fn, score_rows: modify_scores's (the
  // general variant's);
  // dropout: applied to P after the softmax's row sums, which count every element (as the LSE).
  // mask_bh: the mask variant's boolean mask (mask_scores), nullptr in the others.
  // key_limit, v_smem: packed sequences' keys and the V ring (zero_v_rows); unused elsewhere.
  // kFixedMax: the softmax's steps with its fixed reference max (OnlineSoftmax::fixed_max).
  // kFold: the ALiBi variant with its term in the GEMM (Sm90FwdTraits::kAlibiFold; the caller
  // wrote QFold and set the softmax's factor to scale log2 e): no per-score term, the softmax
  // adds each tile's shift (fold_shift).
  template <bool kFixedMax, bool kFold = false, typename Next, typename Blocks>
  __device__ __forceinline__ PipelineState compute_tile(const Sm90FwdArgs<T>& args,
                                               Pipeline& pipe_k, Pipeline& pipe_v,
                                               PipelineState state,
                                               const PingpongRing<T::kConsumers>& ring,
                                               OnlineSoftmax<T>& softmax, const RowMask<T>& mask,
                                               int n_begin, int n_end, int qs,
                                               uint64_t* q_empty, const sm80::ScoreFn& fn,
                                               const int32_t (&score_rows)[2], const Next& next,
                                               const Blocks& blocks, int me,
                                               const TileDropout& dropout,
                                               const uint8_t* mask_bh, int32_t key_limit = 0,
                                               Element* v_smem = nullptr) {
    float alpha[2];
    // The general and mask variants walk the key tiles with the summary one tile ahead: the
    // classes of the tile after this one are loaded (WarpTileBlocks) before this tile's waits
    // and tested after its softmax, so their latency runs under the GEMMs.  (Loaded where they were
    // used, after the wait for S and at the loop's end, the dependent loads stood between
    // Q K^T and the softmax and before each tile's first wait: the mask variant with a mask
    // that hides nothing ran 28% slower than the plain kernel.)
    constexpr bool kSkip = T::kSkipMasked;  // (the general and mask variants)
    // (Tiles in the warpgroup's visible run need neither the classes nor a vote.)
    auto ahead = [&](int n_block) {
      return kSkip && n_block < n_end && !blocks.visible(n_block) ? blocks.load(args.p, n_block)
                                                                  : int{kBlockMasked};
    };
    // After tile n_block whose successor's classes are in `after`: the next tile the bias does
    // not mask for every row (next(), tile by tile, for the rare run of such tiles), and its
    // classes in `after`.
    auto advance = [&](int n_block, int& after) {
      int n = n_block + 1;
      if constexpr (kSkip) {
        if (n < n_end && !blocks.visible(n) && Blocks::all_masked(after)) {
          n = next(n);
          after = ahead(n);
        }
      }
      return n;
    };
    // The ALiBi variant's factors (Sm90FwdTraits::kAlibi): the scores in log2 units.
    const float alibi_scale_log2 = T::kAlibi ? fn.scale * sm80::ScoreFn::kLog2e : 0.f;
    const float alibi_slope_log2 = T::kAlibi ? fn.alibi_slope * sm80::ScoreFn::kLog2e : 0.f;
    // The one-sided tiles' per-column term (modify) rounds slope log2 e (j0 - i0 - off) once
    // more than |.| per score does: an error of about |slope| 2^-17 in the exponent near the
    // diagonal, where |.| per score has none.  Steeper heads (more than 16 in log2 units per
    // key, slope ~11; real ALiBi slopes are at most 1) take |.| per score everywhere, and row
    // half 1 carries no constant (which, at slopes near fp32's range, would be inf).
    const bool alibi_columns = T::kAlibi && fabsf(alibi_slope_log2) <= 16.f;
    const float alibi_shift1 =
        alibi_columns ? alibi_slope_log2 * static_cast<float>(score_rows[1] - score_rows[0])
                      : 0.f;
    if constexpr (T::kAlibi) softmax.lse_shift1 = alibi_shift1;
    static_assert(!kFold || T::kAlibiFold, "");
    // The fold's per-tile part of the term for row half 0, slope log2 e (j0 - i0 - off) at the
    // tile's first key j0 (row half 1 shares it: alibi_shift1 as above; the fold is taken only
    // where alibi_columns holds).
    auto fold_shift = [&](int n_block) {
      return kFold ? alibi_slope_log2 * static_cast<float>(static_cast<int64_t>(n_block) * kN -
                                                           score_rows[0] - fn.alibi_offset)
                   : 0.f;
    };
    auto modify = [&](int n_block, int c) {
      if constexpr (T::kSoftcap) {  // (Sm90FwdTraits::kSoftcap: t = tanh(x * scale / softcap))
#pragma unroll
        for (int i = 0; i < kSVals; ++i) tSrS(i) = sm80::tanh_approx(tSrS(i) * fn.cap_inv_scale);
      }
      if constexpr (T::kAlibi && !kFold) {
        // Each score x becomes x * scale log2 e - slope log2 e |i + off - j| + shift[r], where
        // shift = {0, slope log2 e (i1 - i0)} (alibi_shift1) is a per-row constant that the
        // softmax cancels and the LSE takes back (OnlineSoftmax::lse_shift1): with it both row
        // halves share row half 0's distances.  Where no key this thread may see in the tile
        // lies right of its rows' diagonal (i + off - j >= 0; every tile under a causal mask),
        // |i + off - j| = i + off - j and the term is a column's alone, k(c) = slope log2 e
        // (j - i0 - off): one FFMA per column, shared by both rows, and one per score.  Other
        // tiles take |.| per score (an FADD, an FMUL or FFMA, an FFMA).  The choice is per warp
        // (a vote), so a warp does not run both.
        const int32_t col0 = n_block * kN + mask.thread_col;
        bool one_sided = true;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // The last key of this tile row half r may see (key_hi is relative to thread_col).
          const int32_t last = min(n_block * kN + kN - 1, mask.key_hi[r] + mask.thread_col - 1);
          one_sided = one_sided && score_rows[r] + fn.alibi_offset - last >= 0;
        }
        if (__all_sync(0xffffffff, one_sided && alibi_columns)) {
          const float base =
              alibi_slope_log2 * static_cast<float>(col0 - score_rows[0] - fn.alibi_offset);
#pragma unroll
          for (int c2 = 0; c2 < kSVals / 2; ++c2) {
            const float k = fmaf(alibi_slope_log2, static_cast<float>(s_col(c2)), base);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float& x = tSrS(s_index(r, c2));
              x = fmaf(x, alibi_scale_log2, k);
            }
          }
        } else {
          // The distance at this thread's first column of the tile, dist0, less the column's
          // compile-time offset (one FADD).
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float dist0 = static_cast<float>(score_rows[r] + fn.alibi_offset - col0);
            const float shift = r == 0 ? 0.f : alibi_shift1;
#pragma unroll
            for (int c2 = 0; c2 < kSVals / 2; ++c2) {
              float& x = tSrS(s_index(r, c2));
              x = fmaf(-alibi_slope_log2, fabsf(dist0 - s_col(c2)),
                       fmaf(x, alibi_scale_log2, shift));
            }
          }
        }
      }
      if constexpr (T::kGeneral)
        modify_scores(fn, score_rows, n_block * kN + mask.thread_col,
                      static_cast<int32_t>(args.p.seqlen_k), c);
      if constexpr (T::kMask)
        mask_scores(mask_bh, args.p.bias_row_stride, args.p.bias_col_stride != 0, score_rows,
                    n_block * kN + mask.thread_col, static_cast<int32_t>(args.p.seqlen_k), c,
                    mask, n_block);
    };
    // Dropped elements of P become 0 (the keep bits' order is the accumulator's, dropout.h).
    // The dropout variant (T::kDropout) draws a tile's keep bits (keep) before waiting for its
    // Q K^T, so that the Philox rounds run under the GEMMs, and applies them (drop_kept) after
    // the softmax's row sums.
    auto keep = [&](int n_block) -> uint64_t {
      if constexpr (T::kDropout) {
        const sm80::DropoutFn dropout_fn(args.p);  // (as below)
        return dropout_fn.template keep_bits<kN / 8, true>(dropout.row_base, dropout.row0,
                                                           n_block * kN + mask.thread_col);
      }
      return 0;
    };
    auto drop_kept = [&](uint64_t kept) {
      if constexpr (T::kDropout) {
#pragma unroll
        for (int i = 0; i < kSVals; ++i)
          if (!((kept >> i) & 1u)) tSrS(i) = 0.f;
      }
    };
    auto drop = [&](int n_block) {
      if constexpr (T::kGeneral) {
        // (Built here from the kernel parameters rather than kept in registers across the
        // loop: seed and offset come from the constant bank, or under CUDA-graph capture by two
        // global loads per key tile through their pointers.)
        const sm80::DropoutFn dropout_fn(args.p);
        if (dropout_fn.enabled) {
          const uint64_t kept = dropout_fn.template keep_bits<kN / 8, true>(
              dropout.row_base, dropout.row0, n_block * kN + mask.thread_col);
#pragma unroll
          for (int i = 0; i < kSVals; ++i)
            if (!((kept >> i) & 1u)) tSrS(i) = 0.f;
        }
      }
    };
    // Intra-warpgroup overlap (FlashAttention-3, section 3.2): tile n's Q K^T is issued
    // together with tile n-1's P V, and this tile's softmax runs while P V is still in flight.
    int c = !kSkip                    ? int{kBlockMixed}
            : blocks.visible(n_begin) ? int{kBlockVisible}
                                      : Blocks::row_class(blocks.load(args.p, n_begin), me);
    int after = ahead(n_begin + 1);
    pipe_k.consumer_wait(state);
    issue_qk<kFold>(state.index(), qs);  // outside the ring (see PingpongRing)
    ring.open_ring();
    uint64_t kept = keep(n_begin);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipe_k.consumer_release(state);
    if (n_begin + 1 == n_end) release_q(q_empty);
    modify(n_begin, c);
    softmax.template step<kFixedMax, kFold>(tSrS, mask, n_begin, alpha,
                                                 fold_shift(n_begin));
    drop(n_begin);
    drop_kept(kept);
    convert_p();
    auto prev = state;
    ++state;
    for (int n_block = advance(n_begin, after); n_block < n_end;) {
      // (Inside the visible run, with the next tile in it too, no class is loaded or asked
      // and the next tile is the next one: one test instead of the questions' ~25 instructions.)
      const bool in_run = kSkip && n_block >= blocks.visible_begin &&
                          n_block + 1 < blocks.visible_end;
      if constexpr (kSkip) {
        if (in_run) {
          c = int{kBlockVisible};
        } else {
          c = blocks.visible(n_block) ? int{kBlockVisible} : Blocks::row_class(after, me);
          after = ahead(n_block + 1);
        }
      }
      pipe_k.consumer_wait(state);
      pipe_v.consumer_wait(prev);
      ring.turn_begin();
      issue_qk<kFold>(state.index(), qs);
      issue_pv(prev.index());
      ring.turn_end(false);
      kept = keep(n_block);
      warpgroup_wait<1>();  // S of this tile is ready; P V of the previous one may still run
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(state);
      if (n_block + 1 == n_end) release_q(q_empty);
      modify(n_block, c);
      softmax.template step<kFixedMax, kFold>(tSrS, mask, n_block, alpha,
                                                   fold_shift(n_block));
      drop(n_block);
      drop_kept(kept);
      if constexpr (T::kWaitPvAfterSoftmax) {
        // ptxas hoists a wgmma wait to the start of its basic block.  Written plainly here,
        // that block begins after the mask branch, before the max, so the softmax would not
        // overlap this P V.  A branch right here, with the wait in both arms, keeps the wait
        // after the softmax.  Its condition must be the same for the whole warpgroup
        // (wgmma.wait_group is .aligned: all 128 threads must execute the same instruction),
        // and ptxas must not know its value: num_tiles > 0, which is true for every tile (the
        // launcher does not launch without tiles), so the second arm, which skips the rescale,
        // never runs.  (The warp's rescale vote comes first, so that it runs with the softmax.)
        const bool rescale = __any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f);
        if (args.num_tiles > 0) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          pipe_v.consumer_release(prev);
          if (rescale) softmax.rescale_o(tOrO, alpha, false);
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          pipe_v.consumer_release(prev);
        }
      } else {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        pipe_v.consumer_release(prev);
        softmax.rescale_o(tOrO, alpha, true);
      }
      convert_p();
      prev = state;
      ++state;
      n_block = in_run ? n_block + 1 : advance(n_block, after);
    }
    pipe_v.consumer_wait(prev);
    if constexpr (T::kVarlen) {  // (the last tile is n_end - 1: the plain kernel skips none)
      const int32_t first_row = key_limit - (n_end - 1) * kN;  // > 0: n_end covers key_limit
      if (first_row < kN) zero_v_rows(v_smem, prev.index(), first_row, me);
    }
    ring.turn_begin();
    issue_pv(prev.index());
    ring.turn_end(true);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    pipe_v.consumer_release(prev);
    return state;
  }
};

}  // namespace flash_attn_ext::sm90
