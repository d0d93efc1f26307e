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

#include "checks.h"
#include "dropout.h"
#include "kernels/sm80/flash_bwd_launch.h"
#include "kernels/sm80/flash_fwd_launch.h"
#include "kernels/sm80/launch.h"  // max_smem_optin_per_block (what the launchers test)
#include "kernels/sm90/pack_gqa.h"  // plain C++: the Hopper forward's limits and packing rule
#ifdef FLASH_ATTN_EXT_SM90
#include <cstdlib>

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

// The kernels keep the running max of raw q.k and scale it afterwards: that needs scale > 0
// (flash_attn_ext's Python layer sends other scales to the fallback path).
void check_positive_scale(const AttnArgs& a) {
  TORCH_CHECK_NOT_IMPLEMENTED(a.softmax_scale > 0.0,
                              "the CUDA kernels need softmax_scale > 0, got ", a.softmax_scale);
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

// An environment switch with two values: false when `name` is unset, empty or "auto", true when
// it is `other`; anything else is a ValueError naming the variable.
bool env_switch(const char* name, const char* other) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return false;
  TORCH_CHECK_VALUE(std::strcmp(env, other) == 0, name, " must be 'auto' or '", other,
                    "', got '", env, "'");
  return true;
}

// FLASH_ATTN_EXT_BWD_DQ: "auto" (default: on sm_90 the backward's dQ leaves the dK/dV kernel
// through bulk reductions, flash_bwd_lean.cuh, except at head dim 256, where that tile does not
// fit and atomics are used) or "atomic" (per-lane fp32 atomics, the path sm_80-class GPUs
// take; to test and compare it on sm_90).
bool atomic_dq_forced() { return env_switch("FLASH_ATTN_EXT_BWD_DQ", "atomic"); }

#ifdef FLASH_ATTN_EXT_SM90
// FLASH_ATTN_EXT_KERNEL: "auto" (default; the Hopper kernel where it applies) or "sm80" (the
// portable kernels everywhere, e.g. to compare the two).  flash_attn_ext/dispatch.py reads the
// same variable to report the choice.
bool force_portable() { return env_switch("FLASH_ATTN_EXT_KERNEL", "sm80"); }

// The Hopper forward (kernels/sm90) serves plain attention (any mask window, GQA, L != S) on
// sm_90 when TMA can describe q, k and v: no zero (broadcast) strides on a dimension of size > 1.
// dispatch.py's plan() applies the same rule.
bool use_sm90_fwd(const FwdParams& p) {
  int device = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return false;
  if (force_portable()) return false;  // checked on every sm_90 call, as dispatch.py does
  if (p.general()) return false;
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return false;
  if (p.seqlen_q > sm90::kMaxRows || p.seqlen_k > sm90::kMaxRows) return false;  // 32-bit rows
  auto broadcast = [](int64_t size, int64_t stride) { return size > 1 && stride == 0; };
  return !(broadcast(p.batch, p.q_batch_stride) || broadcast(p.batch, p.k_batch_stride) ||
           broadcast(p.batch, p.v_batch_stride) || broadcast(p.heads_q, p.q_head_stride) ||
           broadcast(p.heads_kv, p.k_head_stride) || broadcast(p.heads_kv, p.v_head_stride) ||
           broadcast(p.seqlen_q, p.q_row_stride) || broadcast(p.seqlen_k, p.k_row_stride) ||
           broadcast(p.seqlen_k, p.v_row_stride));
}

// The Hopper forward's tile schedule (see flash_fwd_sm90.cuh).  FLASH_ATTN_EXT_SM90_SCHEDULE
// (to compare schedules in one build): "auto" (default: "dynamic" when a causal mask or window
// makes tiles unequal, else "static"), "dynamic" (one CTA per SM, each takes its next tile from
// an atomic counter: the longest-first order balances unequal tiles), "static" (one CTA per
// SM, CTA c computes tiles c, c + grid, ...: no counter to zero) or "tile" (one CTA per tile).
enum class Sm90Schedule { kDynamic, kStatic, kTile };
Sm90Schedule sm90_schedule(const FwdParams& p) {
  const char* env = std::getenv("FLASH_ATTN_EXT_SM90_SCHEDULE");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) {
    const bool unequal_tiles = p.window_left >= 0 || p.window_right >= 0;
    return unequal_tiles ? Sm90Schedule::kDynamic : Sm90Schedule::kStatic;
  }
  if (std::strcmp(env, "dynamic") == 0) return Sm90Schedule::kDynamic;
  if (std::strcmp(env, "static") == 0) return Sm90Schedule::kStatic;
  TORCH_CHECK_VALUE(std::strcmp(env, "tile") == 0,
                    "FLASH_ATTN_EXT_SM90_SCHEDULE must be 'auto', 'dynamic', 'static' or 'tile', "
                    "got '", env, "'");
  return Sm90Schedule::kTile;
}

// FLASH_ATTN_EXT_SM90_SECTION=<pairs> (experimental): (batch, head) pairs per section of the
// Hopper forward's tile order; 0 (unset) leaves the choice to its launcher.
int32_t sm90_section_pairs() {
  const char* env = std::getenv("FLASH_ATTN_EXT_SM90_SECTION");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long long pairs = std::strtoll(env, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && pairs > 0 && pairs <= std::numeric_limits<int32_t>::max(),
                    "FLASH_ATTN_EXT_SM90_SECTION must be a positive number of (batch, head) "
                    "pairs, got '", env, "'");
  return static_cast<int32_t>(pairs);
}

// FLASH_ATTN_EXT_SM90_ROW_SHIFT=auto|off (experimental): whether the Hopper forward puts the
// partial query block first under a causal mask ("auto", the default) or last ("off").
bool sm90_row_shift() {
  const char* env = std::getenv("FLASH_ATTN_EXT_SM90_ROW_SHIFT");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return true;
  TORCH_CHECK_VALUE(std::strcmp(env, "off") == 0,
                    "FLASH_ATTN_EXT_SM90_ROW_SHIFT must be 'auto' or 'off', got '", env, "'");
  return false;
}

// Whether the Hopper forward packs GQA query heads (kernels/sm90/pack_gqa.h).
// FLASH_ATTN_EXT_SM90_PACK_GQA=auto|on|off (experimental): "auto" (default) where the rule says
// it pays, "on" for every GQA/MQA call, "off" never.
bool sm90_pack_gqa(const FwdParams& p, int64_t padded_head_dim) {
  const char* env = std::getenv("FLASH_ATTN_EXT_SM90_PACK_GQA");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0)
    return sm90::pack_gqa_pays(p.seqlen_q, p.heads_q, p.heads_kv, padded_head_dim);
  if (std::strcmp(env, "on") == 0)
    return sm90::pack_gqa_possible(p.seqlen_q, p.heads_q, p.heads_kv);
  TORCH_CHECK_VALUE(std::strcmp(env, "off") == 0,
                    "FLASH_ATTN_EXT_SM90_PACK_GQA must be 'auto', 'on' or 'off', got '", env,
                    "'");
  return false;
}

template <typename Element>
cudaError_t run_fwd_sm90(int64_t head_dim, const FwdParams& p, cudaStream_t stream) {
  if (p.sm90_pack_gqa) {
    if (head_dim <= 64) return sm90::run_flash_fwd_sm90_packgqa<Element, 64>(p, stream);
    if (head_dim <= 128) return sm90::run_flash_fwd_sm90_packgqa<Element, 128>(p, stream);
    return sm90::run_flash_fwd_sm90_packgqa<Element, 256>(p, stream);
  }
  if (head_dim <= 64) return sm90::run_flash_fwd_sm90<Element, 64>(p, stream);
  if (head_dim <= 128) return sm90::run_flash_fwd_sm90<Element, 128>(p, stream);
  return sm90::run_flash_fwd_sm90<Element, 256>(p, stream);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool align_bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_bias, double dropout_p, bool deterministic) {
  (void)deterministic;
  const AttnArgs a = check_attn_args(q_in, k_in, v_in, softmax_scale, causal, window_left,
                                     window_right, softcap, alibi_slopes, attn_bias, dropout_p);
  TORCH_CHECK_VALUE(q_in.is_cuda(), "flash_attn_ext CUDA kernel got q on ", q_in.device());
  check_positive_scale(a);
  const c10::cuda::CUDAGuard guard(q_in.device());
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
    const at::Tensor bias_view =
        attn_bias.has_value() ? prepare_bias(*attn_bias, a, at::kFloat, p) : at::Tensor();
    fill_dropout_params(p, dropout_p);
    if (p.dropout) take_philox_state(p, a.seqlen_k);
    p.rng_state = rng_state.data_ptr<int64_t>();
    const int64_t kernel_dim = std::max(p.head_dim, p.head_dim_v);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    cudaError_t err;
#ifdef FLASH_ATTN_EXT_SM90
    at::Tensor tile_counter;  // the Hopper kernel's scheduler scratch (zeroed by its launcher)
    if (use_sm90_fwd(p)) {
      const Sm90Schedule schedule = sm90_schedule(p);
      if (schedule == Sm90Schedule::kDynamic) {
        tile_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.tile_counter = tile_counter.data_ptr<int32_t>();
      }
      if (schedule == Sm90Schedule::kTile) p.max_ctas = std::numeric_limits<int32_t>::max();
      p.heads_per_section = sm90_section_pairs();
      p.sm90_row_shift = sm90_row_shift();
      p.sm90_pack_gqa = sm90_pack_gqa(p, kernel_dim <= 64 ? 64 : kernel_dim <= 128 ? 128 : 256);
      err = bf16 ? run_fwd_sm90<__nv_bfloat16>(kernel_dim, p, stream)
                 : run_fwd_sm90<__half>(kernel_dim, p, stream);
    } else
#endif
    {
      err = bf16 ? run_fwd<__nv_bfloat16>(kernel_dim, p, stream)
                 : run_fwd<__half>(kernel_dim, p, stream);
    }
    C10_CUDA_CHECK(err);
  } else {
    rng_state.zero_();  // no kernel runs for an empty output
  }
  at::Tensor out = dv_padded == a.head_dim_v ? out_padded
                                             : out_padded.narrow(3, 0, a.head_dim_v).contiguous();
  return {out, lse, rng_state};
}

// Backward by recomputation (flash_bwd_kernel.cuh): D = rowsum(dO * O), then the dK/dV and dQ
// kernels.  Plain attention (the 8-warp kernels of flash_bwd_lean.cuh, where they fit),
// unless `deterministic` or torch.use_deterministic_algorithms(True): FlashAttention-2's
// single dK/dV/dQ kernel adding dQ into an fp32 buffer with atomics (the summation order, and
// so dq's last bits, vary from run to run).  Everything else, and deterministic calls: a
// separate dQ kernel, no atomics, bitwise reproducible gradients.
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
  check_positive_scale(a);
  check_bwd_tensors(a, dout_in, out_in, softmax_lse, q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const at::Tensor out = kernel_ready(out_in), dout = kernel_ready(dout_in);
  const at::Tensor lse = softmax_lse.contiguous();
  // Gradients in the padded head dims (the padded columns are sliced off below), laid out like
  // q, k, v (kernel_ready strides: the kernels' alignment holds for them too).
  at::Tensor dq = new_output_like(q);
  at::Tensor dk = new_output_like(k);
  at::Tensor dv = new_output_like(v);
  const bool want_dbias = attn_bias.has_value() && bias_requires_grad;
  at::Tensor dbias_full =
      want_dbias ? at::zeros({a.batch, a.heads_q, a.seqlen_q, a.seqlen_k}, lse.options())
                 : at::Tensor();
  if (dq.numel() + dk.numel() + dv.numel() > 0) {
    if (a.batch * a.heads_q == 0) {  // no query heads: k and v get zeros
      dk.zero_();
      dv.zero_();
    } else {
      at::Tensor delta = at::empty({a.batch, a.heads_q, a.seqlen_q}, lse.options());
      BwdParams p;
      fill_fwd_params(p, a, q, k, v, out, lse, softcap, align_bottom_right);
      fill_grad_params(p, dout, dq, dk, dv);
      p.head_dim = q.size(3);
      p.head_dim_v = v.size(3);
      const at::Tensor bias_view =
          attn_bias.has_value() ? prepare_bias(*attn_bias, a, at::kFloat, p) : at::Tensor();
      p.dbias_full = want_dbias ? dbias_full.data_ptr() : nullptr;
      const at::Tensor dlse = prepare_dlse(dsoftmax_lse, a, q, p);
      fill_dropout_params(p, dropout_p);
      if (p.dropout) {  // the forward's (seed, offset), read on the device
        check_rng_state(rng_state);
        TORCH_CHECK_VALUE(rng_state.device() == q.device(), "rng_state must be on ", q.device(),
                          " (the forward's), got ", rng_state.device());
        p.philox_seed_ptr = rng_state.data_ptr<int64_t>();
        p.philox_offset_ptr = p.philox_seed_ptr + 1;
      }
      const int64_t kernel_dim = std::max(p.head_dim, p.head_dim_v);
      // fp32 scratch of the atomic dQ (params.h: dq_accum), where the 8-warp kernels run (their
      // shared memory fits this GPU: not at head dim 256 on sm_80, 128 on sm_86 / sm_89); the
      // backward zeroes it there.
      at::Tensor dq_accum;
      const int lean_smem = lean_bwd_smem_bytes(static_cast<int>(dq_accum_cols(kernel_dim)));
      if (!deterministic && !at::globalContext().deterministicAlgorithms() && !p.general() &&
          sm80::max_smem_optin_per_block() >= lean_smem) {
        dq_accum = at::empty(
            {a.batch, dq_accum_rows(a.seqlen_q), a.heads_q, dq_accum_cols(kernel_dim)},
            lse.options());
        p.dq_accum = dq_accum.data_ptr<float>();
        p.dq_bulk = !atomic_dq_forced();
      }
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
      float* delta_ptr = delta.data_ptr<float>();
      cudaError_t err = q.scalar_type() == at::kBFloat16
                            ? run_bwd<__nv_bfloat16>(kernel_dim, p, delta_ptr, stream)
                            : run_bwd<__half>(kernel_dim, p, delta_ptr, stream);
      C10_CUDA_CHECK(err);
    }
  }
  auto unpad = [](const at::Tensor& g, int64_t d) {
    return g.size(3) == d ? g : g.narrow(3, 0, d).contiguous();
  };
  return {unpad(dq, a.head_dim), unpad(dk, a.head_dim), unpad(dv, a.head_dim_v),
          reduce_dbias(dbias_full, attn_bias, want_dbias, q)};
}

}  // namespace

}  // namespace flash_attn_ext::cuda

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("fwd", &flash_attn_ext::cuda::fwd_cuda);
  m.impl("bwd", &flash_attn_ext::cuda::bwd_cuda);
}
