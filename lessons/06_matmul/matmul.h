// Lesson 06: the linear layer, y = x W^T.
//
// Every projection in a Llama block (q, k, v, o, gate, up, down) and the lm_head is one call of
//
//     linear(y /*[T, out]*/, x /*[T, in]*/, w /*[out, in]*/, kernel, handle)
//
// with W exactly as Hugging Face stores it: row o of W holds the in weights of output feature o, so
// y[t][o] = sum_i x[t][i] * W[o][i], a dot product of two contiguous rows.
//
// The device of the views decides the path:
//   CPU   the fp32 reference (the oracle): x, y fp32; w fp32, bf16 or fp16 (widened exactly);
//         each output summed in double, then rounded once to fp32.
//   CUDA  x, w bf16; y bf16 (or fp32); products summed in fp32. Four versions:
//           v1  naive: one thread per output element
//           v2  tiled: 64x64 output tiles staged through shared memory, a 4x4 register block per thread
//           v3  cuBLAS cublasGemmEx (tensor cores) with the row-major trick: y^T = W x^T, OP_T / OP_N
//           v4  cuBLASLt cublasLtMatmul: the same product, with an explicit heuristic query and workspace
//
// This header is included by matmul.cu, so it stays C++17.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/tensor.h"

namespace tvllm {

enum class MatmulKernel { V1Naive, V2Tiled, V3Cublas, V4CublasLt };

// The fastest correct version on an H200 (see README "Measured on an H200"); later lessons use this.
inline constexpr MatmulKernel kDefaultMatmulKernel = MatmulKernel::V3Cublas;

// "v1" .. "v4", as on the command line (--kernel).
std::string_view matmul_kernel_version(MatmulKernel kernel);
// "naive", "tiled", "cuBLAS GemmEx", "cuBLASLt"
std::string_view matmul_kernel_description(MatmulKernel kernel);
// Parses "v1" .. "v4"; throws InputError for anything else.
MatmulKernel parse_matmul_kernel(std::string_view version);
// Every version, in order.
const std::vector<MatmulKernel>& all_matmul_kernels();

// A cuBLAS handle, a cuBLASLt handle and the device workspace they share (RAII: created in the
// constructor, destroyed in the destructor). Creating a handle costs milliseconds: make one and reuse it.
// Everything runs on one stream (the legacy default stream unless set_stream is called), so the two
// libraries never use the workspace at the same time. Needs a GPU: throws CudaError without one.
class CublasHandle {
 public:
  // 32 MiB: what PyTorch gives cuBLAS on Hopper; some of the fastest algorithms need a workspace
  // (split-K reductions, stream-K).
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;

  explicit CublasHandle(size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~CublasHandle();
  CublasHandle(CublasHandle&&) noexcept;
  CublasHandle& operator=(CublasHandle&&) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t blas() const;
  cudaStream_t stream() const;
  // The stream every linear() call made with this handle runs on (v1 and v2 included).
  void set_stream(cudaStream_t stream);
  size_t workspace_bytes() const;

  struct Impl;  // defined in matmul.cu (it holds the cuBLASLt handle and the cached Lt plans)
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// y = x W^T.   y: [T, out]   x: [T, in]   w: [out, in]   (row-major, contiguous)
// T may be 0 (nothing to do); in and out must be >= 1. y must not overlap x or w.
// kernel and handle matter on the GPU only: v3 and v4 need a handle (v1 and v2 use its stream if given).
// Throws InputError naming the problem for wrong shapes, dtypes, devices or layouts.
void linear(const TensorView& y, const TensorView& x, const TensorView& w,
            MatmulKernel kernel = kDefaultMatmulKernel, CublasHandle* handle = nullptr);

// Fills a contiguous bf16 CUDA tensor with uniform random values in [lo, hi), made on the device from a
// hash of (seed, index): for benchmarks, where the host would take seconds to make a 262M-element W.
void fill_uniform_bf16(const TensorView& t, uint64_t seed, float lo = -1.f, float hi = 1.f);

namespace detail {
// The two paths behind linear(), called after it has validated every argument.
void linear_cpu(const TensorView& y, const TensorView& x, const TensorView& w);
void linear_cuda(const TensorView& y, const TensorView& x, const TensorView& w, MatmulKernel kernel,
                 CublasHandle* handle);
}  // namespace detail

}  // namespace tvllm
