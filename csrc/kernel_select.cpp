// The process-wide KernelOptions of kernel_select.h.  Set from Python (flash_attn_ext's import
// reads FLASH_ATTN_EXT_KERNEL once; flash_attn_ext.kernel_options changes them for tests and
// comparisons); read by the CUDA glue on every call and by the planning that reports its choice.
#include "kernel_select.h"

#include <mutex>

namespace flash_attn_ext {

namespace {
std::mutex options_mutex;
KernelOptions options_value;
}  // namespace

KernelOptions kernel_options() {
  std::lock_guard<std::mutex> lock(options_mutex);
  return options_value;
}

void set_kernel_options(const KernelOptions& options) {
  std::lock_guard<std::mutex> lock(options_mutex);
  options_value = options;
}

}  // namespace flash_attn_ext
