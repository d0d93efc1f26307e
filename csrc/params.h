// The parameter structs that the ATen glue fills and the kernels read.
//
// Kernels (CPU and CUDA) see raw pointers, sizes and element strides only: nothing here includes
// torch.  Layout is FlashAttention's: q is (batch, seqlen_q, heads_q, head_dim), k is
// (batch, seqlen_k, heads_kv, head_dim), v is (batch, seqlen_k, heads_kv, head_dim_v), with any
// batch/row/head strides and a contiguous last dimension.
#pragma once

#include <cstdint>

#include "fast_div.h"

namespace flash_attn_ext {

constexpr int64_t kMaxHeadDim = 256;  // largest head_dim any kernel instantiates

// One block of one packed sequence (FwdParams::sm90_varlen_tiles): sequence b's rows
// q0 .. q0 + len_q of q / out and keys k0 .. k0 + len_k of k / v (len_k = seqused_k[b] where
// given), its block `block`: in the forward a query block (rows block * block_m ..), in the
// backward a key block (keys block * 128 ..).  row_base: the backward's first row of the
// sequence in its padded per-row scratch (BwdParams::sm90_varlen_rows; 0 in the forward).
// 32 bytes: two 16-byte loads.
struct alignas(16) VarlenTile {
  int32_t b, block, q0, k0, len_q, len_k, row_base, unused;
};

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;          // (batch, seqlen_q, heads_q, head_dim_v), strides below
  void* softmax_lse = nullptr;  // (batch, heads_q, seqlen_q) contiguous, accumulator type

  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;

  // Additive bias (attn_mask) in the accumulator type, indexed (batch, head_q, row, key) with
  // these element strides (0 where it broadcasts); nullptr when absent.  Added after the scale
  // and softcap: scores = softcap(q k^T * scale) + bias.
  const void* attn_bias = nullptr;
  int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0, bias_col_stride = 0;
  // attn_bias is a boolean mask (1 byte per element, nonzero = attend; the same strides), read
  // as it is by the CPU kernels and the Hopper kernels' mask variant: the other CUDA kernels
  // get the additive fp32 form (the glue converts, prepare_bias).
  bool bias_is_mask = false;
  // The Hopper kernels' summary of the bias by 64 x 64 blocks (kernels/sm90/bias_blocks.h: all 0,
  // all -inf, or mixed), indexed (batch, head, row / 64, key / 64) with these strides (0 where
  // the bias broadcasts); nullptr: none (every block read as mixed).
  const uint8_t* bias_blocks = nullptr;
  int64_t blocks_batch_stride = 0, blocks_head_stride = 0, blocks_row_stride = 0,
          blocks_col_stride = 0;
  // Beside it, per (batch, head) of the bias's own extent: for each 64-row block the span of
  // 64-key blocks outside which all its blocks are masked, then for each 64-key block the span
  // of row blocks likewise, as pairs (begin, ~end) (kernels/sm90/bias_blocks.h: bias_key_span,
  // bias_row_span); ranges_key_offset: where the key blocks' pairs start.  nullptr with
  // bias_blocks.
  // After them, for each 64-row block the longest run of key blocks that are all visible (all
  // 0 / all true), as a pair (begin, end) at ranges_visible_offset (bias_visible_tiles).
  const uint32_t* bias_ranges = nullptr;
  int64_t ranges_batch_stride = 0, ranges_head_stride = 0, ranges_key_offset = 0,
          ranges_visible_offset = 0;
  // A boolean mask's rows as key intervals (kernels/sm90/bias_blocks.h: mask_row_keys), for the
  // Hopper forward's mask variant: per row of the mask's own extent a record of four int32
  // whose first two are (begin, end) where the row's visible keys are exactly [begin, end),
  // else begin > end; indexed (batch, head, row) with these strides in records (0 where the
  // mask broadcasts).  nullptr: none (mixed blocks read the mask's bytes).
  const int32_t* bias_row_keys = nullptr;
  int64_t row_keys_batch_stride = 0, row_keys_head_stride = 0, row_keys_row_stride = 0;
  // The same per key for the Hopper backward's mask variant (mask_col_rows): per key of a mask
  // with a value per row and key, (begin, end) of the query rows that see it; indexed (batch,
  // head, key), keys unit-stride.  nullptr: none.
  const int32_t* bias_col_rows = nullptr;
  int64_t col_rows_batch_stride = 0, col_rows_head_stride = 0;

  // ALiBi (Press et al. 2022, arXiv:2108.12409; FlashAttention-2's definition): scores +=
  // -slope(b, h) * |i + off - j|, off as the mask's below (seqlen_k - seqlen_q bottom-right),
  // added after the softcap like the bias.  Slopes in the accumulator type at
  // alibi_slopes[b * alibi_batch_stride + h] (stride 0 for one slope per head); nullptr: none.
  const void* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  double softmax_scale = 1.0;  // double so float64 inputs keep full precision
  double softcap = 0.0;  // 0 = off; else scores become softcap * tanh(scores / softcap)

  // Visible keys for query i: i + off - window_left <= j <= i + off + window_right, a side of -1
  // meaning unbounded; off = seqlen_k - seqlen_q when align_bottom_right, else 0.  Causal
  // attention is window_right = 0 (the glue folds the `causal` flag in).
  int64_t window_left = -1, window_right = -1;
  bool align_bottom_right = true;

  // Dropout on P (dropout.h): element (b, h, i, j) is kept iff its Philox byte is below
  // dropout_threshold (in [0, 256]); kept values are scaled by dropout_scale = 256 / threshold.
  // dropout is false where dropout_p rounds to 0 (dropout_active).
  // The (seed, offset) pair comes from philox_seed/philox_offset, or, where the pointers are set
  // (CUDA: under graph capture, and in the backward, which reads the forward's rng_state), from
  // *philox_seed_ptr and *philox_offset_ptr + philox_offset_intragraph, read on the device.
  bool dropout = false;
  double dropout_p = 0.0;
  uint32_t dropout_threshold = 0;
  float dropout_scale = 1.f;
  uint64_t philox_seed = 0, philox_offset = 0;
  const int64_t* philox_seed_ptr = nullptr;
  const int64_t* philox_offset_ptr = nullptr;
  uint64_t philox_offset_intragraph = 0;
  int64_t* rng_state = nullptr;  // CUDA forward: where to write the (seed, offset) it used

  // Packed sequences (FlashAttention-2's varlen; the portable CUDA kernels, block_info.h's
  // SeqInfo, and the Hopper varlen kernels, from the tables below): with cu_seqlens_q set,
  // sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q / out / dout / dq (keys:
  // cu_seqlens_k, of which it uses the first seqused_k[b] where seqused_k is set), the batch
  // strides are 0, batch is the number of sequences, seqlen_q / seqlen_k are the longest, and
  // softmax_lse (like the portable backward's per-row statistics; the Hopper backward's are in
  // padded rows, BwdParams::sm90_varlen_rows) is (heads_q, total_q).  Device pointers, int32.
  // (The CPU kernels take the same geometry as their Seqs.)
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_k = nullptr;
  int64_t total_q = 0;
  int64_t total_k = 0;  // rows of k and v (packed sequences)
  // The Hopper forward on packed sequences: its tiles, one VarlenTile per query block of
  // sm90_varlen_block_m rows that a sequence has (none for an empty sequence), in the order the
  // CTAs take them, each for all heads_q query heads (tile t: entry t / heads_q, head
  // t % heads_q).  Built on the host from the offsets it has read (the glue); a device array.
  // The Hopper backward's: one per key block of sm90_varlen_block_m keys that some query row
  // of its sequence sees, each for all heads_kv KV heads (BwdParams::sm90_varlen_rows).
  const VarlenTile* sm90_varlen_tiles = nullptr;
  int32_t sm90_varlen_entries = 0;
  int32_t sm90_varlen_block_m = 0;
  int32_t* tile_counter = nullptr;  // Hopper forward: scratch int32 for its tile scheduler
  int32_t max_ctas = 0;  // Hopper forward: CTAs to launch at most (0: one per SM)
  // Hopper forward: (batch, head) pairs per section of its tile order; Hopper backward, causal or
  // windowed with dQ in any order: (batch, KV head) pairs per section of its launch order (0: the
  // launcher's choice; KernelOptions::sm90_section_pairs, experimental)
  int32_t heads_per_section = 0;
  // Hopper forward, softcap variant at head dim 64: exp2s on the FMA pipe per 8 columns (-1:
  // the kernel's default; KernelOptions::sm90_fma_exp2, experimental)
  int32_t sm90_fma_exp2 = -1;
  // Hopper forward, ALiBi and dropout variants at head dim 64: consumer warpgroups, 2 or 3 (0:
  // the kernel's default; KernelOptions::sm90_per_score_consumers, experimental)
  int32_t sm90_per_score_consumers = 0;
  // Hopper forward: under a causal mask, put the partial query block first (see its launcher;
  // KernelOptions::sm90_row_shift = false, experimental, clears it)
  bool sm90_row_shift = true;
  // Hopper forward, ALiBi variant at head dim 64: its term in the Q K^T GEMM where the call
  // allows (fwd_kernel.h's fold_alibi; KernelOptions::sm90_alibi_fold = false, experimental,
  // clears it)
  bool sm90_alibi_fold = true;
  // Hopper forward on packed sequences: the tile table by sequence (each one's query blocks
  // together) in sections of heads, as the dense order (false: the table by weight alone, the
  // heads fastest; KernelOptions::sm90_varlen_sections, experimental)
  bool sm90_varlen_sections = true;
  // Hopper forward, softcap and ALiBi variants at head dim 64: 96-key tiles (false: 128, their
  // default; KernelOptions::sm90_narrow_tiles, experimental)
  bool sm90_narrow_tiles = false;
  // Hopper forward: pack the query heads of a GQA group into one tile (see its launcher; the
  // glue sets it as kernel_select.h decides)
  bool sm90_pack_gqa = false;
  // Hopper forward: store O from registers instead of by TMA; Hopper backward (head dims 64 and
  // 128): dK and dV from registers instead of through shared memory (an experimental variant,
  // KernelOptions::sm90_direct_epilogue)
  bool sm90_direct_epilogue = false;

  // Hopper backward, dropout variant at head dim 64 (dense calls): 64-row steps (false: 128;
  // KernelOptions::sm90_bwd_short_steps, experimental)
  bool sm90_bwd_short_steps = true;

  // Softcap, a bias or ALiBi: what only the Hopper kernels' general variant computes.
  bool score_mods() const {
    return softcap > 0.0 || attn_bias != nullptr || alibi_slopes != nullptr;
  }
  // Those or dropout: the portable kernels' general variant (their plain one otherwise).
  bool general() const { return score_mods() || dropout; }
  // A boolean mask and nothing else (no softcap, ALiBi or dropout): the Hopper kernels' mask
  // variant.
  bool mask_only() const {
    return attn_bias != nullptr && bias_is_mask && softcap <= 0.0 && alibi_slopes == nullptr &&
           !dropout;
  }
  // Softcap and nothing else (no bias, ALiBi or dropout): the Hopper forward's softcap variant.
  bool softcap_only() const {
    return softcap > 0.0 && attn_bias == nullptr && alibi_slopes == nullptr && !dropout;
  }
  // ALiBi and nothing else (no softcap, bias or dropout): the Hopper kernels' ALiBi variant.
  bool alibi_only() const {
    return alibi_slopes != nullptr && softcap <= 0.0 && attn_bias == nullptr && !dropout;
  }
  // Whether a Hopper instantiation of these variant flags takes the call (kGeneral: softcap, an
  // additive bias, ALiBi, dropout with them; kDropout: dropout alone; kMask: a boolean mask
  // alone; kSoftcap: softcap alone; kAlibi: ALiBi alone; none: plain attention).
  bool sm90_variant_is(bool general_v, bool dropout_v, bool mask_v, bool softcap_v = false,
                       bool alibi_v = false) const {
    // (their bias reads take keys unit-stride or broadcast: prepare_bias)
    if (attn_bias != nullptr && seqlen_k > 1 && bias_col_stride != 0 && bias_col_stride != 1)
      return false;
    if (softcap_v) return softcap_only();
    if (alibi_v) return alibi_only();
    if (mask_v) return mask_only();
    if (bias_is_mask) return false;
    return general_v || (!score_mods() && dropout == dropout_v);
  }
};

// Decoding against a KV cache (flash_attn_with_kvcache on CUDA; kernels/sm80/
// flash_decode_kernel.cuh).  q is (batch, seqlen_q, heads_q, head_dim) as above; k / v point at
// the caches: (entries, seqlen_cache, heads_kv, head_dim) with k_batch_stride the entry stride,
// or, with block_table, (num_pages, page_size, heads_kv, head_dim) with k_batch_stride the page
// stride.  Batch row b attends to its entry's cache rows leftpad[b] .. cache_seqlens[b] +
// seqlen_new, all read on the device (no host synchronisation).  A row whose values break a
// rule (a length outside the cache, a left pad past cache_seqlens, an entry or page index out
// of range, rotary rows missing) is not read: its out and softmax_lse become NaN.
struct DecodeParams : FwdParams {
  const int32_t* cache_seqlens = nullptr;    // (batch,): each entry's length before the append
  const int32_t* cache_leftpad = nullptr;    // (batch,) or nullptr: first used row
  const int32_t* cache_batch_idx = nullptr;  // (batch,) or nullptr: the entry of batch row b
  const int32_t* block_table = nullptr;      // (batch, max_blocks) or nullptr: paged KV
  int64_t block_table_stride = 0;
  int64_t page_size = 0;      // rows per page (paged), else seqlen_cache
  int64_t num_entries = 0;    // k_cache.shape[0]: entries, or pages when paged
  int64_t seqlen_cache = 0;   // rows an entry can hold (paged: page_size * max_blocks)
  int64_t seqlen_new = 0;     // rows appended before the attention (already in the cache)
  int64_t rotary_rows = 0;    // with rotary: rows cache_seqlens[b] .. + rotary_rows are rotated
  int64_t seqlen_ro = -1;     // rows of rotary_cos (-1: no rotary embedding)
  // Split-KV: num_splits CTAs share one (batch row, query block, KV head), each a contiguous
  // part of its keys; with num_splits > 1 they write normalised partial outputs out_accum
  // (num_splits, batch, heads_q, seqlen_q, head_dim_v) and their rows' maximum score max_accum
  // and sum sum_accum (num_splits, batch, heads_q, seqlen_q; in the exponent's units: the
  // decode kernel's top comment), fp32, which the combine kernel merges into out / softmax_lse.
  int num_splits = 1;
  // The decode kernel's launch constants as divisors (fast_div.h; set by the glue): the GQA
  // group heads_q / heads_kv, and the grid's decomposition, blockIdx.x = ((b * heads_kv + hk)
  // * num_splits + split) * m_blocks + m_block, m_blocks = ceil(seqlen_q * group /
  // block_rows).
  FastDiv group_div, m_blocks_div, splits_div, heads_kv_div;
  // Lanes per cache row of the decode kernel's copies at head dim 64 (2, 4 or 8; 0: its
  // default, 4); KernelOptions::decode_row_lanes, experimental.
  int32_t row_lanes = 0;
  // The combine launched as a programmatic dependent of the attention kernel (sm_90+;
  // KernelOptions::decode_pdl).
  bool pdl = false;
  // A contiguous cache's rows reached by offsets alone (KernelOptions::decode_contiguous_loads);
  // false: through cache_row_offset's per-row lookup, as a paged cache's.
  bool contiguous_loads = true;
  // Splits one warp of the combine reads before a row is spread over more warps (0: its
  // default; KernelOptions::decode_combine_splits).
  int32_t combine_splits_per_warp = 0;
  // Query rows one decode CTA takes (16 or 32; decode_block_rows, set by the glue, which sized
  // the grid and m_blocks_div by it).
  int32_t block_rows = 16;
  float* out_accum = nullptr;
  float* max_accum = nullptr;
  float* sum_accum = nullptr;
  // The append (kvcache_append): new keys / values (batch, seqlen_new, heads_kv, head_dim)
  // and the rotary table (seqlen_ro, rotary_dim / 2) in fp32, contiguous.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t knew_batch_stride = 0, knew_row_stride = 0, knew_head_stride = 0;
  int64_t vnew_batch_stride = 0, vnew_row_stride = 0, vnew_head_stride = 0;
  const float* rotary_cos = nullptr;
  const float* rotary_sin = nullptr;
  int64_t rotary_dim = 0;
  bool rotary_interleaved = true;
};

// Rows per batch of BwdParams::dq_accum: seqlen_q rounded up to whole 128-row tiles, so that the
// atomic-dQ kernel adds whole tiles without a row test (rows past seqlen_q receive zeros).
constexpr int64_t dq_accum_rows(int64_t seqlen_q) { return (seqlen_q + 127) / 128 * 128; }
// Columns of BwdParams::dq_accum: the head dim padded as the 8-warp kernels take it (64, 128
// or 256).
constexpr int64_t dq_accum_cols(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}
// Shared memory per block of the largest portable (4-warp) backward kernel at a padded head dim:
// its dK/dV kernel (flash_bwd_kernel.cuh, BwdTraits::kSmemDkdv; the launcher checks this formula
// against the traits): K and V of 64 keys, Q and dO double-buffered (64 query rows per step up
// to head dim 128, 32 above), two fp32 statistics per query row.  Every fused CUDA call needs its
// backward to fit, so a GPU that allows less gets no fused kernel (e.g. sm_86 at head dim 256).
constexpr int portable_bwd_smem_bytes(int head_dim) {
  const int rows = head_dim <= 128 ? 64 : 32;
  return (2 * 64 + 4 * rows) * head_dim * 2 + 4 * rows * 4;
}

// Shared memory per block that the 8-warp plain-attention backward (kernels/sm80/
// flash_bwd_lean.cuh) needs at a padded head dim (64, 128 or 256) in its smallest variant
// (64-row steps): the larger of its dK/dV kernel (K, V of 128 keys, 64 at head dim 256; Q, dO
// double-buffered; P^T, dS^T; lse, D) and its dQ kernel.  GPUs that allow less run the 4-warp
// kernels (kernel_select.h decides which run; the glue allocates BwdParams::dq_accum only for
// the 8-warp ones).  launch_flash_bwd checks the formula against LeanBwdTraits.
constexpr int lean_bwd_smem_bytes(int head_dim) {
  const int keys = head_dim <= 128 ? 128 : 64, rows = 64, stages = 2, elem = 2;
  const int dkdv = (2 * keys + 2 * stages * rows) * head_dim * elem + 2 * keys * rows * elem +
                   2 * stages * rows * 4;
  const int dq = (2 * keys + 2 * stages * 64) * head_dim * elem + keys * 64 * elem;
  return dkdv > dq ? dkdv : dq;
}
// Floats of BwdParams::dq_accum: (batch, dq_accum_rows(seqlen_q), heads_q, dq_accum_cols(d)).
constexpr int64_t dq_accum_floats(int64_t batch, int64_t seqlen_q, int64_t heads_q,
                                  int64_t head_dim) {
  return batch * dq_accum_rows(seqlen_q) * heads_q * dq_accum_cols(head_dim);
}

struct BwdParams : FwdParams {
  const void* dout = nullptr;  // same shape as out
  void* dq = nullptr;          // like q
  void* dk = nullptr;          // like k
  void* dv = nullptr;          // like v
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  bool deterministic = false;
  // With a bias that needs a gradient: dS in the accumulator type, (batch, head_q, seqlen_q,
  // seqlen_k) contiguous; the glue reduces it to the bias's shape.  nullptr otherwise.
  void* dbias_full = nullptr;
  // The gradient flowing into softmax_lse, (batch, head_q, seqlen_q) contiguous in the
  // accumulator type, or nullptr: the kernels use delta = rowsum(dO * O) - dsoftmax_lse.
  const void* dsoftmax_lse = nullptr;
  // Optional fp32 scratch for FlashAttention-2's atomic dQ, batch * dq_accum_rows(seqlen_q) *
  // heads_q * (padded head dim of the kernel: 64, 128 or 256) floats: where the 8-warp
  // plain-attention kernels run (flash_bwd_lean.cuh), the delta kernel zeroes it, the dK/dV
  // kernel adds dQ into it (layout: flash_bwd_lean.cuh, DqMode) and a conversion writes dq, in
  // place of the separate dQ kernel.  Ignored elsewhere.  nullptr: the separate dQ kernel
  // (bitwise reproducible gradients, `deterministic=True`).
  float* dq_accum = nullptr;
  // Which backward kernels run (kernel_select.h decides; the launcher obeys): the 8-warp
  // plain-attention kernels of flash_bwd_lean.cuh, or the 4-warp ones of flash_bwd_kernel.cuh.
  bool bwd_eight_warp = false;
  // With dq_accum: dQ by sm_90 bulk reductions of whole tiles (else per-lane fp32 atomics).
  bool dq_bulk = false;
  // The Hopper backward with deterministic=True: int32 counters, dq_semaphores_per_head(...)
  // per (batch, query head), zeroed, the kernel's query block m_block at index m_block (its
  // blocks have 64 or 128 rows: at 128 half of them go unused); packed sequences: one per
  // query block of the padded scratch rows (heads_q * sm90_varlen_padded_q / 64 allocated).
  // Each query block's dQ tiles are added in a fixed order of key blocks
  // (kernels/sm90/bwd_dq.h).  nullptr: in the order the CTAs get there (not bitwise
  // reproducible).
  int32_t* dq_semaphore = nullptr;
  // The Hopper backward on packed sequences (sm90_varlen_tiles: one entry per key block that
  // some query row of its sequence sees): its per-row scratch (statistics, fp32 dQ) holds each
  // sequence's rows from a multiple of 128 (VarlenTile::row_base), sm90_varlen_padded_q rows
  // per head in all; sm90_varlen_rows describes them, two int32 per 128 padded rows: the
  // packed row of q its first row holds and how many of its rows hold one (1 .. 128; the rest
  // are padding).
  // Built on the host from the offsets it read (the glue); device arrays.
  const int32_t* sm90_varlen_rows = nullptr;
  int64_t sm90_varlen_padded_q = 0;
};

// Counters of BwdParams::dq_semaphore per (batch, query head): one per 64 query rows of
// dq_accum_rows(seqlen_q), the smallest query block; and in all.
constexpr int64_t dq_semaphores_per_head(int64_t seqlen_q) { return dq_accum_rows(seqlen_q) / 64; }
constexpr int64_t dq_semaphore_count(int64_t batch, int64_t seqlen_q, int64_t heads_q) {
  return batch * heads_q * dq_semaphores_per_head(seqlen_q);
}

}  // namespace flash_attn_ext
