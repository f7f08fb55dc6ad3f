// Lesson 10's KV policy (the contract at the top of lesson 07's flash_attention.cuh) for the contiguous cache:
// position pos of sequence b at row slots[b] * max_context + pos of the layer. In a header of its own so that every
// kernel written over the contract reads the cache through the same few lines: lesson 10's decode kernel
// (decode_attention.cuh), lesson 07's flash kernel (kv_cache.cu) and lesson 14's fast decode kernel.
//
// Include it from a .cu file (C++17).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention.h"
#include "kv_cache.h"

namespace tvllm {

// The contract is at the top of flash_attention.cuh: sequence() once per block, key()/value() in the hot loop.
struct CacheKV {
  using bf16 = __nv_bfloat16;
  const bf16* k;         // the layer's k: [slots, max_context, kv_dim]
  const bf16* v;
  const int32_t* slots;  // [B] device: sequence b's slot
  int64_t slot_stride;   // max_context * kv_dim: elements from one slot to the next
  int kv_dim;            // elements from one position to the next
  int head_dim;

  struct Sequence {
    const bf16* k;  // position 0 of this sequence's slot, this kv head
    const bf16* v;
    int stride;
    __device__ __forceinline__ const bf16* key(int pos) const { return k + static_cast<int64_t>(pos) * stride; }
    __device__ __forceinline__ const bf16* value(int pos) const { return v + static_cast<int64_t>(pos) * stride; }
  };
  // k_begin (where packed keys would start) means nothing here: a sequence's keys are its slot's positions.
  __device__ __forceinline__ Sequence sequence(int b, int /*k_begin*/, int kv_head) const {
    const int64_t at = static_cast<int64_t>(slots[b]) * slot_stride + static_cast<int64_t>(kv_head) * head_dim;
    return {k + at, v + at, kv_dim};
  }
};

inline CacheKV cache_kv(const TensorView& cache_k, const TensorView& cache_v, const CacheSlots& slots,
                        const AttentionShape& shape) {
  return {cache_k.ptr<const __nv_bfloat16>(), cache_v.ptr<const __nv_bfloat16>(), slots.device_slots(),
          cache_k.shape[1] * cache_k.shape[2], static_cast<int>(cache_k.shape[2]), static_cast<int>(shape.head_dim)};
}

}  // namespace tvllm
