// Lesson 14, CPU: the graph runner's host-side rules (which steps are decode steps, the context buckets, the
// split choice per bucket, the padded batch buckets), that on the CPU every step runs eagerly, and the engine's
// padding of decode steps: what the padded StepInputs hold, and that padding changes no real request's ids.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "engine_bench.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "fast_path.h"
#include "generate.h"
#include "graph_runner.h"
#include "kv_cache.h"
#include "testing/engine_fixture.h"

namespace tvllm {
namespace {

TEST(GraphRunner14, KeyAndBucketRules) {
  EXPECT_EQ(context_bucket(1), 64);
  EXPECT_EQ(context_bucket(64), 64);
  EXPECT_EQ(context_bucket(65), 128);
  EXPECT_EQ(context_bucket(4000), 4096);
  EXPECT_EQ(context_bucket(4097), 8192);
  // Llama 3.2 1B's layout: 32 heads, 8 kv heads, head_dim 64; 132 SMs (an H100/H200).
  AttentionShape shape{32, 8, 64};
  // Every context of a bucket gets the split count of the bucket's top, so one graph serves the bucket.
  for (int64_t k : {129, 200, 256})
    EXPECT_EQ(graph_decode_splits(shape, 1, k, 132), decode_splits(shape, 1, 256, 132)) << k;
  EXPECT_EQ(graph_decode_splits(shape, 1, 10, 132), 1);  // <= 64 keys: one split, no combine pass
  // More sequences fill the machine by themselves: fewer splits.
  EXPECT_LE(graph_decode_splits(shape, 64, 4096, 132), graph_decode_splits(shape, 1, 4096, 132));

  DecodeGraphKey a{4, 2, 4, nullptr, nullptr}, b{4, 2, 4, nullptr, nullptr}, c{5, 2, 4, nullptr, nullptr};
  EXPECT_FALSE(a < b);
  EXPECT_FALSE(b < a);
  EXPECT_TRUE(a < c || c < a);
}

TEST(GraphRunner14, DecodeStepsAreRecognised) {
  const auto& m = testing::bundled_model<Device::CPU>();
  const EngineLimits limits = Generator::limits_for(m.w.config, 64, 4, 32);
  StepInputs step(m.w.config, limits, Device::CPU);
  step.set({1, 2, 3}, {1, 1, 1}, {5, 9, 2}, {0, 1, 2});
  EXPECT_TRUE(is_decode_step(step));
  step.set({1, 2, 3}, {1, 1, 1}, {5, 9, 2}, {0, 2});  // a row missing: not the decode shape
  EXPECT_FALSE(is_decode_step(step));
  step.set({1, 2, 3}, {1, 1, 1}, {5, 9, 2}, {1, 0, 2});  // rows out of order
  EXPECT_FALSE(is_decode_step(step));
  step.set({1, 2, 3}, {2, 1}, {2, 9}, {1, 2});  // a prompt's two tokens beside a decode token: mixed
  EXPECT_FALSE(is_decode_step(step));
  step.set({7}, {1}, {1}, {0});  // a one-token prompt is a decode-shaped step too (k_len 1): fine to replay
  EXPECT_TRUE(is_decode_step(step));
}

TEST(GraphRunner14, OnTheCpuEveryStepRunsEagerly) {
  const auto& m = testing::bundled_model<Device::CPU>();
  Generator gen(m.w, Generator::limits_for(m.w.config, 64, 2, 32));
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.ignore_eos = true;
  const GenerateResult plain = gen.generate(std::vector<int32_t>{5, 6, 7, 8}, opt);
  auto runner = std::make_unique<GraphRunner>(AttentionShape::from_config(m.w.config), 8);
  GraphRunner* r = runner.get();
  gen.context().set_launcher(std::move(runner));
  const GenerateResult through = gen.generate(std::vector<int32_t>{5, 6, 7, 8}, opt);
  EXPECT_EQ(through.ids, plain.ids);
  EXPECT_EQ(r->stats().captures, 0);
  EXPECT_EQ(r->stats().replays, 0);
  EXPECT_EQ(r->stats().eager_steps, 6);  // the prefill and 5 decode steps
}


TEST(GraphRunner14, BatchBuckets) {
  const GraphBuckets b{64, 16, 256};  // the engine's defaults for 256 sequences
  EXPECT_EQ(b.padded(1), 1);
  EXPECT_EQ(b.padded(37), 37);  // exact up to 64: its own graph
  EXPECT_EQ(b.padded(64), 64);
  EXPECT_EQ(b.padded(65), 80);  // above: the next multiple of 16
  EXPECT_EQ(b.padded(80), 80);
  EXPECT_EQ(b.padded(81), 96);
  EXPECT_EQ(b.padded(255), 256);
  EXPECT_EQ(b.padded(256), 256);
  EXPECT_EQ(b.padded(300), 300);  // above max_batch: eager, nothing to pad for
  const std::vector<int64_t> want = {80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256};
  EXPECT_EQ(b.buckets(), want);
  // max_batch not a multiple of the step: it is the last bucket itself.
  const GraphBuckets c{64, 16, 100};
  EXPECT_EQ(c.padded(97), 100);
  EXPECT_EQ(c.padded(96), 96);
  EXPECT_EQ(c.buckets(), (std::vector<int64_t>{80, 96, 100}));
  // No graphs (max_batch 0, the eager launcher's default): no padding at all.
  EXPECT_EQ(GraphBuckets{}.padded(100), 100);
  EXPECT_TRUE(GraphBuckets{}.buckets().empty());
  // The fast path's options: max_graph_batch 0 means every decode batch the loop can run.
  FastPathOptions o;
  EXPECT_EQ(graph_buckets(o, 256).max_batch, 256);
  o.max_graph_batch = 128;
  EXPECT_EQ(graph_buckets(o, 256).max_batch, 128);
  EXPECT_EQ(graph_buckets(o, 100).max_batch, 100);
  o.max_graph_batch = -1;
  EXPECT_THROW(graph_buckets(o, 100), InputError);
  EXPECT_THROW(GraphRunner(AttentionShape{2, 1, 8}, GraphBuckets{64, 0, 128}), InputError);
}

// A CPU launcher that pads like the graph runner and records what each step looked like when it launched.
class PaddingRecorder final : public StepLauncher {
 public:
  explicit PaddingRecorder(const GraphBuckets& b) : buckets_(b) {}
  int64_t padded_batch(int64_t n) const override { return buckets_.padded(n); }
  void launch(ExecContext& /*ctx*/, const StepInputs& step, AttentionBackend& /*backend*/,
              const std::function<void()>& work) override {
    if (is_decode_step(step)) {
      Seen s;
      s.batch = step.num_sequences();
      for (int64_t i = 0; i < step.num_tokens(); ++i) {
        s.ids.push_back(step.host_token_ids()[i]);
        s.positions.push_back(step.host_positions()[i]);
        s.rows.push_back(step.host_logits_rows()[i]);
        s.k_lens.push_back(step.batch().k_len(static_cast<int>(i)));
      }
      seen.push_back(s);
    }
    work();
  }
  struct Seen {
    int64_t batch = 0;
    std::vector<int32_t> ids, positions, rows;
    std::vector<int64_t> k_lens;
  };
  std::vector<Seen> seen;

 private:
  GraphBuckets buckets_;
};

std::vector<CheckRequest> padding_workload() {
  // 12 requests of different lengths: the decode batch shrinks from 12 through every size down to 1.
  const int32_t id_high = workload_id_high(testing::bundled_model<Device::CPU>().w.config);
  std::vector<CheckRequest> r = make_check_requests(12, 2, 9, 1, 30, id_high, 3);
  for (size_t i = 0; i < r.size(); ++i) {
    r[i].params.max_tokens = 2 + 2 * static_cast<int64_t>(i);
    r[i].params.ignore_eos = true;
  }
  return r;
}

TEST(GraphRunner14, PaddedDecodeStepsChangeNoRealIds) {
  const auto& m = testing::bundled_model<Device::CPU>();
  const GraphBuckets buckets{4, 4, 12};  // exact 1..4, then 8 and 12: steps of 5..7 and 9..11 sequences are padded
  for (const bool paged : {false, true}) {
    const KvFactory kv = paged ? paged_kv() : contiguous_kv();
    const std::vector<CheckRequest> requests = padding_workload();
    Engine plain(m.w, testing::engine_config(64, 12, 96), kv);
    const EngineRunResult want = run_requests(plain, requests);
    Engine padded(m.w, testing::engine_config(64, 12, 96), kv);
    auto owned = std::make_unique<PaddingRecorder>(buckets);
    PaddingRecorder* rec = owned.get();
    padded.context().set_launcher(std::move(owned));
    const EngineRunResult got = run_requests(padded, requests);
    const char* which = paged ? "paged" : "contiguous";
    ASSERT_TRUE(got.events_ok) << got.events_error;
    // CPU fp32: every row's result depends on its own inputs only, so the padding rows change no real id.
    ASSERT_EQ(got.ids.size(), want.ids.size());
    for (size_t i = 0; i < want.ids.size(); ++i) EXPECT_EQ(got.ids[i], want.ids[i]) << which << " request " << i;
    EXPECT_EQ(padded.stats().kv.used_blocks(), 0) << which;  // every block back in the pool
    // Every decode step launched at a bucket size, and the padded ones really occurred.
    std::set<int64_t> sizes;
    int padded_steps = 0;
    for (const PaddingRecorder::Seen& s : rec->seen) {
      sizes.insert(s.batch);
      EXPECT_EQ(buckets.padded(s.batch), s.batch) << which << ": a step of " << s.batch << " is not a bucket";
      for (int64_t i = 0; i < s.batch; ++i) EXPECT_EQ(s.rows[static_cast<size_t>(i)], i);  // one row per sequence
    }
    EXPECT_TRUE(sizes.count(8) && sizes.count(12)) << which;
    for (int64_t b : {5, 6, 7, 9, 10, 11}) EXPECT_EQ(sizes.count(b), 0u) << which << " size " << b;
    // The padding rows themselves (the last of each padded step): token 0 at position 0, k_len 1. The real rows
    // sit at position k_len - 1 >= 1 in a decode step after a prompt of >= 2 tokens.
    for (const PaddingRecorder::Seen& s : rec->seen) {
      int64_t pads = 0;
      for (int64_t i = s.batch - 1; i >= 0 && s.k_lens[static_cast<size_t>(i)] == 1; --i) {
        EXPECT_EQ(s.ids[static_cast<size_t>(i)], 0);
        EXPECT_EQ(s.positions[static_cast<size_t>(i)], 0);
        ++pads;
      }
      if (pads > 0) ++padded_steps;
      EXPECT_LT(pads, 4) << which;  // never a whole bucket of padding (steps of 8 rows hold at least 5 real ones)
    }
    EXPECT_GT(padded_steps, 0) << which;
  }
}

TEST(GraphRunner14, NoPaddingWithoutFreeSlots) {
  // The contiguous cache pads into free slots only. 8 sequences may run but the cache has 6 slots: a step of 5 or
  // 6 sequences would need 3 or 2 free slots for the bucket of 8 and has at most 1, so it runs unpadded.
  const auto& m = testing::bundled_model<Device::CPU>();
  Engine engine(m.w, testing::engine_config(64, 8, 96), contiguous_kv(6));
  auto owned = std::make_unique<PaddingRecorder>(GraphBuckets{4, 4, 8});
  PaddingRecorder* rec = owned.get();
  engine.context().set_launcher(std::move(owned));
  std::vector<CheckRequest> requests = padding_workload();
  requests.resize(6);
  const EngineRunResult run = run_requests(engine, requests);
  ASSERT_TRUE(run.events_ok) << run.events_error;
  std::set<int64_t> sizes;
  for (const PaddingRecorder::Seen& s : rec->seen) sizes.insert(s.batch);
  EXPECT_TRUE(sizes.count(5) && sizes.count(6)) << "steps of 5 and 6 without the free slots stay as they are";
  EXPECT_EQ(sizes.count(8), 0u);
  EXPECT_EQ(engine.stats().kv.used_blocks(), 0);
}

}  // namespace
}  // namespace tvllm
