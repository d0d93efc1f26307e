// The prologue every sm_80 kernel starts with: which (batch, head, block) its CTA takes, where
// that head's rows start in q / k / v / dout and the statistics, which tiles on the other side
// of the score matrix are visible under the causal / window mask (mask.h: VisibleKeys), and
// whether a tile needs the per-element mask (boundary) or not (interior).  Also the tile loads
// the kernels share (K and V of a key tile; Q and dO of a query tile).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../../dropout.h"  // csrc/dropout.h (a plain "dropout.h" names sm80/dropout.h)
#include "kernels/sm80/tile.h"
#include "mask.h"
#include "params.h"

namespace flash_attn_ext::sm80 {

// Start of (batch b, head h) in a (batch, seq, heads, dim) tensor with the given strides.
template <typename Element>
__device__ __forceinline__ const Element* head_rows(const void* base, int64_t batch_stride,
                                                    int64_t head_stride, int64_t b, int64_t h) {
  return static_cast<const Element*>(base) + b * batch_stride + h * head_stride;
}
template <typename Element>
__device__ __forceinline__ Element* head_rows(void* base, int64_t batch_stride,
                                              int64_t head_stride, int64_t b, int64_t h) {
  return static_cast<Element*>(base) + b * batch_stride + h * head_stride;
}
// Where sequence b lies (params.h: dense batches, or packed sequences): its first row in q /
// out / dout / dq (q0) and in k / v / dk / dv (k0), 0 for dense tensors, which place a batch by
// its batch stride, and its lengths.  Read once per CTA.
struct SeqInfo {
  int64_t q0, k0, len_q, len_k;
  __device__ __forceinline__ SeqInfo(const FwdParams& p, int64_t b) {
    if (p.cu_seqlens_q == nullptr) {
      q0 = k0 = 0;
      len_q = p.seqlen_q;
      len_k = p.seqlen_k;
    } else {
      q0 = p.cu_seqlens_q[b];
      len_q = p.cu_seqlens_q[b + 1] - q0;
      k0 = p.cu_seqlens_k[b];
      len_k = p.seqused_k != nullptr ? p.seqused_k[b] : p.cu_seqlens_k[b + 1] - k0;
    }
  }
  // Row 0 of (batch b, head h) in a (batch, seq, heads, dim) tensor: q-side rows (q, out,
  // dout, dq) or key-side ones (k, v, dk, dv).
  template <typename Element, typename Ptr>
  __device__ __forceinline__ Element* q_rows(Ptr base, int64_t batch_stride, int64_t row_stride,
                                             int64_t head_stride, int64_t b, int64_t h) const {
    return static_cast<Element*>(base) + b * batch_stride + q0 * row_stride + h * head_stride;
  }
  template <typename Element, typename Ptr>
  __device__ __forceinline__ Element* k_rows(Ptr base, int64_t batch_stride, int64_t row_stride,
                                             int64_t head_stride, int64_t b, int64_t h) const {
    return static_cast<Element*>(base) + b * batch_stride + k0 * row_stride + h * head_stride;
  }
  // Index of row 0 of (b, h) in the per-row statistics (softmax_lse, the backward's delta):
  // (batch, heads_q, seqlen_q) dense, (heads_q, total_q) packed.
  __device__ __forceinline__ int64_t stats(const FwdParams& p, int64_t b, int64_t h) const {
    return p.cu_seqlens_q == nullptr ? (b * p.heads_q + h) * p.seqlen_q : h * p.total_q + q0;
  }
  // Dropout's row id of (b, h)'s query row 0 (dropout.h's dropout_row_base: (b * heads_q + h)
  // * seqlen_q dense, q0 * heads_q + h * len_q packed).
  __device__ __forceinline__ int64_t dropout_rows(const FwdParams& p, int64_t b, int64_t h) const {
    return dropout_row_base(p.cu_seqlens_q == nullptr ? b * p.seqlen_q : q0, h, p.heads_q, len_q);
  }
  // The causal / window mask of this sequence (bottom-right alignment over its own lengths).
  __device__ __forceinline__ VisibleKeys visible(const FwdParams& p) const {
    return VisibleKeys(len_q, len_k, p.window_left, p.window_right, p.align_bottom_right);
  }
};

// The CTA of a kernel with one CTA per (query block of block_m rows, batch, query head): the
// forward and the dQ kernels.  Longest rows first under causal masking: the heaviest query
// blocks start first (block indices run backwards within a head).
struct QueryBlock {
  int64_t b, h, hk, m0;
  __device__ __forceinline__ QueryBlock(const FwdParams& p, int64_t bid, int64_t num_m_blocks,
                                        int block_m) {
    const int64_t m_block = num_m_blocks - 1 - bid % num_m_blocks;
    const int64_t bh = bid / num_m_blocks;
    b = bh / p.heads_q;
    h = bh % p.heads_q;
    hk = h / (p.heads_q / p.heads_kv);
    m0 = m_block * block_m;
  }
};

// Key tile n_block (of block_n keys) of a QueryBlock's visible range `keys`
// (VisibleKeys::block) straddles some row's boundary: it needs the per-element mask.
__device__ __forceinline__ bool key_tile_masked(const VisibleKeys::Block& keys, int64_t n_block,
                                                int block_n) {
  return n_block * block_n < keys.interior_begin || (n_block + 1) * block_n > keys.interior_end;
}

// f(std::true_type{}) or f(std::false_type{}) as `masked` says, when kTwoCopies (two copies of
// the tile code, no per-element mask test in the unmasked one), else f(masked), a runtime bool
// (one copy: where two would cost more registers or spills than the test).
template <bool kTwoCopies, typename F>
__device__ __forceinline__ void with_mask(bool masked, F&& f) {
  if constexpr (kTwoCopies) {
    if (masked)
      f(std::true_type{});
    else
      f(std::false_type{});
  } else {
    f(masked);
  }
}

// Async loads of key rows key0.. of K into k_dst and of V into v_dst (kRows x head dim tiles;
// rows from seqlen_k on are zeros).
template <typename Element, int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_kv_async(Element* k_dst, Element* v_dst, const Element* k,
                                              const Element* v, const FwdParams& p, int64_t key0,
                                              int64_t seqlen_k) {
  load_tile_async<Element, kRows, kChunks, kThreads>(k_dst, k, p.k_row_stride, key0, seqlen_k,
                                                     static_cast<int>(p.head_dim));
  load_tile_async<Element, kRows, kChunks, kThreads>(v_dst, v, p.v_row_stride, key0, seqlen_k,
                                                     static_cast<int>(p.head_dim_v));
}

// Async loads of query rows m0.. of Q and dO of (batch b, query head h) of sequence `seq` into
// q_dst / do_dst.
template <typename Element, int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_q_do_async(Element* q_dst, Element* do_dst,
                                                const BwdParams& p, const SeqInfo& seq,
                                                int64_t b, int64_t h, int64_t m0) {
  load_tile_async<Element, kRows, kChunks, kThreads>(
      q_dst,
      seq.q_rows<const Element>(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, h),
      p.q_row_stride, m0, seq.len_q, static_cast<int>(p.head_dim));
  load_tile_async<Element, kRows, kChunks, kThreads>(
      do_dst,
      seq.q_rows<const Element>(p.dout, p.dout_batch_stride, p.dout_row_stride,
                                p.dout_head_stride, b, h),
      p.dout_row_stride, m0, seq.len_q, static_cast<int>(p.head_dim_v));
}

}  // namespace flash_attn_ext::sm80
