// Lesson 14, CPU: the GEMVs with FP8 weights (F8_E4M3 codes + one fp32 scale per row, lesson 16's checkpoints
// kept resident). The references must be the BF16 references' math with w[n, k] = q[n, k] * scale[n]: with
// power-of-two scales that product is exact, so the two must agree bit for bit. Plus a product by hand, the
// launch shape of 1-byte weights, and the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "gemv.h"
#include "testing/fp8_testing.h"

namespace tvllm {
namespace {

Tensor host(const std::vector<float>& v, Shape shape, DType dtype = DType::F32) {
  return Tensor::from_f32(v, std::move(shape), dtype, Device::CPU);
}

Tensor codes(const std::vector<uint8_t>& q, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::F8_E4M3, Device::CPU);
  std::memcpy(t.data(), q.data(), q.size());
  return t;
}

Tensor zeros(Shape shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Tensor::from_f32(std::vector<float>(static_cast<size_t>(n), 0.0f), std::move(shape), dtype, Device::CPU);
}

float bf16r(float v) { return bf16_to_f32(f32_to_bf16(v)); }


TEST(GemvFp8Cpu14, KnownProductByHand) {
  // q = [[1, 2, -1], [0.5, 1, 2]] (E4M3 0x38, 0x40, 0xB8, 0x30), scales [2, 0.25], x = [[1, 2, 3]]:
  // row 0: (1 + 4 - 3) * 2 = 4; row 1: (0.5 + 2 + 6) * 0.25 = 2.125.
  Tensor q = codes({0x38, 0x40, 0xB8, 0x30, 0x38, 0x40}, {2, 3});
  Tensor scale = host({2.0f, 0.25f}, {2});
  Tensor x = host({1, 2, 3}, {1, 3}, DType::BF16);
  Tensor out = Tensor::empty({1, 2}, DType::F32, Device::CPU);
  gemv(out, x, q, scale);
  EXPECT_EQ(to_f32_vector(out), (std::vector<float>{4.0f, 2.125f}));
}

// The FP8 references against the BF16/F32 ones on w = q * scale, exact with power-of-two scales.
TEST(GemvFp8Cpu14, EveryReferenceEqualsTheDequantizedWeightsBitForBit) {
  const int64_t M = 3, K = 48, N = 10;  // N even: gate | up with I = 5
  const std::vector<uint8_t> q = testing::random_e4m3_codes(static_cast<size_t>(N * K), 5);
  std::vector<float> s(static_cast<size_t>(N)), w(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n) s[n] = std::ldexp(1.0f, static_cast<int>(-6 - n % 4));
  for (int64_t i = 0; i < N * K; ++i) w[i] = fp8_e4m3_to_f32(q[i]) * s[i / K];  // exact: a power of two
  const Tensor qt = codes(q, {N, K}), st = host(s, {N}), wt = host(w, {N, K});
  std::vector<float> xv = random_uniform(static_cast<size_t>(M * K), 6);
  for (float& v : xv) v = bf16r(v);
  const Tensor x = host(xv, {M, K}, DType::BF16), g = host(random_uniform(K, 7, 0.5f, 1.5f), {K}, DType::BF16);
  const float eps = 1e-5f;
  const auto same = [](const Tensor& a, const Tensor& b) { EXPECT_EQ(to_f32_vector(a), to_f32_vector(b)); };
  {
    Tensor a = zeros({M, N}, DType::F32), b = zeros({M, N}, DType::F32);
    gemv_cpu(a, x, qt, st);
    gemv_cpu(b, x, wt);
    same(a, b);
  }
  {
    Tensor a = zeros({M, N}, DType::BF16), b = zeros({M, N}, DType::BF16);
    rmsnorm_gemv_cpu(a, x, g, eps, qt, st);
    rmsnorm_gemv_cpu(b, x, g, eps, wt);
    same(a, b);
  }
  {
    Tensor a = zeros({M, N / 2}, DType::BF16), b = zeros({M, N / 2}, DType::BF16);
    rmsnorm_gemv_silu_mul_cpu(a, x, g, eps, qt, st);
    rmsnorm_gemv_silu_mul_cpu(b, x, g, eps, wt);
    same(a, b);
  }
  {
    const std::vector<float> h0 = random_uniform(static_cast<size_t>(M * N), 8);
    Tensor a = host(h0, {M, N}, DType::BF16), b = host(h0, {M, N}, DType::BF16);
    gemv_residual_cpu(a, x, qt, st);
    gemv_residual_cpu(b, x, wt);
    same(a, b);
    EXPECT_NE(to_f32_vector(a), to_f32_vector(host(h0, {M, N}, DType::BF16)));  // it did add something
  }
}

TEST(GemvFp8Cpu14, TheScaleMultipliesTheFinishedSum) {
  // A non-power-of-two scale: the reference multiplies the exact sum once (double), then rounds to fp32.
  Tensor q = codes({0x38, 0x38, 0x38}, {1, 3});  // 1, 1, 1
  Tensor x = host({1.0f, 1.0f, 1.0f}, {1, 3}, DType::BF16);
  Tensor scale = host({0.1f}, {1});
  Tensor out = Tensor::empty({1, 1}, DType::F32, Device::CPU);
  gemv(out, x, q, scale);
  EXPECT_EQ(to_f32_vector(out)[0], static_cast<float>(3.0 * static_cast<double>(0.1f)));
}

TEST(GemvFp8Cpu14, ShapeOfOneByteWeightsFollowsTheirPacks) {
  // 16 E4M3 weights per 16-byte pack: a row of K codes is as many packs as a bf16 row of K / 2.
  for (int64_t K : {2048, 8192, 640}) {
    const GemvV3Shape a = gemv_v3_shape(3072, K, 1), b = gemv_v3_shape(3072, K / 2, 2);
    EXPECT_EQ(a.threads, b.threads) << K;
    EXPECT_EQ(a.rows_per_block, b.rows_per_block);
    EXPECT_EQ(a.blocks, b.blocks);
  }
  EXPECT_EQ(gemv_v3_shape(2048, 2048, 1).threads, 128);  // 128 packs of 16 codes
  EXPECT_EQ(gemv_v3_shape(2048, 8192, 1).threads, 256);
}

TEST(GemvFp8Cpu14, SupportedNeedsKMultipleOfEight) {
  // As for bf16: 16 codes per 16-byte load when K % 16 == 0, else 8 per 8-byte load (K = 600 in the bundled model).
  const Tensor q32 = codes(std::vector<uint8_t>(4 * 32, 0x38), {4, 32});
  const Tensor q24 = codes(std::vector<uint8_t>(4 * 24, 0x38), {4, 24});
  const Tensor q20 = codes(std::vector<uint8_t>(4 * 20, 0x38), {4, 20});
  EXPECT_TRUE(gemv_shape_supported(q32, DType::BF16));
  EXPECT_TRUE(gemv_shape_supported(q32, DType::F32));
  EXPECT_TRUE(gemv_shape_supported(q24, DType::BF16));
  EXPECT_FALSE(gemv_shape_supported(q20, DType::BF16));  // K % 8 != 0: x's 16-byte loads do not fit
  EXPECT_FALSE(gemv_shape_supported(q32, DType::F16));
  const Tensor x24 = zeros({1, 24}, DType::BF16);
  EXPECT_TRUE(gemv_supported(x24, q24));
  const Tensor x20 = zeros({1, 20}, DType::BF16);
  EXPECT_FALSE(gemv_supported(x20, q20));
}

TEST(GemvFp8Cpu14, BadScalesAreInputErrors) {
  const Tensor q = codes(std::vector<uint8_t>(4 * 16, 0x38), {4, 16});
  const Tensor w = zeros({4, 16}, DType::BF16);
  const Tensor x = zeros({1, 16}, DType::BF16);
  Tensor out = Tensor::empty({1, 4}, DType::F32, Device::CPU);
  const Tensor good = host({1, 1, 1, 1}, {4});
  EXPECT_NO_THROW(gemv(out, x, q, good));
  EXPECT_NO_THROW(gemv(out, x, q, host({1, 1, 1, 1}, {4, 1})));            // the checkpoint's [N, 1]
  EXPECT_THROW(gemv(out, x, q, TensorView{}), InputError);                  // FP8 without its scales
  EXPECT_THROW(gemv(out, x, q), InputError);                                // the BF16-only entry point
  EXPECT_THROW(gemv(out, x, q, host({1, 1, 1}, {3})), InputError);          // one short
  EXPECT_THROW(gemv(out, x, q, host({1, 1, 1, 1}, {4}, DType::BF16)), InputError);  // scales are F32
  EXPECT_THROW(gemv(out, x, w, good), InputError);                          // a scale for BF16 weights
  EXPECT_NO_THROW(gemv(out, x, w, TensorView{}));
  const Tensor h = zeros({1, 4}, DType::BF16), g = zeros({16}, DType::BF16);
  EXPECT_THROW(rmsnorm_gemv(out, x, g, 1e-5f, q), InputError);
  Tensor act = Tensor::empty({1, 2}, DType::BF16, Device::CPU);
  EXPECT_THROW(rmsnorm_gemv_silu_mul(act, x, g, 1e-5f, q, host({1, 1}, {2})), InputError);
  EXPECT_THROW(gemv_residual(h, x, q, TensorView{}), InputError);
  // E5M2 is not a weight format the GEMVs take.
  Tensor e5 = Tensor::empty({4, 16}, DType::F8_E5M2, Device::CPU);
  std::memset(e5.data(), 0, e5.view().nbytes());
  EXPECT_THROW(gemv(out, x, e5, good), InputError);
}

// Fp8GemvVariant::Bits (gemv.cu): (code & 0x7F) << 7 read as a half, the sign at bit 15, is 2^-8 x the E4M3 value
// for every code but the two NaNs: normals, subnormals (0x01..0x07: half subnormals) and both zeros. Both lanes.
TEST(GemvFp8Cpu14, BitsDecodingIsTheCodeTimesTwoToTheMinusEight) {
  int checked = 0;
  for (uint32_t code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN: Bits reads it as +-480 (gemv.h); checkpoints never hold it
    const float want = std::ldexp(fp8_e4m3_to_f32(static_cast<uint8_t>(code)), -8);
    const uint32_t both = detail::e4m3_lanes_to_half2_bits(code << 8 | code << 24);
    const float lo = f16_to_f32(static_cast<uint16_t>(both & 0xFFFFu));
    const float hi = f16_to_f32(static_cast<uint16_t>(both >> 16));
    EXPECT_EQ(lo, want) << "code 0x" << std::hex << code;
    EXPECT_EQ(hi, want) << "code 0x" << std::hex << code;
    EXPECT_EQ(std::signbit(lo), std::signbit(want)) << "code 0x" << std::hex << code;
    // A neighbour in the other lane must not leak into this one (its sign bit is the one that could).
    const uint32_t mixed = detail::e4m3_lanes_to_half2_bits(code << 8 | 0xFFu << 24);
    EXPECT_EQ(f16_to_f32(static_cast<uint16_t>(mixed & 0xFFFFu)), want) << "code 0x" << std::hex << code;
    ++checked;
  }
  EXPECT_EQ(checked, 254);
  // The smallest subnormal, 2^-9, and the largest normal, 448, by value.
  EXPECT_EQ(f16_to_f32(static_cast<uint16_t>(detail::e4m3_lanes_to_half2_bits(0x01u << 8))), std::ldexp(1.0f, -17));
  EXPECT_EQ(f16_to_f32(static_cast<uint16_t>(detail::e4m3_lanes_to_half2_bits(0x7Eu << 8))), 448.0f / 256.0f);
}

TEST(GemvFp8Cpu14, VariantsHaveNamesAndOneEntryPerCompiledBatch) {
  for (Fp8GemvVariant v : all_fp8_gemv_variants()) {
    EXPECT_NE(v, Fp8GemvVariant::Auto);
    EXPECT_EQ(parse_fp8_gemv_variant(fp8_gemv_variant_name(v)), v);
  }
  EXPECT_EQ(all_fp8_gemv_variants().size(), 3u);
  EXPECT_EQ(parse_fp8_gemv_variant("auto"), Fp8GemvVariant::Auto);
  EXPECT_EQ(parse_fp8_gemv_variant("bits-tile8"), Fp8GemvVariant::BitsTile8);
  EXPECT_THROW(parse_fp8_gemv_variant("fast"), InputError);
  EXPECT_THROW(parse_fp8_gemv_variant(""), InputError);
  // The table: never Auto; M picks the entry of the kernel compiled for it (1, 2, 4, 8, 16 rows).
  for (Fp8GemvVariant v : kFp8GemvVariantByRows) EXPECT_NE(v, Fp8GemvVariant::Auto);
  const int slot_of[17] = {-1, 0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4};
  for (int64_t M = 1; M <= kGemvMaxRows; ++M)
    EXPECT_EQ(fp8_gemv_variant_for_rows(M), kFp8GemvVariantByRows[slot_of[M]]) << "M=" << M;
  EXPECT_THROW(fp8_gemv_variant_for_rows(0), InputError);
  EXPECT_THROW(fp8_gemv_variant_for_rows(kGemvMaxRows + 1), InputError);
}

}  // namespace
}  // namespace tvllm
