// Lesson 01 through the programs a user runs: `tiny-vllm inspect` and `lesson01_safetensors`.
// Exit codes are the contract: 0 success, 1 a failed check, 2 bad input (with a message naming the file and
// the problem), 77 --device cuda without a GPU. A crash (a signal) shows up as exit_code -1 and fails.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/device.h"
#include "common/tensor.h"
#include "safetensors.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::run_command;
using testing::SafetensorsBuilder;
using testing::TempDir;

std::string tiny_vllm() { return (testing::bin_dir() / "tiny-vllm").string(); }
std::string lesson01() { return (testing::bin_dir() / "lesson01_safetensors").string(); }
std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(InspectCli, PrintsTheTensorTableOfAFile) {
  TempDir dir;
  testing::write_file(dir / "t.safetensors", SafetensorsBuilder()
                                                 .metadata("format", "pt")
                                                 .add("model.layers.10.w", "BF16", {2, 3}, testing::zeros(12))
                                                 .add("model.layers.2.w", "F32", {4}, testing::zeros(16))
                                                 .build());
  auto r = run_command(tiny_vllm() + " inspect " + q(dir / "t.safetensors"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "model.layers.10.w")) << r.output;
  EXPECT_TRUE(contains(r.output, "BF16")) << r.output;
  EXPECT_TRUE(contains(r.output, "[2, 3]")) << r.output;
  EXPECT_TRUE(contains(r.output, "2 tensors, 10 parameters, 28 bytes")) << r.output;
  EXPECT_TRUE(contains(r.output, "metadata: format = pt")) << r.output;
  // natural order: layer 2 before layer 10
  EXPECT_LT(r.output.find("model.layers.2.w"), r.output.find("model.layers.10.w")) << r.output;
}

TEST(InspectCli, JsonOutputIsMachineReadable) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  auto r = run_command(tiny_vllm() + " inspect --json " + q(dir.path()) + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["total"]["tensors"].get<size_t>(), spec.weights().size());
  EXPECT_EQ(j["tensors"].size(), spec.weights().size());
  EXPECT_EQ(j["tensors"][0]["name"], "model.embed_tokens.weight");
  EXPECT_EQ(j["tensors"][0]["dtype"], "BF16");
  EXPECT_EQ(j["tensors"][0]["shape"], nlohmann::json::array({16, 8}));
  EXPECT_EQ(j["tensors"][0]["bytes"], 16 * 8 * 2);
  EXPECT_EQ(j["config"]["hidden_size"], 8);
  EXPECT_EQ(j["config"]["num_key_value_heads"], 1);
  uint64_t params = 0;
  for (const auto& [name, shape] : spec.weights()) params += static_cast<uint64_t>(shape_numel(shape));
  EXPECT_EQ(j["total"]["parameters"].get<uint64_t>(), params);
}

TEST(InspectCli, ShowsTheConfigSummaryOfAModelDirectory) {
  TempDir dir;
  testing::SyntheticLlama().write(dir.path());
  auto r = run_command(tiny_vllm() + " inspect " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "config.json: llama, 2 layers, hidden 8")) << r.output;
  EXPECT_TRUE(contains(r.output, "2 heads, 1 KV heads")) << r.output;
}

TEST(InspectCli, ShardedModelsListTheirFiles) {
  TempDir dir;
  testing::write_file(dir / "s1.safetensors", SafetensorsBuilder().add("a", "U8", {1}, {1}).build());
  testing::write_file(dir / "s2.safetensors", SafetensorsBuilder().add("b", "U8", {2}, {1, 2}).build());
  testing::write_file(dir / "model.safetensors.index.json",
                      std::string(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})"));
  auto r = run_command(tiny_vllm() + " inspect " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "s2.safetensors")) << r.output;
  EXPECT_TRUE(contains(r.output, "in 2 files")) << r.output;
}

TEST(InspectCli, MalformedFilesExitTwoNamingFileAndProblem) {
  TempDir dir;
  struct Case {
    std::string file;
    Bytes bytes;
    std::string problem;
  };
  const std::string e = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const Case cases[] = {
      {"short.safetensors", Bytes{1, 2}, "too short"},
      {"trailing.safetensors", testing::raw_safetensors(e, testing::zeros(6)), "2 trailing bytes"},
      {"huge.safetensors", testing::raw_safetensors(e, testing::zeros(4), int64_t{1} << 40), "limit"},
      {"notjson.safetensors", testing::raw_safetensors("{oops", {}), "not valid JSON"},
      {"dtype.safetensors",
       testing::raw_safetensors(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", testing::zeros(1)),
       "unknown dtype \"Q4\""},
      {"overflow.safetensors",
       testing::raw_safetensors(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", {}),
       "overflows"},
  };
  for (const Case& c : cases) {
    testing::write_file(dir / c.file, c.bytes);
    auto r = run_command(tiny_vllm() + " inspect " + q(dir / c.file));
    EXPECT_EQ(r.exit_code, 2) << c.file << ": " << r.output;
    EXPECT_TRUE(contains(r.output, (dir / c.file).string())) << r.output;
    EXPECT_TRUE(contains(r.output, c.problem)) << c.file << ": " << r.output;
  }
}

TEST(InspectCli, BadUsageAndMissingPathsExitTwo) {
  auto r = run_command(tiny_vllm() + " inspect /nonexistent/model.safetensors");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "/nonexistent/model.safetensors: no such file")) << r.output;
  r = run_command(tiny_vllm() + " inspect");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_command(tiny_vllm() + " inspect a b");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_command(tiny_vllm());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = run_command(tiny_vllm() + " inspect --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // a model directory with a bad config.json
  TempDir dir;
  testing::SyntheticLlama().write(dir.path());
  testing::write_file(dir / "config.json", std::string(R"({"model_type": "llama", "hidden_size": "8"})"));
  r = run_command(tiny_vllm() + " inspect " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "config.json: missing required field \"vocab_size\"")) << r.output;
}

// ---- the lesson executable ----------------------------------------------------------------------------

// A synthetic model directory with a manifest in make_reference.py's format.
void write_manifest(const fs::path& dir, const testing::SyntheticLlama& spec, bool tamper) {
  nlohmann::json weights = nlohmann::json::object();
  auto w = spec.weights();
  for (size_t i = 0; i < w.size(); ++i) {
    Bytes b = spec.tensor_bytes(i, w[i].second);
    uint64_t h = fnv1a64(b.data(), b.size());
    if (tamper && i == 3) h ^= 1;
    weights[w[i].first] = {{"file", "model.safetensors"}, {"dtype", spec.dtype}, {"shape", w[i].second},
                           {"nbytes", b.size()}, {"fnv1a64", fnv1a64_hex(h)}};
  }
  fs::create_directories(dir / "reference");
  testing::write_file(dir / "reference" / "manifest.json", nlohmann::json{{"weights", weights}}.dump(1));
}

TEST(Lesson01Cli, PassesOnAModelWithAMatchingManifest) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  write_manifest(dir.path(), spec, false);
  auto r = run_command(lesson01() + " --device cpu --model " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "model.layers.1.mlp.down_proj.weight")) << r.output;
  EXPECT_FALSE(contains(r.output, "FAIL")) << r.output;
}

TEST(Lesson01Cli, FailsWhenAChecksumDiffers) {
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  write_manifest(dir.path(), spec, true);
  auto r = run_command(lesson01() + " --device cpu --model " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "FAIL")) << r.output;
  EXPECT_TRUE(contains(r.output, "fnv1a64")) << r.output;
}

TEST(Lesson01Cli, BadInputExitsTwo) {
  TempDir dir;
  auto r = run_command(lesson01() + " --device cpu --model " + q(dir / "missing"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "no such directory")) << r.output;
  testing::SyntheticLlama().write(dir / "m");
  testing::write_file(dir / "m" / "model.safetensors", Bytes{0, 0, 0, 0});
  r = run_command(lesson01() + " --device cpu --model " + q(dir / "m"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "model.safetensors: file is 4 bytes")) << r.output;
  r = run_command(lesson01() + " --device tpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

TEST(Lesson01Cli, CudaWithoutAGpuIsASkip) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present: the skip path cannot be exercised";
  TempDir dir;
  testing::SyntheticLlama().write(dir.path());
  auto r = run_command(lesson01() + " --device cuda --model " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 77) << r.output;
}

TEST(Lesson01Cli, CudaRoundTripPasses) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU available";
  TempDir dir;
  testing::SyntheticLlama spec;
  spec.write(dir.path());
  write_manifest(dir.path(), spec, false);
  auto r = run_command(lesson01() + " --device cuda --model " + q(dir.path()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "device copies byte-identical")) << r.output;
}

TEST(Lesson01Cli, BundledModelPasses) {
  if (!fs::exists(testing::tiny_model_dir() / "config.json")) GTEST_SKIP() << "weights/tiny-llama3 is not there yet";
  auto r = run_command(lesson01() + " --device cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = run_command(tiny_vllm() + " inspect " + q(testing::tiny_model_dir()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "model.embed_tokens.weight")) << r.output;
}

}  // namespace
}  // namespace tvllm
