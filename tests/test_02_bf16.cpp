// Lesson 02 on the CPU: the chapter's worked examples as known answers, rounding by definition against
// the fast conversions, the experiments' claims, and the argument checks of the conversion functions.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include "bf16.h"
#include "common/errors.h"
#include "common/random.h"
#include "model_dir.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// ---- the chapter's worked examples -----------------------------------------------------------------

TEST(WorkedExamples, OnePointOne) {
  // 1.1f = 0x3f8ccccd: keep 0x3f8c, drop 0xcccd > 0x8000, so round up to 0x3f8d = 1.1015625
  EXPECT_EQ(f32_bits(1.1f), 0x3f8ccccdu);
  EXPECT_EQ(f32_to_bf16(1.1f), 0x3f8d);
  EXPECT_EQ(bf16_to_f32(0x3f8d), 1.1015625f);
  EXPECT_EQ(f32_to_bf16_truncate(1.1f), 0x3f8c);  // truncation: 1.09375, the further neighbour
  EXPECT_EQ(bf16_to_f32(0x3f8c), 1.09375f);
}

TEST(WorkedExamples, Pi) {
  // 0x40490fdb: dropped half 0x0fdb < 0x8000, round down to 0x4049 = 3.140625
  EXPECT_EQ(f32_bits(3.14159265f), 0x40490fdbu);
  EXPECT_EQ(f32_to_bf16(3.14159265f), 0x4049);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
}

TEST(WorkedExamples, TiesToEven) {
  // 1 + 2^-8 = 0x3f808000: exactly half-way between 0x3f80 (even) and 0x3f81 (odd): down to 1.0
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 = 0x3f818000: half-way between 0x3f81 (odd) and 0x3f82 (even): up to 1.015625
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
  EXPECT_EQ(bf16_to_f32(0x3f82), 1.015625f);
  // 3000 = 0x453b8000 is a tie too: 0x453b is odd, so it goes up to 0x453c = 3008
  EXPECT_EQ(f32_bits(3000.0f), 0x453b8000u);
  EXPECT_EQ(f32_to_bf16(3000.0f), 0x453c);
  EXPECT_EQ(bf16_to_f32(0x453c), 3008.0f);
}

TEST(WorkedExamples, TheRoundingBiasTrick) {
  // the line `(u + 0x7fff + lsb) >> 16` on 0x3f808000 (lsb 0): 0x3f80ffff >> 16 = 0x3f80
  EXPECT_EQ((0x3f808000u + 0x7fffu + 0u) >> 16, 0x3f80u);
  // on 0x3f818000 (lsb 1): 0x3f820000 >> 16 = 0x3f82: the carry rounds up
  EXPECT_EQ((0x3f818000u + 0x7fffu + 1u) >> 16, 0x3f82u);
  // a carry out of the mantissa moves into the exponent: 0x3fffffff (1.99999988) becomes 2.0
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3fffffff)), 0x4000);
  EXPECT_EQ(bf16_to_f32(0x4000), 2.0f);
}

TEST(WorkedExamples, RangeAndOverflow) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);   // fp16's largest
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);   // half-way to 65536: rounds up, to inf
  EXPECT_EQ(f32_to_bf16(65504.0f), 0x4780);  // bf16 has no trouble: 65536
  EXPECT_EQ(f32_to_f16(9e6f), 0x7c00);       // 3000^2 overflows fp16
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(9e6f)), 8978432.0f);
  EXPECT_EQ(f32_to_f16(1e-8f), 0x0000);      // below half of fp16's smallest subnormal: zero
  EXPECT_NEAR(bf16_to_f32(f32_to_bf16(1e-8f)), 1e-8, 1e-8 / 256);
  EXPECT_EQ(f32_to_bf16(3.4e38f), 0x7f80);   // above bf16's largest + half an ulp: inf
}

// ---- rounding by definition ----------------------------------------------------------------------

TEST(RoundByDefinition, AgreesWithTheFastConversionsOnRandomPatterns) {
  Rng rng(99);
  for (int i = 0; i < (1 << 20); ++i) {
    uint32_t u = static_cast<uint32_t>(rng.next_u64());
    float x = f32_from_bits(u);
    if (std::isnan(x)) {
      EXPECT_TRUE(bf16_is_nan(bf16_round_by_definition(x)));
      EXPECT_TRUE(f16_is_nan(f16_round_by_definition(x)));
      continue;
    }
    ASSERT_EQ(bf16_round_by_definition(x), f32_to_bf16(x)) << std::hex << u;
    ASSERT_EQ(f16_round_by_definition(x), f32_to_f16(x)) << std::hex << u;
  }
}

TEST(RoundByDefinition, KnownAnswers) {
  EXPECT_EQ(bf16_round_by_definition(1.1f), 0x3f8d);
  EXPECT_EQ(bf16_round_by_definition(1.00390625f), 0x3f80);
  EXPECT_EQ(bf16_round_by_definition(1.01171875f), 0x3f82);
  EXPECT_EQ(bf16_round_by_definition(-0.0f), 0x8000);
  EXPECT_EQ(bf16_round_by_definition(INFINITY), 0x7f80);
  EXPECT_EQ(bf16_round_by_definition(f32_from_bits(0x7f7f8000)), 0x7f80);  // overflow on the tie
  EXPECT_EQ(bf16_round_by_definition(f32_from_bits(0x00008001)), 0x0001);  // subnormal
  EXPECT_EQ(bf16_round_by_definition(NAN), 0x7fc0);
  EXPECT_EQ(f16_round_by_definition(65520.0f), 0x7c00);
  EXPECT_EQ(f16_round_by_definition(65519.0f), 0x7bff);
  EXPECT_EQ(f16_round_by_definition(0x1.8p-24f), 0x0002);  // subnormal tie, to even
  EXPECT_EQ(f16_round_by_definition(0x1p-14f), 0x0400);    // the smallest normal
  EXPECT_EQ(f16_round_by_definition(-NAN) & 0x8000u, 0x8000u);
}

TEST(RoundByDefinition, EveryBf16TieGoesToEven) {
  for (uint32_t hi = 0; hi < 0x7f80; ++hi) {  // positive finite top halves
    float tie = f32_from_bits(hi << 16 | 0x8000u);
    uint16_t even = static_cast<uint16_t>((hi & 1u) ? hi + 1 : hi);
    ASSERT_EQ(bf16_round_by_definition(tie), even) << std::hex << hi;
    ASSERT_EQ(f32_to_bf16(tie), even) << std::hex << hi;
    ASSERT_EQ(f32_to_bf16(-tie), even | 0x8000u) << std::hex << hi;
  }
}

// ---- the experiments' claims --------------------------------------------------------------------------

TEST(Experiments, PrecisionStaysUnderTheBoundAndNearIt) {
  for (const PrecisionRow& r : precision_experiments(200000, 1)) {
    SCOPED_TRACE(r.format);
    EXPECT_EQ(r.bound, std::ldexp(1.0, -r.significant_bits));
    EXPECT_LE(r.measured_max_rel, r.bound);         // never worse than half an ulp
    EXPECT_GT(r.measured_max_rel, 0.9 * r.bound);   // and the worst case is actually reached
  }
}

TEST(Experiments, TruncationIsBiasedAndRoundingIsNot) {
  std::vector<BiasRow> rows = bias_experiments(200000, 3);
  ASSERT_EQ(rows.size(), 2u);
  for (const BiasRow& r : rows) {
    SCOPED_TRACE(r.inputs);
    // truncation always shrinks the magnitude: on average by about half an ulp, ~2^-8 relative
    EXPECT_LT(r.truncate_mean_rel, -1e-3);
    EXPECT_GT(r.truncate_mean_rel, -4e-3);
    // round-to-nearest-even errs both ways: the mean is far smaller than one rounding
    EXPECT_LT(std::fabs(r.rne_mean_rel), 1e-4);
  }
  // on positive values the truncated sum is low by ~0.3%; the rounded sum is not
  EXPECT_LT(rows[1].truncate_sum_rel, -1e-3);
  EXPECT_LT(std::fabs(rows[1].rne_sum_rel), 1e-4);
}

TEST(Experiments, Bf16StopsCountingAt256) {
  EXPECT_EQ(count_in_bf16(100), 100.0f);
  EXPECT_EQ(count_in_bf16(256), 256.0f);
  EXPECT_EQ(count_in_bf16(10000), 256.0f);   // 256 + 1 = 257 is a tie between 256 and 258: even is 256
  EXPECT_EQ(count_in_f16(10000), 2048.0f);   // fp16 has 3 more bits: stops at 2048
}

TEST(Experiments, RangeTable) {
  std::vector<RangeRow> rows = range_experiments();
  bool saw_fp16_overflow = false, saw_fp16_underflow = false;
  for (const RangeRow& r : rows) {
    SCOPED_TRACE(r.what);
    if (std::isinf(r.as_f16) && !std::isinf(r.as_f32)) saw_fp16_overflow = true;
    if (r.as_f16 == 0.0f && r.as_f32 != 0.0f) saw_fp16_underflow = true;
    if (std::fabs(r.exact) < 3e38 && std::fabs(r.exact) > 1e-37) {
      // bf16 keeps fp32's range: every such value survives within one bf16 rounding
      EXPECT_LE(std::fabs(r.as_bf16 - r.as_f32), std::ldexp(std::fabs(r.as_f32), -8));
    }
  }
  EXPECT_TRUE(saw_fp16_overflow);
  EXPECT_TRUE(saw_fp16_underflow);
}

// ---- the conversion functions on host views -------------------------------------------------------------

TEST(ConvertCpu, RoundTripsEveryBf16Pattern) {
  std::vector<uint16_t> all(65536), back(65536, 0);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  std::vector<float> wide(65536);
  TensorView vb = TensorView::contiguous(all.data(), DType::BF16, Device::CPU, {256, 256});
  TensorView vw = TensorView::contiguous(wide.data(), DType::F32, Device::CPU, {65536});
  TensorView vback = TensorView::contiguous(back.data(), DType::BF16, Device::CPU, {65536});
  convert_bf16_to_f32(vw, vb);
  convert_f32_to_bf16(vback, vw);
  for (uint32_t b = 0; b < 65536; ++b) {
    ASSERT_EQ(f32_bits(wide[b]), b << 16);
    uint16_t want = bf16_is_nan(static_cast<uint16_t>(b)) ? static_cast<uint16_t>(b | 0x40u) : static_cast<uint16_t>(b);
    ASSERT_EQ(back[b], want) << std::hex << b;
  }
}

TEST(ConvertCpu, Fp16) {
  std::vector<float> x = {1.0f, 65504.0f, 65520.0f, 0x1p-25f, 0x1.8p-24f, -2.0f};
  std::vector<uint16_t> out(x.size(), 0xabcd);
  convert_f32_to_f16(TensorView::contiguous(out.data(), DType::F16, Device::CPU, {6}),
                     TensorView::contiguous(x.data(), DType::F32, Device::CPU, {6}));
  EXPECT_EQ(out, (std::vector<uint16_t>{0x3c00, 0x7bff, 0x7c00, 0x0000, 0x0002, 0xc000}));
}

TEST(ConvertCpu, FillBitPatternsWraps) {
  std::vector<float> x(4);
  fill_f32_bit_patterns(TensorView::contiguous(x.data(), DType::F32, Device::CPU, {4}), 0xfffffffeu);
  EXPECT_EQ(f32_bits(x[0]), 0xfffffffeu);
  EXPECT_EQ(f32_bits(x[1]), 0xffffffffu);
  EXPECT_EQ(f32_bits(x[2]), 0x00000000u);
  EXPECT_EQ(f32_bits(x[3]), 0x00000001u);
}

TEST(ConvertCpu, RejectsBadArguments) {
  std::vector<float> f(4);
  std::vector<uint16_t> h(4), h3(3);
  TensorView vf = TensorView::contiguous(f.data(), DType::F32, Device::CPU, {4});
  TensorView vb = TensorView::contiguous(h.data(), DType::BF16, Device::CPU, {4});
  TensorView vh = TensorView::contiguous(h.data(), DType::F16, Device::CPU, {4});
  TensorView vb3 = TensorView::contiguous(h3.data(), DType::BF16, Device::CPU, {3});
  EXPECT_THROW(convert_f32_to_bf16(vh, vf), InputError);   // out must be BF16
  EXPECT_THROW(convert_f32_to_bf16(vb, vb), InputError);   // x must be F32
  EXPECT_THROW(convert_f32_to_bf16(vb3, vf), InputError);  // counts differ
  EXPECT_THROW(convert_f32_to_bf16(vb, vf, "v7"), InputError);
  EXPECT_THROW(convert_bf16_to_f32(vf, vh), InputError);
  EXPECT_THROW(convert_f32_to_f16(vb, vf), InputError);
  TensorView on_gpu = vf;
  on_gpu.device = Device::CUDA;
  EXPECT_THROW(convert_f32_to_bf16(vb, on_gpu), InputError);  // mixed devices
  TensorView strided = TensorView::contiguous(f.data(), DType::F32, Device::CPU, {2, 2});
  strided.strides = {1, 2};
  EXPECT_THROW(convert_f32_to_bf16(vb, strided), InputError);
  try {
    convert_f32_to_bf16(vb3, vf);
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("BF16[3]"), std::string::npos) << e.what();
  }
}

TEST(ConvertCpu, BundledModelWeightsRoundTrip) {
  std::filesystem::path dir = testing::tiny_model_dir();
  if (!std::filesystem::exists(dir / "config.json")) GTEST_SKIP() << "no bundled model at " << dir;
  ModelDir model = ModelDir::open(dir);
  TensorView emb = model.weights.host("model.embed_tokens.weight");
  ASSERT_EQ(emb.dtype, DType::BF16);
  ASSERT_EQ(emb.shape, (Shape{model.config.vocab_size, model.config.hidden_size}));
  const uint16_t* b = emb.ptr<uint16_t>();
  int64_t nonzero = 0;
  for (int64_t i = 0; i < emb.numel(); ++i) {
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(b[i])), b[i]) << i;
    nonzero += (b[i] & 0x7fffu) != 0;
  }
  EXPECT_GT(nonzero, emb.numel() / 2);  // real weights, not an all-zero file
}

}  // namespace
}  // namespace tvllm
