// common/cuda_stream.h: a stream of our own, and a CUDA graph recorded from it and replayed.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/buffer.h"
#include "common/cuda_stream.h"
#include "common/errors.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

std::vector<uint8_t> bytes_of(const DeviceBuffer& b) {
  std::vector<uint8_t> host(b.bytes());
  b.copy_to_host(host.data(), host.size());
  return host;
}

TEST(CudaGraphGpu, ReplaysWhatWasCapturedAndRunsNothingWhileCapturing) {
  TVLLM_REQUIRE_GPU();
  DeviceBuffer buf(4096);
  buf.fill_zero();
  CudaStream stream;
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  CudaGraph graph = CudaGraph::capture(stream, [&] {
    TVLLM_CUDA_CHECK(cudaMemsetAsync(buf.data(), 0x5A, 1000, stream));
    TVLLM_CUDA_CHECK(cudaMemsetAsync(buf.as<uint8_t>() + 2000, 0x7B, 96, stream));
  });
  EXPECT_EQ(graph.num_nodes(), 2u);
  stream.synchronize();
  for (uint8_t b : bytes_of(buf)) ASSERT_EQ(b, 0) << "capturing must only record";
  graph.launch(stream);
  stream.synchronize();
  const std::vector<uint8_t> got = bytes_of(buf);
  for (size_t i = 0; i < got.size(); ++i) {
    const uint8_t want = i < 1000 ? 0x5A : (i >= 2000 && i < 2096) ? 0x7B : 0;
    ASSERT_EQ(got[i], want) << "byte " << i;
  }
}

TEST(CudaGraphGpu, AnAllocationOrAWaitFailsTheCaptureAndEndsIt) {
  TVLLM_REQUIRE_GPU();
  CudaStream stream;
  // A synchronisation while capturing (global mode) is an error, reported as CudaError.
  EXPECT_THROW(CudaGraph::capture(stream, [&] { TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream)); }), CudaError);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  TVLLM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  // Any exception from the work ends the capture too, and the stream stays usable.
  EXPECT_THROW(CudaGraph::capture(stream, [] { throw std::runtime_error("boom"); }), std::runtime_error);
  TVLLM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  DeviceBuffer buf(64);
  TVLLM_CUDA_CHECK(cudaMemsetAsync(buf.data(), 1, 64, stream));
  stream.synchronize();
  EXPECT_EQ(bytes_of(buf)[63], 1);
}

TEST(CudaGraphGpu, TheLegacyDefaultStreamIsRefused) {
  TVLLM_REQUIRE_GPU();
  EXPECT_THROW(CudaGraph::capture(nullptr, [] {}), InputError);
}

}  // namespace
}  // namespace tvllm
