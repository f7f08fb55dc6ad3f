// common/buffer.h on a GPU: allocation, copies both ways (with offsets), fill, moves, pinned memory,
// and an allocation far larger than any GPU (1 PiB) failing with a CudaError that names the size.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/errors.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

TEST(DeviceBufferGpu, CopiesRoundTripWithOffsets) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint32_t> host(1000);
  std::iota(host.begin(), host.end(), 7u);
  DeviceBuffer d(host.size() * 4);
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d.data()) % 256, 0u);  // cudaMalloc aligns generously
  d.copy_from_host(host.data(), host.size() * 4);
  std::vector<uint32_t> back(host.size(), 0);
  d.copy_to_host(back.data(), back.size() * 4);
  EXPECT_EQ(back, host);
  // overwrite elements [10, 20) through a byte offset, read [5, 25) back through another
  std::vector<uint32_t> patch(10, 0xdeadbeef);
  d.copy_from_host(patch.data(), 40, 40);
  std::vector<uint32_t> window(20, 0);
  d.copy_to_host(window.data(), 80, 20);
  for (int i = 0; i < 20; ++i) {
    uint32_t want = (i >= 5 && i < 15) ? 0xdeadbeef : host[5 + i];
    EXPECT_EQ(window[i], want) << i;
  }
  EXPECT_THROW(d.copy_from_host(patch.data(), 8, host.size() * 4 - 4), std::out_of_range);
}

TEST(DeviceBufferGpu, FillZero) {
  TVLLM_REQUIRE_GPU();
  std::vector<uint8_t> ones(333, 0xff);
  DeviceBuffer d(ones.size());  // an odd size
  d.copy_from_host(ones.data(), ones.size());
  d.fill_zero();
  std::vector<uint8_t> back(ones.size(), 1);
  d.copy_to_host(back.data(), back.size());
  EXPECT_EQ(back, std::vector<uint8_t>(ones.size(), 0));
}

TEST(DeviceBufferGpu, MovesTransferOwnership) {
  TVLLM_REQUIRE_GPU();
  DeviceBuffer a(256);
  void* p = a.data();
  DeviceBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
  DeviceBuffer c(512);
  c = std::move(b);  // frees c's old allocation
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.bytes(), 256u);
}

TEST(DeviceBufferGpu, OutOfMemoryThrowsCudaErrorNamingTheSize) {
  TVLLM_REQUIRE_GPU();
  const size_t one_pib = size_t{1} << 50;  // no GPU has a petabyte
  try {
    DeviceBuffer huge(one_pib);
    FAIL() << "allocated 1 PiB on the GPU";
  } catch (const CudaError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("cudaMalloc"), std::string::npos) << what;
    EXPECT_NE(what.find("1125899906842624 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("1073741824.0 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaErrorMemoryAllocation"), std::string::npos) << what;
  }
  // the failure is not sticky: the next allocation and copy work
  DeviceBuffer small(64);
  uint32_t x = 42, y = 0;
  small.copy_from_host(&x, 4);
  small.copy_to_host(&y, 4);
  EXPECT_EQ(y, 42u);
}

TEST(HostBufferGpu, PinnedMemoryIsUsableForCopies) {
  TVLLM_REQUIRE_GPU();
  HostBuffer pinned(1 << 20, HostBuffer::Kind::Pinned);
  EXPECT_EQ(pinned.kind(), HostBuffer::Kind::Pinned);
  ASSERT_NE(pinned.data(), nullptr);
  for (size_t i = 0; i < pinned.bytes(); ++i) pinned.as<uint8_t>()[i] = static_cast<uint8_t>(i * 31);
  DeviceBuffer d(pinned.bytes());
  d.copy_from_host(pinned.data(), pinned.bytes());
  HostBuffer back(pinned.bytes(), HostBuffer::Kind::Pinned);
  d.copy_to_host(back.data(), back.bytes());
  EXPECT_EQ(std::memcmp(back.data(), pinned.data(), pinned.bytes()), 0);
  HostBuffer moved(std::move(pinned));  // the pinned kind travels with the memory
  EXPECT_EQ(moved.kind(), HostBuffer::Kind::Pinned);
}

TEST(HostBufferGpu, HugePinnedAllocationThrowsCudaErrorNamingTheSize) {
  TVLLM_REQUIRE_GPU();
  try {
    HostBuffer huge(size_t{1} << 50, HostBuffer::Kind::Pinned);
    FAIL() << "pinned 1 PiB of host memory";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("1125899906842624 bytes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tvllm
