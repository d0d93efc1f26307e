// The dropout mask of dropout.h on the device, with curand's Philox4x32-10.
#pragma once

#include <curand_philox4x32_x.h>

#include <cstdint>

#include "params.h"

namespace flash_attn_ext::sm80 {

struct DropoutFn {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float scale = 1.f;
  bool enabled = false;

  __device__ explicit DropoutFn(const FwdParams& p) : enabled(p.dropout) {
    if (!enabled) return;
    threshold = p.dropout_threshold;
    scale = p.dropout_scale;
    seed = p.philox_seed_ptr != nullptr ? static_cast<uint64_t>(*p.philox_seed_ptr)
                                        : p.philox_seed;
    offset = p.philox_offset_ptr != nullptr
                 ? static_cast<uint64_t>(*p.philox_offset_ptr) + p.philox_offset_intragraph
                 : p.philox_offset;
  }
  // The four Philox words of keys 4 * (j / 4) .. + 3 of `row`.
  __device__ __forceinline__ uint4 words(uint64_t row, int64_t j) const {
    const uint64_t block = offset + static_cast<uint64_t>(j / 4);
    const uint4 counter = make_uint4(static_cast<uint32_t>(block),
                                     static_cast<uint32_t>(block >> 32),
                                     static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32));
    return curand_Philox4x32_10(counter, make_uint2(static_cast<uint32_t>(seed),
                                                    static_cast<uint32_t>(seed >> 32)));
  }
  __device__ __forceinline__ static uint32_t word(const uint4& w, int64_t j) {
    const int e = static_cast<int>(j & 3);
    return e == 0 ? w.x : (e == 1 ? w.y : (e == 2 ? w.z : w.w));
  }
  __device__ __forceinline__ bool keep(uint64_t row, int64_t j) const {
    return word(words(row, j), j) < threshold;
  }
};

}  // namespace flash_attn_ext::sm80
