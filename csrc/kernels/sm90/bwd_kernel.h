// The Hopper backward's __global__ function (bwd_traits.h has the algorithm): the CTA's set-up,
// then each warpgroup's role.
//   * warpgroup 0, the producer: gives most of its registers back (setmaxnreg) and one thread
//     issues the TMA loads (bwd_producer.h); its warp 1 adds the consumers' dQ tiles to the
//     fp32 buffer (bwd_dq.h: run_bwd_dq_writer).
//   * warpgroups 1 and 2, the consumers: 64 keys each; per step bwd_mainloop.h (its dQ through
//     bwd_dq.h), at the end dK and dV stored through shared memory (store_dkdv_staged).  At
//     head dim 256 both take the same 64 keys, split by role (bwd_mainloop_split.h; no writer
//     warp), and each stores one of dK and dV.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/arch/reg_reconfig.h>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_mainloop_split.h"
#include "kernels/sm90/bwd_producer.h"
#include "kernels/sm90/bwd_traits.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm90 {

template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    flash_bwd_sm90_kernel(CUTE_GRID_CONSTANT const Sm90BwdArgs<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kM = T::kBlockM, kN = T::kBlockN;
  const BwdParams& p = args.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  // Key block fastest: the CTAs running at once share a few heads' Q and dO (L2), and under a
  // causal mask each head's longest blocks (the first keys) start first.  With dQ added in
  // descending key-block order, the highest first, the shortest under a causal mask (a CTA
  // waits only for CTAs launched before it: bwd_traits.h, kDqDescending).
  // Packed sequences: entry blockIdx / heads_kv of the host's table (heaviest first), KV head
  // blockIdx % heads_kv.  With dQ in a fixed order (each sequence's highest blocks first in
  // the table) the KV head is slowest, entry blockIdx % entries: one head's blocks after
  // another, as the dense descending order, so that a long causal sequence's heavy and light
  // blocks alternate over the launch (with the head fastest every head's heaviest blocks came
  // last: 0.70x the default order); a CTA still waits only for its own head's CTAs launched
  // before it.
  int32_t n_block, b, hk;
  BwdSeq seq;
  if constexpr (T::kVarlen) {
    const uint32_t heads = static_cast<uint32_t>(p.heads_kv);
    const uint32_t entries = static_cast<uint32_t>(p.sm90_varlen_entries);
    const bool head_slowest = args.dq_order != kDqAnyOrder;
    const VarlenTile e =
        p.sm90_varlen_tiles[head_slowest ? blockIdx.x % entries : blockIdx.x / heads];
    hk = static_cast<int32_t>(head_slowest ? blockIdx.x / entries : blockIdx.x % heads);
    n_block = e.block;
    b = e.b;
    seq = {e.q0, e.k0, e.len_q, e.len_k, e.row_base};
  } else {
    const int32_t nb = args.num_n_blocks;
    int32_t n_index, bhk;
    if (args.section_pairs > 0) {
      // Unequal CTAs with dQ in any order: the longest first over the whole launch.  Sections
      // of section_pairs (batch, KV head) pairs (their Q, dO and dQ buffer sized to stay in
      // L2), the key block slowest within a section, so that every pair's longest blocks start
      // first and the launch ends on the shortest (FlashAttention-3's order).  With the key
      // block fastest over the whole launch the last pairs' longest blocks started in the last
      // wave: a greedy model of 132 SMs put that tail at 6-7% of a causal call at L = 1k-8k
      // (docs/perf/sm90_backward.md).
      const int32_t pairs_total = static_cast<int32_t>(p.batch * p.heads_kv);
      const int32_t per = args.section_pairs * nb;
      const int32_t sec = static_cast<int32_t>(blockIdx.x) / per;
      const int32_t r = static_cast<int32_t>(blockIdx.x) % per;
      const int32_t first = sec * args.section_pairs;
      const int32_t pairs = min(args.section_pairs, pairs_total - first);
      n_index = r / pairs;
      bhk = first + r % pairs;
    } else {
      n_index = static_cast<int32_t>(blockIdx.x % nb);
      bhk = static_cast<int32_t>(blockIdx.x / nb);
    }
    n_block = args.dq_order == kDqDescending ? nb - 1 - n_index : n_index;
    b = bhk / static_cast<int32_t>(p.heads_kv);
    hk = bhk % static_cast<int32_t>(p.heads_kv);
    seq = {0, 0, static_cast<int32_t>(p.seqlen_q), static_cast<int32_t>(p.seqlen_k), 0};
  }
  const VisibleKeys vis(seq.len_q, seq.len_k, p.window_left, p.window_right,
                        p.align_bottom_right);
  const BwdSteps st = bwd_steps(args, vis, n_block, b, hk, seq);

  const int warp_group = threadIdx.x / 128;
  using Pipeline = typename T::Pipeline;
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kStageBytes;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer
                                     : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = 128 * T::kConsumers;
  Pipeline pipe(smem.pipe, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&smem.barrier_kv, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutK{});

  if (warp_group == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0 && st.steps > 0)
      run_bwd_producer<T>(args, smem, pipe, st, n_block, b, hk, seq, sQ, sdO, sK, sV);
    if constexpr (!T::kRoleSplit) {
      if (threadIdx.x / 32 == 1 && st.steps > 0)
        run_bwd_dq_writer<T>(args, smem, st, seq, n_block, b, hk);
    } else {  // (the role split adds its dQ itself; in a fixed order after this warp's word)
      if (threadIdx.x / 32 == 1 && st.steps > 0 && args.dq_order != kDqAnyOrder)
        run_split_dq_order<T>(args, st, seq, n_block, b, hk);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename T::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename T::SmemLayoutdS{});
  std::conditional_t<T::kRoleSplit, BwdMainloopSplit<T>, BwdMainloop<T>> mainloop(
      ctid, sQ, sdO, sK, sV, sQt, sdOt, sKt, sdS);
  const int64_t n0 = static_cast<int64_t>(n_block) * kN;

  if (st.steps > 0) {
    cutlass::arch::ClusterTransactionBarrier::wait(&smem.barrier_kv, 0);
    const float scale = static_cast<float>(p.softmax_scale);
    // The exp2 domain's factor of the step's scores: S^T's (scale log2 e), or the softcap
    // variant's tanh values' (softcap log2 e; Sm90BwdTraits::kSoftcap).
    const float scale_log2 =
        T::kSoftcap ? sm80::softcap_log2(p.softcap) : scale * sm80::ScoreFn::kLog2e;
    const int me = ctid / 128, tid = ctid % 128;  // consumer warpgroup, its thread
    // Packed sequences: keys past the sequence's end are the next sequence's (or TMA's zeros
    // past the tensor).  The mask gives them P^T = 0, but dS^T = 0 * (dP^T - D) and dQ = dS K
    // would carry a NaN or inf of theirs through: each warpgroup zeroes its own keys' rows of
    // K and V past the end (the other warpgroup reads them in dQ only after the dS barrier;
    // the role split, both on the same keys: K by warpgroup 0, V by warpgroup 1,
    // bwd_mainloop_split.h).
    if constexpr (T::kVarlen)
      if (n0 + kN > seq.len_k) mainloop.zero_kv_rows(smem, seq.len_k - n0, me, tid);
    // (the writer's staging; the role split adds its dQ itself)
    float* dq_staging = T::kRoleSplit ? nullptr : smem.dq.data() + me * BwdDq<T>::kPartFloats;
    typename Pipeline::PipelineState state;
    BwdStepWalk w{hk * args.group};
    int32_t done = 0;  // steps computed, not skipped
    for (int32_t t = 0; t < st.steps; ++t, w.next(st)) {
      const int32_t h = w.h, m_block = w.m_block(st);
      const int64_t m0 = static_cast<int64_t>(m_block) * kM;
      // The bias's classes of the step's blocks: all masked skips it (bwd_step_skipped's rule,
      // which the producer and the dQ writer ask), else the class on the step's rows and this
      // warpgroup's 64 keys (the role split: both warpgroups on the block's 64 keys).  (Scalar
      // loads, in uniform registers: here, before the step's wait, their latency is covered,
      // and the lane-spread WarpTileBlocks cost the general variant a vector register that it
      // spilled, 112 -> 316 bytes at head dim 128.)
      int cls = kBlockMasked;
      if constexpr (T::kSkipMasked) {
        const BwdStepClasses<T> classes(p, b, h, m0, n0);
        if (classes.skipped()) continue;
        cls = classes.keys(T::kRoleSplit ? 0 : me);
      }
      // Masked unless every key of the block is visible to every row of the step.
      const int64_t last = (m0 + kM < seq.len_q ? m0 + kM : seq.len_q) - 1;
      const bool masked = n0 < vis.begin(last) || n0 + kN > vis.end(m0);
      const VisibleKeys::Relative rel = vis.relative(m0, n0, kN);
      // The scores' parameters of (b, h) (packed sequences: b is the sequence, ALiBi's slope
      // row and bottom-right offset over its lengths) and dropout's row id of its query row 0
      // (dropout.h; a packed sequence's from its first packed row).
      const sm80::ScoreFn fn(p, b, h, seq.len_q, seq.len_k);
      const int64_t drop_rows = dropout_row_base(
          T::kVarlen ? seq.q0 : static_cast<int64_t>(b) * p.seqlen_q, h, p.heads_q, seq.len_q);
      pipe.consumer_wait(state);
      // Packed sequences: the step's rows past the sequence's end (the next sequence's, or
      // zeros) become zeros in Q and dO (their statistics give P^T = 0 and dS^T = 0, but
      // 0 * NaN in dV += P^T dO and dK += dS^T Q would carry a NaN of theirs through).
      if constexpr (T::kVarlen)
        if (m0 + kM > seq.len_q)
          mainloop.zero_qdo_rows(smem, state.index(), static_cast<int>(seq.len_q - m0), me, tid);
      if constexpr (T::kRoleSplit)
        mainloop.step(smem, state.index(), done & 1, masked, rel, scale, scale_log2,
                      p.dq_accum + bwd_scratch_row(args, b, h, seq, m_block) * T::kHeadDim,
                      fn, m0, n0, args.dq_order != kDqAnyOrder, cls,
                      T::kMask ? mask_row(p, b, h, 0) : nullptr,
                      static_cast<int32_t>(seq.len_q - m0), static_cast<int32_t>(seq.len_k - n0),
                      T::kMayDrop ? sm80::DropoutFn(p) : sm80::DropoutFn(), drop_rows);
      else
        mainloop.step(smem, state.index(), done & 1, masked, rel, scale, scale_log2,
                      dq_staging, me, tid, fn, m0, n0,
                      static_cast<int32_t>(seq.len_q - m0), static_cast<int32_t>(seq.len_k - n0),
                      cls, T::kMayDrop ? sm80::DropoutFn(p) : sm80::DropoutFn(), drop_rows,
                      T::kMask ? mask_row(p, b, h, 0) : nullptr,
                      T::kMask ? mask_col_rows(p, b, h) : nullptr, done == 0);
      ++done;
      pipe.consumer_release(state);
      ++state;
    }
    if constexpr (!T::kRoleSplit)
      if (done > 0) BwdDq<T>::drain(me);
    if constexpr (T::kRoleSplit) mainloop.finish_dq_ordered();  // (the last step's adds)
  }
  // zeros where no query row sees the block
  if (BwdMainloop<T>::staged_store_fits(p)) {
    // Both warpgroups past their last GEMM (the other's dQ GEMM reads every key of K) before
    // either overwrites K and V (the dS barrier's id, 0 in both mainloops: both warpgroups
    // pass it equally often).
    cutlass::arch::NamedBarrier::sync(256, 0);
    mainloop.store_dkdv_staged(p, smem.k.data(), smem.v.data(),
                               static_cast<int64_t>(seq.k0) + n0, seq.len_k - n0, b, hk,
                               ctid / 128, ctid % 128);
    return;
  }
  mainloop.store_dkdv(p, static_cast<int64_t>(seq.k0) + n0, seq.len_k - n0, b, hk);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flash_attn_ext::sm90
