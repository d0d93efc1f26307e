// Autograd for the flash_attn_ext ops, in C++ (the Autograd dispatch key, every device).
//
// fwd's backward is the bwd op (fwd_varlen's the bwd_varlen op, the same way): recomputation
// from q, k, v, out and softmax_lse (FlashAttention-2, arXiv:2307.08691, Algorithm 2), including the gradient that flows into
// softmax_lse (e.g. from merging attention chunks).  bwd itself has an autograd node whose
// backward refuses double backward with a clear error.  Written in C++ rather than with
// torch.library.register_autograd because that Python wrapper rebuilt the op's argument list from
// its schema on every call: ~55 us of CPU per training call on a small machine, more than the
// forward kernel at short sequences.  torch.compile traces through these kernels as it does
// through any op with an Autograd kernel (tests/test_ops.py: opcheck, compile).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace flash_attn_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The flags both forward ops hand their backward op (FwdFunction, VarlenFwdFunction).
void save_flags(AutogradContext* ctx, std::optional<double> softmax_scale, bool causal,
                int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                bool deterministic) {
  ctx->saved_data["softmax_scale"] = softmax_scale;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["window_left"] = window_left;
  ctx->saved_data["window_right"] = window_right;
  ctx->saved_data["softcap"] = softcap;
  ctx->saved_data["dropout_p"] = dropout_p;
  ctx->saved_data["deterministic"] = deterministic;
}

// The ops below autograd (the backend kernels: CPU, CUDA, or fake under tracing); call_bwd with
// `with_autograd` goes through bwd's own autograd node (fwd's backward under create_graph).
Tensor3 call_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                 std::optional<double> softmax_scale, bool causal, int64_t window_left,
                 int64_t window_right, bool align_bottom_right, double softcap,
                 const OptTensor& alibi_slopes, const OptTensor& attn_bias, double dropout_p,
                 bool deterministic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flash_attn_ext::fwd", "")
                       .typed<Tensor3(const Tensor&, const Tensor&, const Tensor&,
                                      std::optional<double>, bool, int64_t, int64_t, bool, double,
                                      const OptTensor&, const OptTensor&, double, bool)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, v, softmax_scale, causal, window_left, window_right, align_bottom_right,
                 softcap, alibi_slopes, attn_bias, dropout_p, deterministic);
}

Tensor4 call_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& out, const Tensor& softmax_lse, const Tensor& rng_state,
                 std::optional<double> softmax_scale, bool causal, int64_t window_left,
                 int64_t window_right, bool align_bottom_right, double softcap,
                 const OptTensor& alibi_slopes, const OptTensor& attn_bias, double dropout_p,
                 bool deterministic, bool bias_requires_grad, const OptTensor& dsoftmax_lse,
                 bool with_autograd) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flash_attn_ext::bwd", "")
          .typed<Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, const Tensor&, std::optional<double>, bool,
                         int64_t, int64_t, bool, double, const OptTensor&, const OptTensor&,
                         double, bool, bool, const OptTensor&)>();
  std::optional<at::AutoDispatchBelowADInplaceOrView> guard;
  if (!with_autograd) guard.emplace();
  return op.call(dout, q, k, v, out, softmax_lse, rng_state, softmax_scale, causal, window_left,
                 window_right, align_bottom_right, softcap, alibi_slopes, attn_bias, dropout_p,
                 deterministic, bias_requires_grad, dsoftmax_lse);
}

OptTensor optional_of(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A silently missing gradient would be a wrong answer: refuse slopes that want one.
void check_alibi_no_grad(const OptTensor& alibi_slopes) {
  TORCH_CHECK_VALUE(!(alibi_slopes.has_value() && alibi_slopes->requires_grad() &&
                      at::GradMode::is_enabled()),
                    "alibi_slopes requires grad, but flash_attn_ext computes no gradient for the "
                    "slopes (as FlashAttention-2); pass alibi_slopes.detach()");
}

constexpr const char* kNoDoubleBackward =
    "flash_attn_ext does not support double backward (a gradient of its gradient, e.g. "
    "torch.autograd.grad(..., create_graph=True) followed by another backward); use "
    "torch.nn.functional.scaled_dot_product_attention with the math backend for that";

class FwdFunction : public torch::autograd::Function<FwdFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right,
                               bool align_bottom_right, double softcap,
                               const OptTensor& alibi_slopes, const OptTensor& attn_bias,
                               double dropout_p, bool deterministic) {
    auto [out, softmax_lse, rng_state] =
        call_fwd(q, k, v, softmax_scale, causal, window_left, window_right, align_bottom_right,
                 softcap, alibi_slopes, attn_bias, dropout_p, deterministic);
    ctx->save_for_backward({q, k, v, out, softmax_lse, rng_state,
                            alibi_slopes.value_or(Tensor()), attn_bias.value_or(Tensor())});
    save_flags(ctx, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
               deterministic);
    ctx->saved_data["align_bottom_right"] = align_bottom_right;
    ctx->saved_data["bias_requires_grad"] = attn_bias.has_value() && attn_bias->requires_grad();
    // softmax_lse is differentiable (its gradient enters the bwd op as dsoftmax_lse); the
    // gradients of unused outputs stay undefined rather than zero-filled.
    ctx->mark_non_differentiable({rng_state});
    ctx->set_materialize_grads(false);
    return {out, softmax_lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const bool bias_requires_grad = d.at("bias_requires_grad").toBool();
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    auto [dq, dk, dv, dbias] = call_bwd(
        dout, s[0], s[1], s[2], s[3], s[4], s[5], d.at("softmax_scale").toOptional<double>(),
        d.at("causal").toBool(), d.at("window_left").toInt(), d.at("window_right").toInt(),
        d.at("align_bottom_right").toBool(), d.at("softcap").toDouble(), optional_of(s[6]),
        optional_of(s[7]), d.at("dropout_p").toDouble(), d.at("deterministic").toBool(),
        bias_requires_grad, optional_of(grads[1]), /*with_autograd=*/true);
    return {dq,       dk,       dv,       Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            bias_requires_grad ? dbias : Tensor(), Tensor(), Tensor()};
  }
};

class BwdFunction : public torch::autograd::Function<BwdFunction> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& dout, const Tensor& q,
                               const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& softmax_lse, const Tensor& rng_state,
                               std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right,
                               bool align_bottom_right, double softcap,
                               const OptTensor& alibi_slopes, const OptTensor& attn_bias,
                               double dropout_p, bool deterministic, bool bias_requires_grad,
                               const OptTensor& dsoftmax_lse) {
    auto [dq, dk, dv, dbias] =
        call_bwd(dout, q, k, v, out, softmax_lse, rng_state, softmax_scale, causal, window_left,
                 window_right, align_bottom_right, softcap, alibi_slopes, attn_bias, dropout_p,
                 deterministic, bias_requires_grad, dsoftmax_lse, /*with_autograd=*/false);
    return {dq, dk, dv, dbias};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, kNoDoubleBackward);
  }
};

// Packed sequences (the varlen ops), the same way: fwd_varlen's backward is bwd_varlen.
Tensor3 call_fwd_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                        c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                        std::optional<double> softmax_scale, bool causal, int64_t window_left,
                        int64_t window_right, double softcap, const OptTensor& alibi_slopes,
                        double dropout_p, const OptTensor& seqused_k, bool deterministic) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flash_attn_ext::fwd_varlen", "")
          .typed<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, c10::SymInt, c10::SymInt, std::optional<double>, bool,
                         int64_t, int64_t, double, const OptTensor&, double, const OptTensor&,
                         bool)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                 dropout_p, seqused_k, deterministic);
}

Tensor3 call_bwd_varlen(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
                        const Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                        c10::SymInt max_seqlen_k, const Tensor& rng_state,
                        std::optional<double> softmax_scale, bool causal, int64_t window_left,
                        int64_t window_right, double softcap,
                        const OptTensor& alibi_slopes, double dropout_p,
                        const OptTensor& seqused_k, const OptTensor& dsoftmax_lse,
                        bool deterministic, bool with_autograd) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flash_attn_ext::bwd_varlen", "")
          .typed<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::SymInt,
                         c10::SymInt, const Tensor&, std::optional<double>, bool, int64_t, int64_t,
                         double, const OptTensor&, double, const OptTensor&, const OptTensor&,
                         bool)>();
  std::optional<at::AutoDispatchBelowADInplaceOrView> guard;
  if (!with_autograd) guard.emplace();
  return op.call(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, rng_state, softmax_scale, causal, window_left, window_right,
                 softcap, alibi_slopes, dropout_p, seqused_k, dsoftmax_lse, deterministic);
}

class VarlenFwdFunction : public torch::autograd::Function<VarlenFwdFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& cu_seqlens_q,
                               const Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                               c10::SymInt max_seqlen_k, std::optional<double> softmax_scale,
                               bool causal, int64_t window_left, int64_t window_right,
                               double softcap, const OptTensor& alibi_slopes, double dropout_p,
                               const OptTensor& seqused_k, bool deterministic) {
    auto [out, softmax_lse, rng_state] =
        call_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_left, window_right, softcap,
                        alibi_slopes, dropout_p, seqused_k, deterministic);
    ctx->save_for_backward({q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                            alibi_slopes.value_or(Tensor()), seqused_k.value_or(Tensor())});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    save_flags(ctx, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
               deterministic);
    ctx->mark_non_differentiable({rng_state});
    ctx->set_materialize_grads(false);
    return {out, softmax_lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    auto [dq, dk, dv] = call_bwd_varlen(
        dout, s[0], s[1], s[2], s[3], s[4], s[5], s[6], d.at("max_seqlen_q").toSymInt(),
        d.at("max_seqlen_k").toSymInt(), s[7], d.at("softmax_scale").toOptional<double>(),
        d.at("causal").toBool(), d.at("window_left").toInt(), d.at("window_right").toInt(),
        d.at("softcap").toDouble(), optional_of(s[8]), d.at("dropout_p").toDouble(),
        optional_of(s[9]), optional_of(grads[1]), d.at("deterministic").toBool(),
        /*with_autograd=*/true);
    variable_list result(16);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    return result;
  }
};

class VarlenBwdFunction : public torch::autograd::Function<VarlenBwdFunction> {
 public:
  static variable_list forward(AutogradContext*, const Tensor& dout, const Tensor& q,
                               const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
                               const Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                               c10::SymInt max_seqlen_k, const Tensor& rng_state,
                               std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               const OptTensor& alibi_slopes, double dropout_p,
                               const OptTensor& seqused_k, const OptTensor& dsoftmax_lse,
                               bool deterministic) {
    auto [dq, dk, dv] = call_bwd_varlen(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        rng_state, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
        dropout_p, seqused_k, dsoftmax_lse, deterministic, /*with_autograd=*/false);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, kNoDoubleBackward);
  }
};

Tensor3 fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                     std::optional<double> softmax_scale, bool causal, int64_t window_left,
                     int64_t window_right, bool align_bottom_right, double softcap,
                     const OptTensor& alibi_slopes, const OptTensor& attn_bias, double dropout_p,
                     bool deterministic) {
  check_alibi_no_grad(alibi_slopes);
  const variable_list r =
      FwdFunction::apply(q, k, v, softmax_scale, causal, window_left, window_right,
                         align_bottom_right, softcap, alibi_slopes, attn_bias, dropout_p,
                         deterministic);
  return {r[0], r[1], r[2]};
}

Tensor4 bwd_autograd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& out, const Tensor& softmax_lse, const Tensor& rng_state,
                     std::optional<double> softmax_scale, bool causal, int64_t window_left,
                     int64_t window_right, bool align_bottom_right, double softcap,
                     const OptTensor& alibi_slopes, const OptTensor& attn_bias, double dropout_p,
                     bool deterministic, bool bias_requires_grad, const OptTensor& dsoftmax_lse) {
  const variable_list r = BwdFunction::apply(
      dout, q, k, v, out, softmax_lse, rng_state, softmax_scale, causal, window_left,
      window_right, align_bottom_right, softcap, alibi_slopes, attn_bias, dropout_p,
      deterministic, bias_requires_grad, dsoftmax_lse);
  return {r[0], r[1], r[2], r[3]};
}

Tensor3 fwd_varlen_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            std::optional<double> softmax_scale, bool causal,
                            int64_t window_left, int64_t window_right, double softcap,
                            const OptTensor& alibi_slopes, double dropout_p,
                            const OptTensor& seqused_k, bool deterministic) {
  check_alibi_no_grad(alibi_slopes);
  const variable_list r = VarlenFwdFunction::apply(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, dropout_p, seqused_k, deterministic);
  return {r[0], r[1], r[2]};
}

Tensor3 bwd_varlen_autograd(const Tensor& dout, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            const Tensor& rng_state,
                            std::optional<double> softmax_scale, bool causal,
                            int64_t window_left, int64_t window_right, double softcap,
                            const OptTensor& alibi_slopes, double dropout_p,
                            const OptTensor& seqused_k, const OptTensor& dsoftmax_lse,
                            bool deterministic) {
  const variable_list r = VarlenBwdFunction::apply(
      dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      rng_state, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
      dropout_p, seqused_k, dsoftmax_lse, deterministic);
  return {r[0], r[1], r[2]};
}

}  // namespace
}  // namespace flash_attn_ext

TORCH_LIBRARY_IMPL(flash_attn_ext, Autograd, m) {
  m.impl("fwd", &flash_attn_ext::fwd_autograd);
  m.impl("bwd", &flash_attn_ext::bwd_autograd);
  m.impl("fwd_varlen", &flash_attn_ext::fwd_varlen_autograd);
  m.impl("bwd_varlen", &flash_attn_ext::bwd_varlen_autograd);
}
