// bf16 tile GEMMs on AMX (AMX-BF16: tmul tiles of bf16 pairs, fp32 accumulation) through
// PyTorch's brgemm, where the CPU has them: at::native::cpublas::could_pack(kBFloat16), which
// is how PyTorch's own CPU flash-attention kernel decides.  Same operands as bf16_dot.h's words
// (two bf16 adjacent along the reduction dimension: the VNNI-2 layout AMX reads); the same
// products (exact in fp32) and fp32 accumulation, in another order.  On an AMX CPU it took bf16
// forward + backward from 0.54-0.70x PyTorch's to 1.28-1.52x (docs/perf/cpu.md).
#pragma once

#include <cstdint>

namespace flash_attn_ext::cpu::bf16amx {

// Whether the AMX path runs: PyTorch can pack bf16 for AMX on this CPU, and the environment
// variable FLASH_ATTN_EXT_CPU_BF16_AMX is not "0" (read once).
bool enabled();

// C (m x n, leading dimension ldc) = alpha * A B, plus C's previous contents if `accumulate`;
// A: m rows of `pairs` words at a[i * lda_words + p]; B: pairs rows of
// n words at b[p * ldb + j].  Only call when enabled().
void gemm(float* c, int64_t ldc, const uint32_t* a, int64_t lda_words, const uint32_t* b,
          int64_t ldb, int64_t m, int64_t n, int64_t pairs, float alpha, bool accumulate);

// The same with A stored transposed: A(i, p) at a[p * lda_words + i] (bf16_dot.h's a_m = 1),
// copied into rows first.
void gemm_transposed(float* c, int64_t ldc, const uint32_t* a, int64_t lda_words,
                     const uint32_t* b, int64_t ldb, int64_t m, int64_t n, int64_t pairs,
                     float alpha, bool accumulate);

// Ends this thread's AMX use (brgemm_release): at the end of each parallel chunk that called
// gemm.
void release();

}  // namespace flash_attn_ext::cpu::bf16amx
