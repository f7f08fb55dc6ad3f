// Which device runs a stage, and what the GPU (if any) can do.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tvllm {

enum class Device { CPU, CUDA };
std::string_view device_name(Device device);

// Number of usable CUDA devices; 0 when there is no GPU or no driver. Never throws.
int cuda_device_count();
inline bool cuda_available() { return cuda_device_count() > 0; }

struct DeviceProps {
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  size_t global_memory_bytes = 0;
  size_t l2_cache_bytes = 0;
  size_t shared_memory_per_block_optin = 0;  // the most dynamic shared memory a block may ask for
  int max_threads_per_block = 0;
  int warp_size = 0;
  int memory_bus_width_bits = 0;
  int memory_clock_khz = 0;                   // 0 where the runtime no longer reports it
  double theoretical_bandwidth_gbs() const;   // 2 * clock * bus width (DDR); 0 when unknown
};
DeviceProps query_device(int device = 0);

// Resolves --device: "cpu", "cuda", or "auto" (cuda when a GPU is present, else cpu).
// Throws InputError for anything else.
Device parse_device(std::string_view text);
Device resolve_device(std::string_view text);

}  // namespace tvllm
