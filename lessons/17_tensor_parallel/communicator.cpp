// Lesson 17: the CPU simulation of the collectives.
#include "communicator.h"

#include <cstring>
#include <string>

#include "common/errors.h"

namespace tvllm {

void check_collective_args(const std::vector<TensorView>& bufs, int world_size, Device device, const char* what) {
  TVLLM_REQUIRE(static_cast<int>(bufs.size()) == world_size,
                std::string(what) + ": one buffer per rank is needed (" + std::to_string(world_size) + "), got " +
                    std::to_string(bufs.size()));
  for (const TensorView& b : bufs) {
    TVLLM_REQUIRE(b.is_contiguous() && b.device == device && b.dtype == bufs[0].dtype && b.numel() == bufs[0].numel(),
                  std::string(what) + ": every rank's buffer must be contiguous, on " + std::string(device_name(device)) +
                      " and like rank 0's " + bufs[0].describe() + ", got " + b.describe());
  }
}

CpuSimComm::CpuSimComm(int world_size) : world_size_(world_size) {
  TVLLM_REQUIRE(world_size >= 1, "CpuSimComm: world size must be >= 1, got " + std::to_string(world_size));
}

void CpuSimComm::all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>&) {
  check_collective_args(bufs, world_size_, Device::CPU, "CpuSimComm::all_reduce_sum");
  TVLLM_REQUIRE(bufs[0].dtype == DType::F32, "CpuSimComm::all_reduce_sum: the simulation sums F32, got " +
                                                 bufs[0].describe());
  if (world_size_ == 1) return;  // the sum of one buffer is itself: TP=1 adds nothing
  const int64_t n = bufs[0].numel();
  float* first = bufs[0].ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float s = first[i];
    for (int r = 1; r < world_size_; ++r) s += bufs[static_cast<size_t>(r)].ptr<const float>()[i];  // rank order
    first[i] = s;
  }
  for (int r = 1; r < world_size_; ++r) std::memcpy(bufs[static_cast<size_t>(r)].data, first, bufs[0].nbytes());
}

void CpuSimComm::all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                            const std::vector<cudaStream_t>&) {
  check_collective_args(src, world_size_, Device::CPU, "CpuSimComm::all_gather");
  check_collective_args(dst, world_size_, Device::CPU, "CpuSimComm::all_gather");
  TVLLM_REQUIRE(dst[0].numel() == src[0].numel() * world_size_ && dst[0].dtype == src[0].dtype,
                "CpuSimComm::all_gather: dst must hold world_size x src");
  const size_t bytes = src[0].nbytes();
  for (int d = 0; d < world_size_; ++d)
    for (int r = 0; r < world_size_; ++r)
      std::memcpy(static_cast<char*>(dst[static_cast<size_t>(d)].data) + static_cast<size_t>(r) * bytes,
                  src[static_cast<size_t>(r)].data, bytes);
}

}  // namespace tvllm
