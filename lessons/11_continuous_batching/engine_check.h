// Lesson 11: "N concurrent requests give what each gives alone", as the tests and the lesson executables check
// it on the real model.
//
// The requests run together through an Engine; each one's ids are compared with lesson 10's Generator running
// it alone (an independent implementation of the same loop: whole-prompt prefill, then one decode per id).
//   CPU (fp32): equal, id for id, and the same finish reason. Batching cannot change a sequence's logits beyond
//       fp32 summation order (attention splits and the prefill/decode paths differ only there), far below the
//       model's top-1 margins.
//   GPU (bf16): cuBLAS may pick another algorithm for another number of rows, so a logit moves by up to ε (lesson
//       08's kGpuLogitErrorPerRms x rms) in the batch and alone, and a near-tie may flip; after one flipped id the
//       rest differ. So exact equality is counted (and reported), and what is REQUIRED is teacher-forced
//       agreement: the batch's ids fed alone through the Generator, every id must be the argmax there or within
//       4ε of it (both runs within ε of the exact logits: the batch's argmax can trail alone's by 2 x 2ε).
//   Batch-invariant (EngineConfig::batch_invariant, and the Generator alone set the same way): equal, id for id,
//       on the GPU too. Every kernel then computes a token's row in an order that does not depend on the rest
//       of the step, so nothing is left to differ: exact equality is REQUIRED.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"
#include "model_weights.h"

namespace tvllm {

struct CheckRequest {
  std::vector<int32_t> prompt;
  RequestParams params;  // greedy
};

// n requests: prompt lengths uniform in [min_prompt, max_prompt], max_tokens in [min_output, max_output], ids in
// [0, id_high), every other request ignoring EOS (the others stop at EOS or at one of `stop_ids`);
// `shared_prefix` ids (the same for all) in front of every prompt.
std::vector<CheckRequest> make_check_requests(int n, int64_t min_prompt, int64_t max_prompt, int64_t min_output,
                                              int64_t max_output, int32_t id_high, uint64_t seed,
                                              int64_t shared_prefix = 0, const std::vector<int32_t>& stop_ids = {});

struct EngineRunResult {
  std::vector<std::vector<int32_t>> ids;  // per request, in submission order (the streamed Token events)
  std::vector<FinishReason> reasons;
  std::vector<RequestUsage> usage;
  int64_t steps = 0;
  bool events_ok = true;  // every request: its tokens, then exactly one Finished whose usage matches them
  std::string events_error;
};
// Submits every request at once and runs the engine until it is idle.
EngineRunResult run_requests(Engine& engine, const std::vector<CheckRequest>& requests);

struct AloneCheck {
  int requests = 0;
  int exact = 0;        // ids and finish reason equal to the Generator alone
  int forced_pass = 0;  // GPU: the batch's ids pass the teacher-forced check alone
  int64_t near_ties = 0;
  std::string first_failure;  // the first request that did not pass, and why
  Device device = Device::CPU;
  bool exact_required = false;  // batch-invariant runs (and every CPU run)
  bool pass() const { return device == Device::CPU || exact_required ? exact == requests : forced_pass == requests; }
  std::string summary() const;  // "64/64 exact" or "61/64 exact, 64/64 teacher-forced (3 near-ties)"
};
// Each request run alone through lesson 10's Generator (stop ids join its EOS list), with the engine's max_context.
struct AloneResults {
  std::vector<std::vector<int32_t>> ids;
  std::vector<FinishReason> reasons;
  bool batch_invariant = false;  // the Generator ran with set_batch_invariant(true)
};
AloneResults run_alone(const ModelWeights& weights, const std::vector<CheckRequest>& requests, int64_t max_context,
                       bool batch_invariant = false);

// The rules above. `alone` from run_alone on the same weights (computed once, checked against several runs).
AloneCheck check_against_alone(const ModelWeights& weights, const std::vector<CheckRequest>& requests,
                               const EngineRunResult& run, const AloneResults& alone, int64_t max_context);

// One configuration of the engine on a workload, as the lesson executables print it: a fresh engine, the
// requests at once, the alone check, and whether every KV block came back.
struct EngineCaseResult {
  AloneCheck check;
  EngineStats stats;  // at the end
  int64_t steps = 0;
  std::vector<std::vector<int32_t>> ids;  // per request
  bool events_ok = true;
  bool kv_returned = true;
  bool pass() const { return check.pass() && events_ok && kv_returned; }
};
EngineCaseResult run_engine_case(const ModelWeights& weights, const EngineConfig& config, const KvFactory& kv,
                                 const std::vector<CheckRequest>& requests, const AloneResults& alone);
// "   contiguous, 24 slots          steps  preempt  prefix hits  ids == alone          KV returned"
void print_engine_case_header();
void print_engine_case(const std::string& name, const EngineCaseResult& r);

}  // namespace tvllm
