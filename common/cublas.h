// The one owner of cuBLAS state: a cuBLAS handle, a cuBLASLt handle, the device workspace they share, the
// stream they run on, and the math mode. Lesson 06 (linear layers) and lesson 07 (attention v1) both use
// it; an engine makes one at start-up and passes it everywhere (creating a handle costs milliseconds and
// may allocate, so it must never happen inside a forward step).
//
// The math mode, settled once for the whole project: CUBLAS_DEFAULT_MATH | DISALLOW_REDUCED_PRECISION_
// REDUCTION. With bf16 inputs and CUBLAS_COMPUTE_32F cuBLAS uses the tensor cores and accumulates in fp32
// either way; but the cuBLAS documentation says that in the default mode a split-K algorithm MAY add up its
// partial sums in the OUTPUT type (bf16), one extra bf16 rounding per piece of K. The DISALLOW flag
// "forces any reductions during matrix multiplications to use the accumulator type", which is the
// promise every kernel of this course makes (fp32 accumulation). PyTorch exposes the same switch as
// torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction. cuBLASLt has no math mode: its
// callers restrict the reduction scheme per call (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, lesson 06).
//
// Needs a GPU: the constructor throws CudaError without one. Move-only.
#pragma once

#include <cstddef>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/buffer.h"

namespace tvllm {

class CublasHandle {
 public:
  // 32 MiB: what PyTorch gives cuBLAS on Hopper; some of the fastest algorithms need a workspace
  // (split-K reductions, stream-K). Allocated once, here.
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;
  static constexpr cublasMath_t kMathMode =
      static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);

  explicit CublasHandle(size_t workspace_bytes = kDefaultWorkspaceBytes, cudaStream_t stream = nullptr);
  ~CublasHandle();
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t blas() const { return blas_; }
  cublasLtHandle_t lt() const { return lt_; }
  void* workspace() const { return workspace_.data(); }
  size_t workspace_bytes() const { return workspace_.bytes(); }
  cudaStream_t stream() const { return stream_; }

  // Every cuBLAS call made through this handle from now on runs on `stream` (cuBLASLt calls take the
  // stream as an argument: pass stream()). Everything on one stream, so the two libraries never use the
  // workspace at the same time. Costs nothing; call it whenever the caller's stream changes.
  void set_stream(cudaStream_t stream);

 private:
  void release() noexcept;
  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  DeviceBuffer workspace_;
  cudaStream_t stream_ = nullptr;  // nullptr: the legacy default stream
};

}  // namespace tvllm
