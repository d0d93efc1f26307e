// FlashAttention forward on the CPU: the tiled algorithm with the online softmax
// (Dao et al. 2022, arXiv:2205.14135, Algorithm 1; FlashAttention-2, arXiv:2307.08691, Alg. 1).
//
// For each (batch, head, tile of kBlockQ query rows), in parallel: keep the query tile, the output
// accumulator O and the running row max m / row sum l; stream the visible key/value tiles of
// kBlockK rows; per tile S = scale * Q K^T (BLAS), softcap, mask, the online-softmax update, then
// O = alpha * O + P V (BLAS), where with dropout P loses its dropped elements after the row sum
// l took them (dropout.h).  Finally out = O / l (times 1 / P(kept)) and softmax_lse = m + log(l).  Scores exist only
// as one (kBlockQ x kBlockK) tile per thread: memory is O(seqlen), never O(seqlen_q * seqlen_k).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "checks.h"
#include "cpu/bf16_amx.h"
#include "cpu/bf16_dot.h"
#include "cpu/dropout_cpu.h"
#include "cpu/flash_cpu.h"
#include "cpu/softmax_rows.h"
#include "cpu/tile_gemm.h"
#include "cpu/varlen_cpu.h"
#include "mask.h"

namespace flash_attn_ext::cpu {

namespace {

// K packed for bf16 dot products once per call (bf16_dot.h, pack_transposed: pair p of head
// dims, key row r at [hk][p][r]): each key tile is the B operand of S = Q K^T for every query
// tile and every query head of the group.  Key rows are counted as in the tensor (dense: batch
// b's key j is row b * seqlen_k + j; packed: cu_seqlens_k[b] + j), so the buffer is K's size
// whatever the sequence lengths.
struct PackedKeys {
  std::unique_ptr<uint32_t[], FreeDeleter> words;  // (64-byte aligned, not zeroed)
  int64_t pairs = 0, rows = 0;  // per key/value head: pairs x rows words

  uint32_t* at(const FwdParams& p, const Seqs& seqs, int64_t b, int64_t hk) const {
    const int64_t row = seqs.cu_k == nullptr ? b * p.seqlen_k : seqs.first_k(b);
    return words.get() + hk * pairs * rows + row;
  }
};

constexpr int64_t kPackKeysChunk = 256;  // keys per packing task
// The most rows of a task whose key tiles are read in place (direct_keys in flash_fwd_cpu).
constexpr int64_t kDirectKeyRows = 16;

template <typename scalar_t>
PackedKeys pack_keys(const FwdParams& p, const Seqs& seqs) {
  PackedKeys pk;
  pk.pairs = (p.head_dim + 1) / 2;
  pk.rows = seqs.cu_k == nullptr ? p.batch * p.seqlen_k : seqs.cu_k[p.batch];
  pk.words.reset(CacheLineAllocator<uint32_t>().allocate(
      static_cast<size_t>(std::max<int64_t>(1, p.heads_kv * pk.pairs * pk.rows))));
  const auto* k = static_cast<const scalar_t*>(p.k);
  // Tasks are (batch, key/value head, chunk of keys): a decode call (batch 1, one key/value
  // head, a long cache) still packs on every thread.
  const int64_t chunks = (p.seqlen_k + kPackKeysChunk - 1) / kPackKeysChunk;
  at::parallel_for(0, p.batch * p.heads_kv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks, hk = (task / chunks) % p.heads_kv;
      const int64_t b = task / (chunks * p.heads_kv);
      const int64_t j0 = chunk * kPackKeysChunk;
      const int64_t n = std::min(kPackKeysChunk, seqs.len_k(p, b) - j0);
      if (n <= 0) continue;
      const scalar_t* k_rows = k + b * p.k_batch_stride + hk * p.k_head_stride +
                               (seqs.first_k(b) + j0) * p.k_row_stride;
      bf16dot::pack_transposed(pk.at(p, seqs, b, hk) + j0, pk.rows,
                               reinterpret_cast<const uint16_t*>(k_rows), p.k_row_stride, n,
                               p.head_dim);
    }
  });
  return pk;
}

template <typename scalar_t>
void flash_fwd_cpu(const FwdParams& p, const Seqs& seqs) {
  using acc_t = at::opmath_type<scalar_t>;
  // fp32/fp64 inputs feed BLAS in place; fp16/bf16 tiles are converted to fp32 first, except
  // bf16 on a CPU with AVX512-BF16: its tiles are multiplied as bf16 (bf16_dot.h).
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  // K's words are whole where they lie (an even head dim, even strides from a 4-byte aligned
  // base): decoding can read its tiles in place (direct_keys below).
  const bool k_words_whole = p.head_dim % 2 == 0 && p.k_row_stride % 2 == 0 &&
                             p.k_head_stride % 2 == 0 && p.k_batch_stride % 2 == 0 &&
                             reinterpret_cast<uintptr_t>(p.k) % 4 == 0;
  // Where each key/value head serves a single query row (one token, no GQA group) only with K
  // read in place: packing K once per call is then as much traffic as the attention itself,
  // and the fp32 tiles were 1.3-1.9x faster than that (B = 4, H = H_kv = 8, S = 4096, d = 128,
  // one query; docs/perf/cpu.md).
  const bool dot = kBf16 && bf16dot::enabled() &&
                   (p.seqlen_q * (p.heads_q / p.heads_kv) > 1 || k_words_whole);
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const int64_t BQ = kBlockQ, BK = kBlockK;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const int64_t q_tiles = (p.seqlen_q + BQ - 1) / BQ;
  const int64_t group = p.heads_q / p.heads_kv;
  // Decoding with GQA/MQA (a few query rows per head): `heads` query heads of a group become
  // the rows of one tile, row r = (query i = r / heads, head hk * group + g0 + r % heads), so
  // that each key / value tile is read (and converted or packed) once per `heads` query heads,
  // not once per query head, and its GEMMs have that many times the rows.  The most heads the
  // tile's rows hold with which the busiest thread gets no more rows than without packing
  // (tasks of `heads` times the rows, fewer of them: a count just above a multiple of the
  // threads would leave the others idle; review: 1.1-1.2x slower at seqlen_q = 64 on two
  // threads before this rule), e.g. MQA at batch 1 on two threads: two tasks of 16 heads.
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t pairs = p.batch * p.heads_kv;
  const int64_t rows_unpacked = (p.batch * p.heads_q + threads - 1) / threads;  // x seqlen_q
  int64_t heads = 1;
  for (int64_t n = std::min(group, BQ / std::max<int64_t>(p.seqlen_q, 1)); n > 1; --n) {
    const int64_t tasks_n = pairs * ((group + n - 1) / n);
    if ((tasks_n + threads - 1) / threads * n <= rows_unpacked) {
      heads = n;
      break;
    }
  }
  const bool pack_gqa = heads > 1;
  const int64_t head_chunks = pack_gqa ? (group + heads - 1) / heads : 1;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<acc_t*>(p.softmax_lse);
  const acc_t out_scale = p.dropout ? acc_t(dropout_scale(p.dropout_p)) : acc_t(1);

  // Decoding (a task's rows at most kDirectKeyRows): S^T = K Q^T with the key tile's rows, as
  // they lie in the tensor, as the A operand (words of two bf16 adjacent along the head dim:
  // K's own layout) and Q^T packed as B, then S^T transposed (a few rows: cheap), instead of
  // K packed once per call.  With few rows each packed key is read by one task once, so
  // packing cost as much as the attention (perf, one thread, B = 1, 32:8, S = 4096, d = 128:
  // the packing 44% of the kernel's time; docs/perf/cpu.md).
  const int64_t max_rows = pack_gqa ? p.seqlen_q * heads : std::min(BQ, p.seqlen_q);
  const bool direct_keys = dot && k_words_whole && max_rows <= kDirectKeyRows;
  // On AMX tiles (brgemm has no alpha: a scaled product is a pass of its own over S, 8% of a
  // bf16 forward's time; docs/perf/cpu.md) plain scores are scaled in the softmax's max pass
  // instead (the same rounding), where nothing between the GEMM and the softmax reads them
  // scaled (no softcap, bias or ALiBi; the causal / window mask's -inf is the same either
  // way).
  // (Decided on the float the softmax multiplies by: a positive double below ~7e-46 is 0 in
  // float, and 0 times the mask's -inf is NaN; before the fold, the GEMM's 0 came first and
  // the mask after it.  A reviewer's finding.)
  const float scale_f = static_cast<float>(p.softmax_scale);
  const bool fold_scale = dot && bf16amx::enabled() && p.softcap == 0.0 &&
                          p.attn_bias == nullptr && p.alibi_slopes == nullptr && scale_f > 0.f &&
                          std::isfinite(scale_f);
  const float gemm_scale = fold_scale ? 1.f : scale_f;
  const acc_t softmax_scale = fold_scale ? acc_t(scale_f) : acc_t(1);
  PackedKeys keys;
  if constexpr (kBf16) {
    if (dot && !direct_keys) keys = pack_keys<scalar_t>(p, seqs);
  }
  const int64_t D2 = (D + 1) / 2;

  const int64_t tasks = pack_gqa ? pairs * head_chunks : p.batch * p.heads_q * q_tiles;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const bf16dot::ChunkGuard amx_state{dot};
    const bool conv = !kInPlace && !dot;
    LineVector<acc_t> q_buf(conv ? BQ * D : 0), k_buf(conv ? BK * D : 0),
        v_buf(conv ? BK * Dv : 0);
    // The bf16 path's packed words: the query tile, P, the key tile's V (bf16_dot.h).
    LineVector<uint32_t> q_words(dot ? BQ * D2 : 0), p_words(dot ? BQ * BK / 2 : 0),
        v_words(dot ? BK / 2 * Dv : 0);
    LineVector<float> st_buf(direct_keys ? BK * kDirectKeyRows : 0);  // S^T of a key tile
    LineVector<acc_t> s_buf(BQ * BK), o_acc(BQ * Dv);
    std::vector<acc_t> m(BQ), l(BQ), alpha(BQ);
    std::vector<scalar_t> q_rows(pack_gqa ? BQ * D : 0);  // the group's query rows, gathered
    std::vector<uint8_t> keep(p.dropout ? BK : 0);
    for (int64_t task = begin; task < end; ++task) {
      // This task's rows: (row_h(r), row_i(r)) for r < mq; i0 the first row's query.
      int64_t b, hk, h, i0, mq;
      int64_t gs = 1;  // packed: this task's query heads h .. h + gs - 1
      if (pack_gqa) {
        const int64_t chunk = task % head_chunks;
        hk = (task / head_chunks) % p.heads_kv;
        b = task / (head_chunks * p.heads_kv);
        h = hk * group + chunk * heads;
        gs = std::min(heads, group - chunk * heads);
        i0 = 0;
        mq = seqs.len_q(p, b) * gs;
        if (mq == 0) continue;
      } else {
        const int64_t tile = task % q_tiles;
        h = (task / q_tiles) % p.heads_q;
        b = task / (q_tiles * p.heads_q);
        hk = h / group;  // GQA: query head h reads key/value head h / group
        const int64_t len_q = seqs.len_q(p, b);
        i0 = tile * BQ;
        if (i0 >= len_q) continue;  // (packed: a sequence shorter than the longest)
        mq = std::min(BQ, len_q - i0);
      }
      // (unpacked: gs = 1, every row at head h; packed: i0 = 0)
      const auto row_h = [&](int64_t r) { return h + r % gs; };
      const auto row_i = [&](int64_t r) { return i0 + r / gs; };
      const VisibleKeys vis = seqs.visible(p, b);
      const scalar_t* q_tile = q + b * p.q_batch_stride + h * p.q_head_stride +
                               (seqs.first_q(b) + i0) * p.q_row_stride;
      int64_t q_ld = p.q_row_stride;
      if (pack_gqa) {
        for (int64_t r = 0; r < mq; ++r)
          std::copy_n(q + b * p.q_batch_stride + row_h(r) * p.q_head_stride +
                          (seqs.first_q(b) + row_i(r)) * p.q_row_stride,
                      D, q_rows.data() + r * D);
        q_tile = q_rows.data();
        q_ld = D;
      }
      const scalar_t* k_head = k + b * p.k_batch_stride + hk * p.k_head_stride +
                               seqs.first_k(b) * p.k_row_stride;
      const scalar_t* v_head = v + b * p.v_batch_stride + hk * p.v_head_stride +
                               seqs.first_k(b) * p.v_row_stride;
      // softcap, bias, ALiBi and the mask on S's rows, each at its own (head, query)
      const auto finish = [&](acc_t* S, int64_t nk, int64_t j0) {
        if (!pack_gqa) {
          finish_scores(S, mq, nk, p, vis, b, h, i0, j0);
          return;
        }
        for (int64_t r = 0; r < mq; ++r)
          finish_scores(S + r * BK, 1, nk, p, vis, b, row_h(r), row_i(r), j0);
      };

      std::fill(m.begin(), m.end(), -kInf);
      std::fill(l.begin(), l.end(), acc_t(0));
      std::fill(o_acc.begin(), o_acc.end(), acc_t(0));

      const int64_t key_begin = vis.begin(row_i(0)), key_end = vis.end(row_i(mq - 1));
      Mat<acc_t> qm{nullptr, 0};
      if (direct_keys) {  // B = Q^T (D2 x mq words)
        bf16dot::pack_transposed(q_words.data(), mq, reinterpret_cast<const uint16_t*>(q_tile),
                                 q_ld, mq, D);
      } else if (dot) {
        bf16dot::pack_rows(q_words.data(), D2, reinterpret_cast<const uint16_t*>(q_tile), q_ld,
                           mq, D);
      } else {
        qm = acc_view(q_tile, mq, D, q_ld, q_buf.data());
      }
      for (int64_t j0 = key_begin; j0 < key_end; j0 += BK) {
        const int64_t nk = std::min(BK, key_end - j0);
        acc_t* S = s_buf.data();
        Mat<acc_t> vm{nullptr, 0};
        if (dot) {
          if (direct_keys) {
            const auto* k_words = reinterpret_cast<const uint32_t*>(k_head + j0 * p.k_row_stride);
            bf16dot::gemm(st_buf.data(), mq, k_words, p.k_row_stride / 2, 1, q_words.data(), mq,
                          nk, mq, D2, gemm_scale, false);
            bf16dot::transpose(reinterpret_cast<float*>(S), BK, st_buf.data(), mq, nk, mq);
          } else {
            bf16dot::gemm(reinterpret_cast<float*>(S), BK, q_words.data(), D2, 1,
                          keys.at(p, seqs, b, hk) + j0, keys.rows, mq, nk, D2,
                          gemm_scale, false);
          }
          finish(S, nk, j0);
          // V's rows of this tile only (an odd tile pads with zero, never the next key).
          bf16dot::pack_interleaved(v_words.data(), Dv,
                                    reinterpret_cast<const uint16_t*>(v_head + j0 * p.v_row_stride),
                                    p.v_row_stride, nk, Dv);
        } else {
          const Mat<acc_t> km = acc_view(k_head + j0 * p.k_row_stride, nk, D, p.k_row_stride,
                                         k_buf.data());
          vm = acc_view(v_head + j0 * p.v_row_stride, nk, Dv, p.v_row_stride, v_buf.data());
          gemm(S, BK, qm, km.t(), mq, nk, D, p.softmax_scale, 0.0);  // (score_tile's)
          finish(S, nk, j0);
        }
        // bf16 tiles without dropout: P straight to the P V product's words (one pass over S
        // fewer, and no fp32 P written and read back; docs/perf/cpu.md)
        const bool to_words = dot && !p.dropout;
        if (to_words) {
          bf16dot::softmax_to_words(reinterpret_cast<const float*>(S), mq, nk, BK,
                                    static_cast<float>(softmax_scale),
                                    reinterpret_cast<float*>(m.data()),
                                    reinterpret_cast<float*>(l.data()),
                                    reinterpret_cast<float*>(alpha.data()), p_words.data(), BK / 2);
        } else {
          online_softmax_rows(S, mq, nk, BK, m.data(), l.data(), alpha.data(), softmax_scale);
        }
        if (p.dropout) {
          for (int64_t r = 0; r < mq; ++r) {
            dropout_keep(p.philox_seed, p.philox_offset, p.dropout_threshold,
                         seqs.dropout_row(p, b, row_h(r), row_i(r)), row_i(r), j0, nk,
                         keep.data());
            for (int64_t c = 0; c < nk; ++c)
              if (!keep[c]) S[r * BK + c] = acc_t(0);
          }
        }
        for (int64_t r = 0; r < mq; ++r) {
          if (alpha[r] == acc_t(1)) continue;
          acc_t* o = o_acc.data() + r * Dv;
          for (int64_t c = 0; c < Dv; ++c) o[c] *= alpha[r];
        }
        if (dot) {  // P rounded to bf16 (bf16_dot.h), as the CUDA kernels do
          if (!to_words)
            bf16dot::pack_rows(p_words.data(), BK / 2, reinterpret_cast<const float*>(S), BK, mq,
                               nk);
          bf16dot::gemm(reinterpret_cast<float*>(o_acc.data()), Dv, p_words.data(), BK / 2, 1,
                        v_words.data(), Dv, mq, Dv, (nk + 1) / 2, 1.f, true);
        } else {
          gemm(o_acc.data(), Dv, Mat<acc_t>{S, BK}, vm, mq, Dv, nk, 1.0, 1.0);
        }
      }

      for (int64_t r = 0; r < mq; ++r) {
        const int64_t i = row_i(r), hr = row_h(r);
        scalar_t* o = out + b * p.out_batch_stride + (seqs.first_q(b) + i) * p.out_row_stride +
                      hr * p.out_head_stride;
        const acc_t* acc = o_acc.data() + r * Dv;
        // No visible key: out = 0, lse = -inf.  (l = 0 too: a NaN score leaves m = -inf, as
        // the max skips it, but makes l NaN, and NaN must come out, not an empty row.)
        const bool empty = m[r] == -kInf && l[r] == acc_t(0);
        const acc_t inv_l = empty ? acc_t(0) : out_scale / l[r];
        for (int64_t c = 0; c < Dv; ++c) o[c] = static_cast<scalar_t>(acc[c] * inv_l);
        lse[seqs.lse_index(p, b, hr, i)] = empty ? -kInf : m[r] + std::log(l[r]);
      }
    }
  });
}

// With dropout, a fresh seed from PyTorch's CPU generator (torch.manual_seed reproduces it),
// into p and rng_state[0].
void draw_seed(FwdParams& p, at::Tensor& rng_state) {
  if (!p.dropout) return;
  at::CPUGeneratorImpl* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  p.philox_seed = gen->random64();
  p.philox_offset = 0;
  rng_state.data_ptr<int64_t>()[0] = static_cast<int64_t>(p.philox_seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool align_bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p, bool deterministic) {
  (void)deterministic;
  const AttnArgs a = check_attn_args(q_in, k_in, v_in, softmax_scale, causal, window_left,
                                     window_right, softcap, alibi_slopes, attn_bias, dropout_p);
  TORCH_CHECK_VALUE(q_in.device().is_cpu(), "flash_attn_ext CPU kernel got q on ", q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  at::Tensor out = new_output({a.batch, a.seqlen_q, a.heads_q, a.head_dim_v}, q.options());
  at::Tensor lse = new_output({a.batch, a.heads_q, a.seqlen_q},
                             q.options().dtype(lse_dtype(q.scalar_type())));
  at::Tensor rng_state = at::zeros({2}, q.options().dtype(at::kLong));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse, rng_state};

  FwdParams p;
  fill_fwd_params(p, a, q, k, v, out, lse, softcap, align_bottom_right);
  fill_dropout_params(p, dropout_p);
  draw_seed(p, rng_state);
  const at::Tensor bias_view = attn_bias.has_value()
                                   ? prepare_bias(*attn_bias, a, lse_dtype(q.scalar_type()), p,
                                                  /*keep_mask=*/true)
                                   : at::Tensor();
  const at::Tensor slopes = prepare_alibi(alibi_slopes, lse_dtype(q.scalar_type()), p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_fwd_cpu",
                                  [&] { flash_fwd_cpu<scalar_t>(p, Seqs{}); });
  return {out, lse, rng_state};
}

// Packed sequences (the fwd_varlen op, csrc/ops.cpp): the same kernel over varlen_cpu.h's
// geometry.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_varlen_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    double dropout_p, const std::optional<at::Tensor>& seqused_k, bool /*deterministic*/) {
  const PackedCall c = check_packed_call(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, seqused_k);
  const at::Tensor &q = c.q, &k = c.k, &v = c.v;
  const AttnArgs& a = c.a;
  const Packed& pk = c.pk;
  // Rows outside every sequence: out 0, lse -inf.
  at::Tensor out = at::zeros({1, a.seqlen_q, a.heads_q, a.head_dim_v}, q.options());
  at::Tensor lse = at::full({a.heads_q, a.seqlen_q}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(lse_dtype(q.scalar_type())));
  at::Tensor rng_state = at::zeros({2}, q.options().dtype(at::kLong));
  if (pk.batch == 0 || a.heads_q == 0) return {out.squeeze(0), lse, rng_state};

  FwdParams p;
  fill_fwd_params(p, a, q, k, v, out, lse, softcap, true);
  make_packed(p, pk, max_seqlen_q, max_seqlen_k);
  fill_dropout_params(p, dropout_p);
  draw_seed(p, rng_state);
  const at::Tensor slopes = prepare_alibi(alibi_slopes, lse_dtype(q.scalar_type()), p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_fwd_cpu",
                                  [&] { flash_fwd_cpu<scalar_t>(p, host_seqs(pk)); });
  return {out.squeeze(0), lse, rng_state};
}

}  // namespace

}  // namespace flash_attn_ext::cpu

// The packed-sequence ops' schemas are defined here, next to their CPU kernels (the CUDA ones
// register in csrc/cuda/flash_cuda.cu); the dense ops' schemas are in csrc/ops.cpp.
TORCH_LIBRARY_FRAGMENT(flash_attn_ext, m) {
  // Packed sequences (FlashAttention-2's varlen): q (total_q, H, D), k (total_k, H_kv, D),
  // v (total_k, H_kv, Dv); sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (keys:
  // cu_seqlens_k), int32; max_seqlen_q/k at least the longest; seqused_k (batch,) int32: only
  // the first seqused_k[b] keys of sequence b are used (FlashAttention's).  Causal bottom-right
  // per sequence (over the keys used).  Returns (out (total_q, H, Dv), softmax_lse (H,
  // total_q), rng_state); rows outside every sequence get out = 0, lse = -inf and zero
  // gradients.  CPU and CUDA kernels.  bwd_varlen's dsoftmax_lse: the gradient flowing into
  // softmax_lse ((H, total_q) like it, or None), folded into delta as the dense bwd op does.
  // deterministic (or torch.use_deterministic_algorithms(True)): bitwise-reproducible
  // gradients (on sm_90 the portable backward instead of the Hopper one, whose dQ adds come
  // in any order); the forward takes it only to hand it to the backward (autograd).
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "float dropout_p=0.0, Tensor? seqused_k=None, bool deterministic=False) -> (Tensor out, "
      "Tensor softmax_lse, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
      "Tensor rng_state, float? softmax_scale=None, bool causal=False, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "float dropout_p=0.0, Tensor? seqused_k=None, Tensor? dsoftmax_lse=None, "
      "bool deterministic=False) -> "
      "(Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_attn_ext, CPU, m) {
  m.impl("fwd", &flash_attn_ext::cpu::fwd_cpu);
  m.impl("fwd_varlen", &flash_attn_ext::cpu::fwd_varlen_cpu);
}
