// lesson11_continuous_batching: the scheduler, simulated on the CPU. (The engine that runs it on the model, and
// its GPU step, come with the rest of the lesson; this executable needs no model and no GPU.)
//
//   build/bin/lesson11_continuous_batching [--device auto|cpu|cuda]
//
//   64 requests of mixed prompt and output lengths through the scheduler over a contiguous cache of 8 slots
//   (lesson 10's KvCache as a SlotAllocator) and the fake model of simulate.h, twice:
//     static       8 requests at a time; the next 8 start when the slowest of the batch has finished
//     continuous   all 64 submitted at once; a slot is refilled the step after its request finishes
//   It prints steps, tokens per step and slot use for both, the first steps of each as a timeline, and checks
//   that every request's ids equal what it gives alone (PASS/FAIL).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/lesson.h"
#include "kv_allocator.h"
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

int run_lesson(const LessonOptions&) {
  std::printf("lesson11_continuous_batching: the scheduler on the CPU (a fake model; the engine comes later)\n");
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
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitPass : kExitFail;
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson11_continuous_batching",
                       "continuous batching: the scheduler, simulated on the CPU with a fake model");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run_lesson(opt); });
}
