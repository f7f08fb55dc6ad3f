// Lesson 10: CachedAttention, the attention backend of lesson 08's forward() that keeps every layer's keys and
// values in a KvCache. Per layer of a step it
//   1. stores the step's new k, v rows in the cache (kv_cache_write), at their positions;
//   2. attends over everything each sequence has in the cache (cached_attention: the decode kernel when every
//      sequence brings one token, lesson 07's flash kernel with the cache's KV policy otherwise).
// Which cache slot each sequence of the step uses is set before the step (set_slots), like StepInputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kv_cache.h"
#include "transformer.h"

namespace tvllm {

class CachedAttention final : public AttentionBackend {
 public:
  // `cache` must outlive the backend; its device is the backend's. Sized once from the limits: slot ids for
  // limits.max_sequences sequences and the decode split scratch (CUDA).
  CachedAttention(KvCache& cache, const EngineLimits& limits);

  // The slot of each sequence of the next steps, in the step's sequence order (one async copy on `stream`;
  // not during a graph capture). InputError for a slot outside the cache or used twice.
  void set_slots(const std::vector<int32_t>& slots, cudaStream_t stream = nullptr);
  // Decode steps: 0 (default) lets decode_splits() choose; n > 0 always uses n splits (tests, benchmarks).
  void force_decode_splits(int num_splits);
  void pin_decode_splits(int num_splits) override { force_decode_splits(num_splits); }  // lesson 14's graphs
  // Split (default): decode steps through the split decode kernel. Flash: every step through the flash kernel,
  // so that a token's attention does not depend on the rest of its step. Fast: lesson 14's split decode kernel
  // (installed by lesson 14; kv_cache.h, DecodeAttention).
  void set_decode_attention(DecodeAttention decode) { decode_attention_ = decode; }
  DecodeAttention decode_kind() const { return decode_attention_; }

  // AttentionBackend: kv write, then attention over the cache. InputError when the step has another number of
  // sequences than set_slots() named, or reaches past the cache's max_context.
  void attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const StepInputs& step, cudaStream_t stream) override;

  // Decode steps: where lesson 14's qkv GEMV stores the new k, v rows itself (kv_store.h), and the attention
  // without the write. kv_store() is false for any other step, and checks what kv_cache_write would.
  bool kv_store(int layer, const StepInputs& step, KvStore* store) override;
  void attend_stored(int layer, const TensorView& q, const TensorView& out, const StepInputs& step,
                     cudaStream_t stream) override;
  KvCache& cache() { return cache_; }
  const CacheSlots& slots() const { return slots_; }
  const DecodeWorkspace& decode_workspace() const { return decode_; }

 private:
  void require_slots(const AttentionBatch& batch) const;
  // Step 2 of attend(): every query over its sequence's cached row.
  void attend_cache(int layer, const TensorView& q, const TensorView& out, const AttentionBatch& batch,
                    cudaStream_t stream);
  KvCache& cache_;
  AttentionShape shape_;
  CacheSlots slots_;
  DecodeWorkspace decode_;
  int forced_splits_ = 0;
  DecodeAttention decode_attention_ = DecodeAttention::Split;
};

}  // namespace tvllm
