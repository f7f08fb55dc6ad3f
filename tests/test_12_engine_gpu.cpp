// Lesson 12 on the GPU: the engine over the paged pool in bf16 on the bundled model. 64 concurrent greedy requests
// against lesson 10's Generator alone, with the rule of engine_check.h (by default exact matches counted and
// printed, teacher-forced agreement required; batch-invariant: exact equality required): without prefix caching,
// with it on a shared-prefix workload, with a pool so small that sequences are preempted; a pool sized from the
// free memory; a paged decode step captured in a CUDA graph. After every test every block is back in the pool.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "common/errors.h"
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

const testing::BundledModel<Device::CUDA>& bundled() { return testing::bundled_model<Device::CUDA>(); }

constexpr int64_t kMaxContext = 512;
const std::vector<int32_t> kStopIds = {13};  // test_11_engine.cpp says why

EngineConfig config(int64_t budget, int64_t max_sequences) {
  return testing::engine_config(budget, max_sequences, kMaxContext);
}

KvFactory paged(int64_t num_blocks, bool prefix_caching) {
  PagedKvOptions o;
  o.num_blocks = num_blocks;
  o.block_size = 16;
  o.prefix_caching = prefix_caching;
  return paged_kv(o);
}

const std::vector<CheckRequest>& mixed() {
  static const auto r = make_check_requests(64, 2, 200, 1, 64, workload_id_high(bundled().w.config), 31, 0, kStopIds);
  return r;
}
const AloneResults& mixed_alone() {
  static const AloneResults a = run_alone(bundled().w, mixed(), kMaxContext);
  return a;
}
// A 100-token system prompt (6 full blocks) + 1..60 tokens of each request's own.
const std::vector<CheckRequest>& shared() {
  static const auto r = make_check_requests(64, 1, 60, 1, 48, workload_id_high(bundled().w.config), 32, 100, kStopIds);
  return r;
}
const AloneResults& shared_alone() {
  static const AloneResults a = run_alone(bundled().w, shared(), kMaxContext);
  return a;
}
// The same, with the Generator batch-invariant: what EngineConfig::batch_invariant runs must equal exactly.
const AloneResults& mixed_alone_invariant() {
  static const AloneResults a = run_alone(bundled().w, mixed(), kMaxContext, true);
  return a;
}
const AloneResults& shared_alone_invariant() {
  static const AloneResults a = run_alone(bundled().w, shared(), kMaxContext, true);
  return a;
}
EngineConfig invariant(EngineConfig c) {
  c.batch_invariant = true;
  return c;
}

struct Outcome {
  EngineRunResult run;
  EngineStats stats;
};

Outcome run_case(const char* name, const std::vector<CheckRequest>& requests, const AloneResults& alone,
                 const EngineConfig& c, const KvFactory& kv) {
  Engine engine(bundled().w, c, kv);
  Outcome o;
  o.run = run_requests(engine, requests);
  EXPECT_TRUE(o.run.events_ok) << o.run.events_error;
  const AloneCheck check = check_against_alone(bundled().w, requests, o.run, alone, kMaxContext);
  EXPECT_TRUE(check.pass()) << check.summary();
  if (c.batch_invariant) {
    EXPECT_EQ(check.exact, check.requests) << check.summary();
  }
  o.stats = engine.stats();
  std::printf("%s: %s; %lld preemptions, prefix hits %lld/%lld tokens\n", name, check.summary().c_str(),
              static_cast<long long>(o.stats.preemptions), static_cast<long long>(o.stats.kv.prefix_hit_tokens),
              static_cast<long long>(o.stats.kv.prefix_query_tokens));
  ::testing::Test::RecordProperty(std::string(name) + "_exact", check.exact);
  const KvUsage u = engine.kv().usage();
  EXPECT_EQ(u.free_blocks, u.total_blocks);
  return o;
}

TEST(Engine12Gpu, PagedEqualsAloneWithoutPrefixCaching) {
  TVLLM_REQUIRE_GPU();
  const Outcome paged_run = run_case("paged", mixed(), mixed_alone(), config(1024, 32), paged(32 * 32, false));
  // Paged vs contiguous: both bf16 with the same GEMM shapes step by step; count the equal ones.
  Engine contiguous(bundled().w, config(1024, 32), contiguous_kv(32));
  const EngineRunResult c = run_requests(contiguous, mixed());
  int equal = 0;
  for (size_t i = 0; i < mixed().size(); ++i) equal += c.ids[i] == paged_run.run.ids[i];
  std::printf("paged == contiguous: %d/64 requests id for id\n", equal);
}

TEST(Engine12Gpu, PrefixCachingOnASharedPrefixEqualsAlone) {
  TVLLM_REQUIRE_GPU();
  const Outcome on = run_case("prefix caching on", shared(), shared_alone(), config(1024, 16), paged(16 * 32, true));
  EXPECT_GT(on.stats.kv.prefix_hit_tokens, 0);
  run_case("prefix caching off", shared(), shared_alone(), config(1024, 16), paged(16 * 32, false));
  run_case("prefix caching, chunked (budget 64)", shared(), shared_alone(), config(64, 16), paged(16 * 32, true));
}

TEST(Engine12Gpu, ASmallPoolPreemptsAndOutputsStayEqual) {
  TVLLM_REQUIRE_GPU();
  // 40 blocks of 16 for 16 sequences of up to 264 tokens.
  const Outcome o = run_case("pool of 40 blocks", mixed(), mixed_alone(), config(512, 16), paged(40, true));
  EXPECT_GT(o.stats.preemptions, 0);
}

TEST(Engine12Gpu, BatchInvariantPagedEqualsAloneExactly) {
  TVLLM_REQUIRE_GPU();
  run_case("batch-invariant, paged", mixed(), mixed_alone_invariant(), invariant(config(1024, 32)),
           paged(32 * 32, false));
  const Outcome on = run_case("batch-invariant, prefix caching on", shared(), shared_alone_invariant(),
                              invariant(config(1024, 16)), paged(16 * 32, true));
  EXPECT_GT(on.stats.kv.prefix_hit_tokens, 0);
  run_case("batch-invariant, prefix caching, chunked (budget 64)", shared(), shared_alone_invariant(),
           invariant(config(64, 16)), paged(16 * 32, true));
  const Outcome small = run_case("batch-invariant, pool of 40 blocks", mixed(), mixed_alone_invariant(),
                                 invariant(config(512, 16)), paged(40, true));
  EXPECT_GT(small.stats.preemptions, 0);
}

TEST(Engine12Gpu, APoolSizedFromTheFreeMemory) {
  TVLLM_REQUIRE_GPU();
  PagedKvOptions o;
  o.budget.fraction = 0.05;  // a slice: other tests share the GPU
  Engine engine(bundled().w, config(1024, 32), paged_kv(o));
  std::printf("%s\n", engine.kv().describe().c_str());
  EXPECT_GT(engine.kv().usage().total_blocks, 1000);
  const EngineRunResult run = run_requests(engine, mixed());
  const AloneCheck check = check_against_alone(bundled().w, mixed(), run, mixed_alone(), kMaxContext);
  EXPECT_TRUE(check.pass()) << check.summary();
  EXPECT_EQ(engine.kv().usage().free_blocks, engine.kv().usage().total_blocks);
}

TEST(Engine12Gpu, APagedDecodeStepReplaysInACudaGraph) {
  TVLLM_REQUIRE_GPU();
  Engine engine(bundled().w, config(256, 8), paged(64, true));
  RequestParams p;
  p.sampling = SamplingParams{0.0f, 0, 1.0f, 0};
  p.max_tokens = 40;
  p.ignore_eos = true;
  for (int i = 0; i < 4; ++i)
    engine.submit(std::vector<int32_t>(static_cast<size_t>(20 + 7 * i), 5 + i), p, [](const EngineEvent&) {});
  engine.step();
  engine.step();
  const ScheduledBatch batch = engine.scheduler().schedule();
  ASSERT_EQ(batch.num_decodes(), 4);
  const int64_t rows = engine.prepare_step(batch);
  engine.launch_step();
  const std::vector<int32_t> eager = engine.fetch_ids(rows);
  const cudaStream_t stream = engine.context().stream();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TVLLM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  engine.launch_step();
  TVLLM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  TVLLM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  TVLLM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  EXPECT_EQ(engine.fetch_ids(rows), eager);
  TVLLM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TVLLM_CUDA_CHECK(cudaGraphDestroy(graph));
  engine.scheduler().postprocess(batch, eager);
  for (int64_t id = 0; id < 4; ++id) engine.abort(id);
  engine.run_until_idle();
  EXPECT_EQ(engine.kv().usage().free_blocks, 64);
}

}  // namespace
}  // namespace tvllm
