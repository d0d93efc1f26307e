// The boolean mask's block summary (csrc/kernels/sm90/bias_blocks.cu) against a CPU reference,
// without building the extension: one nvcc call of ~10 s on the device instead of the
// extension's build of 5 minutes, for work on the summary kernels alone.  Fills the summary
// with 0xA5 first (nothing may be left unwritten), then checks for each configuration the
// (row block, key block) classes, the row blocks' and key blocks' spans, and the row records
// (each row's visible keys as an interval, the forward's) or the column records (each key's
// visible rows, the backward's): (begin, end), (0, 0) where none is visible, (1, 0) where they
// are not one interval.  Shapes: L in {1, 17, 64, 113, 1023, 4500} x S in {1, 2, 17, 64, 113,
// 600, 1023, 4500}; masks of 1 to 12 (batch, head) pairs of their own, broadcast over batch,
// heads or rows (stride 0), rows padded (a row stride past S) and a base that is not 16-byte
// aligned (the kernels' two-keys-a-lane path); random, interval, empty, full and holed rows, and
// causal + padding + window patterns.  Both walk forms run: split over CTAs (atomics, finish
// pass) where two or more CTAs per walk fit in 264, one CTA a walk elsewhere.
//
//   nvcc -std=c++17 -O2 -I csrc --expt-relaxed-constexpr -DFLASH_ATTN_EXT_SM90 \
//       -gencode arch=compute_90a,code=sm_90a -x cu dev/gpu/summary_check.cu -o /tmp/summary_check
//   /tmp/summary_check 0   # shapes up to L * S = 200k (684 configurations)
//   /tmp/summary_check 1   # all (864)
//   compute-sanitizer --tool racecheck /tmp/summary_check 2   # (and memcheck): a small subset
//                                                             # and one shape of long walks
//   /tmp/summary_check 3 [L]   # times the passes (below)
//
// Prints "configs N fails F" and exits 1 if F > 0.  Scope 3 times the three passes instead
// (classes and spans only, with the rows' key intervals, with the keys' row intervals) on the
// benchmarks' (B, 1, L, S) causal + padding mask, B = 4, L = S (default 4096), CUDA events over
// 50 calls after 5 warm-up ones, and prints µs per pass and the mask's bytes per µs: the
// yardstick for work on the passes' reading (docs/perf/sm90_score_mods.md, "The summary's
// walks"; the timing mode is newer than the run that checked the kernels).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/sm90/bias_blocks.cu"

using namespace flash_attn_ext;
using namespace flash_attn_ext::sm90;

namespace {

uint64_t rng_state = 88172645463325252ull;
unsigned rnd() {  // xorshift64: a fixed sequence, so that a failure repeats
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return static_cast<unsigned>(rng_state);
}

int fails = 0;

struct Config {
  int64_t batch, heads, seqlen_q, seqlen_k;
  bool batch_broadcast, heads_broadcast, rows_broadcast;
  int row_pad;      // bytes past S in each row (the row stride S + row_pad)
  int base_offset;  // bytes from a 256-aligned allocation to the mask's first element
  int pattern;      // 0: per row random / interval / empty / full / holed; 1: causal + padding +
                    // window; 2: that with a few random holes
};

// The mask on the host: (own batch, own heads, own rows, S + row_pad) bytes.
std::vector<uint8_t> make_mask(const Config& c, int64_t own_bh, int64_t own_rows) {
  const int64_t L = c.seqlen_q, S = c.seqlen_k, stride = S + c.row_pad;
  std::vector<uint8_t> m(own_bh * own_rows * stride, 0);
  for (int64_t bh = 0; bh < own_bh; ++bh) {
    const int64_t padding = rnd() % (S + 1), window = rnd() % (S + 2);
    for (int64_t i = 0; i < own_rows; ++i) {
      uint8_t* row = &m[(bh * own_rows + i) * stride];
      const int kind = rnd() % 8;
      const int64_t a = rnd() % (S + 1), e = a + rnd() % (S + 1 - a);
      for (int64_t j = 0; j < S; ++j) {
        bool v;
        if (c.pattern == 0) {
          const bool in = j >= a && j < e;
          v = kind == 0 ? false
              : kind == 1 ? true
              : kind < 5  ? in
              : kind == 5 ? (rnd() % 2) != 0
                          : in && j != (a + e) / 2;  // an interval with a hole
        } else {
          const int64_t diag = i + S - L;  // bottom-right causal
          v = j <= diag && j < padding + S / 2 && j + window >= diag;
          if (c.pattern == 2 && rnd() % 997 == 0) v = false;
        }
        row[j] = v;
      }
    }
  }
  return m;
}

void run(const Config& c) {
  const int64_t B = c.batch, H = c.heads, L = c.seqlen_q, S = c.seqlen_k;
  const int64_t own_b = c.batch_broadcast ? 1 : B, own_h = c.heads_broadcast ? 1 : H;
  const int64_t own_rows = c.rows_broadcast ? 1 : L, stride = S + c.row_pad;
  const std::vector<uint8_t> m = make_mask(c, own_b * own_h, own_rows);
  uint8_t* mask_dev;
  cudaMalloc(&mask_dev, m.size() + c.base_offset);
  cudaMemcpy(mask_dev + c.base_offset, m.data(), m.size(), cudaMemcpyHostToDevice);
  for (const MaskIntervals what : {MaskIntervals::kRows, MaskIntervals::kCols}) {
    const bool rows_form = what == MaskIntervals::kRows;
    FwdParams p;
    p.batch = B;
    p.heads_q = H;
    p.seqlen_q = L;
    p.seqlen_k = S;
    p.attn_bias = mask_dev + c.base_offset;
    p.bias_is_mask = true;
    p.bias_batch_stride = c.batch_broadcast || B == 1 ? 0 : own_h * own_rows * stride;
    p.bias_head_stride = c.heads_broadcast || H == 1 ? 0 : own_rows * stride;
    p.bias_row_stride = c.rows_broadcast || L == 1 ? 0 : stride;
    p.bias_col_stride = S == 1 ? 0 : 1;
    const int64_t bytes = bias_summary_bytes(p, what);
    uint8_t* summary_dev;
    cudaMalloc(&summary_dev, bytes + 1);
    cudaMemset(summary_dev, 0xa5, bytes);
    const cudaError_t launched = summarize_bias(p, summary_dev, 0, what);
    const cudaError_t ran = cudaDeviceSynchronize();
    if (launched != cudaSuccess || ran != cudaSuccess) {
      printf("CUDA error: %s / %s\n", cudaGetErrorString(launched), cudaGetErrorString(ran));
      ++fails;
      return;
    }
    std::vector<uint8_t> h(bytes);
    cudaMemcpy(h.data(), summary_dev, bytes, cudaMemcpyDeviceToHost);
    // The summary's extent: a broadcast dimension counts once.
    const int64_t rows = p.bias_row_stride ? L : 1, keys = S == 1 ? 1 : S;
    const int64_t row_blocks = (rows + 63) / 64, key_blocks = (keys + 63) / 64;
    const int64_t own_bh = own_b * own_h;
    auto visible = [&](int64_t bh, int64_t i, int64_t j) {
      return m[(bh * own_rows + (p.bias_row_stride ? i : 0)) * stride + j] != 0;
    };
    int bad = 0;
    // Classes (0: all visible, 1: all masked, 2: mixed), one byte per block, then the spans:
    // per (batch, head) each row block's (first, ~end) of its key blocks not all masked, then
    // each key block's of its row blocks.
    const uint32_t* spans = reinterpret_cast<const uint32_t*>(
        h.data() + (own_bh * row_blocks * key_blocks + 7) / 8 * 8);
    for (int64_t bh = 0; bh < own_bh; ++bh) {
      const uint8_t* cls = &h[bh * row_blocks * key_blocks];
      for (int64_t x = 0; x < row_blocks; ++x)
        for (int64_t y = 0; y < key_blocks; ++y) {
          int shown = 0, hidden = 0;
          for (int64_t i = x * 64; i < std::min(rows, x * 64 + 64); ++i)
            for (int64_t j = y * 64; j < std::min(keys, y * 64 + 64); ++j)
              ++(visible(bh, i, j) ? shown : hidden);
          const int want = shown == 0 ? 1 : hidden == 0 ? 0 : 2;
          if (cls[x * key_blocks + y] != want && bad++ < 3)
            printf("  class (bh %lld, row block %lld, key block %lld): got %d, want %d\n",
                   (long long)bh, (long long)x, (long long)y, cls[x * key_blocks + y], want);
        }
      const uint32_t* own = spans + bh * 2 * (2 * row_blocks + key_blocks);
      // A block's span along the other dimension: (first, ~end) of the blocks not all masked.
      auto check_span = [&](const char* name, int64_t n, int64_t along, const uint32_t* got,
                            auto class_at) {
        uint32_t lo = ~0u, not_end = ~0u;
        for (int64_t o = 0; o < along; ++o)
          if (class_at(o) != 1) {
            lo = std::min(lo, static_cast<uint32_t>(o));
            not_end = std::min(not_end, ~static_cast<uint32_t>(o + 1));
          }
        if ((got[0] != lo || got[1] != not_end) && bad++ < 3)
          printf("  %s %lld's span\n", name, (long long)n);
      };
      for (int64_t x = 0; x < row_blocks; ++x)
        check_span("row block", x, key_blocks, own + 2 * x,
                   [&](int64_t y) { return cls[x * key_blocks + y]; });
      for (int64_t y = 0; y < key_blocks; ++y)
        check_span("key block", y, row_blocks, own + 2 * row_blocks + 2 * y,
                   [&](int64_t x) { return cls[x * key_blocks + y]; });
    }
    // The records: kept for rows where keys do not broadcast, for keys where rows do not.
    const int* records = rows_form ? p.bias_row_keys : p.bias_col_rows;
    const bool kept = rows_form ? S > 1 : (S > 1 && p.bias_row_stride != 0);
    if ((records != nullptr) != kept) {
      printf("  records %s, want %s\n", records ? "kept" : "absent", kept ? "kept" : "absent");
      ++bad;
    }
    if (records != nullptr) {
      const int* got_all = reinterpret_cast<const int*>(
          h.data() + (reinterpret_cast<const uint8_t*>(records) - summary_dev));
      const int64_t count_of = rows_form ? rows : S, along = rows_form ? S : rows;
      for (int64_t bh = 0; bh < own_bh; ++bh)
        for (int64_t i = 0; i < count_of; ++i) {
          int64_t first = along, last = -1, count = 0;
          for (int64_t j = 0; j < along; ++j)
            if (rows_form ? visible(bh, i, j) : visible(bh, j, i)) {
              first = std::min(first, j);
              last = j;
              ++count;
            }
          const bool interval = count == last - first + 1;
          const int begin = count == 0 ? 0 : interval ? first : 1;
          const int end = count == 0 ? 0 : interval ? last + 1 : 0;
          const int* got = got_all + 4 * (bh * count_of + i);  // (four words a record)
          if ((got[0] != begin || got[1] != end) && bad++ < 3)
            printf("  %s record (bh %lld, %lld): got (%d, %d), want (%d, %d)\n",
                   rows_form ? "row" : "column", (long long)bh, (long long)i, got[0], got[1],
                   begin, end);
        }
    }
    if (bad) {
      ++fails;
      printf("FAIL %s: B %lld H %lld L %lld S %lld broadcast b/h/rows %d%d%d pad %d offset %d "
             "pattern %d: %d wrong\n",
             rows_form ? "rows" : "columns", (long long)B, (long long)H, (long long)L,
             (long long)S, c.batch_broadcast, c.heads_broadcast, c.rows_broadcast, c.row_pad,
             c.base_offset, c.pattern, bad);
    }
    cudaFree(summary_dev);
  }
  cudaFree(mask_dev);
}

}  // namespace

// Scope 3: µs per summary pass on a (4, 1, L, L) causal + padding mask (each batch entry's
// last quarter of keys hidden in the first half of the entries, as bench_score_mods.py's case).
int time_passes(int64_t L) {
  const int64_t B = 4, S = L;
  std::vector<uint8_t> m(B * L * S);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = b < B / 2 ? S - S / 4 : S;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) m[(b * L + i) * S + j] = j <= i && j < keys;
  }
  uint8_t* mask_dev;
  cudaMalloc(&mask_dev, m.size());
  cudaMemcpy(mask_dev, m.data(), m.size(), cudaMemcpyHostToDevice);
  FwdParams p;
  p.batch = B;
  p.heads_q = 16;
  p.seqlen_q = L;
  p.seqlen_k = S;
  p.attn_bias = mask_dev;
  p.bias_is_mask = true;
  p.bias_batch_stride = L * S;
  p.bias_head_stride = 0;
  p.bias_row_stride = S;
  p.bias_col_stride = 1;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const char* names[] = {"classes and spans", "rows' key intervals", "keys' row intervals"};
  const MaskIntervals forms[] = {MaskIntervals::kNone, MaskIntervals::kRows, MaskIntervals::kCols};
  for (int f = 0; f < 3; ++f) {
    uint8_t* summary_dev;
    cudaMalloc(&summary_dev, bias_summary_bytes(p, forms[f]));
    for (int i = 0; i < 5; ++i) summarize_bias(p, summary_dev, 0, forms[f]);
    cudaEventRecord(start);
    const int calls = 50;
    for (int i = 0; i < calls; ++i) summarize_bias(p, summary_dev, 0, forms[f]);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    const double us = 1e3 * ms / calls;
    printf("L = S = %lld, B = 4: %-20s %7.1f us per call (memset and finish pass included), "
           "%.2f TB/s of mask\n", (long long)L, names[f], us, m.size() / us * 1e-6);
    cudaFree(summary_dev);
  }
  const cudaError_t err = cudaDeviceSynchronize();
  cudaFree(mask_dev);
  if (err != cudaSuccess) printf("CUDA error: %s\n", cudaGetErrorString(err));
  return err != cudaSuccess;
}

int main(int argc, char** argv) {
  const int scope = argc > 1 ? atoi(argv[1]) : 1;  // 0: L * S <= 200k; 1: all; 2: sanitizer's
  if (scope == 3) return time_passes(argc > 2 ? atoll(argv[2]) : 4096);
  const int64_t seqlens_q[] = {1, 17, 64, 113, 1023, 4500};
  const int64_t seqlens_k[] = {1, 2, 17, 64, 113, 600, 1023, 4500};
  int configs = 0;
  for (const int64_t L : seqlens_q)
    for (const int64_t S : seqlens_k)
      for (int pattern = 0; pattern < 3; ++pattern)
        for (int form = 0; form < 6; ++form) {
          // (1, 1) plain and with padded, misaligned rows; (3, 4) with heads or batch
          // broadcast; (2, 6) padded aligned rows; (2, 4) heads and rows broadcast.
          Config c;
          c.batch = form < 2 ? 1 : form < 4 ? 3 : 2;
          c.heads = form < 2 ? 1 : form == 4 ? 6 : 4;
          c.seqlen_q = L;
          c.seqlen_k = S;
          c.batch_broadcast = form == 3;
          c.heads_broadcast = form == 2 || form == 5;
          c.rows_broadcast = form == 5 && pattern == 0;
          c.row_pad = form == 1 ? 3 : form == 4 ? 16 : 0;
          c.base_offset = form == 1 ? 5 : form == 4 ? 16 : form == 3 ? 8 : 0;
          c.pattern = pattern;
          if (scope == 0 && L * S > 200000) continue;
          // (scope 2 also keeps (4500, 600) with 12 pairs: warps that walk two or more blocks,
          // the loads of the next in flight, in both forms)
          const bool walks_on = L == 4500 && S == 600 && pattern == 0 && form == 4;
          if (scope == 2 && !walks_on && (L * S > 70000 || pattern == 2 || form == 2 || form == 4))
            continue;
          run(c);
          ++configs;
        }
  printf("configs %d fails %d\n", configs, fails);
  return fails != 0;
}
