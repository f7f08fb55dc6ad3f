// Lesson 11: the throughput benchmark's workload and driver (shared by `tiny-vllm bench throughput`, the lesson
// executable's --bench and weights/tools/hf_baseline.py, which ports the generator to Python exactly).
//
// The workload (COURSE.md "Performance method"): n requests, prompt and output lengths uniform in
// [min_len, max_len], random prompt ids, EOS ignored. Drawn with SplitMix64 (common/random.h's Rng) seeded with
// `seed`, in this order, request after request:
//
//   prompt_len = min_len + next() % (max_len - min_len + 1)
//   output_len = min_len + next() % (max_len - min_len + 1)
//   prompt_len ids:  id = next() % id_high
//
// id_high (workload_id_high) keeps the ids below the special tokens when they come after the ordinary vocabulary
// (Llama 3: bos 128000 of 128256; the bundled model: 744 of 1000), else the whole vocabulary. (The modulo's bias
// is below 2^-40 for these ranges: irrelevant, and identical on both sides.)
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine.h"
#include "model_config.h"

namespace tvllm {

struct ThroughputRequest {
  std::vector<int32_t> prompt;
  int64_t output_len = 0;  // max_tokens, EOS ignored: exactly this many ids
};

// bos_token_id when vocab/2 < bos < vocab (the special ids follow the ordinary ones), else vocab_size.
int32_t workload_id_high(const ModelConfig& config);
// InputError for n < 1, min_len < 1, min_len > max_len, id_high < 1.
std::vector<ThroughputRequest> make_throughput_workload(int64_t n, int64_t min_len, int64_t max_len, int32_t id_high,
                                                        uint64_t seed);

struct ThroughputProgress {
  int64_t done = 0, total = 0;  // requests
  int64_t output_tokens = 0;    // ids delivered so far
  double seconds = 0.0;
};

struct ThroughputResult {
  int64_t requests = 0, prompt_tokens = 0, output_tokens = 0;
  double seconds = 0.0;
  double output_tok_s = 0.0, total_tok_s = 0.0;
  int64_t steps = 0, peak_running = 0, preemptions = 0;
  int64_t failed = 0;  // requests that did not end with their output_len ids (must be 0)
  KvUsage kv;          // the pool (its usage at the end: all free)
  // The engine thread's wall time in steps, split as EngineStats does: preparing inputs, queueing the device
  // work, waiting for the GPU; `other` is the rest of the steps' time (scheduling, delivering tokens).
  double step_s = 0.0, prepare_s = 0.0, launch_s = 0.0, wait_s = 0.0, other_s = 0.0;
};

// Submits the requests (greedy, ignore_eos, max_tokens = output_len) and runs the engine until all have
// finished. static_batch 0: all at once (continuous batching); B > 0: B at a time, the next B only when the
// whole batch has finished (static batching, for the lesson's comparison). Calls progress about every
// progress_interval_s seconds (and never when it is empty). A short warm-up request runs first, untimed.
ThroughputResult run_throughput(Engine& engine, const std::vector<ThroughputRequest>& requests, int64_t static_batch = 0,
                                const std::function<void(const ThroughputProgress&)>& progress = {},
                                double progress_interval_s = 1.0);

}  // namespace tvllm
