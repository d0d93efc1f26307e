// fp16 -> fp32 conversion of whole rows with F16C for the CPU kernels' tiles (tile_gemm.h:
// load_tile).  c10::Half's own conversion is the portable bit-manipulation form unless the build
// targets F16C, which ours (no -march) does not: converting a key tile that way cost more than
// the attention on it (one query row: 4-7x the fp32 call; docs/perf/cpu.md).  Where the CPU
// lacks F16C, load_tile keeps c10::Half's conversion.
#pragma once

#include <cstdint>

namespace flash_attn_ext::cpu::fp16 {

// Whether the CPU has F16C (checked once; the environment variable FLASH_ATTN_EXT_CPU_F16C=0
// answers false, so that c10::Half's conversion serves).
bool f16c();

// dst[c] = float(src[c]) for c < n, src the IEEE fp16 bits; exact (every fp16 is a float).
// Only where f16c().
void half_to_float(float* dst, const uint16_t* src, int64_t n);

}  // namespace flash_attn_ext::cpu::fp16
