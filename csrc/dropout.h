// The dropout mask of every kernel (CPU and CUDA), as a pure function of (seed, offset) and the
// element's coordinates, so that the backward regenerates the forward's mask instead of storing
// it, and the CPU and CUDA kernels drop the same elements for the same (seed, offset):
//
//   row      = (b * heads_q + h) * seqlen_q + i           (64-bit)
//   words    = Philox4x32-10(counter = (offset + j / 4, row), key = seed)
//              (counter words, low first: lo(offset + j/4), hi(offset + j/4), lo(row), hi(row);
//               key words: lo(seed), hi(seed))
//   keep     = words[j % 4] < threshold,   threshold = round((1 - dropout_p) * 2^32)
//
// so kept elements have probability (1 - dropout_p) up to 2^-32.  The counters of one call span
// offset .. offset + ceil(seqlen_k / 4) per row; the CUDA generator's offset advances by that
// much per call, so successive calls never reuse a counter.  Philox4x32-10 is curand's
// (curand_Philox4x32_10) on the device and ATen's philox_engine, which computes the same
// function, on the host.
#pragma once

#include <cmath>
#include <cstdint>

namespace flash_attn_ext {

inline uint32_t dropout_threshold(double dropout_p) {
  const double t = std::round((1.0 - dropout_p) * 4294967296.0);
  return t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
}

// Philox counter blocks one call uses per row: the generator's offset increment.
inline uint64_t dropout_counters_per_row(int64_t seqlen_k) {
  return static_cast<uint64_t>((seqlen_k + 3) / 4);
}

}  // namespace flash_attn_ext
