// Lesson 12 on the CPU: the block manager. The chain hash (known answers), block tables and the slot mapping,
// growth one block at a time, reference counts, prefix caching (hits, the parent check, forced hash collisions,
// duplicate blocks merged), the LRU eviction order, can_allocate's edge cases, a seeded randomized test against
// a simple model of the pool, and the scheduler over it: 64 requests equal alone with and without prefix caching,
// with a pool small enough to preempt, with a shared system prompt (the expected hit rate) and with aborts; after
// every test every block is back in the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_manager.h"
#include "common/input_error.h"
#include "common/random.h"
#include "scheduler.h"
#include "simulate.h"

namespace tvllm {
namespace {

constexpr int32_t kVocab = 50;

BlockManagerConfig pool(int64_t num_blocks, int64_t block_size, bool caching = true) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.prefix_caching = caching;
  return c;
}

std::vector<int32_t> range_ids(int32_t first, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

Sequence make_seq(int64_t id, std::vector<int32_t> prompt) { return Sequence(id, std::move(prompt), RequestParams{}); }

// Allocates the whole sequence, marks it computed and publishes its full blocks: what a finished prefill does.
void prefill(BlockManager& bm, Sequence& seq) {
  const int64_t expected = bm.cached_tokens(seq);
  EXPECT_EQ(bm.allocate(seq, seq.num_tokens()), expected) << "allocate() returns the cached prefix";
  seq.num_computed = seq.num_tokens();
  bm.computed(seq);
}

// ---- the chain hash ----------------------------------------------------------------------------------------

TEST(PrefixHash12, KnownAnswers) {
  // 64-bit FNV-1a over the parent (8 bytes LE) and the ids (4 bytes LE each), computed independently.
  EXPECT_EQ(hash_block_tokens(0, {}), 0xa8c7f832281a39c5ull);
  const std::vector<int32_t> a{1, 2, 3};
  EXPECT_EQ(hash_block_tokens(kNoParentHash, a), 0x30aff4b7a8d262adull);
  const std::vector<int32_t> b{-1, 70000};
  EXPECT_EQ(hash_block_tokens(kNoParentHash, b), 0xe132eb123fcae8f7ull);
}

TEST(PrefixHash12, DependsOnOrderAndParent) {
  const std::vector<int32_t> ab{1, 2}, ba{2, 1};
  EXPECT_NE(hash_block_tokens(kNoParentHash, ab), hash_block_tokens(kNoParentHash, ba));
  EXPECT_NE(hash_block_tokens(1, ab), hash_block_tokens(2, ab));
  EXPECT_EQ(hash_block_tokens(7, ab), hash_block_tokens(7, ab));
}

// ---- blocks, tables, the slot mapping ----------------------------------------------------------------------

TEST(BlockManagerConfig12, ConfigChecks) {
  EXPECT_THROW(BlockManager(pool(0, 16)), InputError);
  EXPECT_THROW(BlockManager(pool(4, 0)), InputError);
  BlockManager bm(pool(4, 16));
  EXPECT_EQ(bm.num_blocks(), 4);
  EXPECT_EQ(bm.free_blocks(), 4);
  EXPECT_EQ(bm.max_tokens_per_sequence(), 64);
  EXPECT_EQ(bm.num_kv_slots(), 64);
  EXPECT_EQ(bm.blocks_for(0), 0);
  EXPECT_EQ(bm.blocks_for(16), 1);
  EXPECT_EQ(bm.blocks_for(17), 2);
}

TEST(BlockManager12, SlotMapping) {
  BlockManager bm(pool(8, 4, false));
  Sequence a = make_seq(0, range_ids(1, 6)), b = make_seq(1, range_ids(1, 3)), c = make_seq(2, range_ids(1, 10));
  EXPECT_EQ(bm.allocate(a, 6), 0);
  EXPECT_EQ(a.kv_blocks, (std::vector<int32_t>{0, 1}));
  bm.allocate(b, 3);
  EXPECT_EQ(b.kv_blocks, (std::vector<int32_t>{2}));
  bm.free(a);  // blocks 1, 0 back (the last first): the stack gives 0, then 1
  EXPECT_TRUE(a.kv_blocks.empty());
  bm.allocate(c, 10);
  EXPECT_EQ(c.kv_blocks, (std::vector<int32_t>{0, 1, 3}));
  // slot = block_table[p / block_size] * block_size + p % block_size
  const std::vector<int64_t> want{0, 1, 2, 3, 4, 5, 6, 7, 12, 13};
  for (int64_t p = 0; p < 10; ++p) EXPECT_EQ(bm.kv_slot(c, p), want[static_cast<size_t>(p)]) << p;
  EXPECT_EQ(bm.kv_slot(b, 2), 10);
  EXPECT_EQ(bm.kv_slot(c, 11), 15);  // inside its last block: allocated, not yet a token
  EXPECT_THROW(bm.kv_slot(c, 12), std::logic_error);
  EXPECT_THROW(bm.kv_slot(c, -1), std::logic_error);
  bm.free(b);
  bm.free(c);
  EXPECT_EQ(bm.free_blocks(), 8);
}

TEST(BlockManager12, AppendTakesABlockOnlyWhenTheLastIsFull) {
  BlockManager bm(pool(3, 4, false));
  Sequence s = make_seq(0, range_ids(1, 3));
  bm.allocate(s, 3);
  EXPECT_EQ(s.kv_blocks.size(), 1u);
  bm.append(s, 4);  // position 3: still block 0
  EXPECT_EQ(s.kv_blocks.size(), 1u);
  EXPECT_EQ(bm.free_blocks(), 2);
  bm.append(s, 5);  // position 4: a new block
  EXPECT_EQ(s.kv_blocks.size(), 2u);
  bm.append(s, 8);
  EXPECT_EQ(s.kv_blocks.size(), 2u);
  EXPECT_TRUE(bm.can_append(s, 12));
  EXPECT_FALSE(bm.can_append(s, 13));  // 4 blocks: the pool has 3
  bm.append(s, 12);
  EXPECT_EQ(bm.free_blocks(), 0);
  EXPECT_THROW(bm.append(s, 13), std::logic_error);
  EXPECT_EQ(s.kv_blocks.size(), 3u);
  bm.free(s);
  EXPECT_EQ(bm.free_blocks(), 3);
}

TEST(BlockManager12, ExactlyFullBlock) {
  BlockManager bm(pool(4, 16));
  Sequence a = make_seq(0, range_ids(1, 16));
  prefill(bm, a);
  EXPECT_EQ(a.kv_blocks.size(), 1u);  // 16 tokens: one full block, nothing over
  EXPECT_TRUE(bm.is_published(a.kv_blocks[0]));
  a.output.push_back(5);  // the decode of position 16 needs a second block
  EXPECT_TRUE(bm.can_append(a, 17));
  bm.append(a, 17);
  EXPECT_EQ(a.kv_blocks.size(), 2u);
  // The same 16 tokens alone: all of them cached would leave no token to feed, so no hit at all.
  Sequence same = make_seq(1, range_ids(1, 16));
  EXPECT_EQ(bm.cached_tokens(same), 0);
  // 17 tokens, the first 16 equal: the full block is shared, one token left to feed.
  Sequence longer = make_seq(2, range_ids(1, 17));
  EXPECT_EQ(bm.cached_tokens(longer), 16);
  EXPECT_EQ(bm.allocate(longer, 17), 16);
  EXPECT_EQ(longer.kv_blocks[0], a.kv_blocks[0]);
  EXPECT_EQ(bm.ref_count(a.kv_blocks[0]), 2);
  bm.free(a);
  bm.free(longer);
  EXPECT_EQ(bm.free_blocks(), 4);
}

TEST(BlockManager12, CanAllocateEdgeCases) {
  BlockManager bm(pool(4, 4));
  Sequence s = make_seq(0, range_ids(1, 20));
  EXPECT_FALSE(bm.can_allocate(s, 0));
  EXPECT_TRUE(bm.can_allocate(s, 16));   // exactly the pool
  EXPECT_FALSE(bm.can_allocate(s, 17));  // one token more: a fifth block
  BlockManagerConfig c = pool(8, 4);
  c.max_context = 10;
  BlockManager limited(c);
  EXPECT_TRUE(limited.can_allocate(s, 10));
  EXPECT_FALSE(limited.can_allocate(s, 11));  // past max_context, though blocks are free
  EXPECT_TRUE(limited.fits_alone(10));
  EXPECT_FALSE(limited.fits_alone(11));
  BlockManagerConfig big = pool(2, 4);
  big.max_context = 100;  // a context longer than the pool: what fits alone is the pool
  EXPECT_TRUE(BlockManager(big).fits_alone(8));
  EXPECT_FALSE(BlockManager(big).fits_alone(9));
  // A sequence that already holds blocks must append, not allocate.
  Sequence t = make_seq(1, range_ids(1, 4));
  bm.allocate(t, 4);
  EXPECT_FALSE(bm.can_allocate(t, 4));
  EXPECT_THROW(bm.allocate(t, 4), std::logic_error);
  EXPECT_FALSE(bm.can_append(make_seq(2, {1}), 1));  // holds nothing: allocate first
  bm.free(t);
  bm.free(t);  // a second free is harmless
  EXPECT_EQ(bm.free_blocks(), 4);
}

TEST(BlockManager12, IdleHitBlocksCountAgainstTheFreePool) {
  // 4 blocks of 4. A publishes 2 blocks and finishes: they sit in the LRU list (free, but findable).
  BlockManager bm(pool(4, 4));
  Sequence a = make_seq(0, range_ids(1, 9));
  prefill(bm, a);
  bm.free(a);
  EXPECT_EQ(bm.free_blocks(), 4);
  EXPECT_EQ(bm.cached_free_blocks(), 2);
  // B shares A's 8 tokens and brings 8 of its own: 2 hit blocks (idle) + 2 fresh = the whole pool.
  Sequence b = make_seq(1, range_ids(1, 16));
  EXPECT_EQ(bm.cached_tokens(b), 8);
  EXPECT_TRUE(bm.can_allocate(b, 16));
  EXPECT_FALSE(bm.can_allocate(b, 17));  // 3 fresh + 2 idle hits > 4
  EXPECT_EQ(bm.allocate(b, 16), 8);
  EXPECT_EQ(bm.free_blocks(), 0);
  bm.free(b);
  EXPECT_EQ(bm.free_blocks(), 4);
}

TEST(BlockManager12, PrefixHitSharesBlocks) {
  BlockManager bm(pool(16, 4));
  Sequence a = make_seq(0, range_ids(1, 10));  // blocks: [1..4] [5..8] [9 10]
  prefill(bm, a);
  EXPECT_TRUE(bm.is_published(a.kv_blocks[0]));
  EXPECT_TRUE(bm.is_published(a.kv_blocks[1]));
  EXPECT_FALSE(bm.is_published(a.kv_blocks[2]));  // not full
  EXPECT_EQ(bm.stats().prefix_query_tokens, 10);
  EXPECT_EQ(bm.stats().prefix_hit_tokens, 0);

  std::vector<int32_t> p = range_ids(1, 8);
  p.push_back(40);
  p.push_back(41);
  Sequence b = make_seq(1, p);  // the first 8 tokens equal a's
  EXPECT_EQ(bm.allocate(b, 10), 8);
  EXPECT_EQ(b.kv_blocks[0], a.kv_blocks[0]);
  EXPECT_EQ(b.kv_blocks[1], a.kv_blocks[1]);
  EXPECT_NE(b.kv_blocks[2], a.kv_blocks[2]);
  EXPECT_EQ(bm.ref_count(a.kv_blocks[0]), 2);
  EXPECT_EQ(bm.ref_count(a.kv_blocks[2]), 1);
  EXPECT_EQ(bm.used_blocks(), 4);
  EXPECT_EQ(bm.stats().prefix_query_tokens, 20);
  EXPECT_EQ(bm.stats().prefix_hit_tokens, 8);
  EXPECT_DOUBLE_EQ(bm.stats().hit_rate(), 0.4);

  // One token differs in the second block: only the first is shared.
  std::vector<int32_t> q = range_ids(1, 10);
  q[6] = 49;
  Sequence c = make_seq(2, q);
  EXPECT_EQ(bm.cached_tokens(c), 4);

  const int32_t shared = a.kv_blocks[0];
  bm.free(a);  // the shared blocks stay with b
  EXPECT_EQ(bm.ref_count(shared), 1);
  EXPECT_EQ(bm.free_blocks(), 16 - 3);
  bm.free(b);
  EXPECT_EQ(bm.ref_count(shared), 0);
  EXPECT_EQ(bm.free_blocks(), 16);
  EXPECT_EQ(bm.cached_free_blocks(), 2);  // published, idle, still findable
  EXPECT_EQ(bm.cached_tokens(c), 4);
}

TEST(BlockManager12, PrefixNeedsParentToo) {
  // [X][Y] and [Z][Y]: the second blocks hold the same tokens after different prefixes: never shared.
  BlockManager bm(pool(16, 4));
  std::vector<int32_t> xy = range_ids(1, 4), zy = range_ids(20, 4);
  const std::vector<int32_t> y = range_ids(30, 4);
  xy.insert(xy.end(), y.begin(), y.end());
  zy.insert(zy.end(), y.begin(), y.end());
  xy.push_back(1);
  zy.push_back(1);
  Sequence a = make_seq(0, xy), b = make_seq(1, zy);
  prefill(bm, a);
  EXPECT_EQ(bm.cached_tokens(b), 0);
  prefill(bm, b);
  EXPECT_NE(a.kv_blocks[1], b.kv_blocks[1]);
  bm.free(a);
  bm.free(b);
  EXPECT_EQ(bm.free_blocks(), 16);
}

TEST(BlockManager12, ForcedCollisions) {
  // Every block hashes to 42: only the stored tokens and the parent link tell blocks apart.
  BlockManagerConfig c = pool(32, 4);
  c.hash = [](uint64_t, std::span<const int32_t>) { return uint64_t{42}; };
  BlockManager bm(c);
  std::vector<int32_t> xy = range_ids(1, 4), zy = range_ids(20, 4);
  const std::vector<int32_t> y = range_ids(30, 4);
  xy.insert(xy.end(), y.begin(), y.end());
  zy.insert(zy.end(), y.begin(), y.end());
  xy.push_back(1);
  zy.push_back(1);
  Sequence a = make_seq(0, xy), b = make_seq(1, zy);
  prefill(bm, a);
  EXPECT_EQ(bm.cached_tokens(b), 0) << "a hash collision must not make a hit";
  prefill(bm, b);
  EXPECT_NE(a.kv_blocks[1], b.kv_blocks[1]);
  Sequence a2 = make_seq(2, xy), b2 = make_seq(3, zy);  // the real hits still work
  EXPECT_EQ(bm.allocate(a2, 9), 8);
  EXPECT_EQ(bm.allocate(b2, 9), 8);
  EXPECT_EQ(a2.kv_blocks[1], a.kv_blocks[1]);
  EXPECT_EQ(b2.kv_blocks[1], b.kv_blocks[1]);
  for (Sequence* s : {&a, &b, &a2, &b2}) bm.free(*s);
  EXPECT_EQ(bm.free_blocks(), 32);
}

TEST(BlockManager12, RecycledBlocksAreNoLongerFound) {
  // [A][B] published and idle; new content recycles both: a new [A][B] finds nothing.
  BlockManager bm(pool(3, 2));
  Sequence ab = make_seq(0, {1, 2, 3, 4, 5});
  prefill(bm, ab);  // blocks 0 [1 2], 1 [3 4], 2 [5]
  bm.free(ab);      // LRU: 1 (the tail first), 0; block 2 to the free list
  Sequence other = make_seq(1, {7, 8, 9, 9, 9});
  EXPECT_TRUE(bm.can_allocate(other, 5));
  bm.allocate(other, 5);  // block 2, then recycles 1, then 0
  EXPECT_EQ(bm.stats().evictions, 2);
  bm.free(other);
  Sequence again = make_seq(2, {1, 2, 3, 4, 5});
  EXPECT_EQ(bm.cached_tokens(again), 0);
  EXPECT_EQ(bm.free_blocks(), 3);
}

TEST(BlockManager12, DuplicateBlocksAreMerged) {
  // Two sequences with the same prompt admitted in the same step both miss and compute the same blocks.
  BlockManager bm(pool(16, 4));
  Sequence a = make_seq(0, range_ids(1, 9)), b = make_seq(1, range_ids(1, 9));
  bm.allocate(a, 9);
  bm.allocate(b, 9);
  EXPECT_EQ(bm.used_blocks(), 6);
  a.num_computed = b.num_computed = 9;
  bm.computed(a);
  bm.computed(b);  // b's copies of the two full blocks are replaced by a's and freed
  EXPECT_EQ(b.kv_blocks[0], a.kv_blocks[0]);
  EXPECT_EQ(b.kv_blocks[1], a.kv_blocks[1]);
  EXPECT_NE(b.kv_blocks[2], a.kv_blocks[2]);
  EXPECT_EQ(bm.ref_count(a.kv_blocks[0]), 2);
  EXPECT_EQ(bm.used_blocks(), 4);
  bm.free(a);
  bm.free(b);
  EXPECT_EQ(bm.free_blocks(), 16);
  EXPECT_EQ(bm.cached_free_blocks(), 2);
}

TEST(BlockManager12, LruEvictionOrder) {
  BlockManager bm(pool(6, 2));
  Sequence a = make_seq(0, {1, 2, 3, 4, 5}), b = make_seq(1, {6, 7, 8, 9, 10});
  prefill(bm, a);  // 0 [1 2] 1 [3 4] 2 [5]
  prefill(bm, b);  // 3 [6 7] 4 [8 9] 5 [10]
  bm.free(a);
  bm.free(b);
  // Released last block first, so each sequence's tail is recycled before its prefix; a before b.
  EXPECT_EQ(bm.lru_order(), (std::vector<int32_t>{1, 0, 4, 3}));
  EXPECT_EQ(bm.cached_free_blocks(), 4);
  // A hit takes a block out of the LRU list; releasing it puts it back at the most recent end.
  Sequence a_again = make_seq(2, {1, 2, 9});
  EXPECT_EQ(bm.allocate(a_again, 3), 2);
  EXPECT_EQ(bm.lru_order(), (std::vector<int32_t>{1, 4, 3}));
  bm.free(a_again);
  EXPECT_EQ(bm.lru_order(), (std::vector<int32_t>{1, 4, 3, 0}));
  // New content, 4 blocks: the free list first (2 and 5), then the LRU front: 1, then 4.
  Sequence c = make_seq(3, range_ids(20, 8));
  bm.allocate(c, 8);
  EXPECT_EQ(c.kv_blocks, (std::vector<int32_t>{5, 2, 1, 4}));
  EXPECT_EQ(bm.stats().evictions, 2);
  EXPECT_EQ(bm.lru_order(), (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(bm.cached_tokens(make_seq(4, {1, 2, 3, 4, 5})), 2);   // a's first block survived, its second did not
  EXPECT_EQ(bm.cached_tokens(make_seq(5, {6, 7, 8, 9, 10})), 2);  // b's likewise
  bm.free(c);
  EXPECT_EQ(bm.free_blocks(), 6);
}

TEST(BlockManager12, PrefixCachingOffPublishesNothing) {
  BlockManager bm(pool(8, 4, false));
  Sequence a = make_seq(0, range_ids(1, 9));
  prefill(bm, a);
  EXPECT_FALSE(bm.is_published(a.kv_blocks[0]));
  bm.free(a);
  EXPECT_EQ(bm.cached_free_blocks(), 0);
  EXPECT_EQ(bm.cached_tokens(make_seq(1, range_ids(1, 9))), 0);
}

// ---- randomized, against a model of the pool -------------------------------------------------------------

// Random allocate / grow / compute / free / finish on up to 12 live sequences drawn from a few shared prefixes.
// After every operation: each block's ref_count equals the number of live tables that hold it; a block is held
// at most once per table; free + used == total; a published block is never in a table as an uncomputed
// position; and the simulated KV content of every computed position of every live sequence is its token (a
// wrong share or a block recycled while in use would overwrite it).
TEST(BlockManager12, RandomizedAgainstAModel) {
  for (const uint64_t seed : {1u, 2u, 3u, 4u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Rng rng(seed);
    const int64_t bs = 1 + rng.below(6);
    BlockManagerConfig c = pool(24 + rng.below(40), bs);
    if (seed == 4) c.hash = [](uint64_t parent, std::span<const int32_t> t) { return (parent + t.size()) % 3; };
    BlockManager bm(c);
    std::vector<int32_t> content(static_cast<size_t>(bm.num_kv_slots()), -1);
    std::vector<std::vector<int32_t>> prefixes;
    for (int k = 0; k < 3; ++k) prefixes.push_back(range_ids(static_cast<int32_t>(100 * k), 3 + rng.below(20)));
    std::vector<std::unique_ptr<Sequence>> live;
    int64_t next_id = 0, hits = 0;
    for (int op = 0; op < 3000; ++op) {
      const int64_t kind = rng.below(10);
      if (kind < 3 && live.size() < 12) {  // a new sequence: a shared prefix + its own tokens
        std::vector<int32_t> p = prefixes[static_cast<size_t>(rng.below(3))];
        p.resize(static_cast<size_t>(rng.below(static_cast<int64_t>(p.size())) + 1));
        for (int64_t i = rng.below(12); i > 0; --i) p.push_back(static_cast<int32_t>(1000 + rng.below(4)));
        auto s = std::make_unique<Sequence>(next_id++, p, RequestParams{});
        const int64_t cached = bm.cached_tokens(*s);
        ASSERT_EQ(cached % bs, 0);
        ASSERT_LT(cached, s->num_tokens());
        const int64_t want = std::min<int64_t>(s->num_tokens(), cached + 1 + rng.below(8));
        const int64_t free_before = bm.free_blocks();
        if (bm.can_allocate(*s, want)) {
          ASSERT_EQ(bm.allocate(*s, want), cached);
          // The model: it took the fresh blocks it needs and the hit blocks that were idle (now used once).
          const int64_t hit_blocks = cached / bs;
          int64_t idle = 0;
          for (int64_t i = 0; i < hit_blocks; ++i) idle += bm.ref_count(s->kv_blocks[static_cast<size_t>(i)]) == 1;
          ASSERT_EQ(free_before - bm.free_blocks(), bm.blocks_for(want) - hit_blocks + idle);
          s->num_computed = cached;
          hits += cached > 0;
          live.push_back(std::move(s));
        } else {
          ASSERT_LT(free_before, bm.blocks_for(want)) << "refused though the pool had room";
        }
      } else if (kind < 6 && !live.empty()) {  // compute some tokens (growing first), maybe generate one
        Sequence& s = *live[static_cast<size_t>(rng.below(static_cast<int64_t>(live.size())))];
        if (s.num_uncomputed() == 0) s.output.push_back(static_cast<int32_t>(rng.below(3)));
        const int64_t n = 1 + rng.below(std::min<int64_t>(s.num_uncomputed(), 6));
        const int64_t target = s.num_computed + n;
        const int64_t fresh = bm.blocks_for(target) - static_cast<int64_t>(s.kv_blocks.size());
        ASSERT_EQ(bm.can_append(s, target), fresh <= bm.free_blocks());
        if (!bm.can_append(s, target)) continue;
        bm.append(s, target);
        for (int64_t p = s.num_computed; p < target; ++p) {
          const int32_t b = s.kv_blocks[static_cast<size_t>(p / bs)];
          ASSERT_EQ(bm.ref_count(b), 1) << "a write into a shared block";
          ASSERT_FALSE(bm.is_published(b)) << "a write into a published block";
          content[static_cast<size_t>(bm.kv_slot(s, p))] = s.token(p);
        }
        s.num_computed = target;
        bm.computed(s);
      } else if (!live.empty()) {  // free one
        const size_t i = static_cast<size_t>(rng.below(static_cast<int64_t>(live.size())));
        bm.free(*live[i]);
        EXPECT_TRUE(live[i]->kv_blocks.empty());
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      // The invariants.
      std::map<int32_t, int> refs;
      for (const auto& s : live) {
        std::set<int32_t> mine(s->kv_blocks.begin(), s->kv_blocks.end());
        ASSERT_EQ(mine.size(), s->kv_blocks.size()) << "a block twice in one table";
        for (int32_t b : s->kv_blocks) ++refs[b];
        for (int64_t p = 0; p < s->num_computed; ++p)
          ASSERT_EQ(content[static_cast<size_t>(bm.kv_slot(*s, p))], s->token(p))
              << "sequence " << s->id << " position " << p << " after op " << op;
      }
      for (int32_t b = 0; b < bm.num_blocks(); ++b) ASSERT_EQ(bm.ref_count(b), refs.count(b) ? refs[b] : 0) << b;
      ASSERT_EQ(bm.used_blocks(), static_cast<int64_t>(refs.size()));
    }
    for (auto& s : live) bm.free(*s);
    EXPECT_EQ(bm.free_blocks(), bm.num_blocks());
    if (seed != 4) {
      EXPECT_GT(hits, 10) << "the workload was meant to share prefixes";
    }
  }
}

// ---- the scheduler over the block manager ----------------------------------------------------------------

SchedulerConfig sched(int64_t budget, int64_t max_sequences, int64_t max_context) {
  SchedulerConfig c;
  c.max_tokens_per_step = budget;
  c.max_sequences = max_sequences;
  c.max_context = max_context;
  c.eos_ids = {0};
  return c;
}

// Runs to the end; every step checks the budget, that decodes are never stalled, and that no new token is
// written into a block that is shared or published. Returns the preemptions seen. async: lesson 14's async
// scheduling (advance the step in flight, schedule and run the next, then resolve the one in flight).
int64_t drive(Scheduler& s, BlockManager& bm, FakeModel& model, const std::function<void(int64_t)>& before = {},
              bool async = false) {
  int64_t steps = 0, preempted = 0;
  std::optional<ScheduledBatch> in_flight;
  std::vector<int32_t> in_flight_ids;
  for (;;) {
    if (in_flight) s.advance(*in_flight);
    if (before) before(steps);
    if (!s.has_work() && !in_flight) break;
    EXPECT_LT(steps, 100000);
    if (steps >= 100000) break;
    std::set<int64_t> ready;
    for (const Sequence* q : s.running())
      if (q->num_uncomputed() == 1) ready.insert(q->id);
    ScheduledBatch batch = s.schedule();
    if (batch.empty() && in_flight) {  // only the step in flight is left: its ids
      s.resolve(*in_flight, in_flight_ids);
      in_flight.reset();
      continue;
    }
    EXPECT_FALSE(batch.empty());
    if (batch.empty()) break;
    EXPECT_LE(batch.num_tokens(), s.config().max_tokens_per_step);
    for (const ScheduledSequence& q : batch.seqs) ready.erase(q.seq->id);
    for (const int64_t id : batch.preempted) ready.erase(id);
    EXPECT_TRUE(ready.empty()) << "a decode was stalled at step " << steps;
    for (const int64_t slot : batch.slot_mapping) {
      const auto block = static_cast<int32_t>(slot / bm.block_size());
      EXPECT_EQ(bm.ref_count(block), 1) << "a KV write into a shared block";
      EXPECT_FALSE(bm.is_published(block)) << "a KV write into a published block";
    }
    preempted += static_cast<int64_t>(batch.preempted.size());
    ++steps;
    if (!async) {
      s.postprocess(batch, model.step(batch, bm));
      continue;
    }
    batch.token_ids = batch.token_ids_filled(in_flight_ids);
    std::vector<int32_t> ids = model.step(batch, bm);
    if (in_flight) s.resolve(*in_flight, in_flight_ids);
    in_flight = std::move(batch);
    in_flight_ids = std::move(ids);
  }
  return preempted;
}

void expect_equal_alone(const Scheduler& s, const std::vector<SimRequest>& requests, const std::vector<int64_t>& ids,
                        int64_t max_context, const std::set<int64_t>& skip = {}) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const Sequence* seq = s.find(ids[i]);
    ASSERT_NE(seq, nullptr);
    ASSERT_TRUE(seq->is_finished());
    if (skip.count(ids[i])) continue;
    EXPECT_EQ(seq->output, reference_output(requests[i].prompt, requests[i].params, {0}, max_context, kVocab))
        << "request " << i;
  }
}

TEST(PagedSim12, SixtyFourRequestsEqualAloneWithAndWithoutPrefixCaching) {
  const std::vector<SimRequest> requests = make_workload(64, 1, 300, 1, 100, kVocab, 21);
  for (const bool caching : {false, true}) {
    SCOPED_TRACE(caching ? "prefix caching on" : "prefix caching off");
    BlockManagerConfig c = pool(400, 16, caching);
    c.max_context = 512;
    BlockManager bm(c);
    Scheduler s(sched(128, 32, 512), bm);
    FakeModel model(bm.num_kv_slots(), kVocab);
    std::vector<int64_t> ids;
    for (const SimRequest& r : requests) ids.push_back(s.add(r.prompt, r.params));
    drive(s, bm, model);
    expect_equal_alone(s, requests, ids, 512);
    EXPECT_EQ(bm.free_blocks(), bm.num_blocks());
    EXPECT_EQ(bm.used_blocks(), 0);
  }
}

TEST(PagedSim12, SmallPoolPreemptsAndOutputsStayEqual) {
  // Also with lesson 14's async scheduling: blocks published by advance() before the step's ids are back,
  // preemptions of sequences whose id is in flight, prefix hits on blocks the step in flight fills.
  const std::vector<SimRequest> requests = make_workload(64, 1, 200, 1, 150, kVocab, 22);
  for (const auto& [caching, async] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(std::string(caching ? "prefix caching on" : "prefix caching off") + (async ? ", async" : ""));
    BlockManagerConfig c = pool(30, 16, caching);
    c.max_context = 384;
    BlockManager bm(c);
    Scheduler s(sched(64, 16, 384), bm);
    FakeModel model(bm.num_kv_slots(), kVocab);
    std::vector<int64_t> ids;
    for (const SimRequest& r : requests) ids.push_back(s.add(r.prompt, r.params));
    const int64_t preempted = drive(s, bm, model, {}, async);
    EXPECT_GT(preempted, 0) << "the pool was meant to run out";
    EXPECT_EQ(s.stats().preemptions, preempted);
    expect_equal_alone(s, requests, ids, 384);
    EXPECT_EQ(bm.free_blocks(), bm.num_blocks());
  }
}

TEST(PagedSim12, SharedSystemPrompt) {
  // 64 requests = the same 96-token system prompt (6 blocks of 16) + 10..50 tokens of their own. The first runs
  // alone first: every later one must find exactly the 96 system tokens in the cache.
  Rng rng(5);
  std::vector<int32_t> system(96);
  for (int32_t& t : system) t = static_cast<int32_t>(1 + rng.below(kVocab - 1));
  std::vector<SimRequest> requests = make_workload(64, 10, 50, 1, 40, kVocab, 23);
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt.insert(requests[i].prompt.begin(), system.begin(), system.end());
    requests[i].prompt[96] = static_cast<int32_t>(i % (kVocab - 1)) + 1;  // no two share their 7th block by chance
    requests[i].prompt[97] = static_cast<int32_t>(i / (kVocab - 1));
    prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
  }
  for (const bool collide : {false, true}) {
    SCOPED_TRACE(collide ? "every hash collides" : "FNV-1a");
    BlockManagerConfig c = pool(600, 16);
    c.max_context = 256;
    if (collide) c.hash = [](uint64_t, std::span<const int32_t>) { return uint64_t{7}; };
    BlockManager bm(c);
    Scheduler s(sched(256, 64, 256), bm);
    FakeModel model(bm.num_kv_slots(), kVocab);
    std::vector<int64_t> ids{s.add(requests[0].prompt, requests[0].params)};
    drive(s, bm, model);
    for (size_t i = 1; i < requests.size(); ++i) ids.push_back(s.add(requests[i].prompt, requests[i].params));
    drive(s, bm, model);
    expect_equal_alone(s, requests, ids, 256);
    EXPECT_EQ(s.stats().preemptions, 0);
    EXPECT_EQ(bm.stats().prefix_query_tokens, prompt_tokens);
    EXPECT_EQ(bm.stats().prefix_hit_tokens, 63 * 96);
    EXPECT_DOUBLE_EQ(bm.stats().hit_rate(), 63.0 * 96.0 / static_cast<double>(prompt_tokens));
    EXPECT_EQ(s.stats().prefill_tokens, prompt_tokens - 63 * 96);  // the hits were never fed
    for (size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(s.find(ids[i])->num_cached_tokens, 96);
    EXPECT_EQ(bm.free_blocks(), bm.num_blocks());
  }
}

TEST(PagedSim12, AbortFreesBlocksAtOnce) {
  const std::vector<SimRequest> requests = make_workload(64, 20, 150, 20, 100, kVocab, 24);
  BlockManagerConfig c = pool(200, 16);
  c.max_context = 300;
  BlockManager bm(c);
  Scheduler s(sched(96, 24, 300), bm);
  FakeModel model(bm.num_kv_slots(), kVocab);
  std::vector<int64_t> ids;
  for (const SimRequest& r : requests) ids.push_back(s.add(r.prompt, r.params));
  std::set<int64_t> aborted;
  drive(s, bm, model, [&](int64_t step) {
    if (step % 7 != 3 || s.running().empty()) return;
    Sequence* victim = s.running().back();
    // Its blocks no other sequence holds come back now (shared ones only lose a reference).
    int64_t exclusive = 0;
    for (int32_t b : victim->kv_blocks) exclusive += bm.ref_count(b) == 1;
    const int64_t before = bm.free_blocks();
    ASSERT_TRUE(s.abort(victim->id));
    EXPECT_EQ(bm.free_blocks(), before + exclusive);
    EXPECT_TRUE(victim->kv_blocks.empty());
    aborted.insert(victim->id);
  });
  EXPECT_GT(aborted.size(), 3u);
  expect_equal_alone(s, requests, ids, 300, aborted);
  EXPECT_EQ(bm.free_blocks(), bm.num_blocks());
}

}  // namespace
}  // namespace tvllm
