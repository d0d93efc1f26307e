// Decoding against a KV cache: one CTA per (batch row, block of packed query rows, KV head,
// split of the keys), the query heads of a GQA group packed into the rows of one tile, the cache
// read in place (contiguous entries, cache_batch_idx, or pages through block_table: any page
// size), its lengths read on the device.  The split-KV scheme of FlashDecoding
// (Dao et al. 2023, "Flash-Decoding for long-context inference"; FlashAttention-2's
// flash_fwd_splitkv_kernel): with num_splits > 1 each CTA writes a normalised partial output
// out_s and its row statistics (m_s, l_s), and the combine kernel merges them:
// w_s = l_s exp2((m_s - m) c), out = sum_s w_s out_s / sum_s w_s, m = max_s m_s.
//
// Huge scores (cuda/exact_rows.h, issue 29): every exponent is (x - m) * c, the difference
// first (exact where x is close to m), never x * c - m * c with m * c rounded to float32; the
// splits are merged from (m_s, l_s), not from their LSEs rounded to float32; and the LSE is
// formed once, in float64 (lse_of).  So the decode kernels need no exact pass after them: the
// FADD more per score hides behind the loads of a memory-bound loop, where the pass cost ~2.5 us
// (its kernel and launch gap) of a ~19 us small call (docs/perf/decode.md).
//
// Decoding is memory-bound (one query row per head against S keys), so the design aims at keys
// in flight, not at tensor-core rate: the 4 warps of a CTA stream keys independently, each its
// own 16-key tiles through its own cp.async ring (no CTA barrier in the key loop), with the
// online softmax (running max and sum, rescale by exp(m_old - m_new)) of FlashAttention per
// warp; the warps' (m, l, O) are merged through shared memory at the end.  QK^T and PV are
// mma.sync m16n8k16 with fp32 accumulation: with packed GQA heads a key feeds up to 32 query
// rows, which fp32 FMAs on the CUDA cores could not keep up with at the H200's bandwidth.
//
// Rows: packed row r of a (batch row, KV head) is query position i = r / group and query head
// h = hk * group + r % group, group = heads_q / heads_kv.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fast_div.h"
#include "kernels/sm80/decode_entry.h"
#include "kernels/sm80/flash_decode_launch.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/mma.h"
#include "kernels/sm80/score.h"
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

// kMT_: 16-row m-tiles per CTA, 1 or 2 (decode_block_rows: 2 where a group's rows need them
// and the O accumulator, kMT * kHeadDim / 2 floats per lane, fits in registers).
template <int kHeadDim, int kMT_>
struct DecodeTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMT = kMT_;
  static constexpr int kRows = 16 * kMT;
  static constexpr int kBlockN = 16;  // keys per warp step
  static constexpr int kStages = kHeadDim <= 128 ? 3 : 2;
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kTile = kBlockN * kHeadDim;  // elements of one K or V tile
  static constexpr int kSmemQ = kRows * kHeadDim * 2;
  static constexpr int kSmemRing = kWarps * kStages * 2 * kTile * 2;
  // The merge: each warp's O in fp32, rows padded by 4 floats (bank spread), and its m and l.
  static constexpr int kRedStride = kHeadDim + 4;
  static constexpr int kSmemRed = kWarps * kRows * kRedStride * 4;
  static constexpr int kSmemMain = kSmemRing > kSmemRed ? kSmemRing : kSmemRed;
  static constexpr int kSmemStats = 3 * kWarps * kRows * 4;
  static constexpr int kSmem = kSmemQ + kSmemMain + kSmemStats;
  static_assert(kBlockN == 16, "the loads: passes of 4 or 16 rows");
};

// kRowLookup: each cache row's address through cache_row_offset (the page in block_table, or
// the entry: paged caches, and contiguous ones under KernelOptions::decode_contiguous_loads =
// false); else a contiguous cache's rows by row offsets alone (the loads below).  kRowLanes:
// lanes per cache row of a copy instruction (the loads below): 8 at head dims 128 and 256; at
// 64 4 by default, 2 and 8 for A/Bs (DecodeParams::row_lanes).
template <typename Element, int kHeadDim, int kMTiles, bool kRowLookup,
          int kRowLanes = (kHeadDim >= 128 ? 8 : 4)>
__global__ void __launch_bounds__(DecodeTraits<kHeadDim, kMTiles>::kThreads)
    flash_decode_kernel(const __grid_constant__ DecodeParams p) {
  using T = DecodeTraits<kHeadDim, kMTiles>;
  constexpr int kMT = T::kMT, kRows = T::kRows, kChunks = T::kChunks;
  extern __shared__ __align__(128) unsigned char smem[];
  Element* s_q = reinterpret_cast<Element*>(smem);
  Element* s_ring = reinterpret_cast<Element*>(smem + T::kSmemQ);
  float* s_red = reinterpret_cast<float*>(smem + T::kSmemQ);  // after the key loop
  float* s_m = reinterpret_cast<float*>(smem + T::kSmemQ + T::kSmemMain);
  float* s_l = s_m + T::kWarps * kRows;
  float* s_f = s_l + T::kWarps * kRows;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // (The divisions by launch constants as multiplies, FastDiv: each was a ~17-instruction
  // sequence, a dozen of them on the path to the first load; docs/perf/decode.md.)
  const FastDiv& by_group = p.group_div;
  const int group = static_cast<int>(by_group.d);
  const int rows_total = static_cast<int>(p.seqlen_q) * group;
  uint32_t bid = blockIdx.x, m_block, split, hk32;
  p.m_blocks_div.divmod(bid, bid, m_block);
  p.splits_div.divmod(bid, bid, split);
  p.heads_kv_div.divmod(bid, bid, hk32);
  const int64_t hk = hk32, b = bid;
  const int row0 = static_cast<int>(m_block) * kRows;
  // Packed row gr's query position and its head within the group.
  auto row_of = [&](int gr, int& i, int& g) {
    uint32_t q, r;
    by_group.divmod(static_cast<uint32_t>(gr), q, r);
    i = static_cast<int>(q);
    g = static_cast<int>(r);
  };
  // The combine (a programmatic dependent where DecodeParams::pdl) may be launched now: its CTAs
  // take the SM space this grid leaves free, then wait for the grid to complete (pdl_wait), so
  // that its launch and start overlap this kernel instead of following it (docs/perf/decode.md,
  // "Where a small call's time goes").  Every CTA of this grid is resident when the last one
  // triggers, so the combine never takes a slot one of them needs.
  pdl_trigger();

  // Q rows of this block (zero beyond the rows and the head dim), issued first: its copies run
  // while the lengths and pages below are read (each a dependent global load).
  {
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride;
    for (int idx = tid; idx < kRows * kChunks; idx += T::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int gr = row0 + r;
      const bool valid = gr < rows_total && c * 8 < p.head_dim;
      int i, g;
      row_of(gr, i, g);
      const Element* src =
          valid ? q + i * p.q_row_stride + (hk * group + g) * p.q_head_stride + c * 8 : q;
      cp_async_16(smem_addr(s_q + swz<kChunks>(r, c)), src, valid);
    }
    cp_async_commit();
  }

  const DecodeEntry e(p, b);
  bool ok = e.ok && !entry_shared(p, b, e.entry, tid, T::kThreads);
  const int64_t len_k = ok ? e.len_k : 0;
  const VisibleKeys vis(p.seqlen_q, len_k, p.window_left, p.window_right, true);
  // The keys any row of this CTA sees, in 16-key blocks, and this split's share of them.
  // This block's rows (row0 < rows_total; not row0 + kRows, which may pass 2^31 - 1).
  const int rows_here = rows_total - row0 < kRows ? rows_total - row0 : kRows;
  const int i_first = static_cast<int>(by_group.div(row0));
  const int i_last = static_cast<int>(by_group.div(row0 + rows_here - 1));
  const int64_t key_begin = vis.begin(i_first), key_end = vis.end(i_last);
  const int64_t blk_begin = key_begin / T::kBlockN;
  const int64_t blocks =
      key_end > key_begin ? (key_end + T::kBlockN - 1) / T::kBlockN - blk_begin : 0;
  const int64_t per_split =  // (keys < 2^31, as lo / hi below assume)
      p.splits_div.div(static_cast<uint32_t>(blocks + p.num_splits - 1));
  const int64_t my_begin = blk_begin + split * per_split;
  int64_t my_end = my_begin + per_split;
  if (my_end > blk_begin + blocks) my_end = blk_begin + blocks;
  const int32_t* bt =
      p.block_table != nullptr ? p.block_table + b * p.block_table_stride : nullptr;
  if (ok && bt != nullptr && my_end > my_begin) {  // the pages this CTA reads must exist
    int64_t row_end = e.start + my_end * T::kBlockN;
    if (row_end > e.start + len_k) row_end = e.start + len_k;
    ok = pages_exist(p, bt, e.start + my_begin * T::kBlockN, row_end, tid, T::kThreads);
  }
  ok = __syncthreads_and(ok);

  const bool splitting = p.num_splits > 1;
  const float kNaN = __int_as_float(0x7fffffff);
  // Writes row r's (normalised) output o[c], c < head_dim_v, and its LSE (or, splitting, its
  // m and l).
  auto out_ptr_f = [&](int r) {  // split partial: (split, b, h, i, :)
    int i, g;
    row_of(row0 + r, i, g);
    const int64_t h = hk * group + g;
    return p.out_accum + (((split * p.batch + b) * p.heads_q + h) * p.seqlen_q + i) * p.head_dim_v;
  };
  auto stats_index = [&](int r) {  // softmax_lse's (b, h, i), or (split, b, h, i) splitting
    int i, g;
    row_of(row0 + r, i, g);
    const int64_t h = hk * group + g;
    return ((splitting ? split * p.batch : 0) + b) * p.heads_q * p.seqlen_q + h * p.seqlen_q + i;
  };
  auto out_ptr_e = [&](int r) {
    int i, g;
    row_of(row0 + r, i, g);
    const int64_t h = hk * group + g;
    return static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride +
           h * p.out_head_stride;
  };
  float* lse = static_cast<float*>(p.softmax_lse);

  if (!ok) {  // NaN: the caller's values broke a rule (DecodeParams)
    cp_async_wait<0>();
    for (int idx = tid; idx < kRows * kHeadDim; idx += T::kThreads) {
      const int r = idx / kHeadDim, c = idx % kHeadDim;
      if (row0 + r >= rows_total || c >= p.head_dim_v) continue;
      if (splitting) {
        out_ptr_f(r)[c] = kNaN;
        if (c == 0) p.max_accum[stats_index(r)] = p.sum_accum[stats_index(r)] = kNaN;
      } else {
        out_ptr_e(r)[c] = from_float<Element>(kNaN);
        if (c == 0) lse[stats_index(r)] = kNaN;
      }
    }
    return;
  }

  // Q landed (its copies were issued before the checks, to overlap their loads).
  cp_async_wait<0>();
  __syncthreads();

  // Per lane: the visible keys [lo, hi) of its rows (mt, lane / 4 + 8 half), and their ALiBi
  // slopes.
  int lo[kMT][2], hi[kMT][2];
  float slope[kMT][2];
  int qpos[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int gr = row0 + mt * 16 + lane / 4 + 8 * half;
      int i, g;
      row_of(gr, i, g);
      const bool row_ok = gr < rows_total;
      lo[mt][half] = row_ok ? static_cast<int>(vis.begin(i)) : 0;
      hi[mt][half] = row_ok ? static_cast<int>(vis.end(i)) : 0;
      qpos[mt][half] = i;
      slope[mt][half] = row_ok && p.alibi_slopes != nullptr
                            ? static_cast<const float*>(
                                  p.alibi_slopes)[b * p.alibi_batch_stride + hk * group + g]
                            : 0.f;
    }
  const ScoreFn score(p, b, hk * group, p.seqlen_q, len_k);
  const int64_t alibi_off = len_k - p.seqlen_q;

  float acc_o[kMT][kChunks][4];
  zero(acc_o);
  float row_m[kMT][2], row_l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_m[mt][half] = -INFINITY;
      row_l[mt][half] = 0.f;
    }

  // This warp's blocks: my_begin + warp, + kWarps, ...
  const int64_t first_blk = my_begin + warp;
  const int my_count = first_blk < my_end
                           ? static_cast<int>((my_end - first_blk + T::kWarps - 1) / T::kWarps)
                           : 0;
  Element* ring = s_ring + warp * T::kStages * 2 * T::kTile;
  // This KV head's row e.start of the entry without the row lookup (the keys' row 0; it exists
  // whenever a load is issued), its row 0 of entry or page 0 with it (cache_row_offset adds the
  // entry or page and the row): a valid address either way, which rows past the keys keep.
  const int64_t entry_off_k =
      kRowLookup ? 0 : e.entry * p.k_batch_stride + e.start * p.k_row_stride;
  const int64_t entry_off_v =
      kRowLookup ? 0 : e.entry * p.v_batch_stride + e.start * p.v_row_stride;
  const Element* k_base = static_cast<const Element*>(p.k) + hk * p.k_head_stride + entry_off_k;
  const Element* v_base = static_cast<const Element*>(p.v) + hk * p.v_head_stride + entry_off_v;
  // 8 lanes per tile row: lane l copies chunks l % 8 + 8 g of rows l / 8 + 4 i, so that each
  // copy instruction reads 4 whole 128-byte lines (rows of one head are a cache row stride
  // apart, 2 KB in a (B, S, 8, 128) cache).  The loads are L2-request-bound otherwise: with one
  // row per lane pair an instruction touched one 32-byte sector in each of 16 lines, 4x the
  // L2 requests per byte (ncu: L2 throughput 87%, DRAM 66%; docs/perf/decode.md).
  // At head dim 64 (128-byte rows) 4 lanes per row, half a line each, 8 rows per instruction
  // in 2 passes (unrolled: the registers allow it at 64): 3-18% faster than 2 lanes (16 rows
  // per instruction, one sector of each line) at all eight points measured, and than 8 lanes
  // (4 passes) at six of them (H100; docs/perf/decode.md, "The loads").
  constexpr int kRowsPerPass = 32 / kRowLanes;
  constexpr int kPasses = T::kBlockN / kRowsPerPass, kGroups = kChunks / kRowLanes;
  static_assert(kChunks % kRowLanes == 0 && T::kBlockN % kRowsPerPass == 0, "");
  const int my_row0 = lane / kRowLanes, my_chunk0 = lane % kRowLanes;
  const int chunks = static_cast<int>(p.head_dim / 8);  // (a multiple of 8: the glue's rule)
  auto load = [&](int stage, int it) {
    const int64_t key0 = (first_blk + static_cast<int64_t>(it) * T::kWarps) * T::kBlockN;
    Element* sk = ring + stage * 2 * T::kTile;
    Element* sv = sk + T::kTile;
    auto pass = [&](int i) {
      const int r = my_row0 + kRowsPerPass * i;
      const bool row_ok = key0 + r < len_k;
      // One base per operand and row; group g is base + 8 kRowLanes g elements (an immediate
      // offset).
      // A chunk not read (src-size 0: zero-filled, no access) keeps that address too.
      const Element* ks = k_base + my_chunk0 * 8;
      const Element* vs = v_base + my_chunk0 * 8;
      // (Contiguous caches without the lookup, at compile time: its division by the page
      // size, which ptxas if-converted into contiguous calls too, and its 64-bit products were
      // most of a pass's ~112 instructions at head dim 128, ~40 without them; the row selected
      // before the products, not the address after them, for ptxas's registers; ncu and ptxas
      // in docs/perf/decode.md, "The loads' and the prologue's instructions".)
      if constexpr (kRowLookup) {
        if (row_ok) {
          const int64_t row = e.start + key0 + r;
          ks += cache_row_offset(p, bt, e.entry, row, p.k_batch_stride, p.k_row_stride);
          vs += cache_row_offset(p, bt, e.entry, row, p.v_batch_stride, p.v_row_stride);
        }
      } else {
        const int64_t rel = row_ok ? key0 + r : 0;
        ks += rel * p.k_row_stride;
        vs += rel * p.v_row_stride;
      }
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int c = my_chunk0 + kRowLanes * g;
        const bool valid = row_ok && c < chunks;
        cp_async_16(smem_addr(sk + swz<kChunks>(r, c)), ks + 8 * kRowLanes * g, valid);
        cp_async_16(smem_addr(sv + swz<kChunks>(r, c)), vs + 8 * kRowLanes * g, valid);
      }
    };
    if constexpr (kHeadDim <= 64) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) pass(i);
    } else {  // unrolled, ptxas hoisted every pass's addresses (spills at head dim 128)
#pragma unroll 1
      for (int i = 0; i < kPasses; ++i) pass(i);
    }
  };

#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < my_count) load(s, s);
    cp_async_commit();
  }
  const float scale_log2 = score.scale_log2;
  for (int it = 0; it < my_count; ++it) {
    if (it + T::kStages - 1 < my_count) load((it + T::kStages - 1) % T::kStages, it + T::kStages - 1);
    cp_async_commit();
    cp_async_wait<T::kStages - 1>();
    __syncwarp();
    const Element* sk = ring + (it % T::kStages) * 2 * T::kTile;
    const Element* sv = sk + T::kTile;
    float s_acc[kMT][2][4];
    zero(s_acc);
    gemm_ss<Element, kChunks, kMT, 2, kHeadDim>(s_acc, s_q, 0, sk, 0, lane);
    const int key0 = static_cast<int>((first_blk + static_cast<int64_t>(it) * T::kWarps) *
                                      T::kBlockN);
    float corr_all[kMT][2];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = key0 + 8 * j + 2 * (lane % 4) + c;
            float& x = s_acc[mt][j][2 * half + c];
            if (score.modified()) {
              score.transform(x);
              if (score.alibi)
                x = fmaf(-slope[mt][half],
                         fabsf(static_cast<float>(qpos[mt][half] + alibi_off - key)), x);
              score.to_log2(x);
            }
            if (key < lo[mt][half] || key >= hi[mt][half]) x = -INFINITY;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(row_m[mt][half], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float corr = exp2f((row_m[mt][half] - m_use) * scale_log2);
        corr_all[mt][half] = corr;
        row_m[mt][half] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& x = s_acc[mt][j][2 * half + c];
            x = exp2f((x - m_use) * scale_log2);  // (not x c - m c: the top of this file)
            sum += x;
          }
        row_l[mt][half] = row_l[mt][half] * corr + sum;
        rescale |= corr != 1.f;
      }
    // O is rescaled only when a row's maximum moved (warp-uniform branch): after the first
    // tiles of a long cache it rarely does, and the multiplies were a sixth of the loop.
    if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int j = 0; j < kChunks; ++j) {
            acc_o[mt][j][2 * half] *= corr_all[mt][half];
            acc_o[mt][j][2 * half + 1] *= corr_all[mt][half];
          }
    }
    gemm_rs<Element, kChunks, kMT, T::kBlockN, kChunks>(acc_o, s_acc, sv, 0, 0, lane);
    __syncwarp();
  }
  cp_async_wait<0>();

  // Merge the warps: m = max_w m_w, l = sum_w l_w exp(m_w - m), O = sum_w O_w exp(m_w - m) / l.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_l[mt][half];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      row_l[mt][half] = l;
    }
  __syncthreads();  // every warp is out of its ring
  float* red = s_red + warp * kRows * T::kRedStride;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + lane / 4 + 8 * half;
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
        *reinterpret_cast<float2*>(red + r * T::kRedStride + 8 * j + 2 * (lane % 4)) =
            make_float2(acc_o[mt][j][2 * half], acc_o[mt][j][2 * half + 1]);
      if (lane % 4 == 0) {
        s_m[warp * kRows + r] = row_m[mt][half];
        s_l[warp * kRows + r] = row_l[mt][half];
      }
    }
  __syncthreads();
  if (tid < kRows) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) m = fmaxf(m, s_m[w * kRows + tid]);
    const float m_use = m == -INFINITY ? 0.f : m;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w)
      l += s_l[w * kRows + tid] * exp2f((s_m[w * kRows + tid] - m_use) * scale_log2);
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w)
      s_f[w * kRows + tid] = l > 0.f    ? exp2f((s_m[w * kRows + tid] - m_use) * scale_log2) / l
                             : isnan(l) ? l
                                        : 0.f;
    // (NaN in the inputs: l is NaN, and so is the LSE, or the combine's row)
    if (row0 + tid < rows_total) {
      if (splitting) {
        p.max_accum[stats_index(tid)] = m;
        p.sum_accum[stats_index(tid)] = l;
      } else {
        lse[stats_index(tid)] = lse_of(p, score.modified(), m_use, l);
      }
    }
  }
  __syncthreads();
  // (Over this block's rows only: a GQA group of 4 heads fills 4 of a 16-row tile, and the
  // loop over all of them spent three quarters of its iterations on the test.)
  for (int idx = tid; idx < rows_here * (kHeadDim / 2); idx += T::kThreads) {
    const int r = idx / (kHeadDim / 2), c = 2 * (idx % (kHeadDim / 2));
    if (c >= p.head_dim_v) continue;
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) {
      const float f = s_f[w * kRows + r];
      const float2 v = *reinterpret_cast<const float2*>(s_red + (w * kRows + r) * T::kRedStride + c);
      o0 = fmaf(v.x, f, o0);
      o1 = fmaf(v.y, f, o1);
    }
    if (splitting) {
      *reinterpret_cast<float2*>(out_ptr_f(r) + c) = make_float2(o0, o1);
    } else {
      *reinterpret_cast<uint32_t*>(out_ptr_e(r) + c) = pack2<Element>(o0, o1);
    }
  }
}

// The combine: merges the num_splits partial outputs of each (b, h, i) row (see the top of this
// file); rows of any NaN split stay NaN, rows that saw no key get zeros and LSE -inf.  A CTA of
// kCombineWarps warps takes kCombineWarps / row_warps rows, row_warps warps per row
// (combine_row_warps): with many splits and few rows (MQA at B = 1, S = 32k: 32 rows, 109
// splits) one warp per row read its splits serially on a few SMs (19 us against cuDNN's whole
// 14 us call on the H200, docs/perf/decode.md), so the splits of a row are cut into row_warps
// contiguous parts, each warp sums its part of out_accum, and the row's first warp adds the
// parts from shared memory and writes the row.  Measured on the H200 (docs/perf/decode.md):
// MQA B = 1, S = 32k, d = 128 19.1 -> 3.8 us (predicted ~3).  The weights w_s (the top of
// this file) go through shared memory so that the loads of out_accum are independent (several in flight
// per lane: a loop that computed each weight between loads ran ~20 us at 32 splits).  The
// weights come from each split's (m_s, l_s) and the LSE in float64 (lse_of): exact for huge
// scores, where the splits' LSEs rounded to float32 would not be (the top of this file).
constexpr int kCombineWarps = 8;  // (kMaxDecodeSplits: flash_decode_launch.h)
// Channels of a row the combine's shared memory holds (head_dim_v up to kMaxHeadDim).
constexpr int kCombineMaxDim = 256;
// Splits one warp reads before its row is spread over more warps (the default; DecodeParams::
// combine_splits_per_warp, KernelOptions::decode_combine_splits for A/Bs): up to 16, two
// batches of kCombineBatch independent loads per lane, so a row costs two L2 round trips, not
// ~14.  8 and 4 (one batch) measured within noise of 16 at the small calls on the H100
// (docs/perf/decode.md, "The loads' and the prologue's instructions").
constexpr int kCombineSplitsPerWarp = 16;
// Loads of out_accum each lane has in flight (8 x 16 bytes: 32 registers).
constexpr int kCombineBatch = 8;
// Warps (rows x warps per row) past which more warps per row should buy nothing (chosen, not
// measured): ~16 per SM of an H100 / H200 (132 SMs) keep its loads in flight, and a spread
// adds a barrier, the partial sums through shared memory and the LSE loads in every warp.
constexpr int64_t kCombineEnoughWarps = 2048;
static_assert(kMaxDecodeSplits % 32 == 0, "the LSE loads: kMaxDecodeSplits / 32 per lane");
static_assert(kCombineMaxDim % 128 == 0, "the channel loop: 128 channels per warp pass");
static_assert(kCombineMaxDim >= kMaxHeadDim, "the combine takes every head dim");

// Warps that share one row of the combine, 1, 2, 4 or 8 (a divisor of kCombineWarps): doubled
// while the row's warps would each read more than per_warp splits and all the rows' warps stay
// within kCombineEnoughWarps.  Rows with few splits keep one warp each.
__host__ __device__ constexpr int combine_row_warps(int num_splits, int64_t rows,
                                                    int per_warp = kCombineSplitsPerWarp) {
  int w = 1;
  while (2 * w <= kCombineWarps && num_splits > per_warp * w &&
         rows * 2 * w <= kCombineEnoughWarps)
    w *= 2;
  return w;
}
static_assert(combine_row_warps(16, 1) == 1 && combine_row_warps(17, 1) == 2 &&
                  combine_row_warps(33, 1) == 4 && combine_row_warps(65, 1) == 8 &&
                  combine_row_warps(128, 32) == 8 && combine_row_warps(256, 135) == 8 &&
                  combine_row_warps(128, 4096) == 1,
              "combine_row_warps");

// (2 CTAs per SM in the launch bounds: without a minimum, ptxas kept the kernel at 32-48
// registers by sinking each load of out_accum to just before its FMAs, two or three in flight
// per lane, in the one-warp-per-row form before this one too; with it, 72 registers and each
// batch's kCombineBatch loads issued together, on sm_80 and sm_90a.)
template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps, 2)
    flash_decode_combine_kernel(const __grid_constant__ DecodeParams p, int row_warps) {
  // Each warp's weights (its part of the splits) and partial sums.
  __shared__ float s_w[kCombineWarps][kMaxDecodeSplits];
  __shared__ __align__(16) float s_o[kCombineWarps][kCombineMaxDim];
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = warp % row_warps;
  pdl_wait();  // the attention kernel's partial outputs are complete and visible
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (kCombineWarps / row_warps) + warp / row_warps;
  // A warp past the last row reads nothing but still meets the barrier below.
  const bool active = row < rows;
  const int splits = p.num_splits;
  const int s_begin = part * splits / row_warps, s_end = (part + 1) * splits / row_warps;
  // The row's maximum and sum over all its splits, in every warp of the row: at most
  // 2 kMaxDecodeSplits / 32 independent loads per lane, cheaper than a barrier to share them.
  constexpr int kPerLane = kMaxDecodeSplits / 32;
  float xm[kPerLane], xl[kPerLane];
  float m = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int s = lane + 32 * k;
    const bool in = active && s < splits;
    xm[k] = in ? p.max_accum[s * rows + row] : -INFINITY;
    xl[k] = in ? p.sum_accum[s * rows + row] : 0.f;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    nan |= isnan(xm[k]) || isnan(xl[k]);
    m = fmaxf(m, xm[k]);
  }
  nan = __any_sync(0xffffffff, nan);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  const float m_use = m == -INFINITY ? 0.f : m;
  const float scale_log2 = ScoreFn::scale_log2_of(p);
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int s = lane + 32 * k;
    // 0 for a split without keys (m_s -inf, l_s 0) and past the splits
    const float w = xl[k] * exp2f((xm[k] - m_use) * scale_log2);
    if (s >= s_begin && s < s_end) s_w[warp][s - s_begin] = w;
    sum += w;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
  __syncwarp();
  const float kNaN = __int_as_float(0x7fffffff);
  const float f = nan ? kNaN : (sum > 0.f ? 1.f / sum : 0.f);
  const bool writer = active && part == 0;
  if (writer && lane == 0) {
    static_cast<float*>(p.softmax_lse)[row] =
        nan ? kNaN : lse_of(p, ScoreFn::modified_of(p), m_use, sum);
  }
  const int64_t h = (row / p.seqlen_q) % p.heads_q, b = row / (p.seqlen_q * p.heads_q),
                i = row % p.seqlen_q;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride +
                 h * p.out_head_stride;
  auto store = [&](int c, const float4& o) {
    *reinterpret_cast<uint32_t*>(out + c) = pack2<Element>(o.x * f, o.y * f);
    *reinterpret_cast<uint32_t*>(out + c + 2) = pack2<Element>(o.z * f, o.w * f);
  };
  // Four channels per lane and load (head_dim_v is a multiple of 8: rows are 32-byte aligned),
  // chunk j at channels 4 lane + 128 j: this warp's sums first, then the parts added, then the
  // stores.
  constexpr int kChunks = kCombineMaxDim / 128;
  const int64_t split_stride = rows * p.head_dim_v;
  const int count = active ? s_end - s_begin : 0;
  float4 acc[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 4 * lane + 128 * j;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* src = p.out_accum + (active ? row * p.head_dim_v + c : 0) +
                       s_begin * split_stride;
    const int n = c < p.head_dim_v ? count : 0;
    for (int s0 = 0; s0 < n; s0 += kCombineBatch) {
      // The batch's loads first, then its FMAs (past the part: zeros, weight 0): an unrolled
      // loop of load-and-FMA issued its remainder (n % 8 splits) one load at a time.
      float4 v[kCombineBatch];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        v[u] = s0 + u < n ? *reinterpret_cast<const float4*>(src + (s0 + u) * split_stride)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const float w = s0 + u < n ? s_w[warp][s0 + u] : 0.f;
        o.x = fmaf(w, v[u].x, o.x);
        o.y = fmaf(w, v[u].y, o.y);
        o.z = fmaf(w, v[u].z, o.z);
        o.w = fmaf(w, v[u].w, o.w);
      }
    }
    acc[j] = o;
  }
  if (row_warps > 1) {  // (the same in every CTA: a kernel argument)
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
      *reinterpret_cast<float4*>(&s_o[warp][4 * lane + 128 * j]) = acc[j];
    __syncthreads();  // every warp's part in s_o
    if (!writer) return;  // the row's first warp adds the parts of warps + 1 .. + row_warps - 1
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
#pragma unroll
      for (int k = 1; k < kCombineWarps; ++k) {
        if (k >= row_warps) break;
        const float4 v = *reinterpret_cast<const float4*>(&s_o[warp + k][4 * lane + 128 * j]);
        acc[j].x += v.x;
        acc[j].y += v.y;
        acc[j].z += v.z;
        acc[j].w += v.w;
      }
    }
  }
  if (!writer) return;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = 4 * lane + 128 * j;
    if (c < p.head_dim_v) store(c, acc[j]);
  }
}

// The append: rows cache_seqlens[b] .. + seqlen_new of batch row b's entry (or pages) get k_new
// / v_new, k_new rotated on its first rotary_dim channels at its positions (FlashAttention's
// apply_rotary_emb: pairs (2i, 2i + 1) interleaved, else (i, i + rotary_dim / 2)), in fp32 with
// each product rounded as PyTorch's elementwise ops round it.  Rows of a batch row whose values
// break a rule are not written (the attention kernel returns NaN for them).  One CTA per
// (batch row, new row).
template <typename Element>
__global__ void __launch_bounds__(128) kvcache_append_kernel(const __grid_constant__ DecodeParams p) {
  const int64_t b = blockIdx.x / p.seqlen_new, i = blockIdx.x % p.seqlen_new;
  const DecodeEntry e(p, b);
  const bool ok = e.ok && !entry_shared(p, b, e.entry, threadIdx.x, blockDim.x);
  if (!__syncthreads_and(ok)) return;
  const int64_t row = p.cache_seqlens[b] + i;
  const int32_t* bt =
      p.block_table != nullptr ? p.block_table + b * p.block_table_stride : nullptr;
  if (bt != nullptr && !page_exists(p, bt[row / p.page_size])) return;
  const int64_t k_off = cache_row_offset(p, bt, e.entry, row, p.k_batch_stride, p.k_row_stride);
  const int64_t v_off = cache_row_offset(p, bt, e.entry, row, p.v_batch_stride, p.v_row_stride);
  const Element* kn = static_cast<const Element*>(p.k_new) + b * p.knew_batch_stride +
                      i * p.knew_row_stride;
  const Element* vn = static_cast<const Element*>(p.v_new) + b * p.vnew_batch_stride +
                      i * p.vnew_row_stride;
  Element* kc = const_cast<Element*>(static_cast<const Element*>(p.k)) + k_off;
  Element* vc = const_cast<Element*>(static_cast<const Element*>(p.v)) + v_off;
  const int64_t half = p.rotary_dim / 2;
  const float* cos_row = p.rotary_cos != nullptr ? p.rotary_cos + row * half : nullptr;
  const float* sin_row = p.rotary_sin != nullptr ? p.rotary_sin + row * half : nullptr;
  for (int64_t idx = threadIdx.x; idx < p.heads_kv * p.head_dim; idx += blockDim.x) {
    const int64_t h = idx / p.head_dim, c = idx % p.head_dim;
    const Element* src = kn + h * p.knew_head_stride;
    float x = to_float(src[c]);
    if (cos_row != nullptr && c < p.rotary_dim) {
      float x1, x2, cs, sn;
      bool first;
      if (p.rotary_interleaved) {
        x1 = to_float(src[c & ~int64_t{1}]);
        x2 = to_float(src[c | 1]);
        cs = cos_row[c / 2];
        sn = sin_row[c / 2];
        first = (c & 1) == 0;
      } else {
        const int64_t a = c < half ? c : c - half;
        x1 = to_float(src[a]);
        x2 = to_float(src[a + half]);
        cs = cos_row[a];
        sn = sin_row[a];
        first = c < half;
      }
      x = first ? __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn))
                : __fadd_rn(__fmul_rn(x1, sn), __fmul_rn(x2, cs));
    }
    kc[h * p.k_head_stride + c] = from_float<Element>(x);
  }
  for (int64_t idx = threadIdx.x; idx < p.heads_kv * p.head_dim_v; idx += blockDim.x) {
    const int64_t h = idx / p.head_dim_v, c = idx % p.head_dim_v;
    vc[h * p.v_head_stride + c] = vn[h * p.vnew_head_stride + c];
  }
}

// A kernel as a type (each instantiation its own), for with_decode_kernel's callbacks.
template <auto kKernel>
struct KernelTag {
  static constexpr auto kernel = kKernel;
};

// Calls fn(KernelTag<kernel>, traits) with the decode kernel instantiation p selects (rows per
// CTA from p.block_rows, the row lookup for paged caches and p.contiguous_loads = false, the
// lanes per row from p.row_lanes at head dim 64), so that the launch and the occupancy query
// (flash_decode_ctas_per_sm) cannot pick different kernels.
template <typename Element, int kHeadDim, typename Fn>
auto with_decode_kernel(const DecodeParams& p, Fn&& fn) {
  auto layout = [&](auto mt, auto row_lookup) {
    constexpr int kMT = decltype(mt)::value;
    constexpr bool kRowLookup = decltype(row_lookup)::value;
    using T = DecodeTraits<kHeadDim, kMT>;
    if constexpr (kHeadDim == 64) {  // the A/B's load forms (KernelOptions::decode_row_lanes)
      if (p.row_lanes == 2)
        return fn(KernelTag<flash_decode_kernel<Element, kHeadDim, kMT, kRowLookup, 2>>{}, T{});
      if (p.row_lanes == 8)
        return fn(KernelTag<flash_decode_kernel<Element, kHeadDim, kMT, kRowLookup, 8>>{}, T{});
    }
    return fn(KernelTag<flash_decode_kernel<Element, kHeadDim, kMT, kRowLookup>>{}, T{});
  };
  auto tiles = [&](auto mt) {
    return p.block_table != nullptr || !p.contiguous_loads ? layout(mt, std::true_type{})
                                                           : layout(mt, std::false_type{});
  };
  if constexpr (kHeadDim <= 128) {
    return p.block_rows == 32 ? tiles(std::integral_constant<int, 2>{})
                              : tiles(std::integral_constant<int, 1>{});
  } else {
    return tiles(std::integral_constant<int, 1>{});
  }
}

// CTAs of the kernel launch_flash_decode runs for p that one SM holds at once (registers and
// shared memory), queried once per device and instantiation; 0 if the query fails.
template <typename Element, int kHeadDim>
int flash_decode_ctas_per_sm(const DecodeParams& p) {
  return with_decode_kernel<Element, kHeadDim>(p, [](auto tag, auto traits) {
    using T = decltype(traits);
    constexpr auto kernel = decltype(tag)::kernel;
    // (a lambda type per kernel instantiation: per_device_cached keeps one value for each)
    auto query = [](int) {
      if (T::kSmem > 48 * 1024 &&
          opt_in_smem(reinterpret_cast<const void*>(kernel), T::kSmem) != cudaSuccess)
        return 0;
      int ctas = 0;
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, T::kThreads,
                                                           T::kSmem) == cudaSuccess
                 ? ctas
                 : 0;
    };
    return per_device_cached(query);
  });
}

template <typename Element, int kHeadDim>
cudaError_t launch_flash_decode(const DecodeParams& p, cudaStream_t stream) {
  // The combine's limits, checked before either kernel runs: its static shared memory holds
  // kMaxDecodeSplits weights and kCombineMaxDim channels per warp, its loads take 4 channels.
  const int64_t combine_rows = p.batch * p.heads_q * p.seqlen_q;
  const int row_warps = combine_row_warps(
      p.num_splits, combine_rows,
      p.combine_splits_per_warp > 0 ? p.combine_splits_per_warp : kCombineSplitsPerWarp);
  if (p.num_splits < 1 || p.num_splits > kMaxDecodeSplits ||
      (p.num_splits > 1 && (p.head_dim_v > kCombineMaxDim || p.head_dim_v % 4 != 0 ||
                            row_warps < 1 || kCombineWarps % row_warps != 0)))
    return cudaErrorInvalidValue;
  const cudaError_t err =
      with_decode_kernel<Element, kHeadDim>(p, [&](auto tag, auto traits) -> cudaError_t {
        using T = decltype(traits);
        constexpr auto kernel = decltype(tag)::kernel;
        // The kernel splits its grid index with p.m_blocks_div, which the glue computed for
        // p.block_rows rows per CTA: a launch of other tiles would leave rows out or run
        // past them.
        if (p.block_rows != T::kRows) return cudaErrorInvalidValue;
        const int64_t ctas = int64_t{p.m_blocks_div.d} * p.num_splits * p.heads_kv * p.batch;
        return launch(kernel, ctas, T::kThreads, T::kSmem, stream, p);
      });
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const int rows_per_combine_cta = kCombineWarps / row_warps;
  return launch_dependent(p.pdl, flash_decode_combine_kernel<Element>,
                          (combine_rows + rows_per_combine_cta - 1) / rows_per_combine_cta,
                          32 * kCombineWarps, 0, stream, p, row_warps);
}

template <typename Element>
cudaError_t launch_kvcache_append(const DecodeParams& p, cudaStream_t stream) {
  return launch(kvcache_append_kernel<Element>, p.batch * p.seqlen_new, 128, 0, stream, p);
}

}  // namespace flash_attn_ext::sm80
