// What the kernel suites' GPU tests share for their outputs: a buffer that fails when an element is left
// unwritten, and the raw bytes of a device tensor for bit-for-bit comparisons. Header-only (tvllm_testing links
// common/ alone; every GPU test links it).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/errors.h"
#include "common/tensor.h"

namespace tvllm::testing {

// An output filled with 0xFF bytes: NaN in bf16 and in fp32, so any element left unwritten fails. Synchronised:
// done before a kernel on another stream may start.
inline Tensor poisoned(Shape shape, DType dtype) {
  Tensor y = Tensor::empty(std::move(shape), dtype, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(y.data(), 0xFF, y.view().nbytes()));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return y;
}

// The raw bytes of a device tensor, after every queued kernel has finished.
inline std::vector<unsigned char> bytes_of(const TensorView& t) {
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> b(t.nbytes());
  TVLLM_CUDA_CHECK(cudaMemcpy(b.data(), t.data, b.size(), cudaMemcpyDeviceToHost));
  return b;
}

}  // namespace tvllm::testing
