// Lesson 15, step 3: thread-block clusters and distributed shared memory (DSMEM). The blocks of one cluster
// run at the same time on neighbouring SMs, and each can read the others' shared memory as if it were its
// own, over the SM-to-SM network: no trip through L2. README.md, "Step 3: clusters".
#include <string>

#include "common/errors.h"
#include "hopper.cuh"
#include "hopper.h"

namespace tvllm {
namespace {

constexpr int kClusterThreads = 256;

__global__ void __launch_bounds__(kClusterThreads)
    cluster_exchange_kernel(const float* values, float* out, int n, int shift) {
#if TVLLM_HOPPER_DEVICE
  extern __shared__ float mine[];  // n floats: this block's slice of values
  const int block = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mine[i] = values[static_cast<int64_t>(block) * n + i];
  // Everyone's shared memory is filled before anyone reads a neighbour's. (It also guarantees that every
  // block of the cluster has STARTED: touching the shared memory of a block that is not running is
  // undefined.)
  cluster_sync();
  const uint32_t source = (cluster_rank() + static_cast<uint32_t>(shift)) % cluster_size();
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    out[static_cast<int64_t>(block) * n + i] = load_from_cluster(map_to_rank(&mine[i], source));
  // Nobody exits while a neighbour may still be reading its shared memory.
  cluster_sync();
#else
  (void)values, (void)out, (void)n, (void)shift;
#endif
}

}  // namespace

void cluster_exchange(const TensorView& out, const TensorView& values, int blocks, int cluster_blocks,
                      int shift, cudaStream_t stream) {
  const std::string what = "cluster_exchange: ";
  TVLLM_REQUIRE(values.dtype == DType::F32 && values.device == Device::CUDA && values.is_contiguous(),
                what + "values must be contiguous fp32 on the GPU, got " + values.describe());
  TVLLM_REQUIRE(
      out.dtype == DType::F32 && out.device == Device::CUDA && out.is_contiguous() &&
          out.numel() == values.numel(),
      what + "out must be contiguous fp32 on the GPU with as many elements as values, got " + out.describe());
  TVLLM_REQUIRE(cluster_blocks >= 1 && cluster_blocks <= 8,
                what +
                    "a cluster holds 1 to 8 blocks (portable size), "
                    "got " +
                    std::to_string(cluster_blocks));
  TVLLM_REQUIRE(
      blocks >= 1 && blocks % cluster_blocks == 0,
      what + "the grid must be a whole number of clusters, got " + std::to_string(blocks) + " blocks");
  TVLLM_REQUIRE(
      values.numel() % blocks == 0 && values.numel() / blocks >= 1 && values.numel() / blocks <= 1024,
      what + "each block takes 1 to 1024 values, an equal share");
  require_hopper("cluster_exchange");
  const int n = static_cast<int>(values.numel() / blocks);
  const int positive_shift = (shift % cluster_blocks + cluster_blocks) % cluster_blocks;

  // A cluster's size is a launch attribute (or __cluster_dims__ on the kernel, fixed at compile time).
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster_blocks);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kClusterThreads);
  config.dynamicSmemBytes = static_cast<size_t>(n) * sizeof(float);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  TVLLM_CUDA_CHECK(cudaLaunchKernelEx(&config, cluster_exchange_kernel,
                                      static_cast<const float*>(values.data), out.ptr<float>(), n,
                                      positive_shift));
}

}  // namespace tvllm
