// The bias summary of bias_blocks.h: a warp per 64 x 64 block, eight blocks along the keys per
// CTA, each lane reading 16 bytes of a row at a time where the block's 64 keys are whole,
// unit-stride and 16-byte aligned in every row (else two keys of every row), the class by two
// warp votes.  An additive fp32
// bias: 0 visible, -inf masked; a boolean mask (FwdParams::bias_is_mask): nonzero visible,
// zero masked.
//
// With row intervals (MaskIntervals::kRows, the forward's mask variant, a boolean mask with a
// value per key): also each row's first and last visible key and its count of visible keys,
// per block from the lanes' bits, per CTA (eight key blocks) in shared memory, per row by
// three atomics into its record; finish_record then turns the record into the row's interval
// (mask_row_keys), or marks a row whose visible keys are not one interval (count != last -
// first + 1).  With column intervals (kCols, the backward's mask variant, whose CTA keeps its
// keys for all its steps; a mask with a value per row and key): the same per key over the
// rows, each column's rows gathered from the lanes' bits by one warp vote per key of a lane's
// 16 (bits of eight rows and four 16-key groups each), three atomics per column and block.
//
// Why this shape: a (B, 1, L, S) mask is B * L * S values (64 MB at B = 4, L = S = 4k), read
// before the forward and again before the backward, so the pass must run at memory speed.
// One CTA per block, its index split by two 64-bit divisions per value, cost the causal +
// padding forward ~0.3 ms (a third of it); a warp per block reading a byte per lane took
// 101 us on the H200 (0.63 TB/s); docs/perf/sm90_score_mods.md has the measurements.
#include "kernels/sm90/bias_blocks.h"

#include <cmath>
#include <type_traits>

namespace flash_attn_ext::sm90 {

namespace {

constexpr int kWarpsPerCta = 8;  // key blocks per CTA

// The summary's extent: the bias's own (1 where it broadcasts, stride 0) batch and heads, and
// its 64-blocks of rows and keys.
// Words of a row's record (FwdParams::bias_row_keys) or a column's (bias_col_rows): while
// summarize_bias_kernel runs, the first visible key (row) by atomicMin, ~the last (atomicMin),
// ~the count (atomicSub from ~0), all starting at ~0; then (begin, end) in the first two
// (finish_record).
constexpr int kRecord = 4;

struct SummaryShape {
  int64_t batch, heads, rows, row_blocks, key_blocks, own_keys;
  bool row_keys;  // row records: asked for, and a boolean mask with a value per key
  bool col_keys;  // column records: asked for, and a boolean mask with a value per row and key
  SummaryShape(const FwdParams& p, MaskIntervals what)
      : batch(own(p.batch, p.bias_batch_stride)),
        heads(own(p.heads_q, p.bias_head_stride)),
        rows(own(p.seqlen_q, p.bias_row_stride)),
        row_blocks(blocks_of(rows)),
        key_blocks(blocks_of(own(p.seqlen_k, p.bias_col_stride))),
        own_keys(own(p.seqlen_k, p.bias_col_stride)),
        row_keys(what == MaskIntervals::kRows && p.bias_is_mask && p.bias_col_stride != 0),
        col_keys(what == MaskIntervals::kCols && p.bias_is_mask && p.bias_col_stride != 0 &&
                 p.bias_row_stride != 0) {}
  static int64_t own(int64_t size, int64_t stride) { return stride == 0 ? 1 : size; }
  static int64_t blocks_of(int64_t n) { return (n + kBiasBlock - 1) / kBiasBlock; }
  int64_t blocks() const { return batch * heads * row_blocks * key_blocks; }
  // The class bytes, rounded up to whole 64-bit words (the spans follow them, then the row
  // records, read as int2).
  int64_t class_bytes() const { return (blocks() + 7) / 8 * 8; }
  // Per (batch, head): the row blocks' key spans, the key blocks' row spans, the row blocks'
  // visible runs, two words each.
  int64_t pair_words() const { return 2 * (2 * row_blocks + key_blocks); }
  int64_t span_words() const { return batch * heads * pair_words(); }
  int64_t row_words() const { return row_keys ? batch * heads * rows * kRecord : 0; }
  int64_t col_words() const { return col_keys ? batch * heads * own_keys * kRecord : 0; }
};

// The visible bytes (nonzero) of a boolean mask's 16 bytes as bits 0-15 (byte i: bit i).
__device__ __forceinline__ uint32_t visible_bits16(const uint4& x) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // A byte's top bit after this is set iff the byte is nonzero; the four top bits are then
    // gathered into bits 28-31 by one multiply (no carries reach them).
    const uint32_t t = (((w[i] & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w[i]) & 0x80808080u;
    bits |= ((t >> 7) * 0x10204080u >> 28) << (4 * i);
  }
  return bits;
}

// Bits 0, 4, ..., 28 of x as bits 0-7 (a vote's bits of one 16-key group over eight rows).
__device__ __forceinline__ uint32_t gather_rows8(uint32_t x) {
  x &= 0x11111111u;
  x = (x | (x >> 3)) & 0x03030303u;
  x = (x | (x >> 6)) & 0x000f000fu;
  return (x | (x >> 12)) & 0xffu;
}

// A column's visible rows of one block (bit r: row row0 + r) into its record.
__device__ __forceinline__ void record_column(uint32_t* record, int64_t row0, uint64_t rows) {
  if (rows == 0) return;
  atomicMin(record, static_cast<uint32_t>(row0 + __ffsll(static_cast<long long>(rows)) - 1));
  atomicMin(record + 1, ~static_cast<uint32_t>(row0 + 63 - __clzll(static_cast<long long>(rows))));
  atomicSub(record + 2, static_cast<uint32_t>(__popcll(rows)));
}

// A record's (first, ~last, ~count) as the interval (begin, end) of mask_row_keys /
// mask_col_rows: (first, last + 1) where the count fills it, (0, 0) where nothing is visible,
// else (1, 0).
__device__ __forceinline__ void finish_record(uint32_t* record) {
  const int64_t first = record[0], last = ~record[1], count = ~record[2];
  int32_t begin = 1, end = 0;
  if (count == 0) {
    begin = 0;
  } else if (count == last - first + 1) {
    begin = static_cast<int32_t>(first);
    end = static_cast<int32_t>(last + 1);
  }
  record[0] = static_cast<uint32_t>(begin);
  record[1] = static_cast<uint32_t>(end);
}

template <typename Value>
__device__ __forceinline__ void classify(Value x, bool& zero, bool& masked) {
  if constexpr (std::is_same_v<Value, uint8_t>) {
    zero &= x != 0;
    masked &= x == 0;
  } else {
    zero &= x == 0.f;
    masked &= x == -INFINITY;
  }
}

// Sixteen bytes of values at once: a boolean mask's 16 values (zero bytes found by the usual
// word trick), or four floats.
template <typename Value>
__device__ __forceinline__ void classify16(const uint4& x, bool& zero, bool& masked) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<Value, uint8_t>) {
      zero &= ((w[i] - 0x01010101u) & ~w[i] & 0x80808080u) == 0;  // no byte is 0
      masked &= w[i] == 0;
    } else {
      classify(__uint_as_float(w[i]), zero, masked);
    }
  }
}

// One warp's block of summarize_bias_kernel (key block key_block, row block blockIdx.y,
// (batch, head) blockIdx.z); with row intervals (kRows) also, for each of its rows, the first
// and last visible key (relative to the block) and their count into first[r], last[r],
// count[r] (64, -1 and 0 where the row sees none of the block's keys); with column intervals
// (kCols) each of its keys' visible rows into the key's record of col_records (the records of
// the bias's own keys, per (batch, head) of its own extent).
template <typename Value, MaskIntervals kWhat>
__device__ __forceinline__ void summarize_block(const FwdParams& p, uint8_t* blocks,
                                                uint32_t* ranges, int64_t row_blocks,
                                                int64_t key_blocks, int64_t key_block, int lane,
                                                int32_t* first, int32_t* last, int32_t* count,
                                                uint32_t* col_records) {
  constexpr bool kRowKeys = kWhat == MaskIntervals::kRows, kColKeys = kWhat == MaskIntervals::kCols;
  const int64_t heads = p.bias_head_stride == 0 ? 1 : p.heads_q;
  const int64_t bh = blockIdx.z, b = bh / heads, h = bh % heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBiasBlock;
  const int64_t key0 = key_block * kBiasBlock;
  // Rows and keys of the block that exist (one where the bias broadcasts along them: all its
  // rows or keys are that one).
  const int64_t rows_left = p.seqlen_q - row0, keys_left = p.seqlen_k - key0;
  const int64_t rows = p.bias_row_stride == 0       ? 1
                       : rows_left < kBiasBlock ? rows_left
                                                : kBiasBlock;
  const int64_t keys = p.bias_col_stride == 0       ? 1
                       : keys_left < kBiasBlock ? keys_left
                                                : kBiasBlock;
  const Value* row_ptr = static_cast<const Value*>(p.attn_bias) + b * p.bias_batch_stride +
                         h * p.bias_head_stride + row0 * p.bias_row_stride +
                         key0 * p.bias_col_stride;
  bool zero = true, masked = true;
  // Whole rows of 64 unit-stride keys, 16-byte aligned: 16 bytes per lane and load (a
  // boolean mask's row is four lanes' loads, a warp reads eight rows at once); else two values
  // per lane and row (keys lane and lane + 32).
  constexpr int kPerVec = 16 / sizeof(Value), kLanesPerRow = kBiasBlock / kPerVec;
  const bool vectors = keys == kBiasBlock && p.bias_col_stride == 1 &&
                       reinterpret_cast<uintptr_t>(row_ptr) % 16 == 0 &&
                       (rows == 1 || (p.bias_row_stride * sizeof(Value)) % 16 == 0);
  if (vectors) {
    const Value* ptr = row_ptr + (lane / kLanesPerRow) * p.bias_row_stride +
                       (lane % kLanesPerRow) * kPerVec;
    const int64_t step = (32 / kLanesPerRow) * p.bias_row_stride;
    if constexpr (kRowKeys) {
      // Eight passes of eight rows (four lanes a row), every lane in every pass for the
      // shuffles; a row's lanes combine their 16 keys' first, last and count.
      constexpr int kRowsPerPass = 32 / kLanesPerRow;
      const int lane_key0 = (lane % kLanesPerRow) * kPerVec;
#pragma unroll
      for (int pass = 0; pass < kBiasBlock / kRowsPerPass; ++pass, ptr += step) {
        const int r = lane / kLanesPerRow + pass * kRowsPerPass;
        int32_t f = kBiasBlock, l = -1, n = 0;
        if (r < rows) {
          const uint32_t bits = visible_bits16(*reinterpret_cast<const uint4*>(ptr));
          zero &= bits == 0xffffu;
          masked &= bits == 0;
          if (bits != 0) {
            f = lane_key0 + __ffs(bits) - 1;
            l = lane_key0 + 31 - __clz(bits);
            n = __popc(bits);
          }
        }
#pragma unroll
        for (int o = 1; o < kLanesPerRow; o <<= 1) {
          f = min(f, __shfl_xor_sync(0xffffffffu, f, o));
          l = max(l, __shfl_xor_sync(0xffffffffu, l, o));
          n += __shfl_xor_sync(0xffffffffu, n, o);
        }
        if (lane % kLanesPerRow == 0 && r < rows) {
          first[r] = f;
          last[r] = l;
          count[r] = n;
        }
      }
    } else if constexpr (kColKeys) {
      // Eight passes of eight rows as above.  Per pass one vote per key of a lane's 16: vote k
      // holds key k of each 16-key group g (lane % 4) in each row j (lane / 4) at bit 4 j + g.
      // Lane l keeps vote l % 16, where its columns l and l + 32 (groups l / 16, l / 16 + 2)
      // find their eight rows.
      static_assert(kLanesPerRow == 4 && kPerVec == 16, "a boolean mask's 16-byte loads");
      constexpr int kRowsPerPass = 32 / kLanesPerRow;
      uint64_t col_rows[2] = {0, 0};  // bit r: row row0 + r sees column lane + 32 c
#pragma unroll
      for (int pass = 0; pass < kBiasBlock / kRowsPerPass; ++pass, ptr += step) {
        const int r = lane / kLanesPerRow + pass * kRowsPerPass;
        uint32_t bits = 0;
        if (r < rows) {
          bits = visible_bits16(*reinterpret_cast<const uint4*>(ptr));
          zero &= bits == 0xffffu;
          masked &= bits == 0;
        }
        uint32_t mine = 0;
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) {
          const uint32_t vote = __ballot_sync(0xffffffffu, (bits >> k) & 1u);
          mine = k == (lane & 15) ? vote : mine;
        }
#pragma unroll
        for (int c = 0; c < 2; ++c)
          col_rows[c] |= static_cast<uint64_t>(gather_rows8(mine >> (lane / 16 + 2 * c)))
                         << (kRowsPerPass * pass);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c)
        record_column(col_records + kRecord * (key0 + lane + 32 * c), row0, col_rows[c]);
    } else {
#pragma unroll 8
      for (int64_t r = lane / kLanesPerRow; r < rows; r += 32 / kLanesPerRow, ptr += step)
        classify16<Value>(*reinterpret_cast<const uint4*>(ptr), zero, masked);
    }
  } else {
    const bool has0 = lane < keys, has1 = lane + 32 < keys;  // this lane's keys
    const int64_t off0 = lane * p.bias_col_stride, off1 = (lane + 32) * p.bias_col_stride;
    uint64_t col_rows[2] = {0, 0};  // (kCols) bit r: row row0 + r sees key lane + 32 c
#pragma unroll 8
    for (int64_t r = 0; r < rows; ++r, row_ptr += p.bias_row_stride) {
      if constexpr (kColKeys) {
        const bool v0 = has0 && row_ptr[off0] != 0, v1 = has1 && row_ptr[off1] != 0;
        zero &= (!has0 || v0) && (!has1 || v1);
        masked &= !v0 && !v1;
        col_rows[0] |= static_cast<uint64_t>(v0) << r;
        col_rows[1] |= static_cast<uint64_t>(v1) << r;
      } else if constexpr (kRowKeys) {  // (rows is the warp's: every lane runs every row)
        const bool v0 = has0 && row_ptr[off0] != 0, v1 = has1 && row_ptr[off1] != 0;
        zero &= (!has0 || v0) && (!has1 || v1);
        masked &= !v0 && !v1;
        const int32_t f = __reduce_min_sync(0xffffffffu, v0 ? lane : v1 ? lane + 32 : 64);
        const int32_t l = __reduce_max_sync(0xffffffffu, v1 ? lane + 32 : v0 ? lane : -1);
        const int32_t n = __reduce_add_sync(0xffffffffu, int{v0} + int{v1});
        if (lane == 0) {
          first[r] = f;
          last[r] = l;
          count[r] = n;
        }
      } else {
        if (has0) classify(row_ptr[off0], zero, masked);
        if (has1) classify(row_ptr[off1], zero, masked);
      }
    }
    if constexpr (kColKeys) {
      if (has0) record_column(col_records + kRecord * (key0 + lane), row0, col_rows[0]);
      if (has1) record_column(col_records + kRecord * (key0 + lane + 32), row0, col_rows[1]);
    }
  }
  zero = __all_sync(0xffffffffu, zero);
  masked = __all_sync(0xffffffffu, masked);
  if (lane == 0) {
    blocks[(bh * row_blocks + blockIdx.y) * key_blocks + key_block] =
        masked ? kBlockMasked : zero ? kBlockVisible : kBlockMixed;
    if (!masked) {  // the spans (bias_key_span, bias_row_span): begin and ~end by atomicMin
      const uint32_t kb = static_cast<uint32_t>(key_block);
      uint32_t* row_pair = ranges + bh * 2 * (2 * row_blocks + key_blocks) + 2 * blockIdx.y;
      uint32_t* key_pair = ranges + bh * 2 * (2 * row_blocks + key_blocks) + 2 * row_blocks +
                           2 * kb;
      atomicMin(row_pair, kb);
      atomicMin(row_pair + 1, ~(kb + 1));
      atomicMin(key_pair, blockIdx.y);
      atomicMin(key_pair + 1, ~(blockIdx.y + 1));
    }
  }
}

template <typename Value, MaskIntervals kWhat>
__global__ void __launch_bounds__(32 * kWarpsPerCta) summarize_bias_kernel(
    const FwdParams p, uint8_t* blocks, uint32_t* ranges, uint32_t* records,
    int64_t row_blocks, int64_t key_blocks) {
  static_assert(kWhat == MaskIntervals::kNone || std::is_same_v<Value, uint8_t>, "");
  // This warp's block: key block blockIdx.x * kWarpsPerCta + warp, row block blockIdx.y,
  // (batch, head) blockIdx.z of the bias's own extent.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t key_block = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if constexpr (kWhat != MaskIntervals::kRows) {
    // (column records: this (batch, head)'s, p.seqlen_k keys of its own)
    if (key_block < key_blocks)
      summarize_block<Value, kWhat>(p, blocks, ranges, row_blocks, key_blocks, key_block, lane,
                                    nullptr, nullptr, nullptr,
                                    records == nullptr
                                        ? nullptr
                                        : records + kRecord * static_cast<int64_t>(blockIdx.z) * p.seqlen_k);
  } else {
    uint32_t* row_records = records;
    // Per warp (key block) and row of the row block: first and last visible key, count.
    __shared__ int32_t first[kWarpsPerCta][kBiasBlock], last[kWarpsPerCta][kBiasBlock],
        count[kWarpsPerCta][kBiasBlock];
    if (key_block < key_blocks)
      summarize_block<Value, kWhat>(p, blocks, ranges, row_blocks, key_blocks, key_block, lane,
                                    first[warp], last[warp], count[warp], nullptr);
    __syncthreads();
    // A thread per row: the CTA's blocks combined, then one atomic per word of its record.
    const int r = threadIdx.x;
    const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kBiasBlock;
    const int64_t rows = p.bias_row_stride == 0 ? 1 : p.seqlen_q - row0;
    if (r >= kBiasBlock || r >= rows) return;
    int64_t lo = INT64_MAX, hi = -1, n = 0;
    for (int w = 0; w < kWarpsPerCta; ++w) {
      const int64_t kb = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + w;
      if (kb >= key_blocks) break;
      if (count[w][r] == 0) continue;
      lo = min(lo, kb * kBiasBlock + first[w][r]);
      hi = max(hi, kb * kBiasBlock + last[w][r]);
      n += count[w][r];
    }
    if (n == 0) return;
    const int64_t own_rows = p.bias_row_stride == 0 ? 1 : p.seqlen_q;
    uint32_t* record = row_records + kRecord * (blockIdx.z * own_rows + row0 + r);
    atomicMin(record, static_cast<uint32_t>(lo));
    atomicMin(record + 1, ~static_cast<uint32_t>(hi));
    atomicSub(record + 2, static_cast<uint32_t>(n));
  }
}

// Each row block's longest run of visible key blocks (bias_visible_tiles), from the classes:
// a warp per (row block, batch * head) of the bias's own extent, 32 key blocks per vote,
// the runs followed across votes by the lowest set bits.  Written as (begin, end); (0, 0)
// where no block is visible.  With row records (not nullptr; `rows`: the bias's own rows),
// also the row block's rows' intervals (mask_row_keys) from summarize_bias_kernel's first,
// ~last and ~count (finish_record).
__global__ void __launch_bounds__(32) visible_runs_kernel(const uint8_t* blocks, uint32_t* ranges,
                                                          uint32_t* row_records, int64_t rows,
                                                          int64_t row_blocks,
                                                          int64_t key_blocks) {
  const int lane = threadIdx.x;
  const int64_t bh = blockIdx.y, rb = blockIdx.x;
  if (row_records != nullptr) {
    for (int64_t r = rb * kBiasBlock + lane; r < rows && r < (rb + 1) * kBiasBlock; r += 32)
      finish_record(row_records + kRecord * (bh * rows + r));
  }
  const uint8_t* row = blocks + (bh * row_blocks + rb) * key_blocks;
  int64_t run_begin = -1, best_begin = 0, best_end = 0;  // run_begin: an open run's start
  auto close = [&](int64_t end) {
    if (end - run_begin > best_end - best_begin) {
      best_begin = run_begin;
      best_end = end;
    }
    run_begin = -1;
  };
  for (int64_t base = 0; base < key_blocks; base += 32) {
    const int64_t kb = base + lane;
    uint32_t bits = __ballot_sync(0xffffffffu, kb < key_blocks && row[kb] == kBlockVisible);
    const int64_t valid = key_blocks - base < 32 ? key_blocks - base : 32;
    int pos = 0;  // the next bit of this vote to look at
    while (pos < valid) {
      const uint32_t rest = pos == 0 ? bits : bits >> pos;
      if (run_begin < 0) {  // find the next visible block
        if (rest == 0) break;
        pos += __ffs(rest) - 1;
        run_begin = base + pos;
      } else {  // find the run's end: the next block that is not visible
        const uint32_t gaps = pos == 0 ? ~bits : ~bits >> pos;
        if (gaps == 0) break;
        const int end = pos + __ffs(gaps) - 1;
        if (end >= valid) break;
        close(base + end);
        pos = end;
      }
    }
  }
  if (run_begin >= 0) close(key_blocks);
  if (lane == 0) {
    uint32_t* pair = ranges + bh * 2 * (2 * row_blocks + key_blocks) + 2 * (row_blocks +
                                                                            key_blocks) +
                     2 * rb;
    pair[0] = static_cast<uint32_t>(best_begin);
    pair[1] = static_cast<uint32_t>(best_end);
  }
}

// The column records' intervals (finish_record), a thread per record.
__global__ void __launch_bounds__(256) finish_records_kernel(uint32_t* records, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i < count) finish_record(records + kRecord * i);
}

}  // namespace

int64_t bias_summary_bytes(const FwdParams& p, MaskIntervals what) {
  const SummaryShape s(p, what);
  return s.class_bytes() + 4 * (s.span_words() + s.row_words() + s.col_words());
}

cudaError_t summarize_bias(FwdParams& p, uint8_t* summary, cudaStream_t stream,
                           MaskIntervals what) {
  const SummaryShape s(p, what);
  if (s.blocks() == 0) return cudaSuccess;
  // Past the grid's limits: no summary (p.bias_blocks stays nullptr: every block is read).
  if (s.key_blocks > 0x7fffffffLL || s.row_blocks > 65535 || s.batch * s.heads > 65535)
    return cudaSuccess;
  uint8_t* blocks = summary;
  uint32_t* ranges = reinterpret_cast<uint32_t*>(summary + s.class_bytes());
  uint32_t* row_records = s.row_keys ? ranges + s.span_words() : nullptr;
  uint32_t* col_records = s.col_keys ? ranges + s.span_words() : nullptr;
  // (all bits set: begin past every block, end 0, until a block that is not all masked; the
  // records' words start at ~0 too)
  cudaError_t err = cudaMemsetAsync(
      ranges, 0xff, 4 * (s.span_words() + s.row_words() + s.col_words()), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((s.key_blocks + kWarpsPerCta - 1) / kWarpsPerCta),
                  static_cast<unsigned>(s.row_blocks), static_cast<unsigned>(s.batch * s.heads));
  if (s.row_keys)
    summarize_bias_kernel<uint8_t, MaskIntervals::kRows><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, row_records, s.row_blocks, s.key_blocks);
  else if (s.col_keys)
    summarize_bias_kernel<uint8_t, MaskIntervals::kCols><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, col_records, s.row_blocks, s.key_blocks);
  else if (p.bias_is_mask)
    summarize_bias_kernel<uint8_t, MaskIntervals::kNone><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, nullptr, s.row_blocks, s.key_blocks);
  else
    summarize_bias_kernel<float, MaskIntervals::kNone><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, nullptr, s.row_blocks, s.key_blocks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  visible_runs_kernel<<<dim3(static_cast<unsigned>(s.row_blocks),
                             static_cast<unsigned>(s.batch * s.heads)),
                        32, 0, stream>>>(blocks, ranges, row_records, s.rows, s.row_blocks,
                                         s.key_blocks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (s.col_keys) {
    const int64_t records = s.batch * s.heads * s.own_keys;
    finish_records_kernel<<<static_cast<unsigned>((records + 255) / 256), 256, 0, stream>>>(
        col_records, records);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t kb = s.key_blocks, rb = s.row_blocks;
  p.bias_blocks = blocks;
  p.bias_ranges = ranges;
  p.ranges_key_offset = 2 * rb;
  p.ranges_visible_offset = 2 * (rb + kb);
  p.ranges_head_stride = p.bias_head_stride == 0 ? 0 : s.pair_words();
  p.ranges_batch_stride = p.bias_batch_stride == 0 ? 0 : s.heads * s.pair_words();
  p.blocks_col_stride = p.bias_col_stride == 0 ? 0 : 1;
  p.blocks_row_stride = p.bias_row_stride == 0 ? 0 : kb;
  p.blocks_head_stride = p.bias_head_stride == 0 ? 0 : rb * kb;
  p.blocks_batch_stride = p.bias_batch_stride == 0 ? 0 : s.heads * rb * kb;
  if (s.row_keys) {
    p.bias_row_keys = reinterpret_cast<const int32_t*>(row_records);
    p.row_keys_row_stride = p.bias_row_stride == 0 ? 0 : 1;
    p.row_keys_head_stride = p.bias_head_stride == 0 ? 0 : s.rows;
    p.row_keys_batch_stride = p.bias_batch_stride == 0 ? 0 : s.heads * s.rows;
  }
  if (s.col_keys) {
    p.bias_col_rows = reinterpret_cast<const int32_t*>(col_records);
    p.col_rows_head_stride = p.bias_head_stride == 0 ? 0 : s.own_keys;
    p.col_rows_batch_stride = p.bias_batch_stride == 0 ? 0 : s.heads * s.own_keys;
  }
  return cudaSuccess;
}

}  // namespace flash_attn_ext::sm90
