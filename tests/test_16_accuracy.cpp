// Lesson 16 on the CPU: the bundled model with FP8 weights against itself with bf16 weights, teacher-forced
// over the first 256 ids of each weights/corpus/*.txt (2040 positions). The targets: top-1
// agreement >= 98% and perplexity within 1% of bf16. Measured here (fp32 CPU path): 100% and +0.012%. The
// bounds leave room for a different CPU, not for a wrong dequantization: with scales ignored (codes read as
// values) or a transposed scale the logits are garbage and agreement collapses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "accuracy.h"
#include "common/dtype.h"
#include "fp8_gemm.h"
#include "model_weights.h"
#include "quantize.h"
#include "transformer.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;

// fp8_activations: the candidate's projections see per-token FP8 activations (fp8_gemm.h's CPU simulation of
// the FP8 tensor-core GEMM), the reference's do not. fp8_lm_head: the candidate's lm_head is rounded through
// E4M3 with a scale per row (TeacherForcing::simulate_fp8_lm_head, what --fp8-lm-head reads).
LogitsComparison measure(const fs::path& fp8_dir, Device device, bool fp8_activations = false,
                         bool fp8_lm_head = false) {
  const fs::path model = TVLLM_TINY_MODEL_DIR;
  const ModelDir bf16 = ModelDir::open(model), fp8 = ModelDir::open(fp8_dir);
  LogitsComparison total;
  TeacherForcing run_bf16(bf16, device, 256), run_fp8(fp8, device, 256);
  if (fp8_lm_head) run_fp8.simulate_fp8_lm_head();
  struct Off {
    ~Off() { simulate_fp8_activations_on_cpu(false); }
  } off;
  for (const std::vector<int32_t>& ids : corpus_windows(model, model.parent_path() / "corpus", 256, 8)) {
    const Tensor ref = run_bf16.logits(ids);
    simulate_fp8_activations_on_cpu(fp8_activations);
    const Tensor cand = run_fp8.logits(ids);
    simulate_fp8_activations_on_cpu(false);
    accumulate(total, compare_logits(cand.view(), ref.view(), ids));
  }
  return total;
}

TEST(Accuracy16, Fp8WeightsAgreeWithBf16OnTheCpu) {
  testing::TempDir tmp;
  quantize_checkpoint(TVLLM_TINY_MODEL_DIR, tmp / "fp8", QuantizeOptions{});
  const LogitsComparison c = measure(tmp / "fp8", Device::CPU);
  std::printf("positions %lld, top-1 %.4f, perplexity bf16 %.5f fp8 %.5f, rms err %.4f (rms logits %.3f)\n",
              static_cast<long long>(c.positions), c.top1_agreement(), c.reference_perplexity, c.candidate_perplexity,
              c.rms_error, c.reference_rms);
  EXPECT_GE(c.positions, 2000);
  EXPECT_GE(c.top1_agreement(), 0.98);
  EXPECT_LE(std::fabs(c.candidate_perplexity / c.reference_perplexity - 1.0), 0.01);
  EXPECT_GT(c.rms_error, 0.0);  // FP8 weights are not the bf16 weights: the logits must move a little
  EXPECT_LT(c.rms_error, 0.1 * c.reference_rms);
}

// README 7.3: the FP8 tensor-core GEMM also quantizes the activations, per token. Simulated on the CPU for every
// projection of every step (the engine quantizes only steps of 17+ tokens: this is the worst case). The issue's
// targets hold for it too. Measured here (fp32 CPU path): top-1 100%, perplexity +0.04% (1.02509 vs 1.02467), rms
// logit error 0.293 against 0.199 for the weights alone (rms logits 4.26). The bounds leave room for another CPU.
TEST(Accuracy16, Fp8WeightsAndFp8ActivationsAgreeWithBf16OnTheCpu) {
  testing::TempDir tmp;
  quantize_checkpoint(TVLLM_TINY_MODEL_DIR, tmp / "fp8", QuantizeOptions{});
  const LogitsComparison w = measure(tmp / "fp8", Device::CPU);
  const LogitsComparison c = measure(tmp / "fp8", Device::CPU, true);
  std::printf("FP8 weights + activations: top-1 %.4f, perplexity bf16 %.5f fp8 %.5f, rms err %.4f (weights only "
              "%.4f; rms logits %.3f)\n",
              c.top1_agreement(), c.reference_perplexity, c.candidate_perplexity, c.rms_error, w.rms_error,
              c.reference_rms);
  EXPECT_GE(c.positions, 2000);
  EXPECT_GE(c.top1_agreement(), 0.98);
  EXPECT_LE(std::fabs(c.candidate_perplexity / c.reference_perplexity - 1.0), 0.01);
  EXPECT_GT(c.rms_error, w.rms_error);  // the activations' quantization moved the logits further
  EXPECT_LT(c.rms_error, 0.2 * c.reference_rms);
  // And it is off again: the same run without it gives the weights-only logits.
  EXPECT_EQ(installed_cpu_activation_transform(), nullptr);
}

// README 7.4: --fp8-lm-head, simulated on the CPU (the lm_head rounded through E4M3 with one scale per vocabulary
// entry, decoded to F32) on top of the FP8 weights. The targets must hold for it too: top-1 >= 98% and
// perplexity within 1% of bf16. Its rounding (<= 2^-4 relative per weight, ~2% rms) moves each logit once more, so
// the rms logit error must grow over the weights-only row, and stay a small share of the logits' rms. Measured
// here (fp32 CPU path): top-1 100%, perplexity 1.02452 vs 1.02467 (-0.014%), rms logit error 0.2172 against 0.1992
// for the weights alone (rms logits 4.26).
TEST(Accuracy16, Fp8WeightsAndAnFp8LmHeadAgreeWithBf16OnTheCpu) {
  testing::TempDir tmp;
  quantize_checkpoint(TVLLM_TINY_MODEL_DIR, tmp / "fp8", QuantizeOptions{});
  const LogitsComparison w = measure(tmp / "fp8", Device::CPU);
  const LogitsComparison c = measure(tmp / "fp8", Device::CPU, false, true);
  std::printf("FP8 weights + FP8 lm_head: top-1 %.4f, perplexity bf16 %.5f fp8 %.5f (%+.3f%%), rms err %.4f "
              "(weights only %.4f; rms logits %.3f), max |err| %.4f\n",
              c.top1_agreement(), c.reference_perplexity, c.candidate_perplexity,
              100.0 * (c.candidate_perplexity / c.reference_perplexity - 1.0), c.rms_error, w.rms_error,
              c.reference_rms, c.max_abs_error);
  EXPECT_GE(c.positions, 2000);
  EXPECT_GE(c.top1_agreement(), 0.98);
  EXPECT_LE(std::fabs(c.candidate_perplexity / c.reference_perplexity - 1.0), 0.01);
  EXPECT_GT(c.rms_error, w.rms_error);  // the lm_head's rounding moved the logits further
  EXPECT_LT(c.rms_error, 0.2 * c.reference_rms);
}

// The simulation rounds the lm_head only: the embedding table (tied here) is the bf16 one still, and every row of
// the simulated lm_head is within its rounding bound of the original (half an E4M3 spacing of |w| / scale, times
// the row's scale amax / 448: quantize.h's fp8_error_bound).
TEST(Accuracy16, TheSimulatedFp8LmHeadIsEachRowRoundedThroughE4m3) {
  const ModelDir bf16 = ModelDir::open(TVLLM_TINY_MODEL_DIR);
  const ModelWeights w = ModelWeights::bind(bf16, Device::CPU);
  ASSERT_EQ(w.lm_head.dtype, DType::BF16);
  const int64_t V = w.lm_head.shape[0], H = w.lm_head.shape[1];
  Tensor sim = Tensor::empty({V, H}, DType::F32, Device::CPU);
  fake_quantize_activations(sim.view(), w.lm_head);
  int64_t moved = 0, at_top = 0;
  for (int64_t v = 0; v < V; ++v) {
    float amax = 0.0f;
    for (int64_t k = 0; k < H; ++k) amax = std::fmax(amax, std::fabs(bf16_to_f32(w.lm_head.ptr<const uint16_t>()[v * H + k])));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int64_t k = 0; k < H; ++k) {
      const float x = bf16_to_f32(w.lm_head.ptr<const uint16_t>()[v * H + k]);
      const float y = sim.view().ptr<const float>()[v * H + k];
      // fp8_error_bound, plus the fp32 rounding of code x scale (2^-24 relative).
      ASSERT_LE(std::fabs(static_cast<double>(y) - x), fp8_error_bound(x, scale) + std::fabs(y) * 0x1p-24)
          << "row " << v << " column " << k;
      moved += y != x;
      at_top += std::fabs(x) == amax && std::fabs(std::fabs(y) - amax) <= amax * 0x1p-20;
    }
  }
  EXPECT_GT(moved, V * H / 4);  // most bf16 values (8 significant bits) are not E4M3 values (4) times the scale
  EXPECT_GE(at_top, V);         // each row's amax maps to code 448 and back to itself
}

// compare_logits on a hand-made case: two rows, vocab 3.
TEST(Accuracy16, CompareLogitsKnownAnswers) {
  std::vector<float> ref = {0, 0, 0, 2, 0, 0}, cand = {0, 0, 0, 0, 2, 0};
  const TensorView r = TensorView::contiguous(ref.data(), DType::F32, Device::CPU, {2, 3});
  const TensorView c = TensorView::contiguous(cand.data(), DType::F32, Device::CPU, {2, 3});
  const LogitsComparison x = compare_logits(c, r, {0, 1, 0});
  EXPECT_EQ(x.positions, 2);
  EXPECT_EQ(x.top1_agree, 1);  // row 0: all equal, both argmax 0; row 1: 0 vs 1
  // reference: p(1 | row 0) = 1/3, p(0 | row 1) = e^2 / (e^2 + 2) -> perplexity = exp(-(log(1/3) + log(p)) / 2)
  const double p = std::exp(2.0) / (std::exp(2.0) + 2.0);
  EXPECT_NEAR(x.reference_perplexity, std::exp(-(std::log(1.0 / 3.0) + std::log(p)) / 2.0), 1e-12);
  EXPECT_DOUBLE_EQ(x.max_abs_error, 2.0);
}

}  // namespace
}  // namespace tvllm
