// Lesson 16 through the product: `tiny-vllm quantize` writes an FP8 checkpoint of the bundled model,
// `tiny-vllm generate` runs it (lesson 01 dequantizes at load), and bad requests exit 2 with a message.
// The greedy ids of the FP8 model beside the bf16 ones are reported (RecordProperty and stdout); they are
// not required to be equal in general, but on this prompt both must finish the sentence the same way
// (the model's top-1/top-2 margins are large: weights/README.md).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "testing/cli.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

std::string tiny_vllm() { return testing::tiny_vllm_bin(); }
const auto q = testing::shell_quote;
std::string model() { return testing::tiny_model_arg(); }
using testing::contains;

namespace fs = std::filesystem;
using testing::run_command;
using testing::TempDir;


// The last line of the output that parses as a JSON object (generate --output json prints one).
nlohmann::json json_line(const std::string& output) {
  std::istringstream in(output);
  nlohmann::json found;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') found = nlohmann::json::parse(line, nullptr, false);
  }
  return found;
}

TEST(Cli16, QuantizeThenGenerateGreedy) {
  TempDir tmp;
  const std::string out = (tmp / "fp8").string();
  const auto r = run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "quantized 14 Linear weights to F8_E4M3")) << r.output;
  const auto inspect = run_command(tiny_vllm() + " inspect " + q(out));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_TRUE(contains(inspect.output, "model.layers.0.self_attn.q_proj.weight_scale")) << inspect.output;
  EXPECT_TRUE(contains(inspect.output, "F8_E4M3")) << inspect.output;

  const std::string args = " --prompt 'The capital of Portugal is' --max-tokens 16 --device cpu --output json";
  const auto a = run_command(tiny_vllm() + " generate --model " + model() + args);
  const auto b = run_command(tiny_vllm() + " generate --model " + q(out) + args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const nlohmann::json ja = json_line(a.output), jb = json_line(b.output);
  ASSERT_TRUE(ja.is_object() && jb.is_object()) << a.output << b.output;
  EXPECT_EQ(ja["prompt_ids"], jb["prompt_ids"]);
  std::printf("greedy ids, bf16 weights: %s\ngreedy ids, FP8 weights:  %s\n", ja["ids"].dump().c_str(),
              jb["ids"].dump().c_str());
  RecordProperty("bf16_ids", ja["ids"].dump());
  RecordProperty("fp8_ids", jb["ids"].dump());
  EXPECT_EQ(jb["text"], ja["text"]);  // " Lisbon." both
}

TEST(Cli16, QuantizeRefusals) {
  TempDir tmp;
  const std::string out = (tmp / "fp8").string();
  ASSERT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out)).exit_code, 0);
  // an FP8 checkpoint is not quantized again
  auto r = run_command(tiny_vllm() + " quantize --model " + q(out) + " --out " + q((tmp / "again").string()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "already has a quantization_config")) << r.output;
  // the output directory is not overwritten
  r = run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "exists and is not an empty directory")) << r.output;
  // unknown scheme / strategy: usage errors
  EXPECT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q((tmp / "x").string()) +
                        " --scheme int4").exit_code, 2);
  EXPECT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q((tmp / "x").string()) +
                        " --strategy block").exit_code, 2);
  // a config with an unsupported field: generate refuses it, naming the field
  std::ifstream in(fs::path(out) / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128;
  std::ofstream(fs::path(out) / "config.json") << config.dump(2);
  r = run_command(tiny_vllm() + " generate --model " + q(out) + " --prompt hi --max-tokens 2 --device cpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "quantization_config.config_groups.group_0.weights.group_size is 128")) << r.output;
}

// --fp8-weights (lesson 16, "FP8 in the engine"): on the CPU an FP8 checkpoint is always dequantized at load; asking
// for resident weights where they cannot be is a clear refusal (exit 2), never a silent fallback.
TEST(Cli16, Fp8WeightsFlagOnTheCpuAndItsRefusals) {
  TempDir tmp;
  const std::string out = (tmp / "fp8").string();
  ASSERT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out)).exit_code, 0);
  const std::string args = " --prompt hi --max-tokens 2 --device cpu --output json";
  for (const std::string choice : {"", " --fp8-weights auto", " --fp8-weights dequantize"}) {
    SCOPED_TRACE(choice);
    const auto r = run_command(tiny_vllm() + " generate --model " + q(out) + args + choice);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(json_line(r.output)["path"].get<std::string>(), "FP8 weights dequantized to bf16 at load"))
        << r.output;
  }
  // A bf16 checkpoint says nothing about FP8.
  auto r = run_command(tiny_vllm() + " generate --model " + model() + args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(json_line(r.output)["path"].get<std::string>(), "FP8")) << r.output;
  // resident on the CPU; resident for a bf16 checkpoint; an unknown choice.
  r = run_command(tiny_vllm() + " generate --model " + q(out) + args + " --fp8-weights resident");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "FP8 weights stay resident only on CUDA")) << r.output;
  r = run_command(tiny_vllm() + " generate --model " + model() + args + " --fp8-weights resident");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "not an FP8 checkpoint")) << r.output;
  r = run_command(tiny_vllm() + " generate --model " + q(out) + args + " --fp8-weights sometimes");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--fp8-weights")) << r.output;
  // The benches and the server take the same flag, with the same refusal.
  r = run_command(tiny_vllm() + " bench latency --model " + q(out) +
                  " --device cpu --context 4 --output-len 2 --prefill-len 4 --iters 1 --fp8-weights resident");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "FP8 weights stay resident only on CUDA")) << r.output;
  r = run_command(tiny_vllm() + " serve --model " + q(out) + " --device cpu --port 0 --fp8-weights resident");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "FP8 weights stay resident only on CUDA")) << r.output;
}

// --fp8-gemm (lesson 16, README 7.3): parsed by generate, chat, serve and both benches; an unknown choice is a usage
// error (exit 2 naming the flag); scale-vectors / epilogue need resident weights, which the CPU never has (exit 2
// saying so); auto and dequantize pass anywhere. bench throughput's JSON says which path was installed and what ran.
TEST(Cli16, Fp8GemmFlagParsingAndItsRefusals) {
  TempDir tmp;
  const std::string out = (tmp / "fp8").string();
  ASSERT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out)).exit_code, 0);
  const std::string args = " --prompt hi --max-tokens 2 --device cpu --output json";
  for (const std::string cmd : {" generate", " chat"}) {
    SCOPED_TRACE(cmd);
    auto r = run_command(tiny_vllm() + cmd + " --model " + q(out) + " --device cpu --fp8-gemm sometimes");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--fp8-gemm")) << r.output;
  }
  for (const std::string choice : {" --fp8-gemm auto", " --fp8-gemm dequantize"}) {
    SCOPED_TRACE(choice);
    const auto r = run_command(tiny_vllm() + " generate --model " + q(out) + args + choice);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  for (const std::string choice : {" --fp8-gemm epilogue", " --fp8-gemm scale-vectors"}) {
    SCOPED_TRACE(choice);
    auto r = run_command(tiny_vllm() + " generate --model " + q(out) + args + choice);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--fp8-weights resident")) << r.output;
    r = run_command(tiny_vllm() + " bench latency --model " + q(out) +
                    " --device cpu --context 4 --output-len 2 --prefill-len 4 --iters 1" + choice);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    r = run_command(tiny_vllm() + " serve --model " + q(out) + " --device cpu --port 0" + choice);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--fp8-weights resident")) << r.output;
  }
  const auto r = run_command(tiny_vllm() + " bench throughput --model " + q(out) +
                             " --device cpu --num-requests 2 --min-len 4 --max-len 12 --output json --fp8-gemm auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = json_line(r.output);
  ASSERT_TRUE(j.contains("fp8_gemm")) << r.output;
  EXPECT_EQ(j["fp8_gemm"]["path"], "dequantize") << r.output;  // nothing installed: the CPU dequantizes at load
  EXPECT_EQ(j["fp8_gemm"]["calls"]["epilogue"], 0) << r.output;
  EXPECT_EQ(j["fp8_weights"], "dequantize") << r.output;
}

// --fp8-lm-head (lesson 16, README 7.4): an FP8 copy of the lm_head for the FP8 decode GEMVs, so only with resident
// FP8 weights, which the CPU never has: every command that takes the flag refuses it (exit 2, naming it) before
// loading anything, for an FP8 checkpoint (dequantized here) and for a bf16 one alike.
TEST(Cli16, Fp8LmHeadNeedsResidentWeights) {
  TempDir tmp;
  const std::string out = (tmp / "fp8").string();
  ASSERT_EQ(run_command(tiny_vllm() + " quantize --model " + model() + " --out " + q(out)).exit_code, 0);
  for (const std::string dir : {q(out), model()}) {
    for (const std::string cmd :
         {" generate --prompt hi --max-tokens 2", " chat", " serve --port 0",
          " bench latency --context 4 --output-len 2 --prefill-len 4 --iters 1",
          " bench throughput --num-requests 2 --min-len 4 --max-len 12"}) {
      SCOPED_TRACE(dir + cmd);
      const auto r = run_command(tiny_vllm() + cmd + " --model " + dir + " --device cpu --fp8-lm-head");
      EXPECT_EQ(r.exit_code, 2) << r.output;
      EXPECT_TRUE(contains(r.output, "--fp8-lm-head: needs FP8 weights resident")) << r.output;
    }
  }
  // Without the flag nothing changes: the same generate runs.
  const auto r = run_command(tiny_vllm() + " generate --model " + q(out) + " --prompt hi --max-tokens 2 --device cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace tvllm

namespace tvllm {
namespace {

TEST(Cli16, KvCacheDtypeFp8RunsTheEngineAndIsRefusedWhereItCannotRun) {
  // bench throughput (the engine's paged pool) takes it and says so; the JSON names it.
  const std::string bench = testing::tiny_vllm_bin() + " bench throughput --model " + testing::tiny_model_arg() +
                            " --device cpu --num-requests 4 --min-len 4 --max-len 12 --output json";
  const auto fp8 = testing::run_command(bench + " --kv-cache-dtype fp8");
  ASSERT_EQ(fp8.exit_code, 0) << fp8.output;
  EXPECT_TRUE(testing::contains(fp8.output, "FP8 KV cache (E4M3, scales 1.0)")) << fp8.output;
  EXPECT_TRUE(testing::contains(fp8.output, "E4M3-rounded")) << fp8.output;
  EXPECT_TRUE(testing::contains(fp8.output, "\"kv_cache_dtype\":\"fp8\"")) << fp8.output;
  const auto plain = testing::run_command(bench);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_TRUE(testing::contains(plain.output, "\"kv_cache_dtype\":\"auto\"")) << plain.output;
  // Where it cannot run: a clear message and a failing exit code, never a crash.
  const auto contiguous = testing::run_command(bench + " --kv-cache-dtype fp8 --kv contiguous");
  EXPECT_NE(contiguous.exit_code, 0);
  EXPECT_TRUE(testing::contains(contiguous.output, "needs --kv paged")) << contiguous.output;
  const auto invariant = testing::run_command(bench + " --kv-cache-dtype fp8 --batch-invariant");
  EXPECT_NE(invariant.exit_code, 0);
  EXPECT_TRUE(testing::contains(invariant.output, "--batch-invariant")) << invariant.output;
  const auto gen = testing::run_command(testing::tiny_vllm_bin() + " generate --model " + testing::tiny_model_arg() +
                                        " --prompt 'The capital of Portugal is' --max-tokens 4 --device cpu "
                                        "--kv-cache-dtype fp8");
  EXPECT_NE(gen.exit_code, 0);
  EXPECT_TRUE(testing::contains(gen.output, "tiny-vllm serve, tiny-vllm bench throughput")) << gen.output;
  const auto bad = testing::run_command(bench + " --kv-cache-dtype fp16");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(testing::contains(bad.output, "kv-cache-dtype")) << bad.output;
}

}  // namespace
}  // namespace tvllm
