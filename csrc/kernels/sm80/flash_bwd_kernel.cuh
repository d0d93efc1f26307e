// FlashAttention-2 backward for sm_80+ (mma.sync; also runs on sm_90), by recomputation
// (arXiv:2205.14135 Algorithm 4; FlashAttention-2, arXiv:2307.08691, Algorithm 2).
//
// The forward saved out and the LSE only.  Three kernels, none with atomics, so the gradients
// are bitwise reproducible run to run (deterministic=True costs nothing):
//  1. delta:  D_i = rowsum(dO_i * O_i) - dlse_i  (fp32, one warp per row; dlse_i, the gradient
//     flowing into softmax_lse, is 0 when absent).
//  2. dK/dV:  one CTA per (key block of 64 rows, batch, kv head[, half of the head dim]); each of
//     the 4 warps owns 16 key rows and keeps their dK/dV accumulators in registers.  It streams
//     Q/dO tiles of every query head of the GQA group (double-buffered cp.async) and per tile
//     recomputes S^T = K Q^T and P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D),
//     dV += P^T dO, dK += dS^T Q.  Summing the group's heads inside the CTA is the GQA reduction.
//  3. dQ:     one CTA per (query block of 64 rows, batch, head); each warp owns 16 query rows and
//     streams K/V tiles: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// Kernel 3 repeats two of kernel 2's GEMMs (S and dP): 7 GEMM passes instead of the 5 of
// FlashAttention-2's single kernel that adds dQ with fp32 atomics.  That variant, on these
// 4-warp kernels, measured 11-21% slower (docs/perf/cuda_backward.md) and is not kept here; the
// 8-warp kernels below do use it.  Kernel 3 and the 8-warp dQ kernel share one skeleton
// (flash_bwd_dq.h), whose block
// prologue (as the forward's) is block_info.h's.
//
// Plain attention (no softcap / bias / dropout) runs the 8-warp kernels of flash_bwd_lean.cuh
// instead of 2 and 3 where the GPU's shared memory allows them (head dim 256: sm_90's 227 KB)
// (launch_flash_bwd picks; with p.dq_accum, i.e. deterministic=False, dQ is added there with
// atomics); the kernels here serve everything else.
//
// Scores follow the forward (score.h: scale, softcap, bias); P = exp2(s * c - lse * log2 e),
// dx = dS * ds/dx.  With dropout (mask Z regenerated from the forward's rng_state, dropout.h):
// dV = (P Z / (1 - p))^T dO and dS = P (dP Z / (1 - p) - D).  With a bias that needs a
// gradient, the dQ kernel also writes dS (the gradient of the scores, = of the bias before
// broadcasting) to p.dbias_full.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm80/block_info.h"
#include "kernels/sm80/dropout.h"
#include "kernels/sm80/flash_bwd_dq.h"
#include "kernels/sm80/flash_bwd_launch.h"
#include "kernels/sm80/flash_bwd_lean.cuh"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/score.h"
#include "kernels/sm80/softmax.h"
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

template <typename Element_, int kHeadDim_, int kBlockM_, int kSplitD_, int kBlockNQ_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim (q/k and v), multiple of 64
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // dK/dV kernel: 16 key rows per warp, kBlockM query rows per step; each CTA produces
  // kOutDim = kHeadDim / kSplitD columns of dK and dV (kSplitD = 2 at head dim 256 keeps the
  // accumulators in registers, at the price of recomputing S and dP once more).
  static constexpr int kBlockN = 16 * kWarps;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kSplitD = kSplitD_;
  static constexpr int kOutDim = kHeadDim / kSplitD;
  // K, V once; Q, dO double-buffered; lse*log2e and D per query row, double-buffered.
  static constexpr int kSmemDkdv = (2 * kBlockN + 4 * kBlockM) * kHeadDim * int(sizeof(Element)) +
                                   4 * kBlockM * int(sizeof(float));
  // dQ kernel: 16 query rows per warp, kBlockNQ key rows per step.  Q, dO once; K, V
  // double-buffered.
  static constexpr int kBlockMQ = 16 * kWarps;
  static constexpr int kBlockNQ = kBlockNQ_;
  static constexpr int kSmemDq = (2 * kBlockMQ + 4 * kBlockNQ) * kHeadDim * int(sizeof(Element));
  static_assert(kHeadDim % 64 == 0 && kOutDim % 16 == 0 && kBlockM % 16 == 0 &&
                    kBlockNQ % 16 == 0, "");
};

// D = rowsum(dO * O) - dsoftmax_lse in fp32, (batch, heads_q, pitch) contiguous (pitch >=
// seqlen_q; rows past seqlen_q get 0); kTpr threads per row (one 16-byte load of O and of dO per
// thread and step: rows are 16-byte aligned and head_dim_v a multiple of 8, the glue's
// kernel_ready), 256 / kTpr rows per CTA.  With `lse_log2` (the Hopper backward's statistics),
// also softmax_lse * log2(e) in the same layout (+inf past seqlen_q and for rows that see no
// key, so that P = 0 there).  Also zeroes `zero_quads` float4 at `zero` (the atomic-dQ scratch,
// so that no memset pass precedes the dK/dV kernel).  (A gradient g_i flowing into lse_i adds
// g_i * P_ij to dS_ij, i.e. subtracts it from D.)
template <typename Element, int kTpr>
__global__ void __launch_bounds__(256)
    flash_bwd_delta_kernel(const BwdParams p, float* delta, float4* zero, int64_t zero_quads,
                           int64_t pitch, float* lse_log2_out, const int32_t* row_blocks) {
  static_assert(kTpr >= 1 && kTpr <= 32 && (kTpr & (kTpr - 1)) == 0, "");
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t i = int64_t(blockIdx.x) * 256 + tid; i < zero_quads; i += int64_t(gridDim.x) * 256)
    zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t row_id = int64_t(blockIdx.x) * (256 / kTpr) + tid / kTpr;
  const int t = tid % kTpr;
  const bool valid = row_id < p.batch * p.heads_q * pitch;
  const int64_t i = row_id % pitch, bh = row_id / pitch;
  // The row of out / dout / softmax_lse that scratch row i holds: i itself, or with row_blocks
  // (packed sequences' padded rows, BwdParams::sm90_varlen_rows) the one its 128-row block maps.
  bool in_seq = valid && i < p.seqlen_q;
  int64_t src = i;
  if (row_blocks != nullptr && valid) {
    in_seq = i % 128 < row_blocks[2 * (i / 128) + 1];
    src = row_blocks[2 * (i / 128)] + i % 128;
  }
  float sum = 0.f;
  if (in_seq) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const auto* o = static_cast<const Element*>(p.out) + b * p.out_batch_stride +
                    src * p.out_row_stride + h * p.out_head_stride;
    const auto* d = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride +
                    src * p.dout_row_stride + h * p.dout_head_stride;
    for (int c = t * 8; c < p.head_dim_v; c += kTpr * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += to_float(oe[e]) * to_float(de[e]);
    }
  }
#pragma unroll
  for (int s = kTpr / 2; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
  if (valid && t == 0) {
    const int64_t row = bh * p.seqlen_q + src;  // in (batch, heads_q, seqlen_q) tensors
    const auto* dlse = static_cast<const float*>(p.dsoftmax_lse);
    delta[row_id] = !in_seq ? 0.f : dlse == nullptr ? sum : sum - dlse[row];
    if (lse_log2_out != nullptr)
      lse_log2_out[row_id] =
          in_seq ? lse_log2(static_cast<const float*>(p.softmax_lse)[row]) : INFINITY;
  }
}

// The delta launch for kernels of head dim kHeadDim (>= head_dim_v), zeroing zero_floats floats
// at `zero` on the way (a multiple of 4, 16-byte aligned); rows of `pitch` (seqlen_q unless
// given) and lse_log2 as flash_bwd_delta_kernel says.
template <typename Element, int kHeadDim>
cudaError_t launch_bwd_delta(const BwdParams& p, float* delta, float* zero, int64_t zero_floats,
                             cudaStream_t stream, int64_t pitch = -1,
                             float* lse_log2_out = nullptr,
                             const int32_t* row_blocks = nullptr) {
  constexpr int kTpr = kHeadDim / 8 < 32 ? kHeadDim / 8 : 32, kRowsPerCta = 256 / kTpr;
  // Packed sequences: D row by row over all total_q rows of each head, which is this kernel's
  // dense form for one batch entry of total_q rows (batch strides are 0; the statistics are
  // (heads_q, total_q), as this layout; rows outside every sequence get a D nothing reads).
  BwdParams rows_of = p;
  // With row_blocks (the Hopper backward's padded rows): `pitch` of them per head.
  if (p.cu_seqlens_q != nullptr) {
    rows_of.batch = 1;
    rows_of.seqlen_q = p.total_q;
    if (row_blocks == nullptr) pitch = p.total_q;
  }
  if (pitch < 0) pitch = rows_of.seqlen_q;
  const int64_t rows = rows_of.batch * rows_of.heads_q * pitch;
  return launch(flash_bwd_delta_kernel<Element, kTpr>, (rows + kRowsPerCta - 1) / kRowsPerCta,
                256, 0, stream, rows_of, delta, reinterpret_cast<float4*>(zero), zero_floats / 4,
                pitch, lse_log2_out, row_blocks);
}

// kGeneral: softcap, attn_bias and dropout are handled (runtime flags), as in the forward.
template <typename T, bool kGeneral>
__global__ void __launch_bounds__(T::kThreads) flash_bwd_dkdv_kernel(const BwdParams p,
                                                                     const float* delta,
                                                                     int64_t num_n_blocks) {
  using Element = typename T::Element;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim, kC = T::kChunks;
  constexpr int kM8 = kM / 8, kOut8 = T::kOutDim / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* k_s = reinterpret_cast<Element*>(smem_raw);
  Element* v_s = k_s + kN * kD;
  Element* qdo_s = v_s + kN * kD;  // [stage][Q | dO], kM x kD each
  float* stats_s = reinterpret_cast<float*>(qdo_s + 4 * kM * kD);  // [stage][lse_log2 | D]

  const int64_t bid = blockIdx.x;
  const int split = static_cast<int>(bid % T::kSplitD);
  const int64_t n_block = (bid / T::kSplitD) % num_n_blocks;
  const int64_t bhk = bid / T::kSplitD / num_n_blocks;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = n_block * kN;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int col_chunk0 = split * T::kOutDim / 8;
  // This batch's sequence (packed sequences: its own rows and lengths; the grid covers the
  // longest, and key blocks past this one's keys have nothing to do: the glue zeroes dk, dv).
  const SeqInfo seq(p, b);
  if (n0 >= seq.len_k) return;

  const VisibleKeys vis = seq.visible(p);
  const int64_t n1 = n0 + kN < seq.len_k ? n0 + kN : seq.len_k;
  int64_t row_lo = vis.first_row(n0), row_hi = vis.row_limit(n1);
  row_lo = row_lo < 0 ? 0 : row_lo;
  row_hi = row_hi > seq.len_q ? seq.len_q : row_hi;
  const int64_t m_begin = row_lo / kM;
  const int64_t m_blocks = row_hi > row_lo ? (row_hi + kM - 1) / kM - m_begin : 0;
  const int64_t steps = m_blocks * group;  // (query head of the group, query block) pairs

  const auto* k = seq.k_rows<const Element>(p.k, p.k_batch_stride, p.k_row_stride,
                                            p.k_head_stride, b, hk);
  const auto* v = seq.k_rows<const Element>(p.v, p.v_batch_stride, p.v_row_stride,
                                            p.v_head_stride, b, hk);
  const DropoutFn drop(p);

  // Issues the loads of step t's Q and dO tiles (async) and its per-row statistics.
  auto load_step = [&](int stage, int64_t t) {
    const int64_t h = hk * group + t / m_blocks, m0 = (m_begin + t % m_blocks) * kM;
    Element* dst = qdo_s + stage * 2 * kM * kD;
    load_q_do_async<Element, kM, kC, T::kThreads>(dst, dst + kM * kD, p, seq, b, h, m0);
    const float* lse = static_cast<const float*>(p.softmax_lse) + seq.stats(p, b, h);
    const float* dlt = delta + seq.stats(p, b, h);
    float* st = stats_s + stage * 2 * kM;
    for (int r = tid; r < kM; r += T::kThreads) {
      const bool in = m0 + r < seq.len_q;
      st[r] = in ? lse_log2(lse[m0 + r]) : INFINITY;
      st[kM + r] = in ? dlt[m0 + r] : 0.f;
    }
  };

  if (steps > 0) {
    load_tile_async<Element, kN, kC, T::kThreads>(k_s, k, p.k_row_stride, n0, seq.len_k,
                                                  static_cast<int>(p.head_dim));
    load_tile_async<Element, kN, kC, T::kThreads>(v_s, v, p.v_row_stride, n0, seq.len_k,
                                                  static_cast<int>(p.head_dim_v));
    load_step(0, 0);
    cp_async_commit();
  }

  float dk_acc[1][kOut8][4], dv_acc[1][kOut8][4];
  zero(dk_acc);
  zero(dv_acc);
  const int64_t key_of[2] = {n0 + warp * 16 + lane / 4, n0 + warp * 16 + lane / 4 + 8};

  for (int64_t t = 0; t < steps; ++t) {
    const int stage = static_cast<int>(t & 1);
    if (t + 1 < steps) {
      load_step(stage ^ 1, t + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const Element* q_s = qdo_s + stage * 2 * kM * kD;
    const Element* do_s = q_s + kM * kD;
    const float* lse_s = stats_s + stage * 2 * kM;
    const float* d_s = lse_s + kM;
    const int64_t m0 = (m_begin + t % m_blocks) * kM;
    const int64_t h = hk * group + t / m_blocks;
    const ScoreFn fn(p, b, h, seq.len_q, seq.len_k);

    // S^T (this warp's 16 keys x kM queries) and dP^T.
    float st[1][kM8][4], dpt[1][kM8][4];
    zero(st);
    zero(dpt);
    gemm_ss<Element, kC, 1, kM8, kD>(st, k_s, warp * 16, q_s, 0, lane);
    gemm_ss<Element, kC, 1, kM8, kD>(dpt, v_s, warp * 16, do_s, 0, lane);

    uint64_t kept = 0;  // dropout's keep bits of S^T (dropout.h)
    if (kGeneral && drop.enabled)
      kept = drop.keep_bits<kM8, false>(seq.dropout_rows(p, b, h), key_of[0],
                                        m0 + 2 * (lane % 4));
    // Masking is needed unless every key of the block is visible to every row of the tile.
    const int64_t last = (m0 + kM < seq.len_q ? m0 + kM : seq.len_q) - 1;
    const bool need_mask = n0 < vis.begin(last) || n0 + kN > vis.end(m0);
#pragma unroll
    for (int j = 0; j < kM8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane % 4) + (e & 1);  // query row within the tile
        const int64_t key = key_of[e / 2];
        float x = st[0][j][e];
        const int64_t row = m0 + col < seq.len_q ? m0 + col : seq.len_q - 1;
        const float dscore =
            kGeneral ? fn.apply(x, row, key < seq.len_k ? key : seq.len_k - 1) : fn.scale;
        float pr = kGeneral ? fn.prob(x, lse_s[col]) : exp2f(fmaf(x, fn.scale_log2, -lse_s[col]));
        if (need_mask && (key < vis.begin(m0 + col) || key >= vis.end(m0 + col))) pr = 0.f;
        float dp = dpt[0][j][e];
        st[0][j][e] = pr;
        if (kGeneral && drop.enabled) {
          const bool keep = DropoutFn::bit(kept, j, e);
          st[0][j][e] = keep ? pr * drop.scale : 0.f;
          dp = keep ? dp * drop.scale : 0.f;
        }
        dpt[0][j][e] = pr * (dp - d_s[col]) * dscore;
      }
    gemm_rs<Element, kC, 1, kM, kOut8>(dv_acc, st, do_s, 0, col_chunk0, lane);
    gemm_rs<Element, kC, 1, kM, kOut8>(dk_acc, dpt, q_s, 0, col_chunk0, lane);
    __syncthreads();  // this stage is overwritten by the prefetch two steps from now
  }

  auto* dk = seq.k_rows<Element>(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b, hk);
  auto* dv = seq.k_rows<Element>(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b, hk);
  const int col0 = split * T::kOutDim;
  store_rows<Element>(dk, p.dk_row_stride, dk_acc, n0 + warp * 16, seq.len_k, col0,
                      static_cast<int>(p.head_dim), lane);
  store_rows<Element>(dv, p.dv_row_stride, dv_acc, n0 + warp * 16, seq.len_k, col0,
                      static_cast<int>(p.head_dim_v), lane);
}

// The 4-warp dQ kernel's part of flash_bwd_dq.h's skeleton: one 16-row tile per warp, S and dP
// in registers, dQ += dS K with dS taken from them (gemm_rs); softcap, bias (and its gradient
// dS, written to p.dbias_full) and dropout with kGeneral.
template <typename T, bool kGeneral>
struct DqStep {
  using Traits = T;
  using Element = typename T::Element;
  static constexpr int kN = T::kBlockNQ, kD = T::kHeadDim, kC = T::kChunks;
  static constexpr int kStages = 2, kMT = 1, kS8 = kN / 8, kD8 = kD / 8;
  static constexpr bool kPrefetchFirst = true, kTwoCopies = false, kSyncAtEnd = true;
  const int64_t b, h;
  const ScoreFn fn;
  const DropoutFn drop;
  float* const dbias;
  int64_t row_of[2];  // this lane's query rows

  __device__ __forceinline__ DqStep(const BwdParams& p_, const SeqInfo& seq, int64_t b_,
                                    int64_t h_)
      : b(b_),
        h(h_),
        fn(p_, b_, h_, seq.len_q, seq.len_k),
        drop(p_),
        dbias(p_.dbias_full == nullptr
                  ? nullptr
                  : static_cast<float*>(p_.dbias_full) + (b_ * p_.heads_q + h_) * p_.seqlen_q *
                                                             p_.seqlen_k) {}
  __device__ __forceinline__ static int row0(int warp) { return warp * 16; }
  __device__ __forceinline__ static int col0(int) { return 0; }
  __device__ __forceinline__ static float scale_d(float d) { return d; }
  __device__ __forceinline__ void setup(int64_t m0, const Element*, const Element*,
                                        const Element*, int warp, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_of[r] = m0 + warp * 16 + lane / 4 + 8 * r;
  }

  __device__ __forceinline__ void scores(float (&s)[1][kS8][4], float (&dp)[1][kS8][4],
                                         const Element* q_s, const Element* do_s,
                                         const Element* k_s, int, int warp, int lane) const {
    gemm_ss<Element, kC, 1, kS8, kD>(s, q_s, warp * 16, k_s, 0, lane);
    gemm_ss<Element, kC, 1, kS8, kD>(dp, do_s, warp * 16, k_s + kN * kD, 0, lane);
  }

  // dS (times ds/dx) into s; need_mask: the tile straddles a row's visible range.
  __device__ __forceinline__ void grad(bool need_mask, float (&s)[1][kS8][4],
                                       const float (&dp)[1][kS8][4], const float (&lse_row)[1][2],
                                       const float (&d_row)[1][2], const DqTile& t) const {
    const BwdParams& p = t.p;
    const int64_t col0 = t.n_block * kN + 2 * (t.lane % 4);
    uint64_t kept = 0;
    if (kGeneral && drop.enabled)
      kept = drop.keep_bits<kS8, true>(t.seq.dropout_rows(p, b, h), row_of[0], col0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t lo = t.vis.begin(row_of[r]), hi = t.vis.end(row_of[r]);
      const int64_t row = row_of[r] < t.seq.len_q ? row_of[r] : t.seq.len_q - 1;
#pragma unroll
      for (int j = 0; j < kS8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[0][j][2 * r + e];
          const int64_t col = col0 + j * 8 + e;
          const float dscore =
              kGeneral ? fn.apply(x, row, col < t.seq.len_k ? col : t.seq.len_k - 1) : fn.scale;
          float pr = kGeneral ? fn.prob(x, lse_row[0][r])
                              : exp2f(fmaf(x, fn.scale_log2, -lse_row[0][r]));
          if (need_mask && (col < lo || col >= hi)) pr = 0.f;
          float dpv = dp[0][j][2 * r + e];
          if (kGeneral && drop.enabled)
            dpv = DropoutFn::bit(kept, j, 2 * r + e) ? dpv * drop.scale : 0.f;
          const float ds = pr * (dpv - d_row[0][r]);
          if (kGeneral && dbias != nullptr && row_of[r] < p.seqlen_q && col < p.seqlen_k)
            dbias[row_of[r] * p.seqlen_k + col] = ds;
          x = ds * dscore;
        }
      }
    }
  }

  __device__ __forceinline__ void dq(float (&dq_acc)[1][kD8][4], const float (&s)[1][kS8][4],
                                     const Element* k_s, int, int lane) const {
    gemm_rs<Element, kC, 1, kN, kD8>(dq_acc, s, k_s, 0, 0, lane);
  }
};

template <typename T, bool kGeneral>
__global__ void __launch_bounds__(T::kThreads) flash_bwd_dq_kernel(const BwdParams p,
                                                                   const float* delta,
                                                                   int64_t num_m_blocks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bwd_dq_body<DqStep<T, kGeneral>>(p, delta, num_m_blocks, smem_raw);
}

// Host side: the three launches on `stream`; `delta` is a (batch * heads_q * seqlen_q) fp32
// scratch buffer.
template <typename T>
cudaError_t launch_flash_bwd(const BwdParams& p, float* delta, cudaStream_t stream) {
  using Element = typename T::Element;
  const bool general = p.general();
  if (p.bias_is_mask) return cudaErrorInvalidValue;  // (the bias in fp32 only: prepare_bias)
  {
    // Plain attention: the 8-warp kernels of flash_bwd_lean.cuh, where their shared memory fits
    // (at head dim 64 with 64-row steps on GPUs with less shared memory; head dim 256 needs
    // 209 KB, e.g. sm_90's).  The delta kernel zeroes their atomic-dQ scratch.
    using Lean = LeanBwdTraits<Element, T::kHeadDim>;
    static_assert(dq_accum_cols(T::kHeadDim) == T::kHeadDim, "");
    const int64_t accum_floats =
        p.dq_accum == nullptr ? 0 : dq_accum_floats(p.batch, p.seqlen_q, p.heads_q, T::kHeadDim);
    // (Lean64 is Lean itself where Lean already takes 64-row steps.)
    using Lean64 = std::conditional_t<Lean::kBlockM != 64, LeanBwdTraits<Element, T::kHeadDim, 64>,
                                      Lean>;
    static_assert(lean_bwd_smem_bytes(T::kHeadDim) ==
                      (Lean64::kSmemDkdv > Lean64::kSmemDq ? Lean64::kSmemDkdv : Lean64::kSmemDq),
                  "flash_bwd_launch.h's lean_bwd_smem_bytes must follow LeanBwdTraits");
    static_assert(portable_bwd_smem_bytes(T::kHeadDim) == T::kSmemDkdv,
                  "kernel_select.h's portable_bwd_smem_bytes must follow BwdTraits");
    if (p.bwd_eight_warp) {  // kernel_select.h's choice (it never picks them with `general`)
      // (Nor for packed sequences: these kernels place batches by their strides only.)
      if (general || p.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;
      // The full variant where its shared memory fits, else 64-row steps (the rule's minimum).
      const bool full = lean_bwd_fits<Lean>();
      const cudaError_t err = launch_bwd_delta<Element, T::kHeadDim>(p, delta, p.dq_accum,
                                                                      accum_floats, stream);
      if (err != cudaSuccess) return err;
      return full ? launch_flash_bwd_lean<Lean>(p, delta, stream)
                  : launch_flash_bwd_lean<Lean64>(p, delta, stream);
    }
  }
  cudaError_t err = launch_bwd_delta<Element, T::kHeadDim>(p, delta, nullptr, 0, stream);
  if (err != cudaSuccess) return err;
  const int64_t num_n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  const int64_t dkdv_blocks = num_n_blocks * p.batch * p.heads_kv * T::kSplitD;
  err = launch(general ? flash_bwd_dkdv_kernel<T, true> : flash_bwd_dkdv_kernel<T, false>,
               dkdv_blocks, T::kThreads, T::kSmemDkdv, stream, p,
               static_cast<const float*>(delta), num_n_blocks);
  if (err != cudaSuccess) return err;
  const int64_t num_m_blocks = (p.seqlen_q + T::kBlockMQ - 1) / T::kBlockMQ;
  return launch(general ? flash_bwd_dq_kernel<T, true> : flash_bwd_dq_kernel<T, false>,
                num_m_blocks * p.batch * p.heads_q, T::kThreads, T::kSmemDq, stream, p,
                static_cast<const float*>(delta), num_m_blocks);
}

}  // namespace flash_attn_ext::sm80
