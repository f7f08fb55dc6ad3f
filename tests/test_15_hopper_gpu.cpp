// Lesson 15, GPU: every step against its CPU oracle (hopper_check.h states each tolerance), on an H100/H200.
// Skipped without a GPU, and on a GPU that is not compute capability 9.0 (sm_90a code runs nowhere else).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "hopper.h"
#include "hopper_check.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

std::string describe(const CompareResult& r) {
  std::string s = r.name + ": bad " + std::to_string(r.bad) + " of " + std::to_string(r.count) +
                  ", max_abs " + std::to_string(r.max_abs) + " " + r.error;
  for (const Mismatch& m : r.first_mismatches)
    s += "\n  [" + std::to_string(m.index) + "] got " + std::to_string(m.actual) + ", expected " +
         std::to_string(m.expected);
  return s;
}

#define EXPECT_PASSES(result)               \
  do {                                      \
    const CompareResult r_ = (result);      \
    EXPECT_GT(r_.count, 0) << r_.name;      \
    EXPECT_TRUE(r_.pass()) << describe(r_); \
  } while (0)

TEST(Hopper15Gpu, TmaTileCopyMatchesTheOracle) {
  TVLLM_REQUIRE_HOPPER();
  // Boxes inside the matrix: small, tall, wide, the largest (256 x 256).
  EXPECT_PASSES(check_tma_tile(64, 64, 0, 0, 64, 64, TmaSwizzle::None, 1));
  EXPECT_PASSES(check_tma_tile(300, 96, 40, 8, 200, 16, TmaSwizzle::None, 2));
  EXPECT_PASSES(check_tma_tile(40, 1024, 3, 512, 8, 256, TmaSwizzle::None, 3));
  EXPECT_PASSES(check_tma_tile(300, 520, 17, 8, 256, 256, TmaSwizzle::None, 4));
}

TEST(Hopper15Gpu, TmaTileOffTheEdgeIsZeroFilled) {
  TVLLM_REQUIRE_HOPPER();
  for (TmaSwizzle sw : {TmaSwizzle::None, TmaSwizzle::B128}) {
    SCOPED_TRACE(tma_swizzle_name(sw));
    EXPECT_PASSES(check_tma_tile(200, 136, 150, 96, 64, 64, sw, 10));  // past the bottom and the right
    EXPECT_PASSES(check_tma_tile(200, 136, -5, -24, 64, 64, sw, 11));  // before row 0 and column 0
    EXPECT_PASSES(check_tma_tile(37, 72, 0, 0, 128, 64, sw, 12));      // a box taller than the matrix
  }
}

// A box wider than the whole matrix (64 columns of an 8-column matrix): the columns past the edge are zeros.
TEST(Hopper15Gpu, TmaTileWiderThanTheMatrixIsZeroFilled) {
  TVLLM_REQUIRE_HOPPER();
  for (TmaSwizzle sw : {TmaSwizzle::None, TmaSwizzle::B128}) {
    SCOPED_TRACE(tma_swizzle_name(sw));
    EXPECT_PASSES(check_tma_tile(8, 8, 0, 0, 16, 64, sw, 14));
  }
}

// A box that barely overlaps the matrix: one row of 8 elements inside (its bottom-right corner), zeros elsewhere.
// (A box with none inside, or a corner off a 16-byte boundary, is refused before launch: Hopper15Args.TmaBox*.)
TEST(Hopper15Gpu, TmaTileThatBarelyOverlaps) {
  TVLLM_REQUIRE_HOPPER();
  for (TmaSwizzle sw : {TmaSwizzle::None, TmaSwizzle::B128}) {
    SCOPED_TRACE(tma_swizzle_name(sw));
    EXPECT_PASSES(check_tma_tile(64, 64, -15, -56, 16, 64, sw, 13));
  }
}

TEST(Hopper15Gpu, TmaSwizzledTileIsReadBackThroughTheFormula) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_PASSES(check_tma_tile(64, 64, 0, 0, 64, 64, TmaSwizzle::B128, 20));
  EXPECT_PASSES(check_tma_tile(512, 256, 128, 192, 256, 64, TmaSwizzle::B128, 21));
  EXPECT_PASSES(check_tma_tile(100, 64, 3, 0, 9, 64, TmaSwizzle::B128, 22));  // 9 rows: part of an atom
}

TEST(Hopper15Gpu, WgmmaTileIsExactOnSmallIntegers) {
  TVLLM_REQUIRE_HOPPER();
  for (int first = 0; first < 4; ++first) EXPECT_PASSES(check_wgmma_tile(first, 1, true, 30 + first));
  EXPECT_PASSES(check_wgmma_tile(0, 4, true, 35));
  EXPECT_PASSES(check_wgmma_tile(1, 2, true, 36));
}

TEST(Hopper15Gpu, WgmmaTileMatchesTheOracleOnEverySlice) {
  TVLLM_REQUIRE_HOPPER();
  for (int first = 0; first < 4; ++first)
    for (int steps = 1; first + steps <= 4; ++steps)
      EXPECT_PASSES(check_wgmma_tile(first, steps, false, 40 + 4 * first + steps));
}

TEST(Hopper15Gpu, ClusterBlocksReadTheirNeighboursSharedMemory) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_PASSES(check_cluster_exchange(2, 1, 0, 64, 50));  // a cluster of one reads itself
  EXPECT_PASSES(check_cluster_exchange(8, 2, 1, 1000, 51));
  EXPECT_PASSES(check_cluster_exchange(16, 4, 3, 1024, 52));
  EXPECT_PASSES(check_cluster_exchange(64, 8, -1, 333, 53));
}

TEST(Hopper15Gpu, GemmMatchesLesson06OnRaggedShapes) {
  TVLLM_REQUIRE_HOPPER();
  uint64_t seed = 60;
  for (const GemmShape& s : gemm_check_shapes()) EXPECT_PASSES(check_gemm_wgmma(s.m, s.n, s.k, seed++));
}

TEST(Hopper15Gpu, GemmAtAPrefillShape) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_PASSES(check_gemm_wgmma(1000, 3072, 2048, 70));  // a 1000-token prompt through a 1B-shaped qkv_proj
}

TEST(Hopper15Gpu, GemmIsDeterministicAndRunsOnAStream) {
  TVLLM_REQUIRE_HOPPER();
  const int64_t m = 300, n = 384, k = 1024;
  const Tensor x = Tensor::from_f32(random_uniform(m * k, 80), {m, k}, DType::BF16, Device::CUDA);
  const Tensor w =
      Tensor::from_f32(random_uniform(n * k, 81, -0.05f, 0.05f), {n, k}, DType::BF16, Device::CUDA);
  const Tensor y1 = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
  const Tensor y2 = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(y2.data(), 0xFF, y2.view().nbytes()));
  CudaStream stream;
  gemm_wgmma(y1, x, w);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  gemm_wgmma(y2, x, w, stream.get());
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  std::vector<uint16_t> a(m * n), b(m * n);
  TVLLM_CUDA_CHECK(cudaMemcpy(a.data(), y1.data(), a.size() * 2, cudaMemcpyDeviceToHost));
  TVLLM_CUDA_CHECK(cudaMemcpy(b.data(), y2.data(), b.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(a, b);  // the same bits: each output's sum runs in one fixed order
}

// ---- GEMM v2: the same contract, the same oracle and tolerance (lesson 06's kBf16OutVsCpu) ---------------

TEST(Hopper15Gpu, GemmV2MatchesLesson06OnRaggedShapes) {
  TVLLM_REQUIRE_HOPPER();
  uint64_t seed = 100;
  for (const GemmShape& s : gemm_v2_check_shapes()) {
    SCOPED_TRACE(std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k));
    EXPECT_PASSES(check_gemm_wgmma(s.m, s.n, s.k, seed++, true, 2));
  }
}

TEST(Hopper15Gpu, GemmV2AtPrefillShapes) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_PASSES(check_gemm_wgmma(1000, 3072, 2048, 110, true, 2));  // a 1000-token prompt, 1B qkv_proj
  EXPECT_PASSES(check_gemm_wgmma(513, 2048, 8192, 111, true, 2));   // down_proj's long K: 128 K steps
}

TEST(Hopper15Gpu, GemmV2IsDeterministicAndRunsOnAStream) {
  TVLLM_REQUIRE_HOPPER();
  for (const int64_t n : {384, 390}) {  // the TMA-store epilogue and the register one
    SCOPED_TRACE("N = " + std::to_string(n));
    const int64_t m = 300, k = 1024;
    const Tensor x = Tensor::from_f32(random_uniform(m * k, 120), {m, k}, DType::BF16, Device::CUDA);
    const Tensor w =
        Tensor::from_f32(random_uniform(n * k, 121, -0.05f, 0.05f), {n, k}, DType::BF16, Device::CUDA);
    const Tensor y1 = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
    const Tensor y2 = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaMemset(y2.data(), 0xFF, y2.view().nbytes()));
    CudaStream stream;
    gemm_wgmma_v2(y1, x, w);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    gemm_wgmma_v2(y2, x, w, stream.get());
    TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    std::vector<uint16_t> a(m * n), b(m * n);
    TVLLM_CUDA_CHECK(cudaMemcpy(a.data(), y1.data(), a.size() * 2, cudaMemcpyDeviceToHost));
    TVLLM_CUDA_CHECK(cudaMemcpy(b.data(), y2.data(), b.size() * 2, cudaMemcpyDeviceToHost));
    EXPECT_EQ(a, b);
  }
}

// Batch invariance, bit for bit: a row computed alone (M = 1) equals the same row computed among 300 (rows in
// the first, middle and last tile, at both consumers' edges). No split-K, one K order per output: a row's sum
// cannot depend on M. v1 holds it too (the same argument); both epilogues of v2 are covered.
TEST(Hopper15Gpu, GemmV2IsBatchInvariantBitForBit) {
  TVLLM_REQUIRE_HOPPER();
  const std::vector<int64_t> rows = {0, 1, 63, 64, 127, 128, 200, 299};
  EXPECT_EQ(gemm_batch_variant_rows(2, 300, 1000, 2048, rows, 130), 0);  // N % 8 == 0: TMA store
  EXPECT_EQ(gemm_batch_variant_rows(2, 300, 1030, 1024, rows, 131), 0);  // the register epilogue
  EXPECT_EQ(gemm_batch_variant_rows(1, 300, 1000, 2048, rows, 132), 0);
}

// ---- step 8: the gated MLP in GEMM v2's epilogue --------------------------------------------------------------

// Against the CPU oracle (kGatedMlpVsCpu) and, bit for bit, against GEMM v2 + lesson 08's silu_mul: one tile; one
// row (the second consumer has nothing to store); I = 8 (the smallest TMA row, a 128-row box mostly past I); I not a
// multiple of 128 nor 64 (a partial tile and a partial 64-column chunk: its gate box reads TMA's zeros past row I,
// never the up half); odd M with a long K; more tiles than SMs (the persistent loop wraps, stage counters too).
TEST(Hopper15Gpu, GatedMlpMatchesTheOracleAndTheUnfusedBits) {
  TVLLM_REQUIRE_HOPPER();
  uint64_t seed = 200;
  for (const GemmShape& s : std::vector<GemmShape>{
           {128, 128, 64}, {1, 256, 128}, {2, 8, 64}, {100, 200, 320}, {333, 136, 1024}, {4100, 1160, 128}}) {
    SCOPED_TRACE(std::to_string(s.m) + " x I " + std::to_string(s.n) + " x K " + std::to_string(s.k));
    EXPECT_PASSES(check_gated_mlp_wgmma(s.m, s.n, s.k, seed++));
  }
}

// The 1B model's MLP (I = 8192, K = 2048) at prefill lengths, bit for bit against GEMM v2 + silu_mul (the CPU
// oracle at 130 rows: 4.4 G double multiply-adds; at 1000 rows the bits alone).
TEST(Hopper15Gpu, GatedMlpAtThe1BShape) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_PASSES(check_gated_mlp_wgmma(130, 8192, 2048, 210));
  EXPECT_PASSES(check_gated_mlp_wgmma(1000, 8192, 2048, 211, false));
}

// A row computed alone equals the same row among 300, in every bit (rows at both consumers' edges and in the last,
// partial tile): each act element is one fixed-order sum, as in GEMM v2.
TEST(Hopper15Gpu, GatedMlpIsBatchInvariantBitForBit) {
  TVLLM_REQUIRE_HOPPER();
  EXPECT_EQ(gated_mlp_batch_variant_rows(300, 392, 512, {0, 1, 63, 64, 127, 128, 200, 299}, 220), 0);
}

TEST(Hopper15Gpu, GatedMlpRefusesOnTheGpuToo) {
  TVLLM_REQUIRE_HOPPER();
  const Tensor x = Tensor::empty({4, 64}, DType::BF16, Device::CUDA);
  const Tensor w = Tensor::empty({24, 64}, DType::BF16, Device::CUDA);
  const Tensor act = Tensor::empty({4, 12}, DType::BF16, Device::CUDA);
  EXPECT_THROW(gated_mlp_wgmma(act, x, w), InputError);  // I = 12: not a multiple of 8
}

TEST(Hopper15Gpu, GemmV2RefusesBadKOnTheGpuToo) {
  TVLLM_REQUIRE_HOPPER();
  const Tensor x = Tensor::empty({4, 96}, DType::BF16, Device::CUDA);
  const Tensor w = Tensor::empty({8, 96}, DType::BF16, Device::CUDA);
  const Tensor y = Tensor::empty({4, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(gemm_wgmma_v2(y, x, w), InputError);
}

TEST(Hopper15Gpu, GemmRefusesBadKOnTheGpuToo) {
  TVLLM_REQUIRE_HOPPER();
  const Tensor x = Tensor::empty({4, 96}, DType::BF16, Device::CUDA);
  const Tensor w = Tensor::empty({8, 96}, DType::BF16, Device::CUDA);
  const Tensor y = Tensor::empty({4, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(gemm_wgmma(y, x, w), InputError);
}

}  // namespace
}  // namespace tvllm
