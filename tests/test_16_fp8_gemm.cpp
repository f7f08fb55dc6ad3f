// Lesson 16 on the CPU: the FP8 tensor-core GEMM's host side (fp8_gemm.h): --fp8-gemm's parsing, the per-token
// activation quantizer's oracle, the double-precision reference of the quantized product and the layout rules.
//
// Tolerances. Quantizing to E4M3 (3 stored mantissa bits, round to nearest) moves a normal value by at most half
// a step: 2^-4 of its magnitude; below 2^-6 (E4M3's smallest normal) the step is fixed at 2^-9, so at most
// 2^-10 in code units, times the row's scale. The quantized product's error against the exact bf16 product then
// is at most (2^-4 + 2^-4 + 2^-8) Σ_k |x_k w_k| + the subnormal terms: we allow 2^-3 Σ|x w| + K 2^-10 s_x s_w 448.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "fp8.h"
#include "fp8_gemm.h"

namespace tvllm {
namespace {

TensorView host(std::vector<uint16_t>& v, Shape s) { return TensorView::contiguous(v.data(), DType::BF16, Device::CPU, s); }
TensorView host(std::vector<uint8_t>& v, Shape s) { return TensorView::contiguous(v.data(), DType::F8_E4M3, Device::CPU, s); }
TensorView host(std::vector<float>& v, Shape s) { return TensorView::contiguous(v.data(), DType::F32, Device::CPU, s); }

std::vector<uint16_t> random_bf16(int64_t n, double sigma, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = f32_to_bf16(static_cast<float>(sigma * rng.normal()));
  return v;
}

TEST(Fp8Gemm16, PathNamesRoundTripAndBadChoicesAreRefused) {
  for (Fp8GemmPath p : {Fp8GemmPath::Auto, Fp8GemmPath::ScaleVectors, Fp8GemmPath::Epilogue, Fp8GemmPath::Dequantize})
    EXPECT_EQ(parse_fp8_gemm_path(fp8_gemm_path_name(p)), p);
  EXPECT_EQ(fp8_gemm_path_name(Fp8GemmPath::ScaleVectors), "scale-vectors");
  EXPECT_THROW(parse_fp8_gemm_path("sometimes"), InputError);
  EXPECT_THROW(parse_fp8_gemm_path(""), InputError);
  EXPECT_THROW(parse_fp8_gemm_path("Epilogue"), InputError);  // exact spelling, as the CLI's other choices
  // With resident weights every path is allowed; without, only the two that need no codes.
  EXPECT_EQ(fp8_gemm_mode("epilogue", true), Fp8GemmPath::Epilogue);
  EXPECT_EQ(fp8_gemm_mode("scale-vectors", true), Fp8GemmPath::ScaleVectors);
  EXPECT_EQ(fp8_gemm_mode("auto", false), Fp8GemmPath::Auto);
  EXPECT_EQ(fp8_gemm_mode("dequantize", false), Fp8GemmPath::Dequantize);
  EXPECT_THROW(fp8_gemm_mode("epilogue", false), InputError);
  EXPECT_THROW(fp8_gemm_mode("scale-vectors", false), InputError);
  try {
    fp8_gemm_mode("epilogue", false);
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-weights resident"), std::string::npos) << e.what();
  }
}

// Every row's largest |x| becomes the top code ±448 (x / (amax / 448) is within an fp32 rounding of 448, and the
// encoder saturates rather than overflowing), and every code decodes to within half an E4M3 step of x / scale.
TEST(Fp8Gemm16, QuantizerRowsHitTheTopCode) {
  const int64_t T = 7, K = 300;
  std::vector<uint16_t> x = random_bf16(T * K, 3.0, 1);
  x[5] = f32_to_bf16(-1000.0f);  // row 0's amax is negative
  std::vector<uint8_t> codes(static_cast<size_t>(T * K));
  std::vector<float> scale(static_cast<size_t>(T));
  quantize_activations(host(codes, {T, K}), host(scale, {T}), host(x, {T, K}));
  for (int64_t t = 0; t < T; ++t) {
    float amax = 0.0f;
    int64_t at = 0;
    for (int64_t k = 0; k < K; ++k)
      if (std::fabs(bf16_to_f32(x[t * K + k])) > amax) amax = std::fabs(bf16_to_f32(x[t * K + k])), at = k;
    EXPECT_EQ(scale[t], amax / 448.0f) << "row " << t;
    const float top = fp8_to_f32(Fp8Kind::E4M3, codes[t * K + at]);
    EXPECT_EQ(std::fabs(top), 448.0f) << "row " << t;
    EXPECT_EQ(std::signbit(top), std::signbit(bf16_to_f32(x[t * K + at])));
    for (int64_t k = 0; k < K; ++k) {
      const double v = bf16_to_f32(x[t * K + k]) / scale[t];
      const double got = fp8_to_f32(Fp8Kind::E4M3, codes[t * K + k]);
      const double half_step = std::fabs(v) >= 0.015625 ? std::ldexp(std::fabs(v), -4) : std::ldexp(1.0, -10);
      EXPECT_LE(std::fabs(got - v), half_step * (1 + 1e-6)) << "row " << t << " k " << k;
    }
  }
  EXPECT_EQ(scale[0], 1000.0f / 448.0f);
}

TEST(Fp8Gemm16, QuantizerZeroRowAndSaturation) {
  const int64_t T = 3, K = 16, stride = 24;  // rows strided: a column view of a wider buffer
  std::vector<uint16_t> buf(static_cast<size_t>(T * stride), f32_to_bf16(123.0f));
  for (int64_t k = 0; k < K; ++k) {
    buf[static_cast<size_t>(0 * stride + k)] = 0;                                   // row 0: zeros
    buf[static_cast<size_t>(1 * stride + k)] = f32_to_bf16(k == 3 ? 1e-30f : 0.0f);  // row 1: one tiny value
    buf[static_cast<size_t>(2 * stride + k)] = f32_to_bf16(static_cast<float>(k) - 8.0f);
  }
  TensorView x = TensorView::contiguous(buf.data(), DType::BF16, Device::CPU, {T, stride}).columns(0, K);
  std::vector<uint8_t> codes(static_cast<size_t>(T * K), 0x55);
  std::vector<float> scale(static_cast<size_t>(T));
  quantize_activations(host(codes, {T, K}), host(scale, {T}), x);
  EXPECT_EQ(scale[0], 1.0f);  // amax 0: scale 1, codes +0, nothing divided by zero
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(codes[static_cast<size_t>(k)], 0x00) << k;
  EXPECT_EQ(codes[static_cast<size_t>(K + 3)], 0x7e);  // the tiny value is its row's top code: 448
  EXPECT_EQ(scale[2], 8.0f / 448.0f);
  EXPECT_EQ(codes[static_cast<size_t>(2 * K + 0)], 0xfe);  // -8 -> -448
  for (int64_t k = 1; k < K; ++k) {  // the 123s beyond K were not read: no code is 448 but k = 0
    EXPECT_LT(std::fabs(fp8_to_f32(Fp8Kind::E4M3, codes[static_cast<size_t>(2 * K + k)])), 448.0f) << k;
  }
  // Bad views are InputErrors naming the function.
  std::vector<float> small(2);
  EXPECT_THROW(quantize_activations(host(codes, {T, K}), host(small, {2}), x), InputError);
}

TEST(Fp8Gemm16, ReferenceIsTheScaledSumOfExactProducts) {
  // x codes: 1.0 (0x38), 2.0 (0x40), -0.5 (0xb0); w codes: 448 (0x7e), 1.0, 1.0.
  std::vector<uint8_t> xq = {0x38, 0x40, 0xb0}, wq = {0x7e, 0x38, 0x38};
  std::vector<float> sx = {0.25f}, sw = {3.0f};
  const Fp8GemmReference r = fp8_gemm_reference(host(xq, {1, 3}), host(sx, {1}), host(wq, {1, 3}), host(sw, {1}));
  ASSERT_EQ(r.value.size(), 1u);
  EXPECT_EQ(r.value[0], 0.75 * (448.0 + 2.0 - 0.5));
  EXPECT_EQ(r.abs_sum[0], 0.75 * (448.0 + 2.0 + 0.5));
}

// The whole quantized product (activations per token, weights per channel) against the exact bf16 product.
TEST(Fp8Gemm16, QuantizedProductApproximatesTheBf16Product) {
  const int64_t T = 5, N = 24, K = 256;
  std::vector<uint16_t> x = random_bf16(T * K, 1.0, 2), w = random_bf16(N * K, 0.05, 3);
  std::vector<uint8_t> xq(static_cast<size_t>(T * K)), wq(static_cast<size_t>(N * K));
  std::vector<float> sx(static_cast<size_t>(T)), sw(static_cast<size_t>(N));
  quantize_activations(host(xq, {T, K}), host(sx, {T}), host(x, {T, K}));
  quantize_activations(host(wq, {N, K}), host(sw, {N}), host(w, {N, K}));  // per-row weights: the same rule
  const Fp8GemmReference r = fp8_gemm_reference(host(xq, {T, K}), host(sx, {T}), host(wq, {N, K}), host(sw, {N}));
  double worst = 0.0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(bf16_to_f32(x[t * K + k])) * bf16_to_f32(w[n * K + k]);
        exact += p;
        abs_sum += std::fabs(p);
      }
      const double err = std::fabs(r.value[static_cast<size_t>(t * N + n)] - exact);
      const double tol = std::ldexp(abs_sum, -3) + K * std::ldexp(1.0, -10) * sx[t] * sw[n] * 448.0;
      EXPECT_LE(err, tol) << t << "," << n;
      worst = std::max(worst, err / abs_sum);
    }
  EXPECT_GT(worst, 0.0);  // quantization moved something: the test compares two different products
}

TEST(Fp8Gemm16, LayoutRulesNameWhatIsBroken) {
  alignas(16) static uint8_t buf[64];
  EXPECT_EQ(fp8_gemm_layout_problem(32, 2048, 2048, buf, buf, buf), "");
  EXPECT_NE(fp8_gemm_layout_problem(32, 336, 600, buf, buf, buf).find("K = 600"), std::string::npos);  // bundled down
  EXPECT_NE(fp8_gemm_layout_problem(32, 7, 64, buf, buf, buf).find("N = 7"), std::string::npos);
  EXPECT_NE(fp8_gemm_layout_problem(32, 64, 64, buf + 8, buf, buf).find("aligned"), std::string::npos);
  EXPECT_NE(fp8_gemm_layout_problem(0, 64, 64, buf, buf, buf), "");
}

}  // namespace
}  // namespace tvllm
