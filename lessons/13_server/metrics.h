// Lesson 13: GET /metrics, in the Prometheus text format (prometheus.io/docs/instrumenting/exposition_formats).
//
//   # HELP tvllm_time_to_first_token_seconds Time from a request's arrival to its first token.
//   # TYPE tvllm_time_to_first_token_seconds histogram
//   tvllm_time_to_first_token_seconds_bucket{le="0.01"} 3        cumulative: requests with TTFT <= 10 ms
//   ...
//   tvllm_time_to_first_token_seconds_bucket{le="+Inf"} 5
//   tvllm_time_to_first_token_seconds_sum 0.0734
//   tvllm_time_to_first_token_seconds_count 5
//
// Counters only grow (a scraper computes rates from them); gauges are a snapshot (queue depth, KV blocks).
// Everything here is thread-safe: the engine thread records, any HTTP thread renders.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"  // EngineStats

namespace tvllm::server {

// A Prometheus histogram: counts per upper bound (cumulative when rendered), their sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // The lines of one histogram metric (HELP, TYPE, buckets, sum, count).
  std::string render(const std::string& name, const std::string& help) const;
  int64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0.0;
  int64_t count_ = 0;
};

// How a request ended, as /metrics counts it.
enum class Outcome { Stop, Length, Abort, Error, kCount };
const char* outcome_name(Outcome outcome);  // "stop", "length", "abort", "error"

class ServerMetrics {
 public:
  ServerMetrics();

  // A request the engine finished: its outcome, token counts and latencies (seconds; tpot < 0: fewer than two
  // tokens, not observed).
  void record_finished(Outcome outcome, int64_t prompt_tokens, int64_t generation_tokens, double ttft,
                       double tpot, double e2e);
  // A request answered with an error status before it reached the engine (400, 404, 429, 503...).
  void record_rejected(int status);

  // The whole page: these counters and histograms, and gauges from the engine's statistics.
  std::string render(const EngineStats& engine, int64_t http_in_flight,
                     int64_t waiting_for_first_token) const;

  int64_t finished(Outcome outcome) const { return finished_[static_cast<size_t>(outcome)].load(); }
  int64_t rejected(int status) const;
  const Histogram& ttft() const { return ttft_; }
  const Histogram& tpot() const { return tpot_; }

 private:
  std::array<std::atomic<int64_t>, static_cast<size_t>(Outcome::kCount)> finished_{};
  std::atomic<int64_t> prompt_tokens_{0}, generation_tokens_{0};
  mutable std::mutex rejected_mutex_;
  std::vector<std::pair<int, int64_t>> rejected_;  // (status, count), sorted by status
  Histogram ttft_, tpot_, e2e_;
};

}  // namespace tvllm::server
