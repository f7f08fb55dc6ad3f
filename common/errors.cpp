#include "common/errors.h"

#include <sstream>

namespace tvllm {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  cudaGetLastError();  // clear a sticky-free error so the caller may continue after catching
  std::ostringstream msg;
  msg << "CUDA error " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") in " << call
      << " at " << file << ":" << line;
  throw CudaError(msg.str());
}

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  std::ostringstream msg;
  msg << "cuBLAS error " << cublas_status_name(status) << " in " << call << " at " << file << ":" << line;
  throw CudaError(msg.str());
}

}  // namespace tvllm
