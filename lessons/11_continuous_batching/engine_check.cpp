// Lesson 11: concurrent == alone on the real model (engine_check.h).
#include "engine_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "common/errors.h"
#include "common/random.h"
#include "generate.h"
#include "generate_check.h"
#include "logits_check.h"

namespace tvllm {

std::vector<CheckRequest> make_check_requests(int n, int64_t min_prompt, int64_t max_prompt, int64_t min_output,
                                              int64_t max_output, int32_t id_high, uint64_t seed,
                                              int64_t shared_prefix, const std::vector<int32_t>& stop_ids) {
  TVLLM_REQUIRE(n >= 1 && 1 <= min_prompt && min_prompt <= max_prompt && 1 <= min_output &&
                    min_output <= max_output && id_high >= 1 && shared_prefix >= 0,
                "make_check_requests: bad sizes");
  Rng rng(seed);
  std::vector<int32_t> prefix(static_cast<size_t>(shared_prefix));
  for (int32_t& id : prefix) id = static_cast<int32_t>(rng.below(id_high));
  std::vector<CheckRequest> requests(static_cast<size_t>(n));
  for (size_t i = 0; i < requests.size(); ++i) {
    CheckRequest& r = requests[i];
    r.prompt = prefix;
    const int64_t len = min_prompt + rng.below(max_prompt - min_prompt + 1);
    for (int64_t j = 0; j < len; ++j) r.prompt.push_back(static_cast<int32_t>(rng.below(id_high)));
    r.params.sampling = SamplingParams{0.0f, 0, 1.0f, 0};
    r.params.max_tokens = min_output + rng.below(max_output - min_output + 1);
    r.params.ignore_eos = i % 2 == 1;
    if (!r.params.ignore_eos) r.params.stop_ids = stop_ids;
  }
  return requests;
}

EngineRunResult run_requests(Engine& engine, const std::vector<CheckRequest>& requests) {
  EngineRunResult run;
  const size_t n = requests.size();
  run.ids.resize(n);
  run.reasons.assign(n, FinishReason::None);
  run.usage.resize(n);
  std::vector<int> finished(n, 0);
  std::vector<int64_t> ids;  // request id of each
  // The sink runs on this thread (step() calls it): plain vectors are enough.
  for (size_t i = 0; i < n; ++i) {
    ids.push_back(engine.submit(requests[i].prompt, requests[i].params, [&run, &finished, i](const EngineEvent& e) {
      if (finished[i] > 0) {
        run.events_ok = false;
        run.events_error = "request " + std::to_string(i) + ": an event after Finished";
      }
      if (e.kind == EngineEvent::Kind::Token) {
        run.ids[i].push_back(e.token);
      } else {
        ++finished[i];
        run.reasons[i] = e.reason;
        run.usage[i] = e.usage;
      }
    }));
  }
  run.steps = engine.run_until_idle();
  for (size_t i = 0; i < n && run.events_ok; ++i) {
    if (finished[i] != 1) {
      run.events_ok = false;
      run.events_error = "request " + std::to_string(i) + ": " + std::to_string(finished[i]) + " Finished events";
    } else if (run.usage[i].completion_tokens != static_cast<int64_t>(run.ids[i].size()) ||
               run.usage[i].prompt_tokens != static_cast<int64_t>(requests[i].prompt.size())) {
      run.events_ok = false;
      run.events_error = "request " + std::to_string(i) + ": usage " +
                         std::to_string(run.usage[i].prompt_tokens) + " + " +
                         std::to_string(run.usage[i].completion_tokens) + " does not match its tokens";
    }
  }
  return run;
}

std::string AloneCheck::summary() const {
  std::string s = std::to_string(exact) + "/" + std::to_string(requests) + " exact";
  if (device == Device::CUDA)
    s += ", " + std::to_string(forced_pass) + "/" + std::to_string(requests) + " teacher-forced (" +
         std::to_string(near_ties) + " near-ties)";
  if (!first_failure.empty()) s += "; first failure: " + first_failure;
  return s;
}

namespace {

FinishReason generator_reason(StopReason stop) {
  return stop == StopReason::Eos ? FinishReason::Stop : FinishReason::Length;
}

double rms(const Tensor& t) {
  const TensorView v = t.view();
  const float* p = v.ptr<const float>();
  double sum = 0.0;
  for (int64_t i = 0; i < v.numel(); ++i) sum += static_cast<double>(p[i]) * p[i];
  return std::sqrt(sum / static_cast<double>(std::max<int64_t>(1, v.numel())));
}

}  // namespace

AloneResults run_alone(const ModelWeights& weights, const std::vector<CheckRequest>& requests, int64_t max_context,
                       bool batch_invariant) {
  Generator gen(weights, Generator::limits_for(weights.config, max_context, 1));
  gen.set_batch_invariant(batch_invariant);
  AloneResults a;
  a.batch_invariant = batch_invariant;
  for (const CheckRequest& r : requests) {
    GenerateOptions o;
    o.max_new_tokens = r.params.max_tokens;
    o.ignore_eos = r.params.ignore_eos;
    o.sampling = r.params.sampling;
    if (!r.params.stop_ids.empty()) {  // the engine stops at a stop id, and (unless ignore_eos) at EOS
      TVLLM_REQUIRE(!r.params.ignore_eos, "run_alone: stop ids with ignore_eos: the Generator cannot do that");
      o.eos_ids = weights.config.eos_token_ids;
      o.eos_ids.insert(o.eos_ids.end(), r.params.stop_ids.begin(), r.params.stop_ids.end());
    }
    GenerateResult g = gen.generate(r.prompt, o);
    a.ids.push_back(std::move(g.ids));
    a.reasons.push_back(generator_reason(g.stop));
  }
  return a;
}

AloneCheck check_against_alone(const ModelWeights& weights, const std::vector<CheckRequest>& requests,
                               const EngineRunResult& run, const AloneResults& alone, int64_t max_context) {
  AloneCheck c;
  c.device = weights.device;
  c.requests = static_cast<int>(requests.size());
  c.exact_required = alone.batch_invariant;
  TVLLM_REQUIRE(alone.ids.size() == requests.size() && run.ids.size() == requests.size(),
                "check_against_alone: results for another number of requests");
  std::optional<Generator> gen;  // GPU teacher forcing
  const auto fail = [&](size_t i, const std::string& why) {
    if (c.first_failure.empty()) c.first_failure = "request " + std::to_string(i) + ": " + why;
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    const CheckRequest& r = requests[i];
    const std::vector<int32_t>& got = run.ids[i];
    if (got == alone.ids[i] && run.reasons[i] == alone.reasons[i]) {
      ++c.exact;
      ++c.forced_pass;
      continue;
    }
    const int64_t at = first_difference(got, alone.ids[i]);
    const std::string diff = "ids " + ids_text(got) + " (" + std::string(finish_reason_name(run.reasons[i])) +
                             ") vs alone " + ids_text(alone.ids[i]) + " (" +
                             std::string(finish_reason_name(alone.reasons[i])) + "), first difference at " +
                             std::to_string(at);
    if (weights.device == Device::CPU || c.exact_required || got.empty()) {
      fail(i, diff + (c.exact_required ? " (batch-invariant: must be equal)" : ""));
      continue;
    }
    // GPU: the batch's ids, fed alone, must each be the argmax there up to 4ε (engine_check.h).
    if (!gen) gen.emplace(weights, Generator::limits_for(weights.config, max_context, 1));
    const Tensor logits = gen->forced_logits(r.prompt, got);
    const double eps = kGpuLogitErrorPerRms * rms(logits);
    const ForcedAgreement a = forced_agreement(logits.view(), got, 2 * eps);
    c.near_ties += a.near_ties;
    const bool length_ok =
        run.reasons[i] == FinishReason::Stop ||
        (run.reasons[i] == FinishReason::Length &&
         (static_cast<int64_t>(got.size()) == r.params.max_tokens ||
          static_cast<int64_t>(r.prompt.size() + got.size()) == max_context));
    if (a.pass() && length_ok) {
      ++c.forced_pass;
    } else {
      fail(i, diff + "; teacher-forced: " + a.summary() + (length_ok ? "" : "; wrong length"));
    }
  }
  return c;
}

EngineCaseResult run_engine_case(const ModelWeights& weights, const EngineConfig& config, const KvFactory& kv,
                                 const std::vector<CheckRequest>& requests, const AloneResults& alone) {
  TVLLM_REQUIRE(config.batch_invariant == alone.batch_invariant,
                "run_engine_case: the engine and the Generator alone must both be batch-invariant, or neither");
  Engine engine(weights, config, kv);
  EngineCaseResult r;
  const EngineRunResult run = run_requests(engine, requests);
  r.steps = run.steps;
  r.ids = run.ids;
  r.events_ok = run.events_ok;
  r.check = check_against_alone(weights, requests, run, alone, engine.limits().max_context);
  r.stats = engine.stats();
  r.kv_returned = r.stats.kv.free_blocks == r.stats.kv.total_blocks;
  return r;
}

void print_engine_case_header() {
  std::printf("   %-40s %6s %8s %12s  %-44s %s\n", "engine", "steps", "preempt", "prefix hits", "ids == alone",
              "KV back");
}

void print_engine_case(const std::string& name, const EngineCaseResult& r) {
  const std::string hits = std::to_string(r.stats.kv.prefix_hit_tokens) + "/" +
                           std::to_string(r.stats.kv.prefix_query_tokens);
  std::string alone = r.check.summary();
  const size_t cut = alone.find("; first failure");
  if (cut != std::string::npos) alone.resize(cut);
  std::printf("   %-40s %6lld %8lld %12s  %-44s %s  %s\n", name.c_str(), static_cast<long long>(r.steps),
              static_cast<long long>(r.stats.preemptions), hits.c_str(), alone.c_str(), r.kv_returned ? "yes" : "NO",
              r.pass() ? "PASS" : "FAIL");
  if (!r.check.first_failure.empty()) std::printf("      %s\n", r.check.first_failure.c_str());
  if (!r.events_ok) std::printf("      the token stream was wrong\n");
}

}  // namespace tvllm
