// Lesson 12: PagedAttention, the attention backend of lesson 08's forward() over a PagedKvPool. Per layer of a
// step it
//   1. stores the step's new k, v rows in the pool at their KV slots (paged_kv_write, driven by the slot mapping);
//   2. attends over everything each sequence has in the pool, through its block table (paged_attention: the paged
//      decode kernel when every sequence brings at most one token, lesson 07's flash kernel with the PagedKV
//      policy otherwise: prefill, chunked prefill, a prompt whose first blocks were a prefix-cache hit).
// The step's slot mapping and block tables are set before the step (set_tables), like StepInputs; the lengths
// come from the step (StepInputs::batch()). The block manager (block_manager.h) says what they are:
//   slot_mapping[t]  = kv_slot(seq, position of token t)     block_tables[b] = sequence b's kv_blocks
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "paged_kv.h"
#include "transformer.h"

namespace tvllm {

class PagedAttention final : public AttentionBackend {
 public:
  // `pool` must outlive the backend; its device is the backend's. Sized once from the limits: a slot mapping of
  // limits.max_tokens entries, block tables for limits.max_sequences sequences of up to
  // ceil(limits.max_context / block_size) blocks (the whole pool when max_context is 0), and the decode split
  // scratch (CUDA).
  PagedAttention(PagedKvPool& pool, const EngineLimits& limits);

  // The next steps' slot mapping (one KV slot per new token, in the step's token order; -1 = do not store) and
  // block tables (one per sequence, in the step's sequence order). One pair of async copies on `stream`; not
  // during a graph capture. InputError for a slot or block outside the pool, or beyond the limits.
  void set_tables(const std::vector<int32_t>& slot_mapping, const std::vector<std::vector<int32_t>>& block_tables,
                  cudaStream_t stream = nullptr);
  // Decode steps: 0 (default) lets decode_splits() choose; n > 0 always uses n splits (graphs, tests, benchmarks).
  void force_decode_splits(int num_splits);
  void pin_decode_splits(int num_splits) override { force_decode_splits(num_splits); }  // lesson 14's graphs
  // Split (default): decode steps through the split decode kernel. Flash: every step through the flash kernel,
  // so that a token's attention does not depend on the rest of its step. Fast: lesson 14's split decode kernel
  // (installed by lesson 14; kv_cache.h, DecodeAttention).
  void set_decode_attention(DecodeAttention decode) { decode_attention_ = decode; }
  DecodeAttention decode_kind() const { return decode_attention_; }

  // AttentionBackend: paged KV write, then attention over the pool. InputError when the tables do not match the
  // step (check_paged_step: their counts, a context its table does not cover, a slot its table contradicts).
  void attend(int layer, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
              const StepInputs& step, cudaStream_t stream) override;

  // Decode steps: where lesson 14's qkv GEMV stores the new k, v rows itself (kv_store.h: the slot mapping; E4M3
  // codes and the inverse scales for an FP8 pool), and the attention without the write. kv_store() is false for
  // any other step (and for an FP8 pool on the CPU), and checks what attend()'s write would.
  bool kv_store(int layer, const StepInputs& step, KvStore* store) override;
  void attend_stored(int layer, const TensorView& q, const TensorView& out, const StepInputs& step,
                     cudaStream_t stream) override;
  PagedKvPool& pool() { return pool_; }
  const PagedStepTables& tables() const { return tables_; }
  const DecodeWorkspace& decode_workspace() const { return decode_; }

 private:
  // Step 2 of attend(): every query over its sequence's blocks.
  void attend_pool(int layer, const TensorView& q, const TensorView& out, const AttentionBatch& batch,
                   cudaStream_t stream);
  PagedKvPool& pool_;
  AttentionShape shape_;
  PagedStepTables tables_;
  DecodeWorkspace decode_;
  int forced_splits_ = 0;
  DecodeAttention decode_attention_ = DecodeAttention::Split;
};

}  // namespace tvllm
