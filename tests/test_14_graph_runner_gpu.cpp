// Lesson 14 on the GPU: the graph runner. Decode steps replayed from CUDA graphs must give exactly the ids of the
// same steps launched eagerly with the same pinned decode splits (PinnedEagerLauncher): a graph replays the very
// kernels, arguments and grids it captured, so nothing may differ, not even a near-tie. Checked through lesson
// 10's Generator (batches that shrink as sequences stop, sampled and greedy) and lesson 11's Engine (contiguous
// and paged KV with prefix caching, requests arriving and leaving). The captures run in
// cudaStreamCaptureModeGlobal (common/cuda_stream.h): an allocation, a synchronisation or a handle creation
// inside a step would fail them, so these tests also prove the step is capture-safe.
// Padded buckets (engine with 100 sequences: decode steps of 65..100 replay the graphs of 80, 96 and 100, their
// extra rows padding): the same ids as the pinned eager launcher padding the same way, contiguous and paged, and
// in batch-invariant mode every request's ids equal its ids alone (a padding row that wrote into a live
// sequence's KV would change them).
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <vector>

#include "engine.h"
#include "common/device.h"
#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "generate.h"
#include "graph_runner.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CUDA>& bundled() { return testing::bundled_model<Device::CUDA>(); }
AttentionShape shape() { return AttentionShape::from_config(bundled().w.config); }

// The generator (and its launcher) dies on return: a GraphRunner's stats are copied out first (graph_stats).
std::vector<GenerateResult> generate_with(std::unique_ptr<StepLauncher> launcher, GraphRunnerStats* graph_stats,
                                          const GenerateOptions& opt) {
  Generator gen(bundled().w, Generator::limits_for(bundled().w.config, 512, 4, 256));
  const auto* runner = dynamic_cast<const GraphRunner*>(launcher.get());
  gen.context().set_launcher(std::move(launcher));
  const std::vector<std::vector<int32_t>> prompts = {{5, 6, 7, 8, 9}, {11, 12}, {20, 21, 22, 23, 24, 25, 26}};
  std::vector<GenerateResult> out = gen.generate(prompts, opt);
  if (graph_stats) {
    EXPECT_NE(runner, nullptr) << "graph stats asked of a launcher that is not a GraphRunner";
    if (runner) *graph_stats = runner->stats();
  }
  return out;
}

TEST(GraphRunner14Gpu, GeneratorGraphsEqualEager) {
  TVLLM_REQUIRE_GPU();
  for (const SamplingParams& sampling : {SamplingParams{0.0f, 0, 1.0f, 0}, SamplingParams{0.9f, 40, 0.9f, 7}}) {
    GenerateOptions opt;
    opt.sampling = sampling;
    opt.max_new_tokens = 120;  // crosses the 64 and 128 context buckets
    opt.ignore_eos = true;
    const auto eager = generate_with(std::make_unique<PinnedEagerLauncher>(shape()), nullptr, opt);
    GraphRunnerStats stats;
    const auto graphs = generate_with(std::make_unique<GraphRunner>(shape(), 8), &stats, opt);
    ASSERT_EQ(eager.size(), graphs.size());
    for (size_t b = 0; b < eager.size(); ++b) EXPECT_EQ(graphs[b].ids, eager[b].ids) << "sequence " << b;
    EXPECT_GT(stats.captures, 0);
    EXPECT_EQ(stats.replays, graphs[0].decode_steps);  // every decode step replayed
    EXPECT_EQ(stats.eager_steps, 1);                   // the prefill
  }
}

TEST(GraphRunner14Gpu, OneGraphPerBatchSizeAndBucket) {
  TVLLM_REQUIRE_GPU();
  Generator gen(bundled().w, Generator::limits_for(bundled().w.config, 512, 1, 256));
  auto owned = std::make_unique<GraphRunner>(shape(), 8);
  GraphRunner* runner = owned.get();
  gen.context().set_launcher(std::move(owned));
  GenerateOptions opt;
  opt.max_new_tokens = 200;  // contexts 4 .. 203: buckets 64, 128, 256
  opt.ignore_eos = true;
  gen.generate(std::vector<int32_t>{1, 2, 3, 4}, opt);
  const AttentionShape s = shape();
  const int sms = query_device().multiprocessors;
  std::set<int> splits;
  for (int64_t k : {64, 128, 256}) splits.insert(graph_decode_splits(s, 1, k, sms));
  EXPECT_EQ(runner->num_graphs(), splits.size());
  EXPECT_EQ(runner->stats().captures, static_cast<int64_t>(splits.size()));
  EXPECT_EQ(runner->stats().replays, 199);
  // A second generation captures nothing new.
  gen.generate(std::vector<int32_t>{9, 8, 7}, opt);
  EXPECT_EQ(runner->stats().captures, static_cast<int64_t>(splits.size()));
}

// Runs `requests` through a new engine driven by `launcher`. The engine owns its launcher and dies on return, so
// a GraphRunner's stats are copied out first (graph_stats, when the launcher is one), never read through a pointer
// into the dead engine.
EngineRunResult run_with(const EngineConfig& config, const KvFactory& kv, std::unique_ptr<StepLauncher> launcher,
                         const std::vector<CheckRequest>& requests, GraphRunnerStats* graph_stats) {
  Engine engine(bundled().w, config, kv);
  const auto* runner = dynamic_cast<const GraphRunner*>(launcher.get());
  engine.context().set_launcher(std::move(launcher));
  EngineRunResult run = run_requests(engine, requests);
  EXPECT_TRUE(run.events_ok) << run.events_error;
  EXPECT_EQ(engine.stats().kv.used_blocks(), 0);  // every block back in the pool
  if (graph_stats) {
    EXPECT_NE(runner, nullptr) << "graph stats asked of a launcher that is not a GraphRunner";
    if (runner) *graph_stats = runner->stats();
  }
  return run;
}

EngineRunResult run_engine(const KvFactory& kv, std::unique_ptr<StepLauncher> launcher,
                           GraphRunnerStats* graph_stats) {
  static const auto requests =
      make_check_requests(24, 2, 120, 1, 48, workload_id_high(bundled().w.config), 5, 0, {13});
  return run_with(testing::engine_config(64, 16, 512), kv, std::move(launcher), requests, graph_stats);
}

TEST(GraphRunner14Gpu, EngineGraphsEqualEager) {
  TVLLM_REQUIRE_GPU();
  for (const bool paged : {false, true}) {
    const KvFactory kv = paged ? paged_kv() : contiguous_kv();
    const EngineRunResult eager = run_engine(kv, std::make_unique<PinnedEagerLauncher>(shape()), nullptr);
    GraphRunnerStats stats;
    const EngineRunResult graphs = run_engine(kv, std::make_unique<GraphRunner>(shape(), 16), &stats);
    ASSERT_EQ(graphs.ids.size(), eager.ids.size());
    for (size_t i = 0; i < eager.ids.size(); ++i) EXPECT_EQ(graphs.ids[i], eager.ids[i]) << "request " << i;
    EXPECT_GT(stats.replays, 0) << (paged ? "paged" : "contiguous");
    EXPECT_GT(stats.eager_steps, 0);  // prefill and mixed steps
  }
}


// 100 requests whose outputs end one after another: decode steps of every size from 100 down to 1.
std::vector<CheckRequest> hundred_requests() {
  std::vector<CheckRequest> r = make_check_requests(100, 2, 24, 1, 8, workload_id_high(bundled().w.config), 17);
  for (size_t i = 0; i < r.size(); ++i) {
    r[i].params.max_tokens = 4 + static_cast<int64_t>(i % 67);
    r[i].params.ignore_eos = true;
  }
  return r;
}

const GraphBuckets kHundred{64, 16, 100};  // exact 1..64, then 80, 96, 100
// A budget that takes every prompt whole in the first step (100 x <= 24 tokens): no chunked prefill, so the
// batch-invariant comparison with each request alone rests on batch invariance alone.
EngineConfig hundred_config(bool batch_invariant) {
  EngineConfig config = testing::engine_config(2560, 100, 160);
  config.batch_invariant = batch_invariant;
  return config;
}

EngineRunResult run_hundred(const KvFactory& kv, std::unique_ptr<StepLauncher> launcher,
                            GraphRunnerStats* graph_stats, bool batch_invariant = false) {
  return run_with(hundred_config(batch_invariant), kv, std::move(launcher), hundred_requests(), graph_stats);
}

void expect_bucket_replays(const GraphRunnerStats& stats, const char* which) {
  int64_t above = 0;
  for (const auto& [batch, n] : stats.replays_by_batch) {
    if (batch <= 64) continue;
    EXPECT_TRUE(batch == 80 || batch == 96 || batch == 100) << which << ": a replay at " << batch << ", not a bucket";
    above += n;
  }
  const auto& by = stats.replays_by_batch;
  for (int b : {80, 96, 100}) EXPECT_TRUE(by.count(b) && by.at(b) > 0) << which << ": no replay at bucket " << b;
  EXPECT_GT(above, 0) << which;
}

TEST(GraphRunner14Gpu, PaddedBucketsEqualEager) {
  TVLLM_REQUIRE_GPU();
  for (const bool paged : {false, true}) {
    const char* which = paged ? "paged" : "contiguous";
    const KvFactory kv = paged ? paged_kv() : contiguous_kv();
    const EngineRunResult eager = run_hundred(kv, std::make_unique<PinnedEagerLauncher>(shape(), kHundred), nullptr);
    GraphRunnerStats stats;
    const EngineRunResult graphs = run_hundred(kv, std::make_unique<GraphRunner>(shape(), kHundred), &stats);
    ASSERT_EQ(graphs.ids.size(), eager.ids.size());
    for (size_t i = 0; i < eager.ids.size(); ++i) EXPECT_EQ(graphs.ids[i], eager.ids[i]) << which << " request " << i;
    expect_bucket_replays(stats, which);
  }
}

TEST(GraphRunner14Gpu, PaddingRowsWriteNoLiveKv) {
  TVLLM_REQUIRE_GPU();
  // Batch-invariant mode: a request's ids are the same bits whatever runs beside it, padding rows included; so
  // any difference from the request alone is a padding row that wrote into (or was read by) a live sequence.
  const std::vector<CheckRequest> requests = hundred_requests();
  for (const bool paged : {false, true}) {
    const char* which = paged ? "paged" : "contiguous";
    const KvFactory kv = paged ? paged_kv() : contiguous_kv();
    GraphRunnerStats stats;
    const EngineRunResult together = run_hundred(kv, std::make_unique<GraphRunner>(shape(), kHundred), &stats, true);
    expect_bucket_replays(stats, which);
    Engine alone(bundled().w, hundred_config(true), kv);
    alone.context().set_launcher(std::make_unique<GraphRunner>(shape(), kHundred));
    for (size_t i = 0; i < requests.size(); i += 7) {  // 15 requests, short and long ones
      const EngineRunResult one = run_requests(alone, {requests[i]});
      ASSERT_EQ(one.ids.size(), 1u);
      EXPECT_EQ(together.ids[i], one.ids[0]) << which << " request " << i;
    }
    EXPECT_EQ(alone.stats().kv.used_blocks(), 0) << which;
  }
}

TEST(GraphRunner14Gpu, AsyncSchedulingGivesTheSynchronousIds) {
  TVLLM_REQUIRE_GPU();
  // Async scheduling (EngineConfig::async_scheduling) through graphs and padded buckets. Its steps hold other mixes
  // than the synchronous engine's (a finished sequence frees its KV one step later; a request that stops at a stop
  // id decodes once more), so the comparison is made in batch-invariant mode, where a request's ids do not depend on
  // its neighbours: every request must give exactly the synchronous engine's ids. The token each decode feeds is
  // filled in on the device (pending_tokens.h) between the graph replays; a wrong one would change the ids.
  std::vector<CheckRequest> requests = hundred_requests();
  for (size_t i = 0; i < requests.size(); i += 3) {
    requests[i].params.ignore_eos = false;
    requests[i].params.stop_ids = {13};
  }
  for (const bool paged : {false, true}) {
    const char* which = paged ? "paged" : "contiguous";
    const KvFactory kv = paged ? paged_kv() : contiguous_kv();
    EngineConfig sync_config = hundred_config(true), async_config = hundred_config(true);
    async_config.async_scheduling = true;
    const EngineRunResult sync =
        run_with(sync_config, kv, std::make_unique<GraphRunner>(shape(), kHundred), requests, nullptr);
    GraphRunnerStats stats;
    const EngineRunResult async =
        run_with(async_config, kv, std::make_unique<GraphRunner>(shape(), kHundred), requests, &stats);
    ASSERT_EQ(async.ids.size(), sync.ids.size());
    for (size_t i = 0; i < sync.ids.size(); ++i) EXPECT_EQ(async.ids[i], sync.ids[i]) << which << " request " << i;
    expect_bucket_replays(stats, which);
  }
}

}  // namespace
}  // namespace tvllm
