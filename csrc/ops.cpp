// The flash_attn_ext op schemas (the contract every implementation and the Python layer share) and
// the argument checks shared by the CPU and CUDA glue.
//
// Schemas are functional: they return new tensors and mutate nothing, so that autograd
// registration and torch.compile accept them.  New arguments go at the end, with defaults.
#include <torch/library.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "dropout.h"

namespace flash_attn_ext {

namespace {

// The four dtypes of either route (the CPU kernels and the unfused fallback): not every
// floating one, since ATen counts float8 as floating.
bool is_float_dtype(at::ScalarType d) {
  return d == at::kFloat || d == at::kDouble || d == at::kHalf || d == at::kBFloat16;
}

bool is_supported_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  if (t.is_cuda()) return d == at::kHalf || d == at::kBFloat16;
  return is_float_dtype(d);
}

}  // namespace

namespace {
std::atomic<bool> g_debug_poison{false};
}  // namespace

void set_debug_poison(bool enabled) { g_debug_poison = enabled; }

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!g_debug_poison) return at::empty(sizes, options);
  if (at::isFloatingType(options.dtype().toScalarType()))
    return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
  return at::full(sizes, -1, options);
}

at::Tensor new_output_like(const at::Tensor& t) {
  // empty_like lays a new tensor out in the order of t's strides, and every kernel writes rows
  // with a unit-stride last dimension.  A dimension of size > 1 whose stride is not above the
  // last one's (0 where t is expanded, as in K of shape (1, S, 2, D) with strides (1, D, 0, 1),
  // which empty_like turned into (1, 2D, 1, 2)) would land inside the last dimension: such a
  // tensor gets a contiguous buffer.  ops.py's _grad_like predicts the same layout for the
  // fake kernels.
  bool keep = t.size(-1) <= 1 || t.stride(-1) == 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) <= 1) keep = false;
  at::Tensor out = keep ? at::empty_like(t) : at::empty(t.sizes(), t.options());
  if (g_debug_poison) {
    if (at::isFloatingType(t.scalar_type()))
      out.fill_(std::numeric_limits<double>::quiet_NaN());
    else
      out.fill_(-1);
  }
  return out;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    // (c10 names the complex types ComplexHalf/Float/Double, which lowercased below would read
    // torch.complexfloat: a name torch has not; torch calls them by their bit widths)
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {
      std::string name = c10::toString(t);  // e.g. Float8_e4m3fn, UInt16: torch's names lowercased
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

at::ScalarType lse_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

AttnArgs check_attn_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<double> softmax_scale, bool causal, int64_t window_left,
                         int64_t window_right, double softcap,
                         const std::optional<at::Tensor>& alibi_slopes,
                         const std::optional<at::Tensor>& attn_bias, double dropout_p,
                         bool kernel_dtypes) {
  TORCH_CHECK_VALUE(q.dim() == 4,
                    "q must have 4 dimensions (batch, seqlen_q, num_heads, head_dim), got q.dim()=",
                    q.dim(), " with shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4,
                    "k must have 4 dimensions (batch, seqlen_k, num_heads_k, head_dim), got "
                    "k.dim()=", k.dim(), " with shape ", k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4,
                    "v must have 4 dimensions (batch, seqlen_k, num_heads_k, head_dim_v), got "
                    "v.dim()=", v.dim(), " with shape ", v.sizes());
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "q, k and v must have the same dtype, got q.dtype=", dtype_name(q.scalar_type()),
                    ", k.dtype=", dtype_name(k.scalar_type()), ", v.dtype=",
                    dtype_name(v.scalar_type()));
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                    "q, k and v must be on the same device, got q.device=", q.device(),
                    ", k.device=", k.device(), ", v.device=", v.device());
  // Without kernel_dtypes (a call the unfused fallback may serve) the four dtypes of either
  // route: float8 passed at::isFloatingType and ran unfused in float8 with a warning that no
  // kernel or fallback took it (a new-user finding).
  const auto d = q.scalar_type();
  const bool dtype_ok = kernel_dtypes ? is_supported_dtype(q) : is_float_dtype(d);
  TORCH_CHECK_VALUE(dtype_ok, "q.dtype=", dtype_name(d), " is not supported on ",
                    q.device().type(), ": CPU takes float32, float64, float16 and bfloat16; CUDA "
                    "takes float16 and bfloat16",
                    kernel_dtypes ? "" : " (float32 and float64 through the unfused fallback)");

  AttnArgs a{};
  a.batch = q.size(0);
  a.seqlen_q = q.size(1);
  a.heads_q = q.size(2);
  a.head_dim = q.size(3);
  a.seqlen_k = k.size(1);
  a.heads_kv = k.size(2);
  a.head_dim_v = v.size(3);

  TORCH_CHECK_VALUE(k.size(0) == a.batch && v.size(0) == a.batch,
                    "q, k and v must have the same batch size, got q.size(0)=", a.batch,
                    ", k.size(0)=", k.size(0), ", v.size(0)=", v.size(0));
  TORCH_CHECK_VALUE(v.size(1) == a.seqlen_k, "k and v must have the same seqlen_k, got k.size(1)=",
                    a.seqlen_k, ", v.size(1)=", v.size(1));
  TORCH_CHECK_VALUE(v.size(2) == a.heads_kv,
                    "k and v must have the same number of heads, got k.size(2)=", a.heads_kv,
                    ", v.size(2)=", v.size(2));
  TORCH_CHECK_VALUE(k.size(3) == a.head_dim, "k.size(3) (head_dim) must equal q.size(3)=",
                    a.head_dim, ", got ", k.size(3));
  TORCH_CHECK_VALUE(a.head_dim >= 1 && a.head_dim <= kMaxHeadDim,
                    "head_dim must be between 1 and ", kMaxHeadDim, ", got q.size(3)=", a.head_dim);
  TORCH_CHECK_VALUE(a.head_dim_v >= 1 && a.head_dim_v <= kMaxHeadDim,
                    "head_dim_v must be between 1 and ", kMaxHeadDim, ", got v.size(3)=",
                    a.head_dim_v);
  TORCH_CHECK_VALUE(a.heads_kv >= 1 || a.heads_q == 0,
                    "k and v must have at least one head when q has heads, got k.size(2)=",
                    a.heads_kv, " with q.size(2)=", a.heads_q);
  const bool no_heads = a.heads_q == 0 && a.heads_kv == 0;
  TORCH_CHECK_VALUE(no_heads || (a.heads_kv >= 1 && a.heads_q % a.heads_kv == 0),
                    "the number of query heads must be a multiple of the number of key/value heads "
                    "(GQA/MQA), got num_heads q.size(2)=", a.heads_q, " and num_heads_k k.size(2)=",
                    a.heads_kv);

  TORCH_CHECK_VALUE(window_left >= -1, "window_left must be >= -1 (-1 = unbounded), got ",
                    window_left);
  TORCH_CHECK_VALUE(window_right >= -1, "window_right must be >= -1 (-1 = unbounded), got ",
                    window_right);
  // A side reaching past both sequences is the same as unbounded; folding it to -1 also keeps
  // i + offset +- window inside int64 for any window the user passes.
  const int64_t covers_all = a.seqlen_q + a.seqlen_k;
  a.window_left = window_left > covers_all ? -1 : window_left;
  a.window_right = causal ? 0 : (window_right > covers_all ? -1 : window_right);

  a.softmax_scale = softmax_scale.has_value() ? *softmax_scale
                                              : 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  TORCH_CHECK_VALUE(std::isfinite(a.softmax_scale) &&
                        std::abs(a.softmax_scale) <= std::numeric_limits<float>::max(),
                    "softmax_scale must be finite and representable in float32, got ",
                    a.softmax_scale);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0 &&
                        softcap <= std::numeric_limits<float>::max(),
                    "softcap must be finite and >= 0 (0 = off), got ", softcap);
  TORCH_CHECK_VALUE(std::isfinite(dropout_p) && dropout_p >= 0.0 && dropout_p < 1.0,
                    "dropout_p must be in [0, 1), got ", dropout_p);
  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    TORCH_CHECK_VALUE(at::isFloatingType(slopes.scalar_type()),
                      "alibi_slopes must be a floating tensor (float32 as FlashAttention-2 takes "
                      "it), got dtype ", dtype_name(slopes.scalar_type()));
    TORCH_CHECK_VALUE(slopes.device() == q.device(), "alibi_slopes must be on ", q.device(),
                      ", got ", slopes.device());
    const bool per_head = slopes.dim() == 1 && slopes.size(0) == a.heads_q;
    const bool per_batch_head =
        slopes.dim() == 2 && slopes.size(0) == a.batch && slopes.size(1) == a.heads_q;
    TORCH_CHECK_VALUE(per_head || per_batch_head, "alibi_slopes must have shape (num_heads,) = (",
                      a.heads_q, ",) or (batch, num_heads) = (", a.batch, ", ", a.heads_q,
                      "), got ", slopes.sizes());
  }
  if (attn_bias.has_value()) {
    const at::Tensor& bias = *attn_bias;
    TORCH_CHECK_VALUE(bias.dim() <= 4,
                      "attn_bias must have at most 4 dimensions (batch, num_heads, seqlen_q, "
                      "seqlen_k), got attn_bias.dim()=", bias.dim());
    TORCH_CHECK_VALUE(at::isFloatingType(bias.scalar_type()) || bias.scalar_type() == at::kBool,
                      "attn_bias must be a floating tensor (additive) or a boolean mask (True = "
                      "attend), got dtype ", dtype_name(bias.scalar_type()));
    TORCH_CHECK_VALUE(bias.device() == q.device(), "attn_bias must be on ", q.device(), ", got ",
                      bias.device());
    const int64_t full[4] = {a.batch, a.heads_q, a.seqlen_q, a.seqlen_k};
    for (int64_t d = 0; d < bias.dim(); ++d) {
      const int64_t size = bias.size(bias.dim() - 1 - d), want = full[3 - d];
      TORCH_CHECK_VALUE(size == want || size == 1, "attn_bias of shape ", bias.sizes(),
                        " is not broadcastable to (batch, num_heads, seqlen_q, seqlen_k) = (",
                        a.batch, ", ", a.heads_q, ", ", a.seqlen_q, ", ", a.seqlen_k, ")");
    }
  }
  return a;
}

at::Tensor prepare_alibi(const std::optional<at::Tensor>& alibi_slopes, at::ScalarType acc_dtype,
                         FwdParams& p) {
  if (!alibi_slopes.has_value()) return at::Tensor();
  const at::Tensor slopes = alibi_slopes->to(acc_dtype).contiguous();
  p.alibi_slopes = slopes.data_ptr();
  p.alibi_batch_stride = slopes.dim() == 2 ? slopes.size(1) : 0;
  return slopes;
}

void check_bias_grad(const std::optional<at::Tensor>& attn_bias, bool bias_requires_grad) {
  TORCH_CHECK_VALUE(!(bias_requires_grad && attn_bias.has_value() &&
                      attn_bias->scalar_type() == at::kBool),
                    "bias_requires_grad=True with a boolean attn_bias: a mask has no gradient");
}

// A boolean mask as 0 / -inf in `dtype`, converted at its own extent (size 1 where it is
// expanded, stride 0) and expanded back, so that a broadcast stays one.
at::Tensor additive_mask(const at::Tensor& mask, at::ScalarType dtype) {
  at::Tensor own = mask;
  for (int64_t d = 0; d < mask.dim(); ++d)
    if (mask.stride(d) == 0 && mask.size(d) > 1) own = own.narrow(d, 0, 1);
  return at::zeros(own.sizes(), own.options().dtype(dtype))
      .masked_fill_(own.logical_not(), -std::numeric_limits<double>::infinity())
      .expand(mask.sizes());
}

at::Tensor prepare_bias(const at::Tensor& bias, const AttnArgs& a, at::ScalarType acc_dtype,
                        FwdParams& p, bool keep_mask) {
  const bool mask = bias.scalar_type() == at::kBool;
  at::Tensor b = !mask ? bias.to(acc_dtype) : keep_mask ? bias : additive_mask(bias, acc_dtype);
  p.bias_is_mask = mask && keep_mask;
  // Keys unit-stride or broadcast (stride 0), which the Hopper kernels' bias reads assume: a
  // copy only for other strides (a broadcast key dimension stays one: copying it would
  // materialise every broadcast dimension, e.g. a (B, 1, L, 1) mask as B * H * L * S floats).
  if (b.dim() > 0 && b.size(-1) > 1 && b.stride(-1) != 1 && b.stride(-1) != 0) b = b.contiguous();
  b = b.expand({a.batch, a.heads_q, a.seqlen_q, a.seqlen_k});
  p.attn_bias = b.data_ptr();
  p.bias_batch_stride = b.stride(0);
  p.bias_head_stride = b.stride(1);
  p.bias_row_stride = b.stride(2);
  p.bias_col_stride = b.stride(3);
  return b;
}

void check_like(const at::Tensor& t, const char* name, at::IntArrayRef sizes,
                const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.sizes() == sizes, name, " must have shape ", sizes, ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), name, " must be on ", q.device(), ", got ",
                    t.device());
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return (t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1) ? t : t.contiguous();
}

void fill_fwd_params(FwdParams& p, const AttnArgs& a, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     double softcap, bool align_bottom_right) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.softmax_lse = lse.data_ptr();
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.heads_q = a.heads_q;
  p.heads_kv = a.heads_kv;
  p.head_dim = a.head_dim;
  p.head_dim_v = a.head_dim_v;
  set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set_strides(out, p.out_batch_stride, p.out_row_stride, p.out_head_stride);
  p.softmax_scale = a.softmax_scale;
  p.softcap = softcap;
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  p.align_bottom_right = align_bottom_right;
}

void check_bwd_tensors(const AttnArgs& a, const at::Tensor& dout, const at::Tensor& out,
                       const at::Tensor& softmax_lse, const at::Tensor& q) {
  const std::vector<int64_t> out_shape{a.batch, a.seqlen_q, a.heads_q, a.head_dim_v};
  check_like(out, "out", out_shape, q);
  check_like(dout, "dout", out_shape, q);
  check_like(softmax_lse, "softmax_lse", {a.batch, a.heads_q, a.seqlen_q}, q);
  TORCH_CHECK_VALUE(out.scalar_type() == q.scalar_type() && dout.scalar_type() == q.scalar_type(),
                    "out and dout must have q's dtype ", dtype_name(q.scalar_type()),
                    ", got out.dtype=", dtype_name(out.scalar_type()), ", dout.dtype=",
                    dtype_name(dout.scalar_type()));
  TORCH_CHECK_VALUE(softmax_lse.scalar_type() == lse_dtype(q.scalar_type()),
                    "softmax_lse must have dtype ", dtype_name(lse_dtype(q.scalar_type())),
                    ", got ", dtype_name(softmax_lse.scalar_type()));
}

at::Tensor prepare_dlse(const std::optional<at::Tensor>& dsoftmax_lse, at::IntArrayRef sizes,
                        const at::Tensor& q, BwdParams& p) {
  if (!dsoftmax_lse.has_value()) return at::Tensor();
  check_like(*dsoftmax_lse, "dsoftmax_lse", sizes, q);
  TORCH_CHECK_VALUE(dsoftmax_lse->scalar_type() == lse_dtype(q.scalar_type()),
                    "dsoftmax_lse must have softmax_lse's dtype ",
                    dtype_name(lse_dtype(q.scalar_type())), ", got ",
                    dtype_name(dsoftmax_lse->scalar_type()));
  at::Tensor t = dsoftmax_lse->contiguous();
  p.dsoftmax_lse = t.data_ptr();
  return t;
}

void check_rng_state(const at::Tensor& rng_state) {
  TORCH_CHECK_VALUE(rng_state.dim() == 1 && rng_state.size(0) == 2 &&
                        rng_state.scalar_type() == at::kLong,
                    "rng_state must be the forward's int64 tensor of 2 elements (seed, offset), "
                    "got dtype ", dtype_name(rng_state.scalar_type()), " and shape ", rng_state.sizes());
}

void fill_dropout_params(FwdParams& p, double dropout_p) {
  p.dropout = dropout_active(dropout_p);  // a dropout_p that rounds to 0 drops nothing
  p.dropout_p = dropout_p;
  p.dropout_threshold = p.dropout ? dropout_threshold(dropout_p) : 0u;
  p.dropout_scale = p.dropout ? static_cast<float>(dropout_scale(dropout_p)) : 1.f;
}

at::Tensor reduce_dbias(const at::Tensor& dbias_full, const std::optional<at::Tensor>& attn_bias,
                        bool wanted, const at::Tensor& q) {
  if (!wanted) return at::empty({0}, q.options());
  return at::sum_to(dbias_full, attn_bias->sizes()).to(attn_bias->scalar_type()).contiguous();
}

void fill_grad_params(BwdParams& p, const at::Tensor& dout, const at::Tensor& dq,
                      const at::Tensor& dk, const at::Tensor& dv) {
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  set_strides(dout, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride);
  set_strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  set_strides(dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  set_strides(dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
}

}  // namespace flash_attn_ext

TORCH_LIBRARY(flash_attn_ext, m) {
  // Returns (out (B, L, H, Dv), softmax_lse (B, H, L) float32 [float64 for float64 inputs],
  // rng_state int64[2] = philox (seed, offset) used by dropout, zeros without dropout).
  // `deterministic` does not change the forward; autograd hands it to bwd.  Tagged
  // nondeterministic_seeded (its dropout seed comes from PyTorch's generator): torch.compile's
  // partitioner then replays the generator state for a forward it recomputes in the backward
  // (activation checkpointing), so the recomputation draws the same dropout mask.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, bool align_bottom_right=True, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? attn_bias=None, float dropout_p=0.0, "
      "bool deterministic=False) -> (Tensor out, Tensor softmax_lse, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  // Returns (dq, dk, dv, dbias); dbias is empty unless attn_bias is given and bias_requires_grad.
  // dsoftmax_lse: the gradient flowing into softmax_lse (like it, or None); since
  // d lse_i / d s_ij = P_ij it enters as delta_i = rowsum(dO_i * O_i) - dlse_i.
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor rng_state, float? softmax_scale=None, bool causal=False, int window_left=-1, "
      "int window_right=-1, bool align_bottom_right=True, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? attn_bias=None, float dropout_p=0.0, "
      "bool deterministic=False, bool bias_requires_grad=False, Tensor? dsoftmax_lse=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
  // Decoding against a KV cache (flash_attn_with_kvcache; CUDA only, cuda/kvcache_cuda.cu):
  // q (B, L, H, d) against the caches read in place, batch row b's keys being its entry's (or
  // pages') rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new; all lengths read on the
  // device.  Returns (out (B, L, H, d), softmax_lse (B, H, L) float32); rows whose values break
  // a rule (params.h: DecodeParams) are NaN.
  m.def(
      "fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, Tensor? block_table=None, "
      "int seqlen_new=0, int rotary_rows=0, int seqlen_ro=-1, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None, int num_splits=0) -> (Tensor out, Tensor softmax_lse)");
  // Writes k / v (B, seqlen_new, H_kv, d) into the caches at rows cache_seqlens[b] .. (k
  // rotated on its first 2 * rotary_cos.shape[1] channels), in place.
  m.def(
      "kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
      "Tensor cache_seqlens, Tensor? cache_batch_idx=None, Tensor? block_table=None, "
      "Tensor? rotary_cos=None, Tensor? rotary_sin=None, bool rotary_interleaved=True) -> ()");
}
