// Lesson 11's engine, async scheduling (lesson 14): pending_tokens.h.
#include "common/errors.h"
#include "pending_tokens.h"

namespace tvllm {

namespace {

constexpr int kFillThreads = 256;

// One thread per pending token: a gather of a few hundred int32 at most (one per decoding sequence).
__global__ void __launch_bounds__(kFillThreads)
    fill_pending_tokens_kernel(int32_t* token_ids, const int32_t* previous_ids, const int32_t* pairs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) token_ids[pairs[2 * i]] = previous_ids[pairs[2 * i + 1]];
}

}  // namespace

void fill_pending_tokens(int32_t* token_ids, const int32_t* previous_ids, const int32_t* pairs, int n,
                         cudaStream_t stream) {
  if (n <= 0) return;
  const int blocks = (n + kFillThreads - 1) / kFillThreads;
  fill_pending_tokens_kernel<<<blocks, kFillThreads, 0, stream>>>(token_ids, previous_ids, pairs, n);
  TVLLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tvllm
