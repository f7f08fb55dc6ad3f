// Lesson 17: the NCCL communicator.
#include "nccl_comm.h"

#include <cstdlib>
#include <set>

#include "common/errors.h"

namespace tvllm {

void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line) {
  throw NcclError(std::string(call) + " failed: " + ncclGetErrorString(result) + " (" + ncclGetLastError(nullptr) +
                  ") at " + file + ":" + std::to_string(line));
}

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    default: break;
  }
  throw InputError("nccl_dtype: no NCCL type for " + std::string(dtype_name(dtype)));
}

std::string nccl_version_string() {
  int v = 0;
  TVLLM_NCCL_CHECK(ncclGetVersion(&v));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

NcclComm::NcclComm(const std::vector<int>& devices) : devices_(devices) {
  int count = 0;
  TVLLM_CUDA_CHECK(cudaGetDeviceCount(&count));
  TVLLM_REQUIRE(!devices.empty(), "NcclComm: no devices given");
  TVLLM_REQUIRE(std::set<int>(devices.begin(), devices.end()).size() == devices.size(),
                "NcclComm: a GPU is listed twice (NCCL puts at most one rank on a GPU)");
  for (int d : devices)
    TVLLM_REQUIRE(d >= 0 && d < count, "NcclComm: device " + std::to_string(d) + " does not exist (" +
                                           std::to_string(count) + " GPU(s) here)");
  // Never NVLink SHARP / multicast: the communicators must not create multicast objects. Set before the
  // first communicator is made (NCCL reads its environment then), overriding whatever the caller had.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  comms_.resize(devices.size(), nullptr);
  TVLLM_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data()));
}

NcclComm::~NcclComm() {
  for (ncclComm_t c : comms_)
    if (c != nullptr) ncclCommDestroy(c);  // (a destructor must not throw; a failure here is not actionable)
}

void NcclComm::all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>& streams) {
  check_collective_args(bufs, world_size(), Device::CUDA, "NcclComm::all_reduce_sum");
  TVLLM_REQUIRE(streams.size() == bufs.size(), "NcclComm::all_reduce_sum: one stream per rank");
  const ncclDataType_t type = nccl_dtype(bufs[0].dtype);
  const size_t count = static_cast<size_t>(bufs[0].numel());
  TVLLM_NCCL_CHECK(ncclGroupStart());
  for (size_t r = 0; r < bufs.size(); ++r)
    TVLLM_NCCL_CHECK(ncclAllReduce(bufs[r].data, bufs[r].data, count, type, ncclSum, comms_[r], streams[r]));
  TVLLM_NCCL_CHECK(ncclGroupEnd());
}

void NcclComm::all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                          const std::vector<cudaStream_t>& streams) {
  check_collective_args(src, world_size(), Device::CUDA, "NcclComm::all_gather");
  check_collective_args(dst, world_size(), Device::CUDA, "NcclComm::all_gather");
  TVLLM_REQUIRE(streams.size() == src.size(), "NcclComm::all_gather: one stream per rank");
  TVLLM_REQUIRE(dst[0].numel() == src[0].numel() * world_size() && dst[0].dtype == src[0].dtype,
                "NcclComm::all_gather: dst must hold world_size x src");
  const ncclDataType_t type = nccl_dtype(src[0].dtype);
  const size_t count = static_cast<size_t>(src[0].numel());
  TVLLM_NCCL_CHECK(ncclGroupStart());
  for (size_t r = 0; r < src.size(); ++r)
    TVLLM_NCCL_CHECK(ncclAllGather(src[r].data, dst[r].data, count, type, comms_[r], streams[r]));
  TVLLM_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace tvllm
