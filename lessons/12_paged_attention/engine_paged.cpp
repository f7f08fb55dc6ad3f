// Lesson 12: the engine's paged KV side (engine_paged.h).
#include "engine_paged.h"

#include <string>

#include <cmath>

#include "common/dtype.h"
#include "common/errors.h"
#include "model_dir.h"

namespace tvllm {

namespace {

PagedKvPool make_pool(const ModelWeights& weights, const EngineLimits& limits, const PagedKvOptions& o) {
  TVLLM_REQUIRE(o.block_size >= 1, "paged KV: block_size must be >= 1, got " + std::to_string(o.block_size));
  TVLLM_REQUIRE(o.k_scales.size() == o.v_scales.size(),
                "paged KV: k_scales and v_scales must both be empty or both one per layer");
  PagedKvPool pool = [&] {
    if (o.num_blocks > 0)
      return PagedKvPool::for_model(weights.config, o.num_blocks, o.block_size, weights.device, o.kv_dtype);
    if (weights.device == Device::CUDA)
      return PagedKvPool::fill_free_memory(weights.config, o.block_size, o.budget, o.log, o.kv_dtype);
    const int64_t per_seq = (limits.max_context + o.block_size - 1) / o.block_size;
    return PagedKvPool::for_model(weights.config, limits.max_sequences * per_seq, o.block_size, weights.device,
                                  o.kv_dtype);
  }();
  if (!o.k_scales.empty()) pool.set_scales(o.k_scales, o.v_scales);
  return pool;
}

BlockManagerConfig block_config(const PagedKvPool& pool, const EngineLimits& limits, bool prefix_caching) {
  BlockManagerConfig c;
  c.num_blocks = pool.num_blocks();
  c.block_size = pool.block_size();
  c.max_context = limits.max_context;
  c.prefix_caching = prefix_caching;
  return c;
}

}  // namespace

PagedKv::PagedKv(const ModelWeights& weights, const EngineLimits& limits, const PagedKvOptions& options)
    : pool_(make_pool(weights, limits, options)),
      blocks_(block_config(pool_, limits, options.prefix_caching)),
      attention_(pool_, limits),
      prefix_caching_(options.prefix_caching) {}

void PagedKv::prepare(const ScheduledBatch& batch, cudaStream_t stream) { prepare_padded(batch, 0, stream); }

void PagedKv::prepare_padded(const ScheduledBatch& batch, int64_t pad_rows, cudaStream_t stream) {
  TVLLM_REQUIRE(pad_rows >= 0, "PagedKv: " + std::to_string(pad_rows) + " padding rows");
  TVLLM_REQUIRE(pad_rows == 0 || (!batch.seqs.empty() && !batch.seqs[0].seq->kv_blocks.empty()),
                "PagedKv: padding rows need a real sequence with a block to read");
  slot_mapping_.clear();
  for (int64_t slot : batch.slot_mapping) slot_mapping_.push_back(static_cast<int32_t>(slot));  // < 2^31 (pool)
  tables_.resize(batch.seqs.size() + static_cast<size_t>(pad_rows));
  for (size_t b = 0; b < batch.seqs.size(); ++b) tables_[b] = batch.seqs[b].seq->kv_blocks;
  for (size_t b = batch.seqs.size(); b < tables_.size(); ++b) {
    slot_mapping_.push_back(-1);                             // stores nothing
    tables_[b].assign(1, batch.seqs[0].seq->kv_blocks[0]);   // reads a written key: finite, harmless
  }
  attention_.set_tables(slot_mapping_, tables_, stream);
}

KvUsage PagedKv::usage() const {
  KvUsage u;
  u.kind = "paged";
  u.block_size = blocks_.block_size();
  u.total_blocks = blocks_.num_blocks();
  u.free_blocks = blocks_.free_blocks();
  u.prefix_query_tokens = blocks_.stats().prefix_query_tokens;
  u.prefix_hit_tokens = blocks_.stats().prefix_hit_tokens;
  u.bytes = pool_.bytes();
  return u;
}

std::string PagedKv::describe() const {
  return pool_.describe() + (prefix_caching_ ? ", prefix caching on" : ", prefix caching off");
}

bool load_kv_scales(const ModelDir& model, PagedKvOptions& options) {
  const int64_t layers = model.config.num_hidden_layers;
  std::vector<float> k, v;
  int64_t found = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string base = "model.layers." + std::to_string(l) + ".self_attn.";
    for (const char* which : {"k_scale", "v_scale"}) {
      const std::string name = base + which;
      if (!model.weights.contains(name)) continue;
      const TensorView t = model.weights.host(name);
      TVLLM_REQUIRE(t.numel() == 1, name + ": a per-tensor KV scale must be one value, got " + t.describe());
      const float s = load_as_f32(t.data, t.dtype, 0);
      TVLLM_REQUIRE(std::isfinite(s) && s > 0.0f, name + ": a KV scale must be finite and > 0, got " +
                                                      std::to_string(s));
      (which[0] == 'k' ? k : v).push_back(s);
      ++found;
    }
  }
  if (found == 0) return false;
  TVLLM_REQUIRE(found == 2 * layers, "the checkpoint has " + std::to_string(found) +
                                         " of its k_scale / v_scale tensors, not the " + std::to_string(2 * layers) +
                                         " (one k and one v per layer) an FP8 KV cache needs");
  options.k_scales = std::move(k);
  options.v_scales = std::move(v);
  return true;
}

KvFactory paged_kv(const PagedKvOptions& options) {
  return [options](const ModelWeights& w, const EngineLimits& l) { return std::make_unique<PagedKv>(w, l, options); };
}

}  // namespace tvllm
