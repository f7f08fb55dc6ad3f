// Lesson 16 on the GPU: the FP8-weight GEMV against the double-precision reference.
//
// Tolerance. The GPU gets exactly the reference's inputs (bf16 x, E4M3 codes decoded exactly, F32 scales),
// so it can differ only through
//   (a) its fp32 summation: K products added in fp32 (each product exact: 8 x 4 significant bits) in some
//       order. The classic bound for any order is (K - 1) 2^-24 Σ|x q| (plus the warps' tree, a few more
//       roundings): we allow 2 K 2^-24 Σ|x q|, times the scale (abs_sum of the reference);
//   (b) the multiply by the scale in fp32: 2^-24 of the value;
//   (c) the final rounding to bf16: at most 2^-8 of the value (half a step of 8 significant bits at the
//       bottom of a binade). F32 outputs: none.
// So |got - want| <= 2 K 2^-24 abs_sum + 2^-8 |want| (bf16) or + 2^-23 |want| (F32).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/errors.h"
#include "common/random.h"
#include "fp8.h"
#include "fp8_gemv.h"
#include "quantize.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

struct Problem {
  std::vector<uint16_t> x;  // bf16 [M, K]
  Fp8Weight w;              // codes [N, K], scales [N] or [1]
  int64_t M, N, K;
};

Problem make(int64_t M, int64_t N, int64_t K, bool per_row, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> wb(static_cast<size_t>(N * K));
  for (auto& v : wb) v = f32_to_bf16(static_cast<float>(rng.normal() / std::sqrt(static_cast<double>(K))));
  Problem p{std::vector<uint16_t>(static_cast<size_t>(M * K)), {}, M, N, K};
  for (auto& v : p.x) v = f32_to_bf16(static_cast<float>(2.0 * rng.uniform() - 1.0));
  p.w = quantize_weight_fp8(TensorView::contiguous(wb.data(), DType::BF16, Device::CPU, {N, K}),
                            per_row ? Fp8Quantization::Strategy::Channel : Fp8Quantization::Strategy::Tensor, DType::F32);
  return p;
}

// Runs the GPU kernel; returns out as floats.
std::vector<float> run(const Problem& p, DType out_dtype, int64_t m_first = 0, int64_t m_count = -1) {
  if (m_count < 0) m_count = p.M;
  Tensor x = Tensor::empty({m_count, p.K}, DType::BF16, Device::CUDA);
  Tensor q = Tensor::empty({p.N, p.K}, DType::F8_E4M3, Device::CUDA);
  Tensor s = Tensor::empty({static_cast<int64_t>(p.w.scales.size())}, DType::F32, Device::CUDA);
  Tensor out = Tensor::empty({m_count, p.N}, out_dtype, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemcpy(x.data(), p.x.data() + m_first * p.K, m_count * p.K * 2, cudaMemcpyHostToDevice));
  TVLLM_CUDA_CHECK(cudaMemcpy(q.data(), p.w.codes.data(), p.w.codes.size(), cudaMemcpyHostToDevice));
  TVLLM_CUDA_CHECK(cudaMemcpy(s.data(), p.w.scales.data(), p.w.scales.size() * 4, cudaMemcpyHostToDevice));
  TVLLM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.view().nbytes()));  // NaN: an unwritten output fails
  fp8_gemv(out.view(), x.view(), q.view(), s.view());
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got(static_cast<size_t>(m_count * p.N));
  if (out_dtype == DType::F32) {
    TVLLM_CUDA_CHECK(cudaMemcpy(got.data(), out.data(), got.size() * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> b(got.size());
    TVLLM_CUDA_CHECK(cudaMemcpy(b.data(), out.data(), b.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < b.size(); ++i) got[i] = bf16_to_f32(b[i]);
  }
  return got;
}

void expect_matches(const Problem& p, DType out_dtype) {
  Problem host = p;
  const Fp8GemvReference ref = fp8_gemv_reference(
      TensorView::contiguous(host.x.data(), DType::BF16, Device::CPU, {p.M, p.K}),
      TensorView::contiguous(host.w.codes.data(), DType::F8_E4M3, Device::CPU, {p.N, p.K}),
      TensorView::contiguous(host.w.scales.data(), DType::F32, Device::CPU, {static_cast<int64_t>(p.w.scales.size())}));
  const std::vector<float> got = run(p, out_dtype);
  const double rel = out_dtype == DType::F32 ? std::ldexp(1.0, -23) : std::ldexp(1.0, -8);
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 2.0 * static_cast<double>(p.K) * std::ldexp(1.0, -24) * ref.abs_sum[i] + rel * std::fabs(ref.value[i]);
    if (!(std::fabs(got[i] - ref.value[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << "M " << p.M << " N " << p.N << " K " << p.K << " element " << i << ": got " << got[i]
                    << ", want " << ref.value[i] << " (tol " << tol << ")";
  }
  EXPECT_EQ(bad, 0);
}

TEST(Fp8Gemv16Gpu, MatchesTheReferenceAtDecodeShapes) {
  TVLLM_REQUIRE_GPU();
  // Llama-3.2-1B: QKV 3072 x 2048, o 2048 x 2048, gate|up 16384 x 2048, down 2048 x 8192; batch 1 and 5
  for (auto [N, K] : {std::pair<int64_t, int64_t>{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}})
    for (int64_t M : {1, 5}) expect_matches(make(M, N, K, true, static_cast<uint64_t>(N + K + M)), DType::BF16);
  expect_matches(make(1, 2048, 2048, false, 7), DType::BF16);  // one scale for the tensor
  expect_matches(make(2, 4096, 2048, true, 8), DType::F32);    // F32 out (logits)
}

TEST(Fp8Gemv16Gpu, OddShapesTakeTheByteLoads) {
  TVLLM_REQUIRE_GPU();
  // the bundled model's down_proj: K = 600 is not a multiple of 16; N not a multiple of the 4-row tile
  expect_matches(make(1, 336, 600, true, 1), DType::BF16);
  expect_matches(make(3, 7, 17, true, 2), DType::BF16);
  expect_matches(make(16, 129, 336, true, 3), DType::F32);
}

TEST(Fp8Gemv16Gpu, RowsAreTheSameBitsWhateverTheBatch) {
  TVLLM_REQUIRE_GPU();
  const Problem p = make(16, 1024, 2048, true, 9);
  const std::vector<float> all = run(p, DType::F32);
  for (int64_t m : {0, 7, 15}) {
    const std::vector<float> alone = run(p, DType::F32, m, 1);
    for (int64_t n = 0; n < p.N; ++n)
      ASSERT_EQ(f32_bits(alone[static_cast<size_t>(n)]), f32_bits(all[static_cast<size_t>(m * p.N + n)])) << m << " " << n;
  }
}

}  // namespace
}  // namespace tvllm
