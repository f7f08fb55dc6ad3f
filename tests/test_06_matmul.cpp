// Lesson 06, CPU: the fp32 reference linear layer y = x W^T, argument validation, and the row-scaled
// comparison the lesson checks with.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "common/random.h"
#include "matmul.h"
#include "matmul_check.h"

namespace tvllm {
namespace {

Tensor host_f32(const std::vector<float>& values, Shape shape) {
  return Tensor::from_f32(values, std::move(shape), DType::F32, Device::CPU);
}

// y = x W^T with a plain double loop, the obvious way: the test's own oracle.
std::vector<float> linear_by_definition(const std::vector<float>& x, const std::vector<float>& w, int64_t tokens,
                                        int64_t in, int64_t out) {
  std::vector<float> y(static_cast<size_t>(tokens * out));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(x[t * in + i]) * w[o * in + i];
      y[t * out + o] = static_cast<float>(acc);
    }
  return y;
}

std::vector<float> run_cpu(const std::vector<float>& x, const std::vector<float>& w, int64_t tokens, int64_t in,
                           int64_t out, DType w_dtype = DType::F32) {
  Tensor xt = host_f32(x, {tokens, in});
  Tensor wt = Tensor::from_f32(w, {out, in}, w_dtype, Device::CPU);
  Tensor y = Tensor::empty({tokens, out}, DType::F32, Device::CPU);
  linear(y, xt, wt);
  return to_f32_vector(y);
}

// ---- known answers --------------------------------------------------------------------------------

TEST(Matmul06Cpu, KnownProductByHand) {
  // x = [[1, 2, 3],      W = [[1, 0, -1],     y = x W^T = [[1*1 + 2*0 + 3*-1, 1*2 + 2*1 + 3*0],
  //      [4, 5, 6]]           [2, 1,  0]]                  [4*1 + 5*0 + 6*-1, 4*2 + 5*1 + 6*0]]
  //                                                      = [[-2, 4], [-2, 13]]
  const std::vector<float> x = {1, 2, 3, 4, 5, 6}, w = {1, 0, -1, 2, 1, 0};
  const std::vector<float> expected = {-2, 4, -2, 13};
  // The weight's storage dtype must not matter for values it holds exactly.
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    EXPECT_EQ(run_cpu(x, w, 2, 3, 2, dtype), expected);
  }
}

TEST(Matmul06Cpu, WIsUsedAsStoredNotTransposed) {
  // A non-square W tells y = x W^T from y = x W: W [3 out, 2 in], x [1, 2] = [1, 10]:
  // y[o] = W[o][0] + 10 W[o][1] = [1 + 20, 3 + 40, 5 + 60].
  EXPECT_EQ(run_cpu({1, 10}, {1, 2, 3, 4, 5, 6}, 1, 2, 3), (std::vector<float>{21, 43, 65}));
}

TEST(Matmul06Cpu, IdentityWeightReturnsTheInput) {
  const int64_t tokens = 5, n = 7;
  const std::vector<float> x = random_uniform(tokens * n, 3);
  std::vector<float> eye(n * n, 0.f);
  for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1.f;
  EXPECT_EQ(run_cpu(x, eye, tokens, n, n), x);
}

TEST(Matmul06Cpu, OneHotInputSelectsAColumnOfW) {
  // x = e_j picks column j of W: y[o] = W[o][j], exactly.
  const int64_t in = 9, out = 11, j = 4;
  const std::vector<float> w = random_normal(in * out, 5);
  std::vector<float> x(in, 0.f);
  x[j] = 1.f;
  const std::vector<float> y = run_cpu(x, w, 1, in, out, DType::F32);
  for (int64_t o = 0; o < out; ++o) EXPECT_EQ(y[o], w[o * in + j]) << "o = " << o;
}

// ---- the reference against the definition, on awkward shapes -----------------------------------------

TEST(Matmul06Cpu, MatchesTheDefinitionOnOddShapes) {
  // Block edges (T and out not multiples of 4), size 1, and a product large enough to use threads.
  struct Case { int64_t tokens, in, out; };
  for (Case c : {Case{1, 1, 1}, Case{1, 7, 1}, Case{3, 7, 64}, Case{17, 600, 37}, Case{5, 1000, 9},
                 Case{64, 512, 1000}, Case{6, 2048, 5}}) {
    SCOPED_TRACE("T=" + std::to_string(c.tokens) + " in=" + std::to_string(c.in) + " out=" + std::to_string(c.out));
    const std::vector<float> x = random_uniform(c.tokens * c.in, 10 + c.in);
    const std::vector<float> w = random_normal(c.out * c.in, 20 + c.out, 0.1f);
    const std::vector<float> got = run_cpu(x, w, c.tokens, c.in, c.out);
    const std::vector<float> want = linear_by_definition(x, w, c.tokens, c.in, c.out);
    // Both are one rounding of a double sum to fp32: equal to 1 fp32 ulp.
    CompareResult r = compare("y", got, want, Tolerance{1e-30, 1.0 / (1 << 23)});
    EXPECT_TRUE(r.pass()) << "bad " << r.bad << ", max_abs " << r.max_abs;
  }
}

TEST(Matmul06Cpu, Bf16WeightsAreWidenedExactly) {
  // W given as bf16 must give exactly what the same (bf16-representable) values give as fp32.
  const int64_t tokens = 6, in = 33, out = 10;
  std::vector<float> w = random_normal(in * out, 8);
  for (float& v : w) v = bf16_to_f32(f32_to_bf16(v));  // make every value bf16-exact
  const std::vector<float> x = random_uniform(tokens * in, 9);
  EXPECT_EQ(run_cpu(x, w, tokens, in, out, DType::BF16), run_cpu(x, w, tokens, in, out, DType::F32));
}

TEST(Matmul06Cpu, RowsDoNotDependOnTheBatch) {
  // Each output is the same sequence of operations whatever rows are computed with it: computing 13
  // rows at once, or in pieces, gives bit-identical results. (Lesson 11 relies on this idea: a request
  // must get the same answer alone or batched with others.)
  const int64_t tokens = 13, in = 300, out = 23;
  const std::vector<float> x = random_uniform(tokens * in, 31);
  const std::vector<float> w = random_normal(in * out, 32, 0.05f);
  const std::vector<float> all = run_cpu(x, w, tokens, in, out);
  for (int64_t split : {int64_t{1}, int64_t{5}}) {
    std::vector<float> pieces;
    for (int64_t t0 = 0; t0 < tokens; t0 += split) {
      const int64_t n = std::min(split, tokens - t0);
      std::vector<float> xs(x.begin() + t0 * in, x.begin() + (t0 + n) * in);
      std::vector<float> ys = run_cpu(xs, w, n, in, out);
      pieces.insert(pieces.end(), ys.begin(), ys.end());
    }
    EXPECT_EQ(pieces, all) << "rows computed " << split << " at a time";
  }
}

TEST(Matmul06Cpu, ZeroTokensIsANoOp) {
  Tensor x = Tensor::empty({0, 4}, DType::F32, Device::CPU);
  Tensor w = host_f32({1, 2, 3, 4}, {1, 4});
  Tensor y = Tensor::empty({0, 1}, DType::F32, Device::CPU);
  EXPECT_NO_THROW(linear(y, x, w));
}

// ---- validation --------------------------------------------------------------------------------------

// A view that claims to live on the GPU. linear() must reject bad arguments before touching memory,
// so these fake addresses are never dereferenced.
TensorView fake_cuda(DType dtype, Shape shape, uintptr_t address) {
  return TensorView::contiguous(reinterpret_cast<void*>(address), dtype, Device::CUDA, std::move(shape));
}

TEST(Matmul06Cpu, RejectsMismatchedShapes) {
  Tensor x = Tensor::empty({2, 3}, DType::F32, Device::CPU);
  Tensor w = Tensor::empty({4, 5}, DType::F32, Device::CPU);
  Tensor w_ok = Tensor::empty({4, 3}, DType::F32, Device::CPU);
  Tensor y = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  Tensor y_bad = Tensor::empty({2, 5}, DType::F32, Device::CPU);
  Tensor x_rank1 = Tensor::empty({3}, DType::F32, Device::CPU);
  Tensor x_rank3 = Tensor::empty({1, 2, 3}, DType::F32, Device::CPU);
  EXPECT_THROW(linear(y, x, w), InputError);         // in: 3 vs 5
  EXPECT_THROW(linear(y_bad, x, w_ok), InputError);  // y must be [2, 4]
  EXPECT_THROW(linear(y, x_rank1, w_ok), InputError);
  EXPECT_THROW(linear(y, x_rank3, w_ok), InputError);
  EXPECT_NO_THROW(linear(y, x, w_ok));
  try {
    linear(y, x, w);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("input features"), std::string::npos) << e.what();
  }
}

TEST(Matmul06Cpu, RejectsZeroFeatures) {
  Tensor x = Tensor::empty({2, 0}, DType::F32, Device::CPU);
  Tensor w = Tensor::empty({4, 0}, DType::F32, Device::CPU);
  Tensor y = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  EXPECT_THROW(linear(y, x, w), InputError);
}

TEST(Matmul06Cpu, RejectsWrongDtypesOnTheCpu) {
  Tensor x = Tensor::empty({2, 3}, DType::F32, Device::CPU);
  Tensor x_bf16 = Tensor::empty({2, 3}, DType::BF16, Device::CPU);
  Tensor w = Tensor::empty({4, 3}, DType::BF16, Device::CPU);
  Tensor w_int = Tensor::empty({4, 3}, DType::I32, Device::CPU);
  Tensor y = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  Tensor y_bf16 = Tensor::empty({2, 4}, DType::BF16, Device::CPU);
  EXPECT_THROW(linear(y, x_bf16, w), InputError);  // the CPU path is the fp32 reference
  EXPECT_THROW(linear(y_bf16, x, w), InputError);
  EXPECT_THROW(linear(y, x, w_int), InputError);
}

TEST(Matmul06Cpu, RejectsMixedDevicesAndBadLayouts) {
  Tensor x = Tensor::empty({2, 3}, DType::F32, Device::CPU);
  Tensor w = Tensor::empty({4, 3}, DType::F32, Device::CPU);
  Tensor y = Tensor::empty({2, 4}, DType::F32, Device::CPU);
  EXPECT_THROW(linear(y, x, fake_cuda(DType::F32, {4, 3}, 0x10000)), InputError);
  EXPECT_THROW(linear(fake_cuda(DType::F32, {2, 4}, 0x10000), x, w), InputError);

  // A transposed (non-contiguous) view of a [3, 2] buffer as [2, 3].
  Tensor buf = Tensor::empty({3, 2}, DType::F32, Device::CPU);
  TensorView x_t = buf.view();
  x_t.shape = {2, 3};
  x_t.strides = {1, 2};
  EXPECT_THROW(linear(y, x_t, w), InputError);

  // In place (y over x's memory) would overwrite inputs still being read.
  Tensor square = Tensor::empty({2, 2}, DType::F32, Device::CPU);
  Tensor w2 = Tensor::empty({2, 2}, DType::F32, Device::CPU);
  EXPECT_THROW(linear(square, square, w2), InputError);
}

TEST(Matmul06Cpu, RejectsWrongCudaArgumentsBeforeLaunching) {
  const TensorView x = fake_cuda(DType::BF16, {2, 8}, 0x10000);
  const TensorView w = fake_cuda(DType::BF16, {4, 8}, 0x20000);
  const TensorView y = fake_cuda(DType::BF16, {2, 4}, 0x30000);
  // cuBLAS versions need a handle; v1 to v4 do not (not launched here: there may be no GPU).
  EXPECT_THROW(linear(y, x, w, MatmulKernel::V5Cublas, nullptr), InputError);
  EXPECT_THROW(linear(y, x, w, MatmulKernel::V6CublasLt, nullptr), InputError);
  EXPECT_THROW(linear(y, x, w, MatmulKernel::V7BatchInvariant, nullptr), InputError);  // its workspace
  EXPECT_THROW(linear(y, x, w, MatmulKernel::V8PinnedLt, nullptr), InputError);
  for (MatmulKernel k : all_matmul_kernels()) {
    EXPECT_EQ(matmul_kernel_needs_handle(k), k == MatmulKernel::V5Cublas || k == MatmulKernel::V6CublasLt ||
                                                 k == MatmulKernel::V7BatchInvariant || k == MatmulKernel::V8PinnedLt);
    EXPECT_EQ(matmul_kernel_is_batch_invariant(k), k == MatmulKernel::V4MmaSync ||
                                                       k == MatmulKernel::V7BatchInvariant || k == MatmulKernel::V8PinnedLt);
  }
  // The GPU path is bf16 in: fp32 x or w is an error, as is an fp16 y.
  EXPECT_THROW(linear(y, fake_cuda(DType::F32, {2, 8}, 0x10000), w, MatmulKernel::V2Tiled), InputError);
  EXPECT_THROW(linear(y, x, fake_cuda(DType::F16, {4, 8}, 0x20000), MatmulKernel::V2Tiled), InputError);
  EXPECT_THROW(linear(fake_cuda(DType::F16, {2, 4}, 0x30000), x, w, MatmulKernel::V2Tiled), InputError);
  // Overlap is checked on the device too.
  EXPECT_THROW(linear(fake_cuda(DType::BF16, {2, 4}, 0x10004), x, w, MatmulKernel::V1Naive), InputError);
}

// v7's split of K depends on W's shape only (its whole point), covers K exactly, in pieces that are whole
// 32-column slices of v4 (the last may be shorter), enough of them for ~264 blocks when out is small.
TEST(Matmul06Cpu, BatchInvariantSplitCoversKFromTheShapeAlone) {
  struct Case { int64_t in, out; int splits; int64_t split_len; };
  const Case cases[] = {
      {2048, 2048, 8, 256},     // Llama 3.2 1B o_proj: 16 tiles of 128 outputs; 2048 / 256 caps it at 8
      {8192, 2048, 16, 512},    // down_proj: 17 wanted, at most 16
      {2048, 3072, 8, 256},     // the fused q|k|v
      {2048, 16384, 3, 704},    // gate|up: 128 tiles already, 3 pieces for 264 blocks
      {2048, 128256, 1, 2048},  // lm_head: plenty of tiles, one piece (v4 exactly)
      {100, 64, 1, 128},        // shorter than a piece: one piece, rounded up to whole slices
      {1000, 64, 3, 352},       // 3 pieces of 11 slices: 352 + 352 + 296 = 1000
  };
  for (const Case& c : cases) {
    const SplitK s = batch_invariant_split(c.in, c.out);
    EXPECT_EQ(s.splits, c.splits) << c.in << " x " << c.out;
    EXPECT_EQ(s.split_len, c.split_len) << c.in << " x " << c.out;
    EXPECT_EQ(s.split_len % 32, 0);
    EXPECT_GE(s.split_len * s.splits, c.in);
    EXPECT_LT(s.split_len * (s.splits - 1), c.in);  // no empty piece
  }
  EXPECT_THROW(batch_invariant_split(0, 8), InputError);
}

TEST(Matmul06Cpu, KernelNamesRoundTrip) {
  ASSERT_EQ(all_matmul_kernels().size(), 8u);
  for (MatmulKernel k : all_matmul_kernels()) EXPECT_EQ(parse_matmul_kernel(matmul_kernel_version(k)), k);
  // The order of the chapter: v1 naive, v2 tiled, v3 WMMA, v4 mma.sync, v5 cuBLAS, v6 cuBLASLt, v7, v8.
  EXPECT_EQ(parse_matmul_kernel("v3"), MatmulKernel::V3Wmma);
  EXPECT_EQ(parse_matmul_kernel("v4"), MatmulKernel::V4MmaSync);
  EXPECT_EQ(parse_matmul_kernel("v5"), MatmulKernel::V5Cublas);
  EXPECT_EQ(parse_matmul_kernel("v6"), MatmulKernel::V6CublasLt);
  EXPECT_EQ(matmul_kernel_description(MatmulKernel::V4MmaSync), "mma.sync");
  EXPECT_EQ(kDefaultMatmulKernel, MatmulKernel::V5Cublas);
  EXPECT_EQ(parse_matmul_kernel("v7"), MatmulKernel::V7BatchInvariant);
  EXPECT_EQ(parse_matmul_kernel("v8"), MatmulKernel::V8PinnedLt);
  EXPECT_EQ(matmul_kernel_description(MatmulKernel::V8PinnedLt), "batch-invariant cuBLASLt");
  EXPECT_EQ(kBatchInvariantMatmulKernel, MatmulKernel::V8PinnedLt);  // what lesson 11's batch_invariant runs
  EXPECT_THROW(parse_matmul_kernel("v9"), InputError);
  EXPECT_THROW(parse_matmul_kernel("v0"), InputError);
  EXPECT_THROW(parse_matmul_kernel(""), InputError);
}

// ---- the row-scaled comparison ------------------------------------------------------------------------

TEST(Matmul06Cpu, RowScaledToleranceFollowsEachRowsSize) {
  // Row 0 has RMS 1, row 1 has RMS 1000. With atol = 2^-6 row RMS and rtol 0, an error of 0.01 passes in
  // row 0 (0.01 <= 0.0156), 0.02 fails there, and 10 passes in row 1 (<= 15.6) but 20 fails.
  const LinearTolerance tol{1.0 / 64, 0.0};
  Tensor ref = host_f32({1, -1, 1, -1, 1000, -1000, 1000, -1000}, {2, 4});
  auto with_errors = [&](float e0, float e1) {
    return host_f32({1 + e0, -1, 1, -1, 1000, -1000 + e1, 1000, -1000}, {2, 4});
  };
  EXPECT_TRUE(compare_rows("ok", with_errors(0.01f, 10.f), ref, tol).pass());
  const CompareResult small_row = compare_rows("row 0", with_errors(0.02f, 0.f), ref, tol);
  EXPECT_EQ(small_row.bad, 1);
  ASSERT_EQ(small_row.first_mismatches.size(), 1u);
  EXPECT_EQ(small_row.first_mismatches[0].index, 0);
  const CompareResult big_row = compare_rows("row 1", with_errors(0.f, 20.f), ref, tol);
  EXPECT_EQ(big_row.bad, 1);
  EXPECT_EQ(big_row.first_mismatches[0].index, 5);
  EXPECT_DOUBLE_EQ(big_row.tol.atol, 1000.0 / 64);  // the largest atol applied is reported
}

TEST(Matmul06Cpu, RowScaledComparisonAccumulatesAndCatchesNaN) {
  RowScaledComparison c("two tensors", kBf16VsReference);
  Tensor ref = host_f32({3, 4}, {1, 2});
  c.add(host_f32({3, 4}, {1, 2}), ref);
  EXPECT_TRUE(c.result().pass());
  c.add(host_f32({3, NAN}, {1, 2}), ref);  // an unwritten (poisoned) element
  EXPECT_FALSE(c.result().pass());
  EXPECT_EQ(c.result().count, 4);
  EXPECT_EQ(c.result().bad, 1);
  EXPECT_EQ(c.result().first_mismatches[0].index, 3);  // index across both additions
  RowScaledComparison shapes("shape", kBf16VsReference);
  shapes.add(host_f32({1, 2}, {2, 1}), ref);
  EXPECT_FALSE(shapes.result().pass());
  EXPECT_FALSE(shapes.result().error.empty());
}

TEST(Matmul06Cpu, Bf16ToleranceAcceptsInputRoundingAndRejectsADroppedTerm) {
  // The bf16 tolerance must accept exactly the error it was derived for (x rounded to bf16, output
  // rounded to bf16) and reject a real bug (one of the K terms missing), on a realistic shape.
  const int64_t tokens = 8, in = 320, out = 384;
  const std::vector<float> x = random_normal(tokens * in, 41);
  std::vector<float> w = random_normal(in * out, 42, 1.0f / std::sqrt(static_cast<float>(in)));
  for (float& v : w) v = bf16_to_f32(f32_to_bf16(v));
  const std::vector<float> reference = linear_by_definition(x, w, tokens, in, out);

  std::vector<float> x_bf16 = x;
  for (float& v : x_bf16) v = bf16_to_f32(f32_to_bf16(v));
  std::vector<float> simulated = linear_by_definition(x_bf16, w, tokens, in, out);
  for (float& v : simulated) v = bf16_to_f32(f32_to_bf16(v));
  const CompareResult good =
      compare_rows("bf16", host_f32(simulated, {tokens, out}), host_f32(reference, {tokens, out}), kBf16VsReference);
  EXPECT_TRUE(good.pass()) << "bad " << good.bad;
  EXPECT_GT(good.rel_l2, 5e-4);  // the error is there ...
  EXPECT_LT(good.rel_l2, 4e-3);  // ... and about 0.6 * 2^-8 = 2.3e-3, as the README derives

  std::vector<float> x_dropped = x_bf16;
  for (int64_t t = 0; t < tokens; ++t) x_dropped[t * in + in - 1] = 0.f;  // forget the last term
  std::vector<float> buggy = linear_by_definition(x_dropped, w, tokens, in, out);
  const CompareResult bad =
      compare_rows("bug", host_f32(buggy, {tokens, out}), host_f32(reference, {tokens, out}), kBf16VsReference);
  EXPECT_FALSE(bad.pass());
}

// The large-GEMM seam (matmul.h): installing and removing it, a bad threshold, and CPU views never reaching it.
int g_large_gemm_calls = 0;
bool counting_large_gemm(const TensorView&, const TensorView&, const TensorView&, cudaStream_t) {
  ++g_large_gemm_calls;
  return true;
}

TEST(Matmul06Cpu, TheLargeGemmSeamIsForGpuStepsOnly) {
  EXPECT_EQ(installed_large_gemm(), nullptr);
  EXPECT_THROW(install_large_gemm(counting_large_gemm, 0), InputError);
  EXPECT_EQ(installed_large_gemm(), nullptr);
  install_large_gemm(counting_large_gemm, 1);
  EXPECT_EQ(installed_large_gemm(), &counting_large_gemm);
  EXPECT_EQ(installed_large_gemm_min_tokens(), 1);
  Tensor x = Tensor::from_f32({1.f, 2.f, 3.f, 4.f}, {2, 2}, DType::F32, Device::CPU);
  Tensor w = Tensor::from_f32({1.f, 0.f, 0.f, 1.f}, {2, 2}, DType::F32, Device::CPU);
  Tensor y = Tensor::empty({2, 2}, DType::F32, Device::CPU);
  linear(y, x, w);  // the CPU reference: the seam is for the GPU's default kernel only
  EXPECT_EQ(g_large_gemm_calls, 0);
  const std::vector<float> got = to_f32_vector(y);
  EXPECT_EQ(got, (std::vector<float>{1.f, 2.f, 3.f, 4.f}));
  install_large_gemm(nullptr, 1);
  EXPECT_EQ(installed_large_gemm(), nullptr);
}

}  // namespace
}  // namespace tvllm
