#include "common/cublas.h"

#include <utility>

#include "common/errors.h"

namespace tvllm {

CublasHandle::CublasHandle(size_t workspace_bytes, cudaStream_t stream) {
  try {
    TVLLM_CUBLAS_CHECK(cublasCreate(&blas_));
    TVLLM_CUBLAS_CHECK(cublasLtCreate(&lt_));
    TVLLM_CUBLAS_CHECK(cublasSetMathMode(blas_, kMathMode));
    if (workspace_bytes > 0) workspace_ = DeviceBuffer(workspace_bytes);
    set_stream(stream);
  } catch (...) {
    release();  // a constructor that throws runs no destructor: free what was made
    throw;
  }
}

CublasHandle::~CublasHandle() { release(); }

void CublasHandle::release() noexcept {
  if (blas_) cublasDestroy(blas_);  // never throws from a destructor
  if (lt_) cublasLtDestroy(lt_);
  blas_ = nullptr;
  lt_ = nullptr;
}

CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : blas_(std::exchange(other.blas_, nullptr)),
      lt_(std::exchange(other.lt_, nullptr)),
      workspace_(std::move(other.workspace_)),
      stream_(other.stream_) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    release();
    blas_ = std::exchange(other.blas_, nullptr);
    lt_ = std::exchange(other.lt_, nullptr);
    workspace_ = std::move(other.workspace_);
    stream_ = other.stream_;
  }
  return *this;
}

void CublasHandle::set_stream(cudaStream_t stream) {
  TVLLM_CUBLAS_CHECK(cublasSetStream(blas_, stream));
  // cublasSetStream resets the workspace to cuBLAS's own default: give it ours back.
  if (!workspace_.empty()) TVLLM_CUBLAS_CHECK(cublasSetWorkspace(blas_, workspace_.data(), workspace_.bytes()));
  stream_ = stream;
}

}  // namespace tvllm
