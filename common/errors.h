// Errors and the checks that raise them.
//
// Two kinds of failure matter to a course program, and they get different exit codes:
//   InputError  the user gave us something wrong (a malformed file, a bad argument): exit 2
//   CudaError   the GPU or a CUDA library call failed (out of memory, bad launch): exit 1
// Every CUDA and cuBLAS call in the project goes through TVLLM_CUDA_CHECK / TVLLM_CUBLAS_CHECK, which
// name the call, the file and the line, so an error points at the exact place it happened.
#pragma once

#include <stdexcept>
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/input_error.h"  // InputError and TVLLM_REQUIRE (CUDA-free, for the parsers)

namespace tvllm {

// A CUDA runtime or library call returned an error. Exit code 1.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);
const char* cublas_status_name(cublasStatus_t status);

}  // namespace tvllm

// Wrap every CUDA runtime call: TVLLM_CUDA_CHECK(cudaMalloc(&p, n));
#define TVLLM_CUDA_CHECK(call)                                                     \
  do {                                                                             \
    cudaError_t tvllm_err_ = (call);                                               \
    if (tvllm_err_ != cudaSuccess) {                                               \
      ::tvllm::throw_cuda_error(tvllm_err_, #call, __FILE__, __LINE__);            \
    }                                                                              \
  } while (0)

// Wrap every cuBLAS call: TVLLM_CUBLAS_CHECK(cublasGemmEx(...));
#define TVLLM_CUBLAS_CHECK(call)                                                   \
  do {                                                                             \
    cublasStatus_t tvllm_status_ = (call);                                         \
    if (tvllm_status_ != CUBLAS_STATUS_SUCCESS) {                                  \
      ::tvllm::throw_cublas_error(tvllm_status_, #call, __FILE__, __LINE__);       \
    }                                                                              \
  } while (0)

// After every kernel launch: a launch returns nothing, so a bad configuration (too many threads,
// too much shared memory) only shows up in cudaGetLastError().
#define TVLLM_CHECK_LAUNCH() TVLLM_CUDA_CHECK(cudaGetLastError())
