// Lesson 14, the fast sampler: the warp and block pieces both of its paths use (fast_sampler.cu's multi-pass
// kernels, cluster_sampler.cu's cluster kernel). All on 64-bit unsigned integers, the sampler's counts and
// masses: sums in any order give the same bits, so these may add in whatever order is fastest.
// CUDA only: included by .cu files.
#pragma once

#include <cstdint>

#include "common/cuda_utils.cuh"  // kWarpSize

namespace tvllm::sampler_block {

using u64 = unsigned long long;  // the type CUDA's 64-bit atomics and shuffles take
static_assert(sizeof(u64) == sizeof(uint64_t), "masses are 64-bit");

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Inclusive prefix sum over the lanes of a warp, in lane order.
__device__ __forceinline__ u64 warp_inclusive_scan_u64(u64 v) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int d = 1; d < kWarpSize; d <<= 1) {
    const u64 other = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += other;
  }
  return v;
}

// Inclusive prefix sum over a block of kThreads threads, in thread order; *total gets the block's sum.
// warp_slots: kThreads / 32 words of shared memory. Every thread must call it (two barriers inside).
template <int kThreads>
__device__ u64 block_inclusive_scan(u64 v, u64* total, u64* warp_slots) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_inclusive_scan_u64(v);
  if (lane == kWarpSize - 1) warp_slots[warp] = v;
  __syncthreads();
  u64 before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_slots[w];
    all += warp_slots[w];
  }
  __syncthreads();  // the slots may be reused right after
  *total = all;
  return v + before;
}

// Adds a measure to bucket `b` of a shared-memory histogram kept as two 32-bit halves (shared atomics are
// native for 32-bit words; a 64-bit add would be a compare-and-swap loop): the low word, then the high word
// with the carry out of the low one (the old low word plus ours wrapped around 2^32). Exact while the
// bucket's sum stays below 2^64 (the sampler's: at most 2^23 tokens of at most 2^40 each).
__device__ __forceinline__ void add_to_bucket(uint32_t* lo_words, uint32_t* hi_words, uint32_t b,
                                              u64 measure) {
  const uint32_t lo = static_cast<uint32_t>(measure);
  const uint32_t old = atomicAdd(lo_words + b, lo);
  const uint32_t hi = static_cast<uint32_t>(measure >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(hi_words + b, hi);
}

}  // namespace tvllm::sampler_block
