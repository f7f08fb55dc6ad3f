// Lesson 08 on the CPU: the fp32 reference forward against Hugging Face (logits, final norm, and the last
// layer's intermediate tensors left in the workspace), batch == alone, logits rows, an F32 checkpoint; the
// checkpoint/config validation sweep; SiLU·mul and packing against their definitions; StepInputs and
// EngineLimits at the API boundary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "logits_check.h"
#include "model_dir.h"
#include "silu_mul.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

using testing::SyntheticLlama;
using testing::TempDir;

void expect_input_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected an InputError mentioning \"" << needles.front() << "\"";
  } catch (const InputError& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << n;
  }
}

double max_abs(const TensorView& host_f32) {
  double m = 0.0;
  for (int64_t i = 0; i < host_f32.numel(); ++i)
    m = std::max(m, static_cast<double>(std::fabs(host_f32.ptr<const float>()[i])));
  return m;
}

std::vector<std::vector<int32_t>> reference_prompts(const ReferenceSet& ref) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < ref.num_prompts(); ++i) prompts.push_back(ref.prompt_ids(i));
  return prompts;
}

// A CPU engine for `model` sized for `max_tokens` tokens, every row's logits.
struct CpuEngine {
  CpuEngine(const ModelDir& model, int64_t max_tokens, int64_t max_sequences = 8)
      : limits{max_tokens, max_sequences, max_tokens, 0},
        weights(ModelWeights::bind(model, Device::CPU)),
        ctx(model.config, limits, Device::CPU),
        step(model.config, limits, Device::CPU),
        attn(model.config, limits, Device::CPU) {}
  // Logits of every row of the prompts run as one step, copied out.
  Tensor run(const std::vector<std::vector<int32_t>>& prompts) {
    step.set_prompts(prompts, /*all_rows=*/true);
    return Tensor::copy_of(forward(ctx, weights, step, attn), Device::CPU);
  }
  EngineLimits limits;
  ModelWeights weights;
  ExecContext ctx;
  StepInputs step;
  PrefillAttention attn;
};

std::vector<float> values(const TensorView& v) { return to_f32_vector(v); }

// ---- the forward pass vs Hugging Face -------------------------------------------------------------

TEST(Transformer, CpuForwardMatchesHuggingFace) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  CpuEngine e(model, 256);
  for (int i = 0; i < ref.num_prompts(); ++i) {
    SCOPED_TRACE("prompt p" + std::to_string(i));
    const Tensor logits = e.run({ref.prompt_ids(i)});
    const Tensor want = Tensor::copy_of(ref.prompt(i, "logits"), Device::CPU, DType::F32);
    const CompareResult r = compare("logits", logits, want, {kCpuLogitsAtolPerMax * max_abs(want), 0.0});
    EXPECT_TRUE(r.pass()) << "max_abs " << r.max_abs << " bad " << r.bad;
    // The measured error is far inside the bound: a regression of 10x would still show here.
    EXPECT_LT(r.max_abs, 1e-5 * max_abs(want));
    const Top1Agreement a = top1_agreement(logits, want, 0.0);
    EXPECT_EQ(a.agree_all, a.positions) << a.summary();

    // The final norm's output is left in the workspace (every row was wanted, in order).
    const int64_t T = static_cast<int64_t>(ref.prompt_ids(i).size());
    const Tensor norm = Tensor::copy_of(e.ctx.workspace().out_normed.view().rows(0, T), Device::CPU);
    const Tensor want_norm = Tensor::copy_of(ref.prompt(i, "norm"), Device::CPU, DType::F32);
    EXPECT_TRUE(compare("norm", norm, want_norm, {kCpuNormAtolPerMax * max_abs(want_norm), 0.0}).pass());
  }
}

// After a step, the workspace holds the last layer's tensors: they equal Hugging Face's, one by one. This
// pins down the residual bookkeeping (h holds attn_residual, delta the MLP output, h + delta the layer
// output).
TEST(Transformer, WorkspaceHoldsTheLastLayersTensors) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  CpuEngine e(model, 256);
  const int last = static_cast<int>(model.config.num_hidden_layers) - 1;
  const std::string L = "layers." + std::to_string(last) + ".";
  const std::vector<int32_t> ids = ref.prompt_ids(2);
  const auto T = static_cast<int64_t>(ids.size());
  e.run({ids});
  Workspace& ws = e.ctx.workspace();
  auto check = [&](const std::string& name, const TensorView& got) {
    const Tensor want = Tensor::copy_of(ref.prompt(2, L + name), Device::CPU, DType::F32);
    const CompareResult r = compare(name, got, want, {5e-5 * max_abs(want), 0.0});
    EXPECT_TRUE(r.pass()) << name << ": max_abs " << r.max_abs << " of max " << max_abs(want);
  };
  check("attn_residual", ws.hidden.view().rows(0, T));
  check("post_attention_layernorm", ws.normed.view().rows(0, T));
  check("attn", ws.attn.view().rows(0, T));
  check("mlp_act", ws.act.view().rows(0, T));
  check("down_proj", ws.delta.view().rows(0, T));
  std::vector<float> out = values(ws.hidden.view().rows(0, T));
  const std::vector<float> delta = values(ws.delta.view().rows(0, T));
  for (size_t j = 0; j < out.size(); ++j) out[j] += delta[j];
  check("output", Tensor::from_f32(out, {T, model.config.hidden_size}, DType::F32, Device::CPU));
}

TEST(Transformer, BatchEqualsAlone) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ref);
  CpuEngine e(model, 512);
  // Reversed order and a repeated prompt: each sequence must still see only itself.
  const std::vector<std::vector<int32_t>> batch = {prompts[2], prompts[0], prompts[1], prompts[0]};
  const std::vector<float> together = values(e.run(batch));
  int64_t row = 0;
  const int64_t V = model.config.vocab_size;
  for (const std::vector<int32_t>& p : batch) {
    const std::vector<float> alone = values(e.run({p}));
    const std::vector<float> part(together.begin() + row * V,
                                  together.begin() + (row + static_cast<int64_t>(p.size())) * V);
    EXPECT_EQ(part, alone) << "the CPU reference's sums do not depend on the batch: bit for bit";
    row += static_cast<int64_t>(p.size());
  }
}

TEST(Transformer, LogitsOnlyForTheRowsAsked) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  const auto prompts = reference_prompts(ref);
  CpuEngine e(model, 512);
  const std::vector<float> all = values(e.run({prompts[0], prompts[1]}));
  const int64_t V = model.config.vocab_size, n0 = static_cast<int64_t>(prompts[0].size());
  const int64_t n1 = static_cast<int64_t>(prompts[1].size());

  // Generation asks for each sequence's last row.
  e.step.set_prompts({prompts[0], prompts[1]}, /*all_rows=*/false);
  ASSERT_EQ(e.step.num_logits_rows(), 2);
  const std::vector<float> last = values(forward(e.ctx, e.weights, e.step, e.attn));
  ASSERT_EQ(last.size(), static_cast<size_t>(2 * V));
  EXPECT_TRUE(std::equal(last.begin(), last.begin() + V, all.begin() + (n0 - 1) * V));
  EXPECT_TRUE(std::equal(last.begin() + V, last.end(), all.begin() + (n0 + n1 - 1) * V));

  // Any rows, any order, repeats allowed; and none at all.
  const std::vector<int32_t> ids = [&] {
    std::vector<int32_t> v = prompts[0];
    v.insert(v.end(), prompts[1].begin(), prompts[1].end());
    return v;
  }();
  e.step.set(ids, {n0, n1}, {n0, n1}, {5, 0, static_cast<int32_t>(n0 + 3), 5});
  const std::vector<float> some = values(forward(e.ctx, e.weights, e.step, e.attn));
  const int64_t rows[] = {5, 0, n0 + 3, 5};
  for (int r = 0; r < 4; ++r)
    EXPECT_TRUE(std::equal(some.begin() + r * V, some.begin() + (r + 1) * V, all.begin() + rows[r] * V)) << r;
  e.step.set(ids, {n0, n1}, {n0, n1}, {});
  EXPECT_EQ(forward(e.ctx, e.weights, e.step, e.attn).shape, (Shape{0, V}));
}

// Writes `model` again with every tensor widened to F32 (exact: bf16 is the top half of an fp32).
void write_f32_copy(const ModelDir& model, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(model.path / "config.json", dir / "config.json");
  testing::SafetensorsBuilder b;
  for (const std::string& name : model.weights.names()) {
    const std::vector<float> v = to_f32_vector(model.weights.host(name));
    b.add(name, "F32", model.weights.entry(name).shape, testing::f32_bytes(v));
  }
  testing::write_file(dir / "model.safetensors", b.build());
}

TEST(Transformer, F32CheckpointGivesTheSameLogits) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  TempDir tmp;
  write_f32_copy(model, tmp.path());
  const ModelDir f32 = ModelDir::open(tmp.path());
  ASSERT_EQ(f32.weights.entry("model.embed_tokens.weight").dtype, DType::F32);
  CpuEngine a(model, 128), b(f32, 128);
  EXPECT_EQ(values(a.run({ref.prompt_ids(1)})), values(b.run({ref.prompt_ids(1)})))
      << "the CPU widens bf16 exactly, so the same values stored as F32 give the same bits";
}

TEST(Transformer, UntiedLmHeadIsUsed) {
  // A synthetic model with its own lm_head: the logits must be normed . lm_head, not normed . embed.
  TempDir tmp;
  SyntheticLlama s;
  s.tied = false;
  s.write(tmp.path());
  const ModelDir model = ModelDir::open(tmp.path());
  CpuEngine e(model, 16);
  const ModelWeights& w = e.weights;
  EXPECT_FALSE(w.tied);
  EXPECT_NE(w.lm_head.data, w.embed.data);
  const std::vector<float> logits = values(e.run({{1, 2, 3}}));
  // Recompute the last row from the workspace's final norm and lm_head.weight.
  const std::vector<float> normed = values(e.ctx.workspace().out_normed.view().rows(2, 1));
  const std::vector<float> head = values(model.weights.host("lm_head.weight"));
  for (int64_t v = 0; v < s.vocab; ++v) {
    double dot = 0.0;
    for (int64_t j = 0; j < s.hidden; ++j) dot += static_cast<double>(normed[j]) * head[v * s.hidden + j];
    EXPECT_NEAR(logits[2 * s.vocab + v], dot, 1e-5 * (1 + std::fabs(dot))) << v;
  }
}

// ---- the checkpoint and config validation sweep ----------------------------------------------------

// Writes a synthetic model whose tensors are edited, plus `extra` tensors (F32 zeros).
struct Edit {
  std::string drop;                                  // a tensor to leave out
  std::string reshape;                               // a tensor whose first dimension gets + 1
  std::string retype;                                // a tensor stored as I8
  std::vector<std::pair<std::string, Shape>> extra;  // tensors to add
};
Edit dropping(std::string name) {
  Edit e;
  e.drop = std::move(name);
  return e;
}
Edit reshaping(std::string name) {
  Edit e;
  e.reshape = std::move(name);
  return e;
}
Edit retyping(std::string name) {
  Edit e;
  e.retype = std::move(name);
  return e;
}
Edit adding(std::vector<std::pair<std::string, Shape>> tensors) {
  Edit e;
  e.extra = std::move(tensors);
  return e;
}

std::filesystem::path write_edited(const TempDir& tmp, const SyntheticLlama& s, const Edit& edit) {
  std::filesystem::create_directories(tmp.path());
  testing::write_file(tmp / "config.json", s.config_json());
  testing::SafetensorsBuilder b;
  const auto w = s.weights();
  for (size_t i = 0; i < w.size(); ++i) {
    auto [name, shape] = w[i];
    if (name == edit.drop) continue;
    if (name == edit.reshape) shape[0] += 1;
    if (name == edit.retype) {
      b.add(name, "I8", shape, testing::zeros(static_cast<size_t>(shape_numel(shape))));
      continue;
    }
    b.add(name, s.dtype, shape, s.tensor_bytes(i, shape));
  }
  for (const auto& [name, shape] : edit.extra)
    b.add(name, "F32", shape, testing::zeros(4 * static_cast<size_t>(shape_numel(shape))));
  testing::write_file(tmp / "model.safetensors", b.build());
  return tmp.path();
}

// The user's path (ModelDir::open, then ModelWeights::bind) refuses the checkpoint with a message holding
// `user` (lesson 01 catches what it knows first); check_llama_weights alone, with one holding `own`.
void expect_refused(const SyntheticLlama& s, const Edit& edit, const std::vector<std::string>& user,
                    const std::vector<std::string>& own) {
  TempDir tmp;
  const std::filesystem::path dir = write_edited(tmp, s, edit);
  expect_input_error([&] { ModelWeights::bind(ModelDir::open(dir), Device::CPU); }, user);
  const ModelConfig config = load_model_config(dir);
  const WeightStore weights = WeightStore::open(dir);
  expect_input_error([&] { check_llama_weights(config, weights); }, own);
}

TEST(TransformerValidation, ASyntheticModelBindsAndRuns) {
  for (std::string dtype : {"BF16", "F16", "F32"}) {
    SCOPED_TRACE(dtype);
    SyntheticLlama s;
    s.dtype = dtype;
    TempDir tmp;
    const ModelDir model = ModelDir::open(write_edited(tmp, s, Edit()));
    CpuEngine e(model, 16);
    EXPECT_EQ(e.weights.layers.size(), 2u);
    EXPECT_EQ(e.weights.embed.dtype, model.weights.entry("model.embed_tokens.weight").dtype)
        << "read as stored";
    EXPECT_FALSE(e.weights.layers[0].packed()) << "the CPU reads q, k, v as stored, unpacked";
    for (float x : values(e.run({{0, 5, 15, 7}}))) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(TransformerValidation, MissingTensor) {
  SyntheticLlama s;
  expect_refused(s, dropping("model.layers.1.mlp.up_proj.weight"),
                 {"no tensor \"model.layers.1.mlp.up_proj.weight\""},
                 {"tensor \"model.layers.1.mlp.up_proj.weight\" is missing"});
  expect_refused(s, dropping("model.norm.weight"), {"\"model.norm.weight\""},
                 {"\"model.norm.weight\" is missing"});
  s.tied = false;
  expect_refused(s, dropping("lm_head.weight"), {"no tensor \"lm_head.weight\""},
                 {"\"lm_head.weight\" is missing", "tie_word_embeddings is false"});
}

TEST(TransformerValidation, WrongShape) {
  SyntheticLlama s;
  expect_refused(s, reshaping("model.layers.0.self_attn.k_proj.weight"),
                 {"\"model.layers.0.self_attn.k_proj.weight\" has shape [7, 8]", "[6, 8]"},
                 {"\"model.layers.0.self_attn.k_proj.weight\" has shape [7, 8], expected [6, 8]"});
  expect_refused(s, reshaping("model.embed_tokens.weight"), {"embed_tokens", "[17, 8]"},
                 {"[17, 8], expected [16, 8]"});
  expect_refused(s, reshaping("model.layers.1.input_layernorm.weight"), {"input_layernorm", "[9]"},
                 {"[9], expected [8]"});
}

TEST(TransformerValidation, QuantisedOrIntegerWeight) {
  SyntheticLlama s;
  expect_refused(s, retyping("model.layers.0.mlp.down_proj.weight"),
                 {"\"model.layers.0.mlp.down_proj.weight\" is I8"},
                 {"\"model.layers.0.mlp.down_proj.weight\" is I8", "F32, F16 or BF16"});
}

TEST(TransformerValidation, UnexpectedTensors) {
  SyntheticLlama s;
  const std::vector<std::string> bias = {"unexpected tensor \"model.layers.0.self_attn.q_proj.bias\"",
                                         "no such weight"};
  expect_refused(s, adding({{"model.layers.0.self_attn.q_proj.bias", {s.heads * s.head_dim}}}), bias, bias);
  const std::vector<std::string> layer = {"unexpected tensor \"model.layers.2.input_layernorm.weight\"",
                                          "2 layers"};
  expect_refused(s, adding({{"model.layers.2.input_layernorm.weight", {s.hidden}}}), layer, layer);
  const std::vector<std::string> scale = {"unexpected tensor \"model.layers.1.mlp.up_proj.weight_scale\""};
  expect_refused(s, adding({{"model.layers.1.mlp.up_proj.weight_scale", {1}}}), scale, scale);
  // Tolerated, as Hugging Face tolerates them: RoPE buffers of old checkpoints, lm_head beside tied
  // embeddings.
  TempDir tmp;
  const ModelDir ok =
      ModelDir::open(write_edited(tmp, s,
                                  adding({{"model.layers.0.self_attn.rotary_emb.inv_freq", {s.head_dim / 2}},
                                          {"lm_head.weight", {s.vocab, s.hidden}}})));
  EXPECT_NO_THROW(ModelWeights::bind(ok, Device::CPU));
}

// What config.json may say that this forward pass does not compute: refused when the model is opened.
TEST(TransformerValidation, UnsupportedConfig) {
  const SyntheticLlama s;
  const std::string base = s.config_json();
  auto with = [&](const std::string& field) { return base.substr(0, base.size() - 1) + ", " + field + "}"; };
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {with("\"hidden_act\": \"gelu\""), {"hidden_act", "silu", "gelu"}},
      {with("\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}"),
       {"rope_type \"yarn\"", "not supported"}},
      {with("\"num_local_experts\": 8"), {"num_local_experts", "mixture-of-experts"}},
  };
  for (const auto& [config, needles] : cases) {
    SCOPED_TRACE(config);
    TempDir tmp;
    s.write(tmp.path());
    testing::write_file(tmp / "config.json", config);
    expect_input_error([&] { ModelDir::open(tmp.path()); }, needles);
  }
  TempDir tmp;
  s.write(tmp.path());
  std::string gemma = base;
  gemma.replace(gemma.find("\"llama\""), 7, "\"gemma2\"");
  testing::write_file(tmp / "config.json", gemma);
  expect_input_error([&] { ModelDir::open(tmp.path()); }, {"model_type", "gemma2"});
}

// Issue 18: lesson 01 reads the Qwen2 / Qwen3 / Mistral / biased-Llama differences, and binding expects the
// tensors each one implies: a Llama checkpoint relabelled as one of them lacks them, and is refused naming the
// first missing tensor (on every device: the check runs before anything is bound). (The sliding window needs no
// tensor: every attention path computes it, tests/test_12_sliding_window.cpp.)
TEST(TransformerValidation, FamilyExtrasWithoutTheirTensorsAreRefusedAtBinding) {
  const SyntheticLlama s;
  const std::string base = s.config_json();
  auto with = [&](const std::string& field) { return base.substr(0, base.size() - 1) + ", " + field + "}"; };
  auto as_family = [&](std::string j, const std::string& type, const std::string& arch) {
    j.replace(j.find("\"llama\""), 7, "\"" + type + "\"");
    j.replace(j.find("\"LlamaForCausalLM\""), 18, "\"" + arch + "\"");
    return j;
  };
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {with("\"attention_bias\": true"), {"tensor \"model.layers.0.self_attn.q_proj.bias\" is missing"}},
      {with("\"mlp_bias\": true"), {"tensor \"model.layers.0.mlp.gate_proj.bias\" is missing"}},
      {as_family(base, "qwen2", "Qwen2ForCausalLM"), {"\"model.layers.0.self_attn.q_proj.bias\" is missing"}},
      {as_family(base, "qwen3", "Qwen3ForCausalLM"), {"\"model.layers.0.self_attn.q_norm.weight\" is missing"}},
  };
  for (const auto& [config, needles] : cases) {
    SCOPED_TRACE(config);
    TempDir tmp;
    s.write(tmp.path());
    testing::write_file(tmp / "config.json", config);
    const ModelDir model = ModelDir::open(tmp.path());  // the config itself is fine
    expect_input_error([&] { ModelWeights::bind(model, Device::CPU); }, needles);
  }
  // Mistral without a window (7B v0.2 / v0.3) is a Llama by another name, and with one (v0.1) every attention
  // path computes it (test_12_sliding_window.cpp): both bind and run.
  for (const char* window : {"\"sliding_window\": null", "\"sliding_window\": 4"}) {
    SCOPED_TRACE(window);
    TempDir tmp;
    s.write(tmp.path());
    testing::write_file(tmp / "config.json", as_family(with(window), "mistral", "MistralForCausalLM"));
    const ModelDir model = ModelDir::open(tmp.path());
    CpuEngine e(model, 16);
    for (float x : values(e.run({{0, 5, 15, 7}}))) ASSERT_TRUE(std::isfinite(x));
  }
}

// The tiny models transformers wrote (weights/tools/make_family_models.py, tests/data/models/): their
// config.json reads into the right flags and they bind with exactly the extra views their flags imply
// (tests/test_08_families.cpp compares what they compute with transformers; Mistral's window:
// tests/test_12_sliding_window.cpp).
TEST(TransformerValidation, TransformersWrittenFamilyModelsOpenAndBind) {
  struct Case {
    const char* dir;
    bool qkv_bias, o_bias, mlp_bias, qk_norm;
    int64_t window, head_dim;
  };
  const Case cases[] = {
      {"qwen2", true, false, false, false, 0, 8},
      {"qwen3", false, false, false, true, 0, 16},
      {"mistral", false, false, false, false, 5, 16},
      {"llama_bias", true, true, true, false, 0, 8},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.dir);
    const ModelDir model = ModelDir::open(testing::test_data_dir() / "models" / k.dir);
    const ModelConfig& c = model.config;
    EXPECT_EQ(c.qkv_bias, k.qkv_bias);
    EXPECT_EQ(c.o_bias, k.o_bias);
    EXPECT_EQ(c.mlp_bias, k.mlp_bias);
    EXPECT_EQ(c.qk_norm, k.qk_norm);
    EXPECT_EQ(c.sliding_window, k.window);
    EXPECT_EQ(c.head_dim, k.head_dim);
    const ModelWeights w = ModelWeights::bind(model, Device::CPU);
    for (const LayerWeights& L : w.layers) {
      EXPECT_EQ(L.has_qkv_bias(), k.qkv_bias);
      EXPECT_EQ(L.bo.data != nullptr, k.o_bias);
      EXPECT_EQ(L.b_gate.data != nullptr && L.b_up.data != nullptr && L.b_down.data != nullptr, k.mlp_bias);
      EXPECT_EQ(L.has_qk_norm(), k.qk_norm);
      EXPECT_EQ(L.llama_only(), !(k.qkv_bias || k.o_bias || k.mlp_bias || k.qk_norm));
      if (k.qkv_bias) {
        EXPECT_EQ(L.bq.shape, (Shape{c.q_dim()}));
        EXPECT_EQ(L.bk.shape, (Shape{c.kv_dim()}));
      }
      if (k.qk_norm) {
        EXPECT_EQ(L.k_norm.shape, (Shape{c.head_dim}));
      }
    }
  }
}

TEST(TransformerValidation, ExpectedTensorsFollowTheConfig) {
  SyntheticLlama s;
  TempDir tmp;
  s.write(tmp.path());
  ModelConfig c = ModelDir::open(tmp.path()).config;
  EXPECT_EQ(expected_llama_tensors(c).size(), 1 + 9 * 2 + 1u);
  c.tie_word_embeddings = false;
  const auto t = expected_llama_tensors(c);
  EXPECT_EQ(t.back().name, "lm_head.weight");
  EXPECT_EQ(t.back().shape, (Shape{s.vocab, s.hidden}));
  EXPECT_EQ(t[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(t[2].shape, (Shape{s.heads * s.head_dim, s.hidden}));
  // The families' extras: each bias right after its weight, q/k norms after o_proj, per layer.
  c.qkv_bias = c.o_bias = c.mlp_bias = c.qk_norm = true;
  const auto x = expected_llama_tensors(c);
  EXPECT_EQ(x.size(), t.size() + (3 + 1 + 3 + 2) * 2u);
  EXPECT_EQ(x[3].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(x[3].shape, (Shape{s.heads * s.head_dim}));
  EXPECT_EQ(x[5].name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(x[5].shape, (Shape{s.kv_heads * s.head_dim}));
  EXPECT_EQ(x[9].name, "model.layers.0.self_attn.o_proj.bias");
  EXPECT_EQ(x[9].shape, (Shape{s.hidden}));
  EXPECT_EQ(x[10].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(x[10].shape, (Shape{s.head_dim}));
  EXPECT_EQ(x[11].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(x[14].name, "model.layers.0.mlp.gate_proj.bias");
  EXPECT_EQ(x[18].name, "model.layers.0.mlp.down_proj.bias");
  EXPECT_EQ(x[18].shape, (Shape{s.hidden}));
}

// ---- SiLU·mul ------------------------------------------------------------------------------------

TEST(SiluMul, KnownValues) {
  EXPECT_EQ(silu_f32(0.0f), 0.0f);
  EXPECT_FLOAT_EQ(silu_f32(1.0f), static_cast<float>(1.0 / (1.0 + std::exp(-1.0))));
  EXPECT_FLOAT_EQ(silu_f32(-2.0f), static_cast<float>(-2.0 / (1.0 + std::exp(2.0))));
  EXPECT_EQ(silu_f32(100.0f), 100.0f) << "sigmoid(100) rounds to 1 in fp32";
  EXPECT_EQ(silu_f32(-1000.0f), -0.0f) << "e^1000 overflows to inf in double: the limit 0, not NaN";
  EXPECT_LT(silu_f32(-1.278464542f), -0.278464f) << "the minimum of silu, about -0.2785";
}

TEST(SiluMul, StridedViewsOfOneGateUpBuffer) {
  const int64_t T = 5, I = 7;
  const std::vector<float> gate_up = random_normal(static_cast<size_t>(T * 2 * I), 3, 3.0f);
  const Tensor buf = Tensor::from_f32(gate_up, {T, 2 * I}, DType::F32, Device::CPU);
  // Column views of one [T, 2I] buffer: row stride 2I.
  TensorView gate = buf.view(), up = buf.view();
  gate.shape = up.shape = {T, I};
  up.data = buf.view().ptr<float>() + I;
  Tensor out = Tensor::from_f32(std::vector<float>(T * I, NAN), {T, I}, DType::F32, Device::CPU);
  silu_mul(out, gate, up);
  const std::vector<float> got = values(out);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gate_up[t * 2 * I + i], u = gate_up[t * 2 * I + I + i];
      const float want = static_cast<float>(g / (1.0 + std::exp(-static_cast<double>(g)))) * u;
      EXPECT_EQ(got[t * I + i], want) << t << "," << i;
    }
}

TEST(SiluMul, RejectsBadArguments) {
  const Tensor a = Tensor::from_f32(std::vector<float>(12, 1.0f), {3, 4}, DType::F32, Device::CPU);
  const Tensor b = Tensor::from_f32(std::vector<float>(12, 1.0f), {3, 4}, DType::F32, Device::CPU);
  const Tensor c = Tensor::from_f32(std::vector<float>(12, 1.0f), {4, 3}, DType::F32, Device::CPU);
  const Tensor h = Tensor::from_f32(std::vector<float>(12, 1.0f), {3, 4}, DType::BF16, Device::CPU);
  Tensor out = Tensor::empty({3, 4}, DType::F32, Device::CPU);
  expect_input_error([&] { silu_mul(out, a, c); }, {"up", "must be [3, 4]"});
  expect_input_error([&] { silu_mul(out, h, b); }, {"takes F32"});
  expect_input_error([&] { silu_mul(a, a, b); }, {"must not overlap"});
  TensorView transposed = a.view();
  transposed.strides = {1, 3};
  expect_input_error([&] { silu_mul(out, transposed, b); }, {"contiguous columns"});
}

TEST(GatherRows, PicksRowsOnTheHost) {
  const Tensor x = Tensor::from_f32({0, 1, 10, 11, 20, 21}, {3, 2}, DType::F32, Device::CPU);
  Tensor out = Tensor::empty({4, 2}, DType::F32, Device::CPU);
  const Tensor rows = Tensor::from_i32({2, 0, 2, 1}, {4}, Device::CPU);
  gather_rows(out, x, rows);
  EXPECT_EQ(values(out), (std::vector<float>{20, 21, 0, 1, 20, 21, 10, 11}));
  const Tensor bad = Tensor::from_i32({0, 3, 0, 0}, {4}, Device::CPU);
  expect_input_error([&] { gather_rows(out, x, bad); }, {"rows[1] = 3", "outside [0, 3)"});
}

// ---- packing ---------------------------------------------------------------------------------------

TEST(PackRows, StacksAndRoundsToBf16) {
  const std::vector<float> a = random_normal(6, 11), b = random_normal(9, 12), c = random_normal(3, 13);
  const Tensor pa = Tensor::from_f32(a, {2, 3}, DType::F32, Device::CPU);   // F32: rounded to nearest even
  const Tensor pb = Tensor::from_f32(b, {3, 3}, DType::F16, Device::CPU);   // F16: widened, then rounded once
  const Tensor pc = Tensor::from_f32(c, {1, 3}, DType::BF16, Device::CPU);  // BF16: copied bit for bit
  Tensor dst = Tensor::empty({6, 3}, DType::BF16, Device::CPU);
  pack_rows_bf16(dst, {pa, pb, pc});
  const auto* bits = dst.view().ptr<const uint16_t>();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(bits[i], f32_to_bf16(a[i])) << i;
  for (int i = 0; i < 9; ++i)
    EXPECT_EQ(bits[6 + i], f32_to_bf16(f16_to_f32(pb.view().ptr<const uint16_t>()[i]))) << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(bits[15 + i], pc.view().ptr<const uint16_t>()[i]) << i;
  // A tie rounds to even: 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7.
  const Tensor tie =
      Tensor::from_f32({1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -0.0f}, {3}, DType::F32, Device::CPU);
  Tensor one = Tensor::empty({3}, DType::BF16, Device::CPU);
  pack_rows_bf16(one, {tie});
  EXPECT_EQ(one.view().ptr<const uint16_t>()[0], 0x3f80);
  EXPECT_EQ(one.view().ptr<const uint16_t>()[1], 0x3f82);
  EXPECT_EQ(one.view().ptr<const uint16_t>()[2], 0x8000);
}

TEST(PackRows, RejectsPartsThatDoNotStack) {
  const Tensor a = Tensor::from_f32(std::vector<float>(6, 1.0f), {2, 3}, DType::F32, Device::CPU);
  const Tensor b = Tensor::from_f32(std::vector<float>(8, 1.0f), {2, 4}, DType::F32, Device::CPU);
  Tensor dst = Tensor::empty({4, 3}, DType::BF16, Device::CPU);
  expect_input_error([&] { pack_rows_bf16(dst, {a, b}); }, {"does not stack"});
  expect_input_error([&] { pack_rows_bf16(dst, {a}); }, {"2 rows", "has 4"});
}

// ---- StepInputs and EngineLimits -------------------------------------------------------------------

ModelConfig tiny_config() { return ModelDir::open(testing::tiny_model_dir()).config; }

TEST(StepInputs, PositionsFollowTheLengths) {
  const ModelConfig c = tiny_config();
  StepInputs step(c, {16, 4, 4, 0}, Device::CPU);
  // Sequence 0: a 3-token prompt. Sequence 1: one new token after 6 earlier ones (a decode step).
  step.set({1, 2, 3, 4}, {3, 1}, {3, 7}, {2, 3});
  EXPECT_EQ(step.num_tokens(), 4);
  EXPECT_EQ(step.num_logits_rows(), 2);
  EXPECT_EQ(step.num_sequences(), 2);
  EXPECT_EQ(std::vector<int32_t>(step.host_positions(), step.host_positions() + 4),
            (std::vector<int32_t>{0, 1, 2, 6}));
  EXPECT_EQ(step.batch().cu_seqlens_q(), (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(step.batch().cu_seqlens_k(), (std::vector<int32_t>{0, 3, 10}));
  EXPECT_EQ(step.token_ids().shape, (Shape{4}));
  EXPECT_EQ(step.token_ids().device, Device::CPU);
}

TEST(StepInputs, RefusesABadStepAndKeepsThePreviousOne) {
  const ModelConfig c = tiny_config();
  StepInputs step(c, {8, 2, 2, 100}, Device::CPU);
  step.set({1, 2, 3}, {3}, {3}, {2});
  expect_input_error([&] { step.set({1, 2000}, {2}, {2}, {}); }, {"token id 2000", "vocabulary [0, 1000)"});
  expect_input_error([&] { step.set({1, -1}, {2}, {2}, {}); }, {"token id -1"});
  expect_input_error([&] { step.set(std::vector<int32_t>(9, 1), {9}, {9}, {}); },
                     {"9 tokens", "token budget of 8"});
  expect_input_error([&] { step.set({1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {}); }, {"3 sequences", "limit of 2"});
  expect_input_error([&] { step.set({1, 1}, {2}, {1}, {}); }, {"k_len 1"});
  expect_input_error([&] { step.set({1}, {1}, {101}, {}); }, {"101 tokens", "context limit of 100"});
  expect_input_error([&] { step.set({1, 1}, {2}, {2}, {2}); }, {"logits row 2"});
  expect_input_error([&] { step.set({1, 1}, {2}, {2}, {0, 1, 0}); }, {"3 logits rows", "limit of 2"});
  expect_input_error([&] { step.set({1, 1, 1}, {2}, {2}, {}); }, {"3 token ids for 2"});
  // Nothing of the failed calls leaked into the step.
  EXPECT_EQ(step.num_tokens(), 3);
  EXPECT_EQ(std::vector<int32_t>(step.host_token_ids(), step.host_token_ids() + 3),
            (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(step.batch().cu_seqlens_q(), (std::vector<int32_t>{0, 3}));
}

TEST(StepInputs, PrefillAttentionNeedsACacheForEarlierTokens) {
  const ModelDir model = ModelDir::open(testing::tiny_model_dir());
  CpuEngine e(model, 16);
  e.step.set({1, 2}, {2}, {5}, {1});  // 2 new tokens after 3 earlier ones
  expect_input_error([&] { forward(e.ctx, e.weights, e.step, e.attn); }, {"KV cache", "lesson 10"});
}

TEST(EngineLimits, CheckedAgainstTheConfig) {
  const ModelConfig c = tiny_config();
  EXPECT_EQ(EngineLimits{}.resolved(c).max_context, c.max_position_embeddings);
  expect_input_error(
      [&] {
        EngineLimits{16, 1, 1, c.max_position_embeddings + 1}.resolved(c);
      },
      {"max_context", "max_position_embeddings"});
  expect_input_error([&] { EngineLimits{0, 1, 1, 0}.resolved(c); }, {"max_tokens"});
  expect_input_error([&] { EngineLimits{4, 1, 5, 0}.resolved(c); }, {"max_logits_rows"});
  // The workspace is sized once from them: a step beyond them is refused, never reallocated.
  Workspace ws(c, {32, 2, 4, 64}, Device::CPU);
  EXPECT_EQ(ws.hidden.shape(), (Shape{32, c.hidden_size}));
  EXPECT_EQ(ws.logits.shape(), (Shape{4, c.vocab_size}));
  EXPECT_EQ(ws.qkv.numel(), 32 * (c.q_dim() + 2 * c.kv_dim()));
  EXPECT_EQ(ws.rope.max_positions(), 64);
}

TEST(ForwardFlops, CountsEveryMatmul) {
  ModelConfig c;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 2;
  c.vocab_size = 10;
  // Per token and layer: qkv 4x(4+2+2), o 4x4, gate|up 2x(6x4), down 6x4: 32+16+48+24 = 120 MACs.
  // Attention, one sequence of 3 new tokens after 2 earlier ones: 3*2 + 3*4/2 = 12 pairs x 2 heads x 2 x 2.
  // lm_head: 4 x 10 per row.
  EXPECT_DOUBLE_EQ(forward_flops(c, {3}, {5}, 1), 2 * (2.0 * 3 * 120) + 2 * 12 * 4.0 * 2 * 2 + 2.0 * 40);
}

// ---- the GPU bound: Hugging Face's bf16 noise floor from the manifest -----------------------------------

TEST(Bf16Floor, TheBundledManifestRecordsEveryPromptAndSequence) {
  const std::map<std::string, Bf16Floor> floors = read_bf16_floors(testing::tiny_model_dir());
  const ReferenceSet ref = ReferenceSet::open(testing::tiny_model_dir());
  for (int i = 0; i < ref.num_prompts(); ++i) {
    for (const std::string& name : {"p" + std::to_string(i), "g" + std::to_string(i)}) {
      const Bf16Floor* f = find_floor(floors, name);
      ASSERT_NE(f, nullptr) << name << ": rerun weights/tools/make_reference.py";
      // bf16 vs fp32 of a trained model: a real but small error (a few % of the logits' rms of ~4.5).
      EXPECT_GT(f->logits_max_abs_error, 0.01) << name;
      EXPECT_LT(f->logits_max_abs_error, 1.0) << name;
      EXPECT_LT(f->logits_rms_error, f->logits_max_abs_error) << name;
      EXPECT_GT(f->rows, 0) << name;
      EXPECT_LE(f->top1_agree, f->rows) << name;
      EXPECT_EQ(f->norm_max_abs_error >= 0, name[0] == 'p') << name;  // the norm: prompts only
    }
    EXPECT_EQ(find_floor(floors, "p" + std::to_string(i))->rows,
              static_cast<int64_t>(ref.prompt_ids(i).size()));
  }
  // On the bundled model the fixed part is the larger: 0.2 x rms (~0.9) > 1.5 x HF bf16 (<= 0.5).
  const Tensor want = Tensor::copy_of(ref.prompt(0, "logits"), Device::CPU, DType::F32);
  const GpuLogitBound b = gpu_logit_bound(rms(want), find_floor(floors, "p0"));
  EXPECT_DOUBLE_EQ(b.epsilon, kGpuLogitErrorPerRms * rms(want));
}

TEST(Bf16Floor, TheBoundIsTheLargerPart) {
  Bf16Floor f;
  f.logits_max_abs_error = 7.97;
  const GpuLogitBound chaotic = gpu_logit_bound(10.04, &f);  // HF's own bf16 error on a deep random model
  EXPECT_DOUBLE_EQ(chaotic.epsilon, kBf16FloorFactor * 7.97);
  EXPECT_DOUBLE_EQ(chaotic.clear_margin(), 2 * kBf16FloorFactor * 7.97);
  EXPECT_NE(chaotic.describe().find("HF bf16 7.97"), std::string::npos) << chaotic.describe();
  f.logits_max_abs_error = 0.1;
  EXPECT_DOUBLE_EQ(gpu_logit_bound(10.0, &f).epsilon, kGpuLogitErrorPerRms * 10.0);
  const GpuLogitBound fixed = gpu_logit_bound(10.0, nullptr);
  EXPECT_DOUBLE_EQ(fixed.epsilon, kGpuLogitErrorPerRms * 10.0);
  EXPECT_NE(fixed.describe().find("no HF bf16 floor"), std::string::npos) << fixed.describe();
}

TEST(Bf16Floor, AnOldManifestHasNoneAndABadOneIsAnError) {
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "reference");
  const auto manifest = dir.path() / "reference" / "manifest.json";
  testing::write_file(manifest, std::string(R"({"prompts": [{"name": "p0", "min_top1_margin": 1.0}],
    "generate": {"sequences": [{"name": "g0"}]}})"));
  EXPECT_TRUE(read_bf16_floors(dir.path()).empty());  // the fixed rule, with a notice
  testing::write_file(manifest, std::string(R"({"prompts": [{"name": "p0", "hf_bf16": {"logits_max_abs_error": "x"}}]})"));
  expect_input_error([&] { read_bf16_floors(dir.path()); }, {"manifest.json", "hf_bf16"});
  testing::write_file(manifest, std::string("{\"prompts\": ["));
  expect_input_error([&] { read_bf16_floors(dir.path()); }, {"manifest.json"});
  std::filesystem::remove(manifest);
  EXPECT_TRUE(read_bf16_floors(dir.path()).empty());  // no manifest at all: the fixed rule too
}

}  // namespace
}  // namespace tvllm
