// Prometheus metrics (metrics.h).
#include "metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace tvllm::server {

namespace {

// Prometheus floats: shortest round-trip form; "+Inf" for the last bucket. A whole number prints as an
// integer ("10", not "1e+01": %g switches to exponents at its precision), as every exporter prints counts.
std::string num(double v) {
  if (v == std::trunc(v) && std::fabs(v) < 9007199254740992.0)  // 2^53: every integer below is exact
    return std::to_string(static_cast<int64_t>(v));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Prefer the short form when it round-trips (0.25, not 0.25000000000000000).
  for (int digits = 1; digits < 17; ++digits) {
    char s[64];
    std::snprintf(s, sizeof s, "%.*g", digits, v);
    if (std::strtod(s, nullptr) == v) return s;
  }
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, double value, const std::string& labels = {}) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + num(value) + "\n";
}

// Seconds. TTFT spans a queue wait and a prefill (ms to s); TPOT one decode step (sub-ms on a GPU for the
// bundled model, tens of ms for a 1B model on a CPU).
const std::vector<double> kTtftBounds = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0};
const std::vector<double> kTpotBounds = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                         0.025,  0.05,    0.075,  0.1,   0.15,   0.2,   0.3,
                                         0.4,    0.5,     0.75,   1.0,   2.5};
const std::vector<double> kE2eBounds = {0.01, 0.025, 0.05, 0.1,  0.25, 0.5, 1.0,
                                        2.5,  5.0,   10.0, 20.0, 40.0, 80.0};

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t b =
      static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[b];  // bucket b: value <= bounds_[b] (le is inclusive)
  sum_ += value;
  ++count_;
}

int64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  header(out, name, "histogram", help);
  int64_t cumulative = 0;
  for (size_t b = 0; b <= bounds_.size(); ++b) {
    cumulative += counts_[b];
    const std::string le = b < bounds_.size() ? num(bounds_[b]) : "+Inf";
    sample(out, name + "_bucket", static_cast<double>(cumulative), "le=\"" + le + "\"");
  }
  sample(out, name + "_sum", sum_);
  sample(out, name + "_count", static_cast<double>(count_));
  return out;
}

const char* outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::Stop:
      return "stop";
    case Outcome::Length:
      return "length";
    case Outcome::Abort:
      return "abort";
    default:
      return "error";
  }
}

ServerMetrics::ServerMetrics() : ttft_(kTtftBounds), tpot_(kTpotBounds), e2e_(kE2eBounds) {}

void ServerMetrics::record_finished(Outcome outcome, int64_t prompt_tokens, int64_t generation_tokens,
                                    double ttft, double tpot, double e2e) {
  ++finished_[static_cast<size_t>(outcome)];
  prompt_tokens_ += prompt_tokens;
  generation_tokens_ += generation_tokens;
  if (ttft >= 0) ttft_.observe(ttft);
  if (tpot >= 0) tpot_.observe(tpot);
  if (e2e >= 0) e2e_.observe(e2e);
}

void ServerMetrics::record_rejected(int status) {
  std::lock_guard<std::mutex> lock(rejected_mutex_);
  const auto it =
      std::lower_bound(rejected_.begin(), rejected_.end(), std::pair<int, int64_t>{status, INT64_MIN});
  if (it != rejected_.end() && it->first == status)
    ++it->second;
  else
    rejected_.insert(it, {status, 1});
}

int64_t ServerMetrics::rejected(int status) const {
  std::lock_guard<std::mutex> lock(rejected_mutex_);
  for (const auto& [s, n] : rejected_)
    if (s == status) return n;
  return 0;
}

std::string ServerMetrics::render(const EngineStats& e, int64_t http_in_flight,
                                  int64_t waiting_for_first_token) const {
  std::string out;
  header(out, "tvllm_requests_total", "counter",
         "Requests the engine finished, by outcome (stop, length, abort, error).");
  for (size_t o = 0; o < finished_.size(); ++o)
    sample(out, "tvllm_requests_total", static_cast<double>(finished_[o].load()),
           std::string("outcome=\"") + outcome_name(static_cast<Outcome>(o)) + "\"");
  header(out, "tvllm_requests_rejected_total", "counter",
         "Requests answered with an error before reaching the engine, by HTTP status.");
  {
    std::lock_guard<std::mutex> lock(rejected_mutex_);
    for (const int status : {400, 429, 503})  // always present, so a dashboard's query has a series
      if (std::none_of(rejected_.begin(), rejected_.end(), [&](const auto& r) { return r.first == status; }))
        sample(out, "tvllm_requests_rejected_total", 0, "status=\"" + std::to_string(status) + "\"");
    for (const auto& [status, n] : rejected_)
      sample(out, "tvllm_requests_rejected_total", static_cast<double>(n),
             "status=\"" + std::to_string(status) + "\"");
  }
  header(out, "tvllm_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  sample(out, "tvllm_prompt_tokens_total", static_cast<double>(prompt_tokens_.load()));
  header(out, "tvllm_generation_tokens_total", "counter", "Tokens generated for finished requests.");
  sample(out, "tvllm_generation_tokens_total", static_cast<double>(generation_tokens_.load()));

  header(out, "tvllm_num_requests_waiting", "gauge",
         "Requests queued in the engine, not running (inbox + waiting).");
  sample(out, "tvllm_num_requests_waiting", static_cast<double>(e.pending + e.waiting));
  header(out, "tvllm_num_requests_running", "gauge", "Sequences the scheduler is running.");
  sample(out, "tvllm_num_requests_running", static_cast<double>(e.running));
  header(out, "tvllm_http_requests_in_flight", "gauge", "Generation requests admitted and not finished.");
  sample(out, "tvllm_http_requests_in_flight", static_cast<double>(http_in_flight));
  header(out, "tvllm_requests_awaiting_first_token", "gauge",
         "Admitted requests without a first token yet (what --max-waiting limits).");
  sample(out, "tvllm_requests_awaiting_first_token", static_cast<double>(waiting_for_first_token));

  header(out, "tvllm_kv_blocks_total", "gauge", "KV-cache blocks in the pool (contiguous: slots).");
  sample(out, "tvllm_kv_blocks_total", static_cast<double>(e.kv.total_blocks));
  header(out, "tvllm_kv_blocks_used", "gauge", "KV-cache blocks held by sequences.");
  sample(out, "tvllm_kv_blocks_used", static_cast<double>(e.kv.used_blocks()));
  header(out, "tvllm_kv_blocks_free", "gauge",
         "KV-cache blocks a new allocation could take (cached prefixes included).");
  sample(out, "tvllm_kv_blocks_free", static_cast<double>(e.kv.free_blocks));
  header(out, "tvllm_kv_cache_usage_ratio", "gauge", "Used KV blocks over all blocks.");
  sample(out, "tvllm_kv_cache_usage_ratio",
         e.kv.total_blocks > 0
             ? static_cast<double>(e.kv.used_blocks()) / static_cast<double>(e.kv.total_blocks)
             : 0.0);
  header(out, "tvllm_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.");
  sample(out, "tvllm_prefix_cache_queries_total", static_cast<double>(e.kv.prefix_query_tokens));
  header(out, "tvllm_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.");
  sample(out, "tvllm_prefix_cache_hits_total", static_cast<double>(e.kv.prefix_hit_tokens));
  header(out, "tvllm_preemptions_total", "counter",
         "Sequences whose KV cache was taken away (recomputed later).");
  sample(out, "tvllm_preemptions_total", static_cast<double>(e.preemptions));
  header(out, "tvllm_engine_steps_total", "counter", "Forward steps the engine ran.");
  sample(out, "tvllm_engine_steps_total", static_cast<double>(e.steps));

  out +=
      ttft_.render("tvllm_time_to_first_token_seconds", "Time from a request's arrival to its first token.");
  out +=
      tpot_.render("tvllm_time_per_output_token_seconds",
                   "Mean time between a request's output tokens after the first (requests with 2+ tokens).");
  out += e2e_.render("tvllm_e2e_request_latency_seconds", "Time from a request's arrival to its last token.");
  return out;
}

}  // namespace tvllm::server
