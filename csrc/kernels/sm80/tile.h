// Shared-memory tiles and the two warp-level GEMM shapes every sm_80 attention kernel is built
// from (forward: S = Q K^T, O += P V; backward: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
// dK += dS^T Q, and S, dP, dQ += dS K for the dQ kernel).
//
// Tiles are row-major with kChunks 16-byte chunks per row, the chunk index XOR-swizzled by the
// row (chunk ^ (row % 8)), so the 8 rows an ldmatrix reads at one logical chunk hit 8 distinct
// bank groups.
#pragma once

#include <cstdint>

#include "kernels/sm80/mma.h"

namespace flash_attn_ext::sm80 {

// Element offset of (row, 16-byte chunk) in a swizzled tile with kChunks chunks per row.
template <int kChunks>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kChunks * 8 + ((chunk ^ (row & 7)) * 8);
}

// Loads rows [row0, row0 + kRows) of a (num_rows x cols) global matrix into a swizzled tile with
// cp.async, all kThreads threads of the CTA taking part; rows >= num_rows and columns >= cols are
// zero-filled.
template <typename Element, int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem,
                                                int64_t row_stride, int64_t row0,
                                                int64_t num_rows, int cols) {
  constexpr int kTotal = kRows * kChunks;
  if constexpr (kTotal % kThreads == 0 && kThreads % kChunks == 0) {
    // Every thread keeps its chunk column and steps down the tile by kThreads / kChunks rows,
    // unrolled: the column test and the row base computed once, the source pointer advanced by
    // a precomputed 64-bit step, rows tested in 32 bits (the loop form below cost ~20
    // instructions per cp.async in the kernels' main loops).
    constexpr int kRowStep = kThreads / kChunks;
    const int c = static_cast<int>(threadIdx.x) % kChunks;
    const int r0 = static_cast<int>(threadIdx.x) / kChunks;
    const bool col_ok = c * 8 < cols;
    const int64_t left = num_rows - row0;
    const int rows_in = left <= 0 ? 0 : (left >= kRows ? kRows : static_cast<int>(left));
    const Element* src = gmem + (row0 + r0) * row_stride + c * 8;
    const int64_t step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < kTotal / kThreads; ++i) {
      const int r = r0 + i * kRowStep;
      const bool valid = col_ok && r < rows_in;
      cp_async_16(smem_addr(smem + swz<kChunks>(r, c)), valid ? src : gmem, valid);
      src += step;
    }
  } else {
    for (int idx = threadIdx.x; idx < kTotal; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = row0 + r < num_rows && c * 8 < cols;
      const Element* src = valid ? gmem + (row0 + r) * row_stride + c * 8 : gmem;
      cp_async_16(smem_addr(smem + swz<kChunks>(r, c)), src, valid);
    }
  }
}

// The k loop every warp-level GEMM below shares: per 16-deep k step kk, the kMT A fragments
// (load_a(kk, mt, fragment)), then per pair of n8 tiles j2 one B fragment (load_b(kk, j2,
// fragment)) and 2 kMT MMAs.  acc is this lane's part of kMT x kN8 accumulator fragments
// (16 x 8 each, fp32).  The GEMMs differ only in where their fragments come from.
template <typename Element, int kMT, int kN8, int kK, typename LoadA, typename LoadB>
__device__ __forceinline__ void gemm_loop(float (&acc)[kMT][kN8][4], LoadA load_a,
                                          LoadB load_b) {
  static_assert(kN8 % 2 == 0 && kK % 16 == 0, "");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) load_a(kk, mt, a[mt]);
#pragma unroll
    for (int j2 = 0; j2 < kN8 / 2; ++j2) {
      uint32_t b[4];
      load_b(kk, j2, b);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<Element>(acc[mt][2 * j2], a[mt], b[0], b[1]);
        mma_16816<Element>(acc[mt][2 * j2 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The A fragment of m16k16 step kk from this lane's fp32 accumulator fragments of a previous
// GEMM, rounded to Element (the C layout of m16n8 is the A layout of m16k16 two tiles at a
// time).
template <typename Element, int kN8>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&p)[kN8][4], int kk) {
  a[0] = pack2<Element>(p[2 * kk][0], p[2 * kk][1]);
  a[1] = pack2<Element>(p[2 * kk][2], p[2 * kk][3]);
  a[2] = pack2<Element>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
  a[3] = pack2<Element>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

// acc[mt][j] += sum_k A[a_row0 + 16 mt + i][k] * B[b_row0 + 8 j + n][k] for k < kK: both
// operands are rows of swizzled shared tiles (e.g. S = Q K^T with A = Q rows, B = K rows).
// acc is this lane's part of kMT x kN8 accumulator fragments (16 x 8 each, fp32).
template <typename Element, int kChunks, int kMT, int kN8, int kK>
__device__ __forceinline__ void gemm_ss(float (&acc)[kMT][kN8][4], const Element* a_s, int a_row0,
                                        const Element* b_s, int b_row0, int lane) {
  gemm_loop<Element, kMT, kN8, kK>(
      acc,
      [&](int kk, int mt, uint32_t(&f)[4]) {
        ldmatrix_x4(f, smem_addr(a_s + swz<kChunks>(a_row0 + mt * 16 + lane % 16,
                                                    kk * 2 + lane / 16)));
      },
      [&](int kk, int j2, uint32_t(&f)[4]) {
        ldmatrix_x4(f, smem_addr(b_s + swz<kChunks>(b_row0 + j2 * 16 + (lane / 16) * 8 + lane % 8,
                                                    kk * 2 + (lane / 8) % 2)));
      });
}

// acc[mt][j] += sum_k P[16 mt + i][k] * B[b_row0 + k][8 (chunk0 + j) + n] for k < kK, where P is
// this lane's fp32 accumulator fragments of a previous GEMM (rounded to Element on the way: the
// C layout of m16n8 is the A layout of m16k16 two tiles at a time) and B is kK rows of a
// swizzled shared tile read transposed (e.g. O += P V, dQ += dS K).
template <typename Element, int kChunks, int kMT, int kK, int kN8>
__device__ __forceinline__ void gemm_rs(float (&acc)[kMT][kN8][4], const float (&p)[kMT][kK / 8][4],
                                        const Element* b_s, int b_row0, int chunk0, int lane) {
  gemm_loop<Element, kMT, kN8, kK>(
      acc, [&](int kk, int mt, uint32_t(&f)[4]) { pack_a<Element>(f, p[mt], kk); },
      [&](int kk, int j2, uint32_t(&f)[4]) {
        ldmatrix_x4_trans(f, smem_addr(b_s + swz<kChunks>(b_row0 + kk * 16 + lane % 16,
                                                          chunk0 + j2 * 2 + lane / 16)));
      });
}

// The GEMMs above (gemm_ss; gemm_rs with A from shared memory or registers) with operands given
// as per-lane shared addresses (the 8-warp backward, flash_bwd_lean.cuh, and the forward).
// tile.h recomputes swz(row, chunk) for every k step, and since the swizzle is an XOR the
// compiler keeps one address register per (operand, k step): ~50 registers in these kernels,
// which made the head-dim-128 kernels spill.  Here each operand has one base address, that of
// its first ldmatrix, and the others follow from it: an ldmatrix address moves by whole
// 16-row groups (a constant, the row % 8 of every lane is unchanged) and by compile-time
// chunk steps c, which swz_step applies as an XOR on the swizzled chunk bits (bits 4-6 of the
// address, c % 8) plus a constant (c / 8 whole 8-chunk groups).  That is exact when the chunk
// the base was computed for and c % 8 share no bit (the base's chunk is lane / 16 or
// (lane / 8) % 2, plus a multiple of kN8 for the transposed operand, and c a multiple of 2
// below 8 or of 8) and every tile starts 128-byte aligned.
__device__ __forceinline__ uint32_t swz_step(uint32_t base, int c) {
  return (base ^ static_cast<uint32_t>((c & 7) << 4)) + static_cast<uint32_t>((c & ~7) << 4);
}
// Traps unless the dynamic shared memory (declared __align__(128)) starts 128-byte aligned, as
// swz_step needs (never expected).
__device__ __forceinline__ void check_swz_alignment(const void* smem) {
  if (smem_addr(smem) % 128 != 0) __trap();
}

// Base address of the A operand of lean_gemm_ss / lean_gemm_ss_t (rows row0.., k from 0), and
// of the B operand of lean_gemm_ss (rows row0.. of a tile read untransposed).
template <int kChunks, typename Element>
__device__ __forceinline__ uint32_t a_base(const Element* s, int row0, int lane) {
  return smem_addr(s + swz<kChunks>(row0 + lane % 16, lane / 16));
}
template <int kChunks, typename Element>
__device__ __forceinline__ uint32_t b_base(const Element* s, int row0, int lane) {
  return smem_addr(s + swz<kChunks>(row0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2));
}
// Base address of the transposed B operand of lean_gemm_ss_t (rows from 0, columns from
// 8 * chunk0, chunk0 a multiple of the GEMM's kN8).
template <int kChunks, typename Element>
__device__ __forceinline__ uint32_t bt_base(const Element* s, int chunk0, int lane) {
  return smem_addr(s + swz<kChunks>(lane % 16, chunk0 + lane / 16));
}

// acc[mt][j] += sum_k A[16 mt + i][k] * B[8 j + n][k], k < kK (tile.h gemm_ss).
template <typename Element, int kChunks, int kMT, int kN8, int kK>
__device__ __forceinline__ void lean_gemm_ss(float (&acc)[kMT][kN8][4], uint32_t a, uint32_t b) {
  constexpr uint32_t kGroup = 16 * kChunks * 16;  // bytes of 16 rows
  gemm_loop<Element, kMT, kN8, kK>(
      acc,
      [&](int kk, int mt, uint32_t(&f)[4]) { ldmatrix_x4(f, swz_step(a, 2 * kk) + mt * kGroup); },
      [&](int kk, int j2, uint32_t(&f)[4]) { ldmatrix_x4(f, swz_step(b, 2 * kk) + j2 * kGroup); });
}

// acc[mt][j] += sum_k A[16 mt + i][k] * B[k][8 j + n], k < kK, B read transposed (as tile.h
// gemm_rs), A staged in shared memory by other warps (dV += P^T dO, dK += dS^T Q, dQ += dS K).
// kATrans: A is stored k-major too and read with ldmatrix.trans (dQ += dS K from dS^T in the
// dK/dV kernel; its base from at_base), else row-major (a_base).
template <typename Element, int kAChunks, int kBChunks, int kMT, int kN8, int kK,
          bool kATrans = false>
__device__ __forceinline__ void lean_gemm_ss_t(float (&acc)[kMT][kN8][4], uint32_t a,
                                               uint32_t b) {
  static_assert(kAChunks >= 8 && kBChunks >= 8, "");
  constexpr uint32_t kAGroup = 16 * kAChunks * 16, kBGroup = 16 * kBChunks * 16;
  gemm_loop<Element, kMT, kN8, kK>(
      acc,
      [&](int kk, int mt, uint32_t(&f)[4]) {
        if constexpr (kATrans)
          ldmatrix_x4_trans(f, swz_step(a, 2 * mt) + kk * kAGroup);
        else
          ldmatrix_x4(f, swz_step(a, 2 * kk) + mt * kAGroup);
      },
      [&](int kk, int j2, uint32_t(&f)[4]) {
        ldmatrix_x4_trans(f, swz_step(b, 2 * j2) + kk * kBGroup);
      });
}

// Base address of an A operand read transposed (lean_gemm_ss_t<..., true>): the tile is stored
// k-major (rows = k from 0, columns = the GEMM's m from 8 * chunk0), e.g. dS^T read as dS.
// Same lane pattern as b_base: lane l gives row (l / 16) * 8 + l % 8 of 8 x 8 matrix l / 8.
template <int kChunks, typename Element>
__device__ __forceinline__ uint32_t at_base(const Element* s, int chunk0, int lane) {
  return smem_addr(s + swz<kChunks>((lane / 16) * 8 + lane % 8, chunk0 + (lane / 8) % 2));
}

// acc[mt][j] += sum_k P[16 mt + i][k] * B[k][8 j + n], k < kK: gemm_rs with B's per-lane base
// address from bt_base (O += P V in the forward).
template <typename Element, int kBChunks, int kMT, int kK, int kN8>
__device__ __forceinline__ void lean_gemm_rs(float (&acc)[kMT][kN8][4],
                                             const float (&p)[kMT][kK / 8][4], uint32_t b) {
  static_assert(kBChunks >= 8, "");
  constexpr uint32_t kBGroup = 16 * kBChunks * 16;
  gemm_loop<Element, kMT, kN8, kK>(
      acc, [&](int kk, int mt, uint32_t(&f)[4]) { pack_a<Element>(f, p[mt], kk); },
      [&](int kk, int j2, uint32_t(&f)[4]) {
        ldmatrix_x4_trans(f, swz_step(b, 2 * j2) + kk * kBGroup);
      });
}

// Base address of store_frag_smem's stores into a swizzled shared tile with kChunks chunks per
// row: this lane's first element, row row0 + lane / 4 (row0 a multiple of 8), column
// 8 chunk0 + 2 (lane % 4), chunk0 a multiple of the store's kN8 rounded up to a power of two.
template <int kChunks, typename Element>
__device__ __forceinline__ uint32_t frag_base(const Element* s, int row0, int chunk0, int lane) {
  return smem_addr(s + swz<kChunks>(row0 + lane / 4, chunk0) + 2 * (lane % 4));
}

// Rounds this lane's fp32 fragments acc[mt][j] to Element and writes them to the tile of
// frag_base: rows + 16 mt (+8), chunks + j.  One 4-byte store per pair, conflict-free (the 8
// rows of a store land in 8 distinct chunks); every address is the base XOR-stepped by j
// (swz_step) plus a constant, so the compiler keeps one register per j, not per store.
template <typename Element, int kChunks, int kMT, int kN8>
__device__ __forceinline__ void store_frag_smem(uint32_t base,
                                                const float (&acc)[kMT][kN8][4]) {
  constexpr uint32_t kRowBytes = kChunks * 16;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < kN8; ++j)
        st_shared_b32(swz_step(base, j) + (mt * 16 + 8 * r) * kRowBytes,
                      pack2<Element>(acc[mt][j][2 * r], acc[mt][j][2 * r + 1]));
}

template <int kMT, int kN8>
__device__ __forceinline__ void zero(float (&acc)[kMT][kN8][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
}

// Writes rows of fp32 fragments acc[mt][j] (rows row0 + 16 mt + lane/4 (+8), columns
// col0 + 8 j + 2 (lane % 4) (+1)) to a row-major global matrix as Element, scaled by `mul`,
// skipping rows >= num_rows and columns >= cols (cols even).
template <typename Element, int kMT, int kN8>
__device__ __forceinline__ void store_rows(Element* gmem, int64_t row_stride,
                                           const float (&acc)[kMT][kN8][4], int64_t row0,
                                           int64_t num_rows, int col0, int cols, int lane,
                                           float mul = 1.f) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + mt * 16 + lane / 4 + 8 * r;
      if (row >= num_rows) continue;
#pragma unroll
      for (int j = 0; j < kN8; ++j) {
        const int col = col0 + j * 8 + 2 * (lane % 4);
        if (col < cols)
          *reinterpret_cast<uint32_t*>(gmem + row * row_stride + col) =
              pack2<Element>(acc[mt][j][2 * r] * mul, acc[mt][j][2 * r + 1] * mul);
      }
    }
}

}  // namespace flash_attn_ext::sm80
