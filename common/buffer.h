// RAII buffers: memory that frees itself. Every cudaMalloc in the project lives inside one of these,
// so an exception (a failed check, a bad input) can never leak device memory.
#pragma once

#include <cstddef>
#include <utility>

namespace tvllm {

// Device (GPU) memory from cudaMalloc. Move-only: exactly one owner frees it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);  // throws CudaError (e.g. out of memory) naming the size
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept { DeviceBuffer tmp(std::move(other)); swap(tmp); return *this; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }

  void copy_from_host(const void* src, size_t bytes, size_t offset = 0);
  void copy_to_host(void* dst, size_t bytes, size_t offset = 0) const;
  void fill_zero();

 private:
  void swap(DeviceBuffer& o) noexcept { std::swap(ptr_, o.ptr_); std::swap(bytes_, o.bytes_); }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Host (CPU) memory. Pinned (page-locked, cudaMallocHost) memory copies to and from the GPU at full
// PCIe/NVLink speed and allows asynchronous copies; pageable memory (plain new) works everywhere,
// also on machines without a GPU.
class HostBuffer {
 public:
  enum class Kind { Pageable, Pinned };
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes, Kind kind = Kind::Pageable);
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept { swap(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept { HostBuffer tmp(std::move(other)); swap(tmp); return *this; }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return ptr_; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  Kind kind() const { return kind_; }

 private:
  void swap(HostBuffer& o) noexcept {
    std::swap(ptr_, o.ptr_); std::swap(bytes_, o.bytes_); std::swap(kind_, o.kind_);
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Kind kind_ = Kind::Pageable;
};

}  // namespace tvllm
