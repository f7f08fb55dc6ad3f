// Lesson 11: who owns which part of the KV cache.
//
// The scheduler decides WHICH tokens run; a KvAllocator decides WHERE their k and v live. The scheduler only
// asks it questions in token counts ("can this sequence hold its first n tokens?"), so the same scheduler runs
// over two very different caches:
//
//   SlotAllocator (this lesson)   a fixed number of slots of max_context positions each: a sequence takes a
//                                 whole slot when admitted (lesson 10's KvCache), even if it only ever uses 40
//                                 positions of 4096. Simple, and wasteful: the slot count caps the batch.
//   BlockManager (lesson 12)      a pool of small blocks (16 tokens): a sequence takes blocks as it grows,
//                                 shares full blocks with other sequences that have the same prefix, and gives
//                                 them back when it finishes.
//
// The address of token `position` of a sequence is a "KV slot": an index into the cache viewed as
// [num_kv_slots(), kv_dim] rows per layer. Contiguous: slot * max_context + position. Paged:
// block_table[position / block_size] * block_size + position % block_size. The step's slot mapping (one KV
// slot per new token) is what the KV-write kernel reads.
//
// Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "sequence.h"

namespace tvllm {

class KvAllocator {
 public:
  virtual ~KvAllocator() = default;

  // Positions one sequence may ever hold (its context limit as far as the cache goes).
  virtual int64_t max_tokens_per_sequence() const = 0;
  // Rows of the cache (per layer): the KV slots there are.
  virtual int64_t num_kv_slots() const = 0;
  // Whether a sequence of `tokens` tokens could EVER fit, with the whole cache to itself (checked at submit:
  // a request that can never fit would wait forever).
  virtual bool fits_alone(int64_t tokens) const = 0;

  // A sequence that holds nothing: how many of its first tokens are already in the cache (a prefix-cache
  // hit), always < seq.num_tokens() (the last token must be fed to give logits). No side effects.
  virtual int64_t cached_tokens(const Sequence& seq) const {
    (void)seq;
    return 0;
  }
  // Whether it can get room for its first `tokens` tokens (a cached prefix included).
  virtual bool can_allocate(const Sequence& seq, int64_t tokens) const = 0;
  // Gives it that room (seq.kv_blocks filled) and returns cached_tokens(seq): the tokens it need not feed.
  virtual int64_t allocate(Sequence& seq, int64_t tokens) = 0;

  // A sequence that holds room already: whether it can grow to hold its first `tokens` tokens, and doing it.
  virtual bool can_append(const Sequence& seq, int64_t tokens) const = 0;
  virtual void append(Sequence& seq, int64_t tokens) = 0;

  // Tells the allocator that seq.num_computed advanced (after a step): a paged cache with prefix caching
  // publishes the blocks that are now full and computed, so later sequences can share them.
  virtual void computed(Sequence& seq) { (void)seq; }

  // Gives everything the sequence holds back (seq.kv_blocks emptied). Fine to call on one that holds nothing.
  virtual void free(Sequence& seq) = 0;

  // The KV slot of token `position` of a sequence that holds room for it.
  virtual int64_t kv_slot(const Sequence& seq, int64_t position) const = 0;
};

// Lesson 10's contiguous cache as an allocator: `num_slots` slots of `max_context` positions. A sequence gets a
// whole slot when it is admitted; growing never fails (the slot already has max_context positions), so a
// sequence is never preempted, and the number of slots is the most sequences that can run at once.
class SlotAllocator final : public KvAllocator {
 public:
  SlotAllocator(int64_t num_slots, int64_t max_context);  // both >= 1, else InputError

  int64_t max_tokens_per_sequence() const override { return max_context_; }
  int64_t num_kv_slots() const override { return num_slots_ * max_context_; }
  bool fits_alone(int64_t tokens) const override { return tokens <= max_context_; }
  bool can_allocate(const Sequence& seq, int64_t tokens) const override;
  int64_t allocate(Sequence& seq, int64_t tokens) override;
  bool can_append(const Sequence& seq, int64_t tokens) const override;
  void append(Sequence& seq, int64_t tokens) override;
  void free(Sequence& seq) override;
  int64_t kv_slot(const Sequence& seq, int64_t position) const override;

  int64_t num_slots() const { return num_slots_; }
  int64_t free_slots() const { return static_cast<int64_t>(free_.size()); }
  // The i-th free slot, i < free_slots() (the engine's padded decode rows write into free slots: lesson 14).
  int32_t free_slot(int64_t i) const { return free_.at(static_cast<size_t>(i)); }

 private:
  int64_t num_slots_, max_context_;
  std::vector<int32_t> free_;  // a stack; the lowest slot on top
};

}  // namespace tvllm
