// The exact passes over flagged rows (cuda/exact_rows.h says when and why): scalar fp32 kernels
// over (batch, seq, heads, dim) tensors of the glue's kernel-ready layout (16-byte aligned
// rows, head dims padded to multiples of 8 with zeros, at most 256), dense or packed sequences
// (params.h: cu_seqlens_q / cu_seqlens_k, seqused_k).
#include "cuda/exact_rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/sm80/block_info.h"  // SeqInfo::dropout_rows
#include "kernels/sm80/dropout.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/mma.h"  // to_float, from_float
#include "kernels/sm80/score.h"
#include "mask.h"

namespace flash_attn_ext::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxDim = kThreads;  // one thread per head-dim column
constexpr int kTileKeys = 32;      // keys per tile of the dK/dV kernel: 8 threads per key
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    exact_rows_flag_kernel(const float* lse, int64_t rows, float* lse_hidden, uint8_t* flags,
                           int32_t* any) {
  for (int64_t r = int64_t(blockIdx.x) * kThreads + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * kThreads) {
    const float x = lse[r];
    const bool flagged = isfinite(x) && fabsf(x * sm80::ScoreFn::kLog2e) >= kExactRowsLse2;
    lse_hidden[r] = flagged ? -INFINITY : x;
    flags[r] = flagged ? 1 : 0;
    if (flagged) *any = 1;  // (every writer writes the same value)
  }
}

// Sum (kMax: max) of x over the CTA, in a fixed order; every thread gets it.
template <bool kMax>
__device__ float block_reduce(float x, float* red) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, s);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // red's previous readers are done
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) x = kMax ? fmaxf(x, red[w]) : x + red[w];
  return x;
}

// The threads whose `flagged` is set, in ascending order, into list[0 .. count); returns count.
__device__ int ordered_flags(bool flagged, int* list, int* warp_counts) {
  const unsigned ballot = __ballot_sync(0xffffffffu, flagged);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // list's previous readers are done
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? warp_counts[w] : 0;
    total += warp_counts[w];
  }
  if (flagged) list[before + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int>(threadIdx.x);
  __syncthreads();
  return total;
}

// a (fp32, shared) . row[c0, c0 + 8), row 16-byte aligned.
template <typename Element>
__device__ __forceinline__ float dot8(const float* a, const Element* row, int c0, float acc) {
  const uint4 raw = *reinterpret_cast<const uint4*>(row + c0);
  const Element* e = reinterpret_cast<const Element*>(&raw);
#pragma unroll
  for (int u = 0; u < 8; ++u) acc = fmaf(a[c0 + u], sm80::to_float(e[u]), acc);
  return acc;
}
template <typename Element>
__device__ __forceinline__ float dot_row(const float* a, const Element* row, int64_t dim) {
  float acc = 0.f;
  for (int c = 0; c < dim; c += 8) acc = dot8(a, row, c, acc);
  return acc;
}

// Where (batch or packed sequence b, query head h, query row i of its sequence) and its keys
// lie, and what it sees (dout only with BwdParams).  Packed sequences (cu_seqlens_q set): the
// sequence's rows and keys from its offsets (SeqInfo; batch strides 0), causal and windows
// bottom-right over its own lengths.
template <typename Element>
struct RowView {
  int64_t b, h, i;
  int64_t q_row;         // i's row in q, out, dout, dq: q0 + i
  int64_t k0;            // key 0's row in k, v, dk, dv
  int64_t len_q, len_k;  // the sequence's lengths (seqlen_q, seqlen_k without packing)
  const Element *q, *out, *k, *v;
  const Element* dout = nullptr;
  __device__ RowView(const FwdParams& p, int64_t b_, int64_t h_, int64_t i_) : b(b_), h(h_), i(i_) {
    const sm80::SeqInfo seq(p, b);
    q_row = seq.q0 + i;
    k0 = seq.k0;
    len_q = seq.len_q;
    len_k = seq.len_k;
    const int64_t hk = h / (p.heads_q / p.heads_kv);
    q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + q_row * p.q_row_stride +
        h * p.q_head_stride;
    out = static_cast<const Element*>(p.out) + b * p.out_batch_stride +
          q_row * p.out_row_stride + h * p.out_head_stride;
    k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + k0 * p.k_row_stride +
        hk * p.k_head_stride;
    v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + k0 * p.v_row_stride +
        hk * p.v_head_stride;
  }
  __device__ RowView(const BwdParams& p, int64_t b_, int64_t h_, int64_t i_)
      : RowView(static_cast<const FwdParams&>(p), b_, h_, i_) {
    dout = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride +
           q_row * p.dout_row_stride + h * p.dout_head_stride;
  }
  __device__ const Element* key(const FwdParams& p, int64_t j) const {
    return k + j * p.k_row_stride;
  }
  __device__ const Element* value(const FwdParams& p, int64_t j) const {
    return v + j * p.v_row_stride;
  }
  __device__ VisibleKeys visible(const FwdParams& p) const {
    return VisibleKeys(len_q, len_k, p.window_left, p.window_right, p.align_bottom_right);
  }
};

// The per-row statistics' row count (softmax_lse's layout: (batch, heads_q, seqlen_q), packed
// (heads_q, total_q)) and where row r lies; false for a packed row outside every sequence.
__host__ __device__ inline int64_t stats_rows(const FwdParams& p) {
  return p.cu_seqlens_q == nullptr ? p.batch * p.heads_q * p.seqlen_q : p.heads_q * p.total_q;
}
__device__ inline bool locate(const FwdParams& p, int64_t r, int64_t& b, int64_t& h,
                              int64_t& i) {
  if (p.cu_seqlens_q == nullptr) {
    i = r % p.seqlen_q;
    b = r / p.seqlen_q / p.heads_q;
    h = r / p.seqlen_q % p.heads_q;
    return true;
  }
  h = r / p.total_q;
  const int64_t row = r % p.total_q;
  if (row < p.cu_seqlens_q[0] || row >= p.cu_seqlens_q[p.batch]) return false;
  int64_t lo = 0, hi = p.batch - 1;  // the last sequence that starts at or before row
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens_q[mid] <= row) lo = mid; else hi = mid - 1;
  }
  b = lo;
  i = row - p.cu_seqlens_q[b];
  return true;
}

// A row's scores as the main kernels form them: ScoreFn's (scale, softcap, a float bias, ALiBi)
// and a boolean mask's -inf where the call kept it as bytes (FwdParams::bias_is_mask: the Hopper
// kernels' mask variant, whose scores are otherwise plain).  Exponents are
// (x - m) * scale_log2 for a row max m: for plain scores x is q.k itself and scale_log2 =
// scale * log2 e, else x is in log2 units and scale_log2 = 1 (score.h).  x - m is exact where
// the two are close (Sterbenz), so P keeps fp32's relative precision at any magnitude of the
// scores, where the main kernels' one FMA x * scale_log2 - m * scale_log2 rounds the product
// m * scale_log2 by up to half its ulp.
struct RowScore {
  sm80::ScoreFn fn;
  const uint8_t* mask = nullptr;  // at (b, h, 0, 0) where bias_is_mask
  int64_t mask_row_stride = 0, mask_col_stride = 0;
  __device__ static FwdParams without_mask(const FwdParams& p) {
    FwdParams q = p;
    if (p.bias_is_mask) q.attn_bias = nullptr;
    return q;
  }
  // For (b, h) of a sequence of lengths (seqlen_q, seqlen_k) (ALiBi's offset is its own).
  __device__ RowScore(const FwdParams& p, int64_t b, int64_t h, int64_t seqlen_q,
                      int64_t seqlen_k)
      : fn(without_mask(p), b, h, seqlen_q, seqlen_k) {
    if (p.bias_is_mask && p.attn_bias != nullptr) {
      mask = static_cast<const uint8_t*>(p.attn_bias) + b * p.bias_batch_stride +
             h * p.bias_head_stride;
      mask_row_stride = p.bias_row_stride;
      mask_col_stride = p.bias_col_stride;
    }
  }
  // x (q.k) becomes the score for query row i and key j; returns ds/dx.
  __device__ __forceinline__ float apply(float& x, int64_t i, int64_t j) const {
    const float dscore = fn.apply(x, i, j);
    if (mask != nullptr && mask[i * mask_row_stride + j * mask_col_stride] == 0) x = -INFINITY;
    return dscore;
  }
  // exp2 of the score x's exponent against the row max m (see above), capped at 0: exact
  // arithmetic gives at most 0 where m is the max of the same scores, formed in the same order.
  // A compare, not fminf, so that a NaN stays NaN.
  __device__ __forceinline__ float unnormalised(float x, float m) const {
    const float e = (x - m) * fn.scale_log2;
    return exp2f(e > 0.f ? 0.f : e);
  }
};

// Dropout's keep decision for (b, h, i, j) (dropout.h's cell rule, the row numbering of the main
// kernels: SeqInfo::dropout_rows) and the factor it puts on P.
__device__ __forceinline__ float dropout_factor(const FwdParams& p, const sm80::DropoutFn& drop,
                                                int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!drop.enabled) return 1.f;
  const uint64_t row_id =
      static_cast<uint64_t>(sm80::SeqInfo(p, b).dropout_rows(p, b, h) + dropout_cell_row(i));
  const uint4 w = drop.cell(row_id, dropout_cell_col(j));
  return drop.kept(sm80::DropoutFn::word(w, dropout_cell_index(i)), dropout_cell_index(j))
             ? drop.scale
             : 0.f;
}

// A row's max m of its scores (RowScore's form) over keys [kb, ke) and sum l of their
// exponentials against it, every thread of the CTA getting both; nan 1 where a score is NaN
// (fmaxf drops it from m), else 0.  q_s: the row of q in fp32.
template <typename Params, typename View>
__device__ void row_max_sum(const Params& p, const View& row, const RowScore& fn,
                            const float* q_s, int64_t i, int64_t kb, int64_t ke, float* red,
                            float& m, float& l, float& nan) {
  m = -INFINITY;
  nan = 0.f;
  for (int64_t j = kb + threadIdx.x; j < ke; j += kThreads) {
    float x = dot_row(q_s, row.key(p, j), p.head_dim);
    fn.apply(x, i, j);
    m = fmaxf(m, x);
    if (isnan(x)) nan = 1.f;
  }
  m = block_reduce<true>(m, red);
  nan = block_reduce<true>(nan, red);
  l = 0.f;
  if (m != -INFINITY) {
    for (int64_t j = kb + threadIdx.x; j < ke; j += kThreads) {
      float x = dot_row(q_s, row.key(p, j), p.head_dim);
      fn.apply(x, i, j);
      l += fn.unnormalised(x, m);
    }
  }
  l = block_reduce<false>(l, red);
}

// Calls body(r, b, h, i) for every row r of the statistics (stats_rows) that flagged(r) flags
// and that lies in a sequence (locate), uniformly over the CTA: one CTA per window of kThreads
// rows (grid-stride), each window's rows in ascending order, every flag of a window read
// before body runs for any of its rows.
template <typename Params, typename Flagged, typename Body>
__device__ void for_each_flagged_row(const Params& p, Flagged flagged, Body body) {
  __shared__ int list[kThreads], warp_counts[kWarps];
  const int64_t rows = stats_rows(p), tid = threadIdx.x;
  for (int64_t w0 = int64_t(blockIdx.x) * kThreads; w0 < rows;
       w0 += int64_t(gridDim.x) * kThreads) {
    const int count = ordered_flags(w0 + tid < rows && flagged(w0 + tid), list, warp_counts);
    for (int u = 0; u < count; ++u) {
      const int64_t r = w0 + list[u];
      int64_t b, h, i;
      if (locate(p, r, b, h, i)) body(r, b, h, i);
    }
  }
}

// One tile of up to kThreads keys: acc + sum_t g_t * row_of(t)[threadIdx.x] over its
// min(left, kThreads) keys, g_t the g of thread t (through g_s), for threads below cols.
template <typename RowOf>
__device__ float add_tile(float acc, float g, float* g_s, int64_t left, int64_t cols,
                          RowOf row_of) {
  __syncthreads();  // g_s's previous readers are done
  g_s[threadIdx.x] = g;
  __syncthreads();
  const int n = static_cast<int>(left < kThreads ? left : kThreads);
  if (threadIdx.x < cols)
    for (int t = 0; t < n; ++t) acc = fmaf(g_s[t], sm80::to_float(row_of(t)[threadIdx.x]), acc);
  return acc;
}

// One CTA per window of kThreads rows of the statistics (grid-stride): each flagged row's max m
// and sum l of its scores (as the forward forms them: RowScore), its D, its whole dq row and
// its entries of dbias_full; (m, 1 / l, D) into row_stats for the dK/dV kernel.
template <typename Element>
__global__ void __launch_bounds__(kThreads)
    exact_rows_dq_kernel(const BwdParams p, const uint8_t* flags, const int32_t* any,
                         float* row_stats) {
  if (*any == 0) return;
  __shared__ float q_s[kMaxDim], do_s[kMaxDim], g_s[kThreads], red[kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const sm80::DropoutFn drop(p);
  const auto* dlse = static_cast<const float*>(p.dsoftmax_lse);
  const auto flagged = [&](int64_t r) { return flags[r] != 0; };
  for_each_flagged_row(p, flagged, [&](int64_t r, int64_t b, int64_t h, int64_t i) {
    const RowView<Element> row(p, b, h, i);
    const VisibleKeys vis = row.visible(p);
    __syncthreads();  // q_s, do_s of the previous row are done with
    float od = 0.f;
    if (tid < p.head_dim) q_s[tid] = sm80::to_float(row.q[tid]);
    if (tid < p.head_dim_v) {
      do_s[tid] = sm80::to_float(row.dout[tid]);
      od = do_s[tid] * sm80::to_float(row.out[tid]);
    }
    const float D = block_reduce<false>(od, red) - (dlse != nullptr ? dlse[r] : 0.f);
    const RowScore fn(p, b, h, row.len_q, row.len_k);
    const int64_t kb = vis.begin(i), ke = vis.end(i);
    float m, l, nan;
    row_max_sum(p, row, fn, q_s, i, kb, ke, red, m, l, nan);
    // A NaN score (a NaN in q or a key) poisons the row's gradients, as the main backward's
    // P would: inv_l NaN, here and for the dK/dV kernel.
    const bool poisoned = nan != 0.f || isnan(l);
    const float inv_l = poisoned ? NAN : l > 0.f ? 1.f / l : 0.f;
    float* dbias = p.dbias_full != nullptr ? static_cast<float*>(p.dbias_full) + r * p.seqlen_k
                                           : nullptr;
    float acc = 0.f;  // dq[i, tid]
    for (int64_t j0 = kb; j0 < ke; j0 += kThreads) {
      const int64_t j = j0 + tid;
      float g = 0.f;
      if (j < ke && (inv_l > 0.f || poisoned)) {
        float x = dot_row(q_s, row.key(p, j), p.head_dim);
        const float dscore = fn.apply(x, i, j);
        const float prob = fn.unnormalised(x, m) * inv_l;
        const float dp =
            dot_row(do_s, row.value(p, j), p.head_dim_v) *
            dropout_factor(p, drop, row.b, row.h, i, j);
        const float ds = prob * (dp - D);
        if (dbias != nullptr) dbias[j] = ds;
        g = ds * dscore;
      }
      acc = add_tile(acc, g, g_s, ke - j0, p.head_dim,
                     [&](int t) { return row.key(p, j0 + t); });
    }
    if (tid < p.head_dim)
      static_cast<Element*>(p.dq)[b * p.dq_batch_stride + row.q_row * p.dq_row_stride +
                                  h * p.dq_head_stride + tid] = sm80::from_float<Element>(acc);
    if (tid == 0) {
      row_stats[3 * r] = m;
      row_stats[3 * r + 1] = inv_l;
      row_stats[3 * r + 2] = D;
    }
  });
}

// One CTA per tile of kTileKeys keys of a (batch or packed sequence, KV head) (grid-stride,
// tiles of the longest sequence's keys): the contributions of the group's flagged rows, in
// ascending (head, row) order, to dk and dv of those keys, added to what the main backward
// wrote.
template <typename Element>
__global__ void __launch_bounds__(kThreads)
    exact_rows_dkdv_kernel(const BwdParams p, const uint8_t* flags, const int32_t* any,
                           const float* row_stats) {
  if (*any == 0) return;
  __shared__ float q_s[kMaxDim], do_s[kMaxDim], g_s[kTileKeys], pd_s[kTileKeys];
  __shared__ int list[kThreads], warp_counts[kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int jj = tid / 8, part = tid % 8;  // phase a: 8 threads per key
  const int64_t key_tiles = (p.seqlen_k + kTileKeys - 1) / kTileKeys;
  const int64_t tiles = p.batch * p.heads_kv * key_tiles;
  const int64_t group = p.heads_q / p.heads_kv;
  const sm80::DropoutFn drop(p);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t j0 = (tile % key_tiles) * kTileKeys, bhk = tile / key_tiles;
    const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
    const sm80::SeqInfo seq(p, b);
    if (j0 >= seq.len_k) continue;  // (uniform over the CTA)
    const VisibleKeys vis(seq.len_q, seq.len_k, p.window_left, p.window_right,
                          p.align_bottom_right);
    float acc_k[kTileKeys], acc_v[kTileKeys];
#pragma unroll
    for (int t = 0; t < kTileKeys; ++t) acc_k[t] = acc_v[t] = 0.f;
    bool touched = false;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const RowScore fn(p, b, h, seq.len_q, seq.len_k);
      const int64_t row0 = seq.stats(p, b, h);
      for (int64_t i0 = 0; i0 < seq.len_q; i0 += kThreads) {
        const int64_t mine = i0 + tid;
        const bool meets = mine < seq.len_q && flags[row0 + mine] != 0 &&
                           vis.begin(mine) < j0 + kTileKeys && vis.end(mine) > j0;
        const int count = ordered_flags(meets, list, warp_counts);
        for (int u = 0; u < count; ++u) {
          const int64_t i = i0 + list[u];
          const RowView<Element> row(p, b, h, i);
          const float m = row_stats[3 * (row0 + i)], inv_l = row_stats[3 * (row0 + i) + 1],
                      D = row_stats[3 * (row0 + i) + 2];
          __syncthreads();  // q_s, do_s, g_s, pd_s of the previous row are done with
          if (tid < p.head_dim) q_s[tid] = sm80::to_float(row.q[tid]);
          if (tid < p.head_dim_v) do_s[tid] = sm80::to_float(row.dout[tid]);
          __syncthreads();
          const int64_t j = j0 + jj;
          const bool in = j < seq.len_k;
          // dO . v over 8 threads per key; q . k by one thread in dot_row's order, the dQ
          // kernel's: a hidden row's score sits next to a bias of ~1e9, where one ulp of q . k
          // can round the biased score to another float than the one m was taken from.
          float dp = 0.f;
          if (in)
            for (int c = part * 8; c < p.head_dim_v; c += 64)
              dp = dot8(do_s, row.value(p, j), c, dp);
#pragma unroll
          for (int s = 1; s < 8; s <<= 1) dp += __shfl_xor_sync(0xffffffffu, dp, s);
          if (part == 0) {
            float g = 0.f, pd = 0.f;
            if (in && j >= vis.begin(i) && j < vis.end(i) && (inv_l > 0.f || isnan(inv_l))) {
              float x = dot_row(q_s, row.key(p, j), p.head_dim);
              const float dscore = fn.apply(x, i, j);
              const float prob = fn.unnormalised(x, m) * inv_l;
              const float keep = dropout_factor(p, drop, b, h, i, j);
              g = prob * (dp * keep - D) * dscore;
              pd = prob * keep;
            }
            g_s[jj] = g;
            pd_s[jj] = pd;
          }
          __syncthreads();
#pragma unroll
          for (int t = 0; t < kTileKeys; ++t) {
            if (tid < p.head_dim) acc_k[t] = fmaf(g_s[t], q_s[tid], acc_k[t]);
            if (tid < p.head_dim_v) acc_v[t] = fmaf(pd_s[t], do_s[tid], acc_v[t]);
          }
          touched = true;
        }
      }
    }
    if (!touched) continue;  // (uniform over the CTA)
#pragma unroll
    for (int t = 0; t < kTileKeys; ++t) {
      const int64_t j = j0 + t;
      if (j >= seq.len_k) break;
      if (tid < p.head_dim) {
        Element* g = static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                     (seq.k0 + j) * p.dk_row_stride + hk * p.dk_head_stride + tid;
        *g = sm80::from_float<Element>(sm80::to_float(*g) + acc_k[t]);
      }
      if (tid < p.head_dim_v) {
        Element* g = static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                     (seq.k0 + j) * p.dv_row_stride + hk * p.dv_head_stride + tid;
        *g = sm80::from_float<Element>(sm80::to_float(*g) + acc_v[t]);
      }
    }
  }
}

// Whether the forward's row r takes the exact pass, from its LSE as the main forward wrote it:
// a huge finite one (exact_rows.h), or +inf / NaN, which huge scores give where P overflowed;
// or -inf where the row sees keys: a rounded reference max far above the row's scores (a
// factor 2^(m * c - m_c) below float32's range) made every P underflow to 0, l = 0, and the
// main kernels wrote LSE -inf with out NaN (0 * inf).  A row that sees no key (LSE -inf, out
// zeros) is right as it is; with a boolean mask, which may hide all of a row's keys, out's NaN
// tells the two apart.
template <typename Element>
__device__ bool forward_flagged(const FwdParams& p, int64_t r, float lse) {
  if (lse != -INFINITY) return !(fabsf(lse * sm80::ScoreFn::kLog2e) < kExactRowsLse2);
  int64_t b, h, i;
  if (!locate(p, r, b, h, i)) return false;
  const RowView<Element> row(p, b, h, i);
  if (row.visible(p).empty_row(i)) return false;
  if (p.bias_is_mask && p.attn_bias != nullptr) return isnan(sm80::to_float(row.out[0]));
  return true;
}

// The forward's pass: one CTA per window of kThreads rows of the LSE (grid-stride), each row
// that forward_flagged flags recomputed: m and l as in the dQ kernel, out = sum_j P_j keep_j
// v_j / l, and the LSE from m and l in float64, rounded once.
// A row with a NaN score, or one that makes an exponent NaN, gets NaN (fmaxf would drop it from
// m), as from the main kernels.
template <typename Element>
__global__ void __launch_bounds__(kThreads) exact_rows_fwd_kernel(const FwdParams p) {
  __shared__ float q_s[kMaxDim], g_s[kThreads], red[kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const sm80::DropoutFn drop(p);
  auto* lse = static_cast<float*>(p.softmax_lse);
  // (each window's flags are all read before any row of it is written: for_each_flagged_row)
  const auto flagged = [&](int64_t r) { return forward_flagged<Element>(p, r, lse[r]); };
  for_each_flagged_row(p, flagged, [&](int64_t r, int64_t b, int64_t h, int64_t i) {
    const RowView<Element> row(p, b, h, i);
    const VisibleKeys vis = row.visible(p);
    __syncthreads();  // q_s of the previous row is done with
    if (tid < p.head_dim) q_s[tid] = sm80::to_float(row.q[tid]);
    __syncthreads();
    const RowScore fn(p, b, h, row.len_q, row.len_k);
    const int64_t kb = vis.begin(i), ke = vis.end(i);
    float m, l, nan;
    row_max_sum(p, row, fn, q_s, i, kb, ke, red, m, l, nan);
    // (an infinite score, or an infinite scale_log2, makes x - m or its product NaN)
    if (isnan(l) || m == INFINITY) nan = 1.f;
    const float inv_l = l > 0.f && nan == 0.f ? 1.f / l : 0.f;
    float acc = 0.f;  // out[i, tid]
    for (int64_t j0 = kb; j0 < ke && inv_l > 0.f; j0 += kThreads) {
      const int64_t j = j0 + tid;
      float g = 0.f;
      if (j < ke) {
        float x = dot_row(q_s, row.key(p, j), p.head_dim);
        fn.apply(x, i, j);
        g = fn.unnormalised(x, m) * inv_l * dropout_factor(p, drop, b, h, i, j);
      }
      acc = add_tile(acc, g, g_s, ke - j0, p.head_dim_v,
                     [&](int t) { return row.value(p, j0 + t); });
    }
    if (nan != 0.f) acc = NAN;
    if (tid < p.head_dim_v)
      static_cast<Element*>(p.out)[b * p.out_batch_stride + row.q_row * p.out_row_stride +
                                   h * p.out_head_stride + tid] =
          sm80::from_float<Element>(acc);
    if (tid == 0) lse[r] = nan != 0.f ? NAN : sm80::lse_of(p, fn.fn.modified(), m, l);
  });
}

// Whether the kernels take the call's head dims: one thread per column (at most kMaxDim) and
// dot8's 8-column loads (multiples of 8, the glue's padding).
bool dims_fit(const FwdParams& p) {
  return p.head_dim <= kMaxDim && p.head_dim_v <= kMaxDim && p.head_dim % 8 == 0 &&
         p.head_dim_v % 8 == 0;
}

int64_t grid_of(int64_t work) {
  const int64_t cap = 4 * std::max(sm80::multiprocessor_count(), 1);
  return std::max<int64_t>(1, std::min(work, cap));
}

}  // namespace

cudaError_t exact_rows_flag(const BwdParams& p, float* lse_hidden, uint8_t* flags, int32_t* any,
                            cudaStream_t stream) {
  const int64_t rows = stats_rows(p);
  return sm80::launch(exact_rows_flag_kernel, grid_of((rows + kThreads - 1) / kThreads),
                      kThreads, 0, stream, static_cast<const float*>(p.softmax_lse), rows,
                      lse_hidden, flags, any);
}

template <typename Element>
cudaError_t exact_rows_backward(const BwdParams& p, const uint8_t* flags, const int32_t* any,
                                float* row_stats, cudaStream_t stream) {
  if (!dims_fit(p)) return cudaErrorInvalidValue;
  const int64_t rows = stats_rows(p);
  cudaError_t err = sm80::launch(exact_rows_dq_kernel<Element>,
                                 grid_of((rows + kThreads - 1) / kThreads), kThreads, 0, stream,
                                 p, flags, any, row_stats);
  if (err != cudaSuccess) return err;
  const int64_t tiles = p.batch * p.heads_kv * ((p.seqlen_k + kTileKeys - 1) / kTileKeys);
  return sm80::launch(exact_rows_dkdv_kernel<Element>, grid_of(tiles), kThreads, 0, stream, p,
                      flags, any, static_cast<const float*>(row_stats));
}

template <typename Element>
cudaError_t exact_rows_forward(const FwdParams& p, cudaStream_t stream) {
  if (!dims_fit(p)) return cudaErrorInvalidValue;
  const int64_t rows = stats_rows(p);
  return sm80::launch(exact_rows_fwd_kernel<Element>, grid_of((rows + kThreads - 1) / kThreads),
                      kThreads, 0, stream, p);
}

template cudaError_t exact_rows_forward<__half>(const FwdParams&, cudaStream_t);
template cudaError_t exact_rows_forward<__nv_bfloat16>(const FwdParams&, cudaStream_t);
template cudaError_t exact_rows_backward<__half>(const BwdParams&, const uint8_t*,
                                                 const int32_t*, float*, cudaStream_t);
template cudaError_t exact_rows_backward<__nv_bfloat16>(const BwdParams&, const uint8_t*,
                                                        const int32_t*, float*, cudaStream_t);

}  // namespace flash_attn_ext::cuda
