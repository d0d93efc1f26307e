// The dropout mask of dropout.h on the host, with ATen's Philox4x32 engine (10 rounds).
#pragma once

#include <ATen/core/PhiloxRNGEngine.h>

#include <cstdint>

#include "dropout.h"

namespace flash_attn_ext::cpu {

// keep[c] = 1 if element (query row i, key j0 + c) is kept, for c < n.  cell_row_id: the row id
// of i's cell (dropout.h: the (batch, head)'s first row id + dropout_cell_row(i)).  Each call
// decides 4 of the row's keys (the cell's row di = dropout_cell_index(i)): the host goes row by
// row; the kernels, which hold whole cells, use all 16 bytes.
inline void dropout_keep(uint64_t seed, uint64_t offset, uint32_t threshold, uint64_t cell_row_id,
                         int64_t i, int64_t j0, int64_t n, uint8_t* keep) {
  const int di = dropout_cell_index(i);
  at::Philox4_32 engine(seed, cell_row_id, 0);
  // Keys 16 * J + 2 * v + {0, 1, 8, 9} share the call of cell column 4 * J + v.
  for (int64_t base = j0 - j0 % 16; base < j0 + n; base += 16) {
    for (int64_t v = 0; v < 4; ++v) {
      const int64_t y = base + 2 * v;
      // Skip cells none of whose keys lie in [j0, j0 + n).
      if (y + 9 < j0 || y >= j0 + n) continue;
      engine.set_offset(offset + static_cast<uint64_t>(dropout_cell_col(y)));
      uint32_t words[4];
      for (uint32_t& w : words) w = engine();  // words 0..3 of the call, in order (all four:
                                               // the engine draws anew after the fourth)
      const uint32_t word = words[di];
      for (int dj = 0; dj < 4; ++dj) {
        const int64_t c = y + (dj & 1) + 8 * (dj >> 1) - j0;
        if (c >= 0 && c < n) keep[c] = ((word >> (8 * dj)) & 0xffu) < threshold;
      }
    }
  }
}

}  // namespace flash_attn_ext::cpu
