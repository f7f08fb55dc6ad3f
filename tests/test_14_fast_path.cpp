// Lesson 14, CPU: the fast path's switches as data. The progression the chapter measures adds one technique per
// row (graphs, fused GEMVs, the fast sampler, programmatic dependent launch, the fast decode attention), the
// default options are its last row, and on the CPU nothing of it is installed (the CPU path is the fp32
// reference) and PDL is never claimed.
// What the fast path says it installs: the fused GEMV decode computes Llama's layer only, so a model with biases
// or q/k norms (issue 18; tests/data/models) is declined by name, and the notice says the composed kernels run
// (the GPU side: tests/test_14_fast_path_gpu.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/device.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "generate.h"
#include "latency_bench.h"
#include "model_dir.h"
#include "pdl.h"
#include "testing/engine_fixture.h"
#include "testing/family_models.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(FastPath14, TheProgressionAddsOneTechniquePerRow) {
  const std::vector<LatencyVariant> v = progression_variants();
  ASSERT_EQ(v.size(), 6u);
  EXPECT_FALSE(v[0].fast.has_value());  // lesson 10 as it is
  // Each row turns exactly one switch on over the row before it, in the chapter's order.
  const auto on = [](const FastPathOptions& o) {
    return std::vector<bool>{o.graphs, o.fused, o.fast_sampler, o.pdl, o.fast_attention};
  };
  for (size_t i = 1; i < v.size(); ++i) {
    ASSERT_TRUE(v[i].fast.has_value()) << v[i].name;
    const std::vector<bool> now = on(*v[i].fast);
    for (size_t k = 0; k < now.size(); ++k) EXPECT_EQ(now[k], k < i) << v[i].name << ", switch " << k;
  }
  EXPECT_NE(v[4].name.find("programmatic dependent launch"), std::string::npos);
  EXPECT_NE(v.back().name.find("fast decode attention"), std::string::npos);
  // The last row is what the product runs by default.
  const FastPathOptions defaults;
  EXPECT_EQ(on(*v.back().fast), on(defaults));
  EXPECT_EQ(v.back().fast->max_graph_batch, defaults.max_graph_batch);
}

TEST(FastPath14, PdlIsNeverClaimedWhereItCannotRun) {
  // Without a GPU there is no PDL; with one, only from compute capability 9.0 on.
  if (!cuda_available() || query_device().compute_major < 9) {
    EXPECT_FALSE(pdl_supported());
  }
  EXPECT_FALSE(fast_path_uses_pdl({}, Device::CPU));
  EXPECT_FALSE(fast_path_uses_pdl(fast_path_options(false, true, true, true, true), Device::CUDA));  // needs fused
  EXPECT_FALSE(fast_path_uses_pdl(fast_path_options(true, true, true, false, true), Device::CUDA));  // --no-pdl
  EXPECT_EQ(fast_path_uses_pdl(fast_path_options(true, false, false, true, true), Device::CUDA), pdl_supported());
  // What the banner says follows the same rule.
  const std::string fused_pdl = describe_fast_path(fast_path_options(true, true, true, true, true), Device::CUDA);
  EXPECT_EQ(fused_pdl.find("with PDL") != std::string::npos, pdl_supported()) << fused_pdl;
  EXPECT_NE(describe_fast_path(fast_path_options(true, true, true, false, true), Device::CUDA).find("--no-pdl"),
            std::string::npos);
  EXPECT_EQ(describe_fast_path({}, Device::CPU), "CPU reference path (the fast path is for CUDA)");
  // The notice names the decode attention kernel too (--no-fast-attention: lesson 10's).
  EXPECT_NE(describe_fast_path({}, Device::CUDA).find(", fast decode attention"), std::string::npos);
  EXPECT_NE(describe_fast_path(fast_path_options(true, true, true, true, false), Device::CUDA)
                .find(", lesson 10 decode attention"),
            std::string::npos);
}

TEST(FastPath14, OnTheCpuNothingIsInstalled) {
  const auto& m = testing::bundled_model<Device::CPU>();
  Generator gen(m.w, Generator::limits_for(m.w.config, 64, 1, 64));
  use_fast_path(gen);
  EXPECT_EQ(gen.context().forward_fn(), nullptr);  // lesson 08's forward_composed, the reference
  EXPECT_EQ(gen.context().launcher(), nullptr);
}

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
