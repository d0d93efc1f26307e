// Argument validation shared by every implementation (CPU, CUDA) of the flash_attn_ext ops.
// Each failed check names the argument, the value it got and the rule it broke.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "params.h"

namespace flash_attn_ext {

// The batch, row and head strides of a (batch, seqlen, heads, head_dim) tensor, into a params
// struct's three fields.
inline void set_strides(const at::Tensor& t, int64_t& batch_stride, int64_t& row_stride,
                        int64_t& head_stride) {
  batch_stride = t.stride(0);
  row_stride = t.stride(1);
  head_stride = t.stride(2);
}

struct AttnArgs {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  double softmax_scale;
  int64_t window_left, window_right;  // causal already folded into window_right = 0
};

// Validates q/k/v and the flags of the forward (and, with the same arguments, the backward) op.
// kernel_dtypes: require a dtype this device's kernels take; else float16, bfloat16, float32 or
// float64 (the checks of the unfused fallback path; float8 is floating in ATen but refused).
AttnArgs check_attn_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<double> softmax_scale, bool causal, int64_t window_left,
                         int64_t window_right, double softcap,
                         const std::optional<at::Tensor>& alibi_slopes,
                         const std::optional<at::Tensor>& attn_bias, double dropout_p,
                         bool kernel_dtypes = true);

// The attention bias as an accumulator-type (float32, float64 for float64 inputs) view
// expanded to (batch, heads_q, seqlen_q, seqlen_k): broadcast dimensions get stride 0, so only
// the bias's own elements exist in memory; the keys' stride is 1 or 0 (a copy where needed).
// A boolean mask (True = attend) becomes 0 / -inf at its own shape, or with keep_mask stays
// the bytes it is (p.bias_is_mask: the CPU kernels, the Hopper kernels' mask variant).  Fills
// the bias fields of `p`.
at::Tensor prepare_bias(const at::Tensor& bias, const AttnArgs& a, at::ScalarType acc_dtype,
                        FwdParams& p, bool keep_mask = false);
// The backward's bias_requires_grad against attn_bias: a boolean mask has no gradient
// (ValueError).
void check_bias_grad(const std::optional<at::Tensor>& attn_bias, bool bias_requires_grad);

// alibi_slopes (checked by check_attn_args: (heads_q,) or (batch, heads_q)) as a contiguous
// accumulator-type tensor, pointed to by p.alibi_slopes with p.alibi_batch_stride (0 for one
// slope per head); an undefined tensor without slopes.  It must outlive the kernels.
at::Tensor prepare_alibi(const std::optional<at::Tensor>& alibi_slopes, at::ScalarType acc_dtype,
                         FwdParams& p);

// Checks that `t` has exactly `sizes`, and q's dtype and device.
void check_like(const at::Tensor& t, const char* name, at::IntArrayRef sizes,
                const at::Tensor& q);

// A dtype as Python writes it ("torch.float16", not c10's "Half"), for error messages.
std::string dtype_name(at::ScalarType t);

// The dtype of softmax_lse for inputs of this dtype: float32, or float64 for float64 inputs.
at::ScalarType lse_dtype(at::ScalarType input_dtype);

// Allocates an output the kernel must fill completely.  With debug poisoning on, it starts as NaN
// (integers: -1) so that any element a kernel forgets to write shows up in tests.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);
// The same with t's sizes, dtype, device and, where that keeps the last dimension innermost,
// t's stride order (empty_like; otherwise contiguous, e.g. for an expanded t): a
// gradient laid out like its input is kept by autograd as .grad instead of being copied into
// the input's layout (an extra pass over q, k and v for inputs in SDPA's (B, H, L, d) layout).
at::Tensor new_output_like(const at::Tensor& t);
void set_debug_poison(bool enabled);

// Returns t if its last dimension is contiguous (stride 1), else a copy that is.
at::Tensor last_dim_contiguous(const at::Tensor& t);

// Fills the shape/stride/flag part of FwdParams (pointers for q/k/v/out/lse included).
void fill_fwd_params(FwdParams& p, const AttnArgs& a, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     double softcap, bool align_bottom_right);

// The backward's checks of out, dout (shape of out, q's dtype and device) and softmax_lse.
void check_bwd_tensors(const AttnArgs& a, const at::Tensor& dout, const at::Tensor& out,
                       const at::Tensor& softmax_lse, const at::Tensor& q);

// The bwd op's optional dsoftmax_lse: checked like softmax_lse (shape `sizes`: (B, H, L)
// dense, (H, total_q) packed), made contiguous, pointed to by p.dsoftmax_lse; the returned
// tensor must outlive the kernels.
at::Tensor prepare_dlse(const std::optional<at::Tensor>& dsoftmax_lse, at::IntArrayRef sizes,
                        const at::Tensor& q, BwdParams& p);

// The bwd op's rng_state with dropout: the forward's int64[2] (seed, offset).
void check_rng_state(const at::Tensor& rng_state);

// Sets the dropout flag, threshold and scale of `p` (not the seed/offset: see params.h).
void fill_dropout_params(FwdParams& p, double dropout_p);

// The bwd op's dbias: dbias_full ((batch, heads_q, seqlen_q, seqlen_k), the scores' gradient)
// summed to attn_bias's shape and dtype when `wanted`; else an empty tensor like q.
at::Tensor reduce_dbias(const at::Tensor& dbias_full, const std::optional<at::Tensor>& attn_bias,
                        bool wanted, const at::Tensor& q);

// Fills the dout/dq/dk/dv pointers and strides of BwdParams.
void fill_grad_params(BwdParams& p, const at::Tensor& dout, const at::Tensor& dq,
                      const at::Tensor& dk, const at::Tensor& dv);

}  // namespace flash_attn_ext
