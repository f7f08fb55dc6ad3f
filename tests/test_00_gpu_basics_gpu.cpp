// Lesson 00 on the GPU: every SAXPY kernel equals the CPU's std::fma bit for bit, on sizes that are not
// multiples of the block size or of 4, on misaligned views, in place, with the output poisoned first; and
// on a stream of the test's own.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "gpu_basics.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// Bit-exact: GPU and CPU both compute fma(a, x, y), one correctly rounded operation, so there is no
// tolerance to state; any difference is a bug.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    uint32_t g, w;
    std::memcpy(&g, &got[i], 4);
    std::memcpy(&w, &want[i], 4);
    ASSERT_EQ(g, w) << what << ": element " << i << " got " << got[i] << " want " << want[i];
  }
}

std::vector<float> download(const TensorView& v) {
  std::vector<float> host(static_cast<size_t>(v.numel()));
  copy_view(TensorView::contiguous(host.data(), DType::F32, Device::CPU, v.shape), v);
  return host;
}

// Runs `kernel` on n random elements held at element offset `offset` of their device buffers.
void check_kernel(const std::string& kernel, int64_t n, int64_t offset, bool in_place) {
  SCOPED_TRACE(kernel + " n=" + std::to_string(n) + " offset=" + std::to_string(offset) +
               (in_place ? " in place" : ""));
  const float a = -1.7f;
  std::vector<float> x = random_uniform(static_cast<size_t>(n), 10 + n, -3.f, 3.f);
  std::vector<float> y = random_uniform(static_cast<size_t>(n), 20 + n, -3.f, 3.f);
  std::vector<float> want(x.size());
  saxpy_cpu(want.data(), a, x.data(), y.data(), n);

  Tensor xb = Tensor::empty({n + offset}, DType::F32, Device::CUDA);
  Tensor yb = Tensor::empty({n + offset}, DType::F32, Device::CUDA);
  Tensor ob = Tensor::empty({n + offset + 1}, DType::F32, Device::CUDA);  // +1: a guard element after the end
  // poison everything: 0xff bytes are NaN, so any element the kernel forgets (or writes twice wrongly) fails
  TVLLM_CUDA_CHECK(cudaMemset(ob.data(), 0xff, ob.view().nbytes()));
  TensorView xv = xb.view().rows(offset, n);
  TensorView yv = yb.view().rows(offset, n);
  TensorView ov = in_place ? yv : ob.view().rows(offset, n);
  copy_view(xv, TensorView::contiguous(x.data(), DType::F32, Device::CPU, {n}));
  copy_view(yv, TensorView::contiguous(y.data(), DType::F32, Device::CPU, {n}));

  saxpy(ov, a, xv, yv, kernel);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  expect_same_bits(download(ov), want, kernel);
  if (!in_place) {
    // the guard element after the end must still be the poison: nothing wrote past n
    std::vector<float> all = download(ob.view());
    uint32_t guard;
    std::memcpy(&guard, &all[static_cast<size_t>(offset + n)], 4);
    EXPECT_EQ(guard, 0xffffffffu) << "a kernel wrote past the end";
  }
}

const int64_t kSizes[] = {1, 2, 3, 4, 5, 31, 255, 256, 257, 1025, 1000003};

TEST(SaxpyGpu, EveryKernelMatchesTheCpuBitForBit) {
  TVLLM_REQUIRE_GPU();
  for (const std::string& kernel : saxpy_kernel_versions()) {
    for (int64_t n : kSizes) check_kernel(kernel, n, 0, false);
  }
}

// One kernel alone on every size (student mode grades each kernel by its own test). Aligned views: on
// misaligned ones v3 runs v2.
void check_one_kernel(const std::string& kernel) {
  for (int64_t n : kSizes) check_kernel(kernel, n, 0, false);
  for (int64_t n : {1, 33, 1000003}) check_kernel(kernel, n, 0, true);
}

TEST(SaxpyGpu, V1MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel("v1");
}

TEST(SaxpyGpu, V2MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel("v2");
}

TEST(SaxpyGpu, V3MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel("v3");
}

TEST(SaxpyGpu, MisalignedViewsStillWork) {
  TVLLM_REQUIRE_GPU();
  // offsets of 1..3 floats leave the pointers 4, 8 or 12 bytes off a 16-byte boundary: v3 must fall back
  for (const std::string& kernel : saxpy_kernel_versions()) {
    for (int64_t offset : {1, 2, 3}) {
      for (int64_t n : {1, 7, 1025, 100003}) check_kernel(kernel, n, offset, false);
    }
  }
}

TEST(SaxpyGpu, InPlace) {
  TVLLM_REQUIRE_GPU();
  for (const std::string& kernel : saxpy_kernel_versions()) {
    for (int64_t n : {1, 33, 1000003}) check_kernel(kernel, n, 0, true);
  }
}

TEST(SaxpyGpu, ClosedFormOnTheFullLessonSize) {
  TVLLM_REQUIRE_GPU();
  const int64_t n = 10'000'019;
  std::vector<float> x(n), y(n);
  fill_closed_form_inputs(x.data(), y.data(), n);
  Tensor gx = Tensor::from_f32(x, {n}, DType::F32, Device::CUDA);
  Tensor gy = Tensor::from_f32(y, {n}, DType::F32, Device::CUDA);
  Tensor out = Tensor::empty({n}, DType::F32, Device::CUDA);
  for (const std::string& kernel : saxpy_kernel_versions()) {
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));
    saxpy(out, kClosedFormA, gx, gy, kernel);
    std::vector<float> got = download(out.view());
    int64_t first = -1;
    EXPECT_EQ(count_closed_form_mismatches(got.data(), n, &first), 0) << kernel << ", first at " << first;
  }
}

TEST(SaxpyGpu, ZeroElementsLaunchesNothing) {
  TVLLM_REQUIRE_GPU();
  Tensor empty = Tensor::empty({0}, DType::F32, Device::CUDA);
  for (const std::string& kernel : saxpy_kernel_versions()) EXPECT_NO_THROW(saxpy(empty, 1.0f, empty, empty, kernel));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(SaxpyGpu, RunsOnTheCallersStream) {
  TVLLM_REQUIRE_GPU();
  const int64_t n = 100003;
  std::vector<float> x = random_uniform(static_cast<size_t>(n), 61), y = random_uniform(static_cast<size_t>(n), 62);
  std::vector<float> want(x.size());
  saxpy_cpu(want.data(), 0.3f, x.data(), y.data(), n);
  Tensor xd = Tensor::from_f32(x, {n}, DType::F32, Device::CUDA), yd = Tensor::from_f32(y, {n}, DType::F32, Device::CUDA);
  CudaStream stream;  // non-blocking: nothing orders it after the legacy stream but our synchronisation
  for (const std::string& kernel : saxpy_kernel_versions()) {
    Tensor out = Tensor::empty({n}, DType::F32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    saxpy(out, 0.3f, xd, yd, kernel, stream);
    stream.synchronize();
    expect_same_bits(download(out), want, kernel + " on a stream");
  }
}

TEST(CopyBandwidthsGpu, Plausible) {
  TVLLM_REQUIRE_GPU();
  CopyBandwidths bw = measure_copy_bandwidths(size_t{64} << 20, size_t{256} << 20);
  // PCIe 3 x16 moves ~12 GB/s, NVLink-C2C ~450: anything outside [1, 1000] is a measuring bug
  EXPECT_GT(bw.h2d_pageable_gbs, 1.0);
  EXPECT_GT(bw.h2d_pinned_gbs, 1.0);
  EXPECT_GT(bw.d2h_pinned_gbs, 1.0);
  EXPECT_LT(bw.h2d_pinned_gbs, 1000.0);
  // device memory is far faster than any host link
  EXPECT_GT(bw.d2d_gbs, 100.0);
  EXPECT_GT(bw.d2d_gbs, bw.h2d_pinned_gbs);
}

}  // namespace
}  // namespace tvllm
