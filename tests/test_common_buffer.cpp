// common/buffer.h without a GPU: pageable host memory, and the device buffer's behaviour that needs no
// CUDA call (empty buffers, bounds checks, moves).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/buffer.h"
#include "common/device.h"
#include "common/errors.h"

namespace tvllm {
namespace {

TEST(HostBuffer, PageableIsAlignedAndWritable) {
  HostBuffer b(1000);
  EXPECT_EQ(b.bytes(), 1000u);
  EXPECT_EQ(b.kind(), HostBuffer::Kind::Pageable);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  std::memset(b.data(), 0xab, 1000);  // every byte belongs to us (ASan would catch an overrun)
  EXPECT_EQ(b.as<uint8_t>()[999], 0xab);
}

TEST(HostBuffer, ZeroBytesHasNoMemory) {
  HostBuffer b(0);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.bytes(), 0u);
  HostBuffer d;
  EXPECT_EQ(d.data(), nullptr);
}

TEST(HostBuffer, MovesTransferOwnership) {
  HostBuffer a(64);
  void* p = a.data();
  HostBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.bytes(), 64u);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty, by design
  EXPECT_EQ(a.bytes(), 0u);
  HostBuffer c(128);
  c = std::move(b);  // c's old memory is freed (ASan/LSan would report a leak otherwise)
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.bytes(), 64u);
}

TEST(DeviceBuffer, DefaultAndZeroBytesAreEmptyAndNeedNoGpu) {
  DeviceBuffer none;
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.bytes(), 0u);
  DeviceBuffer zero(0);
  EXPECT_TRUE(zero.empty());
  EXPECT_EQ(zero.data(), nullptr);
  EXPECT_EQ(zero.bytes(), 0u);
  // copies of nothing and a fill of nothing do no CUDA call, so they work on any machine
  EXPECT_NO_THROW(zero.copy_from_host(nullptr, 0));
  EXPECT_NO_THROW(zero.copy_to_host(nullptr, 0));
  EXPECT_NO_THROW(zero.fill_zero());
}

TEST(DeviceBuffer, CopiesPastTheEndThrowBeforeTouchingTheGpu) {
  DeviceBuffer zero(0);
  char byte = 0;
  EXPECT_THROW(zero.copy_from_host(&byte, 1), std::out_of_range);
  EXPECT_THROW(zero.copy_to_host(&byte, 1), std::out_of_range);
  EXPECT_THROW(zero.copy_from_host(&byte, 0, 1), std::out_of_range);
}

TEST(DeviceBuffer, MovesOfEmptyBuffers) {
  DeviceBuffer a(0);
  DeviceBuffer b(std::move(a));
  EXPECT_TRUE(b.empty());
  DeviceBuffer c;
  c = std::move(b);
  EXPECT_TRUE(c.empty());
}

TEST(DeviceBuffer, AllocationWithoutAGpuThrowsCudaErrorNamingTheSize) {
  if (cuda_available()) GTEST_SKIP() << "this machine has a GPU (the GPU suite tests out-of-memory)";
  try {
    DeviceBuffer b(4096);
    FAIL() << "cudaMalloc succeeded without a GPU";
  } catch (const CudaError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("cudaMalloc"), std::string::npos) << what;
    EXPECT_NE(what.find("4096 bytes"), std::string::npos) << what;
  }
}

TEST(HostBuffer, PinnedWithoutAGpuThrowsCudaError) {
  if (cuda_available()) GTEST_SKIP() << "this machine has a GPU (the GPU suite tests pinned memory)";
  EXPECT_THROW(HostBuffer(4096, HostBuffer::Kind::Pinned), CudaError);
}

}  // namespace
}  // namespace tvllm
