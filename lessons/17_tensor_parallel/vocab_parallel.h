// Lesson 17: the vocabulary-parallel embedding lookup.
//
// Rank r holds embedding rows [vocab_begin, vocab_begin + rows). A token whose id falls in that range gets its
// row; any other token gets zeros. After an all-reduce (sum) every rank has every token's row: exactly one
// rank contributed a non-zero row, the others +0.0, and x + 0 = x exactly, so the result is the unsharded
// lookup bit for bit. (The ids were checked against the whole vocabulary by StepInputs.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/tensor.h"

namespace tvllm {

// out [T, hidden] (CPU: F32; CUDA: BF16), ids I32 [T], table [rows, hidden] on out's device (CPU: any float
// dtype; CUDA: BF16). CUDA: queued on `stream`, no synchronisation. InputError for mismatched arguments.
void embedding_shard(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin,
                     cudaStream_t stream = nullptr);

void embedding_shard_cpu(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin);
void embedding_shard_cuda(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin,
                          cudaStream_t stream);

}  // namespace tvllm
