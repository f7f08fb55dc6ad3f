// Lesson 14 on the CPU: what the fast path says it installs. The fused GEMV decode computes Llama's layer only,
// so a model with biases or q/k norms (issue 18; tests/data/models) is declined by name, and the notice says
// the composed kernels run (the GPU side: tests/test_14_fast_path_gpu.cpp).
#include <gtest/gtest.h>

#include <string>

#include "fast_forward.h"
#include "fast_path.h"
#include "model_dir.h"
#include "testing/family_models.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

TEST(FastPath14, TheFamiliesExtrasAreDeclinedByName) {
  const std::pair<const char*, const char*> cases[] = {
      {"qwen2", "q/k/v biases"},
      {"qwen3", "q/k norm"},
      {"llama_bias", "q/k/v biases, o_proj bias, MLP biases"},
  };
  for (const auto& [family, declined] : cases) {
    SCOPED_TRACE(family);
    const ModelDir model = ModelDir::open(testing::family_model_dir(family));
    EXPECT_EQ(fast_forward_declines(model.config), declined);
    const std::string notice = describe_fast_path({}, Device::CUDA, &model.config);
    EXPECT_TRUE(contains(notice, std::string("composed kernels (the fused GEMV decode does not compute this "
                                             "model's ") + declined + ")"))
        << notice;
    EXPECT_TRUE(contains(notice, "CUDA graphs")) << "graphs still apply: " << notice;
    // CPU weights never take the fused path, whatever the model.
    EXPECT_FALSE(fast_forward_supported(ModelWeights::bind(model, Device::CPU)));
  }
  const ModelDir llama = ModelDir::open(testing::tiny_model_dir());
  EXPECT_EQ(fast_forward_declines(llama.config), "");
  const std::string notice = describe_fast_path({}, Device::CUDA, &llama.config);
  EXPECT_TRUE(contains(notice, "fused GEMV decode") && !contains(notice, "composed")) << notice;
  EXPECT_EQ(describe_fast_path({}, Device::CUDA), notice) << "without a config: the options alone";
}

}  // namespace
}  // namespace tvllm
