// Lesson 02 on the GPU: every conversion kernel bit-exact against the CPU (common/dtype.h) over all
// 65536 bf16 patterns and a random sweep of fp32 patterns (NaN, inf, subnormals and ties included), on
// odd sizes and misaligned views, with the outputs poisoned first. NaN inputs only have to give NaN for
// the intrinsic versions (the hardware picks its own NaN bits); v1 is the CPU's algorithm, so its NaN
// bits must match too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// fp32 inputs: every bf16 value widened, every bf16 tie (and one ulp either side), random patterns, specials.
std::vector<uint32_t> sweep_patterns() {
  std::vector<uint32_t> p;
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u}) p.push_back(hi << 16 | lo);
  }
  Rng rng(42);
  for (int i = 0; i < (1 << 22); ++i) p.push_back(static_cast<uint32_t>(rng.next_u64() >> 32));
  for (uint32_t s : {0x00000001u, 0x007fffffu, 0x477ff000u, 0x477fefffu, 0x7f7fffffu, 0x7f800001u, 0xffffffffu}) {
    p.push_back(s);
  }
  return p;
}

struct Device16 {
  Tensor x;    // [n] fp32 on the GPU (plus `offset` leading elements)
  Tensor out;  // [n] 16-bit on the GPU (plus `offset` leading elements and one guard after the end)
};

// Runs convert (f32 -> 16-bit) on the patterns at element offset `offset`, returns the 16-bit results
// and checks the guard element after the end is still the poison.
template <class Convert>
std::vector<uint16_t> run_narrowing(const std::vector<uint32_t>& patterns, int64_t offset, DType out_dtype,
                                    const Convert& convert) {
  const int64_t n = static_cast<int64_t>(patterns.size());
  Tensor x = Tensor::empty({n + offset}, DType::F32, Device::CUDA);
  Tensor out = Tensor::empty({n + offset + 1}, out_dtype, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));  // poison: 0xffff is a NaN
  TensorView xv = x.view().rows(offset, n);
  TensorView ov = out.view().rows(offset, n);
  TVLLM_CUDA_CHECK(cudaMemcpy(xv.data, patterns.data(), n * 4, cudaMemcpyHostToDevice));
  convert(ov, xv);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> all(static_cast<size_t>(n + offset + 1));
  TVLLM_CUDA_CHECK(cudaMemcpy(all.data(), out.data(), all.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(all.back(), 0xffff) << "a kernel wrote past the end";
  return std::vector<uint16_t>(all.begin() + offset, all.end() - 1);
}

void expect_bf16_matches_cpu(const std::vector<uint32_t>& inputs, const std::vector<uint16_t>& got, bool exact_nan) {
  ASSERT_EQ(inputs.size(), got.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    float x = f32_from_bits(inputs[i]);
    uint16_t want = f32_to_bf16(x);
    if (std::isnan(x) && !exact_nan) {
      ASSERT_TRUE(bf16_is_nan(got[i])) << "element " << i << " fp32 " << std::hex << inputs[i] << " gave " << got[i];
    } else {
      ASSERT_EQ(got[i], want) << "element " << i << " fp32 " << std::hex << inputs[i];
    }
  }
}

TEST(Bf16Gpu, EveryNarrowingKernelMatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint32_t> patterns = sweep_patterns();
  for (const std::string& v : bf16_kernel_versions()) {
    SCOPED_TRACE(v);
    std::vector<uint16_t> got = run_narrowing(patterns, 0, DType::BF16, [&](const TensorView& o, const TensorView& x) {
      convert_f32_to_bf16(o, x, v);
    });
    expect_bf16_matches_cpu(patterns, got, v == "v1");
  }
}

// One narrowing kernel alone on the whole sweep and a few odd sizes, aligned (student mode grades each
// kernel by its own test; on misaligned views v3 runs v2).
void check_one_kernel(const std::string& v) {
  const std::vector<uint32_t> all = sweep_patterns();
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1025}, static_cast<int64_t>(all.size())}) {
    SCOPED_TRACE(v + " n=" + std::to_string(n));
    std::vector<uint32_t> patterns(all.end() - n, all.end());
    std::vector<uint16_t> got = run_narrowing(patterns, 0, DType::BF16, [&](const TensorView& o, const TensorView& x) {
      convert_f32_to_bf16(o, x, v);
    });
    expect_bf16_matches_cpu(patterns, got, v == "v1");
  }
}

TEST(Bf16Gpu, V1MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel("v1");
}

TEST(Bf16Gpu, V3MatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  check_one_kernel("v3");
}

TEST(Bf16Gpu, OddSizesAndMisalignedViews) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint32_t> all = sweep_patterns();
  for (const std::string& v : bf16_kernel_versions()) {
    for (int64_t n : {1, 2, 3, 5, 7, 255, 1025, 100003}) {
      for (int64_t offset : {0, 1, 2, 3}) {  // 4, 8, 12 bytes off: v3 must fall back
        SCOPED_TRACE(v + " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        std::vector<uint32_t> patterns(all.end() - n, all.end());  // random patterns and the specials
        std::vector<uint16_t> got = run_narrowing(patterns, offset, DType::BF16,
                                                  [&](const TensorView& o, const TensorView& x) {
                                                    convert_f32_to_bf16(o, x, v);
                                                  });
        expect_bf16_matches_cpu(patterns, got, v == "v1");
      }
    }
  }
}

TEST(Bf16Gpu, WideningIsExactForAllPatterns) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  for (int64_t offset : {0, 1}) {
    Tensor x = Tensor::empty({65536 + offset}, DType::BF16, Device::CUDA);
    Tensor out = Tensor::empty({65536 + offset + 1}, DType::F32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));
    TensorView xv = x.view().rows(offset, 65536);
    TensorView ov = out.view().rows(offset, 65536);
    TVLLM_CUDA_CHECK(cudaMemcpy(xv.data, all.data(), 65536 * 2, cudaMemcpyHostToDevice));
    convert_bf16_to_f32(ov, xv);
    std::vector<uint32_t> got(65536 + 1);
    TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), ov.data, got.size() * 4, cudaMemcpyDeviceToHost));
    for (uint32_t b = 0; b < 65536; ++b) ASSERT_EQ(got[b], b << 16) << std::hex << b;  // NaN payloads too
    EXPECT_EQ(got[65536], 0xffffffffu) << "wrote past the end";
  }
}

TEST(Bf16Gpu, Fp16KernelMatchesTheCpu) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint32_t> patterns = sweep_patterns();
  // fp16's own ties: midpoints of neighbouring fp16 values, with one fp32 ulp either side
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    double lo = f16_to_f32(static_cast<uint16_t>(h));
    double hi = h + 1 < 0x7c00 ? f16_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0;
    uint32_t mid = f32_bits(static_cast<float>((lo + hi) / 2));
    for (uint32_t m : {mid - 1, mid, mid + 1}) {
      patterns.push_back(m);
      patterns.push_back(m | 0x80000000u);
    }
  }
  for (int64_t offset : {0, 1}) {
    std::vector<uint16_t> got = run_narrowing(patterns, offset, DType::F16, [](const TensorView& o, const TensorView& x) {
      convert_f32_to_f16(o, x);
    });
    for (size_t i = 0; i < patterns.size(); ++i) {
      float x = f32_from_bits(patterns[i]);
      if (std::isnan(x)) {
        ASSERT_TRUE(f16_is_nan(got[i])) << std::hex << patterns[i];
      } else {
        ASSERT_EQ(got[i], f32_to_f16(x)) << "fp32 " << std::hex << patterns[i];
      }
    }
  }
}

TEST(Bf16Gpu, FillBitPatternsWritesConsecutiveBits) {
  TVLLM_REQUIRE_GPU();
  const int64_t n = 1000003;
  Tensor x = Tensor::empty({n}, DType::F32, Device::CUDA);
  fill_f32_bit_patterns(x, 0xfffffff0u);  // wraps past 2^32 after 16 elements
  std::vector<uint32_t> got(n);
  TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), x.data(), n * 4, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 0xfffffff0u + static_cast<uint32_t>(i)) << i;
}

TEST(Bf16Gpu, ConversionsRunOnTheCallersStream) {
  TVLLM_REQUIRE_GPU();
  const int64_t n = 70001;
  const std::vector<float> values = random_normal(static_cast<size_t>(n), 71, 100.0f);
  Tensor x = Tensor::from_f32(values, {n}, DType::F32, Device::CUDA);
  CudaStream stream;  // non-blocking: nothing orders it after the legacy stream but our synchronisation
  for (const std::string& v : bf16_kernel_versions()) {
    Tensor b = Tensor::empty({n}, DType::BF16, Device::CUDA), back = Tensor::empty({n}, DType::F32, Device::CUDA);
    Tensor h = Tensor::empty({n}, DType::F16, Device::CUDA);
    // poison (0xff bytes are NaN): a kernel that writes nothing must not pass on a freed buffer's old values
    for (Tensor* t : {&b, &back, &h}) TVLLM_CUDA_CHECK(cudaMemset(t->data(), 0xff, t->view().nbytes()));
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    convert_f32_to_bf16(b, x, v, stream);
    convert_bf16_to_f32(back, b, stream);
    convert_f32_to_f16(h, x, stream);
    stream.synchronize();
    const std::vector<float> widened = to_f32_vector(back), halves = to_f32_vector(h);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(widened[i], bf16_to_f32(f32_to_bf16(values[i]))) << v << " element " << i;
      ASSERT_EQ(halves[i], f16_to_f32(f32_to_f16(values[i]))) << "f16 element " << i;
    }
  }
  Tensor bits = Tensor::empty({n}, DType::F32, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(bits.data(), 0xff, bits.view().nbytes()));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  fill_f32_bit_patterns(bits, 0x3f800000u, stream);
  stream.synchronize();
  std::vector<uint32_t> got(static_cast<size_t>(n));
  TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), bits.data(), got.size() * 4, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 0x3f800000u + static_cast<uint32_t>(i));
}

TEST(Bf16Gpu, ZeroElements) {
  TVLLM_REQUIRE_GPU();
  Tensor x = Tensor::empty({0}, DType::F32, Device::CUDA);
  Tensor b = Tensor::empty({0}, DType::BF16, Device::CUDA);
  for (const std::string& v : bf16_kernel_versions()) EXPECT_NO_THROW(convert_f32_to_bf16(b, x, v));
  EXPECT_NO_THROW(convert_bf16_to_f32(x, b));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace tvllm
