// Lesson 15, CPU: the layouts Hopper's tensor cores read (the 128-byte swizzle, the wgmma descriptor, the
// accumulator fragment), the CPU oracles of every step, and the host code's refusals: bad shapes (InputError
// naming the rule) and a machine that cannot run sm_90a code (InputError saying why). No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/tensor.h"
#include "common/validate.h"
#include "hopper.h"
#include "hopper_check.h"
#include "hopper_layout.h"
#include "tensor_map.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::fake_cuda;
using testing::input_error_of;

TEST(Hopper15Layout, SwizzleXorsTheChunkWithTheRowModEight) {
  // Row 0 is unchanged; row r's 16-byte chunk j moves to chunk j ^ (r % 8); rows stay where they are.
  for (uint32_t col = 0; col < 64; ++col) EXPECT_EQ(swizzled_offset_bf16(0, col), col * 2);
  EXPECT_EQ(swizzled_offset_bf16(1, 0), 128u + 16u);
  EXPECT_EQ(swizzled_offset_bf16(1, 8), 128u + 0u);
  EXPECT_EQ(swizzled_offset_bf16(3, 13), 3u * 128 + ((1u ^ 3u) * 16) + 10);  // col 13: chunk 1, byte 10 in it
  EXPECT_EQ(swizzled_offset_bf16(8, 8), 8u * 128 + 16);  // row 8 is row 0 of the next atom
  EXPECT_EQ(swizzled_offset_bf16(15, 0), 15u * 128 + 7 * 16);
  // A permutation of every 1024-byte atom, its own inverse.
  std::set<uint32_t> seen;
  for (uint32_t b = 0; b < 2048; b += 2) {
    seen.insert(swizzle128(b));
    EXPECT_EQ(swizzle128(swizzle128(b)), b);
    EXPECT_EQ(swizzle128(b) / 128, b / 128);
  }
  EXPECT_EQ(seen.size(), 1024u);
}

TEST(Hopper15Layout, DescriptorFieldsSitOnTheirBits) {
  const uint64_t d = encode_smem_descriptor(0x2C400, 256, 1024, DescriptorSwizzle::B128);
  EXPECT_EQ(d & 0x3FFF, 0x2C40u);      // bits 0-13: address >> 4
  EXPECT_EQ((d >> 16) & 0x3FFF, 16u);  // bits 16-29: LBO >> 4
  EXPECT_EQ((d >> 32) & 0x3FFF, 64u);  // bits 32-45: SBO >> 4
  EXPECT_EQ((d >> 49) & 7, 0u);        // bits 49-51: base offset 0
  EXPECT_EQ(d >> 62, 1u);              // bits 62-63: 1 = 128-byte swizzle
  EXPECT_EQ(encode_smem_descriptor(0, 0, 0, DescriptorSwizzle::B32) >> 62, 3u);
  EXPECT_EQ(encode_smem_descriptor(0, 0, 0, DescriptorSwizzle::None), 0u);
  // The swizzled K-major descriptor: LBO 1 (unused), SBO 1024 bytes, K steps of 32 bytes.
  const uint64_t s = sw128_kmajor_descriptor(0x8000);
  EXPECT_EQ(s, (uint64_t{1} << 62) | (uint64_t{64} << 32) | (uint64_t{1} << 16) | 0x800u);
  EXPECT_EQ(sw128_kmajor_descriptor(0x8000, 3), s + 6);
}

TEST(Hopper15Layout, AccumulatorFragmentIsMmaSyncsLayoutRepeated) {
  // Thread 0: rows 0 and 8, columns 0, 1 of every 8-column slice.
  EXPECT_EQ(accumulator_position(0, 0).row, 0u);
  EXPECT_EQ(accumulator_position(0, 1).col, 1u);
  EXPECT_EQ(accumulator_position(0, 2).row, 8u);
  EXPECT_EQ(accumulator_position(0, 4).col, 8u);
  // Thread 37 = warp 1, lane 5: rows 16 + 1 and 16 + 9, columns 2 and 3 of each slice.
  EXPECT_EQ(accumulator_position(37, 0).row, 17u);
  EXPECT_EQ(accumulator_position(37, 0).col, 2u);
  EXPECT_EQ(accumulator_position(37, 63).row, 25u);
  EXPECT_EQ(accumulator_position(37, 63).col, 8u * 15 + 3);
  std::vector<int> hits(64 * 128, 0);
  for (uint32_t t = 0; t < 128; ++t)
    for (uint32_t i = 0; i < 64; ++i)
      ++hits[accumulator_position(t, i).row * 128 + accumulator_position(t, i).col];
  for (int h : hits) ASSERT_EQ(h, 1);
}

TEST(Hopper15Oracle, EveryOracleCheckOfTheLessonPasses) {
  Report report("oracles");
  add_oracle_checks(report);
  EXPECT_GE(report.size(), 6u);
  EXPECT_TRUE(report.all_pass());
  if (!report.all_pass()) report.print(std::cout);
}

TEST(Hopper15Oracle, TileCopyZeroFillsEveryOutOfBoundsSide) {
  std::vector<float> src(3 * 4);
  for (int i = 0; i < 12; ++i) src[i] = static_cast<float>(10 + i);
  const Tensor s = Tensor::from_f32(src, {3, 4}, DType::F32, Device::CPU);
  const Tensor d = Tensor::empty({5, 6}, DType::F32, Device::CPU);
  tma_tile_copy_cpu(d, s, -1, -1);  // one row above, one column left, and past the bottom and the right
  const std::vector<float> got = to_f32_vector(d);
  const std::vector<float> want = {0, 0,  0,  0,  0,  0,  //
                                   0, 10, 11, 12, 13, 0,  //
                                   0, 14, 15, 16, 17, 0,  //
                                   0, 18, 19, 20, 21, 0,  //
                                   0, 0,  0,  0,  0,  0};
  EXPECT_EQ(got, want);
}

TEST(Hopper15Oracle, TileProductSumsOnlyTheChosenSlices) {
  // a = 1 everywhere, b[n][k] = k: slice s alone gives sum_{k=16s}^{16s+15} k = 256 s + 120 in every element.
  std::vector<float> a(kTileM * kTileK, 1.0f), b(kTileN * kTileK);
  for (int n = 0; n < kTileN; ++n)
    for (int k = 0; k < kTileK; ++k) b[n * kTileK + k] = static_cast<float>(k);
  const Tensor ta = Tensor::from_f32(a, {kTileM, kTileK}, DType::F32, Device::CPU);
  const Tensor tb = Tensor::from_f32(b, {kTileN, kTileK}, DType::F32, Device::CPU);
  const Tensor d = Tensor::empty({kTileM, kTileN}, DType::F32, Device::CPU);
  for (int s = 0; s < 4; ++s) {
    wgmma_tile_cpu(d, ta, tb, s, 1);
    EXPECT_EQ(to_f32_vector(d)[5 * kTileN + 77], 256.0f * s + 120.0f);
  }
  wgmma_tile_cpu(d, ta, tb, 1, 3);
  EXPECT_EQ(to_f32_vector(d)[0], 63.0f * 64 / 2 - 120.0f);
  EXPECT_NE(input_error_of([&] { wgmma_tile_cpu(d, ta, tb, 2, 3); }).find("[0, 4)"), std::string::npos);
}

TEST(Hopper15Oracle, ClusterExchangeWrapsAroundInsideEachCluster) {
  std::vector<float> v(6 * 2);
  for (int i = 0; i < 12; ++i) v[i] = static_cast<float>(i);
  const Tensor in = Tensor::from_f32(v, {6, 2}, DType::F32, Device::CPU);
  const Tensor out = Tensor::empty({6, 2}, DType::F32, Device::CPU);
  cluster_exchange_cpu(out, in, 6, 3, -1);  // clusters {0,1,2} {3,4,5}: block b reads rank r - 1
  const std::vector<float> want = {4, 5, 0, 1, 2, 3, 10, 11, 6, 7, 8, 9};
  EXPECT_EQ(to_f32_vector(out), want);
}

// TMA's rules for a box corner, learnt on the H200: the first column on a 16-byte boundary (corners at columns -63
// and 500 faulted with cudaErrorIllegalInstruction), and (our own rule) some overlap with the matrix.
TEST(Hopper15Args, TmaBoxCornerOffA16ByteBoundaryIsRefused) {
  for (const int64_t col0 : {int64_t{-63}, int64_t{-1}, int64_t{3}, int64_t{500}}) {
    const std::string e = input_error_of([&] {
      tma_tile_copy(fake_cuda(DType::BF16, {16, 64}), fake_cuda(DType::BF16, {64, 64}), 0, col0, TmaSwizzle::None);
    });
    EXPECT_NE(e.find("multiple of 8"), std::string::npos) << col0 << ": " << e;
  }
}

TEST(Hopper15Args, TmaBoxThatMissesTheMatrixIsRefused) {
  for (const auto& [row0, col0] :
       std::vector<std::pair<int64_t, int64_t>>{{504, 504}, {64, 0}, {0, 64}, {-16, 0}, {0, -64}}) {
    const std::string e = input_error_of([&] {
      tma_tile_copy(fake_cuda(DType::BF16, {16, 64}), fake_cuda(DType::BF16, {64, 64}), row0, col0,
                    TmaSwizzle::None);
    });
    EXPECT_NE(e.find("must overlap the matrix"), std::string::npos) << row0 << ", " << col0 << ": " << e;
  }
}

TEST(Hopper15Args, GemmRefusesAKThatIsNotAMultipleOf64) {
  const std::string e = input_error_of([] {
    gemm_wgmma(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 100}),
               fake_cuda(DType::BF16, {16, 100}));
  });
  EXPECT_NE(e.find("multiple of 64"), std::string::npos) << e;
}

TEST(Hopper15Args, GemmV2RefusesWhatV1Refuses) {
  EXPECT_NE(input_error_of([] {
              gemm_wgmma_v2(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 100}),
                            fake_cuda(DType::BF16, {16, 100}));
            }).find("multiple of 64"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              gemm_wgmma_v2(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 128}),
                            fake_cuda(DType::BF16, {16, 64}));
            }).find("same K"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              run_gemm_wgmma(3, fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 64}),
                             fake_cuda(DType::BF16, {16, 64}));
            }).find("version must be 1 or 2"),
            std::string::npos);
}

TEST(Hopper15Args, GroupedTileOrderVisitsEveryTileOnce) {
  for (const auto& [tm, tn, g] : std::vector<std::array<uint32_t, 3>>{
           {1, 1, 8}, {5, 3, 2}, {32, 32, 8}, {33, 9, 8}, {9, 33, 8}, {1, 64, 8}, {64, 1, 8}, {8, 8, 8}}) {
    std::vector<int> hits(tm * tn, 0);
    for (uint32_t tile = 0; tile < tm * tn; ++tile) {
      const GemmTile at = grouped_tile(tile, tm, tn, g);
      ASSERT_LT(at.m, tm);
      ASSERT_LT(at.n, tn);
      ++hits[at.m * tn + at.n];
    }
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), static_cast<int64_t>(tm * tn))
        << tm << " x " << tn << " in bands of " << g;
  }
  // Inside a band the row runs fastest: consecutive tiles (as consecutive blocks take them) share a W panel.
  EXPECT_EQ(grouped_tile(0, 32, 32, 8).n, 0u);
  EXPECT_EQ(grouped_tile(7, 32, 32, 8).m, 7u);
  EXPECT_EQ(grouped_tile(7, 32, 32, 8).n, 0u);
  EXPECT_EQ(grouped_tile(8, 32, 32, 8).m, 0u);
  EXPECT_EQ(grouped_tile(8, 32, 32, 8).n, 1u);
  EXPECT_EQ(grouped_tile(256, 32, 32, 8).m, 8u);  // the second band starts at tile row 8
  EXPECT_EQ(grouped_tile(256, 32, 32, 8).n, 0u);
  // The last band of 33 rows in bands of 8 is one row high: its tiles walk along that row.
  EXPECT_EQ(grouped_tile(32 * 9, 33, 9, 8).m, 32u);
  EXPECT_EQ(grouped_tile(32 * 9 + 5, 33, 9, 8).n, 5u);
}

TEST(Hopper15Args, GemmRefusesMismatchedShapesAndDtypes) {
  EXPECT_NE(input_error_of([] {
              check_gemm_wgmma_args(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 128}),
                                    fake_cuda(DType::BF16, {16, 64}));
            }).find("same K"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              check_gemm_wgmma_args(fake_cuda(DType::BF16, {8, 17}), fake_cuda(DType::BF16, {8, 64}),
                                    fake_cuda(DType::BF16, {16, 64}));
            }).find("16 columns"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              check_gemm_wgmma_args(fake_cuda(DType::F32, {8, 16}), fake_cuda(DType::BF16, {8, 64}),
                                    fake_cuda(DType::BF16, {16, 64}));
            }).find("must be BF16"),
            std::string::npos);
  // y overlapping x.
  const TensorView x = fake_cuda(DType::BF16, {8, 64});
  const TensorView y = TensorView::contiguous(x.data, DType::BF16, Device::CUDA, {8, 16});
  EXPECT_NE(input_error_of([&] {
              check_gemm_wgmma_args(y, x, fake_cuda(DType::BF16, {16, 64}));
            }).find("overlap"),
            std::string::npos);
}

// Step 8: the gated MLP's own rules on top of GEMM v2's, each named in its message.
TEST(Hopper15Args, GatedMlpRefusesWhatItCannotDo) {
  const auto error_of = [](std::vector<int64_t> act, std::vector<int64_t> x, std::vector<int64_t> w) {
    return input_error_of([&] {
      check_gated_mlp_args(fake_cuda(DType::BF16, act), fake_cuda(DType::BF16, x), fake_cuda(DType::BF16, w));
    });
  };
  EXPECT_EQ(error_of({8, 16}, {8, 64}, {32, 64}), "(no InputError)");  // I = 16, K = 64: taken
  EXPECT_NE(error_of({8, 16}, {8, 64}, {33, 64}).find("2I rows"), std::string::npos);  // not gate + up rows
  EXPECT_NE(error_of({8, 12}, {8, 64}, {32, 64}).find("16 columns"), std::string::npos);  // act is not [M, I]
  EXPECT_NE(error_of({7, 16}, {8, 64}, {32, 64}).find("8 rows"), std::string::npos);      // nor [M, ...]
  EXPECT_NE(error_of({8, 16}, {8, 96}, {32, 96}).find("multiple of 64"), std::string::npos);
  EXPECT_NE(error_of({8, 16}, {8, 64}, {32, 128}).find("same K"), std::string::npos);
  EXPECT_NE(error_of({8, 12}, {8, 64}, {24, 64}).find("multiple of 8"), std::string::npos);  // I = 12: no TMA row
  EXPECT_NE(input_error_of([] {
              check_gated_mlp_args(fake_cuda(DType::F32, {8, 16}), fake_cuda(DType::BF16, {8, 64}),
                                   fake_cuda(DType::BF16, {32, 64}));
            }).find("must be BF16"),
            std::string::npos);
  const TensorView x = fake_cuda(DType::BF16, {8, 64});  // act written over x
  EXPECT_NE(input_error_of([&] {
              check_gated_mlp_args(TensorView::contiguous(x.data, DType::BF16, Device::CUDA, {8, 16}), x,
                                   fake_cuda(DType::BF16, {32, 64}));
            }).find("overlap"),
            std::string::npos);
}

TEST(Hopper15Args, TmaAndTileRefuseWhatTheHardwareCannotDo) {
  // The 128-byte swizzle needs a 64-column box.
  EXPECT_NE(input_error_of([] {
              tma_tile_copy(fake_cuda(DType::BF16, {16, 32}), fake_cuda(DType::BF16, {64, 64}), 0, 0,
                            TmaSwizzle::B128);
            }).find("64 columns"),
            std::string::npos);
  // A source row must be a multiple of 16 bytes.
  EXPECT_NE(input_error_of([] {
              tma_tile_copy(fake_cuda(DType::BF16, {16, 64}), fake_cuda(DType::BF16, {64, 60}), 0, 0,
                            TmaSwizzle::None);
            }).find("multiple of 16 bytes"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              wgmma_tile(fake_cuda(DType::F32, {64, 128}), fake_cuda(DType::BF16, {64, 64}),
                         fake_cuda(DType::BF16, {128, 64}), 3, 2);
            }).find("[0, 4)"),
            std::string::npos);
  EXPECT_NE(input_error_of([] {
              cluster_exchange(fake_cuda(DType::F32, {12}), fake_cuda(DType::F32, {12}), 6, 4, 1);
            }).find("whole number of clusters"),
            std::string::npos);
}

TEST(Hopper15Args, TensorMapsRefuseWhatTmaCannotDescribe) {
  // Each rule is checked before the driver is asked for anything: no GPU needed.
  const void* base = reinterpret_cast<const void*>(uintptr_t{1} << 20);
  const auto error = [&](const void* b, uint64_t rows, uint64_t cols, uint64_t pitch, uint32_t box_rows,
                         uint32_t box_cols, TmaSwizzle sw) {
    return input_error_of([&] { make_tensor_map_bf16_2d(b, rows, cols, pitch, box_rows, box_cols, sw); });
  };
  EXPECT_NE(error(static_cast<const char*>(base) + 8, 64, 64, 128, 64, 64, TmaSwizzle::None).find("16-byte"),
            std::string::npos);
  EXPECT_NE(error(base, 64, 60, 120, 64, 64, TmaSwizzle::None).find("row pitch"), std::string::npos);
  EXPECT_NE(error(base, 64, 64, 64, 64, 64, TmaSwizzle::None).find("row pitch"),
            std::string::npos);  // < a row
  EXPECT_NE(error(base, 0, 64, 128, 64, 64, TmaSwizzle::None).find("[1, 2^32)"), std::string::npos);
  EXPECT_NE(error(base, 512, 512, 1024, 257, 64, TmaSwizzle::None).find("[1, 256]"), std::string::npos);
  EXPECT_NE(error(base, 512, 512, 1024, 64, 12, TmaSwizzle::None).find("multiple of 16 bytes"),
            std::string::npos);
  EXPECT_NE(error(base, 512, 512, 1024, 64, 128, TmaSwizzle::B128).find("at most 128 bytes"),
            std::string::npos);
}

TEST(Hopper15Args, AvailabilityAndItsReasonAgree) {
  EXPECT_EQ(hopper_available(), hopper_unavailable_reason().empty());
}

TEST(Hopper15Args, WithoutAHopperGpuEveryKernelRefusesWithTheReason) {
  if (hopper_available())
    GTEST_SKIP() << "this machine runs the kernels: the refusal is tested where it cannot";
  const std::string reason = hopper_unavailable_reason();
  const std::string e = input_error_of([] {
    gemm_wgmma(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 64}),
               fake_cuda(DType::BF16, {16, 64}));
  });
  EXPECT_NE(e.find("gemm_wgmma: " + reason), std::string::npos) << e;
  const std::string e2 = input_error_of([] {
    gemm_wgmma_v2(fake_cuda(DType::BF16, {8, 16}), fake_cuda(DType::BF16, {8, 64}),
                  fake_cuda(DType::BF16, {16, 64}));
  });
  EXPECT_NE(e2.find("gemm_wgmma_v2: " + reason), std::string::npos) << e2;
  EXPECT_NE(input_error_of([] {
              wgmma_tile(fake_cuda(DType::F32, {64, 128}), fake_cuda(DType::BF16, {64, 64}),
                         fake_cuda(DType::BF16, {128, 64}), 0, 4);
            }).find(reason),
            std::string::npos);
}

}  // namespace
}  // namespace tvllm
