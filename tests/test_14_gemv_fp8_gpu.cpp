// Lesson 14, GPU: v3 and its fused variants with FP8 weights (F8_E4M3 codes, one F32 scale per row) against
// the CPU references at the 1B model's decode shapes and at odd ones, for batches 1..16; rows that are the same
// bits whatever the batch; bad operands refused.
//
// Tolerance. The GPU gets exactly the reference's inputs (bf16 x, the same codes, decoded exactly by both:
// every E4M3 value is a half, and cvt.rn.f16x2.e4m3x2 is exact), so it differs only through
//   (a) its fp32 summation of K exact products (8 x 4 significant bits) in its own order, then one fp32
//       multiply by the scale: <= ~2 K 2^-24 scale * sum|x q| (the classic bound with 2x to spare). The weights
//       below are codes of magnitude 2^-3 .. 15 with scales ~1 / (8 sqrt(K)), so w = q * scale is ~1/sqrt(K) as in
//       test_14_gemv_gpu.cpp, and that file's kAtol = 2e-3 covers (a) the same way; we check the derived bound
//       per output and kAtol both;
//   (b) the final rounding to bf16: 2^-8 of the value (rtol 2^-7 leaves 2x); F32 outputs: rtol 2^-16;
//   (c) an intermediate bf16 rounding (gate, up, the residual's product) one step off: 2^-7 of what it adds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "gemv.h"
#include "silu_mul.h"
#include "testing/fp8_testing.h"
#include "testing/gpu_buffers.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::bytes_of;
using testing::poisoned;

constexpr double kAtol = 2e-3;
constexpr double kRtolBf16 = 1.0 / 128;
constexpr double kRtolF32 = 1.0 / 65536;
constexpr double kFlip = 1.0 / 128;


Tensor code_tensor(const std::vector<uint8_t>& q, Shape shape, Device device) {
  Tensor t = Tensor::empty(std::move(shape), DType::F8_E4M3, device);
  if (device == Device::CPU)
    std::memcpy(t.data(), q.data(), q.size());
  else
    TVLLM_CUDA_CHECK(cudaMemcpy(t.data(), q.data(), q.size(), cudaMemcpyHostToDevice));
  return t;
}

std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

struct Problem {
  int64_t M, K, N;
  std::vector<float> x, g, scale;  // [M, K] U(-1, 1); [K] U(0.5, 1.5); [N] ~ U(0.5, 1.5) / (8 sqrt K)
  std::vector<uint8_t> q;          // [N, K]
  Tensor x_dev, q_dev, s_dev, g_dev, x_cpu, q_cpu, s_cpu, g_cpu;

  Problem(int64_t M_, int64_t K_, int64_t N_, uint64_t seed) : M(M_), K(K_), N(N_) {
    x = bf16_exact(random_uniform(static_cast<size_t>(M * K), seed));
    g = bf16_exact(random_uniform(static_cast<size_t>(K), seed + 2, 0.5f, 1.5f));
    scale = random_uniform(static_cast<size_t>(N), seed + 3, 0.5f, 1.5f);
    for (float& s : scale) s /= 8.0f * std::sqrt(static_cast<float>(K));
    q = testing::random_e4m3_codes(static_cast<size_t>(N * K), seed + 1);
    x_dev = Tensor::from_f32(x, {M, K}, DType::BF16, Device::CUDA);
    g_dev = Tensor::from_f32(g, {K}, DType::BF16, Device::CUDA);
    s_dev = Tensor::from_f32(scale, {N}, DType::F32, Device::CUDA);
    q_dev = code_tensor(q, {N, K}, Device::CUDA);
    x_cpu = Tensor::from_f32(x, {M, K}, DType::BF16, Device::CPU);
    g_cpu = Tensor::from_f32(g, {K}, DType::BF16, Device::CPU);
    s_cpu = Tensor::from_f32(scale, {N}, DType::F32, Device::CPU);
    q_cpu = code_tensor(q, {N, K}, Device::CPU);
  }
  TensorView xd(int64_t rows) const { return x_dev.view().rows(0, rows); }
  TensorView xc(int64_t rows) const { return x_cpu.view().rows(0, rows); }
  // (a) per output of a plain product of x's rows: 2 K 2^-24 scale[n] sum_k |x[m,k] q[n,k]|.
  std::vector<double> sum_bound(int64_t rows) const {
    std::vector<double> b(static_cast<size_t>(rows * N));
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> qa(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) qa[k] = std::fabs(fp8_e4m3_to_f32(q[n * K + k]));
      for (int64_t m = 0; m < rows; ++m) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += std::fabs(x[m * K + k]) * qa[k];
        b[m * N + n] = 2.0 * static_cast<double>(K) * std::ldexp(1.0, -24) * scale[n] * s;
      }
    }
    return b;
  }
  std::string describe() const { return "K=" + std::to_string(K) + " N=" + std::to_string(N); }
};


Tensor host_f32(Shape shape) { return Tensor::empty(std::move(shape), DType::F32, Device::CPU); }


// |got - want| <= kAtol + rtol |want| + extra[i]; and, where `bound` is given, also <= bound[i] + rtol |want| +
// extra[i] + 1e-6 (the derived (a) bound on its own, with a floor for outputs that are ~0).
void expect_close(const TensorView& got_dev, const std::vector<float>& want, double rtol,
                  const std::vector<double>& extra = {}, const std::vector<double>& bound = {}) {
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = to_f32_vector(got_dev);
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double common = rtol * std::fabs(want[i]) + (extra.empty() ? 0.0 : extra[i]);
    double tol = kAtol + common;
    if (!bound.empty()) tol = std::min(tol, bound[i] + common + 1e-6);
    const double diff = std::fabs(double(got[i]) - want[i]);
    if (!(diff <= tol) && ++bad <= 5)
      ADD_FAILURE() << "[" << i << "] got " << got[i] << ", want " << want[i] << " (tol " << tol << ")";
  }
  EXPECT_EQ(bad, 0) << "of " << got.size();
}

const int64_t kBatches[] = {1, 2, 3, 8, 16};

TEST(GemvFp8Gpu14, GemvMatchesTheReferenceAtDecodeShapes) {
  TVLLM_REQUIRE_GPU();
  // QKV (2048 -> 3072), o_proj (2048 -> 2048), gate|up (2048 -> 16384), down_proj (8192 -> 2048), odd (656 -> 77),
  // and the bundled model's down_proj (600 -> 336: K % 16 != 0, the 8-byte loads).
  const std::pair<int64_t, int64_t> shapes[] = {{2048, 3072}, {2048, 2048}, {2048, 16384}, {8192, 2048},
                                                {656, 77},    {600, 336}};
  for (const auto& [K, N] : shapes) {
    const Problem p(kGemvMaxRows, K, N, 10 + K + N);
    Tensor ref = host_f32({kGemvMaxRows, N});
    gemv_cpu(ref, p.xc(kGemvMaxRows), p.q_cpu, p.s_cpu);
    const std::vector<float> want = to_f32_vector(ref);
    const std::vector<double> bound = p.sum_bound(kGemvMaxRows);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      for (DType out_dtype : {DType::BF16, DType::F32}) {
        Tensor y = poisoned({M, N}, out_dtype);
        gemv(y, p.xd(M), p.q_dev, p.s_dev);
        expect_close(y, std::vector<float>(want.begin(), want.begin() + M * N),
                     out_dtype == DType::BF16 ? kRtolBf16 : kRtolF32, {},
                     std::vector<double>(bound.begin(), bound.begin() + M * N));
      }
    }
  }
}

TEST(GemvFp8Gpu14, RmsNormGemvMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 3072}, {656, 77}, {600, 40}}) {
    const Problem p(kGemvMaxRows, K, N, 70 + K);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      Tensor ref = host_f32({M, N});
      rmsnorm_gemv_cpu(ref, p.xc(M), p.g_cpu, eps, p.q_cpu, p.s_cpu);
      for (DType out_dtype : {DType::BF16, DType::F32}) {
        Tensor y = poisoned({M, N}, out_dtype);
        rmsnorm_gemv(y, p.xd(M), p.g_dev, eps, p.q_dev, p.s_dev);
        // (c): a normalised x one bf16 step off moves one term by 2^-8 of itself: inside kAtol.
        expect_close(y, to_f32_vector(ref), out_dtype == DType::BF16 ? kRtolBf16 : kRtolF32);
      }
    }
  }
}

TEST(GemvFp8Gpu14, RmsNormGemvSiluMulMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, I] : {std::pair<int64_t, int64_t>{2048, 8192}, {656, 77}, {600, 40}}) {
    const Problem p(kGemvMaxRows, K, 2 * I, 90 + K);
    Tensor gate_up = host_f32({kGemvMaxRows, 2 * I});
    rmsnorm_gemv_cpu(gate_up, p.xc(kGemvMaxRows), p.g_cpu, eps, p.q_cpu, p.s_cpu);
    const std::vector<float> gu = to_f32_vector(gate_up);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      Tensor ref = host_f32({M, I});
      rmsnorm_gemv_silu_mul_cpu(ref, p.xc(M), p.g_cpu, eps, p.q_cpu, p.s_cpu);
      std::vector<double> extra(static_cast<size_t>(M * I));  // (c), as test_14_gemv_gpu.cpp
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < I; ++j) {
          const double gate = gu[m * 2 * I + j], up = gu[m * 2 * I + I + j];
          extra[m * I + j] = kFlip * (std::fabs(gate) + std::fabs(silu_f32(float(gate)))) * std::fabs(up);
        }
      Tensor act = poisoned({M, I}, DType::BF16);
      rmsnorm_gemv_silu_mul(act, p.xd(M), p.g_dev, eps, p.q_dev, p.s_dev);
      expect_close(act, to_f32_vector(ref), kRtolBf16, extra);
    }
  }
}

TEST(GemvFp8Gpu14, GemvResidualMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 2048}, {8192, 2048}, {656, 77}, {600, 336}}) {
    const Problem p(kGemvMaxRows, K, N, 110 + K);
    const std::vector<float> h0 = bf16_exact(random_uniform(static_cast<size_t>(kGemvMaxRows * N), 7 + K));
    Tensor prod = host_f32({kGemvMaxRows, N});
    gemv_cpu(prod, p.xc(kGemvMaxRows), p.q_cpu, p.s_cpu);
    const std::vector<float> product = to_f32_vector(prod);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      const std::vector<float> h_rows(h0.begin(), h0.begin() + M * N);
      Tensor ref = Tensor::from_f32(h_rows, {M, N}, DType::F32, Device::CPU);
      gemv_residual_cpu(ref, p.xc(M), p.q_cpu, p.s_cpu);
      Tensor h = Tensor::from_f32(h_rows, {M, N}, DType::BF16, Device::CUDA);
      gemv_residual(h, p.xd(M), p.q_dev, p.s_dev);
      std::vector<double> extra(static_cast<size_t>(M * N));
      for (size_t i = 0; i < extra.size(); ++i) extra[i] = kFlip * std::fabs(product[i]);
      expect_close(h, to_f32_vector(ref), kRtolBf16, extra);
    }
  }
}

// Row m among 16 rows, among 3, and alone: the same bits (the launch shape is a function of N and K only).
TEST(GemvFp8Gpu14, RowsAreTheSameBitsWhateverTheBatch) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 3072}, {8192, 2048}, {656, 78}, {600, 336}}) {
    const Problem p(kGemvMaxRows, K, N, 130 + K);
    const std::vector<float> h0 = random_uniform(static_cast<size_t>(kGemvMaxRows * N), 3);
    auto check = [&](const std::string& name, auto run) {
      SCOPED_TRACE(name + " " + p.describe());
      const std::vector<unsigned char> all = run(kGemvMaxRows, 0);
      const size_t row_bytes = all.size() / kGemvMaxRows;
      for (int64_t m : {0, 5, 14}) {
        const std::vector<unsigned char> one = run(1, m);
        EXPECT_EQ(0, std::memcmp(one.data(), all.data() + m * row_bytes, row_bytes)) << "row " << m;
      }
      const std::vector<unsigned char> three = run(3, 0);
      EXPECT_EQ(0, std::memcmp(three.data(), all.data(), three.size())) << "M=3";
    };
    auto x_rows = [&](int64_t M, int64_t first) { return p.x_dev.view().rows(first, M); };
    check("gemv", [&](int64_t M, int64_t first) {
      Tensor y = poisoned({M, N}, DType::BF16);
      gemv(y, x_rows(M, first), p.q_dev, p.s_dev);
      return bytes_of(y);
    });
    check("rmsnorm_gemv", [&](int64_t M, int64_t first) {
      Tensor y = poisoned({M, N}, DType::BF16);
      rmsnorm_gemv(y, x_rows(M, first), p.g_dev, eps, p.q_dev, p.s_dev);
      return bytes_of(y);
    });
    check("rmsnorm_gemv_silu_mul", [&](int64_t M, int64_t first) {
      Tensor y = poisoned({M, N / 2}, DType::BF16);
      rmsnorm_gemv_silu_mul(y, x_rows(M, first), p.g_dev, eps, p.q_dev, p.s_dev);
      return bytes_of(y);
    });
    check("gemv_residual", [&](int64_t M, int64_t first) {
      Tensor h = Tensor::from_f32(std::vector<float>(h0.begin() + first * N, h0.begin() + (first + M) * N), {M, N},
                                  DType::BF16, Device::CUDA);
      gemv_residual(h, x_rows(M, first), p.q_dev, p.s_dev);
      return bytes_of(h);
    });
  }
}

// ---- Fp8GemvVariant: every decoding of the codes, selected explicitly ------------------------------------------
// Every variant sums the same products in the same order (Bits: each product 2^-8 of Cvt's, an exact power of
// two, put back by the scale in the epilogue; the 8-row tiles change which block owns a row, not how its sum is
// made), so all of them must equal Cvt BIT FOR BIT, fused ops included; and each is checked against the oracle
// with the tolerance above. With those, the batch invariance RowsAreTheSameBitsWhateverTheBatch shows for the
// table's choice holds whatever variant the table gives each batch size.

std::string variant_trace(Fp8GemvVariant v, const std::string& what) {
  return std::string(fp8_gemv_variant_name(v)) + " " + what;
}

TEST(GemvFp8Gpu14, EveryVariantMatchesTheReferenceAndCvtBitForBit) {
  TVLLM_REQUIRE_GPU();
  // The 1B model's four decode shapes (16384 x 2048 and 3072 x 2048 take BitsTile8's 8-row tiles; 2048 rows do
  // not), odd rows (77: 1-row tiles), the 8-byte loads (K = 600).
  const std::pair<int64_t, int64_t> shapes[] = {{2048, 3072}, {2048, 2048}, {2048, 16384}, {8192, 2048},
                                                {656, 77},    {600, 336}};
  for (const auto& [K, N] : shapes) {
    const Problem p(kGemvMaxRows, K, N, 410 + K + N);
    Tensor ref = host_f32({kGemvMaxRows, N});
    gemv_cpu(ref, p.xc(kGemvMaxRows), p.q_cpu, p.s_cpu);
    const std::vector<float> want = to_f32_vector(ref);
    const std::vector<double> bound = p.sum_bound(kGemvMaxRows);
    for (int64_t M : kBatches) {
      for (DType out_dtype : {DType::BF16, DType::F32}) {
        Tensor base = poisoned({M, N}, out_dtype);
        gemv(base, p.xd(M), p.q_dev, p.s_dev, nullptr, Fp8GemvVariant::Cvt);
        const std::vector<unsigned char> cvt = bytes_of(base);
        for (Fp8GemvVariant v : all_fp8_gemv_variants()) {
          SCOPED_TRACE(variant_trace(v, p.describe() + " M=" + std::to_string(M) + " " +
                                            std::string(dtype_name(out_dtype))));
          Tensor y = poisoned({M, N}, out_dtype);
          gemv(y, p.xd(M), p.q_dev, p.s_dev, nullptr, v);
          expect_close(y, std::vector<float>(want.begin(), want.begin() + M * N),
                       out_dtype == DType::BF16 ? kRtolBf16 : kRtolF32, {},
                       std::vector<double>(bound.begin(), bound.begin() + M * N));
          EXPECT_EQ(bytes_of(y), cvt) << "differs from cvt";
        }
      }
    }
  }
}

// Every code but the NaNs, alone in its row (x = 1 at its column, scale 1, F32 out): each variant's decoding is
// the code's exact value, subnormals (0x01..0x07, 0x81..0x87) and signs included; the random codes above have
// none. K = 16: the 16-byte packs; K = 8: the 8-byte ones. The code sits at column 5 (mid-word: the PRMT lanes).
TEST(GemvFp8Gpu14, EveryVariantDecodesEveryCodeExactly) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint8_t> all_codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F) all_codes.push_back(static_cast<uint8_t>(c));
  const auto N = static_cast<int64_t>(all_codes.size());
  for (int64_t K : {16, 8}) {
    std::vector<uint8_t> q(static_cast<size_t>(N * K), 0);
    for (int64_t n = 0; n < N; ++n) q[n * K + 5] = all_codes[n];
    std::vector<float> x(static_cast<size_t>(K), 0.0f);
    x[5] = 1.0f;
    const Tensor q_dev = code_tensor(q, {N, K}, Device::CUDA);
    const Tensor x_dev = Tensor::from_f32(x, {1, K}, DType::BF16, Device::CUDA);
    const Tensor s_dev = Tensor::from_f32(std::vector<float>(static_cast<size_t>(N), 1.0f), {N}, DType::F32,
                                          Device::CUDA);
    for (Fp8GemvVariant v : all_fp8_gemv_variants()) {
      SCOPED_TRACE(variant_trace(v, "K=" + std::to_string(K)));
      Tensor y = poisoned({1, N}, DType::F32);
      gemv(y, x_dev, q_dev, s_dev, nullptr, v);
      const std::vector<float> got = to_f32_vector(y);
      int bad = 0;
      for (int64_t n = 0; n < N; ++n) {
        const float want = fp8_e4m3_to_f32(all_codes[n]);
        if (!(got[n] == want) && ++bad <= 5)
          ADD_FAILURE() << "code 0x" << std::hex << int(all_codes[n]) << std::dec << ": got " << got[n] << ", want "
                        << want;
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(GemvFp8Gpu14, EveryVariantOfTheFusedOpsIsCvtBitForBit) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  // QKV and gate|up at the 1B model's shapes (both take 8-row tiles in BitsTile8), down_proj, odd shapes.
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 3072}, {2048, 16384}, {8192, 2048}, {656, 78},
                             {600, 336}}) {
    const Problem p(kGemvMaxRows, K, N, 430 + K + N);
    const std::vector<float> h0 = random_uniform(static_cast<size_t>(kGemvMaxRows * N), 11);
    for (int64_t M : {1, 3, 8, 16}) {
      auto same_as_cvt = [&](const std::string& what, auto run) {
        const std::vector<unsigned char> cvt = run(Fp8GemvVariant::Cvt);
        for (Fp8GemvVariant v : all_fp8_gemv_variants()) {
          SCOPED_TRACE(variant_trace(v, what + " " + p.describe() + " M=" + std::to_string(M)));
          EXPECT_EQ(run(v), cvt) << "differs from cvt";
        }
      };
      same_as_cvt("rmsnorm_gemv", [&](Fp8GemvVariant v) {
        Tensor y = poisoned({M, N}, DType::BF16);
        rmsnorm_gemv(y, p.xd(M), p.g_dev, eps, p.q_dev, p.s_dev, nullptr, false, v);
        return bytes_of(y);
      });
      same_as_cvt("rmsnorm_gemv_silu_mul", [&](Fp8GemvVariant v) {
        Tensor y = poisoned({M, N / 2}, DType::BF16);
        rmsnorm_gemv_silu_mul(y, p.xd(M), p.g_dev, eps, p.q_dev, p.s_dev, nullptr, false, v);
        return bytes_of(y);
      });
      same_as_cvt("gemv_residual", [&](Fp8GemvVariant v) {
        Tensor h = Tensor::from_f32(std::vector<float>(h0.begin(), h0.begin() + M * N), {M, N}, DType::BF16,
                                    Device::CUDA);
        gemv_residual(h, p.xd(M), p.q_dev, p.s_dev, nullptr, false, v);
        return bytes_of(h);
      });
    }
  }
}

TEST(GemvFp8Gpu14, OperandsTheKernelsCannotReadAreRefused) {
  TVLLM_REQUIRE_GPU();
  const Problem p(2, 2048, 64, 200);
  Tensor y = poisoned({2, 64}, DType::BF16);
  // K % 8 != 0: x's 16-byte loads do not fit (and there is no byte-load fallback on this path).
  const Problem odd(1, 644, 64, 201);
  Tensor y1 = poisoned({1, 64}, DType::BF16);
  EXPECT_THROW(gemv(y1, odd.xd(1), odd.q_dev, odd.s_dev), InputError);
  EXPECT_THROW(gemv_residual(y1, odd.xd(1), odd.q_dev, odd.s_dev), InputError);
  // Scales on the host for weights on the GPU; no scales; BF16 weights through the F8 path's checks.
  EXPECT_THROW(gemv(y, p.xd(2), p.q_dev, p.s_cpu), InputError);
  EXPECT_THROW(gemv(y, p.xd(2), p.q_dev, TensorView{}), InputError);
  EXPECT_THROW(gemv(y, p.xd(2), p.q_dev), InputError);
  EXPECT_NO_THROW(gemv(y, p.xd(2), p.q_dev, p.s_dev));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tvllm
