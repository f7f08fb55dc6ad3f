// Lesson 10 on the GPU: the KV write, decode attention (flash-decoding) and prefill over the cache (lesson 07's
// flash kernel with the CacheKV policy).
//
//   kv_write_kernel           one block per new token: its k and v rows -> (slot, position) of the cache
//   CacheKV                   the KV policy of flash_attention.cuh for this cache, which both the decode
//                             kernels (decode_attention.cuh: flash-decoding, split over the keys, then a
//                             combine) and lesson 07's flash kernel read the cache through
//
// README.md derives them; the comments here say why each line is as it is.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "cache_kv.cuh"
#include "decode_attention.cuh"
#include "flash_attention.cuh"
#include "kv_cache.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

// =================================================================================================
// The KV write
// =================================================================================================

constexpr int kWriteThreads = 128;

// The sequence a packed token t belongs to: the largest b with cu_q[b] <= t (sequences with no new token
// share their cu_q value with the next one; the largest such b is the one whose range holds t).
[[maybe_unused]] __device__ __forceinline__ int sequence_of(const int32_t* cu_q, int batch_size, int t) {
  int lo = 0, hi = batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_q[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

struct KvWriteParams {
  bf16* k_cache;         // layer's k: [slots, max_context, kv_dim]
  bf16* v_cache;
  const bf16* k;         // the step's new rows [T, >= kv_dim], k_stride apart (views into the QKV buffer)
  const bf16* v;
  int64_t k_stride, v_stride;
  const int32_t* cu_q;   // [B+1] device
  const int32_t* cu_k;   // [B+1] device
  const int32_t* slots;  // [B] device
  int batch_size;
  int kv_dim;
  int max_context;
};

// grid: one block per new token (T = batch.total_q()). Everything that changes from step to step (which
// sequence, which slot, which position) is read from device arrays, so a captured graph stays right.
__global__ void __launch_bounds__(kWriteThreads) kv_write_kernel(const KvWriteParams p) {
  // --- exercise 10.3: the KV-write kernel -------------------------------------------------------------
  // Task: block t copies row t of k and of v (kv_dim bf16 each) into the cache, at row
  //   slots[b] * max_context + pos of the layer, where b is token t's sequence (sequence_of) and
  //   pos = k_len[b] - q_len[b] + (t - cu_q[b]) its position. 16 bytes (8 bf16) per thread per step.
  // Hint: load_pack<8> / store_pack<8> (common/cuda_utils.cuh) move 8 bf16 at once; kv_dim is a multiple of 8.
  // Hint: the cache offset needs 64 bits: slots * max_context * kv_dim exceeds 2^31 for a large cache.
  // Tests: KvCacheGpu.WriteMatchesCpu* KvCacheGpu.GenerationAgreesWithHuggingFaceTeacherForced
  // Stub: device
  // --- solution ---
  const int t = blockIdx.x;
  const int b = sequence_of(p.cu_q, p.batch_size, t);
  const int q_begin = p.cu_q[b];
  const int q_len = p.cu_q[b + 1] - q_begin;
  const int k_len = p.cu_k[b + 1] - p.cu_k[b];
  const int pos = k_len - q_len + (t - q_begin);  // the new tokens are the last q_len of the k_len
  const int64_t row = static_cast<int64_t>(p.slots[b]) * p.max_context + pos;
  bf16* k_dst = p.k_cache + row * p.kv_dim;
  bf16* v_dst = p.v_cache + row * p.kv_dim;
  const bf16* k_src = p.k + static_cast<int64_t>(t) * p.k_stride;
  const bf16* v_src = p.v + static_cast<int64_t>(t) * p.v_stride;
  for (int c = threadIdx.x * 8; c < p.kv_dim; c += kWriteThreads * 8) {
    store_pack<8>(k_dst + c, load_pack<8>(k_src + c));
    store_pack<8>(v_dst + c, load_pack<8>(v_src + c));
  }
  // --- end of exercise 10.3 ---
}

// =================================================================================================
// Decode and prefill over the cache: decode_attention.cuh's and lesson 07's kernels with this cache's policy
// =================================================================================================

// CacheKV, the policy both read this cache through, is in cache_kv.cuh (lesson 14's decode kernel reads it too).

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void kv_cache_write_cuda(const TensorView& cache_k, const TensorView& cache_v, const TensorView& k,
                         const TensorView& v, const AttentionBatch& batch, const CacheSlots& slots,
                         cudaStream_t stream) {
  KvWriteParams p;
  p.k_cache = cache_k.ptr<bf16>();
  p.v_cache = cache_v.ptr<bf16>();
  p.k = k.ptr<const bf16>();
  p.v = v.ptr<const bf16>();
  p.k_stride = k.strides[0];
  p.v_stride = v.strides[0];
  p.cu_q = batch.cu_seqlens_q_device();
  p.cu_k = batch.cu_seqlens_k_device();
  p.slots = slots.device_slots();
  p.batch_size = batch.batch_size();
  p.kv_dim = static_cast<int>(cache_k.shape[2]);
  p.max_context = static_cast<int>(cache_k.shape[1]);
  kv_write_kernel<<<static_cast<unsigned>(batch.total_q()), kWriteThreads, 0, stream>>>(p);
  TVLLM_CHECK_LAUNCH();
}

void decode_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                           const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                           const AttentionShape& shape, int num_splits, const DecodeWorkspace& workspace,
                           cudaStream_t stream) {
  decode::launch(decode::make_params(out, q, batch, shape, workspace), cache_kv(cache_k, cache_v, slots, shape),
                 static_cast<int>(shape.n_kv_heads), batch.batch_size(), num_splits, stream);
}

void cached_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& cache_k,
                                 const TensorView& cache_v, const AttentionBatch& batch, const CacheSlots& slots,
                                 const AttentionShape& shape, cudaStream_t stream) {
  flash_attention(out, q, cache_kv(cache_k, cache_v, slots, shape), batch, shape, stream);
}

}  // namespace tvllm
