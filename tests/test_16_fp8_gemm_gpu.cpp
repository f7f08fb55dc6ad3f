// Lesson 16 on the GPU: the FP8 tensor-core GEMM (fp8_gemm.h) against its CPU oracles.
//
// The quantizer: bit for bit (both divide in IEEE fp32 and encode with round-to-nearest-even, saturating).
// The GEMM: both sides get the same codes and scales, so they differ only through
//   (a) the fp32 accumulation of K exact products (4 x 4 significant bits) in some order: the classic bound
//       (K - 1) 2^-24 Σ|terms|; we allow 2 K 2^-24 abs_sum (abs_sum: the reference's scaled Σ|terms|);
//   (b) scale vectors: the scales applied in fp32 (a few 2^-24) and one rounding to bf16, at most 2^-8 |value|;
//       epilogue: the bare sum rounded to bf16 first, then scaled and rounded again: 2 x 2^-8 |value|;
//   (c) fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM on): the tensor cores' FP8 accumulator keeps fewer
//       bits than fp32, and NVIDIA does not document how many. We allow 2^-10 abs_sum at K = 2048, the error of
//       a 13-bit accumulator over 2048 additions, and print the largest error seen (README 7.3 records it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "common/cublas.h"
#include "common/errors.h"
#include "common/random.h"
#include "fp8.h"
#include "fp8_gemm.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

std::vector<uint16_t> random_bf16(int64_t n, double sigma, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = f32_to_bf16(static_cast<float>(sigma * rng.normal()));
  return v;
}

template <typename T>
Tensor upload(const std::vector<T>& v, Shape shape, DType dtype) {
  Tensor t = Tensor::empty(std::move(shape), dtype, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemcpy(t.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return t;
}
template <typename T>
std::vector<T> download(const Tensor& t) {
  std::vector<T> v(t.view().nbytes() / sizeof(T));
  TVLLM_CUDA_CHECK(cudaMemcpy(v.data(), t.data(), t.view().nbytes(), cudaMemcpyDeviceToHost));
  return v;
}

TEST(Fp8Gemm16Gpu, QuantizerEqualsTheCpuBitForBit) {
  TVLLM_REQUIRE_GPU();
  // (T, K, row stride): the vector kernel (K % 8 == 0), the scalar one (K = 600 is, but stride 601 is not; 17),
  // and a zero row.
  const int64_t cases[][3] = {{33, 2048, 2048}, {5, 8192, 8192}, {4, 600, 601}, {3, 17, 17}, {19, 64, 72}};
  for (const auto& c : cases) {
    const int64_t T = c[0], K = c[1], S = c[2];
    std::vector<uint16_t> x = random_bf16(T * S, 4.0, static_cast<uint64_t>(T * K));
    for (int64_t k = 0; k < S; ++k) x[static_cast<size_t>(k)] = 0;  // row 0 all zeros
    std::vector<uint8_t> want(static_cast<size_t>(T * K));
    std::vector<float> want_s(static_cast<size_t>(T));
    const TensorView xh = TensorView::contiguous(x.data(), DType::BF16, Device::CPU, {T, S}).columns(0, K);
    quantize_activations(TensorView::contiguous(want.data(), DType::F8_E4M3, Device::CPU, {T, K}),
                         TensorView::contiguous(want_s.data(), DType::F32, Device::CPU, {T}), xh);
    Tensor xd = upload(x, {T, S}, DType::BF16);
    Tensor q = Tensor::empty({T, K}, DType::F8_E4M3, Device::CUDA), s = Tensor::empty({T}, DType::F32, Device::CUDA);
    quantize_activations(q.view(), s.view(), xd.view().columns(0, K));
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(download<uint8_t>(q), want) << "T " << T << " K " << K << " stride " << S;
    EXPECT_EQ(download<float>(s), want_s) << "T " << T << " K " << K << " stride " << S;
  }
}

struct Problem {
  int64_t T, N, K;
  std::vector<uint8_t> xq, wq;
  std::vector<float> sx, sw;
};

Problem make(int64_t T, int64_t N, int64_t K, bool per_channel, uint64_t seed) {
  Problem p{T, N, K, std::vector<uint8_t>(static_cast<size_t>(T * K)), std::vector<uint8_t>(static_cast<size_t>(N * K)),
            std::vector<float>(static_cast<size_t>(T)), std::vector<float>(static_cast<size_t>(N))};
  std::vector<uint16_t> x = random_bf16(T * K, 1.0, seed), w = random_bf16(N * K, 0.02, seed + 1);
  quantize_activations(TensorView::contiguous(p.xq.data(), DType::F8_E4M3, Device::CPU, {T, K}),
                       TensorView::contiguous(p.sx.data(), DType::F32, Device::CPU, {T}),
                       TensorView::contiguous(x.data(), DType::BF16, Device::CPU, {T, K}));
  quantize_activations(TensorView::contiguous(p.wq.data(), DType::F8_E4M3, Device::CPU, {N, K}),
                       TensorView::contiguous(p.sw.data(), DType::F32, Device::CPU, {N}),
                       TensorView::contiguous(w.data(), DType::BF16, Device::CPU, {N, K}));
  if (!per_channel) p.sw.assign(1, p.sw[0]);  // one scale for the tensor (the codes stay as they are)
  return p;
}

// Runs `path`; returns the path that ran and the output (NaN where nothing was written).
std::pair<Fp8GemmPath, std::vector<float>> run(const Problem& p, Fp8GemmPath path, bool fast_accum) {
  CublasHandle handle;
  Tensor xq = upload(p.xq, {p.T, p.K}, DType::F8_E4M3), wq = upload(p.wq, {p.N, p.K}, DType::F8_E4M3);
  Tensor sx = upload(p.sx, {p.T}, DType::F32), sw = upload(p.sw, {static_cast<int64_t>(p.sw.size())}, DType::F32);
  Tensor y = Tensor::empty({p.T, p.N}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(y.data(), 0xff, y.view().nbytes()));  // NaN: an unwritten output fails
  const Fp8GemmContext ctx{handle.lt(), handle.workspace(), handle.workspace_bytes(), nullptr, fast_accum};
  const Fp8GemmPath ran = fp8_gemm(y.view(), xq.view(), sx.view(), wq.view(), sw.view(), path, ctx);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out;
  for (uint16_t b : download<uint16_t>(y)) out.push_back(bf16_to_f32(b));
  return {ran, out};
}

// The largest |got - want| / abs_sum seen, after checking every element against its bound.
double expect_close(const Problem& p, const std::vector<float>& got, double rel_value, double rel_abs_sum) {
  std::vector<uint8_t> xq = p.xq, wq = p.wq;
  std::vector<float> sx = p.sx, sw = p.sw;
  const Fp8GemmReference ref = fp8_gemm_reference(
      TensorView::contiguous(xq.data(), DType::F8_E4M3, Device::CPU, {p.T, p.K}),
      TensorView::contiguous(sx.data(), DType::F32, Device::CPU, {p.T}),
      TensorView::contiguous(wq.data(), DType::F8_E4M3, Device::CPU, {p.N, p.K}),
      TensorView::contiguous(sw.data(), DType::F32, Device::CPU, {static_cast<int64_t>(sw.size())}));
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref.value[i]);
    const double tol = rel_abs_sum * ref.abs_sum[i] + rel_value * std::fabs(ref.value[i]);
    if (!(err <= tol) && bad++ < 5)
      ADD_FAILURE() << "T " << p.T << " N " << p.N << " K " << p.K << " element " << i << ": got " << got[i]
                    << ", want " << ref.value[i] << " (tol " << tol << ")";
    if (ref.abs_sum[i] > 0) worst = std::max(worst, err / ref.abs_sum[i]);
  }
  EXPECT_EQ(bad, 0);
  return worst;
}

double accumulation(int64_t K) { return 2.0 * static_cast<double>(K) * std::ldexp(1.0, -24); }

// Llama-3.2-1B's projections (QKV, o, gate|up, down) at a small prefill and a decode batch past the GEMV's 16.
const int64_t kShapes[][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}};

TEST(Fp8Gemm16Gpu, EpilogueMatchesTheReference) {
  TVLLM_REQUIRE_GPU();
  for (const auto& [N, K] : kShapes)
    for (int64_t T : {17, 48}) {
      const Problem p = make(T, N, K, true, static_cast<uint64_t>(N + K + T));
      const auto [ran, got] = run(p, Fp8GemmPath::Epilogue, false);
      ASSERT_EQ(ran, Fp8GemmPath::Epilogue) << "cuBLASLt returned no FP8 algorithm for " << T << "x" << N << "x" << K;
      expect_close(p, got, 2 * std::ldexp(1.0, -8), accumulation(K));
    }
  const Problem tensor_wide = make(32, 2048, 2048, false, 9);  // one weight scale, broadcast by the epilogue
  const auto [ran, got] = run(tensor_wide, Fp8GemmPath::Epilogue, false);
  ASSERT_EQ(ran, Fp8GemmPath::Epilogue);
  expect_close(tensor_wide, got, 2 * std::ldexp(1.0, -8), accumulation(2048));
}

TEST(Fp8Gemm16Gpu, ScaleVectorsMatchTheReferenceWhereCublasLtHasThem) {
  TVLLM_REQUIRE_GPU();
  if (!fp8_scale_vectors_supported(64, 2048, 2048))
    GTEST_SKIP() << "this cuBLASLt returns no algorithm for CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F (needs "
                    "CUDA 12.9+ on sm_90): auto runs the epilogue path";
  for (const auto& [N, K] : kShapes)
    for (int64_t T : {17, 48}) {
      const Problem p = make(T, N, K, true, static_cast<uint64_t>(3 * N + K + T));
      const auto [ran, got] = run(p, Fp8GemmPath::ScaleVectors, false);
      ASSERT_EQ(ran, Fp8GemmPath::ScaleVectors) << T << "x" << N << "x" << K;
      expect_close(p, got, std::ldexp(1.0, -8), accumulation(K));
    }
  // Auto takes them, and a per-tensor weight scale (not a vector of N) goes to the epilogue.
  EXPECT_EQ(run(make(32, 2048, 2048, true, 1), Fp8GemmPath::Auto, false).first, Fp8GemmPath::ScaleVectors);
  EXPECT_EQ(run(make(32, 2048, 2048, false, 1), Fp8GemmPath::Auto, false).first, Fp8GemmPath::Epilogue);
}

TEST(Fp8Gemm16Gpu, FastAccumulationStaysWithinItsLooserBound) {
  TVLLM_REQUIRE_GPU();
  const Problem p = make(64, 2048, 2048, true, 11);
  const auto [ran, got] = run(p, Fp8GemmPath::Auto, true);
  ASSERT_NE(ran, Fp8GemmPath::Dequantize);
  const double worst = expect_close(p, got, 2 * std::ldexp(1.0, -8), std::ldexp(1.0, -10));
  const double slow = expect_close(p, run(p, ran, false).second, 2 * std::ldexp(1.0, -8), accumulation(2048));
  std::printf("fast accumulation: largest |error| / sum|terms| %.3g (without: %.3g), path %s\n", worst, slow,
              std::string(fp8_gemm_path_name(ran)).c_str());
}

TEST(Fp8Gemm16Gpu, BrokenLayoutRulesAreDeclinedAndWriteNothing) {
  TVLLM_REQUIRE_GPU();
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{336, 600}, {20, 64}}) {  // K % 16, N % 8
    const Problem p = make(32, N, K, true, 5);
    for (Fp8GemmPath path : {Fp8GemmPath::Auto, Fp8GemmPath::ScaleVectors, Fp8GemmPath::Epilogue}) {
      const auto [ran, got] = run(p, path, false);
      EXPECT_EQ(ran, Fp8GemmPath::Dequantize) << N << "x" << K;
      for (float v : got) ASSERT_TRUE(std::isnan(v)) << "a declined product wrote y";
    }
  }
}

}  // namespace
}  // namespace tvllm
