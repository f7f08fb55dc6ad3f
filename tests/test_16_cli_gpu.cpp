// Lesson 16 through the product on the GPU: an FP8 checkpoint made by `tiny-vllm quantize` runs in
// `generate` on the GPU (lesson 14's fused path with graphs by default, then --no-fused --enforce-eager), and its greedy
// continuation of the chapter's prompt is the bf16 model's (" Lisbon.": the bundled model's top-1/top-2
// margins are far larger than what FP8 weights move its logits by, measured in test_16_accuracy.cpp).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>

#include "testing/cli.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

const auto q = testing::shell_quote;


nlohmann::json last_json_line(const std::string& output) {
  std::istringstream in(output);
  nlohmann::json found;
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') found = nlohmann::json::parse(line, nullptr, false);
  return found;
}

TEST(Cli16Gpu, Fp8CheckpointGeneratesOnTheGpu) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir tmp;
  const std::string bin = q((testing::bin_dir() / "tiny-vllm").string());
  const std::string bf16 = q(testing::tiny_model_dir().string()), fp8 = q((tmp / "fp8").string());
  const auto made = testing::run_command(bin + " quantize --model " + bf16 + " --out " + fp8);
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const std::string args = " --prompt 'The capital of Portugal is' --max-tokens 8 --output json --device cuda";
  const auto want = testing::run_command(bin + " generate --model " + bf16 + args);
  ASSERT_EQ(want.exit_code, 0) << want.output;
  // The fast path (FP8 weights resident: the decode GEMVs read the codes), the fast path on weights dequantized at
  // load, and the plain path (dequantized: --no-fused).
  const std::pair<std::string, std::string> runs[] = {
      {"", "FP8 weights resident"},
      {" --fp8-weights dequantize", "FP8 weights dequantized to bf16 at load"},
      {" --no-fused --enforce-eager", "FP8 weights dequantized to bf16 at load"}};
  for (const auto& [extra, notice] : runs) {
    SCOPED_TRACE(extra);
    const auto got = testing::run_command(bin + " generate --model " + fp8 + args + extra);
    ASSERT_EQ(got.exit_code, 0) << got.output;
    EXPECT_EQ(last_json_line(got.output)["text"], last_json_line(want.output)["text"]) << got.output;
    EXPECT_NE(last_json_line(got.output)["path"].get<std::string>().find(notice), std::string::npos) << got.output;
  }
  // Resident needs the fused path that reads it.
  const auto refused =
      testing::run_command(bin + " generate --model " + fp8 + args + " --no-fused --fp8-weights resident");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("drop --no-fused"), std::string::npos) << refused.output;
  // bench latency reports how the weights were loaded: auto dequantizes there (batches: bf16 is faster), resident
  // when asked for.
  const std::string bench_args = " --context 16 --output-len 4 --prefill-len 16 --iters 1 --output json";
  const auto bench = testing::run_command(bin + " bench latency --model " + fp8 + bench_args);
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  EXPECT_EQ(last_json_line(bench.output)["fp8_weights"], "dequantize") << bench.output;
  const auto bench_resident =
      testing::run_command(bin + " bench latency --model " + fp8 + bench_args + " --fp8-weights resident");
  ASSERT_EQ(bench_resident.exit_code, 0) << bench_resident.output;
  EXPECT_EQ(last_json_line(bench_resident.output)["fp8_weights"], "resident") << bench_resident.output;
  // --fp8-gemm (README 7.3): a prefill of 64 tokens runs the FP8 tensor-core GEMM on the path asked for, and the
  // JSON counts it (the bundled model's down_proj, K = 600, is declined: dequantize); dequantize runs none.
  const std::string long_args = " --context 64 --output-len 2 --prefill-len 64 --iters 1 --output json";
  const auto epilogue = testing::run_command(bin + " bench latency --model " + fp8 + long_args +
                                             " --fp8-weights resident --fp8-gemm epilogue");
  ASSERT_EQ(epilogue.exit_code, 0) << epilogue.output;
  const nlohmann::json e = last_json_line(epilogue.output)["fp8_gemm"];
  EXPECT_EQ(e["path"], "epilogue") << epilogue.output;
  EXPECT_GT(e["calls"]["epilogue"].get<int64_t>(), 0) << epilogue.output;
  EXPECT_EQ(e["calls"]["scale_vectors"].get<int64_t>(), 0) << epilogue.output;
  const auto dequantize = testing::run_command(bin + " bench latency --model " + fp8 + long_args +
                                               " --fp8-weights resident --fp8-gemm dequantize");
  ASSERT_EQ(dequantize.exit_code, 0) << dequantize.output;
  const nlohmann::json d = last_json_line(dequantize.output)["fp8_gemm"];
  EXPECT_EQ(d["path"], "dequantize") << dequantize.output;
  EXPECT_EQ(d["calls"]["epilogue"].get<int64_t>() + d["calls"]["scale_vectors"].get<int64_t>(), 0);
  EXPECT_GT(d["calls"]["dequantize"].get<int64_t>(), 0) << dequantize.output;
}

}  // namespace
}  // namespace tvllm

namespace tvllm {
namespace {

TEST(Cli16Gpu, BenchThroughputWithAnFp8KvCacheHasTwiceTheBlocks) {
  TVLLM_REQUIRE_GPU();
  // The engine on the GPU with lesson 14's fast path (graphs, the fast decode kernel through its FP8 seam), the pool
  // planned from the same fraction of free memory: FP8 blocks hold half the bytes, so about twice as many fit (not
  // exactly: the free memory moves a little between the two processes).
  const std::string bench = q((testing::bin_dir() / "tiny-vllm").string()) + " bench throughput --model " +
                            q(testing::tiny_model_dir().string()) +
                            " --device cuda --num-requests 16 --min-len 8 --max-len 48 --output json"
                            " --gpu-memory-utilization 0.2";
  const auto bf16 = testing::run_command(bench);
  const auto fp8 = testing::run_command(bench + " --kv-cache-dtype fp8");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  ASSERT_EQ(fp8.exit_code, 0) << fp8.output;
  const nlohmann::json a = last_json_line(bf16.output), b = last_json_line(fp8.output);
  ASSERT_TRUE(a.is_object() && b.is_object()) << bf16.output << fp8.output;
  EXPECT_EQ(b["kv_cache_dtype"], "fp8");
  EXPECT_EQ(b["failed"], 0);
  EXPECT_EQ(b["output_tokens"], a["output_tokens"]);  // the same workload ran to its end (lengths are fixed)
  const double ratio = b["kv_blocks"].get<double>() / a["kv_blocks"].get<double>();
  EXPECT_NEAR(ratio, 2.0, 0.05) << bf16.output << fp8.output;
  EXPECT_NE(fp8.output.find("F8_E4M3"), std::string::npos) << fp8.output;
  std::printf("KV blocks: bf16 %s, fp8 %s (ratio %.3f)\n", a["kv_blocks"].dump().c_str(), b["kv_blocks"].dump().c_str(),
              ratio);
}

}  // namespace
}  // namespace tvllm
