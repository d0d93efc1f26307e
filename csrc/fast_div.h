// Division by a divisor fixed for a kernel launch, as one 32 x 32 -> 64-bit multiply and a
// shift (Granlund and Montgomery 1994, "Division by invariant integers using multiplication"):
// for 0 <= n < 2^31 and 1 <= d < 2^31, n / d = (n * mul) >> shift with shift = 31 +
// ceil(log2 d) and mul = ceil(2^shift / d) < 2^32 (exact: mul * d - 2^shift < d <= 2^(shift -
// 31), so n's error term stays below 1 / d).  The host computes (mul, shift) once per launch;
// the kernels replace a 32-bit division (~17 instructions: a reciprocal and corrections) by
// 3-4.  Used where a kernel divides by a launch constant many times (the decode kernel's GQA
// group, its grid decomposition; docs/perf/decode.md).
#pragma once

#include <cstdint>

#include "mask.h"  // FAE_HOST_DEVICE

namespace flash_attn_ext {

struct FastDiv {
  uint32_t d = 1;
  uint32_t mul = 1u << 31;
  uint32_t shift = 31;

  FastDiv() = default;
  // d in [1, 2^31); the caller checks.
  constexpr explicit FastDiv(int64_t divisor) : d(static_cast<uint32_t>(divisor)) {
    uint32_t log2_ceil = 0;
    while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
    shift = 31 + log2_ceil;
    mul = static_cast<uint32_t>(((uint64_t{1} << shift) + d - 1) / d);
  }
  // n / d for 0 <= n < 2^31.
  constexpr FAE_HOST_DEVICE uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> shift);
  }
  // n / d and n % d for 0 <= n < 2^31.
  constexpr FAE_HOST_DEVICE void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * d;
  }
};

// (The range's edges, at compile time.  The formula was also checked by enumeration: 6,000
// divisors, small and random, each with its edge dividends and 200 random ones.)
static_assert(FastDiv(1).div(2147483647u) == 2147483647u &&
                  FastDiv(2).div(2147483647u) == 1073741823u &&
                  FastDiv(3).div(2147483647u) == 715827882u &&
                  FastDiv(7).div(2147483646u) == 306783378u &&
                  FastDiv(2147483647).div(2147483646u) == 0u &&
                  FastDiv(2147483647).div(2147483647u) == 1u &&
                  FastDiv(1000).div(999u) == 0u && FastDiv(1000).div(1000u) == 1u,
              "FastDiv");

}  // namespace flash_attn_ext
