// The backward's exact pass over flagged rows (cuda/exact_rows.h says when and why): scalar
// fp32 kernels over dense (batch, seq, heads, dim) tensors of the glue's kernel-ready layout
// (16-byte aligned rows, head dims padded to multiples of 8 with zeros, at most 256).
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

// Where (batch b, query head h, query row i) and its keys lie.
template <typename Element>
struct RowView {
  int64_t b, h, i;
  const Element *q, *dout, *out, *k, *v;
  __device__ RowView(const BwdParams& p, int64_t b_, int64_t h_, int64_t i_) : b(b_), h(h_), i(i_) {
    const int64_t hk = h / (p.heads_q / p.heads_kv);
    q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride +
        h * p.q_head_stride;
    dout = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride +
           i * p.dout_row_stride + h * p.dout_head_stride;
    out = static_cast<const Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride +
          h * p.out_head_stride;
    k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
    v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  }
  __device__ const Element* key(const BwdParams& p, int64_t j) const { return k + j * p.k_row_stride; }
  __device__ const Element* value(const BwdParams& p, int64_t j) const {
    return v + j * p.v_row_stride;
  }
};

// Dropout's keep decision for (b, h, i, j) (dropout.h's cell rule, the row numbering of the main
// kernels: SeqInfo::dropout_rows) and the factor it puts on P.
__device__ __forceinline__ float dropout_factor(const BwdParams& p, const sm80::DropoutFn& drop,
                                                int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!drop.enabled) return 1.f;
  const uint64_t row_id =
      static_cast<uint64_t>(sm80::SeqInfo(p, b).dropout_rows(p, b, h) + dropout_cell_row(i));
  const uint4 w = drop.cell(row_id, dropout_cell_col(j));
  return drop.kept(sm80::DropoutFn::word(w, dropout_cell_index(i)), dropout_cell_index(j))
             ? drop.scale
             : 0.f;
}

// A score's probability from its row's max m and 1 / l.  Both kernels form the score x the same
// way (dot_row, then ScoreFn), so x <= m wherever the dQ kernel found m; the cap keeps a score
// that came out above m (it cannot, unless the two orders differ) from scaling P past 1 / l.
// A compare, not fminf, so that a NaN stays NaN (as ScoreFn::prob keeps it).
__device__ __forceinline__ float prob_of(float x, float m, float inv_l) {
  const float e = x - m;
  return exp2f(e > 0.f ? 0.f : e) * inv_l;
}

// One CTA per window of kThreads rows (grid-stride): each flagged row's max m and sum l of its
// scores (as the forward forms them, in log2 units: a bias makes ScoreFn's scores
// s' = s log2 e), its D, its whole dq row and its entries of dbias_full; (m, 1 / l, D) into
// row_stats for the dK/dV kernel.
template <typename Element>
__global__ void __launch_bounds__(kThreads)
    exact_rows_dq_kernel(const BwdParams p, const uint8_t* flags, const int32_t* any,
                         float* row_stats) {
  if (*any == 0) return;
  __shared__ float q_s[kMaxDim], do_s[kMaxDim], g_s[kThreads], red[kWarps];
  __shared__ int list[kThreads], warp_counts[kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const VisibleKeys vis(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                        p.align_bottom_right);
  const sm80::DropoutFn drop(p);
  const auto* dlse = static_cast<const float*>(p.dsoftmax_lse);
  for (int64_t w0 = int64_t(blockIdx.x) * kThreads; w0 < rows;
       w0 += int64_t(gridDim.x) * kThreads) {
    const int count = ordered_flags(w0 + tid < rows && flags[w0 + tid] != 0, list, warp_counts);
    for (int u = 0; u < count; ++u) {
      const int64_t r = w0 + list[u];
      const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q;
      const RowView<Element> row(p, bh / p.heads_q, bh % p.heads_q, i);
      __syncthreads();  // q_s, do_s of the previous row are done with
      float od = 0.f;
      if (tid < p.head_dim) q_s[tid] = sm80::to_float(row.q[tid]);
      if (tid < p.head_dim_v) {
        do_s[tid] = sm80::to_float(row.dout[tid]);
        od = do_s[tid] * sm80::to_float(row.out[tid]);
      }
      const float D = block_reduce<false>(od, red) - (dlse != nullptr ? dlse[r] : 0.f);
      const sm80::ScoreFn fn(p, row.b, row.h);
      const int64_t kb = vis.begin(i), ke = vis.end(i);
      float m = -INFINITY;
      for (int64_t j = kb + tid; j < ke; j += kThreads) {
        float x = dot_row(q_s, row.key(p, j), p.head_dim);
        fn.apply(x, i, j);
        m = fmaxf(m, x);
      }
      m = block_reduce<true>(m, red);
      float l = 0.f;
      if (m != -INFINITY) {
        for (int64_t j = kb + tid; j < ke; j += kThreads) {
          float x = dot_row(q_s, row.key(p, j), p.head_dim);
          fn.apply(x, i, j);
          l += exp2f(x - m);
        }
      }
      l = block_reduce<false>(l, red);
      const float inv_l = l > 0.f ? 1.f / l : 0.f;
      float* dbias = p.dbias_full != nullptr ? static_cast<float*>(p.dbias_full) + r * p.seqlen_k
                                             : nullptr;
      float acc = 0.f;  // dq[i, tid]
      for (int64_t j0 = kb; j0 < ke; j0 += kThreads) {
        const int64_t j = j0 + tid;
        float g = 0.f;
        if (j < ke && inv_l > 0.f) {
          float x = dot_row(q_s, row.key(p, j), p.head_dim);
          const float dscore = fn.apply(x, i, j);
          const float prob = prob_of(x, m, inv_l);
          const float dp =
              dot_row(do_s, row.value(p, j), p.head_dim_v) *
              dropout_factor(p, drop, row.b, row.h, i, j);
          const float ds = prob * (dp - D);
          if (dbias != nullptr) dbias[j] = ds;
          g = ds * dscore;
        }
        __syncthreads();  // g_s's previous readers are done
        g_s[tid] = g;
        __syncthreads();
        const int n = static_cast<int>(ke - j0 < kThreads ? ke - j0 : kThreads);
        if (tid < p.head_dim)
          for (int t = 0; t < n; ++t)
            acc = fmaf(g_s[t], sm80::to_float(row.key(p, j0 + t)[tid]), acc);
      }
      if (tid < p.head_dim)
        static_cast<Element*>(p.dq)[row.b * p.dq_batch_stride + i * p.dq_row_stride +
                                    row.h * p.dq_head_stride + tid] = sm80::from_float<Element>(acc);
      if (tid == 0) {
        row_stats[3 * r] = m;
        row_stats[3 * r + 1] = inv_l;
        row_stats[3 * r + 2] = D;
      }
    }
  }
}

// One CTA per tile of kTileKeys keys of a (batch, KV head) (grid-stride): the contributions of
// the group's flagged rows, in ascending (head, row) order, to dk and dv of those keys, added
// to what the main backward wrote.
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
  const VisibleKeys vis(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                        p.align_bottom_right);
  const sm80::DropoutFn drop(p);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t j0 = (tile % key_tiles) * kTileKeys, bhk = tile / key_tiles;
    const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
    float acc_k[kTileKeys], acc_v[kTileKeys];
#pragma unroll
    for (int t = 0; t < kTileKeys; ++t) acc_k[t] = acc_v[t] = 0.f;
    bool touched = false;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const sm80::ScoreFn fn(p, b, h);
      const int64_t row0 = (b * p.heads_q + h) * p.seqlen_q;
      for (int64_t i0 = 0; i0 < p.seqlen_q; i0 += kThreads) {
        const int64_t mine = i0 + tid;
        const bool meets = mine < p.seqlen_q && flags[row0 + mine] != 0 &&
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
          const bool in = j < p.seqlen_k;
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
            if (in && j >= vis.begin(i) && j < vis.end(i) && inv_l > 0.f) {
              float x = dot_row(q_s, row.key(p, j), p.head_dim);
              const float dscore = fn.apply(x, i, j);
              const float prob = prob_of(x, m, inv_l);
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
      if (j >= p.seqlen_k) break;
      if (tid < p.head_dim) {
        Element* g = static_cast<Element*>(p.dk) + b * p.dk_batch_stride + j * p.dk_row_stride +
                     hk * p.dk_head_stride + tid;
        *g = sm80::from_float<Element>(sm80::to_float(*g) + acc_k[t]);
      }
      if (tid < p.head_dim_v) {
        Element* g = static_cast<Element*>(p.dv) + b * p.dv_batch_stride + j * p.dv_row_stride +
                     hk * p.dv_head_stride + tid;
        *g = sm80::from_float<Element>(sm80::to_float(*g) + acc_v[t]);
      }
    }
  }
}

int64_t grid_of(int64_t work) {
  const int64_t cap = 4 * std::max(sm80::multiprocessor_count(), 1);
  return std::max<int64_t>(1, std::min(work, cap));
}

}  // namespace

cudaError_t exact_rows_flag(const BwdParams& p, float* lse_hidden, uint8_t* flags, int32_t* any,
                            cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  return sm80::launch(exact_rows_flag_kernel, grid_of((rows + kThreads - 1) / kThreads),
                      kThreads, 0, stream, static_cast<const float*>(p.softmax_lse), rows,
                      lse_hidden, flags, any);
}

template <typename Element>
cudaError_t exact_rows_backward(const BwdParams& p, const uint8_t* flags, const int32_t* any,
                                float* row_stats, cudaStream_t stream) {
  if (p.head_dim > kMaxDim || p.head_dim_v > kMaxDim || p.head_dim % 8 != 0 ||
      p.head_dim_v % 8 != 0 || p.cu_seqlens_q != nullptr)
    return cudaErrorInvalidValue;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  cudaError_t err = sm80::launch(exact_rows_dq_kernel<Element>,
                                 grid_of((rows + kThreads - 1) / kThreads), kThreads, 0, stream,
                                 p, flags, any, row_stats);
  if (err != cudaSuccess) return err;
  const int64_t tiles = p.batch * p.heads_kv * ((p.seqlen_k + kTileKeys - 1) / kTileKeys);
  return sm80::launch(exact_rows_dkdv_kernel<Element>, grid_of(tiles), kThreads, 0, stream, p,
                      flags, any, static_cast<const float*>(row_stats));
}

template cudaError_t exact_rows_backward<__half>(const BwdParams&, const uint8_t*,
                                                 const int32_t*, float*, cudaStream_t);
template cudaError_t exact_rows_backward<__nv_bfloat16>(const BwdParams&, const uint8_t*,
                                                        const int32_t*, float*, cudaStream_t);

}  // namespace flash_attn_ext::cuda
