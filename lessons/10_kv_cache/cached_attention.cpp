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

void CachedAttention::require_slots(const AttentionBatch& batch) const {
  TVLLM_REQUIRE(slots_.size() == batch.batch_size(),
                "CachedAttention: the step has " + std::to_string(batch.batch_size()) + " sequences but set_slots() named " +
                    std::to_string(slots_.size()) + " slots");
}

void CachedAttention::attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const StepInputs& step, cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  require_slots(batch);
  // 1. This step's keys and values join their sequences' rows of the cache...
  kv_cache_write(cache_.k(layer), cache_.v(layer), k, v, batch, slots_, shape_, stream);
  // A prefill with no cached prefix may attend over the step's own rows instead (lesson 15 on Hopper).
  if (fast_prefill_ && try_fresh_prefill(out, q, k, v, batch, shape_, stream)) return;
  // 2. ...and every query attends over its sequence's whole row, the new tokens included (same stream: the
  //    write is ordered before the reads).
  attend_cache(layer, q, out, batch, stream);
}

bool CachedAttention::kv_store(int layer, const StepInputs& step, KvStore* store) {
  const AttentionBatch& batch = step.batch();
  // Decode steps only: token m is then sequence m, and its key the last of the sequence's k_len (kv_store.h).
  if (batch.max_q_len() != 1 || batch.total_q() != batch.batch_size()) return false;
  require_slots(batch);
  const TensorView cache_k = cache_.k(layer), cache_v = cache_.v(layer);
  check_kv_cache_write(cache_k, cache_v, batch, slots_, shape_);  // what kv_cache_write would check
  const bool cuda = cache_.device() == Device::CUDA;
  KvStore s;
  s.k = cache_k.data;
  s.v = cache_v.data;
  s.dtype = cache_k.dtype;
  s.device = cache_.device();
  s.kv_dim = shape_.kv_dim();
  s.slots = cuda ? slots_.device_slots() : slots_.host().data();
  s.cu_k = cuda ? batch.cu_seqlens_k_device() : batch.cu_seqlens_k().data();
  s.max_context = cache_k.shape[1];
  *store = s;
  return true;
}

void CachedAttention::attend_stored(int layer, const TensorView& q, const TensorView& out, const StepInputs& step,
                                    cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  TVLLM_REQUIRE(batch.max_q_len() <= 1, "CachedAttention::attend_stored: decode steps only (kv_store() declines "
                                        "the others: call attend())");
  require_slots(batch);
  attend_cache(layer, q, out, batch, stream);
}

void CachedAttention::attend_cache(int layer, const TensorView& q, const TensorView& out, const AttentionBatch& batch,
                                   cudaStream_t stream) {
  const TensorView cache_k = cache_.k(layer), cache_v = cache_.v(layer);
  if (forced_splits_ > 0 && batch.max_q_len() <= 1 && decode_attention_ != DecodeAttention::Flash) {
    decode_attention(out, q, cache_k, cache_v, batch, slots_, shape_, forced_splits_, &decode_, stream,
                     decode_attention_);
  } else {
    cached_attention(out, q, cache_k, cache_v, batch, slots_, shape_, &decode_, stream, decode_attention_);
  }
}

}  // namespace tvllm
