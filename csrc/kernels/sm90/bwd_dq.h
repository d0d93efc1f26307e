// The Hopper backward's dQ path: each step's dQ tile (fp32, this CTA's keys' share) is staged
// in shared memory and added to the fp32 dQ buffer by bulk reductions (cp.reduce.async.bulk
// .add.f32, FlashAttention-3's way), then a small kernel converts the buffer to dq.  Per-lane
// REDs (red.global.add.v2.f32, 32 per thread and step) left the consumers waiting on the L1TEX
// queue: 30% of their stall cycles at head dim 128 (ncu).  (Head dim 256 adds with REDs all the
// same, red.global.add.v4.f32 in this layout: the staging tile does not fit there;
// bwd_mainloop_split.h.)
//
// The consumers stage their parts of each step's tile in shared memory and go on; a writer warp
// of the producer warpgroup issues the reductions (FlashAttention-3's dQ writer), so that the
// consumers wait for it only when they come to stage the next step before it has read this
// one.  (With the consumers issuing the reductions themselves, each step cost them two named
// barriers and a wait for the previous step's read: docs/perf/sm90_backward.md.)  Two orders:
//   * as the CTAs get there (default): the fp32 sums' order, hence dq's last bits, vary from
//     run to run.
//   * fixed (deterministic=True: p.dq_semaphore): the writer adds a step's parts once the key
//     blocks before this one, in the order Sm90BwdArgs::dq_order fixes, have added theirs to
//     the query block (one counter per (batch, query head, query block), FlashAttention-3's
//     deterministic backward), then counts itself in.
//
// Buffer layout (p.dq_accum, dq_accum_floats of them): (batch, heads_q, dq_accum_rows(seqlen_q)
// / kBlockM tiles, tile) (packed sequences: (heads_q, padded rows / kBlockM tiles, tile);
// bwd_traits.h's bwd_scratch_row gives a tile's first row, times the head dim its offset), a
// tile being each consumer warpgroup's part in turn, each part its threads' accumulators in
// wgmma fragment order: float4 chunk j of thread t at float
// 4 * (j * 128 + t) (a warp's 16-byte stores then cover 512 contiguous bytes: no bank
// conflicts).  The conversion maps fragment positions back to (row, column) with the same
// TiledMmadQ partition.
#pragma once

#include <cstdint>

#include "kernels/sm80/flash_bwd_lean.cuh"  // bulk_reduce_add_f32, bulk_wait_all, fence_proxy
#include "kernels/sm90/bwd_traits.h"
#include "mask.h"

namespace flash_attn_ext::sm90 {

// Named barriers (CUTLASS's user ids; the mainloop's dS barrier has 0, its per-warpgroup ones
// 1 + warpgroup): a consumer warpgroup's part staged (full) and read by the writer (empty), + the
// warpgroup (BwdDq checks that they fit).
constexpr int kDqFullBarrier = 3, kDqEmptyBarrier = 5;
constexpr int kDqWriterThreads = 32;  // the writer warp

// Global-memory order between CTAs for the ordered adds: the counter read with acquire and
// bumped with release; the proxy fences order the bulk reductions (the async proxy) with them.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ int32_t load_acquire(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(int32_t* ptr, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
// Spins until *ptr >= target.  A wait of a minute means an order that cannot complete (a
// defect, or the rotated order with fewer SMs free than it assumed: bwd_launch_template.h): the
// kernel traps rather than hanging the GPU (the error is sticky: the process's CUDA context
// is lost, as after an illegal memory access).
__device__ __forceinline__ void wait_at_least(const int32_t* ptr, int32_t target) {
  if (load_acquire(ptr) >= target) return;
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (load_acquire(ptr) < target) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 60ull * 1000000000ull) __trap();
  }
}

template <typename T>
struct BwdDq {
  static constexpr int kM = T::kBlockM, kD = T::kHeadDim;
  // Floats of one warpgroup's part of a tile.
  static constexpr int kPartFloats = kM * kD / T::kConsumers;
  static constexpr int kBarrierThreads = 128 + kDqWriterThreads;
  static_assert(kDqEmptyBarrier >= kDqFullBarrier + T::kConsumers &&
                    kDqEmptyBarrier + T::kConsumers +
                            static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) <=
                        16,
                "the dQ writer's named barriers overlap or exceed the hardware's 16");

  // This thread's dQ accumulators (kPartFloats / 128 floats, fragment order) into the staging.
  template <typename Acc>
  __device__ __forceinline__ static void stage(const Acc& acc, float* staging, int tid) {
    constexpr int kVals = decltype(size(acc))::value;
    static_assert(kVals * 128 == kPartFloats && kVals % 4 == 0, "");
    CUTE_UNROLL
    for (int j = 0; j < kVals / 4; ++j)
      *reinterpret_cast<float4*>(staging + 4 * (j * 128 + tid)) =
          make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
    sm80::fence_proxy_async_smem();  // visible to the bulk copy (the async proxy)
  }

  // Warpgroup `me`'s dQ accumulators (acc) handed to the writer (run_bwd_dq_writer), which
  // adds them to the step's tile.  staging: this warpgroup's kPartFloats floats of shared
  // memory, free once the writer has read the previous step's (not waited for at this
  // warpgroup's first step: `first`).
  template <typename Acc>
  __device__ __forceinline__ static void add(const Acc& acc, float* staging, int me, int tid,
                                             bool first) {
    if (!first) cutlass::arch::NamedBarrier::sync(kBarrierThreads, kDqEmptyBarrier + me);
    stage(acc, staging, tid);
    cutlass::arch::NamedBarrier::arrive(kBarrierThreads, kDqFullBarrier + me);
  }
  // Before the CTA ends (its shared memory goes), after at least one step: the writer has read
  // the last step's staging (its last arrival on the empty barrier).
  __device__ __forceinline__ static void drain(int me) {
    cutlass::arch::NamedBarrier::sync(kBarrierThreads, kDqEmptyBarrier + me);
  }
};

// The place of key block n_block among those adding to query block m_block (of every query
// head), in the order of Sm90BwdArgs::dq_order: how many add before it.
// (Packed sequences: blocks of the CTA's sequence, always descending.)
template <typename T>
__device__ __forceinline__ int32_t dq_turn(const Sm90BwdArgs<T>& args, const BwdSteps& st,
                                           const BwdSeq& seq, int32_t n_block,
                                           int32_t m_block) {
  constexpr int kM = T::kBlockM, kN = T::kBlockN;
  const BwdParams& p = args.p;
  if (args.dq_order == kDqDescending) {
    // (Built here from the kernel parameters rather than held: the writer has 24 registers.)
    const VisibleKeys vis(seq.len_q, seq.len_k, p.window_left, p.window_right,
                          p.align_bottom_right);
    // The key blocks reaching a query block are those holding a key one of its rows sees
    // (bwd_steps, without a bias's narrowing): a run of blocks, the last holding the last
    // row's last visible key.  The highest adds first.
    const int64_t m0 = static_cast<int64_t>(m_block) * kM;
    const int64_t last = (m0 + kM < seq.len_q ? m0 + kM : seq.len_q) - 1;
    return static_cast<int32_t>((vis.end(last) - 1) / kN) - n_block;
  }
  // kDqRotated: all N key blocks reach all M query blocks, block j first s_j = floor(j M / N)
  // and block (s_j + u) mod M at its step u.  Those reaching m_block at an earlier step add
  // first; of two reaching it at the same step (M < N), the lower key block.
  // (32-bit: the launcher takes this order only where M * (N + 1) < 2^31, upto's largest
  // product.)
  const int32_t M = st.m_blocks, N = args.num_n_blocks, s = st.rot;
  auto upto = [&](int32_t x) {  // key blocks j with s_j <= x (x >= -1): j < (x + 1) N / M
    const int32_t c = ((x + 1) * N + M - 1) / M;
    return c < N ? c : N;
  };
  const int32_t u = m_block >= s ? m_block - s : m_block - s + M;  // this key block's step
  const int32_t earlier = s + u < M ? upto(s + u) - upto(s) : N - upto(s) + upto(s + u - M);
  return earlier + n_block - upto(s - 1);
}

// The dQ writer (bwd_kernel.h: warp 1 of the producer warpgroup): per step, adds both consumer
// warpgroups' staged parts and frees the staging once read.  In a fixed order (args.dq_order)
// it first waits for its turn at the step's query block (the counter) and counts itself in
// once the adds are in global memory; steps the consumers skip (a bias masks the whole key
// block) add nothing but count in.
template <typename T>
__device__ __forceinline__ void run_bwd_dq_writer(const Sm90BwdArgs<T>& args,
                                                  typename T::SharedStorage& smem,
                                                  const BwdSteps& st, const BwdSeq& seq,
                                                  int32_t n_block, int32_t b, int32_t hk) {
  using Dq = BwdDq<T>;
  const BwdParams& p = args.p;
  const bool leader = threadIdx.x % 32 == 0;
  const bool ordered = args.dq_order != kDqAnyOrder;
  const int64_t counters_per_head = dq_semaphores_per_head(p.seqlen_q);
  BwdStepWalk w{hk * args.group};
  for (int32_t t = 0; t < st.steps; ++t, w.next(st)) {
    const int32_t h = w.h, m_block = w.m_block(st);
    // One counter per query block: (batch, query head, block); packed sequences, per block of
    // the padded scratch rows (a sequence's start a multiple of 128 rows: blocks never shared).
    const int64_t row = bwd_scratch_row(args, b, h, seq, m_block);
    int32_t* counter =
        !ordered ? nullptr
        : p.dq_semaphore +
              (T::kVarlen ? row / T::kBlockM
                          : (static_cast<int64_t>(b) * p.heads_q + h) * counters_per_head +
                                m_block);
    if (ordered) {
      if (leader) {
        wait_at_least(counter, dq_turn(args, st, seq, n_block, m_block));
        fence_proxy_async_global();
      }
      __syncwarp();
    }
    if (!bwd_step_skipped<T>(p, b, h, m_block, n_block)) {
      float* tile = p.dq_accum + row * T::kHeadDim;
      CUTE_UNROLL
      for (int me = 0; me < T::kConsumers; ++me) {
        cutlass::arch::NamedBarrier::sync(Dq::kBarrierThreads, kDqFullBarrier + me);
        if (leader)
          sm80::bulk_reduce_add_f32(tile + me * Dq::kPartFloats,
                                    cast_smem_ptr_to_uint(smem.dq.data() + me * Dq::kPartFloats),
                                    Dq::kPartFloats * sizeof(float));
      }
      if (leader) sm80::bulk_wait_all<true>();
      __syncwarp();
      CUTE_UNROLL
      for (int me = 0; me < T::kConsumers; ++me)
        cutlass::arch::NamedBarrier::arrive(Dq::kBarrierThreads, kDqEmptyBarrier + me);
      if (ordered && leader) sm80::bulk_wait_all<false>();
    }
    if (ordered) {
      if (leader) {
        fence_proxy_async_global();
        add_release(counter, 1);
      }
      __syncwarp();
    }
  }
  if (leader) sm80::bulk_wait_all<false>();  // (the unordered adds: complete before the exit)
}

// dq (Element, like q) from the buffer: one CTA of 128 * kConsumers threads per (tile, batch,
// head) (packed sequences: per (padded tile, head), tiles of padding only returning at once);
// thread t reads the fragments consumer thread t wrote (all loads first: one load in flight at
// a time left the kernel waiting on L1TEX 93% of its cycles), puts each pair of columns into a
// shared tile, and the CTA then writes whole 16-byte chunks of dq's rows (rows of dq are
// 16-byte aligned and head_dim a multiple of 8: the glue's kernel_ready).
template <typename T>
__global__ void __launch_bounds__(128 * T::kConsumers)
    flash_bwd_sm90_convert_dq_kernel(const BwdParams p, int32_t num_m_blocks) {
  using Element = typename T::Element;
  using Dq = BwdDq<T>;
  constexpr int kM = T::kBlockM, kD = T::kHeadDim, kThreads = 128 * T::kConsumers;
  constexpr int kPitch = kD + 8;  // elements per staged row (+16 bytes: fewer bank conflicts)
  __shared__ __align__(16) Element tile[kM * kPitch];
  const int64_t m_block = blockIdx.x % num_m_blocks, bh = blockIdx.x / num_m_blocks;
  // The tile's rows: dense, rows m0 .. of (b, h); packed sequences, padded rows m0 .. of head
  // h (BwdParams::sm90_varlen_rows: where they lie in q, how many are a sequence's).
  int64_t b, h, src_row, dst_row, rows;
  const int64_t m0 = m_block * kM;
  if constexpr (T::kVarlen) {
    b = 0;
    h = bh;
    const int64_t block = m0 / 128, within = m0 % 128;
    dst_row = p.sm90_varlen_rows[2 * block] + within;
    rows = p.sm90_varlen_rows[2 * block + 1] - within;
    if (rows <= 0) return;  // padding only
    src_row = h * p.sm90_varlen_padded_q + m0;
  } else {
    b = bh / p.heads_q;
    h = bh % p.heads_q;
    dst_row = m0;
    rows = p.seqlen_q - m0;
    src_row = (b * p.heads_q + h) * dq_accum_rows(p.seqlen_q) + m0;
  }
  const int ctid = threadIdx.x, me = ctid / 128, tid = ctid % 128;
  typename T::TiledMmadQ mma;
  Tensor coord = mma.get_thread_slice(ctid).partition_C(
      make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
  constexpr int kVals = decltype(size(coord))::value;
  const float* src = p.dq_accum + src_row * kD + me * Dq::kPartFloats;
  float4 x[kVals / 4];
  CUTE_UNROLL
  for (int j = 0; j < kVals / 4; ++j)
    x[j] = *reinterpret_cast<const float4*>(src + 4 * (j * 128 + tid));
  CUTE_UNROLL
  for (int j = 0; j < kVals / 4; ++j) {
    const float v[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
    CUTE_UNROLL
    for (int e = 0; e < 4; e += 2) {
      const int q = get<0>(coord(4 * j + e)), c = get<1>(coord(4 * j + e));
      Element pair[2] = {static_cast<Element>(v[e]), static_cast<Element>(v[e + 1])};
      *reinterpret_cast<uint32_t*>(tile + q * kPitch + c) = *reinterpret_cast<uint32_t*>(pair);
    }
  }
  __syncthreads();
  auto* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
             dst_row * p.dq_row_stride;
  for (int i = ctid; i < kM * kD / 8; i += kThreads) {
    const int r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    if (r < rows && c < p.head_dim)
      *reinterpret_cast<uint4*>(dq + r * p.dq_row_stride + c) =
          *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
  }
}

}  // namespace flash_attn_ext::sm90
