// Student mode (tests/student/student.py): what a stub does in place of an exercise's code.
//
// The solution build never runs any of this: a stub exists only in a student workspace, where the tool
// has replaced a marked region by it. A stub must compile, fail its tests with a clear message and never
// pass by accident, so:
//   host code    throw NotWrittenYet("04.1", "the naive kernel");
//                NotWrittenYet is a std::logic_error, NOT an InputError: a test that expects the code to
//                reject bad input with an InputError still fails. The lesson executable reports it as
//                "failure: not written yet: exercise 04.1 the naive kernel" and exits 1.
//   device code  TVLLM_DEVICE_NOT_WRITTEN_YET("04.1", "the naive kernel");
//                a kernel cannot throw: the first thread of the grid prints the message and the kernel
//                writes nothing, so a test that pre-fills its output with NaN fails its comparison.
// This header is C++17 (.cu files include it).
#pragma once

#include <stdexcept>
#include <string>

namespace tvllm {

class NotWrittenYet : public std::logic_error {
 public:
  NotWrittenYet(const char* exercise, const char* title)
      : std::logic_error(std::string("not written yet: exercise ") + exercise + " " + title) {}
};

}  // namespace tvllm

#if defined(__CUDACC__)
#include <cstdio>
// For a stubbed kernel body: one line from thread 0 of block 0, nothing written.
#define TVLLM_DEVICE_NOT_WRITTEN_YET(exercise, title)                                                   \
  do {                                                                                                  \
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0 && blockIdx.x == 0 && blockIdx.y == 0 && \
        blockIdx.z == 0)                                                                                \
      printf("not written yet: exercise %s %s\n", exercise, title);                                     \
  } while (0)
#endif
