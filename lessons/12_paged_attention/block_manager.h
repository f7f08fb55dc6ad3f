// Lesson 12: the block manager. The KV cache as a pool of small blocks, handed out as sequences grow.
//
//   pool (per layer):  block 0 | block 1 | block 2 | ... | block N-1      each block: block_size positions
//
//   sequence A (40 tokens, block_size 16):  block table [7, 2, 9]   tokens 0-15 in block 7, 16-31 in 2, 32-39 in 9
//   sequence B (20 tokens):                 block table [7, 4]      its first 16 tokens equal A's: it SHARES block 7
//
//   KV slot of token p = block_table[p / block_size] * block_size + p % block_size    (the slot mapping)
//
// A sequence wastes at most block_size - 1 positions (its last block), instead of max_context - length in a
// contiguous cache. Blocks are reference counted: a block holding a prefix several sequences share is counted
// once per sequence and returns to the pool when the last one lets go.
//
// Prefix caching. A FULL block whose tokens are all computed is published under a chain hash:
//
//   h(block i) = H(h(block i - 1), the block_size token ids of block i)      h(block -1) = a fixed seed
//
// so equal hashes mean "the same tokens AND the same everything before them". A new sequence walks its full
// blocks in order and reuses each published block that matches, and the scheduler skips those tokens (it must
// still feed at least its last token, to get logits). Hashes can collide: a match also compares the token
// ids stored with the block and the block it follows (its parent), so a collision costs a miss, never a wrong
// hit. When the last sequence lets go of a published block it is not wiped: it waits in an LRU list, still
// findable, and is only recycled (least recently used first) when the free list is empty.
//
// Host-only, plain C++20.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv_allocator.h"

namespace tvllm {

// The default chain hash: 64-bit FNV-1a over the parent's hash (8 bytes, little-endian) and then the token ids
// (4 bytes each, little-endian).
uint64_t hash_block_tokens(uint64_t parent_hash, std::span<const int32_t> tokens);
inline constexpr uint64_t kNoParentHash = 0x6a09e667f3bcc908ull;  // h(block -1)

using BlockHashFn = std::function<uint64_t(uint64_t parent_hash, std::span<const int32_t> tokens)>;

struct BlockManagerConfig {
  int64_t num_blocks = 0;   // blocks in the pool, >= 1
  int64_t block_size = 16;  // positions per block, >= 1
  int64_t max_context = 0;  // positions per sequence; 0: num_blocks * block_size
  bool prefix_caching = true;
  BlockHashFn hash;  // empty: hash_block_tokens (tests pass a colliding one)
};

struct BlockManagerStats {
  int64_t prefix_query_tokens = 0;  // tokens of the sequences allocate() looked up
  int64_t prefix_hit_tokens = 0;    // of those, found in the cache (prefill skipped them)
  int64_t evictions = 0;            // published blocks recycled for new content
  double hit_rate() const {
    return prefix_query_tokens == 0 ? 0.0
                                    : static_cast<double>(prefix_hit_tokens) / static_cast<double>(prefix_query_tokens);
  }
};

class BlockManager final : public KvAllocator {
 public:
  explicit BlockManager(const BlockManagerConfig& config);  // InputError for a bad size

  // ---- KvAllocator -------------------------------------------------------------------------------------
  int64_t max_tokens_per_sequence() const override { return max_context_; }
  int64_t num_kv_slots() const override { return num_blocks() * block_size_; }
  bool fits_alone(int64_t tokens) const override {
    return tokens <= max_context_ && blocks_for(tokens) <= num_blocks();
  }
  int64_t cached_tokens(const Sequence& seq) const override;
  bool can_allocate(const Sequence& seq, int64_t tokens) const override;
  int64_t allocate(Sequence& seq, int64_t tokens) override;
  bool can_append(const Sequence& seq, int64_t tokens) const override;
  void append(Sequence& seq, int64_t tokens) override;
  void computed(Sequence& seq) override;
  void free(Sequence& seq) override;
  int64_t kv_slot(const Sequence& seq, int64_t position) const override;

  // ---- the pool ----------------------------------------------------------------------------------------
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  // Blocks a new allocation can take: never used, released, or published with no user (the LRU list).
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t used_blocks() const { return num_blocks() - free_blocks(); }
  int64_t cached_free_blocks() const { return static_cast<int64_t>(lru_.size()); }  // findable, no user
  int ref_count(int32_t block) const { return blocks_.at(static_cast<size_t>(block)).ref_count; }
  bool is_published(int32_t block) const { return blocks_.at(static_cast<size_t>(block)).published; }
  // The LRU list, least recently used (the next to be recycled) first.
  std::vector<int32_t> lru_order() const { return {lru_.begin(), lru_.end()}; }
  const BlockManagerStats& stats() const { return stats_; }
  // Blocks the first `tokens` positions take.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

 private:
  struct Block {
    int ref_count = 0;
    bool published = false;       // findable by hash (in index_)
    uint64_t hash = 0;            // its chain hash, when published
    std::vector<int32_t> tokens;  // its token ids, when published (compared on a match)
    int32_t parent = -1;          // the block before it in the sequence that published it (-1: the first)
    uint64_t parent_generation = 0;
    // +1 each time the block gets new content: a link to its old content never matches (defensive: the LRU
    // order recycles a child before its parent, so a published child never outlives its parent's content)
    uint64_t generation = 0;
    std::list<int32_t>::iterator lru_pos;  // valid while in lru_
  };
  struct SeqState {
    int64_t published = 0;               // its first `published` blocks are published (or shared published ones)
    uint64_t last_hash = kNoParentHash;  // the chain hash of block published - 1
  };

  uint64_t hash(uint64_t parent_hash, std::span<const int32_t> tokens) const;
  // The published block that holds exactly these tokens after `parent` (-1: at the start), or -1.
  int32_t find_published(uint64_t h, std::span<const int32_t> tokens, int32_t parent) const;
  // The longest run of published blocks equal to seq's first full blocks, leaving its last token uncached.
  std::vector<int32_t> match_prefix(const Sequence& seq) const;
  int32_t take_block();         // from the free list, else the least recently used published block
  void acquire(int32_t block);  // ref_count + 1 (out of the LRU list if it was there)
  void release(int32_t block);  // ref_count - 1; at 0: to the LRU list if published, else the free list
  void unpublish(int32_t block);

  int64_t block_size_, max_context_;
  bool prefix_caching_;
  BlockHashFn hash_fn_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;                         // a stack, the lowest block on top
  std::list<int32_t> lru_;                            // published blocks with ref_count 0, least recently used first
  std::unordered_multimap<uint64_t, int32_t> index_;  // chain hash -> published blocks
  std::unordered_map<int64_t, SeqState> seqs_;        // per sequence id
  BlockManagerStats stats_;
};

}  // namespace tvllm
