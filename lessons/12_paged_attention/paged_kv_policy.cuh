// Lesson 12's KV policy (the contract at the top of lesson 07's flash_attention.cuh) for the paged pool, and the
// block-table look-up it is built on: position pos of sequence b at row
// (block_table[b][pos >> shift] << shift) + (pos & mask) of the pool, shift = log2(block_size). In a header of its
// own so that every kernel written over the contract reads the pool through the same lines: lesson 10's decode
// kernel and lesson 07's flash kernel (paged_kv.cu), and lesson 14's fast decode kernel.
//
// Include it from a .cu file (C++17).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention.h"
#include "common/exercise.h"
#include "paged_kv.h"

namespace tvllm {

// The pool row (KV slot) of position pos of a sequence whose block table row is `table`: the block that holds
// the position, times the block size, plus the offset inside the block. This one line is what makes lesson 10's
// decode kernel and lesson 07's flash kernel paged (PagedKV below calls it for every key and value they load).
__device__ __forceinline__ int64_t paged_row(const int32_t* table, int pos, int shift) {
  // --- exercise 12.9: the block-table look-up on the GPU ------------------------------------------------------
  // Task: block_size = 2^shift. Position pos sits in entry pos / block_size of the table, at offset
  //   pos % block_size inside that block; return the block's first row plus the offset.
  // Hint: with a power-of-two block size, pos >> shift and pos & ((1 << shift) - 1) are the division and the
  //   remainder; the table entry widened to 64 bits first (a row times kv_dim is an element offset, and a large
  //   pool passes 2^31 elements).
  // Tests: PagedKvGpu.DecodeMatchesCpu* PagedKvGpu.PagedEqualsContiguousOnTheGpu
  // Tests: PagedKvGpu.GraphOfADecodeStepReplaysTheEagerStep PagedKvGpu.OpsRunOnTheCallersStream
  // Tests: PagedKvGpu.BackendEqualsTheContiguousCacheOnTheBundledModel
  // Needs: 12.7
  // Stub:
  //   TVLLM_DEVICE_NOT_WRITTEN_YET("12.9", "the block-table look-up on the GPU");
  //   (void)table;
  //   (void)pos;
  //   (void)shift;
  //   return 0;
  // --- solution ---
  return (static_cast<int64_t>(table[pos >> shift]) << shift) + (pos & ((1 << shift) - 1));
  // --- end of exercise 12.9 ---
}

// log2 of a power-of-two block size: the shift that splits a position into block and offset.
inline int block_shift_of(int64_t power_of_two) {
  int shift = 0;
  while ((int64_t{1} << shift) < power_of_two) ++shift;
  return shift;
}

// The contract is at the top of flash_attention.cuh: sequence() once per block, key()/value() in the hot loop
// (a table look-up, a shift, a mask). Decode (decode_attention.cuh) and prefill (flash) read the pool through
// it, so paging changes nothing but where a row is. A chunk of new queries sees every key before it, whichever
// step wrote it and whichever sequence's blocks they are (a prefix-cache hit is a table that starts with
// another's blocks).
// T is the element of the pool: bf16, or (lesson 16) __nv_fp8_e4m3 for an FP8 pool, whose rows the kernels read
// with load_pack<8>'s FP8 overload (8 codes, 8 bytes) and whose scales the launcher folds into the parameters.
template <class T>
struct PagedKVOf {
  using element = T;
  const T* k;                   // the layer's k pool: [num_blocks * block_size rows, kv_dim]
  const T* v;
  const int32_t* block_tables;  // [B][table_stride] device
  int64_t table_stride;
  int block_shift;              // log2(block_size)
  int kv_dim;                   // elements from one row (KV slot) to the next
  int head_dim;

  struct Sequence {
    const T* k;            // row 0 of the pool, this kv head's column
    const T* v;
    const int32_t* table;  // this sequence's block table
    int shift, kv_dim;
    __device__ __forceinline__ const T* key(int pos) const { return k + paged_row(table, pos, shift) * kv_dim; }
    __device__ __forceinline__ const T* value(int pos) const { return v + paged_row(table, pos, shift) * kv_dim; }
  };
  // k_begin (where packed keys would start) means nothing here: a sequence's keys are wherever its table says.
  __device__ __forceinline__ Sequence sequence(int b, int /*k_begin*/, int kv_head) const {
    const int64_t column = static_cast<int64_t>(kv_head) * head_dim;
    return {k + column, v + column, block_tables + static_cast<int64_t>(b) * table_stride, block_shift, kv_dim};
  }
};
using PagedKV = PagedKVOf<__nv_bfloat16>;
using PagedKVFp8 = PagedKVOf<__nv_fp8_e4m3>;

template <class T = __nv_bfloat16>
inline PagedKVOf<T> paged_kv_policy(const TensorView& pool_k, const TensorView& pool_v, const PagedStepTables& tables,
                                    const AttentionShape& shape) {
  return {pool_k.ptr<const T>(), pool_v.ptr<const T>(), tables.device_block_tables(), tables.max_blocks_per_seq(),
          block_shift_of(tables.block_size()), static_cast<int>(shape.kv_dim()), static_cast<int>(shape.head_dim)};
}

}  // namespace tvllm
