// What lesson 15's suites share: skipping where sm_90a code cannot run, device views that are never touched
// (for the argument checks, which run before any launch), and the text of the InputError a call throws.
// Header-only: it needs lesson 15's hopper.h, which only those suites link.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/errors.h"
#include "common/tensor.h"
#include "hopper.h"
#include "testing/testing.h"

// First line of every lesson-15 GPU test: skipped without a GPU, and on a GPU that is not compute capability
// 9.0 or a build without sm_90a (the reason is printed).
#define TVLLM_REQUIRE_HOPPER()                                                              \
  do {                                                                                      \
    TVLLM_REQUIRE_GPU();                                                                    \
    if (!::tvllm::hopper_available()) GTEST_SKIP() << ::tvllm::hopper_unavailable_reason(); \
  } while (0)

namespace tvllm::testing {

// A CUDA view at an address nothing ever reads: each call gets its own 4 MB-aligned address, so two fakes
// never overlap.
inline TensorView fake_cuda(DType dtype, Shape shape) {
  static uintptr_t next = uintptr_t{1} << 30;
  next += uintptr_t{1} << 22;
  return TensorView::contiguous(reinterpret_cast<void*>(next), dtype, Device::CUDA, std::move(shape));
}

// The message of the InputError f() throws, or "(no InputError)".
template <class F>
std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

}  // namespace tvllm::testing
