// Lesson 12 on the GPU: the paged KV write, and attention over the pool through the block tables: lesson 10's
// decode kernels (flash-decoding) and lesson 07's flash kernel (prefill, chunks, prefix hits), both with the
// PagedKV policy.
//
//   paged_kv_write_kernel   one block per new token: its k and v rows -> KV slot slot_mapping[t]
//   paged_row               position pos of a sequence -> its pool row, through the block table
//   PagedKV                 the KV policy (flash_attention.cuh's contract) for the pool, built on paged_row
//
// Lesson 10's kernels read a contiguous row (slot base + pos * kv_dim); here position pos of sequence b lives at
// row (block_table[b][pos >> shift] << shift) + (pos & mask) of the pool, shift = log2(block_size). Everything
// else (the tiling, the GQA sharing, the online softmax, the split and its combine) is the same code, so the
// paged decode returns the contiguous one's bits when the same keys sit in both caches (a test checks it).
// README.md walks through them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "decode_attention.cuh"
#include "flash_attention.cuh"
#include "paged_kv.h"

namespace tvllm {

namespace {

using bf16 = __nv_bfloat16;

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

int log2_of(int64_t power_of_two) {
  int shift = 0;
  while ((int64_t{1} << shift) < power_of_two) ++shift;
  return shift;
}

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

// =================================================================================================
// Attention over the pool: lesson 10's decode kernels and lesson 07's flash kernel, with the PagedKV policy
// =================================================================================================

// The contract is at the top of flash_attention.cuh: sequence() once per block, key()/value() in the hot loop
// (a table look-up, a shift, a mask). Decode (decode_attention.cuh) and prefill (flash) read the pool through
// it, so paging changes nothing but where a row is. A chunk of new queries sees every key before it, whichever
// step wrote it and whichever sequence's blocks they are (a prefix-cache hit is a table that starts with
// another's blocks).
struct PagedKV {
  const bf16* k;                // the layer's k pool: [num_blocks * block_size rows, kv_dim]
  const bf16* v;
  const int32_t* block_tables;  // [B][table_stride] device
  int64_t table_stride;
  int block_shift;              // log2(block_size)
  int kv_dim;                   // elements from one row (KV slot) to the next
  int head_dim;

  struct Sequence {
    const bf16* k;         // row 0 of the pool, this kv head's column
    const bf16* v;
    const int32_t* table;  // this sequence's block table
    int shift, kv_dim;
    __device__ __forceinline__ const bf16* key(int pos) const { return k + paged_row(table, pos, shift) * kv_dim; }
    __device__ __forceinline__ const bf16* value(int pos) const { return v + paged_row(table, pos, shift) * kv_dim; }
  };
  // k_begin (where packed keys would start) means nothing here: a sequence's keys are wherever its table says.
  __device__ __forceinline__ Sequence sequence(int b, int /*k_begin*/, int kv_head) const {
    const int64_t column = static_cast<int64_t>(kv_head) * head_dim;
    return {k + column, v + column, block_tables + static_cast<int64_t>(b) * table_stride, block_shift, kv_dim};
  }
};

PagedKV paged_kv_policy(const TensorView& pool_k, const TensorView& pool_v, const PagedStepTables& tables,
                        const AttentionShape& shape) {
  return {pool_k.ptr<const bf16>(),   pool_v.ptr<const bf16>(),      tables.device_block_tables(),
          tables.max_blocks_per_seq(), log2_of(tables.block_size()), static_cast<int>(shape.kv_dim()),
          static_cast<int>(shape.head_dim)};
}

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void paged_kv_write_cuda(const TensorView& pool_k, const TensorView& pool_v, const TensorView& k,
                         const TensorView& v, const PagedStepTables& tables, cudaStream_t stream) {
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
                                 cudaStream_t stream) {
  decode::launch(decode::make_params(out, q, batch, shape, workspace), paged_kv_policy(pool_k, pool_v, tables, shape),
                 static_cast<int>(shape.n_kv_heads), batch.batch_size(), num_splits, stream);
}

void paged_flash_attention_cuda(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                const TensorView& pool_v, const AttentionBatch& batch, const PagedStepTables& tables,
                                const AttentionShape& shape, cudaStream_t stream) {
  flash_attention(out, q, paged_kv_policy(pool_k, pool_v, tables, shape), batch, shape, stream);
}

}  // namespace tvllm
