// Lesson 09, sampling: parameter checks and the CPU reference. It computes every token's integer mass with
// the same functions as the GPU kernel (sampling_math.h) and then does the obvious thing: sort for top-p,
// nth_element for top-k, a running sum for the draw. Integer sums do not depend on their order, so the
// plain loops here and the kernel's radix select and block scans agree exactly.
#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/exercise.h"
#include "sampling.h"
#include "sampling_math.h"

namespace tvllm {

void validate_sampling_params(const SamplingParams& params) {
  TVLLM_REQUIRE(std::isfinite(params.temperature) && params.temperature >= 0.0f,
                "sampling: temperature must be finite and >= 0 (0 = greedy), got " +
                    std::to_string(params.temperature));
  TVLLM_REQUIRE(params.top_k >= -1,
                "sampling: top_k must be >= 1, or 0 / -1 for off, got " + std::to_string(params.top_k));
  TVLLM_REQUIRE(params.top_p > 0.0f && params.top_p <= 1.0f,  // false for NaN
                "sampling: top_p must be in (0, 1] (1 = off), got " + std::to_string(params.top_p));
}

SamplingRow make_sampling_row(const SamplingParams& params, uint64_t step) {
  validate_sampling_params(params);
  return SamplingRow{params.temperature, params.top_k < 0 ? 0 : params.top_k, params.top_p, 0u, params.seed,
                     step};
}

namespace {

void check_row_args(const float* logits, int64_t vocab, const SamplingRow& row) {
  TVLLM_REQUIRE(vocab >= 1 && vocab <= sampling::kMaxVocab,
                "sampling: vocab must be in [1, 2^23], got " + std::to_string(vocab));
  TVLLM_REQUIRE(logits != nullptr, "sampling: null logits");
  TVLLM_REQUIRE(std::isfinite(row.temperature) && row.temperature >= 0.0f,
                "sampling: temperature must be finite and >= 0, got " + std::to_string(row.temperature));
  TVLLM_REQUIRE(row.top_p > 0.0f, "sampling: top_p must be > 0, got " + std::to_string(row.top_p));
}

}  // namespace

int32_t argmax_cpu(const float* logits, int64_t vocab) {
  TVLLM_REQUIRE(vocab >= 1 && logits != nullptr, "argmax_cpu: empty row");
  int64_t best = 0;
  float best_value = sampling::sanitize_logit(logits[0]);
  for (int64_t i = 1; i < vocab; ++i) {
    const float v = sampling::sanitize_logit(logits[i]);
    if (v > best_value) {  // strictly greater: on a tie the earlier (lower) id stays
      best = i;
      best_value = v;
    }
  }
  return static_cast<int32_t>(best);
}

SamplingDistribution sampling_distribution_cpu(const float* logits, int64_t vocab, const SamplingRow& row) {
  check_row_args(logits, vocab, row);
  TVLLM_REQUIRE(row.temperature > 0.0f, "sampling_distribution_cpu: greedy rows have no distribution");
  const size_t n = static_cast<size_t>(vocab);

  // 1. Temperature: z = logit / T, and the largest z.
  std::vector<float> z(n);
  float z_max = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    z[i] = sampling::scaled_logit(logits[i], row.temperature);
    z_max = std::max(z_max, z[i]);
  }
  std::vector<uint32_t> key(n);
  std::vector<uint64_t> mass(n);
  for (size_t i = 0; i < n; ++i) {
    key[i] = sampling::order_key(z[i]);
    mass[i] = sampling::token_mass(z[i], z_max);
  }

  // --- exercise 09.4: the kept set and its probabilities ---------------------------------------------
  // Task: given every token's order key (sorts like its z = logit / T) and integer mass (exp(z - z_max)
  //   scaled by 2^40), apply top-k (row.top_k > 0 and < vocab), then top-p (row.top_p < 1) measured on
  //   the top-k survivors, as section 12 of the chapter defines them: both keep every token at or above
  //   a threshold key, ties with the boundary token included. Return a SamplingDistribution (sampling.h)
  //   whose mass holds each kept token's mass and 0 for every removed one, kept_mass their sum, kept the
  //   number of nonzero masses, and top_k_key / top_p_key the threshold each filter chose (0 when off).
  //   Integers only: the GPU kernel must reach the same numbers in another order (sampling_math.h has
  //   top_p_target).
  // Tests: Sampling09.KeptSetAndProbabilitiesMatchHuggingFaceSemantics Sampling09.TopKKeepsTiesWithTheKthToken
  // Tests: Sampling09.TiedMaximaAreAllKeptWhenSampling Sampling09.TinyTemperatureTopK1AndTinyTopPAreGreedy
  // Tests: Sampling09.DrawsFollowTheRenormalisedDistribution Sampling09.DrawsAreUniformOverAFlatRow
  // Stub:
  //   throw NotWrittenYet("09.4", "the kept set and its probabilities");
  // --- solution ---
  SamplingDistribution dist;
  // 2. Top-k: the k-th largest key; every token at or above it survives (ties included).
  uint32_t threshold = 0;  // keys >= threshold survive; 0 keeps everything
  if (row.top_k > 0 && row.top_k < vocab) {
    std::vector<uint32_t> sorted = key;
    std::nth_element(sorted.begin(), sorted.begin() + (row.top_k - 1), sorted.end(), std::greater<>());
    threshold = sorted[static_cast<size_t>(row.top_k - 1)];
    dist.top_k_key = threshold;
  }
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i)
    if (key[i] >= threshold) total += mass[i];

  // 3. Top-p over the survivors: walk the distinct keys from the top; the first key at which the mass
  // at or above it reaches ceil(p * total) is the last one kept.
  uint64_t kept_mass = total;
  if (row.top_p < 1.0f) {
    const uint64_t target = sampling::top_p_target(row.top_p, total);
    std::vector<std::pair<uint32_t, uint64_t>> survivors;
    for (size_t i = 0; i < n; ++i)
      if (key[i] >= threshold) survivors.emplace_back(key[i], mass[i]);
    std::sort(survivors.begin(), survivors.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    uint64_t cumulative = 0;
    for (size_t j = 0; j < survivors.size();) {
      const uint32_t k = survivors[j].first;
      for (; j < survivors.size() && survivors[j].first == k; ++j) cumulative += survivors[j].second;
      if (cumulative >= target) {
        threshold = k;
        dist.top_p_key = k;
        break;
      }
    }
    kept_mass = cumulative;
  }

  // 4. Renormalise: the kept tokens keep their mass, the others get 0; the draw divides by kept_mass.
  for (size_t i = 0; i < n; ++i) {
    if (key[i] < threshold) mass[i] = 0;
    if (mass[i] != 0) ++dist.kept;
  }
  dist.mass = std::move(mass);
  dist.kept_mass = kept_mass;
  return dist;
  // --- end of exercise 09.4 ---
}

int32_t sample_cpu(const float* logits, int64_t vocab, const SamplingRow& row) {
  check_row_args(logits, vocab, row);
  if (row.temperature == 0.0f) return argmax_cpu(logits, vocab);
  const SamplingDistribution dist = sampling_distribution_cpu(logits, vocab, row);
  // Inverse CDF in index order: U uniform in [0, kept_mass); the token whose interval
  // [mass before it, mass before it + its mass) holds U.
  const uint64_t u = sampling::mulhi_u64(sampling::random_u64(row.seed, row.step), dist.kept_mass);
  uint64_t cumulative = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    cumulative += dist.mass[static_cast<size_t>(i)];
    if (cumulative > u) return static_cast<int32_t>(i);
  }
  throw std::logic_error("sample_cpu: the draw fell past the last kept token");  // unreachable: u < kept_mass
}

}  // namespace tvllm
