// Helpers of the FP8 suites (CPU and GPU): random E4M3 weight codes, and how far two greedy runs must agree.
// Header-only.
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

// How many leading rows of teacher-forced logits [rows, V] (row-major) have a clear argmax: a top-1/top-2 gap
// above `margin`. Two greedy runs whose logits differ by less than margin / 2 must pick the same ids over
// exactly these rows; past the first near-tie they may follow different texts.
inline int64_t rows_before_near_tie(const float* logits, int64_t rows, int64_t V, double margin) {
  for (int64_t i = 0; i < rows; ++i) {
    float best = -1e30f, second = -1e30f;
    for (int64_t v = 0; v < V; ++v) {
      const float x = logits[i * V + v];
      if (x > best) {
        second = best;
        best = x;
      } else if (x > second) {
        second = x;
      }
    }
    if (best - second <= margin) return i;
  }
  return rows;
}

}  // namespace tvllm::testing
