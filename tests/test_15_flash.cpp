// Lesson 15, step 5 on the CPU: what the wgmma flash attention decides without a GPU. Which K/V tiles a
// block visits and which of them need the mask (against a brute-force walk over every (row, key) pair), the
// register identity that lets P feed the second wgmma from registers, the MN-major descriptor of V, the
// argument checks, attention_hopper()'s fall-back to lesson 07, the FLOP count of the benchmark, and step
// 6's variants (each listed config compiled, the default tables).
#include <gtest/gtest.h>

#include <cmath>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "flash_check.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "hopper_layout.h"
#include "testing/hopper_testing.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::fake_cuda;
using testing::input_error_of;

// ---- the tiling, against brute force ----------------------------------------------------------------------

struct Walk {  // what a block's real rows actually see
  int first_key = -1, last_key = -1;
};
Walk brute_force(int q_len, int k_len, int q0, int window, int block_m) {
  Walk w;
  for (int i = q0; i < q0 + block_m && i < q_len; ++i) {
    const int pos = k_len - q_len + i;
    for (int key = 0; key < k_len; ++key) {
      if (!flash_key_visible(key, pos, window)) continue;
      if (w.first_key < 0 || key < w.first_key) w.first_key = key;
      w.last_key = std::max(w.last_key, key);
    }
  }
  return w;
}

TEST(Flash15Tiling, TheTileRangeIsExactlyTheTilesHoldingAVisibleKey) {
  // Every (q_len, k_len, q0, window) of a grid with tile edges on both sides: the first tile of the range
  // holds the first key any real row sees, the last tile the last one; nothing visible lies outside. For
  // every block height (64, 128 and 192 query rows).
  int cases = 0;
  for (int block_m : {64, 128, 192})
    for (int q_len : {1, 2, 63, 64, 65, 127, 128, 129, 300, 1000})
      for (int extra : {0, 1, 100, 128, 555})
        for (int window : {0, 1, 7, 64, 128, 129, 500})
          for (int q0 = 0; q0 < q_len; q0 += block_m) {
            const int k_len = q_len + extra;
            const FlashTileRange r = flash_kv_tiles(q_len, k_len, q0, window, block_m);
            const Walk w = brute_force(q_len, k_len, q0, window, block_m);
            const std::string where = "q_len " + std::to_string(q_len) + " k_len " + std::to_string(k_len) +
                                      " q0 " + std::to_string(q0) + " window " + std::to_string(window) +
                                      " block_m " + std::to_string(block_m);
            ASSERT_GE(w.first_key, 0) << where;  // every real row sees itself
            EXPECT_EQ(r.first, w.first_key / kFlashBlockN) << where;
            EXPECT_EQ(r.end, w.last_key / kFlashBlockN + 1) << where;
            ++cases;
          }
  EXPECT_EQ(cases, 1190 + 700 + 560);  // the grid above, all of it (64, 128 and 192-row blocks)
}

TEST(Flash15Tiling, CausalPrefillVisitsTheLowerTriangleOfTiles) {
  // n = 1000 prefill: query tile x (rows 128x ..) visits K tiles 0..x: 8 tiles of 128 keys in all.
  for (int x = 0; x < 8; ++x) {
    const FlashTileRange r = flash_kv_tiles(1000, 1000, 128 * x, 0);
    EXPECT_EQ(r.first, 0);
    EXPECT_EQ(r.end, x + 1);
  }
  // A window of 256 keeps the last tile's block to the tiles of its last 256 + 127 keys.
  const FlashTileRange w = flash_kv_tiles(1000, 1000, 896, 256);
  EXPECT_EQ(w.first, (896 - 255) / 128);
  EXPECT_EQ(w.end, 8);
  // A chunk of 10 queries after 500 cached keys: the keys 0..509, tiles 0..3.
  const FlashTileRange c = flash_kv_tiles(10, 510, 0, 0);
  EXPECT_EQ(c.first, 0);
  EXPECT_EQ(c.end, 4);
}

TEST(Flash15Tiling, TilesWithoutTheMaskAreFullyVisibleToEveryRow) {
  // The kernel skips the mask on a tile when flash_tile_needs_mask says so; then every key of the tile must
  // be inside the sequence and visible to each of the warpgroup's 64 rows. (The converse, masking a tile
  // that needs none, costs time only.)
  for (int window : {0, 50, 128, 300})
    for (int first_pos = 0; first_pos < 700; first_pos += 37)
      for (int k0 = 0; k0 < 800; k0 += kFlashBlockN) {
        const int last_pos = first_pos + 63;
        if (flash_tile_needs_mask(k0, first_pos, last_pos, window)) continue;
        for (int pos = first_pos; pos <= last_pos; ++pos)
          for (int key = k0; key < k0 + kFlashBlockN; ++key)
            ASSERT_TRUE(flash_key_visible(key, pos, window))
                << "key " << key << " pos " << pos << " window " << window;
      }
  // The diagonal tile always needs it.
  EXPECT_TRUE(flash_tile_needs_mask(128, 128, 191, 0));
  EXPECT_FALSE(flash_tile_needs_mask(0, 128, 191, 0));
  EXPECT_TRUE(flash_tile_needs_mask(0, 200, 263, 100));  // key 0 is outside row 200's window
}

TEST(Flash15Tiling, SharedMemoryFitsAndStagesAreWhatTheHeaderSays) {
  EXPECT_EQ(flash_wgmma_stages(64), 4);
  EXPECT_EQ(flash_wgmma_stages(128), 2);
  EXPECT_EQ(flash_wgmma_stages(64, 64), 2);  // two 64-row blocks per SM: 73 KB each (90 with P's tile)
  EXPECT_EQ(flash_smem_bytes(64, 64), 72 * 1024 + 1024);
  EXPECT_LE(2 * flash_smem_bytes(64, 64, true),
            228 * 1024 - 2 * 1024);  // the SM's 228 KB, 1 KB per block reserved
  // Q (block_m rows) + stages x (K + V) (128 rows each), head_dim bf16 a row, + 1 KB of alignment slack:
  // within 227 KB.
  EXPECT_EQ(flash_smem_bytes(64, 128), 144 * 1024 + 1024);
  EXPECT_EQ(flash_smem_bytes(128, 128), 160 * 1024 + 1024);
  EXPECT_EQ(flash_smem_bytes(64, 192), 152 * 1024 + 1024);
  EXPECT_EQ(flash_smem_bytes(128, 192), 176 * 1024 + 1024);
  for (int d : {64, 128})
    for (int block_m : {128, 192}) EXPECT_LE(flash_smem_bytes(d, block_m), 227 * 1024) << d << " " << block_m;
}

// ---- the variants (step 6) --------------------------------------------------------------------------------

TEST(Flash15Configs, PInSharedMemoryCoversTheSwizzledTileOncePerElement) {
  // p_smem: thread t stores its S registers r, r + 1 (r even) as one bf16 pair at sub-tile col / 64 (8 KB
  // each), offset swizzled_offset_bf16(row, col % 64): the K-major 128-byte-swizzled layout that
  // sw128_kmajor_descriptor reads (Q's, as TMA writes it). Every element of the 64 x 128 tile exactly once,
  // each pair's second element 2 bytes after its first, inside the 16 KB.
  std::vector<int> hits(64 * 128 * 2, 0);
  for (uint32_t t = 0; t < 128; ++t)
    for (uint32_t r = 0; r < 64; r += 2) {
      const FragmentPosition f = accumulator_position(t, r);
      const FragmentPosition g = accumulator_position(t, r + 1);
      ASSERT_EQ(g.row, f.row);
      ASSERT_EQ(g.col, f.col + 1);
      ASSERT_EQ(f.col % 2, 0u);
      const uint32_t offset = f.col / 64 * 8192 + swizzled_offset_bf16(f.row, f.col % 64);
      ASSERT_EQ(offset % 4, 0u);
      ASSERT_LT(offset + 3, 16384u);
      EXPECT_EQ(offset + 2, g.col / 64 * 8192 + swizzled_offset_bf16(g.row, g.col % 64));
      ++hits[offset / 2];
      ++hits[offset / 2 + 1];
    }
  int once = 0;
  for (int h : hits) once += h == 1;
  EXPECT_EQ(once, 64 * 128);
  EXPECT_EQ(flash_smem_bytes(128, 128, true), flash_smem_bytes(128, 128) + 32 * 1024);
  EXPECT_EQ(flash_smem_bytes(64, 192, true), flash_smem_bytes(64, 192) + 48 * 1024);
  EXPECT_LE(flash_smem_bytes(128, 192, true), 227 * 1024);
}

TEST(Flash15Configs, EveryListedConfigIsCompiledAndNamedOnce) {
  for (int64_t d : {64, 128}) {
    const FlashConfigList list = flash_configs(d);
    ASSERT_GE(list.size, 2) << d;
    std::set<std::string> names;
    for (const FlashConfig& c : list) {
      EXPECT_TRUE(flash_wgmma_has_config(d, c)) << c.name << " head_dim " << d;
      EXPECT_TRUE(c.block_m == 64 || c.block_m == 128 || c.block_m == 192) << c.name;
      EXPECT_TRUE(names.insert(c.name).second) << "two configs named " << c.name;
    }
    // The baseline (the kernel as first measured) comes first, so every sweep has it.
    EXPECT_STREQ(list[0].name, "m128");
    EXPECT_FALSE(list[0].overlap);
    EXPECT_EQ(list[0].schedule, FlashSchedule::Plain);
    EXPECT_EQ(list[0].order, FlashOrder::TilesInner);
  }
  // A combination nobody compiled is refused by name, not launched.
  EXPECT_FALSE(flash_wgmma_has_config(
      128, FlashConfig{"x", 192, true, FlashSchedule::PingPong, FlashOrder::HeadsInner}));
  EXPECT_THROW(flash_configs(96), InputError);
}

TEST(Flash15Configs, TheDefaultTablesPointIntoTheirLists) {
  const auto check = [](const auto& defaults, int64_t d) {
    int64_t previous = 0;
    for (const FlashDefault& x : defaults) {
      EXPECT_GE(x.config, 0) << d;
      EXPECT_LT(x.config, flash_configs(d).size) << d;
      EXPECT_GT(x.max_q_len, previous) << d << ": ranges in increasing order";
      previous = x.max_q_len;
    }
    EXPECT_EQ(std::end(defaults)[-1].max_q_len, INT64_MAX) << d << ": the last entry covers the rest";
  };
  check(kFlashDefaults64, 64);
  check(kFlashDefaults128, 128);
  // The default for each length is an entry of the list (same object).
  for (int64_t d : {64, 128})
    for (int64_t n : std::vector<int64_t>{1, 512, 1024, 2048, 4096, 16384, int64_t{1} << 40}) {
      const FlashConfig& c = flash_default_config(d, n);
      const FlashConfigList list = flash_configs(d);
      EXPECT_TRUE(&c >= list.begin() && &c < list.end()) << d << " " << n;
    }
}

// ---- the layouts ----------------------------------------------------------------------------------------

TEST(Flash15Layout, PFeedsTheSecondWgmmaFromTheRegistersItWasComputedIn) {
  // For every thread, K step kk and A value j: accumulator register 8kk + j of S = Q K^T holds the element
  // (row, 16kk + col) where (row, col) is value j's place in the A fragment. So packing S's registers in
  // pairs IS the A operand of P V; no shuffle.
  for (uint32_t t = 0; t < 128; ++t)
    for (uint32_t kk = 0; kk < 8; ++kk)
      for (uint32_t j = 0; j < 8; ++j) {
        const FragmentPosition acc = accumulator_position(t, accumulator_register_for_a(kk, j));
        const FragmentPosition a = a_fragment_position(t, j);
        ASSERT_EQ(acc.row, a.row) << t << " " << kk << " " << j;
        ASSERT_EQ(acc.col, 16 * kk + a.col) << t << " " << kk << " " << j;
      }
  // And the A fragment covers the 64 x 16 operand exactly once.
  std::vector<int> hits(64 * 16, 0);
  for (uint32_t t = 0; t < 128; ++t)
    for (uint32_t j = 0; j < 8; ++j) {
      const FragmentPosition a = a_fragment_position(t, j);
      ASSERT_LT(a.row, 64u);
      ASSERT_LT(a.col, 16u);
      ++hits[a.row * 16 + a.col];
    }
  for (int h : hits) EXPECT_EQ(h, 1);
  // Thread 37 (warp 1, lane 5): rows 16 + 1 and + 8, columns 2 (lane % 4 = 1) and + 8.
  EXPECT_EQ(a_fragment_position(37, 0).row, 17u);
  EXPECT_EQ(a_fragment_position(37, 0).col, 2u);
  EXPECT_EQ(a_fragment_position(37, 3).row, 25u);
  EXPECT_EQ(a_fragment_position(37, 6).col, 10u);
}

TEST(Flash15Layout, TheRingOfStagesAndItsParities) {
  // 3 stages: loads 0..8 use buffers 0,1,2,0,1,2,0,1,2; the consumers' parity flips every round; the
  // producer's is the opposite (round 0 waits for parity 1: a fresh barrier passes it at once).
  const uint32_t stage[9] = {0, 1, 2, 0, 1, 2, 0, 1, 2}, full[9] = {0, 0, 0, 1, 1, 1, 0, 0, 0};
  for (uint32_t i = 0; i < 9; ++i) {
    const RingSlot slot = ring_slot(i, 3);
    EXPECT_EQ(slot.stage, stage[i]) << i;
    EXPECT_EQ(slot.full_parity, full[i]) << i;
    EXPECT_EQ(slot.empty_parity, 1u - full[i]) << i;
  }
  // Load i + stages reuses load i's buffer one phase later.
  for (uint32_t stages : {1u, 2u, 4u})
    for (uint32_t i = 0; i < 20; ++i) {
      EXPECT_EQ(ring_slot(i + stages, stages).stage, ring_slot(i, stages).stage);
      EXPECT_NE(ring_slot(i + stages, stages).full_parity, ring_slot(i, stages).full_parity);
    }
}

TEST(Flash15Layout, TheMnMajorDescriptorOfV) {
  // V [128 keys][64 dims] per sub-tile; the next 64 dims 16 KB later (LBO); 8 keys per 1024-byte atom (SBO).
  const uint64_t d = sw128_mnmajor_descriptor(0x8000, 16384, 0);
  EXPECT_EQ(d & 0x3FFF, 0x800u);               // address >> 4
  EXPECT_EQ((d >> 16) & 0x3FFF, 16384u >> 4);  // LBO
  EXPECT_EQ((d >> 32) & 0x3FFF, 1024u >> 4);   // SBO
  EXPECT_EQ((d >> 62) & 3, 1u);                // 128-byte swizzle
  // K step kk (keys 16kk ..) starts 16 rows of 128 bytes = 2048 bytes further.
  EXPECT_EQ(sw128_mnmajor_descriptor(0x8000, 16384, 3) - d, uint64_t{3 * 2048 >> 4});
}

// ---- the arguments --------------------------------------------------------------------------------------

TEST(Flash15Args, OnlyHeadDim64And128) {
  EXPECT_TRUE(flash_wgmma_supports(AttentionShape{32, 8, 64}));
  EXPECT_TRUE(flash_wgmma_supports(AttentionShape{32, 8, 128, 4096}));
  for (int64_t d : {8, 32, 80, 96, 256}) EXPECT_FALSE(flash_wgmma_supports(AttentionShape{8, 8, d})) << d;
  const AttentionShape s{4, 2, 96};
  EXPECT_NE(input_error_of([&] {
              check_flash_wgmma_args(fake_cuda(DType::BF16, {10, 384}), fake_cuda(DType::BF16, {10, 384}),
                                     fake_cuda(DType::BF16, {10, 192}), fake_cuda(DType::BF16, {10, 192}), 10,
                                     10, s);
            }).find("head_dim must be 64 or 128, got 96"),
            std::string::npos);
}

TEST(Flash15Args, RefusesBadViewsNamingThem) {
  const AttentionShape s{4, 2, 64};  // q_dim 256, kv_dim 128
  const auto q = fake_cuda(DType::BF16, {10, 256}), out = fake_cuda(DType::BF16, {10, 256});
  const auto k = fake_cuda(DType::BF16, {12, 128}), v = fake_cuda(DType::BF16, {12, 128});
  EXPECT_NO_THROW(check_flash_wgmma_args(out, q, k, v, 10, 12, s));
  EXPECT_NE(
      input_error_of([&] { check_flash_wgmma_args(out, q, k, v, 10, 13, s); }).find("flash_wgmma: k must be"),
      std::string::npos);
  EXPECT_NE(input_error_of([&] {
              check_flash_wgmma_args(fake_cuda(DType::F32, {10, 256}), q, k, v, 10, 12, s);
            }).find("out must be bf16 on cuda"),
            std::string::npos);
  // A column slice whose row pitch is not a multiple of 16 bytes: TMA cannot describe it.
  const TensorView wide = fake_cuda(DType::BF16, {12, 132});
  EXPECT_NE(
      input_error_of([&] { check_flash_wgmma_args(out, q, wide.columns(0, 128), v, 10, 12, s); }).find("TMA"),
      std::string::npos);
  // A misaligned start (column 4 of a wide buffer: 8 bytes in).
  const TensorView wider = fake_cuda(DType::BF16, {12, 136});
  EXPECT_NE(input_error_of([&] {
              check_flash_wgmma_args(out, q, k, wider.columns(4, 128), 10, 12, s);
            }).find("16-byte aligned"),
            std::string::npos);
  // A bad shape is lesson 07's error (validate()).
  EXPECT_NE(input_error_of([&] {
              check_flash_wgmma_args(out, q, k, v, 10, 12, AttentionShape{4, 3, 64});
            }),
            "(no InputError)");
}

TEST(Flash15Args, AttentionHopperOnTheCpuIsLesson07sReference) {
  // The engine's hook with CPU views runs lesson 07's CPU reference: the same bits as attention().
  const AttentionShape s{4, 2, 64, 0};
  const std::vector<int64_t> lengths = {5, 17};
  const int64_t T = 22;
  const Tensor q = Tensor::from_f32(random_normal(T * s.q_dim(), 1), {T, s.q_dim()}, DType::F32, Device::CPU);
  const Tensor k =
      Tensor::from_f32(random_normal(T * s.kv_dim(), 2), {T, s.kv_dim()}, DType::F32, Device::CPU);
  const Tensor v =
      Tensor::from_f32(random_uniform(T * s.kv_dim(), 3), {T, s.kv_dim()}, DType::F32, Device::CPU);
  const AttentionBatch batch = AttentionBatch::prefill(lengths, Device::CPU);
  const Tensor a = Tensor::empty({T, s.q_dim()}, DType::F32, Device::CPU);
  const Tensor b = Tensor::empty({T, s.q_dim()}, DType::F32, Device::CPU);
  attention(a, q, k, v, batch, s);
  attention_hopper(b, q, k, v, batch, s);
  EXPECT_EQ(to_f32_vector(a), to_f32_vector(b));
  EXPECT_NE(to_f32_vector(a)[0], 0.0f);
}

TEST(Flash15Args, CausalFlopsCountEveryVisiblePairOnce) {
  const AttentionShape s{32, 8, 64};
  // n = 4: 10 pairs x 4 x 64 x 32 heads.
  EXPECT_DOUBLE_EQ(causal_attention_flops({4}, s), 10.0 * 4 * 64 * 32);
  EXPECT_DOUBLE_EQ(causal_attention_flops({4, 1}, s), 11.0 * 4 * 64 * 32);
}

}  // namespace
}  // namespace tvllm
