// common/device.h without a GPU: parsing --device, resolving "auto", and the bandwidth formula.
#include <gtest/gtest.h>

#include <string>

#include "common/device.h"
#include "common/errors.h"

namespace tvllm {
namespace {

TEST(Device, Names) {
  EXPECT_EQ(device_name(Device::CPU), "cpu");
  EXPECT_EQ(device_name(Device::CUDA), "cuda");
}

TEST(Device, ParseAcceptsExplicitDevices) {
  EXPECT_EQ(parse_device("cpu"), Device::CPU);
  EXPECT_EQ(parse_device("cuda"), Device::CUDA);
  EXPECT_EQ(parse_device("gpu"), Device::CUDA);
}

TEST(Device, ParseRejectsEverythingElseNamingIt) {
  for (const char* bad : {"auto", "", "CUDA", "Cpu", "cuda:0", "tpu"}) {
    try {
      parse_device(bad);
      ADD_FAILURE() << "parse_device accepted '" << bad << "'";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + std::string(bad) + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(Device, CountNeverThrows) {
  int n = -1;
  EXPECT_NO_THROW(n = cuda_device_count());
  EXPECT_GE(n, 0);
  EXPECT_EQ(cuda_available(), n > 0);
}

TEST(Device, AutoPicksTheGpuOnlyWhenThereIsOne) {
  Device expected = cuda_available() ? Device::CUDA : Device::CPU;
  EXPECT_EQ(resolve_device("auto"), expected);
  EXPECT_EQ(resolve_device(""), expected);
  EXPECT_EQ(resolve_device("cpu"), Device::CPU);
  EXPECT_EQ(resolve_device("cuda"), Device::CUDA);  // explicit: no fallback (LessonCli turns it into a skip)
  EXPECT_THROW(resolve_device("vulkan"), InputError);
}

TEST(Device, AutoOnAMachineWithoutAGpuIsTheCpu) {
  if (cuda_available()) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_EQ(resolve_device("auto"), Device::CPU);
}

TEST(Device, TheoreticalBandwidthIsDoubleDataRateTimesBusWidth) {
  DeviceProps p;
  EXPECT_EQ(p.theoretical_bandwidth_gbs(), 0.0);  // unknown clock: 0, "not known"
  p.memory_clock_khz = 1'000'000;                 // 1 GHz
  p.memory_bus_width_bits = 256;                  // 32 bytes per transfer
  EXPECT_DOUBLE_EQ(p.theoretical_bandwidth_gbs(), 64.0);  // 2 transfers per clock * 1e9 * 32 B
  p.memory_clock_khz = 2'619'000;
  p.memory_bus_width_bits = 6144;
  EXPECT_NEAR(p.theoretical_bandwidth_gbs(), 4022.8, 0.1);
}

}  // namespace
}  // namespace tvllm
