// Lesson 12 on the CPU: the engine over the paged KV pool (PagedKv: PagedKvPool + BlockManager + PagedAttention)
// on the bundled model. 64 concurrent greedy requests give exactly the ids each gives alone (lesson 10's
// Generator) and the same ids as the contiguous cache - without prefix caching, with it on a shared-prefix
// workload (hits asserted), with chunked prefill under a small budget, and with a pool so small that sequences
// are preempted and recomputed (asserted). Aborting a running request returns its blocks at once; after every
// test every block is back in the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "engine.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "model_dir.h"
#include "model_weights.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CPU>& bundled() { return testing::bundled_model<Device::CPU>(); }

constexpr int64_t kMaxContext = 128;
const std::vector<int32_t> kStopIds = {13};  // test_11_engine.cpp says why

EngineConfig config(int64_t budget, int64_t max_sequences) {
  return testing::engine_config(budget, max_sequences, kMaxContext);
}

KvFactory paged(int64_t num_blocks, bool prefix_caching, int64_t block_size = 16) {
  PagedKvOptions o;
  o.num_blocks = num_blocks;
  o.block_size = block_size;
  o.prefix_caching = prefix_caching;
  return paged_kv(o);
}

std::vector<CheckRequest> mixed_requests(int n = 64, uint64_t seed = 11) {
  return make_check_requests(n, 2, 32, 1, 24, workload_id_high(bundled().w.config), seed, 0, kStopIds);
}
// A 36-token "system prompt" (two full blocks of 16 to share) + 1..16 tokens of each request's own.
std::vector<CheckRequest> shared_prefix_requests(uint64_t seed) {
  return make_check_requests(64, 1, 16, 1, 16, workload_id_high(bundled().w.config), seed, 36, kStopIds);
}

void expect_all_free(Engine& engine) {
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);
  EXPECT_FALSE(engine.has_work());
}

// The two workloads and their alone results, computed once.
const std::vector<CheckRequest>& mixed() {
  static const auto r = mixed_requests();
  return r;
}
const AloneResults& mixed_alone() {
  static const AloneResults a = run_alone(bundled().w, mixed(), kMaxContext);
  return a;
}
const std::vector<CheckRequest>& shared() {
  static const auto r = shared_prefix_requests(21);
  return r;
}
const AloneResults& shared_alone() {
  static const AloneResults a = run_alone(bundled().w, shared(), kMaxContext);
  return a;
}

struct Outcome {
  EngineRunResult run;
  AloneCheck check;
  EngineStats stats;
};

// Runs the requests through a fresh engine and checks them against the Generator alone.
Outcome run_and_check(const std::vector<CheckRequest>& requests, const EngineConfig& c, const KvFactory& kv,
                      const AloneResults& alone) {
  Engine engine(bundled().w, c, kv);
  Outcome o;
  o.run = run_requests(engine, requests);
  EXPECT_TRUE(o.run.events_ok) << o.run.events_error;
  o.check = check_against_alone(bundled().w, requests, o.run, alone, kMaxContext);
  EXPECT_TRUE(o.check.pass()) << o.check.summary();
  o.stats = engine.stats();
  expect_all_free(engine);
  return o;
}

TEST(Engine12, PagedEqualsAloneAndContiguous) {
  const auto& requests = mixed();
  const AloneResults& alone = mixed_alone();
  const Outcome paged_run = run_and_check(requests, config(512, 32), paged(32 * 8, false), alone);
  EXPECT_EQ(paged_run.check.exact, 64);
  EXPECT_EQ(paged_run.stats.kv.kind, "paged");
  EXPECT_EQ(paged_run.stats.kv.prefix_hit_tokens, 0);
  EXPECT_EQ(paged_run.stats.preemptions, 0);
  EXPECT_EQ(paged_run.stats.peak_running, 32);
  const Outcome contiguous = run_and_check(requests, config(512, 32), contiguous_kv(32), alone);
  for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(paged_run.run.ids[i], contiguous.run.ids[i]) << i;
  std::printf("paged, no prefix cache: %s\n", paged_run.check.summary().c_str());
}

TEST(Engine12, PrefixCachingOnASharedPrefixEqualsAlone) {
  // 16 sequences at a time: those admitted after the first wave find the prefix published.
  const auto& requests = shared();
  const AloneResults& alone = shared_alone();
  const Outcome on = run_and_check(requests, config(512, 16), paged(16 * 8, true), alone);
  EXPECT_GT(on.stats.kv.prefix_hit_tokens, 0);
  int with_hits = 0;
  for (const RequestUsage& u : on.run.usage) {
    with_hits += u.cached_tokens > 0;
    EXPECT_TRUE(u.cached_tokens == 0 || u.cached_tokens == 32) << u.cached_tokens;  // two full blocks
  }
  EXPECT_GE(with_hits, 48);
  const Outcome off = run_and_check(requests, config(512, 16), paged(16 * 8, false), alone);
  EXPECT_EQ(off.stats.kv.prefix_hit_tokens, 0);
  EXPECT_LT(on.stats.prefill_tokens, off.stats.prefill_tokens - 48 * 32 + 1);  // the hits were not fed
  for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(on.run.ids[i], off.run.ids[i]) << i;
  std::printf("prefix caching: %lld of %lld prompt tokens hit, %d requests with hits; %s\n",
              static_cast<long long>(on.stats.kv.prefix_hit_tokens),
              static_cast<long long>(on.stats.kv.prefix_query_tokens), with_hits, on.check.summary().c_str());
}

TEST(Engine12, ChunkedPrefillWithPrefixCachingEqualsAlone) {
  // A budget of 16: prompts (and the prefix's blocks) arrive in chunks; a hit skips whole chunks.
  const Outcome o = run_and_check(shared(), config(16, 8), paged(8 * 8, true), shared_alone());
  EXPECT_GT(o.stats.kv.prefix_hit_tokens, 0);
}

TEST(Engine12, ASmallPoolPreemptsAndOutputsStayEqual) {
  // 20 blocks of 8 positions for up to 16 sequences of up to 56 tokens (7 blocks): the pool runs out, the newest
  // sequences are preempted and recomputed later. With and without prefix caching.
  for (const bool caching : {false, true}) {
    const Outcome o = run_and_check(mixed(), config(256, 16), paged(20, caching, 8), mixed_alone());
    EXPECT_GT(o.stats.preemptions, 0) << "caching " << caching;
    std::printf("pool of 20 blocks x 8, prefix caching %s: %lld preemptions, %s\n", caching ? "on" : "off",
                static_cast<long long>(o.stats.preemptions), o.check.summary().c_str());
  }
}

TEST(Engine12, BatchInvariantModeWithPreemptionEqualsAlone) {
  // EngineConfig::batch_invariant on the CPU: every attention through the prefill reference; still exact, with a
  // pool small enough to preempt and prefix caching on (the GPU suite is where the mode matters).
  static const AloneResults alone = run_alone(bundled().w, mixed(), kMaxContext, /*batch_invariant=*/true);
  EngineConfig c = config(256, 16);
  c.batch_invariant = true;
  const Outcome o = run_and_check(mixed(), c, paged(20, true, 8), alone);
  EXPECT_TRUE(o.check.exact_required);
  EXPECT_EQ(o.check.exact, 64);
  EXPECT_GT(o.stats.preemptions, 0);
}

TEST(Engine12, AsyncSchedulingWithPrefixCachingAndPreemptionEqualsAlone) {
  // Lesson 14's async scheduling over the paged pool: blocks published before the step's ids are back, preempted
  // sequences whose id is in flight, prefix hits. The same ids as alone, every block back in the pool.
  for (const bool caching : {false, true}) {
    EngineConfig c = config(256, 16);
    c.async_scheduling = true;
    const Outcome o = run_and_check(mixed(), c, paged(20, caching, 8), mixed_alone());
    EXPECT_GT(o.stats.preemptions, 0) << "caching " << caching;
    EXPECT_EQ(o.check.exact, 64);
  }
  EngineConfig c = config(512, 16);
  c.async_scheduling = true;
  const Outcome shared_prefix = run_and_check(shared(), c, paged(16 * 8, true), shared_alone());
  EXPECT_GT(shared_prefix.stats.kv.prefix_hit_tokens, 0);
}

TEST(Engine12, AbortReturnsTheBlocksAtOnce) {
  Engine engine(bundled().w, config(256, 4), paged(40, false));
  EventQueue a, b;
  RequestParams p;
  p.sampling = SamplingParams{0.0f, 0, 1.0f, 0};
  p.max_tokens = 60;
  p.ignore_eos = true;
  const int64_t ia = engine.submit(std::vector<int32_t>(40, 7), p, a.sink());  // 40 + 1 tokens: 3 blocks of 16
  engine.submit(std::vector<int32_t>(10, 8), p, b.sink());                     // 11 tokens: 1 block
  engine.step();
  engine.step();
  EXPECT_EQ(engine.kv().usage().used_blocks(), 4);
  engine.abort(ia);
  engine.process_inbox();
  EXPECT_EQ(engine.kv().usage().used_blocks(), 1);  // before any further step
  std::optional<EngineEvent> e, last;
  while ((e = a.try_pop())) last = e;
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->reason, FinishReason::Abort);
  EXPECT_EQ(last->usage.completion_tokens, 2);
  engine.run_until_idle();
  expect_all_free(engine);
}

}  // namespace
}  // namespace tvllm
