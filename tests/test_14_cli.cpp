// Lesson 14, the command line: `tiny-vllm bench latency` on the CPU (the bundled model: the numbers mean little,
// the contract is what is tested) and its refusals, and the fast-path flags of generate, which must not change the
// tokens (on the CPU the fast path is not installed at all: the flags are accepted and the path says so).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "testing/testing.h"

namespace tvllm {
namespace {

using nlohmann::json;
using testing::run_command;

std::string bin() { return (testing::bin_dir() / "tiny-vllm").string(); }
std::string model() { return "'" + testing::tiny_model_dir().string() + "'"; }

TEST(LatencyCli14, JsonOnTheCpu) {
  // stderr to /dev/null: the JSON object alone on stdout.
  const auto r = run_command(bin() + " bench latency --model " + model() +
                             " --device cpu --batch-size 1 2 --context 16 --output-len 4 --prefill-len 8 --iters 1"
                             " --output json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json j = json::parse(r.output);
  EXPECT_EQ(j["device"], "cpu");
  ASSERT_EQ(j["runs"].size(), 1u);  // --compare is for CUDA; on the CPU one run, the reference path
  const json& decode = j["runs"][0]["decode"];
  ASSERT_EQ(decode.size(), 2u);
  EXPECT_EQ(decode[0]["batch"], 1);
  EXPECT_EQ(decode[1]["batch"], 2);
  for (const json& d : decode) {
    EXPECT_EQ(d["context"], 16);
    EXPECT_GT(d["ms_per_step"].get<double>(), 0.0);
    EXPECT_NEAR(d["tok_s"].get<double>(), d["batch"].get<double>() * 1e3 / d["ms_per_step"].get<double>(), 1e-6);
  }
  ASSERT_EQ(j["runs"][0]["prefill"].size(), 1u);
  EXPECT_EQ(j["runs"][0]["prefill"][0]["tokens"], 8);
  // The bundled model's weights, all of them (tied: the embedding is read once, as the lm_head): 2 layers of
  // hidden 336, intermediate 600, 6 + 2 + 2 heads of 64, vocab 1000, stored bf16.
  const double H = 336, I = 600, V = 1000, qkv = (6 + 2 + 2) * 64;
  const double params = 2 * (2 * H + H * qkv + 6 * 64 * H + 3 * H * I) + H + V * H;
  EXPECT_DOUBLE_EQ(j["weight_bytes"].get<double>(), 2 * params);
}

TEST(LatencyCli14, BadArgumentsExitTwoWithAMessage) {
  const std::string base = bin() + " bench latency --model " + model() + " --device cpu ";
  for (const std::string args : {"--context 2000 --output-len 128",  // past max_position_embeddings 2048
                                 "--prefill-len 4096", "--output yaml", "--batch-size 0", "--output-len 1",
                                 "--iters 0"}) {
    const auto r = run_command(base + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    // The message names what is wrong: the flag, or the limit it breaks.
    const std::string flag = args.substr(0, args.find(' '));
    EXPECT_TRUE(r.output.find(flag) != std::string::npos || r.output.find("max_position_embeddings") != std::string::npos)
        << args << "\n" << r.output;
  }
  const auto missing = run_command(bin() + " bench latency --model /nonexistent/dir --device cpu");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
}

TEST(LatencyCli14, TheFastPathFlagsAreAcceptedAndTheCpuRunsTheReference) {
  const auto r = run_command(bin() + " bench latency --model " + model() +
                             " --device cpu --context 8 --output-len 2 --prefill-len 4 --iters 1 --output json"
                             " --enforce-eager --no-fused --no-fast-sampler --no-pdl --no-fast-attention --megakernel --no-hopper"
                             " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json j = json::parse(r.output);
  ASSERT_EQ(j["runs"].size(), 1u);
  EXPECT_EQ(j["runs"][0]["variant"], "CPU reference path (the fast path is for CUDA)");
  // The CPU has no lesson 15 kernels: one prefill row, lessons 10 + 06's.
  ASSERT_EQ(j["runs"][0]["prefill"].size(), 1u);
  EXPECT_EQ(j["runs"][0]["prefill"][0]["kernels"], "lessons 10 + 06");
}

TEST(LatencyCli14, FastPathFlagsChangeNoTokens) {
  const std::string base = bin() + " generate --model " + model() +
                           " --device cpu --prompt-ids '744 474 274 370' --max-tokens 8 --ignore-eos --output json";
  const auto plain = run_command(base + " 2>/dev/null");
  const auto flags = run_command(base +
                                 " --enforce-eager --no-fused --no-fast-sampler --no-pdl --no-fast-attention --megakernel"
                                 " --no-hopper-attention --hopper-gemm 2>/dev/null");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(flags.exit_code, 0) << flags.output;
  const json a = json::parse(plain.output), b = json::parse(flags.output);
  EXPECT_EQ(a["ids"], b["ids"]);
  EXPECT_EQ(a["ids"].size(), 8u);
  EXPECT_EQ(a["path"], "CPU reference path (the fast path is for CUDA)");
}

}  // namespace
}  // namespace tvllm
