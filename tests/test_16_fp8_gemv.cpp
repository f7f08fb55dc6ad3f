// Lesson 16 on the CPU: the FP8 GEMV's reference and argument checks (the GPU kernel is checked against
// this reference in test_16_fp8_gemv_gpu.cpp).
#include <gtest/gtest.h>

#include <vector>

#include "common/errors.h"
#include "fp8.h"
#include "fp8_gemv.h"

namespace tvllm {
namespace {

TEST(Fp8Gemv16, ReferenceKnownAnswers) {
  // x = [[1, 2], [-1, 0.5]], q = [[1, -2], [448, 0.5]] (codes), scale = [0.5, 2]
  std::vector<float> x = {1, 2, -1, 0.5f};
  std::vector<uint8_t> q = {f32_to_fp8_e4m3(1), f32_to_fp8_e4m3(-2), f32_to_fp8_e4m3(448), f32_to_fp8_e4m3(0.5f)};
  std::vector<float> s = {0.5f, 2.0f};
  const TensorView xv = TensorView::contiguous(x.data(), DType::F32, Device::CPU, {2, 2});
  const TensorView qv = TensorView::contiguous(q.data(), DType::F8_E4M3, Device::CPU, {2, 2});
  const TensorView sv = TensorView::contiguous(s.data(), DType::F32, Device::CPU, {2});
  const Fp8GemvReference r = fp8_gemv_reference(xv, qv, sv);
  // row 0: (1*1 + 2*-2) * 0.5 = -1.5; (1*448 + 2*0.5) * 2 = 898. row 1: (-1 - 1) * 0.5 = -1; (-448 + 0.25) * 2
  EXPECT_EQ(r.value, (std::vector<double>{-1.5, 898.0, -1.0, -895.5}));
  EXPECT_EQ(r.abs_sum, (std::vector<double>{2.5, 898.0, 1.0, 896.5}));
  std::vector<float> out(4);
  fp8_gemv(TensorView::contiguous(out.data(), DType::F32, Device::CPU, {2, 2}), xv, qv, sv);
  EXPECT_EQ(out, (std::vector<float>{-1.5f, 898.0f, -1.0f, -895.5f}));
  // one scale for the tensor
  std::vector<float> one = {2.0f};
  const Fp8GemvReference t = fp8_gemv_reference(xv, qv, TensorView::contiguous(one.data(), DType::F32, Device::CPU, {1}));
  EXPECT_EQ(t.value[0], -6.0);
}

TEST(Fp8Gemv16, RefusesBadOperands) {
  std::vector<float> x(4), out(4), s(2);
  std::vector<uint8_t> q(4);
  const TensorView xv = TensorView::contiguous(x.data(), DType::F32, Device::CPU, {2, 2});
  const TensorView qv = TensorView::contiguous(q.data(), DType::F8_E4M3, Device::CPU, {2, 2});
  const TensorView sv = TensorView::contiguous(s.data(), DType::F32, Device::CPU, {2});
  const TensorView ov = TensorView::contiguous(out.data(), DType::F32, Device::CPU, {2, 2});
  EXPECT_THROW(fp8_gemv(ov, xv, TensorView::contiguous(q.data(), DType::U8, Device::CPU, {2, 2}), sv), InputError);
  EXPECT_THROW(fp8_gemv(ov, xv, qv, TensorView::contiguous(s.data(), DType::F32, Device::CPU, {3})), InputError);
  EXPECT_THROW(fp8_gemv(TensorView::contiguous(out.data(), DType::F32, Device::CPU, {1, 4}), xv, qv, sv), InputError);
  EXPECT_THROW(fp8_gemv(ov, TensorView::contiguous(x.data(), DType::F32, Device::CPU, {1, 4}), qv, sv), InputError);
  EXPECT_NO_THROW(fp8_gemv(ov, xv, qv, sv));
}

}  // namespace
}  // namespace tvllm
