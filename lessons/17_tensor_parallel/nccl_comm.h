// Lesson 17: NCCL, wrapped. Built only where CMake found NCCL (TVLLM_HAVE_NCCL; cmake/TvllmNccl.cmake).
//
//   NcclComm comm({0, 1});             // one communicator per GPU, all made in this process (ncclCommInitAll)
//   comm.all_reduce_sum(bufs, streams) // ncclAllReduce on every rank inside one ncclGroupStart/End
//
// One host thread drives every rank: NCCL's group calls let one thread queue a collective on N communicators
// without deadlocking (each ncclAllReduce of a group waits for its peers only once the group is closed). The
// kernels themselves run concurrently on the N GPUs. NVLink SHARP / multicast (NVLS) is switched off before the
// communicators are made (NCCL_NVLS_ENABLE=0): the course never uses multicast objects.
#pragma once

#include <nccl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "communicator.h"

namespace tvllm {

// An NCCL call failed. Exit code 1, like a CUDA failure.
class NcclError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
[[noreturn]] void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line);

// The NCCL type of a course dtype (F32, BF16, F16, I32); InputError for the others.
ncclDataType_t nccl_dtype(DType dtype);

class NcclComm final : public Communicator {
 public:
  // One rank per listed CUDA device, rank r on devices[r]. InputError for an empty list, a repeated device or
  // one that does not exist (NCCL refuses two ranks on one GPU).
  explicit NcclComm(const std::vector<int>& devices);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int world_size() const override { return static_cast<int>(comms_.size()); }
  const char* name() const override { return "NCCL"; }
  const std::vector<int>& devices() const { return devices_; }
  ncclComm_t comm(int rank) const { return comms_[static_cast<size_t>(rank)]; }
  void all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>& streams) override;
  void all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                  const std::vector<cudaStream_t>& streams) override;

 private:
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
};

// "2.28.9": the NCCL library this program runs with.
std::string nccl_version_string();

}  // namespace tvllm

#define TVLLM_NCCL_CHECK(call)                                                    \
  do {                                                                            \
    ncclResult_t tvllm_nccl_result_ = (call);                                     \
    if (tvllm_nccl_result_ != ncclSuccess) {                                      \
      ::tvllm::throw_nccl_error(tvllm_nccl_result_, #call, __FILE__, __LINE__);   \
    }                                                                             \
  } while (0)
