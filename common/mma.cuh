// The tensor-core PTX every hand-written GEMM of the course uses, each instruction wrapped once:
//   cp.async      16 bytes global -> shared without passing through registers (Ampere and later)
//   ldmatrix      8x8 bf16 matrices from shared memory straight into mma fragments
//   mma.sync      m16n8k16: D[16x8] += A[16x16] * B[16x8], bf16 in, fp32 accumulate
// Lesson 06 introduces them (its README, section 4, has the fragment pictures); lesson 07's attention
// kernel uses the same instructions.
//
// All need compute capability 8.0 or later (sm_80: A100; sm_90: H100/H200). Compiled for an older
// architecture they trap; the host code that launches them checks the device first
// (require_tensor_core_device). Include from .cu files only. C++17.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/errors.h"

namespace tvllm {

// ---- the device ---------------------------------------------------------------------------------------

// Throws CudaError naming `what` unless the current device has compute capability >= 8.0 (bf16 mma.sync,
// ldmatrix, cp.async). Cheap (an attribute query: no allocation, no synchronisation).
inline void require_tensor_core_device(const char* what) {
  int device = 0, major = 0;
  TVLLM_CUDA_CHECK(cudaGetDevice(&device));
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 8)
    throw CudaError(std::string(what) + " needs a GPU of compute capability 8.0 or later (bf16 tensor cores)");
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TVLLM_MMA_PTX 1  // the PTX below exists on this architecture (and in the host pass, which never runs it)
#endif

// ---- addresses ----------------------------------------------------------------------------------------

// The 32-bit shared-memory address of a pointer into shared memory (what cp.async and ldmatrix take).
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async -----------------------------------------------------------------------------------------

// 16 bytes global -> shared, asynchronously: the thread issues the copy and goes on. Both addresses
// 16-byte aligned. valid == false reads nothing (src-size 0) and fills the 16 bytes with zeros: tiles
// that hang over the edge of a matrix get zeros, which add nothing to a dot product (and 0 * NaN
// garbage never happens). gmem_src must still be an address inside the allocation; pass the matrix base.
// .cg: cache in L2 only (the data goes to shared memory; keeping it in L1 too would waste L1).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#ifdef TVLLM_MMA_PTX
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
#else
  __trap();
#endif
}

// Closes the group of cp.async this thread issued since the last commit (a group per pipeline stage).
__device__ __forceinline__ void cp_async_commit() {
#ifdef TVLLM_MMA_PTX
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. It covers only THIS
// thread's copies: a __syncthreads() must follow before other threads read what they brought.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef TVLLM_MMA_PTX
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---- ldmatrix -----------------------------------------------------------------------------------------

// Four 8x8 bf16 matrices from shared memory into mma fragments, one instruction for the whole warp:
// lanes 8m..8m+7 give the addresses of rows 0..7 of matrix m (each row 16 contiguous bytes, 16-byte
// aligned); register m of lane L receives row L/4, columns 2*(L%4) and 2*(L%4)+1 of matrix m (the lower
// column in the low half).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
#ifdef TVLLM_MMA_PTX
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
#else
  __trap();
#endif
}

// The same, each matrix transposed: register m of lane L receives rows 2*(L%4), 2*(L%4)+1 of column L/4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
#ifdef TVLLM_MMA_PTX
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem))
               : "memory");
#else
  __trap();
#endif
}

// ---- mma.sync -----------------------------------------------------------------------------------------

// d[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators, one instruction for the whole warp.
// Each register holds two bf16 (the lower column or row index in the low half). With g = lane/4 and
// c = lane%4:
//   a: a[0] = (row g, cols 2c..2c+1),   a[1] = (row g+8, cols 2c..2c+1),
//      a[2] = (row g, cols 2c+8..2c+9), a[3] = (row g+8, cols 2c+8..2c+9)
//   b: b0 = (rows 2c..2c+1, col g), b1 = (rows 2c+8..2c+9, col g)      ("col": B is read down its columns)
//   d: d[0..1] = (row g, cols 2c..2c+1), d[2..3] = (row g+8, cols 2c..2c+1)
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef TVLLM_MMA_PTX
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

}  // namespace tvllm
