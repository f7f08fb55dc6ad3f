// common/device.h on a GPU: the properties query returns what any CUDA GPU must have.
#include <gtest/gtest.h>

#include "common/device.h"
#include "common/errors.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(DeviceGpu, QueryReturnsPlausibleProperties) {
  TVLLM_REQUIRE_GPU();
  DeviceProps p = query_device(0);
  EXPECT_FALSE(p.name.empty());
  EXPECT_GE(p.compute_major, 5);
  EXPECT_GT(p.multiprocessors, 0);
  EXPECT_GE(p.global_memory_bytes, size_t{1} << 30);
  EXPECT_GT(p.l2_cache_bytes, 0u);
  EXPECT_EQ(p.warp_size, 32);
  EXPECT_GE(p.max_threads_per_block, 1024);
  EXPECT_GE(p.shared_memory_per_block_optin, size_t{48} << 10);
  EXPECT_GT(p.memory_bus_width_bits, 0);
  if (p.memory_clock_khz > 0) {
    EXPECT_GT(p.theoretical_bandwidth_gbs(), 100.0);
    EXPECT_LT(p.theoretical_bandwidth_gbs(), 100000.0);
  }
}

TEST(DeviceGpu, QueryOfAMissingDeviceThrowsCudaError) {
  TVLLM_REQUIRE_GPU();
  EXPECT_THROW(query_device(cuda_device_count() + 7), CudaError);
  // the failure is not sticky: the next query works
  EXPECT_NO_THROW(query_device(0));
}

TEST(DeviceGpu, AutoResolvesToCuda) {
  TVLLM_REQUIRE_GPU();
  EXPECT_EQ(resolve_device("auto"), Device::CUDA);
}

}  // namespace
}  // namespace tvllm
