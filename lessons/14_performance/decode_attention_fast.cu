// Lesson 14: the fast decode kernel (decode_attention_fast.cuh) instantiated for lesson 10's contiguous cache and
// lesson 12's paged pool, its split policy, and its installation into their seams (decode_attention_fast.h).
#include "decode_attention_fast.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "cache_kv.cuh"
#include "common/errors.h"
#include "decode_attention_fast.cuh"
#include "paged_kv_policy.cuh"

namespace tvllm {

namespace {

std::atomic<FastDecodePipeline> g_pipeline{FastDecodePipeline::Ring};
std::atomic<bool> g_pdl{false};
std::atomic<bool> g_combine_in_kernel{false};

fast_decode::Pipeline pipeline() {
  return g_pipeline.load() == FastDecodePipeline::Ring ? fast_decode::Pipeline::Ring : fast_decode::Pipeline::Registers;
}

fast_decode::Params fast_params(const TensorView& out, const TensorView& q, const AttentionBatch& batch,
                                const AttentionShape& shape, int window, const DecodeWorkspace& workspace) {
  TVLLM_REQUIRE(window >= 0, "fast decode attention: window must be >= 0 (0 = every key), got " +
                                 std::to_string(window));
  fast_decode::Params p;
  p.q = q.ptr<const __nv_bfloat16>();
  p.out = out.ptr<__nv_bfloat16>();
  p.q_stride = q.strides[0];
  p.out_stride = out.strides[0];
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.head_dim = static_cast<int>(shape.head_dim);
  p.group = static_cast<int>(shape.group_size());
  p.n_heads = static_cast<int>(shape.n_heads);
  p.window = window;
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e), as lessons 07 and 10
  p.partials = workspace.partials();
  p.arrivals = g_combine_in_kernel.load() ? workspace.split_arrivals() : nullptr;
  return p;
}

}  // namespace

bool fast_decode_attention_pays(const AttentionShape& shape) { return shape.head_dim <= 64; }

int fast_decode_splits(const AttentionShape& shape, int batch_size, int64_t max_k_len, int num_sms) {
  if (num_sms <= 0) return decode_splits(shape, batch_size, max_k_len, num_sms);
  const int64_t head_tiles = (shape.group_size() + 7) / 8;
  const int64_t blocks = static_cast<int64_t>(batch_size) * shape.n_kv_heads * head_tiles;
  // Enough blocks already: every SM holds two or more for the whole step, and a split would only add a combine.
  if (blocks >= 2 * static_cast<int64_t>(num_sms)) return 1;
  // A sliding window caps the keys a decode query reads at `window`, however long the context: split those
  // (as decode_splits does for lesson 10's kernel).
  if (shape.window > 0) max_k_len = std::min(max_k_len, shape.window);
  const int64_t by_keys = (max_k_len + kMinKeysPerFastSplit - 1) / kMinKeysPerFastSplit;
  const int64_t to_fill = (4 * static_cast<int64_t>(num_sms) + blocks - 1) / blocks;
  return static_cast<int>(std::clamp<int64_t>(std::min(by_keys, to_fill), 1, DecodeWorkspace::kMaxDecodeSplits));
}

void fast_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                const AttentionShape& shape, int num_splits, int window,
                                const DecodeWorkspace& workspace, cudaStream_t stream) {
  fast_decode::launch(pipeline(), fast_params(out, q, batch, shape, window, workspace),
                      cache_kv(cache_k, cache_v, slots, shape), static_cast<int>(shape.n_kv_heads), batch.batch_size(),
                      num_splits, g_pdl.load(), stream);
}

void fast_paged_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                      const TensorView& pool_v, const AttentionBatch& batch,
                                      const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                      int window, const DecodeWorkspace& workspace, cudaStream_t stream) {
  fast_decode::launch(pipeline(), fast_params(out, q, batch, shape, window, workspace),
                      paged_kv_policy(pool_k, pool_v, tables, shape), static_cast<int>(shape.n_kv_heads),
                      batch.batch_size(), num_splits, g_pdl.load(), stream);
}

// Lesson 16's FP8 pool: the scales folded in (k_scale into the score scale, v_scale into the output), the rows read
// as codes by the register pipeline (decode_attention_fast.cuh: launch_for).
void fast_paged_decode_attention_fp8_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                          const TensorView& pool_v, const AttentionBatch& batch,
                                          const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                          int window, const KvQuant& quant, const DecodeWorkspace& workspace,
                                          cudaStream_t stream) {
  fast_decode::Params p = fast_params(out, q, batch, shape, window, workspace);
  p.scale_log2 *= quant.k_scale;
  p.v_scale = quant.v_scale;
  fast_decode::launch(pipeline(), p, paged_kv_policy<__nv_fp8_e4m3>(pool_k, pool_v, tables, shape),
                      static_cast<int>(shape.n_kv_heads), batch.batch_size(), num_splits, g_pdl.load(), stream);
}

void set_fast_decode_pipeline(FastDecodePipeline pipeline) { g_pipeline.store(pipeline); }
void set_fast_decode_pdl(bool on) { g_pdl.store(on); }
void set_fast_decode_combine_in_kernel(bool on) { g_combine_in_kernel.store(on); }
bool fast_decode_combine_in_kernel() { return g_combine_in_kernel.load(); }
FastDecodePipeline fast_decode_pipeline() { return g_pipeline.load(); }

const char* fast_decode_pipeline_name(FastDecodePipeline pipeline) {
  return pipeline == FastDecodePipeline::Ring ? "v2 cp.async ring" : "v1 register stages";
}

void install_fast_decode_attention() {
  FastDecodeKernel kernel;
  kernel.splits = fast_decode_splits;
  kernel.contiguous = fast_decode_attention_cuda;
  install_fast_decode(kernel);
  install_fast_paged_decode(fast_paged_decode_attention_cuda);
  install_fast_paged_decode_fp8(fast_paged_decode_attention_fp8_cuda);
}

}  // namespace tvllm
