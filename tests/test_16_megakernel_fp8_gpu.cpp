// Lesson 16 on the GPU: lesson 14's megakernel with FP8-resident weights (E4M3 codes + a F32 scale per row),
// against the fused FP8 GEMV path on the same codes. Here, not in lesson 14's suites, because it needs lesson
// 16's quantizer. The model is random with every K a multiple of 16 (the megakernel's bulk copies need rows of
// whole 16-byte packs; the bundled model's intermediate 600 is not, so it is declined there: checked too).
//
// Tolerance: both paths decode the same codes exactly, multiply each row's fp32 sum by its scale once and round
// at the same points; only the order of the sums differs. So lesson 08's rule: each within eps = 0.2 rms(logits)
// of the exact logits, within 2 eps of each other, the same argmax wherever the margin exceeds 2 eps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/random.h"
#include "fast_path.h"
#include "fp8_resident.h"
#include "generate.h"
#include "logits_check.h"
#include "megakernel.h"
#include "model_dir.h"
#include "quantize.h"
#include "testing/fast_path_testing.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// The megakernel is opt-in (--megakernel; lesson 14, section 14).
FastPathOptions with_megakernel() {
  FastPathOptions o;
  o.megakernel = true;
  return o;
}

using testing::write_random_llama;

using VariantScope = testing::MegakernelVariantScope;

// The whole check under one consumer scheme (both are tested below: they sum in different orders).
void fp8_resident_weights_match_the_fused_fp8_path(MegakernelVariant variant) {
  const VariantScope scope(variant);
  testing::SyntheticLlama s;
  s.dtype = "F32";
  s.tied = false;
  s.hidden = 320, s.heads = 5, s.kv_heads = 1, s.head_dim = 64, s.intermediate = 896, s.vocab = 1001, s.layers = 2;
  testing::TempDir tmp;
  write_random_llama(s, tmp / "bf16", 16);
  quantize_checkpoint(tmp / "bf16", tmp / "fp8", QuantizeOptions{});
  install_fp8_resident_weights();
  const ModelDir dir = ModelDir::open(tmp / "fp8", Fp8Load::Resident);
  const ModelWeights w = ModelWeights::bind(dir, Device::CUDA);
  ASSERT_TRUE(w.fp8_resident);
  const std::string why = megakernel_declines(w);
  if (!why.empty()) GTEST_SKIP() << "the megakernel declines this setup: " << why;

  const EngineLimits lim = Generator::limits_for(w.config, 64, 1, 64);
  Generator mega(w, lim), fused(w, lim);
  use_fast_path(mega, with_megakernel());
  FastPathOptions no_mega;
  no_mega.megakernel = false;
  use_fast_path(fused, no_mega);
  ASSERT_EQ(mega.context().forward_fn(), &megakernel_forward);
  Rng rng(16);
  std::vector<int32_t> prompt, forced;
  for (int i = 0; i < 7; ++i) prompt.push_back(static_cast<int32_t>(rng.below(1001)));
  for (int i = 0; i < 40; ++i) forced.push_back(static_cast<int32_t>(rng.below(1001)));
  const int64_t before = megakernel_steps_launched();
  const Tensor a = mega.forced_logits(prompt, forced);
  EXPECT_EQ(megakernel_steps_launched() - before, 39) << "every decode step runs the megakernel";
  const Tensor b = fused.forced_logits(prompt, forced);
  const double e = kGpuLogitErrorPerRms * rms(b.view());
  const Top1Agreement t = top1_agreement(a.view(), b.view(), 2 * e);
  std::printf("    FP8 megakernel vs fused FP8: %s\n", t.summary().c_str());
  EXPECT_TRUE(t.pass()) << t.summary();
  EXPECT_LE(t.max_abs_error, 2 * e) << t.summary();
  EXPECT_GT(t.max_abs_error, 0.0) << "the same bits: did the megakernel run at all?";

  // The same checkpoint dequantized at load (BF16 weights equal to code x scale, rounded to bf16) through the
  // megakernel's BF16 path: within the bound too (the weights differ by that rounding only).
  const ModelDir deq_dir = ModelDir::open(tmp / "fp8", Fp8Load::Dequantize);
  const ModelWeights deq = ModelWeights::bind(deq_dir, Device::CUDA);
  Generator deq_mega(deq, lim);
  use_fast_path(deq_mega, with_megakernel());
  const Tensor c = deq_mega.forced_logits(prompt, forced);
  const Top1Agreement u = top1_agreement(a.view(), c.view(), 2 * e);
  EXPECT_LE(u.max_abs_error, 2 * e) << "FP8 vs dequantized through the megakernel: " << u.summary();
  EXPECT_EQ(megakernel_geometry(mega.context(), w).variant, variant);
}

TEST(Megakernel16Gpu, Fp8ResidentWeightsMatchTheFusedFp8Path) {
  TVLLM_REQUIRE_GPU();
  fp8_resident_weights_match_the_fused_fp8_path(MegakernelVariant::PerWarp);
}

TEST(Megakernel16Gpu, Fp8ResidentWeightsMatchTheFusedFp8PathWithSharedStages) {
  TVLLM_REQUIRE_GPU();
  fp8_resident_weights_match_the_fused_fp8_path(MegakernelVariant::SharedStages);
}

TEST(Megakernel16Gpu, TheBundledModelsFp8RowsAreDeclinedByName) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir tmp;
  quantize_checkpoint(testing::tiny_model_dir(), tmp / "fp8", QuantizeOptions{});
  install_fp8_resident_weights();
  const ModelDir dir = ModelDir::open(tmp / "fp8", Fp8Load::Resident);
  const ModelWeights w = ModelWeights::bind(dir, Device::CUDA);
  // intermediate 600: the down projection's rows are 600 codes, not whole 16-byte packs.
  EXPECT_NE(megakernel_declines(w).find("600"), std::string::npos) << megakernel_declines(w);
  Generator gen(w, Generator::limits_for(w.config, 64, 1, 64));
  use_fast_path(gen, with_megakernel());
  EXPECT_NE(gen.context().forward_fn(), &megakernel_forward);
}

}  // namespace
}  // namespace tvllm
