// Lesson 17 on the CPU: the tensor-parallel forward simulated over N ranks equals lesson 08's unsharded fp32
// forward: bit for bit at N = 1 (the same ops in the same order), within kTpCpuLogitsTolPerMax at N = 2 and 4
// (only the row-parallel sums change order), on the bundled model and on a random model with 8 heads. Also the
// layer's two all-reduces: leave one out and the result is wrong.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "communicator.h"
#include "model_dir.h"
#include "shard_plan.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "tp_model.h"

namespace tvllm {
namespace {

using testing::SyntheticLlama;
using testing::TempDir;

std::vector<std::vector<int32_t>> reference_prompts(const std::filesystem::path& dir) {
  const ReferenceSet ref = ReferenceSet::open(dir);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < ref.num_prompts(); ++i) prompts.push_back(ref.prompt_ids(i));
  return prompts;
}

// The TP logits of every prompt token at world size n, and the unsharded ones.
struct TpRun {
  Tensor tp, reference;
};
TpRun run(const ModelDir& model, int n, const std::vector<std::vector<int32_t>>& prompts) {
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  const EngineLimits limits = limits_for_prompts(model.config, prompts);
  CpuSimComm comm(n);
  TpModel tp(w, ShardPlan::make(model.config, n), Device::CPU, limits, comm);
  return {tp.forward_prompts(prompts, /*all_rows=*/true), unsharded_logits(w, limits, prompts, true)};
}

void expect_bits_equal(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  int64_t differ = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    differ += std::memcmp(a.view().ptr<const float>() + i, b.view().ptr<const float>() + i, 4) != 0;
  EXPECT_EQ(differ, 0) << "of " << a.numel() << " logits";
}

void expect_within_bound(const TpRun& r, int n, const char* model) {
  const double diff = max_abs_difference(r.tp, r.reference), scale = max_abs_value(r.reference);
  std::printf("%s, N = %d: max |TP - reference| = %.3g = %.3g x max|logit| (%.4g)\n", model, n, diff, diff / scale,
              scale);
  EXPECT_GT(scale, 0.1);  // real logits, not zeros
  EXPECT_LE(diff, kTpCpuLogitsTolPerMax * scale) << model << " at N = " << n;
}

std::vector<std::vector<int32_t>> random_prompts(int64_t vocab) {
  std::vector<std::vector<int32_t>> p = {{}, {}};
  for (int i = 0; i < 11; ++i) p[0].push_back(static_cast<int32_t>((i * 37 + 5) % vocab));
  for (int i = 0; i < 6; ++i) p[1].push_back(static_cast<int32_t>(vocab - 1 - (i * 13) % vocab));  // the last id too
  return p;
}

// 8 heads, 4 KV heads, 2 layers, an untied lm_head, a vocabulary that N = 4 must pad (50 -> 52).
struct RandomModel {
  TempDir dir;
  RandomModel() {
    SyntheticLlama s;
    s.vocab = 50;
    s.hidden = 64;
    s.intermediate = 96;
    s.layers = 2;
    s.heads = 8;
    s.kv_heads = 4;
    s.head_dim = 16;
    s.tied = false;
    testing::write_random_llama(s, dir.path(), 1717);
  }
};

TEST(TpSim17, OneRankIsTheReferenceBitForBit) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const TpRun r = run(model, 1, reference_prompts(testing::tiny_model_dir()));
  expect_bits_equal(r.tp, r.reference);
}

TEST(TpSim17, TwoRanksEqualTheReferenceOnTheBundledModel) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  expect_within_bound(run(model, 2, reference_prompts(testing::tiny_model_dir())), 2, "bundled model");
}

TEST(TpSim17, FourRanksOfTheBundledModelAreRefused) {
  // 6 heads and 2 KV heads: no whole heads per rank at N = 4 (nor KV heads at N = 3).
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  EXPECT_THROW(ShardPlan::make(model.config, 4), InputError);
  EXPECT_THROW(ShardPlan::make(model.config, 3), InputError);
}

TEST(TpSim17, OneRankIsTheReferenceBitForBitOnARandomModel) {
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  const TpRun r = run(model, 1, random_prompts(model.config.vocab_size));
  expect_bits_equal(r.tp, r.reference);
}

TEST(TpSim17, TwoRanksEqualTheReferenceOnARandomModel) {
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  expect_within_bound(run(model, 2, random_prompts(model.config.vocab_size)), 2, "random 8-head model");
}

TEST(TpSim17, FourRanksEqualTheReferenceOnARandomModel) {
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  expect_within_bound(run(model, 4, random_prompts(model.config.vocab_size)), 4, "random 8-head model");
}

TEST(TpSim17, LastTokenLogitsOnlyAreTheSameRows) {
  // Generation asks for each prompt's last token only: the gather of the lm_head's slices keeps rows in order.
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  const std::vector<std::vector<int32_t>> prompts = random_prompts(model.config.vocab_size);
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  const EngineLimits limits = limits_for_prompts(model.config, prompts);
  CpuSimComm comm(4);
  TpModel tp(w, ShardPlan::make(model.config, 4), Device::CPU, limits, comm);
  const Tensor all = tp.forward_prompts(prompts, true), last = tp.forward_prompts(prompts, false);
  ASSERT_EQ(last.shape(), (Shape{2, model.config.vocab_size}));
  const int64_t V = model.config.vocab_size, row1 = static_cast<int64_t>(prompts[0].size()) - 1;
  const int64_t row2 = static_cast<int64_t>(prompts[0].size() + prompts[1].size()) - 1;
  EXPECT_EQ(0, std::memcmp(last.view().ptr<float>(), all.view().ptr<float>() + row1 * V, V * 4));
  EXPECT_EQ(0, std::memcmp(last.view().ptr<float>() + V, all.view().ptr<float>() + row2 * V, V * 4));
}

// A communicator that forgets one all-reduce of each layer: the placement matters (exercise 17.2).
class ForgetfulComm final : public Communicator {
 public:
  explicit ForgetfulComm(int n) : sim_(n) {}
  int world_size() const override { return sim_.world_size(); }
  const char* name() const override { return "forgetful"; }
  void all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>& s) override {
    if (calls_++ % 2 == 0) sim_.all_reduce_sum(bufs, s);  // the embedding's and every down_proj's, no o_proj's
  }
  void all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                  const std::vector<cudaStream_t>& s) override {
    sim_.all_gather(src, dst, s);
  }
  int calls_ = 0;

 private:
  CpuSimComm sim_;
};

TEST(TpSim17, EveryLayerNeedsBothAllReduces) {
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  const std::vector<std::vector<int32_t>> prompts = random_prompts(model.config.vocab_size);
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  const EngineLimits limits = limits_for_prompts(model.config, prompts);
  ForgetfulComm comm(2);
  TpModel tp(w, ShardPlan::make(model.config, 2), Device::CPU, limits, comm);
  const Tensor bad = tp.forward_prompts(prompts, true);
  EXPECT_EQ(comm.calls_, 1 + 2 * model.config.num_hidden_layers);  // one for the embedding, two per layer
  const Tensor ref = unsharded_logits(w, limits, prompts, true);
  EXPECT_GT(max_abs_difference(bad, ref), 100 * kTpCpuLogitsTolPerMax * max_abs_value(ref));
}

TEST(TpSim17, TheCommunicatorMustMatchThePlan) {
  RandomModel m;
  const ModelDir model = ModelDir::open(m.dir.path());
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  CpuSimComm comm(2);
  EXPECT_THROW(TpModel(w, ShardPlan::make(model.config, 4), Device::CPU, EngineLimits{16, 2, 16, 16}, comm),
               InputError);
}

}  // namespace
}  // namespace tvllm
