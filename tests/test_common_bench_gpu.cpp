// common/bench.h on a GPU: event timing, the L2 flush and the measured copy ceiling.
#include <gtest/gtest.h>

#include "common/bench.h"
#include "common/buffer.h"
#include "common/device.h"
#include "common/errors.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(BenchGpu, TimesAMemsetWithAPositiveMedian) {
  TVLLM_REQUIRE_GPU();
  DeviceBuffer buf(size_t{256} << 20);
  int launches = 0;
  BenchOptions options;
  options.warmup = 2;
  options.iters = 7;
  BenchResult r = bench_gpu(
      [&] {
        ++launches;
        TVLLM_CUDA_CHECK(cudaMemsetAsync(buf.data(), 0, buf.bytes()));
      },
      options);
  EXPECT_EQ(launches, 9);
  EXPECT_EQ(r.iters, 7);
  EXPECT_GT(r.median_ms, 0.0);
  EXPECT_LE(r.min_ms, r.median_ms);
  EXPECT_LE(r.median_ms, r.max_ms);
  // 256 MiB written: no GPU does that in under 10 microseconds, none needs a second
  EXPECT_GT(r.median_ms, 0.01);
  EXPECT_LT(r.median_ms, 1000.0);
}

TEST(BenchGpu, ALaunchErrorIsReported) {
  TVLLM_REQUIRE_GPU();
  BenchOptions options;
  options.warmup = 0;
  options.iters = 1;
  EXPECT_THROW(bench_gpu([] { TVLLM_CUDA_CHECK(cudaMemsetAsync(nullptr, 0, 16)); }, options), CudaError);
}

TEST(L2FlusherGpu, FlushRunsAndTheDeviceStaysHealthy) {
  TVLLM_REQUIRE_GPU();
  L2Flusher flusher;
  flusher.flush();
  flusher.flush();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CeilingsGpu, CopyBandwidthIsPlausible) {
  TVLLM_REQUIRE_GPU();
  double gbs = measure_copy_bandwidth_gbs(size_t{256} << 20, 5);
  // any datacenter GPU copies well over 100 GB/s; more than 20 TB/s would mean a unit slip (ms vs s)
  EXPECT_GT(gbs, 100.0);
  EXPECT_LT(gbs, 20000.0);
  DeviceProps p = query_device(0);
  if (p.theoretical_bandwidth_gbs() > 0) {
    // read + write both count, so the measured figure may approach but not pass the theoretical one by much
    EXPECT_LT(gbs, 1.2 * p.theoretical_bandwidth_gbs()) << "theoretical " << p.theoretical_bandwidth_gbs();
  }
}

TEST(CeilingsGpu, MeasuredOnceAndCached) {
  TVLLM_REQUIRE_GPU();
  Ceilings a = measure_ceilings(false);
  Ceilings b = measure_ceilings(false);
  EXPECT_GT(a.copy_gbs, 100.0);
  EXPECT_EQ(a.copy_gbs, b.copy_gbs);
  EXPECT_EQ(a.bf16_tflops, 0.0);  // not asked for
}

}  // namespace
}  // namespace tvllm
