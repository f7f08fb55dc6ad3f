// Lesson 16 on the GPU: the fp8 conversion kernels against the CPU encoders (fp8_cpu.cpp, themselves
// checked on every fp32 against the table oracle in test_16_fp8.cpp).
//   - v1 (the bit arithmetic) and v2 (cuda_fp8.h's __nv_cvt_* with __NV_SATFINITE) agree on ALL 2^32
//     fp32 patterns, counted on the GPU (two NaNs agree: the hardware picks its NaN's sign);
//   - both equal the CPU encoder, bit for bit, on a dense sample: every fp32 with its low 12 bits in
//     {0x000, 0x7ff, 0x800, 0x801, 0xfff} (all ties and their neighbours for both formats, because both
//     drop at least 20 bits), random patterns and the specials;
//   - fp8 -> fp32 equals common/dtype.h's decoder on all 256 codes of each format.
// Outputs are poisoned first (0xff bytes: a NaN in both formats) and one guard byte past the end checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "fp8.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

bool is_nan_code(Fp8Kind kind, uint8_t c) {
  return kind == Fp8Kind::E4M3 ? (c & 0x7fu) == 0x7fu : (c & 0x7fu) > 0x7cu;
}

std::vector<uint32_t> dense_sample() {
  std::vector<uint32_t> p;
  for (uint32_t hi = 0; hi < (1u << 20); ++hi) {
    for (uint32_t lo : {0x000u, 0x7ffu, 0x800u, 0x801u, 0xfffu}) p.push_back(hi << 12 | lo);
  }
  Rng rng(16);
  for (int i = 0; i < (1 << 22); ++i) p.push_back(static_cast<uint32_t>(rng.next_u64() >> 32));
  return p;
}

// Converts the patterns with `kernel` (at element offset `offset`, so odd starts are exercised too).
std::vector<uint8_t> run_on_gpu(const std::vector<uint32_t>& patterns, Fp8Kind kind, const std::string& kernel,
                                int64_t offset) {
  const int64_t n = static_cast<int64_t>(patterns.size());
  const DType dt = fp8_format(kind).dtype;
  Tensor x = Tensor::empty({n + offset}, DType::F32, Device::CUDA);
  Tensor out = Tensor::empty({n + offset + 1}, dt, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, static_cast<size_t>(n + offset + 1)));
  TVLLM_CUDA_CHECK(cudaMemcpy(static_cast<float*>(x.data()) + offset, patterns.data(), n * 4, cudaMemcpyHostToDevice));
  convert_f32_to_fp8(out.view().rows(offset, n), x.view().rows(offset, n), kernel);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> all(static_cast<size_t>(n + offset + 1));
  TVLLM_CUDA_CHECK(cudaMemcpy(all.data(), out.data(), all.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(all.back(), 0xff) << "a kernel wrote past the end";
  return std::vector<uint8_t>(all.begin() + offset, all.end() - 1);
}

void expect_matches_cpu(Fp8Kind kind, const std::string& kernel) {
  const std::vector<uint32_t> patterns = dense_sample();
  for (int64_t offset : {0, 1}) {
    const std::vector<uint8_t> got = run_on_gpu(patterns, kind, kernel, offset);
    for (size_t i = 0; i < patterns.size(); ++i) {
      const float x = f32_from_bits(patterns[i]);
      const uint8_t want = f32_to_fp8(kind, x);
      if (std::isnan(x)) {
        ASSERT_TRUE(is_nan_code(kind, got[i])) << kernel << " pattern 0x" << std::hex << patterns[i];
      } else {
        ASSERT_EQ(got[i], want) << kernel << " pattern 0x" << std::hex << patterns[i] << " offset " << offset;
      }
    }
  }
}

TEST(Fp8Gpu16, V1MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu(Fp8Kind::E4M3, "v1");
  expect_matches_cpu(Fp8Kind::E5M2, "v1");
}

TEST(Fp8Gpu16, V2MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  expect_matches_cpu(Fp8Kind::E4M3, "v2");
  expect_matches_cpu(Fp8Kind::E5M2, "v2");
}

// All 2^32 patterns, in 2^30-pattern launches: the hardware's satfinite conversion and the bit
// arithmetic must agree everywhere (a few seconds on an H200).
TEST(Fp8Gpu16, V1AndV2AgreeOnEveryFloat) {
  TVLLM_REQUIRE_GPU();
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    Tensor counters = Tensor::empty({2}, DType::I64, Device::CUDA);  // [count, first_bad]
    unsigned long long* count = static_cast<unsigned long long*>(counters.data());
    uint32_t* first_bad = reinterpret_cast<uint32_t*>(count + 1);
    TVLLM_CUDA_CHECK(cudaMemset(count, 0, 8));
    TVLLM_CUDA_CHECK(cudaMemset(first_bad, 0xff, 4));
    const int64_t chunk = int64_t{1} << 30;
    for (int64_t first = 0; first < (int64_t{1} << 32); first += chunk) {
      fp8_count_v1_v2_disagreements_cuda(kind, static_cast<uint32_t>(first), chunk, count, first_bad);
    }
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    unsigned long long host_count = 0;
    uint32_t host_first = 0;
    TVLLM_CUDA_CHECK(cudaMemcpy(&host_count, count, 8, cudaMemcpyDeviceToHost));
    TVLLM_CUDA_CHECK(cudaMemcpy(&host_first, first_bad, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(host_count, 0u) << fp8_format(kind).name << ": first disagreement at fp32 pattern 0x" << std::hex
                              << host_first;
  }
}

TEST(Fp8Gpu16, EveryCodeWidensExactly) {
  TVLLM_REQUIRE_GPU();
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    std::vector<uint8_t> codes(256);
    for (int c = 0; c < 256; ++c) codes[static_cast<size_t>(c)] = static_cast<uint8_t>(c);
    Tensor q = Tensor::empty({256}, fp8_format(kind).dtype, Device::CUDA);
    Tensor f = Tensor::empty({256}, DType::F32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemcpy(q.data(), codes.data(), 256, cudaMemcpyHostToDevice));
    TVLLM_CUDA_CHECK(cudaMemset(f.data(), 0xff, 256 * 4));
    convert_fp8_to_f32(f.view(), q.view());
    std::vector<float> got(256);
    TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), f.data(), 256 * 4, cudaMemcpyDeviceToHost));
    for (int c = 0; c < 256; ++c) {
      const float want = fp8_to_f32(kind, static_cast<uint8_t>(c));
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(got[static_cast<size_t>(c)])) << c;
      else EXPECT_EQ(f32_bits(got[static_cast<size_t>(c)]), f32_bits(want)) << fp8_format(kind).name << " code " << c;
    }
  }
}

}  // namespace
}  // namespace tvllm
