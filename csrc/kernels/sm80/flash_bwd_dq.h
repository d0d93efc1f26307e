// The skeleton both dQ kernels share (flash_bwd_dq_kernel, 4 warps, flash_bwd_kernel.cuh;
// flash_bwd_dq_lean_kernel, 8 warps, flash_bwd_lean.cuh): one CTA per (query block, batch,
// head), Q and dO loaded once, K / V tiles streamed through a kStages-deep cp.async ring; per key
// tile S = Q K^T and dP = dO V^T, dS = P (dP - D), dQ += dS K; dQ stored once.
//
// A Step type supplies what differs:
//   Traits (Element, kHeadDim, kChunks, kThreads, kBlockMQ, kBlockNQ); kStages; kMT (16-row
//   m-tiles per warp), kS8 (n8 tiles of S per warp), kD8 (n8 tiles of dQ per warp);
//   kPrefetchFirst: the next tile's loads are issued before the wait for this one (4 warps), else
//     after the barrier, one group per stage, empty or not (8 warps);
//   scale_d(D): D as the Step's grad() takes it (the 8-warp kernel forms dS scaled);
//   kTwoCopies: the masked and unmasked tiles get separate code (block_info.h with_mask);
//   row0(warp), col0(warp): this warp's first query row and dQ column;
//   setup(...) once before the loop, then per tile scores(), grad(masked, ...) (dS into s) and
//   dq(), and kSyncAtEnd: a barrier after dq() (the stage is overwritten by the next prefetch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/sm80/block_info.h"
#include "kernels/sm80/softmax.h"
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

// What a Step's per-tile hooks may need besides its own state.
struct DqTile {
  const BwdParams& p;
  const VisibleKeys& vis;
  const SeqInfo& seq;  // the CTA's sequence (its lengths; packed sequences)
  int64_t m0, n_block;
  int warp, lane;
};

template <typename Step>
__device__ __forceinline__ void bwd_dq_body(const BwdParams& p, const float* delta,
                                            int64_t num_m_blocks, unsigned char* smem_raw) {
  using T = typename Step::Traits;
  using Element = typename T::Element;
  constexpr int kM = T::kBlockMQ, kN = T::kBlockNQ, kD = T::kHeadDim, kC = T::kChunks;
  constexpr int kStages = Step::kStages, kMT = Step::kMT;
  Element* q_s = reinterpret_cast<Element*>(smem_raw);
  Element* do_s = q_s + kM * kD;
  Element* kv_s = do_s + kM * kD;  // [stage][K | V], kN x kD each

  const QueryBlock blk(p, blockIdx.x, num_m_blocks, kM);
  const int64_t b = blk.b, h = blk.h, m0 = blk.m0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // This batch's sequence (packed sequences: its own rows and lengths; the grid covers the
  // longest, and blocks past this one's rows have nothing to do).
  const SeqInfo seq(p, b);
  if (m0 >= seq.len_q) return;

  const VisibleKeys vis = seq.visible(p);
  const VisibleKeys::Block keys = vis.block(m0, kM, seq.len_q, kN);
  const int64_t n_begin = keys.n_begin, n_end = keys.n_end;

  const auto* k = seq.k_rows<const Element>(p.k, p.k_batch_stride, p.k_row_stride,
                                            p.k_head_stride, b, blk.hk);
  const auto* v = seq.k_rows<const Element>(p.v, p.v_batch_stride, p.v_row_stride,
                                            p.v_head_stride, b, blk.hk);
  Step step(p, seq, b, h);

  auto load_kv = [&](int stage, int64_t n_block) {
    Element* dst = kv_s + stage * 2 * kN * kD;
    load_kv_async<Element, kN, kC, T::kThreads>(dst, dst + kN * kD, k, v, p, n_block * kN,
                                                seq.len_k);
  };
  if (n_begin < n_end) {
    load_q_do_async<Element, kM, kC, T::kThreads>(q_s, do_s, p, seq, b, h, m0);
    load_kv(0, n_begin);
    if constexpr (Step::kPrefetchFirst) cp_async_commit();
  }
  if constexpr (!Step::kPrefetchFirst) {
    cp_async_commit();
#pragma unroll
    for (int s = 1; s < kStages - 1; ++s) {
      if (n_begin + s < n_end) load_kv(s, n_begin + s);
      cp_async_commit();  // one group per stage, empty or not, keeps the wait counts fixed
    }
  }

  // This lane's rows: m0 + row0(warp) + 16 mt + lane / 4 + 8 r.
  float lse_row[kMT][2], d_row[kMT][2];
  const float* lse = static_cast<const float*>(p.softmax_lse) + seq.stats(p, b, h);
  const float* dlt = delta + seq.stats(p, b, h);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = m0 + Step::row0(warp) + mt * 16 + lane / 4 + 8 * r;
      const bool in = row < seq.len_q;
      lse_row[mt][r] = in ? lse_log2(lse[row]) : INFINITY;
      d_row[mt][r] = in ? step.scale_d(dlt[row]) : 0.f;
    }
  step.setup(m0, q_s, do_s, kv_s, warp, lane);

  float dq_acc[kMT][Step::kD8][4];
  zero(dq_acc);

  // Key tile n_block, the i-th of this CTA.
  const int64_t n_count = n_end - n_begin;
  auto step_tile = [&](int64_t n_block, int64_t i, int stage) {
    if constexpr (Step::kPrefetchFirst) {
      if (n_block + 1 < n_end) {
        load_kv(stage ^ 1, n_block + 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    } else {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // K/V of block i visible; every warp done with block i - 1 (its stage, dS)
      // (Issuing these loads under the dQ MMAs instead, as the dK/dV kernel does, measured 0 to
      // -4% in the 8-warp kernel.)
      if (i + kStages - 1 < n_count)
        load_kv(static_cast<int>((i + kStages - 1) % kStages), n_block + kStages - 1);
      cp_async_commit();
    }
    const Element* k_s = kv_s + stage * 2 * kN * kD;
    const DqTile tile{p, vis, seq, m0, n_block, warp, lane};

    float s[kMT][Step::kS8][4], dp[kMT][Step::kS8][4];
    zero(s);
    zero(dp);
    step.scores(s, dp, q_s, do_s, k_s, stage, warp, lane);
    with_mask<Step::kTwoCopies>(key_tile_masked(keys, n_block, kN), [&](auto masked) {
      step.grad(masked, s, dp, lse_row, d_row, tile);
    });
    step.dq(dq_acc, s, k_s, stage, lane);
    if constexpr (Step::kSyncAtEnd) __syncthreads();
  };
  // (Two loop forms, each kernel's own: the same iterations, but either form in the other kernel
  // changed its register allocation by 2-5.)
  if constexpr (Step::kPrefetchFirst) {
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block)
      step_tile(n_block, n_block - n_begin, static_cast<int>((n_block - n_begin) & 1));
  } else {
    for (int64_t i = 0; i < n_count; ++i)
      step_tile(n_begin + i, i, static_cast<int>(i % kStages));
  }
  if constexpr (!Step::kPrefetchFirst) cp_async_wait<0>();  // only empty groups can be left

  auto* dq = seq.q_rows<Element>(p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, h);
  store_rows<Element>(dq, p.dq_row_stride, dq_acc, m0 + Step::row0(warp), seq.len_q,
                      Step::col0(warp), static_cast<int>(p.head_dim), lane);
}

}  // namespace flash_attn_ext::sm80
