// Lesson 14, GPU: every GEMV version and every fused decode kernel against the CPU references at the
// model's real shapes and at odd ones; the fallback for misaligned operands; rows that are the same bits
// whatever the batch; CUDA graph replays equal to eager runs.
//
// Tolerance. The inputs are bf16 values, and the reference (gemv_cpu & co.) gets the SAME values, so the
// GPU may differ from it only through
//   (a) its fp32 summation order: the reference sums in double. K terms in a different order differ by
//       ~sqrt(K) * 2^-24 * sum|x*w| (a random walk of roundings). Here x ~ U(-1, 1) (normalised: |x| <~ 3)
//       and w ~ N(0, 1/K), so sum|x*w| <~ 0.6 sqrt(K) * 3 and the error is <~ 2 * K * 2^-24 ~ 1e-3 at
//       K = 8192, and 10x smaller at K = 2048 (the typical error is far below this bound). kAtol = 2e-3.
//   (b) the final rounding to bf16: <= 2^-8 of the value (half a step of an 8-bit significand is 2^-9;
//       rtol = 2^-7 leaves 2x). F32 outputs have no such rounding: rtol 2^-16.
//   (c) an intermediate bf16 rounding (gate, up, the residual's product, a normalised x) that a tiny
//       difference from (a) pushes across a rounding boundary: one step, <= 2^-8 of that intermediate.
//       The tests that have one add 2^-7 times what that intermediate contributes (below, per test).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_fp8.h>
#include <utility>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/cuda_stream.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "kv_store.h"
#include "gemv.h"
#include "model_config.h"
#include "rope.h"
#include "silu_mul.h"
#include "testing/gpu_buffers.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::bytes_of;
using testing::poisoned;

constexpr double kAtol = 2e-3;
constexpr double kRtolBf16 = 1.0 / 128;
constexpr double kRtolF32 = 1.0 / 65536;
constexpr double kFlip = 1.0 / 128;  // (c): one bf16 step of an intermediate, with 2x to spare

std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// One problem with the largest batch the test needs: smaller batches use the first M rows of x.
struct Problem {
  int64_t M, K, N;
  std::vector<float> x, w, g;  // [M, K] in U(-1, 1), [N, K] in N(0, 1/K), [K] in U(0.5, 1.5)
  Tensor x_dev, w_dev, g_dev;  // bf16 on the GPU
  Tensor x_cpu, w_cpu, g_cpu;  // the same bf16 values on the host, for the references

  Problem(int64_t M_, int64_t K_, int64_t N_, uint64_t seed) : M(M_), K(K_), N(N_) {
    x = bf16_exact(random_uniform(static_cast<size_t>(M * K), seed));
    w = bf16_exact(random_normal(static_cast<size_t>(N * K), seed + 1, 1.0f / std::sqrt(float(K))));
    g = bf16_exact(random_uniform(static_cast<size_t>(K), seed + 2, 0.5f, 1.5f));
    x_dev = Tensor::from_f32(x, {M, K}, DType::BF16, Device::CUDA);
    w_dev = Tensor::from_f32(w, {N, K}, DType::BF16, Device::CUDA);
    g_dev = Tensor::from_f32(g, {K}, DType::BF16, Device::CUDA);
    x_cpu = Tensor::from_f32(x, {M, K}, DType::BF16, Device::CPU);
    w_cpu = Tensor::from_f32(w, {N, K}, DType::BF16, Device::CPU);
    g_cpu = Tensor::from_f32(g, {K}, DType::BF16, Device::CPU);
  }
  TensorView xd(int64_t rows) const { return x_dev.view().rows(0, rows); }
  TensorView xc(int64_t rows) const { return x_cpu.view().rows(0, rows); }
  std::string describe() const {
    return "K=" + std::to_string(K) + " N=" + std::to_string(N);
  }
};


Tensor host_f32(Shape shape) { return Tensor::empty(std::move(shape), DType::F32, Device::CPU); }


// |got - want| <= kAtol + rtol |want| + extra[i] for every element; reports the first few failures.
void expect_close(const TensorView& got_dev, const std::vector<float>& want, double rtol,
                  const std::vector<double>& extra = {}) {
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = to_f32_vector(got_dev);
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = kAtol + rtol * std::fabs(want[i]) + (extra.empty() ? 0.0 : extra[i]);
    const double diff = std::fabs(double(got[i]) - want[i]);
    if (!(diff <= tol)) {  // NaN fails too
      if (++bad <= 5) ADD_FAILURE() << "[" << i << "] got " << got[i] << ", want " << want[i] << " (tol " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0) << "of " << got.size();
}

std::vector<float> reference_gemv(const Problem& p, int64_t M) {
  Tensor ref = host_f32({M, p.N});
  gemv_cpu(ref, p.xc(M), p.w_cpu);
  return to_f32_vector(ref);
}

const int64_t kBatches[] = {1, 2, 3, 8, 16};

// ---- plain GEMV ----------------------------------------------------------------------------------------

TEST(Gemv14Gpu, EveryVersionMatchesTheReferenceAtDecodeShapes) {
  TVLLM_REQUIRE_GPU();
  // QKV (2048 -> 3072), o_proj (2048 -> 2048), gate|up (2048 -> 16384), down_proj (8192 -> 2048).
  const std::pair<int64_t, int64_t> shapes[] = {{2048, 3072}, {2048, 2048}, {2048, 16384}, {8192, 2048}};
  uint64_t seed = 10;
  for (const auto& [K, N] : shapes) {
    const Problem p(kGemvMaxRows, K, N, seed += 3);
    const std::vector<float> ref = reference_gemv(p, kGemvMaxRows);
    for (int64_t M : kBatches) {
      const std::vector<float> want(ref.begin(), ref.begin() + M * N);
      for (GemvKernel kernel : all_gemv_kernels()) {
        SCOPED_TRACE(p.describe() + " M=" + std::to_string(M) + " " + std::string(gemv_kernel_name(kernel)));
        Tensor y = poisoned({M, N}, DType::BF16);
        gemv(y, p.xd(M), p.w_dev, kernel);
        expect_close(y, want, kRtolBf16);
      }
    }
  }
}

TEST(Gemv14Gpu, LmHeadWritesF32Logits) {
  TVLLM_REQUIRE_GPU();
  const Problem p(3, 2048, 128256, 40);
  const std::vector<float> ref = reference_gemv(p, 3);
  for (int64_t M : {1, 3}) {
    for (GemvKernel kernel : {GemvKernel::V2Vector, GemvKernel::V3Blocked}) {
      SCOPED_TRACE("M=" + std::to_string(M) + " " + std::string(gemv_kernel_name(kernel)));
      Tensor y = poisoned({M, p.N}, DType::F32);
      gemv(y, p.xd(M), p.w_dev, kernel);
      expect_close(y, std::vector<float>(ref.begin(), ref.begin() + M * p.N), kRtolF32);
    }
  }
}

TEST(Gemv14Gpu, OddShapes) {
  TVLLM_REQUIRE_GPU();
  // K = 80 * 8 with N = 77 (tiles past N, 3 warps), K = 8 (one pack), K = 24 (threads without a pack),
  // K odd or not a multiple of 8 (v2 and v3 fall back to v1), N = 1.
  const std::pair<int64_t, int64_t> shapes[] = {{640, 77}, {8, 1}, {24, 1000}, {2056, 5}, {77, 33}, {12, 300}};
  uint64_t seed = 50;
  for (const auto& [K, N] : shapes) {
    const Problem p(16, K, N, seed += 3);
    const std::vector<float> ref = reference_gemv(p, 16);
    for (int64_t M : {1, 5, 16}) {
      for (GemvKernel kernel : all_gemv_kernels()) {
        SCOPED_TRACE(p.describe() + " M=" + std::to_string(M) + " " + std::string(gemv_kernel_name(kernel)));
        for (DType dtype : {DType::BF16, DType::F32}) {
          Tensor y = poisoned({M, N}, dtype);
          gemv(y, p.xd(M), p.w_dev, kernel);
          expect_close(y, std::vector<float>(ref.begin(), ref.begin() + M * N),
                       dtype == DType::F32 ? kRtolF32 : kRtolBf16);
        }
      }
    }
  }
}

TEST(Gemv14Gpu, MisalignedOperandsFallBackOrAreRefused) {
  TVLLM_REQUIRE_GPU();
  const int64_t M = 3, K = 64, N = 40;
  const Problem p(M, K, N, 60);
  // x shifted by one element (2 bytes) inside a bigger buffer: gemv_supported is false, gemv still right.
  Tensor buf = Tensor::empty({M * K + 8}, DType::BF16, Device::CUDA);
  const TensorView x_odd = TensorView::contiguous(buf.view().ptr<uint16_t>() + 1, DType::BF16, Device::CUDA, {M, K});
  TVLLM_CUDA_CHECK(cudaMemcpy(x_odd.data, p.x_dev.data(), p.x_dev.view().nbytes(), cudaMemcpyDeviceToDevice));
  EXPECT_FALSE(gemv_supported(x_odd, p.w_dev));
  EXPECT_TRUE(gemv_supported(p.x_dev, p.w_dev));
  const std::vector<float> ref = reference_gemv(p, M);
  for (GemvKernel kernel : all_gemv_kernels()) {
    Tensor y = poisoned({M, N}, DType::BF16);
    gemv(y, x_odd, p.w_dev, kernel);
    expect_close(y, ref, kRtolBf16);
  }
  // The fused kernels have no fallback: they refuse.
  Tensor out = poisoned({M, N}, DType::BF16);
  EXPECT_THROW(rmsnorm_gemv(out, x_odd, p.g_dev, 1e-5f, p.w_dev), InputError);
  EXPECT_THROW(gemv_residual(out, x_odd, p.w_dev), InputError);
  Tensor act = poisoned({M, N / 2}, DType::BF16);
  EXPECT_THROW(rmsnorm_gemv_silu_mul(act, x_odd, p.g_dev, 1e-5f, p.w_dev), InputError);
  // The GPU path takes BF16 operands only; F32 out only for gemv and rmsnorm_gemv.
  Tensor x_f32 = Tensor::empty({M, K}, DType::F32, Device::CUDA);
  EXPECT_THROW(gemv(out, x_f32, p.w_dev), InputError);
  Tensor act_f32 = poisoned({M, N / 2}, DType::F32), h_f32 = poisoned({M, N}, DType::F32);
  EXPECT_THROW(rmsnorm_gemv_silu_mul(act_f32, p.x_dev, p.g_dev, 1e-5f, p.w_dev), InputError);
  EXPECT_THROW(gemv_residual(h_f32, p.x_dev, p.w_dev), InputError);
  EXPECT_TRUE(gemv_shape_supported(p.w_dev, DType::F32));
  EXPECT_FALSE(gemv_shape_supported(p.w_dev, DType::F16));
  EXPECT_FALSE(gemv_shape_supported(x_odd, DType::BF16));
}

// ---- the fused kernels ---------------------------------------------------------------------------------

TEST(Gemv14Gpu, RmsNormGemvMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 3072}, {640, 77}}) {
    const Problem p(kGemvMaxRows, K, N, 70 + K);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      Tensor ref = host_f32({M, N});
      rmsnorm_gemv_cpu(ref, p.xc(M), p.g_cpu, eps, p.w_cpu);
      Tensor y = poisoned({M, N}, DType::BF16);
      rmsnorm_gemv(y, p.xd(M), p.g_dev, eps, p.w_dev);
      // (c): a normalised x that rounds the other way moves one term by 2^-8 of itself: inside kAtol.
      expect_close(y, to_f32_vector(ref), kRtolBf16);
    }
  }
}

TEST(Gemv14Gpu, RmsNormGemvWritesF32LogitsForTheFusedFinalNorm) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  const Problem p(3, 2048, 128256, 170);  // the lm_head
  Tensor ref = host_f32({3, p.N});
  rmsnorm_gemv_cpu(ref, p.xc(3), p.g_cpu, eps, p.w_cpu);
  const std::vector<float> want = to_f32_vector(ref);
  for (int64_t M : {1, 3}) {
    SCOPED_TRACE("M=" + std::to_string(M));
    Tensor y = poisoned({M, p.N}, DType::F32);
    rmsnorm_gemv(y, p.xd(M), p.g_dev, eps, p.w_dev);
    expect_close(y, std::vector<float>(want.begin(), want.begin() + M * p.N), kRtolF32);
  }
}

TEST(Gemv14Gpu, RmsNormGemvSiluMulMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, I] : {std::pair<int64_t, int64_t>{2048, 8192}, {640, 77}}) {
    const Problem p(kGemvMaxRows, K, 2 * I, 90 + K);
    Tensor gate_up = host_f32({kGemvMaxRows, 2 * I});  // unrounded gate and up, for the (c) allowance
    rmsnorm_gemv_cpu(gate_up, p.xc(kGemvMaxRows), p.g_cpu, eps, p.w_cpu);
    const std::vector<float> gu = to_f32_vector(gate_up);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      Tensor ref = host_f32({M, I});
      rmsnorm_gemv_silu_mul_cpu(ref, p.xc(M), p.g_cpu, eps, p.w_cpu);
      // (c): gate one bf16 step off moves act by <= |silu'| 2^-8 |gate| |up| (|silu'| <= 1.1); up one step
      // off by 2^-8 |silu(gate)| |up|. Allow 2^-7 (|gate| + |silu(gate)|) |up|.
      std::vector<double> extra(static_cast<size_t>(M * I));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < I; ++j) {
          const double gate = gu[m * 2 * I + j], up = gu[m * 2 * I + I + j];
          extra[m * I + j] = kFlip * (std::fabs(gate) + std::fabs(silu_f32(float(gate)))) * std::fabs(up);
        }
      Tensor act = poisoned({M, I}, DType::BF16);
      rmsnorm_gemv_silu_mul(act, p.xd(M), p.g_dev, eps, p.w_dev);
      expect_close(act, to_f32_vector(ref), kRtolBf16, extra);
    }
  }
}

TEST(Gemv14Gpu, GemvResidualMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 2048}, {8192, 2048}, {640, 77}}) {
    const Problem p(kGemvMaxRows, K, N, 110 + K);
    const std::vector<float> h0 = bf16_exact(random_uniform(static_cast<size_t>(kGemvMaxRows * N), 7 + K));
    const std::vector<float> product = reference_gemv(p, kGemvMaxRows);
    for (int64_t M : kBatches) {
      SCOPED_TRACE(p.describe() + " M=" + std::to_string(M));
      const std::vector<float> h_rows(h0.begin(), h0.begin() + M * N);
      Tensor ref = Tensor::from_f32(h_rows, {M, N}, DType::F32, Device::CPU);
      gemv_residual_cpu(ref, p.xc(M), p.w_cpu);
      Tensor h = Tensor::from_f32(h_rows, {M, N}, DType::BF16, Device::CUDA);
      gemv_residual(h, p.xd(M), p.w_dev);
      // (c): the product rounded to bf16 one step off: 2^-8 |product|.
      std::vector<double> extra(static_cast<size_t>(M * N));
      for (size_t i = 0; i < extra.size(); ++i) extra[i] = kFlip * std::fabs(product[i]);
      expect_close(h, to_f32_vector(ref), kRtolBf16, extra);
    }
  }
}

// ---- determinism ---------------------------------------------------------------------------------------

// Row m computed among M = 16 rows, among the first 3, and alone: the same bits, for every kernel.
TEST(Gemv14Gpu, RowsAreTheSameBitsWhateverTheBatch) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const auto& [K, N] : {std::pair<int64_t, int64_t>{2048, 3072}, {8192, 2048}, {640, 77}}) {
    const Problem p(kGemvMaxRows, K, N, 130 + K);
    const std::vector<float> h0 = random_uniform(static_cast<size_t>(kGemvMaxRows * N), 3);
    // run(M, first): rows [first, first + M) of x through one op, returning the output's bytes.
    auto check = [&](const std::string& name, auto run) {
      SCOPED_TRACE(name + " " + p.describe());
      const std::vector<unsigned char> all = run(kGemvMaxRows, 0);
      const size_t row_bytes = all.size() / kGemvMaxRows;
      const std::vector<unsigned char> three = run(3, 0);
      EXPECT_EQ(0, std::memcmp(three.data(), all.data(), three.size())) << "M=3";
      for (int64_t m : {0, 5, 14}) {
        const std::vector<unsigned char> two = run(2, m);
        EXPECT_EQ(0, std::memcmp(two.data(), all.data() + m * row_bytes, 2 * row_bytes)) << "rows " << m << ", +1";
        const std::vector<unsigned char> one = run(1, m);
        EXPECT_EQ(0, std::memcmp(one.data(), all.data() + m * row_bytes, row_bytes)) << "row " << m;
      }
    };
    auto x_rows = [&](int64_t M, int64_t first) { return p.x_dev.view().rows(first, M); };
    for (GemvKernel kernel : all_gemv_kernels())
      check(std::string("gemv ") + std::string(gemv_kernel_name(kernel)), [&](int64_t M, int64_t first) {
        Tensor y = poisoned({M, N}, DType::BF16);
        gemv(y, x_rows(M, first), p.w_dev, kernel);
        return bytes_of(y);
      });
    check("rmsnorm_gemv", [&](int64_t M, int64_t first) {
      Tensor y = poisoned({M, N}, DType::BF16);
      rmsnorm_gemv(y, x_rows(M, first), p.g_dev, eps, p.w_dev);
      return bytes_of(y);
    });
    if (N % 2 == 0)
      check("rmsnorm_gemv_silu_mul", [&](int64_t M, int64_t first) {
        Tensor y = poisoned({M, N / 2}, DType::BF16);
        rmsnorm_gemv_silu_mul(y, x_rows(M, first), p.g_dev, eps, p.w_dev);
        return bytes_of(y);
      });
    check("gemv_residual", [&](int64_t M, int64_t first) {
      Tensor h = Tensor::from_f32(std::vector<float>(h0.begin() + first * N, h0.begin() + (first + M) * N), {M, N},
                                  DType::BF16, Device::CUDA);
      gemv_residual(h, x_rows(M, first), p.w_dev);
      return bytes_of(h);
    });
  }
}

// Tile streaming (gemv.h) changes which block computes a tile and when its weights are loaded, never who adds
// what in which order: every op gives the same bytes with it on (fewer blocks than tiles: the gate|up and
// lm_head shapes have 4,096 and 32,064 tiles, several per resident block) and off (one block per tile), for
// BF16 and for E4M3 weights (each decoding, so also the 8-row tiles), at M = 1 and at 5 rows.
class TileStreaming {
 public:
  explicit TileStreaming(bool on) : before_(gemv_tile_streaming()) { set_gemv_tile_streaming(on); }
  ~TileStreaming() { set_gemv_tile_streaming(before_); }

 private:
  bool before_;
};

TEST(Gemv14Gpu, StreamingTilesAreTheSameBitsAsOneBlockPerTile) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  // (K, N): gate|up of Llama 3.2 1B, its down projection (K = 8192: two groups of packs per tile), an lm_head
  // of 32,064 rows, a shape whose last tile is part empty (4,002 rows: 1,000.5 tiles of 4; 2,001 gate|up outputs)
  // and one with 1-row tiles (N < 4 x 264). N is even: gate|up needs 2I rows.
  for (const auto& [K, N] :
       {std::pair<int64_t, int64_t>{2048, 16384}, {8192, 2048}, {2048, 32064}, {640, 4002}, {640, 1000}}) {
    const Problem p(5, K, N, 190 + K);
    const std::vector<float> h0 = random_uniform(static_cast<size_t>(5 * N), 11);
    // E4M3 weights: codes of both signs with exponents up to 14 (0xf7 masks out the NaN pattern s1111111) and a
    // scale per row; what they round to does not matter here, only that both runs read the same.
    std::vector<float> scales(static_cast<size_t>(N));
    std::vector<uint8_t> codes(static_cast<size_t>(N * K));
    for (int64_t n = 0; n < N; ++n) {
      scales[n] = (1.0f + static_cast<float>(n % 7)) / 1024.f;
      for (int64_t k = 0; k < K; ++k) codes[n * K + k] = static_cast<uint8_t>((n * 131 + k * 29 + (k >> 3)) & 0xf7);
    }
    Tensor w8 = Tensor::empty({N, K}, DType::F8_E4M3, Device::CUDA);
    Tensor s8 = Tensor::from_f32(scales, {N}, DType::F32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemcpy(w8.data(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
    for (int64_t M : {1, 5}) {
      for (const bool fp8 : {false, true}) {
        const TensorView w = fp8 ? w8.view() : p.w_dev.view();
        const TensorView scale = fp8 ? s8.view() : TensorView{};
        const auto variants = fp8 ? std::vector<Fp8GemvVariant>{Fp8GemvVariant::Cvt, Fp8GemvVariant::Bits,
                                                                Fp8GemvVariant::BitsTile8}
                                  : std::vector<Fp8GemvVariant>{Fp8GemvVariant::Auto};
        for (const Fp8GemvVariant variant : variants) {
          // Every op's output bytes, with streaming on or off.
          const auto outputs = [&](bool on) {
            const TileStreaming streaming(on);
            std::vector<std::vector<unsigned char>> out;
            Tensor y = poisoned({M, N}, DType::BF16);
            gemv(y, p.xd(M), w, scale, nullptr, variant);
            out.push_back(bytes_of(y));
            Tensor logits = poisoned({M, N}, DType::F32);
            rmsnorm_gemv(logits, p.xd(M), p.g_dev, eps, w, scale, nullptr, false, variant);
            out.push_back(bytes_of(logits));
            Tensor act = poisoned({M, N / 2}, DType::BF16);
            rmsnorm_gemv_silu_mul(act, p.xd(M), p.g_dev, eps, w, scale, nullptr, false, variant);
            out.push_back(bytes_of(act));
            Tensor h = Tensor::from_f32(std::vector<float>(h0.begin(), h0.begin() + M * N), {M, N}, DType::BF16,
                                        Device::CUDA);
            gemv_residual(h, p.xd(M), w, scale, nullptr, false, variant);
            out.push_back(bytes_of(h));
            return out;
          };
          SCOPED_TRACE(p.describe() + " M=" + std::to_string(M) + (fp8 ? " fp8" : " bf16") + " variant " +
                       std::to_string(static_cast<int>(variant)));
          const auto on = outputs(true), off = outputs(false);
          const char* names[] = {"gemv", "rmsnorm_gemv (F32)", "rmsnorm_gemv_silu_mul", "gemv_residual"};
          for (size_t i = 0; i < on.size(); ++i) EXPECT_TRUE(on[i] == off[i]) << names[i];
        }
      }
    }
  }
}

// RoPE in the qkv GEMV's epilogue: the same bits as rmsnorm_gemv then apply_rope on the q and k views (the two
// launches it replaces), for BF16 and E4M3 weights, with tile streaming on and off, at Llama 3.2 1B's qkv shape
// (head_dim 64, 32 q heads, 8 k/v heads), at head_dim 128 and at head_dim 80 with 2-row tiles; positions 0, mid,
// the table's last and one past it (clamped, as PositionCheck::Trusted does).
TEST(Gemv14Gpu, RmsNormGemvRopeIsTheSameBitsAsTheTwoLaunches) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  struct Case {
    int64_t K, head_dim, q_heads, kv_heads;
  };
  for (const Case& c : {Case{2048, 64, 32, 8}, Case{1024, 128, 16, 8}, Case{640, 80, 4, 2}}) {
    const int64_t N = (c.q_heads + 2 * c.kv_heads) * c.head_dim;
    const Problem p(kGemvMaxRows, c.K, N, 210 + c.K);
    ModelConfig config;
    config.model_type = "llama";
    config.head_dim = c.head_dim;
    config.num_attention_heads = c.q_heads;
    config.num_key_value_heads = c.kv_heads;
    config.rope_theta = 500000.0;
    config.max_position_embeddings = 4096;
    RopeTable table = RopeTable::build(config);
    table.upload_to_device();
    std::vector<int32_t> pos(kGemvMaxRows);
    for (int64_t m = 0; m < kGemvMaxRows; ++m) pos[m] = static_cast<int32_t>((m * 977) % 4096);
    pos[1] = 4095;
    pos[2] = 5000;  // past the table: clamped to its last row
    Tensor positions = Tensor::empty({kGemvMaxRows}, DType::I32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemcpy(positions.data(), pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float> scales(static_cast<size_t>(N));  // E4M3 weights, as in the streaming test above
    std::vector<uint8_t> codes(static_cast<size_t>(N * c.K));
    for (int64_t n = 0; n < N; ++n) {
      scales[n] = (1.0f + static_cast<float>(n % 5)) / 2048.f;
      for (int64_t k = 0; k < c.K; ++k) codes[n * c.K + k] = static_cast<uint8_t>((n * 37 + k * 11 + (k >> 4)) & 0xf7);
    }
    Tensor w8 = Tensor::empty({N, c.K}, DType::F8_E4M3, Device::CUDA);
    Tensor s8 = Tensor::from_f32(scales, {N}, DType::F32, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemcpy(w8.data(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
    for (const bool fp8 : {false, true}) {
      const TensorView w = fp8 ? w8.view() : p.w_dev.view();
      const TensorView scale = fp8 ? s8.view() : TensorView{};
      for (const bool streaming : {true, false}) {
        const TileStreaming tiles(streaming);
        for (int64_t M : std::vector<int64_t>{1, 3, kGemvMaxRows}) {
          SCOPED_TRACE(p.describe() + " head_dim=" + std::to_string(c.head_dim) + " M=" + std::to_string(M) +
                       (fp8 ? " fp8" : " bf16") + (streaming ? " streaming" : " one block per tile"));
          const TensorView rows_pos = positions.view().rows(0, M);
          Tensor two = poisoned({M, N}, DType::BF16);
          rmsnorm_gemv(two, p.xd(M), p.g_dev, eps, w, scale);
          apply_rope(two.view().columns(0, c.q_heads * c.head_dim),
                     two.view().columns(c.q_heads * c.head_dim, c.kv_heads * c.head_dim), rows_pos, table,
                     kDefaultRopeKernel, PositionCheck::Trusted);
          Tensor one = poisoned({M, N}, DType::BF16);
          rmsnorm_gemv_rope(one, p.xd(M), p.g_dev, eps, w, scale, rows_pos, table, c.q_heads, c.kv_heads);
          TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<unsigned char> a = bytes_of(one), b = bytes_of(two);
          ASSERT_EQ(a.size(), b.size());
          size_t first_diff = a.size();
          for (size_t i = 0; i < a.size() && first_diff == a.size(); ++i)
            if (a[i] != b[i]) first_diff = i;
          EXPECT_EQ(first_diff, a.size()) << "first different element: " << first_diff / 2 << " (row "
                                          << first_diff / 2 / N << ", column " << first_diff / 2 % N << ")";
        }
      }
    }
  }
}

// The KV store of rmsnorm_gemv_rope (kv_store.h): each token's k heads (after RoPE) and v heads land in its row of a
// cache, as lesson 10's and 12's write kernels would copy them out of qkv: the same bf16 bits, or for lesson 16's
// FP8 pool the E4M3 code of x * inv_scale (cuda_fp8.h's conversion, as paged_kv_write_fp8 calls it); rows no token
// names keep their poison, a padding token (-1) stores nothing. Both ways of naming a row: lesson 12's slot mapping
// and lesson 10's slot + key length (a decode step). With qkv itself the same bits as without the store.
TEST(Gemv14Gpu, RmsNormGemvRopeStoresKAndVWhereTheWriteKernelsWould) {
  TVLLM_REQUIRE_GPU();
  const float eps = 1e-5f;
  struct Case {
    int64_t K, head_dim, q_heads, kv_heads;
  };
  for (const Case& c : {Case{2048, 64, 32, 8}, Case{1024, 128, 16, 8}, Case{640, 80, 4, 2}}) {
    const int64_t N = (c.q_heads + 2 * c.kv_heads) * c.head_dim, kv_dim = c.kv_heads * c.head_dim;
    const Problem p(kGemvMaxRows, c.K, N, 310 + c.K);
    ModelConfig config;
    config.model_type = "llama";
    config.head_dim = c.head_dim;
    config.num_attention_heads = c.q_heads;
    config.num_key_value_heads = c.kv_heads;
    config.rope_theta = 500000.0;
    config.max_position_embeddings = 4096;
    RopeTable table = RopeTable::build(config);
    table.upload_to_device();
    const int64_t cache_rows = 128, max_context = 8;  // lesson 10's view of it: 16 slots of 8 positions
    for (const int64_t M : {int64_t{1}, int64_t{3}, int64_t{kGemvMaxRows}}) {
      // Token m: position 100 + 37 m; pool row (slot mapping) 5 + 3 m, token 1 a padding token; cache slot
      // 15 - m at its key length 1 + m % 8 (lesson 10: row slot * 8 + k_len - 1).
      std::vector<int32_t> pos(M), rows(M), slots(M), cu_k(M + 1, 0);
      for (int64_t m = 0; m < M; ++m) {
        pos[m] = static_cast<int32_t>(100 + 37 * m);
        rows[m] = m == 1 ? -1 : static_cast<int32_t>(5 + 3 * m);
        slots[m] = static_cast<int32_t>(15 - m);
        cu_k[m + 1] = cu_k[m] + static_cast<int32_t>(1 + m % 8);
      }
      const auto upload = [](const std::vector<int32_t>& v) {
        Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32, Device::CUDA);
        TVLLM_CUDA_CHECK(cudaMemcpy(t.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
        return t;
      };
      const Tensor positions = upload(pos), rows_dev = upload(rows), slots_dev = upload(slots), cu_k_dev = upload(cu_k);
      Tensor plain = poisoned({M, N}, DType::BF16);
      rmsnorm_gemv_rope(plain, p.xd(M), p.g_dev, eps, p.w_dev, {}, positions, table, c.q_heads, c.kv_heads);
      const std::vector<unsigned char> qkv = bytes_of(plain);
      const auto element = [&](int64_t m, int64_t col) {  // qkv[m, col]'s bf16 bits
        uint16_t b;
        std::memcpy(&b, qkv.data() + 2 * (m * N + col), 2);
        return b;
      };
      for (const DType dtype : {DType::BF16, DType::F8_E4M3}) {
        for (const bool paged : {true, false}) {
          SCOPED_TRACE(p.describe() + " head_dim=" + std::to_string(c.head_dim) + " M=" + std::to_string(M) +
                       (dtype == DType::BF16 ? " bf16" : " e4m3") + (paged ? " slot mapping" : " slots + k_len"));
          Tensor k = poisoned({cache_rows, kv_dim}, dtype), v = poisoned({cache_rows, kv_dim}, dtype);
          KvStore store;
          store.k = k.data();
          store.v = v.data();
          store.dtype = dtype;
          store.device = Device::CUDA;
          store.kv_dim = kv_dim;
          if (paged) {
            store.rows = rows_dev.view().ptr<const int32_t>();
          } else {
            store.slots = slots_dev.view().ptr<const int32_t>();
            store.cu_k = cu_k_dev.view().ptr<const int32_t>();
            store.max_context = max_context;
          }
          store.k_inv_scale = 1.0f / 0.03f;
          store.v_inv_scale = 1.0f / 0.02f;
          Tensor out = poisoned({M, N}, DType::BF16);
          rmsnorm_gemv_rope(out, p.xd(M), p.g_dev, eps, p.w_dev, {}, positions, table, c.q_heads, c.kv_heads,
                            nullptr, false, Fp8GemvVariant::Auto, &store);
          EXPECT_EQ(bytes_of(out), qkv) << "the store changed qkv";
          // What the write kernels would leave: poison everywhere but each stored token's row.
          const size_t elem = dtype_size(dtype);
          std::vector<unsigned char> want_k(static_cast<size_t>(cache_rows * kv_dim) * elem, 0xFF), want_v = want_k;
          for (int64_t m = 0; m < M; ++m) {
            const int64_t row = paged ? rows[m] : int64_t{slots[m]} * max_context + (cu_k[m + 1] - cu_k[m] - 1);
            if (row < 0) continue;
            for (int64_t i = 0; i < kv_dim; ++i) {
              const uint16_t kb = element(m, c.q_heads * c.head_dim + i);
              const uint16_t vb = element(m, c.q_heads * c.head_dim + kv_dim + i);
              const size_t at = static_cast<size_t>(row * kv_dim + i) * elem;
              if (dtype == DType::BF16) {
                std::memcpy(want_k.data() + at, &kb, 2);
                std::memcpy(want_v.data() + at, &vb, 2);
              } else {
                want_k[at] = __nv_cvt_float_to_fp8(bf16_to_f32(kb) * store.k_inv_scale, __NV_SATFINITE, __NV_E4M3);
                want_v[at] = __nv_cvt_float_to_fp8(bf16_to_f32(vb) * store.v_inv_scale, __NV_SATFINITE, __NV_E4M3);
              }
            }
          }
          EXPECT_EQ(bytes_of(k), want_k) << "k rows";
          EXPECT_EQ(bytes_of(v), want_v) << "v rows";
        }
      }
    }
  }
}

TEST(Gemv14Gpu, GraphReplaysEqualEagerRuns) {
  TVLLM_REQUIRE_GPU();
  const int64_t M = 3, K = 2048, N = 3072;
  const float eps = 1e-5f;
  const Problem p(M, K, N, 150);
  const Tensor h0 = Tensor::from_f32(bf16_exact(random_uniform(M * N, 4)), {M, N}, DType::BF16, Device::CUDA);
  CudaStream stream;
  Tensor y = poisoned({M, N}, DType::BF16), y_f32 = poisoned({M, N}, DType::F32), act = poisoned({M, N / 2}, DType::BF16);
  Tensor h = Tensor::empty({M, N}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  // The decode step's four GEMVs on one stream; h is reset from h0 first, so a replay starts the same.
  auto step = [&] {
    TVLLM_CUDA_CHECK(cudaMemcpyAsync(h.data(), h0.data(), h0.view().nbytes(), cudaMemcpyDeviceToDevice, stream));
    rmsnorm_gemv(y, p.x_dev, p.g_dev, eps, p.w_dev, stream);
    rmsnorm_gemv_silu_mul(act, p.x_dev, p.g_dev, eps, p.w_dev, stream);
    gemv_residual(h, p.x_dev, p.w_dev, stream);
    for (GemvKernel kernel : all_gemv_kernels()) gemv(y_f32, p.x_dev, p.w_dev, kernel, stream);
  };
  step();
  stream.synchronize();
  const std::vector<std::vector<unsigned char>> eager{bytes_of(y), bytes_of(y_f32), bytes_of(act), bytes_of(h)};
  for (Tensor* t : {&y, &y_f32, &act, &h}) TVLLM_CUDA_CHECK(cudaMemset(t->data(), 0xFF, t->view().nbytes()));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  CudaGraph graph = CudaGraph::capture(stream, step);  // fails if anything allocates or synchronises
  EXPECT_EQ(graph.num_nodes(), 4 + all_gemv_kernels().size());  // the copy, three fused ops, every gemv version
  graph.launch(stream);
  graph.launch(stream);  // twice: the residual is reset by the graph's own copy
  stream.synchronize();
  const std::vector<std::vector<unsigned char>> replay{bytes_of(y), bytes_of(y_f32), bytes_of(act), bytes_of(h)};
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_TRUE(eager[i] == replay[i]) << "output " << i;
}

}  // namespace
}  // namespace tvllm
