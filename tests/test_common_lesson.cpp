// common/lesson.h: LessonCli turns arguments and exceptions into the course's exit codes
// (0 pass, 1 fail, 2 bad usage or input, 77 --device cuda without a GPU). Tested by calling run() with
// a fake argv.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/lesson.h"

namespace tvllm {
namespace {

struct Outcome {
  int exit_code = -1;
  bool body_ran = false;
  LessonOptions options;
};

// Runs cli with "lessonXX" followed by args; the body records the options and returns body_result
// (or throws what `thrower` throws).
Outcome run_cli(LessonCli& cli, std::vector<std::string> args, int body_result = 0,
                const std::function<void()>& thrower = nullptr) {
  args.insert(args.begin(), "lessonXX");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Outcome out;
  out.exit_code = cli.run(static_cast<int>(args.size()), argv.data(), [&](const LessonOptions& opt) {
    out.body_ran = true;
    out.options = opt;
    if (thrower) thrower();
    return body_result;
  });
  return out;
}

Outcome run_fresh(std::vector<std::string> args, int body_result = 0, const std::function<void()>& thrower = nullptr) {
  LessonCli cli("lessonXX", "a test lesson");
  cli.kernels({"v1", "v2"}, "v2");
  return run_cli(cli, std::move(args), body_result, thrower);
}

TEST(LessonCli, DefaultsAndExplicitOptions) {
  Outcome d = run_fresh({"--device", "cpu"});
  EXPECT_EQ(d.exit_code, kExitPass);
  ASSERT_TRUE(d.body_ran);
  EXPECT_EQ(d.options.device, Device::CPU);
  EXPECT_EQ(d.options.model_dir, default_model_dir());
  EXPECT_EQ(d.options.kernel, "v2");  // the default version
  EXPECT_FALSE(d.options.bench);
  EXPECT_EQ(d.options.bench_tokens, 16384);
  EXPECT_FALSE(d.options.bench_tokens_given);

  Outcome o = run_fresh({"--device", "cpu", "--model", "/tmp/some-model", "--kernel", "v1", "--bench", "--tokens", "128"});
  EXPECT_EQ(o.exit_code, kExitPass);
  EXPECT_EQ(o.options.model_dir, std::filesystem::path("/tmp/some-model"));
  EXPECT_EQ(o.options.kernel, "v1");
  EXPECT_TRUE(o.options.bench);
  EXPECT_EQ(o.options.bench_tokens, 128);
  EXPECT_TRUE(o.options.bench_tokens_given);
}

TEST(LessonCli, TheBodysResultIsTheExitCode) {
  EXPECT_EQ(run_fresh({"--device", "cpu"}, kExitFail).exit_code, kExitFail);
  EXPECT_EQ(run_fresh({"--device", "cpu"}, kExitPass).exit_code, kExitPass);
}

TEST(LessonCli, HelpExitsZeroWithoutRunning) {
  Outcome o = run_fresh({"--help"});
  EXPECT_EQ(o.exit_code, kExitPass);
  EXPECT_FALSE(o.body_ran);
}

TEST(LessonCli, ParseErrorsExitTwoWithoutRunning) {
  for (std::vector<std::string> args : std::vector<std::vector<std::string>>{
           {"--no-such-option"},
           {"--device", "tpu"},
           {"--device"},
           {"--kernel", "v9"},  // not one of this lesson's versions
           {"--tokens", "0"},
           {"--tokens", "many"},
           {"stray-positional"}}) {
    Outcome o = run_fresh(args);
    EXPECT_EQ(o.exit_code, kExitUsage) << args[0];
    EXPECT_FALSE(o.body_ran) << args[0];
  }
}

TEST(LessonCli, KernelIsUnknownWhenTheLessonHasNoVersions) {
  LessonCli cli("lessonXX", "no kernels");
  Outcome o = run_cli(cli, {"--kernel", "v1"});
  EXPECT_EQ(o.exit_code, kExitUsage);
  EXPECT_FALSE(o.body_ran);
}

TEST(LessonCli, DeviceCudaWithoutAGpuIsASkip) {
  Outcome o = run_fresh({"--device", "cuda"});
  if (cuda_available()) {
    EXPECT_EQ(o.exit_code, kExitPass);
    EXPECT_TRUE(o.body_ran);
    EXPECT_EQ(o.options.device, Device::CUDA);
  } else {
    EXPECT_EQ(o.exit_code, kExitSkip);
    EXPECT_FALSE(o.body_ran);
  }
}

TEST(LessonCli, AutoFallsBackToTheCpuWithoutAGpu) {
  Outcome o = run_fresh({});  // --device defaults to auto
  EXPECT_EQ(o.exit_code, kExitPass);
  ASSERT_TRUE(o.body_ran);
  EXPECT_EQ(o.options.device, cuda_available() ? Device::CUDA : Device::CPU);
}

TEST(LessonCli, ExceptionsBecomeExitCodes) {
  EXPECT_EQ(run_fresh({"--device", "cpu"}, 0, [] { throw InputError("bad config.json: hidden_size"); }).exit_code,
            kExitUsage);
  EXPECT_EQ(run_fresh({"--device", "cpu"}, 0, [] { throw CudaError("CUDA error in cudaMalloc"); }).exit_code,
            kExitFail);
  EXPECT_EQ(run_fresh({"--device", "cpu"}, 0, [] { throw std::runtime_error("anything else"); }).exit_code,
            kExitFail);
  EXPECT_EQ(run_fresh({"--device", "cpu"}, 0, [] { throw std::out_of_range("index"); }).exit_code, kExitFail);
}

TEST(LessonCli, LessonSpecificOptions) {
  LessonCli cli("lessonXX", "extra option");
  int64_t n = 5;
  cli.app().add_option("--n", n, "elements");
  Outcome o = run_cli(cli, {"--device", "cpu", "--n", "10000019"});
  EXPECT_EQ(o.exit_code, kExitPass);
  EXPECT_EQ(n, 10000019);
}

}  // namespace
}  // namespace tvllm
