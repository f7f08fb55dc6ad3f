// Lesson 10: CachedAttention, the KV-cache backend of forward().
#include "cached_attention.h"

#include <string>

#include "common/errors.h"

namespace tvllm {

CachedAttention::CachedAttention(KvCache& cache, const EngineLimits& limits)
    : cache_(cache),
      shape_(cache.shape()),
      slots_(limits.max_sequences, cache.num_slots(), cache.device()),
      decode_(cache.shape(), limits.max_sequences, cache.device()) {}

void CachedAttention::set_slots(const std::vector<int32_t>& slots, cudaStream_t stream) { slots_.set(slots, stream); }

void CachedAttention::force_decode_splits(int num_splits) {
  TVLLM_REQUIRE(num_splits >= 0 && num_splits <= DecodeWorkspace::kMaxDecodeSplits,
                "CachedAttention: num_splits must be in [0, " + std::to_string(DecodeWorkspace::kMaxDecodeSplits) +
                    "], got " + std::to_string(num_splits));
  forced_splits_ = num_splits;
}

void CachedAttention::attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const StepInputs& step, cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  TVLLM_REQUIRE(slots_.size() == batch.batch_size(),
                "CachedAttention: the step has " + std::to_string(batch.batch_size()) + " sequences but set_slots() named " +
                    std::to_string(slots_.size()) + " slots");
  const TensorView cache_k = cache_.k(layer), cache_v = cache_.v(layer);
  // 1. This step's keys and values join their sequences' rows of the cache...
  kv_cache_write(cache_k, cache_v, k, v, batch, slots_, shape_, stream);
  // A prefill with no cached prefix may attend over the step's own rows instead (lesson 15 on Hopper).
  if (fast_prefill_ && try_fresh_prefill(out, q, k, v, batch, shape_, stream)) return;
  // 2. ...and every query attends over its sequence's whole row, the new tokens included (same stream: the
  //    write is ordered before the reads).
  if (forced_splits_ > 0 && batch.max_q_len() <= 1 && decode_attention_ != DecodeAttention::Flash) {
    decode_attention(out, q, cache_k, cache_v, batch, slots_, shape_, forced_splits_, &decode_, stream,
                     decode_attention_);
  } else {
    cached_attention(out, q, cache_k, cache_v, batch, slots_, shape_, &decode_, stream, decode_attention_);
  }
}

}  // namespace tvllm
