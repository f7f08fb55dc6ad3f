#include "common/lesson.h"

#include <cstdio>
#include <exception>
#include <iostream>

#include "common/errors.h"

#ifndef TVLLM_DEFAULT_MODEL_DIR
#define TVLLM_DEFAULT_MODEL_DIR "weights/tiny-llama3"
#endif

namespace tvllm {

std::filesystem::path default_model_dir() { return TVLLM_DEFAULT_MODEL_DIR; }

LessonCli::LessonCli(std::string name, std::string description)
    : app_(std::move(description), name), name_(std::move(name)) {
  options_.model_dir = default_model_dir();
  app_.add_option("--model", options_.model_dir, "model directory (config.json + *.safetensors + reference/)")
      ->capture_default_str();
  app_.add_option("--device", device_text_, "where to run: auto (GPU if present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app_.add_flag("--bench", options_.bench, "time each kernel version against the measured device ceilings");
  // Only lessons 02-08 have a benchmark sized in tokens; the others accept the option (one command line
  // for every lesson) and say in --help that they ignore it.
  app_.add_option("--tokens", options_.bench_tokens,
                  "tokens in the --bench batch (lessons 02-08: the kernels' rows, lesson 08's prefill length; "
                  "lessons 00, 01 and 09-13 ignore it)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 22))
      ->capture_default_str();
}

void LessonCli::kernels(std::vector<std::string> versions, std::string default_version) {
  versions_ = std::move(versions);
  options_.kernel = std::move(default_version);
  app_.add_option("--kernel", options_.kernel, "which GPU kernel version to check")
      ->check(CLI::IsMember(versions_))
      ->capture_default_str();
}

int LessonCli::run(int argc, char** argv, const std::function<int(const LessonOptions&)>& body) {
  try {
    app_.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app_.exit(e);  // prints help (rc 0) or the usage error
    return rc == 0 ? kExitPass : kExitUsage;
  }
  try {
    if (device_text_ == "cuda" && !cuda_available()) {
      std::printf("%s: skipped: --device cuda was asked for, but no CUDA GPU is available\n", name_.c_str());
      return kExitSkip;
    }
    options_.bench_tokens_given = app_.get_option("--tokens")->count() > 0;
    options_.device = resolve_device(device_text_);
    if (device_text_ == "auto" && options_.device == Device::CPU)
      std::printf("notice: no CUDA GPU found; running the CPU reference path\n");
    if (options_.bench && options_.device == Device::CPU)
      std::printf("notice: --bench times GPU kernels; without a GPU only the CPU timings (if any) are printed\n");
    return body(options_);
  } catch (const InputError& e) {
    std::fprintf(stderr, "%s: error: %s\n", name_.c_str(), e.what());
    return kExitUsage;
  } catch (const CudaError& e) {
    std::fprintf(stderr, "%s: CUDA failure: %s\n", name_.c_str(), e.what());
    return kExitFail;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: failure: %s\n", name_.c_str(), e.what());
    return kExitFail;
  }
}

}  // namespace tvllm
