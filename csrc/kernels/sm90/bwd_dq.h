// The Hopper backward's dQ path: each step's dQ tile (fp32, this CTA's keys' share) is staged
// in shared memory and added to the fp32 dQ buffer by one bulk reduction per warpgroup
// (cp.reduce.async.bulk .add.f32, FlashAttention-3's way), then a small kernel converts the
// buffer to dq.  Per-lane REDs (red.global.add.v2.f32, 32 per thread and step) left the
// consumers waiting on the L1TEX queue: 30% of their stall cycles at head dim 128 (ncu).
//
// Buffer layout (p.dq_accum, dq_accum_floats of them): (batch, heads_q, dq_accum_rows(seqlen_q)
// / kBlockM tiles, tile), a tile being each consumer warpgroup's part in turn, each part its
// threads' accumulators in wgmma fragment order: float4 chunk j of thread t at float
// 4 * (j * 128 + t) (a warp's 16-byte stores then cover 512 contiguous bytes: no bank
// conflicts).  The conversion maps fragment positions back to (row, column) with the same
// TiledMmadQ partition.
#pragma once

#include <cstdint>

#include "kernels/sm80/flash_bwd_lean.cuh"  // bulk_reduce_add_f32, bulk_wait_all, fence_proxy
#include "kernels/sm90/bwd_traits.h"

namespace flash_attn_ext::sm90 {

template <typename T>
struct BwdDq {
  static constexpr int kM = T::kBlockM, kD = T::kHeadDim;
  // Floats of one warpgroup's part of a tile.
  static constexpr int kPartFloats = kM * kD / T::kConsumers;

  // The first float of tile m_block of (b, h) in the buffer.
  __host__ __device__ static int64_t tile_offset(const BwdParams& p, int64_t b, int64_t h,
                                                 int64_t m_block) {
    return ((b * p.heads_q + h) * dq_accum_rows(p.seqlen_q) + m_block * kM) * kD;
  }

  // Warpgroup `me`'s dQ accumulators (acc: kPartFloats / 128 floats per thread, fragment order)
  // added to its part of the tile at gmem_tile.  staging: this warpgroup's kPartFloats floats
  // of shared memory, free once the previous step's reduction has read it (its issuing thread,
  // tid 0 of the warpgroup, waits for that first).
  template <typename Acc>
  __device__ __forceinline__ static void add(const Acc& acc, float* staging, float* gmem_tile,
                                             int me, int tid) {
    constexpr int kVals = decltype(size(acc))::value;
    static_assert(kVals * 128 == kPartFloats && kVals % 4 == 0, "");
    if (tid == 0) sm80::bulk_wait_all<true>();
    cutlass::arch::NamedBarrier::sync(128, 1 + me);
    CUTE_UNROLL
    for (int j = 0; j < kVals / 4; ++j)
      *reinterpret_cast<float4*>(staging + 4 * (j * 128 + tid)) =
          make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3));
    sm80::fence_proxy_async_smem();  // visible to the bulk copy (the async proxy)
    cutlass::arch::NamedBarrier::sync(128, 1 + me);
    if (tid == 0)
      sm80::bulk_reduce_add_f32(gmem_tile + me * kPartFloats, cast_smem_ptr_to_uint(staging),
                                kPartFloats * sizeof(float));
  }
  // Before the CTA ends (its shared memory goes): the issuing thread's reductions done.
  __device__ __forceinline__ static void drain(int tid) {
    if (tid == 0) sm80::bulk_wait_all<false>();
  }
};

// dq (Element, like q) from the buffer: one CTA of 128 * kConsumers threads per (tile, batch,
// head); thread t reads the fragments consumer thread t wrote (all loads first: one load in
// flight at a time left the kernel waiting on L1TEX 93% of its cycles), puts each pair of
// columns into a shared tile, and the CTA then writes whole 16-byte chunks of dq's rows (rows
// of dq are 16-byte aligned and head_dim a multiple of 8: the glue's kernel_ready).
template <typename T>
__global__ void __launch_bounds__(128 * T::kConsumers)
    flash_bwd_sm90_convert_dq_kernel(const BwdParams p, int32_t num_m_blocks) {
  using Element = typename T::Element;
  using Dq = BwdDq<T>;
  constexpr int kM = T::kBlockM, kD = T::kHeadDim, kThreads = 128 * T::kConsumers;
  constexpr int kPitch = kD + 8;  // elements per staged row (+16 bytes: fewer bank conflicts)
  __shared__ __align__(16) Element tile[kM * kPitch];
  const int64_t m_block = blockIdx.x % num_m_blocks, bh = blockIdx.x / num_m_blocks;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int ctid = threadIdx.x, me = ctid / 128, tid = ctid % 128;
  typename T::TiledMmadQ mma;
  Tensor coord = mma.get_thread_slice(ctid).partition_C(
      make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
  constexpr int kVals = decltype(size(coord))::value;
  const float* src = p.dq_accum + Dq::tile_offset(p, b, h, m_block) + me * Dq::kPartFloats;
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
  auto* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride;
  const int64_t m0 = m_block * kM;
  for (int i = ctid; i < kM * kD / 8; i += kThreads) {
    const int r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    if (m0 + r < p.seqlen_q && c < p.head_dim)
      *reinterpret_cast<uint4*>(dq + (m0 + r) * p.dq_row_stride + c) =
          *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
  }
}

}  // namespace flash_attn_ext::sm90
