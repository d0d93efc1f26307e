// The Python module flash_attn_ext._C: importing it loads the op registrations of this library;
// it also carries build information that is not an op.
#include <torch/extension.h>

#include "checks.h"
#include "cpu/dropout_cpu.h"
#include "dropout.h"
#include "kernels/sm90/pack_gqa.h"

#ifndef FLASH_ATTN_EXT_VERSION
#define FLASH_ATTN_EXT_VERSION "unknown"
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

// Testing aid: the dropout mask (True = kept) that every kernel applies for rng_state
// (seed, offset), as a (batch, heads, seqlen_q, seqlen_k) bool CPU tensor (dropout.h).
at::Tensor dropout_mask(int64_t seed, int64_t offset, int64_t batch, int64_t heads,
                        int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p > 0.0 && dropout_p < 1.0, "dropout_p must be in (0, 1), got ",
                    dropout_p);
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k}, at::kBool);
  auto* keep = reinterpret_cast<uint8_t*>(mask.data_ptr<bool>());
  const uint32_t threshold = flash_attn_ext::dropout_threshold(dropout_p);
  for (int64_t row = 0; row < batch * heads * seqlen_q; ++row)
    flash_attn_ext::cpu::dropout_keep(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                      threshold, static_cast<uint64_t>(row), 0, seqlen_k,
                                      keep + row * seqlen_k);
  return mask;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flash_attn_ext compiled library (ops are under torch.ops.flash_attn_ext)";
  m.def("build_info", &build_info, "How this library was built: version, CUDA on/off, archs.");
  m.def("set_debug_poison", &flash_attn_ext::set_debug_poison,
        "Testing aid: outputs start as NaN so unwritten elements are caught.");
  m.def("sm90_pack_gqa", &flash_attn_ext::sm90::pack_gqa_pays, pybind11::arg("seqlen_q"),
        pybind11::arg("heads_q"), pybind11::arg("heads_kv"), pybind11::arg("padded_head_dim"),
        "The Hopper forward's rule for packing GQA query heads (without the environment "
        "override; dispatch.sm90_packs_gqa applies it).");
  m.def("sm90_pack_gqa_possible", &flash_attn_ext::sm90::pack_gqa_possible,
        pybind11::arg("seqlen_q"), pybind11::arg("heads_q"), pybind11::arg("heads_kv"),
        "Whether the Hopper forward can pack GQA query heads at all (a group of 2+, packed rows "
        "within its 32-bit row arithmetic).");
  m.attr("sm90_max_rows") = flash_attn_ext::sm90::kMaxRows;
  m.def("lean_bwd_smem_bytes", &flash_attn_ext::lean_bwd_smem_bytes, pybind11::arg("head_dim"),
        "Shared memory per block the 8-warp CUDA backward needs at a padded head dim (64, 128 "
        "or 256); GPUs that allow less run the 4-warp kernels.");
  m.def("check_args", &check_args, "Validates q/k/v and flags like the fwd op (raises on error).");
  m.def("dropout_mask", &dropout_mask,
        "Testing aid: the kernels' dropout mask (True = kept) for (seed, offset), "
        "(batch, heads, seqlen_q, seqlen_k) bool.");
}
