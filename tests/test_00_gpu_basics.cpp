// Lesson 00 on the CPU: SAXPY's known answers, the single rounding of std::fma, the closed-form inputs,
// and the argument checks of saxpy().
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/errors.h"
#include "common/tensor.h"
#include "gpu_basics.h"

namespace tvllm {
namespace {

TensorView view_of(std::vector<float>& v) {
  return TensorView::contiguous(v.data(), DType::F32, Device::CPU, {static_cast<int64_t>(v.size())});
}

TEST(SaxpyCpu, KnownValues) {
  std::vector<float> x = {1, 2, 3, -4}, y = {10, 20, 30, 0.5f}, out(4, NAN);
  saxpy_cpu(out.data(), 2.0f, x.data(), y.data(), 4);
  EXPECT_EQ(out, (std::vector<float>{12, 24, 36, -7.5f}));
  saxpy_cpu(out.data(), 0.0f, x.data(), y.data(), 4);
  EXPECT_EQ(out, y);
  saxpy_cpu(out.data(), -1.0f, x.data(), x.data(), 4);  // a*x + x with a = -1: exactly zero
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(SaxpyCpu, RoundsOnceLikeAFusedMultiplyAdd) {
  // a = x = 1 + 2^-12: the exact product 1 + 2^-11 + 2^-24 needs 25 bits. Rounded to fp32 first (a tie,
  // to even) it loses the 2^-24, and adding y = -(1 + 2^-11) gives 0. Fused, the 2^-24 survives.
  const float a = 0x1.001p0f, x = 0x1.001p0f, y = -0x1.002p0f;
  float fused = NAN, unfused = NAN;
  saxpy_cpu(&fused, a, &x, &y, 1);
  saxpy_cpu_unfused(&unfused, a, &x, &y, 1);
  EXPECT_EQ(fused, 0x1p-24f);
  EXPECT_EQ(unfused, 0.0f);
}

TEST(SaxpyCpu, ZeroElementsTouchesNothing) {
  float sentinel = 5.0f;
  saxpy_cpu(&sentinel, 1.0f, nullptr, nullptr, 0);
  EXPECT_EQ(sentinel, 5.0f);
}

TEST(ClosedForm, KnownValues) {
  EXPECT_EQ(closed_form_expected(0), 0.0f);
  EXPECT_EQ(closed_form_expected(1), 1.75f);     // 3 * 0.25 + 1
  EXPECT_EQ(closed_form_expected(1003), 4.25f);  // x = 3/4, y = 1003 mod 7 = 2: 9/4 + 2
  EXPECT_EQ(closed_form_expected(999), 749.25f + 5.0f);  // 999 mod 7 = 5
  std::vector<float> x(2000), y(2000), out(2000);
  fill_closed_form_inputs(x.data(), y.data(), 2000);
  EXPECT_EQ(x[1003], 0.75f);
  EXPECT_EQ(y[1003], 2.0f);
  saxpy_cpu(out.data(), kClosedFormA, x.data(), y.data(), 2000);
  int64_t first = 123;
  EXPECT_EQ(count_closed_form_mismatches(out.data(), 2000, &first), 0);
  EXPECT_EQ(first, -1);
  out[1500] += 0.25f;
  out[1700] = NAN;
  EXPECT_EQ(count_closed_form_mismatches(out.data(), 2000, &first), 2);
  EXPECT_EQ(first, 1500);
}

TEST(Saxpy, ViewsOnTheCpuRunTheReference) {
  const int64_t n = 1001;
  std::vector<float> x(n), y(n), out(n, NAN);
  fill_closed_form_inputs(x.data(), y.data(), n);
  saxpy(view_of(out), kClosedFormA, view_of(x), view_of(y));
  EXPECT_EQ(count_closed_form_mismatches(out.data(), n, nullptr), 0);
  // in place: y = a*x + y
  saxpy(view_of(y), kClosedFormA, view_of(x), view_of(y), "v1");
  EXPECT_EQ(y, out);
}

TEST(Saxpy, ShapesMayDifferButNotCounts) {
  std::vector<float> x(6, 1.0f), y(6, 1.0f), out(6, 0.0f);
  TensorView x2 = TensorView::contiguous(x.data(), DType::F32, Device::CPU, {2, 3});
  saxpy(view_of(out), 2.0f, x2, view_of(y));
  EXPECT_EQ(out, std::vector<float>(6, 3.0f));
  std::vector<float> shorter(5);
  EXPECT_THROW(saxpy(view_of(shorter), 2.0f, view_of(x), view_of(y)), InputError);
}

TEST(Saxpy, RejectsBadArgumentsWithInputError) {
  std::vector<float> x(4), y(4), out(4);
  std::vector<uint16_t> half(4);
  TensorView bf16 = TensorView::contiguous(half.data(), DType::BF16, Device::CPU, {4});
  EXPECT_THROW(saxpy(bf16, 1.0f, view_of(x), view_of(y)), InputError);
  EXPECT_THROW(saxpy(view_of(out), 1.0f, bf16, view_of(y)), InputError);
  // mixed devices are refused before anything touches a GPU
  TensorView on_gpu = TensorView::contiguous(x.data(), DType::F32, Device::CUDA, {4});
  EXPECT_THROW(saxpy(view_of(out), 1.0f, on_gpu, view_of(y)), InputError);
  TensorView strided = TensorView::contiguous(x.data(), DType::F32, Device::CPU, {2, 2});
  strided.strides = {1, 2};
  EXPECT_THROW(saxpy(view_of(out), 1.0f, strided, view_of(y)), InputError);
  EXPECT_THROW(saxpy(view_of(out), 1.0f, view_of(x), view_of(y), "v9"), InputError);
  try {
    saxpy(view_of(out), 1.0f, view_of(x), view_of(y), "fast");
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'fast'"), std::string::npos) << e.what();
  }
}

TEST(Saxpy, KernelVersions) {
  EXPECT_EQ(saxpy_kernel_versions(), (std::vector<std::string>{"v1", "v2", "v3"}));
  EXPECT_EQ(std::string(kSaxpyDefaultKernel), "v3");
}

}  // namespace
}  // namespace tvllm
