// Lesson 08's seam, lesson 14's use: where a kernel that computes a step's new keys and values may store them in
// the KV cache itself, so that the cache backend's attend() need not launch a write of its own.
//
// A cache backend's attend() does two things per layer: it copies the step's new k and v rows into the cache
// (lesson 10's kv_cache_write, lesson 12's paged_kv_write), then attends over the cache. At batch 1 the copy is
// 2 KiB per layer, and its kernel costs a launch and a round trip of k and v through memory, 16 times a token.
// Lesson 14's qkv GEMV holds those rows in registers when it finishes them, so it can store them where the write
// would have: AttentionBackend::kv_store() tells it where, and attend_stored() then attends without the copy.
//
// A layer's cache is rows of kv_dim elements (lesson 10: [num_slots * max_context, kv_dim]; lesson 12's pool:
// [num_blocks * block_size, kv_dim]). Token m of the step goes to row
//
//   rows[m]                                          lesson 12: the step's slot mapping (-1: not stored)
//   slots[m] * max_context + cu_k[m + 1] - cu_k[m] - 1   lesson 10, a decode step (token m is sequence m, and
//                                                    the last of its k_len positions)
//
// its kv heads at k + row * kv_dim (k) and v + row * kv_dim (v), head h at columns [h * head_dim, (h+1) * head_dim).
// This header is included by .cu files: C++17 only.
#pragma once

#include <cstdint>

#include "common/device.h"
#include "common/dtype.h"

namespace tvllm {

struct KvStore {
  void* k = nullptr;  // this layer's k rows; nullptr: no store (the kernel writes only its usual outputs)
  void* v = nullptr;  // this layer's v rows
  // How an element is stored: BF16 (lessons 10 and 12 on CUDA), F32 (the CPU's caches), or F8_E4M3 (lesson 16's
  // FP8 pool: code = e4m3(x * inv_scale), round to nearest even, saturating, as paged_kv_write stores it).
  DType dtype = DType::BF16;
  Device device = Device::CPU;  // where the rows and the index arrays below live
  int64_t kv_dim = 0;           // elements per row: n_kv_heads * head_dim
  const int32_t* rows = nullptr;   // [T] lesson 12's slot mapping; when set, slots / cu_k are not read
  const int32_t* slots = nullptr;  // [B] lesson 10: each sequence's cache slot
  const int32_t* cu_k = nullptr;   // [B + 1] lesson 10: the step's cumulative key lengths
  int64_t max_context = 0;         // lesson 10: rows per slot
  float k_inv_scale = 1.0f, v_inv_scale = 1.0f;  // F8_E4M3 only

  bool empty() const { return k == nullptr; }
};

}  // namespace tvllm
