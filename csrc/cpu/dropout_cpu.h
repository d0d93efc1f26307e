// The dropout mask of dropout.h on the host, with ATen's Philox4x32 engine (10 rounds).
#pragma once

#include <ATen/core/PhiloxRNGEngine.h>

#include <cstdint>

#include "dropout.h"

namespace flash_attn_ext::cpu {

// keep[c] = 1 if element (row, j0 + c) is kept, for c < n.
inline void dropout_keep(uint64_t seed, uint64_t offset, uint32_t threshold, uint64_t row,
                         int64_t j0, int64_t n, uint8_t* keep) {
  at::Philox4_32 engine(seed, row, 0);
  for (int64_t j = j0 - j0 % 4; j < j0 + n; j += 4) {
    engine.set_offset(offset + static_cast<uint64_t>(j / 4));
    for (int64_t e = 0; e < 4; ++e) {
      const uint32_t word = engine();  // words 0..3 of this counter block, in order
      const int64_t c = j + e - j0;
      if (c >= 0 && c < n) keep[c] = word < threshold;
    }
  }
}

}  // namespace flash_attn_ext::cpu
