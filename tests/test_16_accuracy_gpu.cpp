// Lesson 16 on the GPU: the FP8 checkpoint (dequantized to bf16 at load) through the bf16 GPU path,
// against the bf16 checkpoint through the same path, teacher-forced over the corpus. The targets are the
// issue's (top-1 >= 98%, perplexity within 1%); the GPU path adds bf16 activations to both models alike.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "accuracy.h"
#include "quantize.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(Accuracy16Gpu, Fp8WeightsAgreeWithBf16OnTheGpu) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir tmp;
  quantize_checkpoint(TVLLM_TINY_MODEL_DIR, tmp / "fp8", QuantizeOptions{});
  const std::filesystem::path model = TVLLM_TINY_MODEL_DIR;
  const ModelDir bf16 = ModelDir::open(model), fp8 = ModelDir::open(tmp / "fp8");
  LogitsComparison total;
  TeacherForcing run_bf16(bf16, Device::CUDA, 256), run_fp8(fp8, Device::CUDA, 256);
  for (const std::vector<int32_t>& ids : corpus_windows(model, model.parent_path() / "corpus", 256, 8)) {
    const Tensor ref = run_bf16.logits(ids);
    const Tensor cand = run_fp8.logits(ids);
    accumulate(total, compare_logits(cand.view(), ref.view(), ids));
  }
  std::printf("GPU: positions %lld, top-1 %.4f, perplexity bf16 %.5f fp8 %.5f\n",
              static_cast<long long>(total.positions), total.top1_agreement(), total.reference_perplexity,
              total.candidate_perplexity);
  EXPECT_GE(total.top1_agreement(), 0.98);
  EXPECT_LE(std::fabs(total.candidate_perplexity / total.reference_perplexity - 1.0), 0.01);
}

}  // namespace
}  // namespace tvllm
