// Lesson 11: the contiguous cache's allocator (kv_allocator.h): one whole slot per running sequence.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/input_error.h"
#include "kv_allocator.h"

namespace tvllm {

SlotAllocator::SlotAllocator(int64_t num_slots, int64_t max_context)
    : num_slots_(num_slots), max_context_(max_context) {
  TVLLM_REQUIRE(num_slots >= 1 && num_slots <= INT32_MAX,
                "slot allocator: num_slots must be in [1, 2^31), got " + std::to_string(num_slots));
  TVLLM_REQUIRE(max_context >= 1, "slot allocator: max_context must be >= 1, got " + std::to_string(max_context));
  for (int64_t s = num_slots; s-- > 0;) free_.push_back(static_cast<int32_t>(s));  // slot 0 on top
}

bool SlotAllocator::can_allocate(const Sequence& seq, int64_t tokens) const {
  return seq.kv_blocks.empty() && !free_.empty() && tokens <= max_context_;
}

int64_t SlotAllocator::allocate(Sequence& seq, int64_t tokens) {
  if (!can_allocate(seq, tokens))
    throw std::logic_error("slot allocator: allocate() for sequence " + std::to_string(seq.id) +
                           " that can_allocate() refuses");
  seq.kv_blocks = {free_.back()};
  free_.pop_back();
  return 0;  // no prefix cache: every token is fed
}

bool SlotAllocator::can_append(const Sequence& seq, int64_t tokens) const {
  return seq.kv_blocks.size() == 1 && tokens <= max_context_;
}

void SlotAllocator::append(Sequence& seq, int64_t tokens) {
  if (!can_append(seq, tokens))
    throw std::logic_error("slot allocator: append() of " + std::to_string(tokens) + " tokens for sequence " +
                           std::to_string(seq.id) + " that can_append() refuses");
}

void SlotAllocator::free(Sequence& seq) {
  if (seq.kv_blocks.empty()) return;
  free_.push_back(seq.kv_blocks.front());
  seq.kv_blocks.clear();
}

int64_t SlotAllocator::kv_slot(const Sequence& seq, int64_t position) const {
  if (seq.kv_blocks.size() != 1 || position < 0 || position >= max_context_)
    throw std::logic_error("slot allocator: no KV slot for position " + std::to_string(position) + " of sequence " +
                           std::to_string(seq.id));
  return int64_t{seq.kv_blocks.front()} * max_context_ + position;
}

}  // namespace tvllm
