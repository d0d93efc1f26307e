// The Python module flash_attn_ext._C: importing it loads the op registrations of this library;
// it also carries build information that is not an op.
#include <torch/extension.h>

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
  d["cpu"] = true;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flash_attn_ext compiled library (ops are under torch.ops.flash_attn_ext)";
  m.def("build_info", &build_info, "How this library was built: version, CUDA on/off, archs.");
}
