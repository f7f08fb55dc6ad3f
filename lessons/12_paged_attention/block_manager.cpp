// Lesson 12: the block manager (block_manager.h).
#include "block_manager.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

#include "common/exercise.h"
#include "common/input_error.h"

namespace tvllm {

uint64_t hash_block_tokens(uint64_t parent_hash, std::span<const int32_t> tokens) {
  // --- exercise 12.1: the chain hash ------------------------------------------------------------------------
  // Task: 64-bit FNV-1a over the 8 bytes of parent_hash (least significant byte first), then the 4 bytes of
  //   each token id (least significant byte first, the id read as uint32_t). FNV-1a starts from the offset
  //   basis 0xcbf29ce484222325 and, for each byte: hash ^= byte; hash *= 0x100000001b3 (the FNV prime).
  // Hint: the bytes are fixed by the definition, not by the machine: shift and mask (x >> (8 * i)) & 0xff
  //   rather than reinterpreting memory, and the hash is the same on every host.
  // Tests: PrefixHash12.* BlockManager12.PrefixHitSharesBlocks BlockManager12.PrefixNeedsParentToo
  // Tests: PagedSim12.SharedSystemPrompt
  // Stub:
  //   (void)parent_hash;
  //   (void)tokens;
  //   throw NotWrittenYet("12.1", "the chain hash");
  // --- solution ---
  constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < 8; ++i) {
    h ^= (parent_hash >> (8 * i)) & 0xff;
    h *= kPrime;
  }
  for (const int32_t token : tokens) {
    const auto u = static_cast<uint32_t>(token);
    for (int i = 0; i < 4; ++i) {
      h ^= (u >> (8 * i)) & 0xff;
      h *= kPrime;
    }
  }
  return h;
  // --- end of exercise 12.1 ---
}

BlockManager::BlockManager(const BlockManagerConfig& config)
    : block_size_(config.block_size), prefix_caching_(config.prefix_caching), hash_fn_(config.hash) {
  TVLLM_REQUIRE(config.num_blocks >= 1 && config.num_blocks <= INT32_MAX,
                "block manager: num_blocks must be in [1, 2^31), got " + std::to_string(config.num_blocks));
  TVLLM_REQUIRE(config.block_size >= 1 && config.block_size <= 4096,
                "block manager: block_size must be in [1, 4096], got " + std::to_string(config.block_size));
  TVLLM_REQUIRE(config.max_context >= 0, "block manager: max_context must be >= 0 (0: the whole pool)");
  max_context_ = config.max_context == 0 ? config.num_blocks * config.block_size : config.max_context;
  blocks_.resize(static_cast<size_t>(config.num_blocks));
  for (int64_t b = config.num_blocks; b-- > 0;) free_.push_back(static_cast<int32_t>(b));  // block 0 on top
}

uint64_t BlockManager::hash(uint64_t parent_hash, std::span<const int32_t> tokens) const {
  return hash_fn_ ? hash_fn_(parent_hash, tokens) : hash_block_tokens(parent_hash, tokens);
}

int32_t BlockManager::find_published(uint64_t h, std::span<const int32_t> tokens, int32_t parent) const {
  const auto [first, last] = index_.equal_range(h);
  for (auto it = first; it != last; ++it) {
    const Block& b = blocks_[static_cast<size_t>(it->second)];
    // Equal hashes are a hint; equal tokens after the very same parent block (same content) are the proof.
    if (b.parent == parent && (parent < 0 || b.parent_generation == blocks_[static_cast<size_t>(parent)].generation) &&
        std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin(), tokens.end()))
      return it->second;
  }
  return -1;
}

namespace {
// Token ids [first, first + n) of a sequence (prompt and output are two vectors).
std::vector<int32_t> tokens_of(const Sequence& seq, int64_t first, int64_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = seq.token(first + i);
  return t;
}
}  // namespace

std::vector<int32_t> BlockManager::match_prefix(const Sequence& seq) const {
  std::vector<int32_t> hits;
  if (!prefix_caching_) return hits;
  const int64_t full = (seq.num_tokens() - 1) / block_size_;  // the last token is always fed
  uint64_t h = kNoParentHash;
  int32_t parent = -1;
  for (int64_t i = 0; i < full; ++i) {
    const std::vector<int32_t> tokens = tokens_of(seq, i * block_size_, block_size_);
    h = hash(h, tokens);
    const int32_t b = find_published(h, tokens, parent);
    if (b < 0) break;
    hits.push_back(b);
    parent = b;
  }
  return hits;
}

int64_t BlockManager::cached_tokens(const Sequence& seq) const {
  return static_cast<int64_t>(match_prefix(seq).size()) * block_size_;
}

bool BlockManager::can_allocate(const Sequence& seq, int64_t tokens) const {
  if (!seq.kv_blocks.empty() || tokens < 1 || tokens > max_context_) return false;
  const std::vector<int32_t> hits = match_prefix(seq);
  // Hit blocks nobody uses sit in the LRU list, counted as free: taking them leaves fewer for the rest.
  const auto idle_hits = std::count_if(hits.begin(), hits.end(), [&](int32_t b) { return ref_count(b) == 0; });
  const int64_t fresh = std::max<int64_t>(0, blocks_for(tokens) - static_cast<int64_t>(hits.size()));
  return fresh + idle_hits <= free_blocks();
}

int32_t BlockManager::take_block() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {  // recycle the least recently used published block
    b = lru_.front();
    lru_.pop_front();
    unpublish(b);
    ++stats_.evictions;
  } else {
    throw std::logic_error("block manager: out of blocks (call can_allocate / can_append first)");
  }
  Block& block = blocks_[static_cast<size_t>(b)];
  block.ref_count = 1;
  ++block.generation;  // new content: links to its old content no longer match
  return b;
}

void BlockManager::unpublish(int32_t b) {
  Block& block = blocks_[static_cast<size_t>(b)];
  const auto [first, last] = index_.equal_range(block.hash);
  for (auto it = first; it != last; ++it) {
    if (it->second == b) {
      index_.erase(it);
      break;
    }
  }
  block.published = false;
  block.tokens.clear();
  block.parent = -1;
}

void BlockManager::acquire(int32_t b) {
  Block& block = blocks_[static_cast<size_t>(b)];
  if (block.ref_count == 0) {
    if (!block.published) throw std::logic_error("block manager: acquire() of a free block");
    lru_.erase(block.lru_pos);
  }
  ++block.ref_count;
}

void BlockManager::release(int32_t b) {
  Block& block = blocks_[static_cast<size_t>(b)];
  if (block.ref_count <= 0) throw std::logic_error("block manager: release() of an unused block " + std::to_string(b));
  if (--block.ref_count > 0) return;
  if (block.published) {
    lru_.push_back(b);  // the most recently used end
    block.lru_pos = std::prev(lru_.end());
  } else {
    free_.push_back(b);
  }
}

int64_t BlockManager::allocate(Sequence& seq, int64_t tokens) {
  if (!can_allocate(seq, tokens))
    throw std::logic_error("block manager: allocate() of " + std::to_string(tokens) + " tokens for sequence " +
                           std::to_string(seq.id) + " that can_allocate() refuses");
  // --- exercise 12.2: allocate: the cached prefix, then fresh blocks -------------------------------------------
  // Task: give a sequence that holds nothing its block table (seq.kv_blocks): first the published blocks of
  //   its cached prefix (match_prefix(seq)), each acquired (shared: ref_count + 1), then fresh blocks
  //   (take_block()) until the table covers its first `tokens` positions. Record in seqs_[seq.id] how many
  //   of its blocks are published and the chain hash of the last of them (hash of the hit blocks' tokens,
  //   chained from kNoParentHash), count the lookup in stats_ (prefix_query_tokens += seq.num_tokens(),
  //   prefix_hit_tokens += the cached tokens), and return the cached tokens (hit blocks * block_size).
  // Hint: acquire the hits BEFORE taking fresh blocks: take_block() may recycle an LRU block, and a hit
  //   block with no user is in the LRU list until it is acquired.
  // Tests: BlockManager12.* PagedSim12.* lesson12_paged_attention.cpu
  // --- solution ---
  const std::vector<int32_t> hits = match_prefix(seq);
  SeqState state;
  for (const int32_t b : hits) {
    acquire(b);
    seq.kv_blocks.push_back(b);
    state.last_hash = blocks_[static_cast<size_t>(b)].hash;
  }
  state.published = static_cast<int64_t>(hits.size());
  while (static_cast<int64_t>(seq.kv_blocks.size()) < blocks_for(tokens)) seq.kv_blocks.push_back(take_block());
  seqs_[seq.id] = state;
  const int64_t cached = static_cast<int64_t>(hits.size()) * block_size_;
  stats_.prefix_query_tokens += seq.num_tokens();
  stats_.prefix_hit_tokens += cached;
  return cached;
  // --- end of exercise 12.2 ---
}

bool BlockManager::can_append(const Sequence& seq, int64_t tokens) const {
  if (seq.kv_blocks.empty() || tokens > max_context_) return false;
  return blocks_for(tokens) - static_cast<int64_t>(seq.kv_blocks.size()) <= free_blocks();
}

void BlockManager::append(Sequence& seq, int64_t tokens) {
  if (!can_append(seq, tokens))
    throw std::logic_error("block manager: append() to " + std::to_string(tokens) + " tokens for sequence " +
                           std::to_string(seq.id) + " that can_append() refuses");
  // --- exercise 12.3: append: a new block when the last one is full ------------------------------------------
  // Task: grow seq's block table with fresh blocks (take_block()) until it covers its first `tokens` positions.
  //   A table that covers them already stays as it is (a decode into a block with room left takes nothing).
  // Tests: BlockManager12.AppendTakesABlockOnlyWhenTheLastIsFull BlockManager12.ExactlyFullBlock
  // Tests: BlockManager12.RandomizedAgainstAModel PagedSim12.* lesson12_paged_attention.cpu
  // Stub:
  //   (void)seq;
  //   throw NotWrittenYet("12.3", "append: a new block when the last one is full");
  // --- solution ---
  while (static_cast<int64_t>(seq.kv_blocks.size()) < blocks_for(tokens)) seq.kv_blocks.push_back(take_block());
  // --- end of exercise 12.3 ---
}

void BlockManager::computed(Sequence& seq) {
  if (!prefix_caching_) return;
  const auto it = seqs_.find(seq.id);
  if (it == seqs_.end()) return;
  SeqState& state = it->second;
  // --- exercise 12.4: publishing full blocks ------------------------------------------------------------------
  // Task: publish every block of seq that is now full AND computed (block i with (i + 1) * block_size <=
  //   seq.num_computed) and not published yet (i >= state.published), in order. For each: its chain hash
  //   h = hash(state.last_hash, its tokens) and its parent (the block before it in seq.kv_blocks, -1 for the
  //   first). If find_published(h, tokens, parent) finds ANOTHER block with the same content, use that one
  //   instead (acquire it, release this one, put it in the table): one copy of each prefix. Otherwise publish
  //   this block: published, hash, tokens, parent, parent_generation (the parent's generation), and an entry
  //   in index_. Then state.last_hash = h, state.published = i + 1.
  // Hint: tokens_of(seq, i * block_size_, block_size_) gives a block's token ids.
  // Tests: BlockManager12.PrefixHitSharesBlocks BlockManager12.PrefixNeedsParentToo BlockManager12.ForcedCollisions
  // Tests: BlockManager12.DuplicateBlocksAreMerged BlockManager12.LruEvictionOrder PagedSim12.SharedSystemPrompt
  // Stub:
  //   (void)state;
  //   throw NotWrittenYet("12.4", "publishing full blocks");
  // --- solution ---
  const int64_t full =
      std::min(seq.num_computed, static_cast<int64_t>(seq.kv_blocks.size()) * block_size_) / block_size_;
  for (int64_t i = state.published; i < full; ++i) {
    const std::vector<int32_t> tokens = tokens_of(seq, i * block_size_, block_size_);
    const uint64_t h = hash(state.last_hash, tokens);
    const int32_t parent = i == 0 ? -1 : seq.kv_blocks[static_cast<size_t>(i - 1)];
    int32_t& mine = seq.kv_blocks[static_cast<size_t>(i)];
    const int32_t same = find_published(h, tokens, parent);
    if (same >= 0 && same != mine) {  // computed twice (two sequences missed at once): keep one copy
      acquire(same);
      release(mine);
      mine = same;
    } else if (same < 0) {
      Block& block = blocks_[static_cast<size_t>(mine)];
      block.published = true;
      block.hash = h;
      block.tokens = tokens;
      block.parent = parent;
      block.parent_generation = parent < 0 ? 0 : blocks_[static_cast<size_t>(parent)].generation;
      index_.emplace(h, mine);
    }
    state.last_hash = h;
    state.published = i + 1;
  }
  // --- end of exercise 12.4 ---
}

void BlockManager::free(Sequence& seq) {
  // --- exercise 12.5: free ----------------------------------------------------------------------------------
  // Task: release every block of seq's table (release(): ref_count - 1; at 0 a published block goes to the
  //   LRU list, any other to the free list), clear seq.kv_blocks and forget its state in seqs_. Release the
  //   LAST block first: the LRU list then recycles a sequence's tail before its prefix, which is the part
  //   other requests are likely to share.
  // Tests: BlockManager12.* PagedSim12.* lesson12_paged_attention.cpu
  // Stub:
  //   (void)seq;
  //   throw NotWrittenYet("12.5", "free");
  // --- solution ---
  for (auto it = seq.kv_blocks.rbegin(); it != seq.kv_blocks.rend(); ++it) release(*it);
  seq.kv_blocks.clear();
  seqs_.erase(seq.id);
  // --- end of exercise 12.5 ---
}

int64_t BlockManager::kv_slot(const Sequence& seq, int64_t position) const {
  if (position < 0 || position >= static_cast<int64_t>(seq.kv_blocks.size()) * block_size_)
    throw std::logic_error("block manager: no KV slot for position " + std::to_string(position) + " of sequence " +
                           std::to_string(seq.id) + " (" + std::to_string(seq.kv_blocks.size()) + " blocks)");
  return int64_t{seq.kv_blocks[static_cast<size_t>(position / block_size_)]} * block_size_ + position % block_size_;
}

}  // namespace tvllm
