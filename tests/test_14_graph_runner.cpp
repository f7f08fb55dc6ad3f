// Lesson 14, CPU: the graph runner's host-side rules (which steps are decode steps, the context buckets, the
// split choice per bucket) and that on the CPU every step runs eagerly.
#include <gtest/gtest.h>

#include <vector>

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

}  // namespace
}  // namespace tvllm
