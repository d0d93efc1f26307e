// FlashAttention-2 forward for sm_80+ (mma.sync; also runs on sm_90): one CTA of 4 warps per
// (block of kBlockM query rows, batch, head); each warp owns kMTiles x 16 rows.
//
// Q tile -> shared once; K/V tiles of kBlockN rows stream through a double-buffered shared ring
// with cp.async (the next tile loads while this one computes).  Per tile, in registers:
// S = Q K^T (tensor cores), mask, online softmax in the exp2 domain with fp32 running max m and
// sum l (softmax.h; FlashAttention-2, arXiv:2307.08691, Algorithm 1),
// O = O * exp2(m_old - m_new) + P V with P re-used from the S accumulators as the A operand.
// O / l and the LSE are written once.
//
// Shared tiles and the warp GEMMs are those of tile.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm80/block_info.h"
#include "kernels/sm80/dropout.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/score.h"
#include "kernels/sm80/softmax.h"
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kMTiles_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim (q/k and v), multiple of 64
  // Each warp owns kMTiles x 16 query rows: every K/V fragment loaded from shared memory feeds
  // kMTiles MMAs, which halves shared-memory traffic per MMA at kMTiles = 2 (with 16 rows per
  // warp the kernel was bound by ldmatrix bandwidth at ~45% of mma.sync peak).
  static constexpr int kMTiles = kMTiles_;
  static constexpr int kBlockM = 64 * kMTiles;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kSmemQ = kBlockM * kHeadDim;
  static constexpr int kSmemKV = kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQ + 4 * kSmemKV) * sizeof(Element);  // Q + 2 x (K, V)
  static_assert(kHeadDim % 64 == 0, "swizzle needs >= 8 chunks per row");
  static_assert(kBlockN % 16 == 0, "");
};

// kGeneral: softcap, attn_bias and dropout are handled (runtime flags); without it the kernel
// serves plain/causal/windowed attention with fewer live registers.
template <typename T, bool kGeneral>
__global__ void __launch_bounds__(T::kThreads) flash_fwd_kernel(const FwdParams p,
                                                                int64_t num_m_blocks) {
  using Element = typename T::Element;
  constexpr int kM = T::kBlockM, kN = T::kBlockN, kD = T::kHeadDim, kC = T::kChunks;
  constexpr int kNTiles = kN / 8;  // 8-column tiles of S per warp
  constexpr int kDTiles = kD / 8;  // 8-column tiles of O per warp
  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: see tile.h swz_step
  Element* q_s = reinterpret_cast<Element*>(smem_raw);
  check_swz_alignment(smem_raw);
  Element* kv_s = q_s + T::kSmemQ;  // [stage][K | V]

  const int64_t bid = blockIdx.x;
  const QueryBlock blk(p, bid, num_m_blocks, kM);  // block_info.h
  const int64_t b = blk.b, h = blk.h, m0 = blk.m0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const DropoutFn drop(p);
  // (seed, offset) for the backward; (0, 0) without dropout.  Written here rather than by a
  // separate fill launch.
  if (p.rng_state != nullptr && bid == 0 && threadIdx.x == 0) {
    p.rng_state[0] = kGeneral ? static_cast<int64_t>(drop.seed) : 0;
    p.rng_state[1] = kGeneral ? static_cast<int64_t>(drop.offset) : 0;
  }
  // This batch's sequence (packed sequences: its own rows and lengths; the grid covers the
  // longest, and blocks past this one's rows have nothing to do).
  const SeqInfo seq(p, b);
  if (m0 >= seq.len_q) return;

  const VisibleKeys vis = seq.visible(p);
  const VisibleKeys::Block keys = vis.block(m0, kM, seq.len_q, kN);
  const int64_t n_begin = keys.n_begin, n_end = keys.n_end;

  const auto* q =
      seq.q_rows<const Element>(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, h);
  const auto* k = seq.k_rows<const Element>(p.k, p.k_batch_stride, p.k_row_stride,
                                            p.k_head_stride, b, blk.hk);
  const auto* v = seq.k_rows<const Element>(p.v, p.v_batch_stride, p.v_row_stride,
                                            p.v_head_stride, b, blk.hk);

  const ScoreFn fn(p, b, h, seq.len_q, seq.len_k);
  const float scale_log2 = fn.scale_log2;
  // Softcap, bias and ALiBi go through ScoreFn::apply; plain scores need nothing before the
  // exp2.
  const bool transform = kGeneral && fn.modified();

  // Issues the async loads of key/value tile n_block into shared stage `stage` (K, then V).
  auto load_kv = [&](int stage, int64_t n_block) {
    Element* dst = kv_s + stage * 2 * T::kSmemKV;
    load_kv_async<Element, kN, kC, T::kThreads>(dst, dst + T::kSmemKV, k, v, p, n_block * kN,
                                                seq.len_k);
  };
  if (n_begin < n_end) {
    load_tile_async<Element, kM, kC, T::kThreads>(q_s, q, p.q_row_stride, m0, seq.len_q,
                                                  static_cast<int>(p.head_dim));
    load_kv(0, n_begin);
    cp_async_commit();
  }

  constexpr int kMT = T::kMTiles;
  float o_acc[kMT][kDTiles][4];
  zero(o_acc);
  // Per m-tile and half (rows lane/4 and lane/4 + 8): running max of raw (or transformed)
  // scores and this thread's share of the running sum (softmax.h).
  OnlineSoftmax<kMT> softmax;
  // Query row of this lane's accumulator rows (computed where used: not kept in registers).
  auto row_of = [&](int mt, int r) -> int64_t {
    return m0 + (warp * kMT + mt) * 16 + lane / 4 + 8 * r;
  };
  // Per-lane ldmatrix base addresses (tile.h lean GEMMs; stage 0 for K and V).
  const uint32_t q_a = a_base<kC>(q_s, warp * kMT * 16, lane);
  const uint32_t k_b = b_base<kC>(kv_s, 0, lane);
  const uint32_t v_bt = bt_base<kC>(kv_s + T::kSmemKV, 0, lane);
  // Where the next K/V tile's loads go (into the other stage): at head dim <= 64 once this
  // tile's S = Q K^T is issued, at 128 before O += P V, not at the top of the iteration
  // where the cp.async of all warps queue in front of the S GEMM's ldmatrix (measured: +3.5% at
  // d=64, +1-2% at d=128, docs/perf/sm80_forward.md); at 256 (one m-tile per warp, 32-key tiles)
  // the top measured 4% faster.  After the barrier at the top of an iteration the other stage
  // is free, so only the top placement needs a barrier at the end of the iteration.
  enum { kTop, kAfterS, kBeforePV };
  constexpr int kPrefetchAt = kD <= 64 ? kAfterS : (kD <= 128 ? kBeforePV : kTop);
  for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
    const int stage = static_cast<int>((n_block - n_begin) & 1);
    auto prefetch = [&] {
      if (n_block + 1 < n_end) {
        load_kv(stage ^ 1, n_block + 1);
        cp_async_commit();
      }
    };
    if constexpr (kPrefetchAt == kTop) {
      prefetch();
      if (n_block + 1 < n_end)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
    } else {
      cp_async_wait<0>();  // tile n_block (the only group in flight) has landed
    }
    __syncthreads();  // for all threads; every warp is done with tile n_block - 1's stage
    const uint32_t stage_bytes =
        static_cast<uint32_t>(stage * 2 * T::kSmemKV * sizeof(Element));

    // S = Q K^T for this warp's rows and the tile's kN keys.
    float s[kMT][kNTiles][4];
    zero(s);
    lean_gemm_ss<Element, kC, kMT, kNTiles, kD>(s, q_a, k_b + stage_bytes);
    if constexpr (kPrefetchAt == kAfterS) prefetch();

    // Softcap and bias, mask (only for tiles that straddle a boundary: 32-bit key bounds
    // relative to the tile), online softmax.  `masked`: std::true_type / std::false_type (two
    // copies of the code, no per-element mask test in the unmasked one) or, in the general
    // variant, a runtime bool (one copy: two would make its spills 4x worse).
    const int64_t col0 = n_block * kN + 2 * (lane % 4);
    auto softmax_tile = [&](auto masked) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (transform) {
            const int64_t row = row_of(mt, r) < seq.len_q ? row_of(mt, r) : seq.len_q - 1;
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int64_t col = col0 + j * 8 + e;
                fn.apply(s[mt][j][2 * r + e], row, col < seq.len_k ? col : seq.len_k - 1);
              }
          }
          if (masked) {
            const VisibleKeys::Relative rel = vis.relative(m0, n_block * kN, kN);
            const int dr = (warp * kMT + mt) * 16 + lane / 4 + 8 * r;  // row within the block
            const int lo = rel.begin(dr), hi = rel.end(dr);
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int key = j * 8 + 2 * (lane % 4) + e;  // within the tile
                if (key < lo || key >= hi) s[mt][j][2 * r + e] = -INFINITY;
              }
          }
          const float alpha = softmax.update(mt, r, s[mt], scale_log2);
          rescale_row(o_acc[mt], r, alpha);
        }
        // After both rows' sums: dropout acts on the normalised P.
        if (kGeneral && drop.enabled) {
          const uint64_t kept =
              drop.keep_bits<kNTiles, true>(seq.dropout_rows(p, b, h), row_of(mt, 0), col0);
#pragma unroll
          for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              if (!DropoutFn::bit(kept, j, i)) s[mt][j][i] = 0.f;
        }
      }
    };
    // Key tiles fully inside every row's visible range need no per-element mask.
    const bool need_mask = key_tile_masked(keys, n_block, kN);
    with_mask<!kGeneral>(need_mask, softmax_tile);

    if constexpr (kPrefetchAt == kBeforePV) prefetch();
    // O += P V, P taken from the S accumulators.
    lean_gemm_rs<Element, kC, kMT, kN, kDTiles>(o_acc, s, v_bt + stage_bytes);
    // kTop: this stage is overwritten by the prefetch at the top of the next iteration.
    if constexpr (kPrefetchAt == kTop) __syncthreads();
  }

  // Epilogue: out = O / l (times dropout's 1 / P(kept)) (0 for rows that saw nothing),
  // lse = m * scale + ln(l).
  auto* out = seq.q_rows<Element>(p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride,
                                  b, h);
  float* lse = static_cast<float*>(p.softmax_lse) + seq.stats(p, b, h);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const auto [l, empty] = softmax.finish(mt, r);  // empty: no visible key
      const float inv_l = empty ? 0.f : (kGeneral ? drop.scale : 1.f) / l;
      const int64_t row = row_of(mt, r);
      if (row >= seq.len_q) continue;
      Element* o_row = out + row * p.out_row_stride;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        const int col = j * 8 + 2 * (lane % 4);
        if (col < p.head_dim_v) {  // head_dim_v is even (the glue pads to a multiple of 8)
          *reinterpret_cast<uint32_t*>(o_row + col) =
              pack2<Element>(o_acc[mt][j][2 * r] * inv_l, o_acc[mt][j][2 * r + 1] * inv_l);
        }
      }
      if (lane % 4 == 0) {
        lse[row] = empty ? -INFINITY : softmax.lse(mt, r, l, scale_log2);
      }
    }
  }
}

// Host side: one CTA per (query block, batch, head), launched on `stream`.  Plain attention at
// head dim 64 takes 128-key tiles (Plain): measured 2-4% faster than T's 64
// (docs/perf/sm80_forward.md) although ptxas spills ~200 bytes there; the general variant keeps T's
// tile, where 128 keys would add to its spills.
template <typename T>
cudaError_t launch_flash_fwd(const FwdParams& p, cudaStream_t stream) {
  using Plain = FwdTraits<typename T::Element, T::kHeadDim,
                          T::kHeadDim <= 64 ? 128 : T::kBlockN, T::kMTiles>;
  static_assert(Plain::kBlockM == T::kBlockM, "one query-block grid for both variants");
  if (p.bias_is_mask) return cudaErrorInvalidValue;  // (the bias in fp32 only: prepare_bias)
  const int64_t num_m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  if (p.general())
    return launch(flash_fwd_kernel<T, true>, num_m_blocks * p.batch * p.heads_q, T::kThreads,
                  T::kSmemBytes, stream, p, num_m_blocks);
  return launch(flash_fwd_kernel<Plain, false>, num_m_blocks * p.batch * p.heads_q,
                Plain::kThreads, Plain::kSmemBytes, stream, p, num_m_blocks);
}

}  // namespace flash_attn_ext::sm80
