// Lesson 15, step 5 on the GPU: flash_wgmma() against lesson 07's CPU reference with lesson 07's tolerance
// (flash_check.h), lesson 07's GPU v2 measured beside it on the same inputs. Outputs start as NaN (a row
// the kernel forgets fails) inside a wider NaN buffer (a store outside out's columns fails). Shapes: one
// sequence at every edge of the 128-row / 128-key tiles, packed batches of uneven sequences, chunked
// prefill (q_len < k_len), GQA groups 1 to 8, head_dim 64 and 128, sliding windows, a fused QKV buffer
// (strided tensor maps), long sequences (the ring of stages goes round many times); every variant of
// flash_configs() (step 6: against the reference, and the baseline's bits); determinism; the engine hook
// attention_hopper(); the refusals.
// Skipped without an H100/H200 (sm_90a).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "attention.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "flash_check.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "testing/attention_check.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::describe;  // (row, head, dim) of the first mismatches

// Random bf16 q, k, v on the GPU for a prefill of `lengths`, and its batch: for the tests that compare two
// GPU runs with each other (no CPU reference needed).
struct Inputs {
  Tensor q, k, v;
  AttentionBatch batch;
  int64_t tokens = 0;
};
Inputs random_prefill(const std::vector<int64_t>& lengths, const AttentionShape& s, uint64_t seed) {
  int64_t T = 0;
  for (int64_t n : lengths) T += n;
  return {
      Tensor::from_f32(random_normal(T * s.q_dim(), seed), {T, s.q_dim()}, DType::BF16, Device::CUDA),
      Tensor::from_f32(random_normal(T * s.kv_dim(), seed + 1), {T, s.kv_dim()}, DType::BF16, Device::CUDA),
      Tensor::from_f32(random_uniform(T * s.kv_dim(), seed + 2), {T, s.kv_dim()}, DType::BF16, Device::CUDA),
      AttentionBatch::prefill(lengths, Device::CUDA), T};
}

void expect_matches(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                    const AttentionShape& s, uint64_t seed, bool fused_qkv = false,
                    const FlashConfig* config = nullptr) {
  const FlashCheck r = check_flash_wgmma(q_lens, k_lens, s, seed, fused_qkv, config);
  EXPECT_GT(r.ours.count, 0);
  EXPECT_EQ(r.non_finite, 0) << r.ours.name << ": NaN or inf in the output (a row never written?)";
  EXPECT_EQ(r.written_outside, 0) << r.ours.name << ": wrote outside out's columns";
  EXPECT_TRUE(r.ours.pass()) << describe(r.ours, s);
  EXPECT_TRUE(r.lesson07.pass()) << "the bar itself moved: " << describe(r.lesson07, s);
  std::printf("    %s: max_abs %.3g (lesson 07 v2 %.3g, atol %.3g)\n", r.ours.name.c_str(), r.ours.max_abs,
              r.lesson07.max_abs, r.ours.tol.atol);
}

void expect_prefill_matches(const std::vector<int64_t>& lengths, const AttentionShape& s, uint64_t seed) {
  expect_matches(lengths, lengths, s, seed);
}

// First the second product on its own: if these fail, the register A fragment or V's MN-major descriptor
// is wrong, and every attention test below fails with them.
TEST(Flash15Gpu, PvTileFromRegistersIsExactOnSmallIntegers) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t n : {64, 128}) {
    const CompareResult r = check_wgmma_pv_tile(n, true, 40 + n);
    EXPECT_GT(r.count, 0);
    EXPECT_TRUE(r.pass()) << r.name << ": max_abs " << r.max_abs << ", bad " << r.bad << " of " << r.count;
  }
}

TEST(Flash15Gpu, PvTileFromRegistersMatchesOnRandomValues) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t n : {64, 128}) {
    const CompareResult r = check_wgmma_pv_tile(n, false, 50 + n);
    EXPECT_TRUE(r.pass()) << r.name << ": max_abs " << r.max_abs << ", bad " << r.bad << " of " << r.count;
  }
}

TEST(Flash15Gpu, OneSequenceAtEveryTileEdge) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128}) {
    const AttentionShape s{8, 2, d};
    uint64_t seed = 100 + d;
    for (int64_t n : {1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000})
      expect_prefill_matches({n}, s, seed++);
  }
}

TEST(Flash15Gpu, Llama1BShapeAt1000Tokens) {
  TVLLM_REQUIRE_HOPPER();
  expect_prefill_matches({1000}, AttentionShape{32, 8, 64}, 200);
  expect_prefill_matches({1000}, AttentionShape{32, 8, 128}, 201);
}

TEST(Flash15Gpu, PackedVariableLengths) {
  TVLLM_REQUIRE_HOPPER();
  // Uneven sequences in one batch: tiles that run into the next sequence's rows (masked keys, unstored
  // queries), empty-grid blocks of the short sequences, a one-token sequence.
  for (int64_t d : {64, 128}) {
    expect_prefill_matches({5, 1, 130, 64, 257, 1000}, AttentionShape{8, 2, d}, 300 + d);
    expect_prefill_matches({128, 128, 128}, AttentionShape{4, 4, d}, 310 + d);
    expect_prefill_matches({0, 3, 0, 200}, AttentionShape{4, 1, d}, 320 + d);  // empty sequences too
  }
}

TEST(Flash15Gpu, ChunkedPrefillQueriesAfterCachedKeys) {
  TVLLM_REQUIRE_HOPPER();
  // q_len < k_len: the queries are the last q_len positions (bottom-right aligned), as in lesson 07.
  for (int64_t d : {64, 128}) {
    expect_matches({10, 1, 200}, {510, 1, 300}, AttentionShape{8, 2, d}, 400 + d);
    expect_matches({128, 129}, {1000, 129}, AttentionShape{8, 4, d}, 410 + d);
    expect_matches({1}, {777}, AttentionShape{8, 8, d}, 420 + d);  // a decode-like single query
  }
}

TEST(Flash15Gpu, GqaGroups1To8) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (int64_t group : {1, 2, 4, 8})
      expect_prefill_matches({300, 77}, AttentionShape{8, 8 / group, d}, 500 + group);
}

TEST(Flash15Gpu, SlidingWindows) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (int64_t window : {1, 100, 128, 129, 300}) {
      expect_prefill_matches({1000}, AttentionShape{8, 2, d, window}, 600 + window);
      expect_matches({50, 300}, {700, 300}, AttentionShape{4, 1, d, window}, 610 + window);
    }
}

TEST(Flash15Gpu, FusedQkvBufferGivesStridedTensorMaps) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128}) {
    std::vector<int64_t> lengths = {129, 3, 500};
    const FlashCheck r = check_flash_wgmma(lengths, lengths, AttentionShape{8, 2, d}, 700 + d, true);
    EXPECT_TRUE(r.pass()) << describe(r.ours, AttentionShape{8, 2, d}) << " non-finite " << r.non_finite;
  }
}

TEST(Flash15Gpu, LongSequencesGoRoundTheRingManyTimes) {
  TVLLM_REQUIRE_HOPPER();
  // 2048 keys: 16 K/V tiles for the last query tile, 4 rounds of 4 stages (head_dim 64), 8 of 2 (128).
  expect_prefill_matches({2048}, AttentionShape{4, 1, 64}, 800);
  expect_prefill_matches({2048}, AttentionShape{4, 1, 128}, 801);
}

// The same inputs twice, once on a created stream: the same bits (each output's sums run in one fixed order).
TEST(Flash15Gpu, DeterministicAndRunsOnAStream) {
  TVLLM_REQUIRE_HOPPER();
  const AttentionShape s{8, 2, 64};
  const Inputs in = random_prefill({700, 33}, s, 900);
  const Tensor a = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
  const Tensor b = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(b.data(), 0xFF, b.view().nbytes()));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  flash_wgmma(a, in.q, in.k, in.v, in.batch, s);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  CudaStream stream;
  flash_wgmma(b, in.q, in.k, in.v, in.batch, s, stream.get());
  TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(to_f32_vector(a), to_f32_vector(b));
}

// Step 6's variants (flash_configs): each against the reference on the hard cases, and each bit for bit
// against the baseline (config 0). They change only WHEN wgmma groups are issued (schedule, overlap), how
// many rows a block takes (block_m) and the order of blocks: per row, the same tiles in the same order (a
// tile wholly masked for a row contributes exactly 0 and alpha exactly 1), so the same bits.
TEST(Flash15Gpu, EveryConfigMatchesTheReference) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (const FlashConfig& c : flash_configs(d)) {
      SCOPED_TRACE(std::string(c.name) + " head_dim " + std::to_string(d));
      expect_matches({1}, {1}, AttentionShape{8, 2, d}, 1000 + d, false, &c);  // one tile
      expect_matches({5, 1, 130, 64, 257, 1000}, {5, 1, 130, 64, 257, 1000}, AttentionShape{8, 2, d},
                     1010 + d, false, &c);
      expect_matches({10, 200}, {510, 300}, AttentionShape{8, 8, d}, 1020 + d, false, &c);
      expect_matches({1000}, {1000}, AttentionShape{8, 2, d, 300}, 1030 + d, false, &c);
      expect_matches({2048}, {2048}, AttentionShape{4, 1, d}, 1040 + d, false, &c);
      expect_matches({63, 64, 65, 191, 192, 193, 385}, {63, 64, 65, 191, 192, 193, 385},
                     AttentionShape{4, 2, d}, 1050 + d, false, &c);
      const FlashCheck fused =
          check_flash_wgmma({129, 3, 500}, {129, 3, 500}, AttentionShape{8, 2, d}, 1060 + d, true, &c);
      EXPECT_TRUE(fused.pass()) << describe(fused.ours, AttentionShape{8, 2, d});
    }
}

TEST(Flash15Gpu, EveryConfigGivesTheBaselineBits) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128}) {
    const AttentionShape s{8, 2, d};
    const Inputs in = random_prefill({1000, 1, 300, 777}, s, 1100);
    const FlashConfigList list = flash_configs(d);
    const Tensor base = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    flash_wgmma(base, in.q, in.k, in.v, in.batch, s, nullptr, list[0]);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> want = to_f32_vector(base);
    for (const FlashConfig& c : list) {
      const Tensor got = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
      TVLLM_CUDA_CHECK(cudaMemset(got.data(), 0xFF, got.view().nbytes()));
      flash_wgmma(got, in.q, in.k, in.v, in.batch, s, nullptr, c);
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(to_f32_vector(got), want) << c.name << " head_dim " << d;
    }
  }
}

// Step 6's register and shared-memory arithmetic, as the GPU sees it: the 64-row variants fit two blocks on an
// SM (256 threads x 128 registers, <= 90 KB of shared memory each), every other variant one.
TEST(Flash15Gpu, ResidentBlocksPerSmAreWhatStep6CountsOn) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 128})
    for (const FlashConfig& c : flash_configs(d))
      EXPECT_EQ(flash_wgmma_blocks_per_sm(d, c), c.block_m == 64 ? 2 : 1) << c.name << " head_dim " << d;
}

TEST(Flash15Gpu, AConfigThatIsNotCompiledIsRefused) {
  TVLLM_REQUIRE_HOPPER();
  const AttentionShape s{4, 2, 128};
  const Inputs in = random_prefill({10}, s, 1200);
  const Tensor out = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
  const FlashConfig odd{"odd", 192, true, FlashSchedule::PingPong, FlashOrder::HeadsInner};
  EXPECT_THROW(flash_wgmma(out, in.q, in.k, in.v, in.batch, s, nullptr, odd), InputError);
}

// The engine hook: head_dim 64/128 run flash_wgmma (the same bits), others lesson 07's v2 (the same bits).
TEST(Flash15Gpu, AttentionHopperPicksTheKernel) {
  TVLLM_REQUIRE_HOPPER();
  for (int64_t d : {64, 96}) {
    const AttentionShape s{4, 2, d};
    const Inputs in = random_prefill({200, 5}, s, 950);
    const Tensor hook = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
    const Tensor direct = Tensor::empty({in.tokens, s.q_dim()}, DType::BF16, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    attention_hopper(hook, in.q, in.k, in.v, in.batch, s);
    if (d == 64)
      flash_wgmma(direct, in.q, in.k, in.v, in.batch, s);
    else
      attention(direct, in.q, in.k, in.v, in.batch, s, AttentionKernel::V2Flash);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(to_f32_vector(hook), to_f32_vector(direct)) << "head_dim " << d;
  }
}

TEST(Flash15Gpu, RefusesOtherHeadDimsOnTheGpuToo) {
  TVLLM_REQUIRE_HOPPER();
  const AttentionShape s{4, 2, 96};
  const Tensor q = Tensor::empty({4, s.q_dim()}, DType::BF16, Device::CUDA);
  const Tensor kv = Tensor::empty({4, s.kv_dim()}, DType::BF16, Device::CUDA);
  const AttentionBatch batch = AttentionBatch::prefill({4}, Device::CUDA);
  EXPECT_THROW(flash_wgmma(q, q, kv, kv, batch, s), InputError);
}

}  // namespace
}  // namespace tvllm
