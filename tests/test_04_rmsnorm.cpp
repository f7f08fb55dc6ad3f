// Lesson 04 on the CPU: RMSNorm known answers worked out by hand, properties of the reference, the fused
// residual form, argument checks, and the v3 launch-shape rule (host code, no GPU needed).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "rmsnorm.h"

namespace tvllm {
namespace {

// Hand-computed values carry 10 significant digits; the reference rounds to fp32 (2^-24 ~ 6e-8 relative).
constexpr double kHandRtol = 1e-6;

Tensor f32(const std::vector<float>& v, Shape shape) {
  return Tensor::from_f32(v, std::move(shape), DType::F32, Device::CPU);
}

std::vector<float> run_rmsnorm(const std::vector<float>& x, const std::vector<float>& w, int64_t rows,
                               float eps) {
  const int64_t H = static_cast<int64_t>(w.size());
  Tensor tx = f32(x, {rows, H}), tw = f32(w, {H});
  Tensor out = Tensor::empty({rows, H}, DType::F32, Device::CPU);
  rmsnorm(out, tx, tw, eps);
  return to_f32_vector(out);
}

template <class F>
void expect_input_error(F f, const std::string& part) {
  try {
    f();
    FAIL() << "expected an InputError mentioning '" << part << "'";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(RmsNorm04, KnownAnswerOneToFour) {
  // x = [1, 2, 3, 4]: sum of squares 30, mean 7.5, rms = sqrt(7.5) = 2.738612788, 1/rms = 0.3651483717
  const std::vector<float> y = run_rmsnorm({1, 2, 3, 4}, {1, 1, 1, 1}, 1, 0.0f);
  const double expected[] = {0.3651483717, 0.7302967433, 1.095445115, 1.460593487};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i], expected[i], kHandRtol * expected[i]) << "element " << i;
}

TEST(RmsNorm04, KnownAnswerEpsAndWeight) {
  // x = [2, 2, 2, 2]: mean of squares 4; eps 12 makes it 16, so 1/rms = 1/4 and every x/rms = 0.5 exactly;
  // then the weight scales each element. Every number here is exact in binary.
  const std::vector<float> y = run_rmsnorm({2, 2, 2, 2}, {1, -0.5f, 2, 0.25f}, 1, 12.0f);
  EXPECT_EQ(y, (std::vector<float>{0.5f, -0.25f, 1.0f, 0.125f}));
}

TEST(RmsNorm04, ZeroRowGivesZeros) {
  // mean 0 + eps: 1/rms = 1/sqrt(eps) is finite, and 0 times it is 0 (eps exists for exactly this row)
  const std::vector<float> y = run_rmsnorm({0, 0, 0}, {1, 2, 3}, 1, 1e-5f);
  EXPECT_EQ(y, (std::vector<float>{0, 0, 0}));
}

TEST(RmsNorm04, RowsAreIndependentAndScaleInvariant) {
  // Without eps, rmsnorm(c * x) == rmsnorm(x): row 1 is row 0 times 1000, row 2 is row 0 times 2^-20.
  const int64_t H = 37;
  std::vector<float> row = random_normal(H, 5), w = random_uniform(H, 6, 0.5f, 1.5f);
  std::vector<float> x;
  for (float c : {1.0f, 1000.0f, 1.0f / 1048576.0f})
    for (float v : row) x.push_back(c * v);
  const std::vector<float> y = run_rmsnorm(x, w, 3, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_NEAR(y[H + h], y[h], 1e-6 * std::fabs(y[h]) + 1e-7) << h;
    EXPECT_NEAR(y[2 * H + h], y[h], 1e-6 * std::fabs(y[h]) + 1e-7) << h;
  }
  // and the normalised row has root-mean-square 1 before the weight: check with w = 1
  const std::vector<float> unit = run_rmsnorm(row, std::vector<float>(H, 1.0f), 1, 0.0f);
  double ms = 0;
  for (float v : unit) ms += static_cast<double>(v) * v;
  EXPECT_NEAR(ms / H, 1.0, 1e-6);
}

TEST(RmsNorm04, HugeAndTinyMagnitudes) {
  // |x| = 3e4: x^2 = 9e8 overflows fp16 (max 65504), and 1e18 (x^2 = 1e36, x 64 = 6.4e37) is near fp32's
  // limit, but a constant row c normalises to sign(c) * w either way. 1e-30 squares to 1e-60, below fp32's
  // range: eps takes over and y = x / sqrt(eps).
  const int64_t H = 64;
  std::vector<float> w = random_uniform(H, 4, -2.f, 2.f);
  for (float c : {3.0e4f, -1.0e18f}) {
    const std::vector<float> y = run_rmsnorm(std::vector<float>(H, c), w, 1, 1e-5f);
    for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(y[h], (c > 0 ? 1 : -1) * w[h], 1e-6 * std::fabs(w[h])) << c;
  }
  const std::vector<float> tiny = run_rmsnorm(std::vector<float>(H, 1e-30f), w, 1, 1e-4f);
  for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(tiny[h], 1e-30 * 100.0 * w[h], 1e-6 * std::fabs(1e-28 * w[h]));
}

TEST(RmsNorm04, AllOnesNeedsMoreThanBf16Accumulation) {
  // 8200 ones: the sum of squares is 8200. A bf16 running sum would stall at 256 (256 + 1 rounds back to
  // 256 with 8 significant bits) and give 1/rms = sqrt(8200/256) = 5.7 instead of 1.
  const int64_t H = 8200;
  const std::vector<float> y = run_rmsnorm(std::vector<float>(H, 1.0f), std::vector<float>(H, 1.0f), 1, 0.0f);
  for (int64_t h = 0; h < H; ++h) ASSERT_EQ(y[h], 1.0f) << h;
}

TEST(RmsNorm04, Bf16WeightIsWidenedExactly) {
  const int64_t H = 50;
  std::vector<float> x = random_normal(H, 1), w = random_uniform(H, 2, 0.5f, 1.5f);
  Tensor w_bf16 = Tensor::from_f32(w, {H}, DType::BF16, Device::CPU);
  std::vector<float> w_rounded = to_f32_vector(w_bf16);
  Tensor tx = f32(x, {1, H}), out = Tensor::empty({1, H}, DType::F32, Device::CPU);
  rmsnorm(out, tx, w_bf16, 1e-5f);
  EXPECT_EQ(to_f32_vector(out), run_rmsnorm(x, w_rounded, 1, 1e-5f));
}

TEST(RmsNorm04, InPlaceEqualsOutOfPlace) {
  const int64_t T = 3, H = 33;
  std::vector<float> x = random_normal(T * H, 8), w = random_uniform(H, 9, -1.f, 1.f);
  Tensor tx = f32(x, {T, H}), tw = f32(w, {H});
  rmsnorm(tx, tx, tw, 1e-6f);
  EXPECT_EQ(to_f32_vector(tx), run_rmsnorm(x, w, T, 1e-6f));
}

TEST(RmsNorm04, FusedKnownAnswer) {
  // residual [1, 1] + x [1, 3] = [2, 4]; mean of squares (4 + 16) / 2 = 10; eps 6 -> 16 -> 1/rms = 1/4
  Tensor residual = f32({1, 1}, {1, 2}), x = f32({1, 3}, {1, 2}), w = f32({3, -1}, {2});
  Tensor out = Tensor::empty({1, 2}, DType::F32, Device::CPU);
  add_rmsnorm(residual, x, w, out, 6.0f);
  EXPECT_EQ(to_f32_vector(residual), (std::vector<float>{2, 4}));
  EXPECT_EQ(to_f32_vector(out), (std::vector<float>{1.5f, -1.0f}));
}

TEST(RmsNorm04, FusedEqualsAddThenNorm) {
  const int64_t T = 5, H = 70;
  std::vector<float> r = random_normal(T * H, 10), x = random_normal(T * H, 11, 0.1f),
                     w = random_uniform(H, 12);
  Tensor residual = f32(r, {T, H}), tx = f32(x, {T, H}), tw = f32(w, {H});
  Tensor out = Tensor::empty({T, H}, DType::F32, Device::CPU);
  add_rmsnorm(residual, tx, tw, out, 1e-5f);
  std::vector<float> sum(r.size());
  for (size_t i = 0; i < r.size(); ++i) sum[i] = r[i] + x[i];
  EXPECT_EQ(to_f32_vector(residual), sum);                       // the residual: one fp32 add, exactly
  EXPECT_EQ(to_f32_vector(out), run_rmsnorm(sum, w, T, 1e-5f));  // the output: the norm of the new residual
  // out may be x (the sublayer's output buffer is reused)
  Tensor residual2 = f32(r, {T, H}), tx2 = f32(x, {T, H});
  add_rmsnorm(residual2, tx2, tw, tx2, 1e-5f);
  EXPECT_EQ(to_f32_vector(tx2), to_f32_vector(out));
}

TEST(RmsNorm04, AnyLeadingShape) {
  // [2, 3, H] is 6 rows of H
  const int64_t H = 8;
  std::vector<float> x = random_normal(6 * H, 13), w = random_uniform(H, 14);
  Tensor tx = f32(x, {2, 3, H}), tw = f32(w, {H}), out = Tensor::empty({2, 3, H}, DType::F32, Device::CPU);
  rmsnorm(out, tx, tw, 1e-5f);
  EXPECT_EQ(to_f32_vector(out), run_rmsnorm(x, w, 6, 1e-5f));
}

TEST(RmsNorm04, ArgumentChecks) {
  Tensor x = f32(random_normal(12, 1), {3, 4}), w = f32({1, 1, 1, 1}, {4}),
         out = Tensor::empty({3, 4}, DType::F32, Device::CPU);
  Tensor w5 = f32({1, 1, 1, 1, 1}, {5});
  expect_input_error([&] { rmsnorm(out, x, w5, 1e-5f); }, "weight must be [4]");
  Tensor out_bad = Tensor::empty({4, 3}, DType::F32, Device::CPU);
  expect_input_error([&] { rmsnorm(out_bad, x, w, 1e-5f); }, "must have x's shape");
  expect_input_error([&] { rmsnorm(out, x, w, -1e-5f); }, "eps");
  expect_input_error([&] { rmsnorm(out, x, w, std::numeric_limits<float>::quiet_NaN()); }, "eps");
  Tensor x_bf16 = Tensor::from_f32(random_normal(12, 1), {3, 4}, DType::BF16, Device::CPU);
  expect_input_error([&] { rmsnorm(out, x_bf16, w, 1e-5f); }, "F32");
  // Mixed devices are refused before any CUDA call, so this runs without a GPU.
  TensorView gpu_out = TensorView::contiguous(nullptr, DType::BF16, Device::CUDA, {3, 4});
  expect_input_error([&] { rmsnorm(gpu_out, x, w, 1e-5f); }, "one device");
  // The fused form: residual shape, and out or x aliasing the residual.
  Tensor residual = f32(random_normal(12, 2), {3, 4});
  Tensor residual_bad = f32(random_normal(4, 2), {1, 4});
  expect_input_error([&] { add_rmsnorm(residual_bad, x, w, out, 1e-5f); }, "residual");
  expect_input_error([&] { add_rmsnorm(residual, x, w, residual, 1e-5f); }, "separate memory");
  expect_input_error([&] { add_rmsnorm(residual, residual, w, out, 1e-5f); }, "separate memory");
}

TEST(RmsNorm04, KernelNamesAndOptions) {
  EXPECT_EQ(parse_rmsnorm_kernel("v2"), RmsNormKernel::V2);
  EXPECT_EQ(rmsnorm_kernel_name(RmsNormKernel::V3), "v3");
  EXPECT_EQ(all_rmsnorm_kernels().size(), 3u);
  EXPECT_THROW(parse_rmsnorm_kernel("v0"), InputError);
  RmsNormOptions from_kernel = RmsNormKernel::V1;  // implicit: rmsnorm(out, x, w, eps, RmsNormKernel::V1)
  EXPECT_EQ(from_kernel.kernel, RmsNormKernel::V1);
  EXPECT_EQ(from_kernel.v3_vectors_per_thread, 0);
}

TEST(RmsNorm04, V3LaunchShapes) {
  // hidden 2048 in 16-byte vectors: 256 vectors, 2 per thread, 128 threads (the 1B model's rows)
  RmsNormV3Shape s = rmsnorm_v3_shape(2048, 8, 0);
  EXPECT_TRUE(s.fits);
  EXPECT_EQ(s.vectors_per_thread, 2);
  EXPECT_EQ(s.threads, 128);
  // hidden 320 (the tiny model): 40 vectors, 1 per thread, rounded up to 2 warps
  s = rmsnorm_v3_shape(320, 8, 0);
  EXPECT_EQ(s.vectors_per_thread, 1);
  EXPECT_EQ(s.threads, 64);
  // hidden 1, element by element: one warp, one element used
  s = rmsnorm_v3_shape(1, 1, 0);
  EXPECT_TRUE(s.fits);
  EXPECT_EQ(s.threads, 32);
  // hidden 8200 = 1025 vectors: 8 per thread, ceil(1025 / 8) = 129 threads -> 160 (5 warps)
  s = rmsnorm_v3_shape(8200, 8, 0);
  EXPECT_TRUE(s.fits);
  EXPECT_EQ(s.vectors_per_thread, 8);
  EXPECT_EQ(s.threads, 160);
  // hidden 8201 (odd: 1-element vectors): 8201 / 8 -> 1026 threads -> 1056 > 1024: does not fit (v2 runs)
  EXPECT_FALSE(rmsnorm_v3_shape(8201, 1, 0).fits);
  // forced vectors per thread, as the benchmark sweeps them
  s = rmsnorm_v3_shape(2048, 8, 1);
  EXPECT_EQ(s.threads, 256);
  EXPECT_FALSE(rmsnorm_v3_shape(16384 * 8, 8, 8).fits);  // 16384 vectors / 8 = 2048 threads
  EXPECT_THROW(rmsnorm_v3_shape(2048, 8, 3), InputError);
  EXPECT_THROW(rmsnorm_v3_shape(2048, 16, 0), InputError);
}

}  // namespace
}  // namespace tvllm
