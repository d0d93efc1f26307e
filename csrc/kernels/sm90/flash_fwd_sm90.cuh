// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma tensor-core GEMMs, warp
// specialisation (FlashAttention-3, arXiv:2407.08608, sections 3.1-3.2), written with CuTe from
// the pinned nvidia-cutlass headers.
//
// One CTA of 1 + kConsumers warpgroups per (block of 64 * kConsumers query rows, batch, head):
//   * warpgroup 0, the producer: gives most of its registers back (setmaxnreg) and one thread
//     issues TMA loads: the Q tile once, then K and V tiles into a kStages-deep shared-memory
//     ring, each stage guarded by a pair of mbarriers (CUTLASS's PipelineTmaAsync: "full" when
//     the TMA bytes have landed, "empty" when both consumers are done with the stage).
//   * warpgroups 1 .. kConsumers, the consumers: 64 query rows each (two at head dims 128 and
//     256; three at 64, where the softmax costs as much as the GEMMs and two other warpgroups'
//     GEMMs must cover it).  Per K/V tile:
//     S = Q K^T (wgmma, both operands in shared memory, fp32 accumulators in registers), mask,
//     online softmax in the exp2 domain (running max m and sum l per row; FlashAttention-2,
//     arXiv:2307.08691, Algorithm 1), O = O * exp2(m_old - m_new) + P V with P converted to
//     16 bits in registers and fed to wgmma as its register A operand (the accumulator layout of
//     S and the A-operand layout of P V hold the same rows and columns per thread).
// O / l and the LSE are written once at the end (O through shared memory and TMA stores).  Masking is csrc/mask.h's rule, applied only
// on key tiles that straddle a boundary.  Plain attention only: softcap, attn_bias and dropout
// go to the sm80 kernel (the dispatcher says so).
#pragma once

#ifndef NDEBUG
#define NDEBUG  // CUTLASS's pipelines otherwise add device-side role checks to every wait
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/sm80/launch.h"
#include "kernels/sm90/flash_fwd_sm90_launch.h"
#include "kernels/sm90/pack_gqa.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm90 {

using namespace cute;

// CUTLASS's 16-bit types for CUDA's.
template <typename T>
struct CuteType;
template <>
struct CuteType<__half> {
  using type = cutlass::half_t;
};
template <>
struct CuteType<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};

// A (seqlen, head_dim, heads, batch) view of q, k, v or out: element strides, head dim unit-stride.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

struct TileCoord {
  int32_t m_block, b, h;
};

// What the producer tells the consumers about a tile, with its Q load: its coordinates and its
// key tiles (so that the consumers' tile start and epilogue, which nothing overlaps, do no
// integer divisions or 64-bit bound arithmetic: measured ~1,400 cycles per tile and warpgroup).
template <int kConsumers>
struct TileInfo {
  int32_t tile;  // -1: no more tiles
  int32_t m_block, b, h;
  int32_t n_begin, n_end;  // key tiles [n_begin, n_end) hold every key a row of it sees
  // Keys [interior_begin, interior_end) are visible to every row of warpgroup w's 64 rows.
  int32_t interior_begin[kConsumers], interior_end[kConsumers];
};

template <typename CudaElement, int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_,
          bool kPackGQA_ = false>
struct Sm90FwdTraits {
  using Element = typename CuteType<CudaElement>::type;
  // GQA packing (see Sm90FwdArgs::group): its own instantiation, so that the kernel without it
  // carries none of its code (in one kernel, its tile-boundary code cost 2-5% at L = 1k).
  static constexpr bool kPackGQA = kPackGQA_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim of q/k and v (64, 128 or 256)
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups
  static constexpr int kBlockM = 64 * kConsumers;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;         // keys per K/V tile
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg budgets (per thread) of the producer and of each consumer warpgroup.  They must
  // fit in what the CTA got at launch, 65536 / kThreads per thread rounded down to a multiple
  // of 8 (168 for 384 threads), or the consumers' increase waits forever.  Head dim 128: 40 for
  // the persistent producer's tile loop (24 spilled ~90 bytes there) and 232 for the consumers
  // (no spill); head dim 256's O accumulator needs 240 (232 spills in the main loop).
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : kHeadDim == 128 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : kHeadDim == 128 ? 232 : 240;
  static_assert(kConsumers == 2 || kConsumers == 3, "");
  // The softmax's instruction schedule, which ptxas makes differently per head dim, so chosen
  // per head dim from same-call A/Bs (NOTES, session 13): whether a thread's two rows go
  // through the softmax together or one after the other, in how many independent chains each
  // row's max and sum run, and whether the wait for the previous key tile's P V is pinned after
  // the softmax (else ptxas hoists it before the max, so the softmax no longer overlaps that
  // GEMM).  Against rows one after the other with one chain: head dim 64, together, 4 chains,
  // not pinned: +2% at L = 1k, +1..+12% at 4k, +4..+6% at 16k (pinned: -4% at 1k).  128,
  // together, 4 chains, pinned: +3..+6% at 4k-16k, -1..-3% at 1k without a mask.  256 keeps
  // rows one after the other with one chain (the other schedules measured -1..-6% there).
  static constexpr bool kSoftmaxRowsTogether = kHeadDim <= 128;
  static constexpr int kSoftmaxChains = kHeadDim <= 128 ? 4 : 1;
  static constexpr bool kWaitPvAfterSoftmax = kHeadDim == 128;

  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <=
                    kThreads * (65536 / kThreads / 8 * 8), "");
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows need head dims in multiples of 64");

  // S = Q K^T: M = kBlockM (one 64-row atom per consumer warpgroup), N = kBlockN,
  // K = kHeadDim, operands in smem.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));
  // O += P V: M = kBlockM, N = kHeadDim, K = kBlockN; P from registers, V read "MN-major" (the
  // head dim is V's contiguous axis and the GEMM's N axis).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));

  // Shared tiles: rows of kHeadDim 16-bit elements in 128-byte swizzled atoms (what both TMA and
  // wgmma read without bank conflicts).
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  // Q double-buffered at head dim 64 (not packed): the producer then loads the next tile's Q
  // while this tile's last key tiles run, instead of once every consumer is done with this
  // tile's Q, so the next tile need not wait for it.  Measured +0.9..+1.1% at d=64 L=1k
  // (tiles of 192 rows x 1024 keys; an A/A control read within 0.3%), +0..+0.8% at 2k-4k; at
  // d=128 (which has the shared memory for it) -0.5..-1.5% at 1k-16k, within the noise of
  // single runs (NOTES, session 15).
  static constexpr int kQStages = (!kPackGQA && kHeadDim == 64) ? 2 : 1;
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V seen as (head_dim, keys, stage): the B operand of P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutKV{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  // The epilogue: each consumer warpgroup writes its 64 rows of O to shared memory, kOCols
  // columns at a time, and one of its threads stores them with TMA, so the warpgroup goes on
  // to its next tile while the last copy runs.  At head dim 256 the Q tile and the K/V ring
  // leave room for 128 columns only: two chunks, the second written once TMA has read the first.
  static constexpr int kOCols = kHeadDim < 128 ? kHeadDim : 128;
  using SmemLayoutO = decltype(tile_to_shape(
      SmemAtom{}, Shape<_64, Int<kOCols>, Int<kConsumers>>{}));  // (row, col, warpgroup)
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{},
                                      take<0, 2>(SmemLayoutO{}), Shape<_64, Int<kOCols>>{},
                                      _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTileBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTileBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutO>, 1024> o;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    // Per Q buffer: Q landed (TMA transaction bytes) and its tile announced; every consumer
    // thread is done with that Q and its tile.
    alignas(8) uint64_t barrier_q[kQStages];
    alignas(8) uint64_t barrier_q_empty[kQStages];
    TileInfo<kConsumers> info[2];         // tile i's in info[i % 2] (see the kernel)
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

template <typename T>
struct Sm90FwdArgs {
  typename T::TmaQ tma_q;
  typename T::TmaKV tma_k;
  typename T::TmaKV tma_v;
  FwdParams p;
  // GQA packing (T::kPackGQA; FlashAttention-3's PackGQA): a tile holds the query rows of all
  // `group` query heads of one KV head, tile row rho = position * group + head in group, so K
  // and V are read once per group instead of once per query head.  Q then comes by cp.async
  // (a TMA box cannot gather such rows with a run-time group) and O through shared memory and
  // row stores.  Tiles are then (query block, batch, KV head).  rows_q: the rows a tile counts
  // over, seqlen_q * group packed, else seqlen_q.
  int32_t group;  // heads_q / heads_kv
  int32_t rows_q;
  int32_t num_m_blocks;
  // Query block m holds rows [m * kBlockM - row_shift, (m + 1) * kBlockM - row_shift): the
  // block that seqlen_q fills only in part is the first (its rows below 0 do not exist) rather
  // than the last.  A multiple of 64 below kBlockM, so every warpgroup's 64 rows lie either all
  // below 0 (it idles) or all at or above; 0 with two consumers (no idle warpgroups there).
  // Under a causal mask the partial block then has the fewest key tiles instead of the most
  // (see the launcher).
  int32_t row_shift;
  int32_t heads_per_section;
  int32_t num_sections;  // (batch * tile heads) / heads_per_section, at least 1 (tile_coord)
  int32_t num_tiles;     // num_m_blocks * batch * (heads_kv packed, else heads_q)
  int32_t* tile_counter;  // zeroed before the launch; CTAs take tiles gridDim.x, +1, ... from it
  // Dynamic schedule: the producer takes each next tile from tile_counter and announces it in
  // shared memory.  Static: CTA c computes tiles c, c + gridDim.x, ... (no counter).  In both
  // the producer announces each tile and, after the last, the end (TileInfo::tile = -1).
  bool dynamic;
  typename T::TmaO tma_o;  // set when tma_store_o
  bool tma_store_o;        // out's address and strides suit TMA (else O from registers)
  // Packed GQA with 16-byte aligned out rows: O goes through shared memory as with TMA, then
  // the threads store whole 16-byte chunks of each row (a TMA box cannot scatter the rows).
  bool o_row_stores;
};

// Tile t -> (query block, batch * heads_q + head), heads_q being the tile heads (the KV heads
// when GQA is packed).  The (batch, head) pairs go in num_sections
// sections of heads_per_section (the launcher's choice: 1 at head dims 128 and 256 without a
// mask), the last one also taking the remainder; inside a section the query blocks go
// last-first, which under causal masking starts the longest rows first
// (longest-processing-time-first, as FlashAttention-3's scheduler).  (A short last section
// would end the grid with few heads' longest tiles running while the other SMs idle: at
// d = 256 L = 2k causal, 64 pairs in sections of 6 or 12, remainder last, measured 550, in
// sections of 8 or 16, 620 TFLOP/s.)  All in 32 bits (the launcher checks that the tile count
// fits): 64-bit divisions would cost the 24-register producer spills.  The producer computes it
// and hands it on (TileInfo).
__device__ __forceinline__ TileCoord tile_coord(int32_t tile, int32_t num_m_blocks,
                                                int32_t heads_per_section, int32_t num_sections,
                                                int32_t batch_heads, int32_t heads_q) {
  const int32_t section_size = num_m_blocks * heads_per_section;
  const int32_t section = min(tile / section_size, num_sections - 1);
  const int32_t in_section = tile - section * section_size;
  const int32_t heads_here =
      section == num_sections - 1 ? batch_heads - section * heads_per_section : heads_per_section;
  const int32_t bh = section * heads_per_section + in_section % heads_here;
  return {num_m_blocks - 1 - in_section / heads_here, bh / heads_q, bh % heads_q};
}

// A row's kChains partial maxima (max) or sums (!max) combined pairwise.
template <int kChains>
__device__ __forceinline__ float combine_chains(float (&x)[kChains], bool max) {
#pragma unroll
  for (int w = 1; w < kChains; w *= 2)
#pragma unroll
    for (int j = 0; j + w < kChains; j += 2 * w)
      x[j] = max ? fmaxf(x[j], x[j + w]) : x[j] + x[j + w];
  return x[0];
}

// Persistent: gridDim.x CTAs (at most one per SM) loop over tiles of 64 * kConsumers query rows.
// A CTA's first tile is blockIdx.x; the producer thread takes each next one from an atomic
// counter (dynamic scheduling: whichever CTA is free first takes the next-longest tile) and
// announces it to the consumers in shared memory together with the tile's Q load.  The K/V ring
// runs on across tiles (the producer issues the next tile's first K before it needs the Q
// buffer back), so the consumers find the next tile's data waiting when they finish a tile,
// instead of a new CTA's start-up and first loads.
template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    flash_fwd_sm90_kernel(CUTE_GRID_CONSTANT const Sm90FwdArgs<T> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename T::Element;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim;
  constexpr float kLn2 = 0.6931471805599453f;
  const FwdParams& p = args.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  const int num_m_blocks = args.num_m_blocks;
  // (args' fields are read where used, from the kernel parameters' constant bank: copies kept
  // in registers across the main loop made it spill)
  const int group = args.group;
  // The sequence position of tile row `row` (>= 0).
  auto position = [&](int32_t row) {
    if constexpr (T::kPackGQA) return row / args.group;
    return row;
  };
  const VisibleKeys vis(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                        p.align_bottom_right);

  if (p.rng_state != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    p.rng_state[0] = p.rng_state[1] = 0;  // no dropout in this kernel: (seed, offset) = (0, 0)
  }

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
    for (int s = 0; s < T::kQStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.barrier_q[s], 1);
      cutlass::arch::ClusterBarrier::init(&smem.barrier_q_empty[s], 128 * T::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename T::SmemLayoutVt{});

  // Tile iter's Q buffer and the phase of its two barriers (kQStages = 1: buffer 0, parity
  // iter % 2).
  auto q_stage = [](int iter) { return T::kQStages == 1 ? 0 : iter % T::kQStages; };
  auto q_phase = [](int iter) { return (iter / T::kQStages) & 1; };
  // The producer writes tile iter's info into info[iter % 2] before the mbarrier arrive that
  // announces the tile (the consumers read it after their wait on the same barrier, which
  // acquires).  It writes only after every consumer released the Q of tile iter - kQStages,
  // i.e. (kQStages <= 2) after they read this slot's previous info (tile iter - 2's, read at
  // that tile's start).
  using Info = TileInfo<T::kConsumers>;
  auto publish_tile = [&](int iter, const Info& info) {
    volatile int32_t* dst = reinterpret_cast<volatile int32_t*>(&smem.info[iter & 1]);
    const int32_t* src = reinterpret_cast<const int32_t*>(&info);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(Info) / 4); ++i) dst[i] = src[i];
    asm volatile("" ::: "memory");
  };

  if (warp_group == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x != 0) return;
    const GmemShape shape_q(static_cast<int32_t>(p.seqlen_q), static_cast<int32_t>(p.head_dim),
                            static_cast<int32_t>(p.heads_q), static_cast<int32_t>(p.batch));
    const GmemShape shape_k(static_cast<int32_t>(p.seqlen_k), static_cast<int32_t>(p.head_dim),
                            static_cast<int32_t>(p.heads_kv), static_cast<int32_t>(p.batch));
    const GmemShape shape_v(static_cast<int32_t>(p.seqlen_k), static_cast<int32_t>(p.head_dim_v),
                            static_cast<int32_t>(p.heads_kv), static_cast<int32_t>(p.batch));
    Tensor mQ = args.tma_q.get_tma_tensor(shape_q);
    Tensor mK = args.tma_k.get_tma_tensor(shape_k);
    Tensor mV = args.tma_v.get_tma_tensor(shape_v);
    auto state = cutlass::make_producer_start_state<Pipeline>();
    // Tile iter's Q buffer is free once every consumer released tile iter - kQStages's.
    auto wait_q_empty = [&](int iter) {
      if (iter >= T::kQStages) {
        cutlass::arch::ClusterBarrier::wait(&smem.barrier_q_empty[q_stage(iter)],
                                            q_phase(iter - T::kQStages));
      }
    };
    int32_t tile = blockIdx.x;
    for (int iter = 0;; ++iter) {
      if (tile >= args.num_tiles) {  // tell the consumers to stop, once they released Q
        wait_q_empty(iter);
        Info stop{};
        stop.tile = -1;
        publish_tile(iter, stop);
        cutlass::arch::ClusterTransactionBarrier::arrive(&smem.barrier_q[q_stage(iter)]);
        return;
      }
      // A tile's head: the KV head when packed, else the query head.
      const int32_t tile_heads = static_cast<int32_t>(T::kPackGQA ? p.heads_kv : p.heads_q);
      const TileCoord tc = tile_coord(tile, num_m_blocks, args.heads_per_section,
                                      args.num_sections,
                                      static_cast<int32_t>(p.batch) * tile_heads, tile_heads);
      const int b = tc.b, h = tc.h;
      const int hk = T::kPackGQA ? h : h / group;
      // This tile's first row (negative in a partial first block: see Sm90FwdArgs::row_shift)
      // and the key tiles its existing rows' positions see.
      const int32_t m0 = tc.m_block * kM - args.row_shift;
      // The positions of rows [row, row + rows) cut to [0, rows_q), as vis.block's arguments.
      auto row_positions = [&](int32_t row, int32_t rows, int32_t& first, int32_t& count) {
        const int32_t lo = max(row, 0), hi = min(row + rows, args.rows_q);
        first = position(lo);
        count = hi > lo ? position(hi - 1) + 1 - first : 0;
      };
      int32_t pos0, npos;
      row_positions(m0, kM, pos0, npos);
      const VisibleKeys::Block keys = vis.block(pos0, npos, p.seqlen_q, kN);
      const int n_begin = static_cast<int>(keys.n_begin), n_end = static_cast<int>(keys.n_end);
      // Rows below 0 (a partial first block) are out of the tensor: TMA fills them with zeros.
      // (Unused when packed: the consumers load Q.)
      Tensor gQ = local_tile(domain_offset(make_coord(-args.row_shift, 0), mQ(_, _, h, b)),
                             Shape<Int<kM>, Int<kD>>{}, make_coord(tc.m_block, 0));
      Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<kN>, Int<kD>>{},
                             make_coord(_, 0));  // (kN, kD, n)
      Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<kN>, Int<kD>>{}, make_coord(_, 0));
      auto [tQg, tQs] = tma_partition(args.tma_q, _0{}, Layout<_1>{},
                                      group_modes<0, 2>(sQ(_, _, q_stage(iter))),
                                      group_modes<0, 2>(gQ));
      auto [tKg, tKs] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(gV));
      // The first K tile goes into the ring before the Q buffer is waited for: it may be freed
      // by the previous tile's consumers sooner.
      if (n_begin < n_end) {
        pipe_k.producer_acquire(state);
        copy(args.tma_k.with(*pipe_k.producer_get_barrier(state)), tKg(_, n_begin),
             tKs(_, state.index()));
      }
      wait_q_empty(iter);
      Info info;
      info.tile = tile;
      info.m_block = tc.m_block;
      info.b = b;
      info.h = h;
      info.n_begin = n_begin;
      info.n_end = n_end;
#pragma unroll
      for (int w = 0; w < T::kConsumers; ++w) {
        // warpgroup w's own 64 rows: a key tile straddling another warpgroup's diagonal needs
        // no mask there (under a causal mask 1-2 masked key tiles per warpgroup, not 2-3)
        // (no rows: an idle warpgroup, which reads neither)
        int32_t wpos0, wnpos;
        row_positions(m0 + 64 * w, 64, wpos0, wnpos);
        const VisibleKeys::Block wg_keys = vis.block(wpos0, wnpos, p.seqlen_q, kN);
        info.interior_begin[w] = static_cast<int32_t>(wg_keys.interior_begin);
        info.interior_end[w] = static_cast<int32_t>(wg_keys.interior_end);
      }
      publish_tile(iter, info);  // released by the barrier arrive below
      if constexpr (T::kPackGQA) {  // the consumers load their rows of Q themselves
        cutlass::arch::ClusterTransactionBarrier::arrive(&smem.barrier_q[0]);
      } else {
        uint64_t* full = &smem.barrier_q[q_stage(iter)];
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, T::kTileBytesQ);
        copy(args.tma_q.with(*full), tQg, tQs);
      }
      for (int n_block = n_begin; n_block < n_end; ++n_block) {
        if (n_block > n_begin) {
          pipe_k.producer_acquire(state);
          copy(args.tma_k.with(*pipe_k.producer_get_barrier(state)), tKg(_, n_block),
               tKs(_, state.index()));
        }
        pipe_v.producer_acquire(state);
        copy(args.tma_v.with(*pipe_v.producer_get_barrier(state)), tVg(_, n_block),
             tVs(_, state.index()));
        ++state;
      }
      // Claimed only now, with this tile's loads issued: claiming it earlier would hold a long
      // (causal) tile for this CTA while another CTA may become free sooner.
      tile = args.dynamic ? atomicAdd(args.tile_counter, 1) + static_cast<int32_t>(gridDim.x)
                          : tile + static_cast<int32_t>(gridDim.x);
    }
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;  // 0 .. 128 * kConsumers - 1 over the consumer warpgroups
  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ctid);
  auto thr_pv = mma_pv.get_thread_slice(ctid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);  // shared-memory descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kM>, Int<kN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kM>, Int<kD>>{});
  // (row, column) of every accumulator element of this thread, within the tile.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));

  // wgmma's m64nNk16 accumulator: per thread, values (2 columns) x (rows r, r + 8) x (N / 8
  // column groups), in that order, which is also the order of the m64nNk16 register A operand
  // with K = N (16 columns = two groups per K step).
  constexpr int kSVals = size(tSrS), kOVals = size(tOrO);
  static_assert(kSVals == kN / 2 && kOVals == kD / 2, "unexpected wgmma accumulator layout");
  auto s_index = [](int half, int c) { return (c & 1) + 2 * half + 4 * (c >> 1); };
  Tensor tOrP = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<kN / 16>>>{});
  static_assert(size(tOrP) == kSVals, "");
  const float scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);
  constexpr float kRescaleLog2 = 8.f;  // see softmax_rows

  // Per-tile state.  Rows, columns and key bounds fit in 32 bits (TMA's shapes are int32);
  // keeping them 32-bit frees registers for the accumulators.  Keys [key_lo[r], key_hi[r]) are
  // visible to row r, stored relative to this thread's first column (thread_col: accumulator
  // value c of a row half sits at column thread_col + s_col(c) of the key tile); key tiles
  // inside [interior_begin, interior_end) are visible to every row of this warpgroup.
  int32_t row_of[2], key_lo[2], key_hi[2], interior_begin, interior_end;
  float m_row[2], l_row[2];
  const int32_t thread_col = get<1>(tScS(0));
  auto s_col = [](int c) { return (c & 1) + 8 * (c >> 1); };  // see s_index

  // Online softmax of one S tile in place (S becomes exp2(S * scale - m) in fp32); returns the
  // rescale factors exp2(m_old - m_new) of O's two rows.  Rows [r0, r1) go through each phase
  // (mask, max, exp2 and sum) together, each row's max and sum as kSoftmaxChains independent
  // partial chains (see Sm90FwdTraits: the schedule ptxas makes of it differs per head dim).
  // Max is exact in any order; a chained sum rounds differently from a left-to-right one, at
  // the level of fp32 rounding.
  constexpr int kChains = T::kSoftmaxChains;
  static_assert(kSVals / 2 % kChains == 0, "");
  auto softmax_rows = [&](auto r0_, auto r1_, int n_block, float (&alpha)[2]) {
    constexpr int r0 = decltype(r0_)::value, r1 = decltype(r1_)::value;
    const int32_t col0 = n_block * kN;
    if (col0 < interior_begin || col0 + kN > interior_end) {
#pragma unroll
      for (int r = r0; r < r1; ++r) {
        // Compared with the columns' compile-time offsets: one ISETP and one FSEL per value
        // for the right bound (causal), one more only where a left window bound falls inside.
        const int32_t lo = key_lo[r] - col0, hi = key_hi[r] - col0;
        if (lo > 0) {
#pragma unroll
          for (int c = 0; c < kSVals / 2; ++c) {
            if (s_col(c) < lo || s_col(c) >= hi) tSrS(s_index(r, c)) = -INFINITY;
          }
        } else {
#pragma unroll
          for (int c = 0; c < kSVals / 2; ++c) {
            if (s_col(c) >= hi) tSrS(s_index(r, c)) = -INFINITY;
          }
        }
      }
    }
    // A chain starts at its first value; a single chain starts from -inf and 0 instead (one
    // FMNMX and one FADD more per row, the schedule measured for it, as before session 13).
    float part[2][kChains], mx[2], m_scaled[2];
#pragma unroll
    for (int c = 0; c < kSVals / 2; ++c)
#pragma unroll
      for (int r = r0; r < r1; ++r) {
        const float x = tSrS(s_index(r, c));
        const float first = kChains > 1 ? x : fmaxf(-INFINITY, x);
        part[r][c % kChains] = c < kChains ? first : fmaxf(part[r][c % kChains], x);
      }
#pragma unroll
    for (int r = r0; r < r1; ++r) mx[r] = combine_chains<kChains>(part[r], true);
#pragma unroll
    for (int r = r0; r < r1; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
#pragma unroll
    for (int r = r0; r < r1; ++r) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
#pragma unroll
    for (int r = r0; r < r1; ++r) {
      // Lazy rescaling (FlashAttention-4's): the reference max m moves only when this tile's
      // max exceeds it by more than kRescaleLog2 in the exp2 domain, so P <= 2^kRescaleLog2.
      // O and l always share one reference, so O / l and the LSE stay exact, and most key
      // tiles leave O unscaled.  True for m_old = -inf < mx; false (NaN) while both are -inf.
      const float m_old = m_row[r];
      const bool raise = (mx[r] - m_old) * scale_log2 > kRescaleLog2;
      const float m_new = raise ? mx[r] : m_old;
      // Nothing visible yet: subtract 0 so exp2(-inf) = 0 rather than NaN.
      m_scaled[r] = m_new == -INFINITY ? 0.f : m_new * scale_log2;
      alpha[r] = raise ? exp2f(m_old * scale_log2 - m_scaled[r]) : 1.f;  // 0 if m_old = -inf
      m_row[r] = m_new;
    }
#pragma unroll
    for (int c = 0; c < kSVals / 2; ++c)
#pragma unroll
      for (int r = r0; r < r1; ++r) {
        const int i = s_index(r, c);
        tSrS(i) = exp2f(fmaf(tSrS(i), scale_log2, -m_scaled[r]));
        const float first = kChains > 1 ? tSrS(i) : 0.f + tSrS(i);
        part[r][c % kChains] = c < kChains ? first : part[r][c % kChains] + tSrS(i);
      }
#pragma unroll
    for (int r = r0; r < r1; ++r)
      l_row[r] = l_row[r] * alpha[r] + combine_chains<kChains>(part[r], false);
  };
  auto softmax_step = [&](int n_block, float (&alpha)[2]) {
    if constexpr (T::kSoftmaxRowsTogether) {
      softmax_rows(Int<0>{}, Int<2>{}, n_block, alpha);
    } else {
      softmax_rows(Int<0>{}, Int<1>{}, n_block, alpha);
      softmax_rows(Int<1>{}, Int<2>{}, n_block, alpha);
    }
  };
  // O *= alpha per row; with `vote`, skipped by the whole warp when none of its rows moved its
  // reference max (the caller without it has taken that vote).
  auto rescale_o = [&](const float (&alpha)[2], bool vote) {
    if (vote && !__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kOVals / 2; ++c) tOrO(s_index(r, c)) *= alpha[r];
  };
  auto convert_p = [&]() {
#pragma unroll
    for (int i = 0; i < kSVals; ++i) tOrP(i) = static_cast<Element>(tSrS(i));
  };
  // wgmma issue without waiting: S = Q K^T into tSrS, O += P V into tOrO (one commit group each).
  auto issue_qk = [&](int stage, int qs) {
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_qk, tSrQ(_, _, kb, qs), tSrK(_, _, kb, stage), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  auto issue_pv = [&](int stage) {
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    mma_pv.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tOrP); ++kb) {
      cute::gemm(mma_pv, tOrP(_, _, kb), tOrV(_, _, kb, stage), tOrO);
    }
    warpgroup_commit_batch();
  };
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
  constexpr int kLastWg = T::kConsumers - 1;
  // This consumer warpgroup (0 .. kLastWg), by a lane-0 broadcast (CUTLASS's
  // canonical_warp_group_idx) rather than threadIdx.x / 128: the compiler then knows it is
  // warp-uniform, and so are the values read from smem.info with it (interior_begin/end) and
  // the main loop's stage and descriptor arithmetic, which stay in uniform registers.  At head
  // dim 64: main loop 814 -> 787 instructions per key tile (24 fewer R2UR), no spill loads in
  // it (6 before), 92 -> 16 bytes spilled; measured +4..+7% at every L (d=128/256: +-3%).
  const int me = cutlass::canonical_warp_group_idx() - 1, next = me == kLastWg ? 0 : me + 1;
  auto turn_begin = [&]() { cutlass::arch::NamedBarrier::sync(256, me); };
  auto turn_end = [&](bool last) {
    if (!(last && me == kLastWg)) cutlass::arch::NamedBarrier::arrive(256, next);
  };
  auto open_ring = [&]() {
    if (me == kLastWg) cutlass::arch::NamedBarrier::arrive(256, next);
  };
  // Every consumer thread tells the producer that it is done with this tile's Q buffer and tile
  // number (after the warpgroup_wait that covers its last Q K^T GEMM, or at once for a tile
  // without visible keys): the producer overwrites both only after all of them arrived.
  auto release_q = [&](int qs) {
    cutlass::arch::ClusterBarrier::arrive(&smem.barrier_q_empty[qs]);
  };
  // Named barriers 0 .. kLastWg are the pingpong ring; kConsumers + me is this warpgroup's own
  // (the epilogue's shared-memory handoff to its TMA-issuing thread).
  auto warpgroup_sync = [&]() { cutlass::arch::NamedBarrier::sync(128, T::kConsumers + me); };
  const bool o_leader = ctid % 128 == 0;  // issues this warpgroup's TMA stores of O
  // GQA packing: this warpgroup's 64 rows of a tile (rows m0 + 64 me ..) into its slice of
  // sQ, 16 bytes per cp.async; rows past rows_q and columns past head_dim (padding) as zeros,
  // as TMA would fill them.  Issued for the next tile as soon as this warpgroup's last P V of
  // the current one is done and the producer announced it (the epilogue then overlaps the
  // load), else at the tile's start.  Only this warpgroup reads its slice, and it finished its
  // Q K^T GEMMs of the previous tile before, so no other barrier is needed; finish_q_packed
  // makes the writes visible to wgmma (the async proxy): wait, fence, warpgroup barrier.
  auto issue_q_packed = [&](int32_t m0, int b, int hk) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks per row
    const auto* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                    static_cast<int64_t>(hk) * args.group * p.q_head_stride;
#pragma unroll 1  // unrolled, the compiler kept every address live across the main loop
    for (int i = 0; i < 64 * kChunks / 128; ++i) {
      const int c = ctid % 128 + 128 * i, r = c / kChunks, col = (c % kChunks) * 8;
      const int32_t row = m0 + 64 * me + r;
      const uint32_t dst = cast_smem_ptr_to_uint(&sQ(64 * me + r, col, 0));  // (kQStages 1)
      if (row < args.rows_q && col < p.head_dim) {
        const int32_t pos = row / args.group, g = row - pos * args.group;
        const Element* src = q + pos * p.q_row_stride + g * p.q_head_stride + col;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
      } else {
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  auto finish_q_packed = [&]() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    cutlass::arch::fence_view_async_shared();
    warpgroup_sync();
  };
  bool q_issued = false;  // packed: this tile's Q rows were requested during the previous tile

  typename Pipeline::PipelineState state;  // consumers start at stage 0, phase 0
  for (int iter = 0;; ++iter) {
    const int qs = q_stage(iter);
    cutlass::arch::ClusterTransactionBarrier::wait(&smem.barrier_q[qs], q_phase(iter));
    asm volatile("" ::: "memory");  // CUTLASS's wait has no memory clobber: read after it
    const volatile auto& info = smem.info[iter & 1];
    if (info.tile < 0) break;  // no more tiles (either schedule: the producer's stop)
    const int32_t m_block = info.m_block, b = info.b, h = info.h;
    const int32_t m0 = m_block * kM - args.row_shift;  // this tile's first row (see row_shift)
    const int n_begin = info.n_begin, n_end = info.n_end;
    // A warpgroup whose 64 rows do not exist (below 0 in a partial first block, or past
    // seqlen_q) issues no GEMMs and no softmax; it still waits for and releases every K/V stage
    // and takes its pingpong turns, so the other warpgroups' barriers count as usual.  (At head
    // dim 64, seqlen 1024 = 5 1/3 tiles of 192 rows: without this, the partial tile's two empty
    // warpgroups cost the tensor cores a full tile.)  Only with three consumers (192-row tiles,
    // which power-of-two lengths never fill): at head dim 256 the extra code path made the main
    // loop spill.
    const bool idle =
        T::kConsumers == 3 && (m0 + 64 * me < 0 || m0 + 64 * me >= args.rows_q);
    // Key tiles unmasked for this warpgroup's own 64 rows (the producer's TileInfo).
    interior_begin = info.interior_begin[me];
    interior_end = info.interior_end[me];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_of[r] = m0 + get<0>(tScS(2 * r));
      const int32_t pos = position(max(row_of[r], 0));
      key_lo[r] = static_cast<int32_t>(vis.begin(pos)) - thread_col;
      key_hi[r] = static_cast<int32_t>(vis.end(pos)) - thread_col;
      m_row[r] = -INFINITY;
      l_row[r] = 0.f;
    }
    clear(tOrO);

    if (n_begin < n_end && idle) {
      // The same waits, releases and turns as below, without the math.
      auto prev = state;
      for (int n_block = n_begin; n_block < n_end; ++n_block) {
        pipe_k.consumer_wait(state);
        if (n_block > n_begin) {
          pipe_v.consumer_wait(prev);
          turn_begin();
          turn_end(false);
        } else {
          open_ring();  // as the first Q K^T below: outside the ring
        }
        pipe_k.consumer_release(state);
        if (n_block + 1 == n_end) release_q(qs);
        if (n_block > n_begin) pipe_v.consumer_release(prev);
        prev = state;
        ++state;
      }
      pipe_v.consumer_wait(prev);
      turn_begin();
      turn_end(true);
      pipe_v.consumer_release(prev);
    } else if (n_begin < n_end) {
      if constexpr (T::kPackGQA) {
        if (!q_issued) issue_q_packed(m0, b, h);
        finish_q_packed();
      }
      float alpha[2];
      // Intra-warpgroup overlap (FlashAttention-3, section 3.2): tile n's Q K^T is issued
      // together with tile n-1's P V, and this tile's softmax runs while P V is still in flight.
      pipe_k.consumer_wait(state);
      issue_qk(state.index(), qs);  // outside the ring (see the pingpong comment above)
      open_ring();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(state);
      if (n_begin + 1 == n_end) release_q(qs);
      softmax_step(n_begin, alpha);
      convert_p();
      auto prev = state;
      ++state;
      for (int n_block = n_begin + 1; n_block < n_end; ++n_block) {
        pipe_k.consumer_wait(state);
        pipe_v.consumer_wait(prev);
        turn_begin();
        issue_qk(state.index(), qs);
        issue_pv(prev.index());
        turn_end(false);
        warpgroup_wait<1>();  // S of this tile is ready; P V of the previous one may still run
        warpgroup_fence_operand(tSrS);
        pipe_k.consumer_release(state);
        if (n_block + 1 == n_end) release_q(qs);
        softmax_step(n_block, alpha);
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
            if (rescale) rescale_o(alpha, false);
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            pipe_v.consumer_release(prev);
          }
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          pipe_v.consumer_release(prev);
          rescale_o(alpha, true);
        }
        convert_p();
        prev = state;
        ++state;
      }
      pipe_v.consumer_wait(prev);
      turn_begin();
      issue_pv(prev.index());
      turn_end(true);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      pipe_v.consumer_release(prev);
    }
    q_issued = false;
    if (T::kPackGQA && !idle && n_begin < n_end) {
      // The next tile's Q rows now, so that this tile's epilogue covers their load: the
      // producer announces the next tile once every warpgroup released this one's Q (they
      // all issued their last Q K^T before this warpgroup's last P V), so this wait is short.
      // (At the loop's top the same wait then returns at once.)
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.barrier_q[q_stage(iter + 1)],
                                                     q_phase(iter + 1));
      asm volatile("" ::: "memory");
      const volatile auto& next_info = smem.info[(iter + 1) & 1];
      if (next_info.tile >= 0) {
        const int32_t next_m0 = next_info.m_block * kM - args.row_shift;
        const bool next_idle = T::kConsumers == 3 && (next_m0 + 64 * me < 0 ||
                                                      next_m0 + 64 * me >= args.rows_q);
        if (!next_idle && next_info.n_begin < next_info.n_end) {
          issue_q_packed(next_m0, next_info.b, next_info.h);
          q_issued = true;
        }
      }
    }
    if (n_begin >= n_end) {
      release_q(qs);  // no visible key: nothing reads Q
    }

    // Epilogue: out = O / l (0 for rows that saw nothing), lse = m * scale + ln(l).
    if (idle) continue;  // no row of this warpgroup exists
    float inv_l[2];
    bool empty[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_row[r];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      // No visible key (m = -inf, l = 0).  A NaN score makes l NaN: not empty, NaN comes out.
      empty[r] = m_row[r] == -INFINITY && l == 0.f;
      inv_l[r] = empty[r] ? 0.f : 1.f / l;
      l_row[r] = l;
    }
    // The value pairs (two adjacent columns) of row half r, scaled and rounded to 16 bits.
    auto o_pair = [&](int r, int c) {
      const int i = s_index(r, c);
      Element pair[2] = {static_cast<Element>(tOrO(i) * inv_l[r]),
                         static_cast<Element>(tOrO(i + 1) * inv_l[r])};
      return *reinterpret_cast<const uint32_t*>(pair);
    };
    // Row half r's sequence position and query head (packed: from its tile row), or false for
    // a row past the tile's rows (rows below 0 belong to idle warpgroups, which got here not).
    auto row_head = [&](int32_t row, int32_t& pos, int32_t& head) {
      pos = position(row);
      head = T::kPackGQA ? h * args.group + (row - pos * args.group) : h;
      return row < args.rows_q;
    };
    // (Each instantiation has one of the two shared-memory paths.)
    const bool tma_store_o = !T::kPackGQA && args.tma_store_o;
    const bool o_row_stores = T::kPackGQA && args.o_row_stores;
    if (tma_store_o || o_row_stores) {
      // This warpgroup's rows go to its own (64, kOCols) slice of smem.o, laid out as
      // SmemLayoutO (128-byte swizzle: row r's 16-byte chunk k sits at chunk k ^ (r % 8) of
      // its 128-byte row; atoms of 8 rows x 64 columns, row atoms first), then one thread
      // stores the slice with TMA, which leaves rows past seqlen_q and columns past head_dim_v
      // alone (packed GQA rows: the threads copy the rows out, see o_row_stores).  Thread (warp
      // w, lane) holds rows 16 w + lane / 4 + 8 half and columns
      // 8 g + 2 (lane % 4) + {0, 1} (wgmma's accumulator layout): each 4-byte store of a warp
      // lands in 8 different chunks, no bank conflict.  The byte offsets are written out by
      // hand (checked against CuTe's layout on the host) so that no per-value address stays
      // live across the main loop.
      constexpr int kOCols = T::kOCols, kGroups = kOCols / 8;  // 8-column groups per chunk
      const int lane = ctid % 32, warp = (ctid % 128) / 32, row8 = lane / 4;
#pragma unroll
      for (int chunk = 0; chunk < kD / kOCols; ++chunk) {
        if (o_leader) tma_store_wait<0>();  // the previous store has read the slice
        warpgroup_sync();
        unsigned char* slice = reinterpret_cast<unsigned char*>(smem.o.data()) +
                               me * (64 * kOCols * sizeof(Element)) + warp * 2048 +
                               row8 * 128 + (lane % 4) * 4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int g = 0; g < kGroups; ++g) {
            *reinterpret_cast<uint32_t*>(slice + r * 1024 + (g / 8) * 8192 +
                                         (((g % 8) ^ row8) * 16)) =
                o_pair(r, 2 * (chunk * kGroups + g));
          }
        }
        tma_store_fence();  // the generic-proxy smem writes before the TMA (async proxy) read
        warpgroup_sync();
        if (o_row_stores) {
          // Packed rows: each thread copies 16-byte chunks (row R's chunk k at byte
          // R * 128 + (k / 8) * 8192 + ((k % 8) ^ (R % 8)) * 16 of the slice, as written above)
          // to the row's (position, head) in out, whole rows per 8 or 16 neighbouring threads.
          constexpr int kRowChunks = kOCols / 8;
          const unsigned char* base = reinterpret_cast<const unsigned char*>(smem.o.data()) +
                                      me * (64 * kOCols * sizeof(Element));
#pragma unroll 1
          for (int i = 0; i < 64 * kRowChunks / 128; ++i) {
            const int c = ctid % 128 + 128 * i, rr = c / kRowChunks, k = c % kRowChunks;
            const int col = chunk * kOCols + k * 8;
            int32_t pos, head;
            if (!row_head(m0 + 64 * me + rr, pos, head) || col >= p.head_dim_v) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(
                base + rr * 128 + (k / 8) * 8192 + (((k % 8) ^ (rr % 8)) * 16));
            *reinterpret_cast<uint4*>(static_cast<Element*>(p.out) + b * p.out_batch_stride +
                                      head * p.out_head_stride + pos * p.out_row_stride +
                                      col) = v;
          }
        } else if (o_leader) {
          Tensor sO =
              make_tensor(make_smem_ptr(smem.o.data()), typename T::SmemLayoutO{})(_, _, me);
          Tensor mO = args.tma_o.get_tma_tensor(
              GmemShape(static_cast<int32_t>(p.seqlen_q), static_cast<int32_t>(p.head_dim_v),
                        static_cast<int32_t>(p.heads_q), static_cast<int32_t>(p.batch)));
          Tensor gO = local_tile(mO(_, _, h, b), Shape<_64, Int<kOCols>>{},
                                 make_coord((m0 + 64 * me) / 64, chunk));  // m0 + 64 me >= 0
          auto [tOg, tOs] = tma_partition(args.tma_o, _0{}, Layout<_1>{},
                                          group_modes<0, 2>(sO), group_modes<0, 2>(gO));
          copy(args.tma_o, tOs, tOg);
          tma_store_arrive();
        }
      }
    }
    if (!tma_store_o && !o_row_stores) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int32_t pos, head;
        if (!row_head(row_of[r], pos, head)) continue;
        Element* o_row = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                         head * p.out_head_stride + pos * p.out_row_stride;
#pragma unroll
        for (int c = 0; c < kOVals / 2; c += 2) {
          const int col = get<1>(tOcO(s_index(r, c)));
          // head_dim_v is even (the glue pads it to a multiple of 8)
          if (col < p.head_dim_v) *reinterpret_cast<uint32_t*>(o_row + col) = o_pair(r, c);
        }
      }
    }
    if (get<1>(tScS(0)) == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int32_t pos, head;
        if (row_head(row_of[r], pos, head)) {
          static_cast<float*>(p.softmax_lse)[(b * p.heads_q + head) * p.seqlen_q + pos] =
              empty[r] ? -INFINITY : (m_row[r] * scale_log2 + log2f(l_row[r])) * kLn2;
        }
      }
    }
  }
  if (o_leader) tma_store_wait<0>();  // smem.o must outlive the last store's read
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// Streaming multiprocessors of the current device (queried once per device).
inline cudaError_t sm_count(int* count) {
  *count = sm80::per_device_cached([](int device) {
    int sms = 0;
    return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess
               ? sms
               : 0;
  });
  return *count > 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

// Host side: TMA descriptors for q, k, v (the caller guarantees 16-byte aligned rows and strides),
// the tile counter zeroed, then min(tiles, SMs) persistent CTAs on `stream`.
template <typename T>
cudaError_t launch_flash_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using Element = typename T::Element;
  // A dimension of size 1 may carry any stride (0 included); TMA wants multiples of 16 bytes.
  auto stride_of = [](int64_t size, int64_t stride) {
    return size <= 1 ? int64_t{8} : stride;
  };
  auto gmem = [&](auto* ptr, int64_t rows, int64_t dim, int64_t heads, int64_t batch,
                  int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    using Ptr = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(ptr)>>,
                                   const Element*, Element*>;
    return make_tensor(make_gmem_ptr(static_cast<Ptr>(ptr)),
                       GmemShape(static_cast<int32_t>(rows), static_cast<int32_t>(dim),
                                 static_cast<int32_t>(heads), static_cast<int32_t>(batch)),
                       GmemStride(stride_of(rows, row_stride), _1{},
                                  stride_of(heads, head_stride), stride_of(batch, batch_stride)));
  };
  Sm90FwdArgs<T> args{
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.q, p.seqlen_q, p.head_dim, p.heads_q, p.batch, p.q_row_stride,
                         p.q_head_stride, p.q_batch_stride),
                    take<0, 2>(typename T::SmemLayoutQ{}),
                    Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.k, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.k_row_stride,
                         p.k_head_stride, p.k_batch_stride),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    gmem(p.v, p.seqlen_k, p.head_dim_v, p.heads_kv, p.batch, p.v_row_stride,
                         p.v_head_stride, p.v_batch_stride),
                    take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{}),
      p, 1, 0, 0, 0, 1, 1, 0, p.tile_counter, p.tile_counter != nullptr, typename T::TmaO{},
      false, false};
  // The rows a tile counts over (Sm90FwdArgs::rows_q), in 32 bits as the keys (kMaxRows,
  // pack_gqa.h; the glue keeps longer calls, and packing without a group, off this kernel).
  const int64_t group = p.heads_q / p.heads_kv;
  args.group = static_cast<int32_t>(group);
  constexpr bool pack = T::kPackGQA;
  const int64_t rows_q = pack ? p.seqlen_q * group : p.seqlen_q;
  if ((pack && group <= 1) || rows_q > kMaxRows || p.seqlen_k > kMaxRows)
    return cudaErrorInvalidValue;
  const int64_t tile_heads = pack ? p.heads_kv : p.heads_q;
  args.rows_q = static_cast<int32_t>(rows_q);
  args.num_m_blocks = static_cast<int32_t>((rows_q + T::kBlockM - 1) / T::kBlockM);
  // TMA needs a 16-byte aligned address and strides (the glue's out always has them).
  auto aligned = [](int64_t size, int64_t stride) {
    return size <= 1 || (stride * static_cast<int64_t>(sizeof(Element))) % 16 == 0;
  };
  // p.sm90_direct_epilogue (KernelOptions, experimental: to compare the two in one build): the
  // threads store O from registers (packed GQA rows too).
  const bool direct = p.sm90_direct_epilogue;
  const bool o_aligned = reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                        aligned(p.seqlen_q, p.out_row_stride) &&
                        aligned(p.heads_q, p.out_head_stride) &&
                        aligned(p.batch, p.out_batch_stride);
  args.tma_store_o = !direct && !pack && o_aligned;
  args.o_row_stores = !direct && pack && o_aligned;
  if (args.tma_store_o) {
    args.tma_o = make_tma_copy(SM90_TMA_STORE{},
                               gmem(p.out, p.seqlen_q, p.head_dim_v, p.heads_q, p.batch,
                                    p.out_row_stride, p.out_head_stride, p.out_batch_stride),
                               take<0, 2>(typename T::SmemLayoutO{}),
                               Shape<_64, Int<T::kOCols>>{}, _1{});
  }
  // Under a causal mask (a right window bound and no left one: later rows see more keys) the
  // partial query block goes first (Sm90FwdArgs::row_shift), in whole warpgroups.  With 192-row
  // tiles (head dim 64) and seqlen_q = 1024 the first block then holds rows [-128, 64), one
  // working warpgroup on one key tile, where the last block held rows [960, 1152) on all 8:
  // 27 tile passes per head instead of 32.  Measured (kernel_ab, same call) at d = 64 causal:
  // +9.6% at L = 1k, +3.3% at 2k, +-1% from 4k.  Without a mask both orders do the same work,
  // yet the shift measured -4% at L = 2k (the static schedule's waves), so it stays off there.
  // Only with three consumers: the idle path (for warpgroups without rows) exists only there.
  // p.sm90_row_shift = false (KernelOptions::sm90_row_shift, experimental: to compare the
  // two in one build) keeps the partial block last.
  if (T::kConsumers == 3 && p.sm90_row_shift && p.window_left < 0 && p.window_right >= 0) {
    args.row_shift = static_cast<int32_t>(
        (static_cast<int64_t>(args.num_m_blocks) * T::kBlockM - rows_q) / 64 * 64);
  }
  const int64_t num_tiles = static_cast<int64_t>(args.num_m_blocks) * p.batch * tile_heads;
  if (num_tiles == 0) return cudaSuccess;
  if (num_tiles > 0x7fffffffLL) return cudaErrorInvalidValue;
  args.num_tiles = static_cast<int32_t>(num_tiles);
  int sms = 0;
  cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  // Tile order (see tile_coord).  Two consumer warpgroups (head dims 128, 256) without a mask:
  // one (batch, head) pair per section, i.e. all query blocks of a head back to back, so the
  // CTAs running at once share few heads' K and V and L2 serves them: measured at d=128 L=2k,
  // DRAM reads 430 -> 201 MB (Q, K, V are 192 MB), L2 hit rate 69 -> 83%, +2-7% at d = 128
  // and 256.  Three (head dim 64, short tiles): sections of pairs whose K and V take ~24 MiB
  // of L2, the concurrent CTAs spread over many heads; one head per section measured 5% slower
  // there at L = 1k-2k (many SMs reading the same K/V lines at once).  Two under a causal mask
  // or window (tiles of unequal length): with one head per section the longest-first order
  // holds only inside each head, and the last heads' longest tiles run on with the other SMs
  // idle.  There sections of the L2 rule's size, at most 8 pairs (the best measured: against
  // one pair, d = 256 causal +4% at L = 1k, +15% at 2k-4k; d = 128 +1% at 1k, +2..+9% at 2k-4k;
  // 24 pairs measured 2-7% below 8; sm90_variants.py, NOTES session 14; measured under a causal
  // mask only: a window bounded on both sides, whose tiles are nearly equal, follows the rule).
  // p.heads_per_section > 0 (KernelOptions::sm90_section_pairs, experimental: orders compared in one
  // build) overrides it.
  const bool unequal_tiles = p.window_left >= 0 || p.window_right >= 0;
  const int64_t kv_bytes = p.seqlen_k * (p.head_dim + p.head_dim_v) * sizeof(Element);
  const int64_t l2_heads = (int64_t{24} << 20) / std::max<int64_t>(kv_bytes, 1);
  int64_t heads = T::kConsumers == 3 ? l2_heads
                  : unequal_tiles    ? std::min<int64_t>(l2_heads, 8)
                                     : 1;
  if (p.heads_per_section > 0) heads = p.heads_per_section;
  const int64_t batch_heads = p.batch * tile_heads;
  args.heads_per_section = static_cast<int32_t>(std::clamp<int64_t>(heads, 1, batch_heads));
  args.num_sections = static_cast<int32_t>(batch_heads / args.heads_per_section);
  if (args.dynamic) {
    err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t ctas = std::min<int64_t>(num_tiles, p.max_ctas > 0 ? p.max_ctas : sms);
  return sm80::launch(flash_fwd_sm90_kernel<T>, ctas, T::kThreads, T::kSmemBytes, stream, args);
}

// What each instantiation (flash_fwd_sm90_hdim<d>_<dtype>[_packgqa].cu) launches: the traits of
// head dim kHeadDim (flash_fwd_sm90_launch.h), with or without GQA packing.
template <typename CudaElement, int kHeadDim, bool kPackGQA>
cudaError_t launch_flash_fwd_sm90_hdim(const FwdParams& p, cudaStream_t stream) {
  return launch_flash_fwd_sm90<Sm90FwdTraits<CudaElement, kHeadDim, fwd_block_n<kHeadDim>(),
                                             fwd_stages<kHeadDim>(), fwd_consumers<kHeadDim>(),
                                             kPackGQA>>(p, stream);
}

}  // namespace flash_attn_ext::sm90
