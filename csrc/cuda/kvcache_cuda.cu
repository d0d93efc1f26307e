// CUDA glue for decoding against a KV cache (flash_attn_with_kvcache): the fwd_kvcache op (the
// split-KV decode kernel and its combine kernel, kernels/sm80/flash_decode_kernel.cuh) and the
// kvcache_append op (new keys / values written into the cache in place, the keys rotated).
// Schemas in ops.cpp.  Nothing here reads a tensor's values on the host: the lengths, entries
// and pages are read by the kernels, which return NaN rows for values that break a rule
// (params.h: DecodeParams), so a call never synchronises and can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "checks.h"
#include "kernel_select.h"  // kernel_options
#include "kernels/sm80/flash_decode_launch.h"
#include "kernels/sm80/launch.h"  // per_device_cached, multiprocessor_count

namespace flash_attn_ext::cuda {

namespace {

constexpr int kMaxSplits = sm80::kMaxDecodeSplits;  // the combine kernel's limit

// A 16-bit floating tensor the kernels read in place: 16-byte aligned rows of a contiguous
// last dimension (the caches are never copied: the append writes into them).
void check_in_place(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must have 4 dimensions, got shape ", t.sizes());
  bool aligned = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) aligned = aligned && (t.size(i) <= 1 || t.stride(i) % 8 == 0);
  TORCH_CHECK_VALUE(aligned, name, " must have a contiguous last dimension, strides that are "
                    "multiples of 8 elements and a 16-byte aligned start (read in place), got "
                    "strides ", t.strides());
}

// cache_seqlens and the other per-batch-row int32 tensors: (batch,) int32 on q's device.
const int32_t* int32_rows(const std::optional<at::Tensor>& t, const char* name, int64_t rows,
                          const at::Tensor& q) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == rows &&
                        t->device() == q.device() && t->is_contiguous(),
                    name, " must be a contiguous (batch,) = (", rows, ",) int32 tensor on ",
                    q.device(), ", got ", dtype_name(t->scalar_type()), " of shape ", t->sizes(),
                    " on ", t->device());
  return t->data_ptr<int32_t>();
}

// Fills what fwd_kvcache and kvcache_append share: the caches, the lengths, entries and pages.
void fill_cache_params(DecodeParams& p, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                       const std::optional<at::Tensor>& cache_batch_idx,
                       const std::optional<at::Tensor>& block_table, int64_t batch) {
  TORCH_CHECK_VALUE(k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16,
                    "k_cache must be float16 or bfloat16 (the CUDA decode kernels), got ",
                    dtype_name(k_cache.scalar_type()));
  TORCH_CHECK_VALUE(v_cache.scalar_type() == k_cache.scalar_type() &&
                        q.scalar_type() == k_cache.scalar_type(),
                    "q, k_cache and v_cache must have one dtype, got ", dtype_name(q.scalar_type()),
                    ", ", dtype_name(k_cache.scalar_type()), ", ", dtype_name(v_cache.scalar_type()));
  TORCH_CHECK_VALUE(k_cache.device() == q.device() && v_cache.device() == q.device(),
                    "k_cache and v_cache must be on q's device ", q.device());
  check_in_place(k_cache, "k_cache");
  check_in_place(v_cache, "v_cache");
  TORCH_CHECK_VALUE(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3),
                    "v_cache must match k_cache in its first three dimensions, got ",
                    v_cache.sizes(), " and ", k_cache.sizes());
  p.batch = batch;
  p.heads_kv = k_cache.size(2);
  p.head_dim = k_cache.size(3);
  p.head_dim_v = v_cache.size(3);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  set_strides(k_cache, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(v_cache, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  p.num_entries = k_cache.size(0);
  p.cache_seqlens = int32_rows(cache_seqlens, "cache_seqlens", batch, q);
  p.cache_batch_idx = int32_rows(cache_batch_idx, "cache_batch_idx", batch, q);
  if (block_table.has_value()) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == batch &&
                          bt.device() == q.device() && bt.stride(1) == 1,
                      "block_table must be a (batch, max_num_blocks) = (", batch,
                      ", ...) int32 tensor on ", q.device(), " with unit-stride rows, got ",
                      dtype_name(bt.scalar_type()), " of shape ", bt.sizes());
    TORCH_CHECK_VALUE(!cache_batch_idx.has_value(),
                      "cache_batch_idx cannot be used with block_table (paged KV)");
    p.block_table = bt.data_ptr<int32_t>();
    p.block_table_stride = bt.stride(0);
    p.page_size = k_cache.size(1);
    p.seqlen_cache = k_cache.size(1) * bt.size(1);
  } else {
    p.page_size = p.seqlen_cache = k_cache.size(1);
  }
}

// A device attribute of the current GPU, queried once per device.
int major_version() {
  return sm80::per_device_cached([](int device) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess
               ? v
               : 0;
  });
}
// Split-KV (FlashAttention-2's num_splits_heuristic, with thresholds from our sweep,
// docs/perf/decode.md "The split count") over `slots` CTAs: two per SM at head dims up to 128,
// one at 256, the CTAs that saturate the memory bandwidth (measured: counting the kernel's
// whole occupancy instead, 3-4 per SM at head dim 64, made more splits and ran 5-35% slower at
// all but one point; "The slots").  Each split covers at least 256 keys of the cache's capacity
// (the lengths are not read on the host) and at most kMaxSplits are taken (the combine's per-row
// warps).
// - Where one wave of every allowed split cannot fill the slots (MQA at batch 1: one CTA per
//   split), every allowed split: bandwidth grew in proportion to the CTAs there (each reads at a
//   rate of its own), and FlashAttention-2's 85% rule left 14% on the table.
// - Else the smallest count within 95% of the best wave efficiency: the 85% rule's 29 of 33
//   splits left 24 of 264 slots empty and measured 8-9% below the full wave.
// - Then, where `resident` (the CTAs the GPU holds at once: the kernel's occupancy times the
//   SMs; 0 if unknown) exceeds the slots, a grid past it that ends in a partial wave there
//   (under 90% full) is cut to its whole waves.  (Where it equals the slots the rule above
//   already weighed those waves; where it is smaller, whole waves of the slots stay whole.)  At head dim 64 the 32-row kernel holds 3 per SM, so MQA B = 48 took 11 splits
//   (528 CTAs: two waves of 264, but 1.33 waves of the 396 that run at once, 186 us) where 8
//   (384, one wave) take 153 us.
int64_t heuristic_splits(int64_t ctas, int64_t seqlen_cache, int64_t slots, int64_t resident) {
  slots = std::max<int64_t>(slots, 1);
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, (seqlen_cache + 255) / 256));
  if (ctas <= 0 || ctas >= slots || most == 1) return 1;
  int64_t splits = most;
  if (ctas * most > slots) {
    auto efficiency = [&](int64_t s) {
      const double waves = static_cast<double>(ctas * s) / static_cast<double>(slots);
      return waves / std::ceil(waves);
    };
    double best = 0.0;
    for (int64_t s = 1; s <= most; ++s) best = std::max(best, efficiency(s));
    for (splits = 1; splits < most; ++splits)
      if (efficiency(splits) >= 0.95 * best) break;
  }
  if (resident > slots && resident >= ctas && ctas * splits > resident) {
    const double waves = static_cast<double>(ctas * splits) / static_cast<double>(resident);
    if (waves / std::ceil(waves) < 0.9)
      splits = std::max<int64_t>(1, static_cast<int64_t>(std::floor(waves)) * resident / ctas);
  }
  return splits;
}

template <typename Fn>
auto by_dtype(const at::Tensor& t, Fn fn) {
  return t.scalar_type() == at::kBFloat16 ? fn(__nv_bfloat16{}) : fn(__half{});
}

// fn(element, head-dim constant) for the decode instantiation of q's dtype and the head dim
// padded up to 64, 128 or 256.
template <typename Fn>
auto by_decode_instance(const at::Tensor& q, int64_t head_dim, Fn fn) {
  return by_dtype(q, [&](auto element) {
    return head_dim <= 64    ? fn(element, std::integral_constant<int, 64>{})
           : head_dim <= 128 ? fn(element, std::integral_constant<int, 128>{})
                             : fn(element, std::integral_constant<int, 256>{});
  });
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    int64_t seqlen_new, int64_t rotary_rows, int64_t seqlen_ro,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  TORCH_CHECK_VALUE(q_in.dim() == 4, "q must be (batch, seqlen_q, num_heads, head_dim), got ",
                    q_in.sizes());
  const c10::cuda::CUDAGuard guard(q_in.device());
  TORCH_CHECK_NOT_IMPLEMENTED(major_version() >= 8, "flash_attn_with_kvcache's CUDA kernels "
                              "need compute capability 8.0 or newer, got major version ",
                              major_version());
  const int64_t batch = q_in.size(0), seqlen_q = q_in.size(1), heads_q = q_in.size(2);
  DecodeParams p;
  fill_cache_params(p, q_in, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, batch);
  TORCH_CHECK_VALUE(p.head_dim == q_in.size(3) && p.head_dim == p.head_dim_v &&
                        p.head_dim % 8 == 0 && p.head_dim <= kMaxHeadDim,
                    "the decode kernels take q, k_cache and v_cache of one head_dim, a multiple "
                    "of 8 up to ", kMaxHeadDim, ", got ", q_in.size(3), ", ", p.head_dim, ", ",
                    p.head_dim_v);
  TORCH_CHECK_VALUE(p.heads_kv >= 1 && heads_q % p.heads_kv == 0,
                    "the number of query heads must be a multiple of the number of key/value "
                    "heads (GQA/MQA), got num_heads q.shape[2]=", heads_q,
                    " and num_heads_k k_cache.shape[2]=", p.heads_kv);
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "window_size must be >= -1 on each side (-1 = unbounded), got (",
                    window_left, ", ", window_right, ")");
  TORCH_CHECK_VALUE(num_splits >= 0, "num_splits must be >= 0 (0 = heuristic), got ", num_splits);
  TORCH_CHECK_VALUE(seqlen_new >= 0 && rotary_rows >= 0, "seqlen_new and rotary_rows must be >= 0");
  // q is read by 16-byte copies: a view that is not aligned so is copied (clone: contiguous()
  // would return an already contiguous but misaligned view unchanged).
  const bool q_aligned = q_in.stride(3) == 1 && q_in.stride(1) % 8 == 0 &&
                         q_in.stride(2) % 8 == 0 && q_in.stride(0) % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(q_in.data_ptr()) % 16 == 0;
  const at::Tensor q = q_aligned ? q_in : q_in.clone(at::MemoryFormat::Contiguous);
  at::Tensor out = new_output({batch, seqlen_q, heads_q, p.head_dim_v}, q.options());
  at::Tensor lse = new_output({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
  if (batch == 0 || seqlen_q == 0 || heads_q == 0) return {out, lse};
  p.cache_leftpad = int32_rows(cache_leftpad, "cache_leftpad", batch, q);
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.softmax_lse = lse.data_ptr();
  p.seqlen_q = seqlen_q;
  p.heads_q = heads_q;
  set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(out, p.out_batch_stride, p.out_row_stride, p.out_head_stride);
  p.softmax_scale = softmax_scale.has_value() ? *softmax_scale
                                              : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  TORCH_CHECK_VALUE(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0,
                    "the decode kernels take a finite softmax_scale > 0, got ", p.softmax_scale);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "softcap must be finite and >= 0 (0 = off), got ", softcap);
  p.softcap = softcap;
  // Windows past the cache are unbounded (keeps i + offset +- window inside int32 in the
  // kernel's per-row bounds).
  const int64_t covers_all = seqlen_q + p.seqlen_cache;
  p.window_left = window_left > covers_all ? -1 : window_left;
  p.window_right = causal ? 0 : (window_right > covers_all ? -1 : window_right);
  p.align_bottom_right = true;
  p.seqlen_new = seqlen_new;
  p.rotary_rows = rotary_rows;
  p.seqlen_ro = seqlen_ro;
  at::Tensor slopes;
  if (alibi_slopes.has_value()) {
    const bool per_head = alibi_slopes->dim() == 1 && alibi_slopes->size(0) == heads_q;
    const bool per_row = alibi_slopes->dim() == 2 && alibi_slopes->size(0) == batch &&
                         alibi_slopes->size(1) == heads_q;
    TORCH_CHECK_VALUE((per_head || per_row) && alibi_slopes->device() == q.device() &&
                          at::isFloatingType(alibi_slopes->scalar_type()),
                      "alibi_slopes must be a floating (num_heads,) = (", heads_q,
                      ",) or (batch, num_heads) tensor on ", q.device(), ", got shape ",
                      alibi_slopes->sizes());
    slopes = prepare_alibi(alibi_slopes, at::kFloat, p);
  }
  const int64_t rows = seqlen_q * (heads_q / p.heads_kv);
  const int64_t rows_per_cta =
      sm80::decode_block_rows(static_cast<int>(p.head_dim), rows, batch * p.heads_kv,
                              kernel_options().decode_block_rows);
  p.block_rows = static_cast<int32_t>(rows_per_cta);
  const int64_t m_blocks = (rows + rows_per_cta - 1) / rows_per_cta;
  const int64_t ctas = batch * p.heads_kv * m_blocks;
  // (the kernel choice's inputs before the occupancy query asks which kernel runs)
  p.row_lanes = kernel_options().decode_row_lanes;
  p.contiguous_loads = kernel_options().decode_contiguous_loads;
  int64_t splits = num_splits;
  if (splits <= 0) {
    // The resident CTAs: this kernel's CTAs per SM (its occupancy; the kernel option for A/Bs)
    // times the SMs, which only trims a partial last wave (heuristic_splits).
    int per_sm = kernel_options().decode_ctas_per_sm;
    if (per_sm <= 0)
      per_sm = by_decode_instance(q, p.head_dim, [&](auto element, auto dim) {
        return sm80::run_flash_decode_ctas_per_sm<decltype(element), decltype(dim)::value>(p);
      });
    const int64_t sms = std::max(sm80::multiprocessor_count(), 1);
    splits = heuristic_splits(ctas, p.seqlen_cache, (p.head_dim > 128 ? 1 : 2) * sms,
                              std::max(per_sm, 0) * sms);  // (a failed query: 0, no trim)
  }
  p.num_splits = static_cast<int>(std::clamp<int64_t>(splits, 1, kMaxSplits));
  // (The kernel's packed rows and its grid index are 32-bit: FastDiv's range.)
  TORCH_CHECK_VALUE(rows < (int64_t{1} << 31) && ctas * p.num_splits < (int64_t{1} << 31),
                    "the decode kernels take seqlen_q * num_heads / num_heads_k < 2^31 and "
                    "batch * num_heads_k * num_splits * ceil(that / ", rows_per_cta,
                    ") < 2^31, got seqlen_q = ", seqlen_q, ", num_heads = ", heads_q,
                    ", num_heads_k = ", p.heads_kv, ", batch = ", batch, ", num_splits = ",
                    p.num_splits);
  p.group_div = FastDiv(heads_q / p.heads_kv);
  p.m_blocks_div = FastDiv(m_blocks);
  p.splits_div = FastDiv(p.num_splits);
  p.heads_kv_div = FastDiv(p.heads_kv);
  p.pdl = kernel_options().decode_pdl;
  p.combine_splits_per_warp = kernel_options().decode_combine_splits;
  at::Tensor out_accum, stats_accum;
  if (p.num_splits > 1) {
    out_accum = at::empty({p.num_splits, batch, heads_q, seqlen_q, p.head_dim_v},
                          q.options().dtype(at::kFloat));
    stats_accum =
        at::empty({2, p.num_splits, batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
    p.out_accum = out_accum.data_ptr<float>();
    p.max_accum = stats_accum[0].data_ptr<float>();
    p.sum_accum = stats_accum[1].data_ptr<float>();
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(by_decode_instance(q, p.head_dim, [&](auto element, auto dim) {
    return sm80::run_flash_decode<decltype(element), decltype(dim)::value>(p, stream);
  }));
  // (No exact pass after it, cuda/exact_rows.h: the decode kernels form exponents and LSEs
  // exactly themselves.)
  return {out, lse};
}

void kvcache_append_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& cache_seqlens,
                         const std::optional<at::Tensor>& cache_batch_idx,
                         const std::optional<at::Tensor>& block_table,
                         const std::optional<at::Tensor>& rotary_cos,
                         const std::optional<at::Tensor>& rotary_sin, bool rotary_interleaved) {
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.sizes().slice(0, 3) == v.sizes().slice(0, 3),
                    "k and v must be (batch, seqlen_new, num_heads_k, head_dim), got ", k.sizes(),
                    " and ", v.sizes());
  const c10::cuda::CUDAGuard guard(k.device());
  const int64_t batch = k.size(0);
  DecodeParams p;
  fill_cache_params(p, k, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, batch);
  TORCH_CHECK_VALUE(k.size(2) == p.heads_kv && k.size(3) == p.head_dim &&
                        v.size(3) == p.head_dim_v && v.scalar_type() == k.scalar_type() &&
                        v.device() == k.device(),
                    "k and v must be (batch, seqlen_new, num_heads_k, head_dim) with the caches' "
                    "heads, head dims and dtype, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(k.stride(3) == 1 && v.stride(3) == 1,
                    "k and v must have a contiguous last dimension");
  p.seqlen_new = k.size(1);
  if (batch == 0 || p.seqlen_new == 0) return;
  p.k_new = k.data_ptr();
  p.v_new = v.data_ptr();
  set_strides(k, p.knew_batch_stride, p.knew_row_stride, p.knew_head_stride);
  set_strides(v, p.vnew_batch_stride, p.vnew_row_stride, p.vnew_head_stride);
  at::Tensor cos, sin;
  if (rotary_cos.has_value()) {
    TORCH_CHECK_VALUE(rotary_sin.has_value() && rotary_cos->dim() == 2 &&
                          rotary_cos->sizes() == rotary_sin->sizes() &&
                          2 * rotary_cos->size(1) <= p.head_dim &&
                          rotary_cos->device() == k.device() && rotary_sin->device() == k.device(),
                      "rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) with "
                      "rotary_dim <= head_dim, on k's device");
    cos = rotary_cos->to(at::kFloat).contiguous();
    sin = rotary_sin->to(at::kFloat).contiguous();
    p.rotary_cos = cos.data_ptr<float>();
    p.rotary_sin = sin.data_ptr<float>();
    p.rotary_dim = 2 * cos.size(1);
    p.seqlen_ro = cos.size(0);
    p.rotary_rows = p.seqlen_new;
    p.rotary_interleaved = rotary_interleaved;
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(by_dtype(k, [&](auto element) {
    return sm80::run_kvcache_append<decltype(element)>(p, stream);
  }));
}

}  // namespace

}  // namespace flash_attn_ext::cuda

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd_kvcache", &flash_attn_ext::cuda::fwd_kvcache_cuda);
  m.impl("kvcache_append", &flash_attn_ext::cuda::kvcache_append_cuda);
}
