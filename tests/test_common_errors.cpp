// common/errors.h: the check macros name the failing call, the file and the line. Tested with fake calls
// that return an error code, so no GPU is needed.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"

namespace tvllm {
namespace {

int g_calls = 0;
cudaError_t fake_cuda_call(int argument) {
  ++g_calls;
  return argument == 0 ? cudaSuccess : cudaErrorInvalidValue;
}
cublasStatus_t fake_cublas_call(int argument) {
  ++g_calls;
  return argument == 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(CudaCheck, SuccessPassesAndEvaluatesTheCallOnce) {
  g_calls = 0;
  EXPECT_NO_THROW(TVLLM_CUDA_CHECK(fake_cuda_call(0)));
  EXPECT_EQ(g_calls, 1);
}

TEST(CudaCheck, FailureNamesTheErrorTheCallTheFileAndTheLine) {
  g_calls = 0;
  int line = 0;
  try {
    line = __LINE__; TVLLM_CUDA_CHECK(fake_cuda_call(42));
    FAIL() << "no exception";
  } catch (const CudaError& e) {
    std::string what = e.what();
    EXPECT_TRUE(contains(what, "cudaErrorInvalidValue")) << what;
    EXPECT_TRUE(contains(what, "invalid argument")) << what;  // cudaGetErrorString's words
    EXPECT_TRUE(contains(what, "fake_cuda_call(42)")) << what;
    EXPECT_TRUE(contains(what, "test_common_errors.cpp:" + std::to_string(line))) << what;
  }
  EXPECT_EQ(g_calls, 1);  // evaluated once, not again for the message
}

TEST(CudaCheck, ErrorsAreRuntimeErrorsButNotInputErrors) {
  try {
    TVLLM_CUDA_CHECK(fake_cuda_call(1));
  } catch (const InputError&) {
    FAIL() << "a CUDA failure must not look like bad input (exit 2)";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(dynamic_cast<const CudaError*>(&e), nullptr);
  }
}

TEST(CublasCheck, FailureNamesTheStatusTheCallTheFileAndTheLine) {
  g_calls = 0;
  EXPECT_NO_THROW(TVLLM_CUBLAS_CHECK(fake_cublas_call(0)));
  int line = 0;
  try {
    line = __LINE__; TVLLM_CUBLAS_CHECK(fake_cublas_call(7));
    FAIL() << "no exception";
  } catch (const CudaError& e) {
    std::string what = e.what();
    EXPECT_TRUE(contains(what, "cuBLAS")) << what;
    EXPECT_TRUE(contains(what, "CUBLAS_STATUS_INVALID_VALUE")) << what;
    EXPECT_TRUE(contains(what, "fake_cublas_call(7)")) << what;
    EXPECT_TRUE(contains(what, "test_common_errors.cpp:" + std::to_string(line))) << what;
  }
  EXPECT_EQ(g_calls, 2);
}

TEST(CublasCheck, StatusNames) {
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_ALLOC_FAILED), "CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_ARCH_MISMATCH), "CUBLAS_STATUS_ARCH_MISMATCH");
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_EXECUTION_FAILED), "CUBLAS_STATUS_EXECUTION_FAILED");
  EXPECT_STREQ(cublas_status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_STREQ(cublas_status_name(static_cast<cublasStatus_t>(9999)), "CUBLAS_STATUS_UNKNOWN");
}

TEST(Require, ThrowsInputErrorWithTheMessage) {
  EXPECT_NO_THROW(TVLLM_REQUIRE(1 + 1 == 2, "arithmetic"));
  try {
    int hidden = -3;
    TVLLM_REQUIRE(hidden > 0, "hidden_size must be positive, got " + std::to_string(hidden));
    FAIL() << "no exception";
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "hidden_size must be positive, got -3");
  }
}

TEST(Require, TheMessageIsOnlyBuiltOnFailure) {
  int built = 0;
  auto message = [&] { ++built; return std::string("m"); };
  TVLLM_REQUIRE(true, message());
  EXPECT_EQ(built, 0);
  EXPECT_THROW(TVLLM_REQUIRE(false, message()), InputError);
  EXPECT_EQ(built, 1);
}

}  // namespace
}  // namespace tvllm
