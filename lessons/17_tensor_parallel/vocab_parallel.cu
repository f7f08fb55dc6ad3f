// Lesson 17: the vocabulary-parallel lookup on the GPU: one block per token, bf16 rows copied (or zeroed).
#include <cuda_bf16.h>

#include "common/errors.h"
#include "vocab_parallel.h"

namespace tvllm {

namespace {
__global__ void embedding_shard_kernel(__nv_bfloat16* out, const int32_t* ids, const __nv_bfloat16* table,
                                       int64_t rows, int64_t hidden, int64_t vocab_begin) {
  const int64_t t = blockIdx.x;
  const int64_t local = static_cast<int64_t>(ids[t]) - vocab_begin;
  const bool mine = local >= 0 && local < rows;
  __nv_bfloat16* dst = out + t * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
    dst[h] = mine ? table[local * hidden + h] : __float2bfloat16(0.0f);
}
}  // namespace

void embedding_shard_cuda(const TensorView& out, const TensorView& ids, const TensorView& table, int64_t vocab_begin,
                          cudaStream_t stream) {
  TVLLM_REQUIRE(out.device == Device::CUDA && out.dtype == DType::BF16 && table.dtype == DType::BF16,
                "embedding_shard_cuda: out and table must be BF16 on the GPU, got " + out.describe() + ", " +
                    table.describe());
  const int64_t T = out.shape[0];
  if (T == 0) return;
  embedding_shard_kernel<<<static_cast<unsigned>(T), 128, 0, stream>>>(
      out.ptr<__nv_bfloat16>(), ids.ptr<const int32_t>(), table.ptr<const __nv_bfloat16>(), table.shape[0],
      out.shape[1], vocab_begin);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace tvllm
