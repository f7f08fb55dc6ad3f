// Lesson 14: decode attention at the memory roofline (decode_attention_fast.cuh has the kernel; README section
// "Decode attention at the memory roofline" the story).
//
// The kernel reads lesson 10's contiguous cache and lesson 12's paged pool through their KV policies. Lessons 10 and
// 12 cannot link lesson 14, so they expose a seam (kv_cache.h: install_fast_decode; paged_kv.h:
// install_fast_paged_decode) and DecodeAttention::Fast; install_fast_decode_attention() fills both. From then on
//
//   decode_attention(..., DecodeAttention::Fast)          paged_decode_attention(..., DecodeAttention::Fast)
//   cached_attention / paged_attention with decode == Fast, and the backends' set_decode_attention(Fast)
//
// run this kernel (after the lessons' own argument checks), with fast_decode_splits() as the split policy unless
// a caller pins the count. use_fast_path installs it and makes it the decode kernel of the Generator and the Engine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention.h"
#include "common/tensor.h"
#include "kv_cache.h"
#include "paged_kv.h"

namespace tvllm {

// Fills lesson 10's and lesson 12's seams. Idempotent, cheap; call it before asking for DecodeAttention::Fast.
void install_fast_decode_attention();

// Whether use_fast_path makes this kernel the decode kernel of a model with these heads: measured on the H200
// (chapter section 8), it beats lesson 10's at head_dim 64 at every batch (Llama 3.2 1B: +1.5% at batch 1,
// +13% at batch 8 × 4,096), but at head_dim 128 with groups of 2 (Qwen3-0.6B) decode steps were 1–13% slower at
// batches 1 and 8. So head_dim <= 64 only, until the head_dim-128 case is understood; --no-fast-attention and
// this rule leave lesson 10's kernel, the same answer within one bf16 rounding.
bool fast_decode_attention_pays(const AttentionShape& shape);

// Where a warp keeps the tiles it has in flight (decode_attention_fast.cuh): v1 two stages in registers, v2 (the
// default) a cp.async ring of 3 stages in shared memory. Process-wide; the benchmark and the tests switch it. The
// pipeline only moves bytes: both give the same bits.
enum class FastDecodePipeline { Registers, Ring };
void set_fast_decode_pipeline(FastDecodePipeline pipeline);
FastDecodePipeline fast_decode_pipeline();
const char* fast_decode_pipeline_name(FastDecodePipeline pipeline);

// Whether the decode kernel and its combine are launched as programmatic dependents of the kernel before each
// (pdl.h, chapter section 7): they wait for it in-kernel, and trigger at once, so the o GEMV after them loads its
// weights while they run. Off by default; use_fast_path turns it on where FastPathOptions::pdl_attention asks
// (off by default too: measured no faster, chapter section 11) and pdl_supported(). The same bits either way
// (only the launch changes). Process-wide.
void set_fast_decode_pdl(bool on);

// Where a split decode step is combined: false (the default), by a second kernel (fast_combine_kernel); true, by
// the last of each head's split blocks, in the decode kernel (decode_attention_fast.cuh: last_split_combine;
// chapter section 8: measured no faster at context 128 and slower at 4,096, so not the default). The two add in
// different orders: they agree within one bf16 rounding, and each gives the same bits on every run.
// Process-wide; use_fast_path sets it (FastPathOptions::combine_in_decode).
void set_fast_decode_combine_in_kernel(bool on);
bool fast_decode_combine_in_kernel();

// Splits for a decode step of `batch_size` sequences whose longest context is max_k_len (of which a sliding window
// reads at most shape.window keys: those are what is split). One block per (sequence, kv head, <= 8 query heads,
// split): when the step alone gives at least 2 blocks per SM (B x kv heads >= 264 on an H200) there is no split
// and no combine pass; below that, enough splits for ~4 blocks per SM, each of at least kMinKeysPerFastSplit
// keys, at most kMaxDecodeSplits. num_sms 0 (the CPU): decode_splits()'s choice.
// 256 keys: each warp then has 4 tiles of 16 keys to stream (the ring has something to overlap) and a batch-1 step
// at 4,096 keys makes 16 splits, one wave of 128 blocks. Measured (H100, batch 1, context 4096, whole decode step):
// 64 keys per split 1.283 ms, 128 1.277, 256 1.225, 512 1.236 (chapter section 8).
inline constexpr int kMinKeysPerFastSplit = 256;
int fast_decode_splits(const AttentionShape& shape, int batch_size, int64_t max_k_len, int num_sms);

// The kernels behind the seams (lesson 10 and 12's ops check the arguments first; call those). window: 0 = all keys,
// W > 0 = each sequence's last W keys.
void fast_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                const AttentionShape& shape, int num_splits, int window,
                                const DecodeWorkspace& workspace, cudaStream_t stream);
// Over lesson 16's FP8 pool (quant.fp8): installed as lesson 12's FP8 seam. The register pipeline reads the codes.
void fast_paged_decode_attention_fp8_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                          const TensorView& pool_v, const AttentionBatch& batch,
                                          const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                          int window, const KvQuant& quant, const DecodeWorkspace& workspace,
                                          cudaStream_t stream);
void fast_paged_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                      const TensorView& pool_v, const AttentionBatch& batch,
                                      const PagedStepTables& tables, const AttentionShape& shape, int num_splits,
                                      int window, const DecodeWorkspace& workspace, cudaStream_t stream);

}  // namespace tvllm
