// Packed sequences (FlashAttention-2's varlen API): the checks of a call's q, k, v, cu_seqlens,
// max_seqlen and seqused_k, and the params of a packed call, shared by the CPU
// (cpu/varlen_cpu.h) and CUDA (cuda/flash_cuda.cu) entry points of the fwd_varlen / bwd_varlen
// ops.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "params.h"

namespace flash_attn_ext {

// A packed call's sequences: cu_q / cu_k / used_k on the call's device (contiguous), and their
// host copies (the same tensors on the CPU; the CPU kernels' Seqs points into them).
struct Packed {
  at::Tensor cu_q, cu_k, used_k;
  at::Tensor cu_q_host, cu_k_host, used_k_host;
  int64_t batch = 0;    // number of sequences
  int64_t total_q = 0;  // rows of q
  int64_t total_k = 0;  // rows of k and v
  int64_t longest_q = 0, longest_k = 0;  // the longest sequence of each side (host offsets)
};

inline void check_packed_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const char* names[3] = {"q", "k", "v"};
  const char* shapes[3] = {"(total_q, num_heads, head_dim)", "(total_k, num_heads_k, head_dim)",
                           "(total_k, num_heads_k, head_dim_v)"};
  const at::Tensor* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK_VALUE(ts[i]->dim() == 3, names[i], " must have 3 dimensions ", shapes[i],
                      " for packed sequences, got ", names[i], ".dim()=", ts[i]->dim(),
                      " with shape ", ts[i]->sizes());
  // The shape rules check_attn_args applies again to (1, total, H, D) views, here in the
  // packed tensors' own dimensions, so that a message names the dimension the caller passed.
  TORCH_CHECK_VALUE(v.size(0) == k.size(0), "k and v must have the same total_k, got k.size(0)=",
                    k.size(0), ", v.size(0)=", v.size(0));
  TORCH_CHECK_VALUE(v.size(1) == k.size(1),
                    "k and v must have the same number of heads, got k.size(1)=", k.size(1),
                    ", v.size(1)=", v.size(1));
  TORCH_CHECK_VALUE(k.size(2) == q.size(2), "k.size(2) (head_dim) must equal q.size(2)=",
                    q.size(2), ", got ", k.size(2));
  TORCH_CHECK_VALUE(q.size(2) >= 1 && q.size(2) <= kMaxHeadDim,
                    "head_dim must be between 1 and ", kMaxHeadDim, ", got q.size(2)=", q.size(2));
  TORCH_CHECK_VALUE(v.size(2) >= 1 && v.size(2) <= kMaxHeadDim,
                    "head_dim_v must be between 1 and ", kMaxHeadDim, ", got v.size(2)=",
                    v.size(2));
  TORCH_CHECK_VALUE(k.size(1) >= 1 || q.size(1) == 0,
                    "k and v must have at least one head when q has heads, got k.size(1)=",
                    k.size(1), " with q.size(1)=", q.size(1));
  const bool no_heads = q.size(1) == 0 && k.size(1) == 0;
  TORCH_CHECK_VALUE(no_heads || (k.size(1) >= 1 && q.size(1) % k.size(1) == 0),
                    "the number of query heads must be a multiple of the number of key/value heads "
                    "(GQA/MQA), got num_heads q.size(1)=", q.size(1), " and num_heads_k k.size(1)=",
                    k.size(1));
}

// Checks cu_seqlens_q / cu_seqlens_k (int32, 1-D, batch + 1 non-decreasing offsets from >= 0 up
// to at most the tensors' rows) and max_seqlen_q / max_seqlen_k (at least the longest
// sequence); the geometry for q of total_q rows.  The offsets (and seqused_k) lie all on q's
// device or all on the CPU.  The values are read on the host: offsets on a CUDA device come
// back in one copy (a synchronisation, which also makes the call uncapturable in a CUDA graph;
// FlashAttention-2 reads nothing there and trusts them); offsets on the CPU with q on CUDA are
// read as they are and uploaded from pinned memory on the call's stream (no synchronisation:
// flash_attn_varlen_func copies them once and hands the forward and the backward the host
// copy).
inline Packed check_packed(const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                           int64_t max_seqlen_q, int64_t max_seqlen_k,
                           const std::optional<at::Tensor>& seqused_k) {
  Packed pk;
  const at::Tensor* cus[2] = {&cu_seqlens_q, &cu_seqlens_k};
  const char* names[2] = {"cu_seqlens_q", "cu_seqlens_k"};
  const int64_t totals[2] = {q.size(0), k.size(0)};
  const int64_t maxima[2] = {max_seqlen_q, max_seqlen_k};
  const char* max_names[2] = {"max_seqlen_q", "max_seqlen_k"};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& cu = *cus[i];
    TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) >= 1,
                      names[i], " must be a 1-D int32 tensor of batch + 1 offsets, got dtype ",
                      dtype_name(cu.scalar_type()), " and shape ", cu.sizes());
  }
  // All on q's device, or all on the CPU (host offsets for a CUDA call).
  const at::Device where = cu_seqlens_q.device();
  const bool on_host = where.is_cpu() && !q.device().is_cpu();
  auto check_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE((t.device() == q.device() || t.device().is_cpu()) && t.device() == where,
                      name, " must be on q's device (", q.device(),
                      ") or on the CPU, as cu_seqlens_q (", where, "), got ", t.device());
  };
  check_device(cu_seqlens_q, "cu_seqlens_q");
  check_device(cu_seqlens_k, "cu_seqlens_k");
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                    "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got ",
                    cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  pk.cu_q = cu_seqlens_q.contiguous();
  pk.cu_k = cu_seqlens_k.contiguous();
  pk.batch = cu_seqlens_q.size(0) - 1;
  if (seqused_k.has_value()) {
    const at::Tensor& used = *seqused_k;
    TORCH_CHECK_VALUE(used.scalar_type() == at::kInt && used.dim() == 1 &&
                          used.size(0) == pk.batch,
                      "seqused_k must be a 1-D int32 tensor of batch = ", pk.batch,
                      " key counts, got dtype ", dtype_name(used.scalar_type()), " and shape ",
                      used.sizes());
    check_device(used, "seqused_k");
    pk.used_k = used.contiguous();
  }
  // All offsets (and seqused_k) to the host in one copy: on CUDA each copy is a
  // synchronisation, and a packed step's time at many short sequences is theirs.
  std::vector<at::Tensor> parts = {pk.cu_q, pk.cu_k};
  if (pk.used_k.defined()) parts.push_back(pk.used_k);
  const at::Tensor host = at::cat(parts).cpu();
  pk.cu_q_host = host.narrow(0, 0, pk.batch + 1);
  pk.cu_k_host = host.narrow(0, pk.batch + 1, pk.batch + 1);
  if (pk.used_k.defined()) pk.used_k_host = host.narrow(0, 2 * (pk.batch + 1), pk.batch);
  const int32_t* offsets[2] = {pk.cu_q_host.data_ptr<int32_t>(), pk.cu_k_host.data_ptr<int32_t>()};
  for (int i = 0; i < 2; ++i) {
    const int32_t* cu = offsets[i];
    TORCH_CHECK_VALUE(cu[0] >= 0, names[i], "[0] must be >= 0, got ", cu[0]);
    int64_t longest = 0;
    for (int64_t b = 0; b < pk.batch; ++b) {
      TORCH_CHECK_VALUE(cu[b + 1] >= cu[b], names[i], " must be non-decreasing, got ", names[i],
                        "[", b, "]=", cu[b], " > ", names[i], "[", b + 1, "]=", cu[b + 1]);
      longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
    }
    TORCH_CHECK_VALUE(cu[pk.batch] <= totals[i], names[i], "[-1]=", cu[pk.batch],
                      " exceeds the ", i == 0 ? "q" : "k", " rows (", totals[i], ")");
    TORCH_CHECK_VALUE(maxima[i] >= longest, max_names[i], "=", maxima[i],
                      " is shorter than the longest sequence (", longest, ")");
    (i == 0 ? pk.longest_q : pk.longest_k) = longest;
  }
  if (pk.used_k.defined()) {
    const int32_t* n = pk.used_k_host.data_ptr<int32_t>();
    for (int64_t b = 0; b < pk.batch; ++b)
      TORCH_CHECK_VALUE(n[b] >= 0 && n[b] <= offsets[1][b + 1] - offsets[1][b], "seqused_k[", b,
                        "]=", n[b], " must be in [0, ", offsets[1][b + 1] - offsets[1][b],
                        "] (sequence ", b, "'s keys)");
  }
  if (on_host) {
    // Uploaded from pinned memory, so that the copy is queued on the call's stream without a
    // wait (the host allocator keeps the block until the copy is done).
    const at::Tensor device = host.pin_memory().to(q.options().dtype(at::kInt),
                                                   /*non_blocking=*/true);
    pk.cu_q = device.narrow(0, 0, pk.batch + 1);
    pk.cu_k = device.narrow(0, pk.batch + 1, pk.batch + 1);
    if (pk.used_k.defined()) pk.used_k = device.narrow(0, 2 * (pk.batch + 1), pk.batch);
  }
  pk.total_q = q.size(0);
  pk.total_k = k.size(0);
  return pk;
}

// alibi_slopes of a packed call: (num_heads,) or (batch, num_heads), batch the number of
// sequences.  Returns what the dense checks (check_attn_args: dtype, device, heads) are given
// for them on the packed (1, total, H, D) views: one row.
// (Checked here in the caller's terms: the dense checks would name the views' batch of 1.)
inline std::optional<at::Tensor> packed_alibi_row(const std::optional<at::Tensor>& alibi_slopes,
                                                  int64_t batch, int64_t heads) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  const at::Tensor& slopes = *alibi_slopes;
  TORCH_CHECK_VALUE((slopes.dim() == 1 && slopes.size(0) == heads) ||
                        (slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == heads),
                    "alibi_slopes must have shape (num_heads,) = (", heads,
                    ",) or (batch, num_heads) = (", batch, ", ", heads,
                    ") with batch = len(cu_seqlens_q) - 1, got ", slopes.sizes());
  return slopes.dim() == 2 && batch > 0 ? slopes[0] : slopes.reshape({-1});
}

// A packed call's inputs as the kernels take them: q, k, v as (1, total, H, D) views (last
// dimension contiguous), the dense checks' AttnArgs on them (no bias), the sequences.
struct PackedCall {
  at::Tensor q, k, v;
  AttnArgs a;
  Packed pk;
};

inline PackedCall check_packed_call(const at::Tensor& q_in, const at::Tensor& k_in,
                                    const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
                                    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                    int64_t max_seqlen_k, std::optional<double> softmax_scale,
                                    bool causal, int64_t window_left, int64_t window_right,
                                    double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                    double dropout_p,
                                    const std::optional<at::Tensor>& seqused_k,
                                    c10::DeviceType kernel_device = c10::DeviceType::CPU) {
  check_packed_qkv(q_in, k_in, v_in);
  PackedCall c;
  c.q = last_dim_contiguous(q_in).unsqueeze(0);
  c.k = last_dim_contiguous(k_in).unsqueeze(0);
  c.v = last_dim_contiguous(v_in).unsqueeze(0);
  TORCH_CHECK_VALUE(q_in.device().type() == kernel_device, "flash_attn_ext ",
                    c10::DeviceTypeName(kernel_device), " kernel got q on ", q_in.device());
  c.pk = check_packed(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_k);
  c.a = check_attn_args(c.q, c.k, c.v, softmax_scale, causal, window_left, window_right, softcap,
                        packed_alibi_row(alibi_slopes, c.pk.batch, q_in.size(1)), std::nullopt,
                        dropout_p);
  return c;
}

// The backward's out, dout (total_q, num_heads, head_dim_v) and softmax_lse (the forward's:
// (num_heads, total_q) of lse_dtype).
inline void check_packed_bwd_tensors(const AttnArgs& a, const at::Tensor& dout_in,
                                     const at::Tensor& out_in, const at::Tensor& softmax_lse,
                                     at::ScalarType lse_dtype) {
  TORCH_CHECK_VALUE(dout_in.sizes() == out_in.sizes() &&
                        out_in.sizes() == at::IntArrayRef({a.seqlen_q, a.heads_q, a.head_dim_v}),
                    "dout and out must have shape (total_q, num_heads, head_dim_v) = (",
                    a.seqlen_q, ", ", a.heads_q, ", ", a.head_dim_v, "), got ", dout_in.sizes(),
                    " and ", out_in.sizes());
  TORCH_CHECK_VALUE(softmax_lse.sizes() == at::IntArrayRef({a.heads_q, a.seqlen_q}) &&
                        softmax_lse.scalar_type() == lse_dtype,
                    "softmax_lse must be the forward's (num_heads, total_q) = (", a.heads_q, ", ",
                    a.seqlen_q, ") ", dtype_name(lse_dtype), " tensor, got ",
                    dtype_name(softmax_lse.scalar_type()), " ", softmax_lse.sizes());
}

// Turns params filled from (1, total, H, D) views into the packed call's: one entry per
// sequence, the longest lengths, no batch strides (each kernel places a sequence by its
// offsets: the CPU's Seqs, the CUDA kernels' SeqInfo, which read params.h's cu_seqlens).
// The longest lengths are max_seqlen_q / max_seqlen_k cut to the longest sequence of the
// offsets: they need only be at least that (FlashAttention-2 code often passes a model's
// maximum length), and the kernels count tiles, tasks and grids from them, so that a
// max_seqlen near 2^63 made those counts overflow (the CPU forward's zeros, its backward's
// wrong dq / dk) and one of 1e10 ran seconds of empty tasks (a new-user finding).
inline void make_packed(FwdParams& p, const Packed& pk, int64_t max_seqlen_q,
                        int64_t max_seqlen_k) {
  p.batch = pk.batch;
  p.seqlen_q = std::min(max_seqlen_q, pk.longest_q);
  p.seqlen_k = std::min(max_seqlen_k, pk.longest_k);
  p.align_bottom_right = true;  // causal and windows bottom-right per sequence (FlashAttention-2)
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 0;
}

}  // namespace flash_attn_ext
