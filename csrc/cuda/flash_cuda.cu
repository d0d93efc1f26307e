// CUDA glue for flash_attn_ext::fwd and ::bwd: validate, make the inputs kernel-ready (16-byte
// aligned rows, head dims padded to a multiple of 8 only where needed), allocate the outputs, pick
// the instantiation by (head dim, dtype) and launch on the current stream.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "checks.h"
#include "cuda/exact_rows.h"
#include "dropout.h"
#include "kernels/sm80/flash_bwd_launch.h"
#include "kernels/sm80/flash_fwd_launch.h"
#include "kernels/sm80/launch.h"  // max_smem_optin_per_block (what the launchers test)
#include "kernel_select.h"
#include "mask.h"
#include "varlen_checks.h"
#ifdef FLASH_ATTN_EXT_SM90
#include "kernels/sm90/bias_blocks.h"
#include "kernels/sm90/flash_bwd_sm90_launch.h"
#include "kernels/sm90/flash_fwd_sm90_launch.h"
#endif

namespace flash_attn_ext::cuda {

namespace {

constexpr int64_t kVecElems = 8;  // one 16-byte cp.async of fp16/bf16

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The kernel reads 16-byte chunks: every stride and the base address must be a multiple of
// 8 elements, the last dimension contiguous and padded to a multiple of 8.  Tensors that already
// are (the common case) pass through untouched; others are copied once, zero-padded.
at::Tensor kernel_ready(const at::Tensor& t) {
  const int64_t d = t.size(3);
  const bool aligned = t.stride(3) == 1 && d % kVecElems == 0 &&
                       t.stride(0) % kVecElems == 0 && t.stride(1) % kVecElems == 0 &&
                       t.stride(2) % kVecElems == 0 &&
                       reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  if (aligned) return t;
  const int64_t padded = round_up(d, kVecElems);
  at::Tensor out = at::zeros({t.size(0), t.size(1), t.size(2), padded}, t.options());
  out.narrow(3, 0, d).copy_(t);
  return out;
}

// The instantiation for the padded head dim (64, 128 or 256) of head_dim = max(d_qk, d_v).
// The forward's Philox (seed, offset) from PyTorch's CUDA generator (torch.manual_seed reproduces
// it), advanced by the counters one call uses; under CUDA-graph capture the generator hands out
// device pointers that each replay updates, which the kernel reads (and writes to rng_state).
void take_philox_state(FwdParams& p, int64_t seqlen_k) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(dropout_counters_per_row(seqlen_k));
  }
  if (state.captured_) {
    p.philox_seed_ptr = state.seed_.ptr;
    p.philox_offset_ptr = state.offset_.ptr;
    p.philox_offset_intragraph = state.offset_intragraph_;
  } else {
    p.philox_seed = state.seed_.val;
    p.philox_offset = state.offset_.val;
  }
}

// The GPU the call runs on, as kernel_select.h reads it (queried once per device).
DeviceInfo current_device_info() {
  DeviceInfo d;
  const int capability = sm80::per_device_cached([](int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return 0;
    return major * 10 + minor;
  });
  TORCH_CHECK(capability > 0, "flash_attn_ext: could not read the GPU's compute capability");
  d.major = capability / 10;
  d.minor = capability % 10;
  d.smem_optin = sm80::max_smem_optin_per_block();
  return d;
}

BuildInfo this_build() {
  BuildInfo b;
  b.cuda = true;
#ifdef FLASH_ATTN_EXT_SM90
  b.sm90 = true;
#endif
#ifdef FLASH_ATTN_EXT_CUDA_ARCHS
  b.archs = FLASH_ATTN_EXT_CUDA_ARCHS;
#endif
  return b;
}

TensorDesc describe(const at::Tensor& t) {
  TensorDesc d;
  for (int i = 0; i < 4; ++i) {
    d.size[i] = t.size(i);
    d.stride[i] = t.stride(i);
  }
  return d;
}

// kernel_select.h's answer for a call (the inputs as the caller passed them, before
// kernel_ready), or an error that gives the rule's reasons where no fused kernel serves it
// (flash_attn_ext's Python layer sends such calls to its fallback and reports them).
KernelChoice select_for(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const AttnArgs& a, int score_mods, bool deterministic,
                        const KernelOptions& options, bool packed = false,
                        const std::optional<at::Tensor>& attn_bias = std::nullopt) {
  CallInfo call;
  call.dtype = q.scalar_type() == at::kBFloat16 ? "bf16"
               : q.scalar_type() == at::kHalf   ? "fp16"
               : q.scalar_type() == at::kFloat  ? "fp32"
                                                : "fp64";
  call.has_scale = true;
  call.softmax_scale = a.softmax_scale;
  call.head_dim = a.head_dim;
  call.head_dim_v = a.head_dim_v;
  call.q = describe(q);
  call.k = describe(k);
  call.v = describe(v);
  call.score_mods = score_mods;
  call.unequal_tiles = a.window_left >= 0 || a.window_right >= 0;
  // (broadcastable to (B, H, L, S): its rows differ where its query dimension has more than
  // one element in memory)
  call.bias_rows_differ = attn_bias.has_value() && attn_bias->dim() >= 2 &&
                          attn_bias->size(-2) > 1 && attn_bias->stride(-2) != 0;
  call.deterministic = deterministic || at::globalContext().deterministicAlgorithms();
  call.packed = packed;
  KernelChoice c = select_cuda_kernels(this_build(), current_device_info(), call, options);
  TORCH_CHECK_NOT_IMPLEMENTED(c.fused, "no flash_attn_ext CUDA kernel serves this call: ",
                              detail::join(c.reasons, "; "));
  return c;
}

// The ScoreMod bits (kernel_select.h) of a call.
int score_mods_of(double softcap, const std::optional<at::Tensor>& bias, double dropout_p,
                  bool bias_grad, bool alibi) {
  // (A dropout_p that rounds to 0 drops nothing and the kernels run without dropout: dropout.h.)
  const bool mask = bias.has_value() && bias->scalar_type() == at::kBool;
  return (softcap > 0.0 ? kSoftcap : 0) | (bias.has_value() ? kBias : 0) | (mask ? kMask : 0) |
         (dropout_active(dropout_p) ? kDropout : 0) |
         (bias_grad ? kBiasGrad : 0) | (alibi ? kAlibi : 0);
}

#ifdef FLASH_ATTN_EXT_SM90
// The Hopper kernels' block summary of p's bias (kernels/sm90/bias_blocks.h), in a tensor the
// caller keeps until its kernels are queued; an empty tensor without a bias (or with the kernel
// option sm90_bias_blocks off).
// what: also a boolean mask's rows as key intervals (the forward's mask variant) or its keys
// as row intervals (the backward's).
at::Tensor summarize_bias(FwdParams& p, const at::TensorOptions& options, cudaStream_t stream,
                          sm90::MaskIntervals what) {
  if (p.attn_bias == nullptr || !kernel_options().sm90_bias_blocks) return at::Tensor();
  at::Tensor blocks = at::empty({sm90::bias_summary_bytes(p, what)}, options.dtype(at::kByte));
  C10_CUDA_CHECK(sm90::summarize_bias(p, blocks.data_ptr<uint8_t>(), stream, what));
  return blocks;
}

// f(std::integral_constant<int, d>{}) for the instantiated head dim d (64, 128 or 256) that
// head_dim pads up to.
template <typename F>
cudaError_t by_head_dim(int64_t head_dim, F&& f) {
  if (head_dim <= 64) return f(std::integral_constant<int, 64>{});
  if (head_dim <= 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 256>{});
}

// The Hopper forward's instantiation for p, as kernel_select.h's rule chose it (its variant
// names in the comments).
template <typename Element>
cudaError_t run_fwd_sm90(int64_t head_dim, const FwdParams& p, cudaStream_t stream) {
  return by_head_dim(head_dim, [&](auto d) -> cudaError_t {
    constexpr int D = decltype(d)::value;
    if (p.cu_seqlens_q != nullptr) {  // packed sequences (no bias; one modifier at most)
      if (p.softcap_only()) return sm90::run_flash_fwd_sm90_varlen_softcap<Element, D>(p, stream);
      if (p.alibi_only()) return sm90::run_flash_fwd_sm90_varlen_alibi<Element, D>(p, stream);
      if (p.dropout) return sm90::run_flash_fwd_sm90_varlen_dropout<Element, D>(p, stream);
      return sm90::run_flash_fwd_sm90_varlen<Element, D>(p, stream);
    }
    // (_mask: a boolean mask alone, kernel_select.h's mask_alone; kernel_select.h keeps GQA
    // packing off every variant below but the plain one)
    if (p.bias_is_mask) return sm90::run_flash_fwd_sm90_mask<Element, D>(p, stream);
    if (p.softcap_only()) return sm90::run_flash_fwd_sm90_softcap<Element, D>(p, stream);
    if (p.alibi_only()) return sm90::run_flash_fwd_sm90_alibi<Element, D>(p, stream);
    // (_general: softcap, bias, ALiBi, and dropout with them)
    if (p.score_mods()) return sm90::run_flash_fwd_sm90_general<Element, D>(p, stream);
    if (p.dropout) return sm90::run_flash_fwd_sm90_dropout<Element, D>(p, stream);
    if (p.sm90_pack_gqa) return sm90::run_flash_fwd_sm90_packgqa<Element, D>(p, stream);
    return sm90::run_flash_fwd_sm90<Element, D>(p, stream);
  });
}
// The same for the Hopper backward.
template <typename Element>
cudaError_t run_bwd_sm90(int64_t head_dim, const BwdParams& p, float* stats,
                         cudaStream_t stream) {
  return by_head_dim(head_dim, [&](auto d) -> cudaError_t {
    constexpr int D = decltype(d)::value;
    if (p.cu_seqlens_q != nullptr) {  // packed sequences (no bias; one modifier at most)
      if (p.softcap_only())
        return sm90::run_flash_bwd_sm90_varlen_softcap<Element, D>(p, stats, stream);
      if (p.alibi_only())
        return sm90::run_flash_bwd_sm90_varlen_alibi<Element, D>(p, stats, stream);
      if (p.dropout) return sm90::run_flash_bwd_sm90_varlen_dropout<Element, D>(p, stats, stream);
      return sm90::run_flash_bwd_sm90_varlen<Element, D>(p, stats, stream);
    }
    if (p.bias_is_mask) return sm90::run_flash_bwd_sm90_mask<Element, D>(p, stats, stream);
    if (p.softcap_only()) return sm90::run_flash_bwd_sm90_softcap<Element, D>(p, stats, stream);
    if (p.alibi_only()) return sm90::run_flash_bwd_sm90_alibi<Element, D>(p, stats, stream);
    if (p.score_mods()) {  // (the general variant: up to head dim 128, kernel_select.h)
      if constexpr (D <= 128) return sm90::run_flash_bwd_sm90_general<Element, D>(p, stats, stream);
      return cudaErrorInvalidValue;
    }
    if (p.dropout) return sm90::run_flash_bwd_sm90_dropout<Element, D>(p, stats, stream);
    return sm90::run_flash_bwd_sm90<Element, D>(p, stats, stream);
  });
}
#endif

template <typename Element>
cudaError_t run_fwd(int64_t head_dim, const FwdParams& p, cudaStream_t stream) {
  if (head_dim <= 64) return sm80::run_flash_fwd<Element, 64>(p, stream);
  if (head_dim <= 128) return sm80::run_flash_fwd<Element, 128>(p, stream);
  return sm80::run_flash_fwd<Element, 256>(p, stream);
}
template <typename Element>
cudaError_t run_bwd(int64_t head_dim, const BwdParams& p, float* delta, cudaStream_t stream) {
  if (head_dim <= 64) return sm80::run_flash_bwd<Element, 64>(p, delta, stream);
  if (head_dim <= 128) return sm80::run_flash_bwd<Element, 128>(p, delta, stream);
  return sm80::run_flash_bwd<Element, 256>(p, delta, stream);
}

#ifdef FLASH_ATTN_EXT_SM90
// A table of VarlenTile entries, the heaviest first (stable: equal weights keep the order they
// were found in; `ordered`: as they are, the caller has ordered them), then `extra` int32
// values, in one pinned buffer copied to q's device on the call's stream (no synchronisation;
// the host allocator keeps the block until the copy is done).  Returns the device copy: the
// entries, then the extra values.
at::Tensor upload_varlen_table(std::vector<std::pair<int64_t, VarlenTile>>& tiles,
                               const std::vector<int32_t>& extra, const at::Tensor& q,
                               bool ordered = false) {
  if (!ordered)
    std::stable_sort(tiles.begin(), tiles.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
  constexpr int64_t kInts = sizeof(VarlenTile) / sizeof(int32_t);
  const int64_t tile_ints = static_cast<int64_t>(tiles.size()) * kInts;
  at::Tensor host = at::empty({tile_ints + static_cast<int64_t>(extra.size())},
                              at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  auto* out = reinterpret_cast<VarlenTile*>(host.data_ptr<int32_t>());
  for (size_t i = 0; i < tiles.size(); ++i) out[i] = tiles[i].second;
  std::copy(extra.begin(), extra.end(), host.data_ptr<int32_t>() + tile_ints);
  return host.to(q.options().dtype(at::kInt), /*non_blocking=*/true);
}

// The Hopper forward's tiles for packed sequences (FwdParams::sm90_varlen_tiles), from the
// offsets check_packed read on the host: every query block of block_m rows of every non-empty
// sequence, so that no CTA visits a block past its sequence's end.  Each sequence's blocks
// together, the heaviest (most key tiles: under a causal mask the last ones) first, the
// sequences by their heaviest block (the longest first), as the dense kernel's longest-first
// order within its (batch, head) sections, so that the dynamic schedule ends on short tiles
// and the CTAs running at once share a sequence's K and V (the launcher's sections of heads).
// p.sm90_varlen_sections = false: the heaviest blocks of all sequences first (the form
// before).  On the device by upload_varlen_table; the caller keeps the tensor until the launch
// is queued.
at::Tensor sm90_varlen_tiles(FwdParams& p, const Packed& pk, int64_t kernel_dim,
                             const at::Tensor& q) {
  const int block_m = sm90::fwd_block_m_of(kernel_dim, p.dropout);  // (the dropout variant's)
  const int32_t* cu_q = pk.cu_q_host.data_ptr<int32_t>();
  const int32_t* cu_k = pk.cu_k_host.data_ptr<int32_t>();
  const int32_t* used_k = pk.used_k.defined() ? pk.used_k_host.data_ptr<int32_t>() : nullptr;
  std::vector<std::pair<int64_t, VarlenTile>> tiles;
  for (int64_t b = 0; b < pk.batch; ++b) {
    const int32_t len_q = cu_q[b + 1] - cu_q[b];
    const int32_t len_k = used_k != nullptr ? used_k[b] : cu_k[b + 1] - cu_k[b];
    const VisibleKeys vis(len_q, len_k, p.window_left, p.window_right, p.align_bottom_right);
    for (int32_t m = 0; m * static_cast<int64_t>(block_m) < len_q; ++m) {
      const VisibleKeys::Block keys =
          vis.block(int64_t{m} * block_m, block_m, len_q, kernel_dim <= 128 ? 128 : 64);
      tiles.push_back({keys.n_end - keys.n_begin,
                       {static_cast<int32_t>(b), m, cu_q[b], cu_k[b], len_q, len_k, 0, 0}});
    }
  }
  TORCH_CHECK(tiles.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "flash_attn_ext: too many query blocks for the Hopper forward: ", tiles.size());
  if (p.sm90_varlen_sections) {  // (else upload_varlen_table's order: by weight alone)
    std::vector<int64_t> heaviest(pk.batch, 0);
    for (const auto& t : tiles) heaviest[t.second.b] = std::max(heaviest[t.second.b], t.first);
    std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& x, const auto& y) {
      const int64_t hx = heaviest[x.second.b], hy = heaviest[y.second.b];
      if (hx != hy) return hx > hy;
      if (x.second.b != y.second.b) return x.second.b < y.second.b;
      return x.first > y.first;
    });
  }
  at::Tensor device = upload_varlen_table(tiles, {}, q, /*ordered=*/p.sm90_varlen_sections);
  p.sm90_varlen_tiles = reinterpret_cast<const VarlenTile*>(device.data_ptr<int32_t>());
  p.sm90_varlen_entries = static_cast<int32_t>(tiles.size());
  p.sm90_varlen_block_m = block_m;
  return device;
}

// The Hopper backward's tables for packed sequences, from the offsets check_packed read on the
// host (params.h: BwdParams::sm90_varlen_rows, FwdParams::sm90_varlen_tiles): each sequence's
// rows of the per-row scratch start at a multiple of 128 (row_base), described per 128 rows;
// then every key block (of the kernel's keys per CTA at padded head dim kernel_dim, 128 or 64:
// bwd_sm90_block_n) of every sequence that some query row sees, the heaviest
// (most query rows that see it: under a causal mask the first blocks of the longest
// sequences) first, so that the CTAs launched last are short.  (The padding bounds the
// scratch at 128 rows per sequence: many very short sequences cost memory out of proportion,
// as in FlashAttention-3.)  One buffer on the device (upload_varlen_table: the key blocks,
// then the rows); the caller keeps the tensor until the launch is queued.
// `ordered` (dQ added in a fixed order, deterministic): each sequence's key blocks the highest
// first, by their rank from the sequence's highest block that some row sees (all sequences'
// highest blocks, then all second highest, ...), since a key block's dQ waits for those above
// it in its sequence: they must be launched before it (bwd_dq.h's descending order).
at::Tensor sm90_bwd_varlen_tables(BwdParams& p, const Packed& pk, const at::Tensor& q,
                                  bool ordered, int64_t kernel_dim) {
  const int kBlockN = sm90::bwd_sm90_block_n(kernel_dim);
  constexpr int kRowBlock = 128;
  const int32_t* cu_q = pk.cu_q_host.data_ptr<int32_t>();
  const int32_t* cu_k = pk.cu_k_host.data_ptr<int32_t>();
  const int32_t* used_k = pk.used_k.defined() ? pk.used_k_host.data_ptr<int32_t>() : nullptr;
  std::vector<std::pair<int64_t, VarlenTile>> tiles;
  std::vector<int32_t> rows;  // (first packed row, rows) per 128 padded rows
  int64_t row_base = 0;
  for (int64_t b = 0; b < pk.batch; ++b) {
    const int32_t len_q = cu_q[b + 1] - cu_q[b];
    const int32_t len_k = used_k != nullptr ? used_k[b] : cu_k[b + 1] - cu_k[b];
    const VisibleKeys vis(len_q, len_k, p.window_left, p.window_right, p.align_bottom_right);
    for (int32_t n = 0; int64_t{n} * kBlockN < len_k; ++n) {
      const int64_t n0 = int64_t{n} * kBlockN, n1 = std::min<int64_t>(n0 + kBlockN, len_k);
      const int64_t lo = std::max<int64_t>(vis.first_row(n0), 0);
      const int64_t hi = std::min<int64_t>(vis.row_limit(n1), len_q);
      // (A block no row sees has zero gradients, as dk / dv are allocated: no CTA.  The same
      // rows as the kernel's bwd_steps.)
      if (hi > lo)
        tiles.push_back({hi - lo, {static_cast<int32_t>(b), n, cu_q[b], cu_k[b], len_q, len_k,
                                   static_cast<int32_t>(row_base), 0}});
    }
    if (ordered) {  // weight: minus the rank from the sequence's highest block (0, -1, ...)
      size_t first = tiles.size();
      while (first > 0 && tiles[first - 1].second.b == b) --first;
      for (size_t i = first; i < tiles.size(); ++i)
        tiles[i].first = tiles[i].second.block - tiles.back().second.block;
    }
    for (int32_t r = 0; r < len_q; r += kRowBlock) {
      rows.push_back(cu_q[b] + r);
      rows.push_back(std::min(kRowBlock, len_q - r));
    }
    row_base += (int64_t{len_q} + kRowBlock - 1) / kRowBlock * kRowBlock;
  }
  TORCH_CHECK(static_cast<int64_t>(tiles.size()) * std::max<int64_t>(p.heads_kv, 1) <=
                      std::numeric_limits<int32_t>::max() &&
                  row_base <= std::numeric_limits<int32_t>::max() - kRowBlock,
              "flash_attn_ext: too many key blocks or rows for the Hopper backward: ",
              tiles.size(), " key blocks, ", row_base, " padded rows");
  at::Tensor device = upload_varlen_table(tiles, rows, q);
  p.sm90_varlen_tiles = reinterpret_cast<const VarlenTile*>(device.data_ptr<int32_t>());
  p.sm90_varlen_entries = static_cast<int32_t>(tiles.size());
  p.sm90_varlen_block_m = kBlockN;  // (the launcher checks it against the kernel's)
  p.sm90_varlen_rows = reinterpret_cast<const int32_t*>(p.sm90_varlen_tiles + tiles.size());
  p.sm90_varlen_padded_q = row_base;
  return device;
}
#endif

// The forward as the rule chose it (choice.fwd): the Hopper kernel with its scheduler's scratch,
// the process's kernel options and, for packed sequences (`packed`), the tile table (else the
// bias's block summary), or the portable kernel; then the exact pass; on the current stream.
void run_forward(const KernelChoice& choice, const KernelOptions& options, FwdParams& p,
                 const at::Tensor& q, const Packed* packed) {
  const int64_t kernel_dim = std::max(p.head_dim, p.head_dim_v);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  cudaError_t err;
#ifdef FLASH_ATTN_EXT_SM90
  if (choice.fwd == FwdKernel::kSm90 || choice.fwd == FwdKernel::kSm90PackGqa) {
    at::Tensor tile_counter;  // the scheduler's scratch (zeroed by its launcher)
    if (choice.sm90_schedule == Sm90Schedule::kDynamic) {
      tile_counter = at::empty({1}, q.options().dtype(at::kInt));
      p.tile_counter = tile_counter.data_ptr<int32_t>();
    }
    if (choice.sm90_schedule == Sm90Schedule::kTile)
      p.max_ctas = std::numeric_limits<int32_t>::max();
    p.heads_per_section = options.sm90_section_pairs;
    p.sm90_fma_exp2 = options.sm90_fma_exp2;
    p.sm90_per_score_consumers = options.sm90_per_score_consumers;
    p.sm90_alibi_fold = options.sm90_alibi_fold;
    p.sm90_narrow_tiles = options.sm90_narrow_tiles;
    p.sm90_varlen_sections = options.sm90_varlen_sections;
    // The mask's rows as key intervals (the mask variant's mixed blocks by comparisons) where
    // they measured a gain: at head dim 64 the forward kernel 6-8% shorter on a causal +
    // padding mask, at 128 1.5%, less than the 10 us they add to the summary pass
    // (docs/perf/sm90_score_mods.md).
    const bool mask_rows = options.sm90_mask_rows && kernel_dim <= 64;
    p.sm90_row_shift = options.sm90_row_shift;
    p.sm90_direct_epilogue = options.sm90_direct_epilogue;
    p.sm90_pack_gqa = choice.fwd == FwdKernel::kSm90PackGqa;
    const at::Tensor extra = packed != nullptr ? sm90_varlen_tiles(p, *packed, kernel_dim, q)
                                               : summarize_bias(p, q.options(), stream,
                                                                mask_rows
                                                                    ? sm90::MaskIntervals::kRows
                                                                    : sm90::MaskIntervals::kNone);
    err = bf16 ? run_fwd_sm90<__nv_bfloat16>(kernel_dim, p, stream)
               : run_fwd_sm90<__half>(kernel_dim, p, stream);
  } else
#endif
  {
    err = bf16 ? run_fwd<__nv_bfloat16>(kernel_dim, p, stream)
               : run_fwd<__half>(kernel_dim, p, stream);
  }
  C10_CUDA_CHECK(err);
  // Rows whose plain scores are too large for the main forward's one-FMA exponent
  // (cuda/exact_rows.h): recomputed exactly, after it, on every call unless the option
  // exact_rows_always is off.
  if (options.exact_rows_always && plain_scores(p)) {
    C10_CUDA_CHECK(bf16 ? exact_rows_forward<__nv_bfloat16>(p, stream)
                        : exact_rows_forward<__half>(p, stream));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool align_bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p, bool deterministic) {
  const AttnArgs a = check_attn_args(q_in, k_in, v_in, softmax_scale, causal, window_left,
                                     window_right, softcap, alibi_slopes, attn_bias, dropout_p);
  TORCH_CHECK_VALUE(q_in.is_cuda(), "flash_attn_ext CUDA kernel got q on ", q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const KernelOptions options = kernel_options();
  const int mods = score_mods_of(softcap, attn_bias, dropout_p, false, alibi_slopes.has_value());
  const KernelChoice choice =
      select_for(q_in, k_in, v_in, a, mods, deterministic, options, false, attn_bias);
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const int64_t dv_padded = v.size(3);
  at::Tensor out_padded =
      new_output({a.batch, a.seqlen_q, a.heads_q, dv_padded}, q.options());
  at::Tensor lse = new_output({a.batch, a.heads_q, a.seqlen_q}, q.options().dtype(at::kFloat));
  // Written by the forward kernel: (seed, offset) with dropout, (0, 0) without.
  at::Tensor rng_state = at::empty({2}, q.options().dtype(at::kLong));

  if (out_padded.numel() > 0 || lse.numel() > 0) {
    FwdParams p;
    fill_fwd_params(p, a, q, k, v, out_padded, lse, softcap, align_bottom_right);
    p.head_dim = q.size(3);       // padded columns are zeros: they add nothing to q k^T
    p.head_dim_v = dv_padded;     // padded columns of out are sliced off below
    // (a boolean mask as it is for the Hopper forward's mask variant, else 0 / -inf in fp32)
    const at::Tensor bias_view =
        attn_bias.has_value()
            ? prepare_bias(*attn_bias, a, at::kFloat, p,
                           choice.fwd == FwdKernel::kSm90 && mask_alone(mods))
            : at::Tensor();
    const at::Tensor slopes = prepare_alibi(alibi_slopes, at::kFloat, p);
    fill_dropout_params(p, dropout_p);
    if (p.dropout) take_philox_state(p, a.seqlen_k);
    p.rng_state = rng_state.data_ptr<int64_t>();
    run_forward(choice, options, p, q, nullptr);
  } else {
    rng_state.zero_();  // no kernel runs for an empty output
  }
  at::Tensor out = dv_padded == a.head_dim_v ? out_padded
                                             : out_padded.narrow(3, 0, a.head_dim_v).contiguous();
  return {out, lse, rng_state};
}

// The backward's exact pass around the main backward (cuda/exact_rows.h): hide() flags the
// rows of `lse` whose LSE cannot give their P and points p at a copy of it that hides them;
// finish(), after the main backward, does their part.  Nothing where hide() was not called.
struct ExactRowsPass {
  // One allocation a backward, carved into the pass's pieces, each at a multiple of 16 bytes
  // (a vector access of up to 16 bytes to any piece stays aligned, and no two pieces share a
  // 16-byte word); the hidden LSE first, at the allocator's own alignment as softmax_lse had,
  // because the main backward reads it in softmax_lse's place.
  at::Tensor scratch;
  float* lse_hidden = nullptr;  // a row each, lse's layout
  float* row_stats = nullptr;   // 3 a row
  int32_t* any = nullptr;
  uint8_t* flags = nullptr;  // a row each
  void hide(BwdParams& p, const at::Tensor& lse, cudaStream_t stream) {
    const int64_t rows = lse.numel();
    const auto aligned = [](int64_t bytes) { return (bytes + 15) / 16 * 16; };
    const int64_t stats_at = aligned(rows * int64_t{sizeof(float)});
    const int64_t any_at = stats_at + aligned(3 * rows * int64_t{sizeof(float)});
    const int64_t flags_at = any_at + aligned(int64_t{sizeof(int32_t)});
    scratch = at::empty({flags_at + rows}, lse.options().dtype(at::kByte));
    uint8_t* base = scratch.data_ptr<uint8_t>();
    lse_hidden = reinterpret_cast<float*>(base);
    row_stats = reinterpret_cast<float*>(base + stats_at);
    any = reinterpret_cast<int32_t*>(base + any_at);
    flags = base + flags_at;
    C10_CUDA_CHECK(cudaMemsetAsync(any, 0, sizeof(int32_t), stream));
    C10_CUDA_CHECK(exact_rows_flag(p, lse_hidden, flags, any, stream));
    p.softmax_lse = lse_hidden;
  }
  void finish(const BwdParams& p, bool bf16, cudaStream_t stream) const {
    if (!scratch.defined()) return;
    C10_CUDA_CHECK(bf16 ? exact_rows_backward<__nv_bfloat16>(p, flags, any, row_stats, stream)
                        : exact_rows_backward<__half>(p, flags, any, row_stats, stream));
  }
};

// Backward by recomputation (flash_bwd_kernel.cuh): D = rowsum(dO * O), then the dK/dV and dQ
// kernels, as kernel_select.h picks them.  Plain attention runs the 8-warp kernels of
// flash_bwd_lean.cuh where they fit, which, unless `deterministic` or
// torch.use_deterministic_algorithms(True), add dQ into an fp32 buffer from the dK/dV kernel
// (bulk reductions on sm_90, atomics elsewhere: dq's last bits vary from run to run).
// Everything else, and deterministic calls: a separate dQ kernel, bitwise reproducible.  The
// Hopper backward (kernels/sm90) adds dQ by bulk reductions, in a fixed order when
// deterministic.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse,
    const at::Tensor& rng_state, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool align_bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    double dropout_p, bool deterministic, bool bias_requires_grad,
    const std::optional<at::Tensor>& dsoftmax_lse) {
  const AttnArgs a = check_attn_args(q_in, k_in, v_in, softmax_scale, causal, window_left,
                                     window_right, softcap, alibi_slopes, attn_bias, dropout_p);
  TORCH_CHECK_VALUE(q_in.is_cuda(), "flash_attn_ext CUDA kernel got q on ", q_in.device());
  check_bwd_tensors(a, dout_in, out_in, softmax_lse, q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const bool want_dbias = attn_bias.has_value() && bias_requires_grad;
  check_bias_grad(attn_bias, bias_requires_grad);
  const int mods =
      score_mods_of(softcap, attn_bias, dropout_p, want_dbias, alibi_slopes.has_value());
  // (one snapshot of the options for the choice and the launch, as the forward takes)
  const KernelOptions options = kernel_options();
  const KernelChoice choice = select_for(q_in, k_in, v_in, a, mods, deterministic, options);
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const at::Tensor out = kernel_ready(out_in), dout = kernel_ready(dout_in);
  const at::Tensor lse = softmax_lse.contiguous();
  // Gradients in the padded head dims (the padded columns are sliced off below), laid out like
  // q, k, v (kernel_ready strides: the kernels' alignment holds for them too).
  at::Tensor dq = new_output_like(q);
  at::Tensor dk = new_output_like(k);
  at::Tensor dv = new_output_like(v);
  auto unpad = [](const at::Tensor& g, int64_t d) {
    return g.size(3) == d ? g : g.narrow(3, 0, d).contiguous();
  };
  at::Tensor dbias_full =
      want_dbias ? at::zeros({a.batch, a.heads_q, a.seqlen_q, a.seqlen_k}, lse.options())
                 : at::Tensor();
  if (dq.numel() + dk.numel() + dv.numel() > 0) {
    if (a.batch * a.heads_q == 0) {  // no query heads: k and v get zeros
      dk.zero_();
      dv.zero_();
    } else {
      BwdParams p;
      fill_fwd_params(p, a, q, k, v, out, lse, softcap, align_bottom_right);
      fill_grad_params(p, dout, dq, dk, dv);
      p.head_dim = q.size(3);
      p.head_dim_v = v.size(3);
      // (a boolean mask as it is for the Hopper backward's mask variant, else 0 / -inf in fp32)
      const at::Tensor bias_view =
          attn_bias.has_value()
              ? prepare_bias(*attn_bias, a, at::kFloat, p,
                             choice.bwd == BwdKernel::kSm90 && mask_alone(mods))
              : at::Tensor();
      const at::Tensor slopes = prepare_alibi(alibi_slopes, at::kFloat, p);
      p.dbias_full = want_dbias ? dbias_full.data_ptr() : nullptr;
      const at::Tensor dlse = prepare_dlse(dsoftmax_lse, {a.batch, a.heads_q, a.seqlen_q}, q, p);
      fill_dropout_params(p, dropout_p);
      if (p.dropout) {  // the forward's (seed, offset), read on the device
        check_rng_state(rng_state);
        TORCH_CHECK_VALUE(rng_state.device() == q.device(), "rng_state must be on ", q.device(),
                          " (the forward's), got ", rng_state.device());
        p.philox_seed_ptr = rng_state.data_ptr<int64_t>();
        p.philox_offset_ptr = p.philox_seed_ptr + 1;
      }
      const int64_t kernel_dim = std::max(p.head_dim, p.head_dim_v);
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
      const bool bf16 = q.scalar_type() == at::kBFloat16;
      // Rows whose LSE cannot give their P (a floating bias of huge finite values hiding all of
      // a row's keys, or huge scores): cuda/exact_rows.h.  On every call unless the option
      // exact_rows_always is off: without a floating bias only the scores can make such rows,
      // and the flag kernel reads the LSE to know.
      ExactRowsPass exact_rows;
      if (options.exact_rows_always || (attn_bias.has_value() && attn_bias->is_floating_point()))
        exact_rows.hide(p, lse, stream);
      cudaError_t err;
#ifdef FLASH_ATTN_EXT_SM90
      if (choice.bwd == BwdKernel::kSm90) {
        // fp32 scratch: the accumulated dQ (kernels/sm90/bwd_dq.h lays it out; the size of
        // params.h's dq_accum), and the statistics (lse * log2(e), D) in whole query blocks.
        at::Tensor dq_accum = at::empty(
            {a.batch, dq_accum_rows(a.seqlen_q), a.heads_q, dq_accum_cols(kernel_dim)},
            lse.options());
        at::Tensor stats = at::empty({sm90::bwd_sm90_stats_floats(a.batch, a.heads_q,
                                                                  a.seqlen_q)},
                                     lse.options());
        p.dq_accum = dq_accum.data_ptr<float>();
        // deterministic: dQ added in a fixed order, counted per query block (zeroed).
        at::Tensor dq_semaphore;
        if (choice.dq == DqPath::kOrdered) {
          dq_semaphore = at::zeros({dq_semaphore_count(a.batch, a.seqlen_q, a.heads_q)},
                                   lse.options().dtype(at::kInt));
          p.dq_semaphore = dq_semaphore.data_ptr<int32_t>();
        }
        float* stats_ptr = stats.data_ptr<float>();
        p.heads_per_section = options.sm90_section_pairs;
        p.sm90_direct_epilogue = options.sm90_direct_epilogue;
        p.sm90_bwd_short_steps = options.sm90_bwd_short_steps;
        // The mask's keys as row intervals (the mask variant's mixed steps by comparisons; not
        // the head-dim-256 kernel, whose steps are split by role).
        const bool mask_cols = options.sm90_mask_cols && kernel_dim <= 128;
        const at::Tensor bias_blocks = summarize_bias(
            p, q.options(), stream,
            mask_cols ? sm90::MaskIntervals::kCols : sm90::MaskIntervals::kNone);
        err = bf16 ? run_bwd_sm90<__nv_bfloat16>(kernel_dim, p, stats_ptr, stream)
                   : run_bwd_sm90<__half>(kernel_dim, p, stats_ptr, stream);
      } else
#endif
      {
        // fp32 scratch of the 8-warp kernels' accumulated dQ (params.h: dq_accum), where the
        // rule has them accumulate it (not deterministic); the backward zeroes it.
        p.bwd_eight_warp = choice.bwd == BwdKernel::kSm80EightWarp;
        at::Tensor dq_accum;
        if (p.bwd_eight_warp && choice.dq != DqPath::kSeparate) {
          dq_accum = at::empty(
              {a.batch, dq_accum_rows(a.seqlen_q), a.heads_q, dq_accum_cols(kernel_dim)},
              lse.options());
          p.dq_accum = dq_accum.data_ptr<float>();
          p.dq_bulk = choice.dq == DqPath::kBulk;
        }
        at::Tensor delta = at::empty({a.batch, a.heads_q, a.seqlen_q}, lse.options());
        float* delta_ptr = delta.data_ptr<float>();
        err = bf16 ? run_bwd<__nv_bfloat16>(kernel_dim, p, delta_ptr, stream)
                   : run_bwd<__half>(kernel_dim, p, delta_ptr, stream);
      }
      C10_CUDA_CHECK(err);
      exact_rows.finish(p, bf16, stream);
    }
  }
  return {unpad(dq, a.head_dim), unpad(dk, a.head_dim), unpad(dv, a.head_dim_v),
          reduce_dbias(dbias_full, attn_bias, want_dbias, q)};
}

// Packed sequences (FlashAttention-2's varlen: the fwd_varlen / bwd_varlen ops, schemas in
// cpu/flash_fwd_cpu.cpp): on sm_90 the Hopper forward's varlen instantiations for plain
// attention and softcap, ALiBi or dropout alone (their tiles from a table of every sequence's
// query blocks: sm90_varlen_tiles), elsewhere the portable kernels, each CTA placing its
// sequence by params.h's cu_seqlens (kernels/sm80/block_info.h: SeqInfo).  The backward
// likewise: on sm_90 the Hopper backward's varlen instantiations for the same calls (a table of
// every sequence's key blocks: sm90_bwd_varlen_tables; deterministic: dQ added in a fixed
// order); else the 4-warp kernels with the separate dQ kernel (kernel_select.h).  Checks as on the CPU (varlen_checks.h: the
// offsets are read on the host), so a call cannot be captured in a CUDA graph
// (check_not_capturing).
// Refuses a packed call while q's stream captures a CUDA graph: its checks and tables are made
// on the host from the offsets of this call, and offsets on the CPU would be uploaded once, at
// capture, so a replay with other offsets would compute with these (a wrong answer, silently).
void check_not_capturing(const at::Tensor& q) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(
      cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(q.device().index()), &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusNone,
              "flash_attn_varlen_func (the fwd_varlen / bwd_varlen ops) cannot be captured in a "
              "CUDA graph: the offsets are checked and the kernels' tables built on the host for "
              "each call");
}

void set_packed(FwdParams& p, const Packed& pk, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  make_packed(p, pk, max_seqlen_q, max_seqlen_k);
  p.cu_seqlens_q = pk.cu_q.data_ptr<int32_t>();
  p.cu_seqlens_k = pk.cu_k.data_ptr<int32_t>();
  p.seqused_k = pk.used_k.defined() ? pk.used_k.data_ptr<int32_t>() : nullptr;
  p.total_q = pk.total_q;
  p.total_k = pk.total_k;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_varlen_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    double dropout_p, const std::optional<at::Tensor>& seqused_k, bool /*deterministic*/) {
  check_not_capturing(q_in);
  const PackedCall c = check_packed_call(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, seqused_k, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const AttnArgs& a = c.a;
  const Packed& pk = c.pk;
  // The rule refuses what no CUDA kernel serves (dtype, GPU, build), with its reasons, and
  // picks the forward.
  const KernelOptions options = kernel_options();
  const KernelChoice choice =
      select_for(c.q, c.k, c.v, a, score_mods_of(softcap, std::nullopt, dropout_p, false,
                                                 alibi_slopes.has_value()),
                 false, options, /*packed=*/true);
  const at::Tensor q = kernel_ready(c.q), k = kernel_ready(c.k), v = kernel_ready(c.v);
  const int64_t dv_padded = v.size(3);
  // Rows outside every sequence: out 0, lse -inf.
  at::Tensor out_padded = at::zeros({1, a.seqlen_q, a.heads_q, dv_padded}, q.options());
  at::Tensor lse = at::full({a.heads_q, a.seqlen_q}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(at::kFloat));
  at::Tensor rng_state = at::zeros({2}, q.options().dtype(at::kLong));
  if (pk.batch > 0 && a.heads_q > 0) {
    FwdParams p;
    fill_fwd_params(p, a, q, k, v, out_padded, lse, softcap, true);
    p.head_dim = q.size(3);
    p.head_dim_v = dv_padded;
    set_packed(p, pk, max_seqlen_q, max_seqlen_k);
    const at::Tensor slopes = prepare_alibi(alibi_slopes, at::kFloat, p);
    fill_dropout_params(p, dropout_p);
    if (p.dropout) take_philox_state(p, max_seqlen_k);
    p.rng_state = rng_state.data_ptr<int64_t>();
    run_forward(choice, options, p, q, &pk);
  }
  at::Tensor out = dv_padded == a.head_dim_v ? out_padded
                                             : out_padded.narrow(3, 0, a.head_dim_v).contiguous();
  return {out.squeeze(0), lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& rng_state, std::optional<double> softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& dsoftmax_lse,
    bool deterministic) {
  check_not_capturing(q_in);
  const PackedCall c = check_packed_call(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, seqused_k, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const AttnArgs& a = c.a;
  const Packed& pk = c.pk;
  check_packed_bwd_tensors(a, dout_in, out_in, softmax_lse, at::kFloat);
  const KernelOptions options = kernel_options();
  const KernelChoice choice =
      select_for(c.q, c.k, c.v, a, score_mods_of(softcap, std::nullopt, dropout_p, false,
                                                 alibi_slopes.has_value()),
                 deterministic, options, /*packed=*/true);
  const at::Tensor q = kernel_ready(c.q), k = kernel_ready(c.k), v = kernel_ready(c.v);
  const at::Tensor out = kernel_ready(last_dim_contiguous(out_in).unsqueeze(0));
  const at::Tensor dout = kernel_ready(last_dim_contiguous(dout_in).unsqueeze(0));
  const at::Tensor lse = softmax_lse.contiguous();
  // Rows outside every sequence, and keys a sequence does not use (seqused_k), get zeros.
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  auto unpad = [](const at::Tensor& g, int64_t d) {
    return (g.size(3) == d ? g : g.narrow(3, 0, d).contiguous()).squeeze(0);
  };
  if (pk.batch > 0 && a.heads_q > 0) {
    BwdParams p;
    fill_fwd_params(p, a, q, k, v, out, lse, softcap, true);
    fill_grad_params(p, dout, dq, dk, dv);
    p.head_dim = q.size(3);
    p.head_dim_v = v.size(3);
    set_packed(p, pk, max_seqlen_q, max_seqlen_k);
    p.dout_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
    const at::Tensor slopes = prepare_alibi(alibi_slopes, at::kFloat, p);
    // (H, total_q) like softmax_lse: the delta kernel reads both at the same packed row.
    const at::Tensor dlse = prepare_dlse(dsoftmax_lse, {a.heads_q, a.seqlen_q}, q, p);
    fill_dropout_params(p, dropout_p);
    if (p.dropout) {  // the forward's (seed, offset), read on the device
      check_rng_state(rng_state);
      TORCH_CHECK_VALUE(rng_state.device() == q.device(), "rng_state must be on ", q.device(),
                        " (the forward's), got ", rng_state.device());
      p.philox_seed_ptr = rng_state.data_ptr<int64_t>();
      p.philox_offset_ptr = p.philox_seed_ptr + 1;
    }
    const int64_t kernel_dim = std::max(p.head_dim, p.head_dim_v);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    // Rows whose LSE cannot give their P (huge scores: cuda/exact_rows.h), as in bwd_cuda.
    ExactRowsPass exact_rows;
    if (options.exact_rows_always) exact_rows.hide(p, lse, stream);
#ifdef FLASH_ATTN_EXT_SM90
    if (choice.bwd == BwdKernel::kSm90) {
      // The key-block table and the padded rows, then fp32 scratch in those rows: the
      // accumulated dQ and the statistics (lse * log2(e), D).
      const bool ordered = choice.dq == DqPath::kOrdered;
      p.sm90_direct_epilogue = options.sm90_direct_epilogue;
      const at::Tensor tables = sm90_bwd_varlen_tables(p, pk, q, ordered, kernel_dim);
      if (p.sm90_varlen_padded_q == 0) {  // no sequence has a query row: zeros (allocated)
        return {unpad(dq, a.head_dim), unpad(dk, a.head_dim), unpad(dv, a.head_dim_v)};
      }
      // deterministic: dQ added in a fixed order, a counter per query block of the padded
      // rows (zeroed; blocks of 64 or 128 rows: at most one counter per 64 rows, bwd_dq.h).
      at::Tensor dq_semaphore;
      if (ordered) {
        dq_semaphore = at::zeros({a.heads_q * p.sm90_varlen_padded_q / 64},
                                 q.options().dtype(at::kInt));
        p.dq_semaphore = dq_semaphore.data_ptr<int32_t>();
      }
      at::Tensor dq_accum = at::empty(
          {a.heads_q, p.sm90_varlen_padded_q, dq_accum_cols(kernel_dim)}, lse.options());
      at::Tensor stats = at::empty({2, a.heads_q, p.sm90_varlen_padded_q}, lse.options());
      p.dq_accum = dq_accum.data_ptr<float>();
      C10_CUDA_CHECK(bf16 ? run_bwd_sm90<__nv_bfloat16>(kernel_dim, p, stats.data_ptr<float>(),
                                                        stream)
                          : run_bwd_sm90<__half>(kernel_dim, p, stats.data_ptr<float>(), stream));
    } else
#endif
    {
      p.bwd_eight_warp = false;  // the 4-warp kernels and the separate dQ kernel
      at::Tensor delta = at::empty({a.heads_q, a.seqlen_q}, lse.options());
      C10_CUDA_CHECK(bf16 ? run_bwd<__nv_bfloat16>(kernel_dim, p, delta.data_ptr<float>(), stream)
                          : run_bwd<__half>(kernel_dim, p, delta.data_ptr<float>(), stream));
    }
    exact_rows.finish(p, bf16, stream);
  }
  return {unpad(dq, a.head_dim), unpad(dk, a.head_dim), unpad(dv, a.head_dim_v)};
}

}  // namespace

#ifdef FLASH_ATTN_EXT_SM90
// The Hopper kernels' summary of a boolean mask's rows as key intervals (kernels/sm90/
// bias_blocks.h: mask_row_keys, the forward's) or with `columns` its keys as row intervals
// (mask_col_rows, the backward's), for tests: mask (B, H, L, S) bool on a CUDA device, its keys
// unit-stride or broadcast as prepare_bias leaves them (others are copied); returns (B', H',
// L', 2) (rows) or (B', H', S, 2) (columns) int32 (begin, end) over the mask's own extent (1
// where a dimension broadcasts, stride 0): begin <= end where the row's visible keys (the
// key's rows) are exactly [begin, end), else begin > end.  Raises where the summary keeps no
// intervals (keys broadcast, for columns also rows broadcast, or past the grid's limits).
at::Tensor sm90_mask_row_keys(const at::Tensor& mask, bool columns) {
  TORCH_CHECK_VALUE(mask.is_cuda() && mask.scalar_type() == at::kBool && mask.dim() == 4,
                    "mask must be a 4-D bool CUDA tensor, got ", mask.scalar_type(), " of ",
                    mask.dim(), " dimensions on ", mask.device());
  const c10::cuda::CUDAGuard guard(mask.device());
  at::Tensor m = mask;
  if (m.size(3) > 1 && m.stride(3) != 1 && m.stride(3) != 0) m = m.contiguous();
  FwdParams p;
  p.batch = m.size(0);
  p.heads_q = m.size(1);
  p.seqlen_q = m.size(2);
  p.seqlen_k = m.size(3);
  p.attn_bias = m.data_ptr();
  p.bias_is_mask = true;
  p.bias_batch_stride = m.size(0) > 1 ? m.stride(0) : 0;
  p.bias_head_stride = m.size(1) > 1 ? m.stride(1) : 0;
  p.bias_row_stride = m.size(2) > 1 ? m.stride(2) : 0;
  p.bias_col_stride = m.size(3) > 1 ? m.stride(3) : 0;
  const auto what = columns ? sm90::MaskIntervals::kCols : sm90::MaskIntervals::kRows;
  at::Tensor summary =
      at::empty({sm90::bias_summary_bytes(p, what)}, m.options().dtype(at::kByte));
  C10_CUDA_CHECK(sm90::summarize_bias(p, summary.data_ptr<uint8_t>(),
                                      c10::cuda::getCurrentCUDAStream(), what));
  const int32_t* records = columns ? p.bias_col_rows : p.bias_row_keys;
  TORCH_CHECK(records != nullptr, "flash_attn_ext: no ", columns ? "column" : "row",
              " intervals for this mask");
  const int64_t own[3] = {p.bias_batch_stride == 0 ? 1 : p.batch,
                          p.bias_head_stride == 0 ? 1 : p.heads_q,
                          columns ? p.seqlen_k : p.bias_row_stride == 0 ? 1 : p.seqlen_q};
  const int64_t offset =
      reinterpret_cast<const uint8_t*>(records) - summary.data_ptr<uint8_t>();
  return summary.narrow(0, offset, own[0] * own[1] * own[2] * 16)
      .view(at::kInt)
      .view({own[0], own[1], own[2], 4})
      .narrow(3, 0, 2)
      .clone();
}
#endif

}  // namespace flash_attn_ext::cuda

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd", &flash_attn_ext::cuda::fwd_cuda);
  m.impl("bwd", &flash_attn_ext::cuda::bwd_cuda);
  m.impl("fwd_varlen", &flash_attn_ext::cuda::fwd_varlen_cuda);
  m.impl("bwd_varlen", &flash_attn_ext::cuda::bwd_varlen_cuda);
}
