// Launch-size helpers: how many blocks to start. Lesson 00 introduces them; later lessons reuse them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/errors.h"

namespace tvllm {

// Blocks needed to give each of n work items its own thread: round up, so the last block may have
// threads with nothing to do (the kernel's bounds check sends them home).
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks that fill the GPU once: how many of this kernel's blocks fit on one SM at the same time (the
// occupancy calculator knows its registers and the SM's limits) times the number of SMs. A grid-stride
// kernel launched with one wave keeps every SM busy without paying for blocks that only start late.
template <class Kernel>
int64_t blocks_for_one_wave(Kernel kernel, int threads_per_block) {
  int device = 0, sms = 0, per_sm = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TVLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads_per_block, 0));
  return static_cast<int64_t>(sms) * std::max(per_sm, 1);
}

}  // namespace tvllm
