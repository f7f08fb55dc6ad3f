// Lesson 08 on the CPU, issue 18: the ONE forward computes the Llama-like families' extras as data. Against
// transformers' fp32 run of tiny random models (tests/data/models: Qwen2's q/k/v biases, Qwen3's per-head q/k
// RMSNorm with head_dim 16 != hidden / heads, Llama with attention_bias and mlp_bias): the prompt's last-row
// logits and the greedy ids. Also: each extra changes the answer (so the comparisons can fail), a missing
// promised tensor is refused by name, and the two new ops against their definitions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "family_ops.h"
#include "model_dir.h"
#include "testing/family_models.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

using testing::FamilyReference;
using testing::TempDir;

// The reference logits are printed to 6 significant digits (relative error <= 5e-6), and our fp32 forward
// sums in other orders than PyTorch (dot products of at most 48 terms, 2 layers: a few fp32 ulps, ~1e-6 of
// logits of magnitude <= 5). 2e-5 absolute + 1e-5 relative holds both with a margin, and is ~1000x below
// what dropping any one extra moves the logits (EachExtraChangesTheLogits below).
constexpr double kAbsTol = 2e-5, kRelTol = 1e-5;

// A family's model on the CPU, prefill only: the logits of a whole prompt's last row. Owns the ModelDir (the
// CPU binding views its mapped files).
struct CpuRunner {
  explicit CpuRunner(const std::string& family, int64_t max_tokens = 32)
      : model(ModelDir::open(testing::family_model_dir(family))),
        limits{max_tokens, 1, 1, 0},
        weights(ModelWeights::bind(model, Device::CPU)),
        ctx(model.config, limits, Device::CPU),
        step(model.config, limits, Device::CPU),
        attn(model.config, limits, Device::CPU) {}
  std::vector<float> last_logits(const std::vector<int32_t>& prompt) {
    step.set_prompts({prompt}, /*all_rows=*/false);
    return to_f32_vector(forward(ctx, weights, step, attn));
  }
  ModelDir model;
  EngineLimits limits;
  ModelWeights weights;
  ExecContext ctx;
  StepInputs step;
  PrefillAttention attn;
};

int32_t argmax(const std::vector<float>& v) {  // the first maximum, as torch.argmax
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

double max_excess(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = -1.0;  // max over i of |got - want| - tolerance(want): <= 0 means within tolerance
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, d - (kAbsTol + kRelTol * std::fabs(static_cast<double>(want[i]))));
  }
  return worst;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

TEST(Families, CpuLastRowLogitsMatchTransformers) {
  for (const std::string& family : testing::computed_families()) {
    SCOPED_TRACE(family);
    const FamilyReference ref = testing::read_family_reference(family);
    CpuRunner run(family);
    ASSERT_EQ(ref.last_logits.size(), static_cast<size_t>(run.model.config.vocab_size));
    const std::vector<float> logits = run.last_logits(ref.prompt_ids);
    EXPECT_LE(max_excess(logits, ref.last_logits), 0.0)
        << "max |ours - transformers| = " << max_abs_diff(logits, ref.last_logits);
  }
}

// Greedy decoding by recomputing the whole sequence each step (lesson 08 has no KV cache; lesson 10's cache
// and `tiny-vllm generate` are checked against the same ids in tests/test_10_cli_generate.cpp).
TEST(Families, CpuGreedyIdsEqualTransformers) {
  for (const std::string& family : testing::computed_families()) {
    SCOPED_TRACE(family);
    const FamilyReference ref = testing::read_family_reference(family);
    CpuRunner run(family);
    std::vector<int32_t> seq = ref.prompt_ids, out;
    for (size_t i = 0; i < ref.greedy_ids.size(); ++i) {
      out.push_back(argmax(run.last_logits(seq)));
      seq.push_back(out.back());
    }
    EXPECT_EQ(out, ref.greedy_ids);
  }
}

// Every extra is part of the model: the forward without it is far outside the tolerance above. (So the two
// tests above would fail for a forward that skipped a step.)
TEST(Families, EachExtraChangesTheLogits) {
  struct Drop {
    const char* family;
    const char* what;
    std::function<void(LayerWeights&)> drop;
  };
  const Drop drops[] = {
      {"qwen2", "q/k/v biases", [](LayerWeights& L) { L.bq = L.bk = L.bv = {}; }},
      {"qwen3", "q_norm", [](LayerWeights& L) { L.q_norm = L.k_norm = {}; }},
      {"llama_bias", "o_proj bias", [](LayerWeights& L) { L.bo = {}; }},
      {"llama_bias", "gate/up biases", [](LayerWeights& L) { L.b_gate = L.b_up = {}; }},
      {"llama_bias", "down_proj bias", [](LayerWeights& L) { L.b_down = {}; }},
  };
  for (const Drop& d : drops) {
    SCOPED_TRACE(std::string(d.family) + " without its " + d.what);
    const FamilyReference ref = testing::read_family_reference(d.family);
    CpuRunner run(d.family);
    for (LayerWeights& L : run.weights.layers) d.drop(L);
    EXPECT_GT(max_abs_diff(run.last_logits(ref.prompt_ids), ref.last_logits), 100 * kAbsTol);
  }
}

// A transformers-written model with one tensor left out: refused at binding, naming it.
TEST(Families, AMissingPromisedTensorIsRefusedByName) {
  const std::pair<const char*, const char*> cases[] = {
      {"qwen2", "model.layers.1.self_attn.v_proj.bias"},
      {"qwen3", "model.layers.1.self_attn.k_norm.weight"},
      {"llama_bias", "model.layers.0.self_attn.o_proj.bias"},
      {"llama_bias", "model.layers.1.mlp.down_proj.bias"},
  };
  for (const auto& [family, dropped] : cases) {
    SCOPED_TRACE(dropped);
    const std::filesystem::path src = testing::family_model_dir(family);
    const WeightStore store = WeightStore::open(src);
    testing::SafetensorsBuilder b;
    for (const std::string& name : store.names()) {
      if (name == dropped) continue;
      const TensorView t = store.host(name);
      const auto* bytes = static_cast<const uint8_t*>(t.data);
      b.add(name, std::string(dtype_name(t.dtype)), t.shape, testing::Bytes(bytes, bytes + t.nbytes()));
    }
    TempDir tmp;
    std::filesystem::copy_file(src / "config.json", tmp / "config.json");
    testing::write_file(tmp / "model.safetensors", b.build());
    const ModelDir model = ModelDir::open(tmp.path());  // lesson 01 checks only Llama's own tensors
    try {
      ModelWeights::bind(model, Device::CPU);
      ADD_FAILURE() << "bound without " << dropped;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("tensor \"") + dropped + "\" is missing"), std::string::npos)
          << e.what();
    }
  }
}

// ---- the ops ----------------------------------------------------------------------------------------------

TEST(FamilyOps, AddBiasOnAStridedView) {
  // y: columns 1..3 of a [2, 5] buffer (row stride 5, as q/k/v are column views of the packed QKV rows).
  std::vector<float> buf{0, 1, 2, 3, 9, 0, 4, 5, 6, 9};
  const TensorView whole = TensorView::contiguous(buf.data(), DType::F32, Device::CPU, {2, 5});
  const std::vector<float> b{0.5f, -1.f, 0.25f};
  const TensorView bias = TensorView::contiguous(const_cast<float*>(b.data()), DType::F32, Device::CPU, {3});
  add_bias(whole.columns(1, 3), bias);
  EXPECT_EQ(buf, (std::vector<float>{0, 1.5f, 1, 3.25f, 9, 0, 4.5f, 4, 6.25f, 9})) << "outside columns untouched";
  // A BF16 bias is widened exactly (the CPU reads the weights as stored).
  std::vector<uint16_t> b16{0x3f80, 0xc000, 0x3e80};  // 1, -2, 0.25
  add_bias(whole.columns(1, 3), TensorView::contiguous(b16.data(), DType::BF16, Device::CPU, {3}));
  EXPECT_EQ(buf[1], 2.5f);
  EXPECT_EQ(buf[7], 2.f);
  EXPECT_EQ(buf[8], 6.5f);
}

TEST(FamilyOps, HeadRmsNormNormalisesEachHeadAlone) {
  // Two rows of two heads of head_dim 2 inside a [2, 6] buffer (columns 1..4, row stride 6): each head is
  // normalised by its own mean square, (3, 4): 12.5, (1, 1): 1, (0, 0): 0 (stays 0 thanks to eps), (-2, 2): 4.
  std::vector<float> buf{7, 3, 4, 1, 1, 7, 7, 0, 0, -2, 2, 7};
  const TensorView x = TensorView::contiguous(buf.data(), DType::F32, Device::CPU, {2, 6}).columns(1, 4);
  std::vector<float> w{2.f, 0.5f};
  const float eps = 1e-6f;
  head_rmsnorm(x, TensorView::contiguous(w.data(), DType::F32, Device::CPU, {2}), eps);
  auto want = [&](double v, double mean_sq, float weight) {
    return static_cast<float>(v / std::sqrt(mean_sq + eps)) * weight;
  };
  EXPECT_FLOAT_EQ(buf[1], want(3, 12.5, 2.f));
  EXPECT_FLOAT_EQ(buf[2], want(4, 12.5, 0.5f));
  EXPECT_FLOAT_EQ(buf[3], want(1, 1, 2.f));  // not scaled by its neighbour head's mean square
  EXPECT_FLOAT_EQ(buf[4], want(1, 1, 0.5f));
  EXPECT_EQ(buf[7], 0.f);
  EXPECT_EQ(buf[8], 0.f);
  EXPECT_FLOAT_EQ(buf[9], want(-2, 4, 2.f));
  EXPECT_FLOAT_EQ(buf[10], want(2, 4, 0.5f));
  EXPECT_EQ(buf[0], 7.f);  // outside the view: untouched
  EXPECT_EQ(buf[5], 7.f);
  EXPECT_EQ(buf[6], 7.f);
  EXPECT_EQ(buf[11], 7.f);
}

TEST(FamilyOps, BadArgumentsAreInputErrors) {
  std::vector<float> buf(12, 1.f);
  const TensorView x = TensorView::contiguous(buf.data(), DType::F32, Device::CPU, {2, 6});
  std::vector<float> w(4, 1.f);
  const TensorView w4 = TensorView::contiguous(w.data(), DType::F32, Device::CPU, {4});
  const TensorView w3 = TensorView::contiguous(w.data(), DType::F32, Device::CPU, {3});
  EXPECT_THROW(head_rmsnorm(x, w4, 1e-6f), InputError);  // 6 is not a whole number of heads of 4
  EXPECT_NO_THROW(head_rmsnorm(x, w3, 1e-6f));
  EXPECT_THROW(head_rmsnorm(x, w3, -1.f), InputError);
  EXPECT_THROW(add_bias(x, w4), InputError);  // a bias of 4 for rows of 6
  EXPECT_THROW(add_bias(x.reshape({12}), w4), InputError);  // not [tokens, width]
  std::vector<int32_t> ints(12);
  EXPECT_THROW(add_bias(TensorView::contiguous(ints.data(), DType::I32, Device::CPU, {2, 6}),
                        TensorView::contiguous(w.data(), DType::F32, Device::CPU, {6})),
               InputError);
}

}  // namespace
}  // namespace tvllm
