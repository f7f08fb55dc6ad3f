#include "common/buffer.h"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "common/errors.h"

namespace tvllm {

namespace {
// "1073741824 bytes (1024.0 MiB)": the exact count and a readable size, whatever the magnitude
std::string size_text(size_t bytes) {
  char text[80];
  std::snprintf(text, sizeof text, "%zu bytes (%.1f MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}
}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  cudaError_t err = cudaMalloc(&ptr_, bytes);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    cudaGetLastError();
    throw CudaError("cudaMalloc of " + size_text(bytes) + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);  // a destructor must not throw; a failing free means the context is gone
}

void DeviceBuffer::copy_from_host(const void* src, size_t bytes, size_t offset) {
  if (offset + bytes > bytes_) throw std::out_of_range("DeviceBuffer::copy_from_host past the end");
  if (bytes == 0) return;
  TVLLM_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::copy_to_host(void* dst, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) throw std::out_of_range("DeviceBuffer::copy_to_host past the end");
  if (bytes == 0) return;
  TVLLM_CUDA_CHECK(cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_zero() {
  if (bytes_) TVLLM_CUDA_CHECK(cudaMemset(ptr_, 0, bytes_));
}

HostBuffer::HostBuffer(size_t bytes, Kind kind) : bytes_(bytes), kind_(kind) {
  if (bytes == 0) return;
  if (kind == Kind::Pinned) {
    cudaError_t err = cudaMallocHost(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      cudaGetLastError();
      throw CudaError("cudaMallocHost of " + size_text(bytes) + " failed: " + cudaGetErrorName(err) + " (" +
                      cudaGetErrorString(err) + ")");
    }
  } else {
    // 64-byte alignment: any element type, and whole cache lines for vectorised CPU loops
    ptr_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!ptr_) throw std::bad_alloc();
  }
}

HostBuffer::~HostBuffer() {
  if (!ptr_) return;
  if (kind_ == Kind::Pinned) cudaFreeHost(ptr_);
  else std::free(ptr_);
}

}  // namespace tvllm
