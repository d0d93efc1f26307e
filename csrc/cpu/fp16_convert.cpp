// fp16_convert.h.  As bf16_dot.cpp: the function that uses the instructions carries the target
// attribute and runs only after f16c() checked the CPU, and the file includes no library header
// with inline functions (no F16C copy of a shared inline function for the linker to pick).
#include "cpu/fp16_convert.h"

#include "cpu/env_switch.h"

#include <cstdlib>
#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__)
#define FAE_HAVE_F16C 1
#include <immintrin.h>
#else
#define FAE_HAVE_F16C 0
#endif

namespace flash_attn_ext::cpu::fp16 {

namespace {

#if FAE_HAVE_F16C
__attribute__((target("avx,f16c"))) void with_f16c(float* dst, const uint16_t* src, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(dst + c,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
  for (; c < n; ++c) dst[c] = _cvtsh_ss(src[c]);
}
#endif

}  // namespace

bool f16c() {
  static const bool on = [] {
    // (FLASH_ATTN_EXT_CPU_F16C=0, false, no or off: c10::Half's own conversion, for tests and
    // A/Bs; read on every build, so that a value env_switch does not take is an error
    // wherever it is set)
    if (!env_switch("FLASH_ATTN_EXT_CPU_F16C", true)) return false;
#if FAE_HAVE_F16C
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return on;
}

void half_to_float(float* dst, const uint16_t* src, int64_t n) {
#if FAE_HAVE_F16C
  with_f16c(dst, src, n);
#else
  (void)dst, (void)src, (void)n;  // (f16c() is false: never called)
#endif
}

}  // namespace flash_attn_ext::cpu::fp16
