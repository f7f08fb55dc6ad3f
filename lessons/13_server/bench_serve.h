// Lesson 13: `tiny-vllm bench serve`, a load generator for the server (vLLM's benchmark_serving, in small).
//
//   C workers, each with its own connection, each sending one streaming request at a time until N are done
//   (or the time limit passes):
//
//     POST /v1/completions {"prompt": [P random ids], "max_tokens": M, "ignore_eos": true, "temperature": 0,
//                           "stream": true, "stream_options": {"include_usage": true}}
//
//   per request:  TTFT = first text chunk - request sent           (queueing + prefill)
//                 TPOT = (last chunk - first chunk) / (tokens - 1)  (one decode step, shared with the batch)
//   overall:      requests/s and output tokens/s over the wall time of the run
//
// It only talks to a server on this machine (127.0.0.0/8, ::1, localhost): a benchmark is a load test, and a load
// test is not something to aim at somebody else's server. It is bounded in requests and in time.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace tvllm::server {

struct BenchServeOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string model;    // empty: the first model of GET /v1/models
  std::string api_key;  // sent as a Bearer token when set
  int concurrency = 1;
  int64_t num_requests = 64;
  int64_t max_tokens = 128;
  int64_t prompt_len = 128;
  double duration_limit_s = 600;  // no new requests after this; requests still running are cut off
  uint64_t seed = 0;
  // Prompt ids are drawn uniformly from [id_low, id_high): ordinary tokens of every Llama-family vocabulary
  // (the bundled model's special tokens start at 744, Llama 3's at 128000).
  int32_t id_low = 100, id_high = 600;
};

struct LatencySummary {
  int64_t n = 0;
  double mean = 0, p50 = 0, p99 = 0;  // milliseconds
};

struct BenchServeResult {
  std::string url, model;
  int concurrency = 0;
  int64_t requests_sent = 0, completed = 0, failed = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  double seconds = 0;
  double request_throughput = 0, output_tok_s = 0;
  LatencySummary ttft_ms, tpot_ms, e2e_ms;
  bool duration_limit_hit = false;
  std::string first_error;  // of the failed requests

  nlohmann::ordered_json to_json() const;
  std::string table() const;  // what `bench serve` prints
};

struct LoopbackUrl {
  std::string host;
  int port = 0;
};
// "http://127.0.0.1:8000" (a trailing "/" or "/v1" is allowed). InputError for another scheme, a host that is
// not a loopback address, a missing or bad port.
LoopbackUrl parse_loopback_url(const std::string& url);

// Percentiles as numpy's default (linear between the closest ranks). Empty: 0.
LatencySummary summarize(std::vector<double> values_ms);

// Runs the load. InputError for bad options (concurrency < 1, ...) or a URL that is not loopback; a server that
// cannot be reached is an InputError too (start it first).
BenchServeResult run_bench_serve(const BenchServeOptions& options);

}  // namespace tvllm::server
