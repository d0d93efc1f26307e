// The Hopper backward's loads: one thread of the producer warpgroup issues K and V of the CTA's
// key block once (TMA, one transaction barrier), then per step (bwd_traits.h) the Q and dO tiles
// (TMA) and the step's lse * log2(e) and D (bulk copies of 64 floats) into a kStages-deep ring
// (CUTLASS's PipelineTmaAsync: a stage is "full" when all four landed, "empty" when both
// consumer warpgroups are done with it).
#pragma once

#include <cstdint>

#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/bwd_traits.h"
#include "mask.h"

namespace flash_attn_ext::sm90 {

// Packed sequences (T::kVarlen): the tensors are the packed ones (one batch entry of
// total_q / total_k rows), the tiles start at the sequence's offsets; tiles running past its
// end read the next sequence's rows (or TMA's zeros past the tensor), which the consumers
// zero (bwd_kernel.h).
template <typename T, typename SmemQ, typename SmemK>
__device__ __forceinline__ void run_bwd_producer(const Sm90BwdArgs<T>& args,
                                                 typename T::SharedStorage& smem,
                                                 typename T::Pipeline& pipe, const BwdSteps& st,
                                                 int32_t n_block, int32_t b, int32_t hk,
                                                 const BwdSeq& seq, SmemQ& sQ, SmemQ& sdO,
                                                 SmemK& sK, SmemK& sV) {
  using Pipeline = typename T::Pipeline;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim;
  const BwdParams& p = args.p;
  const int32_t tb = T::kVarlen ? 0 : b;  // the tensors' batch entry
  Tensor mQ = args.tma_q.get_tma_tensor(rows_shape<T::kVarlen>(p, false, p.head_dim, p.heads_q));
  Tensor mdO =
      args.tma_do.get_tma_tensor(rows_shape<T::kVarlen>(p, false, p.head_dim_v, p.heads_q));
  Tensor mK = args.tma_k.get_tma_tensor(rows_shape<T::kVarlen>(p, true, p.head_dim, p.heads_kv));
  Tensor mV =
      args.tma_v.get_tma_tensor(rows_shape<T::kVarlen>(p, true, p.head_dim_v, p.heads_kv));
  // A (rows, head dim) view from row `first` (packed sequences; the dense tensors as they are).
  auto from_row = [](int32_t first, auto&& m) {
    if constexpr (T::kVarlen)
      return domain_offset(make_coord(first, 0), m);
    else
      return m;
  };

  // K and V of the key block, once.
  {
    Tensor gK = local_tile(from_row(seq.k0, mK(_, _, hk, tb)),
                           Shape<Int<kN>, Int<kD>>{}, make_coord(n_block, 0));
    Tensor gV = local_tile(from_row(seq.k0, mV(_, _, hk, tb)),
                           Shape<Int<kN>, Int<kD>>{}, make_coord(n_block, 0));
    auto [tKg, tKs] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.barrier_kv,
                                                                   2 * T::kTileBytesK);
    copy(args.tma_k.with(smem.barrier_kv), tKg, tKs);
    copy(args.tma_v.with(smem.barrier_kv), tVg, tVs);
  }

  auto state = cutlass::make_producer_start_state<Pipeline>();
  BwdStepWalk w{hk * args.group};
  for (int32_t t = 0; t < st.steps; ++t, w.next(st)) {
    const int32_t h = w.h, m_block = w.m_block(st);
    if (bwd_step_skipped<T>(p, b, h, m_block, n_block)) continue;
    Tensor gQ = local_tile(from_row(seq.q0, mQ(_, _, h, tb)),
                           Shape<Int<kM>, Int<kD>>{}, make_coord(_, 0));
    Tensor gdO = local_tile(from_row(seq.q0, mdO(_, _, h, tb)),
                            Shape<Int<kM>, Int<kD>>{}, make_coord(_, 0));
    auto [tQg, tQs] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                    group_modes<0, 2>(gQ));
    auto [tdOg, tdOs] = tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                      group_modes<0, 2>(gdO));
    pipe.producer_acquire(state);  // expects the stage's kStageBytes
    uint64_t* full = pipe.producer_get_barrier(state);
    const int stage = state.index();
    copy(args.tma_q.with(*full), tQg(_, m_block), tQs(_, stage));
    copy(args.tma_do.with(*full), tdOg(_, m_block), tdOs(_, stage));
    const int64_t stat = bwd_scratch_row(args, b, h, seq, m_block);
    SM90_BULK_COPY_G2S::copy(args.lse_log2 + stat, full, smem.lse_log2[stage], T::kStatBytes);
    SM90_BULK_COPY_G2S::copy(args.delta + stat, full, smem.delta[stage], T::kStatBytes);
    ++state;
  }
  // No copy may outlive the CTA: the consumers' waits on every stage cover that (each step's
  // stage is waited for before the CTA ends).
}

}  // namespace flash_attn_ext::sm90
