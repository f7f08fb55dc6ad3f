// Lesson 01: WeightStore (single files, sharded index), ModelDir (config vs weights) and ReferenceSet,
// on files written by the test, then on the bundled model.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "common/tensor.h"
#include "model_dir.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::SafetensorsBuilder;
using testing::TempDir;
using testing::write_file;

template <class F>
void expect_input_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning: " << needle;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected it to mention: " << needle;
  }
}

// Two shards and their index: a,b in shard 1; c in shard 2.
void write_sharded(const fs::path& dir) {
  write_file(dir / "model-00001-of-00002.safetensors",
             SafetensorsBuilder().add("a", "F32", {2}, testing::f32_bytes({1.f, 2.f}))
                 .add("b", "BF16", {1}, testing::u16_bytes({0x4040}))  // 3.0
                 .build());
  write_file(dir / "model-00002-of-00002.safetensors",
             SafetensorsBuilder().add("c", "F16", {2}, testing::u16_bytes({0x4400, 0xC400})).build());  // 4, -4
  write_file(dir / "model.safetensors.index.json", std::string(R"({
    "metadata": {"total_size": 14},
    "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})"));
}

void write_index(const fs::path& dir, const std::string& weight_map) {
  write_file(dir / "model.safetensors.index.json", "{\"weight_map\": " + weight_map + "}");
}

TEST(WeightStore, OpensSingleFileByPathOrDirectory) {
  TempDir dir;
  write_file(dir / "model.safetensors", SafetensorsBuilder()
                                            .add("z", "F32", {1}, testing::f32_bytes({9.f}))
                                            .add("a", "BF16", {2}, testing::u16_bytes({0x3F80, 0x4000}))
                                            .build());
  for (const fs::path& p : {dir.path(), dir / "model.safetensors"}) {
    WeightStore w = WeightStore::open(p);
    EXPECT_EQ(w.names(), (std::vector<std::string>{"a", "z"}));  // sorted
    EXPECT_EQ(w.size(), 2u);
    EXPECT_TRUE(w.contains("a"));
    EXPECT_FALSE(w.contains("b"));
    EXPECT_EQ(w.total_tensor_bytes(), 8u);
    ASSERT_EQ(w.files().size(), 1u);
    EXPECT_EQ(w.entry("a").dtype, DType::BF16);
    EXPECT_EQ(to_f32_vector(w.host("a")), (std::vector<float>{1.f, 2.f}));
    EXPECT_EQ(to_f32_vector(w.get("z", Device::CPU)), (std::vector<float>{9.f}));
    EXPECT_FALSE(w.on_device());
    EXPECT_EQ(w.device_bytes(), 0u);
    expect_input_error([&] { w.entry("b"); }, "no tensor named \"b\"");
    expect_input_error([&] { w.device("a"); }, "call upload_to_device() first");
  }
}

TEST(WeightStore, OpensShardedIndex) {
  TempDir dir;
  write_sharded(dir.path());
  for (const fs::path& p : {dir.path(), dir / "model.safetensors.index.json"}) {
    WeightStore w = WeightStore::open(p);
    EXPECT_EQ(w.names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_EQ(w.files().size(), 2u);
    EXPECT_EQ(w.total_tensor_bytes(), 14u);
    EXPECT_EQ(to_f32_vector(w.host("a")), (std::vector<float>{1.f, 2.f}));
    EXPECT_EQ(to_f32_vector(w.host("b")), (std::vector<float>{3.f}));
    EXPECT_EQ(to_f32_vector(w.host("c")), (std::vector<float>{4.f, -4.f}));
    EXPECT_EQ(w.file_of("c").path().filename(), "model-00002-of-00002.safetensors");
    EXPECT_EQ(w.shard(0).entries().size() + w.shard(1).entries().size(), 3u);
  }
}

TEST(WeightStore, IndexIsPreferredOverASingleFileInTheSameDirectory) {
  TempDir dir;
  write_sharded(dir.path());
  write_file(dir / "model.safetensors", SafetensorsBuilder().add("only", "U8", {1}, {1}).build());
  EXPECT_EQ(WeightStore::open(dir.path()).size(), 3u);
}

TEST(WeightStore, RejectsMissingShard) {
  TempDir dir;
  write_sharded(dir.path());
  fs::remove(dir / "model-00002-of-00002.safetensors");
  expect_input_error([&] { WeightStore::open(dir.path()); },
                     "shard \"model-00002-of-00002.safetensors\" named in weight_map does not exist");
}

TEST(WeightStore, RejectsTensorMissingFromItsShard) {
  TempDir dir;
  write_sharded(dir.path());
  write_index(dir.path(), R"({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                             "c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"})");
  expect_input_error([&] { WeightStore::open(dir.path()); },
                     "weight_map puts tensor \"d\" in model-00002-of-00002.safetensors, but");
  // listed in the wrong shard
  write_index(dir.path(), R"({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                             "c": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"})");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "puts tensor \"c\" in model-00001-of-00002.safetensors");
}

TEST(WeightStore, RejectsTensorNotInTheIndex) {
  TempDir dir;
  write_sharded(dir.path());
  write_index(dir.path(), R"({"a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"})");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "tensor \"b\" is not listed in");
}

TEST(WeightStore, RejectsTensorStoredInTwoShards) {
  TempDir dir;
  write_sharded(dir.path());
  write_file(dir / "model-00002-of-00002.safetensors",
             SafetensorsBuilder().add("c", "F16", {1}, testing::u16_bytes({0})).add("a", "F32", {1}, testing::f32_bytes({0.f})).build());
  expect_input_error([&] { WeightStore::open(dir.path()); }, "tensor \"a\" is stored twice");
}

TEST(WeightStore, RejectsShardNamesThatEscapeTheDirectory) {
  TempDir dir;
  write_sharded(dir.path());
  for (const char* bad : {"../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ""}) {
    write_index(dir.path(), std::string("{\"a\": \"") + bad + "\"}");
    expect_input_error([&] { WeightStore::open(dir.path()); }, "a shard must be a plain file name");
  }
}

TEST(WeightStore, RejectsMalformedIndex) {
  TempDir dir;
  write_sharded(dir.path());
  const fs::path index = dir / "model.safetensors.index.json";
  write_file(index, std::string("{\"weight_map\": {\"a\": "));
  expect_input_error([&] { WeightStore::open(dir.path()); }, "not valid JSON");
  write_file(index, std::string("[]"));
  expect_input_error([&] { WeightStore::open(dir.path()); }, "must be a JSON object");
  write_file(index, std::string("{\"metadata\": {}}"));
  expect_input_error([&] { WeightStore::open(dir.path()); }, "missing \"weight_map\"");
  write_index(dir.path(), "[\"a\"]");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "\"weight_map\" must be a non-empty object");
  write_index(dir.path(), "{}");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "\"weight_map\" must be a non-empty object");
  write_index(dir.path(), "{\"a\": 1}");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "weight_map[\"a\"] must be a file name string");
  write_index(dir.path(), R"({"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"})");
  expect_input_error([&] { WeightStore::open(dir.path()); }, "duplicate key \"a\"");
}

TEST(WeightStore, RejectsMissingOrEmptyPaths) {
  TempDir dir;
  expect_input_error([&] { WeightStore::open(dir.path()); }, "no model.safetensors or model.safetensors.index.json");
  expect_input_error([&] { WeightStore::open(dir / "nope.safetensors"); }, "no such file or directory");
  write_file(dir / "bad.safetensors", Bytes{8, 0, 0, 0, 0, 0, 0, 0, '{', '}'});
  expect_input_error([&] { WeightStore::open(dir / "bad.safetensors"); }, "runs past the end of the file");
}

// ---- ModelDir --------------------------------------------------------------------------------------------

TEST(ModelDir, OpensASyntheticLlama) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  ModelDir m = ModelDir::open(dir.path());
  EXPECT_EQ(m.config.hidden_size, 8);
  EXPECT_EQ(m.config.q_dim(), 12);  // != hidden: shapes are checked against q_dim, not hidden
  EXPECT_EQ(m.weights.size(), spec.weights().size());
  EXPECT_EQ(m.weights.entry("model.layers.1.self_attn.o_proj.weight").shape, (Shape{8, 12}));
  EXPECT_FALSE(m.weights.contains("lm_head.weight"));  // tied
}

TEST(ModelDir, LoadsEveryFloatDtype) {
  for (const char* dt : {"BF16", "F16", "F32"}) {
    TempDir dir;
    testing::SyntheticLlama spec;
    spec.dtype = dt;
    spec.tied = false;
    spec.write(dir.path());
    ModelDir m = ModelDir::open(dir.path());
    EXPECT_EQ(dtype_name(m.weights.entry("lm_head.weight").dtype), dt);
    // bytes in the view are exactly the bytes written
    auto names = spec.weights();
    Bytes expect = spec.tensor_bytes(0, names[0].second);
    TensorView v = m.weights.host(names[0].first);
    ASSERT_EQ(v.nbytes(), expect.size());
    EXPECT_EQ(std::memcmp(v.data, expect.data(), expect.size()), 0) << dt;
  }
}

TEST(ModelDir, RejectsWeightsThatDisagreeWithConfig) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  // config says 3 layers; the file has 2
  testing::SyntheticLlama three = spec;
  three.layers = 3;
  write_file(dir / "config.json", three.config_json());
  expect_input_error([&] { ModelDir::open(dir.path()); }, "no tensor \"model.layers.2.input_layernorm.weight\"");
  // config says 2 KV heads; k_proj has 1 head's rows
  testing::SyntheticLlama kv = spec;
  kv.kv_heads = 2;
  write_file(dir / "config.json", kv.config_json());
  expect_input_error([&] { ModelDir::open(dir.path()); },
                     "tensor \"model.layers.0.self_attn.k_proj.weight\" has shape [6, 8], but config.json implies [12, 8]");
  // untied config without lm_head in the file
  testing::SyntheticLlama untied = spec;
  untied.tied = false;
  write_file(dir / "config.json", untied.config_json());
  expect_input_error([&] { ModelDir::open(dir.path()); }, "no tensor \"lm_head.weight\"");
}

TEST(ModelDir, RejectsIntegerWeights) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  SafetensorsBuilder sb;
  auto w = spec.weights();
  for (size_t i = 0; i < w.size(); ++i) {
    bool norm = w[i].first == "model.norm.weight";
    sb.add(w[i].first, norm ? "I16" : "BF16", w[i].second, spec.tensor_bytes(i, w[i].second));
  }
  write_file(dir / "model.safetensors", sb.build());
  expect_input_error([&] { ModelDir::open(dir.path()); }, "\"model.norm.weight\" is I16; model weights must be BF16, F16 or F32");
}

TEST(ModelDir, RejectsMissingPieces) {
  TempDir dir;
  expect_input_error([&] { ModelDir::open(dir / "nope"); }, "no such directory");
  expect_input_error([&] { ModelDir::open(dir.path()); }, "no config.json");
  write_file(dir / "file", std::string("x"));
  expect_input_error([&] { ModelDir::open(dir / "file"); }, "not a directory");
  testing::SyntheticLlama().write(dir / "m");
  fs::remove(dir / "m" / "model.safetensors");
  expect_input_error([&] { ModelDir::open(dir / "m"); }, "no model.safetensors");
}

// ---- ReferenceSet -------------------------------------------------------------------------------------

TEST(ReferenceSet, FindsPromptsAndCapturedLayers) {
  TempDir dir;
  fs::create_directories(dir / "reference");
  write_file(dir / "reference" / "activations.safetensors",
             SafetensorsBuilder()
                 .add("p0.input_ids", "I32", {3}, testing::i32_bytes({5, 6, 7}))
                 .add("p1.input_ids", "I32", {2}, testing::i32_bytes({9, 10}))
                 .add("p0.layers.0.input_layernorm", "F32", {3, 2}, testing::f32_bytes({1, 2, 3, 4, 5, 6}))
                 .add("p0.layers.11.input_layernorm", "F32", {3, 2}, testing::zeros(24))
                 .add("p0.layers.11.output", "F32", {3, 2}, testing::zeros(24))
                 .add("p1.embed_tokens", "F32", {2, 2}, testing::f32_bytes({0.5f, 1.5f, 2.5f, 3.5f}))
                 .add("p3.input_ids", "I32", {1}, testing::i32_bytes({1}))  // p2 missing: counting stops at 2
                 .build());
  ReferenceSet r = ReferenceSet::open(dir.path());
  EXPECT_EQ(r.num_prompts(), 2);
  EXPECT_EQ(r.captured_layers(), (std::vector<int>{0, 11}));
  EXPECT_EQ(r.prompt_ids(0), (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(r.prompt_ids(1), (std::vector<int32_t>{9, 10}));
  EXPECT_TRUE(r.has("p1.embed_tokens"));
  EXPECT_FALSE(r.has("p1.nothing"));
  EXPECT_EQ(to_f32_vector(r.prompt(1, "embed_tokens")), (std::vector<float>{0.5f, 1.5f, 2.5f, 3.5f}));
  EXPECT_EQ(r.get("p0.layers.0.input_layernorm").shape, (Shape{3, 2}));
  EXPECT_EQ(r.generations(), nullptr);
  expect_input_error([&] { r.get("p0.logits"); }, "no reference tensor \"p0.logits\"");
  expect_input_error([&] { r.prompt(2, "embed_tokens"); }, "prompt 2 of 2");
}

TEST(ReferenceSet, RejectsMissingOrMalformedReferences) {
  TempDir dir;
  expect_input_error([&] { ReferenceSet::open(dir.path()); }, "activations.safetensors: no such file");
  fs::create_directories(dir / "reference");
  write_file(dir / "reference" / "activations.safetensors",
             SafetensorsBuilder().add("p0.embed_tokens", "F32", {1}, testing::zeros(4)).build());
  expect_input_error([&] { ReferenceSet::open(dir.path()); }, "no prompts");
  write_file(dir / "reference" / "activations.safetensors",
             SafetensorsBuilder().add("p0.input_ids", "F32", {1}, testing::zeros(4)).build());
  expect_input_error([&] { ReferenceSet::open(dir.path()); }, "\"p0.input_ids\" must be I32[T]");
  write_file(dir / "reference" / "activations.safetensors", Bytes{1, 2, 3});
  expect_input_error([&] { ReferenceSet::open(dir.path()); }, "too short");
}

// ---- the bundled model ------------------------------------------------------------------------------

TEST(BundledModel, OpensWithTheDocumentedShapes) {
  const fs::path dir = testing::tiny_model_dir();
  if (!fs::exists(dir / "config.json")) GTEST_SKIP() << dir << " is not there yet (weights/tools/make_tiny_model.py)";
  ModelDir m = ModelDir::open(dir);
  const ModelConfig& c = m.config;
  // weights/tools/make_tiny_model.py's deliberately awkward shapes: q_dim != hidden, head_dim != hidden/heads
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 384);
  EXPECT_NE(c.q_dim(), c.hidden_size);
  EXPECT_EQ(c.intermediate_size, 600);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.rope_type, "llama3");
  EXPECT_EQ(m.weights.entry("model.embed_tokens.weight").dtype, DType::BF16);
  EXPECT_EQ(m.weights.entry("model.embed_tokens.weight").shape, (Shape{c.vocab_size, c.hidden_size}));
  EXPECT_EQ(m.weights.entry("model.layers.1.self_attn.o_proj.weight").shape, (Shape{c.hidden_size, 384}));
  // 1 embedding + 9 per layer + final norm (tied: no lm_head)
  EXPECT_EQ(m.weights.size(), 1u + 9u * 2u + 1u);
}

TEST(BundledModel, WeightsMatchTheManifestChecksums) {
  const fs::path dir = testing::tiny_model_dir();
  const fs::path manifest_path = dir / "reference" / "manifest.json";
  if (!fs::exists(manifest_path)) GTEST_SKIP() << manifest_path << " is not there yet (weights/tools/make_reference.py)";
  ModelDir m = ModelDir::open(dir);
  MappedFile f(manifest_path);
  auto manifest = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(f.data()), f.size()));
  ASSERT_TRUE(manifest.contains("weights"));  // make_reference.py: {"weights": {name: {..., "fnv1a64"}}}
  const auto& table = manifest["weights"];
  EXPECT_EQ(table.size(), m.weights.size());
  for (const std::string& name : m.weights.names()) {
    ASSERT_TRUE(table.contains(name)) << name;
    const SafetensorsEntry& e = m.weights.entry(name);
    std::string ours = fnv1a64_hex(fnv1a64(m.weights.file_of(name).tensor_bytes(e), e.end - e.begin));
    EXPECT_EQ(table[name]["fnv1a64"].get<std::string>(), ours) << name;
    EXPECT_EQ(table[name]["dtype"].get<std::string>(), dtype_name(e.dtype)) << name;
    EXPECT_EQ(table[name]["shape"].get<std::vector<int64_t>>(), e.shape) << name;
  }
}

TEST(BundledModel, ReferencesOpen) {
  const fs::path dir = testing::tiny_model_dir();
  if (!fs::exists(dir / "reference" / "activations.safetensors"))
    GTEST_SKIP() << "no reference outputs in " << dir << " yet (weights/tools/make_reference.py)";
  ModelDir m = ModelDir::open(dir);
  ReferenceSet r = ReferenceSet::open(dir);
  EXPECT_GE(r.num_prompts(), 1);
  EXPECT_EQ(r.captured_layers(), (std::vector<int>{0, static_cast<int>(m.config.num_hidden_layers) - 1}));
  std::vector<int32_t> ids = r.prompt_ids(0);
  ASSERT_FALSE(ids.empty());
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, m.config.vocab_size);
  }
  TensorView emb = r.prompt(0, "embed_tokens");
  EXPECT_EQ(emb.shape, (Shape{static_cast<int64_t>(ids.size()), m.config.hidden_size}));
  EXPECT_EQ(emb.dtype, DType::F32);
}

}  // namespace
}  // namespace tvllm
