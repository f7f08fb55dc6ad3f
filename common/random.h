// Deterministic pseudo-random numbers for tests and benchmarks: the same seed gives the same values
// on every machine and compiler (std::normal_distribution does not promise that).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tvllm {

// SplitMix64: tiny, fast, and good enough to fill test tensors.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1), 24 random bits.
  float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal by Box-Muller.
  float normal() {
    float u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0f * std::log(u1 + 1e-12f)) * std::cos(6.28318530718f * u2);
  }
  // Uniform integer in [0, n).
  int64_t below(int64_t n) { return static_cast<int64_t>(next_u64() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

inline std::vector<float> random_uniform(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

inline std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = stddev * rng.normal();
  return v;
}

}  // namespace tvllm
