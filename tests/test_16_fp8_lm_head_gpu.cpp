// Lesson 16 on the GPU: the opt-in FP8 lm_head (--fp8-lm-head, README 7.4). A random Llama-shaped model is
// quantized (FP8-resident weights) and bound twice: once as it is (bf16 lm_head) and once with attach_fp8_lm_head.
// Lesson 14's fused decode path runs both; every kernel before the lm_head is the same on the same bits, so the
// hidden state x = bf16(bf16(rmsnorm(h)) * g) that meets the lm_head is the same too, and the logits differ by
// the lm_head's rounding only (plus each run's fp32 summation).
//
// The bound, per vocabulary row n (K = hidden):
//   |logit'_n - logit_n| = |Σ_k x_k (w'_nk - w_nk)| <= Σ_k |x_k| |Δw_nk| <= ||x||_2 ||Δw_n||_2     (Cauchy-Schwarz)
//   ||x||_2 <= sqrt(K) max|g| (1 + 2^-7)^2: rmsnorm leaves Σ (h_k inv)^2 = K mean(h^2) / (mean(h^2) + eps) <= K,
//              and each of the two bf16 roundings (and the fp32 rsqrt) grows an element by < 2^-7 relative
//   ||Δw_n||_2 computed exactly on the host from the bf16 row and its E4M3 codes x scale (each |Δw| is at most
//              2^-4 |w| for a normal code, 2^-10 of the row's scale for a subnormal one: quantize.h's bound)
//   + each run's fp32 sum over K terms (K 2^-24 Σ|x||w|, Σ|x||w| <= ||x|| ||w||) and the scale's one rounding;
//   + 2^-7 ||x|| ||w'_n||: the fused kernels recompute rmsnorm's sum of squares per block, with a thread count that
//     follows the weight's bytes (gemv_v3_shape), so the two runs may sum h^2 in different orders, get an inv that
//     differs in its last bits, and round an element of x the other way: at most 2^-7 of |x_k| over both roundings.
// No x-dependent quantity is needed, so the bound holds for every logit of every step. Argmaxes must agree where
// the bf16-head run's top-1 margin exceeds twice the largest bound of the step's row; greedy ids up to the first
// step whose margin does not.
//
// The model: weights N(0, 0.002) with tied embeddings. At that size the layers add little to the residual stream
// (o_proj's output ~ 320 x 0.002 relative to an embedding entry), so each step's logits peak at the current token's
// own embedding row, far above the rest: most steps have margins far beyond the bound (~20x on paper), and the
// checks below compare real argmaxes rather than passing on near-ties. Probed on the CPU (the same model in bf16
// through lesson 08's forward, 48 teacher-forced rows): every row's margin 0.23 or more against a largest bound of
// 0.027, and greedy decoding repeats the last token (the peak is the current token's own row).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "fast_forward.h"
#include "fast_path.h"
#include "fp8.h"
#include "fp8_gemm.h"
#include "fp8_resident.h"
#include "generate.h"
#include "logits_check.h"
#include "megakernel.h"
#include "model_dir.h"
#include "quantize.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"
#include "testing/fp8_testing.h"

namespace tvllm {
namespace {

// The random model, quantized, opened resident and bound twice (the second with the FP8 lm_head).
struct HeadModels {
  testing::TempDir tmp;
  ModelDir dir;
  ModelWeights plain, fp8_head;
  static ModelDir make(const testing::TempDir& t) {
    testing::SyntheticLlama s;
    s.tied = true;  // as Llama-3.2-1B: the lm_head is the embedding table
    s.hidden = 320, s.heads = 5, s.kv_heads = 1, s.head_dim = 64, s.intermediate = 896, s.vocab = 2053, s.layers = 2;
    testing::write_random_llama_as(s, t / "bf16", 1616, "F32", 0.002f);
    quantize_checkpoint(t / "bf16", t / "fp8", QuantizeOptions{});
    install_fp8_resident_weights();
    return ModelDir::open(t / "fp8", Fp8Load::Resident);
  }
  HeadModels()
      : dir(make(tmp)), plain(ModelWeights::bind(dir, Device::CUDA)), fp8_head(ModelWeights::bind(dir, Device::CUDA)) {
    attach_fp8_lm_head(fp8_head);
  }
};
const HeadModels& models() {
  static const HeadModels m;
  return m;
}

// The bound of the header, one value per vocabulary row.
std::vector<double> logit_bounds(const ModelWeights& w) {
  const int64_t V = w.lm_head.shape[0], K = w.lm_head.shape[1];
  const std::vector<float> head = to_f32_vector(w.lm_head), g = to_f32_vector(w.final_norm);
  std::vector<uint8_t> codes(static_cast<size_t>(V * K));
  std::vector<float> scale(static_cast<size_t>(V));
  TVLLM_CUDA_CHECK(cudaMemcpy(codes.data(), w.lm_head_fp8.data, codes.size(), cudaMemcpyDeviceToHost));
  TVLLM_CUDA_CHECK(cudaMemcpy(scale.data(), w.lm_head_scale.data, scale.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double gmax = 0.0;
  for (float v : g) gmax = std::max(gmax, std::fabs(static_cast<double>(v)));
  const double X = std::sqrt(static_cast<double>(K)) * gmax * (1.0 + 0x1p-7) * (1.0 + 0x1p-7);
  std::vector<double> bound(static_cast<size_t>(V));
  for (int64_t n = 0; n < V; ++n) {
    double d2 = 0.0, w2 = 0.0, q2 = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(n * K + k);
      const double wq = static_cast<double>(fp8_to_f32(Fp8Kind::E4M3, codes[i])) * scale[static_cast<size_t>(n)];
      d2 += (wq - head[i]) * (wq - head[i]);
      w2 += static_cast<double>(head[i]) * head[i];
      q2 += wq * wq;
    }
    const double sums = static_cast<double>(K) * 0x1p-24 * X * (std::sqrt(w2) + std::sqrt(q2));
    const double prologue = 0x1p-7 * X * std::sqrt(q2);
    bound[static_cast<size_t>(n)] = X * std::sqrt(d2) + sums + 0x1p-23 * X * std::sqrt(q2) + prologue;
  }
  return bound;
}

// SyntheticLlama has 64 positions.
EngineLimits limits(const ModelWeights& w) { return Generator::limits_for(w.config, 64, 1, 64); }

FastPathOptions fused_only() {
  FastPathOptions o;
  o.megakernel = false;
  return o;
}

std::vector<int32_t> random_ids(uint64_t seed, int n, int64_t vocab) {
  Rng rng(seed);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(rng.below(vocab)));
  return ids;
}

TEST(Fp8LmHead16Gpu, TheCopyIsTheActivationQuantizerOfTheBf16LmHeadAndTheRestIsUntouched) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = models().fp8_head;
  const ModelWeights& p = models().plain;
  ASSERT_EQ(w.lm_head_fp8.dtype, DType::F8_E4M3);
  ASSERT_EQ(w.lm_head_fp8.shape, w.lm_head.shape);
  ASSERT_EQ(w.lm_head_scale.dtype, DType::F32);
  ASSERT_EQ(w.lm_head_scale.numel(), w.lm_head.shape[0]);
  EXPECT_EQ(w.lm_head.dtype, DType::BF16);  // the bf16 lm_head stays (embedding, prefill logits, megakernel)
  EXPECT_EQ(w.lm_head.data, w.embed.data);  // tied, as bound
  EXPECT_EQ(p.lm_head_fp8.data, nullptr);   // opt-in: nothing without attach_fp8_lm_head
  EXPECT_TRUE(fast_forward_supported(w));
  // The GPU quantizer against its CPU oracle (fp8_gemm.h: the same fp32 division and rounding), bit for bit.
  const int64_t V = w.lm_head.shape[0], K = w.lm_head.shape[1];
  std::vector<uint16_t> head(static_cast<size_t>(V * K));
  TVLLM_CUDA_CHECK(cudaMemcpy(head.data(), w.lm_head.data, head.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> want_codes(head.size()), got_codes(head.size());
  std::vector<float> want_scale(static_cast<size_t>(V)), got_scale(static_cast<size_t>(V));
  quantize_activations(TensorView::contiguous(want_codes.data(), DType::F8_E4M3, Device::CPU, {V, K}),
                       TensorView::contiguous(want_scale.data(), DType::F32, Device::CPU, {V}),
                       TensorView::contiguous(head.data(), DType::BF16, Device::CPU, {V, K}));
  TVLLM_CUDA_CHECK(cudaMemcpy(got_codes.data(), w.lm_head_fp8.data, got_codes.size(), cudaMemcpyDeviceToHost));
  TVLLM_CUDA_CHECK(cudaMemcpy(got_scale.data(), w.lm_head_scale.data, V * sizeof(float), cudaMemcpyDeviceToHost));
  int64_t code_mismatches = 0;
  for (size_t i = 0; i < want_codes.size(); ++i) code_mismatches += want_codes[i] != got_codes[i];
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_EQ(0, std::memcmp(want_scale.data(), got_scale.data(), want_scale.size() * sizeof(float)));
}

TEST(Fp8LmHead16Gpu, TeacherForcedLogitsAreWithinTheRoundingBoundAndArgmaxesAgreeWhereClear) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = models().fp8_head;
  const std::vector<double> bound = logit_bounds(w);
  const double bmax = *std::max_element(bound.begin(), bound.end());
  Generator with(w, limits(w)), without(models().plain, limits(models().plain));
  use_fast_path(with, fused_only());
  use_fast_path(without, fused_only());
  const int64_t V = w.config.vocab_size;
  int64_t rows = 0, clear_rows = 0;
  for (uint64_t seed : {1u, 2u}) {
    // A 7-token prefill (the fused path's gathered-row gemv) then 48 decode steps (the fused rmsnorm_gemv).
    const std::vector<int32_t> prompt = random_ids(seed, 7, V), forced = random_ids(seed + 100, 48, V);
    const Tensor a = with.forced_logits(prompt, forced), b = without.forced_logits(prompt, forced);
    const float* pa = a.view().ptr<const float>();
    const float* pb = b.view().ptr<const float>();
    const int64_t R = a.view().shape[0];
    double worst = 0.0, max_err = 0.0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < V; ++n) {
        const double err = std::fabs(static_cast<double>(pa[r * V + n]) - pb[r * V + n]);
        max_err = std::max(max_err, err);
        worst = std::max(worst, err / bound[static_cast<size_t>(n)]);
      }
    const Top1Agreement t = top1_agreement(a.view(), b.view(), 2 * bmax);
    std::printf("    seed %llu: max |err| %.3g, worst err / bound %.3f, largest bound %.3g; %s\n",
                static_cast<unsigned long long>(seed), max_err, worst, bmax, t.summary().c_str());
    EXPECT_LE(worst, 1.0) << "a logit moved by more than the lm_head's rounding allows";
    EXPECT_GT(max_err, 0.0) << "the same logits: did the decode read the FP8 lm_head?";
    EXPECT_TRUE(t.pass()) << t.summary();
    rows += t.positions;
    clear_rows += t.clear;
  }
  // The model was made so that margins are clear (header): a check that compares nothing would pass vacuously.
  EXPECT_GE(clear_rows, rows / 2) << "too few rows with a margin beyond the bound to test the argmax";
}

TEST(Fp8LmHead16Gpu, GreedyIdsAreEqualWhereTheMarginsAreClear) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = models().fp8_head;
  const std::vector<double> bound = logit_bounds(w);
  const double bmax = *std::max_element(bound.begin(), bound.end());
  Generator with(w, limits(w)), without(models().plain, limits(models().plain));
  Generator probe(models().plain, limits(models().plain));  // the bf16-head run's margins on its own ids
  use_fast_path(with, fused_only());
  use_fast_path(without, fused_only());
  use_fast_path(probe, fused_only());
  GenerateOptions opt;
  opt.max_new_tokens = 40;
  opt.ignore_eos = true;
  const int64_t V = w.config.vocab_size;
  int64_t compared = 0;
  for (uint64_t seed : {3u, 4u}) {
    const std::vector<int32_t> prompt = random_ids(seed, 9, V);
    const std::vector<int32_t> want = without.generate(prompt, opt).ids;
    const std::vector<int32_t> got = with.generate(prompt, opt).ids;
    const Tensor logits = probe.forced_logits(prompt, want);
    const float* row = logits.view().ptr<const float>();
    const int64_t clear =
        testing::rows_before_near_tie(row, static_cast<int64_t>(want.size()), V, 2 * bmax);
    const std::vector<int32_t> a(got.begin(), got.begin() + clear), b(want.begin(), want.begin() + clear);
    EXPECT_EQ(a, b) << "seed " << seed << ": clear up to step " << clear;
    compared += clear;
  }
  EXPECT_GE(compared, 20) << "too few steps before the first near-tie to test the greedy ids";
}

// The megakernel reads the bf16 lm_head (it declines any other dtype): with the FP8 copy attached it must run and
// give the same bits as on the weights without it.
TEST(Fp8LmHead16Gpu, TheMegakernelKeepsTheBf16LmHead) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = models().fp8_head;
  const std::string why = megakernel_declines(w);
  if (!why.empty()) GTEST_SKIP() << "the megakernel declines this setup: " << why;
  FastPathOptions mk;
  mk.megakernel = true;
  Generator with(w, limits(w)), without(models().plain, limits(models().plain));
  use_fast_path(with, mk);
  use_fast_path(without, mk);
  ASSERT_EQ(with.context().forward_fn(), &megakernel_forward);
  const int64_t V = w.config.vocab_size;
  const std::vector<int32_t> prompt = random_ids(5, 7, V), forced = random_ids(6, 24, V);
  const int64_t before = megakernel_steps_launched();
  const Tensor a = with.forced_logits(prompt, forced);
  EXPECT_EQ(megakernel_steps_launched() - before, 23) << "every decode step runs the megakernel";
  const Tensor b = without.forced_logits(prompt, forced);
  ASSERT_EQ(a.view().nbytes(), b.view().nbytes());
  // Row 0 is the prefill's (the fused path, which reads the FP8 copy); the decode rows are the megakernel's.
  const size_t row = static_cast<size_t>(V) * sizeof(float);
  EXPECT_EQ(0, std::memcmp(static_cast<const char*>(a.data()) + row, static_cast<const char*>(b.data()) + row,
                           a.view().nbytes() - row));
}

}  // namespace
}  // namespace tvllm
