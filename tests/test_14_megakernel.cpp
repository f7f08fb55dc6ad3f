// Lesson 14 on the CPU: the megakernel's host planner (megakernel_plan.h). Every row of every matrix is
// assigned to exactly one block, in contiguous balanced ranges, each chunk fits a stage and starts on a 16-byte
// boundary, rows larger than a stage are cut into column slices that cover the row exactly once, in order.
// Per-warp stages: every chunk has exactly one owner warp, each warp's list is its chunks in program order, a
// sliced row's slices all go to one warp, consecutively, and the warps' shares differ by at most one task.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "common/input_error.h"
#include "megakernel.h"
#include "megakernel_plan.h"

namespace tvllm {
namespace {

// Per-warp stages: the warp lists are exactly the block's chunks, split by owner, each in program order; the
// slices of one row are consecutive in one warp's list; tasks (whole-row chunks, sliced rows) go round-robin.
void expect_valid_warp_lists(const MegakernelPlan& plan) {
  const int P = plan.phases(), G = plan.blocks(), W = plan.warps();
  ASSERT_EQ(plan.warp_begins().size(), static_cast<size_t>(G) * W * (P + 1));
  ASSERT_EQ(plan.warp_chunks().size(), plan.chunks().size());
  for (int b = 0; b < G; ++b) {
    // Expected owners: the task counter runs on across the block's phases.
    uint32_t task = 0;
    for (uint32_t i = plan.begin(b, 0); i < plan.begin(b, P); ++i) {
      const MkChunk& c = plan.chunks()[i];
      ASSERT_EQ(c.warp, task % static_cast<uint32_t>(W)) << "block " << b << " chunk " << i;
      if (c.flags & kMkLastSlice) ++task;
    }
    std::vector<int> seen(plan.begin(b, P) - plan.begin(b, 0), 0);
    std::vector<int64_t> tasks_of(W, 0);
    for (int w = 0; w < W; ++w)
      for (int p = 0; p < P; ++p) {
        int64_t prev_seq = -1;
        for (uint32_t i = plan.warp_begin(b, w, p); i < plan.warp_begin(b, w, p + 1); ++i) {
          const MkChunk& c = plan.warp_chunks()[i];
          ASSERT_EQ(c.warp, static_cast<uint32_t>(w));
          ASSERT_EQ(c.phase, static_cast<uint32_t>(p));
          ASSERT_GT(static_cast<int64_t>(c.seq), prev_seq);  // program order
          ASSERT_LT(c.seq, seen.size());
          const MkChunk& orig = plan.chunks()[plan.begin(b, 0) + c.seq];
          ASSERT_EQ(orig.row0, c.row0);
          ASSERT_EQ(orig.k0, c.k0);
          ASSERT_EQ(orig.rows, c.rows);
          ++seen[c.seq];
          // A slice after the first: the row's previous slice is this warp's previous chunk.
          if (!(c.flags & kMkFirstSlice)) {
            ASSERT_GT(i, plan.warp_begin(b, w, p));
            const MkChunk& before = plan.warp_chunks()[i - 1];
            ASSERT_EQ(before.row0, c.row0);
            ASSERT_EQ(before.k0 + before.kc, c.k0);
            ASSERT_EQ(before.seq + 1, c.seq);
          }
          if (c.flags & kMkLastSlice) ++tasks_of[w];
          prev_seq = c.seq;
        }
      }
    for (size_t n = 0; n < seen.size(); ++n) ASSERT_EQ(seen[n], 1) << "block " << b << " chunk " << n;
    const auto [lo, hi] = std::minmax_element(tasks_of.begin(), tasks_of.end());
    EXPECT_LE(*hi - *lo, 1) << "block " << b;
  }
}

// The checks every plan must pass; returns nothing, fails the test on the first violation of each kind.
void expect_valid(const MegakernelPlan& plan, int max_rows) {
  const int P = plan.phases(), G = plan.blocks();
  for (int p = 0; p < P; ++p) {
    const MkMatrix& m = plan.matrices()[p];
    // covered[r * K + k] counts how often column k of output r is streamed (K small in these tests, or per pack).
    std::vector<int> covered(static_cast<size_t>(m.outputs) * ((m.K + 7) / 8), 0);
    std::vector<int64_t> outputs_of(G, 0);
    for (int b = 0; b < G; ++b) {
      int64_t prev_row = -1, prev_k_end = 0;
      for (uint32_t i = plan.begin(b, p); i < plan.begin(b, p + 1); ++i) {
        const MkChunk& c = plan.chunks()[i];
        ASSERT_EQ(c.phase, static_cast<uint32_t>(p));
        ASSERT_GE(c.rows, 1u);
        ASSERT_LE(c.rows, static_cast<uint32_t>(max_rows));
        ASSERT_LE(plan.chunk_bytes(c), plan.stage_bytes());
        ASSERT_EQ(plan.chunk_bytes(c) % 16, 0);
        // 16-byte aligned source: row0 * K + k0 elements from a 16-byte aligned base.
        ASSERT_EQ((static_cast<int64_t>(c.row0) * m.K + c.k0) * m.elem_bytes % 16, 0);
        ASSERT_EQ(c.kc * m.elem_bytes % 16, 0u);
        ASSERT_LE(c.k0 + c.kc, static_cast<uint64_t>(m.K));
        ASSERT_EQ((c.flags & kMkFirstSlice) != 0, c.k0 == 0);
        ASSERT_EQ((c.flags & kMkLastSlice) != 0, c.k0 + c.kc == m.K);
        if (c.kc != m.K) {
          ASSERT_EQ(c.rows, 1u);
        }
        // In order: rows ascending, a row's slices consecutive and ascending.
        if (static_cast<int64_t>(c.row0) == prev_row) {
          ASSERT_EQ(c.k0, prev_k_end);
        } else {
          ASSERT_GT(static_cast<int64_t>(c.row0), prev_row);
          ASSERT_EQ(c.k0, 0u);
        }
        prev_row = c.row0 + c.rows - 1;
        prev_k_end = c.k0 + c.kc;
        ASSERT_GE(c.row0, MegakernelPlan::first_output(m.outputs, G, b));
        ASSERT_LE(c.row0 + c.rows, MegakernelPlan::first_output(m.outputs, G, b + 1));
        for (uint32_t r = c.row0; r < c.row0 + c.rows; ++r)
          for (uint32_t k = c.k0; k < c.k0 + c.kc; k += 8) ++covered[static_cast<size_t>(r) * ((m.K + 7) / 8) + k / 8];
        if (c.flags & kMkLastSlice) outputs_of[b] += c.rows;
        // The producer's order: the chunk's index in its block's program (its ring slot: test_14_megakernel_ring).
        ASSERT_EQ(c.seq, i - plan.begin(b, 0));
        if (plan.warps() == 0) {
          ASSERT_EQ(c.warp, 0u);
        } else {
          ASSERT_LT(c.warp, static_cast<uint32_t>(plan.warps()));
          ASSERT_LE(c.rows, 32u);  // one lane per output in the epilogue
        }
      }
    }
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "phase " << p << " pack " << i;
    // Balance: every block's share within one output of every other's.
    const auto [lo, hi] = std::minmax_element(outputs_of.begin(), outputs_of.end());
    EXPECT_LE(*hi - *lo, 1) << "phase " << p;
  }
  EXPECT_EQ(plan.begin(G - 1, P), plan.chunks().size());
  if (plan.warps() > 0) expect_valid_warp_lists(plan);
}

TEST(Megakernel14Plan, ALlamaLikeStepOn132Sms) {
  // 1B-like shapes: qkv 3072 x 2048, o 2048 x 2048, gate|up 2 x 8192 x 2048, down 2048 x 8192, lm_head.
  const std::vector<MkMatrix> m = {{3072, 2048, 2, false}, {2048, 2048, 2, false}, {8192, 2048, 2, true},
                                   {2048, 8192, 2, false}, {128256, 2048, 2, false}};
  const MegakernelPlan plan(m, 132, 32768, 6, 256);
  expect_valid(plan, 256);
  // gate|up: an output is 2 x 4 KiB, so 4 per 32 KiB stage; down: a row is 16 KiB, 2 per stage.
  const MkChunk& gu = plan.chunks()[plan.begin(0, 2)];
  EXPECT_EQ(gu.rows, 4u);
  EXPECT_EQ(plan.chunk_bytes(gu), 32768);
  EXPECT_EQ(plan.chunks()[plan.begin(0, 3)].rows, 2u);
  // Bytes per block within one row-chunk of each other (rows per phase differ by at most one).
  int64_t lo = plan.block_bytes(0), hi = lo;
  for (int b = 1; b < 132; ++b) {
    lo = std::min(lo, plan.block_bytes(b));
    hi = std::max(hi, plan.block_bytes(b));
  }
  EXPECT_LE(hi - lo, 2 * 4096 + 2 * 4096 + 2 * 4096 + 16384 + 4096);
}

TEST(Megakernel14Plan, PerWarpStagesOfALlamaLikeStep) {
  // The megakernel's default: 16 KiB stages, 11 owner warps, at most 32 outputs per chunk.
  const std::vector<MkMatrix> m = {{3072, 2048, 2, false}, {2048, 2048, 2, false}, {8192, 2048, 2, true},
                                   {2048, 8192, 2, false}, {128256, 2048, 2, false}};
  const MegakernelPlan plan(m, 132, 16384, 12, 32, 11);
  expect_valid(plan, 32);
  EXPECT_EQ(plan.warps(), 11);
  // qkv: 4 rows of 4 KiB per stage; gate|up: 2 outputs (2 x 2 x 4 KiB); down: one whole 16 KiB row, not sliced.
  EXPECT_EQ(plan.chunks()[plan.begin(0, 0)].rows, 4u);
  EXPECT_EQ(plan.chunks()[plan.begin(0, 2)].rows, 2u);
  const MkChunk& down = plan.chunks()[plan.begin(0, 3)];
  EXPECT_EQ(down.rows, 1u);
  EXPECT_EQ(down.kc, 8192u);
  EXPECT_EQ(plan.chunk_bytes(down), 16384);
  // Block 0's qkv rows [0, 23): chunks of 4, 4, 4, 4, 4, 3 dealt to warps 0..5; o continues with warp 6.
  EXPECT_EQ(plan.begin(0, 1) - plan.begin(0, 0), 6u);
  EXPECT_EQ(plan.chunks()[plan.begin(0, 0) + 5].rows, 3u);
  EXPECT_EQ(plan.chunks()[plan.begin(0, 0) + 5].warp, 5u);
  EXPECT_EQ(plan.chunks()[plan.begin(0, 1)].warp, 6u);
  // FP8-resident rows (1 byte per weight): twice the rows per stage.
  const std::vector<MkMatrix> f8 = {{3072, 2048, 1, false}, {2048, 8192, 1, false}};
  const MegakernelPlan plan8(f8, 132, 16384, 12, 32, 11);
  expect_valid(plan8, 32);
  EXPECT_EQ(plan8.chunks()[plan8.begin(0, 0)].rows, 8u);
  EXPECT_EQ(plan8.chunks()[plan8.begin(0, 1)].rows, 2u);
}

TEST(Megakernel14Plan, PerWarpStagesKeepARowsSlicesWithOneWarp) {
  // K = 14336 bf16 = 28 KiB per row (an 8B-shaped down) into 16 KiB stages: 2 slices per row, one warp each row.
  const MegakernelPlan plan({{4096, 14336, 2, false}, {300, 640, 2, true}}, 132, 16384, 12, 32, 11);
  expect_valid(plan, 32);
  const MkChunk& a = plan.chunks()[0];
  const MkChunk& b = plan.chunks()[1];
  EXPECT_EQ(a.flags, kMkFirstSlice);
  EXPECT_EQ(b.flags, kMkLastSlice);
  EXPECT_EQ(a.warp, b.warp);
  EXPECT_EQ(a.kc + b.kc, 14336u);
  EXPECT_EQ(plan.chunks()[2].warp, 1u);  // the next row: the next warp
}

TEST(Megakernel14Plan, WeirdShapes) {
  // hidden 328 (not a multiple of 64), intermediate 904 (odd multiple of 8), vocab 1009 (prime), head_dim 128.
  const std::vector<MkMatrix> m = {{128 * 5 + 2 * 128 * 1, 328, 2, false}, {328, 640, 2, false},
                                   {904, 328, 2, true}, {328, 904, 2, false}, {1009, 328, 2, false}};
  for (int blocks : {1, 3, 7, 132, 200})
    for (int64_t stage : {int64_t{32}, int64_t{656}, int64_t{1024}, int64_t{32768}}) {
      SCOPED_TRACE(::testing::Message() << blocks << " blocks, stage " << stage);
      expect_valid(MegakernelPlan(m, blocks, stage, 5, 64), 64);
      for (int warps : {1, 3, 11}) {
        SCOPED_TRACE(::testing::Message() << warps << " warps");
        expect_valid(MegakernelPlan(m, blocks, stage, 12, 32, warps), 32);
      }
    }
}

TEST(Megakernel14Plan, RowsBiggerThanAStageAreSlicedInOrder) {
  // K = 8192 bf16 = 16 KiB per row into 6000-byte stages: slices of 3000 columns (375 packs).
  const MegakernelPlan plan({{5, 8192, 2, false}, {3, 8192, 2, true}}, 2, 6000, 3, 8);
  expect_valid(plan, 8);
  const MkChunk& first = plan.chunks()[0];
  EXPECT_EQ(first.kc, 3000u);
  EXPECT_EQ(first.flags, kMkFirstSlice);
  // Block 0 owns outputs 0, 1 of phase 0: 3 slices each (3000 + 3000 + 2192).
  EXPECT_EQ(plan.begin(0, 1) - plan.begin(0, 0), 6u);
  EXPECT_EQ(plan.chunks()[2].kc, 2192u);
  EXPECT_EQ(plan.chunks()[2].flags, kMkLastSlice);
}

TEST(Megakernel14Plan, MoreBlocksThanRowsLeavesSomeIdle) {
  const MegakernelPlan plan({{3, 64, 2, false}}, 8, 1024, 4, 16);
  expect_valid(plan, 16);
  int busy = 0;
  for (int b = 0; b < 8; ++b) busy += plan.begin(b, 1) > plan.begin(b, 0);
  EXPECT_EQ(busy, 3);
}

TEST(Megakernel14Plan, BadArgumentsAreInputErrors) {
  EXPECT_THROW(MegakernelPlan({{4, 12, 2, false}}, 1, 1024, 4, 8), InputError);  // 24-byte rows: not whole packs
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 0, 1024, 4, 8), InputError);
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1000 + 4, 4, 8), InputError);
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1024, 4, 0), InputError);
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1024, 4, 8, -1), InputError);
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1024, 4, 33, 4), InputError);  // per-warp: one lane per output
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1024, 0, 8), InputError);      // no ring
  EXPECT_THROW(MegakernelPlan({{4, 64, 2, false}}, 1, 1024, 3, 8, 4), InputError);   // a warp without a stage
}

// What the megakernel declines, by name, from the config first (no GPU needed for these).
TEST(Megakernel14, DeclinesModelsByNameAndTheCpu) {
  // CPU weights with only a config (ModelWeights is move-only: one per case).
  const auto declines = [](const std::function<void(ModelConfig&)>& edit) {
    ModelWeights w;
    w.config.num_attention_heads = 8, w.config.num_key_value_heads = 2, w.config.head_dim = 64;
    w.device = Device::CPU;
    edit(w.config);
    return megakernel_declines(w);
  };
  EXPECT_EQ(declines([](ModelConfig&) {}), "the CPU");
  EXPECT_EQ(declines([](ModelConfig& c) { c.head_dim = 96; }), "head_dim 96");
  // Qwen2's q/k/v biases are taken (added to the bf16 qkv product): only the device declines here.
  EXPECT_EQ(declines([](ModelConfig& c) { c.qkv_bias = true; }), "the CPU");
  EXPECT_EQ(declines([](ModelConfig& c) { c.qk_norm = true; }), "the CPU");  // Qwen3's q/k norm is taken too
  EXPECT_EQ(declines([](ModelConfig& c) { c.sliding_window = 4096; }), "a sliding window");
  EXPECT_EQ(declines([](ModelConfig& c) { c.o_bias = true; }), "o_proj bias");
  // 16 query heads per kv head: more than the attention phase's 8.
  EXPECT_NE(declines([](ModelConfig& c) { c.num_attention_heads = 32; }).find("query heads per kv head"),
            std::string::npos);
}

}  // namespace
}  // namespace tvllm
