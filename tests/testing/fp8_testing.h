// Random E4M3 weight codes for the FP8 GEMV suites (CPU and GPU). Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/random.h"

namespace tvllm::testing {

// Codes of magnitude 2^-3 .. 2^3 * 1.875 (exponent fields 4..10: never NaN, never subnormal), random signs.
inline std::vector<uint8_t> random_e4m3_codes(size_t n, uint64_t seed) {
  const std::vector<float> u = random_uniform(n * 3, seed, 0.0f, 1.0f);
  std::vector<uint8_t> q(n);
  for (size_t i = 0; i < n; ++i) {
    const int sign = u[3 * i] < 0.5f ? 0 : 1;
    const int exponent = 4 + std::min(6, static_cast<int>(u[3 * i + 1] * 7));
    const int mantissa = std::min(7, static_cast<int>(u[3 * i + 2] * 8));
    q[i] = static_cast<uint8_t>(sign << 7 | exponent << 3 | mantissa);
  }
  return q;
}

}  // namespace tvllm::testing
