// Lesson 12: the engine's paged KV side. Lesson 11's Engine over a pool of blocks:
//
//   PagedKvPool     (paged_kv.h)         the memory: k and v of every layer as num_blocks blocks of block_size
//   BlockManager    (block_manager.h)    who holds which block: block tables, reference counts, prefix caching
//   PagedAttention  (paged_attention.h)  forward()'s attention over the pool, through the step's tables
//
// Per step, prepare() hands PagedAttention the batch's slot mapping (one KV slot per new token, as the
// scheduler computed it through BlockManager::kv_slot) and one block table per sequence (its kv_blocks): copied
// into device arrays of fixed address, so a decode step stays capturable.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "block_manager.h"
#include "engine.h"
#include "paged_attention.h"
#include "paged_kv.h"

namespace tvllm {

struct PagedKvOptions {
  int64_t num_blocks = 0;  // 0: CUDA fills budget.fraction of the free memory; the CPU takes max_sequences *
                           // ceil(max_context / block_size) (every sequence at full length: no preemption)
  int64_t block_size = 16;
  bool prefix_caching = true;
  KvPoolBudget budget;           // when num_blocks is 0 on CUDA
  std::ostream* log = nullptr;   // where the pool plan is printed (CUDA, num_blocks 0)
  // Lesson 16: --kv-cache-dtype. FP8 stores E4M3 codes (half of bf16's bytes: twice the blocks for the same
  // memory) with one k and one v scale per layer: k_scales / v_scales (num_hidden_layers each, e.g. a checkpoint's
  // k_scale / v_scale), or empty for 1.0 everywhere.
  KvCacheDtype kv_dtype = KvCacheDtype::Auto;
  std::vector<float> k_scales, v_scales;
};

class PagedKv final : public EngineKv {
 public:
  PagedKv(const ModelWeights& weights, const EngineLimits& limits, const PagedKvOptions& options);
  KvAllocator& allocator() override { return blocks_; }
  AttentionBackend& attention() override { return attention_; }
  void prepare(const ScheduledBatch& batch, cudaStream_t stream) override;
  // Padding rows (lesson 14's graph buckets) store nothing (slot -1, which paged_kv_write skips) and read, through
  // a one-block table, position 0 of the first real sequence: keys that exist, read only. Any number of them.
  int64_t pad_capacity() const override { return std::numeric_limits<int64_t>::max(); }
  void prepare_padded(const ScheduledBatch& batch, int64_t pad_rows, cudaStream_t stream) override;
  void set_decode_attention(DecodeAttention decode) override { attention_.set_decode_attention(decode); }
  KvUsage usage() const override;
  std::string describe() const override;

  PagedKvPool& pool() { return pool_; }
  BlockManager& block_manager() { return blocks_; }
  PagedAttention& paged_attention() { return attention_; }

 private:
  PagedKvPool pool_;
  BlockManager blocks_;
  PagedAttention attention_;
  bool prefix_caching_;
  // Reused every step (host memory; their capacity grows to the largest step once).
  std::vector<int32_t> slot_mapping_;
  std::vector<std::vector<int32_t>> tables_;
};

KvFactory paged_kv(const PagedKvOptions& options = {});

// Lesson 16: an FP8 KV cache's per-layer scales as a compressed-tensors checkpoint with a kv_cache_scheme stores
// them (llm-compressor: model.layers.N.self_attn.k_scale / v_scale, scalars). Sets options.k_scales / v_scales and
// returns true when every layer has both; false (options untouched) when the checkpoint has none (then 1.0, as
// vLLM). InputError for a partial set, a tensor that is not one finite value > 0.
struct ModelDir;
bool load_kv_scales(const ModelDir& model, PagedKvOptions& options);

}  // namespace tvllm
