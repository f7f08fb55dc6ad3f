// Lesson 15, step 7 on the CPU: what the paged wgmma flash attention decides without a GPU. The boxes the
// producer issues for a tile (against a brute-force walk over every key through lesson 12's block-table
// formula: each key lands in the tile row it belongs to, from the pool row its table gives, no box crosses a
// block's end or starts off the swizzle's 8-row period, no table entry past the sequence's last key is read,
// the mbarrier's byte count is what the boxes deliver), the refusals, the argument checks, the compiled
// variants, and lesson 12's new seam.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string>
#include <vector>

#include "attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "flash_paged.h"
#include "flash_wgmma.h"
#include "paged_kv.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::fake_cuda;
using testing::input_error_of;

// A shuffled table of exactly enough blocks for k_len keys (a read past it would be out of the vector's
// range).
std::vector<int32_t> shuffled_table(int64_t k_len, int64_t bs, int64_t num_blocks, uint64_t seed) {
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  Rng rng(seed);
  for (size_t i = order.size() - 1; i > 0; --i)
    std::swap(order[i], order[rng.below(static_cast<int64_t>(i) + 1)]);
  order.resize(static_cast<size_t>((k_len + bs - 1) / bs));
  return order;
}

TEST(FlashPaged15Boxes, EveryKeyOfATileLandsInItsRowFromItsSlot) {
  int tiles = 0;
  for (int64_t bs : {8, 16, 32, 64, 128, 256, 1024})
    for (int k_len : {1, 7, 8, 9, 100, 127, 128, 129, 255, 256, 300, 1000, 2049}) {
      const int64_t num_blocks = (k_len + bs - 1) / bs + 5;
      const std::vector<int32_t> table =
          shuffled_table(k_len, bs, num_blocks, static_cast<uint64_t>(bs * 7 + k_len));
      for (int k0 = 0; k0 < k_len; k0 += kFlashBlockN, ++tiles) {
        SCOPED_TRACE("block_size " + std::to_string(bs) + " k_len " + std::to_string(k_len) + " k0 " +
                     std::to_string(k0));
        const std::vector<FlashPagedBox> boxes =
            flash_paged_tile_boxes(k0, k_len, bs, table.data(), static_cast<int64_t>(table.size()));
        const int rows = static_cast<int>(std::min<int64_t>(bs, kFlashBlockN));
        int covered_rows = 0;
        for (size_t j = 0; j < boxes.size(); ++j) {
          const FlashPagedBox& b = boxes[j];
          EXPECT_EQ(b.rows, rows);
          EXPECT_EQ(b.tile_row, static_cast<int>(j) * rows) << "boxes in order, side by side";
          EXPECT_EQ(b.tile_row % 8, 0) << "a box starts on the swizzle's 8-row (1024-byte) period";
          EXPECT_LE(b.tile_row + b.rows, kFlashBlockN);
          EXPECT_EQ(b.pos, k0 + b.tile_row);
          EXPECT_LT(b.pos, k_len) << "a box wholly past the last key is never loaded";
          EXPECT_LE(b.pos % bs + b.rows, bs) << "a box never crosses its block's end";
          EXPECT_EQ(b.pool_row % 8, 0);
          covered_rows += b.rows;
        }
        // Brute force: every key of the tile, through lesson 12's formula, sits in the box covering its row.
        const int keys = std::min(kFlashBlockN, k_len - k0);
        for (int r = 0; r < keys; ++r) {
          const int pos = k0 + r;
          const int64_t slot = static_cast<int64_t>(table[static_cast<size_t>(pos / bs)]) * bs + pos % bs;
          int found = 0;
          for (const FlashPagedBox& b : boxes)
            if (r >= b.tile_row && r < b.tile_row + b.rows) {
              ++found;
              EXPECT_EQ(b.pool_row + (r - b.tile_row), slot) << "key " << pos;
            }
          EXPECT_EQ(found, 1) << "key " << pos << " must be in exactly one box";
        }
        // The rows no box fills are all past the last key: the consumers zero V there (clean_v).
        EXPECT_GE(covered_rows, keys);
        EXPECT_LT(covered_rows - keys, rows) << "at most one partly used box";
        // The mbarrier's count: exactly the bytes the boxes deliver, per head_dim; a full tile inside the
        // sequence.
        for (int d : {64, 128}) {
          const uint32_t bytes = flash_paged_tile_bytes(k0, k_len, static_cast<int>(bs), d);
          EXPECT_EQ(bytes, static_cast<uint32_t>(covered_rows) * 128u * static_cast<uint32_t>(d / 64));
          if (k0 + kFlashBlockN <= k_len) {
            EXPECT_EQ(bytes, static_cast<uint32_t>(kFlashBlockN * 2 * d));
          }
        }
        EXPECT_EQ(static_cast<int>(boxes.size()), flash_paged_boxes_loaded(k0, k_len, static_cast<int>(bs)));
      }
    }
  EXPECT_EQ(tiles, 7 * 41);  // 7 block sizes x the tiles of the 13 lengths (1 x 7, 2 x 3, 3, 8, 17)
}

TEST(FlashPaged15Boxes, ATileOfSmallBlocksIsOneBoxPerBlock) {
  // Blocks of 16, a tile at key 128 of a 300-key sequence: boxes at tile rows 0, 16, .., 112 from blocks 8
  // .. 15.
  std::vector<int32_t> table(19);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(100 - i);
  const std::vector<FlashPagedBox> boxes = flash_paged_tile_boxes(128, 300, 16, table.data(), 19);
  ASSERT_EQ(boxes.size(), 8u);
  EXPECT_EQ(boxes[0].pool_row, (100 - 8) * 16);
  EXPECT_EQ(boxes[7].tile_row, 112);
  EXPECT_EQ(boxes[7].pool_row, (100 - 15) * 16);
  // The last tile (keys 256 .. 299): three boxes (256, 272, 288), the fourth .. eighth never loaded.
  const std::vector<FlashPagedBox> last = flash_paged_tile_boxes(256, 300, 16, table.data(), 19);
  ASSERT_EQ(last.size(), 3u);
  EXPECT_EQ(last[2].pool_row, (100 - 18) * 16);
  EXPECT_EQ(flash_paged_tile_bytes(256, 300, 16, 64), 3u * 16u * 128u);
  // Blocks of 512: one 128-row box at the tile's offset inside its block.
  const std::vector<int32_t> big = {3, 9};
  const std::vector<FlashPagedBox> one = flash_paged_tile_boxes(640, 700, 512, big.data(), 2);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].pool_row, 9 * 512 + 128);
}

TEST(FlashPaged15Boxes, BadTilesAndTablesAreInputErrors) {
  const std::vector<int32_t> table = {0, 1, 2};
  EXPECT_NE(input_error_of([&] { flash_paged_tile_boxes(0, 10, 4, table.data(), 3); }).find("power of two"),
            std::string::npos);
  EXPECT_NE(
      input_error_of([&] { flash_paged_tile_boxes(64, 300, 16, table.data(), 3); }).find("multiple of 128"),
      std::string::npos);
  EXPECT_NE(
      input_error_of([&] { flash_paged_tile_boxes(128, 100, 64, table.data(), 3); }).find("before k_len"),
      std::string::npos);
  EXPECT_NE(
      input_error_of([&] { flash_paged_tile_boxes(0, 49, 16, table.data(), 3); }).find("does not cover"),
      std::string::npos);
}

// ---- the refusals
// ---------------------------------------------------------------------------------------------

TEST(FlashPaged15Checks, RefusesHeadDimsBlockSizesAndHugePools) {
  for (int64_t d : {64, 128})
    for (int64_t bs : {8, 16, 32, 64, 128, 256, 4096})
      EXPECT_EQ(flash_paged_refusal(AttentionShape{8, 2, d}, bs, 1000 * bs), "") << d << " " << bs;
  for (int64_t d : {32, 80, 96, 256})
    EXPECT_NE(flash_paged_refusal(AttentionShape{8, 2, d}, 16, 1600).find("head_dim"), std::string::npos)
        << d;
  for (int64_t bs : {0, 1, 2, 4, 12, 24, 100})
    EXPECT_NE(flash_paged_refusal(AttentionShape{8, 2, 64}, bs, 1600).find("block size"), std::string::npos)
        << bs;
  EXPECT_NE(flash_paged_refusal(AttentionShape{8, 2, 64}, 16, int64_t{1} << 31).find("2^31"),
            std::string::npos);
  EXPECT_EQ(flash_paged_refusal(AttentionShape{8, 2, 64}, 16, (int64_t{1} << 31) - 16), "");
}

// The checks before any launch, on fake CUDA views (no GPU here): each names its problem. CPU tables reach
// every check up to "the tables must be made for cuda" (the kernel reads them from the device).
TEST(FlashPaged15Checks, ArgumentsAreCheckedBeforeAnyLaunch) {
  const AttentionShape s{8, 2, 64};
  const int64_t T = 10, blocks = 20, bs = 16;
  const AttentionBatch batch = AttentionBatch::with_lengths({10}, {40}, Device::CPU);
  PagedStepTables tables(T, 1, 4, blocks, bs, Device::CPU);
  const TensorView q = fake_cuda(DType::BF16, {T, s.q_dim()}), out = fake_cuda(DType::BF16, {T, s.q_dim()});
  const TensorView pk = fake_cuda(DType::BF16, {blocks, bs, s.kv_dim()});
  const TensorView pv = fake_cuda(DType::BF16, {blocks, bs, s.kv_dim()});
  const auto error = [&](const TensorView& o, const TensorView& qq, const TensorView& k, const TensorView& v,
                         const PagedStepTables& t, const AttentionShape& shape) {
    return input_error_of([&] { check_flash_paged_args(o, qq, k, v, batch, t, shape); });
  };
  EXPECT_NE(error(out, q, pk, pv, tables, AttentionShape{8, 2, 80}).find("head_dim must be 64 or 128"),
            std::string::npos);
  PagedStepTables small(T, 1, 16, blocks, 4, Device::CPU);
  EXPECT_NE(error(out, q, pk, pv, small, s).find("block size must be a power of two of at least 8"),
            std::string::npos);
  EXPECT_NE(error(out, fake_cuda(DType::F32, {T, s.q_dim()}), pk, pv, tables, s).find("q must be bf16"),
            std::string::npos);
  // q as columns 4.. of a wider buffer: its data is 8 bytes past a 16-byte boundary.
  const TensorView odd = fake_cuda(DType::BF16, {T, s.q_dim() + 8}).columns(4, s.q_dim());
  EXPECT_NE(error(out, odd, pk, pv, tables, s).find("TMA"), std::string::npos);
  EXPECT_NE(error(out, q, fake_cuda(DType::BF16, {blocks, 8, s.kv_dim()}), pv, tables, s)
                .find("pool_k must be one layer"),
            std::string::npos);
  EXPECT_NE(error(out, q, pk, fake_cuda(DType::F32, {blocks, bs, s.kv_dim()}), tables, s)
                .find("pool_v must be contiguous bf16"),
            std::string::npos);
  EXPECT_NE(error(out, q, pk, pv, tables, s).find("must be made for cuda"), std::string::npos);
}

TEST(FlashPaged15Checks, EveryDefaultConfigHasAPagedKernel) {
  // The paged path runs flash_default_config(head_dim, max_q_len): every default must be compiled paged.
  for (int64_t d : {64, 128})
    for (int64_t q_len : {2, 100, 1024, 1025, 8192, 8193, 100000})
      EXPECT_TRUE(flash_wgmma_paged_has_config(d, flash_default_config(d, q_len))) << d << " " << q_len;
  // The overlapped, ping-pong and P-in-shared-memory variants are not (the contiguous kernel keeps them).
  for (int64_t d : {64, 128})
    for (const FlashConfig& c : flash_configs(d))
      if (c.overlap || c.p_smem || c.schedule == FlashSchedule::PingPong) {
        EXPECT_FALSE(flash_wgmma_paged_has_config(d, c)) << c.name;
      }
}

// ---- lesson 12's seam
// -----------------------------------------------------------------------------------------

std::atomic<int> g_calls{0};
bool counting_paged_prefill(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                            const AttentionBatch&, const PagedStepTables&, const AttentionShape&,
                            cudaStream_t) {
  ++g_calls;
  return true;
}

TEST(FlashPaged15Seam, ThePagedPrefillSeamTakesOnlyGpuStepsWithSeveralQueries) {
  const AttentionShape s{8, 2, 64};
  PagedStepTables tables(8, 2, 4, 20, 16, Device::CPU);
  const TensorView pk = fake_cuda(DType::BF16, {20, 16, s.kv_dim()}),
                   pv = fake_cuda(DType::BF16, {20, 16, s.kv_dim()});
  const TensorView q = fake_cuda(DType::BF16, {5, s.q_dim()}), out = fake_cuda(DType::BF16, {5, s.q_dim()});
  const AttentionBatch chunk = AttentionBatch::with_lengths({4, 1}, {40, 9}, Device::CPU);
  const AttentionBatch decode = AttentionBatch::with_lengths({1, 1}, {40, 9}, Device::CPU);
  g_calls = 0;
  EXPECT_EQ(installed_fast_paged_prefill(), nullptr);
  EXPECT_FALSE(try_fast_paged_prefill(out, q, pk, pv, chunk, tables, s, nullptr));  // nothing installed
  install_fast_paged_prefill(counting_paged_prefill);
  EXPECT_EQ(installed_fast_paged_prefill(), &counting_paged_prefill);
  EXPECT_FALSE(
      try_fast_paged_prefill(out, q, pk, pv, decode, tables, s, nullptr));  // decode: lesson 12's kernels
  const TensorView q_cpu = TensorView::contiguous(nullptr, DType::F32, Device::CPU, {0, s.q_dim()});
  EXPECT_FALSE(
      try_fast_paged_prefill(q_cpu, q_cpu, pk, pv, chunk, tables, s, nullptr));  // CPU: the reference
  EXPECT_EQ(g_calls.load(), 0);
  EXPECT_TRUE(try_fast_paged_prefill(out, q, pk, pv, chunk, tables, s, nullptr));  // a chunk after a prefix
  EXPECT_EQ(g_calls.load(), 1);
  install_fast_paged_prefill(nullptr);
  EXPECT_EQ(installed_fast_paged_prefill(), nullptr);
  EXPECT_FALSE(try_fast_paged_prefill(out, q, pk, pv, chunk, tables, s, nullptr));
  EXPECT_EQ(g_calls.load(), 1);
}

}  // namespace
}  // namespace tvllm
