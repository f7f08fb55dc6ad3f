// Lesson 16 on the GPU: the FP8 tensor-core GEMM inside lesson 08's forward (install_fp8_tensor_core_gemm).
//
// The bundled model, quantized by tiny-vllm quantize's code, opened with FP8-resident weights, runs the corpus'
// first texts as prefill steps with every row's logits, on each --fp8-gemm path. The dequantize path is the
// reference: it is the bf16 GEMM on the dequantized weights, whose logits equal the dequantize-at-load model's bit
// for bit (test_16_fp8_engine_gpu.cpp). The FP8 GEMM adds per-token activation quantization, an error of up to
// 2^-4 per activation: not a rounding bound the logits can be held to, so the targets are the accuracy
// targets, which the CPU simulation of the same quantization meets (test_16_accuracy.cpp,
// Accuracy16.Fp8WeightsAndFp8ActivationsAgreeWithBf16OnTheCpu): top-1 agreement >= 98% over every row, rms logit
// error < 20% of the logits' rms, and the error non-zero (the FP8 path ran: its counters say so too). The bundled model's down_proj has K = 600, not a multiple of 16:
// cuBLASLt's FP8 rule declines it, and it runs the dequantize path, counted.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "accuracy.h"
#include "fp8_gemm.h"
#include "fp8_resident.h"
#include "logits_check.h"
#include "model_dir.h"
#include "model_weights.h"
#include "quantize.h"
#include "transformer.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

struct Corpus {
  testing::TempDir tmp;
  ModelDir dir;
  std::vector<std::vector<int32_t>> texts;
  int64_t tokens = 0;
  Corpus() : dir(open(tmp)) {
    const std::filesystem::path model = testing::tiny_model_dir();
    texts = corpus_windows(model, model.parent_path() / "corpus", 96, 4);
    for (const auto& t : texts) tokens += static_cast<int64_t>(t.size());
  }
  static ModelDir open(const testing::TempDir& t) {
    quantize_checkpoint(testing::tiny_model_dir(), t / "fp8", QuantizeOptions{});
    return ModelDir::open(t / "fp8", Fp8Load::Resident);
  }
};
const Corpus& setup() {
  static const Corpus s;
  return s;
}

// Every row's logits of the texts run as one prefill step, on `path`; counts of what ran.
struct PrefillRun {
  Tensor logits;
  Fp8GemmCounts counts;
};
PrefillRun run(Fp8GemmPath path) {
  const Corpus& s = setup();
  install_fp8_resident_weights();
  install_fp8_tensor_core_gemm(path);
  reset_fp8_gemm_counts();
  const EngineLimits limits{s.tokens, static_cast<int64_t>(s.texts.size()), s.tokens, 0};
  const ModelWeights w = ModelWeights::bind(s.dir, Device::CUDA);
  ExecContext ctx(s.dir.config, limits, Device::CUDA);
  StepInputs step(s.dir.config, limits, Device::CUDA);
  PrefillAttention attn(s.dir.config, limits, Device::CUDA);
  step.set_prompts(s.texts, /*all_rows=*/true, ctx.stream());
  const TensorView logits = forward(ctx, w, step, attn);
  ctx.synchronize();
  PrefillRun r{Tensor::copy_of(logits, Device::CPU), fp8_gemm_counts()};
  install_fp8_gemm(nullptr, 1);  // leave the process as it was: the dequantize path everywhere
  return r;
}

void expect_close_to_dequantize(Fp8GemmPath path, const PrefillRun& got, const PrefillRun& want) {
  const int64_t layers = setup().dir.config.num_hidden_layers;
  // qkv, o, gate|up per layer on the FP8 GEMM; down_proj (K = 600) declined.
  EXPECT_EQ(got.counts.scale_vectors + got.counts.epilogue, 3 * layers) << fp8_gemm_path_name(path);
  EXPECT_EQ(got.counts.dequantize, layers) << fp8_gemm_path_name(path);
  const double rms_ref = rms(want.logits.view());
  // Every row counts (margin 0): the argmax may flip only where the reference's top-1/top-2 margin is under twice
  // the largest logit error, and the measurement says how rare that is.
  const Top1Agreement t = top1_agreement(got.logits.view(), want.logits.view(), 0.0);
  std::vector<float> a = to_f32_vector(got.logits.view()), b = to_f32_vector(want.logits.view());
  double se = 0.0;
  for (size_t i = 0; i < a.size(); ++i) se += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
  const double rms_err = std::sqrt(se / static_cast<double>(a.size()));
  std::printf("%s: %s; all rows %lld/%lld; rms err %.4f (rms logits %.3f)\n",
              std::string(fp8_gemm_path_name(path)).c_str(), t.summary().c_str(),
              static_cast<long long>(t.agree_all), static_cast<long long>(t.positions), rms_err, rms_ref);
  EXPECT_GT(t.max_abs_error, 0.0) << "the FP8 GEMM did not change a logit: did it run?";
  EXPECT_LT(rms_err, 0.2 * rms_ref);
  EXPECT_GE(static_cast<double>(t.agree_all), 0.98 * static_cast<double>(t.positions)) << t.summary();
}

TEST(Fp8GemmEngine16Gpu, EachPathAgreesWithTheDequantizePathOnTheCorpus) {
  TVLLM_REQUIRE_GPU();
  ASSERT_GE(setup().tokens, 4 * kFp8GemmMinTokens);
  const PrefillRun want = run(Fp8GemmPath::Dequantize);
  EXPECT_EQ(want.counts.scale_vectors + want.counts.epilogue, 0);
  EXPECT_EQ(want.counts.dequantize, 4 * setup().dir.config.num_hidden_layers);  // every projection declined
  const PrefillRun epilogue = run(Fp8GemmPath::Epilogue);
  EXPECT_EQ(epilogue.counts.scale_vectors, 0);
  expect_close_to_dequantize(Fp8GemmPath::Epilogue, epilogue, want);
  const PrefillRun automatic = run(Fp8GemmPath::Auto);
  expect_close_to_dequantize(Fp8GemmPath::Auto, automatic, want);
  if (fp8_scale_vectors_supported(setup().tokens, setup().dir.config.hidden_size, setup().dir.config.hidden_size)) {
    EXPECT_GT(automatic.counts.scale_vectors, 0) << "auto should prefer the scale vectors where cuBLASLt has them";
    const PrefillRun vectors = run(Fp8GemmPath::ScaleVectors);
    expect_close_to_dequantize(Fp8GemmPath::ScaleVectors, vectors, want);
  }
}

TEST(Fp8GemmEngine16Gpu, StepsBelowTheThresholdKeepTheDequantizePath) {
  TVLLM_REQUIRE_GPU();
  const Corpus& s = setup();
  install_fp8_resident_weights();
  install_fp8_tensor_core_gemm(Fp8GemmPath::Auto);
  reset_fp8_gemm_counts();
  const int64_t T = kFp8GemmMinTokens - 1;
  const std::vector<std::vector<int32_t>> one = {std::vector<int32_t>(s.texts[0].begin(), s.texts[0].begin() + T)};
  const EngineLimits limits{T, 1, T, 0};
  const ModelWeights w = ModelWeights::bind(s.dir, Device::CUDA);
  ExecContext ctx(s.dir.config, limits, Device::CUDA);
  StepInputs step(s.dir.config, limits, Device::CUDA);
  PrefillAttention attn(s.dir.config, limits, Device::CUDA);
  step.set_prompts(one, true, ctx.stream());
  forward(ctx, w, step, attn);
  ctx.synchronize();
  const Fp8GemmCounts c = fp8_gemm_counts();
  install_fp8_gemm(nullptr, 1);
  EXPECT_EQ(c.scale_vectors + c.epilogue + c.dequantize, 0) << "a step of 16 tokens never asks the FP8 GEMM";
}

}  // namespace
}  // namespace tvllm
