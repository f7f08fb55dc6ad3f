// lesson11_continuous_batching: the scheduler, simulated, then the engine on the real model.
//
//   build/bin/lesson11_continuous_batching [--model DIR] [--device auto|cpu|cuda] [--bench]
//
//   1. The simulation (no model, no GPU): 64 requests of mixed prompt and output lengths through the scheduler
//      over a contiguous cache of 8 slots (lesson 10's KvCache as a SlotAllocator) and the fake model of
//      simulate.h, twice:
//        static       8 requests at a time; the next 8 start when the slowest of the batch has finished
//        continuous   all 64 submitted at once; a slot is refilled the step after its request finishes
//      It prints steps, tokens per step and slot use for both, the first steps of each as a timeline, and checks
//      that every request's ids equal what it gives alone.
//   2. The engine (engine.h) on the model, on the device: 64 concurrent greedy requests of mixed lengths, with a
//      contiguous cache of 24 slots and with chunked prefill under a small budget, each request's ids against
//      lesson 10's Generator running it alone (engine_check.h: exact on the CPU; on the GPU exact matches counted
//      and teacher-forced agreement required), and every slot back at the end. PASS/FAIL per configuration.
//   3. --bench: static vs continuous batching measured with the real engine: the throughput workload
//      (engine_bench.h; CUDA: 256 requests, lengths [100, 1024]; CPU: 32 requests, [8, 64]) in static batches
//      of B and all at once with B sequences running (CUDA: B = 64; CPU: 8): output tok/s of each.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "kv_allocator.h"
#include "model_dir.h"
#include "model_weights.h"
#include "scheduler.h"
#include "simulate.h"

namespace tvllm {
namespace {

constexpr int kRequests = 64;
constexpr int64_t kSlots = 8;
constexpr int64_t kMaxContext = 512;
constexpr int64_t kBudget = 256;  // tokens per step
constexpr int32_t kVocab = 50;    // small, so EOS (id 0) stops some requests early
constexpr int kTimelineSteps = 72;

struct Run {
  int64_t steps = 0, tokens = 0, busy_slot_steps = 0;
  bool outputs_equal = true;
  std::vector<std::string> timeline;  // one row per slot, one column per step
};

// A letter per request (A..Z, then again): upper case while it prefills, lower case when it decodes.
char label(int64_t id, bool decode) { return static_cast<char>((decode ? 'a' : 'A') + id % 26); }

Run simulate(const std::vector<SimRequest>& requests, bool continuous) {
  SchedulerConfig config;
  config.max_tokens_per_step = kBudget;
  config.max_sequences = kSlots;
  config.max_context = kMaxContext;
  config.eos_ids = {0};
  SlotAllocator slots(kSlots, kMaxContext);
  Scheduler scheduler(config, slots);
  FakeModel model(slots.num_kv_slots(), kVocab);

  Run run;
  run.timeline.assign(kSlots, std::string());
  const auto on_step = [&](const ScheduledBatch& batch) {
    run.tokens += batch.num_tokens();
    run.busy_slot_steps += batch.num_sequences();
    if (run.timeline[0].size() >= kTimelineSteps) return;
    for (std::string& row : run.timeline) row += '.';
    for (const ScheduledSequence& s : batch.seqs)
      run.timeline[static_cast<size_t>(s.seq->kv_blocks.at(0))].back() = label(s.seq->id, s.is_decode);
  };
  std::vector<int64_t> ids;
  const size_t group = continuous ? requests.size() : static_cast<size_t>(kSlots);
  for (size_t first = 0; first < requests.size(); first += group) {
    for (size_t i = first; i < std::min(requests.size(), first + group); ++i)
      ids.push_back(scheduler.add(requests[i].prompt, requests[i].params));
    run.steps += run_until_idle(scheduler, model, on_step);  // static: the whole group drains first
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    const Sequence* seq = scheduler.find(ids[i]);
    if (seq->output != reference_output(requests[i].prompt, requests[i].params, config.eos_ids, kMaxContext, kVocab))
      run.outputs_equal = false;
  }
  return run;
}

bool run_simulation() {
  std::printf("1. the scheduler on the CPU, with a fake model (simulate.h)\n");
  const std::vector<SimRequest> requests = make_workload(kRequests, 8, 200, 1, 120, kVocab, 0);
  int64_t prompt_tokens = 0;
  for (const SimRequest& r : requests) prompt_tokens += static_cast<int64_t>(r.prompt.size());
  std::printf("workload: %d requests, prompts 8..200 tokens (%lld in all), max_tokens 1..120, seed 0\n", kRequests,
              static_cast<long long>(prompt_tokens));
  std::printf("cache: %lld slots x %lld positions; budget %lld tokens per step\n\n", static_cast<long long>(kSlots),
              static_cast<long long>(kMaxContext), static_cast<long long>(kBudget));

  const Run runs[2] = {simulate(requests, false), simulate(requests, true)};
  const char* names[2] = {"static", "continuous"};
  std::printf("%-11s %6s %8s %12s %9s  %s\n", "batching", "steps", "tokens", "tokens/step", "slot use", "ids == alone");
  bool pass = true;
  for (int m = 0; m < 2; ++m) {
    const Run& r = runs[m];
    std::printf("%-11s %6lld %8lld %12.1f %8.1f%%  %s\n", names[m], static_cast<long long>(r.steps),
                static_cast<long long>(r.tokens), static_cast<double>(r.tokens) / static_cast<double>(r.steps),
                100.0 * static_cast<double>(r.busy_slot_steps) / static_cast<double>(r.steps * kSlots),
                r.outputs_equal ? "PASS" : "FAIL");
    pass = pass && r.outputs_equal;
  }
  std::printf("continuous batching: %.2fx fewer steps\n\n",
              static_cast<double>(runs[0].steps) / static_cast<double>(runs[1].steps));
  for (int m = 0; m < 2; ++m) {
    std::printf(
        "%s, the first %d steps (a column per step, a letter per request: upper case a prefill chunk, "
        "lower case a decode, '.' an idle slot):\n",
        names[m], kTimelineSteps);
    for (size_t s = 0; s < runs[m].timeline.size(); ++s)
      std::printf("  slot %zu  %s\n", s, runs[m].timeline[s].c_str());
    std::printf("\n");
  }
  return pass;
}

bool run_engine_checks(const ModelWeights& w) {
  const bool gpu = w.device == Device::CUDA;
  // CPU: a lighter workload (the fp32 reference computes every token in double-accumulated loops).
  const int64_t max_prompt = gpu ? 200 : 32, max_output = gpu ? 64 : 24, max_context = gpu ? 512 : 128;
  const std::vector<CheckRequest> requests =
      make_check_requests(64, 2, max_prompt, 1, max_output, workload_id_high(w.config), 11);
  std::printf("2. the engine on the model (%s): 64 concurrent greedy requests, prompts 2..%lld, max_tokens 1..%lld, "
              "every other one ignoring EOS\n",
              gpu ? "CUDA, bf16" : "CPU, fp32", static_cast<long long>(max_prompt),
              static_cast<long long>(max_output));
  const AloneResults alone = run_alone(w, requests, max_context);
  EngineConfig c;
  c.max_context = max_context;
  c.max_sequences = 24;
  c.max_tokens_per_step = 1024;
  print_engine_case_header();
  bool pass = true;
  const EngineCaseResult slots = run_engine_case(w, c, contiguous_kv(24), requests, alone);
  print_engine_case("contiguous, 24 slots", slots);
  c.max_sequences = 16;
  c.max_tokens_per_step = 32;
  const EngineCaseResult chunked = run_engine_case(w, c, contiguous_kv(16), requests, alone);
  print_engine_case("chunked prefill, budget 32", chunked);
  pass = slots.pass() && chunked.pass();
  if (gpu) {
    // Batch invariance (README "Batch invariance"): v8 GEMMs and flash attention everywhere, the Generator alone
    // set the same way: now exact equality is required on the GPU too.
    c.batch_invariant = true;
    const AloneResults invariant_alone = run_alone(w, requests, max_context, /*batch_invariant=*/true);
    const EngineCaseResult invariant = run_engine_case(w, c, contiguous_kv(16), requests, invariant_alone);
    print_engine_case("batch-invariant, chunked, budget 32", invariant);
    pass = pass && invariant.pass();
  }
  std::printf("   (ids == alone: lesson 10's Generator running each request alone; %s)\n\n",
              gpu ? "bf16: exact matches counted, teacher-forced agreement required (engine_check.h); "
                    "batch-invariant: exact, id for id"
                  : "fp32: exact, id for id");
  return pass;
}

void run_bench(const ModelWeights& w) {
  const bool gpu = w.device == Device::CUDA;
  const int64_t n = gpu ? 256 : 32, lo = gpu ? 100 : 8, hi = gpu ? 1024 : 64, B = gpu ? 64 : 8;
  const auto requests = make_throughput_workload(n, lo, hi, workload_id_high(w.config), 0);
  EngineConfig c;
  c.max_sequences = B;
  c.max_tokens_per_step = 4096;
  c.max_context = std::min<int64_t>(2 * hi, w.config.max_position_embeddings);
  std::printf("3. --bench: %lld requests, prompt and output lengths uniform in [%lld, %lld] (seed 0, EOS ignored), "
              "contiguous cache of %lld slots, %lld sequences at most\n",
              static_cast<long long>(n), static_cast<long long>(lo), static_cast<long long>(hi),
              static_cast<long long>(B), static_cast<long long>(B));
  std::printf("   %-34s %8s %8s %14s %14s\n", "batching", "steps", "seconds", "output tok/s", "total tok/s");
  double tok_s[2] = {0, 0};
  for (const int64_t static_batch : {B, int64_t{0}}) {
    Engine engine(w, c, contiguous_kv(B));
    const ThroughputResult r = run_throughput(engine, requests, static_batch);
    tok_s[static_batch == 0] = r.output_tok_s;
    const std::string name = static_batch ? "static, batches of " + std::to_string(B) : "continuous (all at once)";
    std::printf("   %-34s %8lld %8.2f %14.1f %14.1f%s\n", name.c_str(), static_cast<long long>(r.steps),
                r.seconds, r.output_tok_s, r.total_tok_s, r.failed ? "  (FAILED requests!)" : "");
  }
  std::printf("   continuous / static: %.2fx output tok/s\n\n", tok_s[1] / tok_s[0]);
}

int run_lesson(const LessonOptions& opt) {
  std::printf("lesson11_continuous_batching: the scheduler (simulated), then the engine on %s (%s)\n\n",
              opt.model_dir.string().c_str(), std::string(device_name(opt.device)).c_str());
  bool pass = run_simulation();
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ModelWeights weights = ModelWeights::bind(model, opt.device);
  pass = run_engine_checks(weights) && pass;
  if (opt.bench) run_bench(weights);
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitPass : kExitFail;
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson11_continuous_batching",
                       "continuous batching: the scheduler simulated, then the engine on the model");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run_lesson(opt); });
}
