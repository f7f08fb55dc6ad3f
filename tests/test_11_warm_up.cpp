// Lesson 11: Engine::warm_up(), what `tiny-vllm serve` runs before it accepts connections. It runs steps (a
// prefill and decodes, greedy and sampled), then leaves no trace: every KV block free, every statistic zero, and
// the next request gets exactly the ids a fresh engine gives it.
#include <gtest/gtest.h>

#include <vector>

#include "common/errors.h"
#include "engine.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const testing::BundledModel<Device::CPU>& bundled() { return testing::bundled_model<Device::CPU>(); }

std::vector<int32_t> greedy_ids(Engine& engine, const std::vector<int32_t>& prompt, int64_t max_tokens) {
  RequestParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  std::vector<int32_t> ids;
  engine.submit(prompt, p, [&](const EngineEvent& e) {
    if (e.kind == EngineEvent::Kind::Token) ids.push_back(e.token);
  });
  engine.run_until_idle();
  return ids;
}

TEST(EngineWarmUp, RunsStepsAndLeavesNoTrace) {
  const std::vector<int32_t> prompt = {1, 450, 783, 310, 12, 99, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  Engine fresh(bundled().w, testing::engine_config(64, 4, 128));
  const std::vector<int32_t> expected = greedy_ids(fresh, prompt, 12);
  ASSERT_EQ(expected.size(), 12u);

  Engine warm(bundled().w, testing::engine_config(64, 4, 128));
  EXPECT_GE(warm.warm_up(), 3);  // a prefill and two decode steps at least
  const EngineStats s = warm.stats();
  EXPECT_EQ(s.steps, 0);
  EXPECT_EQ(s.prefill_tokens, 0);
  EXPECT_EQ(s.decode_tokens, 0);
  EXPECT_EQ(s.generated_tokens, 0);
  EXPECT_EQ(s.requests_submitted, 0);
  EXPECT_EQ(s.finished_stop + s.finished_length + s.aborted + s.failed, 0);
  EXPECT_EQ(s.peak_running, 0);
  EXPECT_EQ(s.pending + s.waiting + s.running, 0);
  EXPECT_EQ(s.kv.free_blocks, s.kv.total_blocks);
  EXPECT_FALSE(warm.has_work());

  EXPECT_EQ(greedy_ids(warm, prompt, 12), expected);
  const EngineStats after = warm.stats();
  EXPECT_EQ(after.requests_submitted, 1);
  EXPECT_EQ(after.generated_tokens, 12);
  EXPECT_EQ(after.finished_length, 1);
  EXPECT_EQ(after.prefill_tokens, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(after.kv.free_blocks, after.kv.total_blocks);
}

// The prefill warm-up: one prompt of each length 16, 32, 64, ... that a step holds (here max_tokens 300: 16 ... 256),
// so the engine runs more steps than the short requests alone need, and still every block comes back.
TEST(EngineWarmUp, PrefillsOfEachLengthALongerBudgetRuns) {
  Engine small(bundled().w, testing::engine_config(12, 4, 128));
  Engine large(bundled().w, testing::engine_config(300, 4, 512));
  EXPECT_TRUE(small.warm_up_prefill_lengths().empty());
  EXPECT_EQ(large.warm_up_prefill_lengths(), (std::vector<int64_t>{16, 32, 64, 128, 256}));
  // Lengths a step cannot hold are skipped: the small engine runs none of the large one's.
  const int64_t few = small.warm_up({}, large.warm_up_prefill_lengths());
  const int64_t more = large.warm_up({}, large.warm_up_prefill_lengths());
  EXPECT_EQ(more, few + 5) << "a 300-token step holds the 16- to 256-token prefills (one step each: max_tokens 1);"
                              " a 12-token step holds none";
  const EngineStats s = large.stats();
  EXPECT_EQ(s.steps, 0);
  EXPECT_EQ(s.kv.free_blocks, s.kv.total_blocks);
  EXPECT_FALSE(large.has_work());
}

TEST(EngineWarmUp, OneSequenceAndABusyEngine) {
  Engine one(bundled().w, testing::engine_config(8, 1, 16));  // one sequence, a small context: still runs
  EXPECT_GE(one.warm_up(), 2);
  EXPECT_EQ(one.stats().steps, 0);
  RequestParams p;
  p.max_tokens = 2;
  one.submit({1, 2, 3}, p, [](const EngineEvent&) {});
  EXPECT_THROW(one.warm_up(), InputError);  // requests in flight: not now
  one.run_until_idle();
  EXPECT_EQ(one.stats().requests_submitted, 1);
}

}  // namespace
}  // namespace tvllm
