// The Hopper forward's __global__ function: the CTA's set-up, then each warpgroup's role.
//
// One CTA of 1 + kConsumers warpgroups, persistent over tiles of 64 * kConsumers query rows
// (fwd_tile_scheduler.h):
//   * warpgroup 0, the producer: gives most of its registers back (setmaxnreg) and one thread
//     issues TMA loads of Q, K and V (fwd_producer.h) and announces each tile.
//   * warpgroups 1 .. kConsumers, the consumers: 64 query rows each (two at head dims 128 and
//     256; three at 64, where the softmax costs as much as the GEMMs and two other warpgroups'
//     GEMMs must cover it).  Per tile: the key tiles' GEMMs and online softmax
//     (fwd_mainloop.h, fwd_softmax.h, masked per fwd_mask.h), then O / l and the LSE written
//     once (fwd_epilogue.h).
#pragma once

#include <cstdint>

#include <cutlass/arch/reg_reconfig.h>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/fwd_epilogue.h"
#include "kernels/sm90/fwd_mainloop.h"
#include "kernels/sm90/fwd_mask.h"
#include "kernels/sm90/fwd_producer.h"
#include "kernels/sm90/fwd_softmax.h"
#include "kernels/sm90/fwd_tile_scheduler.h"
#include "kernels/sm90/fwd_traits.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm90 {

// Whether a tile of the ALiBi variant takes the term in the GEMM (Sm90FwdTraits::kAlibiFold),
// and then its slope parts v: slope / scale rounded to fp32, split into three 16-bit values
// (each the rest of the one before, rounded), whose sum the fold's K step multiplies by the key
// offset jj.  Taken where every visible key is at or left of its row's diagonal (window_right
// = 0: causal, with or without a left window), |slope log2 e| <= 2 (real ALiBi slopes are at
// most 1; the one-sided column rule of compute_tile holds), and the parts miss v by at most
// 2^-14 in the exponent at the tile's last key (fp16's range: a slope / scale past it or with
// its third part below fp16's subnormals fails that); otherwise, and with the kernel option
// sm90_alibi_fold off, the term per score; so does a v so large that S would near fp32's range
// (a softmax_scale below ~1e-30).
template <typename T>
__device__ __forceinline__ bool fold_alibi(const FwdParams& p, const sm80::ScoreFn& fn,
                                           float (&v)[3]) {
  if (!p.sm90_alibi_fold || p.window_right != 0) return false;
  if (!(fabsf(fn.alibi_slope * sm80::ScoreFn::kLog2e) <= 2.f)) return false;  // (NaN too)
  float rest = __fdiv_rn(fn.alibi_slope, fn.scale);
  // (S = x + v jj must stay far from fp32's range, which bf16 parts would not check: a tiny
  // softmax_scale gives a huge v, which the term per score handles as x scale + term)
  if (!(fabsf(rest) * static_cast<float>(T::kBlockN - 1) <= 0x1p100f)) return false;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    v[k] = static_cast<float>(typename T::Element(rest));
    rest = __fsub_rn(rest, v[k]);
  }
  const float miss = fabsf(rest) * static_cast<float>(T::kBlockN - 1) * fn.scale *
                     sm80::ScoreFn::kLog2e;
  return isfinite(v[0]) && miss <= 0x1p-14f;
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    flash_fwd_sm90_kernel(CUTE_GRID_CONSTANT const Sm90FwdArgs<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kM = T::kBlockM, kQStages = T::kQStages;
  const FwdParams& p = args.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const int num_m_blocks = args.num_m_blocks;
  // (args' fields are read where used, from the kernel parameters' constant bank: copies kept
  // in registers across the main loop made it spill)
  const int group = args.group;
  const VisibleKeys vis(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                        p.align_bottom_right);

  // Dropout's Philox (seed, offset) for the backward (the general and dropout variants;
  // dropout.h); (0, 0) without dropout.  Written here rather than by a separate fill launch.
  if (p.rng_state != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    const sm80::DropoutFn drop =
        T::kMayDrop ? sm80::DropoutFn(p) : sm80::DropoutFn();
    p.rng_state[0] = static_cast<int64_t>(drop.seed);
    p.rng_state[1] = static_cast<int64_t>(drop.offset);
  }

  // The K and V rings' pipelines and the Q buffers' barriers.
  const int warp_group = threadIdx.x / 128;
  using Pipeline = typename T::Pipeline;
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kTileBytesKV;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer
                                     : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = 128 * T::kConsumers;
  Pipeline pipe_k(smem.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(smem.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    for (int s = 0; s < kQStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.barrier_q[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.barrier_q_empty[s], 128 * T::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  // The ALiBi fold's key operand (the same for every key tile), visible to wgmma after the
  // barrier.
  using Element = typename T::Element;
  Element* fold_q = nullptr;
  Element* fold_k = nullptr;
  if constexpr (T::kAlibiFold) {
    fold_q = smem.fold.q.data();
    fold_k = smem.fold.k.data();
    FwdMainloop<T>::write_fold_keys(fold_k);
    cutlass::arch::fence_view_async_shared();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutVt{});

  if (warp_group == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x != 0) return;
    run_producer<T>(args, smem, pipe_k, pipe_v, vis, num_m_blocks, group, sQ, sK, sV);
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;  // 0 .. 128 * kConsumers - 1 over the consumer warpgroups
  FwdMainloop<T> mainloop(
      ctid, sQ, sK, sVt, make_tensor(make_smem_ptr(fold_q), typename T::SmemLayoutQFold{}),
      make_tensor(make_smem_ptr(fold_k), typename T::SmemLayoutKFold{}));
  // The exp2 domain's factor: softmax_scale * log2(e) for plain scores (the mask variant's
  // too: a mask only hides scores), softcap * log2(e) for the softcap variant's tanh values,
  // log2(e) for the general variant's softcapped or biased scores, which modify_scores has
  // scaled (sm80::ScoreFn).
  OnlineSoftmax<T> softmax(
      T::kAlibi     ? 1.f  // (modify has taken the ALiBi variant's scores to log2 units)
      : T::kSoftcap ? sm80::softcap_log2(p.softcap)
      : T::kMask  ? static_cast<float>(p.softmax_scale) * sm80::ScoreFn::kLog2e
                  : sm80::ScoreFn(p, 0, 0).scale_log2);
  // This thread's two rows (row halves r and r + 8 of the accumulators), per tile.
  int32_t row_of[2];
  RowMask<T> mask(get<1>(mainloop.tScS(0)));
  // This consumer warpgroup (0 .. kConsumers - 1), by a lane-0 broadcast (CUTLASS's
  // canonical_warp_group_idx) rather than threadIdx.x / 128: the compiler then knows it is
  // warp-uniform, and so are the values read from smem.info with it (interior_begin/end) and
  // the main loop's stage and descriptor arithmetic, which stay in uniform registers.  At head
  // dim 64: main loop 814 -> 787 instructions per key tile (24 fewer R2UR), no spill loads in
  // it (6 before), 92 -> 16 bytes spilled; measured +4..+7% at every L (d=128/256: +-3%).
  const int me = cutlass::canonical_warp_group_idx() - 1;
  const PingpongRing<T::kConsumers> ring(me);
  FwdEpilogue<T> epilogue(args, smem, ctid, me);
  bool q_issued = false;  // packed: this tile's Q rows were requested during the previous tile

  typename Pipeline::PipelineState state;  // consumers start at stage 0, phase 0
  for (int iter = 0;; ++iter) {
    const int qs = q_stage<kQStages>(iter);
    const volatile auto& info =
        wait_tile(&smem.barrier_q[qs], smem.info[iter & 1], q_phase<kQStages>(iter));
    if (info.tile < 0) break;  // no more tiles (either schedule: the producer's stop)
    const int32_t m_block = info.m_block, b = info.b, h = info.h;
    const int32_t m0 = m_block * kM - args.row_shift;  // this tile's first row (see row_shift)
    const int n_begin = info.n_begin, n_end = info.n_end;
    // Packed sequences: the tile's sequence (its q0 and len_q stay live for the epilogue) and
    // the masks over its own lengths.
    TileSeq seq{0, 0, args.rows_q, 0};
    VisibleKeys tile_vis = vis;
    if constexpr (T::kVarlen) {
      seq = {info.seq.q0, info.seq.k0, info.seq.len_q, info.seq.len_k};
      tile_vis = VisibleKeys(seq.len_q, seq.len_k, p.window_left, p.window_right,
                             p.align_bottom_right);
    }
    const bool idle = warpgroup_idle<T::kConsumers>(seq.len_q, m0, me);
    // Key tiles unmasked for this warpgroup's own 64 rows (the producer's TileInfo).
    mask.interior_begin = info.interior_begin[me];
    mask.interior_end = info.interior_end[me];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_of[r] = m0 + get<0>(mainloop.tScS(2 * r));
      mask.set_row(args, tile_vis, r, row_of[r]);
      softmax.reset(r);
    }
    clear(mainloop.tOrO);

    // The key tile after n_block that this tile computes: in the general and mask variants the
    // next one that the bias does not mask for all of the tile's rows (the producer skips the
    // same).
    auto next = [&](int n_block) {
      ++n_block;
      if constexpr (T::kSkipMasked)
        while (n_block < n_end && bias_masks_tile<kM, T::kBlockN>(p, b, h, m0,
                                                                   n_block * T::kBlockN))
          ++n_block;
      return n_block;
    };
    // The bias's classes on the tile's rows, per key tile (bias_blocks.h).
    const WarpTileBlocks<kM / kBiasBlock, T::kBlockN / kBiasBlock> blocks(
        p, b, h, m0, info.visible_begin[me], info.visible_end[me]);
    if (n_begin < n_end && idle) {
      state = FwdMainloop<T>::idle_tile(pipe_k, pipe_v, state, ring, n_begin, n_end,
                                        &smem.barrier_q_empty[qs], next);
    } else if (n_begin < n_end) {
      if constexpr (T::kPackGQA) {
        if (!q_issued) issue_q_packed<T>(args, sQ, ctid, me, m0, b, h);
        finish_q_packed<T>(me);
      }
      // The general and mask variants' rows of the bias, the ALiBi variant's distances (past
      // the last row, a packed sequence's: the last row's, discarded).
      const int32_t last_row = (T::kVarlen ? seq.len_q : static_cast<int32_t>(p.seqlen_q)) - 1;
      const int32_t score_rows[2] = {min(row_of[0], last_row), min(row_of[1], last_row)};
      // Dropout's row id of the (batch, head)'s row 0, a packed sequence's (dropout.h).
      const TileDropout dropout{
          dropout_row_base(T::kVarlen ? seq.q0 : static_cast<int64_t>(b) * p.seqlen_q, h,
                           p.heads_q, T::kVarlen ? seq.len_q : p.seqlen_q),
          row_of[0]};
      // The scores' parameters of (b, h) (packed sequences: b is the sequence, ALiBi's slope
      // row and bottom-right offset its own).
      const sm80::ScoreFn fn = T::kVarlen ? sm80::ScoreFn(p, b, h, seq.len_q, seq.len_k)
                                          : sm80::ScoreFn(p, b, h);
      // The mask variant's boolean mask at this (batch, head)'s key 0, row 0, and the rows'
      // key intervals where the summary has them.
      const uint8_t* mask_bh = T::kMask ? mask_row(p, b, h, 0) : nullptr;
      if constexpr (T::kMask) mask.take_mask_rows(p, b, h, score_rows);
      // (Two calls, not a generic lambda: ptxas left that lambda a function of its own, with
      // the loop's registers on a 1,168-byte stack.)
      constexpr bool kMayFixMax = OnlineSoftmax<T>::kMayFixMax;
      if constexpr (T::kAlibiFold) {
        // The ALiBi variant at head dim 64: the term in the GEMM where fold_alibi allows
        // (QFold written for this tile, the softmax's factor scale log2 e), else per score
        // (factor 1: modify takes the scores to log2 units).
        float v[3];
        if (fold_alibi<T>(p, fn, v)) {
          FwdMainloop<T>::write_fold_slope(fold_q, v, me);
          softmax.scale_log2 = fn.scale * sm80::ScoreFn::kLog2e;
          state = mainloop.template compute_tile<false, true>(
              args, pipe_k, pipe_v, state, ring, softmax, mask, n_begin, n_end, qs,
              &smem.barrier_q_empty[qs], fn, score_rows, next, blocks, me, dropout, mask_bh,
              seq.len_k, smem.v.data());
        } else {
          softmax.scale_log2 = 1.f;
          state = mainloop.template compute_tile<false>(
              args, pipe_k, pipe_v, state, ring, softmax, mask, n_begin, n_end, qs,
              &smem.barrier_q_empty[qs], fn, score_rows, next, blocks, me, dropout, mask_bh,
              seq.len_k, smem.v.data());
        }
      } else if (kMayFixMax && softmax.fixed_max)
        state = mainloop.template compute_tile<kMayFixMax>(
            args, pipe_k, pipe_v, state, ring, softmax, mask, n_begin, n_end, qs,
            &smem.barrier_q_empty[qs], fn, score_rows, next, blocks, me, dropout, mask_bh,
            seq.len_k, smem.v.data());
      else
        state = mainloop.template compute_tile<false>(
            args, pipe_k, pipe_v, state, ring, softmax, mask, n_begin, n_end, qs,
            &smem.barrier_q_empty[qs], fn, score_rows, next, blocks, me, dropout, mask_bh,
            seq.len_k, smem.v.data());
    }
    q_issued = false;
    if (T::kPackGQA && !idle && n_begin < n_end) {
      // The next tile's Q rows now, so that this tile's epilogue covers their load: the
      // producer announces the next tile once every warpgroup released this one's Q (they
      // all issued their last Q K^T before this warpgroup's last P V), so this wait is short.
      // (At the loop's top the same wait then returns at once.)
      const volatile auto& next_info = wait_tile(&smem.barrier_q[q_stage<kQStages>(iter + 1)],
                                                 smem.info[(iter + 1) & 1],
                                                 q_phase<kQStages>(iter + 1));
      if (next_info.tile >= 0) {
        const int32_t next_m0 = next_info.m_block * kM - args.row_shift;
        const bool next_idle = warpgroup_idle<T::kConsumers>(args.rows_q, next_m0, me);
        if (!next_idle && next_info.n_begin < next_info.n_end) {
          issue_q_packed<T>(args, sQ, ctid, me, next_m0, next_info.b, next_info.h);
          q_issued = true;
        }
      }
    }
    if (n_begin >= n_end) {
      release_q(&smem.barrier_q_empty[qs]);  // no visible key: nothing reads Q
    }

    if (idle) continue;  // no row of this warpgroup exists
    // With one Q buffer the tile's info slot is rewritten only after this tile's epilogue (see
    // publish_tile): read the sequence again rather than keep it live across the main loop
    // (at head dim 256 that spilled 100 bytes more).
    if constexpr (T::kVarlen && kQStages == 1) {
      seq.q0 = info.seq.q0;
      seq.len_q = info.seq.len_q;
    }
    epilogue.store(mainloop.tOrO, mainloop.tOcO, softmax, row_of, mask.thread_col, m0, b, h,
                   seq.q0, seq.len_q);
  }
  epilogue.drain();
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flash_attn_ext::sm90
