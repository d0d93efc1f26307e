// Backward kernels for plain attention (no softcap, attn_bias or dropout: the `kGeneral = false`
// case) at padded head dims 64, 128 and 256, on sm_80+ (mma.sync; also runs on sm_90).  The
// general case keeps the kernels of flash_bwd_kernel.cuh, which also serve GPUs whose shared
// memory per block is too small for these (sm_86 / sm_89, 99 KB: head dim 128; their head dim
// 64 kernels in their 64-row-step variant need 97 KB and run there, measured on sm_90 only;
// head dim 256 needs 209 KB: sm_90, not sm_80's 163 KB).
//
// Same algorithm as flash_bwd_kernel.cuh, with FlashAttention-2's warp tiling instead of one
// 16-row tile per warp, which left every shared-memory fragment feeding one or two MMAs
// (ldmatrix-bound, docs/perf/cuda_backward.md).  Two ways to get dQ: by default (p.dq_accum set,
// deterministic=False) the dK/dV kernel also adds dS K into an fp32 buffer (FlashAttention-2's
// single kernel: 5 GEMM passes; on sm_90 one bulk reduction of the step's tile from shared
// memory, FlashAttention-3's way, elsewhere per-lane atomics: DqMode) and a conversion kernel
// writes dq; with deterministic=True the dK/dV kernel, then a separate dQ kernel that
// recomputes S and dP (7 passes, no atomics, bitwise reproducible):
//
//  dK/dV: one CTA of 8 warps per (kBlockN = 128 keys, 64 at head dim 256; batch, kv head); per
//    step a kBlockM-row Q / dO tile (64 rows; 128 at head dim 64) of one query head of the GQA
//    group (double-buffered cp.async, lse and D with it).  S^T = K Q^T and dP^T = V dO^T
//    (kBlockN x kBlockM) are split 4 x 2 over the warps (2 x 4 at head dim 256: 32 keys each);
//    P^T and dS^T = P^T (dP^T - D) go to shared memory as 16-bit values; after a barrier dQ
//    (kBlockM x head dim, if here), then dV += P^T dO and dK += dS^T Q (kBlockN x head dim,
//    split the same way: 32 keys x a half or quarter of the head dim each, accumulators in
//    registers).  Every warp's ldmatrix fragment feeds 2-4 MMAs (0.375-0.5 ldmatrix.x4 per
//    m16n8k16 instead of ~0.6-1 at head dims 64 / 128; at 256 S^T and dP^T, 16 queries per
//    warp, take 0.75).
//  dQ: one CTA of 8 warps per (128 query rows, 64 at head dim 256; batch, head), K / V tiles
//    of 64 keys double-buffered; S and dP split over the warps as above (32 rows each), dS to
//    shared memory, then dQ += dS K split the same way.
// dS is multiplied by the softmax scale before it is rounded to 16 bits (as in the 4-warp
// kernels; unscaled, fp16 dS would overflow 1 / scale times sooner).
//
// Rows and keys beyond the sequences are zero-filled by the loads; a query row beyond seqlen_q
// then has S = dP = 0, lse = D = 0 (zero-filled statistics) and so P = 1 but dS = 0 and a zero
// dO row: it adds nothing.  Keys beyond seqlen_k are masked (they are >= VisibleKeys::end) and
// their dK / dV rows are not stored.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm80/block_info.h"
#include "kernels/sm80/flash_bwd_dq.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/softmax.h"
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

// kBlockM_: query rows per dK/dV step, 0 = the default for the head dim (see kBlockM).
template <typename Element_, int kHeadDim_, int kBlockM_ = 0>
struct LeanBwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim (q/k and v): 64, 128 or 256
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // Both kernels lay their 8 warps out as kWarpsRow along the CTA's own rows (keys for dK/dV,
  // queries for dQ), 32 rows per warp (two m16 tiles), by kWarpsCol along the other GEMM
  // dimension: 4 x 2 up to head dim 128, 2 x 4 at 256, where each warp's dK / dV accumulators
  // (32 rows x kHeadDim / kWarpsCol) stay the 2 x 64 floats per lane of head dim 128.
  static constexpr int kWarpsRow = kHeadDim <= 128 ? 4 : 2, kWarpsCol = kWarps / kWarpsRow;
  static constexpr int kStages = 2;  // cp.async ring depth of the streamed tiles (sm_80's smem)
  // dK/dV kernel: kBlockN keys per CTA (128; 64 at head dim 256), kBlockM query rows per step:
  // by default 128 at head dim 64, as FlashAttention-2 (twice the MMA work per barrier,
  // statistics load and ldmatrix of K / V; 162 KB of shared memory, so GPUs with less, sm_86 /
  // sm_89, take 64), 64 at head dim 128 (128 would not fit the S^T / dP^T accumulators beside
  // dK / dV) and 256 (FlashAttention-2's 64 x 64 tiles there).  Shared memory: K, V; [stage] Q,
  // dO; P^T, dS^T; [stage] lse, D (fp32).
  static constexpr int kBlockN = 32 * kWarpsRow;
  static constexpr int kBlockM = kBlockM_ != 0 ? kBlockM_ : (kHeadDim == 64 ? 128 : 64);
  static constexpr int kSmemDkdv =
      (2 * kBlockN + 2 * kStages * kBlockM) * kHeadDim * int(sizeof(Element)) +
      2 * kBlockN * kBlockM * int(sizeof(Element)) + 2 * kStages * kBlockM * int(sizeof(float));
  // dQ kernel: kBlockMQ query rows per CTA, kBlockNQ keys per step.  Shared memory: Q, dO;
  // [stage] K, V; dS.
  static constexpr int kBlockMQ = 32 * kWarpsRow, kBlockNQ = 64;
  static constexpr int kSmemDq =
      (2 * kBlockMQ + 2 * kStages * kBlockNQ) * kHeadDim * int(sizeof(Element)) +
      kBlockMQ * kBlockNQ * int(sizeof(Element));
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "");
  // The 16-bit P^T / dS^T / dS tiles are swizzled over 8 or 16 chunks per row (tile.h: swz).
  static_assert(kBlockM % 64 == 0 && kBlockNQ == 64 && kWarpsRow * kWarpsCol == kWarps, "");
  // Head dims up to 128 fit sm_80's 163 KB; head dim 256 (209 KB) needs sm_90's 227 KB (the
  // launcher checks the device's limit: lean_bwd_fits).
  static_assert((kHeadDim <= 128 ? 163 : 227) * 1024 >= (kSmemDkdv > kSmemDq ? kSmemDkdv : kSmemDq),
                "");
  // dQ inside the dK/dV kernel (kBlockM x head dim per step): warps kDqWarpsRow x kDqWarpsCol
  // over (query rows, head dim), 32 rows x kDqN8 n8 tiles each.
  static constexpr int kDqWarpsRow = kBlockM / 32, kDqWarpsCol = kWarps / kDqWarpsRow;
  static constexpr int kDqN8 = kHeadDim / kDqWarpsCol / 8;
  static_assert(kDqWarpsRow * kDqWarpsCol == kWarps && kDqN8 % 2 == 0, "");
  // The default variant (kBlockM_ = 0) also has the bulk-reduce dQ for sm_90 (DqMode::kBulk),
  // which stages each step's fp32 dQ tile in kSmemDqTile more bytes of shared memory, where that
  // fits in sm_90's 227 KB (not at head dim 256: atomics there).
  static constexpr int kSmemDqTile = kBlockM * kHeadDim * int(sizeof(float));
  static constexpr bool kHasBulkDq = kBlockM_ == 0 && kSmemDkdv + kSmemDqTile <= 227 * 1024;
  // (Only head dim 256 goes without it: a change that grew another default variant past sm_90's
  // limit would otherwise quietly lose the bulk dQ.)
  static_assert(kBlockM_ != 0 || kHeadDim == 256 || kHasBulkDq, "");
};

// How the dK/dV kernel delivers dQ (flash_bwd_lean.cuh header):
//  kSeparate: not at all, the dQ kernel computes it (deterministic);
//  kAtomic:   red.global.add of each lane's fragments into p.dq_accum, row-major
//             (batch, dq_accum_rows(seqlen_q), heads_q, head dim);
//  kBulk:     (sm_90) each step's tile is written to shared memory in fragment order and added
//             to p.dq_accum with one bulk reduction (cp.reduce.async.bulk, issued by one thread
//             after the next barrier), p.dq_accum laid out (batch, heads_q, dq_accum_rows / kM,
//             kM x head dim tile in fragment order: dq_frag_offset).
enum class DqMode { kSeparate, kAtomic, kBulk };

// Offset in floats, within a kBlockM x head dim tile in fragment order, of the float4
// dq_acc[mt][j][0..3] of lane `lane` of warp `warp` (the dK/dV kernel's dQ GEMM layout): 8 such
// float4 per lane, stored lane-interleaved so that a warp's 16-byte stores are conflict-free.
template <typename T>
__host__ __device__ constexpr int dq_frag_offset(int warp, int mt, int j, int lane) {
  return ((warp * 2 * T::kDqN8 + mt * T::kDqN8 + j) * 32 + lane) * 4;
}

// *gmem += *smem elementwise for `bytes` bytes of fp32 (multiple of 16, both 16-byte aligned),
// asynchronously (bulk-async group of the calling thread; sm_90).
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, uint32_t smem, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;\n" ::"l"(gmem),
               "r"(smem), "r"(bytes)
               : "memory");
#else
  __trap();  // never launched there (launch_flash_bwd_lean checks the binary's version)
#endif
}
// Waits until this thread's bulk reductions have read their shared memory (kRead) or completed.
template <bool kRead>
__device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kRead)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// p[0] += a, p[1] += b in global memory, no return value (one vector RED on sm_90).
__device__ __forceinline__ void red_add2(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(ptr, a);
  atomicAdd(ptr + 1, b);
#endif
}

template <typename T, DqMode kDqMode>
__global__ void __launch_bounds__(T::kThreads, 1)
    flash_bwd_dkdv_lean_kernel(const BwdParams p, const float* delta, int64_t num_n_blocks) {
  using Element = typename T::Element;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim, kC = T::kChunks;
  constexpr int kStages = T::kStages;
  constexpr int kMC = kM / 8;                    // chunks per row of the P^T / dS^T tiles
  constexpr int kRowsW = kN / T::kWarpsRow;      // keys per warp, both phases
  constexpr int kMT = kRowsW / 16;               // m16 tiles per warp
  constexpr int kS8 = kM / T::kWarpsCol / 8;     // n8 tiles (queries) per warp of S^T
  constexpr int kD8 = kD / T::kWarpsCol / 8;     // n8 tiles (head dim) per warp of dK / dV
  constexpr int kQC = T::kDqWarpsCol, kQD8 = T::kDqN8;  // the dQ GEMM's warp layout
  constexpr bool kDqHere = kDqMode != DqMode::kSeparate;
  extern __shared__ __align__(128) unsigned char lean_smem[];  // 128: see swz_step
  Element* k_s = reinterpret_cast<Element*>(lean_smem);
  check_swz_alignment(lean_smem);
  Element* v_s = k_s + kN * kD;
  Element* qdo_s = v_s + kN * kD;                   // [stage][Q | dO], kM x kD each
  Element* pt_s = qdo_s + kStages * 2 * kM * kD;    // P^T, kN x kM
  Element* dst_s = pt_s + kN * kM;                  // dS^T, kN x kM
  float* stats_s = reinterpret_cast<float*>(dst_s + kN * kM);  // [stage][lse | D], raw
  // kBulk: the step's fp32 dQ tile (kSmemDqTile bytes, 128-byte aligned: every region above is
  // a multiple of 128 bytes).
  [[maybe_unused]] float* dq_s = stats_s + kStages * 2 * kM;

  const int64_t bid = blockIdx.x;
  const int64_t n_block = bid % num_n_blocks;
  const int64_t bhk = bid / num_n_blocks;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = n_block * kN;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wr = warp % T::kWarpsRow, wc = warp / T::kWarpsRow;

  const VisibleKeys vis(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                        p.align_bottom_right);
  const int64_t n1 = n0 + kN < p.seqlen_k ? n0 + kN : p.seqlen_k;
  int64_t row_lo = vis.first_row(n0), row_hi = vis.row_limit(n1);
  row_lo = row_lo < 0 ? 0 : row_lo;
  row_hi = row_hi > p.seqlen_q ? p.seqlen_q : row_hi;
  const int64_t m_begin = row_lo / kM;
  const int m_blocks = row_hi > row_lo ? static_cast<int>((row_hi + kM - 1) / kM - m_begin) : 0;
  const int64_t steps = m_blocks * group;  // (query head of the group, query block) pairs

  const auto* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const auto* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  const float scale = static_cast<float>(p.softmax_scale);
  const float scale_log2 = scale * 1.4426950408889634f;  // as ScoreFn's for plain scores

  // Issues the async loads of a step's Q and dO tiles (query head h, rows m0..) and its raw lse
  // and D (zero-filled beyond seqlen_q).
  auto load_step = [&](int stage, int64_t h, int64_t m0) {
    Element* dst = qdo_s + stage * 2 * kM * kD;
    load_tile_async<Element, kM, kC, T::kThreads>(
        dst, static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride,
        p.q_row_stride, m0, p.seqlen_q, static_cast<int>(p.head_dim));
    load_tile_async<Element, kM, kC, T::kThreads>(
        dst + kM * kD,
        static_cast<const Element*>(p.dout) + b * p.dout_batch_stride + h * p.dout_head_stride,
        p.dout_row_stride, m0, p.seqlen_q, static_cast<int>(p.head_dim_v));
    static_assert(2 * kM <= T::kThreads, "one statistic per thread");
    if (tid < 2 * kM) {
      const int r = tid % kM;
      const float* src = tid < kM ? static_cast<const float*>(p.softmax_lse) : delta;
      src += (b * p.heads_q + h) * p.seqlen_q;
      const bool in = m0 + r < p.seqlen_q;
      cp_async_4(smem_addr(stats_s + stage * 2 * kM + tid), in ? src + m0 + r : src, in);
    }
  };
  // Step t is (query head hk * group + t / m_blocks, query block m_begin + t % m_blocks); both
  // the step being computed and the one being loaded walk that order with counters (a 64-bit
  // division per step cost ~100 instructions per thread against 128 MMAs per warp).
  struct StepPos {
    int64_t h;
    int m;  // query block index minus m_begin
  };
  auto advance = [&](StepPos& s) {
    if (++s.m == m_blocks) {
      s.m = 0;
      ++s.h;
    }
  };
  StepPos load_pos{hk * group, 0};
  auto load_next = [&](int stage) {
    load_step(stage, load_pos.h, (m_begin + load_pos.m) * kM);
    advance(load_pos);
  };

  if (steps > 0) {
    load_tile_async<Element, kN, kC, T::kThreads>(k_s, k, p.k_row_stride, n0, p.seqlen_k,
                                                  static_cast<int>(p.head_dim));
    load_tile_async<Element, kN, kC, T::kThreads>(v_s, v, p.v_row_stride, n0, p.seqlen_k,
                                                  static_cast<int>(p.head_dim_v));
    load_next(0);
  }
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < kStages - 1; ++s) {
    if (s < steps) load_next(s);
    cp_async_commit();  // one group per stage, empty or not, keeps the wait counts fixed
  }

  // Per-lane ldmatrix base addresses (stage 0 for Q and dO).
  const uint32_t k_a = a_base<kC>(k_s, wr * kRowsW, lane);
  const uint32_t v_a = a_base<kC>(v_s, wr * kRowsW, lane);
  const uint32_t q_b = b_base<kC>(qdo_s, wc * kS8 * 8, lane);
  const uint32_t do_b = b_base<kC>(qdo_s + kM * kD, wc * kS8 * 8, lane);
  const uint32_t pt_a = a_base<kMC>(pt_s, wr * kRowsW, lane);
  const uint32_t dst_a = a_base<kMC>(dst_s, wr * kRowsW, lane);
  const uint32_t pt_c = frag_base<kMC>(pt_s, wr * kRowsW, wc * kS8, lane);
  const uint32_t dst_c = frag_base<kMC>(dst_s, wr * kRowsW, wc * kS8, lane);
  const uint32_t q_bt = bt_base<kC>(qdo_s, wc * kD8, lane);
  const uint32_t do_bt = bt_base<kC>(qdo_s + kM * kD, wc * kD8, lane);
  // dQ here: warp (wq, wd) of kDqWarpsRow x kQC; dS read from dS^T (chunks 4 wq..), K from
  // column chunk wd * kQD8.
  const int wq = warp / kQC, wd = warp % kQC;
  [[maybe_unused]] const uint32_t ds_at = at_base<kMC>(dst_s, wq * 4, lane);
  [[maybe_unused]] const uint32_t k_bt = bt_base<kC>(k_s, wd * kQD8, lane);

  float dk_acc[kMT][kD8][4], dv_acc[kMT][kD8][4];
  zero(dk_acc);
  zero(dv_acc);

  // kBulk: the tile of p.dq_accum that dq_s holds (step t - 1's), added after the next barrier.
  [[maybe_unused]] float* dq_pending = nullptr;
  [[maybe_unused]] const int64_t dq_rows = dq_accum_rows(p.seqlen_q);
  [[maybe_unused]] auto issue_dq_reduce = [&] {
    if (tid == 0 && dq_pending != nullptr)
      bulk_reduce_add_f32(dq_pending, smem_addr(dq_s), T::kSmemDqTile);
  };

  StepPos pos{hk * group, 0};
  for (int64_t t = 0; t < steps; ++t) {
    const int stage = static_cast<int>(t % kStages);
    cp_async_wait<kStages - 2>();  // step t's group has landed (for this thread) ...
    __syncthreads();  // ... for all threads; and every warp is done with step t - 1
    if constexpr (kDqMode == DqMode::kBulk) issue_dq_reduce();  // step t - 1's dQ tile
    // The stage step t - 1 used, and P^T / dS^T, are free now (step t + 1's loads are issued
    // later in the step, see below).

    const float* lse_s = stats_s + stage * 2 * kM;
    const float* d_s = lse_s + kM;
    const int64_t m0 = (m_begin + pos.m) * kM;
    [[maybe_unused]] const int64_t pos_h = pos.h;  // query head of this step
    advance(pos);

    // S^T and dP^T: this warp's 32 keys x kM / kWarpsCol queries.
    float st[kMT][kS8][4], dpt[kMT][kS8][4];
    zero(st);
    zero(dpt);
    const uint32_t stage_bytes = static_cast<uint32_t>(stage * 2 * kM * kD * sizeof(Element));
    lean_gemm_ss<Element, kC, kMT, kS8, kD>(st, k_a, q_b + stage_bytes);
    lean_gemm_ss<Element, kC, kMT, kS8, kD>(dpt, v_a, do_b + stage_bytes);

    // P^T = exp2(S^T * scale_log2 - lse_log2) and dS^T * scale = P^T (dP^T scale - D scale);
    // the masked variant (a key block not visible to every row of the tile) compares each key
    // with its row's visible range, 32-bit and relative to the block.
    auto softmax_grad = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      VisibleKeys::Relative rel{};
      if constexpr (kMasked) rel = vis.relative(m0, n0, kN);
#pragma unroll
      for (int j = 0; j < kS8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int q = wc * kS8 * 8 + j * 8 + 2 * (lane % 4) + c;  // query row within the tile
          const float lse2 = lse_log2(lse_s[q]);
          const float dd = d_s[q] * scale;
          int lo = 0, hi = kN;  // visible keys of row q, relative to n0
          if constexpr (kMasked) {
            lo = rel.begin(q);
            hi = rel.end(q);
          }
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int key = wr * kRowsW + mt * 16 + lane / 4 + 8 * r;  // within the block
              float pr = exp2f(fmaf(st[mt][j][2 * r + c], scale_log2, -lse2));
              if (kMasked && (key < lo || key >= hi)) pr = 0.f;
              st[mt][j][2 * r + c] = pr;
              // dS^T * scale (the gradient of the scaled scores) is what goes to 16 bits, as in
              // the 4-warp kernels: unscaled, fp16 would overflow 1 / scale times sooner.
              dpt[mt][j][2 * r + c] = pr * fmaf(dpt[mt][j][2 * r + c], scale, -dd);
            }
        }
    };
    // Masking is needed unless every key of the block is visible to every row of the tile.
    const int64_t last = (m0 + kM < p.seqlen_q ? m0 + kM : p.seqlen_q) - 1;
    if (n0 < vis.begin(last) || n0 + kN > vis.end(m0))
      softmax_grad(std::true_type{});
    else
      softmax_grad(std::false_type{});
    store_frag_smem<Element, kMC>(pt_c, st);
    store_frag_smem<Element, kMC>(dst_c, dpt);
    // kBulk: dq_s is written after the next barrier; the reduction issued at the top of this
    // step must have read it by then.
    if constexpr (kDqMode == DqMode::kBulk)
      if (tid == 0) bulk_wait_all<true>();
    __syncthreads();  // P^T and dS^T complete

    if constexpr (kDqHere) {
      // dQ (kM query rows x head dim) += dS K over this CTA's kBlockN keys, added to the fp32
      // p.dq_accum (FlashAttention-2's single-kernel backward): warps kDqWarpsRow x kQC
      // over (query rows, head dim), 32 rows x kD / kQC columns each.  First in the phase, so
      // the REDs drain while the dV / dK MMAs run.
      if constexpr (kDqMode == DqMode::kBulk) {
        float dq_acc[2][kQD8][4];
        zero(dq_acc);
        lean_gemm_ss_t<Element, kMC, kC, 2, kQD8, kN, true>(dq_acc, ds_at, k_bt);
        // The tile to shared memory in fragment order, 16-byte stores; fenced for the bulk
        // reduction, which thread 0 issues after the next barrier (or after the loop).
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int j = 0; j < kQD8; ++j)
            *reinterpret_cast<float4*>(dq_s + dq_frag_offset<T>(warp, mt, j, lane)) =
                make_float4(dq_acc[mt][j][0], dq_acc[mt][j][1], dq_acc[mt][j][2],
                            dq_acc[mt][j][3]);
        fence_proxy_async_smem();
        dq_pending = p.dq_accum + ((b * p.heads_q + pos_h) * dq_rows + m0) * kD;
      } else {
        // Whole tiles: dq_accum has dq_accum_rows(seqlen_q) rows per batch (zeros added beyond
        // seqlen_q), so no row test splits the REDs from the MMAs around them.  In parts of
        // kPartN8 n8 tiles: two at head dim 256 (kQD8 = 8), so that 32 fewer accumulators
        // are live beside dK / dV (the whole tile spilled 40 bytes there).
        static_assert(128 % kM == 0, "dq_accum_rows pads to 128-row tiles");
        constexpr int kPartN8 = kQD8 > 4 ? kQD8 / 2 : kQD8;
        const int64_t row_stride = p.heads_q * kD;
        float* dq_row0 = p.dq_accum + (b * dq_rows + m0) * row_stride + pos_h * kD +
                         wd * kQD8 * 8 + 2 * (lane % 4);
#pragma unroll
        for (int part = 0; part < kQD8 / kPartN8; ++part) {
          float dq_acc[2][kPartN8][4];
          zero(dq_acc);
          // (swz_step: the part's first chunk, a multiple of kPartN8 = 4, shares no bit with
          // the base's lane / 16 or the GEMM's steps 2 j2 < 4)
          lean_gemm_ss_t<Element, kMC, kC, 2, kPartN8, kN, true>(
              dq_acc, ds_at, swz_step(k_bt, part * kPartN8));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float* dst = dq_row0 + (wq * 32 + mt * 16 + lane / 4 + 8 * r) * row_stride +
                           part * kPartN8 * 8;
#pragma unroll
              for (int j = 0; j < kPartN8; ++j)
                red_add2(dst + j * 8, dq_acc[mt][j][2 * r], dq_acc[mt][j][2 * r + 1]);
            }
        }
      }
    }

    // Step t + 1's Q / dO / lse / D loads into the stage step t - 1 used, issued here, under
    // the dV / dK MMAs, rather than right after the first barrier, where all 8 warps' cp.async
    // (and their address arithmetic) queued in front of the S^T / dP^T ldmatrix: +10-12%
    // (docs/perf/cuda_backward.md).  Still half a step ahead of their use.
    if (t + kStages - 1 < steps) load_next(static_cast<int>((t + kStages - 1) % kStages));
    cp_async_commit();
    // dV += P^T dO, dK += dS^T Q: this warp's 32 keys x kD / kWarpsCol head-dim columns.
    lean_gemm_ss_t<Element, kMC, kC, kMT, kD8, kM>(dv_acc, pt_a, do_bt + stage_bytes);
    lean_gemm_ss_t<Element, kMC, kC, kMT, kD8, kM>(dk_acc, dst_a, q_bt + stage_bytes);
  }
  cp_async_wait<0>();  // only empty groups can be left; no copy outlives the CTA
  if constexpr (kDqMode == DqMode::kBulk) {
    __syncthreads();  // the last step's dQ tile is complete
    issue_dq_reduce();
    if (tid == 0) bulk_wait_all<false>();  // done before the CTA's shared memory goes
  }

  auto* dk = static_cast<Element*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride;
  auto* dv = static_cast<Element*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride;
  store_rows<Element>(dk, p.dk_row_stride, dk_acc, n0 + wr * kRowsW, p.seqlen_k, wc * kD8 * 8,
                      static_cast<int>(p.head_dim), lane);
  store_rows<Element>(dv, p.dv_row_stride, dv_acc, n0 + wr * kRowsW, p.seqlen_k, wc * kD8 * 8,
                      static_cast<int>(p.head_dim_v), lane);
}

// The 8-warp dQ kernel's part of flash_bwd_dq.h's skeleton: warps kWarpsRow x kWarpsCol over
// (query rows, keys) for S and dP, 32 rows each; dS (times the scale) through shared memory, then
// dQ += dS K split over (query rows, head dim) the same way.
template <typename T>
struct DqLeanStep {
  using Traits = T;
  using Element = typename T::Element;
  static constexpr int kM = T::kBlockMQ, kN = T::kBlockNQ, kD = T::kHeadDim, kC = T::kChunks;
  static constexpr int kStages = T::kStages;
  static constexpr int kNC = kN / 8;                    // chunks per row of the dS tile
  static constexpr int kRowsW = kM / T::kWarpsRow;      // query rows per warp, both phases
  static constexpr int kMT = kRowsW / 16;
  static constexpr int kS8 = kN / T::kWarpsCol / 8;     // n8 tiles (keys) per warp of S
  static constexpr int kD8 = kD / T::kWarpsCol / 8;     // n8 tiles (head dim) per warp of dQ
  static constexpr bool kPrefetchFirst = false, kTwoCopies = true, kSyncAtEnd = false;
  const float scale, scale_log2;
  // Per-lane ldmatrix base addresses (stage 0 for K and V) and dS's store base.
  uint32_t q_a, do_a, k_b, v_b, ds_a, ds_c, k_bt;

  __device__ __forceinline__ DqLeanStep(const BwdParams& p, const SeqInfo&, int64_t, int64_t)
      : scale(static_cast<float>(p.softmax_scale)),
        scale_log2(scale * 1.4426950408889634f) {}
  __device__ __forceinline__ static int row0(int warp) { return (warp % T::kWarpsRow) * kRowsW; }
  __device__ __forceinline__ static int col0(int warp) {
    return (warp / T::kWarpsRow) * kD8 * 8;
  }
  // D scale (dS is stored scaled).
  __device__ __forceinline__ float scale_d(float d) const { return d * scale; }

  __device__ __forceinline__ void setup(int64_t, const Element* q_s, const Element* do_s,
                                        const Element* kv_s, int warp, int lane) {
    const int wr = warp % T::kWarpsRow, wc = warp / T::kWarpsRow;
    const Element* ds_s = kv_s + kStages * 2 * kN * kD;  // dS, kM x kN
    q_a = a_base<kC>(q_s, wr * kRowsW, lane);
    do_a = a_base<kC>(do_s, wr * kRowsW, lane);
    k_b = b_base<kC>(kv_s, wc * kS8 * 8, lane);
    v_b = b_base<kC>(kv_s + kN * kD, wc * kS8 * 8, lane);
    ds_a = a_base<kNC>(ds_s, wr * kRowsW, lane);
    ds_c = frag_base<kNC>(ds_s, wr * kRowsW, wc * kS8, lane);
    k_bt = bt_base<kC>(kv_s, wc * kD8, lane);
  }
  __device__ __forceinline__ static uint32_t stage_bytes(int stage) {
    return static_cast<uint32_t>(stage * 2 * kN * kD * sizeof(Element));
  }

  // S and dP: this warp's 32 rows x kN / kWarpsCol keys.
  __device__ __forceinline__ void scores(float (&s)[kMT][kS8][4], float (&dp)[kMT][kS8][4],
                                         const Element*, const Element*, const Element*,
                                         int stage, int, int) const {
    lean_gemm_ss<Element, kC, kMT, kS8, kD>(s, q_a, k_b + stage_bytes(stage));
    lean_gemm_ss<Element, kC, kMT, kS8, kD>(dp, do_a, v_b + stage_bytes(stage));
  }

  // dS * scale = P (dP scale - D scale), P = exp2(S * scale_log2 - lse_log2), into s; the masked
  // variant compares each key with its row's visible range (32-bit, relative to the block).
  template <typename Masked>
  __device__ __forceinline__ void grad(Masked, float (&s)[kMT][kS8][4],
                                       const float (&dp)[kMT][kS8][4],
                                       const float (&lse_row)[kMT][2],
                                       const float (&d_row)[kMT][2], const DqTile& t) const {
    constexpr bool kMasked = Masked::value;
    const int wr = t.warp % T::kWarpsRow, wc = t.warp / T::kWarpsRow, lane = t.lane;
    VisibleKeys::Relative rel{};
    if constexpr (kMasked) rel = t.vis.relative(t.m0, t.n_block * kN, kN);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int lo = 0, hi = kN;  // visible keys of this row, relative to the block
        if constexpr (kMasked) {
          const int dr = wr * kRowsW + mt * 16 + lane / 4 + 8 * r;  // row within the block
          lo = rel.begin(dr);
          hi = rel.end(dr);
        }
#pragma unroll
        for (int j = 0; j < kS8; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = wc * kS8 * 8 + j * 8 + 2 * (lane % 4) + c;  // within the block
            float pr = exp2f(fmaf(s[mt][j][2 * r + c], scale_log2, -lse_row[mt][r]));
            if (kMasked && (key < lo || key >= hi)) pr = 0.f;
            s[mt][j][2 * r + c] = pr * fmaf(dp[mt][j][2 * r + c], scale, -d_row[mt][r]);
          }
      }
  }

  // dS to shared memory, then dQ += dS K: this warp's 32 rows x kD / kWarpsCol head-dim columns.
  __device__ __forceinline__ void dq(float (&dq_acc)[kMT][kD8][4], const float (&s)[kMT][kS8][4],
                                     const Element*, int stage, int) const {
    store_frag_smem<Element, kNC>(ds_c, s);
    __syncthreads();  // dS complete
    lean_gemm_ss_t<Element, kNC, kC, kMT, kD8, kN>(dq_acc, ds_a, k_bt + stage_bytes(stage));
  }
};

template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    flash_bwd_dq_lean_kernel(const BwdParams p, const float* delta, int64_t num_m_blocks) {
  extern __shared__ __align__(128) unsigned char lean_smem[];  // 128: see swz_step
  check_swz_alignment(lean_smem);
  bwd_dq_body<DqLeanStep<T>>(p, delta, num_m_blocks, lean_smem);
}

template <typename T>
bool lean_bwd_fits() {
  const int need = T::kSmemDkdv > T::kSmemDq ? T::kSmemDkdv : T::kSmemDq;
  return max_smem_optin_per_block() >= need;
}

// dq = p.dq_accum in Element.  kAtomic layout (row-major (batch, dq_accum_rows(seqlen_q),
// heads_q, kHeadDim)): one CTA per (kConvertRows rows, batch, head), 4 columns per thread and
// iteration.  kBulk layout (tiles in fragment order, DqMode): one CTA per (kBlockM-row tile,
// batch, head), unpermuted through shared memory.
constexpr int kConvertRows = 64;
template <typename T, DqMode kDqMode>
__global__ void __launch_bounds__(256)
    flash_bwd_convert_dq_kernel(const BwdParams p, int64_t num_m_blocks) {
  using Element = typename T::Element;
  constexpr int kD = T::kHeadDim;
  constexpr int kRows = kDqMode == DqMode::kBulk ? T::kBlockM : kConvertRows;
  const int64_t bid = blockIdx.x;
  const int64_t m0 = (bid % num_m_blocks) * kRows, bh = bid / num_m_blocks;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  auto* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
             m0 * p.dq_row_stride;
  const int cols = static_cast<int>(p.head_dim);
  const int64_t rows = dq_accum_rows(p.seqlen_q);
  if constexpr (kDqMode == DqMode::kBulk) {
    // Through shared memory, so that dq is written in whole 16-byte row chunks (rows of dq are
    // 16-byte aligned and head_dim a multiple of 8: the glue's kernel_ready).
    constexpr int kQD8 = T::kDqN8, kPerWarp = 2 * kQD8 * 32;  // float4s per warp
    constexpr int kPitch = kD + 8;  // elements per staged row (+16 bytes: fewer bank conflicts)
    __shared__ __align__(16) Element tile[kRows * kPitch];
    const float4* src =
        reinterpret_cast<const float4*>(p.dq_accum + ((b * p.heads_q + h) * rows + m0) * kD);
    for (int q = static_cast<int>(threadIdx.x); q < kRows * kD / 4; q += 256) {
      const int lane = q % 32, i = (q % kPerWarp) / 32, warp = q / kPerWarp;
      const int mt = i / kQD8, j = i % kQD8;
      const int wq = warp / T::kDqWarpsCol, wd = warp % T::kDqWarpsCol;
      const int row = wq * 32 + mt * 16 + lane / 4;
      const int col = wd * kQD8 * 8 + j * 8 + 2 * (lane % 4);
      const float4 x = src[q];
      *reinterpret_cast<uint32_t*>(tile + row * kPitch + col) = pack2<Element>(x.x, x.y);
      *reinterpret_cast<uint32_t*>(tile + (row + 8) * kPitch + col) = pack2<Element>(x.z, x.w);
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < kRows * kD / 8; i += 256) {
      const int r = i / (kD / 8), c = (i % (kD / 8)) * 8;
      if (m0 + r < p.seqlen_q && c < cols)
        *reinterpret_cast<uint4*>(dq + r * p.dq_row_stride + c) =
            *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
    }
  } else {
    constexpr int kQuads = kD / 4;
    const float* src = p.dq_accum + ((b * rows + m0) * p.heads_q + h) * kD;
    for (int i = static_cast<int>(threadIdx.x); i < kRows * kQuads; i += 256) {
      const int r = i / kQuads, c = (i % kQuads) * 4;
      if (m0 + r >= p.seqlen_q || c >= cols) continue;
      const float4 x = *reinterpret_cast<const float4*>(src + r * p.heads_q * kD + c);
      uint32_t* out = reinterpret_cast<uint32_t*>(dq + r * p.dq_row_stride + c);
      out[0] = pack2<Element>(x.x, x.y);
      if (c + 2 < cols) out[1] = pack2<Element>(x.z, x.w);
    }
  }
}

// Whether the kBulk dK/dV kernel can run here: its shared memory fits and the kernel image the
// runtime picked was compiled for sm_90+ (not, e.g., sm_80 code run through PTX JIT), checked
// once per device.
template <typename T>
bool bulk_dq_ok() {
  if constexpr (!T::kHasBulkDq) {
    return false;
  } else {
    if (max_smem_optin_per_block() < T::kSmemDkdv + T::kSmemDqTile) return false;
    return per_device_cached([](int) {  // 1 no, 2 yes
             cudaFuncAttributes attr{};
             if (cudaFuncGetAttributes(&attr, flash_bwd_dkdv_lean_kernel<T, DqMode::kBulk>) !=
                 cudaSuccess) {
               (void)cudaGetLastError();
               return 1;
             }
             return attr.binaryVersion >= 90 ? 2 : 1;
           }) == 2;
  }
}

// The dK/dV and dQ launches (delta already computed, p.dq_accum zeroed: flash_bwd_kernel.cuh's
// delta kernel) on `stream`.  With p.dq_accum: dQ is accumulated there by the dK/dV kernel
// (bulk reductions on sm_90, else fp32 atomics; not bitwise reproducible) and converted;
// without: the separate dQ kernel (bitwise reproducible).
template <typename T>
cudaError_t launch_flash_bwd_lean(const BwdParams& p, const float* delta, cudaStream_t stream) {
  const int64_t num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  const int64_t dkdv_blocks = num_n_blocks * p.batch * p.heads_kv;
  if (p.dq_accum != nullptr) {
    cudaError_t err;
    // kernel_select.h picks the bulk dQ only where it runs; a mismatch is an error, never a
    // silent switch to the atomic path.
    if (p.dq_bulk && !bulk_dq_ok<T>()) return cudaErrorNotSupported;
    if constexpr (T::kHasBulkDq) {  // (not instantiated where its tile does not fit)
      if (p.dq_bulk) {
        err = launch(flash_bwd_dkdv_lean_kernel<T, DqMode::kBulk>, dkdv_blocks, T::kThreads,
                     T::kSmemDkdv + T::kSmemDqTile, stream, p, delta, num_n_blocks);
        if (err != cudaSuccess) return err;
        const int64_t num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
        return launch(flash_bwd_convert_dq_kernel<T, DqMode::kBulk>,
                      num_m_blocks * p.batch * p.heads_q, 256, 0, stream, p, num_m_blocks);
      }
    }
    err = launch(flash_bwd_dkdv_lean_kernel<T, DqMode::kAtomic>, dkdv_blocks, T::kThreads,
                 T::kSmemDkdv, stream, p, delta, num_n_blocks);
    if (err != cudaSuccess) return err;
    const int64_t num_m_blocks = (p.seqlen_q + kConvertRows - 1) / kConvertRows;
    return launch(flash_bwd_convert_dq_kernel<T, DqMode::kAtomic>,
                  num_m_blocks * p.batch * p.heads_q, 256, 0, stream, p, num_m_blocks);
  }
  cudaError_t err = launch(flash_bwd_dkdv_lean_kernel<T, DqMode::kSeparate>, dkdv_blocks,
                           T::kThreads, T::kSmemDkdv, stream, p, delta, num_n_blocks);
  if (err != cudaSuccess) return err;
  const int64_t num_m_blocks = (p.seqlen_q + T::kBlockMQ - 1) / T::kBlockMQ;
  return launch(flash_bwd_dq_lean_kernel<T>, num_m_blocks * p.batch * p.heads_q, T::kThreads,
                T::kSmemDq, stream, p, delta, num_m_blocks);
}

}  // namespace flash_attn_ext::sm80
