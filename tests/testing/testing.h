// Shared test helpers.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "common/device.h"

namespace tvllm::testing {

// The bundled model (weights/tiny-llama3) and the tests' own data folder (tests/data).
inline std::filesystem::path tiny_model_dir() { return TVLLM_TINY_MODEL_DIR; }
inline std::filesystem::path test_data_dir() { return TVLLM_TEST_DATA_DIR; }
// build/bin, where every executable lands.
inline std::filesystem::path bin_dir() { return TVLLM_BIN_DIR; }

struct CommandResult {
  int exit_code = -1;  // the program's exit status; -1 if it died from a signal (a crash)
  std::string output;  // stdout and stderr together
};
// Runs a shell command and captures its output and exit status.
CommandResult run_command(const std::string& command);

// A fresh temporary directory, removed when the object goes away.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

}  // namespace tvllm::testing

// First line of every GPU test: skips it (reported as skipped by CTest) when there is no GPU.
#define TVLLM_REQUIRE_GPU()                                                  \
  do {                                                                       \
    if (!::tvllm::cuda_available()) GTEST_SKIP() << "no CUDA GPU available"; \
  } while (0)
