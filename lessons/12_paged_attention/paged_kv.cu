// Lesson 12 on the GPU: the paged KV write, and attention over the pool through the block tables: lesson 10's
// decode kernels (flash-decoding) and lesson 07's flash kernel (prefill, chunks, prefix hits), both with the
// PagedKV policy.
//
//   paged_kv_write_kernel   one block per new token: its k and v rows -> KV slot slot_mapping[t]
//   paged_row, PagedKV      (paged_kv_policy.cuh) position pos of a sequence -> its pool row, through the block
//                           table; the KV policy (flash_attention.cuh's contract) for the pool, built on it
//
// Lesson 10's kernels read a contiguous row (slot base + pos * kv_dim); here position pos of sequence b lives at
// row (block_table[b][pos >> shift] << shift) + (pos & mask) of the pool, shift = log2(block_size). Everything
// else (the tiling, the GQA sharing, the online softmax, the split and its combine) is the same code, so the
// paged decode returns the contiguous one's bits when the same keys sit in both caches (a test checks it).
// README.md walks through them.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "decode_attention.cuh"
#include "paged_kv_policy.cuh"
#include "flash_attention.cuh"
#include "paged_kv.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// =================================================================================================
// The KV write
// =================================================================================================

constexpr int kWriteThreads = 128;

struct PagedWriteParams {
  bf16* k_pool;                 // the layer's k: [num_blocks * block_size rows, kv_dim]
  bf16* v_pool;
  const bf16* k;                // the step's new rows [T, >= kv_dim], k_stride apart (views into the QKV buffer)
  const bf16* v;
  int64_t k_stride, v_stride;
  const int32_t* slot_mapping;  // [T] device: KV slot of token t, -1 = not stored
  int kv_dim;
};

// grid: one block per new token (T = the slot mapping's length). The slot comes from a device array, so a
// captured graph writes wherever the latest slot mapping says.
__global__ void __launch_bounds__(kWriteThreads) paged_kv_write_kernel(const PagedWriteParams p) {
  // --- exercise 12.8: the paged KV-write kernel ---------------------------------------------------------------
  // Task: block t copies row t of k and of v (kv_dim bf16 each) into row slot_mapping[t] of the pool (k_pool,
  //   v_pool: one row of kv_dim per KV slot). A slot of -1 is a token not to store: the block does nothing.
  //   16 bytes (8 bf16) per thread per step.
  // Hint: load_pack<8> / store_pack<8> (common/cuda_utils.cuh) move 8 bf16 at once; kv_dim is a multiple of 8.
  // Hint: slot * kv_dim needs 64 bits: a pool of a few million slots times kv_dim passes 2^31.
  // Tests: PagedKvGpu.WriteMatchesCpu PagedKvGpu.GraphOfADecodeStepReplaysTheEagerStep
  // Tests: PagedKvGpu.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Needs: 12.6
  // Stub: device
  // --- solution ---
  const int t = blockIdx.x;
  const int32_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // a padding token: the whole block leaves
  bf16* k_dst = p.k_pool + static_cast<int64_t>(slot) * p.kv_dim;
  bf16* v_dst = p.v_pool + static_cast<int64_t>(slot) * p.kv_dim;
  const bf16* k_src = p.k + static_cast<int64_t>(t) * p.k_stride;
  const bf16* v_src = p.v + static_cast<int64_t>(t) * p.v_stride;
  for (int c = threadIdx.x * 8; c < p.kv_dim; c += kWriteThreads * 8) {
    store_pack<8>(k_dst + c, load_pack<8>(k_src + c));
    store_pack<8>(v_dst + c, load_pack<8>(v_src + c));
  }
  // --- end of exercise 12.8 ---
}

// Lesson 16's FP8 pool: the same copy, each element stored as e4m3(x * inv_scale), round to nearest even and
// saturating (__NV_SATFINITE: +-448, never NaN), the conversion kv_fp8_round makes on the CPU. 8 elements (16
// bytes in, 8 out) per thread per step.
struct PagedWriteFp8Params {
  __nv_fp8_storage_t* k_pool;   // [num_blocks * block_size rows, kv_dim] codes
  __nv_fp8_storage_t* v_pool;
  const bf16* k;
  const bf16* v;
  int64_t k_stride, v_stride;
  const int32_t* slot_mapping;
  int kv_dim;
  float k_inv_scale, v_inv_scale;  // 1 / scale, computed on the host as kv_fp8_round does
};

__device__ __forceinline__ uint2 quantize8(const Pack<8>& x, float inv_scale) {
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t code = __nv_cvt_float_to_fp8(x.get(e) * inv_scale, __NV_SATFINITE, __NV_E4M3);
    word[e / 4] |= code << (8 * (e % 4));  // element e at byte e: little-endian, as the reader expects
  }
  return make_uint2(word[0], word[1]);
}

__global__ void __launch_bounds__(kWriteThreads) paged_kv_write_fp8_kernel(const PagedWriteFp8Params p) {
  const int t = blockIdx.x;
  const int32_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  __nv_fp8_storage_t* k_dst = p.k_pool + static_cast<int64_t>(slot) * p.kv_dim;
  __nv_fp8_storage_t* v_dst = p.v_pool + static_cast<int64_t>(slot) * p.kv_dim;
  const bf16* k_src = p.k + static_cast<int64_t>(t) * p.k_stride;
  const bf16* v_src = p.v + static_cast<int64_t>(t) * p.v_stride;
  for (int c = threadIdx.x * 8; c < p.kv_dim; c += kWriteThreads * 8) {
    *reinterpret_cast<uint2*>(k_dst + c) = quantize8(load_pack<8>(k_src + c), p.k_inv_scale);
    *reinterpret_cast<uint2*>(v_dst + c) = quantize8(load_pack<8>(v_src + c), p.v_inv_scale);
  }
}

// =================================================================================================
// Attention over the pool: lesson 10's decode kernels and lesson 07's flash kernel, with the PagedKV policy
// =================================================================================================

// PagedKV, the policy both read the pool through, and paged_row, its block-table look-up, are in
// paged_kv_policy.cuh (lesson 14's decode kernel reads the pool through them too).

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void paged_kv_write_cuda(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                         const TensorView& v, const PagedStepTables& tables, cudaStream_t stream,
                         const KvQuant& quant) {
  if (quant.fp8) {
    PagedWriteFp8Params p;
    p.k_pool = pool_k.ptr<__nv_fp8_storage_t>();
    p.v_pool = pool_v.ptr<__nv_fp8_storage_t>();
    p.k = k.ptr<const bf16>();
    p.v = v.ptr<const bf16>();
    p.k_stride = k.strides[0];
    p.v_stride = v.strides[0];
    p.slot_mapping = tables.device_slot_mapping();
    p.kv_dim = static_cast<int>(pool_k.shape[2]);
    p.k_inv_scale = 1.0f / quant.k_scale;
    p.v_inv_scale = 1.0f / quant.v_scale;
    paged_kv_write_fp8_kernel<<<static_cast<unsigned>(tables.num_tokens()), kWriteThreads, 0, stream>>>(p);
    TVLLM_CHECK_LAUNCH();
    return;
  }
  PagedWriteParams p;
  p.k_pool = pool_k.ptr<bf16>();
  p.v_pool = pool_v.ptr<bf16>();
  p.k = k.ptr<const bf16>();
  p.v = v.ptr<const bf16>();
  p.k_stride = k.strides[0];
  p.v_stride = v.strides[0];
  p.slot_mapping = tables.device_slot_mapping();
  p.kv_dim = static_cast<int>(pool_k.shape[2]);
  paged_kv_write_kernel<<<static_cast<unsigned>(tables.num_tokens()), kWriteThreads, 0, stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

void paged_decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                 const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                 const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                                 cudaStream_t stream, const KvQuant& quant) {
  decode::DecodeParams p = decode::make_params(out, q, batch, shape, workspace);
  if (quant.fp8) {
    // k = code * k_scale: q.k * scale = (q.code) * (scale * k_scale), one multiply folded into the query's.
    p.scale_log2 *= quant.k_scale;
    p.v_scale = quant.v_scale;
    decode::launch(p, paged_kv_policy<__nv_fp8_e4m3>(pool_k, pool_v, tables, shape),
                   static_cast<int>(shape.n_kv_heads), batch.batch_size(), num_splits, stream);
    return;
  }
  decode::launch(p, paged_kv_policy(pool_k, pool_v, tables, shape), static_cast<int>(shape.n_kv_heads),
                 batch.batch_size(), num_splits, stream);
}

void paged_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, cudaStream_t stream, const KvQuant& quant) {
  if (quant.fp8) {
    // flash_attention() with the scales folded in as the decode launcher does (the CUDA-core kernel runs it).
    check_attention_queries(out, q, batch, shape);
    flash::FlashParams p = flash::make_params(out, q, batch, shape);
    p.scale_log2 *= quant.k_scale;
    p.v_scale = quant.v_scale;
    flash::launch(p, paged_kv_policy<__nv_fp8_e4m3>(pool_k, pool_v, tables, shape), static_cast<int>(shape.n_heads),
                  batch.batch_size(), batch.max_q_len(), stream);
    return;
  }
  flash_attention(out, q, paged_kv_policy(pool_k, pool_v, tables, shape), batch, shape, stream);
}

}  // namespace tvllm
