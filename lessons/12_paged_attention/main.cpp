// lesson12_paged_attention: the block manager simulated on the CPU, then the engine over the paged pool on the
// real model.
//
//   build/bin/lesson12_paged_attention [--model DIR] [--device auto|cpu|cuda] [--bench]
//
//   The simulation (a fake model, simulate.h):
//   1. memory: 64 requests of mixed lengths, the same KV memory (4096 positions) as a contiguous cache of 8 slots
//      x 512 and as a pool of 256 blocks x 16: positions reserved vs used, sequences at once, steps
//   2. prefix caching: 64 requests that share a 128-token system prompt, with and without the prefix cache:
//      prompt tokens fed, the hit rate, steps
//   3. a pool so small that sequences are preempted (recomputed later)
//   Every run checks that each request's ids equal what it gives alone and that every block is back in the pool
//   at the end (PASS/FAIL).
//   4. The engine (lesson 11) over the paged pool on the model, on the device: 64 concurrent greedy requests
//      against lesson 10's Generator alone (engine_check.h) - paged without prefix caching, the contiguous cache
//      on the same requests (paged == contiguous), a shared 100-token system prompt with the prefix cache on
//      and off (hit rate), a pool so small that sequences are preempted; every block back at the end.
//   5. --bench (CUDA): the paged decode attention kernel at batch 64 and 2k context on the model's shape
//      (bench_paged_decode: achieved GB/s as % of the measured copy bandwidth, beside the contiguous kernel).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "block_manager.h"
#include "common/lesson.h"
#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "model_dir.h"
#include "model_weights.h"
#include "common/random.h"
#include "kv_allocator.h"
#include "scheduler.h"
#include "simulate.h"

namespace tvllm {
namespace {

constexpr int32_t kVocab = 50;
constexpr int64_t kMaxContext = 512;

struct Result {
  int64_t steps = 0, prompt_tokens_fed = 0, preemptions = 0, peak_running = 0;
  double reserved = 0, used = 0;  // position-steps: held by the cache vs holding a token
  bool equal = true, all_free = true;
  double hit_rate = 0;
};

Result run(const std::vector<SimRequest>& requests, KvAllocator& alloc, int64_t max_sequences,
           const std::function<int64_t()>& reserved_positions, const std::function<bool()>& all_free,
           size_t submit_first = 0) {
  SchedulerConfig config;
  config.max_tokens_per_step = 256;
  config.max_sequences = max_sequences;
  config.max_context = kMaxContext;
  config.eos_ids = {0};
  Scheduler scheduler(config, alloc);
  FakeModel model(alloc.num_kv_slots(), kVocab);
  Result r;
  std::vector<int64_t> ids;
  const auto on_step = [&](const ScheduledBatch& batch) {
    r.reserved += static_cast<double>(reserved_positions());
    for (const Sequence* s : scheduler.running()) r.used += static_cast<double>(s->num_computed);
    for (const ScheduledSequence& s : batch.seqs) r.used += static_cast<double>(s.q_len);
    r.peak_running = std::max(r.peak_running, scheduler.num_running());
  };
  // submit_first > 0: those requests first, alone until they finish (they warm the prefix cache)
  const size_t first = std::min(submit_first, requests.size());
  for (size_t i = 0; i < first; ++i) ids.push_back(scheduler.add(requests[i].prompt, requests[i].params));
  if (first > 0) r.steps += run_until_idle(scheduler, model, on_step);
  for (size_t i = first; i < requests.size(); ++i) ids.push_back(scheduler.add(requests[i].prompt, requests[i].params));
  r.steps += run_until_idle(scheduler, model, on_step);
  for (size_t i = 0; i < requests.size(); ++i)
    r.equal = r.equal && scheduler.find(ids[i])->output == reference_output(requests[i].prompt, requests[i].params,
                                                                            config.eos_ids, kMaxContext, kVocab);
  r.prompt_tokens_fed = scheduler.stats().prefill_tokens;
  r.preemptions = scheduler.stats().preemptions;
  r.all_free = all_free();
  return r;
}

const char* verdict(const Result& r) { return r.equal && r.all_free ? "PASS" : "FAIL"; }

bool run_simulation() {
  std::printf("the block manager on the CPU, with a fake model (simulate.h)\n\n");
  bool pass = true;

  // 1. The same memory, contiguous vs paged.
  const std::vector<SimRequest> mixed = make_workload(64, 8, 200, 1, 120, kVocab, 0);
  SlotAllocator slots(8, kMaxContext);
  const Result contiguous = run(
      mixed, slots, 64, [&] { return (8 - slots.free_slots()) * kMaxContext; },
      [&] { return slots.free_slots() == 8; });
  BlockManagerConfig bc;
  bc.num_blocks = 256;
  bc.block_size = 16;
  bc.max_context = kMaxContext;
  BlockManager blocks(bc);
  const Result paged = run(
      mixed, blocks, 64, [&] { return blocks.used_blocks() * blocks.block_size(); },
      [&] { return blocks.free_blocks() == blocks.num_blocks(); });
  std::printf("1. the same KV memory (4096 positions), 64 requests: prompts 8..200, max_tokens 1..120, seed 0\n");
  std::printf("   %-26s %8s %12s %6s %11s  %s\n", "cache", "wasted", "at once max", "steps", "preemptions",
              "ids == alone, all free");
  for (const auto& [name, r] :
       {std::pair{"contiguous 8 x 512", &contiguous}, std::pair{"paged 256 blocks x 16", &paged}}) {
    std::printf("   %-26s %7.1f%% %12lld %6lld %11lld  %s\n", name, 100.0 * (1.0 - r->used / r->reserved),
                static_cast<long long>(r->peak_running), static_cast<long long>(r->steps),
                static_cast<long long>(r->preemptions), verdict(*r));
    pass = pass && r->equal && r->all_free;
  }
  std::printf("   (wasted: positions the cache held for running sequences but no token used, over all steps)\n\n");

  // 2. A shared system prompt, with and without the prefix cache. The first request runs alone first, so its
  //    blocks are published before the others arrive.
  Rng rng(1);
  std::vector<int32_t> system(128);
  for (int32_t& t : system) t = static_cast<int32_t>(1 + rng.below(kVocab - 1));
  std::vector<SimRequest> shared = make_workload(64, 16, 64, 1, 60, kVocab, 2);
  for (SimRequest& r : shared) r.prompt.insert(r.prompt.begin(), system.begin(), system.end());
  int64_t prompt_tokens = 0;
  for (const SimRequest& r : shared) prompt_tokens += static_cast<int64_t>(r.prompt.size());
  std::printf(
      "2. prefix caching: 64 requests = a 128-token system prompt + 16..64 tokens of their own (%lld prompt "
      "tokens)\n",
      static_cast<long long>(prompt_tokens));
  std::printf("   %-26s %12s %9s %6s  %s\n", "prefix cache", "prompt fed", "hit rate", "steps",
              "ids == alone, all free");
  for (const bool caching : {false, true}) {
    BlockManagerConfig c;
    c.num_blocks = 512;
    c.max_context = kMaxContext;
    c.prefix_caching = caching;
    BlockManager bm(c);
    Result r = run(
        shared, bm, 64, [&] { return bm.used_blocks() * bm.block_size(); },
        [&] { return bm.free_blocks() == bm.num_blocks(); }, 1);
    std::printf("   %-26s %12lld %8.1f%% %6lld  %s\n", caching ? "on" : "off",
                static_cast<long long>(r.prompt_tokens_fed), 100.0 * bm.stats().hit_rate(),
                static_cast<long long>(r.steps), verdict(r));
    pass = pass && r.equal && r.all_free;
  }
  std::printf(
      "   (prompt fed: prefill tokens; expected hit rate 63 x 128 / %lld = %.1f%%: all but the first find the system "
      "prompt)\n\n",
      static_cast<long long>(prompt_tokens), 100.0 * 63 * 128 / static_cast<double>(prompt_tokens));

  // 3. Too little memory: preemption by recomputation.
  BlockManagerConfig small;
  small.num_blocks = 48;
  small.max_context = kMaxContext;
  BlockManager tiny(small);
  const Result pre = run(
      mixed, tiny, 64, [&] { return tiny.used_blocks() * tiny.block_size(); },
      [&] { return tiny.free_blocks() == tiny.num_blocks(); });
  std::printf(
      "3. a pool of 48 blocks x 16 for the same 64 requests: %lld preemptions, %lld steps, ids == alone and "
      "all blocks free: %s\n\n",
      static_cast<long long>(pre.preemptions), static_cast<long long>(pre.steps), verdict(pre));
  pass = pass && pre.equal && pre.all_free && pre.preemptions > 0;
  return pass;
}

KvFactory paged(int64_t num_blocks, bool prefix_caching) {
  PagedKvOptions o;
  o.num_blocks = num_blocks;
  o.block_size = 16;
  o.prefix_caching = prefix_caching;
  return paged_kv(o);
}

bool run_engine_checks(const ModelWeights& w) {
  const bool gpu = w.device == Device::CUDA;
  // CPU: a lighter workload (the fp32 reference computes every token in double-accumulated loops).
  const int64_t max_prompt = gpu ? 200 : 32, max_output = gpu ? 64 : 24, max_context = gpu ? 512 : 128;
  const int64_t system = gpu ? 100 : 36, blocks_per_seq = max_context / 16;
  const int32_t id_high = workload_id_high(w.config);
  const auto mixed = make_check_requests(64, 2, max_prompt, 1, max_output, id_high, 11);
  const auto shared = make_check_requests(64, 1, max_prompt / 2, 1, max_output, id_high, 12, system);
  std::printf("4. the engine over the paged pool on the model (%s): 64 concurrent greedy requests, prompts 2..%lld, "
              "max_tokens 1..%lld; blocks of 16\n",
              gpu ? "CUDA, bf16" : "CPU, fp32", static_cast<long long>(max_prompt),
              static_cast<long long>(max_output));
  const AloneResults mixed_alone = run_alone(w, mixed, max_context);
  const AloneResults shared_alone = run_alone(w, shared, max_context);
  EngineConfig c;
  c.max_context = max_context;
  c.max_sequences = 32;
  c.max_tokens_per_step = 1024;
  print_engine_case_header();
  bool pass = true;
  const auto show = [&](const std::string& name, const EngineCaseResult& r) {
    print_engine_case(name, r);
    pass = pass && r.pass();
  };
  const EngineCaseResult paged_run = run_engine_case(w, c, paged(32 * blocks_per_seq, false), mixed, mixed_alone);
  show("paged, no prefix cache", paged_run);
  const EngineCaseResult contiguous = run_engine_case(w, c, contiguous_kv(32), mixed, mixed_alone);
  show("contiguous, 32 slots", contiguous);
  int same = 0;
  for (size_t i = 0; i < mixed.size(); ++i) same += paged_run.ids[i] == contiguous.ids[i];
  std::printf("   paged == contiguous: %d/64 requests id for id%s\n", same,
              gpu ? " (bf16: the same rule as == alone)" : "");
  if (!gpu && same != 64) pass = false;
  c.max_sequences = 16;
  const std::string sys = std::to_string(system) + "-token system prompt";
  const EngineCaseResult on = run_engine_case(w, c, paged(16 * blocks_per_seq, true), shared, shared_alone);
  show(sys + ", prefix cache on", on);
  show(sys + ", prefix cache off", run_engine_case(w, c, paged(16 * blocks_per_seq, false), shared, shared_alone));
  const EngineCaseResult small = run_engine_case(w, c, paged(2 * blocks_per_seq, true), mixed, mixed_alone);
  show("a pool of " + std::to_string(2 * blocks_per_seq) + " blocks", small);
  if (small.stats.preemptions == 0) {
    std::printf("      expected preemptions in the small pool: none happened\n");
    pass = false;
  }
  if (gpu) {  // the same small pool, batch-invariant: preempted and recomputed, still exactly equal (lesson 11)
    EngineConfig ci = c;
    ci.batch_invariant = true;
    const EngineCaseResult invariant = run_engine_case(w, ci, paged(2 * blocks_per_seq, true), mixed,
                                                       run_alone(w, mixed, max_context, /*batch_invariant=*/true));
    show("batch-invariant, a pool of " + std::to_string(2 * blocks_per_seq) + " blocks", invariant);
    if (invariant.stats.preemptions == 0) {
      std::printf("      expected preemptions in the small pool: none happened\n");
      pass = false;
    }
  }
  if (on.stats.kv.prefix_hit_tokens == 0) {
    std::printf("      expected prefix-cache hits: none happened\n");
    pass = false;
  }
  std::printf("   prefix cache: %.1f%% of the prompt tokens were hits\n",
              100.0 * static_cast<double>(on.stats.kv.prefix_hit_tokens) /
                  static_cast<double>(std::max<int64_t>(1, on.stats.kv.prefix_query_tokens)));
  std::printf("   (ids == alone: lesson 10's Generator running each request alone; %s)\n\n",
              gpu ? "bf16: exact matches counted, teacher-forced agreement required (engine_check.h); "
                    "batch-invariant: exact, id for id"
                  : "fp32: exact, id for id");
  return pass;
}

int run_lesson(const LessonOptions& opt) {
  std::printf("lesson12_paged_attention: the block manager (simulated), then the engine over the paged pool on %s "
              "(%s)\n\n",
              opt.model_dir.string().c_str(), std::string(device_name(opt.device)).c_str());
  bool pass = run_simulation();
  const ModelDir model = ModelDir::open(opt.model_dir);
  const ModelWeights weights = ModelWeights::bind(model, opt.device);
  pass = run_engine_checks(weights) && pass;
  if (opt.bench) {
    if (opt.device == Device::CUDA) {
      std::printf("5. --bench: paged decode attention, batch 64, context 2048, blocks of 16, %lld layers\n",
                  static_cast<long long>(weights.config.num_hidden_layers));
      bench_paged_decode(AttentionShape::from_config(weights.config), weights.config.num_hidden_layers, 64, 2048, 16,
                         std::cout);
    } else {
      std::printf("5. --bench: the paged decode kernel needs a GPU (--device cuda)\n");
    }
  }
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitPass : kExitFail;
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson12_paged_attention",
                       "paged attention: the block manager simulated, then the engine over the paged pool");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run_lesson(opt); });
}
