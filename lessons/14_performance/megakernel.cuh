// Lesson 14: the megakernel's device building blocks (megakernel.h tells the story; megakernel.cu runs them).
//
//   mbarriers + 1-D bulk copies   the ring between the producer warp and the consumer warps
//   grid_barrier                  a counter and a generation in global memory, release/acquire, with a watchdog
//   the consumers' helpers        bf16 packs, warp sums, the named barrier of the consumer warps
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tvllm {
namespace mk {

using bf16 = __nv_bfloat16;

// Consumer warps of the two schemes (megakernel_plan.h): shared stages (the first version: all of them on every
// chunk) and per-warp stages (each chunk computed by its one owner warp). Thread W * 32 is the producer; the
// block has W * 32 + 32 threads (+ the producer warp).
inline constexpr int kConsumerWarps = 8;         // shared stages
// Per-warp stages: 11 (+ the producer: 12 warps, 3 per SM sub-partition, whose 16,384 registers then give each
// thread up to 168; the kernel uses 160-168, ptxas -v, no spills). With 12 + 1 warps, 4 per sub-partition,
// ptxas must fit 128 and spills.)
inline constexpr int kConsumerWarpsPerWarp = 11;
inline constexpr int kConsumers = kConsumerWarps * 32;
inline constexpr int kThreads = kConsumers + 32;
template <int W>
inline constexpr int threads_of = W * 32 + 32;
inline constexpr int kMaxGroup = 8;                     // query heads per kv head the attention phase takes
inline constexpr int kMinKeysPerSplit = 64;             // attention: fewer keys per item are not worth an item
// A spin (ring or grid barrier) longer than this is a bug, not a wait: record it and trap, so a test fails
// instead of hanging.
inline constexpr unsigned long long kWatchdogNs = 2000000000ull;
// Error codes written to the error flag before the trap.
inline constexpr int kErrRingFull = 1, kErrRingEmpty = 2, kErrGridBarrier = 3;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void watchdog_trap(int* error, int code) {
  atomicExch(error, code);
  __threadfence_system();
  __trap();
}

// ---- mbarriers (PTX ISA "mbarrier"): a 64-bit word in shared memory with a phase bit ----------------------
// A stage's `full` barrier completes a phase when the producer has arrived (count 1) AND the bulk copies have
// delivered the expect_tx bytes; its `empty` barrier when one consumer thread has arrived (shared stages: after
// the consumer warps' named barrier, all of them done reading the stage; per-warp stages: lane 0 of the stage's
// owner warp, after a __syncwarp). Waiting for parity P returns once the phase
// with that parity has completed; a fresh barrier is in phase 0, so waiting for parity 1 returns at once (the
// producer's first pass over the ring finds every stage free).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// try_wait itself suspends for a while in hardware; the clock is read only between those attempts.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, int* error, int code) {
  if (mbar_try_wait(bar, parity)) return;
  const unsigned long long start = global_ns();
  while (!mbar_try_wait(bar, parity))
    if (global_ns() - start > kWatchdogNs) watchdog_trap(error, code);
}

// 1-D bulk copy global -> this block's shared memory, completing `bytes` on the mbarrier (no tensor map: a flat
// run of bytes; source, destination and size 16-byte aligned). The .shared::cluster destination of a block not
// launched as a cluster is its own shared memory (an implicit cluster of one).
__device__ __forceinline__ void bulk_copy(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst_smem)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// ---- the consumer warps ------------------------------------------------------------------------------------
// Named barrier 1 over the consumer warps only: the producer warp never joins it (it must never wait for the
// consumers except through the ring's empty barriers).
template <int W>
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(W * 32) : "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// 8 bf16 of one 16-byte pack as floats.
__device__ __forceinline__ void unpack8(const uint4& p, float* f) {
  const uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// s + sum of the 8 products of two packs, in index order.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float s) {
  float fa[8], fb[8];
  unpack8(a, fa);
  unpack8(b, fb);
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

// s + sum of 16 E4M3 codes (one pack, low byte first) times 16 bf16 (two packs), in index order. Every E4M3
// value is a half: cvt.rn.f16x2.e4m3x2 and the widening to fp32 are exact (as gemv.cu's Cvt decoding).
__device__ __forceinline__ float dot16_e4m3(const uint4& codes, const uint4& x_lo, const uint4& x_hi, float s) {
  float fx[16];
  unpack8(x_lo, fx);
  unpack8(x_hi, fx + 8);
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w[j] >> (16 * h)) & 0xffffu),
                                                         __NV_E4M3);
      const float2 f = __half22float2(__half2(raw));
      s = fmaf(f.x, fx[4 * j + 2 * h], s);
      s = fmaf(f.y, fx[4 * j + 2 * h + 1], s);
    }
  }
  return s;
}

// ---- the grid barrier --------------------------------------------------------------------------------------
// bar[0] counts arrivals, bar[1] is the generation. Thread 0 of each block (after the consumers' named barrier,
// so every consumer thread's writes of the phase are ordered before its own) fences, arrives; the last to arrive
// resets the count and bumps the generation with a release; the others spin on an acquire load of it. A fence
// after, then the named barrier again, hands the acquired view to the block's other consumer threads. Readers
// of data written during the kernel use L2 loads (__ldcg): L1 is not coherent across SMs.
// `expected` is the generation this block waits to see bumped; every block read it at kernel start, before its
// first arrival, and no barrier completes before every block has arrived, so all blocks agree on it.
template <int W>
__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned& expected, int* error) {
  consumers_sync<W>();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned arrived = atomicAdd(&bar[0], 1u);
    if (arrived == gridDim.x - 1) {
      atomicExch(&bar[0], 0u);
      __threadfence();
      atomicAdd(&bar[1], 1u);  // the release: ordered after the reset and after every block's fenced writes
    } else {
      const unsigned long long start = global_ns();
      unsigned seen;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(&bar[1]) : "memory");
        if (seen != expected) break;
        if (global_ns() - start > kWatchdogNs) watchdog_trap(error, kErrGridBarrier);
      } while (true);
    }
    ++expected;
    __threadfence();
  }
  consumers_sync<W>();
}

// Per-warp stages: a barrier with one round trip for every block, the last one included. bar[0..1] is one
// 64-bit counter that only grows: each block adds 1 per barrier, and barrier k of a step is complete when the
// counter reaches base + (k + 1) * blocks. No reset, no generation: the last arriver does not do three more
// dependent L2 operations (reset, fence, bump) before anyone may go on. `target` is base + k * blocks on entry:
// thread 0 reads the counter at kernel start and rounds it down to a multiple of the block count (every launch
// adds a multiple; barrier 0 cannot complete before this block arrives, so at most blocks - 1 arrivals of this
// launch can be in it). 64 bits: 10^4 arrivals per step wrap it only after ~10^15 steps.
template <int W>
__device__ __forceinline__ void grid_barrier_counter(unsigned long long* counter, unsigned long long& target,
                                                     int* error) {
  consumers_sync<W>();
  if (threadIdx.x == 0) {
    target += gridDim.x;
    __threadfence();  // the block's writes of the phase (ordered before thread 0 by the named barrier) go first
    atomicAdd(counter, 1ull);
    unsigned long long seen;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
    if (seen < target) {
      const unsigned long long start = global_ns();
      do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
        if (global_ns() - start > kWatchdogNs) watchdog_trap(error, kErrGridBarrier);
      } while (seen < target);
    }
    __threadfence();
  }
  consumers_sync<W>();
}

}  // namespace mk
}  // namespace tvllm
