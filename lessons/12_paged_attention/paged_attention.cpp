// Lesson 12: PagedAttention, the paged-KV backend of forward().
#include "paged_attention.h"

#include <algorithm>
#include <string>

#include "common/errors.h"

namespace tvllm {

namespace {

int64_t max_blocks_per_seq(const PagedKvPool& pool, const EngineLimits& limits) {
  TVLLM_REQUIRE(limits.max_context >= 0, "PagedAttention: limits.max_context must be >= 0");
  if (limits.max_context == 0) return pool.num_blocks();
  // A sequence never holds more distinct blocks than the pool has.
  return std::min(pool.num_blocks(), (limits.max_context + pool.block_size() - 1) / pool.block_size());
}

}  // namespace

PagedAttention::PagedAttention(PagedKvPool& pool, const EngineLimits& limits)
    : pool_(pool),
      shape_(pool.shape()),
      tables_(limits.max_tokens, limits.max_sequences, max_blocks_per_seq(pool, limits), pool.num_blocks(),
              pool.block_size(), pool.device()),
      decode_(pool.shape(), limits.max_sequences, pool.device()) {}

void PagedAttention::set_tables(const std::vector<int32_t>& slot_mapping,
                                const std::vector<std::vector<int32_t>>& block_tables, cudaStream_t stream) {
  tables_.set(slot_mapping, block_tables, stream);
}

void PagedAttention::force_decode_splits(int num_splits) {
  TVLLM_REQUIRE(num_splits >= 0 && num_splits <= DecodeWorkspace::kMaxDecodeSplits,
                "PagedAttention: num_splits must be in [0, " + std::to_string(DecodeWorkspace::kMaxDecodeSplits) +
                    "], got " + std::to_string(num_splits));
  forced_splits_ = num_splits;
}

void PagedAttention::attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const StepInputs& step, cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  // Before anything is launched: the tables describe this step (the ops check it again; a wrong table would
  // write or read other sequences' keys without a sound).
  check_paged_step(batch, tables_, "PagedAttention");
  const TensorView pool_k = pool_.k(layer), pool_v = pool_.v(layer);
  const KvQuant quant = pool_.quant(layer);  // lesson 16: FP8 pools store E4M3 codes with per-layer scales
  // 1. This step's keys and values go to their KV slots...
  paged_kv_write(pool_k, pool_v, k, v, tables_, shape_, stream, quant);
  // A prefill with no cached prefix may attend over the step's own rows instead (lesson 15 on Hopper), and any
  // other step with a sequence of several queries (a cached prefix: chunks, prefix-cache hits) may attend over the
  // pool with a faster installed kernel (lesson 15's paged wgmma kernel). Neither for an FP8 pool: every query of an
  // FP8 pool attends over the rounded keys, its own prompt's included, so that what a token sees does not depend on
  // how it arrived (a fresh prompt, a chunk, a prefix-cache hit, a recomputation after preemption) nor on the rest
  // of its step: lesson 11's rule (the engine == each request alone) holds with FP8 as with bf16.
  // lessons/16_quantization/README.md compares this with vLLM's choice (a prefill over its bf16 rows).
  if (fast_prefill_ && !quant.fp8) {
    if (try_fresh_prefill(out, q, k, v, batch, shape_, stream)) return;
    if (try_fast_paged_prefill(out, q, pool_k, pool_v, batch, tables_, shape_, stream)) return;
  }
  // 2. ...and every query attends over its sequence's blocks, the new tokens included (same stream: the write is
  //    ordered before the reads).
  attend_pool(layer, q, out, batch, stream);
}

bool PagedAttention::kv_store(int layer, const StepInputs& step, KvStore* store) {
  const AttentionBatch& batch = step.batch();
  if (batch.max_q_len() != 1 || batch.total_q() != batch.batch_size()) return false;  // decode steps only
  const KvQuant quant = pool_.quant(layer);
  // On the CPU an FP8 pool holds the decoded values (fp32): not a store kv_store.h describes.
  if (quant.fp8 && pool_.device() != Device::CUDA) return false;
  check_paged_step(batch, tables_, "PagedAttention");
  const TensorView pool_k = pool_.k(layer), pool_v = pool_.v(layer);
  check_paged_kv_write(pool_k, pool_v, tables_, shape_, quant);  // what paged_kv_write would check
  KvStore s;
  s.k = pool_k.data;
  s.v = pool_v.data;
  s.dtype = pool_k.dtype;  // BF16 or F8_E4M3 on CUDA, F32 on the CPU
  s.device = pool_.device();
  s.kv_dim = shape_.kv_dim();
  s.rows = pool_.device() == Device::CUDA ? tables_.device_slot_mapping() : tables_.host_slot_mapping();
  if (quant.fp8) {
    s.k_inv_scale = 1.0f / quant.k_scale;  // as paged_kv_write_cuda computes them
    s.v_inv_scale = 1.0f / quant.v_scale;
  }
  *store = s;
  return true;
}

void PagedAttention::attend_stored(int layer, const TensorView& q, const TensorView& out, const StepInputs& step,
                                   cudaStream_t stream) {
  const AttentionBatch& batch = step.batch();
  TVLLM_REQUIRE(batch.max_q_len() <= 1, "PagedAttention::attend_stored: decode steps only (kv_store() declines "
                                        "the others: call attend())");
  check_paged_step(batch, tables_, "PagedAttention");
  attend_pool(layer, q, out, batch, stream);
}

void PagedAttention::attend_pool(int layer, const TensorView& q, const TensorView& out, const AttentionBatch& batch,
                                 cudaStream_t stream) {
  const TensorView pool_k = pool_.k(layer), pool_v = pool_.v(layer);
  const KvQuant quant = pool_.quant(layer);
  if (forced_splits_ > 0 && batch.max_q_len() <= 1 && decode_attention_ != DecodeAttention::Flash) {
    const DecodeAttention kind = decode_kind_for(decode_attention_, quant);
    paged_decode_attention(out, q, pool_k, pool_v, batch, tables_, shape_, forced_splits_, &decode_, stream, kind,
                           quant);
  } else {
    paged_attention(out, q, pool_k, pool_v, batch, tables_, shape_, &decode_, stream, decode_attention_, quant);
  }
}

}  // namespace tvllm
