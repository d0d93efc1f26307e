// Kernel launch with the dynamic shared-memory opt-in done once per (kernel, device) instead of
// on every call, and the grid-size limit checked (1-D grids of up to 2^31 - 1 blocks).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

namespace flash_attn_ext::sm80 {

// query() (> 0 on success, 0 on failure) for the current device, called once per device and
// call site (each lambda type has its own cache); failures are not cached and any CUDA error
// they left is cleared, so the next launch check does not report it.  0 if it failed.
template <typename Query>
int per_device_cached(Query query) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // static storage: zero = not queried yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  int value = device < kMaxDevices ? cache[device].load(std::memory_order_relaxed) : 0;
  if (value != 0) return value;
  value = query(device);
  if (value <= 0) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device < kMaxDevices) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

// Largest dynamic shared memory a block may opt in to on the current device, queried once per
// device (0 if the query fails).
inline int max_smem_optin_per_block() {
  return per_device_cached([](int device) {
    int bytes = 0;
    return cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
                   cudaSuccess
               ? bytes
               : 0;
  });
}

// Streaming multiprocessors of the current device, queried once per device (0 if the query
// fails).
inline int multiprocessor_count() {
  return per_device_cached([](int device) {
    int sms = 0;
    return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess
               ? sms
               : 0;
  });
}

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) for `kernel` on the current device, once.
inline cudaError_t opt_in_smem(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.insert({kernel, device});
  return err;
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int64_t blocks, int threads, int smem_bytes,
                   cudaStream_t stream, Args&&... args) {
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (smem_bytes > 48 * 1024) {
    const cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), smem_bytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), threads, smem_bytes, stream>>>(
      std::forward<Args>(args)...);
  return cudaGetLastError();
}

}  // namespace flash_attn_ext::sm80
