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
// call site (each lambda type has its own cache); a failure is cached too (as -1), and the CUDA
// error it left is cleared once, so the next launch check does not report it.  0 if it failed.
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
  if (value != 0) return value > 0 ? value : 0;
  value = query(device);
  if (value <= 0) {
    (void)cudaGetLastError();
    value = -1;  // (cached too: a failed query is not repeated, nor its error cleared, per call)
  }
  if (device < kMaxDevices) cache[device].store(value, std::memory_order_relaxed);
  return value > 0 ? value : 0;
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

// The current device's compute capability major (0 if the query fails), once per device.
inline int compute_capability_major() {
  return per_device_cached([](int device) {
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
                   cudaSuccess
               ? major
               : 0;
  });
}

// cudaFuncSetAttribute(PreferredSharedMemoryCarveout, max shared) for `kernel` on the current
// device, once: a kernel launched as a programmatic dependent (launch_dependent below) can only
// share an SM with a primary that runs at the largest carveout if it asks for the same one.
inline cudaError_t prefer_max_shared(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
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

// launch() as a programmatic dependent of the kernel before it on the stream (sm_90+: Hopper's
// programmatic dependent launch): its CTAs may be scheduled once every CTA of that kernel has
// executed griddepcontrol.launch_dependents (pdl_trigger) or exited, and wait in
// griddepcontrol.wait (pdl_wait) until that kernel has completed and its writes are visible.
// Its launch and its CTAs' start overlap the previous kernel's tail instead of following it.
// pdl false (or a device before sm_90): an ordinary launch, where pdl_wait returns at once.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(bool pdl, void (*kernel)(Params...), int64_t blocks, int threads,
                             int smem_bytes, cudaStream_t stream, Args&&... args) {
  if (!pdl || compute_capability_major() < 9)
    return launch(kernel, blocks, threads, smem_bytes, stream, std::forward<Args>(args)...);
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  cudaError_t err = smem_bytes > 48 * 1024
                        ? opt_in_smem(reinterpret_cast<const void*>(kernel), smem_bytes)
                        : cudaSuccess;
  if (err == cudaSuccess) err = prefer_max_shared(reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The device side of launch_dependent (no-ops before sm_90 and without a dependent or primary).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace flash_attn_ext::sm80
