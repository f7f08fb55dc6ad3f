// Lesson 14: the one load instruction its memory-bound kernels stream their data with.
//
// Bytes read exactly once per step (a GEMV's weights, decode attention's keys and values) are loaded without
// allocating in L1 (".L1::no_allocate"), through the read-only path (".nc"): L1 then keeps what IS reused (the
// GEMV's x, the block tables). The data must not be written by the same kernel (the read-only path does not see
// such writes); an earlier kernel of the stream may write it. Include from .cu files only (C++17).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/cuda_utils.cuh"

namespace tvllm {

// 16 bytes (8 bf16) at p, 16-byte aligned.
__device__ __forceinline__ Pack<8> load_streaming(const __nv_bfloat16* p) {
  Pack<8> r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.word[0]), "=r"(r.word[1]), "=r"(r.word[2]), "=r"(r.word[3])
      : "l"(p));
  return r;
}

// Lesson 16's FP8 KV cache: 8 E4M3 codes (8 bytes, 8-byte aligned) the same way, converted to 8 bf16 exactly (as
// common/cuda_utils.cuh's load_pack<8> of codes does): half the bytes per key, the same registers after the load.
__device__ __forceinline__ Pack<8> load_streaming(const __nv_fp8_e4m3* p) {
  uint32_t lo, hi;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(lo), "=r"(hi) : "l"(p));
  return e4m3x8_to_bf16(lo, hi);
}

}  // namespace tvllm
