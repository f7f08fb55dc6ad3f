// Lesson 11: the throughput workload and its driver (engine_bench.h).
#include "engine_bench.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_map>

#include "common/errors.h"
#include "common/random.h"

namespace tvllm {

int32_t workload_id_high(const ModelConfig& config) {
  const int64_t bos = config.bos_token_id, vocab = config.vocab_size;
  return static_cast<int32_t>(vocab / 2 < bos && bos < vocab ? bos : vocab);
}

std::vector<ThroughputRequest> make_throughput_workload(int64_t n, int64_t min_len, int64_t max_len, int32_t id_high,
                                                        uint64_t seed) {
  TVLLM_REQUIRE(n >= 1, "workload: the number of requests must be >= 1, got " + std::to_string(n));
  TVLLM_REQUIRE(min_len >= 1 && min_len <= max_len, "workload: lengths must satisfy 1 <= min_len <= max_len, got [" +
                                                        std::to_string(min_len) + ", " + std::to_string(max_len) + "]");
  TVLLM_REQUIRE(id_high >= 1, "workload: id_high must be >= 1");
  Rng rng(seed);  // SplitMix64: the order of the draws below is the contract with hf_baseline.py
  const auto span = static_cast<uint64_t>(max_len - min_len + 1);
  std::vector<ThroughputRequest> requests(static_cast<size_t>(n));
  for (ThroughputRequest& r : requests) {
    const int64_t prompt_len = min_len + static_cast<int64_t>(rng.next_u64() % span);
    r.output_len = min_len + static_cast<int64_t>(rng.next_u64() % span);
    r.prompt.resize(static_cast<size_t>(prompt_len));
    for (int32_t& id : r.prompt) id = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(id_high));
  }
  return requests;
}

ThroughputResult run_throughput(Engine& engine, const std::vector<ThroughputRequest>& requests, int64_t static_batch,
                                const std::function<void(const ThroughputProgress&)>& progress,
                                double progress_interval_s) {
  using Clock = std::chrono::steady_clock;
  TVLLM_REQUIRE(!requests.empty(), "run_throughput: no requests");
  TVLLM_REQUIRE(!engine.has_work(), "run_throughput: the engine is busy");
  RequestParams params;
  params.sampling = SamplingParams{0.0f, 0, 1.0f, 0};  // greedy
  params.ignore_eos = true;

  // Warm-up (untimed): kernels loaded, cuBLAS heuristics cached, a prefill and a few decodes.
  {
    RequestParams warm = params;
    warm.max_tokens = 4;
    engine.submit(std::vector<int32_t>(16, 1), warm, [](const EngineEvent&) {});
    engine.run_until_idle();
  }
  const EngineStats before = engine.stats();

  EventQueue events;
  ThroughputResult result;
  result.requests = static_cast<int64_t>(requests.size());
  for (const ThroughputRequest& r : requests) {
    result.prompt_tokens += static_cast<int64_t>(r.prompt.size());
    result.output_tokens += r.output_len;
  }
  const auto start = Clock::now();
  auto last_report = start;
  const auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const auto B = static_cast<size_t>(static_batch > 0 ? static_batch : static_cast<int64_t>(requests.size()));
  int64_t done = 0, delivered = 0, complete = 0;
  std::unordered_map<int64_t, size_t> index_of;  // engine request id -> workload index (ids need not start at 0)
  for (size_t first = 0; first < requests.size(); first += B) {
    for (size_t i = first; i < std::min(requests.size(), first + B); ++i) {
      params.max_tokens = requests[i].output_len;
      index_of[engine.submit(requests[i].prompt, params, events.sink())] = i;
    }
    while (engine.has_work()) {
      const auto step_start = Clock::now();
      engine.step();
      result.step_s += seconds_since(step_start);
      while (const auto e = events.try_pop()) {
        if (e->kind == EngineEvent::Kind::Token) {
          ++delivered;
        } else {
          ++done;
          const int64_t want = requests.at(index_of.at(e->request_id)).output_len;
          if (e->reason == FinishReason::Length && e->usage.completion_tokens == want) ++complete;
        }
      }
      if (progress && seconds_since(last_report) >= progress_interval_s) {
        last_report = Clock::now();
        progress(ThroughputProgress{done, result.requests, delivered, seconds_since(start)});
      }
    }
  }
  result.seconds = seconds_since(start);
  const EngineStats after = engine.stats();
  result.output_tok_s = static_cast<double>(result.output_tokens) / result.seconds;
  result.total_tok_s = static_cast<double>(result.prompt_tokens + result.output_tokens) / result.seconds;
  result.steps = after.steps - before.steps;
  result.peak_running = after.peak_running;
  result.preemptions = after.preemptions - before.preemptions;
  result.failed = result.requests - complete;
  result.kv = after.kv;
  result.prepare_s = after.prepare_s - before.prepare_s;
  result.launch_s = after.launch_s - before.launch_s;
  result.wait_s = after.wait_s - before.wait_s;
  result.other_s = std::max(0.0, result.step_s - result.prepare_s - result.launch_s - result.wait_s);
  return result;
}

}  // namespace tvllm
