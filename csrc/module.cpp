// The Python module flash_attn_ext._C: importing it loads the op registrations of this library;
// it also carries build information that is not an op.
#include <torch/extension.h>

#include <limits>
#include <tuple>

#include "checks.h"
#include "cpu/bf16_amx.h"
#include "cpu/bf16_dot.h"
#include "cpu/dropout_cpu.h"
#include "dropout.h"
#include "kernel_select.h"
#include "varlen_checks.h"

#ifndef FLASH_ATTN_EXT_VERSION
#define FLASH_ATTN_EXT_VERSION "unknown"
#endif

#ifdef FLASH_ATTN_EXT_SM90
namespace flash_attn_ext::cuda {
at::Tensor sm90_mask_row_keys(const at::Tensor& mask, bool columns);  // cuda/flash_cuda.cu
}
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict d;
  d["version"] = FLASH_ATTN_EXT_VERSION;
#ifdef TORCH_VERSION_MAJOR
  d["torch_version_built"] = std::to_string(TORCH_VERSION_MAJOR) + "." +
                             std::to_string(TORCH_VERSION_MINOR) + "." +
                             std::to_string(TORCH_VERSION_PATCH);
#endif
#ifdef FLASH_ATTN_EXT_WITH_CUDA
  d["cuda"] = true;
  d["cuda_archs"] = FLASH_ATTN_EXT_CUDA_ARCHS;
#else
  d["cuda"] = false;
  d["cuda_archs"] = "";
#endif
#ifdef FLASH_ATTN_EXT_SM90
  d["sm90"] = true;  // the Hopper (sm_90a, TMA + wgmma) forward is built
#else
  d["sm90"] = false;
#endif
  d["cpu"] = true;
  // bf16 CPU tiles multiplied as bf16 (AVX512-BF16 found at run time, not switched off by
  // FLASH_ATTN_EXT_CPU_BF16_DOT=0; csrc/cpu/bf16_dot.h), else converted to fp32 for sgemm.
  // The first read of that variable: a value it does not take fails the import here.
  d["cpu_bf16_dot"] = flash_attn_ext::cpu::bf16dot::enabled();
  // Those tiles on AMX where the CPU has it (PyTorch's brgemm; FLASH_ATTN_EXT_CPU_BF16_AMX=0
  // keeps them on the AVX512-BF16 micro-kernel; cpu/bf16_amx.h).
  d["cpu_bf16_amx"] = d["cpu_bf16_dot"].cast<bool>() && flash_attn_ext::cpu::bf16amx::enabled();
  return d;
}

// The fused ops' argument checks, for paths that do not reach a fused op (the fallback), so bad
// input fails with the same message on every path.
void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::optional<double> softmax_scale, bool causal, int64_t window_left,
                int64_t window_right, double softcap, double dropout_p) {
  flash_attn_ext::check_attn_args(q, k, v, softmax_scale, causal, window_left, window_right,
                                  softcap, std::nullopt, std::nullopt, dropout_p,
                                  /*kernel_dtypes=*/false);
}

// The varlen ops' argument checks (check_packed_call: shapes, offsets and their values,
// max_seqlen, seqused_k, slopes, dtype, flags) without computing anything, for explain() of a
// packed call: the errors the fwd_varlen op raises, in its order, on q's device type.  The
// offsets are read on the host, as the op reads them (offsets on a GPU: one copy).
void check_varlen_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k,
                       std::optional<double> softmax_scale, bool causal, int64_t window_left,
                       int64_t window_right, double softcap,
                       const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                       const std::optional<at::Tensor>& seqused_k) {
  flash_attn_ext::check_packed_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, softmax_scale, causal, window_left,
                                    window_right, softcap, alibi_slopes, dropout_p, seqused_k,
                                    q.device().type());
}

// Testing aid: the dropout mask (True = kept) that every kernel applies for rng_state
// (seed, offset), as a (batch, heads, seqlen_q, seqlen_k) bool CPU tensor (dropout.h).
// packed_start >= 0: the mask of one packed sequence (flash_attn_varlen_func) whose query rows
// start at packed row packed_start and number seqlen_q (batch must be 1).
at::Tensor dropout_mask(int64_t seed, int64_t offset, int64_t batch, int64_t heads,
                        int64_t seqlen_q, int64_t seqlen_k, double dropout_p,
                        int64_t packed_start) {
  TORCH_CHECK_VALUE(dropout_p > 0.0 && dropout_p < 1.0, "dropout_p must be in (0, 1), got ",
                    dropout_p);
  TORCH_CHECK_VALUE(packed_start < 0 || batch == 1,
                    "dropout_mask: a packed sequence (packed_start = ", packed_start,
                    ") needs batch = 1, got ", batch);
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k}, at::kBool);
  auto* keep = reinterpret_cast<uint8_t*>(mask.data_ptr<bool>());
  const uint32_t threshold = flash_attn_ext::dropout_threshold(dropout_p);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t q0 = packed_start >= 0 ? packed_start : b * seqlen_q;
      const int64_t base = flash_attn_ext::dropout_row_base(q0, h, heads, seqlen_q);
      for (int64_t i = 0; i < seqlen_q; ++i)
        flash_attn_ext::cpu::dropout_keep(
            static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), threshold,
            static_cast<uint64_t>(base + flash_attn_ext::dropout_cell_row(i)), i, 0, seqlen_k,
            keep + ((b * heads + h) * seqlen_q + i) * seqlen_k);
    }
  return mask;
}

// The scale of the elements dropout keeps (dropout.h): 1 / P(kept), where P(kept) is
// 1 - dropout_p rounded to a multiple of 1/256; 0 when nothing is kept.
double dropout_scale(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ",
                    dropout_p);
  return flash_attn_ext::dropout_scale(dropout_p);
}

// kernel_select.h's rule for a CUDA call described by Python values (flash_attn_ext/planning.py
// passes them; it reads no tensor).  `build`: build_info(); `device`: (major, minor,
// smem_optin); `layout`: None (sizes symbolic: traced) or 24 ints, the sizes then strides of q,
// k and v in (batch, seqlen, heads, head_dim).  Returns (fused, reasons, forward kernel name,
// backward kernel name, notes) for the process's current kernel options.
pybind11::tuple select_cuda_kernels(const pybind11::dict& build, const std::tuple<int, int, int>& device,
                                    const std::string& dtype, std::optional<double> softmax_scale,
                                    int64_t head_dim, int64_t head_dim_v,
                                    const std::optional<std::vector<int64_t>>& layout,
                                    int score_mods, bool unequal_tiles, bool deterministic,
                                    bool packed) {
  using namespace flash_attn_ext;
  BuildInfo b;
  b.cuda = build["cuda"].cast<bool>();
  b.sm90 = build["sm90"].cast<bool>();
  b.archs = build["cuda_archs"].cast<std::string>();
  DeviceInfo d;
  std::tie(d.major, d.minor, d.smem_optin) = device;
  CallInfo call;
  call.dtype = dtype;
  call.has_scale = softmax_scale.has_value();
  call.softmax_scale = softmax_scale.value_or(0.0);
  call.head_dim = head_dim;
  call.head_dim_v = head_dim_v;
  call.known = layout.has_value();
  if (call.known) {
    TORCH_CHECK_VALUE(layout->size() == 24, "layout must hold 24 sizes and strides, got ",
                      layout->size());
    TensorDesc* tensors[3] = {&call.q, &call.k, &call.v};
    for (int t = 0; t < 3; ++t)
      for (int i = 0; i < 4; ++i) {
        tensors[t]->size[i] = (*layout)[t * 8 + i];
        tensors[t]->stride[i] = (*layout)[t * 8 + 4 + i];
      }
  }
  call.score_mods = score_mods;
  call.unequal_tiles = unequal_tiles;
  call.deterministic = deterministic;
  call.packed = packed;
  const KernelChoice c = select_cuda_kernels(b, d, call, kernel_options());
  pybind11::tuple reasons = pybind11::cast(c.reasons), notes = pybind11::cast(c.notes);
  return pybind11::make_tuple(c.fused, pybind11::tuple(reasons), c.fwd_name, c.bwd_name,
                              pybind11::tuple(notes));
}

// A count option's value as set_kernel_options takes it: "auto" where it holds auto_value.
pybind11::object count_or_auto(int32_t value, int32_t auto_value) {
  if (value == auto_value) return pybind11::str("auto");
  return pybind11::int_(value);
}

// KernelOptions as a dict of plain values, and back (unknown keys and bad values raise).
pybind11::dict options_dict(const flash_attn_ext::KernelOptions& o) {
  static const char* pack[] = {"auto", "on", "off"};
  static const char* schedule[] = {"auto", "dynamic", "static", "tile"};
  pybind11::dict d;
  d["force_portable"] = o.force_portable;
  d["sm90_pack_gqa"] = pack[static_cast<int>(o.sm90_pack_gqa)];
  d["sm90_schedule"] = schedule[static_cast<int>(o.sm90_schedule)];
  d["sm90_section_pairs"] = o.sm90_section_pairs;
  d["sm90_row_shift"] = o.sm90_row_shift;
  d["sm90_direct_epilogue"] = o.sm90_direct_epilogue;
  d["bwd_atomic_dq"] = o.bwd_atomic_dq;
  d["sm90_bias_blocks"] = o.sm90_bias_blocks;
  d["sm90_bwd"] = pack[static_cast<int>(o.sm90_bwd)];
  d["exact_rows_always"] = o.exact_rows_always;
  d["sm90_fma_exp2"] = count_or_auto(o.sm90_fma_exp2, -1);
  d["sm90_per_score_consumers"] = count_or_auto(o.sm90_per_score_consumers, 0);
  d["decode_row_lanes"] = count_or_auto(o.decode_row_lanes, 0);
  d["decode_combine_splits"] = count_or_auto(o.decode_combine_splits, 0);
  d["sm90_alibi_fold"] = o.sm90_alibi_fold;
  d["sm90_narrow_tiles"] = o.sm90_narrow_tiles;
  d["sm90_varlen_sections"] = o.sm90_varlen_sections;
  d["sm90_bwd_short_steps"] = o.sm90_bwd_short_steps;
  d["sm90_mask_rows"] = o.sm90_mask_rows;
  d["sm90_mask_cols"] = o.sm90_mask_cols;
  d["decode_pdl"] = o.decode_pdl;
  d["decode_contiguous_loads"] = o.decode_contiguous_loads;
  d["decode_block_rows"] = count_or_auto(o.decode_block_rows, 0);
  d["decode_ctas_per_sm"] = count_or_auto(o.decode_ctas_per_sm, 0);
  return d;
}

pybind11::dict get_kernel_options() { return options_dict(flash_attn_ext::kernel_options()); }

void set_kernel_options(const pybind11::dict& values) {
  using namespace flash_attn_ext;
  KernelOptions o = kernel_options();
  for (const auto& item : values) {
    const std::string key = item.first.cast<std::string>();
    const pybind11::handle v = item.second;
    auto flag = [&](bool& field) {
      TORCH_CHECK_VALUE(pybind11::isinstance<pybind11::bool_>(v), key, " must be a bool, got ",
                        pybind11::repr(v).cast<std::string>());
      field = v.cast<bool>();
    };
    auto word = [&](std::initializer_list<const char*> words) {
      const std::string w = pybind11::isinstance<pybind11::str>(v) ? v.cast<std::string>() : "";
      int i = 0;
      for (const char* allowed : words) {
        if (w == allowed) return i;
        ++i;
      }
      std::string list;
      for (const char* allowed : words) list += std::string(list.empty() ? "" : ", ") + "'" + allowed + "'";
      TORCH_CHECK_VALUE(false, key, " must be one of ", list, ", got ",
                        pybind11::repr(v).cast<std::string>());
      return 0;
    };
    // "auto" (stored as auto_value) or one of the counts in `allowed`; `what` says what the
    // count counts, for the message.
    auto count = [&](std::initializer_list<int> allowed, int32_t auto_value, const char* what) {
      if (pybind11::isinstance<pybind11::str>(v) && v.cast<std::string>() == "auto")
        return auto_value;
      if (pybind11::isinstance<pybind11::int_>(v) && !pybind11::isinstance<pybind11::bool_>(v)) {
        const int64_t n = v.cast<int64_t>();
        for (int allowed_n : allowed)
          if (n == allowed_n) return static_cast<int32_t>(n);
      }
      std::string list = "'auto'";
      int i = 0;
      for (int allowed_n : allowed) {
        list += (++i == static_cast<int>(allowed.size()) ? " or " : ", ") + std::to_string(allowed_n);
      }
      TORCH_CHECK_VALUE(false, key, " must be ", list, " (", what, "), got ",
                        pybind11::repr(v).cast<std::string>());
      return auto_value;
    };
    if (key == "force_portable") {
      flag(o.force_portable);
    } else if (key == "sm90_pack_gqa") {
      o.sm90_pack_gqa = static_cast<PackGqa>(word({"auto", "on", "off"}));
    } else if (key == "sm90_schedule") {
      o.sm90_schedule = static_cast<Sm90Schedule>(word({"auto", "dynamic", "static", "tile"}));
    } else if (key == "sm90_section_pairs") {
      const bool ok = pybind11::isinstance<pybind11::int_>(v) &&
                      !pybind11::isinstance<pybind11::bool_>(v) && v.cast<int64_t>() >= 0 &&
                      v.cast<int64_t>() <= std::numeric_limits<int32_t>::max();
      TORCH_CHECK_VALUE(ok, "sm90_section_pairs must be a number of (batch, head) pairs >= 0 "
                        "(0: the launcher's choice), got ", pybind11::repr(v).cast<std::string>());
      o.sm90_section_pairs = static_cast<int32_t>(v.cast<int64_t>());
    } else if (key == "sm90_row_shift") {
      flag(o.sm90_row_shift);
    } else if (key == "sm90_direct_epilogue") {
      flag(o.sm90_direct_epilogue);
    } else if (key == "bwd_atomic_dq") {
      flag(o.bwd_atomic_dq);
    } else if (key == "sm90_bias_blocks") {
      flag(o.sm90_bias_blocks);
    } else if (key == "sm90_bwd") {
      o.sm90_bwd = static_cast<Sm90Bwd>(word({"auto", "on", "off"}));
    } else if (key == "exact_rows_always") {
      flag(o.exact_rows_always);
    } else if (key == "sm90_fma_exp2") {
      o.sm90_fma_exp2 = count({0, 2, 4}, -1,
                              "exp2s on the FMA pipe per 8 columns");
    } else if (key == "sm90_per_score_consumers") {
      o.sm90_per_score_consumers =
          count({2, 3}, 0,
                "consumer warpgroups of the Hopper forward's ALiBi and dropout variants at head "
                "dim 64");
    } else if (key == "sm90_alibi_fold") {
      flag(o.sm90_alibi_fold);
    } else if (key == "sm90_narrow_tiles") {
      flag(o.sm90_narrow_tiles);
    } else if (key == "sm90_varlen_sections") {
      flag(o.sm90_varlen_sections);
    } else if (key == "sm90_bwd_short_steps") {
      flag(o.sm90_bwd_short_steps);
    } else if (key == "sm90_mask_rows") {
      flag(o.sm90_mask_rows);
    } else if (key == "sm90_mask_cols") {
      flag(o.sm90_mask_cols);
    } else if (key == "decode_pdl") {
      flag(o.decode_pdl);
    } else if (key == "decode_contiguous_loads") {
      flag(o.decode_contiguous_loads);
    } else if (key == "decode_row_lanes") {
      o.decode_row_lanes =
          count({2, 4, 8}, 0, "lanes per cache row of the decode kernel's loads at head dim 64");
    } else if (key == "decode_combine_splits") {
      o.decode_combine_splits =
          count({4, 8, 16}, 0, "splits one warp of the decode combine reads");
    } else if (key == "decode_block_rows") {
      o.decode_block_rows =
          count({16, 32}, 0, "query rows one decode CTA takes at head dims up to 128");
    } else if (key == "decode_ctas_per_sm") {
      o.decode_ctas_per_sm =
          count({1, 2, 3, 4}, 0, "decode CTAs per SM the split heuristic counts");
    } else {
      TORCH_CHECK_VALUE(false, "unknown kernel option '", key, "' (known: ",
                        pybind11::str(pybind11::list(options_dict(o).attr("keys")()))
                            .cast<std::string>(),
                        ")");
    }
  }
  set_kernel_options(o);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flash_attn_ext compiled library (ops are under torch.ops.flash_attn_ext)";
  m.def("build_info", &build_info, "How this library was built: version, CUDA on/off, archs.");
  m.def("set_debug_poison", &flash_attn_ext::set_debug_poison,
        "Testing aid: outputs start as NaN so unwritten elements are caught.");
  m.attr("sm90_max_rows") = flash_attn_ext::sm90::kMaxRows;
  m.attr("max_head_dim") = flash_attn_ext::kMaxHeadDim;
  m.def("select_cuda_kernels", &select_cuda_kernels, pybind11::arg("build"),
        pybind11::arg("device"), pybind11::arg("dtype"), pybind11::arg("softmax_scale"),
        pybind11::arg("head_dim"), pybind11::arg("head_dim_v"), pybind11::arg("layout"),
        pybind11::arg("score_mods"), pybind11::arg("unequal_tiles"), pybind11::arg("deterministic"),
        pybind11::arg("packed") = false,
        "The CUDA glue's kernel choice (csrc/kernel_select.h) for a described call "
        "(packed: packed sequences, the varlen ops): "
        "(fused, reasons, forward kernel, backward kernel, notes).");
  m.def("kernel_options", &get_kernel_options, "The process's kernel options (a dict).");
  m.def("set_kernel_options", &set_kernel_options, pybind11::arg("values"),
        "Sets some of the process's kernel options (a dict; unknown keys and bad values raise "
        "ValueError).");
  m.def("check_args", &check_args, "Validates q/k/v and flags like the fwd op (raises on error).");
  m.def("check_varlen_args", &check_varlen_args,
        "Validates a packed call's arguments like the fwd_varlen op (raises on error).");
  m.def("dropout_mask", &dropout_mask, pybind11::arg("seed"), pybind11::arg("offset"),
        pybind11::arg("batch"), pybind11::arg("heads"), pybind11::arg("seqlen_q"),
        pybind11::arg("seqlen_k"), pybind11::arg("dropout_p"),
        pybind11::arg("packed_start") = -1,
        "Testing aid: the kernels' dropout mask (True = kept) for (seed, offset), "
        "(batch, heads, seqlen_q, seqlen_k) bool; packed_start >= 0: the packed sequence whose "
        "query rows start at that row (batch 1).");
#ifdef FLASH_ATTN_EXT_SM90
  m.def("sm90_mask_row_keys", &flash_attn_ext::cuda::sm90_mask_row_keys, pybind11::arg("mask"),
        pybind11::arg("columns") = false,
        "For tests: the Hopper kernels' summary of a boolean mask's rows as key intervals "
        "(the forward's), or with columns=True its keys as row intervals (the backward's).");
#endif
  m.def("dropout_scale", &dropout_scale,
        "The kernels' scale of kept dropout elements: 1 / P(kept), P(kept) = 1 - dropout_p "
        "rounded to a multiple of 1/256 (0 when nothing is kept).");
}
