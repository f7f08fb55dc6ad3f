// Lesson 14: the one load instruction its memory-bound kernels stream their data with.
//
// Bytes read exactly once per step (a GEMV's weights, decode attention's keys and values) are loaded without
// allocating in L1 (".L1::no_allocate"), through the read-only path (".nc"): L1 then keeps what IS reused (the
// GEMV's x, the block tables). The data must not be written by the same kernel (the read-only path does not see
// such writes); an earlier kernel of the stream may write it. Include from .cu files only (C++17).
#pragma once

#include <cuda_bf16.h>

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

}  // namespace tvllm
