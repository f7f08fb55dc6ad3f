#include "common/device.h"

#include "common/errors.h"

namespace tvllm {

std::string_view device_name(Device device) { return device == Device::CUDA ? "cuda" : "cpu"; }

int cuda_device_count() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // "no driver" / "no device" is an answer here, not an error to keep
    return 0;
  }
  return count;
}

double DeviceProps::theoretical_bandwidth_gbs() const {
  return 2.0 * memory_clock_khz * 1e3 * (memory_bus_width_bits / 8.0) / 1e9;
}

DeviceProps query_device(int device) {
  cudaDeviceProp p{};
  TVLLM_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  DeviceProps out;
  out.name = p.name;
  out.compute_major = p.major;
  out.compute_minor = p.minor;
  out.multiprocessors = p.multiProcessorCount;
  out.global_memory_bytes = p.totalGlobalMem;
  out.l2_cache_bytes = static_cast<size_t>(p.l2CacheSize);
  out.shared_memory_per_block_optin = p.sharedMemPerBlockOptin;
  out.max_threads_per_block = p.maxThreadsPerBlock;
  out.warp_size = p.warpSize;
  out.memory_bus_width_bits = p.memoryBusWidth;
  // CUDA 13 removed memoryClockRate from cudaDeviceProp; the attribute still answers on most drivers.
  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess) {
    cudaGetLastError();
    clock_khz = 0;
  }
  out.memory_clock_khz = clock_khz;
  return out;
}

Device parse_device(std::string_view text) {
  if (text == "cpu") return Device::CPU;
  if (text == "cuda" || text == "gpu") return Device::CUDA;
  throw InputError("unknown device '" + std::string(text) + "' (expected cpu, cuda or auto)");
}

Device resolve_device(std::string_view text) {
  if (text == "auto" || text.empty()) return cuda_available() ? Device::CUDA : Device::CPU;
  return parse_device(text);
}

}  // namespace tvllm
