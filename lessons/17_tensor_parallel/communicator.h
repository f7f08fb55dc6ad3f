// Lesson 17: the two collectives tensor parallelism needs, behind one interface.
//
//   CpuSimComm   N ranks simulated in one process on the CPU: every rank's buffer is a host view, the sum is
//                taken element by element in rank order (0 + 1 + ... + N-1) and written back to every rank.
//                Deterministic; with N = 1 it is nothing at all, so TP=1 is the unsharded forward bit for bit.
//   NcclComm     (nccl_comm.h) the same two calls as NCCL collectives, one communicator per GPU.
//
// Every call takes one buffer per rank, in rank order, each on its rank's device, and (CUDA) the rank's stream.
// It only queues the work: nothing waits.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/tensor.h"

namespace tvllm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int world_size() const = 0;
  virtual const char* name() const = 0;
  // In place: afterwards every bufs[r] holds the element-wise sum over the ranks. Same dtype and element count
  // on every rank, contiguous.
  virtual void all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>& streams) = 0;
  // dst[r] (count N * src[r].numel()) receives every rank's src, rank 0's first.
  virtual void all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                          const std::vector<cudaStream_t>& streams) = 0;
};

class CpuSimComm final : public Communicator {
 public:
  explicit CpuSimComm(int world_size);
  int world_size() const override { return world_size_; }
  const char* name() const override { return "CPU simulation"; }
  void all_reduce_sum(const std::vector<TensorView>& bufs, const std::vector<cudaStream_t>& streams) override;
  void all_gather(const std::vector<TensorView>& src, const std::vector<TensorView>& dst,
                  const std::vector<cudaStream_t>& streams) override;

 private:
  int world_size_;
};

// The arguments every communicator checks (InputError): one buffer per rank, equal counts and dtypes, contiguous,
// on `device`.
void check_collective_args(const std::vector<TensorView>& bufs, int world_size, Device device, const char* what);

}  // namespace tvllm
