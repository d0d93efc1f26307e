// fp16 -> fp32 conversion of whole rows for the CPU kernels' tiles (tile_gemm.h: load_tile).
// c10::Half's own conversion is the portable bit-manipulation form unless the build targets
// F16C, which ours (no -march) does not: converting a key tile that way cost more than the
// attention on it (one query row: 4-7x the fp32 call; docs/perf/cpu.md).
#pragma once

#include <cstdint>

namespace flash_attn_ext::cpu::fp16 {

// Whether half_to_float uses the CPU's F16C conversions (checked once; the environment variable
// FLASH_ATTN_EXT_CPU_F16C=0 turns them off).
bool f16c();

// dst[c] = float(src[c]) for c < n, src the IEEE fp16 bits; exact (every fp16 is a float).
void half_to_float(float* dst, const uint16_t* src, int64_t n);

}  // namespace flash_attn_ext::cpu::fp16
