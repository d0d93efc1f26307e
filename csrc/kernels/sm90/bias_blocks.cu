// The bias summary of bias_blocks.h: a warp per 64 x 64 block, eight blocks along the keys per
// CTA, each lane reading 16 bytes of a row at a time where the block's 64 keys are whole,
// unit-stride and 16-byte aligned in every row (else two keys of every row), the class by two
// warp votes.  An additive fp32 bias: 0 visible, -inf masked; a boolean mask
// (FwdParams::bias_is_mask): nonzero visible, zero masked.
//
// With row intervals (MaskIntervals::kRows, the forward's mask variant, a boolean mask with a
// value per key): also each row's first and last visible key and its count of visible keys.
// Then a CTA takes one row block of one (batch, head) and its eight warps walk all its key
// blocks (warp w every eighth from w), each keeping its rows' running first, last and count in
// shared memory; the CTA combines its warps' and writes each row's interval once
// (store_interval: mask_row_keys), or marks a row whose visible keys are not one interval
// (count != last - first + 1).  With column intervals (kCols, the backward's mask variant,
// whose CTA keeps its keys for all its steps; a mask with a value per row and key): the same
// per key over the rows, a CTA per key block walking its row blocks, each lane reading two
// whole rows of a block (load_mask_rows), the warp transposing the block's 64 x 64 bits by
// shuffles (transpose32) so that each lane holds two keys' rows, kept as two running records
// per lane in registers.  Where few walks would run (a (B, 1, 1, S) padding mask has one row
// block per batch entry), each is split over several CTAs whose parts atomics add and a last
// pass finishes.  A walking warp issues its next block's loads before it summarizes the
// current one (walk_blocks).
//
// Why this shape: a (B, 1, L, S) mask is B * L * S values (64 MB at B = 4, L = S = 4k), read
// before the forward and again before the backward, so the pass must run at memory speed.
// One CTA per block, its index split by two 64-bit divisions per value, cost the causal +
// padding forward ~0.3 ms (a third of it); a warp per block reading a byte per lane took
// 101 us on the H200 (0.63 TB/s); docs/perf/sm90_score_mods.md has the measurements.
#include "kernels/sm90/bias_blocks.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace flash_attn_ext::sm90 {

namespace {

constexpr int kWarpsPerCta = 8;  // blocks a CTA takes at once
// CTAs the row and column walks fill at most by splitting walks: two per SM of an H100 / H200
// (132 SMs), as many as are resident at once (the walks' 106-128 registers a thread let two
// 256-thread CTAs share an SM), so that split walks run in one wave.  Their 16 warps keep
// 64-128 KB of loads in flight per SM (one or two blocks of 4 KB each).
constexpr int64_t kWalkCtas = 264;

// Words of a row's record (FwdParams::bias_row_keys) or a column's (bias_col_rows): the interval
// (begin, end) in the first two (store_interval); while split walks add their parts, the first
// three hold first, ~last and ~count (add_to_record); the fourth is unused (the kernels' and
// the hook's layout).
constexpr int kRecord = 4;

// The summary's extent: the bias's own (1 where it broadcasts, stride 0) batch and heads, and
// its 64-blocks of rows and keys.
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

// The visible bytes (nonzero) of a boolean mask's 16 bytes as 16 bits in another order: byte
// 4 i + b at bit 8 b + i (visible_bits16's test without its gather; the columns' transpose
// takes any fixed order and undoes it with one shuffle).
__device__ __forceinline__ uint32_t visible_nibbles16(const uint4& x) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    bits |= ((((w[i] & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w[i]) & 0x80808080u) >> (7 - i);
  return bits;
}

// A 32 x 32 bit matrix held a row per lane (bit c of lane i: row i, column c) transposed, so
// that lane c holds column c (bit i: row i): five rounds of the recursive block swap, round j
// exchanging the off-diagonal j x j blocks of every 2j x 2j block between lanes i and i ^ j
// (one shuffle each).
__device__ __forceinline__ uint32_t transpose32(uint32_t x, int lane) {
#pragma unroll
  for (int j = 16; j >= 1; j >>= 1) {
    // Columns c with c & j == 0 (0x0000ffff for j = 16, ..., 0x55555555 for j = 1).
    const uint32_t low = j == 16  ? 0x0000ffffu
                         : j == 8 ? 0x00ff00ffu
                         : j == 4 ? 0x0f0f0f0fu
                         : j == 2 ? 0x33333333u
                                  : 0x55555555u;
    const bool upper = (lane & j) == 0;  // keeps its low columns, takes the partner's low ones
    const uint32_t send = upper ? (x >> j) & low : (x & low) << j;
    x = (x & (upper ? low : ~low)) | __shfl_xor_sync(0xffffffffu, send, j);
  }
  return x;
}

// A row's or key's running first and last visible key (row) and count, over the blocks its
// warp has walked: first kNone and last -1 while it saw none.
struct Span {
  int32_t first, last, count;
  static constexpr int32_t kNone = 0x7fffffff;
  __device__ __forceinline__ static Span none() { return Span{kNone, -1, 0}; }
  __device__ __forceinline__ void add(int32_t f, int32_t l, int32_t n) {
    if (n == 0) return;
    first = min(first, f);
    last = max(last, l);
    count += n;
  }
  // A block's visible rows of one column (bit r: row row0 + r).
  __device__ __forceinline__ void add_bits(int64_t row0, uint64_t rows) {
    if (rows == 0) return;
    add(static_cast<int32_t>(row0 + __ffsll(static_cast<long long>(rows)) - 1),
        static_cast<int32_t>(row0 + 63 - __clzll(static_cast<long long>(rows))),
        __popcll(rows));
  }
};

// A row's or key's record as the interval (begin, end) of mask_row_keys / mask_col_rows:
// (first, last + 1) where the count fills it, (0, 0) where nothing is visible, else (1, 0).
__device__ __forceinline__ void store_interval(uint32_t* record, const Span& s) {
  int32_t begin = 1, end = 0;
  if (s.count == 0) {
    begin = 0;
  } else if (s.count == s.last - s.first + 1) {
    begin = s.first;
    end = s.last + 1;
  }
  *reinterpret_cast<int2*>(record) = make_int2(begin, end);
}

// A CTA's span of a row or key into its record where the walk over its blocks is split
// between CTAs (Summary::splits > 1): the first visible key (row) by atomicMin, ~the last
// (atomicMin), ~the count (atomicSub), all starting at ~0 (the memset); finish_record then
// makes the interval.  (With one CTA per row or key, store_interval writes it at once.)
__device__ __forceinline__ void add_to_record(uint32_t* record, const Span& s) {
  if (s.count == 0) return;
  atomicMin(record, static_cast<uint32_t>(s.first));
  atomicMin(record + 1, ~static_cast<uint32_t>(s.last));
  atomicSub(record + 2, static_cast<uint32_t>(s.count));
}
__device__ __forceinline__ void finish_record(uint32_t* record) {
  Span s;
  s.count = static_cast<int32_t>(~record[2]);
  s.first = static_cast<int32_t>(record[0]);
  s.last = static_cast<int32_t>(~record[1]);
  store_interval(record, s);
}
// Row (key) i's spans of a walk's warps combined into its record: stored where one CTA walks
// all its blocks (gridDim.y == 1), else added for finish_records_kernel.
__device__ __forceinline__ void store_warps_span(const Span (&spans)[kWarpsPerCta][kBiasBlock],
                                                 int i, uint32_t* record) {
  Span all = Span::none();
  for (int w = 0; w < kWarpsPerCta; ++w)
    all.add(spans[w][i].first, spans[w][i].last, spans[w][i].count);
  if (gridDim.y > 1)
    add_to_record(record, all);
  else
    store_interval(record, all);
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

// One block of the bias's own extent: key block key_block, row block row_block, (batch, head) bh:
// where it starts, the rows and keys of it that exist (one where the bias broadcasts along
// them: all its rows or keys are that one), and whether it is read in the vector form (whole
// rows of 64 unit-stride keys, 16-byte aligned: 16 bytes per lane and load) or two values per
// lane and row (keys lane and lane + 32).
// Where (batch, head) bh of the bias's own extent starts: its index split once (two 64-bit
// divisions), by a walk once for all its blocks rather than per block.
template <typename Value>
__device__ __forceinline__ const Value* bias_origin(const FwdParams& p, int64_t bh) {
  const int64_t heads = p.bias_head_stride == 0 ? 1 : p.heads_q;
  const int64_t b = bh / heads, h = bh % heads;
  return static_cast<const Value*>(p.attn_bias) + b * p.bias_batch_stride +
         h * p.bias_head_stride;
}

template <typename Value>
struct BiasBlockAt {
  const Value* first;
  int64_t row0, key0, rows, keys;
  bool vectors;
  // origin: bias_origin of the block's (batch, head).
  __device__ __forceinline__ BiasBlockAt(const FwdParams& p, const Value* origin,
                                         int64_t row_block, int64_t key_block) {
    row0 = row_block * kBiasBlock;
    key0 = key_block * kBiasBlock;
    const int64_t rows_left = p.seqlen_q - row0, keys_left = p.seqlen_k - key0;
    rows = p.bias_row_stride == 0 ? 1 : rows_left < kBiasBlock ? rows_left : kBiasBlock;
    keys = p.bias_col_stride == 0 ? 1 : keys_left < kBiasBlock ? keys_left : kBiasBlock;
    first = origin + row0 * p.bias_row_stride + key0 * p.bias_col_stride;
    vectors = keys == kBiasBlock && p.bias_col_stride == 1 &&
              reinterpret_cast<uintptr_t>(first) % 16 == 0 &&
              (rows == 1 || (p.bias_row_stride * sizeof(Value)) % 16 == 0);
  }
};

// A boolean mask block's vector form: eight passes of eight rows, four lanes a row, a lane's 16
// keys (lane % 4) * 16 of row lane / 4 + 8 * pass in loads[pass].
constexpr int kMaskLanesPerRow = kBiasBlock / 16, kMaskRowsPerPass = 32 / kMaskLanesPerRow,
              kMaskPasses = kBiasBlock / kMaskRowsPerPass;
using MaskLoads = uint4[kMaskPasses];

// The block's loads of the vector form, all issued at once (rows past the block's: zeros, not
// loaded); nothing in the other form.  A walk issues its next block's loads before it
// summarizes this one, so that the processing of one block overlaps the loads of the next:
// without it, the warps that all start together read in lockstep phases, each paying the
// load latency and then the processing with nothing in flight.
__device__ __forceinline__ void load_mask_block(const FwdParams& p, const BiasBlockAt<uint8_t>& at,
                                                int lane, MaskLoads& loads) {
  if (!at.vectors) return;
  const uint8_t* ptr = at.first + (lane / kMaskLanesPerRow) * p.bias_row_stride +
                       (lane % kMaskLanesPerRow) * 16;
  const int64_t step = kMaskRowsPerPass * p.bias_row_stride;
#pragma unroll
  for (int pass = 0; pass < kMaskPasses; ++pass, ptr += step)
    loads[pass] = lane / kMaskLanesPerRow + pass * kMaskRowsPerPass < at.rows
                      ? *reinterpret_cast<const uint4*>(ptr)
                      : make_uint4(0, 0, 0, 0);
}

// The columns' vector form of a boolean mask block: lane l reads its rows l and l + 32 whole,
// four 16-byte loads each (loads[4 h + q]: row l + 32 h, keys 16 q ... 16 q + 15; rows past the
// block's: zeros, not loaded), so that the warp holds the block a row per lane and transposes
// it (summarize_block).  Each load instruction reads 16 bytes of 32 rows; its row's other 48
// come from L1 for the next three.
__device__ __forceinline__ void load_mask_rows(const FwdParams& p, const BiasBlockAt<uint8_t>& at,
                                               int lane, MaskLoads& loads) {
  if (!at.vectors) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lane + 32 * h;
    const uint8_t* ptr = at.first + r * p.bias_row_stride;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      loads[4 * h + q] =
          r < at.rows ? *reinterpret_cast<const uint4*>(ptr + 16 * q) : make_uint4(0, 0, 0, 0);
  }
}

// One warp's block `at` (key block key_block, row block row_block, (batch, head) bh; a boolean
// mask's vector form from `loads`, load_mask_block's).  Its class into `blocks` and its spans
// into `ranges`; with row intervals (kRows) also, for each of its rows, the first and last
// visible key and their count added to row_spans[r] (the warp's running spans of the row
// block's rows, in shared memory); with column intervals (kCols) each of this lane's keys'
// (key0 + lane + 32 c) visible rows added to col_spans[c].
template <typename Value, MaskIntervals kWhat>
__device__ __forceinline__ void summarize_block(const FwdParams& p, uint8_t* blocks,
                                                uint32_t* ranges, int64_t row_blocks,
                                                int64_t key_blocks, int64_t row_block,
                                                int64_t key_block, int64_t bh, int lane,
                                                const BiasBlockAt<Value>& at,
                                                const MaskLoads& loads, Span* row_spans,
                                                Span (&col_spans)[2]) {
  constexpr bool kRowKeys = kWhat == MaskIntervals::kRows, kColKeys = kWhat == MaskIntervals::kCols;
  constexpr bool kIsMask = std::is_same_v<Value, uint8_t>;
  static_assert(kIsMask || kWhat == MaskIntervals::kNone, "intervals of a boolean mask only");
  const int64_t row0 = at.row0, key0 = at.key0, rows = at.rows, keys = at.keys;
  bool zero = true, masked = true;
  if (at.vectors && kIsMask) {
    const int row_in_pass = lane / kMaskLanesPerRow;
    if constexpr (kRowKeys) {
      // A row's lanes combine their 16 keys' first, last and count by shuffles, every lane in
      // every pass.
      const int lane_key0 = (lane % kMaskLanesPerRow) * 16;
#pragma unroll
      for (int pass = 0; pass < kMaskPasses; ++pass) {
        const int r = row_in_pass + pass * kMaskRowsPerPass;
        const uint32_t bits = visible_bits16(loads[pass]);
        int32_t f = kBiasBlock, l = -1, n = 0;
        if (r < rows) {
          zero &= bits == 0xffffu;
          masked &= bits == 0;
          if (bits != 0) {
            f = lane_key0 + __ffs(bits) - 1;
            l = lane_key0 + 31 - __clz(bits);
            n = __popc(bits);
          }
        }
#pragma unroll
        for (int o = 1; o < kMaskLanesPerRow; o <<= 1) {
          f = min(f, __shfl_xor_sync(0xffffffffu, f, o));
          l = max(l, __shfl_xor_sync(0xffffffffu, l, o));
          n += __shfl_xor_sync(0xffffffffu, n, o);
        }
        if (lane % kMaskLanesPerRow == 0 && r < rows)
          row_spans[r].add(static_cast<int32_t>(key0) + f, static_cast<int32_t>(key0) + l, n);
      }
    } else if constexpr (kColKeys) {
      // loads: rows lane and lane + 32 whole (load_mask_rows).  Word 2 h + g: row lane + 32 h,
      // keys 32 g ... 32 g + 31, key 32 g + 16 u + 4 i + b at bit 8 b + 4 u + i; transposed,
      // lane l holds that key's 32 rows for the key whose bit is l, which lane key_lane(l)
      // needs: one shuffle puts each lane's keys lane and lane + 32 in place.
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        words[w] = visible_nibbles16(loads[2 * w]) | visible_nibbles16(loads[2 * w + 1]) << 4;
        if (lane + 32 * (w / 2) < rows) {
          zero &= words[w] == 0xffffffffu;
          masked &= words[w] == 0;
        }
      }
      // The lane whose bit, after the transpose, is this lane's key: key 16 u + 4 i + b sits
      // at bit 8 b + 4 u + i.
      const int src = 8 * (lane & 3) + 4 * ((lane >> 4) & 1) + ((lane >> 2) & 3);
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const uint32_t lo = __shfl_sync(0xffffffffu, transpose32(words[g], lane), src);
        const uint32_t hi = __shfl_sync(0xffffffffu, transpose32(words[2 + g], lane), src);
        col_spans[g].add_bits(row0, static_cast<uint64_t>(hi) << 32 | lo);
      }
    } else {
#pragma unroll
      for (int pass = 0; pass < kMaskPasses; ++pass)
        if (row_in_pass + pass * kMaskRowsPerPass < rows)
          classify16<uint8_t>(loads[pass], zero, masked);
    }
  } else if (!kIsMask && at.vectors) {  // an fp32 bias: four floats a lane and load, two rows
    constexpr int kPerVec = 4, kLanesPerRow = kBiasBlock / kPerVec;
    const Value* ptr = at.first + (lane / kLanesPerRow) * p.bias_row_stride +
                       (lane % kLanesPerRow) * kPerVec;
    const int64_t step = (32 / kLanesPerRow) * p.bias_row_stride;
#pragma unroll 8
    for (int64_t r = lane / kLanesPerRow; r < rows; r += 32 / kLanesPerRow, ptr += step)
      classify16<Value>(*reinterpret_cast<const uint4*>(ptr), zero, masked);
  } else {
    const Value* row_ptr = at.first;
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
        if (lane == 0)
          row_spans[r].add(static_cast<int32_t>(key0) + f, static_cast<int32_t>(key0) + l, n);
      } else {
        if (has0) classify(row_ptr[off0], zero, masked);
        if (has1) classify(row_ptr[off1], zero, masked);
      }
    }
    if constexpr (kColKeys) {
      col_spans[0].add_bits(row0, col_rows[0]);  // (keys that do not exist: no bits)
      col_spans[1].add_bits(row0, col_rows[1]);
    }
  }
  zero = __all_sync(0xffffffffu, zero);
  masked = __all_sync(0xffffffffu, masked);
  if (lane == 0) {
    blocks[(bh * row_blocks + row_block) * key_blocks + key_block] =
        masked ? kBlockMasked : zero ? kBlockVisible : kBlockMixed;
    if (!masked) {  // the spans (bias_key_span, bias_row_span): begin and ~end by atomicMin
      const uint32_t kb = static_cast<uint32_t>(key_block), rb = static_cast<uint32_t>(row_block);
      uint32_t* row_pair = ranges + bh * 2 * (2 * row_blocks + key_blocks) + 2 * row_block;
      uint32_t* key_pair = ranges + bh * 2 * (2 * row_blocks + key_blocks) + 2 * row_blocks +
                           2 * kb;
      atomicMin(row_pair, kb);
      atomicMin(row_pair + 1, ~(kb + 1));
      atomicMin(key_pair, rb);
      atomicMin(key_pair + 1, ~(rb + 1));
    }
  }
}

// A warp's walk over blocks first, first + stride, ... below `count` (key blocks of a row
// block, or row blocks of a key block): block i's loads issued before block i - stride is
// summarized (load(p, at, lane, loads): load_mask_block or load_mask_rows), two sets of loads
// alternating.  visit(index, at, loads) summarizes one.
template <typename Load, typename Locate, typename Visit>
__device__ __forceinline__ void walk_blocks(const FwdParams& p, int64_t first, int64_t stride,
                                            int64_t count, int lane, Load load, Locate locate,
                                            Visit visit) {
  MaskLoads even, odd;
  if (first < count) load(p, locate(first), lane, even);
  // (a step loads into `next` and summarizes from `cur`; the two calls per round swap them so
  // that no loaded value is copied, which would wait for its load)
  auto step = [&](int64_t i, MaskLoads& cur, MaskLoads& next) {
    if (i + stride < count) load(p, locate(i + stride), lane, next);
    visit(i, locate(i), cur);
  };
  for (int64_t i = first; i < count; i += 2 * stride) {
    step(i, even, odd);
    if (i + stride < count) step(i + stride, odd, even);
  }
}

// The classes alone: a warp per block, key block blockIdx.x * kWarpsPerCta + warp, row block
// blockIdx.y, (batch, head) blockIdx.z of the bias's own extent.
template <typename Value>
__global__ void __launch_bounds__(32 * kWarpsPerCta) summarize_bias_kernel(
    const FwdParams p, uint8_t* blocks, uint32_t* ranges, int64_t row_blocks,
    int64_t key_blocks) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t key_block = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (key_block >= key_blocks) return;
  const BiasBlockAt<Value> at(p, bias_origin<Value>(p, blockIdx.z), blockIdx.y, key_block);
  MaskLoads loads;
  if constexpr (std::is_same_v<Value, uint8_t>) load_mask_block(p, at, lane, loads);
  Span unused[2] = {Span::none(), Span::none()};
  summarize_block<Value, MaskIntervals::kNone>(p, blocks, ranges, row_blocks, key_blocks,
                                               blockIdx.y, key_block, blockIdx.z, lane, at, loads,
                                               nullptr, unused);
}

// The classes and each row's interval of a boolean mask with a value per key: row
// block blockIdx.x of (batch, head) blockIdx.z, its key blocks walked by the warps of
// gridDim.y CTAs (CTA y's warp w: blocks y * kWarpsPerCta + w, then every kWarpsPerCta *
// gridDim.y-th), then a thread per row combining the warps' spans into its record of
// row_records (the bias's own rows of each of its own (batch, head)): stored at once where one
// CTA walks them all, else added for finish_records_kernel (store_warps_span).
__global__ void __launch_bounds__(32 * kWarpsPerCta) summarize_rows_kernel(
    const FwdParams p, uint8_t* blocks, uint32_t* ranges, uint32_t* row_records,
    int64_t row_blocks, int64_t key_blocks) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ Span spans[kWarpsPerCta][kBiasBlock];  // per warp, the row block's rows
  for (int r = lane; r < kBiasBlock; r += 32) spans[warp][r] = Span::none();
  __syncwarp();
  Span unused[2] = {Span::none(), Span::none()};
  const int64_t stride = static_cast<int64_t>(kWarpsPerCta) * gridDim.y;
  const uint8_t* origin = bias_origin<uint8_t>(p, blockIdx.z);
  walk_blocks(
      p, static_cast<int64_t>(blockIdx.y) * kWarpsPerCta + warp, stride, key_blocks, lane,
      load_mask_block, [&](int64_t kb) { return BiasBlockAt<uint8_t>(p, origin, blockIdx.x, kb); },
      [&](int64_t kb, const BiasBlockAt<uint8_t>& at, const MaskLoads& loads) {
        summarize_block<uint8_t, MaskIntervals::kRows>(p, blocks, ranges, row_blocks,
                                                       key_blocks, blockIdx.x, kb, blockIdx.z,
                                                       lane, at, loads, spans[warp], unused);
        __syncwarp();  // (a row's span is added by one lane per block, not always the same one)
      });
  __syncthreads();
  const int r = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBiasBlock;
  const int64_t own_rows = p.bias_row_stride == 0 ? 1 : p.seqlen_q;
  if (r >= kBiasBlock || row0 + r >= own_rows) return;
  store_warps_span(spans, r, row_records + kRecord * (blockIdx.z * own_rows + row0 + r));
}

// The classes and each key's interval of rows of a boolean mask with a value per row and key:
// key block blockIdx.x of (batch, head) blockIdx.z, its row blocks walked by the warps of
// gridDim.y CTAs as above, each lane's two keys' spans in registers, then a thread per key
// combining the warps' into its record of col_records (the bias's own keys of each of its own
// (batch, head)), stored at once or added as above.
// (Two CTAs an SM at most 128 registers: ptxas took 132 without the bound, one CTA an SM,
// 12% occupancy; with it 32 bytes spill and the pass runs 10% faster, H100.)
__global__ void __launch_bounds__(32 * kWarpsPerCta, 2) summarize_cols_kernel(
    const FwdParams p, uint8_t* blocks, uint32_t* ranges, uint32_t* col_records,
    int64_t row_blocks, int64_t key_blocks) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Span mine[2] = {Span::none(), Span::none()};  // keys key0 + lane and key0 + lane + 32
  const int64_t stride = static_cast<int64_t>(kWarpsPerCta) * gridDim.y;
  const uint8_t* origin = bias_origin<uint8_t>(p, blockIdx.z);
  walk_blocks(
      p, static_cast<int64_t>(blockIdx.y) * kWarpsPerCta + warp, stride, row_blocks, lane,
      load_mask_rows, [&](int64_t rb) { return BiasBlockAt<uint8_t>(p, origin, rb, blockIdx.x); },
      [&](int64_t rb, const BiasBlockAt<uint8_t>& at, const MaskLoads& loads) {
        summarize_block<uint8_t, MaskIntervals::kCols>(p, blocks, ranges, row_blocks,
                                                       key_blocks, rb, blockIdx.x, blockIdx.z,
                                                       lane, at, loads, nullptr, mine);
      });
  __shared__ Span spans[kWarpsPerCta][kBiasBlock];
  spans[warp][lane] = mine[0];
  spans[warp][lane + 32] = mine[1];
  __syncthreads();
  const int c = threadIdx.x;
  const int64_t key0 = static_cast<int64_t>(blockIdx.x) * kBiasBlock;
  if (c >= kBiasBlock || key0 + c >= p.seqlen_k) return;
  store_warps_span(spans, c, col_records + kRecord * (blockIdx.z * p.seqlen_k + key0 + c));
}

// The records' intervals where the walks were split (finish_record), a thread per record.
__global__ void __launch_bounds__(256) finish_records_kernel(uint32_t* records, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i < count) finish_record(records + kRecord * i);
}

// Each row block's longest run of visible key blocks (bias_visible_tiles), from the classes:
// a warp per (row block, batch * head) of the bias's own extent, 32 key blocks per vote,
// the runs followed across votes by the lowest set bits.  Written as (begin, end); (0, 0)
// where no block is visible.
__global__ void __launch_bounds__(32) visible_runs_kernel(const uint8_t* blocks, uint32_t* ranges,
                                                          int64_t row_blocks,
                                                          int64_t key_blocks) {
  const int lane = threadIdx.x;
  const int64_t bh = blockIdx.y, rb = blockIdx.x;
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
  // The walks (row or column records): a CTA per row block (key block) and (batch, head) of
  // the bias's own extent, its blocks along the other dimension split over `splits` CTAs
  // where at least two splits of each walk fit in kWalkCtas (a (B, 1, 1, S) padding mask has
  // one row block per batch entry; a short query against a long cache few), at least a block
  // per warp each; their records are then added by atomics and finished by a last pass.
  // (Rounded down: a split that made a second wave of CTAs would cost more than it spreads.)
  const unsigned bh = static_cast<unsigned>(s.batch * s.heads);
  const int64_t walks = s.row_keys ? s.row_blocks : s.key_blocks;
  const int64_t walked = s.row_keys ? s.key_blocks : s.row_blocks;
  const int64_t splits = std::max<int64_t>(
      1, std::min<int64_t>(kWalkCtas / (walks * bh), (walked + kWarpsPerCta - 1) / kWarpsPerCta));
  uint32_t* records = s.row_keys ? row_records : col_records;
  const int64_t record_words = s.row_keys ? s.row_words() : s.col_words();
  // (all bits set: begin past every block, end 0, until a block that is not all masked; split
  // walks' records at ~0 too, else each is stored once by its walk)
  const bool split = (s.row_keys || s.col_keys) && splits > 1;
  cudaError_t err = cudaMemsetAsync(
      ranges, 0xff, 4 * (s.span_words() + (split ? record_words : 0)), stream);
  if (err != cudaSuccess) return err;
  const dim3 walk_grid(static_cast<unsigned>(walks), static_cast<unsigned>(splits), bh);
  if (s.row_keys)
    summarize_rows_kernel<<<walk_grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, row_records, s.row_blocks, s.key_blocks);
  else if (s.col_keys)
    summarize_cols_kernel<<<walk_grid, 32 * kWarpsPerCta, 0, stream>>>(
        p, blocks, ranges, col_records, s.row_blocks, s.key_blocks);
  else {
    const dim3 grid(static_cast<unsigned>((s.key_blocks + kWarpsPerCta - 1) / kWarpsPerCta),
                    static_cast<unsigned>(s.row_blocks), bh);
    if (p.bias_is_mask)
      summarize_bias_kernel<uint8_t><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
          p, blocks, ranges, s.row_blocks, s.key_blocks);
    else
      summarize_bias_kernel<float><<<grid, 32 * kWarpsPerCta, 0, stream>>>(
          p, blocks, ranges, s.row_blocks, s.key_blocks);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  visible_runs_kernel<<<dim3(static_cast<unsigned>(s.row_blocks), bh), 32, 0, stream>>>(
      blocks, ranges, s.row_blocks, s.key_blocks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (split) {
    const int64_t count = record_words / kRecord;
    finish_records_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(
        records, count);
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
