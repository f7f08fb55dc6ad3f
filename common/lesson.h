// The skeleton every lesson executable shares:
//
//   build/bin/lessonNN_name [--model DIR] [--device auto|cpu|cuda] [--kernel vN] [--bench] [--tokens N]
//
//   1. load the model (default: the bundled weights/tiny-llama3) and its reference outputs
//   2. run the stage on the reference inputs, on the chosen device
//   3. compare with the reference and print the PASS/FAIL table
//   4. --bench: time each kernel version and print GB/s or TFLOP/s beside the measured ceiling
//   5. exit 0 on PASS, 1 on FAIL (or a CUDA failure), 2 on bad usage or bad input, 77 when --device cuda
//      was asked for on a machine without a GPU (CTest reports that as skipped)
//
// A lesson's main() is a few lines:
//
//   int main(int argc, char** argv) {
//     tvllm::LessonCli cli("lesson04_rmsnorm", "RMSNorm: tree reduction, then warp shuffles");
//     cli.kernels({"v1", "v2"}, "v2");
//     return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { ... return report.exit_code(); });
//   }
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/device.h"

namespace tvllm {

inline constexpr int kExitPass = 0;
inline constexpr int kExitFail = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitSkip = 77;

struct LessonOptions {
  std::filesystem::path model_dir;  // --model
  Device device = Device::CPU;      // --device, resolved (auto -> cuda if present)
  std::string kernel;               // --kernel, one of the lesson's versions ("" if it has none)
  bool bench = false;               // --bench
  int64_t bench_tokens = 16384;     // --tokens: tokens in the benchmark batch (used by lessons 02-08 only)
  bool bench_tokens_given = false;  // whether --tokens was on the command line (a lesson may pick its own default)
};

// The bundled model's directory (compiled in from the source tree).
std::filesystem::path default_model_dir();

class LessonCli {
 public:
  LessonCli(std::string name, std::string description);
  // The kernel versions this lesson has, and the default (the fastest correct one).
  void kernels(std::vector<std::string> versions, std::string default_version);
  // For lesson-specific options: cli.app().add_option(...)
  CLI::App& app() { return app_; }
  // Parses argv, resolves the device (with a one-line notice when falling back to the CPU), runs body,
  // and turns exceptions into the exit codes above with a one-line message.
  int run(int argc, char** argv, const std::function<int(const LessonOptions&)>& body);

 private:
  CLI::App app_;
  std::string name_;
  std::vector<std::string> versions_;
  std::string device_text_ = "auto";
  LessonOptions options_;
};

}  // namespace tvllm
