// lesson12_paged_attention: the block manager, simulated on the CPU. (The paged KV-write and attention kernels,
// and the engine that runs them on the model, come with the rest of the lesson; this executable needs no model
// and no GPU.)
//
//   build/bin/lesson12_paged_attention [--device auto|cpu|cuda]
//
//   1. memory: 64 requests of mixed lengths, the same KV memory (4096 positions) as a contiguous cache of 8 slots
//      x 512 and as a pool of 256 blocks x 16: positions reserved vs used, sequences at once, steps
//   2. prefix caching: 64 requests that share a 128-token system prompt, with and without the prefix cache:
//      prompt tokens fed, the hit rate, steps
//   3. a pool so small that sequences are preempted (recomputed later)
//   Every run checks that each request's ids equal what it gives alone and that every block is back in the pool
//   at the end (PASS/FAIL).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "block_manager.h"
#include "common/lesson.h"
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

int run_lesson(const LessonOptions&) {
  std::printf("lesson12_paged_attention: the block manager on the CPU (a fake model; the kernels come later)\n\n");
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

  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitPass : kExitFail;
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson12_paged_attention",
                       "paged attention: the block manager, simulated on the CPU with a fake model");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run_lesson(opt); });
}
