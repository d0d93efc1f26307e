// FlashAttention backward on the CPU by recomputation (Dao et al. 2022, arXiv:2205.14135,
// Algorithm 2; FlashAttention-2, arXiv:2307.08691, Algorithm 2).
//
// The forward saved only out and softmax_lse.  Per (batch, key/value head) task, in parallel:
// delta = rowsum(dO * O) (minus the gradient flowing into softmax_lse, if any) for every query row
// of the heads in the GQA group; then for each key tile
// (kBlockK rows, dK/dV accumulated on chip) and each query tile that sees it:
//   P  = exp(scale * Q K^T - lse)            recomputed, never stored
//   dV += P^T dO,   dP = dO V^T,   dS = P * (dP - delta)
//   dK += scale * dS^T Q,   dQ += scale * dS K   (dQ accumulated in the task's own buffer)
// Rows whose saved LSE is too large in magnitude for its float to carry log(l) (|lse| >= 64:
// scores shifted by a large finite mask value such as -1e9 or finfo.min, or huge scores) get
// their max m and sum l recomputed exactly first (one more pass of Q K^T over their keys), and
// P = exp((S - m) - log l) there: exp(S - lse) would scale such a row's P by exp(lse's rounding),
// e.g. by S_k (the key count) for a row that a finite mask value hides completely, whose forward
// is the uniform average.  Other rows are unchanged (their extra term is 0).
// Every query head of a group belongs to the task of its key/value head, so dK/dV sum over the
// group and no two threads ever write the same gradient.  With fewer (batch, kv head) pairs than
// threads the key tiles are split too, and the partial dQ are summed in a fixed order: the
// result is deterministic for a given thread count.
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/bf16_dot.h"
#include "cpu/dropout_cpu.h"
#include "cpu/flash_cpu.h"
#include "cpu/softmax_rows.h"
#include "cpu/tile_gemm.h"
#include "cpu/varlen_cpu.h"
#include "mask.h"

namespace flash_attn_ext::cpu {

namespace {

template <typename T, typename S>
inline void store_tile(S* dst, int64_t ld, const T* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * ld + c] = static_cast<S>(src[r * cols + c]);
}

// With dropout, the forward's (seed, offset) from rng_state into p.
void read_seed(BwdParams& p, const at::Tensor& rng_state) {
  if (!p.dropout) return;
  check_rng_state(rng_state);
  const at::Tensor rng = rng_state.cpu();
  p.philox_seed = static_cast<uint64_t>(rng[0].item<int64_t>());
  p.philox_offset = static_cast<uint64_t>(rng[1].item<int64_t>());
}

template <typename scalar_t>
void flash_bwd_cpu(const BwdParams& p, const Seqs& seqs) {
  using acc_t = at::opmath_type<scalar_t>;
  // bf16 on a CPU with AVX512-BF16: every tile GEMM multiplies bf16 words (bf16_dot.h), packed
  // here: K and V per key tile, Q and dO per query tile, P and dS per step.
  const bool dot = std::is_same_v<scalar_t, c10::BFloat16> && bf16dot::enabled();
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const bool conv = !kInPlace && !dot;
  const int64_t BQ = kBlockQ, BK = kBlockK;
  // L: the longest sequence's queries (the per-task buffers' rows); Lb: this sequence's.
  const int64_t D = p.head_dim, Dv = p.head_dim_v, L = p.seqlen_q;
  const int64_t group = p.heads_q / p.heads_kv;
  const acc_t scale = p.softmax_scale;
  const acc_t drop_scale = p.dropout ? acc_t(dropout_scale(p.dropout_p)) : acc_t(1);
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* out = static_cast<const scalar_t*>(p.out);
  const auto* dout = static_cast<const scalar_t*>(p.dout);
  const auto* lse = static_cast<const acc_t*>(p.softmax_lse);
  auto* dq = static_cast<scalar_t*>(p.dq);
  auto* dk = static_cast<scalar_t*>(p.dk);
  auto* dv = static_cast<scalar_t*>(p.dv);
  auto* dbias = static_cast<acc_t*>(p.dbias_full);
  const auto* dlse = static_cast<const acc_t*>(p.dsoftmax_lse);

  // Tasks are (batch, kv head) pairs.  With fewer pairs than threads (MQA, batch 1) each pair's
  // key tiles are also split into `chunks`: dK/dV rows stay disjoint, and each chunk adds its
  // share of dQ into its own buffer, summed in a fixed order afterwards (still deterministic).
  // Each chunk's buffer is a float copy of the whole dQ, so chunks are capped at kMaxChunks and
  // at what kChunkBytes allows: memory stays O(L), not O(L x threads) (a 64-thread machine
  // wanted 64 copies).
  constexpr int64_t kMaxChunks = 4, kChunkBytes = int64_t{1} << 31;
  const int64_t pairs = p.batch * p.heads_kv;
  const int64_t key_tiles = (p.seqlen_k + BK - 1) / BK;
  const int64_t threads = at::get_num_threads();
  const int64_t dq_bytes = std::max<int64_t>(
      1, pairs * group * L * D * static_cast<int64_t>(sizeof(acc_t)));
  const int64_t chunks = std::max<int64_t>(
      1, std::min({key_tiles, (threads + pairs - 1) / pairs, kMaxChunks, kChunkBytes / dq_bytes}));
  const int64_t tiles_per_chunk = chunks > 1 ? (key_tiles + chunks - 1) / chunks : key_tiles;
  LineVector<acc_t> dq_partial(chunks > 1 ? chunks * pairs * group * L * D : 0);

  at::parallel_for(0, pairs * chunks, 1, [&](int64_t begin, int64_t end) {
    const bf16dot::ChunkGuard amx_state{dot};
    // (64-byte aligned work buffers: flash_cpu.h, LineVector)
    std::vector<acc_t> delta(group * L);
    LineVector<acc_t> dq_own(chunks > 1 ? 0 : group * L * D);
    LineVector<acc_t> k_buf(conv ? BK * D : 0), v_buf(conv ? BK * Dv : 0);
    LineVector<acc_t> q_buf(conv ? BQ * D : 0), do_buf(conv ? BQ * Dv : 0);
    const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2;
    auto words = [&](int64_t n) { return LineVector<uint32_t>(dot ? n : 0); };
    // K^T and V^T (B of S and dP), K interleaved (B of dQ); Q and dO as rows (A of S and dP)
    // and interleaved (B of dK and dV); P^T and dS^T (A of dV and dK), dS as rows (A of dQ).
    LineVector<uint32_t> kt_w = words(D2 * BK), vt_w = words(Dv2 * BK), ki_w = words(BK / 2 * D);
    LineVector<uint32_t> q_w = words(BQ * D2), do_w = words(BQ * Dv2), qi_w = words(BQ / 2 * D),
                         doi_w = words(BQ / 2 * Dv);
    LineVector<uint32_t> pt_w = words(BQ / 2 * BK), dsT_w = words(BQ / 2 * BK),
                         ds_w = words(BQ * BK / 2);
    auto bits = [](const scalar_t* x) { return reinterpret_cast<const uint16_t*>(x); };
    auto f32 = [](acc_t* x) { return reinterpret_cast<float*>(x); };
    LineVector<acc_t> dk_acc(BK * D), dv_acc(BK * Dv), s_buf(BQ * BK), dp_buf(BQ * BK);
    LineVector<acc_t> dtanh(p.softcap > 0.0 ? BQ * BK : 0);
    LineVector<acc_t> pz_buf(p.dropout ? BQ * BK : 0);  // P with dropout applied
    std::vector<uint8_t> keep(p.dropout ? BQ * BK : 0);
    // P = exp((S - row_hi) - row_lo) per row: (lse, 0), or (m, log l) recomputed (header).
    std::vector<acc_t> row_hi(group * L), row_lo(group * L);
    std::vector<uint8_t> exact_row(group * L);
    std::vector<acc_t> exact_m(group * L), exact_l(group * L), alpha(BQ);  // (the exact pass)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / chunks, chunk = task % chunks;
      const int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
      acc_t* dq_acc = chunks > 1 ? dq_partial.data() + (chunk * pairs + pair) * group * L * D
                                 : dq_own.data();
      const int64_t Lb = seqs.len_q(p, b), q_first = seqs.first_q(b), k_first = seqs.first_k(b);
      const VisibleKeys vis = seqs.visible(p, b);
      const int64_t key_lo = chunk * tiles_per_chunk * BK;
      const int64_t key_hi = std::min(seqs.len_k(p, b), (chunk + 1) * tiles_per_chunk * BK);
      auto q_ptr = [&](int64_t h, int64_t i) {
        return q + b * p.q_batch_stride + h * p.q_head_stride + (q_first + i) * p.q_row_stride;
      };
      auto do_ptr = [&](int64_t h, int64_t i) {
        return dout + b * p.dout_batch_stride + h * p.dout_head_stride +
               (q_first + i) * p.dout_row_stride;
      };
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        for (int64_t i = 0; i < Lb; ++i) {
          const scalar_t* o = out + b * p.out_batch_stride + h * p.out_head_stride +
                              (q_first + i) * p.out_row_stride;
          const scalar_t* d_o = do_ptr(h, i);
          acc_t acc = 0;
          for (int64_t c = 0; c < Dv; ++c)
            acc += static_cast<acc_t>(d_o[c]) * static_cast<acc_t>(o[c]);
          delta[g * L + i] = dlse == nullptr ? acc : acc - dlse[seqs.lse_index(p, b, h, i)];
        }
      }
      std::fill(dq_acc, dq_acc + group * L * D, acc_t(0));
      const scalar_t* k_head =
          k + b * p.k_batch_stride + hk * p.k_head_stride + k_first * p.k_row_stride;
      const scalar_t* v_head =
          v + b * p.v_batch_stride + hk * p.v_head_stride + k_first * p.v_row_stride;
      // K^T of key tile [j0, j0 + nk) for the scores (kt_w, or the returned view).
      auto key_tile = [&](int64_t j0, int64_t nk) {
        const scalar_t* kt = k_head + j0 * p.k_row_stride;
        if (dot) {
          bf16dot::pack_transposed(kt_w.data(), BK, bits(kt), p.k_row_stride, nk, D);
          return Mat<acc_t>{nullptr, 0};
        }
        return acc_view(kt, nk, D, p.k_row_stride, k_buf.data());
      };
      // S = the scores of query rows [i0, i0 + mq) of head h against the key tile key_tile
      // prepared, as the forward forms them; returns Q's view (non-bf16-dot path).
      auto score_rows = [&](acc_t* S, const Mat<acc_t>& km, int64_t h, int64_t i0, int64_t mq,
                            int64_t j0, int64_t nk, acc_t* dtanh_tile) {
        if (dot) {
          bf16dot::pack_rows(q_w.data(), D2, bits(q_ptr(h, i0)), p.q_row_stride, mq, D);
          bf16dot::gemm(f32(S), BK, q_w.data(), D2, 1, kt_w.data(), BK, mq, nk, D2,
                        static_cast<float>(scale), false);
          finish_scores(S, mq, nk, p, vis, b, h, i0, j0, dtanh_tile);
          return Mat<acc_t>{nullptr, 0};
        }
        const Mat<acc_t> qm = acc_view(q_ptr(h, i0), mq, D, p.q_row_stride, q_buf.data());
        score_tile(S, qm, km, mq, nk, p, vis, b, h, i0, j0, dtanh_tile);
        return qm;
      };
      bool any_exact = false;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < Lb; ++i) {
          const acc_t x = lse[seqs.lse_index(p, b, hk * group + g, i)];
          const bool flag = std::isfinite(x) && std::abs(x) >= acc_t(64);
          row_hi[g * L + i] = x;
          row_lo[g * L + i] = 0;
          exact_row[g * L + i] = flag;
          exact_m[g * L + i] = -std::numeric_limits<acc_t>::infinity();
          exact_l[g * L + i] = 0;
          any_exact = any_exact || flag;
        }
      }
      if (any_exact) {  // m and l of the flagged rows over all their keys (not only the chunk's)
        const int64_t len_k = seqs.len_k(p, b);
        for (int64_t j0 = 0; j0 < len_k; j0 += BK) {
          const int64_t nk = std::min(BK, len_k - j0);
          const Mat<acc_t> km = key_tile(j0, nk);
          for (int64_t g = 0; g < group; ++g) {
            for (int64_t i0 = 0; i0 < Lb; i0 += BQ) {
              const int64_t mq = std::min(BQ, Lb - i0);
              const uint8_t* flags = exact_row.data() + g * L + i0;
              if (std::find(flags, flags + mq, uint8_t(1)) == flags + mq) continue;
              if (vis.end(i0 + mq - 1) <= j0 || vis.begin(i0) >= j0 + nk) continue;
              // (the forward's online softmax over the tile's rows, flagged or not: vectorised)
              acc_t* S = s_buf.data();
              score_rows(S, km, hk * group + g, i0, mq, j0, nk, nullptr);
              online_softmax_rows(S, mq, nk, BK, exact_m.data() + g * L + i0,
                                  exact_l.data() + g * L + i0, alpha.data());
            }
          }
        }
        // (a row whose scores held no finite maximum, NaN among them, keeps its lse: NaN
        // propagates as before)
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < Lb; ++i) {
            const acc_t m = exact_m[g * L + i];
            if (!exact_row[g * L + i] || !std::isfinite(m)) continue;
            row_hi[g * L + i] = m;
            row_lo[g * L + i] = std::log(exact_l[g * L + i]);
          }
        }
      }

      for (int64_t j0 = key_lo; j0 < key_hi; j0 += BK) {
        const int64_t nk = std::min(BK, key_hi - j0);
        const Mat<acc_t> km = key_tile(j0, nk);
        Mat<acc_t> vm{nullptr, 0};
        if (dot) {
          const scalar_t* kt = k_head + j0 * p.k_row_stride;
          bf16dot::pack_transposed(vt_w.data(), BK, bits(v_head + j0 * p.v_row_stride),
                                   p.v_row_stride, nk, Dv);
          bf16dot::pack_interleaved(ki_w.data(), D, bits(kt), p.k_row_stride, nk, D);
        } else {
          vm = acc_view(v_head + j0 * p.v_row_stride, nk, Dv, p.v_row_stride, v_buf.data());
        }
        std::fill(dk_acc.begin(), dk_acc.end(), acc_t(0));
        std::fill(dv_acc.begin(), dv_acc.end(), acc_t(0));

        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          for (int64_t i0 = 0; i0 < Lb; i0 += BQ) {
            const int64_t mq = std::min(BQ, Lb - i0);
            // Skip query tiles that see none of keys [j0, j0 + nk).
            if (vis.end(i0 + mq - 1) <= j0 || vis.begin(i0) >= j0 + nk) continue;
            acc_t* S = s_buf.data();
            acc_t* dP = dp_buf.data();
            acc_t* dtanh_tile = p.softcap > 0.0 ? dtanh.data() : nullptr;
            const Mat<acc_t> qm = score_rows(S, km, h, i0, mq, j0, nk, dtanh_tile);
            Mat<acc_t> dom{nullptr, 0};
            if (dot) {
              bf16dot::pack_rows(do_w.data(), Dv2, bits(do_ptr(h, i0)), p.dout_row_stride, mq,
                                 Dv);
              bf16dot::pack_interleaved(qi_w.data(), D, bits(q_ptr(h, i0)), p.q_row_stride, mq,
                                        D);
              bf16dot::pack_interleaved(doi_w.data(), Dv, bits(do_ptr(h, i0)),
                                        p.dout_row_stride, mq, Dv);
            } else {
              dom = acc_view(do_ptr(h, i0), mq, Dv, p.dout_row_stride, do_buf.data());
            }
            probs_from_lse_rows(S, mq, nk, BK, row_hi.data() + g * L + i0,
                                row_lo.data() + g * L + i0);
            if (p.dropout) {
              // The forward's mask: dV = (P Z / (1 - p))^T dO and dP = Z / (1 - p) * dO V^T.
              for (int64_t r = 0; r < mq; ++r) {
                uint8_t* kr = keep.data() + r * BK;
                dropout_keep(p.philox_seed, p.philox_offset, p.dropout_threshold,
                             seqs.dropout_row(p, b, h, i0 + r), i0 + r, j0, nk, kr);
                for (int64_t c = 0; c < nk; ++c)
                  pz_buf[r * BK + c] = kr[c] ? S[r * BK + c] * drop_scale : acc_t(0);
              }
            }
            acc_t* P = p.dropout ? pz_buf.data() : S;
            if (dot) {  // P and dS rounded to bf16 (bf16_dot.h)
              bf16dot::pack_interleaved(pt_w.data(), BK, f32(P), BK, mq, nk);
              bf16dot::gemm(f32(dv_acc.data()), Dv, pt_w.data(), 1, BK, doi_w.data(), Dv, nk, Dv,
                            (mq + 1) / 2, 1.f, true);
              bf16dot::gemm(f32(dP), BK, do_w.data(), Dv2, 1, vt_w.data(), BK, mq, nk, Dv2, 1.f,
                            false);
            } else {
              gemm(dv_acc.data(), Dv, Mat<acc_t>{P, BK}.t(), dom, nk, Dv, mq, 1.0, 1.0);
              gemm(dP, BK, dom, vm.t(), mq, nk, Dv, 1.0, 0.0);
            }
            if (p.dropout) {
              for (int64_t r = 0; r < mq; ++r)
                for (int64_t c = 0; c < nk; ++c)
                  dP[r * BK + c] = keep[r * BK + c] ? dP[r * BK + c] * drop_scale : acc_t(0);
            }
            softmax_grad_rows(S, dP, mq, nk, BK, delta.data() + g * L + i0);
            if (dbias != nullptr) {  // d(bias) = dS: scores = softcap(...) + bias
              acc_t* dst = dbias + ((b * p.heads_q + h) * L + i0) * p.seqlen_k + j0;
              for (int64_t r = 0; r < mq; ++r)
                std::copy(dP + r * BK, dP + r * BK + nk, dst + r * p.seqlen_k);
            }
            if (p.softcap > 0.0) {
              for (int64_t r = 0; r < mq; ++r)
                for (int64_t c = 0; c < nk; ++c) dP[r * BK + c] *= dtanh[r * BK + c];
            }
            if (dot) {
              bf16dot::pack_interleaved(dsT_w.data(), BK, f32(dP), BK, mq, nk);
              bf16dot::pack_rows(ds_w.data(), BK / 2, f32(dP), BK, mq, nk);
              bf16dot::gemm(f32(dk_acc.data()), D, dsT_w.data(), 1, BK, qi_w.data(), D, nk, D,
                            (mq + 1) / 2, static_cast<float>(scale), true);
              bf16dot::gemm(f32(dq_acc + (g * L + i0) * D), D, ds_w.data(), BK / 2, 1,
                            ki_w.data(), D, mq, D, (nk + 1) / 2, static_cast<float>(scale), true);
            } else {
              gemm(dk_acc.data(), D, Mat<acc_t>{dP, BK}.t(), qm, nk, D, mq, scale, 1.0);
              gemm(dq_acc + (g * L + i0) * D, D, Mat<acc_t>{dP, BK}, km, mq, D, nk, scale,
                   1.0);
            }
          }
        }
        store_tile(dk + b * p.dk_batch_stride + hk * p.dk_head_stride +
                       (k_first + j0) * p.dk_row_stride,
                   p.dk_row_stride, dk_acc.data(), nk, D);
        store_tile(dv + b * p.dv_batch_stride + hk * p.dv_head_stride +
                       (k_first + j0) * p.dv_row_stride,
                   p.dv_row_stride, dv_acc.data(), nk, Dv);
      }
      if (chunks == 1) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          store_tile(dq + b * p.dq_batch_stride + h * p.dq_head_stride +
                         q_first * p.dq_row_stride,
                     p.dq_row_stride, dq_acc + g * L * D, Lb, D);
        }
      }
    }
  });
  if (chunks == 1) return;
  // dQ = the chunks' partial sums, added in chunk order; one task per (pair, query head).
  at::parallel_for(0, pairs * group, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> sum(L * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / group, g = task % group;
      std::fill(sum.begin(), sum.end(), acc_t(0));
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const acc_t* part = dq_partial.data() + ((chunk * pairs + pair) * group + g) * L * D;
        for (int64_t x = 0; x < L * D; ++x) sum[x] += part[x];
      }
      const int64_t b = pair / p.heads_kv, h = (pair % p.heads_kv) * group + g;
      store_tile(dq + b * p.dq_batch_stride + h * p.dq_head_stride +
                     seqs.first_q(b) * p.dq_row_stride,
                 p.dq_row_stride, sum.data(), seqs.len_q(p, b), D);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool align_bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    double dropout_p, bool deterministic, bool bias_requires_grad,
    const std::optional<at::Tensor>& dsoftmax_lse) {
  const AttnArgs a = check_attn_args(q_in, k_in, v_in, softmax_scale, causal, window_left,
                                     window_right, softcap, alibi_slopes, attn_bias, dropout_p);
  TORCH_CHECK_VALUE(q_in.device().is_cpu(), "flash_attn_ext CPU kernel got q on ", q_in.device());
  check_bwd_tensors(a, dout_in, out_in, softmax_lse, q_in);
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in), out = last_dim_contiguous(out_in),
                   dout = last_dim_contiguous(dout_in), lse = softmax_lse.contiguous();
  // Laid out like q, k, v (checks.h new_output_like): autograd keeps them as .grad, no copy.
  at::Tensor dq = new_output_like(q);
  at::Tensor dk = new_output_like(k);
  at::Tensor dv = new_output_like(v);
  check_bias_grad(attn_bias, bias_requires_grad);
  const bool want_dbias = attn_bias.has_value() && bias_requires_grad;
  at::Tensor dbias_full = want_dbias ? at::zeros({a.batch, a.heads_q, a.seqlen_q, a.seqlen_k},
                                                 q.options().dtype(lse_dtype(q.scalar_type())))
                                     : at::Tensor();
  auto make_dbias = [&] { return reduce_dbias(dbias_full, attn_bias, want_dbias, q); };
  if (a.batch * a.heads_q == 0) {  // nothing attends: k and v (which may exist) get zeros
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, make_dbias()};
  }

  BwdParams p;
  fill_fwd_params(p, a, q, k, v, out, lse, softcap, align_bottom_right);
  fill_grad_params(p, dout, dq, dk, dv);
  p.deterministic = deterministic;  // the CPU backward is always deterministic
  fill_dropout_params(p, dropout_p);
  read_seed(p, rng_state);
  const at::Tensor bias_view = attn_bias.has_value()
                                   ? prepare_bias(*attn_bias, a, lse_dtype(q.scalar_type()), p,
                                                  /*keep_mask=*/true)
                                   : at::Tensor();
  const at::Tensor slopes = prepare_alibi(alibi_slopes, lse_dtype(q.scalar_type()), p);
  p.dbias_full = want_dbias ? dbias_full.data_ptr() : nullptr;
  const at::Tensor dlse = prepare_dlse(dsoftmax_lse, {a.batch, a.heads_q, a.seqlen_q}, q, p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_bwd_cpu",
                                  [&] { flash_bwd_cpu<scalar_t>(p, Seqs{}); });
  return {dq, dk, dv, make_dbias()};
}

// Packed sequences (the bwd_varlen op): the same kernel over varlen_cpu.h's geometry; rows
// outside every sequence get zero gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& rng_state, std::optional<double> softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& dsoftmax_lse,
    bool /*deterministic: this backward is*/) {
  const PackedCall c = check_packed_call(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, seqused_k);
  const at::Tensor &q = c.q, &k = c.k, &v = c.v;
  const AttnArgs& a = c.a;
  const Packed& pk = c.pk;
  check_packed_bwd_tensors(a, dout_in, out_in, softmax_lse, lse_dtype(q.scalar_type()));
  const at::Tensor out = last_dim_contiguous(out_in).unsqueeze(0),
                   dout = last_dim_contiguous(dout_in).unsqueeze(0),
                   lse = softmax_lse.contiguous();
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  if (pk.batch == 0 || a.heads_q == 0) return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)};

  BwdParams p;
  fill_fwd_params(p, a, q, k, v, out, lse, softcap, true);
  fill_grad_params(p, dout, dq, dk, dv);
  make_packed(p, pk, max_seqlen_q, max_seqlen_k);
  p.dout_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
  fill_dropout_params(p, dropout_p);
  read_seed(p, rng_state);
  const at::Tensor slopes = prepare_alibi(alibi_slopes, lse_dtype(q.scalar_type()), p);
  const at::Tensor dlse = prepare_dlse(dsoftmax_lse, {a.heads_q, a.seqlen_q}, q, p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_bwd_cpu",
                                  [&] { flash_bwd_cpu<scalar_t>(p, host_seqs(pk)); });
  return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)};
}

}  // namespace

}  // namespace flash_attn_ext::cpu

TORCH_LIBRARY_IMPL(flash_attn_ext, CPU, m) {
  m.impl("bwd", &flash_attn_ext::cpu::bwd_cpu);
  m.impl("bwd_varlen", &flash_attn_ext::cpu::bwd_varlen_cpu);
}
