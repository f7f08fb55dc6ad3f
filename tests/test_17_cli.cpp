// Lesson 17 through the product: `--tensor-parallel-size` (vLLM's name) on generate, serve, bench latency and bench
// throughput. 1 runs as before (the same greedy ids as without the flag); 2 is refused before anything loads, exit 2,
// with a message that says why (fewer GPUs than asked for, or the engine over several ranks not built yet); 0 too.
#include <gtest/gtest.h>

#include <string>

#include "testing/cli.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

std::string tiny_vllm() { return testing::tiny_vllm_bin(); }
std::string model() { return testing::tiny_model_arg(); }
using testing::contains;
using testing::run_command;

TEST(Cli17, TensorParallelSizeOneRunsAsBefore) {
  const std::string args = " generate --model " + model() +
                           " --prompt 'The capital of Portugal is' --max-tokens 6 --device cpu --output json";
  const auto plain = run_command(tiny_vllm() + args);
  const auto one = run_command(tiny_vllm() + args + " --tensor-parallel-size 1");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto ids = [](const std::string& out) {
    const size_t at = out.find("\"ids\"");
    return at == std::string::npos ? std::string() : out.substr(at, out.find(']', at) - at);
  };
  EXPECT_FALSE(ids(one.output).empty()) << one.output;
  EXPECT_EQ(ids(one.output), ids(plain.output));
}

TEST(Cli17, TensorParallelSizeTwoIsRefusedWithAReason) {
  for (const char* command : {"generate --prompt hi", "serve --port 0", "bench latency", "bench throughput"}) {
    const auto r = run_command(tiny_vllm() + " " + command + " --model " + model() + " --tensor-parallel-size 2");
    EXPECT_EQ(r.exit_code, 2) << command << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "--tensor-parallel-size 2")) << command << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "needs 2 GPUs") || contains(r.output, "not built yet")) << command << ": "
                                                                                            << r.output;
  }
}

TEST(Cli17, TensorParallelSizeZeroIsRefused) {
  const auto r = run_command(tiny_vllm() + " bench latency --model " + model() + " --tensor-parallel-size 0");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--tensor-parallel-size must be at least 1")) << r.output;
}

}  // namespace
}  // namespace tvllm
